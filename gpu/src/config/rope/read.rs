//! kvmesh's refusal pass over the typed RoPE settings: the two layouts contradicting each
//! other, a type kvmesh does not implement, a parameter of another type, a missing or
//! out-of-range one, a nested per-layer dict, RoPE on part of a head. What passes is
//! resolved to a [`Rope`], with transformers' defaults filled in.

use super::typed::{Param, RopeParams, RopeSource, RopeType, TypeName, SHARED_PARAMS};
use super::{Rope, RopeScaling};
use crate::config::error::{ConfigError, Result};
use crate::config::reader::{shown, Fields};

/// transformers' default theta for every family kvmesh runs.
const DEFAULT_THETA: f64 = 10_000.0;

/// Reads the RoPE settings from either layout. `max_pos` is the model's
/// `max_position_embeddings`, the default for `original_max_position_embeddings`.
pub(in crate::config) fn read_rope(f: &Fields, max_pos: usize) -> Result<Rope> {
    let top_theta = f.f64("rope_theta")?;
    let src = RopeSource::select(f, top_theta.is_some())?;
    let d = Dict {
        name: src.name,
        p: src.params()?,
        f,
        max_pos,
    };
    refuse_nested(&src)?;
    let theta = d.theta(top_theta)?;
    let type_name = d.type_name()?;
    d.refuse_partial_rotary()?;
    let kind = match type_name {
        TypeName::Known(kind) => kind,
        TypeName::Other(other) => {
            return Err(ConfigError::UnknownRopeType {
                dict: d.name,
                rope_type: other,
            })
        }
    };
    refuse_foreign(&src, kind)?;
    let scaling = match kind {
        RopeType::Default => RopeScaling::Default,
        RopeType::Linear => RopeScaling::Linear {
            factor: d.factor(kind)?,
        },
        RopeType::Dynamic => RopeScaling::Dynamic {
            factor: d.factor(kind)?,
        },
        RopeType::Llama3 => d.llama3()?,
        RopeType::Yarn => d.yarn()?,
    };
    Ok(Rope {
        theta,
        scaling,
        layout: src.layout,
    })
}

/// Per-layer-type RoPE (a dict of dicts keyed by layer type) belongs to other families.
fn refuse_nested(src: &RopeSource) -> Result<()> {
    match src.entries().find(|(_, v)| v.is_object()) {
        Some((k, _)) => Err(ConfigError::NestedRope {
            dict: src.name,
            key: k.clone(),
        }),
        None => Ok(()),
    }
}

/// A parameter set (not null) that `kind` does not take: kvmesh will not guess its meaning.
fn refuse_foreign(src: &RopeSource, kind: RopeType) -> Result<()> {
    let takes = kind.params();
    let foreign = src.entries().find(|(k, v)| {
        !SHARED_PARAMS.contains(&k.as_str()) && !takes.contains(&k.as_str()) && !v.is_null()
    });
    match foreign {
        Some((k, v)) => Err(ConfigError::ForeignRopeParam {
            dict: src.name,
            key: k.clone(),
            value: shown(v),
            rope_type: kind.name(),
            takes,
        }),
        None => Ok(()),
    }
}

/// The typed dict, with what its checks need to name and default things.
struct Dict<'a> {
    /// The dict's name in messages: `rope_parameters` or `rope_scaling`.
    name: &'static str,
    p: RopeParams,
    /// The top level, which may repeat some of the dict's settings.
    f: &'a Fields<'a>,
    max_pos: usize,
}

