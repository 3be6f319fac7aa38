//! KV over byte streams: QUIC unidirectional streams or TCP connections, the same framing
//! and the same code on both (see the parent module for the format).
//!
//! The sender runs one writer task per stream; layer `l` goes to stream `l % streams`, so a
//! layer's pieces stay in order while different layers move in parallel. Payloads leave the
//! prefill worker's KV pool without a copy in user space: QUIC takes each run of positions
//! as a buffer that borrows the pool, TCP hands the runs to one `writev`. The receiver runs
//! one reader per stream, each reading payloads directly into the destination blocks.

use std::collections::HashMap;
use std::io::IoSlice;
use std::net::SocketAddr;
use std::sync::Arc;

use kvmesh_telemetry::RateLimited;
use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Semaphore};
use tokio::task::JoinSet;

use super::{blocks_of, Kind, KvReceiver, KvRegion, KvSender, Landing, Lanes, TransferTotals};
use crate::wire::{self, KvPiece, KvStreamHello, UniHeader};
use crate::TransportError;

/// A KV data stream as the receiver gets it, after its hello.
pub type KvInbound = Box<dyn AsyncRead + Send + Unpin>;

type Job = (usize, usize, usize);

/// Sends a transfer over several byte streams.
pub struct StreamSender(Lanes);

impl StreamSender {
    /// Starts a writer on each stream; each first writes `preamble` (its framed hello).
    fn start<W: PieceWriter + 'static>(target: Target, streams: Vec<(W, Vec<u8>)>) -> Self {
        let target = Arc::new(target);
        let mut lanes = Lanes::new();
        for (w, preamble) in streams {
            lanes.spawn(|rx| write_stream(w, preamble, target.clone(), rx));
        }
        StreamSender(lanes)
    }

    /// Opens `streams` unidirectional streams on `conn` (the connection the decode worker
    /// opened to this prefill worker).
    pub async fn quic(
        conn: &quinn::Connection,
        target: Target,
        secret: u64,
        streams: usize,
    ) -> Result<StreamSender, TransportError> {
        let transfer_id = target.transfer_id;
        let mut out = Vec::new();
        for stream in 0..streams.max(1) {
            let s = conn.open_uni().await?;
            let hello = UniHeader::Kv(KvStreamHello {
                transfer_id,
                secret,
                stream: stream as u32,
            });
            out.push((QuicWriter(s), wire::frame(&hello)?));
        }
        Ok(Self::start(target, out))
    }

    /// Connects `connections` times to the decode worker's KV listener at `addr`.
    pub async fn tcp(
        addr: SocketAddr,
        target: Target,
        secret: u64,
        connections: usize,
    ) -> Result<StreamSender, TransportError> {
        let transfer_id = target.transfer_id;
        let mut out = Vec::new();
        for stream in 0..connections.max(1) {
            let fail = |reason: String| TransportError::Connect { addr, reason };
            let s =
                tokio::time::timeout(std::time::Duration::from_secs(5), TcpStream::connect(addr))
                    .await
                    .map_err(|_| fail("no connection within 5 s".into()))?
                    .map_err(|e| fail(e.to_string()))?;
            let _ = s.set_nodelay(true);
            let hello = KvStreamHello {
                transfer_id,
                secret,
                stream: stream as u32,
            };
            out.push((TcpWriter(s), wire::frame(&hello)?));
        }
        Ok(Self::start(target, out))
    }
}

/// What a stream sender reads from and where the pieces go.
pub struct Target {
    /// The prefill side's memory of the sequence.
    pub source: Arc<KvRegion>,
    pub transfer_id: u64,
    /// The decode side's block table, named in each piece's header.
    pub dest_blocks: Vec<u32>,
    /// The transfer's span: each layer's sending gets a `kv.layer` span under it.
    pub span: tracing::Span,
}

#[async_trait::async_trait]
impl KvSender for StreamSender {
    async fn send(&mut self, layer: usize, first: usize, n: usize) -> Result<(), TransportError> {
        self.0.send(layer, first, n).await
    }

    async fn finish(&mut self) -> Result<TransferTotals, TransportError> {
        self.0.finish().await
    }
}

/// One data stream's writing end.
#[async_trait::async_trait]
trait PieceWriter: Send {
    /// The transport's name, for spans.
    const NAME: &'static str;
    /// Framing: copied.
    async fn bytes(&mut self, b: &[u8]) -> std::io::Result<()>;
    /// A payload: runs of the source region's memory.
    async fn segments(
        &mut self,
        region: &Arc<KvRegion>,
        segs: &[(usize, usize)],
    ) -> std::io::Result<()>;
    async fn close(&mut self) -> std::io::Result<()>;
}

