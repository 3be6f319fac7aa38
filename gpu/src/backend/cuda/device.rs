//! The driver as the rest of the backend meets it: whether there is a device at all, and
//! driver errors turned into the engine's.

use cudarc::driver::{CudaContext, DriverError};

use crate::error::{EngineError, Result};

pub const GIB: f64 = (1u64 << 30) as f64;

/// A driver error, saying what was being done.
pub fn drv(what: &str, e: DriverError) -> EngineError {
    EngineError::Backend(format!("CUDA {what}: {e:?}"))
}

/// An allocation or upload of the model or its cache that failed on device `ordinal`: most
/// likely out of memory, which the operator fixes by asking for fewer KV blocks.
pub fn upload_err(ordinal: usize, what: &str, e: DriverError) -> EngineError {
    EngineError::Backend(format!(
        "cuda:{ordinal}: uploading {what} failed ({e:?}); if this is out of memory, \
         ask for fewer KV blocks"
    ))
}

/// Number of CUDA devices, for `--device auto`. 0 when the driver library is not installed
/// or the driver sees no device; an error only when the driver is present but fails.
pub fn device_count() -> Result<usize> {
    // SAFETY: only probes whether libcuda can be opened; nothing is called through it.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Ok(0);
    }
    match CudaContext::device_count() {
        Ok(n) => Ok(n.max(0) as usize),
        Err(DriverError(cudarc::driver::sys::CUresult::CUDA_ERROR_NO_DEVICE)) => Ok(0),
        Err(e) => Err(drv(
            "driver initialisation failed (is the NVIDIA driver loaded?)",
            e,
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--device auto` probes this on every machine: without a driver it must say 0, not
    /// panic inside the dynamic loader.
    #[test]
    fn device_count_never_panics() {
        assert!(device_count().is_ok());
    }
}
