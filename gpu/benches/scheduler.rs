//! What the engine itself costs around the model: the scheduler's plan for each step (admission,
//! chunked prefill, blocks, the prefix cache), sampling and the per-token events, with the sim
//! backend at zero modelled time so that nothing else is measured.
//!
//! `cargo bench -p kvmesh-gpu --bench scheduler` (criterion; `-- --quick` for a short run).
//! Each iteration submits a batch of requests to a running engine thread and reads every
//! token event until all have finished: per-iteration time ÷ (requests × tokens) is the engine's
//! overhead per generated token. `engine-bench` and `gpu-bench` measure the model's part.

use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvmesh_gpu::backend::sim::{SimBackend, SimTiming};
use kvmesh_gpu::engine::{self, EngineConfig, EngineHandle, Request, SeqEvent};
use kvmesh_gpu::kv_pool::{KvDtype, KvSpec};
use kvmesh_gpu::sampler::SamplingParams;

const VOCAB: usize = 4096;
const BLOCK: usize = 16;

/// An engine on the zero-time sim backend with room for `seqs` sequences of `len` tokens.
fn engine(seqs: usize, len: usize) -> EngineHandle {
    let blocks = seqs * len.div_ceil(BLOCK) + 64;
    let spec = KvSpec {
        num_layers: 1,
        block_size: BLOCK,
        num_kv_heads: 1,
        head_dim: 8,
        dtype: KvDtype::Bf16,
    };
    let backend = SimBackend::new(
        SimTiming::zero(),
        spec,
        blocks,
        VOCAB,
        (4..VOCAB as u32).collect(),
    )
    .expect("sim backend");
    let cfg = EngineConfig {
        max_model_len: len + 1,
        max_num_seqs: seqs,
        max_num_batched_tokens: 8192,
        block_size: BLOCK,
        max_waiting: 4 * seqs,
        enable_prefix_caching: true,
    };
    engine::spawn(Box::new(backend), cfg, vec![2], VOCAB)
}

/// Submits `seqs` requests of `prompt` tokens (distinct prompts, so the prefix cache finds
/// only what a previous iteration left) generating `gen` each, and reads them to the end.
fn round(h: &EngineHandle, seqs: usize, prompt: usize, gen: usize, salt: u32) {
    let subs: Vec<_> = (0..seqs as u32)
        .map(|s| {
            let p: Vec<u32> = (0..prompt as u32)
                .map(|i| 4 + (i * 31 + s * 7919 + salt * 104_729) % (VOCAB as u32 - 4))
                .collect();
            let params = SamplingParams {
                max_tokens: gen,
                ignore_eos: true,
                temperature: 0.0,
                ..SamplingParams::default()
            };
            h.submit(Request { prompt: p, params }).expect("submit")
        })
        .collect();
    for mut sub in subs {
        let mut n = 0;
        while let Some(ev) = sub.events.blocking_recv() {
            match ev {
                SeqEvent::Token { finish, .. } => {
                    n += 1;
                    if finish.is_some() {
                        break;
                    }
                }
                SeqEvent::Failed(e) => panic!("a request failed: {e}"),
            }
        }
        assert_eq!(n, gen, "every request generates its tokens");
        sub.finished();
    }
}

fn steps(c: &mut Criterion) {
    let mut g = c.benchmark_group("engine_round");
    g.measurement_time(Duration::from_secs(5)).sample_size(10);
    for &(seqs, prompt, gen) in &[(1, 512, 64), (32, 512, 64), (256, 512, 32)] {
        let h = engine(seqs, prompt + gen);
        g.throughput(Throughput::Elements((seqs * gen) as u64));
        let mut salt = 0;
        g.bench_with_input(
            BenchmarkId::from_parameter(format!("{seqs}x{prompt}+{gen}")),
            &(seqs, prompt, gen),
            |b, &(seqs, prompt, gen)| {
                b.iter(|| {
                    salt += 1;
                    round(&h, seqs, prompt, gen, salt);
                })
            },
        );
    }
    g.finish();
}

criterion_group!(benches, steps);
criterion_main!(benches);
