//! Engines as `serve` and `node` start them: the model and engine flags they share (vLLM's
//! spellings), the model read once for all of a process's engines, an engine on a thread of
//! its own or on a shared pool's driver threads, and the throughput line it logs.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, ValueEnum};

use kvmesh_gpu::backend::sim::SimTiming;
use kvmesh_gpu::backend::sm_split::SmPartition;
use kvmesh_gpu::card::ModelCard;
use kvmesh_gpu::engine::{self, EngineConfig};
use kvmesh_gpu::guided::LazyGuides;
use kvmesh_gpu::model::{
    build_backend_for, resolve_device, BackendKind, KvBudget, LoadedModel, Numerics,
};

/// What computes the model's steps.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendArg {
    /// The model's math, on `--device` (the name predates the CUDA backend).
    Cpu,
    /// No math: a timing model's step times and deterministic tokens.
    Sim,
}

/// The library's defaults, which the flags show and take.
fn engine_defaults() -> EngineConfig {
    EngineConfig::default()
}

fn sim_defaults() -> SimTiming {
    SimTiming::default()
}

/// The model and engine flags `serve` and `node` share (vLLM spellings).
#[derive(Args, Debug, Clone)]
pub struct EngineArgs {
    /// A Hugging Face model folder; without it, the embedded Shakespeare model.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// The model's id in the API (default: the model folder's name).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Longest prompt plus completion, in tokens (default: the model's, capped by the KV cache).
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Most sequences in one batch.
    #[arg(long, default_value_t = engine_defaults().max_num_seqs)]
    pub max_num_seqs: usize,
    /// Most tokens in one engine step (long prompts are prefilled in chunks of this).
    #[arg(long, default_value_t = engine_defaults().max_num_batched_tokens)]
    pub max_num_batched_tokens: usize,
    /// Tokens per KV block.
    #[arg(long, default_value_t = engine_defaults().block_size)]
    pub block_size: usize,
    /// Where the model's math runs (`--backend cpu`): auto (CUDA when a GPU is present),
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Always run eager: no CUDA graphs for decode steps.
    #[arg(long)]
    pub enforce_eager: bool,
    /// CUDA: switches that are not the defaults yet, comma-separated: fuse-norms,
    /// fuse-rope, prefill-graphs, gdn-scan, gdn-chunked, fp8-f32-out, fp8-mma, no-split-decode,
    /// pdl=auto|on|off, skinny-max-rows=N (README, "CUDA options"). An unknown name is
    /// refused.
    #[arg(long, value_name = "LIST")]
    pub cuda_options: Option<String>,
    /// CPU: multiply prompts by bf16 weights with the activations rounded to bf16, on
    /// AVX512-BF16 (about 1.4x the prefill speed; bf16 rounding of the products' inputs, as
    /// GPU engines have). Off: products in f32, the reference numerics.
    #[arg(long)]
    pub cpu_bf16_products: bool,
    /// `cpu` runs the model's math, on `--device`; `sim` runs no math and takes the time a
    /// timing model says (deterministic tokens; for testing serving, routing and scale).
    #[arg(long, value_enum, default_value = "cpu")]
    pub backend: BackendArg,
    /// sim: speed factor (3 = three times as fast as the timing model's base).
    #[arg(long, default_value_t = sim_defaults().speed)]
    pub sim_speed: f64,
    /// sim: microseconds per prompt token.
    #[arg(long, default_value_t = sim_defaults().prefill_per_token.as_micros() as f64)]
    pub sim_prefill_us_per_token: f64,
    /// sim: milliseconds per decode step, plus `--sim-decode-us-per-seq` for each sequence.
    #[arg(long, default_value_t = sim_defaults().decode_base.as_micros() as f64 / 1e3)]
    pub sim_decode_ms: f64,
    #[arg(long, default_value_t = sim_defaults().decode_per_seq.as_micros() as f64)]
    pub sim_decode_us_per_seq: f64,
    /// Memory for the KV cache, in GiB [default: 1 on cpu and sim; on a GPU, what
    /// --gpu-memory-utilization leaves].
    #[arg(long)]
    pub kv_cache_gib: Option<f64>,
    /// Share of a GPU's memory the engine takes in all (weights, activations, KV cache);
    /// the KV cache gets what the rest leaves. Ignored with --kv-cache-gib or
    /// --num-kv-blocks.
    #[arg(long, default_value_t = 0.9)]
    pub gpu_memory_utilization: f64,
    /// Exact number of KV blocks (overrides --kv-cache-gib).
    #[arg(long)]
    pub num_kv_blocks: Option<usize>,
    /// Requests allowed to wait for a slot; beyond that, 429.
    #[arg(long, default_value_t = engine_defaults().max_waiting)]
    pub max_waiting_seqs: usize,
    /// Turn off reuse of cached prompt blocks.
    #[arg(long)]
    pub no_enable_prefix_caching: bool,
    /// Compute threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Set by a node given `--sm-split`: the side of the GPU's SMs this engine runs on.
    #[arg(skip)]
    pub sm_partition: Option<SmPartition>,
    /// Set for a decode engine of a node given `--kv-transport cuda-ipc`: its KV cache is
    /// one allocation another process of this host can map.
    #[arg(skip)]
    pub kv_exportable: bool,
    /// Set for a decode engine of a node given `--kv-transport ucx`: on a GPU its KV cache is
    /// one `cuMemAlloc` allocation where the driver allows it, which UCX's CUDA transports
    /// register and map (memory of the driver's stream-ordered pools they may not); where it
    /// does not, the cache is allocated as usual (with a warning) and KV moves through host
    /// memory. Nothing changes on the CPU.
    #[arg(skip)]
    pub kv_for_ucx: bool,
}

