//! Constrained decoding's cost: output tokens/s with a JSON schema beside the same requests
//! unconstrained, at several batch sizes on the CPU backend (the embedded model), and the
//! time to compute one grammar mask, p50 and p99.
//!
//! `cargo run --release --bin guided-bench -- [--json PATH]`

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use clap::Parser;
use kvmesh_bench::programs::write_json;
use kvmesh_gpu::embedded::DEFAULT_MODEL;
use kvmesh_gpu::engine::{self, EngineConfig, EngineHandle, Request, SeqEvent};
use kvmesh_gpu::guided::{grammar, Guide, LazyGuides};
use kvmesh_gpu::model::{build_backend, BackendKind, KvBudget, LoadedModel};
use kvmesh_gpu::sampler::SamplingParams;
use serde_json::json;

#[derive(Parser)]
#[command(name = "guided-bench")]
struct Args {
    #[arg(long, value_name = "PATH", default_value = "bench/results/guided.json")]
    json: PathBuf,
    /// Batch sizes, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    batches: Vec<usize>,
    /// Tokens each request generates.
    #[arg(long, default_value_t = 64)]
    tokens: usize,
    /// Rounds per batch size (each runs both modes back to back); the median round counts.
    #[arg(long, default_value_t = 9)]
    rounds: usize,
}

fn schema() -> serde_json::Value {
    json!({"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"},
        "lines": {"type": "array", "items": {"type": "string"}}},
        "required": ["name", "age", "lines"]})
}

/// Output tokens per second of `batch` requests run together.
fn run(h: &EngineHandle, batch: usize, tokens: usize, guide: Option<&Guide>) -> f64 {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let t = Instant::now();
    let subs: Vec<_> = (0..batch)
        .map(|i| {
            h.submit(Request {
                prompt: vec![0, 20 + i as u32, 40, 60],
                params: SamplingParams {
                    temperature: 0.0,
                    max_tokens: tokens,
                    ignore_eos: true,
                    guide: guide.cloned(),
                    ..Default::default()
                },
            })
            .expect("submit")
        })
        .collect();
    let mut n = 0;
    rt.block_on(async {
        for mut s in subs {
            while let Some(e) = s.events.recv().await {
                match e {
                    SeqEvent::Token { finish, .. } => {
                        n += 1;
                        if finish.is_some() {
                            break;
                        }
                    }
                    SeqEvent::Failed(m) => panic!("{m}"),
                }
            }
        }
    });
    n as f64 / t.elapsed().as_secs_f64()
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let model = LoadedModel::from_embedded(&DEFAULT_MODEL)?;
    let vocab = model.config.vocab_size;
    let guides = Arc::new(LazyGuides::new(model.tokenizer.clone(), vocab));
    let backend = build_backend(
        BackendKind::Cpu(Default::default()),
        &model,
        16,
        KvBudget::Blocks(1024),
    )?;
    let h = engine::spawn(
        backend,
        EngineConfig {
            max_model_len: 512,
            max_num_seqs: 64,
            ..Default::default()
        },
        vec![],
        vocab,
    )
    .with_guides(guides.clone());
    let guide = Guide::new(&grammar::json_schema(schema()));
    let mut rows = Vec::new();
    // Each round runs both modes back to back (in alternating order), so a round's ratio
    // compares like with like on a noisy machine; the median round is reported.
    println!("batch  unconstrained tok/s  json-schema tok/s  ratio (median round; min..max)");
    for &b in &args.batches {
        let mut rounds = Vec::new();
        for r in 0..args.rounds {
            let (free, bound) = if r % 2 == 0 {
                let f = run(&h, b, args.tokens, None);
                (f, run(&h, b, args.tokens, Some(&guide)))
            } else {
                let g = run(&h, b, args.tokens, Some(&guide));
                (run(&h, b, args.tokens, None), g)
            };
            rounds.push((bound / free, free, bound));
        }
        rounds.sort_by(|a, b| a.0.total_cmp(&b.0));
        let (ratio, free, bound) = rounds[rounds.len() / 2];
        let (lo, hi) = (rounds[0].0, rounds[rounds.len() - 1].0);
        println!("{b:>5}  {free:>19.0}  {bound:>17.0}  {ratio:>5.2} ({lo:.2}..{hi:.2})");
        rows.push(
            json!({"batch": b, "unconstrained_tok_s": free, "json_schema_tok_s": bound,
            "ratio_median": ratio, "ratio_min": lo, "ratio_max": hi, "rounds": args.rounds}),
        );
    }
    // Mask time per token along a greedy walk through the schema.
    let g = guides.get().map_err(anyhow::Error::msg)?;
    let mut times = Vec::new();
    let mut consume = Vec::new();
    let pref: Vec<f32> = (0..vocab).map(|i| ((i * 7919) % 101) as f32).collect();
    for _ in 0..20 {
        let mut m = g
            .compile(grammar::json_schema(schema()))
            .map_err(anyhow::Error::msg)?;
        let mut mask = Vec::new();
        for _ in 0..args.tokens {
            let t = Instant::now();
            m.fill_mask(&mut mask);
            times.push(t.elapsed().as_secs_f64() * 1e6);
            let mut l = pref.clone();
            kvmesh_gpu::guided::apply_mask(&mut l, &mask);
            let tok = kvmesh_gpu::sampler::argmax_of(&l);
            let t = Instant::now();
            let ok = m.consume(tok).is_ok();
            consume.push(t.elapsed().as_secs_f64() * 1e6);
            if !ok || m.is_stopped() {
                break;
            }
        }
    }
    // Starting a sequence's matcher: the first time a grammar is seen (compiled), and again
    // (a clone of the compiled one).
    let mut fresh = Vec::new();
    let mut again = Vec::new();
    for i in 0..50 {
        let mut s = schema();
        s["properties"][format!("extra{i}")] = json!({"type": "integer"});
        let guide = Guide::new(&grammar::json_schema(s));
        let t = Instant::now();
        g.start(&guide, &[1]).map_err(anyhow::Error::msg)?;
        fresh.push(t.elapsed().as_secs_f64() * 1e6);
        let t = Instant::now();
        g.start(&guide, &[1]).map_err(anyhow::Error::msg)?;
        again.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let stats = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        let q = |p: f64| v[((v.len() - 1) as f64 * p) as usize];
        let mean = v.iter().sum::<f64>() / v.len() as f64;
        json!({"p50": q(0.5), "p99": q(0.99), "mean": mean, "n": v.len()})
    };
    let (mask, cons) = (stats(&mut times), stats(&mut consume));
    let (compile, cached) = (stats(&mut fresh), stats(&mut again));
    for (what, s) in [
        ("mask per token", &mask),
        ("consume per token", &cons),
        ("start, new schema", &compile),
        ("start, cached schema", &cached),
    ] {
        println!(
            "{what}: p50 {:.1} us, p99 {:.1} us, mean {:.1} us (n = {}, vocab {vocab})",
            s["p50"].as_f64().unwrap_or(0.0),
            s["p99"].as_f64().unwrap_or(0.0),
            s["mean"].as_f64().unwrap_or(0.0),
            s["n"]
        );
    }
    let out = json!({"model": "shakespeare (embedded)", "backend": "cpu", "tokens": args.tokens,
        "rows": rows, "mask_us": mask, "consume_us": cons,
        "start_new_grammar_us": compile, "start_cached_grammar_us": cached});
    write_json(&args.json, &out)?;
    println!("wrote {}", args.json.display());
    Ok(())
}
