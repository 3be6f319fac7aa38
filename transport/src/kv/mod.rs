//! KV transfers: a prefill worker's K and V, moved layer by layer into blocks a decode worker
//! reserved for them.
//!
//! # The exchange
//!
//! 1. The decode worker reserves blocks for the whole prompt (its own prefix cache covers the
//!    first `from_pos` positions), registers a transfer id, and sends a [`PrefillRequest`](crate::wire::PrefillRequest) on
//!    a QUIC stream to the prefill worker: the prompt, the sampling parameters, `from_pos`,
//!    its block table, its [`KvLayout`](crate::wire::KvLayout), and where the bytes should go ([`DataPath`](crate::wire::DataPath)).
//! 2. The prefill worker refuses a layout unlike its own (a message naming both), else runs
//!    the prompt. As each layer's K and V are computed (chunk by chunk for long prompts) it
//!    sends that layer's new positions as one piece, on one of several data streams.
//! 3. When every layer is sent it closes the data streams and answers on the request stream
//!    with [`PrefillEvent::Done`](crate::wire::PrefillEvent::Done): the first token, the sampler's state, its cache hits, and a hybrid model's recurrent state.
//! 4. The decode worker starts decoding once every position of every layer has landed and
//!    `Done` has arrived. Anything else (a closed stream, a gap, a stall past the timeout)
//!    ends the transfer; the decode worker then prefills locally.
//!
//! # Framing
//!
//! Every data stream opens with a [`KvStreamHello`](crate::wire::KvStreamHello) frame (transfer id, a per-transfer secret,
//! stream index). Then pieces: a [`KvPiece`](crate::wire::KvPiece) header frame (an rkyv archive behind a `u32`
//! length, as every message in `wire`) followed by `payload_bytes` raw bytes: the K of
//! positions `first_pos .. first_pos + num_pos` of `layer`, then their V. Pieces of one layer
//! always travel on the same stream (layer `l` on stream `l % streams`), in order, so the
//! receiver checks that each starts where the previous one ended.
//!
//! # Memory
//!
//! Both sides name memory through a [`KvRegion`]: for each layer the base address of its K
//! and of its V buffer (`[num_blocks, block_size, kv_heads, head_dim]`, so one block's
//! positions are contiguous), the sequence's block table, and the range of positions the
//! transfer owns. The receiver reads each payload **straight into the destination blocks**:
//! every run of positions inside one block is one `read_exact` into that block's bytes, with
//! no buffer in between. The sender writes from its own cache the same way.
//!
//! # Transports
//!
//! One pair of traits, [`KvSender`] and [`KvReceiver`], over:
//! - QUIC (`streams`): several unidirectional streams on the connection the decode worker
//!   opened, with windows sized for bulk transfer (see `transport_config`);
//! - TCP (`streams`, the same code): plain connections from the prefill worker to the decode
//!   worker's KV listener, for trusted networks, as a baseline;
//! - in-process (`local`): both roles in one process; the sender copies each piece from one
//!   pool into the other (a single `memcpy`), no framing, no socket. Two engines on GPUs
//!   lend their device caches' blocks instead ([`RegionMemory::Device`]), and the piece is
//!   copied on the device by the engine's [`DeviceCopy`]; every other transport refuses a
//!   device region ([`TransportError::DeviceMemory`]).
//!
//! RDMA slots in beside them without changing either side's logic: the decode worker
//! registers its pool as memory regions at start-up and puts, in the `DataPath`, the remote
//! address and key of each destination block instead of a stream address. A `KvSender` for
//! RDMA posts one-sided RDMA WRITEs from the source segments (also registered) to those
//! addresses, one per run of positions, exactly where `local` calls `memcpy`; `finish` posts a
//! WRITE-with-immediate (or a SEND) carrying the transfer id, and the decode worker's
//! `KvReceiver` completes when that completion arrives on its queue pair. Coverage needs no
//! per-piece check there: the writes cannot land outside the registered blocks.

pub mod ipc;
pub mod local;
pub mod streams;
pub mod ucx;

use std::any::Any;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::wire::KvPiece;
use crate::TransportError;

/// K or V.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    K,
    V,
}

/// A sequence's KV memory as a transfer sees it. See the module docs.
pub struct KvRegion {
    k: Vec<usize>,
    v: Vec<usize>,
    layer_bytes: usize,
    bytes_per_pos: usize,
    block_size: usize,
    blocks: Vec<u32>,
    positions: Range<usize>,
    memory: RegionMemory,
    /// Keeps the memory (and the blocks' ownership) alive as long as the region.
    _keepalive: Arc<dyn Any + Send + Sync>,
}

