//! `quant_method: "compressed-tensors"`: llm-compressor's float8 checkpoints, read as the
//! compressed-tensors package (0.20) reads them: `QuantizationConfig` at the top,
//! `QuantizationScheme` per config group, `QuantizationArgs` for weights and activations.
//! What kvmesh reads of it is e4m3, symmetric, per-channel or per-tensor weights stored
//! compressed (`quantization_status: compressed`), and dynamic per-token, dynamic or static
//! per-tensor, or no activation quantization; everything else is refused by name.

use serde_json::{Map, Value};

use super::error::{ConfigError, Result};
use super::quant::{
    ct_pattern, off, patterns, quantization, ActivationScheme, Pattern, QuantMethod, Quantization,
    Scheme, WeightScale,
};
use super::reader::shown;

/// Reads the whole `quantization_config` of a compressed-tensors checkpoint.
pub(super) fn read_compressed_tensors(o: &Map<String, Value>) -> Result<Quantization> {
    const KNOWN: &[&str] = &[
        "quant_method",
        "config_groups",
        "format",
        "quantization_status",
        "kv_cache_scheme",
        "ignore",
        // Informational: what the compression saved, and the package that wrote it.
        "global_compression_ratio",
        "version",
        "sparsity_config",
        "transform_config",
        "moe_sparsity_config",
    ];
    if let Some((k, v)) = o.iter().find(|(k, _)| !KNOWN.contains(&k.as_str())) {
        return Err(ConfigError::UnknownQuantField {
            field: k.clone(),
            value: shown(v),
            format: "compressed-tensors",
        });
    }
    let format = o.get("format").and_then(Value::as_str);
    let format = match format {
        Some(f @ ("float-quantized" | "naive-quantized")) => f,
        _ => {
            return Err(ConfigError::Quant {
                field: "format".into(),
                value: shown(o.get("format").unwrap_or(&Value::Null)),
                why: "kvmesh reads float8 weights stored as \"float-quantized\" or \
                 \"naive-quantized\"",
            })
        }
    };
    match o.get("quantization_status") {
        Some(Value::String(s)) if s == "compressed" => {}
        Some(v) => {
            return Err(ConfigError::Quant {
                field: "quantization_status".into(),
                value: shown(v),
                why: "kvmesh reads checkpoints saved compressed (FP8 weights with their scales)",
            })
        }
        None => return Err(ConfigError::NoQuantizationStatus),
    }
    if !off(o.get("kv_cache_scheme")) {
        return Err(ConfigError::KvCacheScheme {
            value: shown(&o["kv_cache_scheme"]),
        });
    }
    for k in ["sparsity_config", "transform_config", "moe_sparsity_config"] {
        if !off(o.get(k)) {
            return Err(ConfigError::Quant {
                field: k.to_string(),
                value: shown(&o[k]),
                why: "sparse, transformed or pruned weights are not read by kvmesh",
            });
        }
    }
    let ignore = match o.get("ignore") {
        None | Some(Value::Null) => Vec::new(),
        Some(v) => patterns("ignore", v, |s| ct_pattern(s, false))?,
    };
    let groups = match o.get("config_groups") {
        Some(Value::Object(g)) if !g.is_empty() => g,
        other => {
            return Err(ConfigError::Quant {
                field: "config_groups".into(),
                value: shown(other.unwrap_or(&Value::Null)),
                why: "expected an object of quantization schemes",
            })
        }
    };
    let mut read = Vec::new();
    for (name, g) in groups {
        read.push(read_group(name, g, format)?);
    }
    Ok(quantization(
        QuantMethod::CompressedTensors,
        read,
        ignore,
        Value::Object(o.clone()),
    ))
}

/// One config group: a scheme object, or a preset's name mapped to its targets.
fn read_group(name: &str, g: &Value, format: &str) -> Result<(Vec<Pattern>, Scheme)> {
    let path = format!("config_groups.{name}");
    if g.is_array() {
        let scheme = match name {
            "FP8_DYNAMIC" => Scheme {
                weights: WeightScale::Channel,
                activations: ActivationScheme::DynamicToken,
            },
            "FP8" => Scheme {
                weights: WeightScale::Tensor,
                activations: ActivationScheme::StaticTensor,
            },
            _ => {
                return Err(ConfigError::Quant {
                    field: path.clone(),
                    value: shown(g),
                    why: "a preset scheme kvmesh does not read (it reads FP8 and FP8_DYNAMIC)",
                })
            }
        };
        return Ok((patterns(&path, g, |s| ct_pattern(s, true))?, scheme));
    }
    let o = g.as_object().ok_or_else(|| ConfigError::Quant {
        field: path.clone(),
        value: shown(g),
        why: "expected a scheme object",
    })?;
    const KNOWN: &[&str] = &[
        "targets",
        "weights",
        "input_activations",
        "output_activations",
        "format",
    ];
    if let Some((k, v)) = o.iter().find(|(k, _)| !KNOWN.contains(&k.as_str())) {
        return Err(ConfigError::UnknownSchemeField {
            field: format!("{path}.{k}"),
            value: shown(v),
        });
    }
    if let Some(f) = o.get("format").filter(|v| !v.is_null()) {
        // float-quantized is compressed-tensors' alias of naive-quantized: one storage.
        let same = |x: &str| matches!(x, "float-quantized" | "naive-quantized");
        if !(f.as_str().is_some_and(same) && same(format)) {
            return Err(ConfigError::Quant {
                field: format!("{path}.format"),
                value: shown(f),
                why: "a group stored in another format than the checkpoint's is not read",
            });
        }
    }
    if !off(o.get("output_activations")) {
        return Err(ConfigError::Quant {
            field: format!("{path}.output_activations"),
            value: shown(&o["output_activations"]),
            why: "quantized outputs are not run by kvmesh",
        });
    }
    let targets = match o.get("targets") {
        Some(t) => patterns(&format!("{path}.targets"), t, |s| ct_pattern(s, true))?,
        None => return Err(ConfigError::NoTargets { group: path }),
    };
    let weights = match o.get("weights").filter(|v| !v.is_null()) {
        Some(w) => {
            let a = Args::read(&format!("{path}.weights"), w)?;
            match (a.strategy.as_str(), a.dynamic) {
                ("channel", false) => WeightScale::Channel,
                ("tensor", false) => WeightScale::Tensor,
                (strategy, dynamic) => {
                    return Err(ConfigError::WeightStrategy {
                        field: format!("{path}.weights"),
                        strategy: strategy.to_string(),
                        dynamic,
                    })
                }
            }
        }
        None => return Err(ConfigError::NoWeights { group: path }),
    };
    let activations = match o.get("input_activations").filter(|v| !v.is_null()) {
        None => ActivationScheme::Unquantized,
        Some(v) => {
            let a = Args::read(&format!("{path}.input_activations"), v)?;
            match (a.strategy.as_str(), a.dynamic) {
                ("token", true) => ActivationScheme::DynamicToken,
                ("tensor", true) => ActivationScheme::DynamicTensor,
                ("tensor", false) => ActivationScheme::StaticTensor,
                (strategy, dynamic) => {
                    return Err(ConfigError::ActivationStrategy {
                        field: format!("{path}.input_activations"),
                        strategy: strategy.to_string(),
                        dynamic,
                    })
                }
            }
        }
    };
    Ok((
        targets,
        Scheme {
            weights,
            activations,
        },
    ))
}

