//! One router over thousands of workers: for each size, a fresh etcd, a gateway (with
//! `--policy`, least-loaded unless named) and one `kvmesh node --replicas N` process of sim workers (each its own
//! member: record, QUIC endpoint, engine), all on loopback. Prints and writes, per size:
//! the time until every worker is routable, the gateway's memory and its growth per worker
//! link, the load reports it absorbs per second (idle and under load), pick times, and
//! req/s and TTFT for 16-token requests at concurrency 64; then the gateway is killed and a
//! new one started, and the time it takes to re-learn every worker is measured.
//!
//! Bounded: each size waits at most `--join-timeout` seconds for its workers and sends a
//! fixed number of requests.
//!
//! `cargo build --release && target/release/scale-bench [--sizes 1000,2000,4000] [--policy P]
//! [--json PATH]`. With `--policy prefix` every prompt begins with the same four lines, so
//! that picks walk the prefix index's holders of those blocks as well as the shortlist.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::Parser;
use kvmesh_bench::harness::abuse::rss_mib;
use kvmesh_bench::harness::load::{pct, run_load, shakespeare_lines, Sample};
use kvmesh_bench::harness::{load_client, status, Proc};
use kvmesh_bench::programs::{kvmesh, write_results, ZERO_COST};
use kvmesh_discovery::testing::Etcd;
use serde_json::{json, Value};

#[derive(Parser)]
#[command(name = "scale-bench")]
struct Args {
    /// Worker counts, one run each.
    #[arg(long, value_delimiter = ',', default_value = "1000,2000,4000")]
    sizes: Vec<usize>,
    /// Requests per size.
    #[arg(long, default_value_t = 2000)]
    requests: usize,
    /// Seconds a size waits for all its workers to be routable.
    #[arg(long, default_value_t = 180)]
    join_timeout: u64,
    /// The gateway's routing policy.
    #[arg(long, default_value = "least-loaded")]
    policy: String,
    /// Niceness of the process hosting the workers: it shares the machine with the router
    /// being measured, as no deployment's 10,000 workers would; 0 gives it equal priority.
    #[arg(long, default_value_t = 10)]
    workers_nice: i32,
    /// Niceness of the load generator's threads (this program's, not the processes it
    /// starts): no deployment's clients share its router's cores either. Their delays
    /// still count in the TTFT they measure.
    #[arg(long, default_value_t = 10)]
    client_nice: i32,
    #[arg(long, value_name = "PATH", default_value = "bench/results/scale.json")]
    json: PathBuf,
}

async fn summary(http: &reqwest::Client, gw: &Proc) -> Value {
    let url = format!("{}/status?workers=0", gw.http);
    match http.get(url).send().await {
        Ok(r) => r.json().await.unwrap_or(Value::Null),
        Err(_) => Value::Null,
    }
}

async fn reports(http: &reqwest::Client, gw: &Proc) -> f64 {
    gw.try_metric(http, "kvmesh:router_load_reports_total")
        .await
        .unwrap_or(f64::NAN)
}

/// Polls the gateway until `n` workers are routable, for `limit` after `t0` at most: the
/// seconds since `t0` it took and how many were routable at the end.
async fn until_routable(
    http: &reqwest::Client,
    gw: &Proc,
    n: usize,
    (t0, limit): (Instant, Duration),
) -> (Option<f64>, usize) {
    let mut routable = 0;
    while t0.elapsed() < limit {
        let s = summary(http, gw).await;
        routable = s["router"]["workers_summary"]["routable"]
            .as_u64()
            .unwrap_or(0) as usize;
        if routable >= n {
            return (Some(t0.elapsed().as_secs_f64()), routable);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    (None, routable)
}

/// A process's OS threads.
fn threads(p: &Proc) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{}/status", p.child.id()))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|t| t.trim().parse().ok())
}

/// Load reports the gateway reads per second, over `secs`.
async fn report_rate(http: &reqwest::Client, gw: &Proc, secs: u64) -> f64 {
    let a = reports(http, gw).await;
    tokio::time::sleep(Duration::from_secs(secs)).await;
    (reports(http, gw).await - a) / secs as f64
}

/// The requests, 16 tokens each at concurrency 64, sent from a runtime of their own whose
/// threads run at niceness `nice`.
async fn load_at(nice: i32, base: &str, prompts: Vec<String>) -> (Vec<Sample>, f64) {
    let base = base.to_string();
    let niced = move || {
        // SAFETY: setpriority is a plain system call; 0 is the calling thread.
        unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, nice) };
    };
    let load = std::thread::spawn(move || {
        niced();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .on_thread_start(niced)
            .build()
            .expect("a runtime for the load");
        rt.block_on(async {
            let http = load_client(Duration::from_secs(60));
            run_load(&http, &base, prompts, 16, 64).await
        })
    });
    tokio::task::spawn_blocking(move || load.join().expect("the load ran"))
        .await
        .expect("the load's thread joined")
}