struct TcpWriter(TcpStream);

#[async_trait::async_trait]
impl PieceWriter for TcpWriter {
    const NAME: &'static str = "tcp";
    async fn bytes(&mut self, b: &[u8]) -> std::io::Result<()> {
        self.0.write_all(b).await
    }

    /// One `writev` for many runs: the kernel copies straight from the KV pool.
    async fn segments(
        &mut self,
        _region: &Arc<KvRegion>,
        segs: &[(usize, usize)],
    ) -> std::io::Result<()> {
        // SAFETY: the region's contract: these positions are computed and ours to read.
        let slices: Vec<&[u8]> = segs
            .iter()
            .map(|&(addr, len)| unsafe { std::slice::from_raw_parts(addr as *const u8, len) })
            .collect();
        write_all_vectored(&mut self.0, &slices).await
    }

    async fn close(&mut self) -> std::io::Result<()> {
        self.0.flush().await?;
        self.0.shutdown().await
    }
}

struct QuicWriter(quinn::SendStream);

/// A run of a KV region's memory handed to QUIC without a copy. It keeps the region (and
/// so the blocks' lease) alive until QUIC lets go of it, after the peer acknowledged it, so
/// a retransmission always reads the same bytes.
struct Segment {
    _region: Arc<KvRegion>,
    addr: usize,
    len: usize,
}

impl AsRef<[u8]> for Segment {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: the region's contract: computed positions, readable while it lives.
        unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len) }
    }
}

#[async_trait::async_trait]
impl PieceWriter for QuicWriter {
    const NAME: &'static str = "quic";
    async fn bytes(&mut self, b: &[u8]) -> std::io::Result<()> {
        self.0.write_all(b).await.map_err(std::io::Error::other)
    }

    async fn segments(
        &mut self,
        region: &Arc<KvRegion>,
        segs: &[(usize, usize)],
    ) -> std::io::Result<()> {
        let mut chunks: Vec<bytes::Bytes> = segs
            .iter()
            .map(|&(addr, len)| {
                bytes::Bytes::from_owner(Segment {
                    _region: region.clone(),
                    addr,
                    len,
                })
            })
            .collect();
        self.0
            .write_all_chunks(&mut chunks)
            .await
            .map_err(std::io::Error::other)
    }

    async fn close(&mut self) -> std::io::Result<()> {
        self.0.finish().map_err(std::io::Error::other)
    }
}

async fn write_stream<W: PieceWriter>(
    mut w: W,
    preamble: Vec<u8>,
    target: Arc<Target>,
    mut jobs: mpsc::UnboundedReceiver<Job>,
) -> Result<TransferTotals, TransportError> {
    let region = &target.source;
    let io = |e: std::io::Error| TransportError::Stream(e.to_string());
    w.bytes(&preamble).await.map_err(io)?;
    let mut totals = TransferTotals::default();
    // Each layer of this stream, from its first piece to its last: a span with its bytes
    // and rate (only for sampled transfers).
    let traced = kvmesh_telemetry::is_sampled(&target.span);
    let mut layers: std::collections::HashMap<usize, LayerSpan> = Default::default();
    while let Some((layer, first, n)) = jobs.recv().await {
        if traced && !layers.contains_key(&layer) {
            layers.insert(layer, LayerSpan::open(&target.span, layer, W::NAME));
        }
        let mut segs = region.segments(layer, Kind::K, first, n)?;
        segs.extend(region.segments(layer, Kind::V, first, n)?);
        let payload: usize = segs.iter().map(|s| s.1).sum();
        let header = KvPiece {
            transfer_id: target.transfer_id,
            layer: layer as u32,
            first_pos: first as u32,
            num_pos: n as u32,
            blocks: blocks_of(&target.dest_blocks, region.block_size(), first, n).to_vec(),
            bytes_per_pos: region.bytes_per_pos() as u32,
            payload_bytes: payload as u64,
        };
        let writing = std::time::Instant::now();
        w.bytes(&wire::frame(&header)?).await.map_err(io)?;
        w.segments(region, &segs).await.map_err(io)?;
        totals.bytes += payload as u64;
        totals.pieces += 1;
        if let Some(l) = layers.get_mut(&layer) {
            l.bytes += payload as u64;
            l.pieces += 1;
            l.writing += writing.elapsed();
            if first + n >= region.positions().end {
                if let Some(l) = layers.remove(&layer) {
                    l.close();
                }
            }
        }
    }
    w.close().await.map_err(io)?;
    Ok(totals)
}

