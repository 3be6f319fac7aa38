//! CUDA engine benchmark: decode time per output token at several batch sizes and prefill
//! tokens/s, beside the device-to-device copy bandwidth measured in the same run.
//!
//! Batch-1 decode streams every weight from device memory once per token, so it can go no
//! faster than `weight bytes per step / memory bandwidth`; the table says what fraction of
//! the measured copy bandwidth a batch-1 step achieves. The models are random-weight bf16
//! checkpoints with the shapes of Qwen2.5-0.5B and Llama-3.2-1B (speed does not depend on
//! the weights' values), made once under `target/bench-models/<preset>`;
//! `scripts/hf_peer_bench.py` runs the same folders in Hugging Face transformers for a
//! side-by-side comparison.
//!
//! Pure decode steps replay CUDA graphs unless `--enforce-eager`; run once each way (with
//! different `--json` paths) to see what the graphs buy.
//!
//! A hybrid preset (`qwen3.5-9b`: Gated DeltaNet and gated attention) runs on the hybrid
//! backend, every sequence with a recurrent-state slot; its batch-1 bound counts the state
//! a step reads and writes beside the weights.
//!
//! `cargo build --release --features cuda --bin gpu-bench`, then on the GPU machine
//! `target/release/gpu-bench [--presets qwen2.5-0.5b,llama-3.2-1b] [--json PATH]`
//! (`--help` lists every flag). The JSON goes to `bench/results/gpu-<device name>.json`
//! unless `--json` says otherwise.

use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Parser;
use kvmesh_bench::compute::prefill_flops;
use kvmesh_bench::programs::write_json;
use kvmesh_gpu::backend::cuda::{CudaBackend, CudaHybridBackend};
use kvmesh_gpu::backend::sm_split::{SmPartition, SmSide, SmSplit};
use kvmesh_gpu::backend::{CudaOptions, ForwardBatch, KvBudget, Pdl, SampleSpec, SeqInput};
use kvmesh_gpu::config::ModelConfig;
use kvmesh_gpu::init::{
    preset, random_fp8_in_memory, write_random_checkpoint, write_random_fp8_checkpoint,
};
use kvmesh_gpu::kv_cache::BlockId;
use kvmesh_gpu::model::LoadedModel;
use kvmesh_gpu::safetensors::{DType, WeightStore};
use kvmesh_gpu::sampler::{Rng, SamplingParams};

const BLOCK_SIZE: usize = 16;

#[path = "gpu_bench/concurrency.rs"]
mod concurrency;
#[path = "gpu_bench/gpu.rs"]
mod gpu;
use gpu::Gpu;
#[path = "gpu_bench/kv.rs"]
mod kv;
#[path = "gpu_bench/products.rs"]
mod products;
use kv::{kv_capacity, kv_json, kv_line, KvCapacity};

