//! Cluster-mode benchmarks, on `sim` workers so they measure the mesh and the routing, not
//! the math. Each scenario starts its own etcd and `kvmesh` processes on loopback, runs a
//! fixed workload through the OpenAI API, prints a table and writes JSON.
//!
//! 1. **Mesh overhead**: a zero-cost sim worker (no prefill or decode time) behind
//!    gateway → router → QUIC → worker, against the same worker in-process (`kvmesh serve`):
//!    requests/s and the added p50/p99 latency, at concurrency 1 and 16.
//! 2. **Heterogeneous nodes**: two sim workers at 1x and 3x speed, `round-robin` against
//!    `least-loaded`: output throughput and p99 TTFT.
//! 3. **Prefix routing**: a multi-turn chat workload (each turn resends the conversation so
//!    far) over 4 workers, `prefix` against `round-robin`: prefix-cache hit rate (cached
//!    prompt tokens / prompt tokens, from the API's usage) and mean TTFT.
//!
//! `cargo build --release && target/release/mesh-bench [--quick] [--json PATH]`
//! (needs `etcd` on PATH, as the tests do; `bash scripts/test.sh` installs it).

mod harness;

use std::time::Instant;

use std::time::Duration;

use harness::{
    gateway, kvmesh_bin, load_client, node, run_load, s, shakespeare_lines, spawn, status, summary,
    wait_workers, BenchArgs, Proc,
};
use kvmesh_discovery::testing::Etcd;
use serde_json::{json, Value};

const ZERO_COST: [&str; 8] = [
    "--backend",
    "sim",
    "--sim-prefill-us-per-token",
    "0",
    "--sim-decode-ms",
    "0",
    "--sim-decode-us-per-seq",
    "0",
];

async fn mesh_overhead(http: &reqwest::Client, quick: bool) -> Value {
    let lines = shakespeare_lines();
    let n = if quick { 200 } else { 1000 };
    let prompts: Vec<String> = (0..n).map(|i| lines[i % lines.len()].clone()).collect();
    let mut rows = Vec::new();
    let serve = spawn(
        &[
            s(&["serve", "--host", "127.0.0.1", "--port", "0"]),
            s(&ZERO_COST),
        ]
        .concat(),
    );
    let etcd = Etcd::start();
    let _w = node(
        &etcd,
        "bench-mesh",
        "w1",
        &[&["--roles", "worker"][..], &ZERO_COST[..]].concat(),
    );
    let gw = gateway(&etcd, "bench-mesh", "round-robin");
    wait_workers(http, &gw, 1).await;
    for conc in [1usize, 16] {
        // Warm both paths, then measure them back to back.
        let _ = run_load(http, &serve.http, prompts[..20].to_vec(), 16, conc).await;
        let _ = run_load(http, &gw.http, prompts[..20].to_vec(), 16, conc).await;
        let (a, wa) = run_load(http, &serve.http, prompts.clone(), 16, conc).await;
        let (b, wb) = run_load(http, &gw.http, prompts.clone(), 16, conc).await;
        let sa = summary(&format!("in-process c={conc}"), &a, wa);
        let sb = summary(&format!("mesh c={conc}"), &b, wb);
        rows.push(json!({"concurrency": conc, "in_process": sa, "mesh": sb,
            "added_p50_ms": sb["e2e_ms"]["p50"].as_f64().unwrap() - sa["e2e_ms"]["p50"].as_f64().unwrap(),
            "added_p99_ms": sb["e2e_ms"]["p99"].as_f64().unwrap() - sa["e2e_ms"]["p99"].as_f64().unwrap(),
            "req_per_s_ratio": sb["req_per_s"].as_f64().unwrap() / sa["req_per_s"].as_f64().unwrap()}));
    }
    println!("\n== mesh overhead: zero-cost sim worker, 16 output tokens, streamed ==");
    println!(
        "{:>5} {:>14} {:>14} {:>8} {:>12} {:>12} {:>12} {:>12}",
        "conc",
        "in-proc req/s",
        "mesh req/s",
        "ratio",
        "in-proc p50",
        "mesh p50",
        "in-proc p99",
        "mesh p99"
    );
    for r in &rows {
        let (a, b) = (&r["in_process"], &r["mesh"]);
        println!(
            "{:>5} {:>14.1} {:>14.1} {:>8.2} {:>10.2}ms {:>10.2}ms {:>10.2}ms {:>10.2}ms",
            r["concurrency"],
            a["req_per_s"].as_f64().unwrap(),
            b["req_per_s"].as_f64().unwrap(),
            r["req_per_s_ratio"].as_f64().unwrap(),
            a["e2e_ms"]["p50"].as_f64().unwrap(),
            b["e2e_ms"]["p50"].as_f64().unwrap(),
            a["e2e_ms"]["p99"].as_f64().unwrap(),
            b["e2e_ms"]["p99"].as_f64().unwrap()
        );
    }
    json!(rows)
}

