//! The KV cache in device memory, and its copies to and from the host for KV transfers.
//!
//! Per layer, K and V are each `[num_blocks + 1, block_size, num_kv_heads, head_dim]` bf16,
//! as on the CPU; the block past the scheduler's pool is the scratch block decode graphs pad
//! with. A transfer moves whole blocks through one page-locked (pinned) host buffer, which
//! the DMA engine reads and writes directly.

use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

use super::device::{drv, upload_err};
use super::ipc::Exported;
use crate::backend::error::KvCopyError;
use crate::config::ModelConfig;
use crate::device_kv::PoolExport;
use crate::error::Result;
use crate::kv_cache::BlockId;
use crate::kv_pool::{HostKvPool, KvDtype, KvKind, KvSpec};

pub struct KvCache {
    pub k: Vec<CudaSlice<u16>>,
    pub v: Vec<CudaSlice<u16>>,
    /// Blocks the scheduler may use (the scratch block is not among them).
    pub num_blocks: usize,
    spec: KvSpec,
    stream: Arc<CudaStream>,
    /// Where `k` and `v` go when the cache is dropped, to be freed with the last device
    /// pool handle (`handover::device_pool`): a transfer may still be copying into them.
    parked: Arc<Parked>,
}

/// A dropped cache's buffers, kept for the device pools that still address them; for an
/// exportable cache, the one allocation every layer's K and V lie in.
#[derive(Default)]
pub struct Parked {
    slices: parking_lot::Mutex<Vec<CudaSlice<u16>>>,
    region: Option<Exported>,
}

impl Drop for KvCache {
    fn drop(&mut self) {
        if self.parked.region.is_some() {
            // Views into the region, which is freed with `parked`, not slice by slice.
            for s in self.k.drain(..).chain(self.v.drain(..)) {
                s.leak();
            }
            return;
        }
        let mut p = self.parked.slices.lock();
        p.append(&mut self.k);
        p.append(&mut self.v);
    }
}

impl KvCache {
    /// The cache of `layers` layers as `opts` asks: exportable (`kv_exportable`, which fails
    /// without it), one region where the driver allows it (`kv_one_allocation`), or per
    /// layer.
    pub fn alloc_as(
        opts: &crate::backend::CudaOptions,
        stream: &Arc<CudaStream>,
        (ordinal, cfg, layers): (usize, &ModelConfig, usize),
        num_blocks: usize,
        block_size: usize,
    ) -> Result<KvCache> {
        let one = || Self::alloc_exportable(stream, ordinal, cfg, layers, num_blocks, block_size);
        if opts.kv_exportable {
            return one();
        }
        if opts.kv_one_allocation {
            match one() {
                Ok(kv) => return Ok(kv),
                Err(e) => tracing::warn!(
                    device = ordinal,
                    error = %e,
                    "the KV cache cannot be one exportable region here; it is allocated per \
                     layer, and UCX moves KV through host memory"
                ),
            }
        }
        Self::alloc_layers(stream, ordinal, cfg, layers, num_blocks, block_size)
    }

    /// Zeroed K and V for `num_blocks` blocks plus the scratch block, in each of `layers`
    /// layers (a hybrid model's full-attention layers only).
    pub fn alloc_layers(
        stream: &Arc<CudaStream>,
        ordinal: usize,
        cfg: &ModelConfig,
        layers: usize,
        num_blocks: usize,
        block_size: usize,
    ) -> Result<KvCache> {
        let per_layer = (num_blocks + 1) * block_size * cfg.kv_dim();
        let zeros = || {
            stream
                .alloc_zeros::<u16>(per_layer)
                .map_err(|e| upload_err(ordinal, "the KV cache", e))
        };
        let mut k = Vec::with_capacity(layers);
        let mut v = Vec::with_capacity(layers);
        for _ in 0..layers {
            k.push(zeros()?);
            v.push(zeros()?);
        }
        Ok(Self::of(
            stream,
            cfg,
            (k, v),
            num_blocks,
            block_size,
            Parked::default(),
        ))
    }

