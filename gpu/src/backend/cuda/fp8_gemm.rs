//! The products of FP8 linear layers (`fp8::Fp8Linear`), part by part, each into its own
//! columns of the f32 output:
//!
//! - a few rows (a decode step's): `fp8_gemv_*`, which reads the e4m3 weights once and the
//!   activations as bf16, unquantized (`kernels/fp8.cu`);
//! - more rows: the activations quantized to e4m3 (`fp8_quant_rows`), cuBLASLt's FP8 GEMM
//!   on the tensor cores with the scales applied in its f32 epilogue, bf16 out, widened into
//!   the product's columns with the bias (`fp8_out_cols`); or, with `CudaOptions::
//!   fp8_f32_out` where cuBLASLt has such a GEMM, f32 out straight into the product's
//!   columns (the bias added after, where there is one);
//! - a part the config leaves unquantized: cuBLAS's bf16 GEMM straight into its columns.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublas::{sys as blas_sys, CudaBlas};
use cudarc::cublaslt::{result as lt, sys as lt_sys};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};

use super::device::drv;
use super::fp8::{lt_rows, Fp8Linear, PartWeights, ScaleKind};
use super::kernels::{failed, holds, Kernels};
use super::launch::{Launch, Null};
use super::shapes::{self, grid, KernelShape};
use crate::backend::error::{Fp8Refusal, LaunchError};
use crate::config::{ModelConfig, FP8_BLOCK};
use crate::error::{EngineError, Result};

/// cuBLASLt's workspace: NVIDIA's recommendation for Hopper (cuBLAS documentation,
/// `cublasSetWorkspace`), allocated once.
pub const LT_WORKSPACE: usize = 32 << 20;

/// Most rows an FP8 product runs through `fp8_gemv_*` (activations read as bf16,
/// unquantized) under a skinny-kernel limit of `skinny_max_rows`; more rows are quantized
/// for cuBLASLt.
pub fn gemv_max_rows(skinny_max_rows: usize) -> usize {
    skinny_max_rows.min(shapes::FP8_GEMV_BLOCK[2].0)
}

/// Most rows an FP8 product runs with its activations read as bf16, unquantized: by
/// `fp8_gemv_*` ([`gemv_max_rows`]), or by `fp8_mma_*` with `mma` (`CudaOptions::fp8_mma`).
pub fn unquantized_max_rows(skinny_max_rows: usize, mma: bool) -> usize {
    if mma {
        MMA_MAX_ROWS
    } else {
        gemv_max_rows(skinny_max_rows)
    }
}

impl crate::backend::CudaOptions {
    /// [`gemv_max_rows`] under these options: the `CpuOptions::fp8_activations_above` that
    /// makes the CPU reference compute what this backend's FP8 path does.
    pub fn fp8_gemv_max_rows(&self) -> usize {
        unquantized_max_rows(self.skinny_max_rows, self.fp8_mma)
    }
}

/// A cuBLASLt handle. Raw handles are not `Send`; the backend that owns this is used from one
/// thread at a time, which is what cuBLASLt asks of a handle.
struct LtHandle(lt_sys::cublasLtHandle_t);

// SAFETY: the handle is only used through `&mut`-free calls from the thread that owns the
// backend at the time; cuBLASLt handles may move between threads.
unsafe impl Send for LtHandle {}

impl Drop for LtHandle {
    fn drop(&mut self) {
        // SAFETY: created by `create_handle` and destroyed once, here.
        let _ = unsafe { lt::destroy_handle(self.0) };
    }
}

/// Buffers of one product, reused by every FP8 product of a step.
struct Scratch {
    tokens: usize,
    /// Quantized activations, `[tokens, widest input]` e4m3.
    q: CudaSlice<u8>,
    /// Their scales: per 128-column group `[groups, tokens]`, or per token.
    qs: CudaSlice<f32>,
    /// cuBLASLt's bf16 output `[tokens, widest part]`.
    d: CudaSlice<u16>,
}

impl Scratch {
    /// For steps of `tokens` tokens through products of up to `inp` inputs and `out`
    /// outputs.
    fn alloc(
        stream: &Arc<CudaStream>,
        (inp, out): (usize, usize),
        tokens: usize,
    ) -> Result<Scratch> {
        let tokens = lt_rows(tokens.max(1));
        let a = |what: &str, e| drv(&format!("FP8 scratch ({what}) allocation"), e);
        Ok(Scratch {
            tokens,
            q: stream
                .alloc_zeros::<u8>(tokens * inp)
                .map_err(|e| a("q", e))?,
            qs: stream
                .alloc_zeros::<f32>(tokens * inp.div_ceil(FP8_BLOCK))
                .map_err(|e| a("scales", e))?,
            d: stream
                .alloc_zeros::<u16>(tokens * out)
                .map_err(|e| a("d", e))?,
        })
    }
}