/// One layer's sending, as a span: from its first piece to its last (the layer's chunks
/// are computed meanwhile), with the time spent writing and the rate while writing.
pub(super) struct LayerSpan {
    pub(super) span: tracing::Span,
    pub(super) bytes: u64,
    pub(super) pieces: u64,
    pub(super) writing: std::time::Duration,
}

impl LayerSpan {
    pub(super) fn open(parent: &tracing::Span, layer: usize, transport: &str) -> LayerSpan {
        LayerSpan {
            span: tracing::info_span!(
                target: kvmesh_telemetry::TARGET,
                parent: parent,
                "kv.layer",
                layer,
                transport,
                ucx_tl = tracing::field::Empty,
                bytes = tracing::field::Empty,
                pieces = tracing::field::Empty,
                write_ms = tracing::field::Empty,
                gb_per_s = tracing::field::Empty,
            ),
            bytes: 0,
            pieces: 0,
            writing: std::time::Duration::ZERO,
        }
    }

    pub(super) fn close(self) {
        let secs = self.writing.as_secs_f64();
        self.span.record("bytes", self.bytes);
        self.span.record("pieces", self.pieces);
        self.span.record("write_ms", secs * 1e3);
        self.span
            .record("gb_per_s", self.bytes as f64 / secs.max(1e-9) / 1e9);
    }
}

/// Writes every slice, as few calls as the writer allows.
async fn write_all_vectored<W: AsyncWrite + Unpin>(
    w: &mut W,
    slices: &[&[u8]],
) -> std::io::Result<()> {
    let mut bufs: Vec<IoSlice> = slices.iter().map(|s| IoSlice::new(s)).collect();
    let mut rest: &mut [IoSlice] = &mut bufs;
    IoSlice::advance_slices(&mut rest, 0);
    while !rest.is_empty() {
        let n = w.write_vectored(rest).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut rest, n);
    }
    Ok(())
}

/// Receives a transfer from the streams delivered to it (see [`KvInbox`]).
pub struct StreamReceiver {
    landing: Arc<Landing>,
    incoming: mpsc::UnboundedReceiver<KvInbound>,
    expected: usize,
}

impl StreamReceiver {
    pub fn new(
        landing: Arc<Landing>,
        incoming: mpsc::UnboundedReceiver<KvInbound>,
        expected: usize,
    ) -> StreamReceiver {
        StreamReceiver {
            landing,
            incoming,
            expected: expected.max(1),
        }
    }
}

#[async_trait::async_trait]
impl KvReceiver for StreamReceiver {
    async fn complete(&mut self) -> Result<TransferTotals, TransportError> {
        let mut readers = JoinSet::new();
        let (mut arrived, mut finished) = (0, 0);
        while finished < self.expected {
            tokio::select! {
                s = self.incoming.recv(), if arrived < self.expected => match s {
                    Some(s) => {
                        arrived += 1;
                        readers.spawn(read_stream(s, self.landing.clone()));
                    }
                    None => return Err(TransportError::Stream(
                        "the transfer was closed before its streams arrived".into())),
                },
                Some(r) = readers.join_next(), if !readers.is_empty() => {
                    r.map_err(|e| TransportError::Stream(format!("KV reader: {e}")))??;
                    finished += 1;
                }
            }
        }
        if !self.landing.is_complete() {
            return Err(TransportError::Stream(format!(
                "the KV streams ended early: {}",
                self.landing.missing()
            )));
        }
        Ok(self.landing.totals())
    }

    fn landed_bytes(&self) -> u64 {
        self.landing.landed_bytes()
    }
}

async fn read_stream(mut s: KvInbound, landing: Arc<Landing>) -> Result<(), TransportError> {
    let io = |e: std::io::Error| TransportError::Stream(e.to_string());
    while let Some(piece) = wire::read_frame::<KvPiece, _>(&mut s).await? {
        for (addr, len) in landing.accept(&piece)? {
            // SAFETY: `accept` checked the positions are inside the region, which owns them
            // for writing while it lives (the lease held by `landing`).
            let dst = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) };
            s.read_exact(dst).await.map_err(io)?;
            landing
                .bytes
                .fetch_add(len as u64, std::sync::atomic::Ordering::Relaxed);
        }
        landing.landed(&piece);
    }
    Ok(())
}

