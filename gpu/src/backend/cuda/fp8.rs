//! FP8 checkpoints on the CUDA backend: the quantized linear layers stay e4m3 on the device,
//! one byte a weight, with their f32 scales; everything the config leaves unquantized (the
//! embeddings, the output head, norms, ignored layers) is uploaded as for a bf16 model.
//!
//! A stacked product (q/k/v, gate/up) is held as parts, each a run of rows that one kernel or
//! one GEMM computes: adjacent FP8 parts with the same kind of scale are merged when their
//! scales concatenate into one valid grid (always for per-row scales; for 128 x 128 blocks
//! when every part before the last has a multiple of 128 rows, as in every published model),
//! and a part the config leaves unquantized (an ignored `up_proj`) is a bf16 part. Each part
//! writes its own columns of the product.
//!
//! What this path does not run is refused by name before anything is uploaded
//! (`refuse_schemes`, `refuse_device`): the math of the checkpoint is never swapped for
//! another one. `fp8_gemm` runs the products.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};

use super::device::upload_err;
use crate::backend::error::Fp8Refusal;
use crate::checkpoint::{Checkpoint, Stack};
use crate::config::{ActivationScheme, ModelConfig, Scheme, WeightScale, FP8_BLOCK};
use crate::error::Result;
use crate::safetensors::{TensorData, WeightStore};

/// The oldest compute capability with FP8 tensor cores (Ada, 8.9).
pub const FP8_MIN_CAPABILITY: (i32, i32) = (8, 9);

/// The first cuBLASLt with the scale modes this path uses (`CUBLASLT_MATMUL_MATRIX_SCALE_
/// VEC128_32F`, `BLK128x128_32F`, `OUTER_VEC_32F`): they came with cuBLAS 12.9 (CUDA 12.9.0)
/// for Hopper (sm_90) only, as NVIDIA's cuBLAS documentation lists them and its maintainers
/// confirm (NVIDIA/CUDALibrarySamples issues 270 and 310). `cublasLtGetVersion` gives
/// major * 10000 + minor * 100 + patch.
pub const LT_MIN_VERSION: usize = 120_900;

/// How a part's weights are scaled on the device, which also says how its activations are
/// quantized for cuBLASLt: `Block` weights meet activations quantized per token in groups
/// of 128 (the `fp8` format's dynamic scheme); `Row` weights (per-channel, or a per-tensor
/// scale repeated per row, the same product) meet activations quantized per token, by
/// their own amax (dynamic) or by the layer's calibrated `input_scale` (static per-tensor,
/// llm-compressor's `FP8` recipe: the one scale given to every token).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ScaleKind {
    Block,
    Row,
}

impl ScaleKind {
    /// The device kind of a scheme this path runs; `None` for one it does not run
    /// (`Fp8Refusal::Scheme` says which it runs).
    pub fn of(s: &Scheme) -> Option<ScaleKind> {
        match (s.weights, s.activations) {
            (WeightScale::Block { rows, cols }, ActivationScheme::DynamicTokenGroup(g))
                if rows == FP8_BLOCK && cols == FP8_BLOCK && g == FP8_BLOCK =>
            {
                Some(ScaleKind::Block)
            }
            (
                WeightScale::Channel | WeightScale::Tensor,
                ActivationScheme::DynamicToken | ActivationScheme::StaticTensor,
            ) => Some(ScaleKind::Row),
            _ => None,
        }
    }
}

/// The token count cuBLASLt's FP8 GEMM runs for `m` tokens: `m` rounded up to a multiple of
/// 4. On Hopper its block-scaled GEMMs (`VEC128_32F` activations) take no other token count:
/// the heuristic answers `CUBLAS_STATUS_NOT_SUPPORTED` for 5 tokens (measured on an H200,
/// cuBLAS 12.9+). The padding rows of the quantized activations hold whatever an earlier step
/// left there; each output row depends only on its own activation row, and the padding
/// rows' outputs are never read.
pub fn lt_rows(m: usize) -> usize {
    m.div_ceil(4) * 4
}

