//! The disaggregation effect, on `sim` workers with a realistic timing model (20 µs per
//! prompt token, 8 ms per decode step plus 0.1 ms per sequence: a small model on one GPU)
//! and real KV volumes (a Llama-3.2-1B KV shape: 32 KiB per token, moved over QUIC).
//!
//! 1. **Mixed load**: decode-heavy chat streams (128-token prompts, 64 output tokens, a
//!    fixed number in flight) while long prompts arrive (Poisson); aggregated workers
//!    against the same number of machines split into prefill and decode nodes (2 aggregated
//!    against 1 prefill + 1 decode; the full run adds 4 against 2 + 2). Reported for the
//!    chat streams: P99 TPOT, P99 ITL and P99 TTFT; for the long prompts: P99 and mean TTFT.
//!    Swept over prompt length × arrival rate, to show where disaggregation stops paying.
//! 2. **Isolated TTFT**: one long prompt at a time, aggregated against disaggregated: what
//!    the transfer adds to time to first token when nothing else runs.
//!
//! `cargo build --release && target/release/disagg-bench [--quick] [--json PATH]`
//! (needs `etcd` on PATH, as the tests do).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use kvmesh_bench::harness::load::{mean, one_body, pct, Sample};
use kvmesh_bench::harness::{load_client, wait_workers, Kvmesh, Proc};
use kvmesh_bench::programs::{kvmesh, write_results};
use kvmesh_discovery::testing::Etcd;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Exp};
use serde_json::{json, Value};

/// The disaggregation effect on sim workers: chat streams beside long prompts, aggregated
/// against prefill + decode nodes, and the isolated TTFT a KV transfer adds.
#[derive(Parser)]
#[command(name = "disagg-bench")]
struct Args {
    /// One sweep point and the smaller setups only, with fewer requests.
    #[arg(long)]
    quick: bool,
    /// Where the results go.
    #[arg(long, value_name = "PATH", default_value = "bench/results/disagg.json")]
    json: PathBuf,
    /// Only the isolated TTFT of each setup (every transport), not the mixed-load sweep.
    #[arg(long)]
    isolated_only: bool,
}

/// Writes a checkpoint with Llama-3.2-1B's KV shape (16 layers, 8 KV heads of 64) and tiny
/// everything else: sim workers never run its weights, only size their KV by it.
fn sim_model(km: &Kvmesh, dir: &Path) -> PathBuf {
    let out = dir.join("llama-3.2-1b-kv-shape");
    if !out.join("config.json").exists() {
        let st = km
            .command()
            .args([
                "model",
                "init-random",
                "--preset",
                "llama-3.2-1b",
                "--hidden-size",
                "256",
                "--intermediate-size",
                "256",
                "--heads",
                "8",
                "--kv-heads",
                "8",
                "--head-dim",
                "64",
                "--vocab-size",
                "2048",
                "--max-position-embeddings",
                "8192",
                "--out",
            ])
            .arg(&out)
            .status()
            .expect("run kvmesh model init-random");
        assert!(st.success(), "init-random failed");
    }
    out
}

/// A streamed completion for whatever model the cluster serves.
fn completion(prompt: Value, max_tokens: u32) -> Value {
    let mut b = kvmesh_bench::harness::load::completion(prompt, max_tokens);
    b.as_object_mut().expect("a JSON object").remove("model");
    b
}

fn ids(rng: &mut rand::rngs::StdRng, n: usize) -> Value {
    json!((0..n)
        .map(|_| rng.random_range(5..2000u32))
        .collect::<Vec<_>>())
}

/// A cluster of one setup.
struct Cluster {
    gw: Proc,
    _nodes: Vec<Proc>,
    _etcd: Etcd,
}

/// What machines a setup has and how they move KV.
#[derive(Clone, Copy)]
struct Shape {
    label: &'static str,
    /// The decode nodes' `--kv-transport` (`-` where there are none).
    transport: &'static str,
    /// The gateway's `--disagg-max-queue`.
    max_queue: usize,
    aggregated: usize,
    prefill: usize,
    decode: usize,
}

