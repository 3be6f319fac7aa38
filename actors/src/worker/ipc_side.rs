//! The prefill side of CUDA IPC transfers (`kvmesh_transport::kv::ipc`): decode workers'
//! exported KV caches mapped into this process (once per export), and the destination a
//! transfer copies into.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use kvmesh_gpu::device_kv::{KvMemory, MappedPool, PoolExport};
use kvmesh_gpu::engine::KvLease;
use kvmesh_transport::kv::{ipc, DeviceCopy, KvRegion};
use kvmesh_transport::wire::{CudaIpcPath, DataPath};

/// Decode workers' exports mapped here, by IPC handle. A decode process exports its cache
/// once, so there is one entry per decode process this worker has served (a restarted one
/// exports anew; the old mapping stays until this process ends).
#[derive(Default)]
pub struct IpcMaps {
    maps: parking_lot::Mutex<HashMap<[u8; 64], Arc<MappedPool>>>,
}

/// Why a CUDA IPC transfer cannot be made: said to the decode worker, which prefills the
/// prompt itself (another prefill worker could not do better).
#[derive(Debug)]
pub struct Refused(pub String);

impl From<&str> for Refused {
    fn from(s: &str) -> Refused {
        Refused(s.to_string())
    }
}

/// A mapped pool as the transport sees it: where it is, never a copier itself.
struct Mapped(u32);

impl DeviceCopy for Mapped {
    fn device(&self) -> u32 {
        self.0
    }

    unsafe fn copy(&self, _: &[(usize, usize, usize)], _: u32) -> Result<(), String> {
        Err("another process's mapped cache is only copied into".into())
    }

    fn bind_thread(&self) -> Result<(), String> {
        Err("another process's mapped cache is not read by UCX".into())
    }
}

impl IpcMaps {
    /// The decode worker's blocks `dest_blocks` over `positions`, in its pool that `data`
    /// names, mapped here: where this transfer copies to from `lease`'s blocks.
    pub fn dest(
        &self,
        lease: &KvLease,
        data: &DataPath,
        dest_blocks: &[u32],
        positions: Range<usize>,
    ) -> Result<KvRegion, Refused> {
        let DataPath::CudaIpc(path) = data else {
            return Err("not a CUDA IPC transfer".into());
        };
        let CudaIpcPath {
            handle,
            len,
            offsets,
            num_blocks,
            host,
            ..
        } = &**path;
        let here = ipc::host_id();
        if here.as_deref() != Some(host.as_str()) {
            return Err(Refused(format!(
                "CUDA IPC needs the decode worker on this host: its boot id is {host}, this \
                 host's {}",
                here.as_deref().unwrap_or("unknown")
            )));
        }
        let KvMemory::Device(pool) = lease.memory() else {
            return Err(
                "this prefill worker's KV cache is not on a GPU; CUDA IPC needs one".into(),
            );
        };
        let spec = pool.spec();
        let layer_bytes = *num_blocks * spec.block_bytes() as u64;
        if offsets.len() != 2 * spec.num_layers
            || offsets
                .iter()
                .any(|&o| o.checked_add(layer_bytes).is_none_or(|e| e > *len))
        {
            return Err(Refused(format!(
                "the decode worker's export ({len} bytes, {} buffers of {layer_bytes}) does not \
                 hold {} layers of K and V",
                offsets.len(),
                spec.num_layers
            )));
        }
        let handle: [u8; 64] = handle
            .as_slice()
            .try_into()
            .map_err(|_| Refused(format!("a CUDA IPC handle of {} bytes", handle.len())))?;
        let mapped = self.map(pool.copier().as_ref(), handle, *len)?;
        let at = |i: usize| (mapped.base + offsets[i]) as usize as *mut u8;
        let k = (0..spec.num_layers).map(|l| at(2 * l)).collect();
        let v = (0..spec.num_layers).map(|l| at(2 * l + 1)).collect();
        // SAFETY: the mapping holds `len` bytes, every layer buffer lies inside it (checked
        // above), laid out as the decode worker's pool is (the layouts matched); the decode
        // worker reserved `dest_blocks` for this transfer and reads them only after its
        // notices; the mapping lives as long as the region (`keep`).
        Ok(unsafe {
            KvRegion::new(
                k,
                v,
                layer_bytes as usize,
                spec.bytes_per_pos(),
                spec.block_size,
                dest_blocks.to_vec(),
                positions,
                mapped.keep.clone(),
            )
            .on_device(Arc::new(Mapped(mapped.device.ordinal)))
        })
    }

    /// The export `handle` names, mapped through `copier`'s context: once, then cached.
    fn map(
        &self,
        copier: &dyn kvmesh_gpu::device_kv::DeviceCopy,
        handle: [u8; 64],
        len: u64,
    ) -> Result<Arc<MappedPool>, Refused> {
        if let Some(m) = self.maps.lock().get(&handle) {
            return Ok(m.clone());
        }
        let export = PoolExport {
            handle,
            len,
            base: 0,
        };
        let m = Arc::new(
            copier
                .map(&export)
                .map_err(|e| Refused(format!("mapping the decode worker's KV cache: {e}")))?,
        );
        self.maps.lock().insert(handle, m.clone());
        Ok(m)
    }
}
