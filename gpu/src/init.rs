//! Checkpoints with random weights, in the Hugging Face layout, at tiny test shapes or at the
//! shapes of real models, so tests and benchmarks need no downloads.

use std::path::Path;

use crate::config::{Arch, ModelConfig, Rope, RopeScaling, TensorRole};
use crate::error::{EngineError, Result};
use crate::safetensors::{write_file, DType};
use crate::sampler::Rng;
use crate::tokenizer::{TextTokenizer, TokenizerFiles};

/// Preset names `model init-random --preset` takes.
pub const PRESETS: &[&str] = &["tiny", "qwen2.5-0.5b", "llama-3.2-1b", "qwen3-0.6b"];

fn base(arch: Arch) -> ModelConfig {
    ModelConfig {
        arch,
        vocab_size: 0,
        hidden_size: 64,
        intermediate_size: 128,
        num_layers: 2,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 16,
        rms_norm_eps: 1e-6,
        rope: Rope::plain(10_000.0),
        max_position_embeddings: 512,
        tie_word_embeddings: false,
        qkv_bias: arch == Arch::Qwen2,
        o_bias: false,
        mlp_bias: false,
        qk_norm: arch == Arch::Qwen3,
        sliding_window: None,
        sliding_layers: None,
        bos_token_id: None,
        eos_token_ids: Vec::new(),
        declared_dtype: None,
        ignored_fields: Vec::new(),
    }
}

/// The shape of a preset; `vocab_size` 0 means "the tokenizer's size".
pub fn preset(arch: Option<Arch>, name: &str) -> Result<ModelConfig> {
    let real_arch = match name {
        "qwen2.5-0.5b" => Some(Arch::Qwen2),
        "llama-3.2-1b" => Some(Arch::Llama),
        "qwen3-0.6b" => Some(Arch::Qwen3),
        "tiny" => None,
        other => {
            return Err(EngineError::InvalidRequest(format!(
                "unknown preset `{other}`; presets: {}",
                PRESETS.join(", ")
            )))
        }
    };
    if let (Some(a), Some(r)) = (arch, real_arch) {
        if a != r {
            return Err(EngineError::InvalidRequest(format!(
                "preset `{name}` is a {} model, not {}",
                r.model_type(),
                a.model_type()
            )));
        }
    }
    let arch = real_arch.or(arch).unwrap_or(Arch::Llama);
    let mut c = base(arch);
    match name {
        "qwen2.5-0.5b" => {
            c.vocab_size = 151_936;
            c.hidden_size = 896;
            c.intermediate_size = 4864;
            c.num_layers = 24;
            c.num_heads = 14;
            c.num_kv_heads = 2;
            c.head_dim = 64;
            c.rope = Rope::plain(1_000_000.0);
            c.max_position_embeddings = 32_768;
            c.tie_word_embeddings = true;
        }
        "llama-3.2-1b" => {
            c.vocab_size = 128_256;
            c.hidden_size = 2048;
            c.intermediate_size = 8192;
            c.num_layers = 16;
            c.num_heads = 32;
            c.num_kv_heads = 8;
            c.head_dim = 64;
            c.rms_norm_eps = 1e-5;
            c.rope = Rope {
                scaling: RopeScaling::Llama3 {
                    factor: 32.0,
                    low_freq_factor: 1.0,
                    high_freq_factor: 4.0,
                    original_max_position_embeddings: 8192.0,
                },
                ..Rope::plain(500_000.0)
            };
            c.max_position_embeddings = 131_072;
            c.tie_word_embeddings = true;
        }
        "qwen3-0.6b" => {
            c.vocab_size = 151_936;
            c.hidden_size = 1024;
            c.intermediate_size = 3072;
            c.num_layers = 28;
            c.num_heads = 16;
            c.num_kv_heads = 8;
            c.head_dim = 128;
            c.rope = Rope::plain(1_000_000.0);
            c.max_position_embeddings = 40_960;
            c.tie_word_embeddings = true;
        }
        _ => match arch {
            // Small shapes that still exercise what makes each family different.
            Arch::Llama => {
                c.rope.scaling = RopeScaling::Llama3 {
                    factor: 4.0,
                    low_freq_factor: 1.0,
                    high_freq_factor: 4.0,
                    original_max_position_embeddings: 64.0,
                };
            }
            Arch::Qwen2 => c.tie_word_embeddings = true,
            Arch::Qwen3 => {
                c.head_dim = 32;
                c.tie_word_embeddings = true;
            }
            Arch::Mistral => c.sliding_window = Some(4096),
        },
    }
    Ok(c)
}

