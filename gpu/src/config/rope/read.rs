//! Reading the RoPE settings from either of transformers' layouts, refusing what kvmesh
//! does not implement.

use serde_json::{Map, Value};

use super::{Rope, RopeLayout, RopeScaling};
use crate::config::reader::{bad, shown, typed, Fields};
use crate::error::Result;

/// The numbers a RoPE dict may hold, read with the dict's name in messages.
struct RopeDict<'a> {
    name: &'static str,
    obj: &'a Map<String, Value>,
}

impl RopeDict<'_> {
    fn f64(&self, k: &str) -> Result<Option<f64>> {
        typed(
            self.obj,
            &format!("{}.{k}", self.name),
            k,
            Value::as_f64,
            "a number",
        )
    }

    fn need(&self, k: &str, kind: &str) -> Result<f64> {
        self.f64(k)?.ok_or_else(|| {
            bad(format!(
                "`{}` is rope type `{kind}` but has no `{k}`, which that type requires",
                self.name
            ))
        })
    }

    fn factor(&self, kind: &str) -> Result<f64> {
        let f = self.need("factor", kind)?;
        if !(f >= 1.0 && f.is_finite()) {
            return Err(bad(format!(
                "`{}.factor` is {f}; rope type `{kind}` needs a factor of 1 or more",
                self.name
            )));
        }
        Ok(f)
    }
}