/// Output tokens per second the sim timing model allows at best when `concurrency`
/// sequences are spread over workers of these speeds (each worker's step: `base_ms +
/// per_seq_ms` per sequence, over its speed; prompts ignored): the best split, by search.
fn model_ideal(speeds: &[f64], concurrency: usize, base_ms: f64, per_seq_ms: f64) -> f64 {
    fn best(speeds: &[f64], left: usize, base: f64, per: f64) -> f64 {
        let Some((&s, rest)) = speeds.split_first() else {
            return 0.0;
        };
        let rate = |n: usize| {
            if n == 0 {
                0.0
            } else {
                n as f64 * s / (base + per * n as f64)
            }
        };
        if rest.is_empty() {
            return rate(left);
        }
        (0..=left)
            .map(|n| rate(n) + best(rest, left - n, base, per))
            .fold(0.0, f64::max)
    }
    best(speeds, concurrency, base_ms, per_seq_ms) * 1000.0
}

/// A workload on workers of mixed speeds, per policy.
struct Mix {
    name: &'static str,
    speeds: &'static [f64],
    /// Extra worker flags: the timing regime.
    timing: &'static [&'static str],
    base_ms: f64,
    per_seq_ms: f64,
}

async fn heterogeneous(http: &reqwest::Client, quick: bool) -> Value {
    let lines = shakespeare_lines();
    let n = if quick { 120 } else { 400 };
    let concurrency = 48;
    let prompts: Vec<String> = (0..n)
        .map(|i| lines[(i * 7) % lines.len()].clone())
        .collect();
    let mixes = [
        Mix {
            name: "1x+3x",
            speeds: &[1.0, 3.0],
            timing: &[],
            base_ms: 8.0,
            per_seq_ms: 0.1,
        },
        Mix {
            name: "1x+2x+4x",
            speeds: &[1.0, 2.0, 4.0],
            timing: &[],
            base_ms: 8.0,
            per_seq_ms: 0.1,
        },
        // Each sequence costs more than the step's fixed part: throughput follows speed.
        Mix {
            name: "1x+3x per-seq-bound",
            speeds: &[1.0, 3.0],
            timing: &["--sim-decode-ms", "1", "--sim-decode-us-per-seq", "1000"],
            base_ms: 1.0,
            per_seq_ms: 1.0,
        },
    ];
    let mut out = Vec::new();
    for mix in &mixes {
        let mut rows = Vec::new();
        for policy in ["round-robin", "least-loaded", "power-of-two"] {
            let etcd = Etcd::start();
            let cluster = format!("bench-het-{policy}");
            let _workers: Vec<Proc> = mix
                .speeds
                .iter()
                .enumerate()
                .map(|(i, sp)| {
                    let speed = sp.to_string();
                    let mut args = vec!["--roles", "worker", "--backend", "sim", "--sim-speed"];
                    args.push(&speed);
                    args.extend_from_slice(mix.timing);
                    node(&etcd, &cluster, &format!("w{i}-{sp}x"), &args)
                })
                .collect();
            let gw = gateway(&etcd, &cluster, policy);
            wait_workers(http, &gw, mix.speeds.len()).await;
            let (samples, wall) = run_load(http, &gw.http, prompts.clone(), 64, concurrency).await;
            let mut sum = summary(policy, &samples, wall);
            sum["routed"] = status(http, &gw).await["router"]["workers"].clone();
            rows.push(sum);
        }
        let ideal = model_ideal(mix.speeds, concurrency, mix.base_ms, mix.per_seq_ms);
        let rr = rows[0]["output_tok_per_s"].as_f64().unwrap();
        println!(
            "\n== heterogeneous {}: sim workers, {n} requests x 64 tokens, concurrency {concurrency} ==",
            mix.name
        );
        println!(
            "   best split the timing model allows: {ideal:.0} tok/s ({:.2}x round-robin's measured)",
            ideal / rr
        );
        println!(
            "{:>13} {:>13} {:>9} {:>10} {:>10} {:>10} {:>24}",
            "policy",
            "output tok/s",
            "vs rr",
            "of ideal",
            "p99 TTFT",
            "mean TTFT",
            "routed (slow..fast)"
        );
        for r in &rows {
            let routed: Vec<String> = r["routed"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .iter()
                .map(|x| x["routed"].to_string())
                .collect();
            let tps = r["output_tok_per_s"].as_f64().unwrap();
            println!(
                "{:>13} {:>13.1} {:>8.2}x {:>9.0}% {:>8.1}ms {:>8.1}ms {:>24}",
                r["label"].as_str().unwrap(),
                tps,
                tps / rr,
                100.0 * tps / ideal,
                r["ttft_ms"]["p99"].as_f64().unwrap(),
                r["ttft_ms"]["mean"].as_f64().unwrap(),
                routed.join("/")
            );
        }
        out.push(
            json!({"mix": mix.name, "speeds": mix.speeds, "model_ideal_tok_per_s": ideal,
            "concurrency": concurrency, "rows": rows}),
        );
    }
    json!(out)
}

/// Bursty open-loop arrivals on 1x + 3x sim workers (`kvmesh bench --request-rate R
/// --burstiness 0.3`, gamma gaps: bursts and lulls), at 90% of what the timing model says
/// the pair can generate: output throughput and TTFT per policy.
fn bursty(quick: bool) -> Value {
    let n = if quick { 120 } else { 400 };
    let (speeds, out_len, conc) = ([1.0, 3.0], 64usize, 48usize);
    let ideal = model_ideal(&speeds, conc, 8.0, 0.1);
    let rate = 0.9 * ideal / out_len as f64;
    let mut rows = Vec::new();
    println!(
        "\n== bursty arrivals: 1x+3x sim workers, {n} requests x {out_len} tokens at {rate:.1} req/s (90% of the model's best), burstiness 0.3 =="
    );
    println!(
        "{:>13} {:>13} {:>9} {:>10} {:>10}",
        "policy", "output tok/s", "vs rr", "p99 TTFT", "mean TTFT"
    );
    for policy in ["round-robin", "least-loaded", "power-of-two"] {
        let etcd = Etcd::start();
        let cluster = format!("bench-burst-{policy}");
        let _workers: Vec<Proc> = speeds
            .iter()
            .enumerate()
            .map(|(i, sp)| {
                let speed = sp.to_string();
                node(
                    &etcd,
                    &cluster,
                    &format!("w{i}-{sp}x"),
                    &[
                        "--roles",
                        "worker",
                        "--backend",
                        "sim",
                        "--sim-speed",
                        &speed,
                    ],
                )
            })
            .collect();
        let gw = gateway(&etcd, &cluster, policy);
        let http = load_client(Duration::from_secs(120));
        let rt = tokio::runtime::Handle::current();
        tokio::task::block_in_place(|| rt.block_on(wait_workers(&http, &gw, speeds.len())));
        let dir = std::env::temp_dir().join(format!(
            "kvmesh-mesh-bench-burst-{}-{policy}",
            std::process::id()
        ));
        let st = std::process::Command::new(kvmesh_bin())
            .args(["bench", "--base-url", &gw.http, "--dataset", "random"])
            .args(["--input-len", "64", "--output-len", &out_len.to_string()])
            .args(["--num-prompts", &n.to_string()])
            .args([
                "--request-rate",
                &format!("{rate:.3}"),
                "--burstiness",
                "0.3",
            ])
            .args(["--max-concurrency", &conc.to_string(), "--seed", "7"])
            .args(["--label", policy, "--result-dir"])
            .arg(&dir)
            .stdout(std::process::Stdio::null())
            .status()
            .expect("run kvmesh bench");
        assert!(st.success(), "kvmesh bench failed for {policy}");
        let run: Value = std::fs::read_dir(&dir)
            .unwrap()
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|p| {
                let name = p.file_name().unwrap().to_string_lossy().to_string();
                name.ends_with(".json") && !name.contains("summary")
            })
            .map(|p| serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap())
            .expect("the run's JSON");
        let _ = std::fs::remove_dir_all(&dir);
        let m = &run["metrics"];
        let p99 = m["ttft_ms"]["percentiles"]
            .as_array()
            .and_then(|ps| ps.iter().find(|p| p[0].as_f64() == Some(99.0)))
            .and_then(|p| p[1].as_f64())
            .unwrap_or(f64::NAN);
        rows.push(json!({
            "label": policy,
            "output_tok_per_s": m["output_throughput"],
            "ttft_p99_ms": p99,
            "ttft_mean_ms": m["ttft_ms"]["mean"],
            "failed": m["failed"],
        }));
    }
    let rr = rows[0]["output_tok_per_s"].as_f64().unwrap_or(f64::NAN);
    for r in &rows {
        let tps = r["output_tok_per_s"].as_f64().unwrap_or(f64::NAN);
        println!(
            "{:>13} {:>13.1} {:>8.2}x {:>8.1}ms {:>8.1}ms",
            r["label"].as_str().unwrap(),
            tps,
            tps / rr,
            r["ttft_p99_ms"].as_f64().unwrap_or(f64::NAN),
            r["ttft_mean_ms"].as_f64().unwrap_or(f64::NAN),
        );
    }
    json!({"speeds": speeds, "request_rate": rate, "burstiness": 0.3, "requests": n,
           "model_ideal_tok_per_s": ideal, "rows": rows})
}