/// What FP8 products need besides the weights: the cuBLASLt handle, its workspace and the
/// scratch, allocated when the backend starts (and the scratch regrown with the step's
/// activations, `ensure_tokens`).
pub struct Fp8Ctx {
    lt: LtHandle,
    workspace: CudaSlice<u8>,
    scratch: RefCell<Scratch>,
    /// The widest input and output a product has.
    widest: (usize, usize),
    /// cuBLASLt's choice of algorithm for each product shape, asked once: the heuristic sees
    /// only the descriptors (types, layouts, scale modes, the workspace limit), which are
    /// the same for every call of a shape, and asking it costs more host time than the
    /// rest of the call. A step of a 36-layer model makes over 250 FP8 products. `None`:
    /// cuBLASLt has none (an f32 output it does not support with these scales).
    algos: RefCell<HashMap<AlgoKey, Option<lt_sys::cublasLtMatmulAlgo_t>>>,
    /// Whether GEMMs write f32 straight into the product's columns where cuBLASLt has such
    /// a GEMM (`CudaOptions::fp8_f32_out`).
    f32_out: bool,
    /// Products that did (for the checks of `fp8_check`).
    f32_products: std::cell::Cell<usize>,
    /// Whether products of up to `MMA_MAX_ROWS` rows run `fp8_mma_*` (`CudaOptions::fp8_mma`).
    mma: bool,
}

/// Most rows `fp8_mma_*` takes.
pub const MMA_MAX_ROWS: usize = shapes::FP8_MMA[0][1].0;

/// What a cached algorithm is for: `(m, n, k)`, the scale kind, and whether D is f32 (and
/// its leading dimension: the output's row, not the part's).
type AlgoKey = (usize, usize, usize, ScaleKind, Option<usize>);

impl Fp8Ctx {
    /// For `cfg`'s products in steps of `tokens` tokens.
    pub fn new(
        stream: &Arc<CudaStream>,
        cfg: &ModelConfig,
        tokens: usize,
        f32_out: bool,
    ) -> Result<Fp8Ctx> {
        Self::with_widest(stream, super::fp8::widest(cfg), tokens, f32_out)
    }

    /// For products of up to `widest` (inputs, outputs) in steps of `tokens` tokens.
    pub fn with_widest(
        stream: &Arc<CudaStream>,
        widest: (usize, usize),
        tokens: usize,
        f32_out: bool,
    ) -> Result<Fp8Ctx> {
        let handle =
            lt::create_handle().map_err(|e| EngineError::device("cuBLASLt initialisation", e))?;
        let lt = LtHandle(handle);
        let workspace = stream
            .alloc_zeros::<u8>(LT_WORKSPACE)
            .map_err(|e| drv("cuBLASLt workspace allocation", e))?;
        Ok(Fp8Ctx {
            lt,
            workspace,
            scratch: RefCell::new(Scratch::alloc(stream, widest, tokens)?),
            widest,
            algos: RefCell::default(),
            f32_out,
            f32_products: Default::default(),
            mma: false,
        })
    }

    /// With `CudaOptions::fp8_mma` as `on`.
    pub fn with_mma(mut self, on: bool) -> Fp8Ctx {
        self.mma = on;
        self
    }

    /// Whether products of up to `MMA_MAX_ROWS` rows run on the tensor cores (`fp8_mma_*`).
    pub fn mma(&self) -> bool {
        self.mma
    }

    /// Products whose GEMM wrote f32 straight into their columns, so far.
    pub fn f32_products(&self) -> usize {
        self.f32_products.get()
    }

    /// Scratch for steps of at least `tokens` tokens.
    pub fn ensure_tokens(&mut self, stream: &Arc<CudaStream>, tokens: usize) -> Result<()> {
        let widest = self.widest;
        let s = self.scratch.get_mut();
        if s.tokens < tokens {
            // The old buffers go first, so their memory can be reused.
            *s = Scratch::alloc(stream, widest, 1)?;
            *s = Scratch::alloc(stream, widest, tokens)?;
        }
        Ok(())
    }