impl KvRegion {
    /// # Safety
    /// For every layer, `k[l]` and `v[l]` must point to `layer_bytes` bytes laid out as
    /// `[blocks, block_size, bytes_per_pos]`, valid while `keepalive` lives; every block in
    /// `blocks` must lie inside them; and the positions in `positions` of those blocks must be
    /// this region's alone to read (sender) or write (receiver) while it lives.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn new(
        k: Vec<*mut u8>,
        v: Vec<*mut u8>,
        layer_bytes: usize,
        bytes_per_pos: usize,
        block_size: usize,
        blocks: Vec<u32>,
        positions: Range<usize>,
        keepalive: Arc<dyn Any + Send + Sync>,
    ) -> KvRegion {
        KvRegion {
            k: k.into_iter().map(|p| p as usize).collect(),
            v: v.into_iter().map(|p| p as usize).collect(),
            layer_bytes,
            bytes_per_pos,
            block_size,
            blocks,
            positions,
            memory: RegionMemory::Host,
            _keepalive: keepalive,
        }
    }

    /// The same addresses, as device memory of this process that `copy` moves: only an
    /// in-process transfer ([`local`]) reads or writes such a region; every other transport
    /// refuses it.
    ///
    /// # Safety
    /// `new`'s contract, for device addresses on the device `copy` copies on.
    pub unsafe fn on_device(mut self, copy: Arc<dyn DeviceCopy>) -> KvRegion {
        self.memory = RegionMemory::Device(copy);
        self
    }

    pub fn memory(&self) -> &RegionMemory {
        &self.memory
    }

    pub fn num_layers(&self) -> usize {
        self.k.len()
    }

    pub fn bytes_per_pos(&self) -> usize {
        self.bytes_per_pos
    }

    pub fn positions(&self) -> Range<usize> {
        self.positions.clone()
    }

    pub fn blocks(&self) -> &[u32] {
        &self.blocks
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The blocks positions `first .. first + n` fall in.
    pub fn blocks_of(&self, first: usize, n: usize) -> &[u32] {
        blocks_of(&self.blocks, self.block_size, first, n)
    }

    /// The memory of `kind` for positions `first .. first + n` of `layer`: one
    /// `(address, length)` per block touched, in position order.
    /// Host memory only: a device region's bytes cannot be read or written from here.
    pub fn segments(
        &self,
        layer: usize,
        kind: Kind,
        first: usize,
        n: usize,
    ) -> Result<Vec<(usize, usize)>, TransportError> {
        if let RegionMemory::Device(c) = &self.memory {
            return Err(TransportError::DeviceMemory { device: c.device() });
        }
        self.any_segments(layer, kind, first, n)
    }

    /// `segments` in host or device memory, for a transfer that copies with the region's
    /// own [`DeviceCopy`] where it is on a device.
    pub(crate) fn any_segments(
        &self,
        layer: usize,
        kind: Kind,
        first: usize,
        n: usize,
    ) -> Result<Vec<(usize, usize)>, TransportError> {
        if layer >= self.k.len() {
            return Err(TransportError::Codec(format!(
                "layer {layer} does not exist (the region has {})",
                self.k.len()
            )));
        }
        if first < self.positions.start || first + n > self.positions.end {
            return Err(TransportError::Codec(format!(
                "positions {first}..{} are outside the transfer's {}..{}",
                first + n,
                self.positions.start,
                self.positions.end
            )));
        }
        let base = match kind {
            Kind::K => self.k[layer],
            Kind::V => self.v[layer],
        };
        block_runs(&self.blocks, self.block_size, self.bytes_per_pos, first, n)?
            .into_iter()
            .map(|(start, len)| {
                if start + len > self.layer_bytes {
                    Err(TransportError::Codec(format!(
                        "block {} is outside the KV pool",
                        start / (self.block_size * self.bytes_per_pos)
                    )))
                } else {
                    Ok((base + start, len))
                }
            })
            .collect()
    }
}

/// Where a region's bytes are.
#[derive(Clone)]
pub enum RegionMemory {
    /// Host memory: every transport reads and writes it.
    Host,
    /// A GPU's memory in this process, moved only by its copier (in-process transfers).
    Device(Arc<dyn DeviceCopy>),
}

