//! KV over UCX: one-sided puts straight into the decode worker's registered KV buffers.
//!
//! UCX turns a `put` into an RDMA write on InfiniBand or RoCE, a copy between processes on
//! one host (`cma`: `process_vm_writev`), or a TCP stream elsewhere; the code here is the
//! same for all of them.
//!
//! # The exchange
//!
//! 1. The decode worker registers its KV pool with UCX (`ucp_mem_map`) once, packs a remote
//!    key per layer buffer, and sends them with the transfer's reservation:
//!    [`DataPath::Ucx`](crate::wire::DataPath::Ucx) carries its UCX worker address, the
//!    registration, each buffer's base, length and key, and how many notice lanes to open.
//! 2. The prefill worker connects to that worker address (endpoints are cached per peer),
//!    unpacks the keys (cached per registration), and for each piece puts every run of
//!    positions from its own blocks into the decode worker's blocks — no receive-side copy and
//!    no intermediate buffer. Every put is checked against the registered buffer first.
//! 3. It then flushes the endpoint: once the flush completes, the bytes are in the decode
//!    worker's memory. Only then does it send a [`KvLandedNotice`] (the piece's header, and a
//!    checksum of its bytes when the decode worker asked for one) on a QUIC stream of the
//!    request's connection, opened with the transfer's id and secret like any KV stream.
//! 4. The decode worker checks each notice exactly as a streamed piece's header (the
//!    transfer, the order, the blocks), verifies the checksum if it asked for one, and treats
//!    the positions as landed. The transfer is complete when every layer is.
//!
//! A peer that dies mid-put fails its endpoint (UCX's peer error handling): the flush
//! reports the error, the sender fails, and the decode worker, hearing no notices, gives the
//! lease back unlanded after the transfer timeout, as with every transport.

mod error;
pub mod ffi;
pub mod worker;

use std::collections::VecDeque;
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc;
use tokio::task::{JoinHandle, JoinSet};

use super::streams::{KvInbound, LayerSpan, Target};
use super::{
    block_runs, pair_runs, Checksum, Kind, KvReceiver, KvSender, Landing, Lanes, RegionMemory,
    TransferTotals,
};
use crate::wire::{self, KvLandedNotice, KvPiece, KvStreamHello, UcxBuffer, UniHeader};
use crate::TransportError;
pub use error::UcxError;
pub use worker::{MemoryType, PutOp, Registration, RemoteBuffer, RemoteKeys, Ucx, UcxOptions};

/// Pieces whose puts may be in flight on one lane before the oldest's notice is written.
const DEPTH: usize = 16;

/// A piece whose puts have not completed in this long fails its transfer (a peer that
/// stopped without UCX noticing, on transports that cannot report it).
pub const PUT_DEADLINE: std::time::Duration = std::time::Duration::from_secs(10);

type Job = (usize, usize, usize);

/// The decode side's registered buffers as the wire carries them.
pub fn wire_buffers(reg: &Registration) -> Vec<UcxBuffer> {
    reg.buffers
        .iter()
        .map(|b| UcxBuffer {
            base: b.base,
            len: b.len,
            rkey: b.rkey.clone(),
        })
        .collect()
}

/// What the prefill side needs to address the decode side's memory.
pub fn remote_keys(worker: &[u8], registration: u64, buffers: &[UcxBuffer]) -> RemoteKeys {
    RemoteKeys {
        peer: worker.into(),
        registration,
        buffers: buffers
            .iter()
            .map(|b| RemoteBuffer {
                base: b.base,
                len: b.len,
                rkey: b.rkey.clone(),
            })
            .collect(),
    }
}

/// Sends a transfer with UCX puts; notices go on `lanes` QUIC streams.
pub struct UcxSender(Lanes);

/// Where a lane's notices go.
pub enum NoticeStream {
    Quic(quinn::SendStream),
    /// Any byte stream (tests, benchmarks).
    Other(Box<dyn tokio::io::AsyncWrite + Send + Unpin>),
}

