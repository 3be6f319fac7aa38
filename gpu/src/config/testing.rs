//! Small configs the tests of every part of `config` start from.

use super::ModelConfig;
use crate::error::Result;

/// A two-layer llama with `extra` appended to its fields (`extra` starts with a comma).
pub(super) fn llama(extra: &str) -> Result<ModelConfig> {
    ModelConfig::from_json(&format!(
        r#"{{"architectures":["LlamaForCausalLM"],"model_type":"llama","vocab_size":10,
           "hidden_size":128,"intermediate_size":8,"num_hidden_layers":2,
           "num_attention_heads":2,"max_position_embeddings":64{extra}}}"#
    ))
}

/// A two-layer qwen2 with `extra` appended to its fields (`extra` starts with a comma).
pub(super) fn qwen2(extra: &str) -> Result<ModelConfig> {
    ModelConfig::from_json(&format!(
        r#"{{"architectures":["Qwen2ForCausalLM"],"vocab_size":100,"hidden_size":64,
           "intermediate_size":128,"num_hidden_layers":2,"num_attention_heads":4,
           "num_key_value_heads":2{extra}}}"#
    ))
}

/// The refusal's message.
pub(super) fn err(r: Result<ModelConfig>) -> String {
    r.expect_err("expected a refusal").to_string()
}
