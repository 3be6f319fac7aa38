//! Routing decision time as the cluster grows: in-process over the router's own index and
//! policies, and in a running router over many sim workers.

use std::time::Instant;

use kvmesh_bench::harness::load::{run_load, shakespeare_lines};
use kvmesh_bench::harness::{status, wait_workers};
use kvmesh_bench::programs::ZERO_COST;
use kvmesh_discovery::testing::Etcd;
use serde_json::{json, Value};

use crate::ctx::Ctx;

/// How long a routing decision takes as the cluster grows: building every candidate (load,
/// capacity, the prompt's cached blocks from the router's cluster-wide block index) and
/// picking, against power-of-two's two candidates. In-process, over an index of workers
/// holding 4096 blocks each, for a 1024-token prompt (64 blocks).
pub fn pick_time(quick: bool) -> Value {
    use kvmesh_actors::kv_index::{KvIndex, WorkerKv};
    use kvmesh_actors::policy::{pick, two_choices, Candidate, Policy, PrefixTuning, RequestShape};
    let iters = if quick { 2_000 } else { 20_000 };
    let hashes: Vec<u64> = (0..64).collect();
    let mut rows = Vec::new();
    println!("\n== routing decision time (in-process, per pick) ==");
    println!(
        "{:>8} {:>14} {:>20} {:>20} {:>14}",
        "workers", "least-loaded", "prefix (all hold)", "prefix (2 hold)", "power-of-two"
    );
    for n in [8usize, 64, 256] {
        let now = Instant::now();
        // One index for the cluster, as the router keeps it.
        let build = |spread: bool| {
            let index = KvIndex::default();
            for w in 0..n {
                // Each worker's own bookkeeping, as its link keeps it.
                let kv = WorkerKv::default();
                let held: Vec<u64> = (0..4096u64).map(|k| k * 1000 + w as u64 + 64).collect();
                index.apply(w as u32, &kv, true, &held, &[]);
                // Spread: worker w holds the prompt's first w % 64 blocks (every worker
                // holds some: the index's worst case). Otherwise two workers hold it all,
                // as prefix routing leaves a conversation.
                let upto = if spread {
                    w % 64
                } else if w < 2 {
                    64
                } else {
                    0
                };
                index.apply(w as u32, &kv, false, &hashes[..upto], &[]);
            }
            index
        };
        let (spread, pair) = (build(true), build(false));
        let shape = RequestShape {
            prompt_tokens: 1024,
            block_size: 16,
            output_tokens: 128,
        };
        let cand = |i: usize, hits: &[(u32, usize, usize)]| Candidate {
            load: (i % 7) as f64,
            capacity: 100.0 + i as f64,
            cached_blocks: hits
                .binary_search_by_key(&(i as u32), |h| h.0)
                .map_or(0, |k| hits[k].2),
            queued_prompt_tokens: 0.0,
            prefill_rate: 5000.0,
            step_base: 0.008,
            step_per_seq: 0.0001,
            max_running: 64.0,
        };
        let time = |policy: Policy, index: &KvIndex| {
            let t0 = Instant::now();
            let mut sink = 0usize;
            for t in 0..iters as u64 {
                let cands: Vec<Candidate> = match policy {
                    Policy::PowerOfTwo => two_choices(n, t)
                        .into_iter()
                        .map(|i| cand(i, &[]))
                        .collect(),
                    Policy::Prefix => {
                        let hits = index.leading_hits(&hashes, now);
                        (0..n).map(|i| cand(i, &hits)).collect()
                    }
                    _ => (0..n).map(|i| cand(i, &[])).collect(),
                };
                sink += pick(policy, &cands, shape, t, PrefixTuning::default()).unwrap();
            }
            std::hint::black_box(sink);
            t0.elapsed().as_secs_f64() * 1e6 / iters as f64
        };
        let (ll, px, px2, p2) = (
            time(Policy::LeastLoaded, &pair),
            time(Policy::Prefix, &spread),
            time(Policy::Prefix, &pair),
            time(Policy::PowerOfTwo, &pair),
        );
        println!("{n:>8} {ll:>12.2}us {px:>18.2}us {px2:>18.2}us {p2:>12.2}us");
        rows.push(json!({"workers": n, "least_loaded_us": ll, "prefix_us": px,
            "prefix_two_holders_us": px2, "power_of_two_us": p2}));
    }
    json!(rows)
}

