//! A model's shape and math, read from the Hugging Face `config.json` it ships with.
//!
//! Each family spells a few things its own way (Qwen2's q/k/v biases, Qwen3's per-head q/k
//! norms, Llama-3's RoPE scaling, Mistral's sliding window); `ModelConfig` is the one
//! normalised view the backends use.
//!
//! The rule here: every field that changes the math is either applied or refused, with a
//! message naming the field, its value and what is supported. A serving engine that quietly
//! falls back to a default (a `rope_theta` it did not find, a scaling type it did not know)
//! answers with a different model than the one asked for, and nothing looks wrong. So:
//!
//! - Both layouts transformers has written are read: the current one (transformers 5),
//!   `"rope_parameters": {"rope_type", "rope_theta", ...}` with `dtype`, and the legacy one,
//!   top-level `rope_theta` plus `"rope_scaling": {"type" | "rope_type", ...}` with
//!   `torch_dtype`. A config that says the same thing twice in ways that disagree is refused.
//! - Fields known not to change the forward pass (metadata, training-only settings,
//!   generation defaults) are listed in [`IGNORED_FIELDS`] and skipped.
//! - Any other field with a value (not null, false or empty) is refused: it may belong to a
//!   variant of the family that kvmesh does not implement.
//! - A field missing from the file takes the default transformers' own config class for the
//!   family gives it, so an old or hand-written file means what it means to transformers.

use serde_json::{Map, Value};

use crate::error::{EngineError, Result};

/// The model families kvmesh runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
    Qwen3,
    Mistral,
}

impl Arch {
    pub fn from_architecture(name: &str) -> Option<Arch> {
        match name {
            "LlamaForCausalLM" => Some(Arch::Llama),
            "Qwen2ForCausalLM" => Some(Arch::Qwen2),
            "Qwen3ForCausalLM" => Some(Arch::Qwen3),
            "MistralForCausalLM" => Some(Arch::Mistral),
            _ => None,
        }
    }

    pub fn from_model_type(name: &str) -> Option<Arch> {
        match name {
            "llama" => Some(Arch::Llama),
            "qwen2" => Some(Arch::Qwen2),
            "qwen3" => Some(Arch::Qwen3),
            "mistral" => Some(Arch::Mistral),
            _ => None,
        }
    }

    pub fn architecture_name(self) -> &'static str {
        match self {
            Arch::Llama => "LlamaForCausalLM",
            Arch::Qwen2 => "Qwen2ForCausalLM",
            Arch::Qwen3 => "Qwen3ForCausalLM",
            Arch::Mistral => "MistralForCausalLM",
        }
    }

    pub fn model_type(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Mistral => "mistral",
        }
    }

    /// `max_position_embeddings` when the file has none (transformers' class default).
    fn default_max_position_embeddings(self) -> usize {
        match self {
            Arch::Llama => 2048,
            Arch::Qwen2 | Arch::Qwen3 => 32_768,
            Arch::Mistral => 131_072,
        }
    }

    /// The config fields this family reads, besides the shape and RoPE fields all share.
    fn own_fields(self) -> &'static [&'static str] {
        match self {
            Arch::Llama => &["attention_bias", "mlp_bias", "head_dim"],
            // Qwen2's modeling code always has q/k/v biases and never an o_proj bias, so
            // `attention_bias` in a qwen2 config is not read by transformers, nor here.
            Arch::Qwen2 | Arch::Qwen3 => &[
                "attention_bias",
                "head_dim",
                "use_sliding_window",
                "sliding_window",
                "max_window_layers",
                "layer_types",
            ],
            // `layer_types` only to refuse it with the reason (see `read_window`).
            Arch::Mistral => &["head_dim", "sliding_window", "layer_types"],
        }
    }
}

/// How rotary position embeddings are scaled, with each type's own parameters.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE: `inv_freq[i] = theta^(-2i/d)`.
    Default,
    /// Position interpolation: every frequency divided by `factor`.
    Linear { factor: f64 },
    /// Dynamic NTK: past `max_position_embeddings` the base grows with the sequence length,
    /// `theta * (factor * len / max - (factor - 1))^(d / (d - 2))`; below it, plain RoPE.
    Dynamic { factor: f64 },
    /// Llama 3.1: low frequencies divided by `factor`, high ones kept, a smooth ramp between.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
    /// YaRN (Qwen2.5 / Qwen3 long context): per-frequency blend of interpolation and
    /// extrapolation over a ramp set by `beta_fast` / `beta_slow`, and cos/sin multiplied by
    /// `attention_factor` (so attention scores by its square).
    Yarn {
        factor: f64,
        original_max_position_embeddings: f64,
        beta_fast: f64,
        beta_slow: f64,
        /// Resolved: the config's own value, or the one its `factor` / `mscale` imply.
        attention_factor: f64,
        truncate: bool,
    },
}

impl RopeScaling {
    pub fn type_name(&self) -> &'static str {
        match self {
            RopeScaling::Default => "default",
            RopeScaling::Linear { .. } => "linear",
            RopeScaling::Dynamic { .. } => "dynamic",
            RopeScaling::Llama3 { .. } => "llama3",
            RopeScaling::Yarn { .. } => "yarn",
        }
    }
}

/// Which of transformers' layouts the RoPE settings were read from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeLayout {
    /// transformers 5: `rope_parameters`.
    Parameters,
    /// Older files: top-level `rope_theta` and `rope_scaling`.
    Legacy,
    /// Neither is present: plain RoPE at the default theta.
    Absent,
}

