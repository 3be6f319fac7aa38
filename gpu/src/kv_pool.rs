//! KV memory in host RAM that more than one thread touches: the engine thread computes into
//! it, and KV transfers read finished positions out of it (prefill side) or write received
//! positions straight into reserved blocks (decode side) while the engine keeps running.
//!
//! # Layout
//!
//! Per layer, one buffer for K and one for V, each `[num_blocks, block_size, num_kv_heads,
//! head_dim]` in the pool's element type (f32 on the `cpu` backend, bf16-sized on `sim`).
//! So the K of one position of one layer is `kv_dim * elem` contiguous bytes, and the
//! positions of one block are contiguous: a run of positions inside a block is one segment.
//!
//! # Who may touch which bytes
//!
//! The pool hands out raw pointers, never a reference to a whole buffer, so that disjoint
//! parts can be used from different threads. The rule that keeps that sound is ownership by
//! block, enforced by the engine's bookkeeping:
//!
//! - the engine thread writes only the slots of positions it is computing, in blocks of
//!   running sequences, and reads only blocks of sequences in its batch;
//! - a transfer writes only blocks reserved for it (allocated to a sequence that waits for
//!   its KV and is in no batch), and only at positions the sequence has not cached;
//! - a transfer reads only positions already computed, which the engine never rewrites.
//!
//! Blocks under a transfer are held by a lease (`engine::KvLease`) and go back to the free
//! list only when the last holder of the lease is gone, so no transfer can write into a
//! block after it was given to someone else.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

use crate::backend::error::{KvCopyError, MemoryError};
use crate::error::Result;
use crate::kv_cache::BlockId;

/// How K and V elements are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvDtype {
    F32,
    Bf16,
}

impl KvDtype {
    pub fn size(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::Bf16 => 2,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::Bf16 => "bf16",
        }
    }
}

/// The shape of a backend's KV cache: what a prefill worker and a decode worker must agree on
/// before one fills the other's blocks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvSpec {
    pub num_layers: usize,
    pub block_size: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub dtype: KvDtype,
}

impl KvSpec {
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Bytes of K (or of V) for one position of one layer.
    pub fn bytes_per_pos(&self) -> usize {
        self.kv_dim() * self.dtype.size()
    }

    /// Bytes of K and V over all layers for one token: what a transfer moves per token.
    pub fn bytes_per_token(&self) -> usize {
        2 * self.num_layers * self.bytes_per_pos()
    }

    /// Bytes of one block's K (or V) in one layer.
    pub fn block_bytes(&self) -> usize {
        self.block_size * self.bytes_per_pos()
    }
}

/// K or V.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvKind {
    K,
    V,
}

struct RawBuf {
    /// The first byte of the buffer, aligned to [`RawBuf::ALIGN`].
    ptr: NonNull<u8>,
    from: Source,
}

/// Where a buffer's memory came from, and so how it is given back.
enum Source {
    /// A private anonymous mapping of this many bytes.
    #[cfg(unix)]
    Mapped(usize),
    /// The allocator: what it returned, and with which layout.
    Heap(NonNull<u8>, Layout),
}

impl RawBuf {
    /// The buffer's alignment: a cache line.
    const ALIGN: usize = 64;
    /// Buffers this large or larger are mapped from the kernel.
    #[cfg(unix)]
    const MAP_FROM: usize = 64 << 10;

    /// Zeroed memory, resident only once written (a sim worker's pool costs what it uses).
    ///
    /// Large buffers are mapped from the kernel: fresh zero pages, page-aligned. The
    /// allocator would not promise that: once it has given back a large block it raises its
    /// own threshold for mapping, and serves later ones of that size from its heap, zeroing
    /// (and so making resident) every byte, so `--replicas` sim workers cost their whole
    /// pools. Small ones come from the allocator with no more than its own alignment, so that
    /// it is a `calloc` and not a `posix_memalign` with a `memset`; the cache-line alignment
    /// comes from over-allocating by one line and starting at the first aligned byte.
    fn zeroed(bytes: usize) -> Option<RawBuf> {
        #[cfg(unix)]
        if bytes >= Self::MAP_FROM {
            // SAFETY: a fresh private anonymous mapping; no existing memory is touched.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    bytes,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if p == libc::MAP_FAILED {
                return None;
            }
            let ptr = NonNull::new(p.cast::<u8>())?;
            return Some(RawBuf {
                ptr,
                from: Source::Mapped(bytes),
            });
        }
        let layout = Layout::from_size_align(bytes.checked_add(Self::ALIGN)?, 16).ok()?;
        // SAFETY: the layout has a non-zero size.
        let alloc = NonNull::new(unsafe { alloc_zeroed(layout) })?;
        let skip = alloc.as_ptr().align_offset(Self::ALIGN);
        // SAFETY: `skip < ALIGN`, and ALIGN bytes more than `bytes` were allocated.
        let ptr = unsafe { alloc.add(skip) };
        Some(RawBuf {
            ptr,
            from: Source::Heap(alloc, layout),
        })
    }
}