/// Block scales are stored row-major, `[ceil(rows / 128), stride]`, each row padded to a
/// multiple of 4 values: cuBLASLt's `BLK128x128_32F` layout for an operand whose inner
/// (contiguous) dimension is k (see `fp8_gemm`). The padding is never read.
pub fn block_stride(inp: usize) -> usize {
    inp.div_ceil(FP8_BLOCK).div_ceil(4) * 4
}

/// One part's weights on the device.
pub enum PartWeights {
    /// e4m3 `[rows, inp]` row-major, and its scales: `Block`, `ceil(rows / 128)` rows of
    /// `block_stride(inp)`; `Row`, one per row.
    Fp8 {
        w: CudaSlice<u8>,
        kind: ScaleKind,
        scales: CudaSlice<f32>,
        /// A static scheme's `input_scale`, on the host (which parts may share one
        /// quantization of x) and on the device (what `fp8_quant_rows` reads).
        input_scale: Option<(f32, CudaSlice<f32>)>,
    },
    /// An unquantized part, bf16 `[rows, inp]`.
    Bf16(CudaSlice<u16>),
}

/// A run of rows of a stacked product.
pub struct Part {
    /// Its first row in the product, and its rows.
    pub row0: usize,
    pub rows: usize,
    pub w: PartWeights,
}

/// A product with FP8 parts: `y[m, out] = x[m, inp] · Wᵀ (+ bias)`.
pub struct Fp8Linear {
    pub out: usize,
    pub inp: usize,
    pub parts: Vec<Part>,
    pub bias: Option<CudaSlice<f32>>,
}

impl Fp8Linear {
    /// Bytes a decode step reads: the weights, scales and bias.
    pub fn bytes(&self) -> usize {
        let parts: usize = self
            .parts
            .iter()
            .map(|p| match &p.w {
                PartWeights::Fp8 { w, scales, .. } => w.len() + 4 * scales.len(),
                PartWeights::Bf16(w) => 2 * w.len(),
            })
            .sum();
        parts + 4 * self.bias.as_ref().map_or(0, |b| b.len())
    }
}

/// One part as read from the checkpoint, before upload: its rows and, for FP8, the bytes
/// and scales in the device layout.
enum HostPart {
    Fp8 {
        kind: ScaleKind,
        w: Vec<u8>,
        scales: Vec<f32>,
        input_scale: Option<f32>,
        rows: usize,
    },
    Bf16 {
        w: Vec<u16>,
        rows: usize,
    },
}

impl HostPart {
    fn rows(&self) -> usize {
        match self {
            HostPart::Fp8 { rows, .. } | HostPart::Bf16 { rows, .. } => *rows,
        }
    }

    /// Appends `next` when the two make one valid part (see the module docs).
    fn merge(&mut self, next: HostPart) -> std::result::Result<(), HostPart> {
        match (self, next) {
            (
                HostPart::Fp8 {
                    kind,
                    w,
                    scales,
                    input_scale,
                    rows,
                },
                HostPart::Fp8 {
                    kind: k2,
                    w: w2,
                    scales: s2,
                    input_scale: i2,
                    rows: r2,
                },
            ) if *kind == k2
                && *input_scale == i2
                && (k2 == ScaleKind::Row || rows.is_multiple_of(FP8_BLOCK)) =>
            {
                w.extend(w2);
                scales.extend(s2);
                *rows += r2;
                Ok(())
            }
            (HostPart::Bf16 { w, rows }, HostPart::Bf16 { w: w2, rows: r2 }) => {
                w.extend(w2);
                *rows += r2;
                Ok(())
            }
            (_, next) => Err(next),
        }
    }
}

/// The scales of FP8 layer `module` (`[out, inp]`) in the device layout of `kind`.
pub fn device_scales(
    store: &WeightStore,
    module: &str,
    out: usize,
    inp: usize,
    scheme: &Scheme,
    kind: ScaleKind,
) -> Result<Vec<f32>> {
    let v = crate::quant::scale_values(store, module, out, inp, scheme)?;
    Ok(match (kind, scheme.weights) {
        (ScaleKind::Block, _) => pad_block_scales(&v, out, inp),
        (ScaleKind::Row, WeightScale::Tensor) => vec![v[0]; out],
        (ScaleKind::Row, _) => v,
    })
}

