//! What goes into an engine and what comes out: requests, their limits, token events.

use std::time::Duration;

use crate::kv_pool::KvSpec;
use crate::sampler::{Sampled, SamplingParams};

/// Identifies a request inside the engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SeqId(pub u64);

#[derive(Clone, Debug)]
pub struct EngineConfig {
    pub max_model_len: usize,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub block_size: usize,
    /// Requests allowed to wait for one of the `max_num_seqs` slots: a request is refused
    /// only when `max_num_seqs + max_waiting` submitted requests are still unfinished.
    pub max_waiting: usize,
    pub enable_prefix_caching: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_model_len: 2048,
            max_num_seqs: 64,
            max_num_batched_tokens: 2048,
            block_size: 16,
            max_waiting: 1024,
            enable_prefix_caching: true,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An eos or stop token.
    Stop,
    /// `max_tokens` or the context length.
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

#[derive(Debug)]
pub enum SeqEvent {
    /// One generated token; `finish` is set on the last.
    Token {
        sampled: Sampled,
        finish: Option<FinishReason>,
        cached_tokens: usize,
    },
    Failed(String),
}

#[derive(Clone, Debug)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
}

/// How a sequence is getting on inside the engine, for tracing (see [`Submission::progress`]).
#[derive(Clone, Debug, PartialEq)]
pub enum Progress {
    /// Admitted to a batch after waiting `queued`; `cached_tokens` of the prompt were found
    /// in the prefix cache.
    Scheduled {
        queued: Duration,
        cached_tokens: usize,
    },
    /// A step computed `tokens` prompt tokens of this sequence, up to position `upto`; the
    /// step (with every other sequence in it) took `step`.
    Prefilled {
        tokens: usize,
        upto: usize,
        step: Duration,
    },
}

/// What a gateway needs to know about an engine.
#[derive(Clone, Debug)]
pub struct EngineInfo {
    pub device: String,
    pub num_blocks: usize,
    /// Recurrent-state slots beside the KV blocks (0 for a model without recurrent layers):
    /// at most this many sequences run at once.
    pub num_state_slots: usize,
    /// Saved recurrent states the prefix cache can keep (0 for a model without recurrent
    /// layers, or with prefix caching off).
    pub num_state_snapshots: usize,
    pub config: EngineConfig,
    pub eos_ids: Vec<u32>,
    pub vocab_size: usize,
    /// The KV cache's shape, when the backend can say.
    pub kv_spec: Option<KvSpec>,
    /// Whether the backend's KV can be moved in and out by transfers (host memory).
    pub kv_transfer: bool,
    /// The device the KV cache is on, where a transfer to or from another engine of this
    /// process can copy on the device ([`Handover::Device`](super::Handover::Device)).
    pub device_kv: Option<crate::device_kv::DeviceKey>,
}
