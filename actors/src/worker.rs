//! The worker roles' data path. A node's QUIC endpoint accepts routers' and decode workers'
//! connections ([`Serving`]); each request stream goes to the role that takes it: a
//! generate request to the node's worker or decode role, a prefill request to its prefill
//! role. Load reports go out on every connection.
//!
//! Per-token traffic goes engine channel → QUIC stream directly; the role actors only decide
//! which roles are serving (see `supervisor.rs`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvmesh_gpu::engine::{EngineHandle, FinishReason, Progress, Request, SeqEvent};
use kvmesh_gpu::error::EngineError;
use kvmesh_gpu::kv_cache::KvEvent;
use kvmesh_gpu::sampler::SamplingParams;
use kvmesh_telemetry::phases::Phases;
use kvmesh_telemetry::TARGET;
use kvmesh_transport::wire::{
    self, Finish, GenerateRequest, KvEventBatch, LoadReport, PrefillLoad, StreamRequest,
    TokenEvent, TopLogprob, UniHeader,
};
use kvmesh_transport::{peer_fingerprint, Connection, NodeEndpoint, RecvStream, SendStream};
use parking_lot::{Mutex, RwLock};
use tracing::{field::Empty, Instrument};

use crate::disagg::{self, KvSide};

/// How often a worker pushes its load to each connected router.
pub const LOAD_REPORT_INTERVAL: Duration = Duration::from_millis(200);

/// What a worker core does with its engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CoreRole {
    /// Prefills and decodes its own requests (aggregated).
    Worker,
    /// Computes prompts for decode workers and sends them the KV.
    Prefill,
    /// Decodes; takes prompts' KV from prefill workers when the router says so.
    Decode,
}

impl CoreRole {
    pub fn as_str(self) -> &'static str {
        match self {
            CoreRole::Worker => "worker",
            CoreRole::Prefill => "prefill",
            CoreRole::Decode => "decode",
        }
    }
}

pub struct WorkerCore {
    pub node_id: String,
    pub role: CoreRole,
    pub engine: EngineHandle,
    /// Declared capacity (tokens/s) until a measurement replaces it.
    pub declared_capacity: f64,
    meter: Mutex<Meter>,
    pub requests_served: AtomicU64,
    /// Prefill and decode roles: KV transfer settings, peers and counters.
    pub kv: Option<Arc<KvSide>>,
}

/// Generation rate over report intervals. Capacity is the rate one running sequence gets:
/// steps per second of the steps that computed no prompt (smoothed; all steps until there
/// has been a decode-only one), so the prompts a node happens to be computing do not make
/// it look slow to a router that also counts them as queued work. It falls as a node fills,
/// so a router weighting by it settles where each node's sequences progress equally fast,
/// which gives a node three times faster about three times the work. The prefill rate is
/// prompt tokens per second of the steps that computed prompts.
struct Meter {
    last_tokens: u64,
    last_steps: u64,
    last_busy_us: u64,
    last_decode_steps: u64,
    last_decode_busy_us: u64,
    last_prefill_busy_us: u64,
    last_prompt: u64,
    last_at: Instant,
    rate: f64,
    per_seq: f64,
    prefill_rate: f64,
}

fn smooth(old: f64, sample: f64) -> f64 {
    if old == 0.0 {
        sample
    } else {
        0.7 * old + 0.3 * sample
    }
}