impl Drop for RawBuf {
    fn drop(&mut self) {
        match self.from {
            #[cfg(unix)]
            // SAFETY: mapped in `zeroed` with this length, and unmapped only here.
            Source::Mapped(len) => unsafe {
                libc::munmap(self.ptr.as_ptr().cast(), len);
            },
            // SAFETY: allocated in `zeroed` with this layout.
            Source::Heap(alloc, layout) => unsafe { dealloc(alloc.as_ptr(), layout) },
        }
    }
}

pub struct HostKvPool {
    spec: KvSpec,
    num_blocks: usize,
    k: Vec<RawBuf>,
    v: Vec<RawBuf>,
}

// SAFETY: the pool only hands out raw pointers; the module docs give the ownership rule under
// which threads use them.
unsafe impl Send for HostKvPool {}
unsafe impl Sync for HostKvPool {}

impl HostKvPool {
    pub fn new(spec: KvSpec, num_blocks: usize) -> Result<HostKvPool> {
        let per = num_blocks
            .checked_mul(spec.block_bytes())
            .filter(|&b| b <= isize::MAX as usize)
            .ok_or(MemoryError::HostTooLarge { blocks: num_blocks })?;
        let mut k = Vec::with_capacity(spec.num_layers);
        let mut v = Vec::with_capacity(spec.num_layers);
        for _ in 0..spec.num_layers {
            match (RawBuf::zeroed(per), RawBuf::zeroed(per)) {
                (Some(a), Some(b)) => {
                    k.push(a);
                    v.push(b);
                }
                _ => {
                    return Err(MemoryError::HostAlloc {
                        blocks: num_blocks,
                        layers: spec.num_layers,
                        layer_bytes: per,
                    }
                    .into())
                }
            }
        }
        Ok(HostKvPool {
            spec,
            num_blocks,
            k,
            v,
        })
    }

    pub fn spec(&self) -> &KvSpec {
        &self.spec
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Start of `layer`'s K or V buffer.
    pub fn base(&self, layer: usize, kind: KvKind) -> *mut u8 {
        let b = match kind {
            KvKind::K => &self.k[layer],
            KvKind::V => &self.v[layer],
        };
        b.ptr.as_ptr()
    }

    /// Bytes in each layer's K (or V) buffer.
    pub fn layer_bytes(&self) -> usize {
        self.num_blocks * self.spec.block_bytes()
    }

    /// Checks that every block of a table is in the pool.
    pub fn check_table(&self, table: &[BlockId]) -> Result<()> {
        match table.iter().find(|b| b.0 as usize >= self.num_blocks) {
            Some(b) => Err(KvCopyError::BlockOutsidePool {
                block: b.0,
                num_blocks: self.num_blocks,
            }
            .into()),
            None => Ok(()),
        }
    }

    /// A view of one layer as f32 slots (the `cpu` backend's element type).
    ///
    /// # Safety
    /// The pool's dtype must be f32, and the caller must follow the module's ownership rule
    /// for every slot it reads or writes through the view.
    pub unsafe fn f32_layer(&self, layer: usize) -> F32Layer {
        debug_assert_eq!(self.spec.dtype, KvDtype::F32);
        F32Layer {
            k: self.base(layer, KvKind::K) as *mut f32,
            v: self.base(layer, KvKind::V) as *mut f32,
            kv_dim: self.spec.kv_dim(),
            slots: self.num_blocks * self.spec.block_size,
        }
    }
}

/// One layer's K and V as f32 slots of `kv_dim` values (slot = block * block_size + offset).
#[derive(Clone, Copy)]
pub struct F32Layer {
    k: *mut f32,
    v: *mut f32,
    kv_dim: usize,
    slots: usize,
}

// SAFETY: a view of pool memory; the ownership rule (module docs) governs its use.
unsafe impl Send for F32Layer {}
unsafe impl Sync for F32Layer {}

impl F32Layer {
    /// `len` values of slot `slot`'s K, from value `at`.
    ///
    /// # Safety
    /// No one may write these values while the slice lives.
    #[inline]
    pub unsafe fn k(&self, slot: usize, at: usize, len: usize) -> &[f32] {
        debug_assert!(slot < self.slots && at + len <= self.kv_dim);
        std::slice::from_raw_parts(self.k.add(slot * self.kv_dim + at), len)
    }