    /// A cache of the buffers `k` and `v` (a layer each), which `parked` keeps as it says.
    fn of(
        stream: &Arc<CudaStream>,
        cfg: &ModelConfig,
        (k, v): (Vec<CudaSlice<u16>>, Vec<CudaSlice<u16>>),
        num_blocks: usize,
        block_size: usize,
        parked: Parked,
    ) -> KvCache {
        KvCache {
            spec: KvSpec {
                num_layers: k.len(),
                block_size,
                num_kv_heads: cfg.num_kv_heads,
                head_dim: cfg.head_dim,
                dtype: KvDtype::Bf16,
            },
            k,
            v,
            num_blocks,
            stream: stream.clone(),
            parked: Arc::new(parked),
        }
    }

    /// As `alloc_layers`, in one allocation another process of this host can map (CUDA IPC,
    /// `ipc::Exported`): per layer K then V, each `[num_blocks + 1, block_size, kv_dim]`.
    pub fn alloc_exportable(
        stream: &Arc<CudaStream>,
        ordinal: usize,
        cfg: &ModelConfig,
        layers: usize,
        num_blocks: usize,
        block_size: usize,
    ) -> Result<KvCache> {
        let per_layer = (num_blocks + 1) * block_size * cfg.kv_dim();
        let region = Exported::alloc(stream.context(), 2 * layers * per_layer * 2)?;
        let base = region.device_ptr();
        // Zeroed whole before any view exists, so that no error path drops (frees) a view.
        // SAFETY: the region's own bytes, on this stream.
        unsafe {
            cudarc::driver::result::memset_d8_async(base, 0, region.len(), stream.cu_stream())
        }
        .map_err(|e| upload_err(ordinal, "the KV cache", e))?;
        let mut k = Vec::with_capacity(layers);
        let mut v = Vec::with_capacity(layers);
        for l in 0..layers {
            for (i, out) in [(2 * l, &mut k), (2 * l + 1, &mut v)] {
                let at = base + (i * per_layer * 2) as u64;
                // SAFETY: `per_layer` bf16 inside the region, which `parked` keeps until the
                // cache is dropped, when the views are leaked rather than freed.
                out.push(unsafe { stream.upgrade_device_ptr::<u16>(at, per_layer) });
            }
        }
        let parked = Parked {
            slices: Default::default(),
            region: Some(region),
        };
        Ok(Self::of(
            stream,
            cfg,
            (k, v),
            num_blocks,
            block_size,
            parked,
        ))
    }

    /// How another process maps the cache, when it was allocated exportable.
    pub fn export(&self) -> Option<PoolExport> {
        self.parked.region.as_ref().map(|r| PoolExport {
            handle: r.handle().bytes,
            len: r.len() as u64,
            base: r.device_ptr(),
        })
    }

    /// The device address of `layer`'s K or V buffer.
    pub fn address(&self, layer: usize, kind: KvKind) -> u64 {
        let buf = match kind {
            KvKind::K => &self.k[layer],
            KvKind::V => &self.v[layer],
        };
        let (p, _record) = buf.device_ptr(&self.stream);
        p
    }

    /// What keeps the buffers alive past the cache (see `parked`).
    pub fn keep(&self) -> Arc<dyn std::any::Any + Send + Sync> {
        self.parked.clone()
    }

    pub fn spec(&self) -> &KvSpec {
        &self.spec
    }

    pub fn block_size(&self) -> usize {
        self.spec.block_size
    }

    /// bf16 elements of one block in one layer, for K or for V.
    fn block_elems(&self) -> usize {
        self.spec.block_size * self.spec.kv_dim()
    }