    /// The loaded cuBLASLt's version (`120900` for 12.9.0), for `fp8::refuse_device`.
    pub fn lt_version() -> Result<usize> {
        // SAFETY: only checks that the library can be opened.
        if !unsafe { lt_sys::is_culib_present() } {
            return Err(Fp8Refusal::NoCublasLt.into());
        }
        // SAFETY: takes no arguments and reads a constant of the library.
        Ok(unsafe { lt_sys::cublasLtGetVersion() })
    }
}

/// The products of FP8 layers on one stream.
#[derive(Clone, Copy)]
pub struct Fp8Products<'a> {
    pub blas: &'a CudaBlas,
    pub s: &'a CudaStream,
    pub k: &'a Kernels,
    pub ctx: &'a Fp8Ctx,
    /// Products of at most this many rows use `fp8_gemv_*`.
    pub gemv_max_rows: usize,
}

impl Fp8Products<'_> {
    /// Whether a product of `m` rows runs `fp8_gemv_*` or `fp8_mma_*` (else cuBLASLt).
    pub fn gemv(&self, m: usize) -> bool {
        m >= 1 && m <= unquantized_max_rows(self.gemv_max_rows, self.ctx.mma)
    }

    /// `y[m, l.out] = x[m, l.inp] · Wᵀ (+ bias)`, y f32 row-major.
    pub fn linear(
        &self,
        l: &Fp8Linear,
        m: usize,
        x: &CudaSlice<u16>,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let name = "FP8 product";
        holds(name, "x", x.len(), m * l.inp)?;
        holds(name, "y", y.len(), m * l.out)?;
        if m == 0 {
            return Ok(());
        }
        let gemv = self.gemv(m);
        // The input is quantized once for all the parts that take it quantized the same way
        // (the same scale kind, and the same static scale if any).
        let mut quantized: Option<(ScaleKind, Option<u32>)> = None;
        for p in &l.parts {
            let bias = l.bias.as_ref().map(|b| b.slice(p.row0..p.row0 + p.rows));
            let cols = Cols {
                col0: p.row0,
                rows: p.rows,
                ld: l.out,
            };
            match &p.w {
                PartWeights::Bf16(w) => {
                    gemm_bf16_cols(self.blas, self.s, x, w, y, m, l.inp, cols)?;
                    self.add_bias(bias.as_ref(), y, m, cols)?;
                }
                PartWeights::Fp8 {
                    w, kind, scales, ..
                } if gemv => {
                    Gemv {
                        mma: self.ctx.mma,
                        x,
                        w,
                        kind: *kind,
                        scales,
                        bias: bias.as_ref(),
                        y,
                        rows: m,
                        k: l.inp,
                        cols,
                    }
                    .launch(self.k, self.s)?;
                }
                PartWeights::Fp8 { .. } => {
                    let into = (&mut *y, cols, bias.as_ref());
                    self.lt_part(&p.w, (x, m, l.inp), into, &mut quantized)?;
                }
            }
        }
        Ok(())
    }

    /// `y[:m, cols] += bias`, where the part has one (its product was written in place).
    fn add_bias(
        &self,
        bias: Option<&cudarc::driver::CudaView<f32>>,
        y: &mut CudaSlice<f32>,
        m: usize,
        cols: Cols,
    ) -> Result<()> {
        match bias {
            Some(b) => OutCols {
                d: None,
                bias: Some(b),
                y,
                rows: m,
                cols,
            }
            .launch(self.k, self.s),
            None => Ok(()),
        }
    }

    /// A part's product through cuBLASLt: the input quantized (unless `quantized` says the
    /// last part's quantization is this one's), the GEMM, and its output widened into the
    /// part's columns with the bias, or written there in f32 (`Fp8Ctx::f32_out`).
    fn lt_part(
        &self,
        part: &PartWeights,
        (x, m, k): (&CudaSlice<u16>, usize, usize),
        (y, cols, bias): (
            &mut CudaSlice<f32>,
            Cols,
            Option<&cudarc::driver::CudaView<f32>>,
        ),
        quantized: &mut Option<(ScaleKind, Option<u32>)>,
    ) -> Result<()> {
        let PartWeights::Fp8 {
            w,
            kind,
            scales,
            input_scale,
        } = part
        else {
            unreachable!("lt_part is called for FP8 parts only");
        };
        let mut sc = self.ctx.scratch.borrow_mut();
        let padded = lt_rows(m);
        if sc.tokens < padded {
            return Err(LaunchError::Fp8Scratch {
                tokens: sc.tokens,
                rows: padded,
            }
            .into());
        }
        let Scratch { q, qs, d, .. } = &mut *sc;
        let how = (*kind, input_scale.as_ref().map(|(v, _)| v.to_bits()));
        if *quantized != Some(how) {
            Quantize {
                x,
                q,
                scales: qs,
                rows: m,
                ld: padded,
                k,
                kind: *kind,
                fixed: input_scale.as_ref().map(|(_, d)| d),
            }
            .launch(self.k, self.s)?;
            *quantized = Some(how);
        }
        let mnk = (padded, cols.rows, k);
        // f32 straight into the columns: the GEMM writes all `padded` rows, so y must have
        // room for them (rows past m are never read), and cuBLASLt wants D 16-byte aligned.
        let direct = self.ctx.f32_out
            && y.len() >= (padded - 1) * cols.ld + cols.col0 + cols.rows
            && cols.col0.is_multiple_of(4)
            && cols.ld.is_multiple_of(4);
        let (w_scales, q, q_scales) = (scales, &*q, &*qs);
        let op = |out| LtOp {
            kind: *kind,
            w,
            w_scales,
            q,
            q_scales,
            out,
            mnk,
        };
        if direct
            && self
                .ctx
                .matmul(self.s, op(LtOut::F32 { y: &mut *y, cols }))?
        {
            self.ctx.f32_products.set(self.ctx.f32_products.get() + 1);
            return self.add_bias(bias, y, m, cols);
        }
        self.ctx.matmul(self.s, op(LtOut::Bf16(&mut *d)))?;
        OutCols {
            d: Some(d),
            bias,
            y,
            rows: m,
            cols,
        }
        .launch(self.k, self.s)?;
        Ok(())
    }
}

