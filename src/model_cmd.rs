//! `kvmesh model ...`: what the engine makes of a checkpoint, and random checkpoints for tests
//! and benchmarks.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Subcommand, ValueEnum};
use kvmesh_gpu::config::{Arch, ModelConfig, RopeScaling};
use kvmesh_gpu::init::{preset, write_random_checkpoint, write_random_fp8_checkpoint};
use kvmesh_gpu::model::LoadedModel;
use kvmesh_gpu::safetensors::DType;
use serde_json::{json, Value};

#[derive(Clone, Copy, ValueEnum)]
pub enum ArchArg {
    Llama,
    Qwen2,
    Qwen3,
    Mistral,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum DTypeArg {
    Bf16,
    F16,
    F32,
}

#[derive(Subcommand)]
pub enum ModelCommand {
    /// What the engine will use from a model folder: family, shapes, dtype, RoPE, attention
    /// window, biases, eos ids, chat template, context and KV bytes per token. Refuses, with
    /// the same message as `serve`, what kvmesh does not understand.
    Inspect {
        /// Model folder (the embedded model when left out).
        dir: Option<PathBuf>,
        /// Print JSON instead of the table.
        #[arg(long)]
        json: bool,
    },
    /// Write a checkpoint with random weights in the Hugging Face layout.
    InitRandom {
        /// Model family.
        #[arg(long, value_enum)]
        arch: Option<ArchArg>,
        /// Shape preset: tiny, or a published model's shape (qwen2.5-0.5b, llama-3.2-1b,
        /// qwen3-0.6b, qwen3-8b, llama-3.1-8b, qwen3-32b, qwen2.5-72b, and Qwen3.5's hybrid
        /// qwen3.5-9b, whose shape the flags below cannot change).
        #[arg(long, default_value = "tiny", value_parser = clap::builder::PossibleValuesParser::new(kvmesh_gpu::init::PRESETS))]
        preset: String,
        #[command(flatten)]
        shape: ShapeFlags,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        #[arg(long, value_enum, default_value = "bf16")]
        dtype: DTypeArg,
        /// Write an FP8 checkpoint as Qwen publishes them (`quant_method: fp8`): the
        /// decoder's linear layers as e4m3 with a scale per 128 x 128 block, the rest bf16.
        #[arg(long)]
        fp8: bool,
        /// Folder to write.
        #[arg(long)]
        out: PathBuf,
    },
}

/// `init-random`'s changes to a preset's shape.
#[derive(clap::Args, Debug, Default)]
pub struct ShapeFlags {
    #[arg(long)]
    layers: Option<usize>,
    #[arg(long)]
    hidden_size: Option<usize>,
    #[arg(long)]
    intermediate_size: Option<usize>,
    #[arg(long)]
    heads: Option<usize>,
    #[arg(long)]
    kv_heads: Option<usize>,
    #[arg(long)]
    head_dim: Option<usize>,
    #[arg(long)]
    vocab_size: Option<usize>,
    #[arg(long)]
    max_position_embeddings: Option<usize>,
}

impl ShapeFlags {
    fn any(&self) -> bool {
        [
            self.layers,
            self.hidden_size,
            self.intermediate_size,
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.vocab_size,
            self.max_position_embeddings,
        ]
        .iter()
        .any(Option::is_some)
    }

