//! FP8 weights as a checkpoint stores them, against what its `quantization_config` says
//! (see `config::quant`): the check that every linear layer is stored the way the config
//! claims, and the dequantization the CPU reference computes with.
//!
//! The dequantized weight is the e4m3 value times the scale that covers it, multiplied in
//! f32 and kept in f32. That is the product transformers' FP8 loader and compressed-tensors'
//! `dequantize` compute (compressed-tensors then rounds it to the scale's dtype, bf16 in
//! llm-compressor's files; an FP8 GEMM applies the scales in its f32 epilogue and rounds
//! nothing in between, so kvmesh keeps the exact product as the reference the GPU is held
//! to). Activations are not quantized on the CPU: it computes the dequantized model.

use rayon::prelude::*;

use crate::config::{ActivationScheme, ModelConfig, Scheme, WeightScale};
use crate::error::{EngineError, Result};
use crate::safetensors::{DType, WeightStore};

fn bad(msg: String) -> EngineError {
    EngineError::BadModel(format!("weights: {msg}"))
}

/// The weight of linear layer `module` (`[out, inp]`), dequantized with `scheme`.
pub fn dequantize(
    store: &WeightStore,
    module: &str,
    out: usize,
    inp: usize,
    scheme: &Scheme,
) -> Result<Vec<f32>> {
    let mut w = store.f8_e4m3(&format!("{module}.weight"), &[out, inp])?;
    let scale = scale_values(store, module, out, inp, scheme)?;
    if inp == 0 {
        return Ok(w);
    }
    match scheme.weights {
        WeightScale::Block { rows, cols } => {
            let grid_cols = inp.div_ceil(cols);
            w.par_chunks_mut(inp).enumerate().for_each(|(r, row)| {
                let s = &scale[(r / rows) * grid_cols..][..grid_cols];
                for (c, x) in row.iter_mut().enumerate() {
                    *x *= s[c / cols];
                }
            });
        }
        WeightScale::Channel => {
            w.par_chunks_mut(inp).zip(&scale).for_each(|(row, &s)| {
                row.iter_mut().for_each(|x| *x *= s);
            });
        }
        WeightScale::Tensor => w.par_iter_mut().for_each(|x| *x *= scale[0]),
    }
    Ok(w)
}

/// The e4m3 bytes of linear layer `module`'s weight (`[out, inp]`, row-major) as stored,
/// checked as [`dequantize`] checks them (dtype, shape, no NaN), for a backend that keeps
/// the weights in FP8.
pub fn stored_fp8<'a>(
    store: &'a WeightStore,
    module: &str,
    out: usize,
    inp: usize,
) -> Result<&'a [u8]> {
    let name = format!("{module}.weight");
    let Some((t, raw)) = store.raw(&name) else {
        return Err(bad(format!("tensor `{name}` is missing")));
    };
    if t.dtype != DType::F8E4M3 || t.shape != [out, inp] {
        return Err(bad(format!(
            "tensor `{name}` is {} {:?}; its quantization_config makes it F8_E4M3 {:?}",
            t.dtype.name(),
            t.shape,
            [out, inp]
        )));
    }
    // e4m3 has one NaN per sign (S.1111.111) and no infinities.
    if let Some(i) = raw.iter().position(|&b| b & 0x7f == 0x7f) {
        return Err(bad(format!(
            "tensor `{name}` holds an FP8 NaN at element {i}"
        )));
    }
    Ok(raw)
}

/// The scales of `module`'s weight, in the order [`dequantize`] reads them, checked: a
/// shape the scheme allows, and finite values (a NaN or infinite scale would poison every
/// product of its block).
pub fn scale_values(
    store: &WeightStore,
    module: &str,
    out: usize,
    inp: usize,
    scheme: &Scheme,
) -> Result<Vec<f32>> {
    let name = format!("{module}.{}", scheme.scale_suffix());
    let info = store.info(&name).ok_or_else(|| {
        bad(format!(
            "tensor `{name}` is missing ({})",
            scheme.describe()
        ))
    })?;
    let shape = info.shape.clone();
    check_scale(&name, info.dtype, &shape, &scheme.scale_shapes(out, inp))?;
    let v = store.f32(&name, &shape)?;
    if let Some(i) = v.iter().position(|x| !x.is_finite()) {
        return Err(bad(format!(
            "tensor `{name}` holds {} at element {i}",
            v[i]
        )));
    }
    Ok(v)
}

