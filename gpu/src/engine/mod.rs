//! The engine: one thread that owns the backend and the block manager, and runs steps of
//! continuous batching for as long as there is work.
//!
//! Requests arrive on a channel and join the running batch at the next step. Each step gives
//! running sequences their next tokens first (a decode token, or the next chunk of a long
//! prompt), then admits waiting ones while the token budget, the sequence limit and the free
//! blocks allow. When blocks run out, the latest-arrived running sequence is preempted: its
//! blocks are freed and it goes back to the head of the queue to be recomputed (its full
//! blocks stay in the prefix cache, so the recompute is mostly a cache hit).
//!
//! Disaggregated requests (see [`lease`]) take two other paths through the same scheduler.
//! A decode worker's remote-prefill sequence is admitted by reserving blocks for its whole
//! prompt and lending them to a transfer; it waits, in no batch, until the KV has landed
//! (it then decodes) or the transfer gave up (it then prefills here). A prefill worker's
//! export sequence reserves its whole prompt at admission too, is never preempted, and
//! reports each layer as it is computed so the transfer overlaps the rest of the step.

pub mod kv_events;
mod lease;
#[cfg(test)]
mod transfer_tests;

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::ops::Range;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};

pub use lease::{ExportEvent, KvLease, Landed};

use crate::backend::{Backend, ForwardBatch, SampleSpec, SeqInput};
use crate::error::{EngineError, Result};
use crate::kv_cache::{block_hashes, BlockHash, BlockId, BlockManager};
use crate::kv_pool::{HostKvPool, KvSpec};
use crate::sampler::{Rng, Sampled, SamplingParams};

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
    /// No worker could take the request and nothing was generated (a cluster's router says
    /// this; a client may retry later).
    Unavailable {
        message: String,
        why: Unavailable,
    },
}

/// Why a routed request found no worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unavailable {
    /// Every worker's queue is full (HTTP 429, as on one node).
    QueueFull,
    /// No worker is there, or none could take it in time (HTTP 503).
    NoWorker,
    /// Its worker was lost before anything reached the client, and no other could
    /// continue it (HTTP 502).
    WorkerLost,
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

/// Counters and gauges the engine keeps for `/metrics`.
#[derive(Default)]
pub struct EngineStats {
    pub running: AtomicUsize,
    pub waiting: AtomicUsize,
    pub free_blocks: AtomicUsize,
    pub prefix_queries: AtomicU64,
    pub prefix_hits: AtomicU64,
    pub preemptions: AtomicU64,
    pub steps: AtomicU64,
    /// Wall time spent in steps, in microseconds: steps / busy time is how fast one running
    /// sequence advances while the engine works (what a router weighs nodes by).
    pub busy_us: AtomicU64,
    /// Steps with no prompt tokens in them, and their wall time: how fast decoding goes
    /// apart from the prompts a node happens to be computing.
    pub decode_steps: AtomicU64,
    pub decode_busy_us: AtomicU64,
    /// Wall time prompt tokens took: steps that computed them, less the decode part of a
    /// mixed step (see [`prefill_part_us`]).
    pub prefill_busy_us: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    /// Sequences holding reserved blocks while their prompt's KV arrives from elsewhere.
    pub awaiting_kv: AtomicUsize,
    /// Blocks of finished sequences still lent to a transfer.
    pub held_blocks: AtomicUsize,
    /// How a decode step's time grows with its batch, fitted over recent steps: what a
    /// router needs to tell whether one more sequence here costs little (batching) or a
    /// share of the node (a saturated one).
    pub step_fit: parking_lot::Mutex<StepFit>,
}

/// A decode step's wall time as `base + per_seq * batch`, by least squares over recent
/// pure-decode steps, each weighing [`StepFit::DECAY`] times the one after it (about the
/// last 200 steps count). Batch sizes that never varied leave the slope unknown: the fit
/// then says the mean step and no slope, rather than guessing one.
#[derive(Clone, Debug, Default)]
pub struct StepFit {
    w: f64,
    sn: f64,
    st: f64,
    snn: f64,
    snt: f64,
}

/// A fitted step model, in seconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepModel {
    pub base_s: f64,
    pub per_seq_s: f64,
    /// The weight of the steps behind it (each older one counts less).
    pub samples: f64,
}

impl StepFit {
    pub const DECAY: f64 = 0.995;
    /// The weight of steps behind a fit before a step's decode part is predicted from it.
    pub const TRUSTED: f64 = 5.0;

    pub fn add(&mut self, batch: usize, took_s: f64) {
        let (n, t, d) = (batch as f64, took_s, Self::DECAY);
        self.w = self.w * d + 1.0;
        self.sn = self.sn * d + n;
        self.st = self.st * d + t;
        self.snn = self.snn * d + n * n;
        self.snt = self.snt * d + n * t;
    }

    /// `None` before any step. With no spread in batch sizes (variance below a quarter of
    /// a sequence squared) the slope is 0 and the base the mean step.
    pub fn model(&self) -> Option<StepModel> {
        if self.w < 1e-9 {
            return None;
        }
        let (mean_n, mean_t) = (self.sn / self.w, self.st / self.w);
        let var = self.snn / self.w - mean_n * mean_n;
        let cov = self.snt / self.w - mean_n * mean_t;
        let mut per_seq = if var > 0.25 { cov / var } else { 0.0 };
        // Timing noise can tilt a flat fit below zero; a step never gets faster with more.
        per_seq = per_seq.max(0.0);
        let mut base = mean_t - per_seq * mean_n;
        if base < 0.0 {
            // All of the time is per sequence.
            base = 0.0;
            per_seq = if mean_n > 0.0 { mean_t / mean_n } else { 0.0 };
        }
        Some(StepModel {
            base_s: base,
            per_seq_s: per_seq,
            samples: self.w,
        })
    }
}