    /// The K and V of `blocks` in `layer`, as little-endian bf16 bytes, block after block,
    /// each block its K `[block_size, num_kv_heads, head_dim]` then its V.
    ///
    /// The blocks are gathered on the device into one buffer and copied out in a single
    /// transfer through pinned memory; the pinned buffer is allocated per call (not kept)
    /// for now.
    pub fn copy_blocks_out(&self, layer: usize, blocks: &[BlockId]) -> Result<Vec<u8>> {
        let per = self.block_elems();
        self.check_blocks(layer, blocks)?;
        if blocks.is_empty() {
            return Ok(Vec::new());
        }
        let s = &self.stream;
        s.context()
            .bind_to_thread()
            .map_err(|e| drv("binding the context", e))?;
        let n = blocks.len() * 2 * per;
        let mut staging = s
            .alloc_zeros::<u16>(n)
            .map_err(|e| drv("KV staging buffer", e))?;
        for (i, b) in blocks.iter().enumerate() {
            let src = b.0 as usize * per;
            let dst = i * 2 * per;
            s.memcpy_dtod(
                &self.k[layer].slice(src..src + per),
                &mut staging.slice_mut(dst..dst + per),
            )
            .map_err(|e| drv("KV block copy", e))?;
            s.memcpy_dtod(
                &self.v[layer].slice(src..src + per),
                &mut staging.slice_mut(dst + per..dst + 2 * per),
            )
            .map_err(|e| drv("KV block copy", e))?;
        }
        // SAFETY: the buffer is fully overwritten by the copy below before it is read.
        let mut pinned = unsafe { s.context().alloc_pinned_with_flags::<u16>(n, 0) }
            .map_err(|e| drv("pinned host buffer", e))?;
        s.memcpy_dtoh(&staging, &mut pinned)
            .map_err(|e| drv("KV copy to host", e))?;
        s.synchronize().map_err(|e| drv("KV copy to host", e))?;
        let host = pinned
            .as_slice()
            .map_err(|e| drv("reading the pinned buffer", e))?;
        let mut out = Vec::with_capacity(2 * n);
        for v in host {
            out.extend_from_slice(&v.to_le_bytes());
        }
        Ok(out)
    }

    /// The inverse of `copy_blocks_out`: writes `bytes` (the same layout) into `blocks` of
    /// `layer`, through a pinned buffer and one host-to-device transfer.
    pub fn copy_blocks_in(&mut self, layer: usize, blocks: &[BlockId], bytes: &[u8]) -> Result<()> {
        let per = self.block_elems();
        self.check_blocks(layer, blocks)?;
        let n = blocks.len() * 2 * per;
        if bytes.len() != 2 * n {
            return Err(KvCopyError::Bytes {
                blocks: blocks.len(),
                expected: 2 * n,
                got: bytes.len(),
            }
            .into());
        }
        if blocks.is_empty() {
            return Ok(());
        }
        let s = self.stream.clone();
        s.context()
            .bind_to_thread()
            .map_err(|e| drv("binding the context", e))?;
        // SAFETY: every element is written below before the copy reads it.
        let mut pinned = unsafe { s.context().alloc_pinned_with_flags::<u16>(n, 0) }
            .map_err(|e| drv("pinned host buffer", e))?;
        {
            let host = pinned
                .as_mut_slice()
                .map_err(|e| drv("writing the pinned buffer", e))?;
            for (dst, b) in host.iter_mut().zip(bytes.chunks_exact(2)) {
                *dst = u16::from_le_bytes([b[0], b[1]]);
            }
        }
        let mut staging = s
            .alloc_zeros::<u16>(n)
            .map_err(|e| drv("KV staging buffer", e))?;
        s.memcpy_htod(&pinned, &mut staging)
            .map_err(|e| drv("KV copy to device", e))?;
        for (i, b) in blocks.iter().enumerate() {
            let dst = b.0 as usize * per;
            let src = i * 2 * per;
            s.memcpy_dtod(
                &staging.slice(src..src + per),
                &mut self.k[layer].slice_mut(dst..dst + per),
            )
            .map_err(|e| drv("KV block copy", e))?;
            s.memcpy_dtod(
                &staging.slice(src + per..src + 2 * per),
                &mut self.v[layer].slice_mut(dst..dst + per),
            )
            .map_err(|e| drv("KV block copy", e))?;
        }
        s.synchronize().map_err(|e| drv("KV copy to device", e))?;
        Ok(())
    }