/// A static scheme's calibrated activation scale (`{module}.input_scale`, one value; the
/// loader checked its presence, dtype and shape), refused unless finite and positive: a
/// zero or negative scale would quantize every activation to nothing or flip its sign.
/// `None` for dynamic schemes.
pub fn static_input_scale(
    store: &WeightStore,
    module: &str,
    scheme: &Scheme,
) -> Result<Option<f32>> {
    if scheme.activations != ActivationScheme::StaticTensor {
        return Ok(None);
    }
    let name = format!("{module}.input_scale");
    let shape = store
        .info(&name)
        .map(|i| i.shape.clone())
        .ok_or_else(|| EngineError::BadModel(format!("`{name}` is missing")))?;
    let v = store.f32(&name, &shape)?;
    match v.as_slice() {
        [s] if s.is_finite() && *s > 0.0 => Ok(Some(*s)),
        _ => Err(EngineError::BadModel(format!(
            "`{name}` is {v:?}: a static activation scale must be one finite positive value"
        ))),
    }
}

fn check_scale(name: &str, dtype: DType, shape: &[usize], allowed: &[Vec<usize>]) -> Result<()> {
    if dtype == DType::F8E4M3 {
        return Err(bad(format!(
            "scale `{name}` is F8_E4M3; scales are read as F32, BF16 or F16"
        )));
    }
    if !allowed.iter().any(|s| s == shape) {
        return Err(bad(format!(
            "scale `{name}` has shape {shape:?}; the quantization_config makes it {}",
            allowed
                .iter()
                .map(|s| format!("{s:?}"))
                .collect::<Vec<_>>()
                .join(" or ")
        )));
    }
    Ok(())
}

/// Refuses a checkpoint whose FP8 tensors disagree with its config: a layer the config
/// quantizes stored in another dtype (or with a scale of the wrong shape), an FP8 tensor
/// the config does not quantize (an ignored layer, a norm, the embeddings, or any FP8
/// tensor when there is no `quantization_config`). Either way the file does not mean what
/// the config says, and running it would compute something else. Runs after
/// `model::check_tensors` has found every expected tensor present.
pub fn check_tensors(cfg: &ModelConfig, w: &WeightStore) -> Result<()> {
    let q = cfg.quantization.as_ref();
    let mut quantized = std::collections::HashSet::new();
    for (m, out, inp) in cfg.linear_layers() {
        let weight = format!("{m}.weight");
        let Some(info) = w.info(&weight) else {
            continue;
        };
        match q.and_then(|q| q.scheme_of(&m)) {
            Some(s) => {
                if info.dtype != DType::F8E4M3 {
                    return Err(bad(format!(
                        "`{weight}` is {}, but quantization_config quantizes layer {m} ({}); \
                         the file and its config disagree",
                        info.dtype.name(),
                        s.describe()
                    )));
                }
                let scale = format!("{m}.{}", s.scale_suffix());
                if let Some(i) = w.info(&scale) {
                    check_scale(&scale, i.dtype, &i.shape, &s.scale_shapes(out, inp))?;
                }
                if let (Some(shapes), Some(i)) =
                    (s.input_scale_shapes(), w.info(&format!("{m}.input_scale")))
                {
                    check_scale(&format!("{m}.input_scale"), i.dtype, &i.shape, &shapes)?;
                }
                quantized.insert(weight);
            }
            None if info.dtype == DType::F8E4M3 => {
                return Err(bad(format!(
                    "`{weight}` is F8_E4M3, but {}; its scales are not known",
                    match q {
                        Some(_) => format!(
                            "quantization_config leaves layer {m} unquantized (its skip or \
                             ignore list)"
                        ),
                        None => "config.json has no quantization_config".into(),
                    }
                )));
            }
            None => {}
        }
    }
    // Parts of a checkpoint the config knows of and leaves unread (Qwen3.5's vision tower
    // and multi-token-prediction head) may hold FP8 weights of their own.
    for name in w.names().into_iter().filter(|n| !cfg.ignores_tensor(n)) {
        let fp8 = w.info(name).is_some_and(|i| i.dtype == DType::F8E4M3);
        if fp8 && !quantized.contains(name) {
            return Err(bad(format!(
                "`{name}` is F8_E4M3, but it is not the weight of a layer the \
                 quantization_config quantizes; kvmesh reads FP8 linear-layer weights only"
            )));
        }
    }
    Ok(())
}