/// Block scales `[ceil(out / 128), ceil(inp / 128)]` (a checkpoint's `weight_scale_inv`) with
/// each row padded to `block_stride(inp)` (zeros, never read).
pub fn pad_block_scales(v: &[f32], out: usize, inp: usize) -> Vec<f32> {
    let (grid, stride) = (inp.div_ceil(FP8_BLOCK), block_stride(inp));
    let mut padded = vec![0.0f32; out.div_ceil(FP8_BLOCK) * stride];
    for (dst, src) in padded.chunks_mut(stride).zip(v.chunks(grid)) {
        dst[..grid].copy_from_slice(src);
    }
    padded
}

/// Reads stack `s` of a checkpoint: its parts, merged where they can be.
fn read_stack(
    ck: &Checkpoint,
    cfg: &ModelConfig,
    store: &WeightStore,
    s: &Stack,
) -> Result<Vec<HostPart>> {
    let q = cfg.quantization.as_ref();
    let mut parts: Vec<HostPart> = Vec::new();
    for (name, out) in &s.parts {
        let part = match q.and_then(|q| q.scheme_of(name)) {
            Some(scheme) => {
                let kind = ScaleKind::of(&scheme).ok_or_else(|| Fp8Refusal::Scheme {
                    module: name.clone(),
                    scheme: scheme.describe(),
                })?;
                HostPart::Fp8 {
                    kind,
                    w: crate::quant::stored_fp8(store, name, *out, s.inp)?.to_vec(),
                    scales: device_scales(store, name, *out, s.inp, &scheme, kind)?,
                    input_scale: crate::quant::static_input_scale(store, name, &scheme)?,
                    rows: *out,
                }
            }
            None => HostPart::Bf16 {
                w: to_bf16(ck.projection(name, *out, s.inp, false)?.weight),
                rows: *out,
            },
        };
        match parts.last_mut() {
            Some(last) => {
                if let Err(part) = last.merge(part) {
                    parts.push(part);
                }
            }
            None => parts.push(part),
        }
    }
    Ok(parts)
}

/// As `weights::to_bf16` (bf16 as stored, f32 rounded to nearest even), for an unquantized
/// part of a stack with FP8 parts.
fn to_bf16(d: TensorData) -> Vec<u16> {
    match d {
        TensorData::Bf16(v) => v,
        TensorData::F32(v) => v
            .into_iter()
            .map(|x| half::bf16::from_f32(x).to_bits())
            .collect(),
    }
}

/// Reads and uploads stack `s`; `what` names it in errors.
pub fn upload_stack(
    stream: &Arc<CudaStream>,
    ordinal: usize,
    ck: &Checkpoint,
    cfg: &ModelConfig,
    store: &WeightStore,
    s: &Stack,
) -> Result<Fp8Linear> {
    let what = s.parts.first().map_or("", |(n, _)| n.as_str());
    let err = |e| upload_err(ordinal, what, e);
    let mut parts = Vec::new();
    let mut row0 = 0;
    for p in read_stack(ck, cfg, store, s)? {
        let rows = p.rows();
        let w = match p {
            HostPart::Fp8 {
                kind,
                w,
                scales,
                input_scale,
                ..
            } => PartWeights::Fp8 {
                w: stream.clone_htod(&w).map_err(err)?,
                kind,
                scales: stream.clone_htod(&scales).map_err(err)?,
                input_scale: match input_scale {
                    Some(v) => Some((v, stream.clone_htod(&[v]).map_err(err)?)),
                    None => None,
                },
            },
            HostPart::Bf16 { w, .. } => PartWeights::Bf16(stream.clone_htod(&w).map_err(err)?),
        };
        parts.push(Part { row0, rows, w });
        row0 += rows;
    }
    let bias = if s.bias {
        let mut b = Vec::with_capacity(s.out());
        for (name, out) in &s.parts {
            b.extend(store.f32(&format!("{name}.bias"), &[*out])?);
        }
        Some(stream.clone_htod(&b).map_err(err)?)
    } else {
        None
    };
    Ok(Fp8Linear {
        out: s.out(),
        inp: s.inp,
        parts,
        bias,
    })
}

