//! The engine thread: owns the backend and the scheduler, takes commands between steps, and
//! carries each step's plan out: lends blocks to transfers, runs the batch, samples, and
//! sends every sequence its tokens.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::{mpsc, oneshot};

use super::handle::{Command, EngineHandle, Inbox, Mode};
use super::kv_events::KvEventHub;
use super::lease::{ExportEvent, Handover, KvLease, Landed, LeaseEvent, LeaseNotify};
use super::masks::MaskThread;
use super::request::{EngineConfig, EngineInfo, FinishReason, Progress, SeqEvent, SeqId};
use super::scheduler::{Entry, Lend, Limits, Place, Plan, Scheduler, SeqState, Transfer};
use super::stats::{prefill_part_us, EngineStats};
use crate::backend::error::{KvCopyError, StateError};
use crate::backend::{Backend, ForwardBatch, MaskSlot, SampleSpec, SeqInput};
use crate::device_kv::{DeviceKvPool, KvMemory};
use crate::error::{EngineError, Result};
use crate::guided::{mask_words, Guided};
use crate::kv_cache::BlockId;
use crate::kv_pool::HostKvPool;
use crate::sampler::{Rng, Sampled, SamplingParams};

/// The engine's parts of a sequence, beside what the scheduler knows of it.
struct SeqIo {
    params: SamplingParams,
    rng: Rng,
    events: mpsc::UnboundedSender<SeqEvent>,
    progress: mpsc::UnboundedSender<Progress>,
    enqueued: Instant,
    /// Decode side: where its blocks' lease goes when it is admitted.
    lease_tx: Option<oneshot::Sender<KvLease>>,
    /// Prefill side: what its transfer hears.
    export: Option<mpsc::UnboundedSender<ExportEvent>>,
    /// Where its transfer wants the blocks lent.
    handover: Handover,
    /// On a backend without host-visible KV: the host copy of this sequence's blocks that
    /// its transfer reads from or lands in (block `i` mirrors `blocks[i]`).
    stage: Option<Arc<HostKvPool>>,
    /// Decode side: what its transfer landed with, once it has.
    landed: Option<Landed>,
    /// Its grammar's matcher; taken out while a step computes its mask.
    guided: Option<Box<Guided>>,
}

type Seq = Entry<SeqIo>;

/// Starts the engine thread.
pub fn spawn(
    backend: Box<dyn Backend>,
    cfg: EngineConfig,
    eos_ids: Vec<u32>,
    vocab_size: usize,
) -> EngineHandle {
    let (mut engine, handle) = build(backend, cfg, eos_ids, vocab_size, None);
    std::thread::Builder::new()
        .name("kvmesh-engine".into())
        .spawn(move || engine.run())
        .expect("spawn engine thread");
    handle
}