impl NoticeStream {
    pub(crate) async fn write(&mut self, b: &[u8]) -> Result<(), TransportError> {
        let r = match self {
            NoticeStream::Quic(s) => s.write_all(b).await.map_err(|e| e.to_string()),
            NoticeStream::Other(w) => w.write_all(b).await.map_err(|e| e.to_string()),
        };
        r.map_err(TransportError::Stream)
    }

    pub(crate) async fn close(&mut self) -> Result<(), TransportError> {
        let r = match self {
            NoticeStream::Quic(s) => s.finish().map_err(|e| e.to_string()),
            NoticeStream::Other(w) => w.shutdown().await.map_err(|e| e.to_string()),
        };
        r.map_err(TransportError::Stream)
    }
}

impl UcxSender {
    /// Opens `lanes` notice streams on `conn` (the decode worker's connection) and starts a
    /// lane on each.
    pub async fn quic(
        ucx: Ucx,
        conn: &quinn::Connection,
        target: Target,
        keys: RemoteKeys,
        secret: u64,
        lanes: usize,
        checksum: bool,
    ) -> Result<UcxSender, TransportError> {
        let mut streams = Vec::new();
        for lane in 0..lanes.max(1) {
            let s = conn.open_uni().await?;
            let hello = UniHeader::Kv(KvStreamHello {
                transfer_id: target.transfer_id,
                secret,
                stream: lane as u32,
            });
            streams.push((NoticeStream::Quic(s), wire::frame(&hello)?));
        }
        UcxSender::start(ucx, target, keys, streams, checksum)
    }

    /// Starts a lane on each stream; each first writes its preamble (the framed hello).
    pub fn start(
        ucx: Ucx,
        target: Target,
        keys: RemoteKeys,
        streams: Vec<(NoticeStream, Vec<u8>)>,
        checksum: bool,
    ) -> Result<UcxSender, TransportError> {
        let layers = target.source.num_layers();
        if keys.buffers.len() != 2 * layers {
            return Err(TransportError::Codec(format!(
                "the decode worker registered {} KV buffers; {layers} layers need {}",
                keys.buffers.len(),
                2 * layers
            )));
        }
        // A prefill cache on a GPU is put from directly where UCX was built with CUDA.
        let src_mem =
            match target.source.memory() {
                RegionMemory::Host => MemoryType::Host,
                RegionMemory::Device(c) if !ucx.supports_cuda() => {
                    return Err(TransportError::DeviceMemory { device: c.device() })
                }
                RegionMemory::Device(_) if checksum => return Err(TransportError::Codec(
                    "a checksum of KV in GPU memory was asked for; it is taken of host memory only"
                        .into(),
                )),
                RegionMemory::Device(_) => MemoryType::Cuda,
            };
        let lane = Arc::new(Lane {
            ucx,
            keys: Arc::new(keys),
            target,
            src_mem,
            checksum,
            tl: Mutex::new(None),
        });
        let mut lanes = Lanes::new();
        for (s, preamble) in streams {
            lanes.spawn(|rx| lane.clone().run(s, preamble, rx));
        }
        Ok(UcxSender(lanes))
    }
}

#[async_trait::async_trait]
impl KvSender for UcxSender {
    async fn send(&mut self, layer: usize, first: usize, n: usize) -> Result<(), TransportError> {
        self.0.send(layer, first, n).await
    }

    async fn finish(&mut self) -> Result<TransferTotals, TransportError> {
        self.0.finish().await
    }
}

/// What every lane of a transfer shares.
struct Lane {
    ucx: Ucx,
    keys: Arc<RemoteKeys>,
    target: Target,
    /// Where the source region lives (GPU memory only where UCX has CUDA).
    src_mem: MemoryType,
    checksum: bool,
    /// UCX's transport layer to the peer, learned after the first put.
    tl: Mutex<Option<String>>,
}

/// A lane's notice stream and its pieces in flight. Dropped early (the transfer cancelled),
/// it keeps the stream open until UCX is done with every put already posted: the decode
/// side holds the transfer's blocks until the stream ends, so no put lands after it let
/// them go.
struct LaneIo {
    stream: Option<NoticeStream>,
    flight: VecDeque<InFlight>,
}