/// Copies between device addresses of this process: the engine's, behind a trait so that
/// the transport needs no GPU library.
pub trait DeviceCopy: Send + Sync {
    /// The device's ordinal: equal for two regions on one device.
    fn device(&self) -> u32;

    /// Copies every `(source, destination, length)` run, the destinations on `dst_device`,
    /// and returns once all have landed.
    ///
    /// # Safety
    /// Every run's source must be readable and its destination writable device memory, lent
    /// to this copy until it returns, with no overlap between them.
    unsafe fn copy(&self, runs: &[(usize, usize, usize)], dst_device: u32) -> Result<(), String>;

    /// Makes the device's context current on the calling thread (UCX's, before it
    /// registers or reads this memory).
    fn bind_thread(&self) -> Result<(), String>;
}

/// Where positions `first .. first + n` of a sequence lie in one layer's buffer laid out as
/// `[blocks, block_size, bytes_per_pos]`, with `table` its block table: one `(offset,
/// length)` in bytes per block touched, in position order.
pub fn block_runs(
    table: &[u32],
    block_size: usize,
    bytes_per_pos: usize,
    first: usize,
    n: usize,
) -> Result<Vec<(usize, usize)>, TransportError> {
    let mut out = Vec::new();
    let mut p = first;
    while p < first + n {
        let bi = p / block_size;
        let block = *table
            .get(bi)
            .ok_or_else(|| TransportError::Codec(format!("no block for position {p}")))?
            as usize;
        let off = p % block_size;
        let run = (block_size - off).min(first + n - p);
        out.push((
            (block * block_size + off) * bytes_per_pos,
            run * bytes_per_pos,
        ));
        p += run;
    }
    Ok(out)
}

/// Pairs two lists of runs of the same total length into `(source, destination, length)`
/// copies: each copy lies inside one source run and one destination run.
pub fn pair_runs(src: &[(usize, usize)], dst: &[(usize, usize)]) -> Vec<(usize, usize, usize)> {
    let mut out = Vec::new();
    let (mut si, mut so, mut di, mut doff) = (0, 0, 0, 0);
    while si < src.len() && di < dst.len() {
        let n = (src[si].1 - so).min(dst[di].1 - doff);
        if n > 0 {
            out.push((src[si].0 + so, dst[di].0 + doff, n));
        }
        so += n;
        doff += n;
        if so == src[si].1 {
            si += 1;
            so = 0;
        }
        if doff == dst[di].1 {
            di += 1;
            doff = 0;
        }
    }
    out
}

/// A checksum of bytes fed in any split (a transfer's source and destination runs split
/// differently): 64-bit words mixed in order, the tail padded with zeros.
#[derive(Default)]
pub struct Checksum {
    h: u64,
    tail: [u8; 8],
    fill: usize,
    len: u64,
}

impl Checksum {
    fn word(&mut self, w: u64) {
        self.h = (self.h ^ w)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .rotate_left(27);
    }

    pub fn update(&mut self, mut b: &[u8]) {
        self.len += b.len() as u64;
        if self.fill > 0 {
            let take = (8 - self.fill).min(b.len());
            self.tail[self.fill..self.fill + take].copy_from_slice(&b[..take]);
            self.fill += take;
            b = &b[take..];
            if self.fill < 8 {
                return;
            }
            let w = u64::from_le_bytes(self.tail);
            self.word(w);
            self.fill = 0;
        }
        let mut words = b.chunks_exact(8);
        for w in &mut words {
            self.word(u64::from_le_bytes(w.try_into().expect("8 bytes")));
        }
        let rest = words.remainder();
        self.tail[..rest.len()].copy_from_slice(rest);
        self.fill = rest.len();
    }

    /// The checksum of memory runs.
    ///
    /// # Safety
    /// Every run must be readable.
    pub unsafe fn of_runs(runs: &[(usize, usize)]) -> u64 {
        let mut c = Checksum::default();
        for &(addr, len) in runs {
            // SAFETY: the caller's contract.
            c.update(unsafe { std::slice::from_raw_parts(addr as *const u8, len) });
        }
        c.finish()
    }

    pub fn finish(mut self) -> u64 {
        if self.fill > 0 {
            self.tail[self.fill..].fill(0);
            let w = u64::from_le_bytes(self.tail);
            self.word(w);
        }
        let len = self.len;
        self.word(len);
        self.h
    }
}