    /// The flags given, over `cfg`; a new hidden size without `--head-dim` sets the head size
    /// to hidden ÷ heads.
    fn apply(&self, cfg: &mut ModelConfig) {
        if let Some(v) = self.layers {
            cfg.num_layers = v;
        }
        if let Some(v) = self.hidden_size {
            cfg.hidden_size = v;
            if self.head_dim.is_none() {
                cfg.head_dim = v / self.heads.unwrap_or(cfg.num_heads);
            }
        }
        let set = |field: &mut usize, v: Option<usize>| {
            if let Some(v) = v {
                *field = v;
            }
        };
        set(&mut cfg.intermediate_size, self.intermediate_size);
        set(&mut cfg.num_heads, self.heads);
        set(&mut cfg.num_kv_heads, self.kv_heads);
        set(&mut cfg.head_dim, self.head_dim);
        set(&mut cfg.vocab_size, self.vocab_size);
        set(
            &mut cfg.max_position_embeddings,
            self.max_position_embeddings,
        );
    }
}

/// A hybrid (Qwen3.5) preset's layer layout and linear-attention heads come with its shape, so
/// a flag changing one part of the shape is refused.
fn refuse_hybrid_overrides(name: &str, shape: &ShapeFlags) -> anyhow::Result<()> {
    anyhow::ensure!(
        !shape.any(),
        "--preset {name} is a hybrid (Qwen3.5) model whose layer layout and linear attention \
         heads come with its shape; the shape flags apply to the dense presets"
    );
    Ok(())
}

/// The shape's head counts and sizes after the flags, and the dtype to write.
fn check_shape(cfg: &ModelConfig, dtype: DTypeArg, fp8: bool) -> anyhow::Result<DType> {
    anyhow::ensure!(
        cfg.num_kv_heads > 0 && cfg.num_heads.is_multiple_of(cfg.num_kv_heads),
        "--heads ({}) must be a multiple of --kv-heads ({})",
        cfg.num_heads,
        cfg.num_kv_heads
    );
    anyhow::ensure!(
        cfg.head_dim.is_multiple_of(2) && cfg.head_dim > 0,
        "head_dim must be even"
    );
    let dtype = match dtype {
        DTypeArg::Bf16 => DType::BF16,
        DTypeArg::F16 => DType::F16,
        DTypeArg::F32 => DType::F32,
    };
    anyhow::ensure!(
        !fp8 || dtype == DType::BF16,
        "--fp8 writes what it does not quantize as bf16: leave --dtype out"
    );
    Ok(dtype)
}

pub fn run(cmd: ModelCommand) -> anyhow::Result<()> {
    match cmd {
        ModelCommand::Inspect { dir, json } => {
            let model = match &dir {
                Some(d) => {
                    LoadedModel::from_dir(d).with_context(|| format!("loading {}", d.display()))?
                }
                None => LoadedModel::from_embedded(&kvmesh_gpu::embedded::DEFAULT_MODEL)
                    .context("loading the embedded model")?,
            };
            let report = inspect(&model, dir.as_deref());
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", render(&report));
            }
            Ok(())
        }
        ModelCommand::InitRandom {
            arch,
            preset: name,
            shape,
            seed,
            dtype,
            fp8,
            out,
        } => {
            let arch = arch.map(|a| match a {
                ArchArg::Llama => Arch::Llama,
                ArchArg::Qwen2 => Arch::Qwen2,
                ArchArg::Qwen3 => Arch::Qwen3,
                ArchArg::Mistral => Arch::Mistral,
            });
            let mut cfg = preset(arch, &name)?;
            if cfg.hybrid.is_some() {
                refuse_hybrid_overrides(&name, &shape)?;
            }
            shape.apply(&mut cfg);
            let dtype = check_shape(&cfg, dtype, fp8)?;
            let tokenizer = kvmesh_gpu::embedded::default_tokenizer();
            let cfg = if fp8 {
                write_random_fp8_checkpoint(cfg, seed, &tokenizer, &out)
            } else {
                write_random_checkpoint(cfg, seed, dtype, &tokenizer, &out)
            }
            .with_context(|| format!("writing {}", out.display()))?;
            println!(
                "wrote {} ({} {}, {:.1}M parameters, vocab {}) to {}",
                name,
                cfg.arch.architecture_name(),
                cfg.quantization
                    .as_ref()
                    .map_or_else(|| dtype.name().to_string(), |q| q.summary()),
                cfg.num_params() as f64 / 1e6,
                cfg.vocab_size,
                out.display()
            );
            Ok(())
        }
    }
}

