//! Matrix products through cuBLAS: bf16 inputs, f32 accumulation and output.

use std::ffi::c_void;

use cudarc::cublas::{result as blas_result, sys as blas_sys, CudaBlas};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};

use super::kernels::{BiasAdd, Kernels};
use super::weights::DevLinear;
use crate::error::{EngineError, Result};

/// `y[m, n] = x[m, k] · W[n, k]ᵀ`, everything row-major, x and W bf16, y f32, accumulated in
/// f32. The buffers may be longer than the product needs; shorter is an error.
///
/// cuBLAS is column-major. A row-major `[r, c]` matrix is the column-major `[c, r]` matrix,
/// its transpose, with leading dimension `c`. So the row-major product `y = x · Wᵀ` is the
/// column-major `yᵀ = W · xᵀ` where, in column-major terms:
///   - `yᵀ` is `[n, m]`, ld `n`: exactly y's memory (C, ldc = n);
///   - `xᵀ` is `[k, m]`, ld `k`: exactly x's memory, used as is (B, op N, ldb = k);
///   - `W` is `[n, k]`, which W's memory holds as the column-major `[k, n]` matrix `Wᵀ`
///     (ld `k`), so A is W's memory with op T (A, op T, lda = k).
///
/// giving `gemm(opA = T, opB = N, m = n, n = m, k = k, A = W, lda = k, B = x, ldb = k,
/// C = y, ldc = n)`.
pub fn gemm_bf16_f32(
    blas: &CudaBlas,
    stream: &CudaStream,
    x: &CudaSlice<u16>,
    w: &CudaSlice<u16>,
    y: &mut CudaSlice<f32>,
    (m, n, k): (usize, usize, usize),
) -> Result<()> {
    let short = |what: &str, len: usize, need: usize| {
        EngineError::Backend(format!(
            "cuBLAS GEMM ({m}x{k} by {n}x{k}): `{what}` holds {len} elements, needs {need}"
        ))
    };
    for (what, len, need) in [
        ("x", x.len(), m * k),
        ("w", w.len(), n * k),
        ("y", y.len(), m * n),
    ] {
        if len < need {
            return Err(short(what, len, need));
        }
    }
    let (mi, ni, ki) = (
        i32::try_from(m).map_err(|_| too_big("m"))?,
        i32::try_from(n).map_err(|_| too_big("n"))?,
        i32::try_from(k).map_err(|_| too_big("k"))?,
    );
    let (alpha, beta) = (1.0f32, 0.0f32);
    let (xp, _gx) = x.device_ptr(stream);
    let (wp, _gw) = w.device_ptr(stream);
    let (yp, _gy) = y.device_ptr_mut(stream);
    // SAFETY: the three pointers are live device allocations of the handle's context, held
    // by the guards above for the call, and each holds at least the elements the product
    // reads or writes (checked above); the operation and leading dimensions are the
    // row-major to column-major mapping derived in the doc comment.
    unsafe {
        blas_result::gemm_ex(
            *blas.handle(),
            blas_sys::cublasOperation_t::CUBLAS_OP_T,
            blas_sys::cublasOperation_t::CUBLAS_OP_N,
            ni,
            mi,
            ki,
            &alpha as *const f32 as *const c_void,
            wp as *const c_void,
            blas_sys::cudaDataType::CUDA_R_16BF,
            ki,
            xp as *const c_void,
            blas_sys::cudaDataType::CUDA_R_16BF,
            ki,
            &beta as *const f32 as *const c_void,
            yp as *mut c_void,
            blas_sys::cudaDataType::CUDA_R_32F,
            ni,
            blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| EngineError::device(format!("cuBLAS GEMM ({m}x{k} by {n}x{k})"), e))
}

fn too_big(what: &str) -> EngineError {
    EngineError::Backend(format!(
        "GEMM dimension {what} exceeds the 32-bit range cuBLAS takes"
    ))
}

/// `y = x · Wᵀ` (+ bias) for a `DevLinear` over the first `m` rows.
pub fn linear(
    blas: &CudaBlas,
    stream: &CudaStream,
    k: &Kernels,
    l: &DevLinear,
    m: usize,
    x: &CudaSlice<u16>,
    y: &mut CudaSlice<f32>,
) -> Result<()> {
    gemm_bf16_f32(blas, stream, x, &l.w, y, (m, l.out, l.inp))?;
    if let Some(bias) = &l.bias {
        BiasAdd {
            y,
            bias,
            rows: m,
            cols: l.out,
        }
        .launch(k, stream)?;
    }
    Ok(())
}
