//! Disaggregated prefill and decode, on the workers' side.
//!
//! The router sends a request to a decode worker naming a prefill worker (see `router.rs`).
//! The decode worker asks its engine for a remote prefill: the engine either prefills itself
//! (enough of the prompt is in its prefix cache) or reserves the prompt's blocks and lends
//! them. With a lease in hand the decode worker asks the prefill worker to compute the prompt
//! into those blocks ([`pull`]); the prefill worker runs it and pushes each layer's K and V
//! as soon as it is computed ([`WorkerCore::export`]). When every layer has landed and the
//! first token has come, the lease is given back as landed and the sequence decodes. If the
//! prefill worker refuses, dies, or goes quiet for longer than the transfer timeout, the
//! lease is given back without landing and the engine prefills the prompt itself: the
//! request completes either way.
//!
//! The bytes travel over QUIC streams, TCP connections, or, when both roles are in this
//! process, by a copy from one pool into the other (`kvmesh_transport::kv`).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvmesh_gpu::engine::{ExportEvent, KvLease, Landed, SeqEvent, Submission};
use kvmesh_gpu::error::EngineError;
use kvmesh_gpu::kv_pool::KvKind;
use kvmesh_gpu::sampler::Sampled;
use kvmesh_telemetry::TARGET;
use kvmesh_transport::kv::local::{self, LocalSender, LocalTarget};
use kvmesh_transport::kv::streams::{KvInbox, StreamReceiver, StreamSender, Target};
use kvmesh_transport::kv::{
    random_u64, DataPath, HostRegion, KvLayout, KvReceiver, KvSender, Landing, PrefillEvent,
    PrefillRequest, TransferTotals,
};
use kvmesh_transport::wire::{
    self, GenerateRequest, PrefillPeer, StreamRequest, TopLogprob, UniHeader,
};
use kvmesh_transport::{Connection, NodeEndpoint};
use parking_lot::RwLock;
use tokio::sync::mpsc;
use tracing::{field::Empty, Instrument};

use crate::worker::{to_engine_request, WorkerCore};

/// How a decode worker wants its KV delivered.
#[derive(Clone, Debug)]
pub enum KvTransport {
    /// Unidirectional QUIC streams on the connection to the prefill worker.
    Quic { streams: usize },
    /// TCP connections from the prefill worker to this listener.
    Tcp {
        addr: SocketAddr,
        connections: usize,
    },
}

impl KvTransport {
    pub fn name(&self) -> &'static str {
        match self {
            KvTransport::Quic { .. } => "quic",
            KvTransport::Tcp { .. } => "tcp",
        }
    }
}

/// Counters for `/metrics`.
#[derive(Default)]
pub struct KvStats {
    /// Decode side: prompts whose KV came from a prefill worker.
    pub remote: AtomicU64,
    /// Decode side: enough of the prompt was cached here, so it was prefilled here.
    pub cached_locally: AtomicU64,
    /// Decode side: the transfer failed and the prompt was prefilled here instead.
    pub fallback: AtomicU64,
    pub bytes_in: AtomicU64,
    /// Decode side: microseconds from lease to landing, summed over remote prefills.
    pub transfer_us: AtomicU64,
    /// Prefill side: transfers sent in full.
    pub served: AtomicU64,
    /// Prefill side: requests refused (another layout, a full queue) or abandoned.
    pub failed: AtomicU64,
    pub bytes_out: AtomicU64,
}

/// What the prefill and decode roles need for KV transfers.
pub struct KvSide {
    pub layout: KvLayout,
    pub transport: KvTransport,
    /// A transfer that makes no progress for this long is given up.
    pub timeout: Duration,
    /// Where this decode worker's incoming KV streams find their transfer.
    pub inbox: KvInbox,
    pub peers: PeerLinks,
    /// This node's own prefill role, when it has one (in-process transfers).
    pub local_prefill: RwLock<Option<Arc<WorkerCore>>>,
    /// The decode role's KV listener, with the TCP transport.
    pub tcp_listener: Option<Arc<tokio::net::TcpListener>>,
    pub stats: KvStats,
}