impl Shape {
    const fn new(
        label: &'static str,
        transport: &'static str,
        max_queue: usize,
        (aggregated, prefill, decode): (usize, usize, usize),
    ) -> Shape {
        Shape {
            label,
            transport,
            max_queue,
            aggregated,
            prefill,
            decode,
        }
    }

    fn machines(&self) -> usize {
        self.aggregated + self.prefill + self.decode
    }
}

/// Starts `shape` as the cluster `name` (its own etcd) serving `model`.
fn start(km: &Kvmesh, name: &str, model: &Path, shape: &Shape) -> Cluster {
    let etcd = Etcd::start();
    let cluster = format!("disagg-{}", name.replace(' ', "-"));
    let m = model.to_str().unwrap();
    let engine = [
        "--backend",
        "sim",
        "--model",
        m,
        "--max-num-batched-tokens",
        "2048",
        "--kv-cache-gib",
        "2",
    ];
    let mut nodes = Vec::new();
    // UCX (here over shared memory) is loaded on both ends of a transfer.
    let ucx: &[&str] = match shape.transport {
        "ucx" => &["--kv-transport", "ucx", "--ucx-tls", "sm"],
        _ => &[],
    };
    let mut add = |id: String, role: &str| {
        let mut a = vec!["--roles", role];
        a.extend_from_slice(&engine);
        if role == "prefill" {
            a.extend_from_slice(ucx);
        }
        nodes.push(km.node(&etcd, &cluster, &id, &a));
    };
    for i in 0..shape.aggregated {
        add(format!("w{i}"), "worker");
    }
    for i in 0..shape.prefill {
        add(format!("p{i}"), "prefill");
    }
    for i in 0..shape.decode {
        let mut a = vec!["--roles", "decode", "--kv-transport", shape.transport];
        a.extend_from_slice(&engine);
        a.extend_from_slice(ucx.get(2..).unwrap_or(&[]));
        nodes.push(km.node(&etcd, &cluster, &format!("d{i}"), &a));
    }
    let queue = shape.max_queue.to_string();
    let gw = km.gateway_with(
        &etcd,
        &cluster,
        "gw",
        "least-loaded",
        &[
            "--model",
            m,
            "--backend",
            "sim",
            "--disagg-min-tokens",
            "256",
            "--disagg-max-queue",
            &queue,
        ],
    );
    Cluster {
        gw,
        _nodes: nodes,
        _etcd: etcd,
    }
}

struct Point {
    prompt_len: usize,
    /// Long prompts per second, for the whole cluster.
    rate: f64,
}

