//! `kvmesh model ...`: checkpoints for tests and benchmarks.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Subcommand, ValueEnum};
use kvmesh_gpu::config::Arch;
use kvmesh_gpu::init::{preset, write_random_checkpoint};
use kvmesh_gpu::safetensors::DType;

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
    /// Write a checkpoint with random weights in the Hugging Face layout.
    InitRandom {
        /// Model family.
        #[arg(long, value_enum)]
        arch: Option<ArchArg>,
        /// Shape preset: tiny, qwen2.5-0.5b, llama-3.2-1b, qwen3-0.6b.
        #[arg(long, default_value = "tiny")]
        preset: String,
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
        #[arg(long, default_value_t = 0)]
        seed: u64,
        #[arg(long, value_enum, default_value = "bf16")]
        dtype: DTypeArg,
        /// Folder to write.
        #[arg(long)]
        out: PathBuf,
    },
}

pub fn run(cmd: ModelCommand) -> anyhow::Result<()> {
    match cmd {
        ModelCommand::InitRandom {
            arch,
            preset: name,
            layers,
            hidden_size,
            intermediate_size,
            heads,
            kv_heads,
            head_dim,
            vocab_size,
            max_position_embeddings,
            seed,
            dtype,
            out,
        } => {
            let arch = arch.map(|a| match a {
                ArchArg::Llama => Arch::Llama,
                ArchArg::Qwen2 => Arch::Qwen2,
                ArchArg::Qwen3 => Arch::Qwen3,
                ArchArg::Mistral => Arch::Mistral,
            });
            let mut cfg = preset(arch, &name)?;
            if let Some(v) = layers {
                cfg.num_layers = v;
            }
            if let Some(v) = hidden_size {
                cfg.hidden_size = v;
                if head_dim.is_none() {
                    cfg.head_dim = v / heads.unwrap_or(cfg.num_heads);
                }
            }
            if let Some(v) = intermediate_size {
                cfg.intermediate_size = v;
            }
            if let Some(v) = heads {
                cfg.num_heads = v;
            }
            if let Some(v) = kv_heads {
                cfg.num_kv_heads = v;
            }
            if let Some(v) = head_dim {
                cfg.head_dim = v;
            }
            if let Some(v) = vocab_size {
                cfg.vocab_size = v;
            }
            if let Some(v) = max_position_embeddings {
                cfg.max_position_embeddings = v;
            }
            anyhow::ensure!(
                cfg.num_kv_heads > 0 && cfg.num_heads % cfg.num_kv_heads == 0,
                "--heads ({}) must be a multiple of --kv-heads ({})",
                cfg.num_heads,
                cfg.num_kv_heads
            );
            anyhow::ensure!(
                cfg.head_dim % 2 == 0 && cfg.head_dim > 0,
                "head_dim must be even"
            );
            let dtype = match dtype {
                DTypeArg::Bf16 => DType::BF16,
                DTypeArg::F16 => DType::F16,
                DTypeArg::F32 => DType::F32,
            };
            let cfg = write_random_checkpoint(
                cfg,
                seed,
                dtype,
                &crate::embedded::default_tokenizer(),
                &out,
            )
            .with_context(|| format!("writing {}", out.display()))?;
            println!(
                "wrote {} ({} {}, {:.1}M parameters, vocab {}) to {}",
                name,
                cfg.arch.architecture_name(),
                dtype.name(),
                cfg.num_params() as f64 / 1e6,
                cfg.vocab_size,
                out.display()
            );
            Ok(())
        }
    }
}
