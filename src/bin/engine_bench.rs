//! CPU engine benchmark: decode tokens/s at several batch sizes and prefill tokens/s, beside
//! the memory-bandwidth bound measured in the same run.
//!
//! Batch-1 decode reads every weight once per token, so it can go no faster than
//! `weight bytes per step / memory bandwidth`; the table says how close the engine gets.
//!
//! `cargo run --release --bin engine-bench -- [--model DIR] [--json PATH]`
//! Without `--model`, a Qwen2.5-0.5B-shaped checkpoint with random weights is made once
//! under `target/bench-models/`.

use std::path::PathBuf;
use std::time::Instant;

use kvmesh_gpu::backend::cpu::{CpuBackend, CpuModel};
use kvmesh_gpu::backend::{Backend, ForwardBatch, SeqInput};
use kvmesh_gpu::init::{preset, write_random_checkpoint};
use kvmesh_gpu::kv_cache::BlockId;
use kvmesh_gpu::model::LoadedModel;
use kvmesh_gpu::safetensors::DType;
use rayon::prelude::*;

struct Args {
    model: Option<PathBuf>,
    json: PathBuf,
    batches: Vec<usize>,
    prompt_len: usize,
    decode_steps: usize,
    prefill_len: usize,
}

fn parse_args() -> anyhow::Result<Args> {
    let mut a = Args {
        model: None,
        json: PathBuf::from("bench/results/cpu-engine.json"),
        batches: vec![1, 8, 32],
        prompt_len: 64,
        decode_steps: 8,
        prefill_len: 512,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || {
            it.next()
                .ok_or_else(|| anyhow::anyhow!("{flag} needs a value"))
        };
        match flag.as_str() {
            "--model" => a.model = Some(val()?.into()),
            "--json" => a.json = val()?.into(),
            "--batches" => {
                a.batches = val()?
                    .split(',')
                    .map(str::parse)
                    .collect::<Result<_, _>>()?
            }
            "--prompt-len" => a.prompt_len = val()?.parse()?,
            "--decode-steps" => a.decode_steps = val()?.parse()?,
            "--prefill-len" => a.prefill_len = val()?.parse()?,
            "-h" | "--help" => {
                println!("engine-bench [--model DIR] [--json PATH] [--batches 1,8,32] [--prompt-len N] [--decode-steps N] [--prefill-len N]");
                std::process::exit(0);
            }
            other => anyhow::bail!("unknown flag {other}"),
        }
    }
    Ok(a)
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
            }],
        })?;
        times.push(t.elapsed().as_secs_f64());
    }
    let mut rest = times[1.min(times.len() - 1)..].to_vec();
    rest.sort_by(f64::total_cmp);
    Ok(rest[rest.len() / 2])
}

