//! What the prefill and decode roles need for KV transfers: the layout both ends must share,
//! how the bytes travel, the decode side's inbox and connections to prefill workers, and the
//! counters `/metrics` shows.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvmesh_gpu::device_kv::{CopyRun, DeviceCopy, DeviceKey, DeviceKvPool, KvMemory};
use kvmesh_gpu::engine::KvLease;
use kvmesh_gpu::kv_pool::HostKvPool;
use kvmesh_gpu::kv_pool::KvKind;
use kvmesh_telemetry::metrics::Exposition;
use kvmesh_transport::grant::{self, Counted, StreamGrant};
use kvmesh_transport::kv::streams::KvInbox;
use kvmesh_transport::kv::ucx::{MemoryType, Registration, Ucx, UcxError};
use kvmesh_transport::kv::KvRegion;
use kvmesh_transport::wire::{self, KvLayout, PrefillPeer, UniHeader};
use kvmesh_transport::{Connection, NodeEndpoint};

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
    /// UCX puts into this worker's registered KV pool, with notices on `lanes` QUIC
    /// streams; from a prefill worker without UCX, KV comes as `otherwise` says.
    Ucx {
        lanes: usize,
        otherwise: Box<KvTransport>,
    },
    /// Copies on the GPU by prefill workers of this host straight into this worker's
    /// exported KV cache (CUDA IPC), with notices on a QUIC stream; from a prefill worker
    /// whose cache is not on a GPU, KV comes as `otherwise` says.
    CudaIpc { otherwise: Box<KvTransport> },
}

impl KvTransport {
    pub fn name(&self) -> &'static str {
        match self {
            KvTransport::Quic { .. } => "quic",
            KvTransport::Tcp { .. } => "tcp",
            KvTransport::Ucx { .. } => "ucx",
            KvTransport::CudaIpc { .. } => "cuda-ipc",
        }
    }
}

/// A node's UCX: its worker, whether decode workers ask for checksums (tests), and the
/// registrations of the KV pools transfers land in.
pub struct UcxSide {
    pub ucx: Ucx,
    pub checksum: bool,
    regs: parking_lot::Mutex<Vec<PoolRegistration>>,
}

struct PoolRegistration {
    pool: WeakPool,
    reg: Arc<Registration>,
}

/// A registered pool, held weakly: its registration goes when it does.
enum WeakPool {
    Host(std::sync::Weak<HostKvPool>),
    Device(std::sync::Weak<DeviceKvPool>),
}

impl WeakPool {
    fn alive(&self) -> bool {
        match self {
            WeakPool::Host(p) => p.strong_count() > 0,
            WeakPool::Device(p) => p.strong_count() > 0,
        }
    }

    fn is(&self, memory: &KvMemory) -> bool {
        match (self, memory) {
            (WeakPool::Host(w), KvMemory::Host(p)) => std::ptr::eq(w.as_ptr(), Arc::as_ptr(p)),
            (WeakPool::Device(w), KvMemory::Device(p)) => std::ptr::eq(w.as_ptr(), Arc::as_ptr(p)),
            _ => false,
        }
    }
}

impl UcxSide {
    /// Registrations kept for pools other than the engine's own (staging pools of backends
    /// without host KV live as long as their sequence).
    const KEPT: usize = 64;

    pub fn new(ucx: Ucx, checksum: bool) -> UcxSide {
        UcxSide {
            ucx,
            checksum,
            regs: Default::default(),
        }
    }

    /// The registration of a pool's buffers (per layer, K then V), in host memory or a
    /// GPU's (UCX built with CUDA): made on first use and kept while the pool lives.
    pub async fn registration(&self, memory: &KvMemory) -> Result<Arc<Registration>, UcxError> {
        {
            let mut regs = self.regs.lock();
            regs.retain(|r| r.pool.alive());
            if let Some(r) = regs.iter().find(|r| r.pool.is(memory)) {
                return Ok(r.reg.clone());
            }
        }
        let layers = memory.spec().num_layers;
        let (buffers, mem, pool) = match memory {
            KvMemory::Host(p) => (
                pool_buffers(layers, |l, k| p.base(l, k) as usize, p.layer_bytes()),
                MemoryType::Host,
                WeakPool::Host(Arc::downgrade(p)),
            ),
            KvMemory::Device(p) => {
                // UCX registers a GPU's memory in the context current on its thread.
                self.ucx
                    .bind(Arc::new(EngineCopy(p.copier().clone())))
                    .await?;
                (
                    pool_buffers(layers, |l, k| p.base(l, k) as usize, p.layer_bytes()),
                    MemoryType::Cuda,
                    WeakPool::Device(Arc::downgrade(p)),
                )
            }
        };
        // SAFETY: the buffers are the pool's, allocated while it lives, of the type said;
        // the registration is dropped (unmapped) once the pool is gone (`retain` above),
        // and a transfer holds the pool through its lease while it uses the registration.
        let reg = Arc::new(unsafe { self.ucx.register(buffers, mem) }.await?);
        let mut regs = self.regs.lock();
        if regs.len() >= Self::KEPT {
            regs.remove(0);
        }
        regs.push(PoolRegistration {
            pool,
            reg: reg.clone(),
        });
        Ok(reg)
    }