/// CUDA engine benchmark: decode time per output token at several batch sizes and prefill
/// tokens/s, beside the device-to-device copy bandwidth measured in the same run.
#[derive(Parser)]
#[command(name = "gpu-bench")]
struct Args {
    /// Make `-fp8` presets' checkpoints in memory and never write them (a checkpoint larger
    /// than the disk: Qwen2.5-72B's 73 GB).
    #[arg(long)]
    in_memory: bool,
    /// Where the random-weight checkpoints are made (once) and found.
    #[arg(long, value_name = "DIR", default_value = "target/bench-models")]
    models_dir: PathBuf,
    /// Model shapes to measure, comma-separated (presets of `kvmesh model init-random`; a
    /// `-fp8` suffix, e.g. `qwen3-32b-fp8`, measures the shape as an FP8 checkpoint).
    #[arg(long, value_delimiter = ',', value_parser = trimmed::<String>,
          default_value = "qwen2.5-0.5b,llama-3.2-1b")]
    presets: Vec<String>,
    /// Where the results go [default: bench/results/gpu-<device name>.json]
    #[arg(long, value_name = "PATH")]
    json: Option<PathBuf>,
    /// The CUDA device's ordinal.
    #[arg(long, value_name = "N", default_value_t = 0)]
    device: usize,
    /// Launch every step eagerly: no CUDA graphs for decode steps.
    #[arg(long)]
    enforce_eager: bool,
    /// Products of at most this many rows go to the engine's skinny kernels, the rest to
    /// cuBLAS; 0 sends all to cuBLAS [default: the engine's]. Kernels exist up to 8 rows.
    #[arg(long, value_name = "N")]
    skinny_max_rows: Option<usize>,
    /// Decode attention one block per head, the history unsplit (the engine splits it at
    /// small batches; see `CudaOptions::split_decode`).
    #[arg(long)]
    no_split_decode: bool,
    /// Programmatic dependent launch: auto (the engine's choice by model size), on or off
    /// (see `CudaOptions::pdl`).
    #[arg(long, value_name = "auto|on|off", default_value = "auto")]
    pdl: Pdl,
    /// Decode steps of 1–2 rows run the residual adds and norms as the next product's
    /// prologue (see `CudaOptions::fuse_norms`).
    #[arg(long)]
    fuse_norms: bool,
    /// Decode steps of few rows normalise (q/k norms) and rotate q and k and write the new
    /// K/V in the q/k/v product's epilogue (see `CudaOptions::fuse_rope`).
    #[arg(long)]
    fuse_rope: bool,
    /// Steps with prompts run a hybrid model's Gated DeltaNet layers through the scan path
    /// (see `CudaOptions::gdn_scan`).
    #[arg(long)]
    gdn_scan: bool,
    /// Steps with prompts run the Gated DeltaNet recurrence in the chunked form inside the
    /// scan path (see `CudaOptions::gdn_chunked`).
    #[arg(long)]
    gdn_chunked: bool,
    /// FP8 prefill GEMMs write f32 straight into the product's columns where cuBLASLt can
    /// (see `CudaOptions::fp8_f32_out`).
    #[arg(long)]
    fp8_f32_out: bool,
    /// FP8 products of 1 to 16 rows run on the tensor cores (see `CudaOptions::fp8_mma`).
    #[arg(long)]
    fp8_mma: bool,
    /// Steps with prompts of up to 512 tokens replay piecewise CUDA graphs (see
    /// `CudaOptions::prefill_graphs`).
    #[arg(long)]
    prefill_graphs: bool,
    /// Run on one side of an SM split (a green context), e.g. `prefill:96,decode:36` or
    /// `0.75` (prefill's share); `--sm-side` says which side is measured.
    #[arg(long, value_name = "SPLIT", requires = "sm_side")]
    sm_split: Option<SmSplit>,
    /// The side of `--sm-split` measured: prefill or decode.
    #[arg(long, value_name = "prefill|decode", value_parser = sm_side, requires = "sm_split")]
    sm_side: Option<SmSide>,
    /// Decode batch sizes to measure, comma-separated.
    #[arg(long, value_delimiter = ',', value_parser = trimmed::<usize>,
          default_value = "1,8,32,64,128,256")]
    batches: Vec<usize>,
    /// Tokens of history each decoding sequence has.
    #[arg(long, value_name = "N", default_value_t = 128)]
    prompt_len: usize,
    /// Decode steps run before the measured ones.
    #[arg(long, value_name = "N", default_value_t = 3)]
    warmup: usize,
    /// Decode steps measured per batch size (the median counts).
    #[arg(long, value_name = "N", default_value_t = 20)]
    decode_steps: usize,
    /// Batch sizes whose decode is measured again with sampling (temperature 0.7, top-k 20,
    /// top-p 0.8: Qwen2.5's generation defaults), comma-separated; `0` for none.
    #[arg(long, value_delimiter = ',', value_parser = trimmed::<usize>,
          default_value = "1,32,128")]
    sampled_batches: Vec<usize>,
    /// Prefill lengths to measure, comma-separated.
    #[arg(long, value_delimiter = ',', value_parser = trimmed::<usize>,
          default_value = "512,2048,8192")]
    prefill_lens: Vec<usize>,
    /// Prefill throughput when this many prompts arrive at once, comma-separated (see
    /// `concurrency`); `0` for none.
    #[arg(long, value_delimiter = ',', value_parser = trimmed::<usize>, default_value = "0")]
    prefill_concurrency: Vec<usize>,
    /// Tokens of each prompt of `--prefill-concurrency`.
    #[arg(long, value_name = "N", default_value_t = 128)]
    concurrency_prompt_len: usize,
    /// Most tokens a step of `--prefill-concurrency` runs (the engine's default
    /// `--max-num-batched-tokens`); prompts are never split.
    #[arg(long, value_name = "N", default_value_t = 8192)]
    concurrency_step_tokens: usize,
    /// Rows at which each kind of a dense model's decode products is timed alone and over
    /// every layer back to back, comma-separated (`0` for none): where a small batch's step
    /// goes between the weights' bandwidth and each launch's fixed cost.
    #[arg(long, value_delimiter = ',', value_parser = trimmed::<usize>, default_value = "0")]
    product_sweep: Vec<usize>,
    /// Measured prefills per length, after one warm-up (the median counts).
    #[arg(long, value_name = "N", default_value_t = 3)]
    prefill_reps: usize,
    /// Most tokens one step runs while filling the decode sequences' histories, so the
    /// activations of that fill stay the size of the largest measured prefill.
    #[arg(long, value_name = "N", default_value_t = 2048)]
    fill_chunk: usize,
    /// Size of the buffer the copy bandwidth is measured with, in MiB.
    #[arg(long, value_name = "N", default_value_t = 1024)]
    copy_mib: usize,
    /// Copies of that buffer; the best counts.
    #[arg(long, value_name = "N", default_value_t = 10)]
    copy_reps: usize,
    /// The square GEMM (m = n = k) whose bf16 tensor-core throughput prefill is compared
    /// against; 0 skips it.
    #[arg(long, value_name = "N", default_value_t = 8192)]
    gemm_size: usize,
    /// Time only the Gated DeltaNet kernels of the presets' linear layers (hybrid presets,
    /// e.g. qwen3.5-9b), one layer per case, for `scripts/fla_peer_bench.py`; `--prefill-reps`
    /// (at least 10 here) runs per case.
    #[arg(long)]
    gated_deltanet: bool,
    /// Share of the device's memory the KV capacity is reported at (the engine's default
    /// `--gpu-memory-utilization`).
    #[arg(long, value_name = "F", default_value_t = 0.9)]
    memory_share: f64,
}

