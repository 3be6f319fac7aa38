//! Mesh overhead: a zero-cost sim worker behind gateway → router → QUIC → worker, against
//! the same worker in-process (`kvmesh serve`).

use kvmesh_bench::harness::load::{run_load, shakespeare_lines, summary};
use kvmesh_bench::harness::wait_workers;
use kvmesh_bench::programs::ZERO_COST;
use kvmesh_discovery::testing::Etcd;
use serde_json::{json, Value};

use crate::ctx::Ctx;

/// Requests/s and the added p50/p99 latency, at concurrency 1 and 16.
pub async fn mesh_overhead(ctx: &Ctx) -> Value {
    let (km, http, quick) = (&ctx.km, &ctx.http, ctx.quick);
    let lines = shakespeare_lines();
    let n = if quick { 200 } else { 1000 };
    let prompts: Vec<String> = (0..n).map(|i| lines[i % lines.len()].clone()).collect();
    let mut rows = Vec::new();
    let serve = km.serve(&ZERO_COST);
    let etcd = Etcd::start();
    let _w = km.node(
        &etcd,
        "bench-mesh",
        "w1",
        &[&["--roles", "worker"][..], &ZERO_COST[..]].concat(),
    );
    let gw = km.gateway(&etcd, "bench-mesh", "gw", "round-robin");
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