/// The part of a step's time its prompt tokens took: all of it when nothing decoded in
/// it; otherwise what is left after the decode fit's prediction for its decoding
/// sequences (while there is a fit). Counting a mixed step's whole time as prefill would
/// rate short prompts as slow as a decode step: a 16-token prompt beside a batch on an
/// 8 ms step would measure some 2,000 tokens per second where the device does 50,000.
/// The remainder is floored at a fiftieth of the step, as noise can put the prediction
/// above the step.
pub fn prefill_part_us(took_us: u64, decode_seqs: usize, fit: Option<StepModel>) -> u64 {
    match fit {
        Some(m) if decode_seqs > 0 && m.samples >= StepFit::TRUSTED => {
            let predicted = (m.base_s + m.per_seq_s * decode_seqs as f64) * 1e6;
            let rest = took_us as f64 - predicted;
            (rest.max(took_us as f64 / 50.0)).round() as u64
        }
        _ => took_us,
    }
}

/// What a gateway needs to know about an engine.
#[derive(Clone, Debug)]
pub struct EngineInfo {
    pub device: String,
    pub num_blocks: usize,
    pub config: EngineConfig,
    pub eos_ids: Vec<u32>,
    pub vocab_size: usize,
    /// The KV cache's shape, when the backend can say.
    pub kv_spec: Option<KvSpec>,
    /// Whether the backend's KV can be moved in and out by transfers (host memory).
    pub kv_transfer: bool,
}

enum Command {
    Add {
        id: SeqId,
        req: Request,
        events: mpsc::UnboundedSender<SeqEvent>,
        progress: mpsc::UnboundedSender<Progress>,
        mode: Mode,
    },
    Abort(SeqId),
    /// A remote-prefill sequence's KV has landed.
    KvOutcome {
        id: SeqId,
        landed: Landed,
    },
    /// The last clone of a sequence's lease is gone.
    LeaseDropped(SeqId),
}

/// How a sequence gets its prompt's KV.
enum Mode {
    /// Computed here.
    Local,
    /// Decode side: from a prefill worker, when at least `min_uncached` prompt tokens are not
    /// in the prefix cache here (otherwise computed here). The reservation goes to `lease_tx`.
    Remote {
        min_uncached: usize,
        lease_tx: Option<oneshot::Sender<KvLease>>,
    },
    /// Prefill side: computed here and sent elsewhere from position `from_pos` on.
    Export {
        from_pos: usize,
        tx: mpsc::UnboundedSender<ExportEvent>,
    },
}

/// A cloneable way in to the engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    tx: crossbeam_channel::Sender<Command>,
    next_id: Arc<AtomicU64>,
    /// Submissions not yet finished or dropped: what admission counts against the limit.
    /// (The `stats` gauges lag the engine thread, which publishes them between steps: a
    /// request freeing its slot, or several arriving at once, would be miscounted.)
    admitted: Arc<AtomicUsize>,
    pub stats: Arc<EngineStats>,
    /// The prefix cache's stores and evictions, for routers.
    pub kv_events: Arc<kv_events::KvEventHub>,
    pub info: Arc<EngineInfo>,
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
    /// What produces the events when they come from elsewhere (a router forwarding a remote
    /// worker's stream), polled by [`Submission::next_event`] in the reader's own task:
    /// each event then reaches the reader with no hand-off between tasks.
    driver: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
}

impl Submission {
    /// The request finished on its own: nothing to abort, and its place is free.
    pub fn finished(&mut self) {
        self.abort.armed = false;
        self.slot = None;
    }

    /// The next event; `None` once the producer is gone and every event was read. A driven
    /// submission's producer runs only while this is awaited.
    pub async fn next_event(&mut self) -> Option<SeqEvent> {
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

/// One admitted request, counted until dropped.
struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// What dropping an unfinished submission cancels: a sequence in this process's engine, or
/// something else that produces the events (a request streamed from a remote worker).
enum AbortTarget {
    Engine {
        id: SeqId,
        tx: crossbeam_channel::Sender<Command>,
    },
    /// Events from the submission's own driver: dropping the driver cancels it.
    Driven,
}

struct AbortOnDrop {
    target: AbortTarget,
    armed: bool,
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        match &mut self.target {
            AbortTarget::Engine { id, tx } => {
                let _ = tx.send(Command::Abort(*id));
            }
            AbortTarget::Driven => {}
        }
    }
}

impl Submission {
    /// A submission whose events `driver` sends on `events` (a router forwarding a remote
    /// worker's stream). The driver runs as [`Submission::next_event`] is awaited, and is
    /// cancelled when the submission is dropped.
    pub fn driven(
        id: SeqId,
        events: mpsc::UnboundedReceiver<SeqEvent>,
        driver: impl Future<Output = ()> + Send + 'static,
    ) -> Submission {
        Submission {
            id,
            events,
            progress: mpsc::unbounded_channel().1,
            abort: AbortOnDrop {
                target: AbortTarget::Driven,
                armed: false,
            },
            slot: None,
            driver: Some(Box::pin(driver)),
        }
    }
}

impl EngineHandle {
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
        self.check_transfer()?;
        let (tx, rx) = oneshot::channel();
        let sub = self.enqueue(
            req,
            Mode::Remote {
                min_uncached,
                lease_tx: Some(tx),
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
        self.check_transfer()?;
        if from_pos >= req.prompt.len() {
            return Err(EngineError::InvalidRequest(format!(
                "the transfer starts at position {from_pos} but the prompt has {} tokens",
                req.prompt.len()
            )));
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let sub = self.enqueue(req, Mode::Export { from_pos, tx })?;
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
            })
            .map_err(|_| EngineError::Stopped)?;
        Ok(Submission {
            id,
            events: erx,
            progress: prx,
            abort: AbortOnDrop {
                target: AbortTarget::Engine {
                    id,
                    tx: self.tx.clone(),
                },
                armed: true,
            },
            slot: Some(slot),
            driver: None,
        })
    }
}

struct Seq {
    id: SeqId,
    tokens: Vec<u32>,
    prompt_len: usize,
    num_computed: usize,
    blocks: Vec<BlockId>,
    hashes: Vec<BlockHash>,
    params: SamplingParams,
    rng: Rng,
    events: mpsc::UnboundedSender<SeqEvent>,
    cached_tokens: usize,
    admitted_once: bool,
    mode: Mode,
    /// A lease on this sequence's blocks is out: they are freed only when it comes back.
    lease_out: bool,
    /// On a backend without host-visible KV: the host copy of this sequence's blocks that
    /// its transfer reads from or lands in (block `i` mirrors `blocks[i]`).
    stage: Option<Arc<HostKvPool>>,
    progress: mpsc::UnboundedSender<Progress>,
    enqueued: Instant,
}

impl Seq {
    fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }
}