/// The entries of a block table that positions `first .. first + n` fall in.
pub fn blocks_of(table: &[u32], block_size: usize, first: usize, n: usize) -> &[u32] {
    if n == 0 || block_size == 0 {
        return &[];
    }
    let (a, b) = (first / block_size, (first + n - 1) / block_size);
    &table[a.min(table.len())..(b + 1).min(table.len())]
}

/// Byte and piece counts of a finished transfer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TransferTotals {
    pub bytes: u64,
    pub pieces: u64,
}

/// The sending half of a transfer (prefill side).
#[async_trait::async_trait]
pub trait KvSender: Send {
    /// Sends positions `first .. first + n` of `layer` from the source region. May return
    /// before the bytes left (queued on a stream); `finish` waits for everything.
    async fn send(&mut self, layer: usize, first: usize, n: usize) -> Result<(), TransportError>;
    /// Every piece has been handed to the transport (or copied, in process).
    async fn finish(&mut self) -> Result<TransferTotals, TransportError>;
}

/// The receiving half (decode side).
#[async_trait::async_trait]
pub trait KvReceiver: Send {
    /// Resolves once every position of every layer in the region has landed.
    async fn complete(&mut self) -> Result<TransferTotals, TransportError>;
    /// Bytes landed so far, for noticing a stalled sender.
    fn landed_bytes(&self) -> u64;
    /// The transport layer under the transfer, where the transport has one to name (UCX's
    /// `tcp`, `cma`, `rc_mlx5`, ...).
    fn transport_layer(&self) -> Option<String> {
        None
    }
    /// After a transfer failed or was given up: resolves once the sender can no longer
    /// write into the destination, for transports whose writes the receiver does not
    /// perform itself (UCX puts). `None`: at once.
    fn quarantine(
        self: Box<Self>,
    ) -> Option<std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>> {
        None
    }
}

/// What has landed of a transfer, checked piece by piece.
pub struct Landing {
    pub region: KvRegion,
    pub transfer_id: u64,
    /// Per layer, the next position expected.
    next: Mutex<Vec<usize>>,
    bytes: AtomicU64,
    pieces: AtomicU64,
}

impl Landing {
    pub fn new(region: KvRegion, transfer_id: u64) -> Landing {
        let start = region.positions().start;
        let layers = region.num_layers();
        Landing {
            region,
            transfer_id,
            next: Mutex::new(vec![start; layers]),
            bytes: AtomicU64::new(0),
            pieces: AtomicU64::new(0),
        }
    }

    /// Checks a piece's header against the region and what already landed; the segments
    /// its payload goes to (K's, then V's). Host memory only.
    fn accept(&self, p: &KvPiece) -> Result<Vec<(usize, usize)>, TransportError> {
        self.check(p)?;
        let (layer, first, n) = (p.layer as usize, p.first_pos as usize, p.num_pos as usize);
        let mut segs = self.region.segments(layer, Kind::K, first, n)?;
        segs.extend(self.region.segments(layer, Kind::V, first, n)?);
        Ok(segs)
    }

    /// `accept` in host or device memory (an in-process transfer copies either way).
    fn accept_any(&self, p: &KvPiece) -> Result<Vec<(usize, usize)>, TransportError> {
        self.check(p)?;
        let (layer, first, n) = (p.layer as usize, p.first_pos as usize, p.num_pos as usize);
        let mut segs = self.region.any_segments(layer, Kind::K, first, n)?;
        segs.extend(self.region.any_segments(layer, Kind::V, first, n)?);
        Ok(segs)
    }

    /// A piece's header against the region and what already landed.
    fn check(&self, p: &KvPiece) -> Result<(), TransportError> {
        let bad = |m: String| Err(TransportError::Codec(m));
        if p.transfer_id != self.transfer_id {
            return bad(format!(
                "a piece of transfer {} arrived on transfer {}",
                p.transfer_id, self.transfer_id
            ));
        }
        if p.bytes_per_pos as usize != self.region.bytes_per_pos {
            return bad(format!(
                "the piece has {} bytes per position, the destination {}",
                p.bytes_per_pos, self.region.bytes_per_pos
            ));
        }
        let (layer, first, n) = (p.layer as usize, p.first_pos as usize, p.num_pos as usize);
        if p.payload_bytes != (2 * n * self.region.bytes_per_pos) as u64 {
            return bad(format!(
                "a piece of {n} positions carries {} bytes",
                p.payload_bytes
            ));
        }
        {
            let next = self.next.lock();
            let Some(&expected) = next.get(layer) else {
                return bad(format!("layer {layer} does not exist"));
            };
            if first != expected {
                return bad(format!(
                    "layer {layer}: a piece starts at position {first}, expected {expected}"
                ));
            }
        }
        if p.blocks.as_slice() != self.region.blocks_of(first, n) {
            return bad(format!(
                "layer {layer}: the piece names blocks {:?}, the reservation has {:?}",
                p.blocks,
                self.region.blocks_of(first, n)
            ));
        }
        Ok(())
    }

