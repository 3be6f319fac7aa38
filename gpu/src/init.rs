//! Checkpoints with random weights, in the Hugging Face layout, at tiny test shapes or at the
//! shapes of real models, so tests and benchmarks need no downloads.

use std::path::Path;

use rayon::prelude::*;

use crate::config::{Arch, ModelConfig, Rope, RopeScaling, TensorRole, TensorSpec, FP8_BLOCK};
use crate::error::{EngineError, Result};
use crate::safetensors::{
    f32_to_e4m3, write_chunks, write_file_streamed, write_parts, DType, WeightStore, STREAM_CHUNK,
};
use crate::sampler::Rng;
use crate::tokenizer::{TextTokenizer, TokenizerFiles};

/// Preset names `model init-random --preset` takes.
pub const PRESETS: &[&str] = &[
    "tiny",
    "qwen2.5-0.5b",
    "llama-3.2-1b",
    "qwen3-0.6b",
    "qwen3-8b",
    "llama-3.1-8b",
    "qwen3-32b",
    "qwen2.5-72b",
    "qwen3.5-9b",
];

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
        hybrid: None,
        quantization: None,
    }
}

/// The shape of a preset; `vocab_size` 0 means "the tokenizer's size".
pub fn preset(arch: Option<Arch>, name: &str) -> Result<ModelConfig> {
    let real_arch = match name {
        "qwen2.5-0.5b" | "qwen2.5-72b" => Some(Arch::Qwen2),
        "llama-3.2-1b" => Some(Arch::Llama),
        "qwen3-0.6b" | "qwen3-8b" | "qwen3-32b" => Some(Arch::Qwen3),
        "llama-3.1-8b" => Some(Arch::Llama),
        "qwen3.5-9b" => Some(Arch::Qwen35),
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
    if name == "qwen3.5-9b" {
        return ModelConfig::from_json(QWEN35_9B);
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
        // The published configs (Qwen/Qwen3-8B, meta-llama/Llama-3.1-8B).
        "qwen3-8b" => {
            c.vocab_size = 151_936;
            c.hidden_size = 4096;
            c.intermediate_size = 12_288;
            c.num_layers = 36;
            c.num_heads = 32;
            c.num_kv_heads = 8;
            c.head_dim = 128;
            c.rope = Rope::plain(1_000_000.0);
            c.max_position_embeddings = 40_960;
        }
        "qwen3-32b" | "qwen2.5-72b" => fp8_table_shape(name, &mut c),
        "llama-3.1-8b" => {
            c.vocab_size = 128_256;
            c.hidden_size = 4096;
            c.intermediate_size = 14_336;
            c.num_layers = 32;
            c.num_heads = 32;
            c.num_kv_heads = 8;
            c.head_dim = 128;
            c.rms_norm_eps = 1e-5;
            c.rope = Rope {
                scaling: RopeScaling::Llama3 {
                    factor: 8.0,
                    low_freq_factor: 1.0,
                    high_freq_factor: 4.0,
                    original_max_position_embeddings: 8192.0,
                },
                ..Rope::plain(500_000.0)
            };
            c.max_position_embeddings = 131_072;
        }
        _ => tiny_shape(arch, &mut c)?,
    }
    Ok(c)
}

/// Qwen3.5-9B's text model as a `config.json` in the `Qwen3_5ForCausalLM` form, read by the
/// same reader as a user's file. The figures are those of the public descriptions of
/// Qwen/Qwen3.5-9B (model cards of its derivatives, its GGUF metadata): 32 layers, three
/// Gated DeltaNet layers to each gated full-attention one, hidden 4,096, MLP 12,288, 16
/// query and 4 KV heads of 256, RoPE on a quarter of each head at θ = 10⁷, 16 key and 32
/// value heads of 128 in the linear layers, convolution kernel 4, a 248,320-token
/// vocabulary, untied head. Their sum, 8.95B parameters, is what the GGUF metadata gives.
const QWEN35_9B: &str = r#"{
  "architectures": ["Qwen3_5ForCausalLM"],
  "model_type": "qwen3_5_text",
  "vocab_size": 248320,
  "hidden_size": 4096,
  "intermediate_size": 12288,
  "num_hidden_layers": 32,
  "num_attention_heads": 16,
  "num_key_value_heads": 4,
  "head_dim": 256,
  "full_attention_interval": 4,
  "linear_num_key_heads": 16,
  "linear_num_value_heads": 32,
  "linear_key_head_dim": 128,
  "linear_value_head_dim": 128,
  "linear_conv_kernel_dim": 4,
  "hidden_act": "silu",
  "attention_bias": false,
  "rms_norm_eps": 1e-6,
  "max_position_embeddings": 262144,
  "rope_parameters": {
    "rope_type": "default",
    "rope_theta": 10000000.0,
    "partial_rotary_factor": 0.25,
    "mrope_section": [11, 11, 10],
    "mrope_interleaved": true
  },
  "tie_word_embeddings": false,
  "dtype": "bfloat16"
}"#;