/// How long a routing decision takes as the cluster grows: building every candidate (load,
/// capacity, the prompt's cached blocks in each worker's KV view) and picking, against
/// power-of-two's two candidates. In-process, over synthetic views holding 4096 blocks
/// each, for a 1024-token prompt.
fn pick_time(quick: bool) -> Value {
    use kvmesh_actors::policy::{
        pick, two_choices, Candidate, KvView, Policy, PrefixTuning, RequestShape,
    };
    let iters = if quick { 2_000 } else { 20_000 };
    let hashes: Vec<u64> = (0..64).collect();
    let mut rows = Vec::new();
    println!("\n== routing decision time (in-process, per pick) ==");
    println!(
        "{:>8} {:>14} {:>14} {:>14}",
        "workers", "least-loaded", "prefix", "power-of-two"
    );
    for n in [8usize, 64, 256] {
        let now = Instant::now();
        let views: Vec<KvView> = (0..n)
            .map(|w| {
                let mut v = KvView::default();
                let held: Vec<u64> = (0..4096u64).map(|k| k * 1000 + w as u64).collect();
                v.apply(true, &held, &[]);
                // Worker w holds the prompt's first w % 64 blocks.
                v.apply(false, &hashes[..w % 64], &[]);
                v
            })
            .collect();
        let shape = RequestShape {
            prompt_tokens: 1024,
            block_size: 16,
        };
        let cand = |i: usize, with_hits: bool| Candidate {
            load: (i % 7) as f64,
            capacity: 100.0 + i as f64,
            cached_blocks: if with_hits {
                views[i].leading_hits(&hashes, now).1
            } else {
                0
            },
            queued_prompt_tokens: 0.0,
            prefill_rate: 5000.0,
        };
        let time = |policy: Policy| {
            let t0 = Instant::now();
            let mut sink = 0usize;
            for t in 0..iters as u64 {
                let cands: Vec<Candidate> = match policy {
                    Policy::PowerOfTwo => two_choices(n, t)
                        .into_iter()
                        .map(|i| cand(i, false))
                        .collect(),
                    Policy::Prefix => (0..n).map(|i| cand(i, true)).collect(),
                    _ => (0..n).map(|i| cand(i, false)).collect(),
                };
                sink += pick(policy, &cands, shape, t, PrefixTuning::default()).unwrap();
            }
            std::hint::black_box(sink);
            t0.elapsed().as_secs_f64() * 1e6 / iters as f64
        };
        let (ll, px, p2) = (
            time(Policy::LeastLoaded),
            time(Policy::Prefix),
            time(Policy::PowerOfTwo),
        );
        println!("{n:>8} {ll:>12.2}us {px:>12.2}us {p2:>12.2}us");
        rows.push(
            json!({"workers": n, "least_loaded_us": ll, "prefix_us": px, "power_of_two_us": p2}),
        );
    }
    json!(rows)
}

