//! The skinny products' launches: `kernels/skinny.cu`'s bf16 kernels, and the fused forms
//! of `kernels/fp8.cu`'s `fp8_gemv_*` for FP8 weights, with the same prologue (the residual
//! add and RMSNorm) and epilogues (bias, SiLU-gated product, rotary embedding and K/V write).
//!
//! The cache slots a rotated product writes were checked when the batch was laid out
//! (`batch::build`), or are a decode graph's padding, which points at the scratch block.

use cudarc::driver::{CudaFunction, CudaSlice, CudaStream};

use super::buffers::StepInputs;
use super::fp8::{block_stride, ScaleKind};
use super::kernels::{failed, holds, Heads, Kernels};
use super::launch::{Launch, Null};
use super::shapes::{self, grid, KernelShape};
use crate::backend::error::{BackendError, LaunchError};
use crate::config::FP8_BLOCK;
use crate::error::{EngineError, Result};

/// What a skinny product writes: `y = x · wᵀ (+ bias)` in f32, or for an MLP's stacked
/// gate/up weights (`n` gate rows, then `n` up rows) `act = silu(gate) · up` in bf16.
pub enum SkinnyOut<'a> {
    Sums {
        y: &'a mut CudaSlice<f32>,
        bias: Option<&'a CudaSlice<f32>>,
    },
    SiluMul {
        act: &'a mut CudaSlice<u16>,
    },
    /// `Sums` of a layer's q/k/v product (`n` = `rope.heads.row()`), each q and k head
    /// normalised (when the layer has q/k norms) and rotated, and the new K and V written to
    /// the cache at each row's slot, as `rope_kv_write` leaves them: one row a token.
    Rope {
        y: &'a mut CudaSlice<f32>,
        bias: Option<&'a CudaSlice<f32>>,
        rope: RopeIn<'a>,
    },
}

impl<'a> SkinnyOut<'a> {
    /// Pushes the output's arguments of a kernel `name` over `rows` rows of `n` (checking
    /// that the buffers hold them); returns the weight rows one block covers. `scalars` are
    /// a rotated product's head counts and size, as `i32`s, and its q/k norms' epsilon.
    fn push(
        self,
        b: &mut Launch<'a>,
        name: &'static str,
        rows: usize,
        n: usize,
        scalars: &'a ([i32; 3], f32),
    ) -> Result<usize> {
        let bias_arg = |b: &mut Launch<'a>, bias: Option<&'a CudaSlice<f32>>| -> Result<()> {
            match bias {
                Some(bias) => {
                    holds(name, "bias", bias.len(), n)?;
                    b.arg(bias);
                }
                None => {
                    b.arg(Null);
                }
            }
            Ok(())
        };
        Ok(match self {
            SkinnyOut::Sums { y, bias } => {
                holds(name, "y", y.len(), rows * n)?;
                bias_arg(b, bias)?;
                b.arg(y);
                shapes::SKINNY_ROWS_PER_BLOCK
            }
            SkinnyOut::SiluMul { act } => {
                holds(name, "act", act.len(), rows * n)?;
                b.arg(act);
                shapes::SKINNY_ROWS_PER_BLOCK / shapes::SKINNY_ROWS
            }
            SkinnyOut::Rope { y, bias, rope } => {
                let h = rope.heads;
                if n != h.row() || h.dim % 2 != 0 {
                    return Err(BackendError::Invariant(
                        "a rotated skinny product that is not a layer's q/k/v of even heads",
                    )
                    .into());
                }
                holds(name, "y", y.len(), rows * n)?;
                holds(name, "positions", rope.inputs.positions.len(), rows)?;
                holds(name, "slots", rope.inputs.slots.len(), rows)?;
                holds(name, "inv_freq", rope.inv_freq.len(), h.dim / 2)?;
                holds(name, "ticks", rope.ticks.len(), h.q + h.kv)?;
                bias_arg(b, bias)?;
                b.arg(y)
                    .arg(&rope.inputs.positions)
                    .arg(rope.inv_freq)
                    .arg(&rope.inputs.slots)
                    .arg(rope.k_cache)
                    .arg(rope.v_cache);
                match rope.norms {
                    Some((q_w, k_w, _)) => {
                        holds(name, "q_w", q_w.len(), h.dim)?;
                        holds(name, "k_w", k_w.len(), h.dim)?;
                        b.arg(q_w).arg(k_w);
                    }
                    None => {
                        b.arg(Null).arg(Null);
                    }
                }
                let (heads, eps) = scalars;
                b.arg(eps).arg(rope.ticks);
                b.arg(&heads[0]).arg(&heads[1]).arg(&heads[2]);
                shapes::SKINNY_ROWS_PER_BLOCK
            }
        })
    }
}

