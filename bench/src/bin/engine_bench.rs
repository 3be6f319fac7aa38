//! CPU engine benchmark: decode tokens/s at several batch sizes and prefill tokens/s, beside
//! the memory-bandwidth bound measured in the same run.
//!
//! Batch-1 decode reads every weight once per token, so it can go no faster than
//! `weight bytes per step / memory bandwidth`; the table says how close the engine gets.
//!
//! `cargo run --release --bin engine-bench -- [--model DIR] [--json PATH]`
//! Without `--model`, a Qwen2.5-0.5B-shaped checkpoint with random weights is made once
//! under `target/bench-models/`.

use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Parser;
use kvmesh_bench::compute::{prefill_flops, ComputePeaks};
use kvmesh_bench::programs::write_json;
use kvmesh_gpu::backend::cpu::{CpuBackend, CpuModel};
use kvmesh_gpu::backend::{Backend, ForwardBatch, SeqInput};
use kvmesh_gpu::config::ModelConfig;
use kvmesh_gpu::init::{preset, write_random_checkpoint};
use kvmesh_gpu::kv_cache::BlockId;
use kvmesh_gpu::model::LoadedModel;
use kvmesh_gpu::safetensors::DType;
use rayon::prelude::*;

const BLOCK_SIZE: usize = 16;

/// CPU engine benchmark: decode tokens/s at several batch sizes and prefill tokens/s, beside
/// the memory-bandwidth bound measured in the same run.
#[derive(Parser)]
#[command(name = "engine-bench")]
struct Args {
    /// A Hugging Face model folder [default: a Qwen2.5-0.5B-shaped random checkpoint, made
    /// once under target/bench-models/]
    #[arg(long, value_name = "DIR")]
    model: Option<PathBuf>,
    /// Where the results go.
    #[arg(
        long,
        value_name = "PATH",
        default_value = "bench/results/cpu-engine.json"
    )]
    json: PathBuf,
    /// Decode batch sizes to measure, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    batches: Vec<usize>,
    /// Tokens of history each decoding sequence has.
    #[arg(long, value_name = "N", default_value_t = 64)]
    prompt_len: usize,
    /// Decode steps per batch size (the first warms caches; the median of the rest counts).
    #[arg(long, value_name = "N", default_value_t = 8)]
    decode_steps: usize,
    /// Tokens of the prefill measured.
    #[arg(long, value_name = "N", default_value_t = 512)]
    prefill_len: usize,
}

/// Read bandwidth of main memory with all threads, best of several passes over 1 GiB.
/// Integer adds are associative, so the loop vectorizes and memory, not arithmetic, limits it.
fn read_bandwidth() -> f64 {
    let n = (1usize << 30) / 8;
    let buf: Vec<u64> = (0..n as u64)
        .into_par_iter()
        .map(|i| i.wrapping_mul(0x9e37_79b9))
        .collect();
    let mut best = 0f64;
    for _ in 0..5 {
        let t = Instant::now();
        let s = buf
            .par_chunks(1 << 16)
            .map(|c| c.iter().fold(0u64, |a, &x| a.wrapping_add(x)))
            .reduce(|| 0, u64::wrapping_add);
        let secs = t.elapsed().as_secs_f64();
        std::hint::black_box(s);
        best = best.max((n * 8) as f64 / secs);
    }
    best
}

/// Median time of `steps` batch-1 decode steps after a prompt of `prompt_len` tokens.
fn batch1_decode(
    backend: &mut CpuBackend,
    prompt_len: usize,
    steps: usize,
    vocab: u32,
) -> anyhow::Result<f64> {
    let blocks = (prompt_len + steps + 1).div_ceil(16);
    let table: Vec<BlockId> = (0..blocks).map(|b| BlockId(b as u32)).collect();
    let prompt: Vec<u32> = (0..prompt_len)
        .map(|i| (i as u32 * 7 + 3) % vocab)
        .collect();
    backend.forward(&ForwardBatch {
        seqs: vec![SeqInput {
            tokens: &prompt,
            start_pos: 0,
            context_len: 0,
            block_table: &table,
            want_logits: false,
            state_slot: None,
        }],
    })?;
    let mut times = Vec::new();
    for step in 0..steps {
        let tok = [(step as u32 * 13 + 1) % vocab];
        let t = Instant::now();
        backend.forward(&ForwardBatch {
            seqs: vec![SeqInput {
                tokens: &tok,
                start_pos: prompt_len + step,
                context_len: 0,
                block_table: &table,
                want_logits: true,
                state_slot: None,
            }],
        })?;
        times.push(t.elapsed().as_secs_f64());
    }
    let mut rest = times[1.min(times.len() - 1)..].to_vec();
    rest.sort_by(f64::total_cmp);
    Ok(rest[rest.len() / 2])
}