/// Chat streams in flight throughout, long prompts arriving meanwhile.
async fn mixed(
    http: &reqwest::Client,
    gw: &Proc,
    p: &Point,
    streams: usize,
    long_count: usize,
) -> Value {
    let base = gw.http.clone();
    let stop = Arc::new(AtomicBool::new(false));
    let window_start = Instant::now() + Duration::from_millis(1500);
    // Chat streams: each client sends one request after another until told to stop.
    let chat: Vec<_> = (0..streams)
        .map(|c| {
            let (http, base, stop) = (http.clone(), base.clone(), stop.clone());
            tokio::spawn(async move {
                let mut rng = rand::rngs::StdRng::seed_from_u64(c as u64);
                let mut out = Vec::new();
                for _ in 0..400 {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let started = Instant::now();
                    let s = one_body(&http, &base, completion(ids(&mut rng, 128), 64)).await;
                    // Only requests run entirely while long prompts arrive count.
                    if started >= window_start && !stop.load(Ordering::Relaxed) {
                        out.push(s);
                    }
                }
                out
            })
        })
        .collect();
    tokio::time::sleep_until(window_start.into()).await;
    let mut rng = rand::rngs::StdRng::seed_from_u64(99);
    let gaps = Exp::new(p.rate).unwrap();
    let mut long = Vec::new();
    for i in 0..long_count {
        let body = completion(ids(&mut rng, p.prompt_len), 8);
        let (http, base) = (http.clone(), base.clone());
        long.push(tokio::spawn(
            async move { one_body(&http, &base, body).await },
        ));
        if i + 1 < long_count {
            tokio::time::sleep(Duration::from_secs_f64(gaps.sample(&mut rng))).await;
        }
    }
    let mut long_samples = Vec::new();
    for t in long {
        long_samples.push(t.await.unwrap());
    }
    stop.store(true, Ordering::Relaxed);
    let mut chat_samples: Vec<Sample> = Vec::new();
    for t in chat {
        chat_samples.extend(t.await.unwrap());
    }
    let ok = |v: &[Sample]| v.iter().filter(|s| s.ok).cloned().collect::<Vec<_>>();
    let (c, l) = (ok(&chat_samples), ok(&long_samples));
    let ms = |f: &dyn Fn(&Sample) -> Option<f64>, v: &[Sample]| -> Vec<f64> {
        v.iter().filter_map(f).map(|x| x * 1e3).collect()
    };
    let tpot = ms(&|s| s.tpot(), &c);
    let itl: Vec<f64> = c.iter().flat_map(|s| s.itls()).map(|x| x * 1e3).collect();
    let chat_ttft = ms(&|s| Some(s.ttft), &c);
    let long_ttft = ms(&|s| Some(s.ttft), &l);
    json!({
        "prompt_len": p.prompt_len, "rate": p.rate,
        "chat_requests": c.len(), "chat_failed": chat_samples.len() - c.len(),
        "long_requests": l.len(), "long_failed": long_samples.len() - l.len(),
        "tpot_ms": {"mean": mean(&tpot), "p50": pct(&tpot, 50.0), "p99": pct(&tpot, 99.0)},
        "itl_ms": {"mean": mean(&itl), "p50": pct(&itl, 50.0), "p99": pct(&itl, 99.0)},
        "chat_ttft_ms": {"mean": mean(&chat_ttft), "p99": pct(&chat_ttft, 99.0)},
        "long_ttft_ms": {"mean": mean(&long_ttft), "p50": pct(&long_ttft, 50.0), "p99": pct(&long_ttft, 99.0)},
    })
}

fn decisions(m: &str) -> Value {
    let mut v = serde_json::Map::new();
    for l in m
        .lines()
        .filter(|l| l.starts_with("kvmesh:disagg_decisions_total{"))
    {
        let reason = l.split('"').nth(1).unwrap_or("?").to_string();
        let n: f64 = l
            .rsplit(' ')
            .next()
            .and_then(|x| x.parse().ok())
            .unwrap_or(0.0);
        v.insert(reason, json!(n));
    }
    Value::Object(v)
}

async fn isolated_ttft(
    km: &Kvmesh,
    http: &reqwest::Client,
    model: &Path,
    lens: &[usize],
    reps: usize,
) -> Value {
    let mut rows = Vec::new();
    for shape in [
        Shape::new("aggregated", "-", 8, (1, 0, 0)),
        Shape::new("1P+1D tcp", "tcp", 8, (0, 1, 1)),
        Shape::new("1P+1D quic", "quic", 8, (0, 1, 1)),
        Shape::new("1P+1D ucx (shm)", "ucx", 8, (0, 1, 1)),
    ] {
        let label = shape.label;
        let c = start(km, &format!("iso-{label}"), model, &shape);
        wait_workers(http, &c.gw, shape.machines()).await;
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        for &len in lens {
            let mut ttft = Vec::new();
            for _ in 0..reps {
                let s = one_body(http, &c.gw.http, completion(ids(&mut rng, len), 2)).await;
                assert!(s.ok, "isolated request failed");
                ttft.push(s.ttft * 1e3);
            }
            rows.push(json!({"setup": label, "prompt_len": len,
                "ttft_ms": {"mean": mean(&ttft), "min": ttft.iter().copied().fold(f64::INFINITY, f64::min)}}));
        }
    }
    println!("\n== isolated TTFT: one prompt at a time, 2 output tokens ==");
    println!(
        "{:>12} {:>10} {:>14} {:>14}",
        "setup", "prompt", "mean TTFT", "min TTFT"
    );
    for r in &rows {
        println!(
            "{:>12} {:>10} {:>12.1}ms {:>12.1}ms",
            r["setup"].as_str().unwrap(),
            r["prompt_len"],
            r["ttft_ms"]["mean"].as_f64().unwrap(),
            r["ttft_ms"]["min"].as_f64().unwrap()
        );
    }
    json!(rows)
}