impl LaneIo {
    fn stream(&mut self) -> &mut NoticeStream {
        self.stream
            .as_mut()
            .expect("the stream is open until the lane ends")
    }
}

impl Drop for LaneIo {
    fn drop(&mut self) {
        let flight = std::mem::take(&mut self.flight);
        let stream = self.stream.take();
        if flight.is_empty() {
            return;
        }
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                for f in flight {
                    let _ = tokio::time::timeout_at(f.started + PUT_DEADLINE, f.put).await;
                }
                drop(stream);
            });
        }
    }
}

/// A piece whose puts are in flight.
struct InFlight {
    notice: KvLandedNotice,
    layer: usize,
    started: tokio::time::Instant,
    put: JoinHandle<Result<(), UcxError>>,
}

impl Lane {
    /// The puts of positions `first .. first + n` of `layer`, and the piece's notice.
    fn plan(
        &self,
        layer: usize,
        first: usize,
        n: usize,
    ) -> Result<(Vec<PutOp>, KvLandedNotice), TransportError> {
        let region = &self.target.source;
        let (bs, bpp) = (region.block_size(), region.bytes_per_pos());
        let dest = &self.target.dest_blocks;
        let mut ops = Vec::new();
        let mut all_src = Vec::new();
        for (i, kind) in [Kind::K, Kind::V].into_iter().enumerate() {
            let buffer = (2 * layer + i) as u32;
            let base = self.keys.buffers[buffer as usize].base as usize;
            let src = match self.src_mem {
                MemoryType::Host => region.segments(layer, kind, first, n)?,
                MemoryType::Cuda => region.any_segments(layer, kind, first, n)?,
            };
            let dst: Vec<(usize, usize)> = block_runs(dest, bs, bpp, first, n)?
                .into_iter()
                .map(|(off, len)| (base + off, len))
                .collect();
            ops.extend(pair_runs(&src, &dst).into_iter().map(|(s, d, len)| PutOp {
                src: s,
                buffer,
                dst: d as u64,
                len,
            }));
            all_src.extend(src);
        }
        let checksum = self.checksum.then(|| {
            // SAFETY: the region's contract: these positions are computed and readable.
            unsafe { Checksum::of_runs(&all_src) }
        });
        let notice = KvLandedNotice {
            piece: KvPiece {
                transfer_id: self.target.transfer_id,
                layer: layer as u32,
                first_pos: first as u32,
                num_pos: n as u32,
                blocks: super::blocks_of(dest, bs, first, n).to_vec(),
                bytes_per_pos: bpp as u32,
                payload_bytes: (2 * n * bpp) as u64,
            },
            registration: self.keys.registration,
            checksum,
            tl: String::new(),
        };
        Ok((ops, notice))
    }