    fn landed(&self, p: &KvPiece) {
        self.next.lock()[p.layer as usize] += p.num_pos as usize;
        self.pieces.fetch_add(1, Ordering::Relaxed);
    }

    pub fn landed_bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    /// Whether every layer has every position.
    pub fn is_complete(&self) -> bool {
        let end = self.region.positions().end;
        self.next.lock().iter().all(|&n| n == end)
    }

    /// What is missing, for an error message.
    pub fn missing(&self) -> String {
        let end = self.region.positions().end;
        let next = self.next.lock();
        let short: Vec<String> = next
            .iter()
            .enumerate()
            .filter(|(_, &n)| n != end)
            .take(4)
            .map(|(l, &n)| format!("layer {l} has positions up to {n} of {end}"))
            .collect();
        short.join(", ")
    }

    pub fn totals(&self) -> TransferTotals {
        TransferTotals {
            bytes: self.bytes.load(Ordering::Relaxed),
            pieces: self.pieces.load(Ordering::Relaxed),
        }
    }
}

/// A sender's lanes (streams, connections): layer `l`'s pieces go to lane `l % lanes`, in
/// order, while different layers move in parallel; each lane is a task adding up what it sent.
pub(crate) struct Lanes {
    jobs: Vec<tokio::sync::mpsc::UnboundedSender<(usize, usize, usize)>>,
    tasks: tokio::task::JoinSet<Result<TransferTotals, TransportError>>,
}

impl Lanes {
    pub(crate) fn new() -> Lanes {
        Lanes {
            jobs: Vec::new(),
            tasks: tokio::task::JoinSet::new(),
        }
    }

    /// Starts a lane: `run` gets its jobs, `(layer, first, n)`.
    pub(crate) fn spawn<F>(
        &mut self,
        run: impl FnOnce(tokio::sync::mpsc::UnboundedReceiver<(usize, usize, usize)>) -> F,
    ) where
        F: std::future::Future<Output = Result<TransferTotals, TransportError>> + Send + 'static,
    {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        self.jobs.push(tx);
        self.tasks.spawn(run(rx));
    }

    pub(crate) async fn send(
        &mut self,
        layer: usize,
        first: usize,
        n: usize,
    ) -> Result<(), TransportError> {
        if n == 0 {
            return Ok(());
        }
        let k = layer % self.jobs.len();
        if self.jobs[k].send((layer, first, n)).is_err() {
            // The lane stopped: its error comes out of `finish`.
            return Err(self.finish().await.err().unwrap_or(TransportError::Stopped));
        }
        Ok(())
    }

    /// Closes the lanes and waits for each: the totals, or the first lane's error.
    pub(crate) async fn finish(&mut self) -> Result<TransferTotals, TransportError> {
        self.jobs.clear();
        let mut totals = TransferTotals::default();
        while let Some(r) = self.tasks.join_next().await {
            let t = r.map_err(|e| TransportError::Stream(format!("KV lane: {e}")))??;
            totals.bytes += t.bytes;
            totals.pieces += t.pieces;
        }
        Ok(totals)
    }
}

