//! Soak under abuse: normal requests through a cluster gateway (etcd, a gateway, two sim
//! workers on loopback), first alone, then while abusive clients run beside them: idle
//! connections, connections dripping their headers, near-limit prompts of ~1.9 MB,
//! streams dropped after their first token, and a worker killed and replaced. Prints the
//! normal requests' latency in both phases, what the abusers got, and the gateway's memory
//! before and after. Then the mesh's own ports: strangers on a decode node's KV listener,
//! and a prefill peer frozen under 16 long prompts (`peers`). Last, floods on one `kvmesh
//! serve` (`floods`): distinct JSON schemas, hundreds of tools, 1 MB model names, slow
//! readers and oversized bodies, each beside normal requests. Writes JSON.
//!
//! Bounded: a fixed number of normal requests per phase, a fixed number of abusers, each
//! with a deadline.
//!
//! `cargo build --release && target/release/soak-bench [--quick] [--only floods] [--json PATH]`

mod floods;
mod peers;

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use kvmesh_bench::harness::abuse::rss_mib;
use kvmesh_bench::harness::load::{pct, run_load, shakespeare_lines, Sample};
use kvmesh_bench::harness::{load_client, wait_workers, Kvmesh};
use kvmesh_bench::programs::{kvmesh, write_results};
use kvmesh_discovery::testing::Etcd;
use serde_json::{json, Value};
use tokio::io::AsyncWriteExt;
use tokio::task::JoinHandle;

/// Soak under abuse: normal requests through a cluster gateway, alone and beside abusive
/// clients and a worker killed and replaced.
#[derive(Parser)]
#[command(name = "soak-bench")]
struct Args {
    /// Fewer normal requests per phase (100 instead of 300) and a shorter abuse (20 s
    /// instead of 40).
    #[arg(long)]
    quick: bool,
    /// Where the results go.
    #[arg(long, value_name = "PATH", default_value = "bench/results/soak.json")]
    json: PathBuf,
    /// Run only these phases (`floods`: the floods on one `kvmesh serve`, without etcd);
    /// by default every phase runs.
    #[arg(long, value_name = "PHASES", value_parser = ["floods"])]
    only: Option<String>,
}

fn host_port(url: &str) -> String {
    url.trim_start_matches("http://").to_string()
}

/// Latency of the normal requests (ms) and how many failed.
fn normal_row(label: &str, samples: &[Sample], wall: f64) -> Value {
    let ok: Vec<f64> = samples
        .iter()
        .filter(|s| s.ok)
        .map(|s| s.e2e * 1e3)
        .collect();
    let ttft: Vec<f64> = samples
        .iter()
        .filter(|s| s.ok)
        .map(|s| s.ttft * 1e3)
        .collect();
    json!({
        "phase": label,
        "requests": samples.len(),
        "failed": samples.len() - ok.len(),
        "wall_s": wall,
        "p50_ms": pct(&ok, 50.0),
        "p99_ms": pct(&ok, 99.0),
        "ttft_p99_ms": pct(&ttft, 99.0),
    })
}

/// What the abusers got, counted by their tasks.
#[derive(Default)]
struct Tally {
    idle_closed: AtomicUsize,
    drip_closed: AtomicUsize,
    /// Each large prompt's status (0: no answer) and milliseconds.
    large: Mutex<Vec<(u16, f64)>>,
    dropped: AtomicUsize,
}

