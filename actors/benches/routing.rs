//! What one routing decision costs, piece by piece: a policy's pick over the workers a
//! router sees, and the prefix index's walks (the leading run per worker, the top runs)
//! and updates (a worker's snapshot, a step's stored/removed events).
//!
//! `cargo bench -p kvmesh-actors --bench routing` (criterion; `-- --quick` for a short run).
//! The mesh benchmarks (`bench/`) measure the same path end to end, through processes.

use std::hint::black_box;
use std::time::Instant;

use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion};
use kvmesh_actors::kv_index::{KvIndex, WorkerKv};
use kvmesh_actors::policy::{self, Candidate, PrefixTuning, RequestShape};
use kvmesh_actors::Policy;

/// A deterministic spread of worker states: loads 0..32, a few speeds, some cached blocks.
fn candidates(n: usize) -> Vec<Candidate> {
    (0..n)
        .map(|i| {
            let h = (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 32;
            Candidate {
                load: (h % 32) as f64,
                capacity: 20.0 + (h % 5) as f64 * 10.0,
                cached_blocks: (h % 7) as usize,
                queued_prompt_tokens: (h % 4096) as f64,
                prefill_rate: 20_000.0,
                step_base: 0.008,
                step_per_seq: 0.0001,
                max_running: 256.0,
            }
        })
        .collect()
}

fn picks(c: &mut Criterion) {
    let req = RequestShape {
        prompt_tokens: 1024,
        block_size: 16,
        output_tokens: 128,
    };
    let mut g = c.benchmark_group("policy_pick");
    for n in [16usize, 256, 4096] {
        let cands = candidates(n);
        for p in [Policy::LeastLoaded, Policy::Prefix, Policy::PowerOfTwo] {
            g.bench_with_input(BenchmarkId::new(p.as_str(), n), &cands, |b, cands| {
                let mut turn = 0u64;
                b.iter(|| {
                    turn += 1;
                    let pool: Vec<Candidate> = if p == Policy::PowerOfTwo {
                        policy::two_choices(cands.len(), turn)
                            .into_iter()
                            .map(|i| cands[i].clone())
                            .collect()
                    } else {
                        Vec::new()
                    };
                    let from = if pool.is_empty() { cands } else { &pool };
                    black_box(policy::pick(p, from, req, turn, PrefixTuning::default()))
                })
            });
        }
    }
    g.finish();
}

/// Block hashes of worker `w`'s `n` blocks: chains of 64 (one prompt each), every fourth
/// chain shared by all workers (a common system prompt).
fn worker_blocks(w: u32, n: usize) -> Vec<u64> {
    (0..n as u64)
        .map(|i| {
            let chain = i / 64;
            let owner = if chain % 4 == 0 { 0 } else { w as u64 + 1 };
            (owner << 40 | i).wrapping_mul(0xbf58_476d_1ce4_e5b9)
        })
        .collect()
}

/// An index with `workers` workers, each holding `blocks` blocks.
fn index(workers: u32, blocks: usize) -> (KvIndex, Vec<WorkerKv>) {
    let ix = KvIndex::default();
    let kvs: Vec<WorkerKv> = (0..workers).map(|_| WorkerKv::default()).collect();
    for (w, kv) in kvs.iter().enumerate() {
        ix.apply(w as u32, kv, true, &worker_blocks(w as u32, blocks), &[]);
    }
    (ix, kvs)
}

fn prefix_index(c: &mut Criterion) {
    let mut g = c.benchmark_group("kv_index");
    for workers in [16u32, 256] {
        let (ix, _kvs) = index(workers, 4096);
        // A 64-block prompt every worker holds (the shared chain), and one only worker 3
        // holds past its first block.
        let shared: Vec<u64> = worker_blocks(0, 64);
        let own: Vec<u64> = worker_blocks(3, 128)[64..].to_vec();
        let now = Instant::now();
        g.bench_function(BenchmarkId::new("leading_hits_shared", workers), |b| {
            b.iter(|| black_box(ix.leading_hits(black_box(&shared), now)))
        });
        g.bench_function(BenchmarkId::new("leading_hits_one_holder", workers), |b| {
            b.iter(|| black_box(ix.leading_hits(black_box(&own), now)))
        });
        g.bench_function(BenchmarkId::new("top_hits_shared_k4", workers), |b| {
            b.iter(|| black_box(ix.top_hits(black_box(&shared), now, 4, &[], |_| true, 0)))
        });
    }
    // A worker's snapshot of 4,096 blocks into an index of 64 workers, replacing its last.
    let (ix, kvs) = index(64, 4096);
    let fresh = worker_blocks(5, 4096);
    g.bench_function("apply_snapshot_4096", |b| {
        b.iter(|| ix.apply(5, &kvs[5], true, black_box(&fresh), &[]))
    });
    // One step's events: 16 blocks stored, 16 removed.
    g.bench_function("apply_step_events_16", |b| {
        b.iter_batched(
            || {
                let stored: Vec<u64> = (0..16u64).map(|i| (7 << 48 | i) * 31).collect();
                stored
            },
            |stored| {
                ix.apply(7, &kvs[7], false, &stored, &[]);
                ix.apply(7, &kvs[7], false, &[], &stored);
            },
            BatchSize::SmallInput,
        )
    });
    g.finish();
}

criterion_group!(benches, picks, prefix_index);
criterion_main!(benches);