/// `kvmesh bench --dataset conversation` against a gateway: the run's JSON.
fn conversation_run(gw: &Proc, label: &str, conversations: usize, turns: usize) -> Value {
    let dir = std::env::temp_dir().join(format!("kvmesh-mesh-bench-{}", std::process::id()));
    let conc = conversations.to_string();
    let turns = turns.to_string();
    let st = std::process::Command::new(kvmesh_bin())
        .args([
            "bench",
            "--base-url",
            &gw.http,
            "--dataset",
            "conversation",
            "--conversations",
            &conc,
            "--turns",
            &turns,
            "--input-len",
            "128",
            "--turn-input-len",
            "24",
            "--output-len",
            "24",
            "--concurrency",
            &conc,
            "--label",
            label,
            "--result-dir",
        ])
        .arg(&dir)
        .stdout(std::process::Stdio::null())
        .status()
        .expect("run kvmesh bench");
    assert!(st.success(), "kvmesh bench failed for {label}");
    let path = dir.join(format!("{label}-c{conc}.json"));
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    v
}

/// The 99th percentile of a `kvmesh bench` statistic (`percentiles: [[p, value], …]`).
fn p99(stat: &Value) -> f64 {
    stat["percentiles"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p[0].as_f64() == Some(99.0)))
        .and_then(|p| p[1].as_f64())
        .unwrap_or(f64::NAN)
}