impl RopeLayout {
    pub fn describe(self) -> &'static str {
        match self {
            RopeLayout::Parameters => "rope_parameters",
            RopeLayout::Legacy => "rope_theta + rope_scaling (legacy layout)",
            RopeLayout::Absent => "none in config.json (transformers' default)",
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Rope {
    pub theta: f64,
    pub scaling: RopeScaling,
    pub layout: RopeLayout,
}

impl Rope {
    pub fn plain(theta: f64) -> Rope {
        Rope {
            theta,
            scaling: RopeScaling::Default,
            layout: RopeLayout::Parameters,
        }
    }
}

#[derive(Clone, Debug)]
pub struct ModelConfig {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub rope: Rope,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Bias on the q, k and v projections (Qwen2 always; `attention_bias` in Llama and Qwen3).
    pub qkv_bias: bool,
    /// Bias on the output projection (`attention_bias` in Llama and Qwen3).
    pub o_bias: bool,
    /// Biases on gate, up and down projections (Llama's `mlp_bias`).
    pub mlp_bias: bool,
    /// RMSNorm over each head of q and k before RoPE (Qwen3).
    pub qk_norm: bool,
    /// The attention window: a query sees itself and the `w - 1` positions before it.
    pub sliding_window: Option<usize>,
    /// Which layers use the window (`None`: all of them, when there is a window).
    pub sliding_layers: Option<Vec<bool>>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// The dtype the file declares (`dtype` or `torch_dtype`); the weights' own dtype is what
    /// is loaded, this is only reported.
    pub declared_dtype: Option<String>,
    /// Fields present in the file and skipped because they do not change the math.
    pub ignored_fields: Vec<String>,
}

/// Fields that never change the forward pass: provenance, training-only settings, how
/// transformers runs, and generation defaults (sampling defaults are read from
/// `generation_config.json`). Also skipped: any name starting with `_` or ending in
/// `_version`.
pub const IGNORED_FIELDS: &[&str] = &[
    "transformers_version",
    "dtype",
    "torch_dtype",
    "use_cache",
    "initializer_range",
    "attention_dropout",
    "pretraining_tp",
    "pad_token_id",
    "sep_token_id",
    "decoder_start_token_id",
    "return_dict",
    "output_hidden_states",
    "output_attentions",
    "torchscript",
    "use_bfloat16",
    "tf_legacy_loss",
    "chunk_size_feed_forward",
    "id2label",
    "label2id",
    "num_labels",
    "problem_type",
    "finetuning_task",
    "task_specific_params",
    "tokenizer_class",
    "prefix",
    "auto_map",
    "custom_pipelines",
    "max_length",
    "min_length",
    "do_sample",
    "early_stopping",
    "num_beams",
    "num_beam_groups",
    "diversity_penalty",
    "temperature",
    "top_k",
    "top_p",
    "typical_p",
    "repetition_penalty",
    "length_penalty",
    "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size",
    "bad_words_ids",
    "num_return_sequences",
    "output_scores",
    "return_dict_in_generate",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "remove_invalid_values",
    "exponential_decay_length_penalty",
    "suppress_tokens",
    "begin_suppress_tokens",
];

/// Fields every family reads (the shape, RoPE and token ids).
const COMMON_FIELDS: &[&str] = &[
    "architectures",
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "hidden_act",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "partial_rotary_factor",
    "original_max_position_embeddings",
    "max_position_embeddings",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
];

/// Fields that must be off: a decoder-only model with these set is another kind of model.
const MUST_BE_OFF: &[&str] = &[
    "is_encoder_decoder",
    "add_cross_attention",
    "pruned_heads",
    "quantization_config",
    "compression_config",
];

/// Token ids given as a number or a list of numbers.
pub(crate) fn token_ids(v: &Value) -> Vec<u32> {
    match v {
        Value::Number(n) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Value::Array(a) => a
            .iter()
            .filter_map(|x| x.as_u64())
            .map(|x| x as u32)
            .collect(),
        _ => Vec::new(),
    }
}

fn bad(msg: impl Into<String>) -> EngineError {
    EngineError::BadModel(format!("config.json: {}", msg.into()))
}

/// A value as it appears in the file, cut short for messages.
fn shown(v: &Value) -> String {
    let s = v.to_string();
    if s.len() > 120 {
        format!(
            "{}…",
            &s[..s.char_indices().nth(117).map_or(s.len(), |(i, _)| i)]
        )
    } else {
        s
    }
}

/// Null, false, 0-free empties: a field set to one of these turns nothing on.
fn is_off(v: &Value) -> bool {
    match v {
        Value::Null | Value::Bool(false) => true,
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        Value::String(s) => s.is_empty(),
        Value::Number(_) | Value::Bool(true) => false,
    }
}

/// Reads typed fields from the top-level object, naming the field on a type error.
struct Fields<'a> {
    obj: &'a Map<String, Value>,
}

/// A typed read of `obj[k]` (`null` counts as absent); a value of another type is an error
/// that names the field as `name` and says what was expected.
fn typed<'v, T>(
    obj: &'v Map<String, Value>,
    name: &str,
    k: &str,
    conv: impl Fn(&'v Value) -> Option<T>,
    expected: &str,
) -> Result<Option<T>> {
    match obj.get(k).filter(|v| !v.is_null()) {
        None => Ok(None),
        Some(v) => conv(v)
            .map(Some)
            .ok_or_else(|| bad(format!("`{name}` is {}; expected {expected}", shown(v)))),
    }
}

impl<'a> Fields<'a> {
    /// The value, with `null` treated as absent.
    fn get(&self, k: &str) -> Option<&'a Value> {
        self.obj.get(k).filter(|v| !v.is_null())
    }

    fn usize(&self, k: &str) -> Result<Option<usize>> {
        let int = |v: &Value| v.as_u64().map(|x| x as usize);
        typed(self.obj, k, k, int, "a non-negative integer")
    }

    fn need(&self, k: &str) -> Result<usize> {
        self.usize(k)?.ok_or_else(|| bad(format!("missing `{k}`")))
    }

    fn f64(&self, k: &str) -> Result<Option<f64>> {
        typed(self.obj, k, k, Value::as_f64, "a number")
    }

    fn bool(&self, k: &str) -> Result<Option<bool>> {
        typed(self.obj, k, k, Value::as_bool, "true or false")
    }

    fn str(&self, k: &str) -> Result<Option<&'a str>> {
        typed(self.obj, k, k, Value::as_str, "a string")
    }
}