/// Everything `model inspect` reports, as JSON (the text view is rendered from it).
fn inspect(m: &LoadedModel, dir: Option<&std::path::Path>) -> Value {
    let c = &m.config;
    let mut dtypes: std::collections::BTreeMap<&str, usize> = Default::default();
    let names = m.weights.names();
    for n in &names {
        if let Some(i) = m.weights.info(n) {
            *dtypes.entry(i.dtype.name()).or_default() += 1;
        }
    }
    let rope = &c.rope;
    let mut rope_json = json!({
        "type": rope.scaling.type_name(),
        "theta": rope.theta,
        "read_from": rope.layout.describe(),
        "attention_factor": c.rope_attention_factor(),
        "depends_on_sequence_length": c.rope_depends_on_length(),
    });
    let params = c.rope_parameters_json();
    if let (Some(o), Some(p)) = (rope_json.as_object_mut(), params.as_object()) {
        for (k, v) in p {
            if k != "rope_type" && k != "rope_theta" {
                o.insert(k.clone(), v.clone());
            }
        }
    }
    let windows: Vec<Value> = (0..c.num_layers)
        .map(|i| c.layer_window(i).map_or(Value::Null, |w| w.into()))
        .collect();
    // Hybrid models keep K/V for their full-attention layers only.
    let kv_layers = c
        .hybrid
        .as_ref()
        .map_or(c.num_layers, |h| h.num_full_layers());
    let kv_elems = 2 * kv_layers * c.kv_dim();
    let context_from = match &c.rope.scaling {
        RopeScaling::Linear { factor } | RopeScaling::Dynamic { factor } => format!(
            "max_position_embeddings {} x {} factor {factor}",
            c.max_position_embeddings,
            rope.scaling.type_name()
        ),
        RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            ..
        } => format!(
            "original_max_position_embeddings {original_max_position_embeddings} x yarn factor {factor}"
        ),
        RopeScaling::Default | RopeScaling::Llama3 { .. } => {
            format!("max_position_embeddings {}", c.max_position_embeddings)
        }
    };
    let mut notes = Vec::new();
    if c.rope_depends_on_length() {
        notes.push(format!(
            "dynamic RoPE: past {} tokens the frequencies follow the sequence's length, so keys \
             keep the rotation of the length they were computed at (as in transformers' cached \
             generation); the cpu backend runs it, the cuda backend refuses it, and prefix \
             caching is off",
            c.max_position_embeddings
        ));
    }
    if let Some(h) = &c.hybrid {
        notes.push(hybrid_note(c, h));
    }
    if m.tokenizer.vocab_size() > c.vocab_size {
        notes.push(format!(
            "the tokenizer has {} tokens, the model {}: ids past the model's are refused",
            m.tokenizer.vocab_size(),
            c.vocab_size
        ));
    }
    json!({
        "path": dir.map(|d| d.display().to_string()),
        "name": m.name,
        "family": c.arch.model_type(),
        "architecture": c.architecture_name(),
        "vocab_size": c.vocab_size,
        "tokenizer_vocab_size": m.tokenizer.vocab_size(),
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_layers": c.num_layers,
        "num_heads": c.num_heads,
        "num_kv_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "parameters": c.num_params(),
        "declared_dtype": c.declared_dtype,
        "weights": {
            "tensors": names.len(),
            "bytes": m.weights.stored_bytes(),
            "dtypes": dtypes,
        },
        "quantization": quantization(m),
        "rms_norm_eps": shortest(c.rms_norm_eps),
        "activation": "silu",
        "tie_word_embeddings": c.tie_word_embeddings,
        "qkv_bias": c.qkv_bias,
        "o_bias": c.o_bias,
        "mlp_bias": c.mlp_bias,
        "qk_norm": c.qk_norm,
        "rope": rope_json,
        "attention_scale": shortest(c.attention_scale()),
        "sliding_window": c.sliding_window,
        "layer_windows": windows,
        "max_position_embeddings": c.max_position_embeddings,
        "max_context": c.max_context(),
        "max_context_from": context_from,
        "notes": notes,
        "bos_token_id": m.tokenizer.bos_id().or(c.bos_token_id),
        "eos_token_ids": m.tokenizer.eos_ids(),
        "eos_source": m.tokenizer.eos_source(),
        "chat_template": m.tokenizer.chat_template_source(),
        "kv_bytes_per_token": {
            "bf16": kv_elems * 2,
            "f32": kv_elems * 4,
        },
        "ignored_config_fields": c.ignored_fields,
    })
}

