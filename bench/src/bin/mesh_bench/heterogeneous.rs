//! Workers of mixed speeds: closed-loop load per policy against the timing model's best
//! split, and bursty open-loop arrivals through `kvmesh bench`.

use std::time::Duration;

use kvmesh_bench::harness::load::{run_load, shakespeare_lines, summary};
use kvmesh_bench::harness::{get_json, load_client, status, wait_for, wait_workers, Proc};
use kvmesh_discovery::testing::Etcd;
use serde_json::{json, Value};

use crate::ctx::{p99, Ctx};

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

/// Two or three sim workers of mixed speeds, per policy: output throughput (whole run and
/// steady state) against what the timing model allows, and TTFT.
pub async fn heterogeneous(ctx: &Ctx) -> Value {
    let quick = ctx.quick;
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
        let rows = run_mix(ctx, mix, &prompts, concurrency).await;
        let ideal = model_ideal(mix.speeds, concurrency, mix.base_ms, mix.per_seq_ms);
        print_mix(mix, &rows, ideal, n, concurrency);
        out.push(
            json!({"mix": mix.name, "speeds": mix.speeds, "model_ideal_tok_per_s": ideal,
            "concurrency": concurrency, "rows": rows}),
        );
    }
    json!(out)
}

/// One mix under each policy, then its fastest node alone: a summary each.
async fn run_mix(ctx: &Ctx, mix: &Mix, prompts: &[String], concurrency: usize) -> Vec<Value> {
    let (km, http) = (&ctx.km, &ctx.http);
    let mut rows = Vec::new();
    // The last run has the fastest node alone: what this machine reaches with every
    // request there (the gateway, the load generator and the worker share its CPUs).
    let fastest = mix.speeds.iter().copied().fold(0.0, f64::max);
    // `prefix` too: these prompts share no block, so it should match least-loaded.
    for policy in [
        "round-robin",
        "least-loaded",
        "power-of-two",
        "prefix",
        "fastest-alone",
    ] {
        let etcd = Etcd::start();
        let cluster = format!("bench-het-{policy}");
        let alone = policy == "fastest-alone";
        let _workers: Vec<Proc> = mix
            .speeds
            .iter()
            .enumerate()
            .filter(|(_, &sp)| !alone || sp == fastest)
            .map(|(i, sp)| {
                let speed = sp.to_string();
                let mut args = vec!["--sim-speed", &speed];
                args.extend_from_slice(mix.timing);
                km.worker(&etcd, &cluster, &format!("w{i}-{sp}x"), &args)
            })
            .collect();
        let routing = if alone { "round-robin" } else { policy };
        let gw = km.gateway(&etcd, &cluster, "gw", routing);
        wait_workers(http, &gw, _workers.len()).await;
        let (samples, wall) = run_load(http, &gw.http, prompts.to_vec(), 64, concurrency).await;
        let mut sum = summary(policy, &samples, wall);
        sum["routed"] = status(http, &gw).await["router"]["workers"].clone();
        rows.push(sum);
    }
    rows
}

/// One mix's table: each policy against round-robin and the model's best.
fn print_mix(mix: &Mix, rows: &[Value], ideal: f64, n: usize, concurrency: usize) {
    let tps = |r: &Value| r["output_tok_per_s"].as_f64().unwrap();
    // Steady state: all `concurrency` requests in flight (no ramp-up or drain), as
    // the model assumes; a run too short for a window falls back to the whole run.
    let steady = |r: &Value| r["steady_output_tok_per_s"].as_f64().unwrap_or(tps(r));
    let (rr, rr_steady) = (tps(&rows[0]), steady(&rows[0]));
    println!(
        "\n== heterogeneous {}: sim workers, {n} requests x 64 tokens, concurrency {concurrency} ==",
        mix.name
    );
    let alone = rows.last().unwrap();
    println!(
        "   best split the timing model allows: {ideal:.0} tok/s ({:.2}x round-robin's steady state); \
         the fastest node alone reaches {:.0} here ({:.0} steady, {:.2}x)",
        ideal / rr_steady,
        tps(alone),
        steady(alone),
        steady(alone) / rr_steady
    );
    println!(
        "{:>13} {:>13} {:>9} {:>13} {:>9} {:>10} {:>10} {:>10} {:>24}",
        "policy",
        "output tok/s",
        "vs rr",
        "steady tok/s",
        "vs rr",
        "of ideal",
        "p99 TTFT",
        "mean TTFT",
        "routed (slow..fast)"
    );
    for r in rows {
        let routed: Vec<String> = r["routed"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .iter()
            .map(|x| x["routed"].to_string())
            .collect();
        println!(
            "{:>13} {:>13.1} {:>8.2}x {:>13.1} {:>8.2}x {:>9.0}% {:>8.1}ms {:>8.1}ms {:>24}",
            r["label"].as_str().unwrap(),
            tps(r),
            tps(r) / rr,
            steady(r),
            steady(r) / rr_steady,
            100.0 * steady(r) / ideal,
            r["ttft_ms"]["p99"].as_f64().unwrap(),
            r["ttft_ms"]["mean"].as_f64().unwrap(),
            routed.join("/")
        );
    }
}

/// Bursty open-loop arrivals on 1x + 3x sim workers (`kvmesh bench --request-rate R
/// --burstiness 0.3`, gamma gaps: bursts and lulls), at 90% of what the timing model says
/// the pair can generate: output throughput and TTFT per policy.
pub fn bursty(ctx: &Ctx) -> Value {
    let (km, quick) = (&ctx.km, ctx.quick);
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
                km.worker(
                    &etcd,
                    &cluster,
                    &format!("w{i}-{sp}x"),
                    &["--sim-speed", &speed],
                )
            })
            .collect();
        let gw = km.gateway(&etcd, &cluster, "gw", policy);
        let http = load_client(Duration::from_secs(120));
        let rt = tokio::runtime::Handle::current();
        tokio::task::block_in_place(|| {
            rt.block_on(async {
                wait_workers(&http, &gw, speeds.len()).await;
                // `kvmesh bench` names the model /v1/models lists first: a worker connected
                // a moment ago may not be routable yet.
                wait_for("the gateway lists its model", 20, async || {
                    get_json(&http, &gw, "/v1/models").await["data"]
                        .as_array()
                        .is_some_and(|d| !d.is_empty())
                })
                .await;
            })
        });
        let dir = std::env::temp_dir().join(format!(
            "kvmesh-mesh-bench-burst-{}-{policy}",
            std::process::id()
        ));
        let (out_arg, n_arg, conc_arg) = (out_len.to_string(), n.to_string(), conc.to_string());
        let rate_arg = format!("{rate:.3}");
        let args = [
            ["--base-url", &gw.http, "--dataset", "random"].as_slice(),
            &["--input-len", "64", "--output-len", &out_arg],
            &["--num-prompts", &n_arg],
            &["--request-rate", &rate_arg, "--burstiness", "0.3"],
            &["--max-concurrency", &conc_arg, "--seed", "7"],
            &["--label", policy],
        ]
        .concat();
        ctx.kvmesh_bench(&args, &dir, policy);
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
        rows.push(json!({
            "label": policy,
            "output_tok_per_s": m["output_throughput"],
            "ttft_p99_ms": p99(&m["ttft_ms"]),
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
