//! The default model, compiled in so that `kvmesh serve` needs no download: a small Llama
//! trained on Shakespeare by `scripts/train_default_model.py`. It sits in the engine crate so
//! that the binary, the bench programs and the tests reach the same bytes by one path; only a
//! program that names [`DEFAULT_MODEL`] carries them.

use crate::model::EmbeddedModel;
use crate::tokenizer::TokenizerFiles;

pub const DEFAULT_MODEL: EmbeddedModel = EmbeddedModel {
    name: "shakespeare",
    config_json: include_str!("../../models/shakespeare/config.json"),
    #[cfg(not(feature = "external-default-model"))]
    safetensors: include_bytes!("../../models/shakespeare/model.safetensors"),
    #[cfg(feature = "external-default-model")]
    safetensors: &[],
    tokenizer_json: include_bytes!("../../models/shakespeare/tokenizer.json"),
    tokenizer_config: Some(include_str!(
        "../../models/shakespeare/tokenizer_config.json"
    )),
    chat_template: Some(include_str!("../../models/shakespeare/chat_template.jinja")),
    generation_config: Some(include_str!(
        "../../models/shakespeare/generation_config.json"
    )),
};

/// The default model's tokenizer, given to checkpoints made with random weights.
pub fn default_tokenizer() -> TokenizerFiles {
    TokenizerFiles {
        tokenizer_json: DEFAULT_MODEL.tokenizer_json.to_vec(),
        tokenizer_config: DEFAULT_MODEL.tokenizer_config.map(String::from),
        chat_template_jinja: DEFAULT_MODEL.chat_template.map(String::from),
        generation_config: DEFAULT_MODEL.generation_config.map(String::from),
    }
}