/// The FP8 scheme of each quantized linear layer (the layers named per decoder layer, with
/// the decoder layers they are in), the layers left as stored, and the bytes the weights
/// take on a GPU that keeps them in FP8 beside the same model's in bf16.
fn quantization(m: &LoadedModel) -> Value {
    let c = &m.config;
    let Some(q) = &c.quantization else {
        return Value::Null;
    };
    // scheme -> layer kind (`mlp.down_proj`) -> decoder layers holding it
    let mut schemes: std::collections::BTreeMap<
        String,
        std::collections::BTreeMap<String, Vec<usize>>,
    > = Default::default();
    let mut unquantized = Vec::new();
    for (name, _, _) in c.linear_layers() {
        let Some(s) = q.scheme_of(&name) else {
            unquantized.push(name);
            continue;
        };
        // Qwen3.5's wrapper layout puts the decoder layers under `model.language_model.`.
        let (kind, layer) = match name
            .strip_prefix("model.layers.")
            .or_else(|| name.strip_prefix("model.language_model.layers."))
            .and_then(|r| r.split_once('.'))
        {
            Some((i, kind)) => (kind.to_string(), i.parse::<usize>().ok()),
            None => (name.clone(), None),
        };
        let layers = schemes
            .entry(s.describe())
            .or_default()
            .entry(kind)
            .or_default();
        layers.extend(layer);
    }
    let schemes: Vec<Value> = schemes
        .into_iter()
        .map(|(scheme, kinds)| {
            let layers: Vec<Value> = kinds
                .into_iter()
                .map(|(kind, l)| json!({"layer": kind, "in_decoder_layers": l}))
                .collect();
            json!({"scheme": scheme, "layers": layers})
        })
        .collect();
    let (fp8, bf16) = kvmesh_gpu::quant::gpu_bytes(c, &m.weights);
    json!({
        "method": q.method.name(),
        "summary": q.summary(),
        "schemes": schemes,
        "unquantized_layers": unquantized,
        "gpu_bytes_fp8": fp8,
        "gpu_bytes_bf16": bf16,
        "cpu": "dequantized to f32 at load",
        "cuda": "kept in FP8 (e4m3 weights read by the decode kernels, cuBLASLt FP8 GEMMs \
                 for larger steps; compute capability 8.9 or later, block and per-channel \
                 scales on Hopper)",
    })
}

/// The text view of the quantization: one line per scheme, then the bytes.
fn quantization_lines(r: &Value) -> Vec<(&'static str, String)> {
    let q = &r["quantization"];
    if q.is_null() {
        return Vec::new();
    }
    let num_layers = r["num_layers"].as_u64().unwrap_or(0) as usize;
    let mut lines = vec![(
        "quantization",
        format!("{} ({})", text(q, "summary"), text(q, "cpu")),
    )];
    for s in q["schemes"].as_array().into_iter().flatten() {
        let kinds: Vec<String> = s["layers"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|l| {
                let n = l["in_decoder_layers"].as_array().map_or(0, Vec::len);
                match n {
                    0 => text(l, "layer"),
                    n if n == num_layers => format!("{} (all layers)", text(l, "layer")),
                    n => format!("{} ({n} of {num_layers} layers)", text(l, "layer")),
                }
            })
            .collect();
        lines.push((
            "  scheme",
            format!("{}: {}", text(s, "scheme"), kinds.join(", ")),
        ));
    }
    let kept: Vec<&str> = q["unquantized_layers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    lines.push((
        "  unquantized",
        if kept.is_empty() {
            "none".into()
        } else {
            kept.join(", ")
        },
    ));
    lines.push((
        "  GPU bytes",
        format!(
            "{} kept in FP8 ({} in bf16); cuda backend: {}",
            human_bytes(num(q, "gpu_bytes_fp8")),
            human_bytes(num(q, "gpu_bytes_bf16")),
            text(q, "cuda")
        ),
    ));
    lines
}