    /// # Safety
    /// As [`F32Layer::k`].
    #[inline]
    pub unsafe fn v(&self, slot: usize, at: usize, len: usize) -> &[f32] {
        debug_assert!(slot < self.slots && at + len <= self.kv_dim);
        std::slice::from_raw_parts(self.v.add(slot * self.kv_dim + at), len)
    }

    /// Writes slot `slot`'s K and V.
    ///
    /// # Safety
    /// No one else may read or write this slot meanwhile.
    #[inline]
    pub unsafe fn write(&self, slot: usize, k: &[f32], v: &[f32]) {
        debug_assert!(slot < self.slots && k.len() == self.kv_dim && v.len() == self.kv_dim);
        std::ptr::copy_nonoverlapping(k.as_ptr(), self.k.add(slot * self.kv_dim), self.kv_dim);
        std::ptr::copy_nonoverlapping(v.as_ptr(), self.v.add(slot * self.kv_dim), self.kv_dim);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> KvSpec {
        KvSpec {
            num_layers: 2,
            block_size: 4,
            num_kv_heads: 2,
            head_dim: 3,
            dtype: KvDtype::F32,
        }
    }

    #[test]
    fn sizes_follow_the_shape() {
        let s = spec();
        assert_eq!(s.kv_dim(), 6);
        assert_eq!(s.bytes_per_pos(), 24);
        assert_eq!(s.block_bytes(), 96);
        assert_eq!(s.bytes_per_token(), 2 * 2 * 24);
    }

    #[test]
    fn slots_are_written_and_read_back_per_layer_and_kind() {
        let pool = HostKvPool::new(spec(), 3).unwrap();
        assert_eq!(pool.layer_bytes(), 3 * 96);
        let k: Vec<f32> = (0..6).map(|x| x as f32).collect();
        let v: Vec<f32> = (0..6).map(|x| -(x as f32)).collect();
        // SAFETY: single-threaded test, f32 pool.
        unsafe {
            let l1 = pool.f32_layer(1);
            l1.write(7, &k, &v);
            assert_eq!(l1.k(7, 0, 6), &k[..]);
            assert_eq!(l1.v(7, 3, 3), &v[3..]);
            assert_eq!(pool.f32_layer(0).k(7, 0, 6), &[0.0; 6]);
            // Slot 7 is block 1, offset 3: byte (4 + 3) * 24 of layer 1's K buffer.
            let p = pool.base(1, KvKind::K).add(7 * 24) as *const f32;
            assert_eq!(*p.add(5), 5.0);
        }
        assert!(pool.check_table(&[BlockId(2)]).is_ok());
        assert!(pool.check_table(&[BlockId(3)]).is_err());
    }

    /// Resident memory of this process, in bytes (Linux).
    fn resident() -> Option<usize> {
        let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
        let pages: usize = statm.split_whitespace().nth(1)?.parse().ok()?;
        Some(pages * 4096)
    }

    /// A large pool is aligned and zero, and costs no memory until written: a sim worker's
    /// gigabyte of KV must not be written through at start-up.
    #[test]
    fn a_large_pool_is_aligned_zero_and_not_resident() {
        let spec = KvSpec {
            num_layers: 4,
            block_size: 16,
            num_kv_heads: 4,
            head_dim: 64,
            dtype: KvDtype::Bf16,
        };
        let before = resident();
        let pool = HostKvPool::new(spec, 16384).unwrap();
        let after = resident();
        assert_eq!(pool.layer_bytes(), 128 << 20);
        for layer in 0..4 {
            for kind in [KvKind::K, KvKind::V] {
                let base = pool.base(layer, kind);
                assert_eq!(
                    base as usize % 64,
                    0,
                    "layer {layer} {kind:?} is not aligned"
                );
                // SAFETY: inside the layer's buffer, nothing else touches it.
                unsafe {
                    assert_eq!(*base, 0);
                    assert_eq!(*base.add(pool.layer_bytes() - 1), 0);
                }
            }
        }
        if let (Some(before), Some(after)) = (before, after) {
            let grew = after.saturating_sub(before);
            assert!(
                grew < 512 << 20,
                "a 1 GiB pool made {} MiB resident before any write",
                grew >> 20
            );
        }
    }
}