/// An engine and its handle; `wake` (an engine on a shared driver, whose backend then hands
/// its steps' time to the driver where it can) is called after every command sent to it.
pub(super) fn build(
    mut backend: Box<dyn Backend>,
    cfg: EngineConfig,
    eos_ids: Vec<u32>,
    vocab_size: usize,
    wake: Option<Arc<dyn Fn() + Send + Sync>>,
) -> (Engine, EngineHandle) {
    let deferred = wake.is_some() && backend.defer_steps();
    let mut cfg = cfg;
    if cfg.enable_prefix_caching && backend.kv_depends_on_context() {
        tracing::info!(
            "prefix caching is off: this model's K/V depend on the sequence's length (dynamic \
             RoPE), so cached blocks cannot be shared between sequences"
        );
        cfg.enable_prefix_caching = false;
    }
    let state_slots = backend.num_state_slots();
    let mut snapshots = backend.num_state_snapshots();
    if cfg.enable_prefix_caching && state_slots > 0 && snapshots == 0 {
        tracing::info!(
            "prefix caching is off: this model's linear-attention layers carry a recurrent \
             state that cached KV blocks do not hold, and the backend keeps no saved states \
             to resume a cached prefix from (every prompt is computed in full)"
        );
        cfg.enable_prefix_caching = false;
    }
    if !cfg.enable_prefix_caching {
        snapshots = 0;
    }
    if let Some(max) = backend.max_step_tokens() {
        if cfg.max_num_batched_tokens > max {
            tracing::warn!(
                asked = cfg.max_num_batched_tokens,
                max,
                "--max-num-batched-tokens is above what the backend takes in one step; \
                 using its maximum (longer prompts are prefilled in chunks)"
            );
            cfg.max_num_batched_tokens = max;
        }
    }
    let (tx, rx) = crossbeam_channel::unbounded();
    let tx = Inbox { tx, wake };
    let num_blocks = backend.num_blocks();
    let stats = Arc::new(EngineStats::default());
    stats.free_blocks.store(num_blocks, Ordering::Relaxed);
    stats.free_state_slots.store(state_slots, Ordering::Relaxed);
    let kv_events = Arc::new(KvEventHub::default());
    let pool = backend.host_kv();
    let device_kv = backend.device_kv();
    let kv_spec = backend.kv_spec();
    let info = Arc::new(EngineInfo {
        device: backend.device(),
        num_blocks,
        num_state_slots: state_slots,
        num_state_snapshots: snapshots,
        config: cfg.clone(),
        eos_ids: eos_ids.clone(),
        vocab_size,
        kv_spec: kv_spec.clone(),
        kv_transfer: pool.is_some() || (backend.kv_staging() && kv_spec.is_some()),
        device_kv: device_kv.as_ref().map(|d| d.device()),
    });
    let limits = Limits {
        max_num_seqs: cfg.max_num_seqs,
        max_num_batched_tokens: cfg.max_num_batched_tokens,
        block_size: cfg.block_size,
        enable_prefix_caching: cfg.enable_prefix_caching,
    };
    // Leases report back through the command channel.
    let notify: LeaseNotify = {
        let tx = tx.clone();
        Arc::new(move |e: LeaseEvent| {
            let _ = tx.send(Command::Lease(e));
        })
    };
    let engine = Engine {
        sched: Scheduler::with_state_slots(limits, num_blocks, state_slots, snapshots),
        backend,
        cfg,
        eos_ids,
        pool,
        device_kv,
        stats: stats.clone(),
        kv_events: kv_events.clone(),
        rx,
        notify,
        vocab_size,
        masks: MaskThread::default(),
        deferred,
        pending: None,
    };
    let handle = EngineHandle {
        tx,
        next_id: Arc::new(AtomicU64::new(1)),
        admitted: Arc::new(AtomicUsize::new(0)),
        stats,
        kv_events,
        info,
        guides: None,
    };
    (engine, handle)
}

pub(super) struct Engine {
    backend: Box<dyn Backend>,
    sched: Scheduler<SeqIo>,
    cfg: EngineConfig,
    eos_ids: Vec<u32>,
    pool: Option<Arc<HostKvPool>>,
    /// The device cache as in-process transfers address it, on a backend that has one.
    device_kv: Option<Arc<DeviceKvPool>>,
    stats: Arc<EngineStats>,
    kv_events: Arc<KvEventHub>,
    rx: crossbeam_channel::Receiver<Command>,
    notify: LeaseNotify,
    vocab_size: usize,
    masks: MaskThread,
    /// The backend hands its steps' time to a shared driver (see `shared`).
    deferred: bool,
    /// A deferred step, computed, whose time is not up yet.
    pending: Option<Box<Stepped>>,
}

/// A step whose batch is computed: what its end needs to count it and send its tokens.
struct Stepped {
    plan: Plan,
    exports: Vec<Export>,
    /// Whether its layers were reported as they were computed.
    streamed: bool,
    started: Instant,
    /// When the step's planning began, and how long the backend's forward took.
    cycle: Instant,
    forward_us: u64,
    sampling: Vec<usize>,
    sampled: Vec<Sampled>,
    rngs: Vec<Rng>,
    prompt_tokens: usize,
    decode_seqs: usize,
}

/// What starting a step came to.
enum Began {
    /// Nothing could run.
    Idle,
    /// A request that can never fit was failed instead.
    Retired,
    Ran(Box<Stepped>),
}

/// What a turn on a shared driver leaves the engine waiting for.
pub(super) enum Turn {
    /// A command.
    Idle,
    /// Nothing: it has more to do.
    Again,
    /// The end of its step's modelled time.
    Due(std::time::Duration),
}

/// An exported sequence in a step: its index in `running`, its channel, and the positions
/// the step computes.
type Export = (usize, mpsc::UnboundedSender<ExportEvent>, usize, usize);

/// Block ids `0..n`: a staging pool's blocks, mirroring a sequence's table in order.
fn mirror(n: usize) -> Vec<BlockId> {
    (0..n as u32).map(BlockId).collect()
}

