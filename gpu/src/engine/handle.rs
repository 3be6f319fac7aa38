//! The way in to an engine: a cloneable handle that checks a request against the engine's
//! limits and queues it, and the submission its caller reads the tokens from.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::{mpsc, oneshot};

use super::kv_events::KvEventHub;
use super::lease::{ExportEvent, Handover, KvLease, LeaseEvent};
use super::request::{EngineInfo, Progress, Request, SeqEvent, SeqId};
use super::stats::EngineStats;
use crate::error::{EngineError, Result};
use crate::guided::{Guided, LazyGuides};

/// What the engine thread is told.
pub(super) enum Command {
    Add {
        id: SeqId,
        req: Request,
        events: mpsc::UnboundedSender<SeqEvent>,
        progress: mpsc::UnboundedSender<Progress>,
        mode: Mode,
        /// Its grammar's matcher, compiled by the submitter (never on the engine thread).
        guided: Option<Box<Guided>>,
    },
    Abort(SeqId),
    /// A lease on a sequence's blocks landed, or its last clone is gone.
    Lease(LeaseEvent),
}

/// The way commands reach the engine: its channel, and for an engine on a shared driver
/// (see `shared`) what tells the driver it has something to read.
#[derive(Clone)]
pub(super) struct Inbox {
    pub(super) tx: crossbeam_channel::Sender<Command>,
    pub(super) wake: Option<Arc<dyn Fn() + Send + Sync>>,
}

impl Inbox {
    /// Queues a command; `Err` when the engine is gone.
    pub(super) fn send(&self, c: Command) -> std::result::Result<(), ()> {
        self.tx.send(c).map_err(|_| ())?;
        if let Some(wake) = &self.wake {
            wake();
        }
        Ok(())
    }
}

/// How a sequence gets its prompt's KV, with the channels its transfer hears on.
pub(super) enum Mode {
    /// Computed here.
    Local,
    /// Decode side: from a prefill worker, when at least `min_uncached` prompt tokens are not
    /// in the prefix cache here (otherwise computed here). The reservation goes to `lease_tx`.
    Remote {
        min_uncached: usize,
        lease_tx: oneshot::Sender<KvLease>,
        handover: Handover,
    },
    /// Prefill side: computed here and sent elsewhere from position `from_pos` on.
    Export {
        from_pos: usize,
        tx: mpsc::UnboundedSender<ExportEvent>,
        handover: Handover,
    },
}

/// A cloneable way in to the engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    pub(super) tx: Inbox,
    pub(super) next_id: Arc<AtomicU64>,
    /// Submissions not yet finished or dropped: what admission counts against the limit.
    /// (The `stats` gauges lag the engine thread, which publishes them between steps: a
    /// request freeing its slot, or several arriving at once, would be miscounted.)
    pub(super) admitted: Arc<AtomicUsize>,
    pub stats: Arc<EngineStats>,
    /// The prefix cache's stores and evictions, for routers.
    pub kv_events: Arc<KvEventHub>,
    pub info: Arc<EngineInfo>,
    /// What compiles requests' grammars over this model's vocabulary; without it a request
    /// with a grammar is refused.
    pub guides: Option<Arc<LazyGuides>>,
}

/// A submitted request's token events. Dropping it aborts the request and frees its blocks.
pub struct Submission {
    pub id: SeqId,
    pub events: mpsc::UnboundedReceiver<SeqEvent>,
    /// When it was scheduled and how its prompt was computed; whoever traces the request
    /// reads it, the rest may ignore it.
    pub progress: mpsc::UnboundedReceiver<Progress>,
    abort: AbortOnDrop,
    /// The request's place in the engine's admission count, given back when it finishes or
    /// is dropped, whichever comes first.
    slot: Option<Slot>,
}

impl Submission {
    /// The request finished on its own: nothing to abort, and its place is free.
    pub fn finished(&mut self) {
        self.abort.armed = false;
        self.slot = None;
    }
}

/// One admitted request, counted until dropped.
struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Dropping an unfinished submission aborts its sequence in the engine.
struct AbortOnDrop {
    id: SeqId,
    tx: Inbox,
    armed: bool,
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if self.armed {
            let _ = self.tx.send(Command::Abort(self.id));
        }
    }
}

impl EngineHandle {
    /// Lets requests carry grammars, compiled over this tokenizer's vocabulary.
    pub fn with_guides(mut self, guides: Arc<LazyGuides>) -> EngineHandle {
        self.guides = Some(guides);
        self
    }

    /// Compiles the request's grammar, if it has one and it is not compiled yet, on the
    /// blocking pool: submitting it afterwards starts its matcher from the cache instead of
    /// compiling on the caller's (async) thread. Errors are left for the submission to
    /// report.
    pub async fn warm_guide(&self, req: &Request) {
        let (Some(guides), Some(guide)) = (&self.guides, &req.params.guide) else {
            return;
        };
        let (guides, grammar) = (guides.clone(), guide.grammar.clone());
        let _ = tokio::task::spawn_blocking(move || {
            if let Ok(g) = guides.get() {
                let _ = g.start(&crate::guided::Guide { grammar, replay: 0 }, &[]);
            }
        })
        .await;
    }

    /// A matcher for the request's grammar, if it has one.
    fn compile_guide(&self, req: &Request) -> Result<Option<Box<Guided>>> {
        let Some(guide) = &req.params.guide else {
            return Ok(None);
        };
        let guides = self
            .guides
            .as_ref()
            .ok_or_else(|| {
                EngineError::InvalidRequest(
                    "this engine was started without a tokenizer, so it cannot follow a grammar"
                        .into(),
                )
            })?
            .get()
            .map_err(|e| EngineError::InvalidRequest(e.to_string()))?;
        guides
            .start(guide, &req.prompt)
            .map(|g| Some(Box::new(g)))
            .map_err(|e| EngineError::InvalidRequest(format!("the grammar: {e}")))
    }