impl Dict<'_> {
    fn num(&self, key: &str, p: &Param<f64>) -> Result<Option<f64>> {
        p.read(self.name, key)
    }

    /// The dict's theta, or the top-level one; both given must agree.
    fn theta(&self, top_theta: Option<f64>) -> Result<f64> {
        let name = self.name;
        let theta = match (self.num("rope_theta", &self.p.rope_theta)?, top_theta) {
            (Some(a), Some(b)) if a != b => {
                return Err(ConfigError::ThetaDisagrees {
                    dict: name,
                    dict_theta: a,
                    top_theta: b,
                })
            }
            (Some(a), _) | (None, Some(a)) => a,
            (None, None) => DEFAULT_THETA,
        };
        if !(theta > 1.0 && theta.is_finite()) {
            return Err(ConfigError::RopeTheta { theta });
        }
        Ok(theta)
    }

    /// The type, under `rope_type` or the legacy `type`; both given must agree.
    fn type_name(&self) -> Result<TypeName> {
        let name = self.name;
        let current = self.p.rope_type.read(name, "rope_type")?;
        let legacy = self.p.legacy_type.read(name, "type")?;
        match (current, legacy) {
            (Some(a), Some(b)) if a != b => Err(ConfigError::RopeTypeDisagrees {
                dict: name,
                rope_type: a.as_str().to_string(),
                legacy_type: b.as_str().to_string(),
            }),
            (Some(a), _) | (None, Some(a)) => Ok(a),
            (None, None) => Ok(TypeName::Known(RopeType::Default)),
        }
    }

    /// kvmesh rotates whole heads, so `partial_rotary_factor` (in the dict or at the top
    /// level, the dict's first) must be 1.
    fn refuse_partial_rotary(&self) -> Result<()> {
        let k = "partial_rotary_factor";
        let partial = match (self.num(k, &self.p.partial_rotary_factor)?, self.f.f64(k)?) {
            (Some(a), _) | (None, Some(a)) => a,
            (None, None) => 1.0,
        };
        if partial != 1.0 {
            return Err(ConfigError::PartialRotary { factor: partial });
        }
        Ok(())
    }

    /// A parameter `kind` cannot do without.
    fn need(&self, key: &'static str, p: &Param<f64>, kind: RopeType) -> Result<f64> {
        self.num(key, p)?.ok_or(ConfigError::MissingRopeParam {
            dict: self.name,
            rope_type: kind.name(),
            key,
        })
    }

    /// `factor`, which stretches positions and so cannot be below 1.
    fn factor(&self, kind: RopeType) -> Result<f64> {
        let f = self.need("factor", &self.p.factor, kind)?;
        if !(f >= 1.0 && f.is_finite()) {
            return Err(ConfigError::RopeFactor {
                dict: self.name,
                factor: f,
                rope_type: kind.name(),
            });
        }
        Ok(f)
    }

    /// The context length the model was trained on. transformers lets a top-level
    /// `original_max_position_embeddings` override the dict's; both given must agree.
    fn original(&self) -> Result<f64> {
        let k = "original_max_position_embeddings";
        match (
            self.num(k, &self.p.original_max_position_embeddings)?,
            self.f.f64(k)?,
        ) {
            (Some(a), Some(b)) if a != b => Err(ConfigError::OriginalDisagrees {
                dict: self.name,
                dict_value: a,
                top: b,
            }),
            (Some(a), _) | (None, Some(a)) => Ok(a),
            (None, None) => Ok(self.max_pos as f64),
        }
    }

    fn llama3(&self) -> Result<RopeScaling> {
        let kind = RopeType::Llama3;
        let factor = self.factor(kind)?;
        let lo = self.need("low_freq_factor", &self.p.low_freq_factor, kind)?;
        let hi = self.need("high_freq_factor", &self.p.high_freq_factor, kind)?;
        let original_max_position_embeddings = self.original()?;
        if hi <= lo || lo <= 0.0 {
            return Err(ConfigError::Llama3Freqs {
                dict: self.name,
                low: lo,
                high: hi,
            });
        }
        Ok(RopeScaling::Llama3 {
            factor,
            low_freq_factor: lo,
            high_freq_factor: hi,
            original_max_position_embeddings,
        })
    }

    fn yarn(&self) -> Result<RopeScaling> {
        let orig = self.original()?;
        if orig < 1.0 {
            return Err(ConfigError::YarnOriginal {
                dict: self.name,
                original: orig,
            });
        }
        // An explicit null factor means "the ratio of the context lengths", as in
        // transformers; an absent one is an error there and here.
        let factor = match self.p.factor {
            Param::Null => self.max_pos as f64 / orig,
            _ => self.factor(RopeType::Yarn)?,
        };
        let attention_factor = self.yarn_attention_factor(factor)?;
        let truncate = self.p.truncate.read(self.name, "truncate")?.unwrap_or(true);
        // transformers reads `beta_fast or 32`, so 0 also means the default.
        let beta = |k: &str, p: &Param<f64>, dflt: f64| -> Result<f64> {
            Ok(self.num(k, p)?.filter(|&b| b != 0.0).unwrap_or(dflt))
        };
        Ok(RopeScaling::Yarn {
            factor,
            original_max_position_embeddings: orig,
            beta_fast: beta("beta_fast", &self.p.beta_fast, 32.0)?,
            beta_slow: beta("beta_slow", &self.p.beta_slow, 1.0)?,
            attention_factor,
            truncate,
        })
    }

    /// yarn's factor on cos and sin: the config's own, or the one `factor` and the
    /// DeepSeek-style `mscale` / `mscale_all_dim` imply.
    fn yarn_attention_factor(&self, factor: f64) -> Result<f64> {
        let mscale = |scale: f64, m: f64| {
            if scale <= 1.0 {
                1.0
            } else {
                0.1 * m * scale.ln() + 1.0
            }
        };
        match self.num("attention_factor", &self.p.attention_factor)? {
            Some(a) if a > 0.0 => Ok(a),
            Some(a) => Err(ConfigError::YarnAttentionFactor {
                dict: self.name,
                factor: a,
            }),
            None => match (
                self.num("mscale", &self.p.mscale)?,
                self.num("mscale_all_dim", &self.p.mscale_all_dim)?,
            ) {
                (Some(m), Some(a)) if m != 0.0 && a != 0.0 => {
                    Ok(mscale(factor, m) / mscale(factor, a))
                }
                _ => Ok(mscale(factor, 1.0)),
            },
        }
    }
}