/// What `SkinnyOut::Rope` rotates by and writes to: the step's positions and slots, the
/// frequency table, the layer's cache, and its q/k norms (weights and epsilon; Qwen3) if
/// it has them.
pub struct RopeIn<'a> {
    pub inputs: &'a StepInputs,
    pub inv_freq: &'a CudaSlice<f32>,
    pub k_cache: &'a mut CudaSlice<u16>,
    pub v_cache: &'a mut CudaSlice<u16>,
    pub heads: Heads,
    pub norms: Option<(&'a CudaSlice<f32>, &'a CudaSlice<f32>, f32)>,
    /// A ticket per q and k head, zero between launches (`Workspace::rope_ticks`): with
    /// norms, the last of a head's warps normalises and rotates it (`kernels/skinny.cu`).
    pub ticks: &'a mut CudaSlice<i32>,
}

/// A skinny product's input: bf16 rows, or the residual add and RMSNorm that produce them,
/// taken as the kernel's prologue (`skinny_norm*`): `res_out = res_in + delta`, and the
/// input `bf16(rmsnorm(res_out) * w)`, exactly as `add_rmsnorm_to_bf16` computes it.
pub enum SkinnyIn<'a> {
    X(&'a CudaSlice<u16>),
    Norm {
        res_in: &'a CudaSlice<f32>,
        delta: &'a CudaSlice<f32>,
        w: &'a CudaSlice<f32>,
        eps: f32,
        res_out: &'a mut CudaSlice<f32>,
    },
}

/// A skinny product's weights: bf16 rows, or e4m3 rows with their scales (an FP8 product
/// of one part, `fp8::PartWeights::Fp8`), which the fused forms of `fp8_gemv_*` stream.
#[derive(Clone, Copy)]
pub enum SkinnyW<'a> {
    Bf16(&'a CudaSlice<u16>),
    Fp8 {
        w: &'a CudaSlice<u8>,
        kind: ScaleKind,
        scales: &'a CudaSlice<f32>,
    },
}

/// A skinny kernel family: its name, its shapes and its functions, by the most rows each
/// takes.
type SkinnyFamily<'k> = (
    &'static str,
    &'static [(usize, KernelShape)],
    &'k [(usize, CudaFunction)],
);

/// `x[rows, k]` (bf16) times `w[n, k]ᵀ` (`w[2n, k]ᵀ` for `SkinnyOut::SiluMul`) by the skinny
/// kernel for that many rows (see `kernels/skinny.cu`), or for FP8 weights by the fused
/// form of `fp8_gemv_*` (`kernels/fp8.cu`; a prologue or an epilogue is required, the
/// plain FP8 product being `fp8_gemm`'s).
pub struct SkinnyGemm<'a> {
    pub x: SkinnyIn<'a>,
    pub w: SkinnyW<'a>,
    pub out: SkinnyOut<'a>,
    pub rows: usize,
    pub n: usize,
    pub k: usize,
}