/// The family: `model_type` is what transformers' `AutoModelForCausalLM` dispatches on;
/// `architectures` names the class that saved the file. Both must agree when both are given.
fn read_arch(f: &Fields) -> Result<Arch> {
    let model_type = f.str("model_type")?;
    let archs: Vec<String> = match f.get("architectures") {
        None => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| {
                x.as_str().map(String::from).ok_or_else(|| {
                    bad(format!(
                        "`architectures` holds {}; expected class names",
                        shown(x)
                    ))
                })
            })
            .collect::<Result<_>>()?,
        Some(v) => {
            return Err(bad(format!(
                "`architectures` is {}; expected a list of class names",
                shown(v)
            )))
        }
    };
    let supported = "kvmesh runs LlamaForCausalLM (llama), Qwen2ForCausalLM (qwen2), \
                     Qwen3ForCausalLM (qwen3) and MistralForCausalLM (mistral)";
    let from_archs = match archs.as_slice() {
        [] => None,
        [one] => Some(Arch::from_architecture(one).ok_or_else(|| {
            bad(format!(
                "unsupported architecture {one:?} (model_type {:?}); {supported}",
                model_type.unwrap_or("")
            ))
        })?),
        many => {
            return Err(bad(format!(
                "`architectures` names several classes {many:?}; a checkpoint for kvmesh names one: {supported}"
            )))
        }
    };
    let from_type = match model_type {
        None => None,
        Some(t) => Some(Arch::from_model_type(t).ok_or_else(|| {
            bad(format!(
                "unsupported model_type {t:?} (architectures {archs:?}); {supported}"
            ))
        })?),
    };
    match (from_archs, from_type) {
        (Some(a), Some(t)) if a != t => Err(bad(format!(
            "`architectures` says {} but `model_type` says {:?}; transformers builds the model \
             from model_type, so the file is ambiguous: make them agree",
            a.architecture_name(),
            t.model_type()
        ))),
        (Some(a), _) | (None, Some(a)) => Ok(a),
        (None, None) => Err(bad(format!(
            "neither `architectures` nor `model_type` is set; {supported}"
        ))),
    }
}

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
fn read_rope(f: &Fields, max_pos: usize) -> Result<Rope> {
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

impl ModelConfig {
    pub fn from_json(text: &str) -> Result<ModelConfig> {
        let root: Value =
            serde_json::from_str(text).map_err(|e| bad(format!("not valid JSON: {e}")))?;
        let obj = root
            .as_object()
            .ok_or_else(|| bad("expected a JSON object at the top level"))?;
        let f = Fields { obj };
        let arch = read_arch(&f)?;

        // Every field present is applied, known to be harmless, or refused.
        let mut ignored_fields = Vec::new();
        for (k, v) in obj {
            let key = k.as_str();
            if MUST_BE_OFF.contains(&key) {
                if is_off(v) {
                    continue;
                }
                let what = match key {
                    "quantization_config" | "compression_config" => format!(
                        "the checkpoint is quantized ({}); kvmesh loads bf16, f16 and f32 weights only",
                        v.get("quant_method")
                            .or_else(|| v.get("format"))
                            .map_or_else(|| shown(v), |m| format!("quant_method {}", shown(m)))
                    ),
                    _ => format!("`{key}` is {}; kvmesh runs decoder-only models", shown(v)),
                };
                return Err(bad(what));
            }
            if COMMON_FIELDS.contains(&key) || arch.own_fields().contains(&key) {
                continue;
            }
            if IGNORED_FIELDS.contains(&key) || key.starts_with('_') || key.ends_with("_version") {
                ignored_fields.push(k.clone());
                continue;
            }
            if is_off(v) {
                ignored_fields.push(k.clone());
                continue;
            }
            return Err(bad(format!(
                "`{key}` = {} is not a field kvmesh knows for {} models, and it may change the \
                 model's math, so the model is refused rather than run differently from how it \
                 was trained. If it does not change the forward pass, delete it from config.json",
                shown(v),
                arch.model_type()
            )));
        }

        let hidden_size = f.need("hidden_size")?;
        let num_heads = f.need("num_attention_heads")?;
        if num_heads == 0 || hidden_size == 0 {
            return Err(bad("zero hidden_size or num_attention_heads"));
        }
        // transformers' class defaults when the field is absent.
        let num_kv_heads = f.usize("num_key_value_heads")?.unwrap_or(match arch {
            Arch::Llama => num_heads,
            Arch::Qwen2 | Arch::Qwen3 => 32,
            Arch::Mistral => 8,
        });
        if num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
            return Err(bad(format!(
                "num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}"
            )));
        }
        let head_dim = f.usize("head_dim")?.unwrap_or(match arch {
            Arch::Qwen3 => 128,
            _ => hidden_size / num_heads,
        });
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(bad(format!(
                "head_dim is {head_dim}; rotary embeddings need an even, non-zero head size"
            )));
        }
        let act = f.str("hidden_act")?.unwrap_or("silu");
        if act != "silu" && act != "swish" {
            return Err(bad(format!(
                "`hidden_act` is {act:?}; the families kvmesh runs use silu (SwiGLU), and it \
                 implements no other activation"
            )));
        }
        let max_position_embeddings = f
            .usize("max_position_embeddings")?
            .unwrap_or_else(|| arch.default_max_position_embeddings());
        if max_position_embeddings == 0 {
            return Err(bad("`max_position_embeddings` is 0"));
        }
        let rope = read_rope(&f, max_position_embeddings)?;
        if matches!(rope.scaling, RopeScaling::Dynamic { .. }) && head_dim <= 2 {
            return Err(bad("dynamic RoPE needs head_dim above 2"));
        }

        let attention_bias = f.bool("attention_bias")?.unwrap_or(false);
        let mlp_bias = f.bool("mlp_bias")?.unwrap_or(false);
        let (qkv_bias, o_bias) = match arch {
            Arch::Llama | Arch::Qwen3 => (attention_bias, attention_bias),
            Arch::Qwen2 => (true, false),
            Arch::Mistral => (false, false),
        };

        let (sliding_window, sliding_layers) = read_window(&f, arch)?;
        let rms_norm_eps = f.f64("rms_norm_eps")?.unwrap_or(1e-6);
        if !(rms_norm_eps > 0.0 && rms_norm_eps.is_finite()) {
            return Err(bad(format!(
                "`rms_norm_eps` is {rms_norm_eps}; expected a small positive number"
            )));
        }
        let num_layers = f.need("num_hidden_layers")?;
        if let Some(l) = &sliding_layers {
            if l.len() != num_layers {
                return Err(bad(format!(
                    "`layer_types` lists {} layers but num_hidden_layers is {num_layers}",
                    l.len()
                )));
            }
        }
        Ok(ModelConfig {
            arch,
            vocab_size: f.need("vocab_size")?,
            hidden_size,
            intermediate_size: f.need("intermediate_size")?,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: rms_norm_eps as f32,
            rope,
            max_position_embeddings,
            tie_word_embeddings: f.bool("tie_word_embeddings")?.unwrap_or(false),
            qkv_bias,
            o_bias,
            mlp_bias,
            qk_norm: arch == Arch::Qwen3,
            sliding_window,
            sliding_layers,
            bos_token_id: f
                .get("bos_token_id")
                .and_then(|v| token_ids(v).first().copied()),
            eos_token_ids: f.get("eos_token_id").map(token_ids).unwrap_or_default(),
            declared_dtype: f.str("dtype")?.or(f.str("torch_dtype")?).map(String::from),
            ignored_fields,
        })
    }

    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// The attention window of layer `layer`, if it has one.
    pub fn layer_window(&self, layer: usize) -> Option<usize> {
        let w = self.sliding_window?;
        match &self.sliding_layers {
            None => Some(w),
            Some(l) => l.get(layer).copied().unwrap_or(false).then_some(w),
        }
    }

    /// The longest context the model serves. RoPE scaling that stretches positions extends
    /// it the way vLLM does: `linear` and `dynamic` multiply `max_position_embeddings` by the
    /// factor; `yarn` multiplies `original_max_position_embeddings` by it; `llama3` models
    /// already state the extended length. A sliding window does not shorten it: older
    /// positions are masked, not forgotten.
    pub fn max_context(&self) -> usize {
        let m = self.max_position_embeddings as f64;
        let n = match &self.rope.scaling {
            RopeScaling::Default | RopeScaling::Llama3 { .. } => m,
            RopeScaling::Linear { factor } | RopeScaling::Dynamic { factor } => m * factor,
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                ..
            } => original_max_position_embeddings * factor,
        };
        (n.floor() as usize).max(1)
    }

    /// Whether RoPE frequencies depend on the sequence length (dynamic NTK), so a token's
    /// rotation is not a function of its position alone.
    pub fn rope_depends_on_length(&self) -> bool {
        matches!(self.rope.scaling, RopeScaling::Dynamic { .. })
    }

    /// The factor on cos and sin (yarn's attention factor; 1 otherwise).
    pub fn rope_attention_factor(&self) -> f64 {
        match &self.rope.scaling {
            RopeScaling::Yarn {
                attention_factor, ..
            } => *attention_factor,
            _ => 1.0,
        }
    }

    /// What attention scores are multiplied by: 1/sqrt(head_dim), times the square of the
    /// RoPE attention factor (transformers multiplies both q's and k's cos/sin by it; applying
    /// it to the scores instead is the same product and leaves the cached K unscaled).
    pub fn attention_scale(&self) -> f32 {
        let a = self.rope_attention_factor();
        ((a * a) / (self.head_dim as f64).sqrt()) as f32
    }

    /// Number of parameters the weights hold (embeddings counted once when tied).
    pub fn num_params(&self) -> usize {
        let h = self.hidden_size;
        let per_layer = h * self.q_dim()
            + 2 * h * self.kv_dim()
            + self.q_dim() * h
            + 3 * h * self.intermediate_size
            + 2 * h
            + if self.qkv_bias {
                self.q_dim() + 2 * self.kv_dim()
            } else {
                0
            }
            + if self.o_bias { h } else { 0 }
            + if self.mlp_bias {
                2 * self.intermediate_size + h
            } else {
                0
            }
            + if self.qk_norm { 2 * self.head_dim } else { 0 };
        let emb = self.vocab_size * h;
        emb + if self.tie_word_embeddings { 0 } else { emb } + self.num_layers * per_layer + h
    }

    /// Every tensor name the weights must hold, and only these (a checkpoint with others is
    /// another variant of the model).
    pub fn expected_tensors(&self) -> Vec<String> {
        let mut v = vec![
            "model.embed_tokens.weight".to_string(),
            "model.norm.weight".into(),
        ];
        if !self.tie_word_embeddings {
            v.push("lm_head.weight".into());
        }
        for i in 0..self.num_layers {
            let p = format!("model.layers.{i}");
            v.push(format!("{p}.input_layernorm.weight"));
            v.push(format!("{p}.post_attention_layernorm.weight"));
            for n in ["q_proj", "k_proj", "v_proj", "o_proj"] {
                v.push(format!("{p}.self_attn.{n}.weight"));
            }
            if self.qkv_bias {
                for n in ["q_proj", "k_proj", "v_proj"] {
                    v.push(format!("{p}.self_attn.{n}.bias"));
                }
            }
            if self.o_bias {
                v.push(format!("{p}.self_attn.o_proj.bias"));
            }
            if self.qk_norm {
                v.push(format!("{p}.self_attn.q_norm.weight"));
                v.push(format!("{p}.self_attn.k_norm.weight"));
            }
            for n in ["gate_proj", "up_proj", "down_proj"] {
                v.push(format!("{p}.mlp.{n}.weight"));
                if self.mlp_bias {
                    v.push(format!("{p}.mlp.{n}.bias"));
                }
            }
        }
        v
    }

    /// The config as transformers 5 writes it (`rope_parameters`, `dtype`).
    pub fn to_hf_json(&self) -> Value {
        let mut v = serde_json::json!({
            "architectures": [self.arch.architecture_name()],
            "model_type": self.arch.model_type(),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            // Through the f32's shortest decimal form, so 1e-6 is written as 1e-6.
            "rms_norm_eps": self.rms_norm_eps.to_string().parse::<f64>().unwrap_or(1e-6),
            "rope_parameters": self.rope_parameters_json(),
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "dtype": "bfloat16",
        });
        let o = v.as_object_mut().expect("object");
        if let Some(b) = self.bos_token_id {
            o.insert("bos_token_id".into(), b.into());
        }
        match self.eos_token_ids.as_slice() {
            [] => {}
            [one] => {
                o.insert("eos_token_id".into(), (*one).into());
            }
            many => {
                o.insert("eos_token_id".into(), many.to_vec().into());
            }
        }
        match self.arch {
            Arch::Llama => {
                o.insert("attention_bias".into(), self.o_bias.into());
                o.insert("mlp_bias".into(), self.mlp_bias.into());
            }
            Arch::Mistral => {
                o.insert("sliding_window".into(), self.sliding_window.into());
            }
            Arch::Qwen2 | Arch::Qwen3 => {
                if self.arch == Arch::Qwen3 {
                    o.insert("attention_bias".into(), self.o_bias.into());
                }
                o.insert(
                    "use_sliding_window".into(),
                    self.sliding_window.is_some().into(),
                );
                o.insert("sliding_window".into(), self.sliding_window.into());
                let types: Vec<&str> = (0..self.num_layers)
                    .map(|i| {
                        if self.layer_window(i).is_some() {
                            "sliding_attention"
                        } else {
                            "full_attention"
                        }
                    })
                    .collect();
                o.insert("layer_types".into(), types.into());
            }
        }
        v
    }

    /// `rope_parameters` as transformers 5 writes it.
    pub fn rope_parameters_json(&self) -> Value {
        let mut p = serde_json::json!({
            "rope_theta": self.rope.theta,
            "rope_type": self.rope.scaling.type_name(),
        });
        let o = p.as_object_mut().expect("object");
        let mut put = |k: &str, x: Value| {
            o.insert(k.into(), x);
        };
        match &self.rope.scaling {
            RopeScaling::Default => {}
            RopeScaling::Linear { factor } | RopeScaling::Dynamic { factor } => {
                put("factor", (*factor).into())
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                put("factor", (*factor).into());
                put("low_freq_factor", (*low_freq_factor).into());
                put("high_freq_factor", (*high_freq_factor).into());
                put(
                    "original_max_position_embeddings",
                    (*original_max_position_embeddings as u64).into(),
                );
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                attention_factor,
                truncate,
            } => {
                put("factor", (*factor).into());
                put(
                    "original_max_position_embeddings",
                    (*original_max_position_embeddings as u64).into(),
                );
                put("beta_fast", (*beta_fast).into());
                put("beta_slow", (*beta_slow).into());
                put("attention_factor", (*attention_factor).into());
                put("truncate", (*truncate).into());
            }
        }
        p
    }

    /// Inverse frequencies for rotary embeddings at positions within
    /// `max_position_embeddings` (for every RoPE type but `dynamic`, at any position).
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        self.rope_inv_freq_for_len(0)
    }

    /// Inverse frequencies for a forward pass over a sequence `seq_len` tokens long: only
    /// `dynamic` RoPE looks at the length, as transformers' rotary embedding does when it
    /// recomputes its frequencies for the longest position in the pass.
    pub fn rope_inv_freq_for_len(&self, seq_len: usize) -> Vec<f32> {
        let d = self.head_dim;
        let theta = self.rope.theta;
        let plain = |base: f64| -> Vec<f64> {
            (0..d / 2)
                .map(|i| 1.0 / base.powf((2 * i) as f64 / d as f64))
                .collect()
        };
        let freqs: Vec<f64> = match &self.rope.scaling {
            RopeScaling::Default => plain(theta),
            RopeScaling::Linear { factor } => plain(theta).iter().map(|f| f / factor).collect(),
            RopeScaling::Dynamic { factor } => {
                let max = self.max_position_embeddings as f64;
                let len = (seq_len as f64).max(max);
                let base = theta
                    * ((factor * len / max) - (factor - 1.0)).powf(d as f64 / (d as f64 - 2.0));
                plain(base)
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old,
            } => {
                let low_wavelen = old / low_freq_factor;
                let high_wavelen = old / high_freq_factor;
                plain(theta)
                    .into_iter()
                    .map(|base| {
                        let wavelen = 2.0 * std::f64::consts::PI / base;
                        if wavelen < high_wavelen {
                            base
                        } else if wavelen > low_wavelen {
                            base / factor
                        } else {
                            let smooth = (old / wavelen - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * base / factor + smooth * base
                        }
                    })
                    .collect()
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: orig,
                beta_fast,
                beta_slow,
                truncate,
                ..
            } => {
                let dim = d as f64;
                // The dimension at which a frequency turns `rotations` times over the
                // original context.
                let correction_dim = |rotations: f64| {
                    dim * (orig / (rotations * 2.0 * std::f64::consts::PI)).ln()
                        / (2.0 * theta.ln())
                };
                let (mut low, mut high) = (correction_dim(*beta_fast), correction_dim(*beta_slow));
                if *truncate {
                    low = low.floor();
                    high = high.ceil();
                }
                let low = low.max(0.0);
                let mut high = high.min(dim - 1.0);
                if low == high {
                    high += 0.001;
                }
                plain(theta)
                    .into_iter()
                    .enumerate()
                    .map(|(i, extrapolated)| {
                        let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                        let keep = 1.0 - ramp;
                        let interpolated = extrapolated / factor;
                        interpolated * (1.0 - keep) + extrapolated * keep
                    })
                    .collect()
            }
        };
        freqs.into_iter().map(|f| f as f32).collect()
    }
}

