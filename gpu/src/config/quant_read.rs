//! Reading `quantization_config`: the method it names picks the reader (the block-scaled
//! `fp8` format here, compressed-tensors in `quant_ct`), which fills in a
//! [`Quantization`] (see `quant` for what each part means).

use regex::Regex;
use serde_json::{Map, Value};

use super::error::{ConfigError, PatternError, Result};
use super::quant::{
    off, patterns, quantization, ActivationScheme, Pattern, QuantMethod, Quantization, Scheme,
    WeightScale, FP8_BLOCK,
};
use super::quant_ct::read_compressed_tensors;
use super::reader::shown;

/// Reads `quantization_config`, refusing what it does not understand.
pub(super) fn read_quantization(v: &Value) -> Result<Quantization> {
    let o = v.as_object().ok_or_else(|| ConfigError::Mistyped {
        field: "quantization_config".into(),
        value: shown(v),
        expected: "an object",
    })?;
    match o.get("quant_method").and_then(Value::as_str) {
        Some("fp8") => read_fp8(o),
        Some("compressed-tensors") => read_compressed_tensors(o),
        Some(other) => Err(ConfigError::UnknownQuantMethod {
            method: other.to_string(),
        }),
        None => Err(ConfigError::NoQuantMethod { value: shown(v) }),
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
        return Err(ConfigError::UnknownQuantField {
            field: k.clone(),
            value: shown(v),
            format: "fp8",
        });
    }
    let s = |k: &str| o.get(k).filter(|v| !v.is_null());
    if let Some(v) = s("fmt") {
        if v.as_str() != Some("e4m3") {
            return Err(ConfigError::Quant {
                field: "fmt".into(),
                value: shown(v),
                why: "kvmesh reads e4m3 FP8 weights only",
            });
        }
    }
    match s("activation_scheme") {
        None => {}
        Some(v)
            if v.as_str()
                .is_some_and(|a| a.eq_ignore_ascii_case("dynamic")) => {}
        Some(v) if v.as_str().is_some_and(|a| a.eq_ignore_ascii_case("static")) => {
            return Err(ConfigError::StaticActivations { value: shown(v) })
        }
        Some(v) => return Err(ConfigError::UnknownActivationScheme { value: shown(v) }),
    }
    let block = match s("weight_block_size") {
        None => return Err(ConfigError::NoBlockSize),
        Some(v) => {
            match v
                .as_array()
                .map(|a| a.iter().map(Value::as_u64).collect::<Vec<_>>())
            {
                Some(b) if b == [Some(FP8_BLOCK as u64), Some(FP8_BLOCK as u64)] => FP8_BLOCK,
                _ => return Err(ConfigError::BlockSize { value: shown(v) }),
            }
        }
    };
    if let Some(v) = s("scale_fmt") {
        if v.as_str() != Some("float") {
            return Err(ConfigError::Quant {
                field: "scale_fmt".into(),
                value: shown(v),
                why: "kvmesh reads float scales (f32 or bf16), not power-of-two ue8m0 ones",
            });
        }
    }
    if let Some(v) = s("expert_dtype") {
        if v.as_str() != Some("fp8") {
            return Err(ConfigError::Quant {
                field: "expert_dtype".into(),
                value: shown(v),
                why: "kvmesh runs no FP4 experts",
            });
        }
    }
    if let Some(v) = s("dequantize") {
        if !v.is_boolean() {
            return Err(ConfigError::Quant {
                field: "dequantize".into(),
                value: shown(v),
                why: "expected true or false",
            });
        }
    }
    if !off(o.get("modules_to_convert")) {
        return Err(ConfigError::Quant {
            field: "modules_to_convert".into(),
            value: shown(&o["modules_to_convert"]),
            why: "FP8 embedding tables are not read by kvmesh",
        });
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
            return Err(ConfigError::SkipListsDisagree {
                modules_to_not_convert: shown(a),
                ignored_layers: shown(b),
            })
        }
        (Some(v), _) => patterns("modules_to_not_convert", v, hf_pattern)?,
        (None, Some(v)) => patterns("ignored_layers", v, hf_pattern)?,
        // transformers' default: the output head stays in its stored dtype.
        (None, None) => vec![hf_pattern("lm_head").expect("a plain name")],
    })
}

/// A skip-list entry as transformers reads it (see [`Pattern::Hf`]).
fn hf_pattern(s: &str) -> std::result::Result<Pattern, PatternError> {
    let whole = Regex::new(&format!("^(?:{s})$")).map_err(PatternError::HfRegex)?;
    Ok(Pattern::Hf {
        text: s.to_string(),
        whole,
    })
}
