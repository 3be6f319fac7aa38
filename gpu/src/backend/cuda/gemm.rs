//! Matrix products: bf16 inputs, f32 accumulation and output (bf16 for an MLP's gate/up
//! products before SiLU), through cuBLAS, or for a few rows through the skinny kernels
//! (`kernels/skinny.cu`), which stream the weights once.

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaSlice, CudaStream};

use super::blas::{gemm_bf16_bf16, gemm_bf16_f32};
use super::fp8::{Fp8Linear, PartWeights};
use super::fp8_gemm::{Fp8Ctx, Fp8Products};
use super::kernels::{AddRmsNorm, BiasAdd, Kernels, SiluMul, SiluMulBf16, SILU_MUL_BF16_COLS};
use super::skinny::{RopeIn, SkinnyGemm, SkinnyIn, SkinnyOut, SkinnyW};
use super::weights::{DevLinear, Linear};
use crate::backend::error::{BackendError, LaunchError};
use crate::error::{EngineError, Result};

/// Where a forward pass's products run: the skinny kernels for products of at most
/// `skinny_max_rows` rows (`CudaOptions::skinny_max_rows`), cuBLAS for the rest.
#[derive(Clone, Copy)]
pub struct Products<'a> {
    pub blas: &'a CudaBlas,
    pub s: &'a CudaStream,
    pub k: &'a Kernels,
    pub skinny_max_rows: usize,
    /// cuBLASLt and scratch for FP8 products; `None` for a bf16 model.
    pub fp8: Option<&'a Fp8Ctx>,
}