impl WorkerCore {
    pub fn new(
        node_id: String,
        role: CoreRole,
        engine: EngineHandle,
        declared_capacity: f64,
        kv: Option<Arc<KvSide>>,
    ) -> Arc<WorkerCore> {
        let s = &engine.stats;
        let meter = Meter {
            last_tokens: s.generation_tokens.load(Ordering::Relaxed),
            last_steps: s.steps.load(Ordering::Relaxed),
            last_busy_us: s.busy_us.load(Ordering::Relaxed),
            last_decode_steps: s.decode_steps.load(Ordering::Relaxed),
            last_decode_busy_us: s.decode_busy_us.load(Ordering::Relaxed),
            last_prefill_busy_us: s.prefill_busy_us.load(Ordering::Relaxed),
            last_prompt: s.prompt_tokens.load(Ordering::Relaxed),
            last_at: Instant::now(),
            rate: 0.0,
            per_seq: 0.0,
            prefill_rate: 0.0,
        };
        Arc::new(WorkerCore {
            node_id,
            role,
            engine,
            declared_capacity,
            meter: Mutex::new(meter),
            requests_served: AtomicU64::new(0),
            kv,
        })
    }

    /// The current load. Rates are recomputed at most every half report interval, so many
    /// router connections asking at once share one measurement.
    pub fn load_report(&self) -> LoadReport {
        let s = &self.engine.stats;
        // Sequences waiting for their KV to arrive hold blocks and will decode here.
        let running =
            (s.running.load(Ordering::Relaxed) + s.awaiting_kv.load(Ordering::Relaxed)) as u32;
        let waiting = s.waiting.load(Ordering::Relaxed) as u32;
        let total = self.engine.info.num_blocks as u32;
        let free = s.free_blocks.load(Ordering::Relaxed) as u32;
        let mut m = self.meter.lock();
        let now = Instant::now();
        let dt = (now - m.last_at).as_secs_f64();
        if dt >= LOAD_REPORT_INTERVAL.as_secs_f64() / 2.0 {
            let tokens = s.generation_tokens.load(Ordering::Relaxed);
            m.rate = (tokens - m.last_tokens) as f64 / dt;
            let steps = s.steps.load(Ordering::Relaxed);
            let busy_us = s.busy_us.load(Ordering::Relaxed);
            let prompt = s.prompt_tokens.load(Ordering::Relaxed);
            let (d_steps, d_busy) = (steps - m.last_steps, busy_us - m.last_busy_us);
            let d_prompt = prompt - m.last_prompt;
            let decode_steps = s.decode_steps.load(Ordering::Relaxed);
            let decode_busy = s.decode_busy_us.load(Ordering::Relaxed);
            let prefill_busy = s.prefill_busy_us.load(Ordering::Relaxed);
            let (d_dsteps, d_dbusy) = (
                decode_steps - m.last_decode_steps,
                decode_busy - m.last_decode_busy_us,
            );
            let d_pbusy = prefill_busy - m.last_prefill_busy_us;
            m.last_steps = steps;
            m.last_busy_us = busy_us;
            m.last_prompt = prompt;
            m.last_decode_steps = decode_steps;
            m.last_decode_busy_us = decode_busy;
            m.last_prefill_busy_us = prefill_busy;
            // Only busy time says what the node can do; an idle interval says nothing.
            if d_dsteps > 0 && d_dbusy > 0 {
                m.per_seq = smooth(m.per_seq, d_dsteps as f64 / (d_dbusy as f64 / 1e6));
            } else if m.per_seq == 0.0 && d_steps > 0 && d_busy > 0 {
                m.per_seq = d_steps as f64 / (d_busy as f64 / 1e6);
            }
            if d_prompt > 0 && d_pbusy > 0 {
                m.prefill_rate = smooth(m.prefill_rate, d_prompt as f64 / (d_pbusy as f64 / 1e6));
            }
            m.last_tokens = tokens;
            m.last_at = now;
        }
        let kv_usage = if total == 0 {
            0.0
        } else {
            1.0 - free as f32 / total as f32
        };
        // KV blocks in use, in tokens: what the sequences hold.
        let tokens_in_flight =
            (total.saturating_sub(free) as u64) * self.engine.info.config.block_size as u64;
        let step = self
            .engine
            .stats
            .step_fit
            .lock()
            .model()
            .unwrap_or_default();
        LoadReport {
            step_base_ms: (step.base_s * 1e3) as f32,
            step_per_seq_ms: (step.per_seq_s * 1e3) as f32,
            max_running: self.engine.info.config.max_num_seqs.min(u32::MAX as usize) as u32,
            running,
            waiting,
            tokens_in_flight,
            kv_usage,
            total_blocks: total,
            gen_tokens_per_s: m.rate as f32,
            capacity_tokens_per_s: if m.per_seq > 0.0 {
                m.per_seq as f32
            } else {
                self.declared_capacity as f32
            },
            prompt_tokens_per_s: m.prefill_rate as f32,
            prefill: (self.role == CoreRole::Prefill).then(|| PrefillLoad {
                running,
                waiting,
                tokens_in_flight,
                kv_usage,
                tokens_per_s: m.prefill_rate as f32,
            }),
            draining: false,
        }
    }