impl KvSide {
    pub fn new(
        layout: KvLayout,
        transport: KvTransport,
        timeout: Duration,
        endpoint: NodeEndpoint,
        tcp_listener: Option<Arc<tokio::net::TcpListener>>,
    ) -> Arc<KvSide> {
        let inbox = KvInbox::default();
        Arc::new(KvSide {
            layout,
            transport,
            timeout,
            peers: PeerLinks::new(endpoint, inbox.clone()),
            inbox,
            local_prefill: RwLock::new(None),
            tcp_listener,
            stats: KvStats::default(),
        })
    }

    /// Prometheus lines.
    pub fn render_metrics(&self, out: &mut String) {
        use std::fmt::Write;
        let s = &self.stats;
        let _ = writeln!(
            out,
            "# HELP kvmesh:disagg_prefills_total Prompts of disaggregated requests on this decode worker, by where they were prefilled.\n\
             # TYPE kvmesh:disagg_prefills_total counter"
        );
        for (outcome, v) in [
            ("remote", &s.remote),
            ("cached_locally", &s.cached_locally),
            ("fallback", &s.fallback),
        ] {
            let _ = writeln!(
                out,
                "kvmesh:disagg_prefills_total{{outcome=\"{outcome}\"}} {}",
                v.load(Ordering::Relaxed)
            );
        }
        let _ = writeln!(
            out,
            "# HELP kvmesh:kv_transfer_bytes_total KV bytes moved between workers.\n\
             # TYPE kvmesh:kv_transfer_bytes_total counter\n\
             kvmesh:kv_transfer_bytes_total{{direction=\"in\"}} {}\n\
             kvmesh:kv_transfer_bytes_total{{direction=\"out\"}} {}",
            s.bytes_in.load(Ordering::Relaxed),
            s.bytes_out.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP kvmesh:kv_transfer_seconds_total Time from reserving blocks to the KV landing, over remote prefills.\n\
             # TYPE kvmesh:kv_transfer_seconds_total counter\n\
             kvmesh:kv_transfer_seconds_total {:.6}",
            s.transfer_us.load(Ordering::Relaxed) as f64 / 1e6
        );
        let _ = writeln!(
            out,
            "# HELP kvmesh:prefill_transfers_total Transfers this prefill worker took, by outcome.\n\
             # TYPE kvmesh:prefill_transfers_total counter\n\
             kvmesh:prefill_transfers_total{{outcome=\"sent\"}} {}\n\
             kvmesh:prefill_transfers_total{{outcome=\"failed\"}} {}",
            s.served.load(Ordering::Relaxed),
            s.failed.load(Ordering::Relaxed)
        );
    }
}

/// A lease's blocks as a transfer addresses them, over `positions`.
fn region(lease: &KvLease, positions: Range<usize>) -> HostRegion {
    let pool = lease.pool();
    let spec = pool.spec();
    let layers = spec.num_layers;
    let k = (0..layers).map(|l| pool.base(l, KvKind::K)).collect();
    let v = (0..layers).map(|l| pool.base(l, KvKind::V)).collect();
    let blocks = lease.blocks().iter().map(|b| b.0).collect();
    // SAFETY: the pool's buffers are `[num_blocks, block_size, kv_dim]` per layer and live as
    // long as the pool, which the lease (the keepalive) holds; the engine allocated every
    // block of the table from this pool; and while a lease clone lives, the positions a
    // transfer moves are its own (read-only computed ones on the prefill side, reserved
    // ones on the decode side): the engine keeps the blocks and does not touch them.
    unsafe {
        HostRegion::new(
            k,
            v,
            pool.layer_bytes(),
            spec.bytes_per_pos(),
            spec.block_size,
            blocks,
            positions,
            Arc::new(lease.clone()),
        )
    }
}