/// Where a part's product goes: columns `col0 .. col0 + rows` of output rows `ld` apart.
#[derive(Clone, Copy)]
struct Cols {
    col0: usize,
    rows: usize,
    ld: usize,
}

fn i32_of(what: &'static str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| LaunchError::Fp8Over32Bits { what, value: v }.into())
}

/// One FP8 GEMM through cuBLASLt: `d[m, n] = (q[m, k] · W[n, k]ᵀ)` with both operands' scales
/// applied.
struct LtOp<'a> {
    kind: ScaleKind,
    w: &'a CudaSlice<u8>,
    w_scales: &'a CudaSlice<f32>,
    q: &'a CudaSlice<u8>,
    q_scales: &'a CudaSlice<f32>,
    out: LtOut<'a>,
    mnk: (usize, usize, usize),
}

/// Where an FP8 GEMM writes.
enum LtOut<'a> {
    /// bf16 `[m, n]`, rows n apart (the scratch `fp8_out_cols` widens).
    Bf16(&'a mut CudaSlice<u16>),
    /// f32 straight into columns `cols` of the product's rows.
    F32 {
        y: &'a mut CudaSlice<f32>,
        cols: Cols,
    },
}

/// Descriptors destroyed when the call is over, however it ends.
struct LtDescs {
    desc: lt_sys::cublasLtMatmulDesc_t,
    layouts: Vec<lt_sys::cublasLtMatrixLayout_t>,
    pref: Option<lt_sys::cublasLtMatmulPreference_t>,
}