impl EngineArgs {
    /// The engine's limits as the flags give them, refused where they cannot work; the
    /// model length is 0 until the KV cache's size settles it ([`Self::max_model_len`]).
    pub fn engine_config(&self) -> anyhow::Result<EngineConfig> {
        anyhow::ensure!(self.block_size > 0, "--block-size must be positive");
        anyhow::ensure!(self.max_num_seqs > 0, "--max-num-seqs must be positive");
        anyhow::ensure!(
            self.max_num_batched_tokens > 0,
            "--max-num-batched-tokens must be positive"
        );
        Ok(EngineConfig {
            max_model_len: 0,
            max_num_seqs: self.max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
            block_size: self.block_size,
            max_waiting: self.max_waiting_seqs,
            enable_prefix_caching: !self.no_enable_prefix_caching,
        })
    }

    /// The longest sequence, for a model of `model_max` tokens of context and a KV cache of
    /// `num_blocks` blocks: `--max-model-len` if both hold it, else refused saying which does
    /// not; without the flag, the shorter of the two.
    pub fn max_model_len(&self, model_max: usize, num_blocks: usize) -> anyhow::Result<usize> {
        let cache_tokens = num_blocks * self.block_size;
        match self.max_model_len {
            Some(n) => {
                anyhow::ensure!(n > 0, "--max-model-len must be positive");
                anyhow::ensure!(
                    n <= model_max,
                    "--max-model-len {n} is longer than the model's context of {model_max} tokens"
                );
                anyhow::ensure!(
                    n <= cache_tokens,
                    "--max-model-len {n} does not fit the KV cache ({cache_tokens} tokens in \
                     {num_blocks} blocks); raise --kv-cache-gib or lower --max-model-len"
                );
                Ok(n)
            }
            None => {
                if cache_tokens < model_max {
                    tracing::info!(
                        "max model length capped at {cache_tokens} tokens, what the KV cache \
                         holds (the model allows {model_max})"
                    );
                }
                Ok(model_max.min(cache_tokens))
            }
        }
    }

    /// Whose numbers the engine's tokens are: `--backend sim` makes them up. A node without
    /// an engine given `--model` and `--backend sim` stands for the sim workers of that model.
    pub fn numerics(&self) -> Numerics {
        match self.backend {
            BackendArg::Cpu => Numerics::Model,
            BackendArg::Sim => Numerics::Simulated,
        }
    }