/// The published configs of Qwen/Qwen3-32B and Qwen/Qwen2.5-72B(-Instruct): the shapes the
/// FP8 tables are about.
fn fp8_table_shape(name: &str, c: &mut ModelConfig) {
    match name {
        "qwen3-32b" => {
            c.vocab_size = 151_936;
            c.hidden_size = 5120;
            c.intermediate_size = 25_600;
            c.num_layers = 64;
            c.num_heads = 64;
            c.num_kv_heads = 8;
            c.head_dim = 128;
            c.rope = Rope::plain(1_000_000.0);
            c.max_position_embeddings = 40_960;
        }
        "qwen2.5-72b" => {
            c.vocab_size = 152_064;
            c.hidden_size = 8192;
            c.intermediate_size = 29_568;
            c.num_layers = 80;
            c.num_heads = 64;
            c.num_kv_heads = 8;
            c.head_dim = 128;
            c.rope = Rope::plain(1_000_000.0);
            c.max_position_embeddings = 32_768;
        }
        _ => unreachable!("not an FP8-table preset: {name}"),
    }
}

/// The tiny preset's shape of `arch`: small, but with what makes each family different.
fn tiny_shape(arch: Arch, c: &mut ModelConfig) -> Result<()> {
    match arch {
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
        Arch::Qwen35 => return Err(EngineError::InvalidRequest("no Qwen3.5 preset yet".into())),
    }
    Ok(())
}

/// Writes a checkpoint with `cfg`'s shape and random weights. The tokenizer files are
/// copied in; a vocabulary smaller than the tokenizer's is grown to fit it.
pub fn write_random_checkpoint(
    cfg: ModelConfig,
    seed: u64,
    dtype: DType,
    tokenizer: &TokenizerFiles,
    out: &Path,
) -> Result<ModelConfig> {
    let (cfg, live) = prepare(cfg, tokenizer, out)?;
    let specs = cfg.tensors();
    let names: Vec<(String, Vec<usize>)> = specs
        .iter()
        .map(|t| (t.name.clone(), t.shape.clone()))
        .collect();
    write_file_streamed(
        &out.join("model.safetensors"),
        &names,
        dtype,
        &|ti, start, vals| {
            random_values(&specs[ti], seed, ti, start, vals);
            live.silence_padding(&specs[ti], start, vals);
        },
    )?;

    write_side_files(&cfg, dtype, None, tokenizer, out)?;
    Ok(cfg)
}

/// [`prepare_config`], the folder made.
fn prepare(
    cfg: ModelConfig,
    tokenizer: &TokenizerFiles,
    out: &Path,
) -> Result<(ModelConfig, Live)> {
    std::fs::create_dir_all(out)
        .map_err(|e| EngineError::io(format!("create {}", out.display()), e))?;
    prepare_config(cfg, tokenizer)
}

/// The config with the tokenizer's vocabulary and special ids, and which head rows stay
/// silent.
fn prepare_config(mut cfg: ModelConfig, tokenizer: &TokenizerFiles) -> Result<(ModelConfig, Live)> {
    let tok = TextTokenizer::from_files(tokenizer, &[])?;
    cfg.vocab_size = cfg.vocab_size.max(tok.vocab_size());
    cfg.bos_token_id = tok.bos_id();
    cfg.eos_token_ids = tok.eos_ids().to_vec();
    let live = Live {
        vocab: tok.vocab_size(),
        tied: cfg.tie_word_embeddings,
    };
    Ok((cfg, live))
}

/// Like [`write_random_checkpoint`], as the FP8 checkpoints Qwen publishes are laid out
/// (`quant_method: fp8`, `fmt: e4m3`, dynamic activations, `weight_block_size: [128, 128]`):
/// every linear layer of the decoder is quantized from the values the bf16 checkpoint of the
/// same seed draws, as e4m3 with one f32 `weight_scale_inv` per 128 x 128 block (the block's
/// largest magnitude over 448); embeddings, norms, biases and the output head stay bf16.
pub fn write_random_fp8_checkpoint(
    cfg: ModelConfig,
    seed: u64,
    tokenizer: &TokenizerFiles,
    out: &Path,
) -> Result<ModelConfig> {
    let (cfg, live) = prepare(cfg, tokenizer, out)?;
    let path = out.join("model.safetensors");
    let io = |e| EngineError::io(format!("write {}", path.display()), e);
    let mut file = std::io::BufWriter::new(std::fs::File::create(&path).map_err(io)?);
    write_fp8_tensors(&cfg, seed, &live, &mut file, &path.display().to_string())?;
    std::io::Write::flush(&mut file).map_err(io)?;
    write_side_files(
        &cfg,
        DType::BF16,
        Some(fp8_quantization(&cfg)),
        tokenizer,
        out,
    )?;
    // The config as it reads back, its quantization included.
    let path = out.join("config.json");
    let text = std::fs::read_to_string(&path)
        .map_err(|e| EngineError::io(format!("read {}", path.display()), e))?;
    ModelConfig::from_json(&text)
}

