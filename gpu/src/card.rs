//! A model card: what a gateway needs to serve a model whose files it does not have. A
//! worker makes it from the model it loaded; a gateway fetches it from one of that model's
//! workers, checks it against the fingerprint the workers publish, and tokenizes, templates
//! and applies generation defaults with what it carries.
//!
//! The check is a recomputation: the card carries the model's config, the tokenizer's files
//! and the weights' digest, from which [`crate::model::fingerprint_of`] gives the fingerprint
//! back. A card whose files were changed, or that belongs to another model, does not.

use serde::{Deserialize, Serialize};

use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::model::{fingerprint_of, LoadedModel, Numerics};
use crate::tokenizer::{TextTokenizer, TokenizerFiles};

/// The card's format; a card of another format is refused, naming both.
pub const CARD_FORMAT: u32 = 1;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelCard {
    pub format: u32,
    /// The name the model is served under.
    pub name: String,
    pub fingerprint: String,
    /// The weights' digest as served ([`LoadedModel::served_digest`]: it says whether the
    /// tokens are the model's or the sim backend's), a part of the fingerprint.
    pub weights_digest: String,
    /// Hugging Face architecture, e.g. `LlamaForCausalLM`.
    pub architecture: String,
    /// The longest context the worker that made the card accepts.
    pub max_model_len: usize,
    pub block_size: usize,
    /// The worker's KV layout, when it transfers KV (prefill and decode roles).
    pub kv_layout: Option<String>,
    pub eos_token_ids: Vec<u32>,
    /// `config.json`, as read.
    pub config_json: String,
    /// `tokenizer.json`, as read.
    pub tokenizer_json: String,
    pub tokenizer_config: Option<String>,
    pub chat_template: Option<String>,
    pub generation_config: Option<String>,
}

/// What a gateway serves a model with: built from a checked card.
pub struct CardModel {
    pub card: ModelCard,
    pub config: ModelConfig,
    pub tokenizer: TextTokenizer,
}

impl ModelCard {
    /// The card of `model` as a worker serves it under `name`, computing with `numerics`.
    pub fn of(
        model: &LoadedModel,
        numerics: Numerics,
        name: &str,
        max_model_len: usize,
        block_size: usize,
        kv_layout: Option<String>,
    ) -> Result<ModelCard> {
        let tokenizer_json = String::from_utf8(model.files.tokenizer_json.clone())
            .map_err(|_| EngineError::BadModel("tokenizer.json is not UTF-8".into()))?;
        Ok(ModelCard {
            format: CARD_FORMAT,
            name: name.to_string(),
            fingerprint: model.fingerprint(numerics),
            weights_digest: model.served_digest(numerics),
            architecture: model.config.architecture_name().to_string(),
            max_model_len,
            block_size,
            kv_layout,
            eos_token_ids: model.tokenizer.eos_ids().to_vec(),
            config_json: model.config_json.clone(),
            tokenizer_json,
            tokenizer_config: model.files.tokenizer_config.clone(),
            chat_template: model.files.chat_template_jinja.clone(),
            generation_config: model.files.generation_config.clone(),
        })
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a model card serializes")
    }

    /// Reads a card's bytes; a card of another format, or with fields this version does not
    /// know, is refused with the reason.
    pub fn from_bytes(bytes: &[u8]) -> Result<ModelCard> {
        #[derive(Deserialize)]
        struct Format {
            format: u32,
        }
        let f: Format = serde_json::from_slice(bytes)
            .map_err(|e| EngineError::BadModel(format!("unreadable model card: {e}")))?;
        if f.format != CARD_FORMAT {
            return Err(EngineError::BadModel(format!(
                "model card format {} is not the one this kvmesh reads ({CARD_FORMAT})",
                f.format
            )));
        }
        serde_json::from_slice(bytes)
            .map_err(|e| EngineError::BadModel(format!("unreadable model card: {e}")))
    }

    fn tokenizer_files(&self) -> TokenizerFiles {
        TokenizerFiles {
            tokenizer_json: self.tokenizer_json.clone().into_bytes(),
            tokenizer_config: self.tokenizer_config.clone(),
            chat_template_jinja: self.chat_template.clone(),
            generation_config: self.generation_config.clone(),
        }
    }

