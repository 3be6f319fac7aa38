//! cuBLAS's bf16 product with f32 accumulation: the one call every bf16 GEMM of the backend
//! goes through (f32 outputs, whole or a part's columns of a wider one; bf16 outputs whole).

use std::ffi::c_void;

use cudarc::cublas::{result as blas_result, sys as blas_sys, CudaBlas};
use cudarc::driver::{CudaSlice, CudaStream, CudaViewMut, DevicePtr, DevicePtrMut};

use crate::backend::error::LaunchError;
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
    gemm_bf16_f32_cols(blas, stream, x, w, y, (m, n, k), (n, 0))
}

/// [`gemm_bf16_f32`] into columns `col0..col0 + n` of y's rows, `ld` apart (ldc = ld): a
/// product that fills part of a wider output (an FP8 layer's unquantized part).
pub fn gemm_bf16_f32_cols(
    blas: &CudaBlas,
    stream: &CudaStream,
    x: &CudaSlice<u16>,
    w: &CudaSlice<u16>,
    y: &mut CudaSlice<f32>,
    (m, n, k): (usize, usize, usize),
    (ld, col0): (usize, usize),
) -> Result<()> {
    let len = y.len();
    gemm_into(blas, stream, x, w, (y, len), (m, n, k), (ld, col0))
}

/// [`gemm_bf16_f32`] with y bf16 (rounded to nearest even from the f32 sums): a product
/// whose next step reads bf16, such as an MLP's gate/up products before `silu_mul_bf16`.
pub fn gemm_bf16_bf16(
    blas: &CudaBlas,
    stream: &CudaStream,
    x: &CudaSlice<u16>,
    w: &CudaSlice<u16>,
    y: &mut CudaViewMut<u16>,
    (m, n, k): (usize, usize, usize),
) -> Result<()> {
    let len = y.len();
    gemm_into(blas, stream, x, w, (y, len), (m, n, k), (n, 0))
}

/// An element type cuBLAS writes a product in.
trait OutType {
    const TY: blas_sys::cudaDataType;
}

impl OutType for f32 {
    const TY: blas_sys::cudaDataType = blas_sys::cudaDataType::CUDA_R_32F;
}

impl OutType for u16 {
    const TY: blas_sys::cudaDataType = blas_sys::cudaDataType::CUDA_R_16BF;
}

/// The product into `y` (a buffer and its length in elements), its pointer held for the call.
fn gemm_into<T: OutType, Y: DevicePtrMut<T>>(
    blas: &CudaBlas,
    stream: &CudaStream,
    x: &CudaSlice<u16>,
    w: &CudaSlice<u16>,
    (y, len): (&mut Y, usize),
    mnk: (usize, usize, usize),
    cols: (usize, usize),
) -> Result<()> {
    let (ptr, _gy) = y.device_ptr_mut(stream);
    let out = Out {
        ptr,
        len,
        ty: T::TY,
        size: std::mem::size_of::<T>(),
    };
    gemm_bf16(blas, stream, x, w, out, mnk, cols)
}

/// A product's output: its device pointer (held by the caller's guard), its length in
/// elements, and their type and size.
struct Out {
    ptr: u64,
    len: usize,
    ty: blas_sys::cudaDataType,
    size: usize,
}

/// The product of `gemm_bf16_f32_cols` into an output of either type.
fn gemm_bf16(
    blas: &CudaBlas,
    stream: &CudaStream,
    x: &CudaSlice<u16>,
    w: &CudaSlice<u16>,
    y: Out,
    (m, n, k): (usize, usize, usize),
    (ld, col0): (usize, usize),
) -> Result<()> {
    let short = |what: &'static str, len: usize, need: usize| -> EngineError {
        LaunchError::GemmShort {
            m,
            n,
            k,
            what,
            len,
            need,
        }
        .into()
    };
    let y_need = if m == 0 { 0 } else { (m - 1) * ld + col0 + n };
    for (what, len, need) in [
        ("x", x.len(), m * k),
        ("w", w.len(), n * k),
        ("y", y.len, y_need),
    ] {
        if len < need {
            return Err(short(what, len, need));
        }
    }
    if col0 + n > ld {
        return Err(LaunchError::GemmColumns { m, n, k, col0, ld }.into());
    }
    let (mi, ni, ki, ldc) = (
        i32::try_from(m).map_err(|_| too_big("m"))?,
        i32::try_from(n).map_err(|_| too_big("n"))?,
        i32::try_from(k).map_err(|_| too_big("k"))?,
        i32::try_from(ld).map_err(|_| too_big("ld"))?,
    );
    let (alpha, beta) = (1.0f32, 0.0f32);
    let (xp, _gx) = x.device_ptr(stream);
    let (wp, _gw) = w.device_ptr(stream);
    let yp = y.ptr + (col0 * y.size) as u64;
    // SAFETY: the three pointers are live device allocations of the handle's context, held
    // for the call by the guards above (y's by the caller's, see `Out`), and each holds at least the elements the product
    // reads or writes (checked above, y from column col0 of rows ld apart); the operation
    // and leading dimensions are the row-major to column-major mapping derived in the doc
    // comment.
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
            y.ty,
            ldc,
            blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| EngineError::device(format!("cuBLAS GEMM ({m}x{k} by {n}x{k})"), e))
}

fn too_big(what: &'static str) -> EngineError {
    LaunchError::GemmOver32Bits { what }.into()
}