/// [`write_random_fp8_checkpoint`]'s config and weights made in memory instead of a folder,
/// for a checkpoint larger than the disk it would be written to (Qwen2.5-72B's 73 GB on a
/// machine with 64 GB of disk and 128 GB of memory). The buffer is sized once: no growth
/// doubles it on the way.
pub fn random_fp8_in_memory(
    cfg: ModelConfig,
    seed: u64,
    tokenizer: &TokenizerFiles,
) -> Result<(ModelConfig, WeightStore)> {
    let (cfg, live) = prepare_config(cfg, tokenizer)?;
    let data: usize = fp8_layout(&cfg)?
        .0
        .iter()
        .map(|(_, shape, dtype)| shape.iter().product::<usize>() * dtype.size())
        .sum();
    let mut bytes = Vec::with_capacity(data + (4 << 20));
    write_fp8_tensors(&cfg, seed, &live, &mut bytes, "a checkpoint in memory")?;
    let mut json = cfg.to_hf_json();
    json["quantization_config"] = fp8_quantization(&cfg);
    let cfg = ModelConfig::from_json(&json.to_string())?;
    Ok((cfg, WeightStore::from_vec("model.safetensors", bytes)?))
}

/// `quantization_config` as Qwen's FP8 checkpoints give it; a Qwen3.5 model's Gated
/// DeltaNet gate inputs (`in_proj_a`, `in_proj_b`: one row per value head) stay bf16, as the
/// published Qwen3.5 FP8 recipes leave them.
fn fp8_quantization(cfg: &ModelConfig) -> serde_json::Value {
    let mut q = serde_json::json!({
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
    });
    if cfg.hybrid.is_some() {
        q["modules_to_not_convert"] = serde_json::json!(HYBRID_FP8_SKIP);
    }
    q
}

/// The modules a Qwen3.5 FP8 checkpoint made here leaves bf16 (besides the head).
const HYBRID_FP8_SKIP: [&str; 3] = ["lm_head", "in_proj_a", "in_proj_b"];

/// Whether tensor `t` is a linear layer's weight that an FP8 checkpoint of `cfg` stores in
/// FP8 (`fp8_quantization` says which): two-dimensional (a Gated DeltaNet's convolution is
/// not a linear layer) and not left bf16.
fn stored_fp8(cfg: &ModelConfig, t: &crate::config::TensorSpec) -> bool {
    let module = t.name.strip_suffix(".weight").unwrap_or(&t.name);
    t.role == TensorRole::Dense
        && t.shape.len() == 2
        && !(cfg.hybrid.is_some() && HYBRID_FP8_SKIP.iter().any(|m| module.ends_with(m)))
}

/// What each entry of an FP8 file is made from: a tensor as bf16, a quantized tensor, or the
/// scales of the quantized tensor before it.
enum Part {
    Plain(usize),
    Fp8(usize),
    Scales,
}

type Layout = (Vec<(String, Vec<usize>, DType)>, Vec<Part>);

/// The entries of an FP8 file for `cfg` (name, shape, dtype) and what makes each.
fn fp8_layout(cfg: &ModelConfig) -> Result<Layout> {
    let mut list = Vec::new();
    let mut parts = Vec::new();
    for (ti, t) in cfg.tensors().iter().enumerate() {
        if !stored_fp8(cfg, t) {
            list.push((t.name.clone(), t.shape.clone(), DType::BF16));
            parts.push(Part::Plain(ti));
            continue;
        }
        let module = t.name.strip_suffix(".weight").ok_or_else(|| {
            EngineError::InvalidRequest(format!("`{}` is not a linear layer's weight", t.name))
        })?;
        let (rows, cols) = (t.shape[0], t.shape[1]);
        list.push((t.name.clone(), t.shape.clone(), DType::F8E4M3));
        parts.push(Part::Fp8(ti));
        list.push((
            format!("{module}.weight_scale_inv"),
            vec![rows.div_ceil(FP8_BLOCK), cols.div_ceil(FP8_BLOCK)],
            DType::F32,
        ));
        parts.push(Part::Scales);
    }
    Ok((list, parts))
}