    /// The KV cache's size as the flags give it: blocks, else GiB, else on a GPU the share
    /// of its memory, else 1 GiB.
    pub fn kv_budget(&self, kind: &BackendKind) -> anyhow::Result<KvBudget> {
        Ok(match (self.num_kv_blocks, self.kv_cache_gib) {
            (Some(n), _) => KvBudget::Blocks(n),
            (None, Some(g)) => {
                anyhow::ensure!(
                    g.is_finite() && g > 0.0,
                    "--kv-cache-gib {g} must be a positive number"
                );
                KvBudget::Bytes((g * (1u64 << 30) as f64) as usize)
            }
            (None, None) => match kind {
                BackendKind::Cuda(_) => {
                    let u = self.gpu_memory_utilization;
                    anyhow::ensure!(
                        u > 0.0 && u <= 1.0,
                        "--gpu-memory-utilization {u} must be above 0 and at most 1"
                    );
                    KvBudget::Share(u)
                }
                _ => KvBudget::Bytes(1 << 30),
            },
        })
    }

    /// What runs the model, from `--backend`, `--device`, `--enforce-eager` and the sim
    /// timing: the one place those flags are read together.
    pub fn backend_kind(&self) -> anyhow::Result<BackendKind> {
        match self.backend {
            BackendArg::Cpu => {
                let mut kind = resolve_device(&self.device)?;
                match &mut kind {
                    BackendKind::Cuda(cuda) => {
                        cuda.graphs = !self.enforce_eager;
                        if let Some(list) = &self.cuda_options {
                            cuda.apply_list(list)?;
                        }
                        anyhow::ensure!(
                            !self.cpu_bf16_products,
                            "--cpu-bf16-products is for the CPU backend, and --device {} runs \
                             on cuda (whose products are bf16 already): leave the flag out",
                            self.device
                        );
                    }
                    BackendKind::Cpu(cpu) => cpu.bf16_products = self.cpu_bf16_products,
                    BackendKind::Sim(_) => {}
                }
                anyhow::ensure!(
                    self.cuda_options.is_none() || matches!(kind, BackendKind::Cuda(_)),
                    "--cuda-options is for the CUDA backend, and --device {} runs on the cpu \
                     here: leave the flag out",
                    self.device
                );
                if self.device == "auto" {
                    tracing::info!(
                        "--device auto chose {}",
                        if matches!(kind, BackendKind::Cuda(_)) {
                            "cuda:0"
                        } else {
                            "cpu (no CUDA device)"
                        }
                    );
                }
                Ok(kind)
            }
            BackendArg::Sim => {
                anyhow::ensure!(
                    self.device == "auto",
                    "--device {} names where the model's math runs, and --backend sim runs \
                     none: leave --device out with --backend sim",
                    self.device
                );
                anyhow::ensure!(self.sim_speed > 0.0, "--sim-speed must be positive");
                anyhow::ensure!(
                    self.cuda_options.is_none(),
                    "--cuda-options sets how the CUDA backend runs, and --backend sim runs no \
                     math: leave the flag out"
                );
                anyhow::ensure!(
                    !self.cpu_bf16_products,
                    "--cpu-bf16-products sets how the CPU backend multiplies, and --backend sim \
                     multiplies nothing: leave the flag out"
                );
                let us = |v: f64| Duration::from_secs_f64(v.max(0.0) / 1e6);
                Ok(BackendKind::Sim(SimTiming {
                    prefill_per_token: us(self.sim_prefill_us_per_token),
                    decode_base: us(self.sim_decode_ms * 1e3),
                    decode_per_seq: us(self.sim_decode_us_per_seq),
                    speed: self.sim_speed,
                }))
            }
        }
    }

    /// Refuses a `--served-model-name` that could not name a model in the API (empty, only
    /// whitespace, or holding a control character), before any model is loaded.
    pub fn check_served_model_name(&self) -> anyhow::Result<()> {
        if let Some(name) = &self.served_model_name {
            kvmesh_discovery::check_model_name(name)
                .map_err(|why| anyhow::anyhow!("--served-model-name {name:?} {why}"))?;
        }
        Ok(())
    }

    /// The model's id in the API: `--served-model-name`, else `default` (the model folder's
    /// name, or the embedded model's), refused the same way when it could not be one.
    pub fn served_name(&self, default: &str) -> anyhow::Result<String> {
        self.check_served_model_name()?;
        match &self.served_model_name {
            Some(name) => Ok(name.clone()),
            None => {
                kvmesh_discovery::check_model_name(default).map_err(|why| {
                    anyhow::anyhow!(
                        "the model's name {default:?} (its folder's name, the default for \
                         --served-model-name) {why}: name the model with --served-model-name"
                    )
                })?;
                Ok(default.to_string())
            }
        }
    }
}