impl Products<'_> {
    fn skinny(&self, m: usize, k: usize) -> bool {
        m <= self.skinny_max_rows && SkinnyGemm::takes(m, k)
    }

    /// `y[m, n] = x[m, k] · W[n, k]ᵀ`.
    pub fn product(
        &self,
        x: &CudaSlice<u16>,
        w: &CudaSlice<u16>,
        y: &mut CudaSlice<f32>,
        (m, n, k): (usize, usize, usize),
    ) -> Result<()> {
        self.product_bias(x, w, None, y, (m, n, k))
    }

    /// `y = x · Wᵀ + bias`: the skinny kernels add the bias as they write the sums, after
    /// cuBLAS it takes a launch of its own.
    fn product_bias(
        &self,
        x: &CudaSlice<u16>,
        w: &CudaSlice<u16>,
        bias: Option<&CudaSlice<f32>>,
        y: &mut CudaSlice<f32>,
        (m, n, k): (usize, usize, usize),
    ) -> Result<()> {
        if self.skinny(m, k) {
            return SkinnyGemm {
                x: SkinnyIn::X(x),
                w: SkinnyW::Bf16(w),
                out: SkinnyOut::Sums { y, bias },
                rows: m,
                n,
                k,
            }
            .launch(self.k, self.s);
        }
        gemm_bf16_f32(self.blas, self.s, x, w, y, (m, n, k))?;
        if let Some(bias) = bias {
            BiasAdd {
                y,
                bias,
                rows: m,
                cols: n,
            }
            .launch(self.k, self.s)?;
        }
        Ok(())
    }

    /// `y = x · Wᵀ` (+ bias) for a `DevLinear` over the first `m` rows.
    pub fn linear(
        &self,
        l: &DevLinear,
        m: usize,
        x: &CudaSlice<u16>,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        self.product_bias(x, &l.w, l.bias.as_ref(), y, (m, l.out, l.inp))
    }

    /// The FP8 products, with products of up to `skinny_max_rows` rows by `fp8_gemv_*`.
    fn fp8(&self) -> Result<Fp8Products<'_>> {
        let ctx = self.fp8.ok_or(BackendError::Invariant(
            "an FP8 product without cuBLASLt set up",
        ))?;
        Ok(Fp8Products {
            blas: self.blas,
            s: self.s,
            k: self.k,
            ctx,
            gemv_max_rows: self.skinny_max_rows,
        })
    }

    /// `y = x · Wᵀ` (+ bias) for a dense layer's product over the first `m` rows.
    pub fn proj(
        &self,
        l: &Linear,
        m: usize,
        x: &CudaSlice<u16>,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        match l {
            Linear::Bf16(l) => self.linear(l, m, x, y),
            Linear::Fp8(l) => self.fp8()?.linear(l, m, x, y),
        }
    }

    /// An MLP's `act = silu(x · gateᵀ) · (x · upᵀ)` in bf16 from its stacked gate/up
    /// projection (`2 * inter` outputs): one skinny kernel that never writes the products
    /// where `fuses` holds (bf16 skinny, or an FP8 product of one FP8 part); else for bf16
    /// weights without a bias the products in bf16 and `silu_mul_bf16`; else the f32
    /// products into `products` and `silu_mul`.
    pub fn gate_up_silu_proj(
        &self,
        gate_up: &Linear,
        m: usize,
        x: &CudaSlice<u16>,
        products: &mut CudaSlice<f32>,
        act: &mut CudaSlice<u16>,
    ) -> Result<()> {
        let (out, inp) = gate_up.shape();
        if self.fuses(gate_up, m, Fused::Silu) {
            let (w, _, _, _) = skinny_weights(gate_up)?;
            return SkinnyGemm {
                x: SkinnyIn::X(x),
                w,
                out: SkinnyOut::SiluMul { act },
                rows: m,
                n: out / 2,
                k: inp,
            }
            .launch(self.k, self.s);
        }
        let inter = out / 2;
        if let Linear::Bf16(l) = gate_up {
            if l.bias.is_none() && inter.is_multiple_of(SILU_MUL_BF16_COLS) && !self.skinny(m, inp)
            {
                // cuBLAS writes the products in bf16 (into `products`' memory, which holds
                // twice as many), as a bf16 model's own layers round them, and
                // `silu_mul_bf16` reads half the bytes `silu_mul` reads.
                // SAFETY: u16 has no invalid bit patterns, and the view is written before
                // it is read.
                let mut bf = unsafe { products.transmute_mut::<u16>(m * out) }.ok_or(
                    BackendError::Invariant("gate/up products' buffer short of a bf16 copy"),
                )?;
                gemm_bf16_bf16(self.blas, self.s, x, &l.w, &mut bf, (m, out, inp))?;
                return SiluMulBf16 {
                    gate_up: &bf.as_view(),
                    out: act,
                    rows: m,
                    inter,
                }
                .launch(self.k, self.s);
            }
        }
        self.proj(gate_up, m, x, products)?;
        SiluMul {
            gate_up: products,
            out: act,
            rows: m,
            inter,
        }
        .launch(self.k, self.s)
    }

    /// Whether a product of `m` rows of `l` runs as one skinny kernel (the skinny bf16
    /// kernels, or the fused forms of `fp8_gemv_*` for an FP8 product of one FP8 part)
    /// with the prologue or epilogue `f`.
    pub fn fuses(&self, l: &Linear, m: usize, f: Fused) -> bool {
        let normed = matches!(f, Fused::Norm | Fused::NormSilu);
        let silu = matches!(f, Fused::Silu | Fused::NormSilu);
        if silu && (l.has_bias() || !l.shape().0.is_multiple_of(2)) {
            return false;
        }
        match l {
            Linear::Bf16(l) if normed => self.skinny(m, l.inp) && SkinnyGemm::takes_norm(m, l.inp),
            Linear::Bf16(l) => self.skinny(m, l.inp),
            // The fused FP8 forms are `fp8_gemv_*`'s, which `fp8_mma` replaces.
            Linear::Fp8(l) => {
                fp8_whole(l).is_ok()
                    && self.fp8.is_some_and(|c| !c.mma())
                    && m <= super::fp8_gemm::gemv_max_rows(self.skinny_max_rows)
                    && SkinnyGemm::takes_fp8(m, l.inp, normed)
            }
        }
    }

    /// `proj` of `bf16(rmsnorm(res_in + delta) * w)`, with `res_out = res_in + delta`,
    /// in one skinny kernel (`fuses` must hold for `Fused::Norm`), rotated as
    /// `linear_rope` when `rope` is given.
    pub fn linear_normed(
        &self,
        l: &Linear,
        m: usize,
        input: SkinnyIn,
        y: &mut CudaSlice<f32>,
        rope: Option<RopeIn>,
    ) -> Result<()> {
        let (w, bias, n, k) = skinny_weights(l)?;
        SkinnyGemm {
            x: input,
            w,
            out: match rope {
                Some(rope) => SkinnyOut::Rope { y, bias, rope },
                None => SkinnyOut::Sums { y, bias },
            },
            rows: m,
            n,
            k,
        }
        .launch(self.k, self.s)
    }

    /// A layer's q/k/v `proj` over `m` rows (one token each; `fuses` must hold for
    /// `Fused::Rope`) in one skinny kernel that also rotates q and k and writes the new K
    /// and V to the cache, as `rope_kv_write` would after it.
    pub fn linear_rope(
        &self,
        l: &Linear,
        m: usize,
        x: &CudaSlice<u16>,
        y: &mut CudaSlice<f32>,
        rope: RopeIn,
    ) -> Result<()> {
        let (w, bias, n, k) = skinny_weights(l)?;
        SkinnyGemm {
            x: SkinnyIn::X(x),
            w,
            out: SkinnyOut::Rope { y, bias, rope },
            rows: m,
            n,
            k,
        }
        .launch(self.k, self.s)
    }

    /// `gate_up_silu` of the normed stream, likewise (`fuses` must hold for
    /// `Fused::NormSilu`).
    pub fn gate_up_silu_normed(
        &self,
        gate_up: &Linear,
        m: usize,
        input: SkinnyIn,
        act: &mut CudaSlice<u16>,
    ) -> Result<()> {
        let (w, bias, n, k) = skinny_weights(gate_up)?;
        if bias.is_some() || !n.is_multiple_of(2) {
            return Err(LaunchError::NoFusedGateUp.into());
        }
        SkinnyGemm {
            x: input,
            w,
            out: SkinnyOut::SiluMul { act },
            rows: m,
            n: n / 2,
            k,
        }
        .launch(self.k, self.s)
    }
}