/// Where a decode worker's incoming KV streams find their transfer: transfers register
/// (id, secret) before asking for KV; streams that name an unknown transfer or the wrong
/// secret are refused.
#[derive(Clone, Default)]
pub struct KvInbox {
    /// transfer id → (secret, where its streams go)
    inner: Arc<Mutex<HashMap<u64, Waiting>>>,
}

type Waiting = (u64, mpsc::UnboundedSender<KvInbound>);

/// A registration; removed from the inbox when dropped.
pub struct InboxEntry {
    inbox: KvInbox,
    transfer_id: u64,
}

impl Drop for InboxEntry {
    fn drop(&mut self) {
        self.inbox.inner.lock().remove(&self.transfer_id);
    }
}

/// Why an inbound KV stream found no transfer to join.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum DeliverError {
    #[error("transfer {0} has ended")]
    Ended(u64),
    #[error("a stream for transfer {0} had the wrong secret")]
    WrongSecret(u64),
    #[error("no transfer {0} is waiting")]
    NotWaiting(u64),
}

impl KvInbox {
    pub fn register(
        &self,
        transfer_id: u64,
        secret: u64,
    ) -> (InboxEntry, mpsc::UnboundedReceiver<KvInbound>) {
        let (tx, rx) = mpsc::unbounded_channel();
        self.inner.lock().insert(transfer_id, (secret, tx));
        (
            InboxEntry {
                inbox: self.clone(),
                transfer_id,
            },
            rx,
        )
    }

    /// Hands a stream to its transfer.
    pub fn deliver(&self, hello: &KvStreamHello, s: KvInbound) -> Result<(), DeliverError> {
        let inner = self.inner.lock();
        let id = hello.transfer_id;
        match inner.get(&id) {
            Some((secret, tx)) if *secret == hello.secret => {
                tx.send(s).map_err(|_| DeliverError::Ended(id))
            }
            Some(_) => Err(DeliverError::WrongSecret(id)),
            None => Err(DeliverError::NotWaiting(id)),
        }
    }

