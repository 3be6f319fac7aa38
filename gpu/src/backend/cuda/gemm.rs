//! Matrix products: bf16 inputs, f32 accumulation and output, through cuBLAS, or for a few
//! rows through the skinny kernels (`kernels/skinny.cu`), which stream the weights once.

use std::ffi::c_void;

use cudarc::cublas::{result as blas_result, sys as blas_sys, CudaBlas};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};

use super::kernels::{BiasAdd, Kernels, SkinnyGemm};
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

/// Where a forward pass's products run: the skinny kernels for products of at most
/// `skinny_max_rows` rows (`CudaOptions::skinny_max_rows`), cuBLAS for the rest.
#[derive(Clone, Copy)]
pub struct Products<'a> {
    pub blas: &'a CudaBlas,
    pub s: &'a CudaStream,
    pub k: &'a Kernels,
    pub skinny_max_rows: usize,
}

impl Products<'_> {
    /// `y[m, n] = x[m, k] · W[n, k]ᵀ`.
    pub fn product(
        &self,
        x: &CudaSlice<u16>,
        w: &CudaSlice<u16>,
        y: &mut CudaSlice<f32>,
        (m, n, k): (usize, usize, usize),
    ) -> Result<()> {
        if m <= self.skinny_max_rows && SkinnyGemm::takes(m, k) {
            SkinnyGemm {
                x,
                w,
                y,
                rows: m,
                n,
                k,
            }
            .launch(self.k, self.s)
        } else {
            gemm_bf16_f32(self.blas, self.s, x, w, y, (m, n, k))
        }
    }

    /// `y = x · Wᵀ` (+ bias) for a `DevLinear` over the first `m` rows.
    pub fn linear(
        &self,
        l: &DevLinear,
        m: usize,
        x: &CudaSlice<u16>,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        self.product(x, &l.w, y, (m, l.out, l.inp))?;
        if let Some(bias) = &l.bias {
            BiasAdd {
                y,
                bias,
                rows: m,
                cols: l.out,
            }
            .launch(self.k, self.s)?;
        }
        Ok(())
    }
}

/// The skinny kernels' and cuBLAS's products of the same random bf16 matrices on device
/// `ordinal` (`x` `[m, k]`, `w` `[n, k]`, as bf16 bits), for checking one against the other.
pub fn skinny_and_cublas(
    ordinal: usize,
    x: &[u16],
    w: &[u16],
    (m, n, k): (usize, usize, usize),
) -> Result<(Vec<f32>, Vec<f32>)> {
    use super::device::drv;
    let ctx = cudarc::driver::CudaContext::new(ordinal).map_err(|e| drv("context creation", e))?;
    let s = ctx.new_stream().map_err(|e| drv("stream creation", e))?;
    let (kernels, _) = Kernels::load(&ctx)?;
    let blas = CudaBlas::new(s.clone()).map_err(|e| EngineError::device("cuBLAS handle", e))?;
    let xd = s.clone_htod(x).map_err(|e| drv("upload", e))?;
    let wd = s.clone_htod(w).map_err(|e| drv("upload", e))?;
    let run = |skinny_max_rows: usize| -> Result<Vec<f32>> {
        // Poisoned first, so an element the kernel leaves unwritten shows.
        let mut y = s
            .clone_htod(&vec![f32::NAN; m * n])
            .map_err(|e| drv("upload", e))?;
        Products {
            blas: &blas,
            s: &s,
            k: &kernels,
            skinny_max_rows,
        }
        .product(&xd, &wd, &mut y, (m, n, k))?;
        s.clone_dtoh(&y).map_err(|e| drv("download", e))
    };
    let skinny = run(m)?;
    let cublas = run(0)?;
    Ok((skinny, cublas))
}