/// Aborts a task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Decode side of a disaggregated request. Returns the submission whose events are the
/// request's tokens (its prompt prefilled remotely or here), or `None` if the router went
/// away meanwhile (`router_gone` resolved).
pub async fn decode(
    core: &Arc<WorkerCore>,
    kv: &Arc<KvSide>,
    req: &GenerateRequest,
    peer: &PrefillPeer,
    router_gone: &mut (impl std::future::Future + Unpin),
) -> Result<Option<Submission>, EngineError> {
    let (sub, lease) = core
        .engine
        .submit_remote_prefill(to_engine_request(req), peer.min_tokens as usize)?;
    let queue = tracing::info_span!(target: TARGET, "queue", reserved = true);
    let lease = tokio::select! {
        l = lease => match l {
            Ok(l) => l,
            // The engine found enough of the prompt cached here and prefills it.
            Err(_) => {
                queue.record("reserved", false);
                kv.stats.cached_locally.fetch_add(1, Ordering::Relaxed);
                return Ok(Some(sub));
            }
        },
        _ = &mut *router_gone => return Ok(None),
    };
    drop(queue);
    let span = tracing::info_span!(
        target: TARGET,
        "kv.pull",
        prefill_worker = peer.node_id.as_str(),
        transport = kv.transport.name(),
        from_pos = lease.from_pos(),
        tokens = lease.prompt_len() - lease.from_pos(),
        bytes = Empty,
        ms = Empty,
        outcome = Empty,
        otel.status_code = Empty,
        otel.status_message = Empty,
    );
    let started = Instant::now();
    let outcome = tokio::select! {
        r = pull(core, kv, req, peer, &lease).instrument(span.clone()) => r,
        _ = &mut *router_gone => return Ok(None),
    };
    let secs = started.elapsed().as_secs_f64();
    span.record("ms", secs * 1e3);
    match outcome {
        Ok((landed, totals)) => {
            kv.stats.remote.fetch_add(1, Ordering::Relaxed);
            kv.stats.bytes_in.fetch_add(totals.bytes, Ordering::Relaxed);
            kv.stats
                .transfer_us
                .fetch_add((secs * 1e6) as u64, Ordering::Relaxed);
            span.record("outcome", "remote");
            span.record("bytes", totals.bytes);
            lease.landed(landed);
        }
        Err(e) => {
            kv.stats.fallback.fetch_add(1, Ordering::Relaxed);
            span.record("outcome", "fallback");
            span.record("otel.status_code", "ERROR");
            span.record("otel.status_message", e.as_str());
            tracing::warn!(
                "prefill on {} failed ({e}); prefilling {} tokens here",
                peer.node_id,
                lease.prompt_len() - lease.from_pos()
            );
            // The engine prefills locally once every holder of the lease is gone.
            drop(lease);
        }
    }
    Ok(Some(sub))
}

