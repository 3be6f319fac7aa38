//! The KV handover between two engines of one process on the device (see
//! `crate::device_kv`): a prefill engine's blocks copied straight into the blocks a decode
//! engine reserved, with no host buffer in between.
//!
//! A transfer's copies for one layer go as one launch of `kv_copy_runs` (a run table
//! uploaded, one block per run of positions), on a stream of the copier's own in the
//! source engine's context (so on its SM partition when the GPU is split), and the call
//! returns once they have completed. Where the two caches are on different devices, or a
//! run is not 16-byte aligned, each run goes through the driver's unified-address copy
//! instead (`cuMemcpyAsync`, which also crosses devices).
//!
//! Ordering needs no event: the prefill engine reports a layer only after the step that
//! computed it has finished (its sampled tokens were read back), and the decode engine
//! touches the blocks only after the transfer returned its lease.

use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaFunction, CudaSlice, CudaStream, LaunchConfig};
use parking_lot::Mutex;

use super::device::drv;
use super::ipc::{IpcHandle, Mapped};
use super::kv::KvCache;
use super::launch::Launch;
use super::shapes;
use crate::device_kv::{CopyRun, DeviceCopy, DeviceKey, DeviceKvPool, MappedPool, PoolExport};
use crate::error::Result;
use crate::kv_pool::KvKind;

/// Copies on one device, for the device pool of one engine's cache.
pub struct CudaKvCopy {
    device: DeviceKey,
    stream: Arc<CudaStream>,
    func: CudaFunction,
    /// The run table, grown as transfers need; one copy at a time uses it.
    table: Mutex<Option<CudaSlice<u64>>>,
}

impl CudaKvCopy {
    pub fn new(ctx: &Arc<CudaContext>, ordinal: usize, func: CudaFunction) -> Result<CudaKvCopy> {
        let stream = ctx
            .new_stream()
            .map_err(|e| drv("KV handover stream creation", e))?;
        Ok(CudaKvCopy {
            device: DeviceKey {
                ordinal: ordinal as u32,
            },
            stream,
            func,
            table: Mutex::new(None),
        })
    }

