//! Where a gateway sends token ids: an engine in this process (`kvmesh serve`), or a router
//! in front of workers on other nodes (`kvmesh node --roles gateway,router`). Either way the
//! answer is a `Submission` of token events, and dropping it cancels the request.

use kvmesh_gpu::engine::{EngineHandle, Request, Submission};

use crate::error::ApiError;
use crate::metrics::render_engine;

pub trait Dispatch: Send + Sync + 'static {
    /// Queues a request, or says why it cannot be (bad input, full queue, no worker).
    fn submit(&self, req: Request) -> Result<Submission, ApiError>;
    /// The longest prompt + completion accepted, in tokens; `None` while nothing can serve.
    fn max_model_len(&self) -> Option<usize>;
    /// Prometheus lines about the engine or the workers behind this gateway.
    fn render_metrics(&self, out: &mut String, model: &str);
    /// Whether the engine runs in this process, so the gateway traces its phases (queue,
    /// prefill, decode) itself; a remote worker traces its own.
    fn is_local(&self) -> bool {
        false
    }
    /// Token ids the model has (0 to this, exclusive), when the dispatcher knows; the
    /// gateway checks prompts of token ids against it and the tokenizer's vocabulary.
    fn vocab_size(&self) -> Option<usize> {
        None
    }
}

impl Dispatch for EngineHandle {
    fn submit(&self, req: Request) -> Result<Submission, ApiError> {
        EngineHandle::submit(self, req).map_err(ApiError::from)
    }

    fn max_model_len(&self) -> Option<usize> {
        Some(self.info.config.max_model_len)
    }

    fn render_metrics(&self, out: &mut String, model: &str) {
        render_engine(out, model, self)
    }

    fn is_local(&self) -> bool {
        true
    }

    fn vocab_size(&self) -> Option<usize> {
        Some(self.info.vocab_size)
    }
}