/// Fetches the prompt's KV into the lease's blocks: the first token and what was moved.
async fn pull(
    core: &Arc<WorkerCore>,
    kv: &Arc<KvSide>,
    req: &GenerateRequest,
    peer: &PrefillPeer,
    lease: &KvLease,
) -> Result<(Landed, TransferTotals), String> {
    let (from, to) = (lease.from_pos(), lease.prompt_len());
    let transfer_id = random_u64();
    let secret = random_u64();
    let landing = Arc::new(Landing::new(region(lease, from..to), transfer_id));
    let mut preq = PrefillRequest {
        transfer_id,
        secret,
        decode_node: core.node_id.clone(),
        // The prefill worker's spans continue this transfer's.
        request: GenerateRequest {
            prefill: None,
            traceparent: kvmesh_telemetry::traceparent(&tracing::Span::current()),
            ..req.clone()
        },
        from_pos: from as u32,
        dest_blocks: lease.blocks().iter().map(|b| b.0).collect(),
        layout: kv.layout.clone(),
        data: DataPath::Quic { streams: 1 },
    };
    // Keeps the other side's work (a task or a stream) alive until this function returns.
    let _guard: AbortOnDrop;
    let _entry;
    let local_prefill = kv
        .local_prefill
        .read()
        .clone()
        .filter(|_| peer.node_id == core.node_id);
    let (mut events, mut receiver): (mpsc::UnboundedReceiver<PrefillEvent>, Box<dyn KvReceiver>) =
        match local_prefill {
            Some(p) => {
                let (target, recv) = local::channel(landing.clone());
                let (etx, erx) = mpsc::unbounded_channel();
                _guard = AbortOnDrop(tokio::spawn(async move {
                    p.run_export(preq, SendVia::Local(target), etx).await;
                }));
                _entry = None;
                (erx, Box::new(recv))
            }
            None => {
                let conn = kv.peers.get(peer).await?;
                let (entry, incoming) = kv.inbox.register(transfer_id, secret);
                _entry = Some(entry);
                let streams = match &kv.transport {
                    KvTransport::Quic { streams } => {
                        preq.data = DataPath::Quic {
                            streams: *streams as u32,
                        };
                        *streams
                    }
                    KvTransport::Tcp { addr, connections } => {
                        preq.data = DataPath::Tcp {
                            addr: addr.to_string(),
                            connections: *connections as u32,
                        };
                        *connections
                    }
                };
                let (mut s, mut r) = conn
                    .open_bi()
                    .await
                    .map_err(|e| format!("opening a stream to {}: {e}", peer.node_id))?;
                wire::write_msg(&mut s, &StreamRequest::Prefill(preq))
                    .await
                    .map_err(|e| format!("sending the prefill request: {e}"))?;
                let _ = s.finish();
                let (etx, erx) = mpsc::unbounded_channel();
                _guard = AbortOnDrop(tokio::spawn(async move {
                    loop {
                        let ev = match wire::read_msg::<PrefillEvent>(&mut r).await {
                            Ok(Some(ev)) => ev,
                            Ok(None) => return,
                            Err(e) => PrefillEvent::Failed {
                                message: e.to_string(),
                                retryable: true,
                            },
                        };
                        let last = matches!(ev, PrefillEvent::Failed { .. });
                        if etx.send(ev).is_err() || last {
                            return;
                        }
                    }
                    // Dropping `r` unread tells the prefill worker to stop.
                }));
                (
                    erx,
                    Box::new(StreamReceiver::new(landing.clone(), incoming, streams)),
                )
            }
        };

    let mut done: Option<Landed> = None;
    let mut landed: Option<TransferTotals> = None;
    let mut last_bytes = 0;
    let mut last_progress = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    let complete = receiver.complete();
    tokio::pin!(complete);
    loop {
        if let (Some(_), Some(t)) = (&done, landed) {
            return Ok((done.take().expect("checked"), t));
        }
        tokio::select! {
            ev = events.recv() => {
                last_progress = Instant::now();
                match ev {
                    Some(PrefillEvent::Started { .. }) => {}
                    Some(PrefillEvent::Done { token, logprob, top, rng, cached, .. }) => {
                        done = Some(Landed {
                            first: Sampled {
                                token,
                                logprob,
                                top: top.into_iter().map(|t| (t.token, t.logprob)).collect(),
                            },
                            rng,
                            cached_tokens: (cached as usize).max(from),
                        });
                    }
                    Some(PrefillEvent::Failed { message, .. }) => return Err(message),
                    None if done.is_some() => {}
                    None => return Err("the prefill worker closed the request".into()),
                }
            }
            r = &mut complete, if landed.is_none() => {
                landed = Some(r.map_err(|e| format!("receiving KV: {e}"))?);
            }
            _ = tick.tick() => {
                let b = landing.landed_bytes();
                if b != last_bytes {
                    last_bytes = b;
                    last_progress = Instant::now();
                } else if last_progress.elapsed() > kv.timeout {
                    return Err(format!(
                        "no progress for {:.1} s ({} of {} bytes landed)",
                        kv.timeout.as_secs_f64(),
                        b,
                        2 * (to - from) * kv.layout.bytes_per_pos() * kv.layout.num_layers as usize
                    ));
                }
            }
        }
    }
}

