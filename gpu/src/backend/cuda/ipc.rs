//! CUDA IPC: device memory one process exports and another process on the same host maps,
//! so that a prefill process can copy KV straight into a decode process's pool on the same
//! GPU (or a GPU of the same host) without staging it through host memory.
//!
//! IPC handles name memory from `cuMemAlloc`; memory from the stream-ordered allocator
//! (what `CudaStream::alloc` uses where the device has memory pools) cannot be exported
//! this way, so an exportable region is allocated here, by the plain call.

use std::sync::Arc;

use cudarc::driver::sys;
use cudarc::driver::CudaContext;

use super::device::drv;
use crate::error::{EngineError, Result};

/// What names an exported region to another process: the driver's 64-byte handle and the
/// region's length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IpcHandle {
    pub bytes: [u8; 64],
    pub len: usize,
}

impl IpcHandle {
    /// Hex, for handing over in a message or an environment variable.
    pub fn to_hex(&self) -> String {
        let mut s: String = self.bytes.iter().map(|b| format!("{b:02x}")).collect();
        s.push_str(&format!(":{}", self.len));
        s
    }

    pub fn from_hex(s: &str) -> Result<IpcHandle> {
        let bad = || EngineError::InvalidRequest(format!("`{s}` is not a CUDA IPC handle"));
        let (hex, len) = s.split_once(':').ok_or_else(bad)?;
        if hex.len() != 128 {
            return Err(bad());
        }
        let mut bytes = [0u8; 64];
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
        }
        Ok(IpcHandle {
            bytes,
            len: len.parse().map_err(|_| bad())?,
        })
    }
}

/// A region of device memory others may map.
pub struct Exported {
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
    len: usize,
    handle: IpcHandle,
}

impl Exported {
    /// `len` bytes on `ctx`'s device, exportable.
    pub fn alloc(ctx: &Arc<CudaContext>, len: usize) -> Result<Exported> {
        ctx.bind_to_thread()
            .map_err(|e| drv("binding the context", e))?;
        let mut ptr: sys::CUdeviceptr = 0;
        let mut h = MaybeHandle::zeroed();
        // SAFETY: allocates `len` bytes; the handle names that allocation.
        unsafe {
            sys::cuMemAlloc_v2(&mut ptr, len.max(1))
                .result()
                .map_err(|e| drv("allocating an exportable region", e))?;
            if let Err(e) = sys::cuIpcGetMemHandle(&mut h.0, ptr).result() {
                let _ = sys::cuMemFree_v2(ptr);
                return Err(drv("exporting a region (cuIpcGetMemHandle)", e));
            }
        }
        Ok(Exported {
            ctx: ctx.clone(),
            ptr,
            len,
            handle: h.handle(len),
        })
    }

    pub fn handle(&self) -> IpcHandle {
        self.handle
    }

    pub fn device_ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for Exported {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated in `alloc`, freed once.
        let _ = unsafe { sys::cuMemFree_v2(self.ptr) };
    }
}

/// Another process's region, mapped into this one.
pub struct Mapped {
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
    len: usize,
}

impl Mapped {
    /// Maps the region `h` names (exported by another process) into `ctx`.
    pub fn open(ctx: &Arc<CudaContext>, h: &IpcHandle) -> Result<Mapped> {
        ctx.bind_to_thread()
            .map_err(|e| drv("binding the context", e))?;
        let mut ptr: sys::CUdeviceptr = 0;
        let raw = MaybeHandle::of(h);
        // SAFETY: the handle came from cuIpcGetMemHandle in another process.
        unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut ptr,
                raw.0,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        }
        .result()
        .map_err(|e| drv("mapping another process's region (cuIpcOpenMemHandle)", e))?;
        Ok(Mapped {
            ctx: ctx.clone(),
            ptr,
            len: h.len,
        })
    }

    pub fn device_ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: mapped in `open`, unmapped once.
        let _ = unsafe { sys::cuIpcCloseMemHandle(self.ptr) };
    }
}

/// Copies `src` (host) into device memory at `dst`, synchronously.
pub fn upload(ctx: &CudaContext, dst: sys::CUdeviceptr, src: &[u8]) -> Result<()> {
    ctx.bind_to_thread()
        .map_err(|e| drv("binding the context", e))?;
    // SAFETY: the caller's region holds at least `src.len()` bytes.
    unsafe { sys::cuMemcpyHtoD_v2(dst, src.as_ptr().cast(), src.len()) }
        .result()
        .map_err(|e| drv("copying to the device", e))
}

/// Copies device memory at `src` into `dst` (host), synchronously.
pub fn download(ctx: &CudaContext, dst: &mut [u8], src: sys::CUdeviceptr) -> Result<()> {
    ctx.bind_to_thread()
        .map_err(|e| drv("binding the context", e))?;
    // SAFETY: the caller's region holds at least `dst.len()` bytes.
    unsafe { sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), src, dst.len()) }
        .result()
        .map_err(|e| drv("copying from the device", e))
}

/// The driver's handle type, built from and into [`IpcHandle`].
struct MaybeHandle(sys::CUipcMemHandle);

impl MaybeHandle {
    fn zeroed() -> MaybeHandle {
        MaybeHandle(sys::CUipcMemHandle { reserved: [0; 64] })
    }

    fn of(h: &IpcHandle) -> MaybeHandle {
        let mut m = MaybeHandle::zeroed();
        for (d, s) in m.0.reserved.iter_mut().zip(h.bytes) {
            *d = s as std::ffi::c_char;
        }
        m
    }

    fn handle(&self, len: usize) -> IpcHandle {
        let mut bytes = [0u8; 64];
        for (d, s) in bytes.iter_mut().zip(self.0.reserved) {
            *d = s as u8;
        }
        IpcHandle { bytes, len }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_travel_as_hex() {
        let mut bytes = [0u8; 64];
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = (i * 37 % 256) as u8;
        }
        let h = IpcHandle {
            bytes,
            len: 1 << 20,
        };
        assert_eq!(IpcHandle::from_hex(&h.to_hex()).unwrap(), h);
        let raw = MaybeHandle::of(&h);
        assert_eq!(raw.handle(h.len), h, "through the driver's type and back");
        for bad in [
            "",
            "00:1",
            &format!("{}:x", "0".repeat(128)),
            &"zz".repeat(64),
        ] {
            assert!(IpcHandle::from_hex(bad).is_err(), "{bad}");
        }
    }
}
