//! A KV pool in device memory, as an in-process transfer addresses it.
//!
//! Two engines of one process on GPUs (a prefill and a decode role on one device, each on
//! its own SM partition, or on two devices of one host) hand a prompt's K and V over without
//! the host: the transfer copies from the prefill engine's blocks straight into the blocks
//! the decode engine reserved, on the device. The pool here is what such a transfer needs of
//! a backend's device cache: the per-layer device addresses of K and V (laid out as a
//! [`HostKvPool`](crate::kv_pool::HostKvPool) is: `[blocks, block_size, kv_heads,
//! head_dim]`), and a [`DeviceCopy`] that moves byte ranges between such addresses.
//!
//! The ownership rule is the host pool's: whoever holds a lease on a sequence's blocks may
//! touch those blocks' bytes, and nobody else. The pool also keeps the device memory itself
//! alive: a backend that is dropped (its engine stopped or crashed) while a lease is out
//! parks its cache until the last pool handle is gone, so a late copy never lands in freed
//! memory.

use std::any::Any;
use std::sync::Arc;

use crate::kv_pool::{HostKvPool, KvKind, KvSpec};

/// One copy of an in-process transfer: `len` bytes from device address `src` to `dst`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyRun {
    pub src: u64,
    pub dst: u64,
    pub len: u64,
}

/// Moves bytes between device addresses of this process.
pub trait DeviceCopy: Send + Sync {
    /// The device, as the process tells devices apart (equal for two pools on one device).
    fn device(&self) -> DeviceKey;

    /// Copies every run, and returns once all of them have landed.
    ///
    /// # Safety
    /// Every source range must be device memory that stays readable, and every destination
    /// range device memory that stays writable and read by no one else, until the call
    /// returns; no destination may overlap a source or another destination.
    unsafe fn copy(&self, runs: &[CopyRun], dst_device: DeviceKey) -> Result<(), String>;

    /// Maps another process's exported pool ([`PoolExport`]) into this one, for copies
    /// into it (CUDA IPC).
    fn map(&self, export: &PoolExport) -> Result<MappedPool, String>;

    /// Makes the device's context current on the calling thread, for a library that reads
    /// or registers this memory from a thread of its own (UCX's).
    fn bind_thread(&self) -> Result<(), String>;
}

/// A device pool another process of this host may map (CUDA IPC): the driver's handle for
/// the one allocation that holds every layer's K and V, its length, and its base address in
/// the exporting process (a layer's offset is its address less the base).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolExport {
    pub handle: [u8; 64],
    pub len: u64,
    pub base: u64,
}

/// Another process's pool, mapped here: its base address in this process, the device it is
/// on (as this process numbers them), and what keeps it mapped.
pub struct MappedPool {
    pub base: u64,
    pub device: DeviceKey,
    pub keep: Arc<dyn Any + Send + Sync>,
}

/// A device of this process, by ordinal: two engines on one device (each on its own green
/// context) have the same key, and their pools copy into each other with one kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DeviceKey {
    pub ordinal: u32,
}

/// A backend's KV cache in device memory, as transfers address it.
pub struct DeviceKvPool {
    spec: KvSpec,
    num_blocks: usize,
    k: Vec<u64>,
    v: Vec<u64>,
    copier: Arc<dyn DeviceCopy>,
    export: Option<PoolExport>,
    _keep: Arc<dyn Any + Send + Sync>,
}

impl DeviceKvPool {
    /// # Safety
    /// For every layer `k[l]` and `v[l]` must be device addresses of at least `num_blocks *
    /// spec.block_bytes()` bytes laid out as `[num_blocks, block_size, kv_heads, head_dim]`
    /// of `spec.dtype`, alive as long as `keep` is, on the device `copier` copies on; with
    /// `export`, inside the exported allocation.
    pub unsafe fn new(
        spec: KvSpec,
        num_blocks: usize,
        k: Vec<u64>,
        v: Vec<u64>,
        copier: Arc<dyn DeviceCopy>,
        export: Option<PoolExport>,
        keep: Arc<dyn Any + Send + Sync>,
    ) -> DeviceKvPool {
        debug_assert!(k.len() == spec.num_layers && v.len() == spec.num_layers);
        DeviceKvPool {
            spec,
            num_blocks,
            k,
            v,
            copier,
            export,
            _keep: keep,
        }
    }

    /// How another process of this host maps the pool, when it was allocated exportable
    /// (`CudaOptions::kv_exportable`).
    pub fn export(&self) -> Option<&PoolExport> {
        self.export.as_ref()
    }

    pub fn spec(&self) -> &KvSpec {
        &self.spec
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Device address of `layer`'s K or V buffer.
    pub fn base(&self, layer: usize, kind: KvKind) -> u64 {
        match kind {
            KvKind::K => self.k[layer],
            KvKind::V => self.v[layer],
        }
    }

    /// Bytes in each layer's K (or V) buffer.
    pub fn layer_bytes(&self) -> usize {
        self.num_blocks * self.spec.block_bytes()
    }

    pub fn copier(&self) -> &Arc<dyn DeviceCopy> {
        &self.copier
    }

    pub fn device(&self) -> DeviceKey {
        self.copier.device()
    }
}

/// Where a lease's blocks are: a host pool (the `cpu` and `sim` backends, and a device
/// backend's staging pool for transfers that leave the process), or the device cache itself
/// (a transfer to or from another engine of this process on a GPU).
#[derive(Clone)]
pub enum KvMemory {
    Host(Arc<HostKvPool>),
    Device(Arc<DeviceKvPool>),
}

impl KvMemory {
    pub fn spec(&self) -> &KvSpec {
        match self {
            KvMemory::Host(p) => p.spec(),
            KvMemory::Device(p) => p.spec(),
        }
    }

    /// The host pool, if the blocks are in host memory.
    pub fn host(&self) -> Option<&Arc<HostKvPool>> {
        match self {
            KvMemory::Host(p) => Some(p),
            KvMemory::Device(_) => None,
        }
    }
}