/// Bytes the weights take on a GPU that keeps the quantized layers in FP8: one byte per
/// FP8 weight, the scales as f32, every other tensor as bf16 (how the CUDA backend
/// uploads them). And the bytes of the same model in bf16, for comparison.
pub fn gpu_bytes(cfg: &ModelConfig, w: &WeightStore) -> (usize, usize) {
    let (mut fp8, mut bf16) = (0usize, 0usize);
    for name in w.names() {
        let Some(i) = w.info(name) else { continue };
        let n: usize = i.shape.iter().product();
        let is_scale = name.ends_with(".weight_scale")
            || name.ends_with(".weight_scale_inv")
            || name.ends_with(".input_scale");
        if is_scale {
            fp8 += 4 * n;
        } else if i.dtype == DType::F8E4M3 {
            fp8 += n;
            bf16 += 2 * n;
        } else if !cfg.ignores_tensor(name) {
            fp8 += 2 * n;
            bf16 += 2 * n;
        }
    }
    (fp8, bf16)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::TensorRole;
    use crate::safetensors::{e4m3_to_f32, write_file_typed};

    fn scheme(weights: WeightScale) -> Scheme {
        Scheme {
            weights,
            activations: ActivationScheme::DynamicToken,
        }
    }

    /// A store holding `tensors` (name, shape, values, dtype).
    fn store(tag: &str, tensors: &[(&str, Vec<usize>, Vec<f32>, DType)]) -> WeightStore {
        let dir = std::env::temp_dir().join(format!("kvmesh-quant-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let t: Vec<_> = tensors
            .iter()
            .map(|(n, s, v, d)| (n.to_string(), s.clone(), v.clone(), *d))
            .collect();
        write_file_typed(&dir.join("model.safetensors"), &t).unwrap();
        let w = WeightStore::open_dir(&dir).unwrap();
        std::fs::remove_dir_all(&dir).ok();
        w
    }

    /// e4m3 values 1, 1.125, 1.25, ... (exact), so every product is checkable.
    fn q(n: usize) -> Vec<f32> {
        (0..n).map(|i| e4m3_to_f32(0x38 + (i % 8) as u8)).collect()
    }

    #[test]
    fn each_element_takes_the_scale_of_its_block_partial_blocks_included() {
        // 3 x 5 in 2 x 2 blocks: a grid of 2 x 3, its last row and column partial.
        let scales = vec![1.0, 2.0, 4.0, 8.0, 16.0, 32.0];
        let w = store(
            "block",
            &[
                ("l.weight", vec![3, 5], q(15), DType::F8E4M3),
                ("l.weight_scale_inv", vec![2, 3], scales.clone(), DType::F32),
            ],
        );
        let s = scheme(WeightScale::Block { rows: 2, cols: 2 });
        let got = dequantize(&w, "l", 3, 5, &s).unwrap();
        for r in 0..3 {
            for c in 0..5 {
                let want = q(15)[r * 5 + c] * scales[(r / 2) * 3 + c / 2];
                assert_eq!(got[r * 5 + c], want, "({r}, {c})");
            }
        }
        // The grid must be the ceiling of each side over the block.
        let e = dequantize(
            &w,
            "l",
            3,
            5,
            &scheme(WeightScale::Block { rows: 4, cols: 2 }),
        );
        let e = e.err().unwrap().to_string();
        assert!(
            e.contains("l.weight_scale_inv") && e.contains("[1, 3]"),
            "{e}"
        );
    }

    #[test]
    fn channel_and_tensor_scales_and_bf16_scales() {
        let w = store(
            "channel",
            &[
                ("c.weight", vec![2, 3], q(6), DType::F8E4M3),
                ("c.weight_scale", vec![2, 1], vec![0.5, 3.0], DType::BF16),
                ("t.weight", vec![2, 3], q(6), DType::F8E4M3),
                ("t.weight_scale", vec![1], vec![0.25], DType::F32),
            ],
        );
        let got = dequantize(&w, "c", 2, 3, &scheme(WeightScale::Channel)).unwrap();
        let want: Vec<f32> = q(6)
            .iter()
            .enumerate()
            .map(|(i, x)| x * [0.5, 3.0][i / 3])
            .collect();
        assert_eq!(got, want);
        let got = dequantize(&w, "t", 2, 3, &scheme(WeightScale::Tensor)).unwrap();
        assert_eq!(got, q(6).iter().map(|x| x * 0.25).collect::<Vec<_>>());
        // A scale of the wrong kind is refused with the shapes the scheme allows.
        let e = dequantize(&w, "t", 2, 3, &scheme(WeightScale::Channel))
            .err()
            .unwrap();
        assert!(e.to_string().contains("t.weight_scale"), "{e}");
    }

    #[test]
    fn non_finite_scales_and_fp8_nans_are_refused() {
        let w = store(
            "nan",
            &[
                ("a.weight", vec![1, 2], q(2), DType::F8E4M3),
                ("a.weight_scale", vec![1], vec![f32::INFINITY], DType::F32),
                ("b.weight", vec![1, 2], vec![1.0, f32::NAN], DType::F8E4M3),
                ("b.weight_scale", vec![1], vec![1.0], DType::F32),
            ],
        );
        let s = scheme(WeightScale::Tensor);
        let e = dequantize(&w, "a", 1, 2, &s).err().unwrap().to_string();
        assert!(e.contains("a.weight_scale") && e.contains("inf"), "{e}");
        let e = dequantize(&w, "b", 1, 2, &s).err().unwrap().to_string();
        assert!(e.contains("b.weight") && e.contains("NaN"), "{e}");
    }

    /// A one-layer llama (with Qwen's block `quantization_config` when `quantized`) and a
    /// checkpoint for it: dense weights in FP8 with f32 scales, the rest in bf16, except
    /// the tensors `tweak` names (`None`: left out; `Some(d)`: stored as `d`).
    fn checkpoint(
        tag: &str,
        quantized: bool,
        tweak: &[(&str, Option<DType>)],
    ) -> (ModelConfig, WeightStore) {
        let qc = if quantized {
            r#","quantization_config":{"quant_method":"fp8","fmt":"e4m3",
               "activation_scheme":"dynamic","weight_block_size":[128,128]}"#
        } else {
            ""
        };
        let cfg = ModelConfig::from_json(&format!(
            r#"{{"architectures":["LlamaForCausalLM"],"vocab_size":16,"hidden_size":192,
               "intermediate_size":64,"num_hidden_layers":1,"num_attention_heads":3{qc}}}"#
        ))
        .unwrap();
        let mut tensors: Vec<(String, Vec<usize>, Vec<f32>, DType)> = Vec::new();
        let mut put = |name: String, shape: Vec<usize>, vals: Vec<f32>, default: DType| {
            let dtype = match tweak.iter().find(|(n, _)| *n == name) {
                Some((_, d)) => *d,
                None => Some(default),
            };
            if let Some(d) = dtype {
                tensors.push((name, shape, vals, d));
            }
        };
        for t in cfg.tensors() {
            let n: usize = t.shape.iter().product();
            if t.role == TensorRole::Dense {
                let m = t.name.strip_suffix(".weight").unwrap().to_string();
                let grid = vec![t.shape[0].div_ceil(128), t.shape[1].div_ceil(128)];
                let len = grid[0] * grid[1];
                put(t.name, t.shape, q(n), DType::F8E4M3);
                put(
                    format!("{m}.weight_scale_inv"),
                    grid,
                    vec![0.5; len],
                    DType::F32,
                );
            } else {
                put(t.name, t.shape, q(n), DType::BF16);
            }
        }
        let dir = std::env::temp_dir().join(format!("kvmesh-quant-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        write_file_typed(&dir.join("model.safetensors"), &tensors).unwrap();
        let w = WeightStore::open_dir(&dir).unwrap();
        std::fs::remove_dir_all(&dir).ok();
        (cfg, w)
    }

    fn refusal(tag: &str, quantized: bool, tweak: &[(&str, Option<DType>)]) -> String {
        let (cfg, w) = checkpoint(tag, quantized, tweak);
        crate::model::check_tensors(&cfg, &w)
            .expect_err("refused")
            .to_string()
    }

    const Q: &str = "model.layers.0.self_attn.q_proj.weight";
    const Q_SCALE: &str = "model.layers.0.self_attn.q_proj.weight_scale_inv";

    #[test]
    fn a_checkpoint_as_its_config_says_is_read_and_dequantized() {
        let (cfg, w) = checkpoint("ok", true, &[]);
        crate::model::check_tensors(&cfg, &w).unwrap();
        let ck = crate::checkpoint::Checkpoint::new(&cfg, &w);
        let layer = ck.layer(0).unwrap();
        let crate::safetensors::TensorData::F32(qkv) = &layer.qkv_proj.weight else {
            panic!("dequantized weights are f32");
        };
        assert_eq!(
            qkv[..8],
            q(8).iter().map(|x| x * 0.5).collect::<Vec<_>>()[..]
        );
        // The untied head stays bf16 (transformers' default skip) and is read as stored.
        let head = ck.lm_head().unwrap().unwrap();
        assert!(matches!(
            head.weight,
            crate::safetensors::TensorData::Bf16(_)
        ));
        let (fp8, bf16) = gpu_bytes(&cfg, &w);
        assert!(fp8 < bf16, "{fp8} vs {bf16}");
    }

    #[test]
    fn fp8_tensors_the_config_does_not_account_for_are_refused() {
        // A quantized layer stored in bf16.
        let e = refusal("bf16", true, &[(Q, Some(DType::BF16))]);
        assert!(
            e.contains(Q) && e.contains("BF16") && e.contains("disagree"),
            "{e}"
        );
        // Its scale missing, or stored in FP8.
        let e = refusal("noscale", true, &[(Q_SCALE, None)]);
        assert!(e.contains(Q_SCALE) && e.contains("missing"), "{e}");
        let e = refusal("f8scale", true, &[(Q_SCALE, Some(DType::F8E4M3))]);
        assert!(e.contains(Q_SCALE) && e.contains("F32, BF16 or F16"), "{e}");
        // The head the config leaves unquantized stored in FP8.
        let e = refusal("head", true, &[("lm_head.weight", Some(DType::F8E4M3))]);
        assert!(
            e.contains("lm_head.weight") && e.contains("leaves layer lm_head"),
            "{e}"
        );
        // A norm in FP8.
        let norm = "model.norm.weight";
        let e = refusal("norm", true, &[(norm, Some(DType::F8E4M3))]);
        assert!(
            e.contains(norm) && e.contains("linear-layer weights only"),
            "{e}"
        );
        // FP8 weights with no quantization_config: the scales are extra tensors first.
        let e = refusal("noconfig", false, &[]);
        assert!(
            e.contains("weight_scale_inv") && e.contains("not in the"),
            "{e}"
        );
        let scales: Vec<(String, Option<DType>)> = checkpoint("names", true, &[])
            .1
            .names()
            .into_iter()
            .filter(|n| n.ends_with("_scale_inv"))
            .map(|n| (n.to_string(), None))
            .collect();
        let tweak: Vec<(&str, Option<DType>)> =
            scales.iter().map(|(n, d)| (n.as_str(), *d)).collect();
        let e = refusal("noconfig2", false, &tweak);
        assert!(
            e.contains("F8_E4M3") && e.contains("no quantization_config"),
            "{e}"
        );
    }
    /// A static scale is read as stored ([1] or a scalar) and refused unless it is one finite
    /// positive value.
    #[test]
    fn static_input_scales_are_read_or_refused_by_name() {
        let dir = std::env::temp_dir().join(format!("kvmesh-input-scale-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let m = "model.layers.0.self_attn.q_proj";
        let tensors = [
            (format!("{m}.input_scale"), vec![1], vec![0.03f32]),
            ("a.input_scale".to_string(), vec![], vec![0.5]),
            ("z.input_scale".to_string(), vec![1], vec![0.0]),
            ("n.input_scale".to_string(), vec![1], vec![f32::NAN]),
            ("t.input_scale".to_string(), vec![2], vec![0.1, 0.2]),
        ];
        crate::safetensors::write_file(
            &dir.join("model.safetensors"),
            &tensors,
            crate::safetensors::DType::F32,
        )
        .unwrap();
        let store = WeightStore::open_dir(&dir).unwrap();
        let stat = Scheme {
            weights: WeightScale::Channel,
            activations: ActivationScheme::StaticTensor,
        };
        let dynamic = Scheme {
            weights: WeightScale::Channel,
            activations: ActivationScheme::DynamicToken,
        };
        assert_eq!(static_input_scale(&store, m, &stat).unwrap(), Some(0.03));
        assert_eq!(static_input_scale(&store, "a", &stat).unwrap(), Some(0.5));
        assert_eq!(static_input_scale(&store, m, &dynamic).unwrap(), None);
        for bad in ["z", "n", "t", "missing"] {
            let e = static_input_scale(&store, bad, &stat)
                .unwrap_err()
                .to_string();
            assert!(e.contains(&format!("{bad}.input_scale")), "{e}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