    async fn run(
        self: Arc<Self>,
        s: NoticeStream,
        preamble: Vec<u8>,
        mut jobs: mpsc::UnboundedReceiver<Job>,
    ) -> Result<TransferTotals, TransportError> {
        let mut io = LaneIo {
            stream: Some(s),
            flight: VecDeque::new(),
        };
        io.stream().write(&preamble).await?;
        // UCX reads a GPU's memory in the context current on its thread.
        if let RegionMemory::Device(c) = self.target.source.memory() {
            self.ucx.bind(c.clone()).await?;
        }
        let traced = kvmesh_telemetry::is_sampled(&self.target.span);
        let mut spans: std::collections::HashMap<usize, LayerSpan> = Default::default();
        let mut totals = TransferTotals::default();
        let mut open = true;
        while open || !io.flight.is_empty() {
            let can_take = open && io.flight.len() < DEPTH;
            // The oldest piece's puts completing, or another piece to start.
            let next = {
                let front = io.flight.front_mut();
                tokio::select! {
                    biased;
                    r = async {
                        match front {
                            Some(f) => tokio::time::timeout_at(f.started + PUT_DEADLINE, &mut f.put).await,
                            None => std::future::pending().await,
                        }
                    } => Ok(r),
                    j = jobs.recv(), if can_take => Err(j),
                }
            };
            let done = match next {
                Err(Some((layer, first, n))) => {
                    let (ops, notice) = self.plan(layer, first, n)?;
                    if traced && !spans.contains_key(&layer) {
                        spans.insert(layer, LayerSpan::open(&self.target.span, layer, "ucx"));
                    }
                    let (ucx, keys, mem) = (self.ucx.clone(), self.keys.clone(), self.src_mem);
                    let keep: Box<dyn std::any::Any + Send> = Box::new(self.target.source.clone());
                    // SAFETY: `keep` holds the source region (and its blocks) until UCX is
                    // done reading them.
                    let put =
                        tokio::spawn(async move { unsafe { ucx.put(keys, ops, mem, keep) }.await });
                    io.flight.push_back(InFlight {
                        notice,
                        layer,
                        started: tokio::time::Instant::now(),
                        put,
                    });
                    continue;
                }
                Err(None) => {
                    open = false;
                    continue;
                }
                Ok(done) => done,
            };
            let mut f = io.flight.pop_front().expect("a piece was in flight");
            match done {
                Ok(r) => r.map_err(|e| TransportError::Stream(format!("UCX put task: {e}")))??,
                Err(_) => {
                    return Err(TransportError::Stream(format!(
                        "UCX puts of layer {} did not complete within {} s",
                        f.layer,
                        PUT_DEADLINE.as_secs()
                    )))
                }
            }
            let tl = self.transport_layer().await;
            f.notice.tl.clone_from(&tl);
            io.stream().write(&wire::frame(&f.notice)?).await?;
            let p = &f.notice.piece;
            totals.bytes += p.payload_bytes;
            totals.pieces += 1;
            if let Some(l) = spans.get_mut(&f.layer) {
                l.bytes += p.payload_bytes;
                l.pieces += 1;
                l.writing += f.started.elapsed();
                if (p.first_pos + p.num_pos) as usize >= self.target.source.positions().end {
                    if let Some(l) = spans.remove(&f.layer) {
                        l.span.record("ucx_tl", tl.as_str());
                        l.close();
                    }
                }
            }
        }
        io.stream().close().await?;
        io.stream.take();
        Ok(totals)
    }

    /// UCX's transport layer to the peer (asked once per transfer).
    async fn transport_layer(&self) -> String {
        if let Some(t) = self.tl.lock().clone() {
            return t;
        }
        let t = self
            .ucx
            .transport_to(self.keys.peer.clone())
            .await
            .unwrap_or_else(|e| format!("unknown ({e})"));
        *self.tl.lock() = Some(t.clone());
        t
    }
}

/// Receives a UCX transfer: the bytes land by themselves; the notices say which and when.
pub struct UcxReceiver {
    landing: Arc<Landing>,
    incoming: mpsc::UnboundedReceiver<KvInbound>,
    lanes: usize,
    checksum: bool,
    registration: u64,
    tl: Arc<Mutex<String>>,
    arrived: usize,
    readers: JoinSet<(Result<(), TransportError>, Option<KvInbound>)>,
    /// Streams whose reader stopped at a bad notice, not read to their end.
    leftover: Vec<KvInbound>,
}

impl UcxReceiver {
    pub fn new(
        landing: Arc<Landing>,
        incoming: mpsc::UnboundedReceiver<KvInbound>,
        lanes: usize,
        checksum: bool,
        registration: u64,
    ) -> UcxReceiver {
        UcxReceiver {
            landing,
            incoming,
            lanes: lanes.max(1),
            checksum,
            registration,
            tl: Arc::default(),
            arrived: 0,
            readers: JoinSet::new(),
            leftover: Vec::new(),
        }
    }
}

