//! A model's shape, read from the Hugging Face `config.json` it ships with.
//!
//! Each family spells a few things its own way (Qwen2's q/k/v biases, Qwen3's per-head q/k
//! norms, Llama-3's RoPE scaling); `ModelConfig` is the one normalised view the backends use.

use serde::Deserialize;
use serde_json::Value;

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
}

/// Llama-3 style frequency-dependent RoPE scaling.
#[derive(Clone, Debug, PartialEq)]
pub struct Llama3RopeScaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: f64,
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
    pub rope_theta: f64,
    pub rope_scaling: Option<Llama3RopeScaling>,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Bias on the q, k and v projections (Qwen2, or `attention_bias` in Llama configs).
    pub qkv_bias: bool,
    /// RMSNorm over each head of q and k before RoPE (Qwen3).
    pub qk_norm: bool,
    /// Mistral's sliding window; kvmesh caps the context at it rather than masking.
    pub sliding_window: Option<usize>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

#[derive(Deserialize)]
struct RawConfig {
    architectures: Option<Vec<String>>,
    model_type: Option<String>,
    vocab_size: Option<usize>,
    hidden_size: Option<usize>,
    intermediate_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_scaling: Option<Value>,
    max_position_embeddings: Option<usize>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    sliding_window: Option<Value>,
    use_sliding_window: Option<bool>,
    bos_token_id: Option<Value>,
    eos_token_id: Option<Value>,
}

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

