//! The model family a config names, and what each family reads and assumes by default.

use serde_json::Value;

use super::error::{ConfigError, Result};
use super::reader::{shown, Fields};

/// The model families kvmesh runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
    Qwen3,
    Mistral,
    /// Qwen3.5's text model: Gated DeltaNet layers between gated full-attention layers
    /// (see `config::hybrid`).
    Qwen35,
}

impl Arch {
    pub fn from_architecture(name: &str) -> Option<Arch> {
        match name {
            "LlamaForCausalLM" => Some(Arch::Llama),
            "Qwen2ForCausalLM" => Some(Arch::Qwen2),
            "Qwen3ForCausalLM" => Some(Arch::Qwen3),
            "MistralForCausalLM" => Some(Arch::Mistral),
            "Qwen3_5ForCausalLM" | "Qwen3_5ForConditionalGeneration" => Some(Arch::Qwen35),
            _ => None,
        }
    }

    pub fn from_model_type(name: &str) -> Option<Arch> {
        match name {
            "llama" => Some(Arch::Llama),
            "qwen2" => Some(Arch::Qwen2),
            "qwen3" => Some(Arch::Qwen3),
            "mistral" => Some(Arch::Mistral),
            "qwen3_5_text" | "qwen3_5" => Some(Arch::Qwen35),
            _ => None,
        }
    }

    pub fn architecture_name(self) -> &'static str {
        match self {
            Arch::Llama => "LlamaForCausalLM",
            Arch::Qwen2 => "Qwen2ForCausalLM",
            Arch::Qwen3 => "Qwen3ForCausalLM",
            Arch::Mistral => "MistralForCausalLM",
            Arch::Qwen35 => "Qwen3_5ForCausalLM",
        }
    }

    pub fn model_type(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Mistral => "mistral",
            Arch::Qwen35 => "qwen3_5_text",
        }
    }

    /// `max_position_embeddings` when the file has none (transformers' class default).
    pub(super) fn default_max_position_embeddings(self) -> usize {
        match self {
            Arch::Llama => 2048,
            Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen35 => 32_768,
            Arch::Mistral => 131_072,
        }
    }

    /// `num_key_value_heads` when the file has none (transformers' class default).
    pub(super) fn default_num_kv_heads(self, num_heads: usize) -> usize {
        match self {
            Arch::Llama => num_heads,
            Arch::Qwen2 | Arch::Qwen3 => 32,
            Arch::Mistral => 8,
            Arch::Qwen35 => 4,
        }
    }

    /// `head_dim` when the file has none (transformers' class default).
    pub(super) fn default_head_dim(self, hidden_size: usize, num_heads: usize) -> usize {
        match self {
            Arch::Qwen3 => 128,
            Arch::Qwen35 => 256,
            _ => hidden_size / num_heads,
        }
    }

    /// Biases on (q/k/v, o) projections, given the file's `attention_bias`.
    pub(super) fn attention_biases(self, attention_bias: bool) -> (bool, bool) {
        match self {
            Arch::Llama | Arch::Qwen3 | Arch::Qwen35 => (attention_bias, attention_bias),
            Arch::Qwen2 => (true, false),
            Arch::Mistral => (false, false),
        }
    }

    /// The config fields this family reads, besides the shape and RoPE fields all share.
    pub(super) fn own_fields(self) -> &'static [&'static str] {
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
            Arch::Qwen35 => super::hybrid::OWN_FIELDS,
        }
    }

    /// Fields this family knows and skips: they do not change the forward pass.
    pub(super) fn skipped_fields(self) -> &'static [&'static str] {
        match self {
            Arch::Qwen35 => super::hybrid::SKIPPED_FIELDS,
            _ => &[],
        }
    }
}

/// The family: `model_type` is what transformers' `AutoModelForCausalLM` dispatches on;
/// `architectures` names the class that saved the file. Both must agree when both are given.
pub(super) fn read_arch(f: &Fields) -> Result<Arch> {
    let model_type = f.str("model_type")?;
    let archs = architectures(f)?;
    if let Some(t) = model_type.filter(|t| t.starts_with("qwen3_5_moe")) {
        return Err(ConfigError::MoeRefused {
            what: format!("model_type {t:?}"),
        });
    }
    if let Some(a) = archs.iter().find(|a| a.starts_with("Qwen3_5Moe")) {
        return Err(ConfigError::MoeRefused { what: a.clone() });
    }
    let from_archs =
        match archs.as_slice() {
            [] => None,
            [one] => Some(Arch::from_architecture(one).ok_or_else(|| {
                ConfigError::UnknownArchitecture {
                    architecture: one.clone(),
                    model_type: model_type.unwrap_or("").to_string(),
                }
            })?),
            many => {
                return Err(ConfigError::SeveralArchitectures {
                    names: many.to_vec(),
                })
            }
        };
    let from_type = match model_type {
        None => None,
        Some(t) => Some(
            Arch::from_model_type(t).ok_or_else(|| ConfigError::UnknownModelType {
                model_type: t.to_string(),
                architectures: archs.clone(),
            })?,
        ),
    };
    match (from_archs, from_type) {
        (Some(a), Some(t)) if a != t => Err(ConfigError::FamilyMismatch {
            architecture: a.architecture_name(),
            model_type: t.model_type(),
        }),
        (Some(a), _) | (None, Some(a)) => Ok(a),
        (None, None) => Err(ConfigError::NoFamily),
    }
}

/// The class names in `architectures` (none when it is absent).
fn architectures(f: &Fields) -> Result<Vec<String>> {
    match f.get("architectures") {
        None => Ok(Vec::new()),
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| {
                x.as_str()
                    .map(String::from)
                    .ok_or_else(|| ConfigError::ArchitectureNotAName { value: shown(x) })
            })
            .collect(),
        Some(v) => Err(ConfigError::Mistyped {
            field: "architectures".into(),
            value: shown(v),
            expected: "a list of class names",
        }),
    }
}

#[cfg(test)]
mod tests {
    use crate::config::testing::{err, llama, qwen2};
    use crate::config::ModelConfig;

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
    fn qwen3_head_dim_defaults_to_128() {
        let c = ModelConfig::from_json(
            r#"{"model_type":"qwen3","vocab_size":10,"hidden_size":64,"intermediate_size":8,
               "num_hidden_layers":1,"num_attention_heads":4,"num_key_value_heads":2}"#,
        )
        .unwrap();
        assert_eq!(c.head_dim, 128);
    }
}
