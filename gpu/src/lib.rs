//! kvmesh's worker engine: models as Hugging Face ships them, a paged KV cache with prefix
//! caching, continuous batching, sampling, and the backends that run the math.

pub mod backend;
pub mod card;
pub mod checkpoint;
pub mod config;
pub mod device_kv;
pub mod embedded;
pub mod engine;
pub mod error;
pub mod guided;
pub mod hybrid_checkpoint;
pub mod init;
pub mod kv_cache;
pub mod kv_pool;
pub mod model;
pub mod quant;
pub mod safetensors;
pub mod sampler;
pub mod tokenizer;

pub use error::{EngineError, Result};
