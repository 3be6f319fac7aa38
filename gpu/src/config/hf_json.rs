//! Writing a config back out the way transformers 5 writes it, for checkpoints kvmesh saves
//! and for `model inspect`.

use serde_json::{Map, Value};

use super::arch::Arch;
use super::hybrid::HybridLayout;
use super::model::ModelConfig;
use super::rope::RopeScaling;

impl ModelConfig {
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
        self.put_family_fields(o);
        if let Some(q) = &self.quantization {
            // As read: the weights beside this config are still the FP8 ones.
            o.insert("quantization_config".into(), q.json.clone());
        }
        match &self.hybrid {
            Some(hy) if hy.layout == HybridLayout::ConditionalGeneration => {
                // The wrapper's layout: the text model's fields nested, the head's tie at the
                // top (the vision tower is not written: kvmesh has none to describe).
                let tie = o.remove("tie_word_embeddings").unwrap_or(false.into());
                serde_json::json!({
                    "architectures": [hy.layout.architecture_name()],
                    "model_type": "qwen3_5",
                    "text_config": v,
                    "tie_word_embeddings": tie,
                })
            }
            _ => v,
        }
    }

    /// The fields only some families read: biases and windows.
    fn put_family_fields(&self, o: &mut Map<String, Value>) {
        match self.arch {
            Arch::Llama => {
                o.insert("attention_bias".into(), self.o_bias.into());
                o.insert("mlp_bias".into(), self.mlp_bias.into());
            }
            Arch::Mistral => {
                o.insert("sliding_window".into(), self.sliding_window.into());
            }
            Arch::Qwen35 => {
                let Some(hy) = &self.hybrid else { return };
                o.insert("attention_bias".into(), self.o_bias.into());
                let types: Vec<&str> = hy.layer_types.iter().map(|t| t.name()).collect();
                o.insert("layer_types".into(), types.into());
                for (k, x) in [
                    ("linear_num_key_heads", hy.linear_num_key_heads),
                    ("linear_num_value_heads", hy.linear_num_value_heads),
                    ("linear_key_head_dim", hy.linear_key_head_dim),
                    ("linear_value_head_dim", hy.linear_value_head_dim),
                    ("linear_conv_kernel_dim", hy.linear_conv_kernel_dim),
                ] {
                    o.insert(k.into(), x.into());
                }
                if let Some(Value::Object(r)) = o.get_mut("rope_parameters") {
                    let partial = hy.rotary_dim as f64 / self.head_dim as f64;
                    r.insert("partial_rotary_factor".into(), partial.into());
                }
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
}