/// The fields of a `QuantizationArgs` that decide what is stored; the rest are checked to
/// be what kvmesh reads.
struct Args {
    strategy: String,
    dynamic: bool,
}

impl Args {
    fn read(path: &str, v: &Value) -> Result<Args> {
        let o = v.as_object().ok_or_else(|| ConfigError::Quant {
            field: path.to_string(),
            value: shown(v),
            why: "expected quantization arguments",
        })?;
        const KNOWN: &[&str] = &[
            "num_bits",
            "type",
            "symmetric",
            "group_size",
            "strategy",
            "block_structure",
            "dynamic",
            "actorder",
            "scale_dtype",
            "zp_dtype",
            // How the scales were calibrated, not what they mean.
            "observer",
            "observer_kwargs",
        ];
        if let Some((k, x)) = o.iter().find(|(k, _)| !KNOWN.contains(&k.as_str())) {
            return Err(ConfigError::UnknownQuantArgument {
                field: format!("{path}.{k}"),
                value: shown(x),
            });
        }
        let field = |k: &str| o.get(k).filter(|x| !x.is_null());
        let at = |k: &str| format!("{path}.{k}");
        // compressed-tensors' defaults: 8 bits, int, symmetric.
        if field("num_bits").is_some_and(|x| x.as_u64() != Some(8)) {
            return Err(ConfigError::Quant {
                field: at("num_bits"),
                value: shown(&o["num_bits"]),
                why: "kvmesh reads 8-bit FP8",
            });
        }
        let float = field("type")
            .and_then(Value::as_str)
            .is_some_and(|t| t.eq_ignore_ascii_case("float"));
        if !float {
            return Err(ConfigError::Quant {
                field: at("type"),
                value: shown(o.get("type").unwrap_or(&Value::Null)),
                why: "kvmesh reads float (e4m3) quantization, not int",
            });
        }
        if field("symmetric").is_some_and(|x| x != &Value::Bool(true)) {
            return Err(ConfigError::Quant {
                field: at("symmetric"),
                value: shown(&o["symmetric"]),
                why: "asymmetric (zero-point) FP8 is not read by kvmesh",
            });
        }
        for k in ["block_structure", "scale_dtype", "zp_dtype"] {
            if let Some(x) = field(k) {
                return Err(ConfigError::Quant {
                    field: at(k),
                    value: shown(x),
                    why: "not read by kvmesh (expected null)",
                });
            }
        }
        if let Some(x) = field("actorder") {
            let calibration_only = matches!(x, Value::Bool(false))
                || x.as_str().is_some_and(|s| s == "weight" || s == "static");
            if !calibration_only {
                return Err(ConfigError::Quant {
                    field: at("actorder"),
                    value: shown(x),
                    why: "kvmesh reads no reordered columns",
                });
            }
        }
        let group = field("group_size").map(|x| x.as_i64());
        let strategy = match (field("strategy").and_then(Value::as_str), group) {
            (Some(s), None | Some(Some(-1))) => s.to_ascii_lowercase(),
            (None, None) => "tensor".into(),
            (None, Some(Some(-1))) => "channel".into(),
            _ => {
                return Err(ConfigError::Quant {
                    field: at("group_size"),
                    value: shown(o.get("group_size").unwrap_or(&Value::Null)),
                    why: "group-wise scales are not read by kvmesh",
                })
            }
        };
        let dynamic = match field("dynamic") {
            None => false,
            Some(Value::Bool(b)) => *b,
            Some(x) => {
                return Err(ConfigError::Quant {
                    field: at("dynamic"),
                    value: shown(x),
                    why: "expected true or false (\"local\" scales are NVFP4's)",
                })
            }
        };
        Ok(Args { strategy, dynamic })
    }
}