impl Args {
    fn skinny_rows(&self) -> usize {
        self.skinny_max_rows
            .unwrap_or(kvmesh_gpu::backend::SKINNY_MAX_ROWS)
    }

    fn sm_partition(&self) -> Option<SmPartition> {
        Some(SmPartition {
            split: self.sm_split?,
            side: self.sm_side?,
        })
    }
}

/// `--sm-side`.
fn sm_side(s: &str) -> Result<SmSide, String> {
    match s {
        "prefill" => Ok(SmSide::Prefill),
        "decode" => Ok(SmSide::Decode),
        _ => Err(format!("`{s}` is not prefill or decode")),
    }
}

/// Which products the skinny kernels take, for the report.
fn skinny_line(rows: usize) -> String {
    match rows {
        0 => "every product by cuBLAS (--skinny-max-rows 0)".into(),
        n => format!("products of <= {n} rows by the skinny kernels, larger by cuBLAS"),
    }
}

/// A list item with the spaces around it dropped (`--batches "1, 8"`).
fn trimmed<T: std::str::FromStr>(s: &str) -> Result<T, T::Err> {
    s.trim().parse()
}

fn parse_args() -> anyhow::Result<Args> {
    let a = Args::parse();
    anyhow::ensure!(
        a.decode_steps > 0 && a.prefill_reps > 0 && a.copy_reps > 0,
        "--decode-steps, --prefill-reps and --copy-reps must be at least 1"
    );
    anyhow::ensure!(
        a.prompt_len > 0 && a.fill_chunk > 0,
        "--prompt-len and --fill-chunk must be at least 1"
    );
    Ok(a)
}

/// The device name as a file-name fragment: lower case, runs of anything but ASCII letters
/// and digits folded to one `-`. `scripts/hf_peer_bench.py` applies the same rule so the two
/// result files sit side by side.
fn sanitize(name: &str) -> String {
    let mut out = String::new();
    for c in name.chars() {
        if c.is_ascii_alphanumeric() {
            out.push(c.to_ascii_lowercase());
        } else if !out.is_empty() && !out.ends_with('-') {
            out.push('-');
        }
    }
    while out.ends_with('-') {
        out.pop();
    }
    if out.is_empty() {
        out.push_str("unknown");
    }
    out
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The checkpoint folder for `name`, written with random weights the first time: a preset's
/// shape in bf16, or with `-fp8` after the name, as an FP8 checkpoint in Qwen's published
/// format (block-scaled e4m3 linear layers), quantized here from the same random values.
fn checkpoint(models_dir: &Path, name: &str) -> anyhow::Result<PathBuf> {
    let d = models_dir.join(name);
    if !d.join("model.safetensors").exists() {
        let (shape, fp8) = match name.strip_suffix("-fp8") {
            Some(base) => (base, true),
            None => (name, false),
        };
        let kind = if fp8 {
            "FP8 (block-scaled e4m3)"
        } else {
            "bf16"
        };
        eprintln!(
            "making a {shape}-shaped random {kind} checkpoint in {}",
            d.display()
        );
        let tokenizer = kvmesh_gpu::embedded::default_tokenizer();
        let cfg = preset(None, shape)?;
        if fp8 {
            write_random_fp8_checkpoint(cfg, 0, &tokenizer, &d)?;
        } else {
            write_random_checkpoint(cfg, 0, DType::BF16, &tokenizer, &d)?;
        }
    }
    Ok(d)
}

/// The config and weights of preset `name`: a checkpoint folder (made the first time), or
/// with `--in-memory` an FP8 checkpoint made in memory and never written.
fn model(args: &Args, name: &str) -> anyhow::Result<(ModelConfig, WeightStore, PathBuf)> {
    if args.in_memory {
        let shape = name.strip_suffix("-fp8").ok_or_else(|| {
            anyhow::anyhow!("--in-memory makes FP8 checkpoints: name the preset {name}-fp8")
        })?;
        eprintln!("making a {shape}-shaped random FP8 checkpoint in memory");
        let tokenizer = kvmesh_gpu::embedded::default_tokenizer();
        let (cfg, w) = random_fp8_in_memory(preset(None, shape)?, 0, &tokenizer)?;
        return Ok((cfg, w, PathBuf::from(format!("(in memory) {name}"))));
    }
    let dir = checkpoint(&args.models_dir, name)?;
    let m = LoadedModel::from_dir(&dir)?;
    let cfg = m.config.clone();
    Ok((cfg, m.weights, dir))
}

/// Greedy sampling, which the CUDA backend does on the device: a step copies back one token
/// and one logprob per sequence, as the engine's greedy requests do.
fn greedy() -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        ..SamplingParams::default()
    }
}

/// Sampling as a chat model's generation config asks for it (Qwen2.5's), also done on the
/// device: the step pays for the top-k and top-p thresholds and the draw.
fn sampled() -> SamplingParams {
    SamplingParams {
        temperature: 0.7,
        top_k: 20,
        top_p: 0.8,
        ..SamplingParams::default()
    }
}