    /// Checks the request against the engine's limits and queues it.
    pub fn submit(&self, req: Request) -> Result<Submission> {
        self.enqueue(req, Mode::Local)
    }

    /// Decode side of a disaggregated request: when admitted, the engine reserves blocks for
    /// the whole prompt and sends their lease on the returned channel, unless fewer than
    /// `min_uncached` prompt tokens are missing from its prefix cache: then it prefills
    /// itself, drops the channel, and tokens simply arrive on the submission.
    pub fn submit_remote_prefill(
        &self,
        req: Request,
        min_uncached: usize,
    ) -> Result<(Submission, oneshot::Receiver<KvLease>)> {
        self.submit_remote_prefill_on(req, min_uncached, Handover::Host)
    }

    /// The same, with the blocks lent where `handover` says.
    pub fn submit_remote_prefill_on(
        &self,
        req: Request,
        min_uncached: usize,
        handover: Handover,
    ) -> Result<(Submission, oneshot::Receiver<KvLease>)> {
        self.check_transfer()?;
        let (tx, rx) = oneshot::channel();
        let sub = self.enqueue(
            req,
            Mode::Remote {
                min_uncached,
                lease_tx: tx,
                handover,
            },
        )?;
        Ok((sub, rx))
    }

    /// Prefill side of a disaggregated request: the prompt is computed here and its K and V
    /// from position `from_pos` on are reported layer by layer on the returned channel (after
    /// an [`ExportEvent::Ready`] with the blocks' lease). Its first token arrives on the
    /// submission as usual.
    pub fn submit_export(
        &self,
        req: Request,
        from_pos: usize,
    ) -> Result<(Submission, mpsc::UnboundedReceiver<ExportEvent>)> {
        self.submit_export_on(req, from_pos, Handover::Host)
    }

    /// The same, with the blocks lent where `handover` says.
    pub fn submit_export_on(
        &self,
        req: Request,
        from_pos: usize,
        handover: Handover,
    ) -> Result<(Submission, mpsc::UnboundedReceiver<ExportEvent>)> {
        self.check_transfer()?;
        if from_pos >= req.prompt.len() {
            return Err(EngineError::InvalidRequest(format!(
                "the transfer starts at position {from_pos} but the prompt has {} tokens",
                req.prompt.len()
            )));
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let sub = self.enqueue(
            req,
            Mode::Export {
                from_pos,
                tx,
                handover,
            },
        )?;
        Ok((sub, rx))
    }

    fn check_transfer(&self) -> Result<()> {
        if self.info.kv_transfer {
            Ok(())
        } else {
            Err(EngineError::InvalidRequest(format!(
                "the {} backend keeps its KV cache where transfers cannot reach it; \
                 disaggregated prefill is not available on it",
                self.info.device
            )))
        }
    }

    fn enqueue(&self, req: Request, mode: Mode) -> Result<Submission> {
        let cfg = &self.info.config;
        if req.prompt.is_empty() {
            return Err(EngineError::InvalidRequest("the prompt is empty".into()));
        }
        if let Some(&bad) = req
            .prompt
            .iter()
            .find(|&&t| t as usize >= self.info.vocab_size)
        {
            return Err(EngineError::InvalidRequest(format!(
                "token id {bad} is outside the vocabulary (size {})",
                self.info.vocab_size
            )));
        }
        let total = req.prompt.len() + req.params.max_tokens;
        if total > cfg.max_model_len {
            return Err(EngineError::InvalidRequest(format!(
                "the prompt ({} tokens) plus max_tokens ({}) is {total} tokens, more than the \
                 maximum context length of {} tokens",
                req.prompt.len(),
                req.params.max_tokens,
                cfg.max_model_len
            )));
        }
        let blocks = total.div_ceil(cfg.block_size);
        if blocks > self.info.num_blocks {
            return Err(EngineError::InvalidRequest(format!(
                "the request needs {blocks} KV blocks but the cache holds {}",
                self.info.num_blocks
            )));
        }
        if let Some(&(bad, _)) = req
            .params
            .logit_bias
            .iter()
            .find(|&&(t, _)| t as usize >= self.info.vocab_size)
        {
            return Err(EngineError::InvalidRequest(format!(
                "logit_bias names token id {bad}, outside the vocabulary (size {})",
                self.info.vocab_size
            )));
        }
        let guided = self.compile_guide(&req)?;
        // Checked and counted in one step: two requests arriving together cannot both take
        // the last place.
        let capacity = cfg.max_num_seqs.saturating_add(cfg.max_waiting);
        if self
            .admitted
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < capacity).then_some(n + 1)
            })
            .is_err()
        {
            return Err(EngineError::QueueFull {
                waiting: cfg.max_waiting,
            });
        }
        let slot = Slot(self.admitted.clone());
        let id = SeqId(self.next_id.fetch_add(1, Ordering::Relaxed));
        let (etx, erx) = mpsc::unbounded_channel();
        let (ptx, prx) = mpsc::unbounded_channel();
        self.stats.waiting.fetch_add(1, Ordering::Relaxed);
        self.tx
            .send(Command::Add {
                id,
                req,
                events: etx,
                progress: ptx,
                mode,
                guided,
            })
            .map_err(|_| EngineError::Stopped)?;
        Ok(Submission {
            id,
            events: erx,
            progress: prx,
            abort: AbortOnDrop {
                id,
                tx: self.tx.clone(),
                armed: true,
            },
            slot: Some(slot),
        })
    }
}