/// The safetensors bytes of an FP8 checkpoint of `cfg` into `out` (`what` names it).
fn write_fp8_tensors(
    cfg: &ModelConfig,
    seed: u64,
    live: &Live,
    out: &mut dyn std::io::Write,
    what: &str,
) -> Result<()> {
    let specs = cfg.tensors();
    let (list, parts) = fp8_layout(cfg)?;
    let fill = |ti: usize, start: usize, vals: &mut [f32]| {
        random_values(&specs[ti], seed, ti, start, vals);
        live.silence_padding(&specs[ti], start, vals);
    };
    let mut scales: Vec<f32> = Vec::new();
    write_parts(out, what, &list, &mut |i, w| {
        let io = |e| EngineError::io(format!("write {what}"), e);
        match parts[i] {
            Part::Plain(ti) => write_chunks(&list[i].1, DType::BF16, &|s, v| fill(ti, s, v), w),
            Part::Fp8(ti) => {
                let shape = &specs[ti].shape;
                let mut vals = vec![0f32; shape[0] * shape[1]];
                vals.par_chunks_mut(STREAM_CHUNK)
                    .enumerate()
                    .for_each(|(c, v)| fill(ti, c * STREAM_CHUNK, v));
                let (q, s) = quantize_fp8_blocks(&vals, shape[0], shape[1]);
                scales = s;
                w.write_all(&q).map_err(io)
            }
            Part::Scales => {
                let bytes: Vec<u8> = scales.iter().flat_map(|s| s.to_le_bytes()).collect();
                w.write_all(&bytes).map_err(io)
            }
        }
    })
}

/// Quantizes a `[rows, cols]` matrix to e4m3 by 128 x 128 blocks: each block's scale is its
/// largest magnitude over 448 (1 for a block of zeros), and each value the e4m3 nearest to
/// it over that scale. Returns the bytes and the scales, `[ceil(rows/128), ceil(cols/128)]`.
pub fn quantize_fp8_blocks(vals: &[f32], rows: usize, cols: usize) -> (Vec<u8>, Vec<f32>) {
    assert_eq!(vals.len(), rows * cols, "a [rows, cols] matrix");
    let bc = cols.div_ceil(FP8_BLOCK);
    let mut q = vec![0u8; rows * cols];
    let mut scales = vec![0f32; rows.div_ceil(FP8_BLOCK) * bc];
    let band = FP8_BLOCK * cols.max(1);
    q.par_chunks_mut(band)
        .zip(vals.par_chunks(band))
        .zip(scales.par_chunks_mut(bc.max(1)))
        .for_each(|((qb, vb), sb)| {
            let nr = vb.len() / cols.max(1);
            for (j, s) in sb.iter_mut().enumerate() {
                let (c0, c1) = (j * FP8_BLOCK, ((j + 1) * FP8_BLOCK).min(cols));
                let amax = (0..nr)
                    .flat_map(|r| vb[r * cols + c0..r * cols + c1].iter())
                    .fold(0f32, |m, x| m.max(x.abs()));
                *s = if amax > 0.0 { amax / 448.0 } else { 1.0 };
                for r in 0..nr {
                    for c in c0..c1 {
                        qb[r * cols + c] = f32_to_e4m3(vb[r * cols + c] / *s);
                    }
                }
            }
        });
    (q, scales)
}

/// The ids the tokenizer can decode. A preset's vocabulary (151,936 for Qwen3-8B) is far larger
/// than the embedded tokenizer's; a trained model never picks the ids past it, but random
/// weights would nearly always do so, and a served answer would carry tokens with no text.
/// Their rows of the output head (and of the embedding, when tied to it) are zero, so their
/// logit is exactly 0 while the decodable ids' largest is positive. Shapes, and so speed, are
/// unchanged.
struct Live {
    vocab: usize,
    tied: bool,
}

impl Live {
    /// Zeroes the elements of `vals` (tensor `t` from element `start`) in rows past `vocab`.
    fn silence_padding(&self, t: &TensorSpec, start: usize, vals: &mut [f32]) {
        let head = t.role == TensorRole::Head || (self.tied && t.role == TensorRole::Embedding);
        if !head || t.shape.len() != 2 {
            return;
        }
        let first_dead = self.vocab.min(t.shape[0]) * t.shape[1];
        let from = first_dead.saturating_sub(start).min(vals.len());
        vals[from..].fill(0.0);
    }
}

