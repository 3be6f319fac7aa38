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

/// An FP8 product of one part: `w` `[n, k]` e4m3 with its scales in the device layout.
fn one_part(
    w: CudaSlice<u8>,
    kind: ScaleKind,
    scales: CudaSlice<f32>,
    bias: Option<CudaSlice<f32>>,
    (n, k): (usize, usize),
) -> Fp8Linear {
    Fp8Linear {
        out: n,
        inp: k,
        parts: vec![Part {
            row0: 0,
            rows: n,
            w: PartWeights::Fp8 {
                w,
                kind,
                scales,
                input_scale: None,
            },
        }],
        bias,
    }
}

/// Which kernel `fp8_product` runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fp8Path {
    /// `fp8_gemv_*` (at most 4 rows).
    Gemv,
    /// `fp8_mma_*` (at most 16 rows; `CudaOptions::fp8_mma`).
    Mma,
    /// The activations quantized and cuBLASLt's GEMM.
    Lt,
}

/// An FP8 product on device `ordinal`: `x` `[m, k]` bf16 bits, `w` `[n, k]` e4m3 bytes with
/// `scales` as a checkpoint stores them (`block`: `[ceil(n / 128), ceil(k / 128)]`; else one
/// per row), `bias` `[n]`, by `path`; cuBLASLt writes `y` in f32 directly where it can with
/// `f32_out` (`CudaOptions::fp8_f32_out`: `y` then has room for the GEMM's padded rows).
/// Returns `y` `[m, n]` and whether cuBLASLt wrote it in f32.
#[allow(clippy::too_many_arguments)]
pub fn fp8_product(
    ordinal: usize,
    x: &[u16],
    w: &[u8],
    scales: &[f32],
    block: bool,
    bias: Option<&[f32]>,
    (m, n, k): (usize, usize, usize),
    path: Fp8Path,
    f32_out: bool,
) -> Result<(Vec<f32>, bool)> {
    let (s, kernels) = device(ordinal)?;
    let blas = CudaBlas::new(s.clone()).map_err(|e| EngineError::device("cuBLAS handle", e))?;
    let ctx = Fp8Ctx::with_widest(&s, (k, n), m, f32_out)?.with_mma(path == Fp8Path::Mma);
    let (kind, scales) = if block {
        (ScaleKind::Block, pad_block_scales(scales, n, k))
    } else {
        (ScaleKind::Row, scales.to_vec())
    };
    let bias = bias.map(|b| up(&s, b)).transpose()?;
    let l = one_part(up(&s, w)?, kind, up(&s, &scales)?, bias, (n, k));
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
        gemv_max_rows: if path == Fp8Path::Gemv { m } else { 0 },
    };
    if (path != Fp8Path::Lt) != p.gemv(m) {
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

/// The fused forms of `fp8_gemv_*` (`fp8_norm_*`, `fp8_norm_silu_*`, `fp8_silu_*`) against
/// the launches they replace, on device `ordinal`: `res` and `delta` `[m, k]` f32, `norm`
/// `[k]`, `w` `[2n, k]` e4m3 with `scales` as a checkpoint stores them (see `fp8_product`).
/// Returns, as bits, four pairs meant to be identical, each fused then separate: the
/// residual written; the products `[m, 2n]` of the normed rows; their SiLU-gated product
/// `[m, n]` (w as n gate rows then n up rows); the SiLU-gated product of the normed rows
/// given as input (`fp8_silu_*`) against `fp8_gemv_*` and `silu_mul`.
#[allow(clippy::too_many_arguments)]
pub fn fp8_fused_products(
    ordinal: usize,
    res: &[f32],
    delta: &[f32],
    norm: &[f32],
    w: &[u8],
    scales: &[f32],
    block: bool,
    (m, n, k): (usize, usize, usize),
) -> Result<[Vec<u32>; 8]> {
    use super::kernels::SiluMul;
    use super::skinny::{SkinnyGemm, SkinnyIn, SkinnyOut, SkinnyW};
    let (s, kernels) = device(ordinal)?;
    let blas = CudaBlas::new(s.clone()).map_err(|e| EngineError::device("cuBLAS handle", e))?;
    let ctx = Fp8Ctx::with_widest(&s, (k, 2 * n), m, false)?;
    let (kind, scales) = if block {
        (ScaleKind::Block, pad_block_scales(scales, 2 * n, k))
    } else {
        (ScaleKind::Row, scales.to_vec())
    };
    let (wd, sd) = (up(&s, w)?, up(&s, &scales)?);
    let (res_d, delta_d, norm_d) = (up(&s, res)?, up(&s, delta)?, up(&s, norm)?);
    // Poisoned first, so an element a kernel leaves unwritten shows.
    let f32s = |len: usize| up(&s, &vec![f32::NAN; len]);
    let bf16s = |len: usize| up(&s, &vec![0x7fc0u16; len]);
    let weights = SkinnyW::Fp8 {
        w: &wd,
        kind,
        scales: &sd,
    };
    let normed = |res_out| SkinnyIn::Norm {
        res_in: &res_d,
        delta: &delta_d,
        w: &norm_d,
        eps: 1e-6,
        res_out,
    };
    let fused = |x: SkinnyIn, out: SkinnyOut, n: usize| {
        SkinnyGemm {
            x,
            w: weights,
            out,
            rows: m,
            n,
            k,
        }
        .launch(&kernels, &s)
    };
    let (mut res_f, mut y_f, mut act_f) = (f32s(m * k)?, f32s(m * 2 * n)?, bf16s(m * n)?);
    let (y, bias) = (&mut y_f, None);
    fused(normed(&mut res_f), SkinnyOut::Sums { y, bias }, 2 * n)?;
    let mut scratch = f32s(m * k)?;
    fused(
        normed(&mut scratch),
        SkinnyOut::SiluMul { act: &mut act_f },
        n,
    )?;
    // Separate: the norm kernel on a copy of the residual, the product, silu_mul.
    let (res_s, xn) = super::gemm::norm_apart(&s, &kernels, res, &delta_d, &norm_d, (m, k))?;
    let l = one_part(wd.clone(), kind, sd.clone(), None, (2 * n, k));
    let p = Fp8Products {
        blas: &blas,
        s: &s,
        k: &kernels,
        ctx: &ctx,
        gemv_max_rows: m,
    };
    let (mut y_s, mut act_s, mut act_x) = (f32s(m * 2 * n)?, bf16s(m * n)?, bf16s(m * n)?);
    p.linear(&l, m, &xn, &mut y_s)?;
    SiluMul {
        gate_up: &y_s,
        out: &mut act_s,
        rows: m,
        inter: n,
    }
    .launch(&kernels, &s)?;
    fused(SkinnyIn::X(&xn), SkinnyOut::SiluMul { act: &mut act_x }, n)?;
    let f = |v: &CudaSlice<f32>| -> Result<Vec<u32>> {
        let h = s.clone_dtoh(v).map_err(|e| drv("download", e))?;
        Ok(h.into_iter().map(f32::to_bits).collect())
    };
    let b = |v: &CudaSlice<u16>| -> Result<Vec<u32>> {
        let h = s.clone_dtoh(v).map_err(|e| drv("download", e))?;
        Ok(h.into_iter().map(u32::from).collect())
    };
    Ok([
        f(&res_f)?,
        f(&res_s)?,
        f(&y_f)?,
        f(&y_s)?,
        b(&act_f)?,
        b(&act_s)?,
        b(&act_x)?,
        b(&act_s)?,
    ])
}