    /// How many transfers are registered.
    pub fn len(&self) -> usize {
        self.inner.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Accepts KV connections on a TCP listener until it fails. Anyone who can reach the
    /// port can connect, so nothing is committed before a connection proves it belongs to a
    /// transfer: it must open with a hello (a frame of at most `KvStreamHello::MAX_BYTES`)
    /// within `HELLO_TIMEOUT`, and at most `MAX_UNIDENTIFIED` connections wait for theirs;
    /// one more is closed at once. Refusals are logged with the peer's address, a line every
    /// few seconds at most.
    pub async fn serve_tcp(self, listener: Arc<TcpListener>) {
        let waiting = Arc::new(Semaphore::new(MAX_UNIDENTIFIED));
        let log = Arc::new(Mutex::new(RateLimited::default()));
        loop {
            let (mut s, peer) = match listener.accept().await {
                Ok(x) => x,
                Err(e) => {
                    tracing::warn!("KV listener: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    continue;
                }
            };
            let Ok(permit) = waiting.clone().try_acquire_owned() else {
                refused(
                    &log,
                    peer,
                    "too many connections are waiting for their hello",
                );
                continue;
            };
            let _ = s.set_nodelay(true);
            let inbox = self.clone();
            let log = log.clone();
            tokio::spawn(async move {
                let hello = tokio::time::timeout(
                    HELLO_TIMEOUT,
                    wire::read_frame::<KvStreamHello, _>(&mut s),
                )
                .await;
                drop(permit);
                let why = match hello {
                    Ok(Ok(Some(h))) => match inbox.deliver(&h, Box::new(s)) {
                        Ok(()) => return,
                        Err(e) => e.to_string(),
                    },
                    Ok(Ok(None)) => "it closed before its hello".to_string(),
                    Ok(Err(e)) => format!("its hello was bad: {e}"),
                    Err(_) => format!("no hello within {HELLO_TIMEOUT:?}"),
                };
                refused(&log, peer, &why);
            });
        }
    }
}

/// Connections waiting for their hello, at most; more are closed as they arrive.
pub const MAX_UNIDENTIFIED: usize = 64;

/// How long a connection has to send its hello (the sender writes it as soon as it has
/// connected).
pub const HELLO_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

fn refused(log: &Mutex<RateLimited>, peer: SocketAddr, why: &str) {
    let mut log = log.lock();
    if log.ready() {
        tracing::warn!(
            "KV connection from {peer} refused: {why}{}",
            log.suppressed_note()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::tests::region;

    fn fill(mem: &mut [Vec<u8>]) {
        for (i, m) in mem.iter_mut().enumerate() {
            for (j, b) in m.iter_mut().enumerate() {
                *b = (i * 31 + j * 7) as u8;
            }
        }
    }

    /// A transfer over TCP on loopback lands exactly the source's bytes at the destination's
    /// blocks, and nothing outside the transfer's positions.
    #[tokio::test]
    async fn tcp_transfer_lands_every_byte_in_place() {
        let mut src = vec![vec![0u8; 6 * 4 * 8]; 4];
        fill(&mut src);
        let mut dst = vec![vec![0u8; 6 * 4 * 8]; 4];
        // Source holds positions 0..14 in blocks 5,1,2,0; destination in 3,4,0,1.
        let (from, to) = (4, 14);
        let src_region = Arc::new(region(&mut src, vec![5, 1, 2, 0], from..to));
        let dst_region = region(&mut dst, vec![3, 4, 0, 1], from..to);
        let landing = Arc::new(Landing::new(dst_region, 77));

        let inbox = KvInbox::default();
        let (_entry, rx) = inbox.register(77, 1234);
        let listener = Arc::new(TcpListener::bind("127.0.0.1:0").await.unwrap());
        let addr = listener.local_addr().unwrap();
        tokio::spawn(inbox.clone().serve_tcp(listener));
        let mut recv = StreamReceiver::new(landing.clone(), rx, 2);
        let receiving = tokio::spawn(async move { recv.complete().await });

        let target = Target {
            source: src_region,
            transfer_id: 77,
            dest_blocks: vec![3, 4, 0, 1],
            span: tracing::Span::none(),
        };
        let mut send = StreamSender::tcp(addr, target, 1234, 2).await.unwrap();
        // Layer 0 in two chunks, layer 1 in one.
        send.send(0, 4, 5).await.unwrap();
        send.send(1, 4, 10).await.unwrap();
        send.send(0, 9, 5).await.unwrap();
        let sent = send.finish().await.unwrap();
        let got = receiving.await.unwrap().unwrap();
        assert_eq!(sent, got);
        assert_eq!(got.bytes, 2 * 2 * 10 * 8);
        assert_eq!(got.pieces, 3);
        let (sb, db) = ([5usize, 1, 2, 0], [3usize, 4, 0, 1]);
        for buf in 0..4 {
            for pos in 0..16 {
                let s = (sb[pos / 4] * 4 + pos % 4) * 8;
                let d = (db[pos / 4] * 4 + pos % 4) * 8;
                let want = if (from..to).contains(&pos) {
                    &src[buf][s..s + 8]
                } else {
                    &[0u8; 8][..]
                };
                assert_eq!(&dst[buf][d..d + 8], want, "buffer {buf} position {pos}");
            }
        }
    }

    #[tokio::test]
    async fn a_short_transfer_and_a_wrong_secret_are_errors() {
        let mut src = vec![vec![1u8; 4 * 4 * 8]; 4];
        let mut dst = vec![vec![0u8; 4 * 4 * 8]; 4];
        let src_region = Arc::new(region(&mut src, vec![0, 1, 2], 0..12));
        let landing = Arc::new(Landing::new(region(&mut dst, vec![0, 1, 2], 0..12), 5));
        let inbox = KvInbox::default();
        let (_entry, rx) = inbox.register(5, 42);
        let listener = Arc::new(TcpListener::bind("127.0.0.1:0").await.unwrap());
        let addr = listener.local_addr().unwrap();
        tokio::spawn(inbox.clone().serve_tcp(listener));
        // The wrong secret is refused at the inbox.
        let bad = KvStreamHello {
            transfer_id: 5,
            secret: 41,
            stream: 0,
        };
        assert!(inbox.deliver(&bad, Box::new(tokio::io::empty())).is_err());
        let mut recv = StreamReceiver::new(landing, rx, 1);
        let receiving = tokio::spawn(async move { recv.complete().await });
        let target = Target {
            source: src_region,
            transfer_id: 5,
            dest_blocks: vec![0, 1, 2],
            span: tracing::Span::none(),
        };
        let mut send = StreamSender::tcp(addr, target, 42, 1).await.unwrap();
        send.send(0, 0, 12).await.unwrap(); // layer 1 never sent
        send.finish().await.unwrap();
        let e = receiving.await.unwrap().unwrap_err().to_string();
        assert!(e.contains("layer 1"), "{e}");
    }
}
