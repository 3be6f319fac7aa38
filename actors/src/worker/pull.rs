//! The decode side of a disaggregated request. The router sent the request here naming a
//! prefill worker. The engine either prefills itself (enough of the prompt is in its prefix
//! cache) or reserves the prompt's blocks and lends them; with the lease in hand this side
//! asks the prefill worker to compute the prompt into those blocks and waits for every
//! layer to land and the first token to come ([`pull`]). Then the lease is given back as
//! landed and the sequence decodes. If the prefill worker refuses, dies, or goes quiet for
//! longer than the transfer timeout, the lease is given up without landing and the engine
//! prefills the prompt itself, in other blocks if the lent ones must stay held (UCX): the
//! request completes either way, without waiting for the held blocks.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvmesh_gpu::device_kv::KvMemory;
use kvmesh_gpu::engine::{Handover, KvLease, Landed, Submission};
use kvmesh_gpu::error::EngineError;
use kvmesh_gpu::kv_pool::KvKind;
use kvmesh_telemetry::TARGET;
use kvmesh_transport::kv::local;
use kvmesh_transport::kv::streams::{InboxEntry, StreamReceiver};
use kvmesh_transport::kv::ucx::{wire_buffers, Registration, UcxReceiver};
use kvmesh_transport::kv::{random_u64, KvReceiver, Landing, TransferTotals};
use kvmesh_transport::wire::{
    self, CudaIpcPath, DataPath, GenerateRequest, PrefillEvent, PrefillPeer, PrefillRequest,
    StreamRequest,
};
use tokio::sync::mpsc;
use tracing::{field::Empty, Instrument};

use kvmesh_transport::kv::ucx::UcxError;
use kvmesh_transport::{ConnectionError, TransportError};

use super::export::SendVia;
use super::kv_side::{region, KvSide, KvTransport, PeerError, UcxSide};
use super::role_core::WorkerCore;
use crate::convert;

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
pub(super) async fn decode(
    core: &Arc<WorkerCore>,
    kv: &Arc<KvSide>,
    req: &GenerateRequest,
    peer: &PrefillPeer,
    router_gone: &mut (impl std::future::Future + Unpin),
) -> Result<Option<Submission>, EngineError> {
    let (sub, lease) = core.engine.submit_remote_prefill_on(
        convert::request_from_wire(req),
        peer.min_tokens as usize,
        handover(core, kv, peer),
    )?;
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
        transport = Empty,
        ucx_tl = Empty,
        from_pos = lease.from_pos(),
        tokens = lease.prompt_len() - lease.from_pos(),
        bytes = Empty,
        ms = Empty,
        outcome = Empty,
        otel.status_code = Empty,
        otel.status_description = Empty,
    );
    let started = Instant::now();
    let outcome = tokio::select! {
        r = pull(core, kv, req, peer, &lease).instrument(span.clone()) => r,
        _ = &mut *router_gone => return Ok(None),
    };
    let secs = started.elapsed().as_secs_f64();
    span.record("ms", secs * 1e3);
    match outcome {
        Ok((landed, totals, via)) => {
            kv.stats.remote.fetch_add(1, Ordering::Relaxed);
            kv.stats.count_via(via);
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
            span.record("otel.status_description", e.to_string());
            tracing::warn!(
                "prefill on {} failed ({e}); prefilling {} tokens here",
                peer.node_id,
                lease.prompt_len() - lease.from_pos()
            );
            // The engine prefills locally now, in blocks of its own: the lent ones stay
            // held while a UCX transfer's quarantine keeps a clone of the lease (a sender
            // that may still write into them), and are reused only once it is dropped.
            lease.abandon();
            drop(lease);
        }
    }
    Ok(Some(sub))
}