/// Random values of tensor `t` (the `ti`th of the checkpoint) from element `start` on:
/// embeddings of unit variance, projections scaled by their fan-in, norms near one, small
/// biases, a final norm of ones. Each chunk of `STREAM_CHUNK` elements has its own stream,
/// drawn from `seed`, the tensor's index and the chunk's, so chunks can be made in parallel
/// and the checkpoint is the same however they are scheduled.
fn random_values(t: &TensorSpec, seed: u64, ti: usize, start: usize, vals: &mut [f32]) {
    let chunk = (start / STREAM_CHUNK) as u64;
    let mut rng = Rng::seeded(
        seed ^ (ti as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
            ^ (chunk + 1).wrapping_mul(0xC2B2_AE3D_27D4_EB4F),
    );
    let dense = |fan_in: usize| 1.0 / (fan_in as f64).sqrt();
    let (scale, offset) = match t.role {
        TensorRole::Embedding => (1.0, 0.0),
        TensorRole::Norm => (0.1, 1.0),
        TensorRole::Dense => (dense(t.shape[1]), 0.0),
        TensorRole::Bias => (0.1, 0.0),
        TensorRole::FinalNorm => (0.0, 1.0),
        TensorRole::Head => (4.0 * dense(t.shape[1]), 0.0),
    };
    if scale == 0.0 {
        vals.fill(offset as f32);
        return;
    }
    // Normals two at a time by Marsaglia's polar method: one logarithm and one square root
    // per pair, no trigonometry, which is most of the cost of an 8B checkpoint.
    for pair in vals.chunks_mut(2) {
        let (a, b) = loop {
            let u = 2.0 * rng.next_f64() - 1.0;
            let v = 2.0 * rng.next_f64() - 1.0;
            let s = u * u + v * v;
            if s > 0.0 && s < 1.0 {
                let f = (-2.0 * s.ln() / s).sqrt();
                break (u * f, v * f);
            }
        };
        pair[0] = (offset + a * scale) as f32;
        if let Some(x) = pair.get_mut(1) {
            *x = (offset + b * scale) as f32;
        }
    }
}

/// The files beside the weights: config (declaring `dtype`, and `quant` as its
/// `quantization_config`), tokenizer, chat template and generation config.
fn write_side_files(
    cfg: &ModelConfig,
    dtype: DType,
    quant: Option<serde_json::Value>,
    tokenizer: &TokenizerFiles,
    out: &Path,
) -> Result<()> {
    let mut config = cfg.to_hf_json();
    if let Some(q) = quant {
        config["quantization_config"] = q;
    }
    config["dtype"] = match dtype {
        DType::F32 => "float32",
        DType::F16 => "float16",
        DType::BF16 => "bfloat16",
        DType::F8E4M3 => "float8_e4m3fn",
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_8b_presets_have_the_published_parameter_counts() {
        // Totals of the published checkpoints (their safetensors index's `total_size` / 2).
        assert_eq!(
            preset(None, "qwen3-8b").unwrap().num_params(),
            8_190_735_360
        );
        assert_eq!(
            preset(None, "llama-3.1-8b").unwrap().num_params(),
            8_030_261_248
        );
        assert!(preset(Some(Arch::Llama), "qwen3-8b")
            .unwrap_err()
            .to_string()
            .contains("qwen3"));
    }

    #[test]
    fn the_qwen35_9b_preset_is_the_published_shape() {
        let c = preset(None, "qwen3.5-9b").unwrap();
        let hy = c.hybrid.as_ref().expect("a hybrid model");
        assert_eq!((hy.num_linear_layers(), hy.num_full_layers()), (24, 8));
        assert_eq!(hy.rotary_dim, 64);
        assert_eq!(
            (hy.key_dim(), hy.value_dim(), hy.conv_dim()),
            (2048, 4096, 8192)
        );
        assert_eq!((c.q_dim(), c.kv_dim(), c.vocab_size), (4096, 1024, 248_320));
        assert!(!c.tie_word_embeddings);
        // The GGUF metadata's 8.95B: the text model with its own head.
        let n = c.num_params() as f64 / 1e9;
        assert!((n - 8.95).abs() < 0.005, "{n:.4}B");
        // What init-random writes for it reads back as the same model.
        let back = ModelConfig::from_json(&c.to_hf_json().to_string()).unwrap();
        assert_eq!(back.tensors().len(), c.tensors().len());
        assert_eq!(back.num_params(), c.num_params());
        assert!(preset(Some(Arch::Qwen3), "qwen3.5-9b")
            .unwrap_err()
            .to_string()
            .contains("qwen3_5_text"));
    }

    /// `init-random --fp8` on a Qwen3.5 shape: the linear layers in FP8 but the Gated
    /// DeltaNet gate inputs (and the head), which the config's `modules_to_not_convert`
    /// names; the convolution (not a linear layer) bf16; read back and run on the CPU.
    #[test]
    fn a_random_fp8_hybrid_checkpoint_keeps_the_gate_inputs_bf16() {
        let cfg: ModelConfig = tiny_hybrid();
        let dir = std::env::temp_dir().join(format!("kvmesh-init-hy8-{}", std::process::id()));
        let tok = crate::embedded::default_tokenizer();
        let back = write_random_fp8_checkpoint(cfg, 3, &tok, &dir).unwrap();
        let q = back.quantization.as_ref().expect("quantized");
        let model = crate::model::LoadedModel::from_dir(&dir).unwrap();
        std::fs::remove_dir_all(&dir).ok();
        let dtype = |n: &str| model.weights.info(n).unwrap_or_else(|| panic!("{n}")).dtype;
        let a = "model.layers.0.linear_attn";
        assert_eq!(dtype(&format!("{a}.in_proj_qkv.weight")), DType::F8E4M3);
        assert_eq!(dtype(&format!("{a}.out_proj.weight")), DType::F8E4M3);
        assert_eq!(
            dtype("model.layers.3.self_attn.q_proj.weight"),
            DType::F8E4M3
        );
        for bf16 in ["in_proj_a.weight", "in_proj_b.weight", "conv1d.weight"] {
            assert_eq!(dtype(&format!("{a}.{bf16}")), DType::BF16, "{bf16}");
        }
        assert!(q.scheme_of(&format!("{a}.in_proj_a")).is_none());
        let crate::model::CpuWeights::Hybrid(m) = model
            .cpu_weights(crate::model::CpuOptions::default())
            .unwrap()
        else {
            panic!("a hybrid model loads hybrid weights")
        };
        let mut seq = m.new_sequence();
        let logits = m.forward(&mut seq, &[5, 12, 19, 26]).unwrap();
        assert!(logits.iter().all(|x| x.is_finite()));
    }

    /// The 9B preset's form at a test's size.
    fn tiny_hybrid() -> ModelConfig {
        ModelConfig::from_json(
            r#"{"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
                "vocab_size": 2048, "hidden_size": 64, "intermediate_size": 128,
                "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 1,
                "head_dim": 16, "full_attention_interval": 4, "linear_num_key_heads": 2,
                "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
                "rms_norm_eps": 1e-6, "max_position_embeddings": 512,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                    "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0],
                    "mrope_interleaved": true},
                "tie_word_embeddings": false}"#,
        )
        .unwrap()
    }

    #[test]
    fn a_random_hybrid_checkpoint_loads_and_runs_on_the_cpu() {
        // What `init-random --preset qwen3.5-9b` writes, small: written, read back through
        // the model loader, one prefill run.
        let cfg = tiny_hybrid();
        let dir = std::env::temp_dir().join(format!("kvmesh-init-hy-{}", std::process::id()));
        write_random_checkpoint(
            cfg,
            3,
            DType::BF16,
            &crate::embedded::default_tokenizer(),
            &dir,
        )
        .unwrap();
        let model = crate::model::LoadedModel::from_dir(&dir).unwrap();
        std::fs::remove_dir_all(&dir).ok();
        assert!(model.config.hybrid.is_some());
        let crate::model::CpuWeights::Hybrid(m) = model
            .cpu_weights(crate::model::CpuOptions::default())
            .unwrap()
        else {
            panic!("a hybrid model loads hybrid weights")
        };
        let mut b = crate::backend::cpu::HybridBackend::new(m, 4, 16, 1, 0).unwrap();
        let prompt: Vec<u32> = (0..20).map(|i| 5 + 7 * i).collect();
        let table: Vec<_> = (0..2).map(crate::kv_cache::BlockId).collect();
        let logits = crate::backend::Backend::forward(
            &mut b,
            &crate::backend::ForwardBatch {
                seqs: vec![crate::backend::SeqInput {
                    tokens: &prompt,
                    start_pos: 0,
                    context_len: 0,
                    block_table: &table,
                    want_logits: true,
                    state_slot: Some(0),
                }],
            },
        )
        .unwrap();
        assert_eq!(logits.len(), 1);
        assert_eq!(logits[0].len(), 2048);
        assert!(logits[0].iter().all(|x| x.is_finite()));
        let spread = logits[0].iter().fold(f32::MIN, |a, &x| a.max(x))
            - logits[0].iter().fold(f32::MAX, |a, &x| a.min(x));
        assert!(spread > 0.1, "flat logits: {spread}");
    }

    #[test]
    fn the_fp8_table_presets_have_the_published_sizes() {
        // The model cards' figures, rounded as they give them: total and non-embedding.
        for (name, total, body) in [("qwen3-32b", 32.8, 31.2), ("qwen2.5-72b", 72.7, 70.0)] {
            let c = preset(None, name).unwrap();
            let n = c.num_params() as f64 / 1e9;
            let emb = (c.vocab_size * c.hidden_size * if c.tie_word_embeddings { 1 } else { 2 })
                as f64
                / 1e9;
            assert!((n - total).abs() < 0.05, "{name}: {n:.3}B");
            assert!((n - emb - body).abs() < 0.25, "{name}: {:.3}B", n - emb);
        }
        assert_eq!(preset(None, "qwen2.5-72b").unwrap().arch, Arch::Qwen2);
    }

    #[test]
    fn fp8_blocks_dequantize_within_e4m3_rounding() {
        // Ragged sides: the last row and column blocks are partial.
        let (rows, cols) = (200, 300);
        let mut rng = Rng::seeded(5);
        let vals: Vec<f32> = (0..rows * cols)
            .map(|i| {
                let x = (rng.next_f64() - 0.5) as f32;
                // A block of zeros, and magnitudes spread over decades.
                if (i / cols) < 128 && (i % cols) < 128 {
                    0.0
                } else {
                    x * 10f32.powi((i % 5) as i32 - 2)
                }
            })
            .collect();
        let (q, scales) = quantize_fp8_blocks(&vals, rows, cols);
        assert_eq!(scales.len(), 2 * 3);
        assert_eq!(scales[0], 1.0, "a block of zeros");
        for (i, &x) in vals.iter().enumerate() {
            let s = scales[(i / cols) / 128 * 3 + (i % cols) / 128];
            let back = crate::safetensors::e4m3_to_f32(q[i]) * s;
            // Half a step: 2^-4 relative for normals, 2^-10 of the scale below them.
            let tol = (x.abs() / 16.0).max(s / 1024.0) * 1.0001;
            assert!((back - x).abs() <= tol, "{i}: {x} came back {back}");
        }
        // Each block's largest magnitude lands on 448.
        let top = (0..rows * cols)
            .filter(|i| (i / cols) >= 128)
            .map(|i| crate::safetensors::e4m3_to_f32(q[i]).abs())
            .fold(0f32, f32::max);
        assert_eq!(top, 448.0);
    }

    #[test]
    fn an_fp8_random_checkpoint_reads_back_block_scaled_and_runs_near_its_bf16_twin() {
        use crate::backend::{ForwardBatch, SeqInput};
        use crate::kv_cache::BlockId;
        use crate::model::{build_backend, BackendKind, KvBudget, LoadedModel};
        let base = std::env::temp_dir().join(format!("kvmesh-init-fp8-{}", std::process::id()));
        let tok = crate::embedded::default_tokenizer();
        let cfg = || preset(Some(Arch::Qwen3), "tiny").unwrap();
        let fp8 = write_random_fp8_checkpoint(cfg(), 4, &tok, &base.join("fp8")).unwrap();
        write_random_checkpoint(cfg(), 4, DType::BF16, &tok, &base.join("bf16")).unwrap();
        let q = fp8.quantization.as_ref().expect("a quantization_config");
        assert!(q.summary().contains("fp8"), "{}", q.summary());
        let w = crate::safetensors::WeightStore::open_dir(&base.join("fp8")).unwrap();
        let proj = "model.layers.0.mlp.down_proj";
        let dtype = |n: &str| w.info(n).unwrap_or_else(|| panic!("{n}")).dtype;
        assert_eq!(dtype(&format!("{proj}.weight")), DType::F8E4M3);
        assert_eq!(dtype(&format!("{proj}.weight_scale_inv")), DType::F32);
        assert_eq!(dtype("model.embed_tokens.weight"), DType::BF16);
        let logits = |dir: &str| {
            let m = LoadedModel::from_dir(&base.join(dir)).unwrap();
            let mut be = build_backend(
                BackendKind::Cpu(Default::default()),
                &m,
                16,
                KvBudget::Blocks(8),
            )
            .unwrap();
            let tokens: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % 200).collect();
            let table: Vec<BlockId> = (0..3).map(BlockId).collect();
            let batch = ForwardBatch {
                seqs: vec![SeqInput {
                    tokens: &tokens,
                    start_pos: 0,
                    context_len: 0,
                    block_table: &table,
                    want_logits: true,
                    state_slot: None,
                }],
            };
            be.forward(&batch).unwrap().pop().unwrap()
        };
        let (a, b) = (logits("fp8"), logits("bf16"));
        let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
        let worst = a
            .iter()
            .zip(&b)
            .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        println!("fp8 against bf16: largest logit difference {worst} (scale {scale})");
        assert!(worst > 0.0, "the weights were quantized");
        assert!(worst < 0.1 * scale, "{worst} of {scale}");
        std::fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn an_fp8_checkpoint_made_in_memory_is_the_file_byte_for_byte() {
        let dir = std::env::temp_dir().join(format!("kvmesh-init-mem-{}", std::process::id()));
        let tok = crate::embedded::default_tokenizer();
        let cfg = || preset(Some(Arch::Qwen2), "tiny").unwrap();
        let on_disk = write_random_fp8_checkpoint(cfg(), 9, &tok, &dir).unwrap();
        let (in_mem, w) = random_fp8_in_memory(cfg(), 9, &tok).unwrap();
        assert_eq!(
            in_mem.quantization.as_ref().map(|q| q.summary()),
            on_disk.quantization.as_ref().map(|q| q.summary())
        );
        assert_eq!(in_mem.num_params(), on_disk.num_params());
        let file = crate::safetensors::WeightStore::open_dir(&dir).unwrap();
        assert_eq!(w.names(), file.names());
        for n in file.names() {
            let (a, b) = (w.raw(n).unwrap(), file.raw(n).unwrap());
            assert_eq!((a.0.dtype, &a.0.shape), (b.0.dtype, &b.0.shape), "{n}");
            assert!(a.1 == b.1, "{n}: bytes differ");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn random_values_depend_only_on_the_chunk_they_are_in() {
        let t = TensorSpec {
            name: "w".into(),
            shape: vec![4, 3 * STREAM_CHUNK / 4],
            role: TensorRole::Dense,
        };
        let mut whole = vec![0f32; 2 * STREAM_CHUNK];
        random_values(&t, 7, 3, 0, &mut whole[..STREAM_CHUNK]);
        random_values(&t, 7, 3, STREAM_CHUNK, &mut whole[STREAM_CHUNK..]);
        let mut again = vec![0f32; STREAM_CHUNK];
        random_values(&t, 7, 3, STREAM_CHUNK, &mut again);
        assert_eq!(&whole[STREAM_CHUNK..], &again[..]);
        // Different chunks, tensors and seeds draw different streams.
        assert_ne!(&whole[..16], &whole[STREAM_CHUNK..STREAM_CHUNK + 16]);
        random_values(&t, 7, 4, STREAM_CHUNK, &mut again);
        assert_ne!(&whole[STREAM_CHUNK..STREAM_CHUNK + 16], &again[..16]);
        random_values(&t, 8, 3, STREAM_CHUNK, &mut again);
        assert_ne!(&whole[STREAM_CHUNK..STREAM_CHUNK + 16], &again[..16]);
        // Scaled by the fan-in: standard deviation 1/sqrt(columns).
        let var = whole.iter().map(|&x| (x as f64).powi(2)).sum::<f64>() / whole.len() as f64;
        let want = 1.0 / t.shape[1] as f64;
        assert!((var / want - 1.0).abs() < 0.01, "variance {var} vs {want}");
        // Normal, not merely of that variance: 68.27% within one standard deviation.
        let sd = want.sqrt() as f32;
        let within = whole.iter().filter(|x| x.abs() < sd).count() as f64 / whole.len() as f64;
        assert!((within - 0.6827).abs() < 0.002, "{within}");
    }

    #[test]
    fn a_streamed_checkpoint_loads_with_its_shapes() {
        let dir = std::env::temp_dir().join(format!("kvmesh-init-{}", std::process::id()));
        let cfg = write_random_checkpoint(
            preset(Some(Arch::Qwen3), "tiny").unwrap(),
            1,
            DType::BF16,
            &crate::embedded::default_tokenizer(),
            &dir,
        )
        .unwrap();
        let w = crate::safetensors::WeightStore::open_dir(&dir).unwrap();
        for t in cfg.tensors() {
            let v = w.f32(&t.name, &t.shape).unwrap();
            assert!(v.iter().all(|x| x.is_finite()), "{}", t.name);
            if t.role == TensorRole::FinalNorm {
                assert!(v.iter().all(|&x| x == 1.0));
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn head_rows_past_the_tokenizer_are_zero_and_the_rest_random() {
        let live = Live {
            vocab: 5,
            tied: false,
        };
        let t = |role| TensorSpec {
            name: "w".into(),
            shape: vec![8, 4],
            role,
        };
        // A chunk that starts inside row 3: rows 3 and 4 stay, rows 5.. are zeroed.
        let mut vals = vec![0.5f32; 20];
        live.silence_padding(&t(TensorRole::Head), 13, &mut vals);
        assert!(vals[..7].iter().all(|&x| x == 0.5), "{vals:?}");
        assert!(vals[7..].iter().all(|&x| x == 0.0), "{vals:?}");
        // A chunk wholly before the padding is untouched; one wholly after is zero.
        let mut vals = vec![0.5f32; 8];
        live.silence_padding(&t(TensorRole::Head), 0, &mut vals);
        assert!(vals.iter().all(|&x| x == 0.5));
        live.silence_padding(&t(TensorRole::Head), 24, &mut vals);
        assert!(vals.iter().all(|&x| x == 0.0));
        // Untied embeddings and other tensors keep every row; tied embeddings lose theirs.
        for (role, tied, kept) in [
            (TensorRole::Embedding, false, true),
            (TensorRole::Dense, true, true),
            (TensorRole::Embedding, true, false),
        ] {
            let mut vals = vec![0.5f32; 4];
            Live { vocab: 5, tied }.silence_padding(&t(role), 28, &mut vals);
            assert_eq!(vals.iter().all(|&x| x == 0.5), kept, "{role:?} tied {tied}");
        }
    }

    #[test]
    fn a_large_vocabulary_checkpoint_picks_decodable_tokens() {
        // The qwen3-8b preset's 151,936 ids over the embedded tokenizer, at a tiny width: the
        // ids the tokenizer lacks have zero head rows, the others random ones.
        let dir = std::env::temp_dir().join(format!("kvmesh-init-vocab-{}", std::process::id()));
        let mut cfg = preset(Some(Arch::Qwen3), "tiny").unwrap();
        cfg.vocab_size = 151_936;
        let tokenizer = crate::embedded::default_tokenizer();
        let cfg = write_random_checkpoint(cfg, 3, DType::BF16, &tokenizer, &dir).unwrap();
        let tok = TextTokenizer::from_files(&tokenizer, &[]).unwrap();
        assert!(tok.vocab_size() < 151_936);
        let w = crate::safetensors::WeightStore::open_dir(&dir).unwrap();
        let head = cfg
            .tensors()
            .into_iter()
            .find(|t| {
                t.role == TensorRole::Head
                    || (cfg.tie_word_embeddings && t.role == TensorRole::Embedding)
            })
            .unwrap();
        let v = w.f32(&head.name, &head.shape).unwrap();
        let h = head.shape[1];
        assert!(v[tok.vocab_size() * h..].iter().all(|&x| x == 0.0));
        assert!(v[..tok.vocab_size() * h].iter().any(|&x| x != 0.0));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