/// Bytes in the largest binary unit that leaves a number of at least 1.
fn human_bytes(b: u64) -> String {
    let mut x = b as f64;
    for unit in ["bytes", "KiB", "MiB"] {
        if x < 1024.0 {
            return format!("{x:.2} {unit}").replace(".00 bytes", " bytes");
        }
        x /= 1024.0;
    }
    format!("{x:.2} GiB")
}

/// What a Qwen3.5 model adds to the dense shape, and where it is served.
fn hybrid_note(
    c: &kvmesh_gpu::config::ModelConfig,
    h: &kvmesh_gpu::config::HybridConfig,
) -> String {
    let types: Vec<&str> = h.layer_types.iter().map(|t| t.name()).collect();
    format!(
        "Qwen3.5 hybrid: {} Gated DeltaNet layers ({} key heads of {}, {} value heads of {}, \
         conv kernel {}) and {} gated full-attention layers ({}); RoPE on the first {} of each \
         head's {} dimensions; recurrent state {} bytes per sequence (f32), one slot per \
         running sequence, and saved states at block boundaries for the prefix cache. Served \
         by the CPU and CUDA backends",
        h.num_linear_layers(),
        h.linear_num_key_heads,
        h.linear_key_head_dim,
        h.linear_num_value_heads,
        h.linear_value_head_dim,
        h.linear_conv_kernel_dim,
        h.num_full_layers(),
        types.join(", "),
        h.rotary_dim,
        c.head_dim,
        h.state_bytes_per_sequence()
    )
}

/// An f32 as JSON through its shortest decimal form (1e-5, not 9.999999747378752e-6).
fn shortest(x: f32) -> Value {
    x.to_string()
        .parse::<f64>()
        .map_or(Value::Null, Value::from)
}

/// The text view of `model inspect`, one labelled line per aspect.
fn render(r: &Value) -> String {
    let mut lines = vec![
        (
            "model",
            match r["path"].as_str() {
                Some(p) => format!("{} ({p})", text(r, "name")),
                None => format!("{} (embedded)", text(r, "name")),
            },
        ),
        (
            "family",
            format!("{} ({})", text(r, "family"), text(r, "architecture")),
        ),
        ("shape", shape(r)),
        ("parameters", parameters(r)),
        ("layers", layers(r)),
        ("rope", rope(r)),
        ("attention", attention(r)),
        (
            "max context",
            format!(
                "{} tokens ({})",
                num(r, "max_context"),
                text(r, "max_context_from")
            ),
        ),
        (
            "tokens",
            format!(
                "bos {}, eos {} (from {})",
                r["bos_token_id"],
                r["eos_token_ids"],
                text(r, "eos_source")
            ),
        ),
        (
            "chat template",
            r["chat_template"]
                .as_str()
                .unwrap_or("none (chat completions are refused)")
                .to_string(),
        ),
        ("KV per token", {
            let kv = &r["kv_bytes_per_token"];
            format!(
                "{} bytes as bf16 (cuda, sim), {} bytes as f32 (cpu)",
                kv["bf16"], kv["f32"]
            )
        }),
        ("ignored", ignored(r)),
    ];
    lines.extend(quantization_lines(r));
    for note in r["notes"].as_array().into_iter().flatten() {
        lines.push(("note", note.as_str().unwrap_or("").to_string()));
    }
    lines
        .into_iter()
        .map(|(k, v)| format!("{k:<15}{v}\n"))
        .collect()
}

