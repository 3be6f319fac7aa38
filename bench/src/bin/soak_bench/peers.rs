//! The phases aimed at the mesh's own ports rather than the gateway's: strangers on a decode
//! node's KV listener, and a prefill peer that stops answering (the scenarios of
//! `harness::abuse`, which `tests/reliability.rs` asserts on).

use std::time::Duration;

use kvmesh_bench::harness::abuse::{
    free_port, frozen_prefill_peer, kv_listener_node, kv_listener_strangers,
};
use kvmesh_bench::harness::load::pct;
use kvmesh_bench::harness::Kvmesh;
use kvmesh_discovery::testing::Etcd;
use serde_json::{json, Value};

/// Strangers on a decode node's KV listener: its memory, and how fast they were closed.
pub fn kv_listener_abuse(km: &Kvmesh, etcd: &Etcd) -> Value {
    let kv = format!("127.0.0.1:{}", free_port());
    let node = kv_listener_node(km, etcd, "soak-kv", &kv);
    let r = kv_listener_strangers(&node, &kv);
    println!(
        "KV listener: RSS {:.1} MiB before; {}; {} of {} silent connections closed at once, \
         all {} within {:.1} s; RSS {:.1} MiB after",
        r.rss_before_mib,
        r.rounds
            .iter()
            .map(|(n, rss, closed)| format!(
                "{n} hostile hellos: {rss:.1} MiB during, {closed} closed within 3 s"
            ))
            .collect::<Vec<_>>()
            .join("; "),
        r.silent_closed_at_once,
        r.silent,
        r.silent_closed,
        r.silent_all_closed_s,
        r.rss_after_mib
    );
    r.json()
}

/// 16 long prompts with one prefill peer frozen: when they finished.
pub async fn stalled_prefill_peer(km: &Kvmesh, etcd: &Etcd, http: &reqwest::Client) -> Value {
    let r = frozen_prefill_peer(km, etcd, "soak-pf", http).await;
    let ms: Vec<f64> = r.finished.iter().map(|f| f.1.as_secs_f64() * 1e3).collect();
    let failed = r.finished.iter().filter(|f| f.0 != 200).count();
    let quick = r
        .finished
        .iter()
        .filter(|f| f.1 < Duration::from_secs(1))
        .count();
    let max = ms.iter().copied().fold(0.0, f64::max);
    println!(
        "stalled prefill peer: 16 long prompts, {failed} failed; {quick} finished within 1 s \
         ({} prefilled remotely), p50 {:.0} ms, max {max:.0} ms; {} prefilled locally after \
         the frozen peer's dial failed",
        r.remote,
        pct(&ms, 50.0),
        r.fallbacks
    );
    json!({
        "requests": 16,
        "failed": failed,
        "finished_within_1s": quick,
        "finished_p50_ms": pct(&ms, 50.0),
        "finished_max_ms": max,
        "remote_prefills": r.remote,
        "local_fallbacks": r.fallbacks,
    })
}
