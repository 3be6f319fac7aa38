//! Reading `quantization_config`: the method it names picks the reader (the block-scaled
//! `fp8` format here, compressed-tensors in `quant_ct`), which fills in a
//! [`Quantization`] (see `quant` for what each part means).

use regex::Regex;
use serde_json::{Map, Value};

use super::quant::{
    off, patterns, quantization, refuse, ActivationScheme, Pattern, QuantMethod, Quantization,
    Scheme, WeightScale, FP8_BLOCK,
};
use super::quant_ct::read_compressed_tensors;
use super::reader::{bad, shown};
use crate::error::Result;

/// Reads `quantization_config`, refusing what it does not understand.
pub(super) fn read_quantization(v: &Value) -> Result<Quantization> {
    let o = v.as_object().ok_or_else(|| {
        bad(format!(
            "`quantization_config` is {}; expected an object",
            shown(v)
        ))
    })?;
    match o.get("quant_method").and_then(Value::as_str) {
        Some("fp8") => read_fp8(o),
        Some("compressed-tensors") => read_compressed_tensors(o),
        Some(other) => Err(bad(format!(
            "the checkpoint is quantized with quantization_config.quant_method {other:?}; \
             kvmesh reads FP8 checkpoints in the formats \"fp8\" (block-scaled) and \
             \"compressed-tensors\" (float8), and runs no other quantization"
        ))),
        None => Err(bad(format!(
            "quantization_config has no quant_method ({}); cannot tell how the weights are stored",
            shown(v)
        ))),
    }
}

/// `quant_method: "fp8"` (transformers' `FineGrainedFP8Config`, plus the `fmt` field Qwen
/// and DeepSeek write).
fn read_fp8(o: &Map<String, Value>) -> Result<Quantization> {
    const KNOWN: &[&str] = &[
        "quant_method",
        "fmt",
        "activation_scheme",
        "weight_block_size",
        "modules_to_not_convert",
        "ignored_layers",
        "modules_to_convert",
        // How transformers loads it (dequantize to bf16 at load), not what the file holds.
        "dequantize",
        "scale_fmt",
        "expert_dtype",
    ];
    if let Some((k, v)) = o.iter().find(|(k, _)| !KNOWN.contains(&k.as_str())) {
        return Err(refuse(
            k,
            v,
            "not a field of the fp8 format kvmesh knows, and it may change how the weights \
             are read; refused rather than ignored",
        ));
    }
    let s = |k: &str| o.get(k).filter(|v| !v.is_null());
    if let Some(v) = s("fmt") {
        if v.as_str() != Some("e4m3") {
            return Err(refuse("fmt", v, "kvmesh reads e4m3 FP8 weights only"));
        }
    }
    match s("activation_scheme") {
        None => {}
        Some(v)
            if v.as_str()
                .is_some_and(|a| a.eq_ignore_ascii_case("dynamic")) => {}
        Some(v) if v.as_str().is_some_and(|a| a.eq_ignore_ascii_case("static")) => {
            return Err(refuse(
                "activation_scheme",
                v,
                "static activation scales (`activation_scale` tensors) are not read by kvmesh \
                 yet; it reads the dynamic scheme",
            ))
        }
        Some(v) => return Err(refuse("activation_scheme", v, "expected \"dynamic\"")),
    }
    let block =
        match s("weight_block_size") {
            None => return Err(bad(
                "quantization_config.weight_block_size is absent: a per-tensor fp8 checkpoint; \
                 kvmesh reads the block-scaled one ([128, 128])",
            )),
            Some(v) => {
                match v
                    .as_array()
                    .map(|a| a.iter().map(Value::as_u64).collect::<Vec<_>>())
                {
                    Some(b) if b == [Some(FP8_BLOCK as u64), Some(FP8_BLOCK as u64)] => FP8_BLOCK,
                    _ => return Err(refuse(
                        "weight_block_size",
                        v,
                        "kvmesh reads 128x128 blocks, the size published checkpoints and the FP8 \
                     GEMMs' block scales use",
                    )),
                }
            }
        };
    if let Some(v) = s("scale_fmt") {
        if v.as_str() != Some("float") {
            return Err(refuse(
                "scale_fmt",
                v,
                "kvmesh reads float scales (f32 or bf16), not power-of-two ue8m0 ones",
            ));
        }
    }
    if let Some(v) = s("expert_dtype") {
        if v.as_str() != Some("fp8") {
            return Err(refuse("expert_dtype", v, "kvmesh runs no FP4 experts"));
        }
    }
    if let Some(v) = s("dequantize") {
        if !v.is_boolean() {
            return Err(refuse("dequantize", v, "expected true or false"));
        }
    }
    if !off(o.get("modules_to_convert")) {
        return Err(refuse(
            "modules_to_convert",
            &o["modules_to_convert"],
            "FP8 embedding tables are not read by kvmesh",
        ));
    }
    let scheme = Scheme {
        weights: WeightScale::Block {
            rows: block,
            cols: block,
        },
        activations: ActivationScheme::DynamicTokenGroup(block),
    };
    Ok(quantization(
        QuantMethod::Fp8,
        vec![(vec![Pattern::Linear], scheme)],
        skip_list(o)?,
        Value::Object(o.clone()),
    ))
}

/// The layers the fp8 format leaves unquantized: `modules_to_not_convert`, or its alias
/// `ignored_layers`, or transformers' default (the output head).
fn skip_list(o: &Map<String, Value>) -> Result<Vec<Pattern>> {
    let s = |k: &str| o.get(k).filter(|v| !v.is_null());
    Ok(match (s("modules_to_not_convert"), s("ignored_layers")) {
        (Some(a), Some(b)) if a != b => {
            return Err(bad(format!(
                "quantization_config gives both modules_to_not_convert {} and ignored_layers {} \
                 and they differ; transformers reads only the first, so which layers stay \
                 unquantized is ambiguous",
                shown(a),
                shown(b)
            )))
        }
        (Some(v), _) => patterns("modules_to_not_convert", v, hf_pattern)?,
        (None, Some(v)) => patterns("ignored_layers", v, hf_pattern)?,
        // transformers' default: the output head stays in its stored dtype.
        (None, None) => vec![hf_pattern("lm_head").expect("a plain name")],
    })
}

/// A skip-list entry as transformers reads it (see [`Pattern::Hf`]).
fn hf_pattern(s: &str) -> std::result::Result<Pattern, String> {
    let whole = Regex::new(&format!("^(?:{s})$")).map_err(|e| {
        format!("kvmesh cannot read it as the regex transformers matches it as ({e})")
    })?;
    Ok(Pattern::Hf {
        text: s.to_string(),
        whole,
    })
}