/// A running engine and what a gateway or worker needs to know about it.
pub struct StartedEngine {
    pub name: String,
    pub tokenizer: Arc<kvmesh_gpu::tokenizer::TextTokenizer>,
    pub handle: engine::EngineHandle,
    pub max_model_len: usize,
    pub device: String,
    pub block_size: usize,
    /// The model's fingerprint (see `LoadedModel::fingerprint`).
    pub fingerprint: String,
    /// The model card this engine's node gives gateways, as JSON (shared by the engines of
    /// one model).
    pub card: Arc<Vec<u8>>,
}

pub fn start_engine(args: &EngineArgs) -> anyhow::Result<StartedEngine> {
    start_engine_with(args, &load_model(args)?)
}

/// The model `--model` names, or the embedded one.
pub fn load_model(args: &EngineArgs) -> anyhow::Result<LoadedModel> {
    args.check_served_model_name()?;
    Ok(match &args.model {
        Some(dir) => {
            LoadedModel::from_dir(dir).with_context(|| format!("loading {}", dir.display()))?
        }
        None => LoadedModel::from_embedded(&kvmesh_gpu::embedded::DEFAULT_MODEL)
            .context("loading the embedded model")?,
    })
}

/// An engine for `model` (loaded once for several engines of one process).
pub fn start_engine_with(args: &EngineArgs, model: &LoadedModel) -> anyhow::Result<StartedEngine> {
    start_engine_on(args, model, None)
}

/// Like [`start_engine_with`], on `pool`'s shared driver threads where one is given (sim
/// replicas: thousands of engines, no thread each) instead of a thread of its own.
pub fn start_engine_on(
    args: &EngineArgs,
    model: &LoadedModel,
    pool: Option<&engine::EnginePool>,
) -> anyhow::Result<StartedEngine> {
    let mut cfg = args.engine_config()?;
    let mut kind = args.backend_kind()?;
    match (&mut kind, args.sm_partition) {
        (BackendKind::Cuda(cuda), part) => {
            cuda.reserve_tokens = args.max_num_batched_tokens;
            cuda.reserve_rows = args.max_num_seqs;
            cuda.sm_partition = part;
            cuda.kv_exportable = args.kv_exportable;
            cuda.kv_one_allocation = args.kv_for_ucx;
        }
        (_, Some(p)) => anyhow::bail!(
            "--sm-split {} splits a CUDA GPU's SMs between the prefill and decode engines, and \
             --device {} runs them on the CPU: give a CUDA device, or leave --sm-split out",
            p.split,
            args.device
        ),
        _ if args.kv_exportable => anyhow::bail!(
            "--kv-transport cuda-ipc has prefill nodes copy KV into this decode node's cache on \
             its GPU, and --device {} runs it on the CPU: give a CUDA device, or another \
             --kv-transport",
            args.device
        ),
        _ => {}
    }
    if let Some(t) = args.threads {
        // A node with two engines (prefill and decode roles) shares one compute pool.
        static POOL: std::sync::Once = std::sync::Once::new();
        let mut built = Ok(());
        POOL.call_once(|| {
            built = rayon::ThreadPoolBuilder::new()
                .num_threads(t)
                .build_global();
        });
        built.context("--threads")?;
    }
    let name = args.served_name(&model.name)?;
    let fingerprint = model.fingerprint(args.numerics());
    let budget = args.kv_budget(&kind)?;
    let backend = build_backend_for(kind, model, budget, &cfg)?;
    let num_blocks = backend.num_blocks();
    let max_model_len = args.max_model_len(model.config.max_context(), num_blocks)?;
    cfg.max_model_len = max_model_len;
    let device = backend.device();
    let (eos, vocab) = (model.tokenizer.eos_ids().to_vec(), model.config.vocab_size);
    let handle = match pool {
        Some(pool) => pool.spawn(backend, cfg, eos, vocab),
        None => engine::spawn(backend, cfg, eos, vocab),
    }
    .with_guides(Arc::new(LazyGuides::new(
        model.tokenizer.clone(),
        model.config.vocab_size,
    )));
    tracing::info!(
        "model {name} ({}, {:.1}M parameters) on {device}; KV cache {num_blocks} blocks of {} tokens; max model length {max_model_len}",
        model.config.arch.architecture_name(),
        model.config.num_params() as f64 / 1e6,
        args.block_size,
    );
    let card = model.derived_bytes(
        &format!(
            "card {:?} {name} {max_model_len} {}",
            args.numerics(),
            args.block_size
        ),
        || {
            Ok(ModelCard::of(
                model,
                args.numerics(),
                &name,
                max_model_len,
                args.block_size,
                None,
            )?
            .to_bytes())
        },
    )?;
    Ok(StartedEngine {
        name,
        tokenizer: model.tokenizer.clone(),
        handle,
        max_model_len,
        device,
        block_size: args.block_size,
        card,
        fingerprint,
    })
}