impl Drop for LtDescs {
    fn drop(&mut self) {
        // SAFETY: each handle was created by cuBLASLt for this call and is destroyed once.
        unsafe {
            if let Some(p) = self.pref {
                let _ = lt::destroy_matmul_pref(p);
            }
            for &l in &self.layouts {
                let _ = lt::destroy_matrix_layout(l);
            }
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

impl LtDescs {
    /// The descriptors of an FP8 GEMM (see `Fp8Ctx::matmul`): TN, the scale modes and
    /// pointers of A (weights) and B (activations), the layouts, and a preference for at
    /// most `ws_size` bytes of workspace.
    fn new(
        (a_mode, b_mode): (
            lt_sys::cublasLtMatmulMatrixScale_t,
            lt_sys::cublasLtMatmulMatrixScale_t,
        ),
        (a_scales, b_scales): (u64, u64),
        (m, n, k): (usize, usize, usize),
        (d_type, ld_d): (lt_sys::cudaDataType, usize),
        ws_size: usize,
    ) -> Result<LtDescs> {
        let desc = lt::create_matmul_desc(
            lt_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            lt_sys::cudaDataType::CUDA_R_32F,
        )
        .map_err(lt_err("descriptor"))?;
        let mut descs = LtDescs {
            desc,
            layouts: Vec::with_capacity(3),
            pref: None,
        };
        use lt_sys::cublasLtMatmulDescAttributes_t as A;
        let trans_a = blas_sys::cublasOperation_t::CUBLAS_OP_T as i32;
        let trans_b = blas_sys::cublasOperation_t::CUBLAS_OP_N as i32;
        // SAFETY: every attribute gets a value of the type the cuBLASLt documentation gives
        // it (int32 for the operations and scale modes, a device pointer for the scale
        // pointers), read during the call; the descriptor is live.
        unsafe {
            let set = |attr: A, p: *const c_void, size: usize| {
                lt::set_matmul_desc_attribute(desc, attr, p, size).map_err(lt_err("attribute"))
            };
            set(A::CUBLASLT_MATMUL_DESC_TRANSA, ptr(&trans_a), 4)?;
            set(A::CUBLASLT_MATMUL_DESC_TRANSB, ptr(&trans_b), 4)?;
            set(
                A::CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
                ptr(&(a_mode as i32)),
                4,
            )?;
            set(
                A::CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
                ptr(&(b_mode as i32)),
                4,
            )?;
            set(A::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, ptr(&a_scales), 8)?;
            set(A::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, ptr(&b_scales), 8)?;
        }
        let e4m3 = lt_sys::cudaDataType::CUDA_R_8F_E4M3;
        for (t, rows, cols, ld) in [(e4m3, k, n, k), (e4m3, k, m, k), (d_type, n, m, ld_d)] {
            let l = lt::create_matrix_layout(t, rows as u64, cols as u64, ld as i64)
                .map_err(lt_err("layout"))?;
            descs.layouts.push(l);
        }
        let pref = lt::create_matmul_pref().map_err(lt_err("preference"))?;
        descs.pref = Some(pref);
        // SAFETY: a u64 for MAX_WORKSPACE_BYTES, on a live preference.
        unsafe {
            lt::set_matmul_pref_attribute(
                pref,
                lt_sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                ptr(&(ws_size as u64)),
                8,
            )
            .map_err(lt_err("preference"))?;
        }
        Ok(descs)
    }
}

fn lt_err(what: &str) -> impl Fn(lt::CublasError) -> EngineError + '_ {
    move |e| EngineError::device(format!("cuBLASLt {what}"), e)
}

impl Fp8Ctx {
    /// The GEMM of `op` on stream `s`.
    ///
    /// Layout. cuBLASLt is column-major; FP8 GEMMs take only the "TN" form (A transposed, B
    /// not: both operands K-major, cuBLASLt's FP8 requirement). As `blas::gemm_bf16_f32`
    /// derives: A = W's memory, `[k, n]` column-major with ld k, op T; B = q's memory,
    /// `[k, m]` with ld k, op N; D = `dᵀ`, `[n, m]` with ld n, which is d row-major `[m, n]`.
    ///
    /// Scales (cuBLAS documentation, "cublasLtMatmulMatrixScale_t" and its block-scaling
    /// layouts; cuBLAS 12.9+, sm_90). For an operand stored `[inner, outer]` (inner
    /// contiguous; k for both operands here):
    /// - `BLK128x128_32F` (A, the weights): one f32 per 128 x 128 block, stored with the
    ///   inner blocks contiguous for each outer block and each such run padded to a multiple
    ///   of 4, `roundup(ceil(k / 128), 4) * ceil(n / 128)` values: the checkpoint's
    ///   `weight_scale_inv` `[ceil(n / 128), ceil(k / 128)]` with its rows padded
    ///   (`fp8::device_scales`);
    /// - `VEC128_32F` (B, the activations): one f32 per 128 inner elements of each outer
    ///   index, `ceil(k / 128) * m` values stored outer-index-major: scale of token t, group
    ///   g at `g * m + t` (`fp8_quant_rows`), m here a multiple of 4 (`lt_rows`);
    /// - `OUTER_VEC_32F`: one f32 per outer index: per output channel for A (`n` values), per
    ///   token for B (`m` values).
    ///
    /// The scales multiply in the f32 epilogue; alpha 1, beta 0 (C is D, never read).
    ///
    /// D is bf16 `[m, n]`, or f32 in columns `col0 .. col0 + n` of rows `ld` apart: D's
    /// pointer is then the first row's `col0`, its leading dimension `ld`. Returns false,
    /// having done nothing, where cuBLASLt has no GEMM for an f32 D (bf16 always has one,
    /// or the call fails).
    fn matmul(&self, s: &CudaStream, op: LtOp) -> Result<bool> {
        let (m, n, k) = op.mnk;
        let name = "cuBLASLt FP8 GEMM";
        holds(name, "w", op.w.len(), n * k)?;
        holds(name, "q", op.q.len(), m * k)?;
        let (d_type, ld_d, f32_ld) = match &op.out {
            LtOut::Bf16(d) => {
                holds(name, "d", d.len(), m * n)?;
                (lt_sys::cudaDataType::CUDA_R_16BF, n, None)
            }
            LtOut::F32 { y, cols } => {
                holds(name, "y", y.len(), (m - 1) * cols.ld + cols.col0 + n)?;
                (lt_sys::cudaDataType::CUDA_R_32F, cols.ld, Some(cols.ld))
            }
        };
        let (a_mode, b_mode, a_scales, b_scales) = match op.kind {
            ScaleKind::Block => (
                lt_sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F,
                lt_sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F,
                n.div_ceil(FP8_BLOCK) * super::fp8::block_stride(k),
                k.div_ceil(FP8_BLOCK) * m,
            ),
            ScaleKind::Row => (
                lt_sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F,
                lt_sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F,
                n,
                m,
            ),
        };
        holds(name, "weight scales", op.w_scales.len(), a_scales)?;
        holds(name, "activation scales", op.q_scales.len(), b_scales)?;
        let (wp, _gw) = op.w.device_ptr(s);
        let (qp, _gq) = op.q.device_ptr(s);
        let (wsp, _gws) = op.w_scales.device_ptr(s);
        let (qsp, _gqs) = op.q_scales.device_ptr(s);
        let (dp, _gd) = match op.out {
            LtOut::Bf16(d) => d.device_ptr_mut(s),
            LtOut::F32 { y, cols } => {
                let (p, g) = y.device_ptr_mut(s);
                (p + (cols.col0 * std::mem::size_of::<f32>()) as u64, g)
            }
        };
        let (workp, _gwork) = self.workspace.device_ptr(s);
        let ws_size = self.workspace.len();
        let descs = LtDescs::new(
            (a_mode, b_mode),
            (wsp, qsp),
            (m, n, k),
            (d_type, ld_d),
            ws_size,
        )?;
        let (desc, pref) = (descs.desc, descs.pref.expect("set by new"));
        let [a_desc, b_desc, d_desc] = [descs.layouts[0], descs.layouts[1], descs.layouts[2]];
        // SAFETY: the heuristic and the call read the live descriptors above, operands and
        // scales that hold what the layouts and scale modes describe (checked above), a
        // workspace of `ws_size` bytes and the stream's handle, all held for the call by
        // the guards.
        unsafe {
            let key = (m, n, k, op.kind, f32_ld);
            let cached = self.algos.borrow().get(&key).copied();
            let algo = match cached {
                Some(Some(a)) => a,
                Some(None) => return Ok(false),
                None => {
                    let h = lt::get_matmul_algo_heuristic(
                        self.lt.0, desc, a_desc, b_desc, d_desc, d_desc, pref,
                    );
                    let h = match (h, f32_ld) {
                        (Ok(h), _) => h,
                        (Err(e), Some(_)) => {
                            tracing::info!(
                                "cuBLASLt has no FP8 GEMM with f32 output for {m}x{k} by \
                                 {n}x{k} with {:?} weight scales ({e}): bf16 output, widened",
                                op.kind
                            );
                            self.algos.borrow_mut().insert(key, None);
                            return Ok(false);
                        }
                        (Err(e), None) => {
                            return Err(EngineError::device(
                                format!(
                                    "cuBLASLt has no FP8 GEMM for {m}x{k} by {n}x{k} with {:?} \
                                     weight scales",
                                    op.kind
                                ),
                                e,
                            ))
                        }
                    };
                    self.algos.borrow_mut().insert(key, Some(h.algo));
                    h.algo
                }
            };
            let (alpha, beta) = (1.0f32, 0.0f32);
            lt::matmul(
                self.lt.0,
                desc,
                ptr(&alpha),
                ptr(&beta),
                wp as *const c_void,
                a_desc,
                qp as *const c_void,
                b_desc,
                dp as *const c_void,
                d_desc,
                dp as *mut c_void,
                d_desc,
                &algo,
                workp as *mut c_void,
                ws_size,
                s.cu_stream() as lt_sys::cudaStream_t,
            )
            .map_err(lt_err(&format!("FP8 GEMM ({m}x{k} by {n}x{k})")))?;
        }
        drop(descs);
        Ok(true)
    }
}

fn ptr<T>(v: &T) -> *const c_void {
    v as *const T as *const c_void
}

/// cuBLAS's bf16 product of an unquantized part into its columns (`gemm_bf16_f32_cols`).
#[allow(clippy::too_many_arguments)]
fn gemm_bf16_cols(
    blas: &CudaBlas,
    s: &CudaStream,
    x: &CudaSlice<u16>,
    w: &CudaSlice<u16>,
    y: &mut CudaSlice<f32>,
    m: usize,
    k: usize,
    c: Cols,
) -> Result<()> {
    super::blas::gemm_bf16_f32_cols(blas, s, x, w, y, (m, c.rows, k), (c.ld, c.col0))
}

/// `fp8_gemv_*`, or with `mma` `fp8_mma_*`: a part's product for a few rows, into its
/// columns (the two kernels take the same arguments).
struct Gemv<'a> {
    mma: bool,
    x: &'a CudaSlice<u16>,
    w: &'a CudaSlice<u8>,
    kind: ScaleKind,
    scales: &'a CudaSlice<f32>,
    bias: Option<&'a cudarc::driver::CudaView<'a, f32>>,
    y: &'a mut CudaSlice<f32>,
    rows: usize,
    k: usize,
    cols: Cols,
}

impl Gemv<'_> {
    fn launch(self, kernels: &Kernels, s: &CudaStream) -> Result<()> {
        let kind = usize::from(self.kind == ScaleKind::Row);
        let (family, funcs, per_block): (&[(usize, KernelShape)], _, _) = match self.kind {
            _ if self.mma => (
                &shapes::FP8_MMA[kind],
                &kernels.fp8.mma[kind],
                shapes::FP8_MMA_ROWS_PER_BLOCK,
            ),
            ScaleKind::Block => (
                &shapes::FP8_GEMV_BLOCK,
                &kernels.fp8.gemv_block,
                shapes::FP8_ROWS_PER_BLOCK,
            ),
            ScaleKind::Row => (
                &shapes::FP8_GEMV_CHANNEL,
                &kernels.fp8.gemv_channel,
                shapes::FP8_ROWS_PER_BLOCK,
            ),
        };
        let (rows, n, k, c) = (self.rows, self.cols.rows, self.k, self.cols);
        let Some(i) = family.iter().position(|(most, _)| rows <= *most) else {
            return Err(Fp8Refusal::NoGemv { rows }.into());
        };
        let name = family[i].1.name;
        if rows == 0 || n == 0 || !k.is_multiple_of(16) {
            return Err(LaunchError::Fp8Gemv {
                kernel: name,
                rows,
                k,
                n,
            }
            .into());
        }
        holds(name, "x", self.x.len(), rows * k)?;
        holds(name, "w", self.w.len(), n * k)?;
        holds(name, "y", self.y.len(), (rows - 1) * c.ld + c.col0 + n)?;
        let stride = match self.kind {
            ScaleKind::Block => {
                let stride = super::fp8::block_stride(k);
                holds(
                    name,
                    "scales",
                    self.scales.len(),
                    n.div_ceil(FP8_BLOCK) * stride,
                )?;
                stride
            }
            ScaleKind::Row => {
                holds(name, "scales", self.scales.len(), n)?;
                0
            }
        };
        let (stride, ld, col0, ri, ni, ki) = (
            i32_of("scale stride", stride)?,
            i32_of("ld", c.ld)?,
            i32_of("col0", c.col0)?,
            i32_of("rows", rows)?,
            i32_of("n", n)?,
            i32_of("k", k)?,
        );
        let mut b = Launch::new(s, &funcs[i].1, kernels.pdl);
        b.arg(self.x).arg(self.w).arg(self.scales).arg(&stride);
        match self.bias {
            Some(bias) => {
                holds(name, "bias", bias.len(), n)?;
                b.arg(bias);
            }
            None => {
                b.arg(Null);
            }
        }
        b.arg(self.y).arg(&ld).arg(&col0).arg(&ri).arg(&ni).arg(&ki);
        let cfg = grid(&family[i].1, n.div_ceil(per_block), 1, 1)?;
        // SAFETY: the arguments match `fp8_gemv_*`'s and `fp8_mma_*`'s signature (x, w, ws, ws_stride, bias or
        // null, y, ldy, col0, rows, n, k) in order and type; x holds `rows` rows of k, w n
        // rows of k, the scales the grid of the kind, y the columns written (checked above);
        // k is a multiple of 16, so every 16-byte load of w (and 32-byte read of x) starts
        // on a 16-byte boundary of a 256-byte aligned allocation and ends inside its row.
        unsafe { b.launch(cfg) }.map_err(failed(name))?;
        Ok(())
    }
}

