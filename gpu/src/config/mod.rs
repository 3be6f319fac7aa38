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
//!
//! Where each part lives: the family and its defaults in `arch`; typed reads of top-level
//! fields in `reader`; which fields are read, skipped or refused in `fields`; RoPE in `rope`
//! (a typed pass over the dict, then the refusals); sliding windows in `window`; the order of
//! it all in `model` (and `parse`, which picks the reader by family); writing a config back
//! in `hf_json`; Qwen3.5's hybrid text model in `hybrid` (what it adds to the dense shape)
//! and `qwen35` (its two layouts read into that); FP8 checkpoints' `quantization_config` in
//! `quant` (what a quantization is), `quant_read` (the block-scaled `fp8` format) and
//! `quant_ct` (compressed-tensors). Every refusal is a [`ConfigError`] (`error`), one
//! variant per rule.

mod arch;
pub mod error;
mod fields;
mod hf_json;
mod hybrid;
mod model;
mod parse;
mod quant;
mod quant_ct;
mod quant_read;
#[cfg(test)]
mod quant_tests;
mod qwen35;
mod reader;
mod rope;
#[cfg(test)]
mod testing;
mod window;

pub use arch::Arch;
pub use error::{ConfigError, PatternError};
pub use fields::IGNORED_FIELDS;
pub use hybrid::{HybridConfig, HybridLayout, LayerType};
pub use model::{ModelConfig, TensorRole, TensorSpec};
pub use quant::{ActivationScheme, QuantMethod, Quantization, Scheme, WeightScale, FP8_BLOCK};
pub(crate) use reader::token_ids;
pub use rope::{Rope, RopeLayout, RopeScaling};

/// A refusal of the file, as the engine reports it (`model: config.json: ...`). Written out
/// rather than `#[from]` so that the error is not also the engine error's source: its text
/// is already the message, and a chain (anyhow's `{:?}`) would print it twice.
impl From<ConfigError> for crate::error::EngineError {
    fn from(e: ConfigError) -> Self {
        crate::error::EngineError::Config(e)
    }
}