/// The model folder: `--model`, or the random checkpoint (made on first use).
fn model_dir(args: &Args) -> anyhow::Result<PathBuf> {
    if let Some(d) = &args.model {
        return Ok(d.clone());
    }
    let d = PathBuf::from("target/bench-models/qwen2.5-0.5b");
    if !d.join("model.safetensors").exists() {
        eprintln!(
            "making a Qwen2.5-0.5B-shaped random checkpoint in {}",
            d.display()
        );
        write_random_checkpoint(
            preset(None, "qwen2.5-0.5b")?,
            0,
            DType::BF16,
            &kvmesh_gpu::embedded::default_tokenizer(),
            &d,
        )?;
    }
    Ok(d)
}

/// The `i`th token of a synthetic prompt.
fn token(vocab: u32, i: usize) -> u32 {
    ((i * 7919 + 13) as u32) % vocab.min(2000)
}

/// One prefill of `len` tokens, one sequence in one step (the second of two runs): seconds.
fn prefill(backend: &mut CpuBackend, len: usize, vocab: u32) -> anyhow::Result<f64> {
    let prompt: Vec<u32> = (0..len).map(|i| token(vocab, i)).collect();
    let table: Vec<BlockId> = (0..len.div_ceil(BLOCK_SIZE))
        .map(|b| BlockId(b as u32))
        .collect();
    let mut run = || -> anyhow::Result<f64> {
        let t = Instant::now();
        backend.forward(&ForwardBatch {
            seqs: vec![SeqInput {
                tokens: &prompt,
                start_pos: 0,
                context_len: 0,
                block_table: &table,
                want_logits: true,
                state_slot: None,
            }],
        })?;
        Ok(t.elapsed().as_secs_f64())
    };
    run()?;
    run()
}

/// Median seconds of a decode step of `b` sequences, each `args.prompt_len` tokens in.
fn decode(backend: &mut CpuBackend, args: &Args, b: usize, vocab: u32) -> anyhow::Result<f64> {
    let per_seq_blocks = (args.prompt_len + args.decode_steps + 1).div_ceil(BLOCK_SIZE);
    let token = |i: usize| token(vocab, i);
    let tables: Vec<Vec<BlockId>> = (0..b)
        .map(|s| {
            (0..per_seq_blocks)
                .map(|k| BlockId((s * per_seq_blocks + k) as u32))
                .collect()
        })
        .collect();
    let prompts: Vec<Vec<u32>> = (0..b)
        .map(|s| (0..args.prompt_len).map(|i| token(i + s)).collect())
        .collect();
    // Fill each sequence's history in one batched prefill.
    backend.forward(&ForwardBatch {
        seqs: (0..b)
            .map(|s| SeqInput {
                tokens: &prompts[s],
                start_pos: 0,
                context_len: 0,
                block_table: &tables[s],
                want_logits: false,
                state_slot: None,
            })
            .collect(),
    })?;
    let mut times = Vec::new();
    for step in 0..args.decode_steps {
        let toks: Vec<[u32; 1]> = (0..b).map(|s| [token(step * 31 + s)]).collect();
        let t = Instant::now();
        backend.forward(&ForwardBatch {
            seqs: (0..b)
                .map(|s| SeqInput {
                    tokens: &toks[s],
                    start_pos: args.prompt_len + step,
                    context_len: 0,
                    block_table: &tables[s],
                    want_logits: true,
                    state_slot: None,
                })
                .collect(),
        })?;
        times.push(t.elapsed().as_secs_f64());
    }
    // The first step warms caches; report the median of the rest.
    let mut rest = times[1.min(times.len() - 1)..].to_vec();
    rest.sort_by(f64::total_cmp);
    Ok(rest[rest.len() / 2])
}

/// What one run measured.
struct Measured {
    /// Memory read bandwidth, bytes/s.
    bw: f64,
    /// The cores' f32 FMA and bf16 dot-product peaks, what a prefill's rate is set against.
    peaks: ComputePeaks,
    /// Weight bytes one step reads, as held in memory (bf16 stays bf16).
    step_bytes: usize,
    stored_bytes: usize,
    /// (batch, seconds per decode step)
    decode: Vec<(usize, f64)>,
    /// Batch-1 decode with the weights widened to f32: seconds per step, bytes per step.
    f32_step: f64,
    f32_bytes: usize,
    prefill_secs: f64,
    /// The same prefill with bf16 products (`CpuModel::with_bf16_products`), measured right
    /// after it, and the default once more after that; `None` without AVX512-BF16 or bf16
    /// weights.
    prefill_bf16: Option<(f64, f64)>,
}