/// One step through `forward_sample`, fenced by device synchronisation on both sides so the
/// host clock measures the step's whole device work plus its host overhead (layout,
/// uploads, launches), which is what a serving loop pays per step. Returns the seconds and
/// the sampled tokens.
fn timed_step(
    backend: &mut Gpu,
    batch: &ForwardBatch,
    rngs: &mut [Rng],
    params: &SamplingParams,
) -> anyhow::Result<(f64, Vec<u32>)> {
    let wanted = batch.seqs.iter().filter(|s| s.want_logits).count();
    let mut specs: Vec<SampleSpec> = rngs
        .iter_mut()
        .take(wanted)
        .map(|rng| SampleSpec {
            params,
            rng,
            mask: None,
        })
        .collect();
    backend.measure().synchronize()?;
    let t = Instant::now();
    let out = backend.backend().forward_sample(batch, &mut specs)?;
    backend.measure().synchronize()?;
    let secs = t.elapsed().as_secs_f64();
    Ok((secs, out.into_iter().map(|s| s.token).collect()))
}

struct ModelResult {
    json: serde_json::Value,
    table: Vec<String>,
}

/// A model loaded onto the device, and what its measured steps need.
struct Runner<'a> {
    args: &'a Args,
    name: &'a str,
    backend: Gpu,
    rngs: Vec<Rng>,
    vocab: u32,
    /// KV blocks each decoding sequence owns.
    per_seq_blocks: usize,
}

impl Runner<'_> {
    /// The `i`th token of a synthetic prompt.
    fn token(&self, i: usize) -> u32 {
        ((i * 7919 + 13) as u32) % self.vocab.min(2000)
    }

    /// Prefill: one sequence, one step, per `--prefill-lens`; the first run warms cuBLAS's
    /// heuristics and grows the workspace, the median of the rest is reported. (length,
    /// seconds) each.
    fn prefill(&mut self) -> anyhow::Result<Vec<(usize, f64)>> {
        let mut prefill = Vec::new();
        for &len in &self.args.prefill_lens {
            if len == 0 {
                continue;
            }
            let prompt: Vec<u32> = (0..len).map(|i| self.token(i)).collect();
            let table: Vec<BlockId> = (0..len.div_ceil(BLOCK_SIZE))
                .map(|b| BlockId(b as u32))
                .collect();
            let batch = ForwardBatch {
                seqs: vec![SeqInput {
                    tokens: &prompt,
                    start_pos: 0,
                    context_len: 0,
                    block_table: &table,
                    want_logits: true,
                    state_slot: self.backend.slot(0),
                }],
            };
            let greedy = greedy();
            timed_step(&mut self.backend, &batch, &mut self.rngs, &greedy)?;
            let mut times = Vec::new();
            for _ in 0..self.args.prefill_reps {
                times.push(timed_step(&mut self.backend, &batch, &mut self.rngs, &greedy)?.0);
            }
            let secs = median(times);
            eprintln!("{}: prefill {len} tokens {:.1} ms", self.name, secs * 1e3);
            prefill.push((len, secs));
        }
        Ok(prefill)
    }

    /// Decode at every `--batches` size, greedy (and sampled at `--sampled-batches`): the
    /// seconds per step, the device's seconds over the step's graph, and the sampled steps'.
    #[allow(clippy::type_complexity)]
    fn decode_batches(
        &mut self,
    ) -> anyhow::Result<(Vec<(usize, f64)>, Vec<(usize, f64)>, Vec<(usize, f64)>)> {
        let (mut decode, mut graphs, mut sampled_steps) = (Vec::new(), Vec::new(), Vec::new());
        self.backend.time_graph_replays()?;
        let (args, name) = (self.args, self.name);
        for &b in args.batches.iter().filter(|&&b| b > 0) {
            let (step, graph) = self.decode(b, &greedy())?;
            eprintln!("{name}: batch {b} decode {:.2} ms/step", step * 1e3);
            decode.push((b, step));
            graphs.extend(graph.map(|g| (b, g)));
            if args.sampled_batches.contains(&b) {
                let (step, _) = self.decode(b, &sampled())?;
                eprintln!("{name}: batch {b} sampled decode {:.2} ms/step", step * 1e3);
                sampled_steps.push((b, step));
            }
        }
        Ok((decode, graphs, sampled_steps))
    }

    /// Median seconds of a decode step of `b` sequences (after filling their histories and
    /// `--warmup` steps), each step sampling on the device with `params`, and the median of
    /// the device's time over the step's CUDA graph alone (`None` when it ran eagerly): the
    /// rest of the step is the host's (layout, uploads, launches), the sampling and the
    /// copy back.
    fn decode(&mut self, b: usize, params: &SamplingParams) -> anyhow::Result<(f64, Option<f64>)> {
        let args = self.args;
        let tables: Vec<Vec<BlockId>> = (0..b)
            .map(|s| {
                (0..self.per_seq_blocks)
                    .map(|k| BlockId((s * self.per_seq_blocks + k) as u32))
                    .collect()
            })
            .collect();
        let prompts: Vec<Vec<u32>> = (0..b)
            .map(|s| (0..args.prompt_len).map(|i| self.token(i + s)).collect())
            .collect();
        // Fill every sequence's history, several sequences per step but no more than
        // `fill_chunk` tokens in a step.
        let per_fill = (args.fill_chunk / args.prompt_len).max(1);
        let mut s0 = 0;
        while s0 < b {
            let s1 = (s0 + per_fill).min(b);
            let batch = ForwardBatch {
                seqs: (s0..s1)
                    .map(|s| SeqInput {
                        tokens: &prompts[s],
                        start_pos: 0,
                        context_len: 0,
                        block_table: &tables[s],
                        want_logits: false,
                        state_slot: self.backend.slot(s),
                    })
                    .collect(),
            };
            timed_step(&mut self.backend, &batch, &mut self.rngs, params)?;
            s0 = s1;
        }
        // Each sequence's next input is its last prompt token, then what it sampled.
        let mut last: Vec<u32> = prompts
            .iter()
            .map(|p| p.last().copied().unwrap_or(0))
            .collect();
        let mut times = Vec::new();
        let mut graph_times = Vec::new();
        for step in 0..args.warmup + args.decode_steps {
            let toks: Vec<[u32; 1]> = last.iter().map(|&t| [t % self.vocab]).collect();
            let batch = ForwardBatch {
                seqs: (0..b)
                    .map(|s| SeqInput {
                        tokens: &toks[s],
                        start_pos: args.prompt_len + step,
                        context_len: 0,
                        block_table: &tables[s],
                        want_logits: true,
                        state_slot: self.backend.slot(s),
                    })
                    .collect(),
            };
            let (secs, sampled) = timed_step(&mut self.backend, &batch, &mut self.rngs, params)?;
            anyhow::ensure!(
                sampled.len() == b,
                "a decode step of {b} sequences returned {} tokens",
                sampled.len()
            );
            last = sampled;
            let graph = self.backend.last_graph_replay_secs()?;
            if step >= args.warmup {
                times.push(secs);
                graph_times.extend(graph);
            }
        }
        // Every measured step replayed, or the figure would mix steps.
        let graph = (graph_times.len() == times.len()).then(|| median(graph_times));
        Ok((median(times), graph))
    }
}

