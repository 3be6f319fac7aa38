//! The typed first pass over the RoPE settings: which of transformers' layouts holds them,
//! and the dict's entries read into types. Only the shape is refused here (both layouts at
//! once, a dict that is not an object); what the entries mean together, and whether kvmesh
//! implements it, is for `read`.
//!
//! Entries are not refused while they are deserialized: a value of the wrong type is kept
//! as it stood (`Param::Mistyped`), so that the refusal can name the field and show the
//! value, and comes in the same order as the other checks. An entry that only one RoPE type
//! reads is only type-checked when that type reads it.

use serde::Deserialize;
use serde_json::{Map, Value};

use super::RopeLayout;
use crate::config::error::{ConfigError, Result};
use crate::config::reader::{shown, Fields};

/// The RoPE types kvmesh implements, by the names transformers gives them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
pub(super) enum RopeType {
    #[serde(rename = "default")]
    Default,
    #[serde(rename = "linear")]
    Linear,
    #[serde(rename = "dynamic")]
    Dynamic,
    #[serde(rename = "llama3")]
    Llama3,
    #[serde(rename = "yarn")]
    Yarn,
}

impl RopeType {
    /// The name the file gives the type, for messages.
    pub(super) fn name(self) -> &'static str {
        match self {
            RopeType::Default => "default",
            RopeType::Linear => "linear",
            RopeType::Dynamic => "dynamic",
            RopeType::Llama3 => "llama3",
            RopeType::Yarn => "yarn",
        }
    }

    /// The parameters the type takes besides those every type shares, in the order the
    /// refusal of a foreign one lists them.
    pub(super) fn params(self) -> &'static [&'static str] {
        match self {
            RopeType::Default => &[],
            RopeType::Linear | RopeType::Dynamic => &["factor"],
            RopeType::Llama3 => &[
                "factor",
                "low_freq_factor",
                "high_freq_factor",
                "original_max_position_embeddings",
            ],
            RopeType::Yarn => &[
                "factor",
                "original_max_position_embeddings",
                "attention_factor",
                "beta_fast",
                "beta_slow",
                "mscale",
                "mscale_all_dim",
                "truncate",
            ],
        }
    }
}

/// Entries every RoPE type may hold.
pub(super) const SHARED_PARAMS: &[&str] =
    &["rope_type", "type", "rope_theta", "partial_rotary_factor"];

/// The type a dict names: one kvmesh implements, or any other name (refused by that name).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(untagged)]
pub(super) enum TypeName {
    Known(RopeType),
    Other(String),
}

impl TypeName {
    pub(super) fn as_str(&self) -> &str {
        match self {
            TypeName::Known(t) => t.name(),
            TypeName::Other(s) => s,
        }
    }
}

/// What a type is called in the refusal of a value of another type.
pub(super) trait Expected {
    const WHAT: &'static str;
}

impl Expected for f64 {
    const WHAT: &'static str = "a number";
}

impl Expected for bool {
    const WHAT: &'static str = "true or false";
}

impl Expected for TypeName {
    const WHAT: &'static str = "a string";
}

/// One entry of the dict as the file gives it. `null` is kept apart from absent because
/// yarn reads a null `factor` as "the ratio of the context lengths".
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(untagged)]
pub(super) enum Param<T> {
    #[default]
    #[serde(skip_deserializing)]
    Absent,
    Given(T),
    Null,
    /// A value of another type than `T`, refused when the entry is read.
    Mistyped(Value),
}

impl<T: Clone + Expected> Param<T> {
    /// The value (`null` counts as absent), or the refusal of a mistyped one naming the
    /// entry `dict.key`.
    pub(super) fn read(&self, dict: &str, key: &str) -> Result<Option<T>> {
        match self {
            Param::Absent | Param::Null => Ok(None),
            Param::Given(v) => Ok(Some(v.clone())),
            Param::Mistyped(v) => Err(ConfigError::Mistyped {
                field: format!("{dict}.{key}"),
                value: shown(v),
                expected: T::WHAT,
            }),
        }
    }
}

