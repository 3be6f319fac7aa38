//! The FP8 kernels and cuBLASLt's FP8 GEMMs run on their own, for `tests/cuda_parity.rs` to
//! hold against host computations on a GPU: a layout mistake in the scales (which operand
//! dimension is outer, the padding) shows there as a wrong product, not as a model that is
//! merely a little off.

use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};

use super::device::drv;
use super::fp8::{pad_block_scales, Fp8Linear, Part, PartWeights, ScaleKind};
use super::fp8_gemm::{Fp8Ctx, Fp8Products, Quantize};
use super::kernels::Kernels;
use crate::backend::error::Fp8Refusal;
use crate::error::{EngineError, Result};

fn device(ordinal: usize) -> Result<(Arc<CudaStream>, Kernels)> {
    let ctx = CudaContext::new(ordinal).map_err(|e| drv("context creation", e))?;
    let s = ctx.new_stream().map_err(|e| drv("stream creation", e))?;
    let (kernels, _) = Kernels::load(&ctx)?;
    Ok((s, kernels))
}

fn up<T: cudarc::driver::DeviceRepr>(s: &Arc<CudaStream>, v: &[T]) -> Result<CudaSlice<T>> {
    s.clone_htod(v).map_err(|e| drv("upload", e))
}

/// An FP8 product on device `ordinal`: `x` `[m, k]` bf16 bits, `w` `[n, k]` e4m3 bytes with
/// `scales` as a checkpoint stores them (`block`: `[ceil(n / 128), ceil(k / 128)]`; else one
/// per row), `bias` `[n]`. `gemv` runs `fp8_gemv_*` (m at most 4), otherwise the activations
/// are quantized and cuBLASLt multiplies, with `f32_out` into `y` directly where it can
/// (`CudaOptions::fp8_f32_out`: `y` then has room for the GEMM's padded rows). Returns `y`
/// `[m, n]` and whether cuBLASLt wrote it in f32.
#[allow(clippy::too_many_arguments)]
pub fn fp8_product(
    ordinal: usize,
    x: &[u16],
    w: &[u8],
    scales: &[f32],
    block: bool,
    bias: Option<&[f32]>,
    (m, n, k): (usize, usize, usize),
    gemv: bool,
    f32_out: bool,
) -> Result<(Vec<f32>, bool)> {
    let (s, kernels) = device(ordinal)?;
    let blas = CudaBlas::new(s.clone()).map_err(|e| EngineError::device("cuBLAS handle", e))?;
    let ctx = Fp8Ctx::with_widest(&s, (k, n), m, f32_out)?;
    let (kind, scales) = if block {
        (ScaleKind::Block, pad_block_scales(scales, n, k))
    } else {
        (ScaleKind::Row, scales.to_vec())
    };
    let l = Fp8Linear {
        out: n,
        inp: k,
        parts: vec![Part {
            row0: 0,
            rows: n,
            w: PartWeights::Fp8 {
                w: up(&s, w)?,
                kind,
                scales: up(&s, &scales)?,
                input_scale: None,
            },
        }],
        bias: bias.map(|b| up(&s, b)).transpose()?,
    };
    let xd = up(&s, x)?;
    // Poisoned first, so an element the product leaves unwritten shows; as long as the
    // engine's products are (they hold the step's largest batch), so a direct f32 GEMM has
    // room for its padded rows.
    let mut y = up(&s, &vec![f32::NAN; super::fp8::lt_rows(m) * n])?;
    let p = Fp8Products {
        blas: &blas,
        s: &s,
        k: &kernels,
        ctx: &ctx,
        gemv_max_rows: if gemv { m } else { 0 },
    };
    if gemv != p.gemv(m) {
        return Err(Fp8Refusal::NoGemv { rows: m }.into());
    }
    p.linear(&l, m, &xd, &mut y)?;
    let mut y = s.clone_dtoh(&y).map_err(|e| drv("download", e))?;
    y.truncate(m * n);
    Ok((y, ctx.f32_products() > 0))
}

/// `fp8_quant_rows` on device `ordinal`: `x` `[rows, k]` bf16 bits quantized per token in
/// groups of 128 (`per_group`) or per token, by its own amax or by the static scale `fixed`.
/// Returns the e4m3 bytes `[rows, k]` and the scales as the GEMM reads them (per group:
/// `[groups, rows]`; per token: `[rows]`).
pub fn fp8_quantize(
    ordinal: usize,
    x: &[u16],
    (rows, k): (usize, usize),
    per_group: bool,
    fixed: Option<f32>,
) -> Result<(Vec<u8>, Vec<f32>)> {
    let (s, kernels) = device(ordinal)?;
    let xd = up(&s, x)?;
    let fixed = fixed.map(|v| up(&s, &[v])).transpose()?;
    let mut q = up(&s, &vec![0xaau8; rows * k])?;
    let groups = if per_group { k.div_ceil(128) } else { 1 };
    let mut scales = up(&s, &vec![f32::NAN; rows * groups])?;
    Quantize {
        x: &xd,
        q: &mut q,
        scales: &mut scales,
        rows,
        ld: rows,
        k,
        kind: if per_group {
            ScaleKind::Block
        } else {
            ScaleKind::Row
        },
        fixed: fixed.as_ref(),
    }
    .launch(&kernels, &s)?;
    Ok((
        s.clone_dtoh(&q).map_err(|e| drv("download", e))?,
        s.clone_dtoh(&scales).map_err(|e| drv("download", e))?,
    ))
}