async fn one_size(args: &Args, n: usize) -> Value {
    let km = kvmesh();
    let http = load_client(Duration::from_secs(60));
    let etcd = Etcd::start();
    let cluster = format!("scale-{n}");
    let gw = km.gateway(&etcd, &cluster, "gw", &args.policy);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rss0 = rss_mib(&gw);
    let replicas = n.to_string();
    let t0 = Instant::now();
    let workers = km.clone().niceness(args.workers_nice).node(
        &etcd,
        &cluster,
        "w",
        &[
            &["--roles", "worker", "--replicas", &replicas][..],
            &["--num-kv-blocks", "64", "--max-num-seqs", "64"],
            &ZERO_COST[..],
        ]
        .concat(),
    );
    let limit = Duration::from_secs(args.join_timeout);
    let (joined, routable) = until_routable(&http, &gw, n, (t0, limit)).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let rss = rss_mib(&gw);
    let per_link_kib = (rss - rss0) * 1024.0 / n as f64;
    let idle_reports = report_rate(&http, &gw, 10).await;

    let lines = shakespeare_lines();
    // Prefix routing: a preamble every prompt shares, long enough to fill blocks.
    let preamble = match args.policy.as_str() {
        "prefix" => lines[..4].join("\n") + "\n",
        _ => String::new(),
    };
    let prompts: Vec<String> = (0..args.requests)
        .map(|i| format!("{preamble}{}", lines[(i * 7) % lines.len()]))
        .collect();
    let before = reports(&http, &gw).await;
    let (samples, wall) = load_at(args.client_nice, &gw.http, prompts).await;
    let busy_reports = (reports(&http, &gw).await - before) / wall;
    let ok: Vec<_> = samples.iter().filter(|s| s.ok).collect();
    let ttft: Vec<f64> = ok.iter().map(|s| s.ttft * 1e3).collect();
    let st = status(&http, &gw).await;
    let pick = &st["router"]["pick_time"];
    let worker_threads = threads(&workers);
    // The router restarts: a new gateway learns every worker from etcd and dials it.
    let mut gw = gw;
    gw.kill();
    let t1 = Instant::now();
    let gw2 = km.gateway(&etcd, &cluster, "gw2", &args.policy);
    let (relearned, _) = until_routable(&http, &gw2, n, (t1, limit)).await;
    let row = json!({
        "workers": n,
        "policy": args.policy,
        "workers_nice": args.workers_nice,
        "client_nice": args.client_nice,
        "routable": routable,
        "all_routable_after_s": joined,
        "gateway_rss_mib_before": rss0,
        "gateway_rss_mib": rss,
        "gateway_kib_per_worker": per_link_kib,
        "worker_process_rss_mib": rss_mib(&workers),
        "reports_per_s_idle": idle_reports,
        "reports_per_s_loaded": busy_reports,
        "requests": samples.len(),
        "failed": samples.len() - ok.len(),
        "req_per_s": ok.len() as f64 / wall,
        "ttft_p50_ms": pct(&ttft, 50.0),
        "ttft_p99_ms": pct(&ttft, 99.0),
        "pick_p50_us": pick["recent_p50_us"],
        "pick_p99_us": pick["recent_p99_us"],
        "worker_process_threads": worker_threads,
        "router_restart_relearn_s": relearned,
    });
    let f = |k: &str| row[k].as_f64().unwrap_or(f64::NAN);
    println!(
        "{n:>7} {:>9} {:>9.1}s {:>8.0} {:>8.1} {:>9.0} {:>9.0} {:>6} {:>7.0} {:>8.1} {:>8.1} {:>8.1} {:>8.1} {:>8.1}s {:>7}",
        routable,
        joined.unwrap_or(f64::NAN),
        f("gateway_rss_mib"),
        f("gateway_kib_per_worker"),
        idle_reports,
        busy_reports,
        row["failed"],
        f("req_per_s"),
        f("ttft_p50_ms"),
        f("ttft_p99_ms"),
        f("pick_p50_us"),
        f("pick_p99_us"),
        f("router_restart_relearn_s"),
        worker_threads.map_or("-".into(), |t| t.to_string()),
    );
    row
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    println!(
        "{:>7} {:>9} {:>10} {:>8} {:>8} {:>9} {:>9} {:>6} {:>7} {:>8} {:>8} {:>8} {:>8} {:>9} {:>7}",
        "workers",
        "routable",
        "joined",
        "gw MiB",
        "KiB/wkr",
        "rep/s idl",
        "rep/s ld",
        "failed",
        "req/s",
        "ttft p50",
        "ttft p99",
        "pick p50",
        "pick p99",
        "relearn",
        "threads"
    );
    let mut rows = Vec::new();
    for &n in &args.sizes {
        rows.push(one_size(&args, n).await);
    }
    write_results(&args.json, false, json!({ "sizes": rows }));
}
