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
    gateway, load_client, node, one, run_load, s, shakespeare_lines, spawn, status, summary,
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

async fn heterogeneous(http: &reqwest::Client, quick: bool) -> Value {
    let lines = shakespeare_lines();
    let n = if quick { 120 } else { 400 };
    let prompts: Vec<String> = (0..n)
        .map(|i| lines[(i * 7) % lines.len()].clone())
        .collect();
    let mut rows = Vec::new();
    for policy in ["round-robin", "least-loaded"] {
        let etcd = Etcd::start();
        let cluster = format!("bench-het-{policy}");
        let _slow = node(
            &etcd,
            &cluster,
            "slow-1x",
            &["--roles", "worker", "--backend", "sim", "--sim-speed", "1"],
        );
        let _fast = node(
            &etcd,
            &cluster,
            "fast-3x",
            &["--roles", "worker", "--backend", "sim", "--sim-speed", "3"],
        );
        let gw = gateway(&etcd, &cluster, policy);
        wait_workers(http, &gw, 2).await;
        let (samples, wall) = run_load(http, &gw.http, prompts.clone(), 64, 48).await;
        let mut sum = summary(policy, &samples, wall);
        sum["routed"] = status(http, &gw).await["router"]["workers"].clone();
        rows.push(sum);
    }
    println!(
        "\n== heterogeneous: sim workers at 1x and 3x, {n} requests x 64 tokens, concurrency 48 =="
    );
    println!(
        "{:>13} {:>14} {:>12} {:>12} {:>22}",
        "policy", "output tok/s", "p99 TTFT", "mean TTFT", "routed slow/fast"
    );
    for r in &rows {
        let w = r["routed"].as_array().cloned().unwrap_or_default();
        let get = |id: &str| {
            w.iter()
                .find(|x| x["node_id"] == id)
                .map_or(0, |x| x["routed"].as_u64().unwrap_or(0))
        };
        println!(
            "{:>13} {:>14.1} {:>10.1}ms {:>10.1}ms {:>22}",
            r["label"].as_str().unwrap(),
            r["output_tok_per_s"].as_f64().unwrap(),
            r["ttft_ms"]["p99"].as_f64().unwrap(),
            r["ttft_ms"]["mean"].as_f64().unwrap(),
            format!("{}/{}", get("slow-1x"), get("fast-3x"))
        );
    }
    json!(rows)
}

async fn prefix_routing(http: &reqwest::Client, quick: bool) -> Value {
    let lines = shakespeare_lines();
    let (conversations, turns) = if quick { (16, 4) } else { (32, 5) };
    let mut rows = Vec::new();
    for policy in ["round-robin", "prefix"] {
        let etcd = Etcd::start();
        let cluster = format!("bench-prefix-{policy}");
        let worker_args = [
            "--roles",
            "worker",
            "--backend",
            "sim",
            "--sim-prefill-us-per-token",
            "400",
        ];
        let _ws: Vec<Proc> = (0..4)
            .map(|i| node(&etcd, &cluster, &format!("w{i}"), &worker_args))
            .collect();
        let gw = gateway(&etcd, &cluster, policy);
        wait_workers(http, &gw, 4).await;
        // Each conversation: a long shared system part, then turns that append to it.
        let t0 = Instant::now();
        let tasks: Vec<_> = (0..conversations)
            .map(|c| {
                let (http, base) = (http.clone(), gw.http.clone());
                let lines = lines.clone();
                tokio::spawn(async move {
                    let mut history: String = (0..12)
                        .map(|k| lines[(c * 131 + k) % lines.len()].as_str())
                        .collect::<Vec<_>>()
                        .join("\n");
                    let mut out = Vec::new();
                    for t in 0..turns {
                        history.push_str("\nQUESTIONER: ");
                        history.push_str(&lines[(c * 17 + t * 5) % lines.len()]);
                        history.push_str("\nKVMESH:");
                        let s = one(&http, &base, &history, 24).await;
                        // The reply is not known as text here; a fixed line stands in for it
                        // in the next turn (the cache still matches the prompt part).
                        history.push_str(&lines[(c * 29 + t) % lines.len()]);
                        out.push(s);
                    }
                    out
                })
            })
            .collect();
        let mut samples = Vec::new();
        for t in tasks {
            samples.extend(t.await.unwrap());
        }
        let wall = t0.elapsed().as_secs_f64();
        rows.push(summary(policy, &samples, wall));
    }
    println!(
        "\n== prefix routing: {conversations} conversations x {turns} turns over 4 sim workers =="
    );
    println!(
        "{:>12} {:>15} {:>12} {:>12} {:>10}",
        "policy", "cache hit rate", "mean TTFT", "p99 TTFT", "req/s"
    );
    for r in &rows {
        println!(
            "{:>12} {:>14.1}% {:>10.1}ms {:>10.1}ms {:>10.1}",
            r["label"].as_str().unwrap(),
            100.0 * r["cache_hit_rate"].as_f64().unwrap(),
            r["ttft_ms"]["mean"].as_f64().unwrap(),
            r["ttft_ms"]["p99"].as_f64().unwrap(),
            r["req_per_s"].as_f64().unwrap()
        );
    }
    json!(rows)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = BenchArgs::parse("bench/results/mesh.json");
    let quick = args.quick;
    let http = load_client(Duration::from_secs(120));
    let overhead = mesh_overhead(&http, quick).await;
    let het = heterogeneous(&http, quick).await;
    let prefix = prefix_routing(&http, quick).await;
    args.write(json!({
        "mesh_overhead": overhead,
        "heterogeneous": het,
        "prefix_routing": prefix,
    }));
}
