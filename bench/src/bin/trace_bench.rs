//! What tracing costs: throughput with every request traced (`--trace-sample-ratio 1`, spans
//! kept in the in-memory store) against tracing off (`--trace-sample-ratio 0`), on a
//! zero-cost `sim` worker so that the serving machinery is all there is to measure. Two
//! setups: `kvmesh serve` (every span in one process) and the mesh (gateway → router → QUIC
//! → worker, spans on both nodes). Off and on alternate, twice each, in one run; the ratio
//! of the means is reported.
//!
//! `cargo build --release && target/release/trace-bench [--quick] [--json PATH]`
//! (writes `bench/results/tracing.json`; needs `etcd` on PATH).

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use kvmesh_bench::harness::load::{mean, run_load, shakespeare_lines, summary};
use kvmesh_bench::harness::{load_client, wait_workers};
use kvmesh_bench::programs::{kvmesh, write_results, ZERO_COST};
use kvmesh_discovery::testing::Etcd;
use serde_json::{json, Value};

/// What tracing costs: throughput with every request traced against tracing off, in
/// `kvmesh serve` and through the mesh, on sim workers.
#[derive(Parser)]
#[command(name = "trace-bench")]
struct Args {
    /// Fewer requests per run (300 instead of 1500).
    #[arg(long)]
    quick: bool,
    /// Where the results go.
    #[arg(
        long,
        value_name = "PATH",
        default_value = "bench/results/tracing.json"
    )]
    json: PathBuf,
}

fn ratio_flag(on: bool) -> [&'static str; 2] {
    ["--trace-sample-ratio", if on { "1" } else { "0" }]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = Args::parse();
    let quick = args.quick;
    let km = kvmesh();
    let http = load_client(Duration::from_secs(120));
    let lines = shakespeare_lines();
    let n = if quick { 300 } else { 1500 };
    let conc = 16;
    let prompts: Vec<String> = (0..n).map(|i| lines[i % lines.len()].clone()).collect();
    let mut rows = Vec::new();
    // serve and mesh on a zero-cost worker (the machinery alone: the worst case); then serve
    // on the sim's default timing (8 ms per decode step), where a step's work dwarfs it.
    for setup in ["serve", "mesh", "serve-timed"] {
        let mut runs: Vec<(bool, Value)> = Vec::new();
        for round in 0..2 {
            for on in [false, true] {
                // A fresh server each time, so the store starts empty.
                let (_etcd, procs, base) = if setup.starts_with("serve") {
                    let mut a = if setup == "serve" {
                        ZERO_COST.to_vec()
                    } else {
                        vec!["--backend", "sim"]
                    };
                    a.extend(ratio_flag(on));
                    let p = km.serve(&a);
                    let base = p.http.clone();
                    (None, vec![p], base)
                } else {
                    let etcd = Etcd::start();
                    let cluster = format!("trace-{round}-{on}");
                    let mut w = vec!["--roles", "worker"];
                    w.extend(ZERO_COST);
                    w.extend(ratio_flag(on));
                    let worker = km.node(&etcd, &cluster, "w1", &w);
                    let gw = km.gateway_with(&etcd, &cluster, "gw", "round-robin", &ratio_flag(on));
                    wait_workers(&http, &gw, 1).await;
                    let base = gw.http.clone();
                    (Some(etcd), vec![worker, gw], base)
                };
                let (load, c) = if setup == "serve-timed" {
                    (prompts[..prompts.len() / 4].to_vec(), 4 * conc)
                } else {
                    (prompts.clone(), conc)
                };
                let _ = run_load(&http, &base, prompts[..50].to_vec(), 16, c).await;
                let (samples, wall) = run_load(&http, &base, load, 16, c).await;
                let label = format!("{setup} tracing {}", if on { "on" } else { "off" });
                let sum = summary(&label, &samples, wall);
                println!(
                    "{label:>18} (round {round}): {:>8.1} req/s, p50 E2E {:.2} ms, {} failed",
                    sum["req_per_s"].as_f64().unwrap(),
                    sum["e2e_ms"]["p50"].as_f64().unwrap(),
                    sum["failed"]
                );
                runs.push((on, sum));
                drop(procs);
            }
        }
        let rate = |on: bool| {
            mean(
                &runs
                    .iter()
                    .filter(|(o, _)| *o == on)
                    .map(|(_, s)| s["req_per_s"].as_f64().unwrap())
                    .collect::<Vec<_>>(),
            )
        };
        let (off, on) = (rate(false), rate(true));
        rows.push(
            json!({"setup": setup, "req_per_s_off": off, "req_per_s_on": on,
            "ratio": on / off, "runs": runs.iter().map(|(_, s)| s.clone()).collect::<Vec<_>>()}),
        );
    }
    println!(
        "\n== tracing cost: {n} requests x 16 tokens streamed at concurrency {conc} on a zero-cost sim \
         worker; serve-timed: {} at concurrency {} on the default sim timing ==",
        n / 4,
        4 * conc
    );
    println!(
        "{:>12} {:>14} {:>14} {:>8}",
        "setup", "off req/s", "on req/s", "on/off"
    );
    for r in &rows {
        println!(
            "{:>12} {:>14.1} {:>14.1} {:>7.1}%",
            r["setup"].as_str().unwrap(),
            r["req_per_s_off"].as_f64().unwrap(),
            r["req_per_s_on"].as_f64().unwrap(),
            100.0 * r["ratio"].as_f64().unwrap()
        );
    }
    write_results(
        &args.json,
        quick,
        json!({"requests": n, "concurrency": conc, "rows": rows}),
    );
}
