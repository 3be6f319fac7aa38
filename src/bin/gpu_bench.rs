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
//! Pure decode steps replay CUDA graphs unless `KVMESH_CUDA_GRAPHS=0`; run once each way
//! (with different `--json` paths) to see what the graphs buy.
//!
//! `cargo build --release --features cuda --bin gpu-bench`, then on the GPU machine
//! `target/release/gpu-bench [--presets qwen2.5-0.5b,llama-3.2-1b] [--json PATH]`
//! (`--help` lists every flag). The JSON goes to `bench/results/gpu-<device name>.json`
//! unless `--json` says otherwise.

use std::path::{Path, PathBuf};
use std::time::Instant;

use kvmesh_gpu::backend::cuda::CudaBackend;
use kvmesh_gpu::backend::{Backend, ForwardBatch, SampleSpec, SeqInput};
use kvmesh_gpu::init::{preset, write_random_checkpoint};
use kvmesh_gpu::kv_cache::BlockId;
use kvmesh_gpu::model::LoadedModel;
use kvmesh_gpu::safetensors::DType;
use kvmesh_gpu::sampler::{Rng, SamplingParams};

const BLOCK_SIZE: usize = 16;

struct Args {
    models_dir: PathBuf,
    presets: Vec<String>,
    json: Option<PathBuf>,
    device: usize,
    batches: Vec<usize>,
    prompt_len: usize,
    warmup: usize,
    decode_steps: usize,
    prefill_lens: Vec<usize>,
    prefill_reps: usize,
    /// Most tokens one step runs while filling the decode sequences' histories, so the
    /// activations of that fill stay the size of the largest measured prefill.
    fill_chunk: usize,
    copy_mib: usize,
    copy_reps: usize,
}

fn list<T: std::str::FromStr>(s: &str) -> anyhow::Result<Vec<T>>
where
    T::Err: std::error::Error + Send + Sync + 'static,
{
    Ok(s.split(',')
        .map(|x| x.trim().parse())
        .collect::<Result<_, _>>()?)
}

fn parse_args() -> anyhow::Result<Args> {
    let mut a = Args {
        models_dir: PathBuf::from("target/bench-models"),
        presets: vec!["qwen2.5-0.5b".into(), "llama-3.2-1b".into()],
        json: None,
        device: 0,
        batches: vec![1, 8, 32, 64, 128],
        prompt_len: 128,
        warmup: 3,
        decode_steps: 20,
        prefill_lens: vec![512, 2048],
        prefill_reps: 3,
        fill_chunk: 2048,
        copy_mib: 1024,
        copy_reps: 10,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || {
            it.next()
                .ok_or_else(|| anyhow::anyhow!("{flag} needs a value"))
        };
        match flag.as_str() {
            "--models-dir" => a.models_dir = val()?.into(),
            "--presets" => a.presets = list(&val()?)?,
            "--json" => a.json = Some(val()?.into()),
            "--device" => a.device = val()?.parse()?,
            "--batches" => a.batches = list(&val()?)?,
            "--prompt-len" => a.prompt_len = val()?.parse()?,
            "--warmup" => a.warmup = val()?.parse()?,
            "--decode-steps" => a.decode_steps = val()?.parse()?,
            "--prefill-lens" => a.prefill_lens = list(&val()?)?,
            "--prefill-reps" => a.prefill_reps = val()?.parse()?,
            "--fill-chunk" => a.fill_chunk = val()?.parse()?,
            "--copy-mib" => a.copy_mib = val()?.parse()?,
            "--copy-reps" => a.copy_reps = val()?.parse()?,
            "-h" | "--help" => {
                println!(
                    "gpu-bench [--models-dir DIR] [--presets qwen2.5-0.5b,llama-3.2-1b] \
                     [--json PATH] [--device N] [--batches 1,8,32,64,128] [--prompt-len N] \
                     [--warmup N] [--decode-steps N] [--prefill-lens 512,2048] \
                     [--prefill-reps N] [--fill-chunk N] [--copy-mib N] [--copy-reps N]"
                );
                std::process::exit(0);
            }
            other => anyhow::bail!("unknown flag {other}"),
        }
    }
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

/// The checkpoint folder for `name`, written with random weights the first time.
fn checkpoint(models_dir: &Path, name: &str) -> anyhow::Result<PathBuf> {
    let d = models_dir.join(name);
    if !d.join("model.safetensors").exists() {
        eprintln!(
            "making a {name}-shaped random bf16 checkpoint in {}",
            d.display()
        );
        write_random_checkpoint(
            preset(None, name)?,
            0,
            DType::BF16,
            &kvmesh_gpu::embedded::default_tokenizer(),
            &d,
        )?;
    }
    Ok(d)
}

/// Greedy sampling, which the CUDA backend does on the device: a step copies back one token
/// and one logprob per sequence, as the engine's greedy requests do.
fn greedy() -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        ..SamplingParams::default()
    }
}