/// The prologue or epilogue a skinny kernel takes in place of a launch of its own
/// (`Products::fuses`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fused {
    /// The residual add and RMSNorm before the product.
    Norm,
    /// The SiLU-gated product of an MLP's stacked gate/up weights.
    Silu,
    /// Both.
    NormSilu,
    /// The rotary embedding and K/V write after a q/k/v product.
    Rope,
}

/// An FP8 product's weights when one FP8 part covers all its rows (what the fused kernels
/// stream).
fn fp8_whole(l: &Fp8Linear) -> Result<SkinnyW<'_>> {
    match l.parts.as_slice() {
        [p] if p.row0 == 0 && p.rows == l.out => match &p.w {
            PartWeights::Fp8 {
                w, kind, scales, ..
            } => Ok(SkinnyW::Fp8 {
                w,
                kind: *kind,
                scales,
            }),
            PartWeights::Bf16(_) => Err(not_fusable()),
        },
        _ => Err(not_fusable()),
    }
}

fn not_fusable() -> EngineError {
    BackendError::Invariant("a fused FP8 product of several parts, or of an unquantized one").into()
}

/// A product's weights, bias and shape (outputs, inputs) for a skinny kernel.
fn skinny_weights(l: &Linear) -> Result<(SkinnyW<'_>, Option<&CudaSlice<f32>>, usize, usize)> {
    Ok(match l {
        Linear::Bf16(l) => (SkinnyW::Bf16(&l.w), l.bias.as_ref(), l.out, l.inp),
        Linear::Fp8(l) => (fp8_whole(l)?, l.bias.as_ref(), l.out, l.inp),
    })
}

/// A stream and the compiled kernels on device `ordinal`, for the checks below.
fn check_device(ordinal: usize) -> Result<(std::sync::Arc<cudarc::driver::CudaStream>, Kernels)> {
    use super::device::drv;
    let ctx = cudarc::driver::CudaContext::new(ordinal).map_err(|e| drv("context creation", e))?;
    let s = ctx.new_stream().map_err(|e| drv("stream creation", e))?;
    let (kernels, _) = Kernels::load(&ctx)?;
    Ok((s, kernels))
}

/// A device buffer's values as bits, for bit-for-bit comparisons.
fn f32_bits(s: &std::sync::Arc<CudaStream>, v: &CudaSlice<f32>) -> Result<Vec<u32>> {
    let h = s
        .clone_dtoh(v)
        .map_err(|e| super::device::drv("download", e))?;
    Ok(h.into_iter().map(f32::to_bits).collect())
}

fn bf16_bits(s: &std::sync::Arc<CudaStream>, v: &CudaSlice<u16>) -> Result<Vec<u32>> {
    let h = s
        .clone_dtoh(v)
        .map_err(|e| super::device::drv("download", e))?;
    Ok(h.into_iter().map(u32::from).collect())
}