/// Why a prompt's KV did not come from the prefill worker (the engine then prefills here).
#[derive(Debug, thiserror::Error)]
enum PullError {
    /// Dialing the prefill worker (the error `KvSide::peers` keeps for a while).
    #[error("{0}")]
    Peer(#[source] PeerError),
    #[error("registering the KV pool with UCX: {0}")]
    UcxRegistration(#[source] UcxError),
    #[error("a UCX fallback cannot itself be UCX")]
    UcxFallbackIsUcx,
    #[error(
        "the blocks were lent on the device, and UCX puts between GPUs need UCX built with \
         CUDA on both workers and no checksum"
    )]
    DeviceLease,
    #[error("opening a stream to {node}: {source}")]
    OpenStream {
        node: String,
        #[source]
        source: ConnectionError,
    },
    #[error("sending the prefill request: {0}")]
    SendRequest(#[source] TransportError),
    /// The prefill worker's own message.
    #[error("{0}")]
    PrefillFailed(String),
    #[error("the prefill worker closed the request")]
    Closed,
    #[error("receiving KV: {0}")]
    Receive(#[source] TransportError),
    #[error("no progress for {secs:.1} s ({landed} of {total} bytes landed)")]
    Stalled {
        secs: f64,
        landed: u64,
        total: usize,
    },
}

/// Where the decode engine lends its blocks: on the device where this node's own prefill
/// role computes the prompt and both engines' caches are on GPUs (the copy never leaves
/// the device), or where a prefill node of this host copies in by CUDA IPC; else in host
/// memory, which every transport reaches.
fn handover(core: &WorkerCore, kv: &KvSide, peer: &PrefillPeer) -> Handover {
    if core.engine.info.device_kv.is_none() {
        return Handover::Host;
    }
    let local = core.local_prefill.read();
    match local.as_ref().filter(|_| peer.node_id == core.node_id) {
        Some(p) if p.engine.info.device_kv.is_some() => Handover::Device,
        Some(_) => Handover::Host,
        // Another node: CUDA IPC copies into the exported cache where it was asked for and
        // the prefill node's cache is on a GPU.
        None if peer.cuda_ipc && matches!(kv.transport, KvTransport::CudaIpc { .. }) => {
            Handover::Device
        }
        // UCX with CUDA on both ends: puts from one GPU cache into the other.
        None if peer.ucx_cuda
            && matches!(kv.transport, KvTransport::Ucx { .. })
            && kv.ucx.as_ref().is_some_and(|u| u.takes_device()) =>
        {
            Handover::Device
        }
        None => Handover::Host,
    }
}

/// `--kv-transport ucx`, the prefill worker having UCX too: the lease's pool registered with
/// UCX (its cache on the GPU where both ends have UCX with CUDA, else host memory) and the
/// request's data path.
async fn ucx_path(
    u: &UcxSide,
    lease: &KvLease,
    peer: &PrefillPeer,
    lanes: usize,
) -> Result<(DataPath, Arc<Registration>), PullError> {
    let memory = lease.memory();
    let device = matches!(memory, KvMemory::Device(_));
    if device && !(peer.ucx_cuda && u.takes_device()) {
        return Err(PullError::DeviceLease);
    }
    let reg = u
        .registration(memory)
        .await
        .map_err(PullError::UcxRegistration)?;
    let data = DataPath::Ucx {
        worker: u.ucx.address().to_vec(),
        registration: reg.id,
        buffers: wire_buffers(&reg),
        lanes: lanes as u32,
        checksum: u.checksum && !device,
        device,
    };
    Ok((data, reg))
}

/// `--kv-transport cuda-ipc`: where the prefill worker's cache is on a GPU and this
/// worker's blocks were lent in its exported device cache, the request's data path (the
/// export's handle, each layer buffer's offset, this host's id) and the export's id.
fn cuda_ipc_path(lease: &KvLease, peer: &PrefillPeer) -> Option<(DataPath, u64)> {
    let KvMemory::Device(pool) = lease.memory() else {
        return None;
    };
    let export = pool.export().filter(|_| peer.cuda_ipc)?;
    let host = kvmesh_transport::kv::ipc::host_id()?;
    let offsets = (0..pool.spec().num_layers)
        .flat_map(|l| [KvKind::K, KvKind::V].map(|kind| pool.base(l, kind) - export.base))
        .collect();
    // The allocation's address in this process names the export (a restarted process
    // exports another).
    let registration = export.base ^ u64::from(std::process::id()) << 48;
    Some((
        DataPath::CudaIpc(Box::new(CudaIpcPath {
            handle: export.handle.to_vec(),
            len: export.len,
            offsets,
            num_blocks: pool.num_blocks() as u64,
            registration,
            host,
        })),
        registration,
    ))
}

/// Fetches the prompt's KV into the lease's blocks: the first token and what was moved.
async fn pull(
    core: &Arc<WorkerCore>,
    kv: &Arc<KvSide>,
    req: &GenerateRequest,
    peer: &PrefillPeer,
    lease: &KvLease,
) -> Result<(Landed, TransferTotals, &'static str), PullError> {
    let (from, to) = (lease.from_pos(), lease.prompt_len());
    let transfer_id = random_u64();
    let landing = Arc::new(Landing::new(region(lease, from..to), transfer_id));
    let preq = PrefillRequest {
        transfer_id,
        secret: random_u64(),
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
    let local_prefill = core
        .local_prefill
        .read()
        .clone()
        .filter(|_| peer.node_id == core.node_id);
    let asked = match local_prefill {
        Some(p) => {
            let via = match lease.memory() {
                KvMemory::Device(_) => "in-process-device",
                KvMemory::Host(_) => "in-process",
            };
            tracing::Span::current().record("transport", via);
            Asked::in_process(p, preq, &landing, via)
        }
        None => Asked::over_network(kv, peer, preq, lease, &landing).await?,
    };
    let via = asked.via;
    let (landed, totals) = asked.land(kv, &landing, from, to).await?;
    Ok((landed, totals, via))
}

/// A prefill request under way: the prefill side's events, and where its bytes land. It
/// keeps the other side's work (a task, a stream, an inbox entry) alive while it lives.
///
/// Dropped before its KV landed, a transfer whose sender writes by itself (UCX puts) holds
/// a clone of the lease until the sender has stopped (its notice streams ended), bounded:
/// the engine prefills into those blocks only once every clone is gone, so no late put can
/// land in them while they are being computed.
struct Asked {
    events: mpsc::UnboundedReceiver<PrefillEvent>,
    receiver: Option<Box<dyn KvReceiver>>,
    landed: bool,
    /// UCX: the blocks, held through the quarantine.
    lease: Option<KvLease>,
    quarantine_for: Duration,
    _entry: Option<InboxEntry>,
    /// UCX: the registration the prefill worker puts into.
    _registration: Option<Arc<Registration>>,
    /// The transport's name.
    via: &'static str,
    _work: AbortOnDrop,
}

impl Asked {
    /// This node's own prefill role computes the prompt and copies it in.
    fn in_process(
        prefill: Arc<WorkerCore>,
        preq: PrefillRequest,
        landing: &Arc<Landing>,
        via: &'static str,
    ) -> Asked {
        let (target, recv) = local::channel(landing.clone());
        let (etx, erx) = mpsc::unbounded_channel();
        Asked {
            events: erx,
            receiver: Some(Box::new(recv)),
            landed: false,
            lease: None,
            quarantine_for: Duration::ZERO,
            _work: AbortOnDrop(tokio::spawn(async move {
                prefill.run_export(preq, SendVia::Local(target), etx).await;
            })),
            _entry: None,
            _registration: None,
            via,
        }
    }

    /// The request goes to the prefill worker on a QUIC stream; the KV comes back on the
    /// transport this decode worker takes it on.
    async fn over_network(
        kv: &KvSide,
        peer: &PrefillPeer,
        mut preq: PrefillRequest,
        lease: &KvLease,
        landing: &Arc<Landing>,
    ) -> Result<Asked, PullError> {
        let conn = kv.peers.get(peer).await.map_err(PullError::Peer)?;
        let (entry, incoming) = kv.inbox.register(preq.transfer_id, preq.secret);
        // UCX or CUDA IPC where both ends have it; otherwise what the decode worker falls
        // back to.
        let mut transport = &kv.transport;
        let mut registration = None;
        let mut ipc = None;
        let mut ucx_device = false;
        if let KvTransport::CudaIpc { otherwise } = transport {
            match cuda_ipc_path(lease, peer) {
                Some((data, reg)) => {
                    preq.data = data;
                    ipc = Some(reg);
                }
                None => transport = otherwise,
            }
        }
        if let KvTransport::Ucx { lanes, otherwise } = transport {
            match (&kv.ucx, peer.ucx) {
                (Some(u), true) => {
                    let (data, reg) = ucx_path(u, lease, peer, *lanes).await?;
                    ucx_device = matches!(data, DataPath::Ucx { device: true, .. });
                    preq.data = data;
                    registration = Some((reg, *lanes, u.checksum && !ucx_device));
                }
                _ => transport = otherwise,
            }
        }
        let via = match transport {
            KvTransport::Ucx { .. } if ucx_device => "ucx-device",
            t => t.name(),
        };
        tracing::Span::current().record("transport", via);
        let receiver: Box<dyn KvReceiver> =
            match (transport, &registration) {
                (KvTransport::Ucx { .. }, Some((reg, lanes, checksum))) => Box::new(
                    UcxReceiver::new(landing.clone(), incoming, *lanes, *checksum, reg.id),
                ),
                (KvTransport::Quic { streams }, _) => {
                    preq.data = DataPath::Quic {
                        streams: *streams as u32,
                    };
                    Box::new(StreamReceiver::new(landing.clone(), incoming, *streams))
                }
                (KvTransport::Tcp { addr, connections }, _) => {
                    preq.data = DataPath::Tcp {
                        addr: addr.to_string(),
                        connections: *connections as u32,
                    };
                    Box::new(StreamReceiver::new(landing.clone(), incoming, *connections))
                }
                (KvTransport::Ucx { .. }, None) => {
                    return Err(PullError::UcxFallbackIsUcx);
                }
                (KvTransport::CudaIpc { .. }, _) => match ipc {
                    // Notices come on one stream; device memory has no checksum here.
                    Some(reg) => {
                        Box::new(UcxReceiver::new(landing.clone(), incoming, 1, false, reg))
                    }
                    None => return Err(PullError::UcxFallbackIsUcx),
                },
            };
        let (mut s, mut r) = conn
            .open_bi()
            .await
            .map_err(|source| PullError::OpenStream {
                node: peer.node_id.clone(),
                source,
            })?;
        wire::write_msg(&mut s, &StreamRequest::Prefill(preq))
            .await
            .map_err(PullError::SendRequest)?;
        let _ = s.finish();
        let (etx, erx) = mpsc::unbounded_channel();
        let work = tokio::spawn(async move {
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
        });
        Ok(Asked {
            events: erx,
            receiver: Some(receiver),
            landed: false,
            // One-sided writers (UCX puts, CUDA IPC copies) may still write after a failure:
            // the blocks stay lent until their notice streams end.
            lease: (registration.is_some() || ipc.is_some()).then(|| lease.clone()),
            quarantine_for: kvmesh_transport::kv::ucx::PUT_DEADLINE + kv.timeout,
            _work: AbortOnDrop(work),
            _entry: Some(entry),
            _registration: registration.map(|r| r.0),
            via,
        })
    }

    /// Waits for every position `from..to` to land and the first token to come; gives up
    /// when the prefill side fails or nothing lands for the transfer timeout.
    async fn land(
        mut self,
        kv: &KvSide,
        landing: &Landing,
        from: usize,
        to: usize,
    ) -> Result<(Landed, TransferTotals), PullError> {
        let mut done: Option<Landed> = None;
        let mut landed: Option<TransferTotals> = None;
        let mut last_bytes = 0;
        let mut last_progress = Instant::now();
        let mut tick = tokio::time::interval(Duration::from_millis(50));
        let complete = self
            .receiver
            .as_mut()
            .expect("a receiver until dropped")
            .complete();
        tokio::pin!(complete);
        loop {
            if let (Some(_), Some(t)) = (&done, landed) {
                self.landed = true;
                return Ok((done.take().expect("checked"), t));
            }
            tokio::select! {
                ev = self.events.recv() => {
                    last_progress = Instant::now();
                    match ev {
                        Some(PrefillEvent::Started { .. }) => {}
                        Some(PrefillEvent::Done { token, logprob, top, rng, cached, state, .. }) => {
                            done = Some(Landed {
                                first: convert::sampled_from_wire(token, logprob, top),
                                rng,
                                cached_tokens: (cached as usize).max(from),
                                state,
                            });
                        }
                        Some(PrefillEvent::Failed { message, .. }) => {
                            return Err(PullError::PrefillFailed(message))
                        }
                        None if done.is_some() => {}
                        None => return Err(PullError::Closed),
                    }
                }
                r = &mut complete, if landed.is_none() => {
                    landed = Some(r.map_err(PullError::Receive)?);
                }
                _ = tick.tick() => {
                    let b = landing.landed_bytes();
                    if b != last_bytes {
                        last_bytes = b;
                        last_progress = Instant::now();
                    } else if last_progress.elapsed() > kv.timeout {
                        let l = &kv.layout;
                        return Err(PullError::Stalled {
                            secs: kv.timeout.as_secs_f64(),
                            landed: b,
                            total: 2 * (to - from) * l.bytes_per_pos() * l.num_layers as usize,
                        });
                    }
                }
            }
        }
    }
}

impl Drop for Asked {
    fn drop(&mut self) {
        if self.landed {
            return;
        }
        let Some(fence) = self.receiver.take().and_then(|r| r.quarantine()) else {
            return;
        };
        let hold = (
            self.lease.take(),
            self._entry.take(),
            self._registration.take(),
        );
        let bound = self.quarantine_for;
        tokio::spawn(async move {
            if tokio::time::timeout(bound, fence).await.is_err() {
                tracing::warn!(
                    "a failed UCX transfer's sender had not stopped after {:.0} s; its blocks \
                     are released",
                    bound.as_secs_f64()
                );
            }
            drop(hold);
        });
    }
}