/// What the prefix index costs a pick at 10,000 workers as more of them hold a prompt's
/// shared prefix (a system prompt every request starts with: in the end, every worker):
/// every worker's hits (`leading_hits`, for a pick that costs every worker) against those
/// a shortlisted pick costs (`top_hits`: the 64 shortlisted workers' and the 16 longest
/// other runs). In-process; a 4-block prefix plus a block of each prompt's own.
pub fn shared_prefix_lookup(quick: bool) -> Value {
    use kvmesh_actors::kv_index::{KvIndex, WorkerKv};
    const WORKERS: u32 = 10_000;
    let iters = if quick { 200 } else { 2_000 };
    println!("\n== prefix index lookups at {WORKERS} workers, by holders of a shared prefix ==");
    println!(
        "{:>8} {:>18} {:>18} {:>8}",
        "holders", "all hits (us)", "pick's hits (us)", "ratio"
    );
    let mut rows = Vec::new();
    for holders in [10u32, 100, 1_000, 3_000, 10_000] {
        let index = KvIndex::default();
        let kvs: Vec<WorkerKv> = (0..WORKERS).map(|_| WorkerKv::default()).collect();
        let prefix = [11u64, 12, 13, 14];
        // Spread over the slots, as holders are over a router's workers.
        let step = WORKERS / holders;
        for w in (0..WORKERS).step_by(step as usize).take(holders as usize) {
            index.apply(w, &kvs[w as usize], true, &prefix, &[]);
        }
        // The shortlist: 64 workers from all over.
        let listed: Vec<u32> = (0..64).map(|k| k * (WORKERS / 64) + 3).collect();
        let now = Instant::now();
        let prompt = |t: u64| [11, 12, 13, 14, 1_000 + t];
        let time = |f: &dyn Fn(&[u64]) -> usize| {
            let t0 = Instant::now();
            let mut sink = 0;
            for t in 0..iters {
                sink += f(&prompt(t));
            }
            std::hint::black_box(sink);
            t0.elapsed().as_secs_f64() * 1e6 / iters as f64
        };
        let all = time(&|hs| index.leading_hits(hs, now).len());
        let picks = time(&|hs| index.top_hits(hs, now, 16, &listed, |_| true, 0).len());
        println!(
            "{holders:>8} {all:>18.2} {picks:>18.2} {:>7.1}x",
            all / picks
        );
        rows.push(
            json!({"workers": WORKERS, "holders": holders, "all_hits_us": all,
            "pick_hits_us": picks}),
        );
    }
    json!(rows)
}

/// Pick time in a real router as the cluster grows: one `kvmesh node --replicas N` process
/// hosts N sim workers (each its own member: record, lease, QUIC endpoint, engine), and a
/// gateway per policy routes short requests over them. The routers' own account of their
/// decisions (`/status` `router.pick_time`), beside the in-process figures above.
pub async fn router_scale(ctx: &Ctx) -> Value {
    let (km, http, quick) = (&ctx.km, &ctx.http, ctx.quick);
    let lines = shakespeare_lines();
    let requests = if quick { 100 } else { 400 };
    let sizes: &[usize] = if quick { &[8, 64] } else { &[8, 64, 256] };
    let policies = ["least-loaded", "power-of-two", "prefix"];
    let etcd = Etcd::start();
    let mut rows = Vec::new();
    println!("\n== routing decision time in a running router (N sim workers in one process) ==");
    println!(
        "{:>8} {:>14} {:>9} {:>10} {:>10} {:>10} {:>10} {:>8}",
        "workers", "policy", "picks", "p50", "p99", "mean", "max", "failed"
    );
    for &n in sizes {
        let cluster = format!("bench-scale-{n}");
        let replicas = n.to_string();
        let _workers = km.node(
            &etcd,
            &cluster,
            "w",
            &[
                &[
                    "--roles",
                    "worker",
                    "--replicas",
                    &replicas,
                    "--num-kv-blocks",
                    "64",
                ][..],
                &ZERO_COST[..],
            ]
            .concat(),
        );
        for policy in policies {
            // Each its own id: the last one's record outlives it by up to a lease.
            let gw = km.gateway(&etcd, &cluster, &format!("gw-{policy}"), policy);
            wait_workers(http, &gw, n).await;
            let prompts: Vec<String> = (0..requests)
                .map(|i| lines[(i * 7) % lines.len()].clone())
                .collect();
            let (samples, _) = run_load(http, &gw.http, prompts, 4, 8).await;
            let failed = samples.iter().filter(|s| !s.ok).count();
            let st = status(http, &gw).await;
            let p = &st["router"]["pick_time"];
            let f = |k: &str| p[k].as_f64().unwrap_or(f64::NAN);
            let count = p["count"].as_u64().unwrap_or(0);
            let (p50, p99, mean, max) = (
                f("recent_p50_us"),
                f("recent_p99_us"),
                f("mean_us"),
                f("max_us"),
            );
            println!(
                "{n:>8} {policy:>14} {count:>9} {p50:>8.2}us {p99:>8.1}us {mean:>8.2}us {max:>8.1}us {failed:>8}"
            );
            rows.push(
                json!({"workers": n, "policy": policy, "picks": count, "p50_us": p50,
                "p99_us": p99, "mean_us": mean, "max_us": max, "failed": failed}),
            );
        }
    }
    json!(rows)
}
