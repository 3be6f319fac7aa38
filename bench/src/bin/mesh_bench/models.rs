//! Several models in one mesh: what a router's pick costs when its workers are split over
//! models (it must not grow with the number of models: a request's model picks its pool,
//! and the pick runs over that pool only), and what a gateway's first request for a model
//! costs while it fetches the model's card, against the next one.

use std::time::Instant;

use kvmesh_bench::harness::load::{completion, one_body, pct, shakespeare_lines};
use kvmesh_bench::harness::{status, wait_workers, Proc};
use kvmesh_bench::programs::ZERO_COST;
use kvmesh_discovery::testing::Etcd;
use kvmesh_gpu::model::Numerics;
use serde_json::{json, Value};
use tokio::sync::Semaphore;

use crate::ctx::Ctx;

/// `n` requests, `concurrency` at a time, the i-th for model `model(i)`; returns how many
/// failed.
async fn load(ctx: &Ctx, gw: &Proc, n: usize, model: impl Fn(usize) -> String) -> usize {
    let lines = shakespeare_lines();
    let sem = std::sync::Arc::new(Semaphore::new(8));
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let mut body = completion(json!(lines[(i * 7) % lines.len()]), 4);
            body["model"] = json!(model(i));
            let (http, base, sem) = (ctx.http.clone(), gw.http.clone(), sem.clone());
            tokio::spawn(async move {
                let _permit = sem.acquire_owned().await.unwrap();
                one_body(&http, &base, body).await.ok
            })
        })
        .collect();
    let mut failed = 0;
    for t in tasks {
        if !t.await.unwrap() {
            failed += 1;
        }
    }
    failed
}