/// `add_rmsnorm_to_bf16` on a device copy of `res` (`[m, k]`), for the checks of the norm
/// prologues: the residual it leaves and the normed bf16 rows (eps 1e-6).
pub(super) fn norm_apart(
    s: &std::sync::Arc<CudaStream>,
    kernels: &Kernels,
    res: &[f32],
    delta: &CudaSlice<f32>,
    norm: &CudaSlice<f32>,
    (m, k): (usize, usize),
) -> Result<(CudaSlice<f32>, CudaSlice<u16>)> {
    use super::device::drv;
    let mut residual = s.clone_htod(res).map_err(|e| drv("upload", e))?;
    let mut xn = s
        .clone_htod(&vec![0x7fc0u16; m * k])
        .map_err(|e| drv("upload", e))?;
    AddRmsNorm {
        residual: &mut residual,
        delta,
        w: norm,
        out: &mut xn,
        rows: m,
        hidden: k,
        eps: 1e-6,
    }
    .launch(kernels, s)?;
    Ok((residual, xn))
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
    let (s, kernels) = check_device(ordinal)?;
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
            fp8: None,
        }
        .product(&xd, &wd, &mut y, (m, n, k))?;
        s.clone_dtoh(&y).map_err(|e| drv("download", e))
    };
    let skinny = run(m)?;
    let cublas = run(0)?;
    Ok((skinny, cublas))
}

/// The SiLU-gated product of gate/up products held in bf16 (`gu`, `[rows, 2 * inter]` bf16
/// bits), on device `ordinal`: by `silu_mul_bf16`, and by `silu_mul` from the same values
/// widened to f32. Returns both as bf16 bits, meant to be identical.
pub fn silu_mul_bf16_and_f32(
    ordinal: usize,
    gu: &[u16],
    (rows, inter): (usize, usize),
) -> Result<[Vec<u32>; 2]> {
    use super::device::drv;
    let (s, kernels) = check_device(ordinal)?;
    let wide: Vec<f32> = gu
        .iter()
        .map(|&b| f32::from_bits(u32::from(b) << 16))
        .collect();
    let gu_d = s.clone_htod(gu).map_err(|e| drv("upload", e))?;
    let wide_d = s.clone_htod(&wide).map_err(|e| drv("upload", e))?;
    let poisoned = || {
        s.clone_htod(&vec![0x7fc0u16; rows * inter])
            .map_err(|e| drv("upload", e))
    };
    let (mut from_bf16, mut from_f32) = (poisoned()?, poisoned()?);
    SiluMulBf16 {
        gate_up: &gu_d.as_view(),
        out: &mut from_bf16,
        rows,
        inter,
    }
    .launch(&kernels, &s)?;
    SiluMul {
        gate_up: &wide_d,
        out: &mut from_f32,
        rows,
        inter,
    }
    .launch(&kernels, &s)?;
    Ok([bf16_bits(&s, &from_bf16)?, bf16_bits(&s, &from_f32)?])
}

/// The skinny kernels' epilogues against the launches they replace, on device `ordinal`:
/// `x` `[m, k]` and `w` `[2n, k]` as bf16 bits, `bias` `2n` long. Returns, as bits, the
/// product with its bias added by the kernel and by `bias_add` after it, then the SiLU-gated
/// product (w as n gate rows then n up rows) by `skinny_silu` and by `silu_mul` after the
/// plain product: each pair is meant to be identical.
pub fn skinny_epilogues(
    ordinal: usize,
    x: &[u16],
    w: &[u16],
    bias: &[f32],
    (m, n, k): (usize, usize, usize),
) -> Result<[Vec<u32>; 4]> {
    use super::device::drv;
    let (s, kernels) = check_device(ordinal)?;
    let up = |v: &[u16]| s.clone_htod(v).map_err(|e| drv("upload", e));
    let (xd, wd) = (up(x)?, up(w)?);
    let bd = s.clone_htod(bias).map_err(|e| drv("upload", e))?;
    // Poisoned first, so an element a kernel leaves unwritten shows.
    let f32s = |len: usize| {
        s.clone_htod(&vec![f32::NAN; len])
            .map_err(|e| drv("upload", e))
    };
    let bf16s = |len: usize| {
        s.clone_htod(&vec![0x7fc0u16; len])
            .map_err(|e| drv("upload", e))
    };
    let sums = |y: &mut CudaSlice<f32>, bias: Option<&CudaSlice<f32>>| {
        SkinnyGemm {
            x: SkinnyIn::X(&xd),
            w: SkinnyW::Bf16(&wd),
            out: SkinnyOut::Sums { y, bias },
            rows: m,
            n: 2 * n,
            k,
        }
        .launch(&kernels, &s)
    };
    let (mut fused, mut unfused) = (f32s(m * 2 * n)?, f32s(m * 2 * n)?);
    sums(&mut fused, Some(&bd))?;
    sums(&mut unfused, None)?;
    BiasAdd {
        y: &mut unfused,
        bias: &bd,
        rows: m,
        cols: 2 * n,
    }
    .launch(&kernels, &s)?;
    let (mut act_fused, mut act_unfused, mut products) =
        (bf16s(m * n)?, bf16s(m * n)?, f32s(m * 2 * n)?);
    SkinnyGemm {
        x: SkinnyIn::X(&xd),
        w: SkinnyW::Bf16(&wd),
        out: SkinnyOut::SiluMul {
            act: &mut act_fused,
        },
        rows: m,
        n,
        k,
    }
    .launch(&kernels, &s)?;
    sums(&mut products, None)?;
    SiluMul {
        gate_up: &products,
        out: &mut act_unfused,
        rows: m,
        inter: n,
    }
    .launch(&kernels, &s)?;
    let f = |v: &CudaSlice<f32>| f32_bits(&s, v);
    let b = |v: &CudaSlice<u16>| bf16_bits(&s, v);
    Ok([f(&fused)?, f(&unfused)?, b(&act_fused)?, b(&act_unfused)?])
}