/// Every entry of a RoPE dict that kvmesh reads, from either layout. Other entries are not
/// read here; `read` refuses them by name.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub(super) struct RopeParams {
    pub(super) rope_type: Param<TypeName>,
    /// The legacy layout's name for `rope_type`.
    #[serde(rename = "type")]
    pub(super) legacy_type: Param<TypeName>,
    pub(super) rope_theta: Param<f64>,
    pub(super) partial_rotary_factor: Param<f64>,
    pub(super) factor: Param<f64>,
    pub(super) low_freq_factor: Param<f64>,
    pub(super) high_freq_factor: Param<f64>,
    pub(super) original_max_position_embeddings: Param<f64>,
    pub(super) attention_factor: Param<f64>,
    pub(super) beta_fast: Param<f64>,
    pub(super) beta_slow: Param<f64>,
    pub(super) mscale: Param<f64>,
    pub(super) mscale_all_dim: Param<f64>,
    pub(super) truncate: Param<bool>,
}

/// The RoPE dict of whichever layout the file uses, under the name messages give it.
pub(super) struct RopeSource<'a> {
    pub(super) name: &'static str,
    pub(super) layout: RopeLayout,
    /// `None` when the file has no dict (plain RoPE, perhaps with a top-level theta).
    pub(super) dict: Option<&'a Map<String, Value>>,
}

impl<'a> RopeSource<'a> {
    /// Picks the layout. `top_theta`: whether the file has a top-level `rope_theta`, which
    /// alone makes it the legacy layout.
    pub(super) fn select(f: &Fields<'a>, top_theta: bool) -> Result<RopeSource<'a>> {
        let (name, dict, layout) = match (f.get("rope_parameters"), f.get("rope_scaling")) {
            (Some(p), Some(l)) => {
                return Err(ConfigError::BothRopeLayouts {
                    parameters: shown(p),
                    scaling: shown(l),
                })
            }
            (Some(p), None) => ("rope_parameters", Some(p), RopeLayout::Parameters),
            (None, Some(l)) => ("rope_scaling", Some(l), RopeLayout::Legacy),
            (None, None) if top_theta => ("rope_scaling", None, RopeLayout::Legacy),
            (None, None) => ("rope_parameters", None, RopeLayout::Absent),
        };
        let dict = match dict {
            None => None,
            Some(Value::Object(o)) => Some(o),
            Some(v) => {
                return Err(ConfigError::Mistyped {
                    field: name.to_string(),
                    value: shown(v),
                    expected: "an object",
                });
            }
        };
        Ok(RopeSource { name, layout, dict })
    }

    /// The dict's entries, in the file's order.
    pub(super) fn entries(&self) -> impl Iterator<Item = (&'a String, &'a Value)> {
        self.dict.into_iter().flatten()
    }

    /// The typed read of the dict.
    pub(super) fn params(&self) -> Result<RopeParams> {
        let Some(dict) = self.dict else {
            return Ok(RopeParams::default());
        };
        // Every entry deserializes (a mistyped one as `Param::Mistyped`), so this fails
        // only if serde itself cannot read the object.
        RopeParams::deserialize(&Value::Object(dict.clone())).map_err(|error| {
            ConfigError::RopeDict {
                dict: self.name,
                error,
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::{Param, RopeParams, RopeType, TypeName};

    #[test]
    fn entries_keep_null_absent_and_mistyped_apart() {
        let p: RopeParams = serde_json::from_value(json!({
            "type": "llama3", "rope_type": "longrope", "factor": null, "beta_fast": 8,
            "truncate": "no", "rope_theta": [1], "unrelated": {}
        }))
        .unwrap();
        assert!(matches!(
            p.legacy_type,
            Param::Given(TypeName::Known(RopeType::Llama3))
        ));
        assert!(matches!(p.rope_type, Param::Given(TypeName::Other(ref s)) if s == "longrope"));
        assert!(matches!(p.factor, Param::Null));
        assert!(matches!(p.low_freq_factor, Param::Absent));
        assert!(matches!(p.beta_fast, Param::Given(b) if b == 8.0));
        assert!(matches!(p.truncate, Param::Mistyped(ref v) if v == "no"));
        assert!(matches!(p.rope_theta, Param::Mistyped(ref v) if *v == json!([1])));
    }
}