fn main() -> anyhow::Result<()> {
    let args = parse_args()?;
    let dir = match &args.model {
        Some(d) => d.clone(),
        None => {
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
            d
        }
    };
    let model = LoadedModel::from_dir(&dir)?;
    let cfg = model.config.clone();
    let stored = model.weights.stored_bytes();
    let cpu = CpuModel::load(&cfg, &model.weights)?;
    let step_bytes = cpu.weight_bytes_per_step();

    let block_size = 16;
    let max_batch = *args.batches.iter().max().unwrap_or(&1);
    let per_seq_blocks = (args.prompt_len + args.decode_steps + 1).div_ceil(block_size);
    let num_blocks = (max_batch * per_seq_blocks).max(args.prefill_len.div_ceil(block_size)) + 1;
    let mut backend = CpuBackend::new(cpu, num_blocks, block_size)?;
    let threads = rayon::current_num_threads();
    eprintln!("measuring memory bandwidth...");
    let bw = read_bandwidth();
    let bound_step = step_bytes as f64 / bw;
    let vocab = cfg.vocab_size as u32;
    let token = |i: usize| ((i * 7919 + 13) as u32) % vocab.min(2000);

    // Prefill: one sequence, one step.
    let prompt: Vec<u32> = (0..args.prefill_len).map(token).collect();
    let table: Vec<BlockId> = (0..args.prefill_len.div_ceil(block_size))
        .map(|b| BlockId(b as u32))
        .collect();
    let run_prefill = |backend: &mut CpuBackend| -> anyhow::Result<f64> {
        let t = Instant::now();
        backend.forward(&ForwardBatch {
            seqs: vec![SeqInput {
                tokens: &prompt,
                start_pos: 0,
                context_len: 0,
                block_table: &table,
                want_logits: true,
            }],
        })?;
        Ok(t.elapsed().as_secs_f64())
    };
    run_prefill(&mut backend)?;
    let prefill_secs = run_prefill(&mut backend)?;

    let mut rows = Vec::new();
    for &b in &args.batches {
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
                    })
                    .collect(),
            })?;
            times.push(t.elapsed().as_secs_f64());
        }
        // The first step warms caches; report the median of the rest.
        let mut rest = times[1.min(times.len() - 1)..].to_vec();
        rest.sort_by(f64::total_cmp);
        let step = rest[rest.len() / 2];
        rows.push((b, step));
    }

    let gb = 1e9;
    println!(
        "model        {} ({}, {:.0}M parameters, stored {:.2} GB)",
        dir.display(),
        cfg.arch.architecture_name(),
        cfg.num_params() as f64 / 1e6,
        stored as f64 / gb
    );
    println!("threads      {threads}");
    println!("memory bw    {:.1} GB/s (read, {threads} threads)", bw / gb);
    println!(
        "weights/step {:.2} GB (as held in memory: bf16 stays bf16)",
        step_bytes as f64 / gb
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
    for &(b, step) in &rows {
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
    // The same model widened to f32 at load, side by side: what keeping bf16 buys.
    drop(backend);
    let f32_model = CpuModel::load_with(&cfg, &model.weights, false)?;
    let f32_bytes = f32_model.weight_bytes_per_step();
    drop(model);
    let mut f32_backend = CpuBackend::new(
        f32_model,
        (args.prompt_len + args.decode_steps + 1).div_ceil(block_size) + 1,
        block_size,
    )?;
    let f32_step = batch1_decode(
        &mut f32_backend,
        args.prompt_len,
        args.decode_steps,
        vocab.min(2000),
    )?;
    let bf16_step = rows.iter().find(|r| r.0 == 1).map(|r| r.1);
    println!();
    println!(
        "f32 weights  batch 1: {:.1} ms/step ({:.2} GB/step, bound {:.1} ms) -> bf16 is {:.2}x faster",
        f32_step * 1e3,
        f32_bytes as f64 / gb,
        f32_bytes as f64 / bw * 1e3,
        bf16_step.map_or(f64::NAN, |b| f32_step / b)
    );
    println!(
        "prefill      {} tokens in {:.0} ms = {:.1} tokens/s",
        args.prefill_len,
        prefill_secs * 1e3,
        args.prefill_len as f64 / prefill_secs
    );
    let out = serde_json::json!({
        "benchmark": "cpu-engine",
        "model": dir.display().to_string(),
        "architecture": cfg.arch.architecture_name(),
        "parameters": cfg.num_params(),
        "threads": threads,
        "memory_read_bandwidth_gb_s": bw / gb,
        "weight_bytes_per_step": step_bytes,
        "bound_ms_per_token_batch1": bound_step * 1e3,
        "decode": json_rows,
        "decode_context_tokens": args.prompt_len,
        "f32_weights_batch1": {"ms_per_step": f32_step * 1e3, "weight_bytes_per_step": f32_bytes, "step_over_bound": f32_step / (f32_bytes as f64 / bw)},
        "prefill": {"tokens": args.prefill_len, "ms": prefill_secs * 1e3, "tokens_per_s": args.prefill_len as f64 / prefill_secs},
    });
    if let Some(parent) = args.json.parent() {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::write(&args.json, serde_json::to_string_pretty(&out)?)?;
    println!("wrote {}", args.json.display());
    Ok(())
}