fn measure(args: &Args, model: LoadedModel) -> anyhow::Result<Measured> {
    let cfg = model.config.clone();
    let cpu = CpuModel::load(&cfg, &model.weights)?;
    let step_bytes = cpu.weight_bytes_per_step();
    let max_batch = *args.batches.iter().max().unwrap_or(&1);
    let per_seq_blocks = (args.prompt_len + args.decode_steps + 1).div_ceil(BLOCK_SIZE);
    let num_blocks = (max_batch * per_seq_blocks).max(args.prefill_len.div_ceil(BLOCK_SIZE)) + 1;
    let mut backend = CpuBackend::new(cpu, num_blocks, BLOCK_SIZE)?;
    eprintln!("measuring memory bandwidth...");
    let bw = read_bandwidth();
    eprintln!("measuring the cores' arithmetic peaks...");
    let peaks = ComputePeaks::measure();
    let vocab = cfg.vocab_size as u32;
    let prefill_secs = prefill(&mut backend, args.prefill_len, vocab)?;
    let mut rows = Vec::new();
    for &b in &args.batches {
        rows.push((b, decode(&mut backend, args, b, vocab)?));
    }
    // Prompt products with bf16 activations, side by side with the default (run again after,
    // so drift between the two shows).
    let bf16_model = CpuModel::load(&cfg, &model.weights)?.with_bf16_products();
    let prefill_bf16 = if bf16_model.bf16_products_run() {
        let blocks = args.prefill_len.div_ceil(BLOCK_SIZE) + 1;
        let mut b = CpuBackend::new(bf16_model, blocks, BLOCK_SIZE)?;
        let secs = prefill(&mut b, args.prefill_len, vocab)?;
        drop(b);
        let again = prefill(&mut backend, args.prefill_len, vocab)?;
        Some((secs, again))
    } else {
        None
    };
    // The same model widened to f32 at load, side by side: what keeping bf16 buys.
    drop(backend);
    let f32_model = CpuModel::load_with(&cfg, &model.weights, false)?;
    let f32_bytes = f32_model.weight_bytes_per_step();
    let stored_bytes = model.weights.stored_bytes();
    drop(model);
    let mut f32_backend = CpuBackend::new(
        f32_model,
        (args.prompt_len + args.decode_steps + 1).div_ceil(BLOCK_SIZE) + 1,
        BLOCK_SIZE,
    )?;
    let f32_step = batch1_decode(
        &mut f32_backend,
        args.prompt_len,
        args.decode_steps,
        vocab.min(2000),
    )?;
    Ok(Measured {
        bw,
        peaks,
        step_bytes,
        stored_bytes,
        decode: rows,
        f32_step,
        f32_bytes,
        prefill_secs,
        prefill_bf16,
    })
}

