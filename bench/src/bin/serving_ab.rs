//! Two builds of `kvmesh` on the same serving path, side by side: a gateway/router node and
//! two zero-cost `sim` workers over etcd, loaded by `kvmesh bench` (the new build's client
//! for both) at three shapes. The builds alternate, in both orders, for `--rounds` rounds, so
//! the machine's drift falls on both; each row reports both builds' medians and ranges.
//!
//! `scripts/serving_ab.sh OLD_REV [NEW_REV]` builds the revisions and runs this;
//! directly: `target/release/serving-ab --old PATH/kvmesh [--new PATH/kvmesh]`
//! (writes `bench/results/serving-ab.json`; needs `etcd` on PATH).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use clap::Parser;
use kvmesh_bench::harness::{load_client, Kvmesh, Proc};
use kvmesh_bench::programs::{write_results, ZERO_COST};
use kvmesh_discovery::testing::Etcd;
use serde_json::{json, Value};

#[derive(Parser)]
#[command(name = "serving-ab")]
struct Args {
    /// The baseline build's `kvmesh` binary.
    #[arg(long)]
    old: PathBuf,
    /// The build under test (default: the `kvmesh` beside this program).
    #[arg(long)]
    new: Option<PathBuf>,
    /// Names of the two builds in the table (e.g. their revisions).
    #[arg(long, default_value = "old")]
    old_label: String,
    #[arg(long, default_value = "new")]
    new_label: String,
    /// Rounds; each runs both builds, in alternating order.
    #[arg(long, default_value_t = 4)]
    rounds: usize,
    /// Requests per row and run.
    #[arg(long, default_value_t = 400)]
    requests: usize,
    #[arg(long, default_value = "bench/results/serving-ab.json")]
    json: PathBuf,
}

/// (concurrency, input tokens, output tokens): one request at a time, a busy batch of
/// mid-length prompts, and many long streams of short prompts.
const ROWS: [(usize, usize, usize); 3] = [(1, 16, 16), (32, 128, 64), (64, 16, 128)];

/// A build's cluster: etcd, two zero-cost workers and a gateway/router.
struct Cluster {
    _etcd: Etcd,
    _procs: Vec<Proc>,
    base: String,
}

async fn start(bin: &Path, round: usize, label: &str) -> Cluster {
    let km = Kvmesh::new(bin).quiet();
    let etcd = Etcd::start();
    let cluster = format!("ab-{round}-{label}");
    let mut procs = Vec::new();
    for w in ["w1", "w2"] {
        let mut a = vec!["--roles", "worker"];
        a.extend(ZERO_COST);
        procs.push(km.node(&etcd, &cluster, w, &a));
    }
    let gw = km.gateway(&etcd, &cluster, "gw", "least-loaded");
    let base = gw.http.clone();
    procs.push(gw);
    wait_two_workers(&base).await;
    Cluster {
        _etcd: etcd,
        _procs: procs,
        base,
    }
}