    /// A router's generate request: runs it through the engine, streaming token events. A
    /// decode role first takes the prompt's KV from the prefill worker the router named.
    pub async fn serve_generate(self: Arc<Self>, send: SendStream, req: GenerateRequest) {
        // Continues the router's attempt span.
        let span = tracing::info_span!(
            target: TARGET,
            "worker",
            otel.kind = "server",
            node = self.node_id.as_str(),
            role = self.role.as_str(),
            prompt_tokens = req.prompt.len(),
            max_tokens = req.max_tokens,
            queued_ms = Empty,
            cached_tokens = Empty,
            generated = Empty,
            finish = Empty,
            otel.status_code = Empty,
            otel.status_message = Empty,
        );
        kvmesh_telemetry::set_remote_parent(&span, req.traceparent.as_deref());
        self.generate(send, req).instrument(span).await
    }

    async fn generate(self: Arc<Self>, mut send: SendStream, req: GenerateRequest) {
        let span = tracing::Span::current();
        let mut router_gone = Box::pin(send.stopped());
        let remote =
            matches!((&req.prefill, &self.kv), (Some(_), Some(_))) && self.role == CoreRole::Decode;
        let sub = match (&req.prefill, &self.kv) {
            (Some(peer), Some(kv)) if self.role == CoreRole::Decode => {
                match disagg::decode(&self, kv, &req, peer, &mut router_gone).await {
                    Ok(Some(sub)) => Ok(sub),
                    Ok(None) => return,
                    Err(e) => Err(e),
                }
            }
            _ => self.engine.submit(to_engine_request(&req)),
        };
        let mut sub = match sub {
            Ok(s) => s,
            Err(e) => {
                let retryable = matches!(e, EngineError::QueueFull { .. });
                span.record("otel.status_code", "ERROR");
                span.record("otel.status_message", e.to_string().as_str());
                let _ = wire::write_msg(
                    &mut send,
                    &TokenEvent::Rejected {
                        message: e.to_string(),
                        retryable,
                        queue_full: retryable,
                    },
                )
                .await;
                let _ = send.finish();
                return;
            }
        };
        self.requests_served.fetch_add(1, Ordering::Relaxed);
        // Queue, prefill (chunk by chunk) and decode as spans, for a sampled request whose
        // prompt is computed here.
        let mut phases = Phases::new(&span, !remote, req.prompt.len());
        let mut out = Vec::new();
        loop {
            let ev = tokio::select! {
                biased;
                Some(p) = sub.progress.recv() => {
                    progressed(&mut phases, p);
                    continue;
                }
                ev = sub.events.recv() => ev,
                // The router stopped reading: its client went away. Dropping `sub` aborts.
                _ = &mut router_gone => {
                    span.record("otel.status_code", "ERROR");
                    span.record("otel.status_message", "the router went away");
                    return;
                }
            };
            // Events already waiting go out with this one in a single write: one wake of the
            // connection's driver and one send, not one per token, when the engine runs
            // ahead of this task.
            out.clear();
            let mut ev = ev;
            let last = loop {
                let (msg, last) = to_wire(&mut phases, &span, ev);
                if last {
                    sub.finished();
                }
                if let Err(e) = wire::frame_into(&msg, &mut out) {
                    tracing::error!("could not encode a token event: {e}");
                    return;
                }
                if last {
                    break true;
                }
                // A step's progress comes before its tokens.
                while let Ok(p) = sub.progress.try_recv() {
                    progressed(&mut phases, p);
                }
                match sub.events.try_recv() {
                    Ok(next) => ev = Some(next),
                    Err(_) => break false,
                }
            };
            if send.write_all(&out).await.is_err() {
                return; // the router is gone; dropping `sub` aborts the sequence
            }
            if last {
                let _ = send.finish();
                return;
            }
        }
    }
}