/// Which layers attend through a window, and how wide it is.
fn read_window(f: &Fields, arch: Arch) -> Result<(Option<usize>, Option<Vec<bool>>)> {
    let window = |k: &str| -> Result<Option<usize>> {
        match f.usize(k)? {
            Some(0) => Err(bad(
                "`sliding_window` is 0; expected a window of at least 1 token",
            )),
            w => Ok(w),
        }
    };
    let layer_types = || -> Result<Option<Vec<bool>>> {
        let Some(v) = f.get("layer_types") else {
            return Ok(None);
        };
        let a = v
            .as_array()
            .ok_or_else(|| bad(format!("`layer_types` is {}; expected a list", shown(v))))?;
        a.iter()
            .enumerate()
            .map(|(i, t)| match t.as_str() {
                Some("full_attention") => Ok(false),
                Some("sliding_attention") => Ok(true),
                _ => Err(bad(format!(
                    "`layer_types[{i}]` is {}; kvmesh runs full_attention and sliding_attention layers",
                    shown(t)
                ))),
            })
            .collect::<Result<Vec<bool>>>()
            .map(Some)
    };
    match arch {
        Arch::Llama => {
            if let Some(v) = f.get("sliding_window") {
                return Err(bad(format!(
                    "`sliding_window` is {} on a llama model; Llama attends over the whole \
                     context (transformers' Llama ignores the field, so a window here means the \
                     checkpoint is something else)",
                    shown(v)
                )));
            }
            Ok((None, None))
        }
        Arch::Mistral => {
            if let Some(v) = f.get("layer_types") {
                return Err(bad(format!(
                    "`layer_types` is {} on a mistral model; transformers' Mistral applies one \
                     window to every layer and ignores per-layer types (those are Ministral's)",
                    shown(v)
                )));
            }
            // Absent means transformers' default window of 4096; null means none.
            let w = if f.obj.contains_key("sliding_window") {
                window("sliding_window")?
            } else {
                Some(4096)
            };
            Ok((w, None))
        }
        Arch::Qwen2 | Arch::Qwen3 => {
            let types = layer_types()?;
            let enabled = f.bool("use_sliding_window")?.unwrap_or(false);
            let size = if f.obj.contains_key("sliding_window") {
                window("sliding_window")?
            } else {
                Some(4096)
            };
            if !enabled {
                if let Some(t) = &types {
                    if let Some(i) = t.iter().position(|&s| s) {
                        return Err(bad(format!(
                            "`layer_types[{i}]` is sliding_attention but use_sliding_window is \
                             false; transformers would then find no window size"
                        )));
                    }
                }
                return Ok((None, None));
            }
            let Some(size) = size else {
                return Err(bad(
                    "use_sliding_window is true but `sliding_window` is null; name the window size",
                ));
            };
            let layers = match types {
                Some(t) => t,
                None => {
                    let first = f.usize("max_window_layers")?.unwrap_or(28);
                    let n = f.need("num_hidden_layers")?;
                    (0..n).map(|i| i >= first).collect()
                }
            };
            if layers.iter().any(|&s| s) {
                Ok((Some(size), Some(layers)))
            } else {
                Ok((None, None))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama(extra: &str) -> Result<ModelConfig> {
        ModelConfig::from_json(&format!(
            r#"{{"architectures":["LlamaForCausalLM"],"model_type":"llama","vocab_size":10,
               "hidden_size":128,"intermediate_size":8,"num_hidden_layers":2,
               "num_attention_heads":2,"max_position_embeddings":64{extra}}}"#
        ))
    }

    fn qwen2(extra: &str) -> Result<ModelConfig> {
        ModelConfig::from_json(&format!(
            r#"{{"architectures":["Qwen2ForCausalLM"],"vocab_size":100,"hidden_size":64,
               "intermediate_size":128,"num_hidden_layers":2,"num_attention_heads":4,
               "num_key_value_heads":2{extra}}}"#
        ))
    }

    fn err(r: Result<ModelConfig>) -> String {
        r.expect_err("expected a refusal").to_string()
    }

    #[test]
    fn parses_qwen2_with_defaults() {
        let c = qwen2(
            r#","tie_word_embeddings":true,"sliding_window":4096,"use_sliding_window":false,
               "eos_token_id":[5,6]"#,
        )
        .unwrap();
        assert_eq!(c.arch, Arch::Qwen2);
        assert!(c.qkv_bias && !c.o_bias && !c.qk_norm);
        assert_eq!(c.head_dim, 16);
        assert_eq!(c.sliding_window, None);
        assert_eq!(c.eos_token_ids, vec![5, 6]);
        assert_eq!(c.max_position_embeddings, 32_768);
        assert_eq!(c.rope.layout, RopeLayout::Absent);
        assert_eq!(c.rope.theta, 10_000.0);
    }

    #[test]
    fn unsupported_architecture_is_named() {
        let e = err(ModelConfig::from_json(
            r#"{"architectures":["GPT2LMHeadModel"],"model_type":"gpt2"}"#,
        ));
        assert!(e.contains("GPT2LMHeadModel"), "{e}");
    }

    #[test]
    fn model_type_and_architectures_must_agree() {
        let e = err(ModelConfig::from_json(
            r#"{"architectures":["LlamaForCausalLM"],"model_type":"qwen2","vocab_size":1,
               "hidden_size":8,"intermediate_size":8,"num_hidden_layers":1,"num_attention_heads":1}"#,
        ));
        assert!(e.contains("model_type") && e.contains("qwen2"), "{e}");
    }

    #[test]
    fn both_layouts_give_the_same_rope() {
        let cur = llama(
            r#","rope_parameters":{"rope_type":"llama3","rope_theta":500000.0,"factor":8.0,
               "low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":16}"#,
        )
        .unwrap();
        let old = llama(
            r#","rope_theta":500000.0,"rope_scaling":{"type":"llama3","factor":8.0,
               "low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":16}"#,
        )
        .unwrap();
        assert_eq!(cur.rope.layout, RopeLayout::Parameters);
        assert_eq!(old.rope.layout, RopeLayout::Legacy);
        assert_eq!(cur.rope.theta, 500000.0);
        assert_eq!(cur.rope.scaling, old.rope.scaling);
        assert_eq!(cur.rope_inv_freq(), old.rope_inv_freq());
        // The current layout is what gets written, and reads back the same.
        let back = ModelConfig::from_json(&cur.to_hf_json().to_string()).unwrap();
        assert_eq!(back.rope, cur.rope);
    }

    #[test]
    fn rope_parameters_theta_is_not_ignored() {
        // The bug this file once had: theta read only from the top level.
        let c =
            llama(r#","rope_parameters":{"rope_type":"default","rope_theta":1000000.0}"#).unwrap();
        assert_eq!(c.rope.theta, 1_000_000.0);
        assert_eq!(c.rope_inv_freq()[1], 1e6f64.powf(-2.0 / 64.0) as f32);
    }

    #[test]
    fn llama3_scaling_keeps_high_freqs_and_divides_low_ones() {
        let plain = llama(r#","rope_theta":500000.0"#).unwrap().rope_inv_freq();
        let scaled = llama(
            r#","rope_theta":500000.0,"rope_scaling":{"rope_type":"llama3","factor":32.0,
               "low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":8192}"#,
        )
        .unwrap()
        .rope_inv_freq();
        assert_eq!(plain[0], scaled[0]);
        let last = plain.len() - 1;
        assert!((plain[last] / 32.0 - scaled[last]).abs() < 1e-12);
    }

    #[test]
    fn linear_divides_every_frequency() {
        let plain = llama("").unwrap().rope_inv_freq();
        let lin = llama(r#","rope_scaling":{"type":"linear","factor":4.0}"#).unwrap();
        for (a, b) in plain.iter().zip(lin.rope_inv_freq()) {
            assert!((a / 4.0 - b).abs() <= 1e-7 * a);
        }
        assert_eq!(lin.max_context(), 256);
    }

    #[test]
    fn dynamic_is_plain_within_the_context_and_grows_the_base_past_it() {
        let c = llama(r#","rope_scaling":{"type":"dynamic","factor":2.0}"#).unwrap();
        let plain = llama("").unwrap().rope_inv_freq();
        assert_eq!(c.rope_inv_freq_for_len(64), plain);
        assert_eq!(c.rope_inv_freq_for_len(10), plain);
        let long = c.rope_inv_freq_for_len(100);
        // base' = 10000 * (2 * 100 / 64 - 1)^(64 / 62)
        let base = 10000f64 * (2.0f64 * 100.0 / 64.0 - 1.0).powf(64.0 / 62.0);
        let want = base.powf(-2.0 / 64.0);
        assert!(
            (long[1] as f64 - want).abs() < 1e-6 * want,
            "{} vs {want}",
            long[1]
        );
        assert!(long[1] < plain[1]);
        assert!(c.rope_depends_on_length());
        assert_eq!(c.max_context(), 128);
    }

    #[test]
    fn yarn_blends_frequencies_and_scales_attention() {
        let c = qwen2(
            r#","rope_parameters":{"rope_type":"yarn","rope_theta":10000.0,"factor":4.0,
               "original_max_position_embeddings":32}"#,
        )
        .unwrap();
        let plain = qwen2("").unwrap().rope_inv_freq();
        let y = c.rope_inv_freq();
        // The highest frequencies turn many times over 32 positions: kept.
        assert_eq!(y[0], plain[0]);
        // The lowest turns less than once: interpolated, divided by the factor.
        let last = y.len() - 1;
        assert!((y[last] - plain[last] / 4.0).abs() < 1e-9);
        let af = 0.1 * 4f64.ln() + 1.0;
        assert!((c.rope_attention_factor() - af).abs() < 1e-12);
        assert!((c.attention_scale() - ((af * af) / 4.0) as f32).abs() < 1e-7);
        assert_eq!(c.max_context(), 128);
        // mscale / mscale_all_dim (DeepSeek style) and an explicit attention_factor.
        let m = qwen2(
            r#","rope_scaling":{"type":"yarn","factor":4.0,"original_max_position_embeddings":32,
               "mscale":1.0,"mscale_all_dim":1.0}"#,
        )
        .unwrap();
        assert_eq!(m.rope_attention_factor(), 1.0);
        let e = qwen2(
            r#","rope_scaling":{"type":"yarn","factor":4.0,"original_max_position_embeddings":32,
               "attention_factor":1.5}"#,
        )
        .unwrap();
        assert_eq!(e.rope_attention_factor(), 1.5);
    }

    #[test]
    fn unknown_rope_type_is_refused_by_name() {
        let e = err(llama(
            r#","rope_scaling":{"rope_type":"longrope","factor":2.0}"#,
        ));
        assert!(e.contains("longrope") && e.contains("yarn"), "{e}");
        let e = err(llama(
            r#","rope_parameters":{"rope_type":"su","rope_theta":1e4}"#,
        ));
        assert!(e.contains("\"su\""), "{e}");
    }

    #[test]
    fn rope_parameter_of_another_type_is_refused() {
        let e = err(llama(
            r#","rope_scaling":{"type":"linear","factor":2.0,"beta_fast":8}"#,
        ));
        assert!(
            e.contains("rope_scaling.beta_fast") && e.contains("linear"),
            "{e}"
        );
    }

    #[test]
    fn missing_required_rope_parameter_is_refused() {
        let e = err(llama(r#","rope_scaling":{"type":"linear"}"#));
        assert!(e.contains("factor"), "{e}");
        let e = err(llama(
            r#","rope_scaling":{"rope_type":"llama3","factor":8.0}"#,
        ));
        assert!(e.contains("low_freq_factor"), "{e}");
    }

    #[test]
    fn contradictory_rope_settings_are_refused() {
        let e = err(llama(
            r#","rope_theta":10000.0,"rope_parameters":{"rope_type":"default","rope_theta":500000.0}"#,
        ));
        assert!(e.contains("rope_theta") && e.contains("500000"), "{e}");
        let e = err(llama(
            r#","rope_parameters":{"rope_type":"default","rope_theta":1e4},"rope_scaling":{"type":"linear","factor":2.0}"#,
        ));
        assert!(
            e.contains("rope_parameters") && e.contains("rope_scaling"),
            "{e}"
        );
        let e = err(llama(
            r#","rope_scaling":{"type":"linear","rope_type":"dynamic","factor":2.0}"#,
        ));
        assert!(e.contains("linear") && e.contains("dynamic"), "{e}");
    }

    #[test]
    fn partial_rotary_factor_is_refused() {
        let e = err(llama(r#","partial_rotary_factor":0.5"#));
        assert!(
            e.contains("partial_rotary_factor") && e.contains("0.5"),
            "{e}"
        );
        llama(r#","partial_rotary_factor":1.0"#).unwrap();
    }

    #[test]
    fn other_activations_are_refused() {
        let e = err(llama(r#","hidden_act":"gelu_pytorch_tanh""#));
        assert!(
            e.contains("hidden_act") && e.contains("gelu_pytorch_tanh"),
            "{e}"
        );
        llama(r#","hidden_act":"swish""#).unwrap();
    }

    #[test]
    fn quantized_checkpoints_are_refused() {
        let e = err(llama(
            r#","quantization_config":{"quant_method":"awq","bits":4}"#,
        ));
        assert!(e.contains("quantized") && e.contains("awq"), "{e}");
        llama(r#","quantization_config":null"#).unwrap();
    }

    #[test]
    fn sliding_window_on_llama_is_refused() {
        let e = err(llama(r#","sliding_window":4096"#));
        assert!(
            e.contains("sliding_window") && e.contains("4096") && e.contains("llama"),
            "{e}"
        );
        assert_eq!(
            llama(r#","sliding_window":null"#).unwrap().sliding_window,
            None
        );
    }

    #[test]
    fn unknown_fields_are_refused_and_harmless_ones_skipped() {
        let e = err(llama(r#","final_logit_softcapping":30.0"#));
        assert!(
            e.contains("final_logit_softcapping") && e.contains("30.0"),
            "{e}"
        );
        let e = err(llama(r#","embedding_multiplier":12"#));
        assert!(e.contains("embedding_multiplier"), "{e}");
        let c = llama(
            r#","_name_or_path":"x","unsloth_version":"1","use_cache":true,"dtype":"float32",
               "initializer_range":0.02,"attn_logit_softcapping":null"#,
        )
        .unwrap();
        assert!(c.ignored_fields.contains(&"use_cache".to_string()));
        assert_eq!(c.declared_dtype.as_deref(), Some("float32"));
        // A field another family reads is foreign here.
        let e = err(llama(r#","use_sliding_window":true"#));
        assert!(e.contains("use_sliding_window"), "{e}");
    }

    #[test]
    fn biases_follow_the_family() {
        let c = llama(r#","attention_bias":true,"mlp_bias":true"#).unwrap();
        assert!(c.qkv_bias && c.o_bias && c.mlp_bias);
        let names = c.expected_tensors();
        assert!(names.contains(&"model.layers.1.self_attn.o_proj.bias".to_string()));
        assert!(names.contains(&"model.layers.0.mlp.down_proj.bias".to_string()));
        let q = qwen2(r#","attention_bias":false"#).unwrap();
        assert!(q.qkv_bias && !q.o_bias);
    }

    #[test]
    fn mistral_window_defaults_like_transformers() {
        let base = r#"{"architectures":["MistralForCausalLM"],"vocab_size":10,"hidden_size":64,
               "intermediate_size":8,"num_hidden_layers":2,"num_attention_heads":4,
               "num_key_value_heads":2"#;
        let absent = ModelConfig::from_json(&format!("{base}}}")).unwrap();
        assert_eq!(absent.sliding_window, Some(4096));
        assert_eq!(absent.max_context(), 131_072);
        let none = ModelConfig::from_json(&format!(r#"{base},"sliding_window":null}}"#)).unwrap();
        assert_eq!(none.sliding_window, None);
        let w = ModelConfig::from_json(&format!(r#"{base},"sliding_window":8}}"#)).unwrap();
        assert_eq!((w.layer_window(0), w.layer_window(1)), (Some(8), Some(8)));
        let e = err(ModelConfig::from_json(&format!(
            r#"{base},"layer_types":["full_attention","sliding_attention"]}}"#
        )));
        assert!(e.contains("layer_types") && e.contains("Ministral"), "{e}");
    }

    #[test]
    fn qwen_windows_per_layer() {
        let c = qwen2(r#","use_sliding_window":true,"sliding_window":8,"max_window_layers":1"#)
            .unwrap();
        assert_eq!((c.layer_window(0), c.layer_window(1)), (None, Some(8)));
        let c = qwen2(
            r#","use_sliding_window":true,"sliding_window":8,
               "layer_types":["sliding_attention","full_attention"]"#,
        )
        .unwrap();
        assert_eq!((c.layer_window(0), c.layer_window(1)), (Some(8), None));
        let e = err(qwen2(
            r#","use_sliding_window":false,"layer_types":["sliding_attention","full_attention"]"#,
        ));
        assert!(e.contains("layer_types[0]"), "{e}");
        let e = err(qwen2(r#","use_sliding_window":true,"sliding_window":null"#));
        assert!(e.contains("sliding_window"), "{e}");
        let e = err(qwen2(
            r#","layer_types":["full_attention","chunked_attention"]"#,
        ));
        assert!(e.contains("chunked_attention"), "{e}");
    }

    #[test]
    fn qwen3_head_dim_defaults_to_128() {
        let c = ModelConfig::from_json(
            r#"{"model_type":"qwen3","vocab_size":10,"hidden_size":64,"intermediate_size":8,
               "num_hidden_layers":1,"num_attention_heads":4,"num_key_value_heads":2}"#,
        )
        .unwrap();
        assert_eq!(c.head_dim, 128);
    }

    #[test]
    fn type_errors_name_the_field() {
        let e = err(llama(r#","rms_norm_eps":"small""#));
        assert!(e.contains("rms_norm_eps"), "{e}");
        let e = err(llama(r#","rope_scaling":{"type":"linear","factor":"2"}"#));
        assert!(e.contains("rope_scaling.factor"), "{e}");
    }
}