    /// Builds the config and tokenizer from the card's files, and checks that they give back
    /// `expected` (the fingerprint the model's workers publish) and the card's own.
    pub fn load(self, expected: &str) -> Result<CardModel> {
        let name = self.name.clone();
        let refuse = |why: String| {
            EngineError::BadModel(format!("the model card of '{name}' is refused: {why}"))
        };
        if self.fingerprint != expected {
            return Err(refuse(format!(
                "it is of fingerprint {}, the model's workers publish {expected}",
                self.fingerprint
            )));
        }
        let config = ModelConfig::from_json(&self.config_json)
            .map_err(|e| refuse(format!("its config.json: {e}")))?;
        let files = self.tokenizer_files();
        let tokenizer = TextTokenizer::from_files(&files, &config.eos_token_ids)
            .map_err(|e| refuse(format!("its tokenizer: {e}")))?;
        let computed = fingerprint_of(&config, &tokenizer, &files, &self.weights_digest);
        if computed != self.fingerprint {
            return Err(refuse(format!(
                "its files give fingerprint {computed}, not the {} it names",
                self.fingerprint
            )));
        }
        if tokenizer.eos_ids() != self.eos_token_ids {
            return Err(refuse(format!(
                "its files end sequences with {:?}, not the {:?} it names",
                tokenizer.eos_ids(),
                self.eos_token_ids
            )));
        }
        Ok(CardModel {
            card: self,
            config,
            tokenizer,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn embedded() -> LoadedModel {
        LoadedModel::from_embedded(&crate::embedded::DEFAULT_MODEL).unwrap()
    }

    #[test]
    fn a_card_round_trips_and_gives_back_the_fingerprint_and_tokenizer() {
        let m = embedded();
        let card = ModelCard::of(&m, Numerics::Model, "shakespeare", 512, 16, None).unwrap();
        let back = ModelCard::from_bytes(&card.to_bytes()).unwrap();
        assert_eq!(back, card);
        let loaded = back.load(&m.fingerprint(Numerics::Model)).unwrap();
        let text = "To be, or not to be";
        assert_eq!(
            loaded.tokenizer.encode(text, false).unwrap(),
            m.tokenizer.encode(text, false).unwrap()
        );
        assert_eq!(loaded.config.max_context(), m.config.max_context());
    }

    #[test]
    fn a_changed_or_foreign_card_is_refused_naming_why() {
        let m = embedded();
        let card = ModelCard::of(&m, Numerics::Model, "shakespeare", 512, 16, None).unwrap();
        let fp = m.fingerprint(Numerics::Model);
        // Another model's fingerprint.
        let err = card
            .clone()
            .load("0123456789abcdef")
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("0123456789abcdef") && err.contains("shakespeare"),
            "{err}"
        );
        // A chat template edited on the way.
        let mut edited = card.clone();
        edited.chat_template = Some("{{ messages[0]['content'] }}".into());
        let err = edited.load(&fp).err().unwrap().to_string();
        assert!(err.contains("its files give fingerprint"), "{err}");
        // One token of the vocabulary changed.
        let mut edited = card.clone();
        edited.tokenizer_json = edited.tokenizer_json.replacen("\"the\"", "\"thE\"", 1);
        assert_ne!(edited.tokenizer_json, card.tokenizer_json);
        assert!(edited.load(&fp).is_err());
        // Another weights digest.
        let mut edited = card.clone();
        edited.weights_digest = "ffffffffffffffff".into();
        assert!(edited.load(&fp).is_err());
    }

    #[test]
    fn the_sim_backend_serves_another_fingerprint_and_its_card_says_so() {
        let m = embedded();
        let real = m.fingerprint(Numerics::Model);
        let sim = m.fingerprint(Numerics::Simulated);
        assert_ne!(real, sim);
        assert!(sim.chars().all(|c| c.is_ascii_hexdigit()) && sim.len() == real.len());
        let card = ModelCard::of(&m, Numerics::Simulated, "shakespeare", 512, 16, None).unwrap();
        assert!(
            card.weights_digest.starts_with("sim-"),
            "{}",
            card.weights_digest
        );
        // A gateway pinned to the model's own numbers refuses it.
        let err = card.clone().load(&real).err().unwrap().to_string();
        assert!(err.contains(&sim) && err.contains(&real), "{err}");
        // Its own fingerprint loads it; a card passing sim off as the model does not.
        assert!(card.clone().load(&sim).is_ok());
        let mut forged = card;
        forged.weights_digest = m.weights_digest();
        let err = forged.load(&sim).err().unwrap().to_string();
        assert!(err.contains("its files give fingerprint"), "{err}");
    }

    #[test]
    fn a_card_of_another_format_or_with_unknown_fields_is_refused() {
        let m = embedded();
        let card = ModelCard::of(&m, Numerics::Model, "shakespeare", 512, 16, None).unwrap();
        let mut v: serde_json::Value = serde_json::from_slice(&card.to_bytes()).unwrap();
        v["format"] = 2.into();
        let err = ModelCard::from_bytes(v.to_string().as_bytes())
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("format 2"), "{err}");
        v["format"] = 1.into();
        v["lora_adapters"] = serde_json::json!([]);
        let err = ModelCard::from_bytes(v.to_string().as_bytes())
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("lora_adapters"), "{err}");
    }
}
