//! One router over 2,000 sim workers, all members of their own (record, QUIC endpoint,
//! engine) hosted by one `kvmesh node --replicas` process, with a real etcd on loopback:
//! every worker routable within two minutes, every request served, the gateway's memory
//! per worker link in kilobytes, the load reports it reads bounded by the pace, and
//! `/status` and `/metrics` summarised at that size.

mod common;

use std::time::{Duration, Instant};

use common::kvmesh;
use kvmesh_bench::harness::abuse::rss_mib;
use kvmesh_bench::harness::load::{run_load, shakespeare_lines};
use kvmesh_bench::harness::{client, get_json, Proc};
use kvmesh_discovery::testing::Etcd;
use serde_json::Value;

const WORKERS: usize = 2000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_thousand_workers_behind_one_router() {
    let etcd = Etcd::start();
    let http = client();
    let gw = kvmesh().gateway(&etcd, "scale", "gw", "least-loaded");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rss0 = rss_mib(&gw);
    let replicas = WORKERS.to_string();
    let t0 = Instant::now();
    let workers = kvmesh().worker(
        &etcd,
        "scale",
        "w",
        &[
            "--replicas",
            &replicas,
            "--num-kv-blocks",
            "64",
            "--sim-decode-ms",
            "1",
        ],
    );
    all_routable(&http, &gw, t0, "of starting").await;
    eprintln!("{WORKERS} routable after {:?}", t0.elapsed());

    // Memory per worker link, from the gateway's growth. The aim is 64 KiB; the bound leaves
    // room for a noisy machine's allocator (a link cost over 1 MiB before).
    tokio::time::sleep(Duration::from_secs(2)).await;
    let per_link_kib = (rss_mib(&gw) - rss0) * 1024.0 / WORKERS as f64;
    eprintln!("gateway: {per_link_kib:.1} KiB per worker link");
    assert!(per_link_kib < 96.0, "{per_link_kib:.1} KiB per worker link");
    // The sim engines share a few driver threads: the process does not grow a thread per
    // worker (it had over 2,000 when each engine slept on its own).
    let threads: usize = std::fs::read_to_string(format!("/proc/{}/status", workers.child.id()))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|t| t.trim().parse().ok())
        .unwrap();
    eprintln!("worker process: {threads} threads for {WORKERS} workers");
    assert!(threads < 64, "{threads} threads for {WORKERS} sim workers");

    // Every request served.
    let lines = shakespeare_lines();
    let prompts: Vec<String> = (0..400).map(|i| lines[i % lines.len()].clone()).collect();
    let (samples, wall) = run_load(&http, &gw.http, prompts, 16, 32).await;
    let failed: Vec<_> = samples.iter().filter(|s| !s.ok).collect();
    assert!(failed.is_empty(), "{} of 400 failed", failed.len());
    eprintln!("400 requests in {wall:.1} s");

    // The reports the router reads stay within the pace's bound (5,000 a second).
    let reports = async || {
        gw.try_metric(&http, "kvmesh:router_load_reports_total")
            .await
            .unwrap_or(f64::NAN)
    };
    let a = reports().await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    let per_s = (reports().await - a) / 4.0;
    eprintln!("{per_s:.0} load reports a second");
    assert!(
        per_s > 0.0 && per_s <= 5500.0,
        "{per_s} load reports a second"
    );

    // /status lists 1000 by default and counts all; /metrics has no series per worker.
    let st = get_json(&http, &gw, "/status").await;
    assert_eq!(st["router"]["workers"].as_array().map(Vec::len), Some(1000));
    assert_eq!(st["router"]["workers_summary"]["total"], WORKERS as u64);
    let all = get_json(&http, &gw, "/status?workers=all").await;
    assert_eq!(
        all["router"]["workers"].as_array().map(Vec::len),
        Some(WORKERS)
    );
    let bad = http
        .get(format!("{}/status?workers=many", gw.http))
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status().as_u16(), 400);
    let metrics = gw.metrics(&http).await;
    assert!(
        metrics.contains("kvmesh:router_workers_routable"),
        "{metrics}"
    );
    assert!(
        !metrics.contains("kvmesh:worker_routed_total"),
        "a series per worker at {WORKERS} workers"
    );

    // The router restarts. Its successor learns every worker from etcd and dials them in
    // turns; the workers' process answers thousands of handshakes meanwhile and must not
    // fall so far behind that its lease, and every record under it, expires.
    let key = kvmesh_discovery::node_key("scale", "w");
    let lease = etcd.lease_of(&key).await;
    assert!(lease.is_some_and(|l| l != 0), "{key}: {lease:?}");
    let mut gw = gw;
    gw.kill();
    let t1 = Instant::now();
    let gw2 = kvmesh().gateway(&etcd, "scale", "gw2", "least-loaded");
    all_routable(&http, &gw2, t1, "of the router's restart").await;
    eprintln!(
        "{WORKERS} routable again {:?} after the restart",
        t1.elapsed()
    );
    assert_eq!(
        etcd.lease_of(&key).await,
        lease,
        "the workers' lease was lost while the new router dialled them"
    );
}

/// Waits up to two minutes from `t0` for `gw`'s router to have every worker routable.
async fn all_routable(http: &reqwest::Client, gw: &Proc, t0: Instant, since: &str) {
    let mut summary = Value::Null;
    while t0.elapsed() < Duration::from_secs(120) {
        summary =
            get_json(http, gw, "/status?workers=0").await["router"]["workers_summary"].clone();
        if summary["routable"].as_u64() == Some(WORKERS as u64) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    panic!("not all routable within 120 s {since}: {summary}");
}