/// Where a prefill worker sends a transfer's bytes.
pub enum SendVia {
    /// Streams on the decode worker's connection, or TCP to its listener (`DataPath`).
    Network(Connection),
    /// The decode role in this same process.
    Local(LocalTarget),
}

impl WorkerCore {
    /// Prefill side: computes `req`'s prompt, sends its KV, and reports on `events`; stops
    /// (freeing everything) as soon as `events` is closed.
    pub async fn run_export(
        &self,
        req: PrefillRequest,
        via: SendVia,
        events: mpsc::UnboundedSender<PrefillEvent>,
    ) {
        let span = tracing::info_span!(
            target: TARGET,
            "prefill.remote",
            otel.kind = "server",
            node = self.node_id.as_str(),
            decode_worker = req.decode_node.as_str(),
            via = match (&via, &req.data) {
                (SendVia::Local(_), _) => "in-process",
                (_, DataPath::Quic { .. }) => "quic",
                (_, DataPath::Tcp { .. }) => "tcp",
            },
            prompt_tokens = req.request.prompt.len(),
            from_pos = req.from_pos,
            cached_tokens = Empty,
            bytes = Empty,
            ms = Empty,
            otel.status_code = Empty,
            otel.status_message = Empty,
        );
        kvmesh_telemetry::set_remote_parent(&span, req.request.traceparent.as_deref());
        let closed = events.clone();
        let started = Instant::now();
        let r = tokio::select! {
            r = self.export(&req, via, &events).instrument(span.clone()) => r,
            _ = closed.closed() => Err(("the decode worker went away".into(), false)),
        };
        let secs = started.elapsed().as_secs_f64();
        span.record("ms", secs * 1e3);
        match &r {
            Ok(bytes) => {
                span.record("bytes", *bytes);
            }
            Err((m, _)) => {
                span.record("otel.status_code", "ERROR");
                span.record("otel.status_message", m.as_str());
            }
        }
        let kv = self.kv.as_ref().expect("a prefill role has a KV side");
        match r {
            Ok(bytes) => {
                kv.stats.served.fetch_add(1, Ordering::Relaxed);
                kv.stats.bytes_out.fetch_add(bytes, Ordering::Relaxed);
            }
            Err((message, retryable)) => {
                kv.stats.failed.fetch_add(1, Ordering::Relaxed);
                tracing::info!(
                    "prefill for {} (transfer {}) ended: {message}",
                    req.decode_node,
                    req.transfer_id
                );
                let _ = events.send(PrefillEvent::Failed { message, retryable });
            }
        }
    }