/// What is measured once per run, on the first model's device.
#[derive(Default)]
struct DeviceFigures {
    name: Option<String>,
    /// Device-to-device copy bandwidth, bytes/s.
    copy_bw: Option<f64>,
    /// bf16 GEMM throughput, FLOP/s (`--gemm-size`).
    gemm: Option<f64>,
}

/// What was measured for one model.
struct Figures {
    /// Bytes one batch-1 step must move: its weights, and a hybrid model's recurrent state
    /// read and written back.
    step_bytes: usize,
    /// Of those, the recurrent state's (read and write; 0 for a dense model).
    state_bytes: usize,
    /// Device-to-device copy bandwidth, bytes/s.
    bw: f64,
    gemm: Option<f64>,
    kv: KvCapacity,
    /// Read after the runs: a failed capture switches graphs off mid-run.
    cuda_graphs: bool,
    /// Whether steps with prompts replayed piecewise graphs (read after the runs too).
    prefill_graphs: bool,
    /// (prompt length, seconds)
    prefill: Vec<(usize, f64)>,
    /// (batch, seconds per step)
    decode: Vec<(usize, f64)>,
    /// (batch, the device's seconds over the step's CUDA graph), where it replayed one
    decode_graph: Vec<(usize, f64)>,
    /// (batch, seconds per step) with [`sampled`]'s parameters
    decode_sampled: Vec<(usize, f64)>,
    prefill_concurrency: Vec<concurrency::Concurrency>,
    /// `--product-sweep`'s timings (dense models).
    products: Vec<kvmesh_gpu::backend::cuda::ProductTiming>,
}

impl Figures {
    /// Seconds a batch-1 step takes at best: its weights read once at the copy bandwidth.
    fn bound_step(&self) -> f64 {
        self.step_bytes as f64 / self.bw
    }
}

/// One model's table lines and JSON.
/// The decode settings a run measured, as its table states them.
fn decode_line(args: &Args, cuda_graphs: bool) -> String {
    format!(
        "decode       CUDA graphs {} (--enforce-eager turns them off); {}{}{}{}{}{}",
        if cuda_graphs { "on" } else { "off" },
        skinny_line(args.skinny_rows()),
        if args.no_split_decode {
            "; decode attention unsplit"
        } else {
            "; decode attention split over the history at small batches"
        },
        match args.pdl {
            Pdl::Auto => "",
            Pdl::On => "; programmatic dependent launch on",
            Pdl::Off => "; programmatic dependent launch off",
        },
        if args.fuse_norms {
            "; norms fused into the products at 1-2 rows"
        } else {
            ""
        },
        if args.fuse_rope {
            "; rotary embedding and K/V write fused into the q/k/v product"
        } else {
            ""
        },
        if args.fp8_mma {
            "; FP8 products of 1-16 rows on the tensor cores"
        } else {
            ""
        }
    ) + &match args.sm_partition() {
        Some(p) => format!("; on the {:?} side of --sm-split {}", p.side, p.split),
        None => String::new(),
    }
}