/// `fp8_quant_rows`: `x[rows, k]` bf16 as e4m3 with the scales `kind`'s GEMM takes.
pub(super) struct Quantize<'a> {
    pub x: &'a CudaSlice<u16>,
    pub q: &'a mut CudaSlice<u8>,
    pub scales: &'a mut CudaSlice<f32>,
    pub rows: usize,
    /// The scales' stride between 128-column groups (`Block`): at least `rows`, the token
    /// count of the GEMM that reads them (`lt_rows`).
    pub ld: usize,
    pub k: usize,
    pub kind: ScaleKind,
    /// A static scheme's scale (one value): every row quantized by it (`Row` only).
    pub fixed: Option<&'a CudaSlice<f32>>,
}

impl Quantize<'_> {
    pub(super) fn launch(self, kernels: &Kernels, s: &CudaStream) -> Result<()> {
        let name = shapes::FP8_QUANT.name;
        let (rows, k, ld) = (self.rows, self.k, self.ld);
        if !k.is_multiple_of(16) {
            return Err(LaunchError::Fp8QuantRows { kernel: name, k }.into());
        }
        if ld < rows {
            return Err(LaunchError::Fp8Scratch { tokens: ld, rows }.into());
        }
        holds(name, "x", self.x.len(), rows * k)?;
        holds(name, "q", self.q.len(), rows * k)?;
        let group = match self.kind {
            ScaleKind::Block => {
                holds(
                    name,
                    "scales",
                    self.scales.len(),
                    ld * k.div_ceil(FP8_BLOCK),
                )?;
                FP8_BLOCK as i32
            }
            ScaleKind::Row => {
                holds(name, "scales", self.scales.len(), rows)?;
                0
            }
        };
        if let Some(f) = self.fixed {
            holds(name, "static scale", f.len(), 1)?;
            if self.kind != ScaleKind::Row {
                return Err(LaunchError::Fp8StaticGroups { kernel: name }.into());
            }
        }
        i32_of("rows", rows)?;
        let (ldi, ki) = (i32_of("ld", ld)?, i32_of("k", k)?);
        let mut b = Launch::new(s, &kernels.fp8.quant, kernels.pdl);
        b.arg(self.x)
            .arg(self.q)
            .arg(self.scales)
            .arg(&ldi)
            .arg(&ki)
            .arg(&group);
        match self.fixed {
            Some(f) => b.arg(f),
            None => b.arg(Null),
        };
        let cfg = grid(&shapes::FP8_QUANT, rows, 1, 1)?;
        // SAFETY: the arguments match `fp8_quant_rows`'s signature in order and type; x and
        // q hold the grid's rows of k, the scales what the grouping writes (checked above).
        unsafe { b.launch(cfg) }.map_err(failed(name))?;
        Ok(())
    }
}