    /// Copies `positions` of the sequence whose blocks are `table` into the staging pool
    /// `dst`, at the same positions of `dst_table`. Whole blocks come off the device; only
    /// the asked-for positions are written on the host side.
    pub fn copy_positions_out(
        &self,
        table: &[BlockId],
        positions: Range<usize>,
        dst: &HostKvPool,
        dst_table: &[BlockId],
    ) -> Result<()> {
        if positions.is_empty() {
            return Ok(());
        }
        self.check_stage(dst)?;
        let bs = self.spec.block_size;
        let bpp = self.spec.bytes_per_pos();
        let block_bytes = bs * bpp;
        let (b0, b1) = (positions.start / bs, (positions.end - 1) / bs + 1);
        let blocks = table.get(b0..b1).ok_or_else(|| KvCopyError::NoBlocks {
            positions: positions.clone(),
        })?;
        dst.check_table(dst_table)?;
        for layer in 0..self.spec.num_layers {
            // Per block: its K, then its V.
            let bytes = self.copy_blocks_out(layer, blocks)?;
            for pos in positions.clone() {
                let (i, off) = (pos / bs - b0, pos % bs);
                let dst_block = dst_table
                    .get(pos / bs)
                    .ok_or(KvCopyError::NoStagingBlock { pos })?;
                let at = (dst_block.0 as usize * bs + off) * bpp;
                for (kind, src_at) in [
                    (KvKind::K, i * 2 * block_bytes + off * bpp),
                    (KvKind::V, i * 2 * block_bytes + block_bytes + off * bpp),
                ] {
                    // SAFETY: `check_stage` and `check_table` put the slot inside the staging
                    // pool, which the engine lends to no one for positions not yet reported.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            bytes[src_at..src_at + bpp].as_ptr(),
                            dst.base(layer, kind).add(at),
                            bpp,
                        )
                    };
                }
            }
        }
        Ok(())
    }

    /// Copies `positions` from the staging pool `src` (blocks `src_table`) into the blocks
    /// `table`, whole blocks at a time.
    pub fn copy_positions_in(
        &mut self,
        src: &HostKvPool,
        src_table: &[BlockId],
        positions: Range<usize>,
        table: &[BlockId],
    ) -> Result<()> {
        if positions.is_empty() {
            return Ok(());
        }
        self.check_stage(src)?;
        src.check_table(src_table)?;
        let block_bytes = self.spec.block_bytes();
        let n = (positions.end - positions.start).div_ceil(self.spec.block_size);
        if src_table.len() < n || table.len() < n {
            return Err(KvCopyError::TooFewBlocks { positions, need: n }.into());
        }
        for layer in 0..self.spec.num_layers {
            let mut bytes = Vec::with_capacity(n * 2 * block_bytes);
            for b in &src_table[..n] {
                let at = b.0 as usize * block_bytes;
                for kind in [KvKind::K, KvKind::V] {
                    // SAFETY: inside the staging pool (checked), which the landed transfer no
                    // longer writes.
                    bytes.extend_from_slice(unsafe {
                        std::slice::from_raw_parts(src.base(layer, kind).add(at), block_bytes)
                    });
                }
            }
            self.copy_blocks_in(layer, &table[..n], &bytes)?;
        }
        Ok(())
    }

    /// A staging pool must have this cache's shape.
    fn check_stage(&self, pool: &HostKvPool) -> Result<()> {
        if pool.spec() != &self.spec {
            return Err(KvCopyError::StagingShape {
                pool: format!("{:?}", pool.spec()),
                cache: format!("{:?}", self.spec),
            }
            .into());
        }
        Ok(())
    }

    fn check_blocks(&self, layer: usize, blocks: &[BlockId]) -> Result<()> {
        if layer >= self.k.len() {
            return Err(KvCopyError::NoLayer {
                layer,
                layers: self.k.len(),
            }
            .into());
        }
        if let Some(b) = blocks.iter().find(|b| b.0 as usize >= self.num_blocks) {
            return Err(KvCopyError::BlockOutsidePool {
                block: b.0,
                num_blocks: self.num_blocks,
            }
            .into());
        }
        Ok(())
    }
}
