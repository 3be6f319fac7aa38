//! kvmesh's OpenAI-compatible HTTP gateway: validates requests, applies the chat template,
//! tokenizes, hands token ids to an engine, and streams text back as vLLM serves it.
//!
//! - `api`: the routes (and the API key check);
//! - `complete`: the two completion endpoints, request to response;
//! - `generate`: one request's token events turned into text deltas;
//! - `dispatch`: where token ids go (an engine here, or a router);
//! - `structured`, `tools`: output shapes (JSON, regex, grammars, logit bias) and tool calls;
//! - `state`, `protocol`, `error`, `metrics`, `traces`, `http` (and `raw_errors`, the
//!   OpenAI bodies of the errors the HTTP library writes itself; `conn_phase`, a
//!   connection's timeouts as a pure state machine).

mod api;
mod complete;
mod conn_phase;
pub mod dispatch;
pub mod error;
pub mod generate;
pub mod http;
pub mod metrics;
pub mod protocol;
mod raw_errors;
mod send_pace;
mod shared_defs;
mod state;
pub mod structured;
pub mod tools;
pub mod traces;
pub mod validation;

pub use api::{authorized, check_api_key, router, ApiKeyError};
pub use dispatch::Dispatch;
pub use state::{
    max_bytes_per_token, AppState, Catalog, ListedModel, OneModel, Resolving, ServedModel,
    StreamCut,
};
