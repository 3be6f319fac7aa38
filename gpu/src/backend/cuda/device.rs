//! The driver as the rest of the backend meets it: whether there is a device at all, and
//! driver errors turned into the engine's.

use cudarc::driver::{CudaContext, DriverError};

use crate::error::{EngineError, Result};

pub const GIB: f64 = (1u64 << 30) as f64;

/// A driver error, saying what was being done.
pub fn drv(what: &str, e: DriverError) -> EngineError {
    EngineError::device(format!("CUDA {what}"), e)
}

/// An allocation or upload of the model or its cache that failed on device `ordinal`: most
/// likely out of memory, which the operator fixes by asking for fewer KV blocks.
pub fn upload_err(ordinal: usize, what: &str, e: DriverError) -> EngineError {
    EngineError::device(
        format!(
            "cuda:{ordinal}: uploading {what} failed (if this is out of memory, ask for fewer \
             KV blocks)"
        ),
        e,
    )
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

    /// The driver's error stays reachable as the source, so out-of-memory is told apart by
    /// its code, not its text. (Not printed here: describing a driver error asks the driver,
    /// which this machine may not have.)
    #[test]
    fn driver_errors_are_kept_as_sources() {
        use cudarc::driver::sys::CUresult;
        use std::error::Error;
        let oom = || DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
        for e in [drv("allocating", oom()), upload_err(1, "layer 3", oom())] {
            let src = e.source().expect("a source");
            let d = src
                .downcast_ref::<DriverError>()
                .expect("the driver's error");
            assert_eq!(d.0, CUresult::CUDA_ERROR_OUT_OF_MEMORY);
            let EngineError::Device { what, .. } = &e else {
                panic!("not a device error");
            };
            assert!(what == "CUDA allocating" || what.starts_with("cuda:1: uploading layer 3"));
        }
    }
}
