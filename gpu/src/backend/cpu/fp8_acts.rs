//! FP8 activations on the CPU: the model an FP8 GEMM computes, as a reference for it.
//!
//! The CPU backend runs an FP8 checkpoint dequantized (`quant::dequantize`): the weights'
//! own values with the activations unrounded. A GPU's FP8 GEMM also rounds each activation
//! to e4m3 (3 mantissa bits) by a scale per token, per token group or per tensor, which
//! moves a small model's logits by several percent of their scale. Held only to the
//! dequantized model, a GPU's FP8 path can therefore be wrong by as much without a test
//! seeing it. With [`Fp8Activations`] on a product, the CPU rounds its input as the GEMM
//! does (`fp8_quant_rows` in the CUDA kernels): from the input as bf16 (what a GPU engine
//! holds), the scale `amax / 448` over what it covers (or the layer's calibrated
//! `input_scale`, saturating past 448 of it), each value `e4m3(x / s) * s`, zero where the
//! scale is zero. The product of those values with the dequantized weights is what the
//! GEMM's f32 epilogue computes, up to the order of its sums.
//!
//! `CpuOptions::fp8_activations_above` turns it on for a model's FP8 layers; products of
//! few rows keep their activations, as the CUDA backend's decode GEMVs do.

use rayon::prelude::*;

use crate::config::{ActivationScheme, ModelConfig};
use crate::error::Result;
use crate::safetensors::{e4m3_to_f32, f32_to_e4m3, WeightStore};

/// The largest finite e4m3 magnitude.
const E4M3_MAX: f32 = 448.0;

/// How one part of a product has its input quantized.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ActQuant {
    /// One scale per token and group of this many input columns (the `fp8` format's
    /// dynamic scheme, groups of 128).
    Groups(usize),
    /// One scale per token.
    Token,
    /// One scale over every token of the product.
    Tensor,
    /// The layer's calibrated scale for every token (`{module}.input_scale`).
    Fixed(f32),
}

impl ActQuant {
    /// How `module`'s activations are quantized under `cfg`'s `quantization_config`; `None`
    /// for a layer it leaves unquantized or quantizes weights only.
    pub fn of(cfg: &ModelConfig, store: &WeightStore, module: &str) -> Result<Option<ActQuant>> {
        let Some(scheme) = cfg.quantization.as_ref().and_then(|q| q.scheme_of(module)) else {
            return Ok(None);
        };
        Ok(match scheme.activations {
            ActivationScheme::DynamicTokenGroup(g) => Some(ActQuant::Groups(g)),
            ActivationScheme::DynamicToken => Some(ActQuant::Token),
            ActivationScheme::DynamicTensor => Some(ActQuant::Tensor),
            ActivationScheme::StaticTensor => {
                crate::quant::static_input_scale(store, module, &scheme)?.map(ActQuant::Fixed)
            }
            ActivationScheme::Unquantized => None,
        })
    }
}

/// A stacked product's parts in row order: each part's output rows and how its input is
/// quantized (`None`: a part the config leaves unquantized reads the input as it is).
#[derive(Clone, Debug, PartialEq)]
pub struct Fp8Activations {
    pub parts: Vec<(usize, Option<ActQuant>)>,
    /// Products of at most this many rows read their input unquantized.
    pub above_rows: usize,
}

impl Fp8Activations {
    /// For the parts `(module, rows)` of one product; `None` when no part's activations are
    /// quantized.
    pub fn of_parts(
        cfg: &ModelConfig,
        store: &WeightStore,
        parts: &[(String, usize)],
        above_rows: usize,
    ) -> Result<Option<Fp8Activations>> {
        let parts = parts
            .iter()
            .map(|(name, rows)| Ok((*rows, ActQuant::of(cfg, store, name)?)))
            .collect::<Result<Vec<_>>>()?;
        Ok(parts
            .iter()
            .any(|(_, q)| q.is_some())
            .then_some(Fp8Activations { parts, above_rows }))
    }
}