/// `fp8_out_cols`: `y[:, col0..] = d (+ bias)`, or with no `d`, `y[:, col0..] += bias`.
struct OutCols<'a> {
    d: Option<&'a CudaSlice<u16>>,
    bias: Option<&'a cudarc::driver::CudaView<'a, f32>>,
    y: &'a mut CudaSlice<f32>,
    rows: usize,
    cols: Cols,
}

impl OutCols<'_> {
    fn launch(self, kernels: &Kernels, s: &CudaStream) -> Result<()> {
        let name = shapes::FP8_OUT.name;
        let c = self.cols;
        holds(
            name,
            "y",
            self.y.len(),
            (self.rows - 1) * c.ld + c.col0 + c.rows,
        )?;
        let (ci, ld, col0) = (
            i32_of("cols", c.rows)?,
            i32_of("ld", c.ld)?,
            i32_of("col0", c.col0)?,
        );
        let mut b = Launch::new(s, &kernels.fp8.out, kernels.pdl);
        match self.d {
            Some(d) => {
                holds(name, "d", d.len(), self.rows * c.rows)?;
                b.arg(d);
            }
            None => {
                b.arg(Null);
            }
        }
        match self.bias {
            Some(bias) => {
                holds(name, "bias", bias.len(), c.rows)?;
                b.arg(bias);
            }
            None => {
                b.arg(Null);
            }
        }
        b.arg(self.y).arg(&ci).arg(&ld).arg(&col0);
        let cfg = grid(
            &shapes::FP8_OUT,
            self.rows,
            c.rows.div_ceil(8 * shapes::FP8_OUT.threads as usize),
            1,
        )?;
        // SAFETY: the arguments match `fp8_out_cols`'s signature (d or null, bias or null, y,
        // cols, ldy, col0) in order and type; d holds the grid's rows of `cols`, the bias
        // `cols`, y the columns written (checked above).
        unsafe { b.launch(cfg) }.map_err(failed(name))?;
        Ok(())
    }
}