    /// Whether this decode worker takes KV straight into its cache on a GPU: UCX has
    /// CUDA, and no checksum was asked for (one is taken of host memory only).
    pub fn takes_device(&self) -> bool {
        self.ucx.supports_cuda() && !self.checksum
    }
}

/// A pool's layer buffers as UCX registers them: per layer, K then V.
fn pool_buffers(
    layers: usize,
    base: impl Fn(usize, KvKind) -> usize,
    layer_bytes: usize,
) -> Vec<(usize, usize)> {
    (0..layers)
        .flat_map(|l| [KvKind::K, KvKind::V].map(|k| (base(l, k), layer_bytes)))
        .collect()
}

/// Why a KV transfer did not complete, and whether another prefill worker may succeed where
/// this one did not (a full queue, a lost connection) or none would (another KV layout).
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct TransferError {
    pub message: String,
    pub retryable: bool,
}

impl TransferError {
    pub fn retryable(message: impl Into<String>) -> TransferError {
        TransferError {
            message: message.into(),
            retryable: true,
        }
    }

    pub fn fatal(message: impl Into<String>) -> TransferError {
        TransferError {
            message: message.into(),
            retryable: false,
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
    /// Decode side: remote prefills landed, by transport (`VIA` order).
    pub via: [AtomicU64; 7],
}

impl KvStats {
    /// The transports `via` counts: `in-process-device` is a copy between two engines'
    /// device caches, `in-process` one through host memory, `cuda-ipc` a copy on the GPU
    /// from another process of this host, `ucx-device` UCX puts from one GPU cache into
    /// another (`ucx` puts land in host memory).
    pub const VIA: [&'static str; 7] = [
        "in-process",
        "in-process-device",
        "quic",
        "tcp",
        "ucx",
        "ucx-device",
        "cuda-ipc",
    ];

    pub fn count_via(&self, transport: &str) {
        if let Some(i) = Self::VIA.iter().position(|&t| t == transport) {
            self.via[i].fetch_add(1, Ordering::Relaxed);
        }
    }
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
    /// The decode role's KV listener, with the TCP transport.
    pub tcp_listener: Option<Arc<tokio::net::TcpListener>>,
    /// The node's UCX, with `--kv-transport ucx` or `auto` where the library loads.
    pub ucx: Option<UcxSide>,
    pub stats: KvStats,
    /// Prefill side: decode workers' caches mapped for CUDA IPC transfers.
    pub ipc: super::ipc_side::IpcMaps,
}

impl KvSide {
    /// Parallel streams (QUIC) or connections (TCP) per transfer, unless told otherwise.
    pub const DEFAULT_STREAMS: usize = 4;
    /// A transfer that makes no progress for this long is given up, unless told otherwise.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);

    pub fn new(
        layout: KvLayout,
        transport: KvTransport,
        timeout: Duration,
        endpoint: NodeEndpoint,
        tcp_listener: Option<Arc<tokio::net::TcpListener>>,
        ucx: Option<UcxSide>,
    ) -> Arc<KvSide> {
        let inbox = KvInbox::default();
        Arc::new(KvSide {
            layout,
            transport,
            timeout,
            peers: PeerLinks::new(endpoint, inbox.clone()),
            inbox,
            tcp_listener,
            ucx,
            stats: KvStats::default(),
            ipc: Default::default(),
        })
    }

    /// The KV transfers' metric families.
    pub fn render_metrics(&self, out: &Exposition) {
        let s = &self.stats;
        let n = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64;
        out.counters(
            "kvmesh:disagg_prefills_total",
            "Prompts of disaggregated requests on this decode worker, by where they were prefilled.",
            &["outcome"],
            [
                (vec!["remote"], n(&s.remote)),
                (vec!["cached_locally"], n(&s.cached_locally)),
                (vec!["fallback"], n(&s.fallback)),
            ],
        );
        out.counters(
            "kvmesh:kv_transfers_total",
            "Remote prefills whose KV landed on this decode worker, by transport.",
            &["transport"],
            KvStats::VIA
                .iter()
                .zip(&s.via)
                .map(|(t, c)| (vec![*t], n(c))),
        );
        out.counters(
            "kvmesh:kv_transfer_bytes_total",
            "KV bytes moved between workers.",
            &["direction"],
            [(vec!["in"], n(&s.bytes_in)), (vec!["out"], n(&s.bytes_out))],
        );
        out.counter(
            "kvmesh:kv_transfer_seconds_total",
            "Time from reserving blocks to the KV landing, over remote prefills.",
            n(&s.transfer_us) / 1e6,
        );
        out.counters(
            "kvmesh:prefill_transfers_total",
            "Transfers this prefill worker took, by outcome.",
            &["outcome"],
            [(vec!["sent"], n(&s.served)), (vec!["failed"], n(&s.failed))],
        );
    }
}

/// A lease's blocks as a transfer addresses them, over `positions`: host memory, or the
/// device cache's own blocks for a transfer between two engines of this process.
pub(super) fn region(lease: &KvLease, positions: Range<usize>) -> KvRegion {
    let spec = lease.spec();
    let layers = spec.num_layers;
    let blocks = lease.blocks().iter().map(|b| b.0).collect();
    let keep = Arc::new(lease.clone());
    let (k, v, layer_bytes, copier): (Vec<*mut u8>, Vec<*mut u8>, _, _) = match lease.memory() {
        KvMemory::Host(pool) => (
            (0..layers).map(|l| pool.base(l, KvKind::K)).collect(),
            (0..layers).map(|l| pool.base(l, KvKind::V)).collect(),
            pool.layer_bytes(),
            None,
        ),
        KvMemory::Device(pool) => {
            let addr = |l, kind| pool.base(l, kind) as usize as *mut u8;
            (
                (0..layers).map(|l| addr(l, KvKind::K)).collect(),
                (0..layers).map(|l| addr(l, KvKind::V)).collect(),
                pool.layer_bytes(),
                Some(EngineCopy(pool.copier().clone())),
            )
        }
    };
    // SAFETY: the pool's buffers are `[num_blocks, block_size, kv_dim]` per layer and live as
    // long as the pool, which the lease (the keepalive) holds (a device pool keeps them past
    // its engine, and only `EngineCopy` touches them); the engine allocated every block of
    // the table from this pool; and while a lease clone lives, the positions a transfer moves
    // are its own (read-only computed ones on the prefill side, reserved ones on the decode
    // side): the engine keeps the blocks and does not touch them.
    unsafe {
        let r = KvRegion::new(
            k,
            v,
            layer_bytes,
            spec.bytes_per_pos(),
            spec.block_size,
            blocks,
            positions,
            keep,
        );
        match copier {
            Some(c) => r.on_device(Arc::new(c)),
            None => r,
        }
    }
}

/// An engine's device copier, as the transport calls it.
struct EngineCopy(Arc<dyn DeviceCopy>);

impl kvmesh_transport::kv::DeviceCopy for EngineCopy {
    fn device(&self) -> u32 {
        self.0.device().ordinal
    }

    unsafe fn copy(&self, runs: &[(usize, usize, usize)], dst: u32) -> Result<(), String> {
        let runs: Vec<CopyRun> = runs
            .iter()
            .map(|&(src, dst, len)| CopyRun {
                src: src as u64,
                dst: dst as u64,
                len: len as u64,
            })
            .collect();
        // SAFETY: the transport's contract is the engine's.
        unsafe { self.0.copy(&runs, DeviceKey { ordinal: dst }) }
    }

    fn bind_thread(&self) -> Result<(), String> {
        self.0.bind_thread()
    }
}

/// A decode worker's connections to prefill workers, one per peer, each with a task that
/// hands the KV streams the peer opens to their transfers.
///
/// Dials happen outside the map's lock: one peer that does not answer (a frozen process,
/// a lost machine) holds up only the requests that wanted it. At most one dial per peer is
/// in flight; requests for that peer wait for it, and a failed dial answers the requests
/// that come within `REDIAL_AFTER` with its error at once, so they fall back to a local
/// prefill instead of each waiting out a handshake of their own.
pub struct PeerLinks {
    endpoint: NodeEndpoint,
    inbox: KvInbox,
    conns: parking_lot::Mutex<HashMap<String, Arc<tokio::sync::Mutex<PeerSlot>>>>,
}

/// One prefill peer's connection, as far as it got.
#[derive(Default)]
enum PeerSlot {
    #[default]
    Unknown,
    Live(Connection),
    Failed(Instant, PeerError),
}

/// Why a prefill worker could not be reached; kept for `REDIAL_AFTER` and given to every
/// request for that peer meanwhile, hence shared.
#[derive(Debug, Clone, thiserror::Error)]
pub enum PeerError {
    #[error("prefill worker {node} has a bad address: {source}")]
    BadAddress {
        node: String,
        #[source]
        source: std::net::AddrParseError,
    },
    #[error("prefill worker {node}: {source}")]
    Dial {
        node: String,
        #[source]
        source: Arc<kvmesh_transport::TransportError>,
    },
}

/// How long a failed dial answers for its peer before the next request dials again.
const REDIAL_AFTER: Duration = Duration::from_secs(1);

impl PeerLinks {
    fn new(endpoint: NodeEndpoint, inbox: KvInbox) -> PeerLinks {
        PeerLinks {
            endpoint,
            inbox,
            conns: parking_lot::Mutex::new(HashMap::new()),
        }
    }

    pub async fn get(&self, peer: &PrefillPeer) -> Result<Connection, PeerError> {
        let key = format!("{}@{}#{}", peer.node_id, peer.quic_addr, peer.cert_sha256);
        let slot = {
            let mut conns = self.conns.lock();
            // Forget closed connections and old failures (a slot in use is kept).
            conns.retain(|_, s| {
                s.try_lock().map_or(true, |s| match &*s {
                    PeerSlot::Live(c) => c.close_reason().is_none(),
                    PeerSlot::Failed(at, _) => at.elapsed() < REDIAL_AFTER,
                    PeerSlot::Unknown => false,
                })
            });
            conns.entry(key).or_default().clone()
        };
        let mut slot = slot.lock().await;
        match &*slot {
            PeerSlot::Live(c) if c.close_reason().is_none() => return Ok(c.clone()),
            PeerSlot::Failed(at, e) if at.elapsed() < REDIAL_AFTER => return Err(e.clone()),
            _ => {}
        }
        let dialed = match peer.quic_addr.parse::<SocketAddr>() {
            Ok(addr) => self
                .endpoint
                .connect(addr, &peer.cert_sha256)
                .await
                .map_err(|e| PeerError::Dial {
                    node: peer.node_id.clone(),
                    source: Arc::new(e),
                }),
            Err(source) => Err(PeerError::BadAddress {
                node: peer.node_id.clone(),
                source,
            }),
        };
        match dialed {
            Ok(conn) => {
                tokio::spawn(dispatch_streams(conn.clone(), self.inbox.clone()));
                tokio::spawn(close_when_silent(conn.clone(), peer.node_id.clone()));
                *slot = PeerSlot::Live(conn.clone());
                Ok(conn)
            }
            Err(e) => {
                *slot = PeerSlot::Failed(Instant::now(), e.clone());
                Err(e)
            }
        }
    }
}

/// A prefill worker heard from for this long (keep-alives every 200 ms, each acknowledged)
/// is taken for gone, as a router takes a silent worker: 3.5 missed beats.
pub const PEER_SILENT_AFTER: Duration = Duration::from_millis(700);

/// Closes the link to a prefill worker that falls silent (killed, frozen, cut off): its
/// transfers then fail at once and their requests are prefilled here, instead of waiting
/// out the transfer timeout or QUIC's idle timeout.
async fn close_when_silent(conn: Connection, who: String) {
    tokio::select! {
        () = kvmesh_transport::until_silent(&conn, || PEER_SILENT_AFTER, false) => {
            tracing::warn!(
                "prefill worker {who}: nothing heard for {} ms; its transfers fail over",
                PEER_SILENT_AFTER.as_millis()
            );
            conn.close(0u32.into(), b"prefill worker silent");
        }
        _ = conn.closed() => {}
    }
}

/// Hands each KV stream a prefill worker opens on `conn` to its transfer.
async fn dispatch_streams(conn: Connection, inbox: KvInbox) {
    let grant = StreamGrant::new(&conn, grant::Dir::Uni);
    while let Ok(mut r) = conn.accept_uni().await {
        let inbox = inbox.clone();
        let open = grant.enter();
        tokio::spawn(async move {
            match wire::read_msg::<UniHeader>(&mut r).await {
                Ok(Some(UniHeader::Kv(hello))) => {
                    if let Err(e) = inbox.deliver(&hello, Box::new(Counted::new(r, open))) {
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