/// Long prompts per second, for the 2-machine cluster (the 4-machine one gets twice as
/// many). At 20 µs a token a 4096-token prompt is 82 ms of prefill: 6/s keeps an aggregated
/// worker prefilling a quarter of the time, 12/s (what one prefill node can just keep up
/// with) half the time.
fn points(quick: bool) -> Vec<Point> {
    if quick {
        return vec![Point {
            prompt_len: 4096,
            rate: 10.0,
        }];
    }
    [
        (1024, 12.0),
        (1024, 36.0),
        (2048, 12.0),
        (2048, 22.0),
        (4096, 4.0),
        (4096, 10.0),
        (4096, 12.0),
    ]
    .into_iter()
    .map(|(prompt_len, rate)| Point { prompt_len, rate })
    .collect()
}

/// A setup of the mixed-load sweep: how many times the 2-machine load it carries, its shape,
/// and whether it runs every point or the lightest only.
type Setup = (usize, Shape, bool);

/// QUIC, CPU-bound on a small machine, runs the lightest point only. "queue on P" never
/// falls back to prefilling on the decode node (a queue of 64), trading long prompts' TTFT
/// for the chat streams' TPOT.
fn setups(quick: bool) -> &'static [Setup] {
    const QUICK: &[Setup] = &[
        (1, Shape::new("2 aggregated", "-", 8, (2, 0, 0)), true),
        (1, Shape::new("1P+1D tcp", "tcp", 8, (0, 1, 1)), true),
        (1, Shape::new("1P+1D quic", "quic", 8, (0, 1, 1)), true),
    ];
    const FULL: &[Setup] = &[
        (1, Shape::new("2 aggregated", "-", 8, (2, 0, 0)), true),
        (1, Shape::new("1P+1D tcp", "tcp", 8, (0, 1, 1)), true),
        (
            1,
            Shape::new("1P+1D tcp, queue on P", "tcp", 64, (0, 1, 1)),
            true,
        ),
        (1, Shape::new("1P+1D quic", "quic", 8, (0, 1, 1)), false),
        (2, Shape::new("4 aggregated", "-", 8, (4, 0, 0)), true),
        (2, Shape::new("2P+2D tcp", "tcp", 8, (0, 2, 2)), true),
    ];
    if quick {
        QUICK
    } else {
        FULL
    }
}

/// The mixed-load sweep: every setup at its points, a row each.
async fn mixed_sweep(km: &Kvmesh, http: &reqwest::Client, model: &Path, quick: bool) -> Vec<Value> {
    let points = points(quick);
    let streams_per = 24; // chat streams per decode-capable machine pair
    let long_count = if quick { 30 } else { 80 };
    let mut rows = Vec::new();
    for &(scale, shape, all_points) in setups(quick) {
        let label = shape.label;
        let c = start(km, label, model, &shape);
        wait_workers(http, &c.gw, shape.machines()).await;
        let lightest = points
            .iter()
            .min_by(|a, b| {
                (a.prompt_len as f64 * a.rate).total_cmp(&(b.prompt_len as f64 * b.rate))
            })
            .expect("points");
        for p in points
            .iter()
            .filter(|p| all_points || std::ptr::eq(*p, lightest))
        {
            let point = Point {
                prompt_len: p.prompt_len,
                rate: p.rate * scale as f64,
            };
            let before = decisions(&c.gw.metrics(http).await);
            let mut r = mixed(http, &c.gw, &point, streams_per * scale, long_count * scale).await;
            r["setup"] = json!(label);
            r["machines"] = json!(shape.machines());
            r["decisions_before"] = before;
            r["decisions"] = decisions(&c.gw.metrics(http).await);
            // Long prompts a decode node prefilled itself (no prefill node had room).
            let busy = |d: &Value| d["prefill_busy"].as_f64().unwrap_or(0.0);
            r["long_on_decode"] = if shape.aggregated > 0 {
                json!("-")
            } else {
                json!(busy(&r["decisions"]) - busy(&r["decisions_before"]))
            };
            println!(
                "{label:>22} L={:>5} rate={:>4}/s: P99 TPOT {:>6.1} ms, P99 ITL {:>6.1} ms, chat P99 TTFT {:>7.1} ms, long P99 TTFT {:>7.1} ms",
                point.prompt_len,
                point.rate,
                r["tpot_ms"]["p99"].as_f64().unwrap_or(f64::NAN),
                r["itl_ms"]["p99"].as_f64().unwrap_or(f64::NAN),
                r["chat_ttft_ms"]["p99"].as_f64().unwrap_or(f64::NAN),
                r["long_ttft_ms"]["p99"].as_f64().unwrap_or(f64::NAN),
            );
            rows.push(r);
        }
    }
    rows
}

