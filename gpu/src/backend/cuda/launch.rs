//! Kernel launches through `cuLaunchKernelEx`, so a launch can carry programmatic dependent
//! launch (Hopper and later): the kernel may be scheduled while the one before it in the
//! stream is still finishing, runs what does not depend on it (a skinny product's first
//! weight loads), and waits at `pdl_wait()` (`griddepcontrol.wait`, `kernels/common.cuh`)
//! until that kernel has completed and its writes are visible. Every kernel of
//! `kernels/*.cu` waits before it reads anything an earlier kernel wrote and before it writes
//! anything; that is what makes the overlap safe, and why only this module's launches (never
//! cuBLAS's, which do not wait) carry the attribute. In a captured CUDA graph the attribute
//! becomes a programmatic edge, so the graph's steps overlap the same way.
//!
//! The builder mirrors cudarc's `LaunchArgs` (`arg` by reference, then `launch`), taking the
//! device pointers with the same read/write tracking, so a kernel's typed launch in
//! `kernels.rs` reads the same either way.

use std::ffi::c_void;

use cudarc::driver::sys::{
    self, CUlaunchAttribute, CUlaunchAttributeID, CUlaunchAttributeValue, CUlaunchConfig,
};
use cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, CudaView, DevicePtr, DevicePtrMut, DriverError,
    LaunchConfig, SyncOnDrop,
};

/// One kernel launch being built: its arguments as 8-byte slots (a 4-byte argument in the
/// low half, which is what the driver copies on a little-endian host), and the guards that
/// record the buffers' use on the stream once the launch is queued.
pub struct Launch<'a> {
    stream: &'a CudaStream,
    func: &'a CudaFunction,
    pdl: bool,
    slots: Vec<u64>,
    guards: Vec<SyncOnDrop<'a>>,
}

/// What can be a kernel argument: a buffer (its device pointer) or a scalar.
pub trait Arg<'a> {
    fn push(self, l: &mut Launch<'a>);
}

impl<'a, T> Arg<'a> for &'a CudaSlice<T> {
    fn push(self, l: &mut Launch<'a>) {
        let (p, g) = self.device_ptr(l.stream);
        l.slots.push(p);
        l.guards.push(g);
    }
}

impl<'a, T> Arg<'a> for &'a mut CudaSlice<T> {
    fn push(self, l: &mut Launch<'a>) {
        let (p, g) = self.device_ptr_mut(l.stream);
        l.slots.push(p);
        l.guards.push(g);
    }
}

impl<'a, T> Arg<'a> for &'a CudaView<'a, T> {
    fn push(self, l: &mut Launch<'a>) {
        let (p, g) = self.device_ptr(l.stream);
        l.slots.push(p);
        l.guards.push(g);
    }
}

impl<'a> Arg<'a> for &i32 {
    fn push(self, l: &mut Launch<'a>) {
        l.slots.push(*self as u32 as u64);
    }
}

impl<'a> Arg<'a> for &f32 {
    fn push(self, l: &mut Launch<'a>) {
        l.slots.push(self.to_bits() as u64);
    }
}

/// A pointer argument the kernel takes as absent.
pub struct Null;

impl<'a> Arg<'a> for Null {
    fn push(self, l: &mut Launch<'a>) {
        l.slots.push(0);
    }
}

impl<'a> Launch<'a> {
    /// A launch of `func` on `stream`, with programmatic dependent launch when `pdl`.
    pub fn new(stream: &'a CudaStream, func: &'a CudaFunction, pdl: bool) -> Launch<'a> {
        Launch {
            stream,
            func,
            pdl,
            slots: Vec::with_capacity(20),
            guards: Vec::with_capacity(12),
        }
    }

    pub fn arg(&mut self, a: impl Arg<'a>) -> &mut Self {
        a.push(self);
        self
    }

    /// Queues the launch.
    ///
    /// # Safety
    /// The arguments must be the kernel's parameters in order and type (pointers and 4-byte
    /// scalars), and every buffer must hold what the grid reads and writes.
    pub unsafe fn launch(&mut self, cfg: LaunchConfig) -> Result<(), DriverError> {
        self.stream.context().bind_to_thread()?;
        let mut params: Vec<*mut c_void> = self
            .slots
            .iter_mut()
            .map(|s| s as *mut u64 as *mut c_void)
            .collect();
        // SAFETY: an all-zero attribute value is valid (a union of plain integers).
        let mut value: CUlaunchAttributeValue = unsafe { std::mem::zeroed() };
        value.programmaticStreamSerializationAllowed = 1;
        let mut attr = CUlaunchAttribute {
            id: CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value,
        };
        let config = CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: if self.pdl {
                &mut attr
            } else {
                std::ptr::null_mut()
            },
            numAttrs: self.pdl as u32,
        };
        // SAFETY: `params` points at one slot per kernel parameter (the caller's promise),
        // which live until the call returns (the driver copies them); the function and
        // stream are live handles of the bound context, and `attr` outlives the call.
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                self.func.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()?;
        // The guards record the buffers' use now that the launch is queued.
        self.guards.clear();
        Ok(())
    }
}