fn text(r: &Value, k: &str) -> String {
    r[k].as_str().unwrap_or("-").to_string()
}

fn num(r: &Value, k: &str) -> u64 {
    r[k].as_u64().unwrap_or(0)
}

fn yes(r: &Value, k: &str) -> &'static str {
    if r[k].as_bool() == Some(true) {
        "yes"
    } else {
        "no"
    }
}

fn shape(r: &Value) -> String {
    format!(
        "{} layers, hidden {}, intermediate {}, {} heads / {} kv heads of {}, vocab {} (tokenizer {})",
        num(r, "num_layers"),
        num(r, "hidden_size"),
        num(r, "intermediate_size"),
        num(r, "num_heads"),
        num(r, "num_kv_heads"),
        num(r, "head_dim"),
        num(r, "vocab_size"),
        num(r, "tokenizer_vocab_size")
    )
}

fn parameters(r: &Value) -> String {
    let w = &r["weights"];
    let dtypes: Vec<String> = w["dtypes"]
        .as_object()
        .map(|o| o.iter().map(|(k, v)| format!("{k} x{v}")).collect())
        .unwrap_or_default();
    format!(
        "{:.2}M; {} tensors, {:.1} MB stored ({}); config dtype {}",
        num(r, "parameters") as f64 / 1e6,
        w["tensors"],
        w["bytes"].as_u64().unwrap_or(0) as f64 / 1e6,
        dtypes.join(", "),
        r["declared_dtype"].as_str().unwrap_or("not given")
    )
}

fn layers(r: &Value) -> String {
    format!(
        "RMSNorm eps {}, silu MLP; q/k/v bias {}, o_proj bias {}, mlp bias {}, q/k norm {}; tied embeddings {}",
        r["rms_norm_eps"],
        yes(r, "qkv_bias"),
        yes(r, "o_bias"),
        yes(r, "mlp_bias"),
        yes(r, "qk_norm"),
        yes(r, "tie_word_embeddings")
    )
}

fn rope(r: &Value) -> String {
    let rope = &r["rope"];
    let shown_apart = [
        "type",
        "theta",
        "read_from",
        "attention_factor",
        "depends_on_sequence_length",
    ];
    let extras: Vec<String> = rope
        .as_object()
        .map(|o| {
            o.iter()
                .filter(|(k, _)| !shown_apart.contains(&k.as_str()))
                .map(|(k, v)| format!("{k} {v}"))
                .collect()
        })
        .unwrap_or_default();
    format!(
        "{}, theta {}{}; attention factor {} (read from {})",
        rope["type"].as_str().unwrap_or("?"),
        rope["theta"],
        if extras.is_empty() {
            String::new()
        } else {
            format!(", {}", extras.join(", "))
        },
        rope["attention_factor"],
        rope["read_from"].as_str().unwrap_or("?")
    )
}

fn attention(r: &Value) -> String {
    let windows = r["layer_windows"].as_array().cloned().unwrap_or_default();
    let sliding: Vec<String> = windows
        .iter()
        .enumerate()
        .filter(|(_, w)| !w.is_null())
        .map(|(i, _)| i.to_string())
        .collect();
    if sliding.is_empty() {
        format!(
            "causal over the whole context on every layer; scale {}",
            r["attention_scale"]
        )
    } else if sliding.len() == windows.len() {
        format!(
            "sliding window of {} tokens on every layer; scale {}",
            r["sliding_window"], r["attention_scale"]
        )
    } else {
        format!(
            "sliding window of {} tokens on layers {}, whole context on the others; scale {}",
            r["sliding_window"],
            sliding.join(","),
            r["attention_scale"]
        )
    }
}

fn ignored(r: &Value) -> String {
    let ignored: Vec<String> = r["ignored_config_fields"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default();
    if ignored.is_empty() {
        "nothing".into()
    } else {
        format!("{} (they do not change the math)", ignored.join(", "))
    }
}