/// Every 10 seconds while there is work, one line of throughput and load, as vLLM logs it.
pub async fn log_throughput(engine: kvmesh_gpu::engine::EngineHandle) {
    use std::sync::atomic::Ordering::Relaxed;
    let s = engine.stats.clone();
    let period = std::time::Duration::from_secs(10);
    let mut last = (
        s.prompt_tokens.load(Relaxed),
        s.generation_tokens.load(Relaxed),
    );
    loop {
        tokio::time::sleep(period).await;
        let now = (
            s.prompt_tokens.load(Relaxed),
            s.generation_tokens.load(Relaxed),
        );
        let (running, waiting) = (s.running.load(Relaxed), s.waiting.load(Relaxed));
        if now != last || running > 0 || waiting > 0 {
            let free = s.free_blocks.load(Relaxed) as f64;
            let total = engine.info.num_blocks.max(1) as f64;
            tracing::info!(
                "prompt throughput {:.1} tokens/s, generation throughput {:.1} tokens/s, running {running}, waiting {waiting}, KV cache usage {:.1}%",
                (now.0 - last.0) as f64 / period.as_secs_f64(),
                (now.1 - last.1) as f64 / period.as_secs_f64(),
                100.0 * (1.0 - free / total),
            );
        }
        last = now;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(name: Option<&str>) -> EngineArgs {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            engine: EngineArgs,
        }
        let mut cli = <Cli as clap::Parser>::parse_from(["kvmesh"]);
        cli.engine.served_model_name = name.map(String::from);
        cli.engine
    }

    #[test]
    fn the_kv_budget_follows_the_flags_and_the_device() {
        let cuda = BackendKind::Cuda(kvmesh_gpu::backend::CudaOptions::device(0));
        let cpu = resolve_device("cpu").unwrap();
        let mut a = args(None);
        assert_eq!(a.kv_budget(&cpu).unwrap(), KvBudget::Bytes(1 << 30));
        assert_eq!(a.kv_budget(&cuda).unwrap(), KvBudget::Share(0.9));
        a.gpu_memory_utilization = 0.5;
        assert_eq!(a.kv_budget(&cuda).unwrap(), KvBudget::Share(0.5));
        a.gpu_memory_utilization = 1.5;
        let e = a.kv_budget(&cuda).unwrap_err().to_string();
        assert!(e.contains("--gpu-memory-utilization 1.5"), "{e}");
        // Explicit sizes win on every device.
        a.kv_cache_gib = Some(0.25);
        assert_eq!(a.kv_budget(&cuda).unwrap(), KvBudget::Bytes(1 << 28));
        a.num_kv_blocks = Some(7);
        assert_eq!(a.kv_budget(&cpu).unwrap(), KvBudget::Blocks(7));
        a.num_kv_blocks = None;
        a.kv_cache_gib = Some(-1.0);
        let e = a.kv_budget(&cpu).unwrap_err().to_string();
        assert!(e.contains("--kv-cache-gib -1"), "{e}");
    }

    #[test]
    fn cpu_bf16_products_reach_the_cpu_backend_and_are_refused_elsewhere() {
        let mut a = args(None);
        a.device = "cpu".into();
        let kind = a.backend_kind().unwrap();
        assert!(matches!(kind, BackendKind::Cpu(o) if !o.bf16_products));
        a.cpu_bf16_products = true;
        let kind = a.backend_kind().unwrap();
        assert!(matches!(kind, BackendKind::Cpu(o) if o.bf16_products));
        a.backend = BackendArg::Sim;
        a.device = "auto".into();
        let e = a.backend_kind().unwrap_err().to_string();
        assert!(
            e.contains("--cpu-bf16-products") && e.contains("sim"),
            "{e}"
        );
    }

    #[test]
    fn cuda_options_are_refused_where_no_cuda_backend_runs() {
        let mut a = args(None);
        a.device = "cpu".into();
        a.cuda_options = Some("fuse-rope".into());
        let e = a.backend_kind().unwrap_err().to_string();
        assert!(
            e.contains("--cuda-options") && e.contains("--device cpu"),
            "{e}"
        );
        a.backend = BackendArg::Sim;
        a.device = "auto".into();
        let e = a.backend_kind().unwrap_err().to_string();
        assert!(e.contains("--cuda-options") && e.contains("sim"), "{e}");
        // Without the flag both run.
        a.cuda_options = None;
        assert!(matches!(a.backend_kind().unwrap(), BackendKind::Sim(_)));
    }

    #[test]
    fn engine_limits_follow_the_flags_and_refuse_zeros() {
        let a = args(None);
        let cfg = a.engine_config().unwrap();
        let d = EngineConfig::default();
        assert_eq!(
            (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.block_size),
            (d.max_num_seqs, d.max_num_batched_tokens, d.block_size)
        );
        assert!(cfg.enable_prefix_caching);
        let mut off = args(None);
        off.no_enable_prefix_caching = true;
        assert!(!off.engine_config().unwrap().enable_prefix_caching);
        for (flag, set) in [
            (
                "--block-size",
                (|a: &mut EngineArgs| a.block_size = 0) as fn(&mut EngineArgs),
            ),
            ("--max-num-seqs", |a| a.max_num_seqs = 0),
            ("--max-num-batched-tokens", |a| a.max_num_batched_tokens = 0),
        ] {
            let mut a = args(None);
            set(&mut a);
            let e = a.engine_config().unwrap_err().to_string();
            assert_eq!(e, format!("{flag} must be positive"));
        }
    }

    #[test]
    fn the_model_length_fits_the_model_and_the_cache() {
        let mut a = args(None);
        a.block_size = 16;
        // Without the flag: the shorter of the model's context and the cache.
        assert_eq!(a.max_model_len(4096, 1000).unwrap(), 4096);
        assert_eq!(a.max_model_len(4096, 10).unwrap(), 160);
        a.max_model_len = Some(100);
        assert_eq!(a.max_model_len(4096, 10).unwrap(), 100);
        for (n, want) in [
            (0, "--max-model-len must be positive".to_string()),
            (
                5000,
                "--max-model-len 5000 is longer than the model's context of 4096 tokens".into(),
            ),
            (
                200,
                "--max-model-len 200 does not fit the KV cache (160 tokens in 10 blocks); \
                 raise --kv-cache-gib or lower --max-model-len"
                    .into(),
            ),
        ] {
            a.max_model_len = Some(n);
            assert_eq!(a.max_model_len(4096, 10).unwrap_err().to_string(), want);
        }
    }

    #[test]
    fn served_model_names_are_checked_before_loading() {
        assert_eq!(args(Some("tiny")).served_name("folder").unwrap(), "tiny");
        assert_eq!(args(None).served_name("folder").unwrap(), "folder");
        for (name, why) in [
            ("", "must not be empty"),
            (" \t", "contains a control character (U+0009) at byte 1"),
            ("   ", "must not be only whitespace"),
            ("tiny\nx", "contains a control character (U+000A) at byte 4"),
            ("a\0", "contains a control character (U+0000) at byte 1"),
        ] {
            let a = args(Some(name));
            for e in [
                a.check_served_model_name().unwrap_err(),
                a.served_name("folder").unwrap_err(),
                // Refused before the model is read, not after.
                load_model(&a).err().unwrap(),
            ] {
                let e = e.to_string();
                assert!(
                    e.starts_with("--served-model-name") && e.ends_with(why),
                    "{e}"
                );
            }
        }
        // A folder whose name cannot be served needs the flag.
        let e = args(None)
            .served_name("new\nmodel")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("folder's name")
                && e.contains("--served-model-name")
                && e.contains("U+000A"),
            "{e}"
        );
        assert_eq!(args(Some("ok")).served_name("new\nmodel").unwrap(), "ok");
    }
}
