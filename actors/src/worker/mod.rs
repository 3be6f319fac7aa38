//! The worker-type roles' data path. A node's QUIC endpoint accepts routers' and decode
//! workers' connections ([`Serving`]); each request stream goes to the role that takes it: a
//! generate request to the node's worker or decode role (`generate`), a prefill request to
//! its prefill role (`export`). Load reports and prefix-cache events go out on every
//! connection.
//!
//! Disaggregation is decode-first (see the router): a decode worker sent a request naming a
//! prefill worker reserves the prompt's blocks and asks the prefill worker to fill them
//! (`pull`); the prefill worker computes the prompt and pushes each layer's KV as soon as it
//! is computed (`export`). Per-token traffic goes engine channel → QUIC stream directly; the
//! role actors only decide which roles are serving (see `supervisor.rs`).

mod export;
mod generate;
mod ipc_side;
mod kv_side;
mod load;
mod pull;
mod role_core;
mod serving;

pub use export::SendVia;
pub use kv_side::{KvSide, KvStats, KvTransport, PeerError, PeerLinks, TransferError, UcxSide};
pub use load::LOAD_REPORT_INTERVAL;
pub use role_core::WorkerCore;
pub use serving::Serving;