    /// Every run through `kv_copy_runs`, then waits for it.
    fn by_kernel(&self, runs: &[CopyRun]) -> std::result::Result<(), String> {
        let s = &self.stream;
        let flat: Vec<u64> = runs.iter().flat_map(|r| [r.src, r.dst, r.len]).collect();
        let mut table = self.table.lock();
        if table.as_ref().is_none_or(|t| t.len() < flat.len()) {
            let t = s
                .alloc_zeros::<u64>(flat.len().next_power_of_two())
                .map_err(|e| format!("the run table: {e}"))?;
            *table = Some(t);
        }
        let Some(t) = table.as_mut() else {
            return Err("the run table was not allocated".into());
        };
        s.memcpy_htod(&flat, &mut t.slice_mut(0..flat.len()))
            .map_err(|e| format!("uploading the run table: {e}"))?;
        let n = runs.len() as i32;
        let cfg = LaunchConfig {
            grid_dim: (runs.len() as u32, 1, 1),
            block_dim: (shapes::KV_COPY.threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let t: &CudaSlice<u64> = t;
        let mut b = Launch::new(s, &self.func, false);
        b.arg(t).arg(&n);
        // SAFETY: `kv_copy_runs(const u64* table, int runs)`; the table holds 3 * runs
        // entries; every run's addresses are device memory the caller lent to this copy
        // (`DeviceCopy::copy`'s contract), 16-byte aligned with lengths multiples of 16
        // (checked by `aligned`).
        unsafe { b.launch(cfg) }.map_err(|e| format!("kv_copy_runs launch: {e}"))?;
        s.synchronize().map_err(|e| format!("the KV copy: {e}"))
    }

    /// Every run through the driver's unified-address copy, then waits for them.
    ///
    /// # Safety
    /// `DeviceCopy::copy`'s contract.
    unsafe fn by_driver(&self, runs: &[CopyRun]) -> std::result::Result<(), String> {
        let s = &self.stream;
        s.context()
            .bind_to_thread()
            .map_err(|e| format!("binding the context: {e}"))?;
        for r in runs {
            // SAFETY: the caller's contract: both ranges are device memory of this process,
            // lent to this copy; the driver infers the devices from the addresses.
            unsafe { sys::cuMemcpyAsync(r.dst, r.src, r.len as usize, s.cu_stream()) }
                .result()
                .map_err(|e| format!("cuMemcpyAsync: {e}"))?;
        }
        s.synchronize().map_err(|e| format!("the KV copy: {e}"))
    }
}

/// Whether every address and length is a multiple of 16 bytes (`kv_copy_runs` moves 16 at
/// a time). KV positions are `kv_heads * head_dim` bf16, so every real model's are.
pub fn aligned(runs: &[CopyRun]) -> bool {
    runs.iter().all(|r| (r.src | r.dst | r.len) % 16 == 0)
}

impl DeviceCopy for CudaKvCopy {
    fn device(&self) -> DeviceKey {
        self.device
    }

    fn bind_thread(&self) -> std::result::Result<(), String> {
        self.stream
            .context()
            .bind_to_thread()
            .map_err(|e| format!("binding the context: {e}"))
    }

    fn map(&self, export: &PoolExport) -> std::result::Result<MappedPool, String> {
        let ctx = self.stream.context();
        let h = IpcHandle {
            bytes: export.handle,
            len: export.len as usize,
        };
        let m = Mapped::open(ctx, &h).map_err(|e| e.to_string())?;
        let mut ordinal: i32 = -1;
        // SAFETY: an int for DEVICE_ORDINAL, of an address the driver just mapped.
        unsafe {
            sys::cuPointerGetAttribute(
                (&mut ordinal as *mut i32).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                m.device_ptr(),
            )
        }
        .result()
        .map_err(|e| format!("the mapped pool's device: {e}"))?;
        Ok(MappedPool {
            base: m.device_ptr(),
            device: DeviceKey {
                ordinal: ordinal as u32,
            },
            keep: Arc::new(m),
        })
    }

    unsafe fn copy(&self, runs: &[CopyRun], dst: DeviceKey) -> std::result::Result<(), String> {
        if runs.is_empty() {
            return Ok(());
        }
        if dst == self.device && aligned(runs) {
            self.by_kernel(runs)
        } else {
            // SAFETY: passed on.
            unsafe { self.by_driver(runs) }
        }
    }
}

/// The device pool of `kv`, copying through a new `CudaKvCopy` in `ctx`.
pub fn device_pool(
    kv: &KvCache,
    ctx: &Arc<CudaContext>,
    ordinal: usize,
    func: CudaFunction,
) -> Result<Arc<DeviceKvPool>> {
    let copier = Arc::new(CudaKvCopy::new(ctx, ordinal, func)?);
    let spec = kv.spec().clone();
    let k = (0..spec.num_layers)
        .map(|l| kv.address(l, KvKind::K))
        .collect();
    let v = (0..spec.num_layers)
        .map(|l| kv.address(l, KvKind::V))
        .collect();
    // SAFETY: the cache's per-layer buffers are `[num_blocks + 1, block_size, kv_dim]` bf16
    // (`KvCache::alloc_layers`), and `keep` holds them: a cache dropped while the pool lives
    // parks its buffers there (`KvCache`'s `Drop`).
    Ok(Arc::new(unsafe {
        DeviceKvPool::new(spec, kv.num_blocks, k, v, copier, kv.export(), kv.keep())
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_runs_aligned_to_16_bytes_take_the_kernel() {
        let run = |src, dst, len| CopyRun { src, dst, len };
        assert!(aligned(&[
            run(0x1000, 0x2000, 2048),
            run(0x1800, 0x2800, 16)
        ]));
        assert!(!aligned(&[
            run(0x1000, 0x2000, 2048),
            run(0x1008, 0x2800, 16)
        ]));
        assert!(!aligned(&[run(0x1000, 0x2004, 32)]));
        assert!(!aligned(&[run(0x1000, 0x2000, 24)]));
        assert!(aligned(&[]));
    }
}