/// `x` (`[m, k]`) as an FP8 GEMM reads it under `q`: each value rounded to bf16, then to
/// e4m3 by its scale, and multiplied back by the scale.
pub fn fake_quantize(x: &[f32], m: usize, k: usize, q: ActQuant) -> Vec<f32> {
    debug_assert_eq!(x.len(), m * k);
    let bf16 = |v: f32| half::bf16::from_f32(v).to_f32();
    let mut out: Vec<f32> = x.iter().map(|&v| bf16(v)).collect();
    let round = |vals: &mut [f32], s: f32| {
        for v in vals {
            *v = if s > 0.0 {
                e4m3_to_f32(f32_to_e4m3(*v / s)) * s
            } else {
                0.0
            };
        }
    };
    let amax = |vals: &[f32]| vals.iter().fold(0f32, |a, v| a.max(v.abs()));
    match q {
        ActQuant::Groups(g) => out.par_chunks_mut(k).for_each(|row| {
            for grp in row.chunks_mut(g.max(1)) {
                let s = amax(grp) / E4M3_MAX;
                round(grp, s);
            }
        }),
        ActQuant::Token => out.par_chunks_mut(k).for_each(|row| {
            let s = amax(row) / E4M3_MAX;
            round(row, s);
        }),
        ActQuant::Tensor => {
            let s = amax(&out) / E4M3_MAX;
            round(&mut out, s);
        }
        ActQuant::Fixed(s) => out.par_chunks_mut(k).for_each(|row| round(row, s)),
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values on e4m3's grid times a power-of-two scale come back as they were; values
    /// between grid points move to the nearer one; each group, token or tensor takes its
    /// own scale.
    #[test]
    fn activations_round_to_e4m3_by_the_scale_of_what_covers_them() {
        // A row whose amax is 448 * 2^-4 = 28: scale 2^-4, so 28 and 1.5 (24 and 1.5 * 16 =
        // 24 on e4m3's grid) stay, 1.53125 (24.5 of the scale) rounds to 24 (ties to even:
        // e4m3 steps by 2 between 16 and 32, 24.5 is nearer 24).
        let x = [28.0, 1.5, -1.53125, 0.0];
        let q = fake_quantize(&x, 1, 4, ActQuant::Token);
        assert_eq!(q, vec![28.0, 1.5, -1.5, 0.0]);
        // Two groups of two: the second group's scale comes from its own amax (0.5/448), so
        // 0.3 becomes 256 of it (e4m3 steps by 32 above 256), 2/7; per token the row's scale
        // 2^-4 makes it 4.8 steps, rounded to 5: 0.3125.
        let x = [28.0, 0.25, 0.5, 0.3];
        let g = fake_quantize(&x, 1, 4, ActQuant::Groups(2));
        let t = fake_quantize(&x, 1, 4, ActQuant::Token);
        assert_eq!((g[0], g[1], t[3]), (28.0, 0.25, 0.3125), "{g:?} {t:?}");
        assert!((g[3] - 2.0 / 7.0).abs() < 1e-6, "{g:?}");
        // Per token, a second row with a small amax keeps 3 bits of precision; per tensor it
        // takes the first row's scale (1) and 0.0005, under half of e4m3's smallest step
        // (2^-9), flushes to zero.
        let x = [448.0, 0.0, 0.0005, 0.0];
        let tok = fake_quantize(&x, 2, 2, ActQuant::Token)[2];
        assert!((tok - 0.0005).abs() < 0.0005 / 16.0, "{tok}");
        assert_eq!(fake_quantize(&x, 2, 2, ActQuant::Tensor)[2], 0.0);
        // A fixed scale saturates at 448 of it; a zero row stays zero under a zero scale.
        let f = fake_quantize(&[100.0, -3.0], 1, 2, ActQuant::Fixed(0.125));
        assert_eq!(f, vec![56.0, -3.0]);
        assert_eq!(
            fake_quantize(&[0.0; 4], 2, 2, ActQuant::Token),
            vec![0.0; 4]
        );
    }
}