/// The prefill table's lines and JSON, per length.
fn prefill_rows(cfg: &ModelConfig, f: &Figures) -> (Vec<String>, Vec<serde_json::Value>) {
    let (mut lines, mut json_prefill) = (Vec::new(), Vec::new());
    for &(len, secs) in &f.prefill {
        let flops = prefill_flops(cfg, len);
        let share = f.gemm.map(|peak| flops / secs / peak);
        let share_2p = f
            .gemm
            .map(|peak| 2.0 * cfg.num_params() as f64 * len as f64 / secs / peak);
        lines.push(format!(
            "prefill      {len} tokens in {:.1} ms = {:.0} tokens/s, {:.0} TFLOP/s{}",
            secs * 1e3,
            len as f64 / secs,
            flops / secs / 1e12,
            share.map_or(String::new(), |x| format!(
                " = {:.1}% of the GEMM peak",
                x * 100.0
            ))
        ));
        json_prefill.push(serde_json::json!({
            "tokens": len,
            "ms": secs * 1e3,
            "tokens_per_s": len as f64 / secs,
            "model_flops": flops,
            "model_tflop_per_s": flops / secs / 1e12,
            "share_of_gemm_peak": share,
            "share_of_gemm_peak_2x_params": share_2p,
        }));
    }
    (lines, json_prefill)
}

fn summarise(args: &Args, name: &str, dir: &Path, cfg: &ModelConfig, f: &Figures) -> ModelResult {
    let gb = 1e9;
    let mut table = vec![
        format!(
            "model        {} ({}, {:.0}M parameters)",
            dir.display(),
            cfg.arch.architecture_name(),
            cfg.num_params() as f64 / 1e6
        ),
        format!(
            "weights/step {:.3} GB (bf16 on the device){} -> bound {:.3} ms/token at batch 1",
            (f.step_bytes - f.state_bytes) as f64 / gb,
            if f.state_bytes > 0 {
                format!(
                    " + recurrent state {:.1} MB (read and written)",
                    f.state_bytes as f64 / 1e6
                )
            } else {
                String::new()
            },
            f.bound_step() * 1e3
        ),
        decode_line(args, f.cuda_graphs),
        format!(
            "{:>8} {:>12} {:>12} {:>14} {:>12} {:>12}",
            "batch", "ms/step", "tokens/s", "bw utilisation", "sampled ms", "graph ms"
        ),
    ];
    let mut json_decode = Vec::new();
    let mut util1 = None;
    for &(b, step) in &f.decode {
        // Weight traffic only: at larger batches the KV reads add to it, and the step is
        // no longer bound by the weights alone, so this is a lower bound on the traffic.
        let util = f.step_bytes as f64 / step / f.bw;
        if b == 1 {
            util1 = Some(util);
        }
        let at = |v: &[(usize, f64)]| v.iter().find(|&&(x, _)| x == b).map(|&(_, s)| s * 1e3);
        let (sampled, graph) = (at(&f.decode_sampled), at(&f.decode_graph));
        let ms = |v: Option<f64>| v.map_or("-".into(), |ms| format!("{ms:.3}"));
        table.push(format!(
            "{:>8} {:>12.3} {:>12.1} {:>13.1}% {:>12} {:>12}",
            b,
            step * 1e3,
            b as f64 / step,
            util * 100.0,
            ms(sampled),
            ms(graph)
        ));
        json_decode.push(serde_json::json!({
            "batch": b,
            "ms_per_step": step * 1e3,
            "ms_per_output_token_per_sequence": step * 1e3,
            "tokens_per_s": b as f64 / step,
            "weight_bandwidth_utilisation": util,
            "ms_per_step_sampled": sampled,
            "graph_ms_on_device": graph,
        }));
    }
    let (prefill_lines, json_prefill) = prefill_rows(cfg, f);
    table.extend(prefill_lines);
    let (conc_lines, json_conc) = concurrency::summary(&f.prefill_concurrency, f.prefill_graphs);
    table.extend(conc_lines);
    let (product_lines, json_products) = products::summary(&f.products, f.bw);
    table.extend(product_lines);
    table.push(kv_line(&f.kv));
    let json = serde_json::json!({
        "preset": name,
        "model": dir.display().to_string(),
        "architecture": cfg.arch.architecture_name(),
        "parameters": cfg.num_params(),
        "dtype": cfg.quantization.as_ref().map_or_else(|| "bf16".to_string(), |q| q.summary()),
        "kv_block_size": BLOCK_SIZE,
        "cuda_graphs": f.cuda_graphs,
        "skinny_max_rows": args.skinny_rows(),
        "split_decode": !args.no_split_decode,
        "pdl": format!("{:?}", args.pdl).to_lowercase(),
        "fuse_norms": args.fuse_norms,
        "fuse_rope": args.fuse_rope,
        "gdn_scan": args.gdn_scan,
        "gdn_chunked": args.gdn_chunked,
        "fp8_f32_out": args.fp8_f32_out,
        "fp8_mma": args.fp8_mma,
        "prefill_graphs": f.prefill_graphs,
        "sm_split": args.sm_split.map(|s| s.to_string()),
        "sm_side": args.sm_side.map(|s| format!("{s:?}").to_lowercase()),
        "weight_bytes_per_step": f.step_bytes - f.state_bytes,
        "state_bytes_per_step_batch1": f.state_bytes,
        "bound_ms_per_token_batch1": f.bound_step() * 1e3,
        "batch1_bandwidth_utilisation": util1,
        "decode_prompt_tokens": args.prompt_len,
        "decode_warmup_steps": args.warmup,
        "decode_measured_steps": args.decode_steps,
        "sampled_params": {"temperature": 0.7, "top_k": 20, "top_p": 0.8},
        "decode": json_decode,
        "prefill": json_prefill,
        "prefill_concurrency": json_conc,
        "products": json_products,
        "prefill_flops_note": "model_flops: 2 x the linear layers' parameters (not the embedding; the LM head for one row) per token, plus causal attention's 4 x q_dim x (T^2/2) per layer; share_of_gemm_peak_2x_params counts 2 x all parameters per token instead",
        "kv_capacity": kv_json(&f.kv, args.memory_share),
    });
    ModelResult { json, table }
}