/// The skinny kernels' norm prologue against the launches it replaces, on device `ordinal`:
/// `res` and `delta` `[m, k]` f32, `norm` `[k]`, `w` `[2n, k]` bf16 bits. Returns, as bits,
/// the residual written and the products (`[m, 2n]` sums, then the SiLU-gated `[m, n]`),
/// first by `skinny_norm*` and then by `add_rmsnorm_to_bf16` followed by the plain skinny
/// kernels: each pair is meant to be identical.
pub fn skinny_norm_prologues(
    ordinal: usize,
    res: &[f32],
    delta: &[f32],
    norm: &[f32],
    w: &[u16],
    (m, n, k): (usize, usize, usize),
) -> Result<[Vec<u32>; 6]> {
    use super::device::drv;
    let (s, kernels) = check_device(ordinal)?;
    let up = |v: &[f32]| s.clone_htod(v).map_err(|e| drv("upload", e));
    let (res_d, delta_d, norm_d) = (up(res)?, up(delta)?, up(norm)?);
    let wd = s.clone_htod(w).map_err(|e| drv("upload", e))?;
    let f32s = |len: usize| {
        s.clone_htod(&vec![f32::NAN; len])
            .map_err(|e| drv("upload", e))
    };
    let bf16s = |len: usize| {
        s.clone_htod(&vec![0x7fc0u16; len])
            .map_err(|e| drv("upload", e))
    };
    let normed = |res_out| SkinnyIn::Norm {
        res_in: &res_d,
        delta: &delta_d,
        w: &norm_d,
        eps: 1e-6,
        res_out,
    };
    // Fused: the sums (block 0 writes the residual), then the SiLU-gated product.
    let (mut res_fused, mut y_fused, mut act_fused) =
        (f32s(m * k)?, f32s(m * 2 * n)?, bf16s(m * n)?);
    SkinnyGemm {
        x: normed(&mut res_fused),
        w: SkinnyW::Bf16(&wd),
        out: SkinnyOut::Sums {
            y: &mut y_fused,
            bias: None,
        },
        rows: m,
        n: 2 * n,
        k,
    }
    .launch(&kernels, &s)?;
    let mut scratch = f32s(m * k)?;
    SkinnyGemm {
        x: normed(&mut scratch),
        w: SkinnyW::Bf16(&wd),
        out: SkinnyOut::SiluMul {
            act: &mut act_fused,
        },
        rows: m,
        n,
        k,
    }
    .launch(&kernels, &s)?;
    // Separate: the norm kernel in place on a copy of the residual, then the products.
    let (res_sep, xn) = norm_apart(&s, &kernels, res, &delta_d, &norm_d, (m, k))?;
    let (mut y_sep, mut act_sep) = (f32s(m * 2 * n)?, bf16s(m * n)?);
    SkinnyGemm {
        x: SkinnyIn::X(&xn),
        w: SkinnyW::Bf16(&wd),
        out: SkinnyOut::Sums {
            y: &mut y_sep,
            bias: None,
        },
        rows: m,
        n: 2 * n,
        k,
    }
    .launch(&kernels, &s)?;
    SkinnyGemm {
        x: SkinnyIn::X(&xn),
        w: SkinnyW::Bf16(&wd),
        out: SkinnyOut::SiluMul { act: &mut act_sep },
        rows: m,
        n,
        k,
    }
    .launch(&kernels, &s)?;
    let f = |v: &CudaSlice<f32>| f32_bits(&s, v);
    let b = |v: &CudaSlice<u16>| bf16_bits(&s, v);
    Ok([
        f(&res_fused)?,
        f(&res_sep)?,
        f(&y_fused)?,
        f(&y_sep)?,
        b(&act_fused)?,
        b(&act_sep)?,
    ])
}