#[async_trait::async_trait]
impl KvReceiver for UcxReceiver {
    async fn complete(&mut self) -> Result<TransferTotals, TransportError> {
        let mut finished = 0;
        while finished < self.lanes {
            tokio::select! {
                s = self.incoming.recv(), if self.arrived < self.lanes => match s {
                    Some(s) => {
                        self.arrived += 1;
                        let (landing, tl) = (self.landing.clone(), self.tl.clone());
                        let check = (self.checksum, self.registration);
                        self.readers.spawn(async move {
                            let mut s = s;
                            match read_notices(&mut s, landing, check, tl).await {
                                Ok(()) => (Ok(()), None),
                                Err(e) => (Err(e), Some(s)),
                            }
                        });
                    }
                    None => return Err(TransportError::Stream(
                        "the transfer was closed before its notice streams arrived".into())),
                },
                Some(r) = self.readers.join_next(), if !self.readers.is_empty() => {
                    let (r, rest) = r.map_err(|e| TransportError::Stream(format!("UCX notices: {e}")))?;
                    self.leftover.extend(rest);
                    r?;
                    finished += 1;
                }
            }
        }
        if !self.landing.is_complete() {
            return Err(TransportError::Stream(format!(
                "the UCX transfer ended early: {}",
                self.landing.missing()
            )));
        }
        // The receiving span (`kv.pull`) names UCX's transport layer, where it has the field.
        if let Some(tl) = self.transport_layer() {
            tracing::Span::current().record("ucx_tl", tl.as_str());
        }
        Ok(self.landing.totals())
    }

    fn landed_bytes(&self) -> u64 {
        self.landing.landed_bytes()
    }

    fn transport_layer(&self) -> Option<String> {
        Some(self.tl.lock().clone()).filter(|t| !t.is_empty())
    }

    /// Every notice stream of the transfer read to its end: a prefill worker ends a lane's
    /// stream only once UCX is done with every put the lane posted (`LaneIo`).
    fn quarantine(
        mut self: Box<Self>,
    ) -> Option<std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>> {
        Some(Box::pin(async move {
            let mut streams = std::mem::take(&mut self.leftover);
            while let Some(r) = self.readers.join_next().await {
                if let Ok((_, Some(s))) = r {
                    streams.push(s);
                }
            }
            while self.arrived < self.lanes {
                match self.incoming.recv().await {
                    Some(s) => {
                        self.arrived += 1;
                        streams.push(s);
                    }
                    None => break,
                }
            }
            for mut s in streams {
                let _ = tokio::io::copy(&mut s, &mut tokio::io::sink()).await;
            }
        }))
    }
}

async fn read_notices(
    s: &mut KvInbound,
    landing: Arc<Landing>,
    (checksum, registration): (bool, u64),
    tl: Arc<Mutex<String>>,
) -> Result<(), TransportError> {
    while let Some(n) = wire::read_frame::<KvLandedNotice, _>(s).await? {
        if n.registration != registration {
            return Err(TransportError::Codec(format!(
                "a notice names registration {:#x}; this transfer's is {registration:#x}",
                n.registration
            )));
        }
        // A CUDA IPC transfer's copies land in device memory (`kv::ipc`), which only the
        // header check applies to; host memory (UCX) can be checksummed.
        let segs = match landing.region.memory() {
            RegionMemory::Device(_) if !checksum => landing.accept_any(&n.piece)?,
            _ => landing.accept(&n.piece)?,
        };
        if tl.lock().is_empty() {
            tl.lock().clone_from(&n.tl);
        }
        if checksum {
            // SAFETY: `accept` checked the positions are the region's, and the flush before
            // the notice means the puts have finished writing them.
            let got = unsafe { Checksum::of_runs(&segs) };
            if n.checksum != Some(got) {
                return Err(TransportError::Codec(format!(
                    "layer {} positions {}..{}: the landed bytes' checksum is {got:#x}, the sender's {}",
                    n.piece.layer,
                    n.piece.first_pos,
                    n.piece.first_pos + n.piece.num_pos,
                    n.checksum.map_or("missing".to_string(), |c| format!("{c:#x}"))
                )));
            }
        }
        landing
            .bytes
            .fetch_add(n.piece.payload_bytes, std::sync::atomic::Ordering::Relaxed);
        landing.landed(&n.piece);
    }
    Ok(())
}

#[cfg(test)]
mod tests;