impl ModelConfig {
    pub fn from_json(text: &str) -> Result<ModelConfig> {
        let raw: RawConfig = serde_json::from_str(text)
            .map_err(|e| EngineError::BadModel(format!("config.json: {e}")))?;
        let arch = raw
            .architectures
            .as_ref()
            .and_then(|a| a.iter().find_map(|n| Arch::from_architecture(n)))
            .or_else(|| raw.model_type.as_deref().and_then(Arch::from_model_type))
            .ok_or_else(|| {
                EngineError::BadModel(format!(
                    "unsupported architecture {:?} (model_type {:?}); kvmesh runs LlamaForCausalLM, \
                     Qwen2ForCausalLM, Qwen3ForCausalLM and MistralForCausalLM",
                    raw.architectures.clone().unwrap_or_default(),
                    raw.model_type.clone().unwrap_or_default()
                ))
            })?;
        let need = |v: Option<usize>, name: &str| {
            v.ok_or_else(|| EngineError::BadModel(format!("config.json: missing `{name}`")))
        };
        let hidden_size = need(raw.hidden_size, "hidden_size")?;
        let num_heads = need(raw.num_attention_heads, "num_attention_heads")?;
        if num_heads == 0 || hidden_size == 0 {
            return Err(EngineError::BadModel(
                "config.json: zero hidden_size or heads".into(),
            ));
        }
        let num_kv_heads = raw.num_key_value_heads.unwrap_or(num_heads);
        if num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
            return Err(EngineError::BadModel(format!(
                "config.json: num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}"
            )));
        }
        let rope_scaling = match &raw.rope_scaling {
            None | Some(Value::Null) => None,
            Some(v) => {
                let kind = v
                    .get("rope_type")
                    .or_else(|| v.get("type"))
                    .and_then(Value::as_str)
                    .unwrap_or("");
                let f = |k: &str, d: f64| v.get(k).and_then(Value::as_f64).unwrap_or(d);
                match kind {
                    "llama3" => Some(Llama3RopeScaling {
                        factor: f("factor", 8.0),
                        low_freq_factor: f("low_freq_factor", 1.0),
                        high_freq_factor: f("high_freq_factor", 4.0),
                        original_max_position_embeddings: f(
                            "original_max_position_embeddings",
                            8192.0,
                        ),
                    }),
                    "default" => None,
                    other => {
                        return Err(EngineError::BadModel(format!(
                            "config.json: rope_scaling type `{other}` is not supported (llama3 is)"
                        )))
                    }
                }
            }
        };
        let sliding_window = match (arch, raw.use_sliding_window) {
            // Qwen2/3 configs carry a window but only use it when asked to.
            (Arch::Qwen2 | Arch::Qwen3, Some(false) | None) => None,
            _ => raw
                .sliding_window
                .as_ref()
                .and_then(Value::as_u64)
                .map(|w| w as usize),
        };
        Ok(ModelConfig {
            arch,
            vocab_size: need(raw.vocab_size, "vocab_size")?,
            hidden_size,
            intermediate_size: need(raw.intermediate_size, "intermediate_size")?,
            num_layers: need(raw.num_hidden_layers, "num_hidden_layers")?,
            num_heads,
            num_kv_heads,
            head_dim: raw.head_dim.unwrap_or(hidden_size / num_heads),
            rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-6) as f32,
            rope_theta: raw.rope_theta.unwrap_or(10000.0),
            rope_scaling,
            max_position_embeddings: raw.max_position_embeddings.unwrap_or(4096),
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            qkv_bias: arch == Arch::Qwen2 || raw.attention_bias.unwrap_or(false),
            qk_norm: arch == Arch::Qwen3,
            sliding_window,
            bos_token_id: raw
                .bos_token_id
                .as_ref()
                .and_then(|v| token_ids(v).first().copied()),
            eos_token_ids: raw.eos_token_id.as_ref().map(token_ids).unwrap_or_default(),
        })
    }

    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// The longest context the model can attend over.
    pub fn max_context(&self) -> usize {
        match self.sliding_window {
            Some(w) => w.min(self.max_position_embeddings),
            None => self.max_position_embeddings,
        }
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
            + if self.qk_norm { 2 * self.head_dim } else { 0 };
        let emb = self.vocab_size * h;
        emb + if self.tie_word_embeddings { 0 } else { emb } + self.num_layers * per_layer + h
    }

    /// The config as Hugging Face writes it.
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
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": "bfloat16",
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
                o.insert("attention_bias".into(), self.qkv_bias.into());
                o.insert("mlp_bias".into(), false.into());
            }
            Arch::Mistral => {
                o.insert("sliding_window".into(), self.sliding_window.into());
            }
            Arch::Qwen2 | Arch::Qwen3 => {
                o.insert("use_sliding_window".into(), false.into());
                o.insert("attention_bias".into(), self.qkv_bias.into());
            }
        }
        if let Some(s) = &self.rope_scaling {
            o.insert(
                "rope_scaling".into(),
                serde_json::json!({
                    "rope_type": "llama3",
                    "factor": s.factor,
                    "low_freq_factor": s.low_freq_factor,
                    "high_freq_factor": s.high_freq_factor,
                    "original_max_position_embeddings": s.original_max_position_embeddings as u64,
                }),
            );
        }
        v
    }

    /// Inverse frequencies for rotary embeddings, with Llama-3 scaling applied if configured.
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        let d = self.head_dim;
        (0..d / 2)
            .map(|i| {
                let base = 1.0 / self.rope_theta.powf((2 * i) as f64 / d as f64);
                let f = match &self.rope_scaling {
                    None => base,
                    Some(s) => {
                        let low_wavelen = s.original_max_position_embeddings / s.low_freq_factor;
                        let high_wavelen = s.original_max_position_embeddings / s.high_freq_factor;
                        let wavelen = 2.0 * std::f64::consts::PI / base;
                        if wavelen < high_wavelen {
                            base
                        } else if wavelen > low_wavelen {
                            base / s.factor
                        } else {
                            let smooth = (s.original_max_position_embeddings / wavelen
                                - s.low_freq_factor)
                                / (s.high_freq_factor - s.low_freq_factor);
                            (1.0 - smooth) * base / s.factor + smooth * base
                        }
                    }
                };
                f as f32
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_qwen2_with_defaults() {
        let c = ModelConfig::from_json(
            r#"{"architectures":["Qwen2ForCausalLM"],"vocab_size":100,"hidden_size":64,
               "intermediate_size":128,"num_hidden_layers":2,"num_attention_heads":4,
               "num_key_value_heads":2,"tie_word_embeddings":true,"sliding_window":4096,
               "use_sliding_window":false,"eos_token_id":[5,6]}"#,
        )
        .unwrap();
        assert_eq!(c.arch, Arch::Qwen2);
        assert!(c.qkv_bias && !c.qk_norm);
        assert_eq!(c.head_dim, 16);
        assert_eq!(c.sliding_window, None);
        assert_eq!(c.eos_token_ids, vec![5, 6]);
    }

    #[test]
    fn unsupported_architecture_is_named() {
        let e =
            ModelConfig::from_json(r#"{"architectures":["GPT2LMHeadModel"],"model_type":"gpt2"}"#)
                .unwrap_err()
                .to_string();
        assert!(e.contains("GPT2LMHeadModel"), "{e}");
    }

    #[test]
    fn llama3_scaling_keeps_high_freqs_and_divides_low_ones() {
        let mut c = ModelConfig::from_json(
            r#"{"architectures":["LlamaForCausalLM"],"vocab_size":10,"hidden_size":128,
               "intermediate_size":8,"num_hidden_layers":1,"num_attention_heads":1,
               "rope_theta":500000.0}"#,
        )
        .unwrap();
        let plain = c.rope_inv_freq();
        c.rope_scaling = Some(Llama3RopeScaling {
            factor: 32.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192.0,
        });
        let scaled = c.rope_inv_freq();
        assert_eq!(plain[0], scaled[0]);
        let last = plain.len() - 1;
        assert!((plain[last] / 32.0 - scaled[last]).abs() < 1e-12);
    }
}
