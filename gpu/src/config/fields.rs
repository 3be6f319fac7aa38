//! Which top-level fields of `config.json` kvmesh reads, which it skips because they do not
//! change the forward pass, and the refusal of everything else that is set.

use serde_json::{Map, Value};

use super::arch::Arch;
use super::error::{ConfigError, Result};
use super::reader::shown;

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

/// Every field present is applied, known to be harmless, or refused. Returns the fields
/// skipped, in the file's order.
pub(super) fn screen(obj: &Map<String, Value>, arch: Arch) -> Result<Vec<String>> {
    let mut ignored_fields = Vec::new();
    for (k, v) in obj {
        let key = k.as_str();
        if key == "quantization_config" {
            // Read by `quant` once the shape is known (`ModelConfig::with_quantization`).
            continue;
        }
        if MUST_BE_OFF.contains(&key) {
            if is_off(v) {
                continue;
            }
            return Err(must_be_off(key, v));
        }
        if COMMON_FIELDS.contains(&key) || arch.own_fields().contains(&key) {
            continue;
        }
        if IGNORED_FIELDS.contains(&key)
            || arch.skipped_fields().contains(&key)
            || key.starts_with('_')
            || key.ends_with("_version")
            || is_off(v)
        {
            ignored_fields.push(k.clone());
            continue;
        }
        return Err(ConfigError::UnknownField {
            field: key.to_string(),
            value: shown(v),
            model_type: arch.model_type(),
        });
    }
    Ok(ignored_fields)
}

/// The refusal of a `MUST_BE_OFF` field that is on, saying what kind of model it makes.
fn must_be_off(key: &str, v: &Value) -> ConfigError {
    match key {
        "quantization_config" | "compression_config" => ConfigError::QuantizedModel {
            method: v.get("quant_method").or_else(|| v.get("format")).map(shown),
            value: shown(v),
        },
        _ => ConfigError::NotDecoderOnly {
            field: key.to_string(),
            value: shown(v),
        },
    }
}

#[cfg(test)]
mod tests {
    use crate::config::testing::{err, llama};

    #[test]
    fn quantized_checkpoints_of_other_methods_are_refused() {
        let e = err(llama(
            r#","quantization_config":{"quant_method":"awq","bits":4}"#,
        ));
        assert!(e.contains("quant_method") && e.contains("awq"), "{e}");
        let e = err(llama(
            r#","compression_config":{"format":"pack-quantized"}"#,
        ));
        assert!(
            e.contains("quantized") && e.contains("pack-quantized"),
            "{e}"
        );
        assert!(llama(r#","quantization_config":null"#)
            .unwrap()
            .quantization
            .is_none());
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
}