/// What the FP8 path refuses from the config alone, before the device is touched: a
/// quantized output head, a scheme it has no GEMM for, a layer whose sides are not
/// multiples of 16 (16-byte rows for the decode kernels; cuBLASLt's FP8 operands need
/// leading dimensions of multiples of 16 bytes).
pub fn refuse_schemes(cfg: &ModelConfig) -> Result<()> {
    let Some(q) = &cfg.quantization else {
        return Ok(());
    };
    for (module, out, inp) in cfg.linear_layers() {
        let Some(scheme) = q.scheme_of(&module) else {
            continue;
        };
        if module == "lm_head" {
            return Err(Fp8Refusal::OutputHead { module }.into());
        }
        if ScaleKind::of(&scheme).is_none() {
            let scheme = scheme.describe();
            return Err(Fp8Refusal::Scheme { module, scheme }.into());
        }
        if !out.is_multiple_of(16) || !inp.is_multiple_of(16) {
            return Err(Fp8Refusal::Sides { module, out, inp }.into());
        }
    }
    Ok(())
}

/// What the FP8 path refuses on a device of compute capability `cc` with cuBLASLt version
/// `lt_version` (`cublasLtGetVersion`). A pure function, so every refusal is tested without
/// a GPU.
pub fn refuse_device(cfg: &ModelConfig, cc: (i32, i32), lt_version: usize) -> Result<()> {
    let Some(q) = &cfg.quantization else {
        return Ok(());
    };
    let (major, minor) = cc;
    let quant = q.summary();
    if cc < FP8_MIN_CAPABILITY {
        return Err(Fp8Refusal::Capability {
            quant,
            major,
            minor,
        }
        .into());
    }
    // Every scheme this path runs uses block or outer-vector scales (`ScaleKind`), which
    // cuBLASLt takes on sm_90 only.
    if major != 9 {
        return Err(Fp8Refusal::OffHopper {
            quant,
            major,
            minor,
        }
        .into());
    }
    if lt_version < LT_MIN_VERSION {
        return Err(Fp8Refusal::OldCublasLt {
            quant,
            version: lt_version,
        }
        .into());
    }
    Ok(())
}

/// Device bytes of the model's weights when the quantized layers stay FP8 (see
/// `quant::gpu_bytes`, which counts the same from the files): one byte a quantized weight
/// plus its scales in the device layout, two bytes for every other parameter, and the f32
/// norms the backend keeps.
pub fn weight_bytes(cfg: &ModelConfig) -> usize {
    let bf16 = 2 * cfg.num_params();
    let Some(q) = &cfg.quantization else {
        return bf16;
    };
    let mut saved = 0usize;
    let mut scales = 0usize;
    for (module, out, inp) in cfg.linear_layers() {
        let Some(scheme) = q.scheme_of(&module) else {
            continue;
        };
        saved += out * inp;
        scales += 4 * match ScaleKind::of(&scheme) {
            Some(ScaleKind::Block) => out.div_ceil(FP8_BLOCK) * block_stride(inp),
            _ => out,
        };
    }
    bf16 - saved + scales
}

/// The scratch an FP8 model's products need for steps of `tokens` tokens: the quantized
/// activations and their scales, and cuBLASLt's bf16 output before it is widened. Zero for
/// a bf16 model.
pub fn scratch_bytes(cfg: &ModelConfig, tokens: usize) -> usize {
    if cfg.quantization.is_none() || tokens == 0 {
        return 0;
    }
    let (widest_in, widest_out) = widest(cfg);
    let tokens = lt_rows(tokens);
    tokens * widest_in + 4 * tokens * widest_in.div_ceil(FP8_BLOCK) + 2 * tokens * widest_out
}