    async fn export(
        &self,
        req: &PrefillRequest,
        via: SendVia,
        events: &mpsc::UnboundedSender<PrefillEvent>,
    ) -> Result<u64, (String, bool)> {
        let kv = self
            .kv
            .as_ref()
            .ok_or(("not a prefill worker".to_string(), false))?;
        if let Some(m) = kv.layout.mismatch(
            &format!("prefill worker {}", self.node_id),
            &req.layout,
            &format!("decode worker {}", req.decode_node),
        ) {
            return Err((m, false));
        }
        let mut ereq = to_engine_request(&req.request);
        // Only the first token is drawn here; the decode worker applies every stop rule.
        ereq.params.max_tokens = 1;
        ereq.params.ignore_eos = true;
        ereq.params.stop_token_ids.clear();
        let from = req.from_pos as usize;
        let (mut sub, mut ev) = self.engine.submit_export(ereq, from).map_err(|e| {
            let retryable = matches!(e, EngineError::QueueFull { .. });
            (e.to_string(), retryable)
        })?;
        self.requests_served.fetch_add(1, Ordering::Relaxed);
        let span = tracing::Span::current();
        let queue = tracing::info_span!(target: TARGET, "queue");
        let (lease, computed) = tokio::select! {
            e = ev.recv() => match e {
                Some(ExportEvent::Ready { lease, computed }) => (lease, computed),
                _ => return Err(("the engine dropped the request".into(), true)),
            },
            e = sub.events.recv() => return Err((failure(e), true)),
        };
        drop(queue);
        span.record("cached_tokens", computed);
        let _ = events.send(PrefillEvent::Started {
            cached: computed as u32,
        });
        let to = lease.prompt_len();
        if req.dest_blocks.len() * lease.spec().block_size < to {
            return Err((
                format!(
                    "the decode worker's {} blocks cannot hold {to} tokens",
                    req.dest_blocks.len()
                ),
                false,
            ));
        }
        let target = Target {
            source: Arc::new(region(&lease, from..to)),
            transfer_id: req.transfer_id,
            dest_blocks: req.dest_blocks.clone(),
            span: span.clone(),
        };
        drop(lease);
        let net = |e: kvmesh_transport::TransportError| (format!("sending KV: {e}"), true);
        let mut sender: Box<dyn KvSender> = match (via, &req.data) {
            (SendVia::Local(t), _) => Box::new(LocalSender::new(target.source, t)),
            (SendVia::Network(conn), DataPath::Quic { streams }) => Box::new(
                StreamSender::quic(&conn, target, req.secret, (*streams).clamp(1, 16) as usize)
                    .await
                    .map_err(net)?,
            ),
            (SendVia::Network(_), DataPath::Tcp { addr, connections }) => {
                let addr: SocketAddr = addr
                    .parse()
                    .map_err(|e| (format!("bad KV address '{addr}': {e}"), false))?;
                Box::new(
                    StreamSender::tcp(
                        addr,
                        target,
                        req.secret,
                        (*connections).clamp(1, 16) as usize,
                    )
                    .await
                    .map_err(net)?,
                )
            }
        };
        let layers = kv.layout.num_layers as usize;
        // Per layer, the positions sent so far; the cached prefix goes at once.
        let mut sent = vec![from; layers];
        if computed > from {
            for (layer, s) in sent.iter_mut().enumerate() {
                sender
                    .send(layer, from, computed - from)
                    .await
                    .map_err(net)?;
                *s = computed;
            }
        }
        let mut rng = None;
        // A chunk of the prompt is computed once its last layer is reported.
        let chunk_span =
            || tracing::info_span!(target: TARGET, parent: &span, "prefill.chunk", upto = Empty);
        let mut chunk = Some(chunk_span());
        let mut on_export = |e: ExportEvent, sender_jobs: &mut Vec<(usize, usize, usize)>| match e {
            ExportEvent::Layer { layer, upto } if layer < layers && upto > sent[layer] => {
                sender_jobs.push((layer, sent[layer], upto - sent[layer]));
                sent[layer] = upto;
                if layer + 1 == layers {
                    if let Some(c) = chunk.take() {
                        c.record("upto", upto);
                    }
                    if upto < to {
                        chunk = Some(chunk_span());
                    }
                }
            }
            ExportEvent::Sampled { rng: r } => rng = Some(r),
            _ => {}
        };
        // The export channel closes when the sequence ends, which may be seen before its
        // token is: then only the token is left to wait for.
        let mut ev_open = true;
        let first = loop {
            let mut jobs = Vec::new();
            tokio::select! {
                e = ev.recv(), if ev_open => match e {
                    Some(e) => on_export(e, &mut jobs),
                    None => ev_open = false,
                },
                e = sub.events.recv() => match e {
                    Some(SeqEvent::Token { sampled, .. }) => {
                        sub.finished();
                        // Every layer was reported before the token: collect the rest.
                        while let Ok(e) = ev.try_recv() {
                            on_export(e, &mut jobs);
                        }
                        for (l, f, n) in jobs {
                            sender.send(l, f, n).await.map_err(net)?;
                        }
                        break sampled;
                    }
                    other => return Err((failure(other), true)),
                },
            }
            for (l, f, n) in jobs {
                sender.send(l, f, n).await.map_err(net)?;
            }
        };
        if let Some(l) = sent.iter().position(|&s| s != to) {
            return Err((
                format!("layer {l} was computed up to {} of {to} positions", sent[l]),
                true,
            ));
        }
        let totals = sender.finish().await.map_err(net)?;
        let _ = events.send(PrefillEvent::Done {
            token: first.token,
            logprob: first.logprob,
            top: first
                .top
                .iter()
                .map(|&(token, logprob)| TopLogprob { token, logprob })
                .collect(),
            rng,
            cached: computed as u32,
            bytes: totals.bytes,
        });
        Ok(totals.bytes)
    }