/// Until both workers are routable and the model is listed: `/status` says so (in either
/// build's shape), or, failing that, a completion goes through and 5 s have passed.
async fn wait_two_workers(base: &str) {
    let http = load_client(Duration::from_secs(10));
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(60) {
        let st: Value = match http.get(format!("{base}/status")).send().await {
            Ok(r) => r.json().await.unwrap_or(Value::Null),
            Err(_) => Value::Null,
        };
        let connected = st["router"]["workers_summary"]["connected"]
            .as_u64()
            .or_else(|| st["router"]["workers"].as_array().map(|a| a.len() as u64));
        let listed = match http.get(format!("{base}/v1/models")).send().await {
            Ok(r) => r.json::<Value>().await.unwrap_or(Value::Null)["data"]
                .as_array()
                .is_some_and(|d| !d.is_empty()),
            Err(_) => false,
        };
        if connected >= Some(2) && listed {
            return;
        }
        if connected.is_none() && t.elapsed() > Duration::from_secs(5) {
            let ok = http
                .post(format!("{base}/v1/completions"))
                .json(&json!({"prompt": "a", "max_tokens": 1}))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success());
            if ok {
                return;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{base}: two workers were not routable within 60 s");
}

/// One row through `kvmesh bench` (the new build's client): (p50 TTFT ms, output tok/s,
/// failed).
fn bench_row(client: &Path, base: &str, row: (usize, usize, usize), n: usize) -> (f64, f64, u64) {
    let (c, input, output) = row;
    let dir = std::env::temp_dir().join(format!("kvmesh-ab-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = Command::new(client)
        .args(["bench", "--base-url", base, "--label", "ab"])
        .args(["--input-len", &input.to_string()])
        .args(["--output-len", &output.to_string()])
        .args(["--num-prompts", &n.to_string()])
        .args(["--concurrency", &c.to_string()])
        .arg("--result-dir")
        .arg(&dir)
        .output()
        .expect("run kvmesh bench");
    assert!(
        out.status.success(),
        "kvmesh bench failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = std::fs::read_to_string(dir.join("ab-summary.json")).expect("the bench summary");
    let v: Value = serde_json::from_str(&text).expect("summary JSON");
    let r = &v["runs"][0];
    let _ = std::fs::remove_dir_all(&dir);
    (
        r["median_ttft_ms"].as_f64().unwrap_or(f64::NAN),
        r["output_throughput"].as_f64().unwrap_or(f64::NAN),
        r["failed"].as_u64().unwrap_or(0),
    )
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => s[n / 2],
        n => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

fn range(v: &[f64], digits: usize) -> String {
    let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    format!("{lo:.digits$}–{hi:.digits$}")
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = Args::parse();
    let me = std::env::current_exe().expect("current exe");
    let new = args
        .new
        .clone()
        .unwrap_or_else(|| me.with_file_name("kvmesh"));
    let builds = [
        (args.old_label.as_str(), args.old.as_path()),
        (args.new_label.as_str(), new.as_path()),
    ];
    // samples[build][row] = [(ttft, tok/s)]
    let mut samples = vec![vec![Vec::new(); ROWS.len()]; 2];
    let mut failed = 0;
    for round in 0..args.rounds {
        let order: Vec<usize> = if round % 2 == 0 {
            vec![0, 1]
        } else {
            vec![1, 0]
        };
        for b in order {
            let (label, bin) = builds[b];
            let cluster = start(bin, round, label).await;
            // A short warm-up: connections, caches, the first grammar of nothing.
            let _ = bench_row(&new, &cluster.base, (8, 16, 16), 50);
            for (i, row) in ROWS.iter().enumerate() {
                let (ttft, tps, f) = bench_row(&new, &cluster.base, *row, args.requests);
                failed += f;
                println!(
                    "round {round} {label:>10} c={:<3} {:>4}/{:<4}: p50 TTFT {ttft:>7.3} ms, \
                     {tps:>9.0} output tok/s{}",
                    row.0,
                    row.1,
                    row.2,
                    if f > 0 {
                        format!(", {f} failed")
                    } else {
                        String::new()
                    }
                );
                samples[b][i].push((ttft, tps));
            }
        }
    }
    println!(
        "\n== {} vs {}: {} rounds, {} requests a row, 2 zero-cost sim workers behind a \
         gateway/router ==",
        args.old_label, args.new_label, args.rounds, args.requests
    );
    println!(
        "{:<18} {:>22} {:>22} {:>24} {:>24}",
        "row",
        format!("{} p50 TTFT ms", args.old_label),
        format!("{} p50 TTFT ms", args.new_label),
        format!("{} tok/s", args.old_label),
        format!("{} tok/s", args.new_label)
    );
    let mut rows = Vec::new();
    for (i, (c, input, output)) in ROWS.iter().enumerate() {
        let ttft = |b: usize| samples[b][i].iter().map(|s| s.0).collect::<Vec<_>>();
        let tps = |b: usize| samples[b][i].iter().map(|s| s.1).collect::<Vec<_>>();
        let cell = |v: Vec<f64>, d: usize| format!("{:.d$} ({})", median(&v), range(&v, d));
        println!(
            "{:<18} {:>22} {:>22} {:>24} {:>24}",
            format!("c={c} {input}/{output}"),
            cell(ttft(0), 3),
            cell(ttft(1), 3),
            cell(tps(0), 0),
            cell(tps(1), 0)
        );
        rows.push(json!({
            "concurrency": c, "input_len": input, "output_len": output,
            "ttft_p50_ms": {args.old_label.as_str(): ttft(0), args.new_label.as_str(): ttft(1)},
            "output_tok_per_s": {args.old_label.as_str(): tps(0), args.new_label.as_str(): tps(1)},
            "median_tok_per_s_ratio": median(&tps(1)) / median(&tps(0)),
        }));
    }
    println!("{failed} requests failed in all");
    write_results(
        &args.json,
        false,
        json!({"old": args.old_label, "new": args.new_label, "rounds": args.rounds,
            "requests": args.requests, "failed": failed, "rows": rows}),
    );
}