/// One step through `forward_sample`, fenced by device synchronisation on both sides so the
/// host clock measures the step's whole device work plus its host overhead (layout,
/// uploads, launches), which is what a serving loop pays per step. Returns the seconds and
/// the sampled tokens.
fn timed_step(
    backend: &mut CudaBackend,
    batch: &ForwardBatch,
    rngs: &mut [Rng],
) -> anyhow::Result<(f64, Vec<u32>)> {
    let params = greedy();
    let wanted = batch.seqs.iter().filter(|s| s.want_logits).count();
    let mut specs: Vec<SampleSpec> = rngs
        .iter_mut()
        .take(wanted)
        .map(|rng| SampleSpec {
            params: &params,
            rng,
        })
        .collect();
    backend.synchronize()?;
    let t = Instant::now();
    let out = backend.forward_sample(batch, &mut specs)?;
    backend.synchronize()?;
    let secs = t.elapsed().as_secs_f64();
    Ok((secs, out.into_iter().map(|s| s.token).collect()))
}

struct ModelResult {
    json: serde_json::Value,
    table: Vec<String>,
}

fn bench_model(
    args: &Args,
    name: &str,
    copy_bw: &mut Option<f64>,
    device_name: &mut Option<String>,
) -> anyhow::Result<ModelResult> {
    let dir = checkpoint(&args.models_dir, name)?;
    let model = LoadedModel::from_dir(&dir)?;
    let cfg = model.config.clone();
    let max_batch = args.batches.iter().copied().max().unwrap_or(1);
    let max_prefill = args.prefill_lens.iter().copied().max().unwrap_or(0);
    let per_seq_blocks =
        (args.prompt_len + args.warmup + args.decode_steps + 1).div_ceil(BLOCK_SIZE);
    let num_blocks = (max_batch * per_seq_blocks).max(max_prefill.div_ceil(BLOCK_SIZE)) + 1;
    eprintln!(
        "{name}: loading onto cuda:{} with {num_blocks} KV blocks",
        args.device
    );
    let mut backend = CudaBackend::new(&cfg, &model.weights, args.device, num_blocks, BLOCK_SIZE)?;
    // The host copy of the weights is no longer needed; free it before the runs.
    drop(model);
    if device_name.is_none() {
        *device_name = Some(backend.device_name()?);
    }
    let bw = match *copy_bw {
        Some(b) => b,
        None => {
            eprintln!(
                "measuring device-to-device copy bandwidth ({} MiB buffer)...",
                args.copy_mib
            );
            let b = backend.copy_bandwidth(args.copy_mib << 20, args.copy_reps)?;
            *copy_bw = Some(b);
            b
        }
    };
    let step_bytes = backend.weight_bytes_per_step();
    let bound_step = step_bytes as f64 / bw;
    let vocab = cfg.vocab_size as u32;
    let token = |i: usize| ((i * 7919 + 13) as u32) % vocab.min(2000);
    let mut rngs: Vec<Rng> = (0..max_batch.max(1))
        .map(|s| Rng::seeded(s as u64))
        .collect();

    // Prefill: one sequence, one step; the first run warms cuBLAS's heuristics and grows
    // the workspace, the median of the rest is reported.
    let mut prefill = Vec::new();
    for &len in &args.prefill_lens {
        if len == 0 {
            continue;
        }
        let prompt: Vec<u32> = (0..len).map(token).collect();
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
            }],
        };
        timed_step(&mut backend, &batch, &mut rngs)?;
        let mut times = Vec::new();
        for _ in 0..args.prefill_reps {
            times.push(timed_step(&mut backend, &batch, &mut rngs)?.0);
        }
        let secs = median(times);
        eprintln!("{name}: prefill {len} tokens {:.1} ms", secs * 1e3);
        prefill.push((len, secs));
    }

    let mut decode = Vec::new();
    for &b in &args.batches {
        if b == 0 {
            continue;
        }
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
                    })
                    .collect(),
            };
            timed_step(&mut backend, &batch, &mut rngs)?;
            s0 = s1;
        }
        // Each sequence's next input is its last prompt token, then what it sampled.
        let mut last: Vec<u32> = prompts
            .iter()
            .map(|p| p.last().copied().unwrap_or(0))
            .collect();
        let mut times = Vec::new();
        for step in 0..args.warmup + args.decode_steps {
            let toks: Vec<[u32; 1]> = last.iter().map(|&t| [t % vocab]).collect();
            let batch = ForwardBatch {
                seqs: (0..b)
                    .map(|s| SeqInput {
                        tokens: &toks[s],
                        start_pos: args.prompt_len + step,
                        context_len: 0,
                        block_table: &tables[s],
                        want_logits: true,
                    })
                    .collect(),
            };
            let (secs, sampled) = timed_step(&mut backend, &batch, &mut rngs)?;
            anyhow::ensure!(
                sampled.len() == b,
                "a decode step of {b} sequences returned {} tokens",
                sampled.len()
            );
            last = sampled;
            if step >= args.warmup {
                times.push(secs);
            }
        }
        let step = median(times);
        eprintln!("{name}: batch {b} decode {:.2} ms/step", step * 1e3);
        decode.push((b, step));
    }

    let gb = 1e9;
    let mut table = vec![
        format!(
            "model        {} ({}, {:.0}M parameters)",
            dir.display(),
            cfg.arch.architecture_name(),
            cfg.num_params() as f64 / 1e6
        ),
        format!(
            "weights/step {:.3} GB (bf16 on the device) -> bound {:.3} ms/token at batch 1",
            step_bytes as f64 / gb,
            bound_step * 1e3
        ),
        format!(
            "decode       CUDA graphs {} (KVMESH_CUDA_GRAPHS=0 turns them off)",
            if backend.cuda_graphs_enabled() {
                "on"
            } else {
                "off"
            }
        ),
        format!(
            "{:>8} {:>12} {:>12} {:>14}",
            "batch", "ms/step", "tokens/s", "bw utilisation"
        ),
    ];
    let mut json_decode = Vec::new();
    let mut util1 = None;
    for &(b, step) in &decode {
        // Weight traffic only: at larger batches the KV reads add to it, and the step is
        // no longer bound by the weights alone, so this is a lower bound on the traffic.
        let util = step_bytes as f64 / step / bw;
        if b == 1 {
            util1 = Some(util);
        }
        table.push(format!(
            "{:>8} {:>12.3} {:>12.1} {:>13.1}%",
            b,
            step * 1e3,
            b as f64 / step,
            util * 100.0
        ));
        json_decode.push(serde_json::json!({
            "batch": b,
            "ms_per_step": step * 1e3,
            "ms_per_output_token_per_sequence": step * 1e3,
            "tokens_per_s": b as f64 / step,
            "weight_bandwidth_utilisation": util,
        }));
    }
    let mut json_prefill = Vec::new();
    for &(len, secs) in &prefill {
        table.push(format!(
            "prefill      {len} tokens in {:.1} ms = {:.0} tokens/s",
            secs * 1e3,
            len as f64 / secs
        ));
        json_prefill.push(serde_json::json!({
            "tokens": len,
            "ms": secs * 1e3,
            "tokens_per_s": len as f64 / secs,
        }));
    }
    let json = serde_json::json!({
        "preset": name,
        "model": dir.display().to_string(),
        "architecture": cfg.arch.architecture_name(),
        "parameters": cfg.num_params(),
        "dtype": "bf16",
        "kv_block_size": BLOCK_SIZE,
        // Read after the runs: a failed capture switches graphs off mid-run.
        "cuda_graphs": backend.cuda_graphs_enabled(),
        "weight_bytes_per_step": step_bytes,
        "bound_ms_per_token_batch1": bound_step * 1e3,
        "batch1_bandwidth_utilisation": util1,
        "decode_prompt_tokens": args.prompt_len,
        "decode_warmup_steps": args.warmup,
        "decode_measured_steps": args.decode_steps,
        "decode": json_decode,
        "prefill": json_prefill,
    });
    Ok(ModelResult { json, table })
}