/// A decode sequence whose blocks are lent to a transfer, and what it landed with (if it did).
struct Awaiting {
    seq: Seq,
    landed: Option<Landed>,
}

/// Starts the engine thread.
pub fn spawn(
    backend: Box<dyn Backend>,
    cfg: EngineConfig,
    eos_ids: Vec<u32>,
    vocab_size: usize,
) -> EngineHandle {
    let mut cfg = cfg;
    if cfg.enable_prefix_caching && backend.kv_depends_on_context() {
        tracing::info!(
            "prefix caching is off: this model's K/V depend on the sequence's length (dynamic \
             RoPE), so cached blocks cannot be shared between sequences"
        );
        cfg.enable_prefix_caching = false;
    }
    let (tx, rx) = crossbeam_channel::unbounded();
    let num_blocks = backend.num_blocks();
    let stats = Arc::new(EngineStats::default());
    stats.free_blocks.store(num_blocks, Ordering::Relaxed);
    let kv_events = Arc::new(kv_events::KvEventHub::default());
    let pool = backend.host_kv();
    let kv_spec = backend.kv_spec();
    let info = Arc::new(EngineInfo {
        device: backend.device(),
        num_blocks,
        config: cfg.clone(),
        eos_ids: eos_ids.clone(),
        vocab_size,
        kv_spec: kv_spec.clone(),
        kv_transfer: pool.is_some() || (backend.kv_staging() && kv_spec.is_some()),
    });
    let mut engine = Engine {
        blocks: BlockManager::new(num_blocks, cfg.block_size),
        backend,
        cfg,
        eos_ids,
        running: Vec::new(),
        waiting: VecDeque::new(),
        awaiting: Vec::new(),
        held: HashMap::new(),
        pool,
        stats: stats.clone(),
        kv_events: kv_events.clone(),
        rx,
        tx: tx.clone(),
    };
    std::thread::Builder::new()
        .name("kvmesh-engine".into())
        .spawn(move || engine.run())
        .expect("spawn engine thread");
    EngineHandle {
        tx,
        next_id: Arc::new(AtomicU64::new(1)),
        admitted: Arc::new(AtomicUsize::new(0)),
        stats,
        kv_events,
        info,
    }
}

struct Engine {
    backend: Box<dyn Backend>,
    blocks: BlockManager,
    cfg: EngineConfig,
    eos_ids: Vec<u32>,
    running: Vec<Seq>,
    waiting: VecDeque<Seq>,
    /// Decode sequences whose prompt's KV is being transferred in.
    awaiting: Vec<Awaiting>,
    /// Blocks of sequences that ended while a lease on them was out.
    held: HashMap<SeqId, Vec<BlockId>>,
    pool: Option<Arc<HostKvPool>>,
    stats: Arc<EngineStats>,
    kv_events: Arc<kv_events::KvEventHub>,
    rx: crossbeam_channel::Receiver<Command>,
    /// For leases, which report back through the command channel.
    tx: crossbeam_channel::Sender<Command>,
}

impl Engine {
    fn run(&mut self) {
        loop {
            if self.running.is_empty() && self.waiting.is_empty() {
                match self.rx.recv() {
                    Ok(c) => self.handle(c),
                    Err(_) => return,
                }
            }
            while let Ok(c) = self.rx.try_recv() {
                self.handle(c);
            }
            let idle = match self.step() {
                Ok(ran) => !ran,
                Err(e) => {
                    // A failed step fails the sequences in it; the engine keeps serving.
                    tracing::error!("engine step failed: {e}");
                    for s in std::mem::take(&mut self.running) {
                        let _ = s.events.send(SeqEvent::Failed(e.to_string()));
                        self.retire(s);
                    }
                    false
                }
            };
            self.publish();
            if idle {
                // Nothing could run: what waits needs blocks that are lent out, or a lease
                // to come back. Sleep until a command changes that.
                match self.rx.recv() {
                    Ok(c) => self.handle(c),
                    Err(_) => return,
                }
            }
        }
    }