/// The mixed-load table, each row's P99 TPOT against the aggregated setup of its size.
fn print_mixed(rows: &[Value]) {
    println!("\n== mixed load: chat streams (128 in, 64 out) while long prompts (8 out) arrive ==");
    println!(
        "{:>22} {:>6} {:>7} {:>9} {:>9} {:>10} {:>11} {:>11} {:>9} {:>8}",
        "setup",
        "prompt",
        "rate/s",
        "P99 TPOT",
        "P99 ITL",
        "chat P99",
        "long P99",
        "long mean",
        "TPOT x",
        "on D"
    );
    for r in rows {
        // TPOT ratio against the aggregated setup of the same size at the same point.
        let same_size_agg = rows.iter().find(|a| {
            a["machines"] == r["machines"]
                && a["prompt_len"] == r["prompt_len"]
                && a["rate"] == r["rate"]
                && a["setup"].as_str().unwrap().ends_with("aggregated")
        });
        let ratio = same_size_agg.map_or(f64::NAN, |a| {
            a["tpot_ms"]["p99"].as_f64().unwrap_or(f64::NAN)
                / r["tpot_ms"]["p99"].as_f64().unwrap_or(f64::NAN)
        });
        println!(
            "{:>22} {:>6} {:>7} {:>7.1}ms {:>7.1}ms {:>8.1}ms {:>9.1}ms {:>9.1}ms {:>8.2}x {:>8}",
            r["setup"].as_str().unwrap(),
            r["prompt_len"],
            r["rate"],
            r["tpot_ms"]["p99"].as_f64().unwrap_or(f64::NAN),
            r["itl_ms"]["p99"].as_f64().unwrap_or(f64::NAN),
            r["chat_ttft_ms"]["p99"].as_f64().unwrap_or(f64::NAN),
            r["long_ttft_ms"]["p99"].as_f64().unwrap_or(f64::NAN),
            r["long_ttft_ms"]["mean"].as_f64().unwrap_or(f64::NAN),
            ratio,
            r["long_on_decode"]
        );
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = Args::parse();
    let quick = args.quick;
    let km = kvmesh();
    let http = load_client(Duration::from_secs(120));
    let tmp = std::env::temp_dir().join("kvmesh-disagg-bench");
    std::fs::create_dir_all(&tmp).unwrap();
    let model = sim_model(&km, &tmp);

    let iso = isolated_ttft(
        &km,
        &http,
        &model,
        &[512, 2048, 4096],
        if quick { 3 } else { 5 },
    )
    .await;
    let rows = if args.isolated_only {
        Vec::new()
    } else {
        mixed_sweep(&km, &http, &model, quick).await
    };
    print_mixed(&rows);
    write_results(
        &args.json,
        quick,
        json!({
            "sim": {"prefill_us_per_token": 20, "decode_ms": 8, "decode_us_per_seq": 100,
                     "kv_bytes_per_token": 32768, "max_num_batched_tokens": 2048},
            "isolated_ttft": iso,
            "mixed": rows,
        }),
    );
}
