//! How a router routes, beyond its policy; each `Default` is what the CLI defaults to.

use crate::policy::PrefixTuning;

/// When to disaggregate.
#[derive(Clone, Copy, Debug)]
pub struct DisaggConfig {
    /// Prefill remotely only prompts with at least this many uncached tokens.
    pub min_tokens: usize,
    /// A prefill node with this many prompts queued (reported, or sent by this router and
    /// not yet started) has no room.
    pub max_queue: usize,
}

impl Default for DisaggConfig {
    fn default() -> Self {
        DisaggConfig {
            min_tokens: 256,
            max_queue: 8,
        }
    }
}

/// How a router routes, beyond its policy.
#[derive(Clone, Copy, Debug)]
pub struct RouterConfig {
    pub disagg: DisaggConfig,
    /// How many times one request may move to another worker after tokens were streamed
    /// (its worker lost mid-stream); past that it ends with an error event.
    pub migration_limit: u32,
    pub prefix: PrefixTuning,
}

impl Default for RouterConfig {
    fn default() -> Self {
        RouterConfig {
            disagg: DisaggConfig::default(),
            migration_limit: 3,
            prefix: PrefixTuning::default(),
        }
    }
}