    fn handle(&mut self, c: Command) {
        match c {
            Command::Add {
                id,
                req,
                events,
                progress,
                mode,
            } => {
                let prompt_len = req.prompt.len();
                let rng = match req.params.seed {
                    Some(s) => {
                        let mut r = Rng::seeded(s);
                        r.skip(req.params.resume_draws);
                        r
                    }
                    None => Rng::from_entropy(),
                };
                self.waiting.push_back(Seq {
                    id,
                    tokens: req.prompt,
                    prompt_len,
                    num_computed: 0,
                    blocks: Vec::new(),
                    hashes: Vec::new(),
                    params: req.params,
                    rng,
                    events,
                    cached_tokens: 0,
                    admitted_once: false,
                    mode,
                    lease_out: false,
                    stage: None,
                    progress,
                    enqueued: Instant::now(),
                });
            }
            Command::Abort(id) => {
                if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
                    let s = self.waiting.remove(i).expect("index");
                    self.retire(s);
                } else if let Some(i) = self.running.iter().position(|s| s.id == id) {
                    let s = self.running.remove(i);
                    self.retire(s);
                } else if let Some(i) = self.awaiting.iter().position(|a| a.seq.id == id) {
                    let a = self.awaiting.remove(i);
                    self.retire(a.seq);
                }
            }
            Command::KvOutcome { id, landed } => {
                if let Some(a) = self.awaiting.iter_mut().find(|a| a.seq.id == id) {
                    a.landed = Some(landed);
                }
            }
            Command::LeaseDropped(id) => self.lease_returned(id),
        }
        self.publish();
    }

    /// Every clone of a sequence's lease is gone: nothing else touches its blocks now.
    fn lease_returned(&mut self, id: SeqId) {
        if let Some(blocks) = self.held.remove(&id) {
            self.blocks.release(&blocks);
        } else if let Some(i) = self.awaiting.iter().position(|a| a.seq.id == id) {
            let Awaiting { mut seq, landed } = self.awaiting.remove(i);
            seq.lease_out = false;
            seq.mode = Mode::Local;
            // Staged KV goes to the device before the sequence may use it.
            let landed = landed.filter(|_| match seq.stage.take() {
                None => true,
                Some(stage) => {
                    let from = seq.cached_tokens;
                    let k = from / self.cfg.block_size;
                    let local = mirror(seq.blocks.len());
                    match self.backend.kv_from_host(
                        &stage,
                        &local[k..],
                        from..seq.prompt_len,
                        &seq.blocks[k..],
                    ) {
                        Ok(()) => true,
                        Err(e) => {
                            tracing::warn!("landing staged KV failed ({e}); prefilling locally");
                            false
                        }
                    }
                }
            });
            match landed {
                Some(l) => self.land(seq, l),
                // The transfer failed or was given up: prefill here, from the cached prefix;
                // the blocks reserved past it are simply computed into.
                None => self.waiting.push_front(seq),
            }
        } else if let Some(s) = self
            .running
            .iter_mut()
            .chain(self.waiting.iter_mut())
            .find(|s| s.id == id)
        {
            s.lease_out = false;
        }
    }

    /// A decode sequence's prompt KV is in its blocks: it continues from the first token.
    fn land(&mut self, mut s: Seq, l: Landed) {
        s.num_computed = s.prompt_len;
        Self::register_full_blocks(&mut self.blocks, &self.cfg, &mut s);
        s.cached_tokens = s.cached_tokens.max(l.cached_tokens);
        if let Some(state) = l.rng {
            s.rng = Rng::from_state(state);
        }
        if emit(&self.stats, &self.eos_ids, &self.cfg, &mut s, l.first) {
            self.retire(s);
        } else if self.running.len() < self.cfg.max_num_seqs {
            self.running.push(s);
        } else {
            self.waiting.push_front(s);
        }
    }

    /// A sequence is done with its blocks: they are freed, or kept while a lease is out.
    fn retire(&mut self, s: Seq) {
        if s.lease_out {
            self.held.insert(s.id, s.blocks);
        } else {
            self.blocks.release(&s.blocks);
        }
    }

    fn publish(&mut self) {
        self.kv_events.publish(self.blocks.take_events());
        self.stats
            .running
            .store(self.running.len(), Ordering::Relaxed);
        self.stats
            .waiting
            .store(self.waiting.len(), Ordering::Relaxed);
        self.stats
            .free_blocks
            .store(self.blocks.num_free(), Ordering::Relaxed);
        self.stats
            .awaiting_kv
            .store(self.awaiting.len(), Ordering::Relaxed);
        self.stats
            .held_blocks
            .store(self.held.values().map(Vec::len).sum(), Ordering::Relaxed);
    }

    fn blocks_needed(&self, s: &Seq, n: usize) -> usize {
        (s.num_computed + n)
            .div_ceil(self.cfg.block_size)
            .saturating_sub(s.blocks.len())
    }

    fn preempt(&mut self, mut s: Seq) {
        self.blocks.release(&s.blocks);
        s.blocks.clear();
        s.hashes.clear();
        s.num_computed = 0;
        self.stats.preemptions.fetch_add(1, Ordering::Relaxed);
        self.waiting.push_front(s);
    }

    /// Records every block of `s` that is now full and computed in the prefix cache.
    fn register_full_blocks(blocks: &mut BlockManager, cfg: &EngineConfig, s: &mut Seq) {
        let bs = cfg.block_size;
        while (s.hashes.len() + 1) * bs <= s.num_computed {
            let k = s.hashes.len();
            let h = BlockHash::chain(s.hashes.last().copied(), &s.tokens[k * bs..(k + 1) * bs]);
            s.hashes.push(h);
            if cfg.enable_prefix_caching {
                blocks.register(s.blocks[k], h);
            }
        }
    }

    /// Lends a sequence's blocks out: the pool's own blocks, or on a backend without host
    /// KV a host mirror of them (filled with positions `stage_fill` first).
    fn lease(&mut self, s: &mut Seq, from_pos: usize, stage_fill: Range<usize>) -> Result<KvLease> {
        let (pool, blocks) = match &self.pool {
            Some(p) => (p.clone(), s.blocks.clone()),
            None => {
                let spec = self.backend.kv_spec().ok_or_else(|| {
                    EngineError::Backend("the backend has no KV layout to stage".into())
                })?;
                let stage = Arc::new(HostKvPool::new(spec, s.blocks.len())?);
                let local = mirror(s.blocks.len());
                if !stage_fill.is_empty() {
                    self.backend
                        .kv_to_host(&s.blocks, stage_fill, &stage, &local)?;
                }
                s.stage = Some(stage.clone());
                (stage, local)
            }
        };
        s.lease_out = true;
        Ok(KvLease::new(
            s.id,
            pool,
            blocks,
            s.prompt_len,
            from_pos,
            self.tx.clone(),
        ))
    }

    /// Picks this step's work: `(index into running, tokens to run)`.
    fn schedule(&mut self) -> Vec<(usize, usize)> {
        let mut budget = self.cfg.max_num_batched_tokens;
        let mut plan = Vec::new();
        let mut preempted = false;
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let n = (self.running[i].tokens.len() - self.running[i].num_computed).min(budget);
            let need = self.blocks_needed(&self.running[i], n);
            let mut runnable = true;
            while self.blocks.num_free() < need {
                // The latest arrival goes first; sequences whose blocks are lent out stay.
                let Some(v) = (i..self.running.len())
                    .rev()
                    .find(|&j| !self.running[j].lease_out)
                else {
                    runnable = false;
                    break;
                };
                let victim = self.running.remove(v);
                self.preempt(victim);
                preempted = true;
                if v == i {
                    runnable = false;
                    break;
                }
            }
            if i >= self.running.len() {
                break;
            }
            if !runnable || self.blocks.num_free() < need {
                i += 1;
                continue;
            }
            for _ in 0..need {
                let b = self.blocks.allocate().expect("checked free blocks");
                self.running[i].blocks.push(b);
            }
            plan.push((i, n));
            budget -= n;
            i += 1;
        }
        while !preempted && budget > 0 && self.running.len() < self.cfg.max_num_seqs {
            let Some(mut s) = self.waiting.pop_front() else {
                break;
            };
            if s.blocks.is_empty() && self.cfg.enable_prefix_caching {
                // Leave at least one token to compute, so the step yields logits.
                let reusable = (s.tokens.len() - 1) / self.cfg.block_size;
                let hashes = block_hashes(
                    &s.tokens[..reusable * self.cfg.block_size],
                    self.cfg.block_size,
                );
                s.blocks = self.blocks.take_cached_prefix(&hashes);
                s.num_computed = s.blocks.len() * self.cfg.block_size;
                s.hashes = hashes[..s.blocks.len()].to_vec();
            }
            if let Mode::Remote { min_uncached, .. } = s.mode {
                if s.prompt_len - s.num_computed < min_uncached {
                    // Cached well enough here: no transfer (the lease channel closes).
                    s.mode = Mode::Local;
                }
            }
            let n = (s.tokens.len() - s.num_computed).min(budget);
            // A transfer needs the whole prompt's blocks from the start, so that it never
            // waits for (or is preempted by) a later allocation.
            let need = match s.mode {
                Mode::Local => self.blocks_needed(&s, n),
                _ => s
                    .prompt_len
                    .div_ceil(self.cfg.block_size)
                    .saturating_sub(s.blocks.len()),
            };
            if self.blocks.num_free() < need {
                self.blocks.release(&s.blocks);
                s.blocks.clear();
                s.hashes.clear();
                s.num_computed = 0;
                self.waiting.push_front(s);
                break;
            }
            for _ in 0..need {
                s.blocks
                    .push(self.blocks.allocate().expect("checked free blocks"));
            }
            if !s.admitted_once {
                s.admitted_once = true;
                s.cached_tokens = s.num_computed;
                let _ = s.progress.send(Progress::Scheduled {
                    queued: s.enqueued.elapsed(),
                    cached_tokens: s.num_computed,
                });
                self.stats
                    .prefix_queries
                    .fetch_add(s.prompt_len as u64, Ordering::Relaxed);
                self.stats
                    .prefix_hits
                    .fetch_add(s.num_computed as u64, Ordering::Relaxed);
            }
            match &mut s.mode {
                Mode::Remote { lease_tx, .. } => {
                    // Lent to the transfer; it waits outside every batch until the lease
                    // comes back. If the requester is gone, so is the lease, at once.
                    let tx = lease_tx.take();
                    let from = s.num_computed;
                    match self.lease(&mut s, from, 0..0) {
                        Ok(lease) => {
                            if let Some(tx) = tx {
                                let _ = tx.send(lease);
                            }
                            self.awaiting.push(Awaiting {
                                seq: s,
                                landed: None,
                            });
                            continue;
                        }
                        // No transfer then: prefill here.
                        Err(e) => {
                            tracing::warn!("cannot lend KV blocks ({e}); prefilling locally");
                            s.mode = Mode::Local;
                        }
                    }
                }
                Mode::Export { from_pos, tx } => {
                    let (from, tx) = (*from_pos, tx.clone());
                    let computed = s.num_computed;
                    // What the prefix cache already holds goes out first.
                    match self.lease(&mut s, from, from.min(computed)..computed) {
                        Ok(lease) => {
                            let _ = tx.send(ExportEvent::Ready { lease, computed });
                        }
                        Err(e) => {
                            let _ = s
                                .events
                                .send(SeqEvent::Failed(format!("cannot lend KV blocks: {e}")));
                            self.retire(s);
                            continue;
                        }
                    }
                }
                Mode::Local => {}
            }
            self.running.push(s);
            plan.push((self.running.len() - 1, n));
            budget -= n;
        }
        plan
    }

    /// Runs one step; `false` when nothing could run.
    fn step(&mut self) -> Result<bool> {
        let plan = self.schedule();
        if plan.is_empty() {
            if !self.waiting.is_empty()
                && self.running.is_empty()
                && self.awaiting.is_empty()
                && self.held.is_empty()
            {
                // Cannot happen for requests that passed `submit`'s size check; never spin.
                let s = self.waiting.pop_front().expect("non-empty");
                let _ = s.events.send(SeqEvent::Failed(
                    "the request does not fit in the KV cache".into(),
                ));
                self.retire(s);
                return Ok(true);
            }
            return Ok(false);
        }
        let started = Instant::now();
        let batch = ForwardBatch {
            seqs: plan
                .iter()
                .map(|&(i, n)| {
                    let s = &self.running[i];
                    SeqInput {
                        tokens: &s.tokens[s.num_computed..s.num_computed + n],
                        start_pos: s.num_computed,
                        context_len: s.tokens.len(),
                        block_table: &s.blocks,
                        want_logits: s.num_computed + n == s.tokens.len(),
                    }
                })
                .collect(),
        };
        // Exported sequences in this step hear of each layer as its K and V are in place:
        // (index, channel, first position computed now, position after the last).
        let exports: Vec<Export> = plan
            .iter()
            .filter_map(|&(i, n)| match &self.running[i].mode {
                Mode::Export { tx, .. } => {
                    let at = self.running[i].num_computed;
                    Some((i, tx.clone(), at, at + n))
                }
                _ => None,
            })
            .collect();
        // A backend with host KV says as each layer lands; a staging one is copied out after
        // the step.
        let streaming = !exports.is_empty() && self.pool.is_some();
        let sampling: Vec<usize> = plan
            .iter()
            .filter(|&&(i, n)| self.running[i].num_computed + n == self.running[i].tokens.len())
            .map(|&(i, _)| i)
            .collect();
        // Split borrows: the batch borrows token slices; sampling state is taken out meanwhile.
        let mut rngs: Vec<Rng> = sampling
            .iter()
            .map(|&i| self.running[i].rng.clone())
            .collect();
        let params: Vec<SamplingParams> = sampling
            .iter()
            .map(|&i| self.running[i].params.clone())
            .collect();
        let mut specs: Vec<SampleSpec> = params
            .iter()
            .zip(rngs.iter_mut())
            .map(|(params, rng)| SampleSpec { params, rng })
            .collect();
        let ready = |layer: usize| {
            for (_, tx, _, upto) in &exports {
                let _ = tx.send(ExportEvent::Layer { layer, upto: *upto });
            }
        };
        let out = if streaming {
            self.backend
                .forward_sample_streaming(&batch, &mut specs, &ready)?
        } else {
            self.backend.forward_sample(&batch, &mut specs)?
        };
        drop(specs);
        let prompt_tokens: usize = batch.num_tokens() - sampling.len();
        // Sequences past their prompt: each computes one generated token.
        let decode_seqs = plan
            .iter()
            .filter(|&&(i, _)| self.running[i].num_computed >= self.running[i].prompt_len)
            .count();
        drop(batch);
        let took_us = started.elapsed().as_micros() as u64;
        self.stats.steps.fetch_add(1, Ordering::Relaxed);
        self.stats.busy_us.fetch_add(took_us, Ordering::Relaxed);
        if prompt_tokens == 0 {
            self.stats.decode_steps.fetch_add(1, Ordering::Relaxed);
            self.stats
                .decode_busy_us
                .fetch_add(took_us, Ordering::Relaxed);
            self.stats
                .step_fit
                .lock()
                .add(sampling.len(), took_us as f64 / 1e6);
        } else {
            let fit = self.stats.step_fit.lock().model();
            self.stats.prefill_busy_us.fetch_add(
                prefill_part_us(took_us, decode_seqs, fit),
                Ordering::Relaxed,
            );
        }
        self.stats
            .prompt_tokens
            .fetch_add(prompt_tokens as u64, Ordering::Relaxed);
        tracing::trace!(tokens = prompt_tokens + sampling.len(), elapsed = ?started.elapsed(), "step");
        if !exports.is_empty() && !streaming {
            self.stage_out(&exports)?;
        }

        let step = started.elapsed();
        for &(i, n) in &plan {
            let s = &mut self.running[i];
            if s.num_computed < s.prompt_len {
                let _ = s.progress.send(Progress::Prefilled {
                    tokens: n,
                    upto: s.num_computed + n,
                    step,
                });
            }
            s.num_computed += n;
            Self::register_full_blocks(&mut self.blocks, &self.cfg, s);
        }
        let mut done = Vec::new();
        for ((&i, sampled), rng) in sampling.iter().zip(out).zip(rngs) {
            let s = &mut self.running[i];
            s.rng = rng;
            if let Mode::Export { tx, .. } = &s.mode {
                let _ = tx.send(ExportEvent::Sampled { rng: s.rng.state() });
            }
            if emit(&self.stats, &self.eos_ids, &self.cfg, s, sampled) {
                done.push(i);
            }
        }
        done.sort_unstable();
        for i in done.into_iter().rev() {
            let s = self.running.remove(i);
            self.retire(s);
        }
        Ok(true)
    }
}