/// Pick time in a running router over 64 sim workers, as one model × 64 workers and as
/// 8 models × 8 workers (each model's workers one `--replicas 8` process, served under
/// its own name). Requests cycle over the models; the routers' own account of their picks.
pub async fn pick_by_models(ctx: &Ctx) -> Value {
    let (km, http) = (&ctx.km, &ctx.http);
    let requests = if ctx.quick { 160 } else { 800 };
    let etcd = Etcd::start();
    let mut rows = Vec::new();
    println!("\n== pick time by models in the mesh (64 sim workers, least-loaded) ==");
    println!(
        "{:>16} {:>7} {:>9} {:>10} {:>10} {:>10} {:>8}",
        "layout", "pools", "picks", "mean", "p50", "p99", "failed"
    );
    for (models, per_model) in [(1usize, 64usize), (8, 8)] {
        let cluster = format!("bench-models-{models}x{per_model}");
        let names: Vec<String> = (0..models).map(|k| format!("m{k}")).collect();
        let replicas = per_model.to_string();
        let _workers: Vec<Proc> = names
            .iter()
            .map(|name| {
                let args = [
                    &["--roles", "worker", "--replicas", &replicas][..],
                    &["--num-kv-blocks", "64", "--served-model-name", name][..],
                    &ZERO_COST[..],
                ]
                .concat();
                km.node(&etcd, &cluster, &format!("w-{name}"), &args)
            })
            .collect();
        let gw = km.gateway(&etcd, &cluster, "gw", "least-loaded");
        wait_workers(http, &gw, models * per_model).await;
        // Every model's card fetched before the timed load.
        load(ctx, &gw, models, |i| names[i].clone()).await;
        let failed = load(ctx, &gw, requests, |i| names[i % models].clone()).await;
        let st = status(http, &gw).await;
        let pools = st["router"]["pools"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let picks = st["router"]["pick_time"]["count"].as_u64().unwrap_or(0);
        let mean = st["router"]["pick_time"]["mean_us"]
            .as_f64()
            .unwrap_or(f64::NAN);
        // The pools' recent percentiles, averaged (they see the same traffic each).
        let avg = |k: &str| {
            let v: Vec<f64> = pools
                .iter()
                .filter_map(|p| p["pick_time"][k].as_f64())
                .collect();
            v.iter().sum::<f64>() / v.len().max(1) as f64
        };
        let (p50, p99) = (avg("recent_p50_us"), avg("recent_p99_us"));
        let layout = format!("{models} x {per_model}");
        println!(
            "{layout:>16} {:>7} {picks:>9} {mean:>8.2}us {p50:>8.2}us {p99:>8.1}us {failed:>8}",
            pools.len()
        );
        rows.push(json!({"models": models, "workers_per_model": per_model,
            "pools": pools.len(), "picks": picks, "mean_us": mean, "p50_us": p50,
            "p99_us": p99, "failed": failed}));
    }
    json!(rows)
}

/// The first request for a model on a gateway that has not served it (the card fetched
/// from a worker over QUIC and checked) against the next one, and on a restarted gateway
/// that keeps cards in `--cache-dir`, and one that comes half a second after the worker is
/// connected (the gateway fetches a card unasked). Each round starts new gateways; a zero-cost sim
/// worker serves, so the times are the gateway's. Beside them, the card's check and load
/// alone, in this process.
pub async fn cold_card(ctx: &Ctx) -> Value {
    let (km, http) = (&ctx.km, &ctx.http);
    let rounds = if ctx.quick { 3 } else { 10 };
    let etcd = Etcd::start();
    let cache = std::env::temp_dir().join(format!("kvmesh-bench-cards-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&cache);
    let cluster = "bench-cards";
    let args = [&["--roles", "worker"][..], &ZERO_COST[..]].concat();
    let _worker = km.node(&etcd, cluster, "w", &args);
    let first = |gw: &Proc| {
        let (http, base) = (http.clone(), gw.http.clone());
        async move {
            let t = Instant::now();
            let s = one_body(&http, &base, completion(json!("ROMEO:"), 1)).await;
            assert!(s.ok, "a request failed");
            t.elapsed().as_secs_f64() * 1e3
        }
    };
    let (mut cold, mut warm, mut disk, mut later) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for round in 0..rounds {
        let dir = cache.to_str().unwrap();
        let gw = km.gateway_with(
            &etcd,
            cluster,
            &format!("gw-{round}"),
            "least-loaded",
            &["--cache-dir", dir],
        );
        wait_workers(http, &gw, 1).await;
        cold.push(first(&gw).await);
        warm.push(first(&gw).await);
        drop(gw);
        // A new gateway finds the card on disk.
        let gw = km.gateway_with(
            &etcd,
            cluster,
            &format!("gw-{round}-disk"),
            "least-loaded",
            &["--cache-dir", dir],
        );
        wait_workers(http, &gw, 1).await;
        disk.push(first(&gw).await);
        let _ = std::fs::remove_dir_all(&cache);
        drop(gw);
        // A new gateway whose first request comes half a second after the worker is
        // connected: the card was fetched meanwhile, unasked.
        let gw = km.gateway(&etcd, cluster, &format!("gw-{round}-later"), "least-loaded");
        wait_workers(http, &gw, 1).await;
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        later.push(first(&gw).await);
    }
    // What of it is the card's check and load, in-process: the tokenizer and chat template
    // built from the card's files and the fingerprint recomputed.
    let model = kvmesh_gpu::model::LoadedModel::from_embedded(&kvmesh_gpu::embedded::DEFAULT_MODEL)
        .expect("the embedded model");
    let card =
        kvmesh_gpu::card::ModelCard::of(&model, Numerics::Model, "shakespeare", 512, 16, None)
            .unwrap();
    let bytes = card.to_bytes();
    let mut load = Vec::new();
    for _ in 0..rounds {
        let t = Instant::now();
        let c = kvmesh_gpu::card::ModelCard::from_bytes(&bytes).unwrap();
        let loaded = c
            .load(&model.fingerprint(Numerics::Model))
            .expect("the card checks");
        std::hint::black_box(&loaded.tokenizer);
        load.push(t.elapsed().as_secs_f64() * 1e3);
    }
    println!("\n== first request for a model on a gateway: card fetch ({rounds} rounds, ms) ==");
    println!("{:>28} {:>8} {:>8}", "", "p50", "max");
    let mut out = json!({"rounds": rounds});
    for (label, key, v) in [
        ("cold (card from a worker)", "cold_ms", &mut cold),
        ("warm (card in memory)", "warm_ms", &mut warm),
        ("restarted, --cache-dir", "disk_ms", &mut disk),
        ("first, 0.5 s after joining", "prefetched_ms", &mut later),
        ("card check + load alone", "card_load_ms", &mut load),
    ] {
        v.sort_by(f64::total_cmp);
        let (p50, max) = (pct(v, 50.0), v.last().copied().unwrap_or(f64::NAN));
        println!("{label:>28} {p50:>8.2} {max:>8.2}");
        out[key] = json!({"p50": p50, "max": max, "all": v});
    }
    out
}