    /// Prefill side of a request that came over QUIC: runs the export, writing its events
    /// on the stream; a decode worker that stops reading cancels it.
    pub async fn serve_prefill(
        self: Arc<Self>,
        conn: Connection,
        mut send: kvmesh_transport::SendStream,
        req: PrefillRequest,
    ) {
        let (etx, mut erx) = mpsc::unbounded_channel();
        let core = self.clone();
        let work = core.run_export(req, SendVia::Network(conn), etx);
        tokio::pin!(work);
        let stopped = send.stopped();
        tokio::pin!(stopped);
        let mut finished = false;
        loop {
            tokio::select! {
                _ = &mut work, if !finished => finished = true,
                ev = erx.recv() => match ev {
                    Some(ev) => {
                        if wire::write_msg(&mut send, &ev).await.is_err() {
                            return; // dropping `work` cancels the export
                        }
                    }
                    None => {
                        let _ = send.finish();
                        return;
                    }
                },
                _ = &mut stopped => return,
            }
        }
    }
}

fn failure(e: Option<SeqEvent>) -> String {
    match e {
        Some(SeqEvent::Failed(m)) | Some(SeqEvent::Unavailable { message: m, .. }) => m,
        Some(SeqEvent::Token { .. }) => "an unexpected token".into(),
        None => "the engine stopped".into(),
    }
}

/// A decode worker's connections to prefill workers, one per peer, each with a task that
/// hands the KV streams the peer opens to their transfers.
pub struct PeerLinks {
    endpoint: NodeEndpoint,
    inbox: KvInbox,
    conns: tokio::sync::Mutex<HashMap<String, Connection>>,
}

impl PeerLinks {
    fn new(endpoint: NodeEndpoint, inbox: KvInbox) -> PeerLinks {
        PeerLinks {
            endpoint,
            inbox,
            conns: tokio::sync::Mutex::new(HashMap::new()),
        }
    }

    pub async fn get(&self, peer: &PrefillPeer) -> Result<Connection, String> {
        let key = format!("{}@{}#{}", peer.node_id, peer.quic_addr, peer.cert_sha256);
        let mut conns = self.conns.lock().await;
        if let Some(c) = conns.get(&key) {
            if c.close_reason().is_none() {
                return Ok(c.clone());
            }
        }
        let addr: SocketAddr = peer
            .quic_addr
            .parse()
            .map_err(|e| format!("prefill worker {} has a bad address: {e}", peer.node_id))?;
        let conn = self
            .endpoint
            .connect(addr, &peer.cert_sha256)
            .await
            .map_err(|e| format!("prefill worker {}: {e}", peer.node_id))?;
        tokio::spawn(dispatch_streams(conn.clone(), self.inbox.clone()));
        conns.retain(|_, c| c.close_reason().is_none());
        conns.insert(key, conn.clone());
        Ok(conn)
    }
}

/// Hands each KV stream a prefill worker opens on `conn` to its transfer.
async fn dispatch_streams(conn: Connection, inbox: KvInbox) {
    while let Ok(mut r) = conn.accept_uni().await {
        let inbox = inbox.clone();
        tokio::spawn(async move {
            match wire::read_msg::<UniHeader>(&mut r).await {
                Ok(Some(UniHeader::Kv(hello))) => {
                    if let Err(e) = inbox.deliver(&hello, Box::new(r)) {
                        tracing::warn!("KV stream refused: {e}");
                    }
                }
                // Load reports are for routers.
                _ => {
                    let _ = r.stop(0u32.into());
                }
            }
        });
    }
}