/// 64 idle connections that never send a byte.
fn idle_connections(addr: &str, deadline: Instant, tally: &Arc<Tally>) -> Vec<JoinHandle<()>> {
    (0..64)
        .map(|_| {
            let (addr, tally) = (addr.to_string(), tally.clone());
            tokio::spawn(async move {
                let Ok(mut s) = tokio::net::TcpStream::connect(&addr).await else {
                    return;
                };
                let mut buf = [0u8; 64];
                let r = tokio::time::timeout_at(
                    deadline.into(),
                    tokio::io::AsyncReadExt::read(&mut s, &mut buf),
                )
                .await;
                if matches!(r, Ok(Ok(0)) | Ok(Err(_))) {
                    tally.idle_closed.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect()
}

/// 16 connections dripping their headers, a byte a second.
fn header_drips(addr: &str, deadline: Instant, tally: &Arc<Tally>) -> Vec<JoinHandle<()>> {
    (0..16)
        .map(|_| {
            let (addr, tally) = (addr.to_string(), tally.clone());
            tokio::spawn(async move {
                let Ok(mut s) = tokio::net::TcpStream::connect(&addr).await else {
                    return;
                };
                for b in b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: "
                    .iter()
                    .cycle()
                {
                    if Instant::now() >= deadline {
                        return;
                    }
                    if s.write_all(&[*b]).await.is_err() {
                        tally.drip_closed.fetch_add(1, Ordering::Relaxed);
                        return;
                    }
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            })
        })
        .collect()
}

/// 8 clients sending prompts just under the body limit, 4 each.
fn large_prompts(
    http: &reqwest::Client,
    base: &str,
    deadline: Instant,
    tally: &Arc<Tally>,
) -> Vec<JoinHandle<()>> {
    let big = "All the world's a stage. ".repeat(1_900_000 / 25);
    (0..8)
        .map(|_| {
            let (http, base, big, tally) =
                (http.clone(), base.to_string(), big.clone(), tally.clone());
            tokio::spawn(async move {
                for _ in 0..4 {
                    if Instant::now() >= deadline {
                        return;
                    }
                    let t = Instant::now();
                    let r = http
                        .post(format!("{base}/v1/completions"))
                        .json(&json!({"model": "shakespeare", "prompt": big, "max_tokens": 4}))
                        .send()
                        .await;
                    let st = r.map(|r| r.status().as_u16()).unwrap_or(0);
                    tally
                        .large
                        .lock()
                        .unwrap()
                        .push((st, t.elapsed().as_secs_f64() * 1e3));
                }
            })
        })
        .collect()
}

/// 4 clients each dropping 10 streams after their first chunk.
fn dropped_streams(
    http: &reqwest::Client,
    base: &str,
    deadline: Instant,
    tally: &Arc<Tally>,
) -> Vec<JoinHandle<()>> {
    (0..4)
        .map(|i| {
            let (http, base, tally) = (http.clone(), base.to_string(), tally.clone());
            tokio::spawn(async move {
                for j in 0..10 {
                    if Instant::now() >= deadline {
                        return;
                    }
                    let body = json!({"model": "shakespeare", "prompt": format!("Dropped {i} {j}"),
                                      "max_tokens": 200, "stream": true, "ignore_eos": true});
                    if let Ok(mut r) = http
                        .post(format!("{base}/v1/completions"))
                        .json(&body)
                        .send()
                        .await
                    {
                        let _ = r.chunk().await;
                        tally.dropped.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect()
}

/// The gateway's resident memory at three points, in MiB.
struct Memory {
    before: f64,
    after_baseline: f64,
    after_abuse: f64,
}

/// Prints the phases' table, what the abusers got and the gateway's memory; returns the
/// results' JSON.
fn report(rows: Vec<Value>, tally: &Tally, rss: &Memory) -> Value {
    println!("\n## Soak: normal requests (16 tokens, concurrency 8) through a gateway, with and without abuse\n");
    println!("| phase | requests | failed | p50 ms | p99 ms | TTFT p99 ms |");
    println!("|---|---:|---:|---:|---:|---:|");
    for r in &rows {
        println!(
            "| {} | {} | {} | {:.1} | {:.1} | {:.1} |",
            r["phase"].as_str().unwrap(),
            r["requests"],
            r["failed"],
            r["p50_ms"].as_f64().unwrap_or(f64::NAN),
            r["p99_ms"].as_f64().unwrap_or(f64::NAN),
            r["ttft_p99_ms"].as_f64().unwrap_or(f64::NAN)
        );
    }
    let p99_ratio = rows[1]["p99_ms"].as_f64().unwrap_or(f64::NAN)
        / rows[0]["p99_ms"].as_f64().unwrap_or(f64::NAN);
    println!(
        "\np99 with abuse / without: {p99_ratio:.2}x (with a worker killed too: {:.2}x)",
        rows[2]["p99_ms"].as_f64().unwrap_or(f64::NAN)
            / rows[0]["p99_ms"].as_f64().unwrap_or(f64::NAN)
    );
    let bigs = tally.large.lock().unwrap().clone();
    let big_ms: Vec<f64> = bigs.iter().map(|b| b.1).collect();
    let (idle_closed, drip_closed, dropped) = (
        tally.idle_closed.load(Ordering::Relaxed),
        tally.drip_closed.load(Ordering::Relaxed),
        tally.dropped.load(Ordering::Relaxed),
    );
    println!(
        "abusers: {idle_closed} of 64 idle connections closed by the server, {drip_closed} of 16 header drips cut, {} large prompts (statuses {:?}, p50 {:.0} ms), {dropped} streams dropped after one chunk, worker w2 killed and replaced",
        bigs.len(),
        {
            let mut s: Vec<u16> = bigs.iter().map(|b| b.0).collect();
            s.sort_unstable();
            s.dedup();
            s
        },
        pct(&big_ms, 50.0),
    );
    println!(
        "gateway RSS: {:.1} MiB before, {:.1} after the baseline, {:.1} after the abuse",
        rss.before, rss.after_baseline, rss.after_abuse
    );
    json!({
        "bench": "soak",
        "normal": rows,
        "p99_ratio_abuse_over_normal": p99_ratio,
        "abuse": {
            "idle_connections": 64,
            "idle_closed_by_server": idle_closed,
            "header_drips": 16,
            "header_drips_cut": drip_closed,
            "large_prompts": bigs.iter().map(|b| json!({"status": b.0, "ms": b.1})).collect::<Vec<_>>(),
            "streams_dropped": dropped,
            "worker_killed_and_replaced": true,
        },
        "gateway_rss_mib": {"before": rss.before, "after_baseline": rss.after_baseline, "after_abuse": rss.after_abuse},
    })
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = Args::parse();
    let km = kvmesh();
    let mut results = match args.only.as_deref() {
        Some("floods") => json!({"bench": "soak"}),
        _ => cluster_phases(&km, args.quick).await,
    };
    results["floods"] = floods::run(&km).await;
    write_results(&args.json, args.quick, results);
}

/// The phases through a cluster gateway, then those on the mesh's own ports.
async fn cluster_phases(km: &Kvmesh, quick: bool) -> Value {
    let n = if quick { 100 } else { 300 };
    let lines = shakespeare_lines();
    let prompts = |offset: usize| -> Vec<String> {
        (0..n)
            .map(|i| lines[(i + offset) % lines.len()].clone())
            .collect()
    };
    let etcd = Etcd::start();
    let gw = km.gateway(&etcd, "soak", "gw", "least-loaded");
    let _w1 = km.worker(&etcd, "soak", "w1", &[]);
    let mut w2 = Some(km.worker(&etcd, "soak", "w2", &[]));
    let http = load_client(Duration::from_secs(60));
    wait_workers(&http, &gw, 2).await;
    // Warm up, then the baseline.
    let _ = run_load(
        &http,
        &gw.http,
        prompts(7).into_iter().take(20).collect(),
        16,
        8,
    )
    .await;
    let rss_before = rss_mib(&gw);
    let (base, base_wall) = run_load(&http, &gw.http, prompts(0), 16, 8).await;
    let rss_after_baseline = rss_mib(&gw);

    // The abusers, each bounded by a deadline.
    let deadline = Instant::now() + Duration::from_secs(if quick { 20 } else { 40 });
    let addr = host_port(&gw.http);
    let tally = Arc::new(Tally::default());
    let mut abusers = idle_connections(&addr, deadline, &tally);
    abusers.extend(header_drips(&addr, deadline, &tally));
    abusers.extend(large_prompts(&http, &gw.http, deadline, &tally));
    abusers.extend(dropped_streams(&http, &gw.http, deadline, &tally));
    // The normal load again beside the abusers, then once more while a worker is killed
    // (SIGKILL: the router hears nothing from it for 0.7 s, closes its connection, and its
    // requests move) and replaced.
    let (abused_only, abused_only_wall) = run_load(&http, &gw.http, prompts(0), 16, 8).await;
    let load = {
        let (http, base) = (http.clone(), gw.http.clone());
        let p = prompts(0);
        tokio::spawn(async move { run_load(&http, &base, p, 16, 8).await })
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    drop(w2.take()); // SIGKILL
    tokio::time::sleep(Duration::from_secs(1)).await;
    let _w2b = km.worker(&etcd, "soak", "w2b", &[]);
    let (abused, abused_wall) = load.await.unwrap();
    for a in abusers {
        let _ = a.await;
    }
    let rss = Memory {
        before: rss_before,
        after_baseline: rss_after_baseline,
        after_abuse: rss_mib(&gw),
    };
    let rows = vec![
        normal_row("normal only", &base, base_wall),
        normal_row("with abuse", &abused_only, abused_only_wall),
        normal_row("with abuse and a worker killed", &abused, abused_wall),
    ];
    let mut results = report(rows, &tally, &rss);
    results["kv_listener"] = tokio::task::block_in_place(|| peers::kv_listener_abuse(km, &etcd));
    results["stalled_prefill_peer"] = peers::stalled_prefill_peer(km, &etcd, &http).await;
    results
}