impl Engine {
    fn run(&mut self) {
        loop {
            if self.sched.is_idle() {
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
                    self.fail_running(e);
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

    /// A failed step fails the sequences in it; the engine keeps serving.
    fn fail_running(&mut self, e: EngineError) {
        tracing::error!("engine step failed: {e}");
        for s in std::mem::take(&mut self.sched.running) {
            let _ = s.io.events.send(SeqEvent::Failed(e.to_string()));
            self.sched.retire(s.seq);
        }
    }

    /// One turn on a shared driver: ends the step whose time is up, reads the commands
    /// that arrived meanwhile, and starts the next step.
    pub(super) fn turn(&mut self) -> Turn {
        if let Some(s) = self.pending.take() {
            if let Err(e) = self.end_step(s) {
                self.fail_running(e);
            }
        }
        while let Ok(c) = self.rx.try_recv() {
            self.handle(c);
        }
        let turn = match self.begin_step() {
            Ok(Began::Idle) => Turn::Idle,
            Ok(Began::Retired) => Turn::Again,
            Ok(Began::Ran(s)) => match self.backend.take_due().filter(|d| !d.is_zero()) {
                Some(due) => {
                    self.pending = Some(s);
                    Turn::Due(due)
                }
                None => {
                    if let Err(e) = self.end_step(s) {
                        self.fail_running(e);
                    }
                    Turn::Again
                }
            },
            Err(e) => {
                self.fail_running(e);
                Turn::Again
            }
        };
        self.publish();
        turn
    }

    fn handle(&mut self, c: Command) {
        match c {
            Command::Add {
                id,
                req,
                events,
                progress,
                mode,
                guided,
            } => self.add(id, req.prompt, req.params, events, progress, (mode, guided)),
            Command::Abort(id) => {
                if let Some(e) = self.sched.remove(id) {
                    self.sched.retire(e.seq);
                }
            }
            Command::Lease(LeaseEvent::Landed { seq, landed }) => {
                if let Some(e) = self.sched.awaiting.iter_mut().find(|e| e.seq.id == seq) {
                    e.io.landed = Some(landed);
                }
            }
            Command::Lease(LeaseEvent::Dropped(id)) => self.lease_returned(id),
            Command::Lease(LeaseEvent::Abandoned(id)) => self.lease_abandoned(id),
        }
        self.publish();
    }

    fn add(
        &mut self,
        id: SeqId,
        prompt: Vec<u32>,
        params: SamplingParams,
        events: mpsc::UnboundedSender<SeqEvent>,
        progress: mpsc::UnboundedSender<Progress>,
        (mode, guided): (Mode, Option<Box<Guided>>),
    ) {
        let rng = match params.seed {
            Some(s) => {
                let mut r = Rng::seeded(s);
                r.skip(params.resume_draws);
                r
            }
            None => Rng::from_entropy(),
        };
        let (transfer, lease_tx, export, handover) = match mode {
            Mode::Local => (Transfer::Local, None, None, Handover::Host),
            Mode::Remote {
                min_uncached,
                lease_tx,
                handover,
            } => (
                Transfer::Remote { min_uncached },
                Some(lease_tx),
                None,
                handover,
            ),
            Mode::Export {
                from_pos,
                tx,
                handover,
            } => (Transfer::Export { from_pos }, None, Some(tx), handover),
        };
        self.sched.waiting.push_back(Entry {
            seq: SeqState::new(id, prompt, transfer),
            io: SeqIo {
                params,
                rng,
                events,
                progress,
                enqueued: Instant::now(),
                lease_tx,
                export,
                handover,
                stage: None,
                landed: None,
                guided,
            },
        });
    }

    /// Every clone of a sequence's lease is gone: nothing else touches its blocks now. A
    /// decode sequence whose KV landed decodes on; one whose transfer failed or was given up
    /// prefills here, from its cached prefix (the blocks reserved past it are simply
    /// computed into).
    fn lease_returned(&mut self, id: SeqId) {
        let Some(mut e) = self.sched.lease_returned(id) else {
            return;
        };
        // Staged KV goes to the device before the sequence may use it.
        let landed = e.io.landed.take().filter(|_| match e.io.stage.take() {
            None => true,
            Some(stage) => {
                let from = e.seq.cached_tokens;
                let k = from / self.cfg.block_size;
                let local = mirror(e.seq.blocks.len());
                let blocks = &e.seq.blocks[k..];
                match self
                    .backend
                    .kv_from_host(&stage, &local[k..], from..e.seq.prompt_len, blocks)
                {
                    Ok(()) => true,
                    Err(err) => {
                        tracing::warn!("landing staged KV failed ({err}); prefilling locally");
                        false
                    }
                }
            }
        });
        // A model with recurrent state decodes on only from the state after the prompt.
        let landed = landed.filter(|l| match e.seq.state_slot {
            None => true,
            Some(slot) => {
                let written = match &l.state {
                    Some(state) => self.backend.write_state(slot, state),
                    None => Err(StateError::NotSent.into()),
                };
                if let Err(err) = &written {
                    tracing::warn!(
                        "landing the recurrent state failed ({err}); prefilling locally"
                    );
                }
                written.is_ok()
            }
        });
        match landed {
            Some(l) => self.land(e, l),
            None => self.sched.waiting.push_front(e),
        }
    }

    /// A decode sequence's transfer was given up with its lease still out: it waits first in
    /// line to be prefilled here, in blocks other than the lent ones.
    fn lease_abandoned(&mut self, id: SeqId) {
        let landed = self
            .sched
            .awaiting
            .iter()
            .any(|e| e.seq.id == id && e.io.landed.is_some());
        if landed {
            return;
        }
        if let Some(mut e) = self.sched.abandon_lease(id) {
            e.io.stage = None;
            self.sched.waiting.push_front(e);
        }
    }

    /// A decode sequence's prompt KV is in its blocks: it continues from the first token.
    fn land(&mut self, mut e: Seq, l: Landed) {
        e.seq.num_computed = e.seq.prompt_len;
        self.sched.register_full_blocks(&mut e.seq);
        e.seq.cached_tokens = e.seq.cached_tokens.max(l.cached_tokens);
        if let Some(state) = l.rng {
            e.io.rng = Rng::from_state(state);
        }
        if emit(&self.stats, &self.eos_ids, &self.cfg, &mut e, l.first) {
            self.sched.retire(e.seq);
        } else {
            self.sched.resume(e);
        }
    }

    fn publish(&mut self) {
        self.kv_events.publish(self.sched.blocks.take_events());
        let s = &self.sched;
        let st = &self.stats;
        st.running.store(s.running.len(), Ordering::Relaxed);
        st.waiting.store(s.waiting.len(), Ordering::Relaxed);
        st.free_blocks.store(s.blocks.num_free(), Ordering::Relaxed);
        st.free_state_slots
            .store(s.states.num_free(), Ordering::Relaxed);
        st.saved_states.store(s.snapshots.len(), Ordering::Relaxed);
        st.awaiting_kv.store(s.awaiting.len(), Ordering::Relaxed);
        st.held_blocks
            .store(s.held.values().map(Vec::len).sum(), Ordering::Relaxed);
    }

    /// A lease on a sequence's blocks: the pool's own blocks; the device cache's own, for a
    /// transfer in this process that asked for them ([`Handover::Device`]); or on a backend
    /// without host KV a host mirror of them (filled with positions `stage_fill` first).
    fn lease(
        &mut self,
        place: Place,
        from_pos: usize,
        stage_fill: Range<usize>,
    ) -> Result<KvLease> {
        let e = self.sched.at_mut(place);
        let (memory, blocks) = match (&self.pool, &self.device_kv, e.io.handover) {
            (Some(p), _, _) => (KvMemory::Host(p.clone()), e.seq.blocks.clone()),
            (None, Some(d), Handover::Device) => {
                (KvMemory::Device(d.clone()), e.seq.blocks.clone())
            }
            (None, _, _) => {
                let spec = self.backend.kv_spec().ok_or(KvCopyError::NoLayout)?;
                let stage = Arc::new(HostKvPool::new(spec, e.seq.blocks.len())?);
                let local = mirror(e.seq.blocks.len());
                if !stage_fill.is_empty() {
                    self.backend
                        .kv_to_host(&e.seq.blocks, stage_fill, &stage, &local)?;
                }
                e.io.stage = Some(stage.clone());
                (KvMemory::Host(stage), local)
            }
        };
        Ok(KvLease::new(
            e.seq.id,
            memory,
            blocks,
            e.seq.prompt_len,
            from_pos,
            self.notify.clone(),
        ))
    }

    /// What the plan says beside the batch: remote prefills that stay here drop their
    /// transfer, first admissions are reported, and blocks are lent. A lend that cannot be
    /// made (no host memory to stage in) leaves a remote prefill to be computed here and
    /// fails an export.
    fn carry_out(&mut self, plan: &mut Plan) {
        for &place in &plan.computed_here {
            // Cached well enough here: no transfer (its lease channel closes).
            self.sched.at_mut(place).io.lease_tx = None;
        }
        for &(place, cached) in &plan.admitted {
            let e = self.sched.at(place);
            let _ = e.io.progress.send(Progress::Scheduled {
                queued: e.io.enqueued.elapsed(),
                cached_tokens: cached,
            });
            let prompt = e.seq.prompt_len as u64;
            self.stats
                .prefix_queries
                .fetch_add(prompt, Ordering::Relaxed);
            self.stats
                .prefix_hits
                .fetch_add(cached as u64, Ordering::Relaxed);
        }
        self.stats
            .preemptions
            .fetch_add(plan.preempted as u64, Ordering::Relaxed);
        let mut failed = Vec::new();
        for &lend in &plan.lend {
            match lend {
                Lend::Remote { at, from_pos } => {
                    // If the requester is gone, so is the lease, at once.
                    let tx = self.sched.awaiting[at].io.lease_tx.take();
                    match self.lease(Place::Awaiting(at), from_pos, 0..0) {
                        Ok(lease) => {
                            if let Some(tx) = tx {
                                let _ = tx.send(lease);
                            }
                        }
                        Err(e) => {
                            tracing::warn!("cannot lend KV blocks ({e}); prefilling locally");
                            failed.push(lend);
                        }
                    }
                }
                Lend::Export {
                    at,
                    from_pos,
                    computed,
                } => {
                    // What the prefix cache already holds goes out first.
                    let fill = from_pos.min(computed)..computed;
                    match self.lease(Place::Running(at), from_pos, fill) {
                        Ok(lease) => {
                            if let Some(tx) = &self.sched.running[at].io.export {
                                let _ = tx.send(ExportEvent::Ready { lease, computed });
                            }
                        }
                        Err(e) => {
                            let message = format!("cannot lend KV blocks: {e}");
                            let _ = self.sched.running[at]
                                .io
                                .events
                                .send(SeqEvent::Failed(message));
                            failed.push(lend);
                        }
                    }
                }
            }
        }
        if !failed.is_empty() {
            for e in self.sched.unlend(plan, &failed) {
                self.sched.retire(e.seq);
            }
        }
    }

    /// Runs one step; `false` when nothing could run.
    fn step(&mut self) -> Result<bool> {
        match self.begin_step()? {
            Began::Idle => Ok(false),
            Began::Retired => Ok(true),
            Began::Ran(s) => self.end_step(s).map(|()| true),
        }
    }

    /// Plans a step and computes its batch.
    fn begin_step(&mut self) -> Result<Began> {
        let cycle = Instant::now();
        let mut plan = self.sched.schedule();
        // Sequences that resume after a cached prefix start from its saved state (those
        // waiting for a transfer too: they prefill from it if the transfer fails).
        for &(from, to) in &plan.restores {
            self.backend.copy_state(from, to)?;
        }
        self.carry_out(&mut plan);
        if plan.run.is_empty() {
            if let Some(e) = self.sched.unschedulable() {
                let _ = e.io.events.send(SeqEvent::Failed(
                    "the request does not fit in the KV cache".into(),
                ));
                self.sched.retire(e.seq);
                return Ok(Began::Retired);
            }
            return Ok(Began::Idle);
        }
        let started = Instant::now();
        let exports = self.exports(&plan);
        self.forward(plan, exports, (cycle, started))
            .map(|s| Began::Ran(Box::new(s)))
    }

    /// A computed step's end: it is counted, transfers hear of its layers if they have not,
    /// and its tokens go out.
    fn end_step(&mut self, s: Box<Stepped>) -> Result<()> {
        let Stepped {
            plan,
            exports,
            streamed,
            started,
            cycle,
            forward_us,
            sampling,
            sampled,
            rngs,
            prompt_tokens,
            decode_seqs,
        } = *s;
        self.count_step(started, prompt_tokens, sampling.len(), decode_seqs);
        if prompt_tokens == 0 {
            self.stats
                .decode_forward_us
                .fetch_add(forward_us, Ordering::Relaxed);
        }
        if !exports.is_empty() && !streamed {
            self.stage_out(&exports)?;
        }
        let step = started.elapsed();
        for &(i, n) in &plan.run {
            let e = &self.sched.running[i];
            if e.seq.num_computed < e.seq.prompt_len {
                let _ = e.io.progress.send(Progress::Prefilled {
                    tokens: n,
                    upto: e.seq.num_computed + n,
                    step,
                });
            }
        }
        for (from, to) in self.sched.advance(&plan) {
            self.backend.copy_state(from, to)?;
        }
        let mut done = Vec::new();
        for ((&i, sampled), rng) in sampling.iter().zip(sampled).zip(rngs) {
            let e = &mut self.sched.running[i];
            e.io.rng = rng;
            if let Some(tx) = &e.io.export {
                // The state after the prompt goes with the KV to the decode side.
                if let Some(slot) = e.seq.state_slot {
                    let _ = tx.send(ExportEvent::State(self.backend.read_state(slot)?));
                }
                let _ = tx.send(ExportEvent::Sampled {
                    rng: e.io.rng.state(),
                });
            }
            if emit(&self.stats, &self.eos_ids, &self.cfg, e, sampled) {
                done.push(i);
            }
        }
        done.sort_unstable();
        for i in done.into_iter().rev() {
            let e = self.sched.running.remove(i);
            self.sched.retire(e.seq);
        }
        if prompt_tokens == 0 {
            self.stats
                .decode_cycle_us
                .fetch_add(cycle.elapsed().as_micros() as u64, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Exported sequences in this step hear of each layer as its K and V are in place:
    /// (index, channel, first position computed now, position after the last).
    fn exports(&self, plan: &Plan) -> Vec<Export> {
        plan.run
            .iter()
            .filter_map(|&(i, n)| {
                let e = &self.sched.running[i];
                let tx = e.io.export.as_ref()?;
                let at = e.seq.num_computed;
                Some((i, tx.clone(), at, at + n))
            })
            .collect()
    }

    /// The batch through the backend: the indices of the sequences that sampled, their
    /// tokens and their generators after the draws, with what the step's end counts.
    fn forward(
        &mut self,
        plan: Plan,
        exports: Vec<Export>,
        (cycle, started): (Instant, Instant),
    ) -> Result<Stepped> {
        let sampling: Vec<usize> = plan
            .run
            .iter()
            .filter(|&&(i, n)| {
                let s = &self.sched.running[i].seq;
                s.num_computed + n == s.tokens.len()
            })
            .map(|&(i, _)| i)
            .collect();
        // Grammars' matchers leave their sequences for the step: their masks are computed
        // on other threads while the batch runs.
        let mut guided: Vec<Option<Box<Guided>>> = sampling
            .iter()
            .map(|&i| self.sched.running[i].io.guided.take())
            .collect();
        let slots: Arc<Vec<MaskSlot>> =
            Arc::new(sampling.iter().map(|_| MaskSlot::new()).collect());
        let running = &self.sched.running;
        let batch = ForwardBatch {
            seqs: plan
                .run
                .iter()
                .map(|&(i, n)| {
                    let s = &running[i].seq;
                    SeqInput {
                        tokens: &s.tokens[s.num_computed..s.num_computed + n],
                        start_pos: s.num_computed,
                        context_len: s.tokens.len(),
                        block_table: &s.blocks,
                        want_logits: s.num_computed + n == s.tokens.len(),
                        state_slot: s.state_slot,
                    }
                })
                .collect(),
        };
        // A backend with host KV says as each layer lands; a staging one is copied out after
        // the step.
        // A deferred step's layers are reported at its end, when its time is up.
        let streaming = !exports.is_empty() && self.pool.is_some() && !self.deferred;
        // Split borrows: the batch borrows token slices; sampling state is taken out meanwhile.
        let mut rngs: Vec<Rng> = sampling
            .iter()
            .map(|&i| running[i].io.rng.clone())
            .collect();
        let params: Vec<SamplingParams> = sampling
            .iter()
            .map(|&i| running[i].io.params.clone())
            .collect();
        let mut specs: Vec<SampleSpec> = params
            .iter()
            .zip(rngs.iter_mut())
            .zip(guided.iter().zip(slots.iter()))
            .map(|((params, rng), (g, slot))| SampleSpec {
                params,
                rng,
                mask: g.as_ref().map(|_| slot),
            })
            .collect();
        let ready = |layer: usize| {
            for (_, tx, _, upto) in &exports {
                let _ = tx.send(ExportEvent::Layer { layer, upto: *upto });
            }
        };
        let words = mask_words(self.vocab_size);
        let inline = self.backend.occupies_host_cores();
        let pending = guided.iter().any(Option::is_some).then(|| {
            self.masks
                .start(std::mem::take(&mut guided), slots.clone(), words, inline)
        });
        let f0 = Instant::now();
        let out = if streaming {
            self.backend
                .forward_sample_streaming(&batch, &mut specs, &ready)
        } else {
            self.backend.forward_sample(&batch, &mut specs)
        };
        let forward_us = f0.elapsed().as_micros() as u64;
        drop(specs);
        if let Some(p) = pending {
            guided = p.wait();
        }
        let prompt_tokens: usize = batch.num_tokens() - sampling.len();
        // Sequences past their prompt: each computes one generated token.
        let decode_seqs = plan
            .run
            .iter()
            .filter(|&&(i, _)| running[i].seq.num_computed >= running[i].seq.prompt_len)
            .count();
        drop(batch);
        for (&i, g) in sampling.iter().zip(guided) {
            if g.is_some() {
                self.sched.running[i].io.guided = g;
            }
        }
        Ok(Stepped {
            sampled: out?,
            plan,
            exports,
            streamed: streaming,
            started,
            cycle,
            forward_us,
            sampling,
            rngs,
            prompt_tokens,
            decode_seqs,
        })
    }

    /// A step's time and tokens, in the counters routers and `/metrics` read.
    fn count_step(
        &self,
        started: Instant,
        prompt_tokens: usize,
        sampled: usize,
        decode_seqs: usize,
    ) {
        let took_us = started.elapsed().as_micros() as u64;
        let st = &self.stats;
        st.steps.fetch_add(1, Ordering::Relaxed);
        st.busy_us.fetch_add(took_us, Ordering::Relaxed);
        if prompt_tokens == 0 {
            st.decode_steps.fetch_add(1, Ordering::Relaxed);
            st.decode_busy_us.fetch_add(took_us, Ordering::Relaxed);
            st.step_fit.lock().add(sampled, took_us as f64 / 1e6);
        } else {
            let fit = st.step_fit.lock().model();
            st.prefill_busy_us.fetch_add(
                prefill_part_us(took_us, decode_seqs, fit),
                Ordering::Relaxed,
            );
        }
        st.prompt_tokens
            .fetch_add(prompt_tokens as u64, Ordering::Relaxed);
        tracing::trace!(tokens = prompt_tokens + sampled, elapsed = ?started.elapsed(), "step");
    }

    /// After a step on a backend without host KV: copies what each exported sequence
    /// computed into its staging pool, then reports every layer.
    fn stage_out(&mut self, exports: &[Export]) -> Result<()> {
        let layers = self.backend.kv_spec().map_or(0, |k| k.num_layers);
        for (i, tx, from, upto) in exports {
            let e = &self.sched.running[*i];
            if let Some(stage) = &e.io.stage {
                let local = mirror(e.seq.blocks.len());
                self.backend
                    .kv_to_host(&e.seq.blocks, *from..*upto, stage, &local)?;
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
    e: &mut Seq,
    sampled: Sampled,
) -> bool {
    let (s, p) = (&mut e.seq, &e.io.params);
    let tok = sampled.token;
    // The grammar reads the token first: one it did not allow (its matcher failed) is never
    // sent.
    let guided = match &mut e.io.guided {
        Some(g) => match g.consume(tok) {
            Ok(()) => g.is_stopped(),
            Err(m) => {
                let _ = e.io.events.send(SeqEvent::Failed(format!(
                    "{}{m}",
                    crate::guided::GRAMMAR_FAILED
                )));
                return true;
            }
        },
        None => false,
    };
    s.tokens.push(tok);
    stats.generation_tokens.fetch_add(1, Ordering::Relaxed);
    let finish =
        if (!p.ignore_eos && eos_ids.contains(&tok)) || p.stop_token_ids.contains(&tok) || guided {
            Some(FinishReason::Stop)
        } else if s.generated() >= p.max_tokens || s.tokens.len() >= cfg.max_model_len {
            Some(FinishReason::Length)
        } else {
            None
        };
    let sent = e.io.events.send(SeqEvent::Token {
        sampled,
        finish,
        cached_tokens: s.cached_tokens,
    });
    finish.is_some() || sent.is_err()
}