/// Reads the RoPE settings from either layout. `top_original` is a top-level
/// `original_max_position_embeddings`, which transformers lets override the dict's.
pub(in crate::config) fn read_rope(f: &Fields, max_pos: usize) -> Result<Rope> {
    let params = f.get("rope_parameters");
    let legacy = f.get("rope_scaling");
    let top_theta = f.f64("rope_theta")?;
    let (name, dict, layout) = match (params, legacy) {
        (Some(p), Some(l)) => {
            return Err(bad(format!(
                "both `rope_parameters` ({}) and the legacy `rope_scaling` ({}) are set; \
                 transformers would take rope_scaling and drop rope_parameters, which is rarely \
                 what was meant. Keep one: move rope_scaling's fields into rope_parameters",
                shown(p),
                shown(l)
            )))
        }
        (Some(p), None) => ("rope_parameters", Some(p), RopeLayout::Parameters),
        (None, Some(l)) => ("rope_scaling", Some(l), RopeLayout::Legacy),
        (None, None) if top_theta.is_some() => ("rope_scaling", None, RopeLayout::Legacy),
        (None, None) => ("rope_parameters", None, RopeLayout::Absent),
    };
    let empty = Map::new();
    let obj = match dict {
        None => &empty,
        Some(Value::Object(o)) => o,
        Some(v) => {
            return Err(bad(format!("`{name}` is {}; expected an object", shown(v))));
        }
    };
    let d = RopeDict { name, obj };

    // Per-layer-type RoPE (a dict of dicts keyed by layer type) belongs to other families.
    if let Some((k, _)) = obj.iter().find(|(_, v)| v.is_object()) {
        return Err(bad(format!(
            "`{name}.{k}` is a nested RoPE dict (RoPE per layer type); the families kvmesh runs \
             use one RoPE for every layer"
        )));
    }

    let theta = match (d.f64("rope_theta")?, top_theta) {
        (Some(a), Some(b)) if a != b => {
            return Err(bad(format!(
                "`{name}.rope_theta` is {a} but the top-level `rope_theta` is {b}; make them agree"
            )))
        }
        (Some(a), _) | (None, Some(a)) => a,
        // transformers' default theta for every family kvmesh runs.
        (None, None) => 10_000.0,
    };
    if !(theta > 1.0 && theta.is_finite()) {
        return Err(bad(format!(
            "`rope_theta` is {theta}; expected a number above 1"
        )));
    }

    let kind_key = |k: &str| typed(obj, &format!("{name}.{k}"), k, Value::as_str, "a string");
    let kind = match (kind_key("rope_type")?, kind_key("type")?) {
        (Some(a), Some(b)) if a != b => {
            return Err(bad(format!(
                "`{name}.rope_type` is {a:?} but `{name}.type` is {b:?}; make them agree"
            )))
        }
        (Some(a), _) | (None, Some(a)) => a,
        (None, None) => "default",
    };

    let k = "partial_rotary_factor";
    let partial = match (d.f64(k)?, f.f64(k)?) {
        (Some(a), _) | (None, Some(a)) => a,
        (None, None) => 1.0,
    };
    if partial != 1.0 {
        return Err(bad(format!(
            "`partial_rotary_factor` is {partial}: RoPE on part of each head is not how \
             Llama, Qwen2, Qwen3 or Mistral models work, and kvmesh rotates whole heads"
        )));
    }

    let allowed: &[&str] = match kind {
        "default" => &[],
        "linear" | "dynamic" => &["factor"],
        "llama3" => &[
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        ],
        "yarn" => &[
            "factor",
            "original_max_position_embeddings",
            "attention_factor",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "truncate",
        ],
        other => {
            return Err(bad(format!(
                "`{name}` has rope type {other:?}, which kvmesh does not implement; supported: \
                 default, linear, dynamic, llama3, yarn"
            )))
        }
    };
    for (k, v) in obj {
        let common = ["rope_type", "type", "rope_theta", "partial_rotary_factor"];
        if !common.contains(&k.as_str()) && !allowed.contains(&k.as_str()) && !v.is_null() {
            return Err(bad(format!(
                "`{name}.{k}` = {} is not a parameter of rope type `{kind}` (it takes: {}); \
                 kvmesh will not guess what it means",
                shown(v),
                if allowed.is_empty() {
                    "rope_theta only".to_string()
                } else {
                    allowed.join(", ")
                }
            )));
        }
    }

    // transformers lets a top-level `original_max_position_embeddings` override the dict's.
    let original = || -> Result<f64> {
        match (
            d.f64("original_max_position_embeddings")?,
            f.f64("original_max_position_embeddings")?,
        ) {
            (Some(a), Some(b)) if a != b => Err(bad(format!(
                "`{name}.original_max_position_embeddings` is {a} but the top-level one is {b}; \
                 make them agree"
            ))),
            (Some(a), _) | (None, Some(a)) => Ok(a),
            (None, None) => Ok(max_pos as f64),
        }
    };

    let scaling = match kind {
        "default" => RopeScaling::Default,
        "linear" => RopeScaling::Linear {
            factor: d.factor(kind)?,
        },
        "dynamic" => RopeScaling::Dynamic {
            factor: d.factor(kind)?,
        },
        "llama3" => {
            let s = RopeScaling::Llama3 {
                factor: d.factor(kind)?,
                low_freq_factor: d.need("low_freq_factor", kind)?,
                high_freq_factor: d.need("high_freq_factor", kind)?,
                original_max_position_embeddings: original()?,
            };
            if let RopeScaling::Llama3 {
                low_freq_factor: lo,
                high_freq_factor: hi,
                ..
            } = s
            {
                if hi <= lo || lo <= 0.0 {
                    return Err(bad(format!(
                        "`{name}`: llama3 needs 0 < low_freq_factor < high_freq_factor, got {lo} and {hi}"
                    )));
                }
            }
            s
        }
        "yarn" => {
            let orig = original()?;
            if orig < 1.0 {
                return Err(bad(format!(
                    "`{name}.original_max_position_embeddings` is {orig}; expected a positive length"
                )));
            }
            // An explicit null factor means "the ratio of the context lengths", as in
            // transformers; an absent one is an error there and here.
            let factor = if d.obj.get("factor").is_some_and(Value::is_null) {
                max_pos as f64 / orig
            } else {
                d.factor(kind)?
            };
            let mscale = |scale: f64, m: f64| {
                if scale <= 1.0 {
                    1.0
                } else {
                    0.1 * m * scale.ln() + 1.0
                }
            };
            let attention_factor = match d.f64("attention_factor")? {
                Some(a) if a > 0.0 => a,
                Some(a) => {
                    return Err(bad(format!(
                        "`{name}.attention_factor` is {a}; expected a positive number"
                    )))
                }
                None => match (d.f64("mscale")?, d.f64("mscale_all_dim")?) {
                    (Some(m), Some(a)) if m != 0.0 && a != 0.0 => {
                        mscale(factor, m) / mscale(factor, a)
                    }
                    _ => mscale(factor, 1.0),
                },
            };
            // transformers reads `beta_fast or 32`, so 0 also means the default.
            let beta = |k: &str, dflt: f64| -> Result<f64> {
                Ok(d.f64(k)?.filter(|&b| b != 0.0).unwrap_or(dflt))
            };
            let truncate = typed(
                obj,
                &format!("{name}.truncate"),
                "truncate",
                Value::as_bool,
                "true or false",
            )?
            .unwrap_or(true);
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: orig,
                beta_fast: beta("beta_fast", 32.0)?,
                beta_slow: beta("beta_slow", 1.0)?,
                attention_factor,
                truncate,
            }
        }
        _ => unreachable!("checked above"),
    };
    Ok(Rope {
        theta,
        scaling,
        layout,
    })
}
