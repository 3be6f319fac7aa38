//! transformers' reference fixtures (`tests/fixtures/reference/*.json`, written by the
//! scripts under `scripts/`) as the parity tests read them: the file, the prompts of the
//! dense and FP8 formats, and the checksum that ties a fixture to its checkpoint.

use std::path::PathBuf;

use serde::de::DeserializeOwned;
use serde::Deserialize;

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A model folder under `tests/fixtures/models`.
pub fn model_dir(name: &str) -> PathBuf {
    repo().join("tests/fixtures/models").join(name)
}

/// The reference fixture `name`, which must be in format `format` (else `script` is to be
/// rerun); the path is named in every failure.
pub fn read<T: DeserializeOwned>(name: &str, format: u32, script: &str) -> T {
    #[derive(Deserialize)]
    struct Head {
        format: u32,
    }
    let path = repo()
        .join("tests/fixtures/reference")
        .join(format!("{name}.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let head: Head =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(head.format, format, "{}: rerun {script}", path.display());
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A prompt of the dense and FP8 fixtures.
#[derive(Deserialize)]
pub struct Prompt {
    pub name: String,
    pub ids: Vec<u32>,
    pub last_logits: Vec<f32>,
    pub argmax: Vec<u32>,
    pub argmax_top2_gap: Vec<f32>,
    pub greedy: Vec<u32>,
    pub steps: Steps,
}

/// The teacher-forced sequence, position by position.
#[derive(Deserialize)]
pub struct Steps {
    pub argmax: Vec<u32>,
    pub gap: Vec<f32>,
    pub lse: Vec<f32>,
    pub top_ids: Vec<Vec<usize>>,
    pub top_logits: Vec<Vec<f32>>,
    pub columns: Vec<Vec<f32>>,
}

/// FNV-1a (64-bit) of a file's bytes, as the fixture scripts record it.
pub fn fnv1a64(bytes: &[u8]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// The weights of the linear layers `model`'s `quantization_config` quantizes, sorted: what an
/// FP8 fixture records as stored in FP8 (`quantized_weights`).
pub fn quantized_weights(model: &kvmesh_gpu::model::LoadedModel) -> Vec<String> {
    let q = model.config.quantization.as_ref().expect("quantized");
    let mut v: Vec<String> = model
        .config
        .linear_layers()
        .into_iter()
        .filter(|(m, _, _)| q.scheme_of(m).is_some())
        .map(|(m, _, _)| format!("{m}.weight"))
        .collect();
    v.sort();
    v
}