impl SkinnyGemm<'_> {
    /// Whether a product of `rows` rows with inner dimension `k` has a skinny kernel.
    pub fn takes(rows: usize, k: usize) -> bool {
        rows >= 1 && rows <= shapes::SKINNY_GEMM[3].0 && k >= 8 && k.is_multiple_of(8)
    }

    /// Whether it has one that takes the norm as its prologue.
    pub fn takes_norm(rows: usize, k: usize) -> bool {
        Self::takes(rows, k) && rows <= shapes::SKINNY_NORM[1].0 && k <= shapes::NORM_MAX
    }

    /// Whether an FP8 product of `rows` rows with inner dimension `k` has a fused form
    /// (the norm prologue, when `normed`, also holding the rows in shared memory).
    pub fn takes_fp8(rows: usize, k: usize, normed: bool) -> bool {
        rows >= 1
            && rows <= shapes::FP8_SILU[0][1].0
            && k >= 16
            && k.is_multiple_of(16)
            && (!normed || k <= shapes::NORM_MAX)
    }

    /// The kernel family for the weights, an input and an output: its name, shapes and
    /// functions.
    fn family<'k>(&self, kernels: &'k Kernels) -> Result<SkinnyFamily<'k>> {
        let normed = matches!(self.x, SkinnyIn::Norm { .. });
        let kind = match self.w {
            SkinnyW::Bf16(_) => None,
            SkinnyW::Fp8 { kind, .. } => Some(match kind {
                ScaleKind::Block => 0,
                ScaleKind::Row => 1,
            }),
        };
        let f = &kernels.fp8.fused;
        Ok(match (kind, normed, &self.out) {
            (None, false, SkinnyOut::Sums { .. }) => {
                ("skinny_gemm", &shapes::SKINNY_GEMM, &kernels.skinny)
            }
            (None, false, SkinnyOut::SiluMul { .. }) => {
                ("skinny_silu", &shapes::SKINNY_SILU, &kernels.skinny_silu)
            }
            (None, false, SkinnyOut::Rope { .. }) => {
                ("skinny_rope", &shapes::SKINNY_ROPE, &kernels.skinny_rope)
            }
            (None, true, SkinnyOut::Sums { .. }) => {
                ("skinny_norm", &shapes::SKINNY_NORM, &kernels.skinny_norm)
            }
            (None, true, SkinnyOut::SiluMul { .. }) => (
                "skinny_norm_silu",
                &shapes::SKINNY_NORM_SILU,
                &kernels.skinny_norm_silu,
            ),
            (None, true, SkinnyOut::Rope { .. }) => (
                "skinny_norm_rope",
                &shapes::SKINNY_NORM_ROPE,
                &kernels.skinny_norm_rope,
            ),
            (Some(_), false, SkinnyOut::Sums { .. }) => {
                return Err(BackendError::Invariant(
                    "a plain FP8 product is fp8_gemm's, not a fused skinny kernel's",
                )
                .into())
            }
            (Some(i), false, SkinnyOut::SiluMul { .. }) => {
                ("fp8_silu", &shapes::FP8_SILU[i], &f.silu[i])
            }
            (Some(i), false, SkinnyOut::Rope { .. }) => {
                ("fp8_rope", &shapes::FP8_ROPE[i], &f.rope[i])
            }
            (Some(i), true, SkinnyOut::Sums { .. }) => {
                ("fp8_norm", &shapes::FP8_NORM[i], &f.norm[i])
            }
            (Some(i), true, SkinnyOut::SiluMul { .. }) => {
                ("fp8_norm_silu", &shapes::FP8_NORM_SILU[i], &f.norm_silu[i])
            }
            (Some(i), true, SkinnyOut::Rope { .. }) => {
                ("fp8_norm_rope", &shapes::FP8_NORM_ROPE[i], &f.norm_rope[i])
            }
        })
    }

    pub fn launch(self, kernels: &Kernels, s: &CudaStream) -> Result<()> {
        let silu = matches!(self.out, SkinnyOut::SiluMul { .. });
        let normed = matches!(self.x, SkinnyIn::Norm { .. });
        let (name, family, funcs) = self.family(kernels)?;
        let (rows, n, k) = (self.rows, self.n, self.k);
        let fits = match self.w {
            SkinnyW::Fp8 { .. } => Self::takes_fp8(rows, k, normed),
            SkinnyW::Bf16(_) if normed => Self::takes_norm(rows, k),
            SkinnyW::Bf16(_) => Self::takes(rows, k),
        };
        if !fits || n == 0 {
            return Err(LaunchError::NoSkinny {
                kernel: name,
                rows,
                k,
                n,
            }
            .into());
        }
        let w_rows = if silu { 2 * n } else { n };
        let (shape, func) = family
            .iter()
            .zip(funcs)
            .find(|((most, _), _)| rows <= *most)
            .map(|((_, shape), (_, func))| (shape, func))
            .ok_or(LaunchError::NoSkinny {
                kernel: name,
                rows,
                k,
                n,
            })?;
        let too_big = |what: &'static str| -> EngineError {
            LaunchError::Over32Bits { kernel: name, what }.into()
        };
        let (ri, ni, ki) = (
            i32::try_from(rows).map_err(|_| too_big("rows"))?,
            i32::try_from(n).map_err(|_| too_big("n"))?,
            i32::try_from(k).map_err(|_| too_big("k"))?,
        );
        // An FP8 product's block-scale stride (0 for a scale per row), alive until the launch.
        let stride = match self.w {
            SkinnyW::Fp8 {
                kind: ScaleKind::Block,
                ..
            } => block_stride(k),
            _ => 0,
        };
        let stride_arg = i32::try_from(stride).map_err(|_| too_big("scale stride"))?;
        // A rotated product's head counts and size, and its q/k norms' epsilon, alive until
        // the launch.
        let rope_args = match &self.out {
            SkinnyOut::Rope { rope, .. } => {
                let h = rope.heads;
                (
                    [h.q, h.kv, h.dim].map(|v| i32::try_from(v).unwrap_or(i32::MAX)),
                    rope.norms.map_or(0.0, |(_, _, eps)| eps),
                )
            }
            _ => ([0; 3], 0.0),
        };
        let mut b = Launch::new(s, func, kernels.pdl);
        match self.x {
            SkinnyIn::X(x) => {
                holds(name, "x", x.len(), rows * k)?;
                b.arg(x);
            }
            SkinnyIn::Norm {
                res_in,
                delta,
                w,
                eps,
                res_out,
            } => {
                holds(name, "res_in", res_in.len(), rows * k)?;
                holds(name, "delta", delta.len(), rows * k)?;
                holds(name, "norm", w.len(), k)?;
                holds(name, "res_out", res_out.len(), rows * k)?;
                b.arg(res_in).arg(delta).arg(w).arg(&eps).arg(res_out);
            }
        }
        match self.w {
            SkinnyW::Bf16(w) => {
                holds(name, "w", w.len(), w_rows * k)?;
                b.arg(w);
            }
            SkinnyW::Fp8 { w, kind, scales } => {
                holds(name, "w", w.len(), w_rows * k)?;
                let need = match kind {
                    ScaleKind::Block => w_rows.div_ceil(FP8_BLOCK) * stride,
                    ScaleKind::Row => w_rows,
                };
                holds(name, "scales", scales.len(), need)?;
                b.arg(w).arg(scales).arg(&stride_arg);
            }
        }
        let per_block = self.out.push(&mut b, name, rows, n, &rope_args)?;
        b.arg(&ri).arg(&ni).arg(&ki);
        let cfg = grid(shape, n.div_ceil(per_block), 1, 1)?;
        // SAFETY: the arguments match `skinny_gemm_m*`'s signature (x, w, bias or null, y,
        // rows, n, k), `skinny_silu_m*`'s (x, w, act, rows, n, k) or `skinny_rope_m*`'s (x,
        // w, bias or null, y, positions, inv_freq, slots, k_cache, v_cache, q_w or null, k_w
        // or null, qk_eps, ticks, nq, nkv, d, rows, n, k) in order and type (the norm weights
        // both given or both null), the `skinny_norm*` ones with (res_in, delta, norm, eps,
        // res_out) in x's place, and the `fp8_*` ones with (w, ws, ws_stride) in w's; the
        // inputs hold `rows` rows of k, w the rows the kernel streams (and its scales their
        // grid), y or act `rows` rows of n, the bias n and the norm k, a rotated product's
        // positions and slots `rows`, its frequencies half a head, its norms a head and its
        // tickets a q and k head each (checked above), and
        // every slot is inside the cache (see the module docs); k is a multiple of 8 (16
        // for FP8, and at most NORM_MAX for a norm prologue, which its shared memory
        // holds), so every 16-byte load starts on a 16-byte boundary of a 256-byte aligned
        // allocation and ends inside its row.
        unsafe { b.launch(cfg) }.map_err(failed(name))?;
        Ok(())
    }
}