fn progressed(phases: &mut Phases, p: Progress) {
    match p {
        Progress::Scheduled {
            queued,
            cached_tokens,
        } => phases.scheduled(queued, cached_tokens),
        Progress::Prefilled { tokens, upto, step } => phases.prefilled(tokens, upto, step),
    }
}

/// An engine event as the router is sent it, and whether it is the last; the request's
/// spans record it on the way.
fn to_wire(phases: &mut Phases, span: &tracing::Span, ev: Option<SeqEvent>) -> (TokenEvent, bool) {
    if let Some(SeqEvent::Token {
        sampled,
        finish,
        cached_tokens,
    }) = &ev
    {
        phases.token(sampled.token);
        if let Some(f) = finish {
            span.record("finish", f.as_str());
            span.record("generated", phases.tokens());
            span.record("cached_tokens", *cached_tokens);
        }
    }
    if let Some(SeqEvent::Failed(m)) = &ev {
        span.record("otel.status_code", "ERROR");
        span.record("otel.status_message", m.as_str());
    }
    match ev {
        Some(SeqEvent::Token {
            sampled,
            finish,
            cached_tokens,
        }) => (
            TokenEvent::Token {
                token: sampled.token,
                logprob: sampled.logprob,
                top: sampled
                    .top
                    .iter()
                    .map(|&(token, logprob)| TopLogprob { token, logprob })
                    .collect(),
                finish: finish.map(|f| match f {
                    FinishReason::Stop => Finish::Stop,
                    FinishReason::Length => Finish::Length,
                }),
                cached_tokens: cached_tokens as u32,
            },
            finish.is_some(),
        ),
        Some(SeqEvent::Failed(m)) | Some(SeqEvent::Unavailable { message: m, .. }) => {
            (TokenEvent::Failed { message: m }, true)
        }
        None => (
            TokenEvent::Failed {
                message: "the worker's engine stopped".into(),
            },
            true,
        ),
    }
}

pub(crate) fn to_engine_request(r: &GenerateRequest) -> Request {
    Request {
        prompt: r.prompt.clone(),
        params: SamplingParams {
            temperature: r.temperature,
            top_k: r.top_k as usize,
            top_p: r.top_p,
            seed: r.seed,
            max_tokens: r.max_tokens as usize,
            stop_token_ids: r.stop_token_ids.clone(),
            ignore_eos: r.ignore_eos,
            logprobs: r.logprobs.map(|n| n as usize),
            resume_draws: r.resume_draws,
        },
    }
}

/// A node's QUIC endpoint and the roles serving on it: requests are handed to whichever
/// role takes them, while its actor has it registered.
pub struct Serving {
    pub endpoint: NodeEndpoint,
    /// The worker or decode role: takes generate requests.
    generate: RwLock<Option<Arc<WorkerCore>>>,
    /// The prefill role: takes prefill requests.
    prefill: RwLock<Option<Arc<WorkerCore>>>,
    /// Set once the node starts shutting down: new requests are refused (retryable) and
    /// every router connection is sent a report saying so at once.
    draining: tokio::sync::watch::Sender<bool>,
    /// Generate and prefill streams being served.
    in_flight: AtomicU64,
}

/// Counts a stream being served for as long as it lives.
struct InFlight<'a>(&'a AtomicU64);