/// The widest input and output of a layer's products (a Qwen3.5 model's: its Gated
/// DeltaNet projections and gated query too).
pub fn widest(cfg: &ModelConfig) -> (usize, usize) {
    let (h, inter) = (cfg.hidden_size, cfg.intermediate_size);
    let mut inp = h.max(cfg.q_dim()).max(inter);
    let mut out = (cfg.q_dim() + 2 * cfg.kv_dim()).max(2 * inter).max(h);
    if let Some(hy) = &cfg.hybrid {
        inp = inp.max(hy.value_dim());
        out = out
            .max(2 * cfg.q_dim() + 2 * cfg.kv_dim())
            .max(hy.conv_dim() + hy.value_dim() + 2 * hy.linear_num_value_heads);
    }
    (inp, out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::error::BackendError;
    use crate::error::EngineError;

    /// The FP8 refusal in `r`, by variant.
    fn refusal(r: Result<()>) -> Fp8Refusal {
        match r {
            Err(EngineError::Backend(BackendError::Fp8(e))) => e,
            other => panic!("not an FP8 refusal: {other:?}"),
        }
    }

    fn qwen3_8b(quant: Option<serde_json::Value>) -> ModelConfig {
        let mut v = crate::init::preset(None, "qwen3-8b").unwrap().to_hf_json();
        if let Some(q) = quant {
            v["quantization_config"] = q;
        }
        ModelConfig::from_json(&v.to_string()).unwrap()
    }

    fn block() -> serde_json::Value {
        serde_json::json!({"quant_method": "fp8", "fmt": "e4m3",
            "activation_scheme": "dynamic", "weight_block_size": [128, 128]})
    }

    fn ct(weights: &str, acts: serde_json::Value) -> serde_json::Value {
        serde_json::json!({"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "symmetric": true,
                            "strategy": weights, "dynamic": false},
                "input_activations": acts}},
            "ignore": ["lm_head"], "quantization_status": "compressed"})
    }

    fn token_acts() -> serde_json::Value {
        serde_json::json!({"num_bits": 8, "type": "float", "symmetric": true,
            "strategy": "token", "dynamic": true})
    }

    #[test]
    fn the_published_schemes_pass_on_hopper_with_cublaslt_12_9() {
        let static_acts = serde_json::json!({"num_bits": 8, "type": "float",
            "symmetric": true, "strategy": "tensor", "dynamic": false});
        for q in [
            block(),
            ct("channel", token_acts()),
            ct("tensor", token_acts()),
            ct("channel", static_acts.clone()),
            ct("tensor", static_acts),
        ] {
            let cfg = qwen3_8b(Some(q));
            refuse_schemes(&cfg).unwrap();
            refuse_device(&cfg, (9, 0), 120_900).unwrap();
            refuse_device(&cfg, (9, 0), 130_100).unwrap();
        }
        // A bf16 model is none of this path's business.
        refuse_device(&qwen3_8b(None), (8, 0), 0).unwrap();
    }

    /// Parts merge into one product only where one quantization of x serves both: the same
    /// kind and the same static scale (or none).
    #[test]
    fn parts_with_other_static_scales_stay_apart() {
        let part = |input_scale: Option<f32>| HostPart::Fp8 {
            kind: ScaleKind::Row,
            w: vec![0; 32],
            scales: vec![1.0; 2],
            input_scale,
            rows: 2,
        };
        let mut a = part(Some(0.5));
        assert!(a.merge(part(Some(0.25))).is_err());
        assert!(a.merge(part(None)).is_err());
        assert!(a.merge(part(Some(0.5))).is_ok());
        assert_eq!(a.rows(), 4);
        let mut b = part(None);
        assert!(b.merge(part(None)).is_ok());
    }

    #[test]
    fn a_gpu_without_fp8_tensor_cores_is_refused_with_its_capability() {
        let cfg = qwen3_8b(Some(block()));
        let e = refusal(refuse_device(&cfg, (8, 6), 130_000));
        assert!(
            matches!(
                e,
                Fp8Refusal::Capability {
                    major: 8,
                    minor: 6,
                    ..
                }
            ),
            "{e}"
        );
        let e = e.to_string();
        assert!(
            e.contains("compute capability 8.9") && e.contains("this GPU has 8.6"),
            "{e}"
        );
    }

    #[test]
    fn block_and_per_row_scales_off_hopper_are_refused_by_name() {
        for q in [block(), ct("channel", token_acts())] {
            let cfg = qwen3_8b(Some(q));
            for cc in [(8, 9), (10, 0), (12, 0)] {
                let e = refusal(refuse_device(&cfg, cc, 130_000));
                assert!(matches!(e, Fp8Refusal::OffHopper { .. }), "{e}");
                let e = e.to_string();
                assert!(
                    e.contains("compute capability 9.0 (Hopper) only")
                        && e.contains(&format!("this GPU has {}.{}", cc.0, cc.1)),
                    "{e}"
                );
            }
        }
    }

    #[test]
    fn a_cublaslt_before_12_9_is_refused_with_its_version() {
        let cfg = qwen3_8b(Some(block()));
        let e = refusal(refuse_device(&cfg, (9, 0), 120_801));
        assert!(
            matches!(
                e,
                Fp8Refusal::OldCublasLt {
                    version: 120_801,
                    ..
                }
            ),
            "{e}"
        );
        let e = e.to_string();
        assert!(
            e.contains("cuBLASLt 12.8.1 is loaded") && e.contains("12.9 or newer"),
            "{e}"
        );
    }

    #[test]
    fn schemes_without_an_fp8_gemm_here_are_refused_by_layer() {
        let dynamic_tensor = serde_json::json!({"num_bits": 8, "type": "float",
            "symmetric": true, "strategy": "tensor", "dynamic": true});
        for (acts, said) in [
            (dynamic_tensor, "dynamic per-tensor activations"),
            (serde_json::Value::Null, "unquantized activations"),
        ] {
            let cfg = qwen3_8b(Some(ct("channel", acts)));
            let e = refusal(refuse_schemes(&cfg));
            assert!(matches!(e, Fp8Refusal::Scheme { .. }), "{e}");
            let e = e.to_string();
            assert!(
                e.contains("model.layers.0.self_attn.q_proj") && e.contains(said),
                "{e}"
            );
        }
    }

    #[test]
    fn hybrid_models_and_fp8_heads_are_refused_by_name() {
        let mut v = crate::init::preset(None, "qwen3-8b").unwrap().to_hf_json();
        v["quantization_config"] = serde_json::json!({"quant_method": "fp8", "fmt": "e4m3",
            "activation_scheme": "dynamic", "weight_block_size": [128, 128],
            "modules_to_not_convert": []});
        let cfg = ModelConfig::from_json(&v.to_string()).unwrap();
        let e = refusal(refuse_schemes(&cfg));
        assert!(
            matches!(&e, Fp8Refusal::OutputHead { module } if module == "lm_head"),
            "{e}"
        );
        let e = e.to_string();
        assert!(e.contains("lm_head") && e.contains("output head"), "{e}");
    }

    #[test]
    fn block_scales_are_padded_rows_of_a_multiple_of_four() {
        assert_eq!(block_stride(128), 4);
        assert_eq!(block_stride(4096), 32);
        assert_eq!(block_stride(12288), 96);
        assert_eq!(block_stride(25600), 200);
        assert_eq!(block_stride(29568), 232);
        assert_eq!(block_stride(192), 4);
    }

    #[test]
    fn padded_block_scales_keep_each_row_of_blocks_in_place() {
        // 300 x 400: a grid of 3 x 4 (last row and column partial), rows padded to 4.
        let v: Vec<f32> = (0..12).map(|i| i as f32 + 1.0).collect();
        let p = pad_block_scales(&v, 300, 400);
        assert_eq!(p, v);
        // 200 x 192: a grid of 2 x 2, rows padded to 4.
        let p = pad_block_scales(&[1.0, 2.0, 3.0, 4.0], 200, 192);
        assert_eq!(p, vec![1.0, 2.0, 0.0, 0.0, 3.0, 4.0, 0.0, 0.0]);
    }

    #[test]
    fn weight_bytes_count_one_byte_a_quantized_weight() {
        let bf16 = qwen3_8b(None);
        let fp8 = qwen3_8b(Some(block()));
        let (b, f) = (weight_bytes(&bf16), weight_bytes(&fp8));
        assert_eq!(b, 2 * bf16.num_params());
        // Qwen3-8B: 8.19 B parameters, 6.95 B of them in the layers' linear products; the
        // embeddings and the head (1.24 B) stay bf16.
        assert!(f > 9_400_000_000 && f < 9_500_000_000, "{f}");
        let (win, wout) = widest(&fp8);
        assert_eq!((win, wout), (12288, 24576));
        assert_eq!(
            scratch_bytes(&fp8, 2048),
            2048 * 12288 + 4 * 2048 * 96 + 2 * 2048 * 24576
        );
        assert_eq!(scratch_bytes(&bf16, 2048), 0);
    }
}
