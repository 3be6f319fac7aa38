//! Where a gateway sends token ids: an engine in this process (`kvmesh serve`), or a router
//! in front of workers on other nodes (`kvmesh node --roles gateway,router`). Either way the
//! answer is a [`Reply`] of token events, and dropping it cancels the request.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;

use kvmesh_gpu::engine::{EngineHandle, Progress, Request, SeqEvent, Submission};
use kvmesh_gpu::guided::LazyGuides;
use kvmesh_telemetry::metrics::Exposition;
use tokio::sync::mpsc;

use crate::error::ApiError;
pub use crate::error::Unavailable;

pub trait Dispatch: Send + Sync + 'static {
    /// Queues a request, or says why it cannot be (bad input, full queue, no worker).
    fn submit(&self, req: Request) -> Result<Reply, ApiError>;
    /// The longest prompt + completion accepted, in tokens; `None` while nothing can serve.
    fn max_model_len(&self) -> Option<usize>;
    /// Metric families about the engine or the workers behind this gateway.
    fn render_metrics(&self, out: &Exposition, model: &str);
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
    /// The engine's grammar compiler, when it is in this process: the gateway checks
    /// grammars with it, so the engine finds them compiled.
    fn guides(&self) -> Option<Arc<LazyGuides>> {
        None
    }
}

impl Dispatch for EngineHandle {
    fn submit(&self, req: Request) -> Result<Reply, ApiError> {
        EngineHandle::submit(self, req)
            .map(Reply::Local)
            .map_err(ApiError::from)
    }

    fn max_model_len(&self) -> Option<usize> {
        Some(self.info.config.max_model_len)
    }

    fn render_metrics(&self, out: &Exposition, model: &str) {
        crate::metrics::render_engine(out, model, self)
    }

    fn is_local(&self) -> bool {
        true
    }

    fn vocab_size(&self) -> Option<usize> {
        Some(self.info.vocab_size)
    }

    fn guides(&self) -> Option<Arc<LazyGuides>> {
        self.guides.clone()
    }
}

/// What a dispatched request produces: an engine's events, or a router's word that no
/// worker could take it (a client may retry later).
#[derive(Debug)]
pub enum Event {
    Engine(SeqEvent),
    Unavailable { message: String, why: Unavailable },
}

/// A dispatched request's events. Dropping it cancels the request.
pub enum Reply {
    /// From an engine in this process; its progress (queue, prefill) can be traced here.
    Local(Submission),
    /// Produced elsewhere (a router forwarding a remote worker's stream).
    Driven(Driven),
}

/// Events a driver produces, run by the reader's own task as it awaits them (no spawned
/// task, no hand-off between tasks per token); dropping it drops the driver, which cancels
/// whatever the driver was doing.
pub struct Driven {
    /// The producer's id for the request (in response ids).
    id: u64,
    events: mpsc::UnboundedReceiver<Event>,
    driver: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
}

impl Driven {
    /// Events that `driver` sends on the channel `events` receives from, for the request
    /// the producer knows as `id`.
    pub fn new(
        id: u64,
        events: mpsc::UnboundedReceiver<Event>,
        driver: impl Future<Output = ()> + Send + 'static,
    ) -> Driven {
        Driven {
            id,
            events,
            driver: Some(Box::pin(driver)),
        }
    }

    async fn next_event(&mut self) -> Option<Event> {
        std::future::poll_fn(|cx| {
            if let Poll::Ready(ev) = self.events.poll_recv(cx) {
                return Poll::Ready(ev);
            }
            let Some(driver) = self.driver.as_mut() else {
                return Poll::Pending;
            };
            if driver.as_mut().poll(cx).is_ready() {
                // Done: what it sent is queued, and its sender is dropped, so the channel
                // ends after those.
                self.driver = None;
            }
            // What the driver just sent, without another round through the scheduler.
            self.events.poll_recv(cx)
        })
        .await
    }
}

impl Reply {
    /// The request's id where it is produced (an engine's sequence, a router's request).
    pub fn id(&self) -> u64 {
        match self {
            Reply::Local(sub) => sub.id.0,
            Reply::Driven(d) => d.id,
        }
    }

    /// The next event; `None` once the producer is gone and every event was read. A driven
    /// reply's producer runs only while this is awaited.
    pub async fn next_event(&mut self) -> Option<Event> {
        match self {
            Reply::Local(sub) => sub.events.recv().await.map(Event::Engine),
            Reply::Driven(d) => d.next_event().await,
        }
    }

    /// The request finished on its own: nothing to cancel when this is dropped.
    pub fn finished(&mut self) {
        if let Reply::Local(sub) = self {
            sub.finished();
        }
    }

    /// How an engine in this process is getting on with the request (none for others).
    pub fn progress(&mut self) -> Option<&mut mpsc::UnboundedReceiver<Progress>> {
        match self {
            Reply::Local(sub) => Some(&mut sub.progress),
            Reply::Driven(_) => None,
        }
    }
}