async fn prefix_routing(http: &reqwest::Client, quick: bool) -> Value {
    let (conversations, turns) = if quick { (16, 4) } else { (32, 5) };
    let worker_args = [
        "--roles",
        "worker",
        "--backend",
        "sim",
        "--sim-prefill-us-per-token",
        "400",
    ];
    let mut rows = Vec::new();
    // The all-knowing router's hit rate: every turn finds its history, as on one worker
    // that holds every conversation.
    for (label, policy, workers) in [
        ("one-worker", "round-robin", 1),
        ("round-robin", "round-robin", 4),
        ("least-loaded", "least-loaded", 4),
        ("prefix", "prefix", 4),
    ] {
        let etcd = Etcd::start();
        let cluster = format!("bench-prefix-{label}");
        let _ws: Vec<Proc> = (0..workers)
            .map(|i| node(&etcd, &cluster, &format!("w{i}"), &worker_args))
            .collect();
        let gw = gateway(&etcd, &cluster, policy);
        wait_workers(http, &gw, workers).await;
        let run = conversation_run(&gw, label, conversations, turns);
        let m = &run["metrics"];
        let st = status(http, &gw).await;
        rows.push(json!({
            "label": label,
            "workers": workers,
            "hit_rate": m["prefix_cache_hit_rate"],
            "later_turns_hit_rate": m["conversation"]["later_turns"]["prefix_cache_hit_rate"],
            "ttft_ms": m["ttft_ms"],
            "later_turns_ttft_ms": m["conversation"]["later_turns"]["ttft_ms"],
            "output_tok_per_s": m["output_throughput"],
            "failed": m["failed"],
            "prefix_predictions": st["router"]["prefix_predictions"],
            "routed": st["router"]["workers"],
        }));
    }
    let f = |r: &Value, k: &str| r[k].as_f64().unwrap_or(f64::NAN);
    let oracle = f(&rows[0], "hit_rate");
    let rr_ttft = rows[1]["ttft_ms"]["mean"].as_f64().unwrap_or(f64::NAN);
    println!(
        "\n== prefix routing: kvmesh bench --dataset conversation, {conversations} conversations x {turns} turns, 4 sim workers =="
    );
    println!(
        "{:>13} {:>10} {:>12} {:>11} {:>12} {:>10} {:>22}",
        "policy",
        "hit rate",
        "of one-wkr",
        "mean TTFT",
        "vs rr TTFT",
        "p99 TTFT",
        "predicted exact/all"
    );
    for r in &rows {
        let mean = r["ttft_ms"]["mean"].as_f64().unwrap_or(f64::NAN);
        let p = &r["prefix_predictions"];
        let total: u64 = ["exact", "fewer", "more"]
            .iter()
            .map(|k| p[*k].as_u64().unwrap_or(0))
            .sum();
        println!(
            "{:>13} {:>9.1}% {:>11.0}% {:>9.1}ms {:>11.2}x {:>8.1}ms {:>22}",
            r["label"].as_str().unwrap(),
            100.0 * f(r, "hit_rate"),
            100.0 * f(r, "hit_rate") / oracle,
            mean,
            rr_ttft / mean,
            p99(&r["ttft_ms"]),
            format!("{}/{}", p["exact"].as_u64().unwrap_or(0), total)
        );
    }
    json!(rows)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = BenchArgs::parse("bench/results/mesh.json");
    let quick = args.quick;
    let http = load_client(Duration::from_secs(120));
    let mut out = json!({});
    if args.runs("overhead") {
        out["mesh_overhead"] = mesh_overhead(&http, quick).await;
    }
    if args.runs("heterogeneous") {
        out["heterogeneous"] = heterogeneous(&http, quick).await;
    }
    if args.runs("bursty") {
        out["bursty"] = bursty(quick);
    }
    if args.runs("prefix") {
        out["prefix_routing"] = prefix_routing(&http, quick).await;
    }
    if args.runs("picks") {
        out["pick_time"] = pick_time(quick);
    }
    args.write(out);
}