/// An exported sequence in a step: its index in `running`, its channel, and the positions
/// the step computes.
type Export = (usize, mpsc::UnboundedSender<ExportEvent>, usize, usize);

/// Block ids `0..n`: a staging pool's blocks, mirroring a sequence's table in order.
fn mirror(n: usize) -> Vec<BlockId> {
    (0..n as u32).map(BlockId).collect()
}

impl Engine {
    /// After a step on a backend without host KV: copies what each exported sequence
    /// computed into its staging pool, then reports every layer.
    fn stage_out(&mut self, exports: &[Export]) -> Result<()> {
        let layers = self.backend.kv_spec().map_or(0, |k| k.num_layers);
        for (i, tx, from, upto) in exports {
            let s = &self.running[*i];
            if let Some(stage) = &s.stage {
                let local = mirror(s.blocks.len());
                self.backend
                    .kv_to_host(&s.blocks, *from..*upto, stage, &local)?;
            }
            for layer in 0..layers {
                let _ = tx.send(ExportEvent::Layer { layer, upto: *upto });
            }
        }
        Ok(())
    }
}

/// Appends a generated token and sends it; whether the sequence is finished (or its receiver
/// gone).
fn emit(
    stats: &EngineStats,
    eos_ids: &[u32],
    cfg: &EngineConfig,
    s: &mut Seq,
    sampled: Sampled,
) -> bool {
    let tok = sampled.token;
    s.tokens.push(tok);
    stats.generation_tokens.fetch_add(1, Ordering::Relaxed);
    let finish = if (!s.params.ignore_eos && eos_ids.contains(&tok))
        || s.params.stop_token_ids.contains(&tok)
    {
        Some(FinishReason::Stop)
    } else if s.generated() >= s.params.max_tokens || s.tokens.len() >= cfg.max_model_len {
        Some(FinishReason::Length)
    } else {
        None
    };
    let sent = s.events.send(SeqEvent::Token {
        sampled,
        finish,
        cached_tokens: s.cached_tokens,
    });
    finish.is_some() || sent.is_err()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[test]
    fn step_fit_recovers_base_and_slope_and_admits_an_unknown_slope() {
        let mut f = StepFit::default();
        assert!(f.model().is_none());
        // One batch size only: its mean, no slope.
        for _ in 0..50 {
            f.add(4, 0.010);
        }
        let m = f.model().unwrap();
        assert_eq!(m.per_seq_s, 0.0);
        assert!((m.base_s - 0.010).abs() < 1e-9, "{m:?}");
        // Varied batches on 8 ms + 0.1 ms per sequence.
        let mut f = StepFit::default();
        for k in 0..400 {
            let n = 1 + k % 48;
            f.add(n, 0.008 + 0.0001 * n as f64);
        }
        let m = f.model().unwrap();
        assert!((m.base_s - 0.008).abs() < 1e-6, "{m:?}");
        assert!((m.per_seq_s - 0.0001).abs() < 1e-8, "{m:?}");
        // Purely per sequence, with noise pushing the intercept below zero: all per seq.
        let mut f = StepFit::default();
        for k in 0..200 {
            let n = 10 + k % 3;
            f.add(n, 0.001 * n as f64 - 0.002 * (k % 2) as f64 + 0.001);
        }
        let m = f.model().unwrap();
        assert!(m.base_s >= 0.0 && m.per_seq_s >= 0.0, "{m:?}");
    }

    #[test]
    fn a_mixed_steps_prompt_share_is_what_the_decode_fit_leaves() {
        let mut f = StepFit::default();
        for k in 0..100 {
            f.add(1 + k % 8, 0.008 + 0.0001 * (1 + k % 8) as f64);
        }
        let fit = f.model();
        // 8 ms + 4 x 0.1 ms of decode in a 9 ms step: 0.6 ms of prompt.
        assert_eq!(prefill_part_us(9_000, 4, fit), 600);
        // A prompt-only step is all prompt; so is a mixed step with no fit to split by.
        assert_eq!(prefill_part_us(9_000, 0, fit), 9_000);
        assert_eq!(prefill_part_us(9_000, 4, None), 9_000);
        let mut young = StepFit::default();
        young.add(4, 0.0084);
        assert_eq!(prefill_part_us(9_000, 4, young.model()), 9_000);
        // Noise that puts the prediction above the step leaves a floor, not zero.
        assert_eq!(prefill_part_us(8_000, 4, fit), 160);
    }

    /// Per step: each sequence's (start position, tokens, wants logits).
    type StepLog = Arc<Mutex<Vec<Vec<(usize, usize, bool)>>>>;

    /// A backend with no math: the next token is `(last token + position) % vocab`, so
    /// outputs depend on the whole schedule being right; it records every batch's shape.
    struct Recorder {
        blocks: usize,
        vocab: usize,
        log: StepLog,
    }

    impl Backend for Recorder {
        fn device(&self) -> String {
            "test".into()
        }
        fn num_blocks(&self) -> usize {
            self.blocks
        }
        fn forward(&mut self, batch: &ForwardBatch) -> Result<Vec<Vec<f32>>> {
            self.log.lock().unwrap().push(
                batch
                    .seqs
                    .iter()
                    .map(|s| (s.start_pos, s.tokens.len(), s.want_logits))
                    .collect(),
            );
            Ok(batch
                .seqs
                .iter()
                .filter(|s| s.want_logits)
                .map(|s| {
                    let last = *s.tokens.last().unwrap() as usize;
                    let pos = s.start_pos + s.tokens.len() - 1;
                    let mut l = vec![0.0; self.vocab];
                    l[(last + pos) % self.vocab] = 10.0;
                    l
                })
                .collect())
        }
    }

    fn expected(prompt: &[u32], n: usize, vocab: usize) -> Vec<u32> {
        let mut toks = prompt.to_vec();
        let mut out = Vec::new();
        for _ in 0..n {
            let t = ((*toks.last().unwrap() as usize + toks.len() - 1) % vocab) as u32;
            toks.push(t);
            out.push(t);
        }
        out
    }

    fn drain(sub: &mut Submission) -> Vec<u32> {
        let mut out = Vec::new();
        loop {
            match sub.events.blocking_recv().expect("event") {
                SeqEvent::Token {
                    sampled, finish, ..
                } => {
                    out.push(sampled.token);
                    if finish.is_some() {
                        sub.finished();
                        return out;
                    }
                }
                SeqEvent::Failed(m) | SeqEvent::Unavailable { message: m, .. } => panic!("{m}"),
            }
        }
    }

    /// Logits that leave sampling at temperature 1 genuinely random: a small wave over the
    /// vocabulary that shifts with the last token and the position.
    struct Flat {
        vocab: usize,
    }

    impl Backend for Flat {
        fn device(&self) -> String {
            "flat".into()
        }
        fn num_blocks(&self) -> usize {
            64
        }
        fn forward(&mut self, batch: &ForwardBatch) -> Result<Vec<Vec<f32>>> {
            Ok(batch
                .seqs
                .iter()
                .filter(|s| s.want_logits)
                .map(|s| {
                    let last = *s.tokens.last().unwrap() as usize;
                    let pos = s.start_pos + s.tokens.len() - 1;
                    (0..self.vocab)
                        .map(|i| ((i * 7 + last * 3 + pos) % 11) as f32 * 0.1)
                        .collect()
                })
                .collect())
        }
    }

    /// A seeded sequence continued elsewhere (its tokens so far appended to the prompt and
    /// the generator's spent draws skipped) goes on exactly as it would have.
    #[test]
    fn a_seeded_sequence_resumed_with_its_draws_continues_identically() {
        let vocab = 50;
        let h = spawn(
            Box::new(Flat { vocab }),
            EngineConfig {
                max_model_len: 128,
                block_size: 4,
                ..Default::default()
            },
            vec![],
            vocab,
        );
        let params = |max_tokens: usize, resume_draws: u64| SamplingParams {
            temperature: 1.0,
            seed: Some(42),
            max_tokens,
            ignore_eos: true,
            resume_draws,
            ..Default::default()
        };
        let prompt: Vec<u32> = vec![3, 1, 4, 1, 5, 9, 2, 6];
        let run = |prompt: Vec<u32>, p: SamplingParams| {
            let mut sub = h.submit(Request { prompt, params: p }).unwrap();
            drain(&mut sub)
        };
        let whole = run(prompt.clone(), params(30, 0));
        assert_eq!(
            whole,
            run(prompt.clone(), params(30, 0)),
            "seeded runs repeat"
        );
        let cut = 12;
        let resumed_prompt = [&prompt[..], &whole[..cut]].concat();
        let rest = run(resumed_prompt.clone(), params(30 - cut, cut as u64));
        assert_eq!(rest, whole[cut..]);
        // Without skipping the draws the continuation is another one: the test can fail.
        let naive = run(resumed_prompt, params(30 - cut, 0));
        assert_ne!(naive, whole[cut..]);
    }

    /// A backend that keeps no host-visible KV.
    pub(super) struct NoHostKv;

    impl Backend for NoHostKv {
        fn device(&self) -> String {
            "nohost".into()
        }
        fn num_blocks(&self) -> usize {
            8
        }
        fn forward(&mut self, _: &ForwardBatch) -> Result<Vec<Vec<f32>>> {
            Ok(vec![])
        }
    }

    fn greedy(max_tokens: usize) -> SamplingParams {
        SamplingParams {
            temperature: 0.0,
            max_tokens,
            ignore_eos: true,
            ..Default::default()
        }
    }

    #[test]
    fn admission_refuses_only_beyond_running_plus_waiting() {
        let vocab = 97;
        let cfg = EngineConfig {
            max_model_len: 64,
            max_num_seqs: 2,
            max_num_batched_tokens: 64,
            block_size: 4,
            max_waiting: 2,
            enable_prefix_caching: false,
        };
        let h = spawn(
            Box::new(Recorder {
                blocks: 64,
                vocab,
                log: Arc::new(Mutex::new(Vec::new())),
            }),
            cfg,
            vec![],
            vocab,
        );
        let req = || Request {
            prompt: vec![1, 2, 3],
            params: greedy(6),
        };
        let full = |r: Result<Submission>| matches!(r, Err(EngineError::QueueFull { .. }));
        for round in 0..20 {
            // Four at once, before the engine thread has seen any: two run, two wait.
            let mut subs: Vec<Submission> = (0..4)
                .map(|i| {
                    h.submit(req())
                        .unwrap_or_else(|e| panic!("round {round}, request {i}: {e}"))
                })
                .collect();
            assert!(full(h.submit(req())), "round {round}: a fifth has no place");
            // A finished request frees its place as soon as its last token is read.
            drain(&mut subs[0]);
            subs[0] = h.submit(req()).expect("the finished request's place");
            // So does a dropped one.
            subs.pop();
            subs.push(h.submit(req()).expect("the dropped request's place"));
            assert!(full(h.submit(req())));
            for s in &mut subs {
                drain(s);
            }
        }
    }

    #[test]
    fn budgets_chunking_and_preemption_keep_outputs_exact() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let vocab = 97;
        let cfg = EngineConfig {
            max_model_len: 256,
            max_num_seqs: 3,
            max_num_batched_tokens: 20,
            block_size: 4,
            max_waiting: 100,
            enable_prefix_caching: true,
        };
        // 24 blocks of 4 tokens cannot hold five 50-token sequences at once.
        let h = spawn(
            Box::new(Recorder {
                blocks: 24,
                vocab,
                log: log.clone(),
            }),
            cfg,
            vec![],
            vocab,
        );
        let prompts: Vec<Vec<u32>> = (0..5)
            .map(|i| (0..(13 + 7 * i)).map(|t| (t * 3 + i) as u32 % 90).collect())
            .collect();
        let mut subs: Vec<Submission> = prompts
            .iter()
            .map(|p| {
                h.submit(Request {
                    prompt: p.clone(),
                    params: greedy(25),
                })
                .unwrap()
            })
            .collect();
        for (p, sub) in prompts.iter().zip(subs.iter_mut()) {
            assert_eq!(drain(sub), expected(p, 25, vocab));
        }
        let log = log.lock().unwrap();
        for step in log.iter() {
            assert!(step.len() <= 3, "max_num_seqs exceeded: {step:?}");
            assert!(
                step.iter().map(|s| s.1).sum::<usize>() <= 20,
                "token budget exceeded: {step:?}"
            );
        }
        assert!(
            log.iter()
                .any(|s| s.iter().any(|&(start, n, want)| start > 0 && n > 1 && want)),
            "a prompt was chunked"
        );
        assert!(
            h.stats.preemptions.load(Ordering::Relaxed) > 0,
            "blocks ran out, so something was preempted"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert_eq!(
            h.stats.free_blocks.load(Ordering::Relaxed),
            24,
            "every block is free again"
        );
    }

    #[test]
    fn prefix_cache_skips_computed_blocks_and_eos_stops() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let vocab = 50;
        let cfg = EngineConfig {
            block_size: 4,
            max_model_len: 100,
            ..Default::default()
        };
        let h = spawn(
            Box::new(Recorder {
                blocks: 64,
                vocab,
                log: log.clone(),
            }),
            cfg,
            vec![],
            vocab,
        );
        let prompt: Vec<u32> = (0..18).collect();
        let mut a = h
            .submit(Request {
                prompt: prompt.clone(),
                params: greedy(3),
            })
            .unwrap();
        let first = drain(&mut a);
        let mut b = h
            .submit(Request {
                prompt: prompt.clone(),
                params: greedy(3),
            })
            .unwrap();
        assert_eq!(drain(&mut b), first);
        let log = log.lock().unwrap();
        // The second run's prefill starts after the 4 cached blocks (16 tokens).
        let second_prefill = log.iter().rev().find(|s| s[0].1 > 1).unwrap();
        assert_eq!(second_prefill[0], (16, 2, true));
        assert_eq!(h.stats.prefix_hits.load(Ordering::Relaxed), 16);
        drop(log);
        // A stop token ends the sequence with reason Stop.
        let stop = expected(&prompt, 2, vocab)[1];
        let mut c = h
            .submit(Request {
                prompt,
                params: SamplingParams {
                    stop_token_ids: vec![stop],
                    ..greedy(10)
                },
            })
            .unwrap();
        assert_eq!(drain(&mut c).len(), 2);
    }

    #[test]
    fn oversized_requests_are_refused_with_both_lengths() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let cfg = EngineConfig {
            max_model_len: 32,
            block_size: 4,
            ..Default::default()
        };
        let h = spawn(
            Box::new(Recorder {
                blocks: 64,
                vocab: 10,
                log,
            }),
            cfg,
            vec![],
            10,
        );
        let e = h
            .submit(Request {
                prompt: vec![1; 30],
                params: greedy(5),
            })
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("30") && e.contains('5') && e.contains("32"),
            "{e}"
        );
        let e = h
            .submit(Request {
                prompt: vec![11],
                params: greedy(1),
            })
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("vocabulary"), "{e}");
    }
}
