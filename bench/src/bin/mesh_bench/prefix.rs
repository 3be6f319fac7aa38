//! Prefix routing: a multi-turn chat workload (`kvmesh bench --dataset conversation`, each
//! turn resending the conversation so far) over 4 workers, per policy.

use kvmesh_bench::harness::{status, wait_workers, Proc};
use kvmesh_discovery::testing::Etcd;
use serde_json::{json, Value};

use crate::ctx::{p99, Ctx};

/// `kvmesh bench --dataset conversation` against a gateway: the run's JSON.
fn conversation_run(
    ctx: &Ctx,
    gw: &Proc,
    label: &str,
    conversations: usize,
    turns: usize,
    think_ms: f64,
) -> Value {
    let dir = std::env::temp_dir().join(format!("kvmesh-mesh-bench-{}", std::process::id()));
    let conc = conversations.to_string();
    let turns = turns.to_string();
    let think = think_ms.to_string();
    let args = [
        ["--base-url", &gw.http, "--dataset", "conversation"].as_slice(),
        &["--conversations", &conc, "--turns", &turns],
        &[
            "--input-len",
            "128",
            "--turn-input-len",
            "24",
            "--output-len",
            "24",
        ],
        &[
            "--think-time",
            &think,
            "--concurrency",
            &conc,
            "--label",
            label,
        ],
    ]
    .concat();
    ctx.kvmesh_bench(&args, &dir, label);
    let path = dir.join(format!("{label}-c{conc}.json"));
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    v
}

/// The multi-turn workload twice: turns back to back (a closed loop: every conversation
/// always has a request in, so a faster cluster shows as throughput), and with users who
/// pause a second on average before each turn (latency at a load the cluster carries).
pub async fn prefix_routing(ctx: &Ctx) -> Value {
    let mut out = Vec::new();
    for think_ms in [0.0, 1000.0] {
        out.push(json!({"think_time_ms": think_ms,
                        "rows": prefix_table(ctx, think_ms).await}));
    }
    json!(out)
}

/// Each policy over 4 workers (and one worker, which every turn finds its history on), the
/// users pausing `think_ms` on average before each turn.
async fn prefix_table(ctx: &Ctx, think_ms: f64) -> Value {
    let (km, http, quick) = (&ctx.km, &ctx.http, ctx.quick);
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
            .map(|i| km.node(&etcd, &cluster, &format!("w{i}"), &worker_args))
            .collect();
        let gw = km.gateway(&etcd, &cluster, "gw", policy);
        wait_workers(http, &gw, workers).await;
        let run = conversation_run(ctx, &gw, label, conversations, turns, think_ms);
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