/// A fresh random 64-bit value (transfer ids and secrets), from the standard library's
/// randomly keyed hasher.
pub fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::KvLayout;

    /// A region over plain vectors: 2 layers, block size 4, 8 bytes per position.
    pub(crate) fn region(
        mem: &mut [Vec<u8>],
        blocks: Vec<u32>,
        positions: Range<usize>,
    ) -> KvRegion {
        let layer_bytes = mem[0].len();
        let ptrs: Vec<*mut u8> = mem.iter_mut().map(|m| m.as_mut_ptr()).collect();
        let (k, v) = (vec![ptrs[0], ptrs[1]], vec![ptrs[2], ptrs[3]]);
        // SAFETY: the test keeps `mem` alive and unaliased while the region is used.
        unsafe { KvRegion::new(k, v, layer_bytes, 8, 4, blocks, positions, Arc::new(())) }
    }

    /// Device memory stood in for by host buffers: copies as a GPU's copier would (every
    /// run at once, host bytes here), and says which runs it was given and for which
    /// destination device.
    pub(crate) struct HostAsDevice {
        pub ordinal: u32,
        pub calls: parking_lot::Mutex<Vec<(usize, u32)>>,
    }

    impl DeviceCopy for HostAsDevice {
        fn device(&self) -> u32 {
            self.ordinal
        }

        unsafe fn copy(&self, runs: &[(usize, usize, usize)], dst: u32) -> Result<(), String> {
            self.calls.lock().push((runs.len(), dst));
            for &(s, d, n) in runs {
                // SAFETY: the trait's contract (host buffers here).
                unsafe { std::ptr::copy_nonoverlapping(s as *const u8, d as *mut u8, n) };
            }
            Ok(())
        }

        fn bind_thread(&self) -> Result<(), String> {
            Ok(())
        }
    }

    pub(crate) fn device(ordinal: u32) -> Arc<HostAsDevice> {
        Arc::new(HostAsDevice {
            ordinal,
            calls: Default::default(),
        })
    }

    #[test]
    fn segments_split_at_block_boundaries_and_stay_inside() {
        let mut mem = vec![vec![0u8; 5 * 4 * 8]; 4];
        let r = region(&mut mem, vec![3, 0, 4], 2..11);
        let base = mem[0].as_ptr() as usize;
        // Positions 2..7: block 3 offsets 2..4, then block 0 offsets 0..3.
        let s = r.segments(0, Kind::K, 2, 5).unwrap();
        assert_eq!(s, vec![(base + (12 + 2) * 8, 16), (base, 24)]);
        assert_eq!(r.blocks_of(2, 5), &[3, 0]);
        assert!(r.segments(0, Kind::K, 1, 2).is_err(), "before the range");
        assert!(r.segments(0, Kind::K, 10, 2).is_err(), "past the range");
        assert!(r.segments(2, Kind::K, 2, 1).is_err(), "no such layer");
    }

    #[test]
    fn landing_checks_order_sizes_and_blocks() {
        let mut mem = vec![vec![0u8; 5 * 4 * 8]; 4];
        let l = Landing::new(region(&mut mem, vec![3, 0, 4], 4..10), 9);
        let piece = |layer, first, n: u32, blocks: Vec<u32>| KvPiece {
            transfer_id: 9,
            layer,
            first_pos: first,
            num_pos: n,
            blocks,
            bytes_per_pos: 8,
            payload_bytes: 2 * n as u64 * 8,
        };
        let p = piece(0, 4, 3, vec![0]);
        assert_eq!(l.accept(&p).unwrap().len(), 2);
        l.landed(&p);
        assert!(l.accept(&piece(0, 4, 3, vec![0])).is_err(), "a repeat");
        assert!(l.accept(&piece(0, 8, 2, vec![4])).is_err(), "a gap");
        assert!(l.accept(&piece(0, 7, 3, vec![0])).is_err(), "wrong blocks");
        let mut wrong_size = piece(1, 4, 1, vec![0]);
        wrong_size.payload_bytes = 3;
        assert!(l.accept(&wrong_size).is_err());
        let mut other = piece(1, 4, 1, vec![0]);
        other.transfer_id = 8;
        assert!(l.accept(&other).is_err());
        assert!(!l.is_complete());
        for p in [piece(0, 7, 3, vec![0, 4]), piece(1, 4, 6, vec![0, 4])] {
            l.accept(&p).unwrap();
            l.landed(&p);
        }
        assert!(l.is_complete(), "{}", l.missing());
    }

    #[test]
    fn layouts_name_both_sides_when_they_differ() {
        let a = KvLayout {
            model: "m".into(),
            dtype: "f32".into(),
            num_layers: 2,
            block_size: 16,
            num_kv_heads: 2,
            head_dim: 8,
        };
        assert_eq!(a.bytes_per_pos(), 64);
        assert!(a.mismatch("p", &a.clone(), "d").is_none());
        let b = KvLayout {
            block_size: 32,
            dtype: "bf16".into(),
            ..a.clone()
        };
        let m = a
            .mismatch("prefill worker p1", &b, "decode worker d1")
            .unwrap();
        assert!(
            m.contains("p1") && m.contains("d1") && m.contains("block size 32"),
            "{m}"
        );
        assert_ne!(random_u64(), random_u64());
    }
}
