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
//! 4. **Router scale**: pick time in a running router over 8, 64 and 256 sim workers hosted
//!    by one `kvmesh node --replicas N` process.
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
                    let mut args = vec!["--roles", "worker", "--backend", "sim", "--sim-speed"];
                    args.push(&speed);
                    args.extend_from_slice(mix.timing);
                    node(&etcd, &cluster, &format!("w{i}-{sp}x"), &args)
                })
                .collect();
            let gw = gateway(&etcd, &cluster, if alone { "round-robin" } else { policy });
            wait_workers(http, &gw, _workers.len()).await;
            let (samples, wall) = run_load(http, &gw.http, prompts.clone(), 64, concurrency).await;
            let mut sum = summary(policy, &samples, wall);
            sum["routed"] = status(http, &gw).await["router"]["workers"].clone();
            rows.push(sum);
        }
        let ideal = model_ideal(mix.speeds, concurrency, mix.base_ms, mix.per_seq_ms);
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
        for r in &rows {
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
/// capacity, the prompt's cached blocks from the router's cluster-wide block index) and
/// picking, against power-of-two's two candidates. In-process, over an index of workers
/// holding 4096 blocks each, for a 1024-token prompt (64 blocks).
fn pick_time(quick: bool) -> Value {
    use kvmesh_actors::kv_index::KvIndex;
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
            let mut index = KvIndex::default();
            for w in 0..n {
                let held: Vec<u64> = (0..4096u64).map(|k| k * 1000 + w as u64 + 64).collect();
                index.apply(w as u32, true, &held, &[]);
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
                index.apply(w as u32, false, &hashes[..upto], &[]);
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

/// Pick time in a real router as the cluster grows: one `kvmesh node --replicas N` process
/// hosts N sim workers (each its own member: record, lease, QUIC endpoint, engine), and a
/// gateway per policy routes short requests over them. The routers' own account of their
/// decisions (`/status` `router.pick_time`), beside the in-process figures above.
async fn router_scale(http: &reqwest::Client, quick: bool) -> Value {
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
        let _workers = node(
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
            let gw = harness::gateway_named(&etcd, &cluster, &format!("gw-{policy}"), policy, &[]);
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

/// Percentile `p` (0..=100) of microsecond samples.
fn pct(xs: &mut [f64], p: f64) -> f64 {
    xs.sort_by(|a, b| a.total_cmp(b));
    if xs.is_empty() {
        return f64::NAN;
    }
    xs[((p / 100.0) * (xs.len() - 1) as f64).round() as usize]
}

/// Where the hop's microseconds go, piece by piece, in this process: a QUIC request and
/// first answer between two endpoints on loopback (each on its own runtime, as two nodes
/// are), with a new stream per request as the router opens, and on one kept stream; rkyv
/// framing of a request and a token; a task spawn plus a channel hand-off. Set against the
/// added TTFT the overhead section measures end to end.
/// Round trips of one 100-byte UDP datagram between this thread and an echoing one, both
/// blocking on loopback sockets: back to back, then each after a 1 ms pause. Microseconds.
fn udp_round_trips(iters: usize) -> (Vec<f64>, Vec<f64>) {
    use std::net::UdpSocket;
    let echo = UdpSocket::bind("127.0.0.1:0").expect("bind echo socket");
    let there = echo.local_addr().unwrap();
    let me = UdpSocket::bind("127.0.0.1:0").expect("bind socket");
    me.connect(there).unwrap();
    me.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let echoer = std::thread::spawn(move || {
        let mut buf = [0u8; 256];
        // Ends on the empty datagram.
        while let Ok((n, from)) = echo.recv_from(&mut buf) {
            if n == 0 || echo.send_to(&buf[..n], from).is_err() {
                break;
            }
        }
    });
    let msg = [7u8; 100];
    let mut buf = [0u8; 256];
    let mut trip = || {
        let t0 = Instant::now();
        me.send(&msg).unwrap();
        me.recv(&mut buf).expect("echo");
        t0.elapsed().as_secs_f64() * 1e6
    };
    let busy: Vec<f64> = (0..iters).map(|_| trip()).collect();
    let idle: Vec<f64> = (0..iters.min(1000))
        .map(|_| {
            std::thread::sleep(Duration::from_millis(1));
            trip()
        })
        .collect();
    let _ = me.send(&[]);
    let _ = echoer.join();
    (busy, idle)
}

fn hop_profile(quick: bool) -> Value {
    use kvmesh_transport::wire::{self, Finish, GenerateRequest, StreamRequest, TokenEvent};
    use kvmesh_transport::{AllowList, NodeEndpoint, NodeIdentity};
    let iters = if quick { 500 } else { 3000 };
    let request = |id: u64| GenerateRequest {
        request_id: id,
        prompt: (0..16).collect(),
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        seed: None,
        max_tokens: 16,
        stop_token_ids: vec![],
        ignore_eos: false,
        logprobs: None,
        resume_draws: 0,
        traceparent: None,
        prefill: None,
    };
    let token = |t: u32, last: bool| TokenEvent::Token {
        token: t,
        logprob: 0.0,
        top: vec![],
        finish: last.then_some(Finish::Length),
        cached_tokens: 0,
    };
    // The worker side: its own runtime, answering each stream with one token per message.
    let (a, b) = (
        NodeIdentity::generate("hop-a").unwrap(),
        NodeIdentity::generate("hop-b").unwrap(),
    );
    let allow = AllowList::default();
    allow.set([a.fingerprint.clone()]);
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    let b2 = b.clone();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let ep = NodeEndpoint::bind("127.0.0.1:0".parse().unwrap(), b2, allow).unwrap();
            addr_tx.send(ep.local_addr()).unwrap();
            let conn = ep.accept().await.unwrap().await.unwrap();
            while let Ok((mut send, mut recv)) = conn.accept_bi().await {
                tokio::spawn(async move {
                    // A stream carries either one request, or (the kept stream) many.
                    while let Ok(Some(StreamRequest::Generate(r))) =
                        wire::read_msg::<StreamRequest>(&mut recv).await
                    {
                        if wire::write_msg(&mut send, &token(r.request_id as u32, true))
                            .await
                            .is_err()
                        {
                            break;
                        }
                    }
                    let _ = send.finish();
                });
            }
        });
    });
    let addr = addr_rx.recv().unwrap();
    let rt = tokio::runtime::Handle::current();
    let (new_stream, kept_stream) = tokio::task::block_in_place(|| {
        rt.block_on(async {
            let ep = NodeEndpoint::bind("127.0.0.1:0".parse().unwrap(), a, AllowList::default())
                .unwrap();
            let conn = ep.connect(addr, &b.fingerprint).await.unwrap();
            let mut fresh = Vec::with_capacity(iters);
            for i in 0..(iters + 100) as u64 {
                let t0 = Instant::now();
                let (mut send, mut recv) = conn.open_bi().await.unwrap();
                wire::write_msg(&mut send, &StreamRequest::Generate(request(i)))
                    .await
                    .unwrap();
                let _ = send.finish();
                let _: TokenEvent = wire::read_msg(&mut recv).await.unwrap().unwrap();
                if i >= 100 {
                    fresh.push(t0.elapsed().as_secs_f64() * 1e6);
                }
            }
            let (mut send, mut recv) = conn.open_bi().await.unwrap();
            let mut kept = Vec::with_capacity(iters);
            for i in 0..(iters + 100) as u64 {
                let t0 = Instant::now();
                wire::write_msg(&mut send, &StreamRequest::Generate(request(i)))
                    .await
                    .unwrap();
                let _: TokenEvent = wire::read_msg(&mut recv).await.unwrap().unwrap();
                if i >= 100 {
                    kept.push(t0.elapsed().as_secs_f64() * 1e6);
                }
            }
            conn.close(0u32.into(), b"done");
            (fresh, kept)
        })
    });
    let (mut fresh, mut kept) = (new_stream, kept_stream);
    // rkyv framing, both ways, per message.
    let n = iters * 20;
    let t0 = Instant::now();
    for i in 0..n as u64 {
        let f = wire::encode(&StreamRequest::Generate(request(i))).unwrap();
        let back = wire::decode::<StreamRequest>(&f).unwrap();
        std::hint::black_box(back);
    }
    let rkyv_request_us = t0.elapsed().as_secs_f64() * 1e6 / n as f64;
    let t0 = Instant::now();
    for i in 0..n as u32 {
        let f = wire::encode(&token(i, false)).unwrap();
        let back = wire::decode::<TokenEvent>(&f).unwrap();
        std::hint::black_box(back);
    }
    let rkyv_token_us = t0.elapsed().as_secs_f64() * 1e6 / n as f64;
    // A spawned task sending one value back over a channel: the router's per-request task.
    let mut hand_off = tokio::task::block_in_place(|| {
        rt.block_on(async {
            let mut xs = Vec::with_capacity(iters);
            for i in 0..iters {
                let t0 = Instant::now();
                let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
                tokio::spawn(async move {
                    let _ = tx.send(i);
                });
                let _ = rx.recv().await;
                xs.push(t0.elapsed().as_secs_f64() * 1e6);
            }
            xs
        })
    });
    // The floor under all of it: one UDP datagram to a peer thread blocked on its socket and
    // straight back, with no QUIC, runtime or encoding; back to back, and after 1 ms idle
    // (both threads asleep, as a worker between requests is).
    let (mut udp_busy, mut udp_idle) = udp_round_trips(iters);
    let row = json!({
        "udp_round_trip_us": {"back_to_back_p50": pct(&mut udp_busy, 50.0),
            "back_to_back_p99": pct(&mut udp_busy, 99.0),
            "after_idle_p50": pct(&mut udp_idle, 50.0), "after_idle_p99": pct(&mut udp_idle, 99.0)},
        "quic_new_stream_round_trip_us": {"p50": pct(&mut fresh, 50.0), "p99": pct(&mut fresh, 99.0)},
        "quic_kept_stream_round_trip_us": {"p50": pct(&mut kept, 50.0), "p99": pct(&mut kept, 99.0)},
        "rkyv_request_encode_decode_us": rkyv_request_us,
        "rkyv_token_encode_decode_us": rkyv_token_us,
        "spawn_and_channel_us": {"p50": pct(&mut hand_off, 50.0), "p99": pct(&mut hand_off, 99.0)},
    });
    println!("\n== where the hop goes (in-process pieces, {iters} each) ==");
    println!(
        "  QUIC request -> first answer, new stream per request  p50 {:>7.1}us  p99 {:>7.1}us",
        row["quic_new_stream_round_trip_us"]["p50"]
            .as_f64()
            .unwrap(),
        row["quic_new_stream_round_trip_us"]["p99"]
            .as_f64()
            .unwrap()
    );
    println!(
        "  QUIC request -> answer on one kept stream             p50 {:>7.1}us  p99 {:>7.1}us",
        row["quic_kept_stream_round_trip_us"]["p50"]
            .as_f64()
            .unwrap(),
        row["quic_kept_stream_round_trip_us"]["p99"]
            .as_f64()
            .unwrap()
    );
    let udp = &row["udp_round_trip_us"];
    println!(
        "  plain UDP datagram there and back (the floor)        p50 {:>7.1}us  p99 {:>7.1}us; after 1 ms idle p50 {:.1}us  p99 {:.1}us",
        udp["back_to_back_p50"].as_f64().unwrap(),
        udp["back_to_back_p99"].as_f64().unwrap(),
        udp["after_idle_p50"].as_f64().unwrap(),
        udp["after_idle_p99"].as_f64().unwrap()
    );
    println!("  rkyv encode + validate + decode: request {rkyv_request_us:.2}us, token {rkyv_token_us:.2}us");
    println!(
        "  task spawn + channel hand-off                         p50 {:>7.1}us  p99 {:>7.1}us",
        row["spawn_and_channel_us"]["p50"].as_f64().unwrap(),
        row["spawn_and_channel_us"]["p99"].as_f64().unwrap()
    );
    row
}

/// `kvmesh bench --dataset conversation` against a gateway: the run's JSON.
fn conversation_run(
    gw: &Proc,
    label: &str,
    conversations: usize,
    turns: usize,
    think_ms: f64,
) -> Value {
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
            "--think-time",
            &think_ms.to_string(),
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

/// The multi-turn workload twice: turns back to back (a closed loop: every conversation
/// always has a request in, so a faster cluster shows as throughput), and with users who
/// pause a second on average before each turn (latency at a load the cluster carries).
async fn prefix_routing(http: &reqwest::Client, quick: bool) -> Value {
    let mut out = Vec::new();
    for think_ms in [0.0, 1000.0] {
        out.push(json!({"think_time_ms": think_ms,
                        "rows": prefix_table(http, quick, think_ms).await}));
    }
    json!(out)
}

async fn prefix_table(http: &reqwest::Client, quick: bool, think_ms: f64) -> Value {
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
        let cluster = format!("bench-prefix-{label}-{think_ms}");
        let _ws: Vec<Proc> = (0..workers)
            .map(|i| node(&etcd, &cluster, &format!("w{i}"), &worker_args))
            .collect();
        let gw = gateway(&etcd, &cluster, policy);
        wait_workers(http, &gw, workers).await;
        let run = conversation_run(&gw, label, conversations, turns, think_ms);
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
        "\n== prefix routing: kvmesh bench --dataset conversation, {conversations} conversations x {turns} turns, 4 sim workers, think time {think_ms} ms =="
    );
    let rr_later = rows[1]["later_turns_ttft_ms"]["mean"]
        .as_f64()
        .unwrap_or(f64::NAN);
    println!(
        "{:>13} {:>10} {:>12} {:>11} {:>12} {:>10} {:>14} {:>10} {:>22}",
        "policy",
        "hit rate",
        "of one-wkr",
        "mean TTFT",
        "vs rr TTFT",
        "p99 TTFT",
        "turns 2+ TTFT",
        "vs rr",
        "predicted exact/all"
    );
    for r in &rows {
        let mean = r["ttft_ms"]["mean"].as_f64().unwrap_or(f64::NAN);
        let p = &r["prefix_predictions"];
        let total: u64 = ["exact", "fewer", "more"]
            .iter()
            .map(|k| p[*k].as_u64().unwrap_or(0))
            .sum();
        let later = r["later_turns_ttft_ms"]["mean"]
            .as_f64()
            .unwrap_or(f64::NAN);
        println!(
            "{:>13} {:>9.1}% {:>11.0}% {:>9.1}ms {:>11.2}x {:>8.1}ms {:>12.1}ms {:>9.2}x {:>22}",
            r["label"].as_str().unwrap(),
            100.0 * f(r, "hit_rate"),
            100.0 * f(r, "hit_rate") / oracle,
            mean,
            rr_ttft / mean,
            p99(&r["ttft_ms"]),
            later,
            rr_later / later,
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
    if args.runs("hop") {
        out["hop_profile"] = hop_profile(quick);
    }
    if args.runs("picks") {
        out["pick_time"] = pick_time(quick);
    }
    if args.runs("scale") {
        out["router_scale"] = router_scale(&http, quick).await;
    }
    args.write(out);
}