/// Prints the figures; returns the results' JSON.
fn report(args: &Args, dir: &Path, cfg: &ModelConfig, m: &Measured) -> serde_json::Value {
    let gb = 1e9;
    let threads = rayon::current_num_threads();
    let bound_step = m.step_bytes as f64 / m.bw;
    println!(
        "model        {} ({}, {:.0}M parameters, stored {:.2} GB)",
        dir.display(),
        cfg.arch.architecture_name(),
        cfg.num_params() as f64 / 1e6,
        m.stored_bytes as f64 / gb
    );
    println!("threads      {threads}");
    println!(
        "memory bw    {:.1} GB/s (read, {threads} threads)",
        m.bw / gb
    );
    println!(
        "weights/step {:.2} GB (as held in memory: bf16 stays bf16)",
        m.step_bytes as f64 / gb
    );
    println!(
        "bound        {:.1} ms/token at batch 1 = {:.2} tokens/s",
        bound_step * 1e3,
        1.0 / bound_step
    );
    println!();
    println!(
        "{:>8} {:>12} {:>12} {:>14}",
        "batch", "ms/step", "tokens/s", "vs bound"
    );
    let mut json_rows = Vec::new();
    for &(b, step) in &m.decode {
        let ratio = step / bound_step;
        println!(
            "{:>8} {:>12.1} {:>12.2} {:>13.2}x",
            b,
            step * 1e3,
            b as f64 / step,
            ratio
        );
        json_rows.push(serde_json::json!({"batch": b, "ms_per_step": step * 1e3, "tokens_per_s": b as f64 / step, "step_over_bound": ratio}));
    }
    let bf16_step = m.decode.iter().find(|r| r.0 == 1).map(|r| r.1);
    println!();
    println!(
        "f32 weights  batch 1: {:.1} ms/step ({:.2} GB/step, bound {:.1} ms) -> bf16 is {:.2}x faster",
        m.f32_step * 1e3,
        m.f32_bytes as f64 / gb,
        m.f32_bytes as f64 / m.bw * 1e3,
        bf16_step.map_or(f64::NAN, |b| m.f32_step / b)
    );
    let flops = prefill_flops(cfg, args.prefill_len);
    let gf = |secs: f64| flops / secs / gb;
    let share = |secs: f64, peak: Option<f64>| {
        peak.map_or("no peak measured".to_string(), |p| {
            format!("{:.0}% of it", 100.0 * flops / secs / p)
        })
    };
    println!(
        "compute      f32 FMA peak {}, bf16 dot-product peak {} ({threads} threads)",
        m.peaks
            .f32_fma
            .map_or("-".into(), |p| format!("{:.0} GFLOP/s", p / gb)),
        m.peaks
            .bf16_dot
            .map_or("-".into(), |p| format!("{:.0} GFLOP/s", p / gb)),
    );
    println!(
        "prefill      {} tokens in {:.0} ms = {:.1} tokens/s, {:.0} GFLOP/s: f32 products, {}",
        args.prefill_len,
        m.prefill_secs * 1e3,
        args.prefill_len as f64 / m.prefill_secs,
        gf(m.prefill_secs),
        share(m.prefill_secs, m.peaks.f32_fma)
    );
    let bf16_json = match m.prefill_bf16 {
        Some((bf, again)) => {
            let tps = |s: f64| args.prefill_len as f64 / s;
            println!(
                "prefill      bf16 products (AVX512-BF16, activations rounded to bf16): {:.1} tokens/s, {:.0} GFLOP/s: {} of the bf16 peak; the default again {:.1} tokens/s",
                tps(bf),
                gf(bf),
                share(bf, m.peaks.bf16_dot).trim_end_matches(" of it"),
                tps(again)
            );
            serde_json::json!({"tokens_per_s": tps(bf), "gflop_s": gf(bf),
                "share_of_bf16_dot_peak": m.peaks.bf16_dot.map(|p| flops / bf / p),
                "default_again_tokens_per_s": tps(again)})
        }
        None => {
            println!("prefill      bf16 products: not run (no AVX512-BF16, or f32 weights)");
            serde_json::Value::Null
        }
    };
    serde_json::json!({
        "benchmark": "cpu-engine",
        "model": dir.display().to_string(),
        "architecture": cfg.arch.architecture_name(),
        "parameters": cfg.num_params(),
        "threads": threads,
        "memory_read_bandwidth_gb_s": m.bw / gb,
        "weight_bytes_per_step": m.step_bytes,
        "bound_ms_per_token_batch1": bound_step * 1e3,
        "decode": json_rows,
        "decode_context_tokens": args.prompt_len,
        "f32_weights_batch1": {"ms_per_step": m.f32_step * 1e3, "weight_bytes_per_step": m.f32_bytes, "step_over_bound": m.f32_step / (m.f32_bytes as f64 / m.bw)},
        "compute_peaks": m.peaks.json(),
        "prefill": {"tokens": args.prefill_len, "ms": m.prefill_secs * 1e3, "tokens_per_s": args.prefill_len as f64 / m.prefill_secs,
            "flops": flops, "gflop_s": gf(m.prefill_secs),
            "share_of_f32_fma_peak": m.peaks.f32_fma.map(|p| flops / m.prefill_secs / p)},
        "prefill_flops_note": "2 x the linear layers' parameters per token (not the embedding; the LM head for one row), plus causal attention's 4 x q_dim x T^2/2 per layer",
        "prefill_bf16_products": bf16_json,
    })
}

fn main() -> anyhow::Result<()> {
    // As `kvmesh` does, so the engine is measured as it serves.
    kvmesh_gpu::backend::cpu::keep_freed_memory();
    let args = Args::parse();
    let dir = model_dir(&args)?;
    let model = LoadedModel::from_dir(&dir)?;
    let cfg = model.config.clone();
    let measured = measure(&args, model)?;
    let out = report(&args, &dir, &cfg, &measured);
    write_json(&args.json, &out)?;
    println!("wrote {}", args.json.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn parse(args: &[&str]) -> Result<Args, clap::Error> {
        Args::try_parse_from(std::iter::once("engine-bench").chain(args.iter().copied()))
    }

    #[test]
    fn flags_and_their_defaults() {
        Args::command().debug_assert();
        let a = parse(&[]).unwrap();
        assert_eq!(a.model, None);
        assert_eq!(a.json, Path::new("bench/results/cpu-engine.json"));
        assert_eq!(a.batches, [1, 8, 32]);
        assert_eq!((a.prompt_len, a.decode_steps, a.prefill_len), (64, 8, 512));
        let a = parse(&["--model", "m", "--batches", "2,4", "--prompt-len", "9"]).unwrap();
        assert_eq!(a.model.as_deref(), Some(Path::new("m")));
        assert_eq!((a.batches, a.prompt_len), (vec![2, 4], 9));
        assert!(parse(&["--batches", "1,x"]).is_err());
        assert!(parse(&["--unknown"]).is_err());
    }
}