fn bench_model(args: &Args, name: &str, dev: &mut DeviceFigures) -> anyhow::Result<ModelResult> {
    let (cfg, weights, dir) = model(args, name)?;
    let max_batch = args.batches.iter().copied().max().unwrap_or(1);
    let max_prefill = args.prefill_lens.iter().copied().max().unwrap_or(0);
    let per_seq_blocks =
        (args.prompt_len + args.warmup + args.decode_steps + 1).div_ceil(BLOCK_SIZE);
    let (conc_seqs, conc_blocks) = concurrency::step_seqs_and_blocks(args);
    let num_blocks = (max_batch * per_seq_blocks)
        .max(max_prefill.div_ceil(BLOCK_SIZE))
        .max(conc_blocks)
        + 1;
    eprintln!(
        "{name}: loading onto cuda:{} with {num_blocks} KV blocks",
        args.device
    );
    let cuda = CudaOptions {
        ordinal: args.device,
        graphs: !args.enforce_eager,
        reserve_tokens: max_prefill
            .max(args.fill_chunk)
            .max(concurrency::step_tokens(args)),
        reserve_rows: max_batch.max(conc_seqs),
        skinny_max_rows: args.skinny_rows(),
        split_decode: !args.no_split_decode,
        pdl: args.pdl,
        fuse_norms: args.fuse_norms,
        fuse_rope: args.fuse_rope,
        gdn_scan: args.gdn_scan,
        gdn_chunked: args.gdn_chunked,
        fp8_f32_out: args.fp8_f32_out,
        fp8_mma: args.fp8_mma,
        prefill_graphs: args.prefill_graphs,
        sm_partition: args.sm_partition(),
        kv_exportable: false,
        kv_one_allocation: false,
    };
    let backend = match cfg.hybrid {
        // A recurrent-state slot for every sequence of the largest batch.
        Some(_) => Gpu::Hybrid(Box::new(CudaHybridBackend::new(
            &cfg,
            &weights,
            cuda,
            KvBudget::Blocks(num_blocks),
            BLOCK_SIZE,
            max_batch.max(conc_seqs).max(1),
            false,
        )?)),
        None => Gpu::Dense(Box::new(CudaBackend::new(
            &cfg,
            &weights,
            cuda,
            KvBudget::Blocks(num_blocks),
            BLOCK_SIZE,
        )?)),
    };
    // The host copy of the weights is no longer needed; free it before the runs.
    drop(weights);
    let device = backend.measure();
    if dev.name.is_none() {
        dev.name = Some(device.device_name()?);
    }
    let bw = match dev.copy_bw {
        Some(b) => b,
        None => {
            eprintln!(
                "measuring device-to-device copy bandwidth ({} MiB buffer)...",
                args.copy_mib
            );
            let b = device.copy_bandwidth(args.copy_mib << 20, args.copy_reps)?;
            dev.copy_bw = Some(b);
            b
        }
    };
    if dev.gemm.is_none() && args.gemm_size > 0 {
        let n = args.gemm_size;
        eprintln!("measuring bf16 GEMM throughput ({n} x {n} x {n})...");
        dev.gemm = Some(device.gemm_flops((n, n, n), args.copy_reps)?);
    }
    let kv = kv_capacity(args, &cfg, &device)?;
    let mut runner = Runner {
        args,
        name,
        backend,
        rngs: (0..max_batch.max(conc_seqs).max(1))
            .map(|s| Rng::seeded(s as u64))
            .collect(),
        vocab: cfg.vocab_size as u32,
        per_seq_blocks,
    };
    let prefill = runner.prefill()?;
    let prefill_concurrency = runner.prefill_concurrency()?;
    let (decode, decode_graph, decode_sampled) = runner.decode_batches()?;
    let mut sweep = Vec::new();
    for &rows in args.product_sweep.iter().filter(|&&r| r > 0) {
        sweep.extend(runner.backend.time_products(rows, args.copy_reps)?);
    }
    let state_bytes = 2 * runner.backend.state_bytes_per_seq();
    let figures = Figures {
        step_bytes: runner.backend.weight_bytes_per_step() + state_bytes,
        state_bytes,
        bw,
        gemm: dev.gemm,
        kv,
        cuda_graphs: runner.backend.cuda_graphs(),
        prefill_graphs: runner.backend.prefill_graphs(),
        prefill,
        decode,
        decode_graph,
        decode_sampled,
        prefill_concurrency,
        products: sweep,
    };
    Ok(summarise(args, name, &dir, &cfg, &figures))
}