/// Writes a checkpoint with `cfg`'s shape and random weights. The tokenizer files are
/// copied in; a vocabulary smaller than the tokenizer's is grown to fit it.
pub fn write_random_checkpoint(
    mut cfg: ModelConfig,
    seed: u64,
    dtype: DType,
    tokenizer: &TokenizerFiles,
    out: &Path,
) -> Result<ModelConfig> {
    let tok = TextTokenizer::from_files(tokenizer, &[])?;
    cfg.vocab_size = cfg.vocab_size.max(tok.vocab_size());
    cfg.bos_token_id = tok.bos_id();
    cfg.eos_token_ids = tok.eos_ids().to_vec();
    std::fs::create_dir_all(out)
        .map_err(|e| EngineError::io(format!("create {}", out.display()), e))?;

    write_file(
        &out.join("model.safetensors"),
        &random_tensors(&cfg, seed),
        dtype,
    )?;

    write_side_files(&cfg, dtype, tokenizer, out)?;
    Ok(cfg)
}

/// Random weights for every tensor of `cfg`, drawn in the checkpoint's order from `seed`:
/// embeddings of unit variance, projections scaled by their fan-in, norms near one, small
/// biases, a final norm of ones.
fn random_tensors(cfg: &ModelConfig, seed: u64) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let mut rng = Rng::seeded(seed);
    let mut normal =
        |n: usize, std: f64| -> Vec<f32> { (0..n).map(|_| (rng.normal() * std) as f32).collect() };
    let dense = |fan_in: usize| 1.0 / (fan_in as f64).sqrt();
    cfg.tensors()
        .into_iter()
        .map(|t| {
            let n: usize = t.shape.iter().product();
            let values = match t.role {
                TensorRole::Embedding => normal(n, 1.0),
                TensorRole::Norm => normal(n, 0.1).into_iter().map(|e| 1.0 + e).collect(),
                TensorRole::Dense => normal(n, dense(t.shape[1])),
                TensorRole::Bias => normal(n, 0.1),
                TensorRole::FinalNorm => vec![1.0; n],
                TensorRole::Head => normal(n, 4.0 * dense(t.shape[1])),
            };
            (t.name, t.shape, values)
        })
        .collect()
}

/// The files beside the weights: config (declaring `dtype`), tokenizer, chat template and
/// generation config.
fn write_side_files(
    cfg: &ModelConfig,
    dtype: DType,
    tokenizer: &TokenizerFiles,
    out: &Path,
) -> Result<()> {
    let mut config = cfg.to_hf_json();
    config["dtype"] = match dtype {
        DType::F32 => "float32",
        DType::F16 => "float16",
        DType::BF16 => "bfloat16",
    }
    .into();
    let write = |name: &str, bytes: &[u8]| {
        let p = out.join(name);
        std::fs::write(&p, bytes).map_err(|e| EngineError::io(format!("write {}", p.display()), e))
    };
    write(
        "config.json",
        serde_json::to_string_pretty(&config)
            .expect("json")
            .as_bytes(),
    )?;
    write("tokenizer.json", &tokenizer.tokenizer_json)?;
    if let Some(tc) = &tokenizer.tokenizer_config {
        write("tokenizer_config.json", tc.as_bytes())?;
    }
    if let Some(ct) = &tokenizer.chat_template_jinja {
        write("chat_template.jinja", ct.as_bytes())?;
    }
    let gen = serde_json::json!({
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_ids,
        "max_length": cfg.max_position_embeddings,
    });
    write(
        "generation_config.json",
        serde_json::to_string_pretty(&gen).expect("json").as_bytes(),
    )?;
    Ok(())
}
