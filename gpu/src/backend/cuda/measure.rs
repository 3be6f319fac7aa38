//! What a benchmark asks of the backend besides steps: the device's name, a fence, the bytes
//! a decode step must read, and the memory bandwidth to compare them against.

use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaStream, DriverError};

use super::device::{drv, GIB};
use super::{CudaBackend, CudaHybridBackend};
use crate::error::{EngineError, Result};

/// What the measurements need of a backend: its context, stream and cuBLAS handle.
pub struct Device<'a> {
    ctx: &'a Arc<CudaContext>,
    stream: &'a Arc<CudaStream>,
    blas: &'a CudaBlas,
}

impl CudaBackend {
    /// The device the backend runs on, for the measurements below.
    pub fn measure(&self) -> Device<'_> {
        Device {
            ctx: &self.ctx,
            stream: &self.stream,
            blas: &self.blas,
        }
    }

    /// Bytes of weights one decode step reads (see `weights::DevWeights::bytes_per_step`).
    pub fn weight_bytes_per_step(&self) -> usize {
        self.w.bytes_per_step()
    }
}

impl CudaHybridBackend {
    /// The device the backend runs on, for the measurements below.
    pub fn measure(&self) -> Device<'_> {
        Device {
            ctx: &self.ctx,
            stream: &self.stream,
            blas: &self.blas,
        }
    }

    /// Bytes of weights one decode step reads.
    pub fn weight_bytes_per_step(&self) -> usize {
        self.w.bytes_per_step()
    }

    /// Bytes of recurrent state (every linear layer's convolution window and delta-rule
    /// state) a decode step reads for each sequence, and writes back.
    pub fn state_bytes_per_seq(&self) -> usize {
        self.layout.bytes_per_slot()
    }
}

impl Device<'_> {
    /// The device's name as the driver reports it ("NVIDIA H100 80GB HBM3"), so benchmark
    /// results say which GPU produced them.
    pub fn device_name(&self) -> Result<String> {
        self.ctx.name().map_err(|e| drv("device name query", e))
    }

    /// Waits until everything queued on the backend's stream has finished. Steps return once
    /// their results are copied back, but a caller timing work needs an explicit fence.
    pub fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| drv("stream synchronisation", e))
    }

    /// Device-to-device copy bandwidth in bytes/s: the best of `reps` timed copies of a
    /// `bytes`-byte buffer (after one untimed warm-up), timed with CUDA events on the
    /// backend's stream. Each copy reads and writes `bytes`, so `2 * bytes / time` is
    /// reported, the convention of NVIDIA's `bandwidthTest`: it is the DRAM traffic the
    /// copy sustains, the figure a weight-streaming decode step is compared against.
    pub fn copy_bandwidth(&self, bytes: usize, reps: usize) -> Result<f64> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| drv("binding the context", e))?;
        let s = &self.stream;
        let src = s.alloc_zeros::<u8>(bytes).map_err(|e| oom_bw(bytes, e))?;
        let mut dst = s.alloc_zeros::<u8>(bytes).map_err(|e| oom_bw(bytes, e))?;
        let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let mut best = 0f64;
        for i in 0..=reps {
            let start = s
                .record_event(timing)
                .map_err(|e| drv("bandwidth event", e))?;
            s.memcpy_dtod(&src, &mut dst)
                .map_err(|e| drv("bandwidth copy", e))?;
            let end = s
                .record_event(timing)
                .map_err(|e| drv("bandwidth event", e))?;
            let ms = start
                .elapsed_ms(&end)
                .map_err(|e| drv("bandwidth timing", e))?;
            // The first copy pays for first-touch page mapping; it is not a measurement.
            if i > 0 && ms > 0.0 {
                best = best.max(2.0 * bytes as f64 / (f64::from(ms) * 1e-3));
            }
        }
        Ok(best)
    }

    /// The device's free and total memory, in bytes.
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        self.ctx.mem_get_info().map_err(|e| drv("memory query", e))
    }

    /// Tensor-core throughput of the GEMMs the engine runs (bf16 inputs, f32 accumulation
    /// and output, through the same cuBLAS call), in FLOP/s: the best of `reps` timed
    /// `[m, k] x [n, k]ᵀ` products after one warm-up. A prefill's share of this peak is
    /// what says how much of its time is anything but matrix math.
    pub fn gemm_flops(&self, (m, n, k): (usize, usize, usize), reps: usize) -> Result<f64> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| drv("binding the context", e))?;
        let s = &self.stream;
        let what = "the GEMM benchmark's matrices";
        let x = s.alloc_zeros::<u16>(m * k).map_err(|e| drv(what, e))?;
        let w = s.alloc_zeros::<u16>(n * k).map_err(|e| drv(what, e))?;
        let mut y = s.alloc_zeros::<f32>(m * n).map_err(|e| drv(what, e))?;
        let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let mut best = 0f64;
        for i in 0..=reps {
            let start = s.record_event(timing).map_err(|e| drv("GEMM event", e))?;
            super::blas::gemm_bf16_f32(self.blas, s, &x, &w, &mut y, (m, n, k))?;
            let end = s.record_event(timing).map_err(|e| drv("GEMM event", e))?;
            let ms = start.elapsed_ms(&end).map_err(|e| drv("GEMM timing", e))?;
            if i > 0 && ms > 0.0 {
                best = best.max(2.0 * (m * n * k) as f64 / (f64::from(ms) * 1e-3));
            }
        }
        Ok(best)
    }
}

fn oom_bw(bytes: usize, e: DriverError) -> EngineError {
    drv(
        &format!(
            "allocating two {:.2} GiB buffers for the bandwidth test",
            bytes as f64 / GIB
        ),
        e,
    )
}