impl<'a> InFlight<'a> {
    fn enter(n: &'a AtomicU64) -> InFlight<'a> {
        n.fetch_add(1, Ordering::SeqCst);
        InFlight(n)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Serving {
    pub fn new(endpoint: NodeEndpoint) -> Arc<Serving> {
        Arc::new(Serving {
            endpoint,
            generate: RwLock::new(None),
            prefill: RwLock::new(None),
            draining: tokio::sync::watch::channel(false).0,
            in_flight: AtomicU64::new(0),
        })
    }

    /// Starts the shutdown: refuse new requests, tell every router now.
    pub fn start_draining(&self) {
        self.draining.send_replace(true);
    }

    pub fn draining(&self) -> bool {
        *self.draining.borrow()
    }

    /// Generate and prefill requests being served now.
    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::SeqCst)
    }

    /// Waits until no request is being served, or `deadline`; says whether it got there.
    pub async fn wait_idle(&self, deadline: tokio::time::Instant) -> bool {
        loop {
            if self.in_flight() == 0 {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Puts a role's core in service (`Some`) or out of it (`None`).
    pub fn set(&self, role: CoreRole, core: Option<Arc<WorkerCore>>) {
        match role {
            CoreRole::Prefill => *self.prefill.write() = core,
            CoreRole::Worker | CoreRole::Decode => *self.generate.write() = core,
        }
    }

    /// The node's load, as routers see it: the generating role's, with the prefill role's
    /// beside it.
    pub fn load_report(&self) -> Option<LoadReport> {
        let gen = self.generate.read().clone();
        let pre = self.prefill.read().clone();
        let mut report = match (gen, pre) {
            (Some(g), Some(p)) => {
                let mut r = g.load_report();
                r.prefill = p.load_report().prefill;
                r
            }
            (Some(c), None) | (None, Some(c)) => c.load_report(),
            (None, None) => return None,
        };
        report.draining = self.draining();
        Some(report)
    }

    /// Accepts connections until the endpoint closes.
    pub async fn accept_loop(self: Arc<Self>) {
        while let Some(incoming) = self.endpoint.accept().await {
            let serving = self.clone();
            tokio::spawn(async move {
                match incoming.await {
                    Ok(conn) => serving.serve_connection(conn).await,
                    // Outsiders (unknown certificates) end here.
                    Err(e) => tracing::warn!("refused a QUIC connection: {e}"),
                }
            });
        }
    }

    async fn serve_connection(self: Arc<Self>, conn: Connection) {
        let peer = peer_fingerprint(&conn).unwrap_or_default();
        tracing::info!(
            "peer {} connected from {}",
            &peer[..peer.len().min(12)],
            conn.remote_address()
        );
        let reporter = tokio::spawn(report_load(self.clone(), conn.clone()));
        let kv_reporter = tokio::spawn(report_kv_events(self.clone(), conn.clone()));
        loop {
            match conn.accept_bi().await {
                Ok((send, recv)) => {
                    let serving = self.clone();
                    let conn = conn.clone();
                    tokio::spawn(async move { serving.serve_stream(conn, send, recv).await });
                }
                Err(e) => {
                    tracing::info!("connection from {} ended: {e}", conn.remote_address());
                    break;
                }
            }
        }
        reporter.abort();
        kv_reporter.abort();
    }

    async fn serve_stream(&self, conn: Connection, mut send: SendStream, mut recv: RecvStream) {
        let reject = |message: String, retryable: bool| TokenEvent::Rejected {
            message,
            retryable,
            queue_full: false,
        };
        let msg = match wire::read_msg::<StreamRequest>(&mut recv).await {
            Ok(Some(m)) => m,
            Ok(None) => return,
            Err(e) => {
                let _ = wire::write_msg(
                    &mut send,
                    &reject(format!("unreadable request: {e}"), false),
                )
                .await;
                return;
            }
        };
        let _counted = InFlight::enter(&self.in_flight);
        if self.draining() {
            let why = "this node is shutting down";
            let _ = match msg {
                StreamRequest::Generate(_) => {
                    wire::write_msg(&mut send, &reject(why.into(), true)).await
                }
                StreamRequest::Prefill(_) => {
                    wire::write_msg(
                        &mut send,
                        &kvmesh_transport::kv::PrefillEvent::Failed {
                            message: why.into(),
                            retryable: true,
                        },
                    )
                    .await
                }
            };
            let _ = send.finish();
            return;
        }
        match msg {
            StreamRequest::Generate(req) => {
                let core = self.generate.read().clone();
                match core {
                    Some(c) => c.serve_generate(send, req).await,
                    None => {
                        let why = if self.prefill.read().is_some() {
                            "this node only prefills"
                        } else {
                            "this node's worker role is restarting"
                        };
                        let _ = wire::write_msg(&mut send, &reject(why.into(), true)).await;
                        let _ = send.finish();
                    }
                }
            }
            StreamRequest::Prefill(req) => {
                let core = self.prefill.read().clone();
                match core {
                    Some(c) => c.serve_prefill(conn, send, req).await,
                    None => {
                        let _ = wire::write_msg(
                            &mut send,
                            &kvmesh_transport::kv::PrefillEvent::Failed {
                                message: "this node has no prefill role".into(),
                                retryable: false,
                            },
                        )
                        .await;
                        let _ = send.finish();
                    }
                }
            }
        }
    }
}

/// Pushes the generating engine's prefix-cache stores and evictions on one connection
/// until it ends: a snapshot, then each batch as it comes (those that queued while the
/// last was written go as one). A node without a generating role sends none.
async fn report_kv_events(serving: Arc<Serving>, conn: Connection) {
    let hub = loop {
        if let Some(c) = serving.generate.read().as_ref() {
            break c.engine.kv_events.clone();
        }
        if serving.prefill.read().is_some() {
            return;
        }
        // The role is starting or restarting.
        tokio::time::sleep(LOAD_REPORT_INTERVAL).await;
    };
    let Ok(mut send) = conn.open_uni().await else {
        return;
    };
    if wire::write_msg(&mut send, &UniHeader::KvEvents)
        .await
        .is_err()
    {
        return;
    }
    loop {
        let (held, mut rx) = hub.subscribe();
        let snapshot = KvEventBatch {
            snapshot: true,
            stored: held,
            removed: Vec::new(),
        };
        if wire::write_msg(&mut send, &snapshot).await.is_err() {
            return;
        }
        // Ends when the hub dropped this subscriber for falling behind: resubscribe.
        while let Some(first) = rx.recv().await {
            let mut latest: std::collections::HashMap<u64, bool> = Default::default();
            let mut add = |batch: &[KvEvent]| {
                for e in batch {
                    match *e {
                        KvEvent::Stored(h) => latest.insert(h.0, true),
                        KvEvent::Removed(h) => latest.insert(h.0, false),
                    };
                }
            };
            add(&first);
            while let Ok(more) = rx.try_recv() {
                add(&more);
            }
            let mut batch = KvEventBatch::default();
            for (h, stored) in latest {
                if stored {
                    batch.stored.push(h);
                } else {
                    batch.removed.push(h);
                }
            }
            if wire::write_msg(&mut send, &batch).await.is_err() {
                return;
            }
        }
    }
}

/// Pushes load reports on one connection until it ends.
async fn report_load(serving: Arc<Serving>, conn: Connection) {
    let Ok(mut send) = conn.open_uni().await else {
        return;
    };
    if wire::write_msg(&mut send, &UniHeader::Load).await.is_err() {
        return;
    }
    let mut tick = tokio::time::interval(LOAD_REPORT_INTERVAL);
    let mut draining = serving.draining.subscribe();
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            // Draining started: say so now, not at the next tick.
            Ok(()) = draining.changed() => {}
        }
        let Some(report) = serving.load_report() else {
            continue;
        };
        if wire::write_msg(&mut send, &report).await.is_err() {
            return;
        }
    }
}