fn main() -> anyhow::Result<()> {
    let args = parse_args()?;
    let mut copy_bw = None;
    let mut device_name = None;
    let mut results = Vec::new();
    for name in &args.presets {
        results.push(bench_model(&args, name, &mut copy_bw, &mut device_name)?);
    }
    let device = device_name.unwrap_or_else(|| "unknown".into());
    let bw = copy_bw.unwrap_or(f64::NAN);
    println!("device       cuda:{} {device}", args.device);
    println!(
        "copy bw      {:.1} GB/s (device-to-device, {} MiB, read + write, best of {})",
        bw / 1e9,
        args.copy_mib,
        args.copy_reps
    );
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
        "timing": "host clock around forward_sample (greedy, sampled on the device), device synchronised before and after",
        "models": results.into_iter().map(|r| r.json).collect::<Vec<_>>(),
    });
    let path = args
        .json
        .clone()
        .unwrap_or_else(|| PathBuf::from(format!("bench/results/gpu-{}.json", sanitize(&device))));
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::write(&path, serde_json::to_string_pretty(&out)?)?;
    println!("wrote {}", path.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_names_become_file_names() {
        assert_eq!(sanitize("NVIDIA H100 80GB HBM3"), "nvidia-h100-80gb-hbm3");
        assert_eq!(sanitize("  NVIDIA  H200 (x) "), "nvidia-h200-x");
        assert_eq!(sanitize("!!"), "unknown");
    }
}