fn main() -> anyhow::Result<()> {
    let args = parse_args()?;
    if args.gated_deltanet {
        let path = args
            .json
            .clone()
            .unwrap_or_else(|| PathBuf::from("bench/results/gpu-gdn-kvmesh.json"));
        return kvmesh_bench::delta_peer::run(
            &args.presets,
            args.device,
            args.prefill_reps.max(10),
            &path,
        );
    }
    let mut dev = DeviceFigures::default();
    let mut results = Vec::new();
    for name in &args.presets {
        results.push(bench_model(&args, name, &mut dev)?);
    }
    let device = dev.name.clone().unwrap_or_else(|| "unknown".into());
    let bw = dev.copy_bw.unwrap_or(f64::NAN);
    println!("device       cuda:{} {device}", args.device);
    println!(
        "copy bw      {:.1} GB/s (device-to-device, {} MiB, read + write, best of {})",
        bw / 1e9,
        args.copy_mib,
        args.copy_reps
    );
    if let Some(g) = dev.gemm {
        println!(
            "bf16 GEMM    {:.0} TFLOP/s ({n} x {n} x {n}, f32 accumulation, best of {})",
            g / 1e12,
            args.copy_reps,
            n = args.gemm_size
        );
    }
    for r in &results {
        println!();
        for line in &r.table {
            println!("{line}");
        }
    }
    let out = serde_json::json!({
        "benchmark": "gpu-engine",
        "engine": "kvmesh",
        "device": device,
        "device_ordinal": args.device,
        "copy_bandwidth_gb_s": bw / 1e9,
        "copy_buffer_bytes": args.copy_mib << 20,
        "copy_bandwidth_note": "cuMemcpyDtoD, 2 x bytes / time (read + write), best of copy_reps",
        "gemm_tflop_per_s": dev.gemm.map(|g| g / 1e12),
        "gemm_size": args.gemm_size,
        "timing": "host clock around forward_sample (greedy, and for ms_per_step_sampled the sampled_params, both sampled on the device), device synchronised before and after",
        "models": results.into_iter().map(|r| r.json).collect::<Vec<_>>(),
    });
    let path = args
        .json
        .clone()
        .unwrap_or_else(|| PathBuf::from(format!("bench/results/gpu-{}.json", sanitize(&device))));
    write_json(&path, &out)?;
    println!("wrote {}", path.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Args, clap::Error> {
        Args::try_parse_from(std::iter::once("gpu-bench").chain(args.iter().copied()))
    }

    #[test]
    fn flags_and_their_defaults() {
        use clap::CommandFactory;
        Args::command().debug_assert();
        let a = parse(&[]).unwrap();
        assert_eq!(a.models_dir, Path::new("target/bench-models"));
        assert_eq!(a.presets, ["qwen2.5-0.5b", "llama-3.2-1b"]);
        assert_eq!((&a.json, a.device), (&None, 0));
        assert_eq!(a.batches, [1, 8, 32, 64, 128, 256]);
        assert_eq!(a.prefill_lens, [512, 2048, 8192]);
        assert_eq!((a.gemm_size, a.memory_share), (8192, 0.9));
        assert_eq!((a.prompt_len, a.warmup, a.decode_steps), (128, 3, 20));
        assert_eq!(a.sampled_batches, [1, 32, 128]);
        assert_eq!((a.prefill_reps, a.fill_chunk), (3, 2048));
        assert_eq!((a.copy_mib, a.copy_reps), (1024, 10));
        assert_eq!(a.skinny_rows(), kvmesh_gpu::backend::SKINNY_MAX_ROWS);
        assert!(skinny_line(a.skinny_rows()).contains("skinny kernels"));
        let a = parse(&["--skinny-max-rows", "0"]).unwrap();
        assert_eq!(a.skinny_rows(), 0);
        assert!(skinny_line(0).contains("every product by cuBLAS"));
        // List items may carry spaces, as the hand-written parser allowed.
        let a = parse(&["--batches", "1, 8", "--presets", "llama-3.2-1b, qwen3-0.6b"]).unwrap();
        assert_eq!(a.batches, [1, 8]);
        assert_eq!(a.presets, ["llama-3.2-1b", "qwen3-0.6b"]);
    }

    #[test]
    fn device_names_become_file_names() {
        assert_eq!(sanitize("NVIDIA H100 80GB HBM3"), "nvidia-h100-80gb-hbm3");
        assert_eq!(sanitize("  NVIDIA  H200 (x) "), "nvidia-h200-x");
        assert_eq!(sanitize("!!"), "unknown");
    }
}
