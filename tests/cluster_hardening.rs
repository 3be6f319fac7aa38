//! What an unlucky operator and an overloaded cluster do to the mesh: real etcd, real
//! `kvmesh node` processes on loopback.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::{bin, kvmesh};
use kvmesh_bench::harness::{client, post, routed, sse, status, wait_for, Proc};
use kvmesh_discovery::testing::Etcd;
use serde_json::{json, Value};

fn completion(prompt: &str, max_tokens: u32) -> Value {
    json!({"model": "shakespeare", "prompt": prompt, "max_tokens": max_tokens,
           "temperature": 0, "ignore_eos": true})
}

async fn workers(http: &reqwest::Client, gw: &Proc) -> Vec<Value> {
    status(http, gw).await["router"]["workers"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

async fn routable(http: &reqwest::Client, gw: &Proc) -> Vec<String> {
    workers(http, gw)
        .await
        .iter()
        .filter(|w| w["connected"] == true && w["draining"] != true)
        .map(|w| w["node_id"].as_str().unwrap().to_string())
        .collect()
}

async fn routed_to(http: &reqwest::Client, gw: &Proc, id: &str) -> u64 {
    routed(http, gw).await.get(id).copied().unwrap_or(0)
}

/// A streamed greedy completion: (tokens, error message, done).
async fn stream(
    http: &reqwest::Client,
    base: &str,
    prompt: &str,
    n: u32,
) -> (usize, Option<String>, bool) {
    let mut body = completion(prompt, n);
    body["stream"] = json!(true);
    body["return_token_ids"] = json!(true);
    let (chunks, error, done) = sse(http, base, body).await;
    let tokens = chunks
        .iter()
        .filter_map(|v| v["choices"][0]["token_ids"].as_array())
        .map(|a| a.len())
        .sum();
    (tokens, error, done)
}

/// A second node under a live node's id is refused at start-up, naming the id; the first
/// stays listed and routed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_node_id_is_refused_at_start() {
    let etcd = Etcd::start();
    let http = client();
    let gw = kvmesh().gateway(&etcd, "h1", "gw", "round-robin");
    let _w1 = kvmesh().worker(&etcd, "h1", "w1", &[]);
    let t = Instant::now();
    let out = Command::new(bin())
        .args([
            "node",
            "--etcd",
            &etcd.url(),
            "--cluster",
            "h1",
            "--node-id",
            "w1",
        ])
        .args(["--roles", "worker", "--backend", "sim", "--lease-ttl", "2"])
        .output()
        .unwrap();
    assert!(!out.status.success(), "a duplicate node id was accepted");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("node id w1 is already taken") && err.contains("--node-id"),
        "unclear refusal: {err}"
    );
    assert!(t.elapsed() < Duration::from_secs(30));
    wait_for("w1 still routed", 10, async || {
        routable(&http, &gw).await == ["w1"]
    })
    .await;
    let (st, body) = post(&http, &gw.http, completion("Still here?", 4)).await;
    assert_eq!(st, 200, "{body}");
}

/// etcd restarted on an empty data directory: the router keeps its live links while
/// everyone registers again, so no stream breaks and no request fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wiped_registry_cuts_no_traffic() {
    let mut etcd = Etcd::start();
    let http = client();
    let gw = kvmesh().gateway(&etcd, "h2", "gw", "least-loaded");
    let steps = ["--sim-decode-ms", "50"];
    let _w1 = kvmesh().worker(&etcd, "h2", "w1", &steps);
    let _w2 = kvmesh().worker(&etcd, "h2", "w2", &steps);
    wait_for("both routable", 15, async || {
        routable(&http, &gw).await.len() == 2
    })
    .await;
    // 80 tokens at 50 ms: four seconds of streaming across the wipe.
    let streams: Vec<_> = (0..4)
        .map(|i| {
            let (http, base) = (http.clone(), gw.http.clone());
            tokio::spawn(async move { stream(&http, &base, &format!("Stream {i}:"), 80).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    etcd.wipe();
    etcd.restart();
    // Requests while the registry is empty and while nodes re-register.
    for i in 0..6 {
        let (st, body) = post(
            &http,
            &gw.http,
            completion(&format!("During the wipe {i}"), 4),
        )
        .await;
        assert_eq!(st, 200, "request {i} after the wipe: {body}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for s in streams {
        let (tokens, error, done) = s.await.unwrap();
        assert_eq!(
            error, None,
            "a stream broke when the registry forgot its worker"
        );
        assert!(done && tokens == 80, "{tokens} tokens");
    }
    assert_eq!(gw.metric(&http, "kvmesh:migrations_total").await, 0.0);
    wait_for("every node registered again", 20, async || {
        let table = kvmesh().cluster_status(&etcd, "h2");
        ["gw ", "w1 ", "w2 "]
            .iter()
            .all(|id| table.lines().any(|l| l.starts_with(id)))
    })
    .await;
    assert_eq!(routable(&http, &gw).await.len(), 2);
}

/// A worker serving another model under the same name is never routed to, and cluster
/// status says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_different_model_under_the_same_name_is_not_routed_to() {
    let etcd = Etcd::start();
    let http = client();
    let dir = std::env::temp_dir().join(format!("kvmesh-other-model-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = Command::new(bin())
        .args([
            "model",
            "init-random",
            "--arch",
            "llama",
            "--vocab-size",
            "300",
            "--out",
        ])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let gw = kvmesh().gateway(&etcd, "h3", "gw", "round-robin");
    let _good = kvmesh().worker(&etcd, "h3", "good", &[]);
    let _other = kvmesh().worker(
        &etcd,
        "h3",
        "other",
        &[
            "--model",
            dir.to_str().unwrap(),
            "--served-model-name",
            "shakespeare",
        ],
    );
    wait_for("good routable", 15, async || {
        routable(&http, &gw).await == ["good"]
    })
    .await;
    wait_for("other refused", 10, async || {
        status(&http, &gw).await["router"]["refused"]
            .as_array()
            .is_some_and(|r| r.iter().any(|w| w["node_id"] == "other"))
    })
    .await;
    for i in 0..6 {
        let (st, body) = post(&http, &gw.http, completion(&format!("Which model {i}?"), 4)).await;
        assert_eq!(st, 200, "{body}");
    }
    assert_eq!(routed_to(&http, &gw, "good").await, 6);
    assert_eq!(routed_to(&http, &gw, "other").await, 0);
    let table = kvmesh().cluster_status(&etcd, "h3");
    let line = table
        .lines()
        .find(|l| l.starts_with("other "))
        .expect("other listed");
    assert!(line.contains("refused"), "{table}");
    assert!(
        table
            .lines()
            .any(|l| l.starts_with("! other:") && l.contains("another model")),
        "cluster status does not say why:\n{table}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Small queues everywhere and more requests than they hold: the excess gets 429
/// `queue_full` with Retry-After at once, not a 500 after a retry storm.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overloaded_cluster_answers_429_with_bounded_retries() {
    let etcd = Etcd::start();
    let http = client();
    let gw = kvmesh().gateway(&etcd, "h4", "gw", "least-loaded");
    let small = [
        "--max-num-seqs",
        "2",
        "--max-waiting-seqs",
        "2",
        "--sim-decode-ms",
        "50",
    ];
    let _w1 = kvmesh().worker(&etcd, "h4", "w1", &small);
    let _w2 = kvmesh().worker(&etcd, "h4", "w2", &small);
    wait_for("both routable", 15, async || {
        routable(&http, &gw).await.len() == 2
    })
    .await;
    let n = 40;
    let t = Instant::now();
    let results = futures::future::join_all((0..n).map(|i| {
        let (http, base) = (http.clone(), gw.http.clone());
        async move {
            // Half stream: a refusal is an HTTP status for them too, not a 200 stream
            // holding an error event.
            let mut body = completion(&format!("Overload {i}"), 20);
            body["stream"] = json!(i % 2 == 0);
            let r = http
                .post(format!("{base}/v1/completions"))
                .json(&body)
                .send()
                .await
                .unwrap();
            let st = r.status().as_u16();
            let retry_after = r.headers().get("retry-after").is_some();
            let body: Value = r.json().await.unwrap_or(Value::Null);
            (st, retry_after, body)
        }
    }))
    .await;
    let elapsed = t.elapsed();
    let ok = results.iter().filter(|r| r.0 == 200).count();
    let full: Vec<_> = results.iter().filter(|r| r.0 == 429).collect();
    println!(
        "overload: {ok} served, {} refused with 429, in {elapsed:?}",
        full.len()
    );
    assert_eq!(
        ok + full.len(),
        n,
        "other statuses: {:?}",
        results.iter().map(|r| r.0).collect::<Vec<_>>()
    );
    assert!(ok >= 8, "the cluster holds 8 at once: {ok} served");
    assert!(!full.is_empty(), "40 requests into 8 places: none refused");
    for (_, retry_after, body) in &full {
        assert!(retry_after, "429 without Retry-After");
        assert_eq!(body["error"]["code"], "queue_full", "{body}");
    }
    let retries = gw.metric(&http, "kvmesh:router_retries_total").await;
    // Each refused request tries each worker at most 1 + FULL_ROUNDS times.
    assert!(
        retries <= (n * 2 * 3) as f64,
        "retry storm: {retries} retries"
    );
    assert_eq!(
        gw.metric(&http, "kvmesh:router_queue_full_total").await,
        full.len() as f64
    );
}

/// A worker with a short context limit shrinks nobody's: the gateway reports the largest,
/// and a request only the larger worker fits goes there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_small_worker_does_not_shrink_the_context() {
    let etcd = Etcd::start();
    let http = client();
    let gw = kvmesh().gateway(&etcd, "h5", "gw", "round-robin");
    let _small = kvmesh().worker(&etcd, "h5", "small", &["--max-model-len", "32"]);
    let _big = kvmesh().worker(&etcd, "h5", "big", &[]);
    wait_for("both routable", 15, async || {
        routable(&http, &gw).await.len() == 2
    })
    .await;
    let models: Value = http
        .get(format!("{}/v1/models", gw.http))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"][0]["max_model_len"], 512, "{models}");
    let long = "To be, or not to be, that is the question: whether 'tis nobler in the mind";
    for _ in 0..4 {
        let (st, body) = post(&http, &gw.http, completion(long, 20)).await;
        assert_eq!(st, 200, "{body}");
        assert!(body["usage"]["total_tokens"].as_u64().unwrap() > 32);
    }
    assert_eq!(routed_to(&http, &gw, "small").await, 0);
    assert_eq!(routed_to(&http, &gw, "big").await, 4);
    // Short ones may go to either.
    for _ in 0..4 {
        let (st, body) = post(&http, &gw.http, completion("Hi", 2)).await;
        assert_eq!(st, 200, "{body}");
    }
    assert!(routed_to(&http, &gw, "small").await > 0);
}

/// A non-streaming request whose worker dies: it continues on another worker (200); with
/// migration off, the client gets 502 `worker_lost`, not a 500.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_worker_is_a_retry_or_a_502_never_a_500() {
    let etcd = Etcd::start();
    let http = client();
    let gw = kvmesh().gateway(&etcd, "h6", "gw", "least-loaded");
    let strict = kvmesh().node(
        &etcd,
        "h6",
        "gw0",
        &[
            "--roles",
            "gateway,router",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--migration-limit",
            "0",
        ],
    );
    let steps = ["--sim-decode-ms", "50"];
    let mut w1 = kvmesh().worker(&etcd, "h6", "w1", &steps);
    wait_for("w1 routable", 15, async || {
        routable(&http, &gw).await.len() == 1 && routable(&http, &strict).await.len() == 1
    })
    .await;
    let spawn = |base: String| {
        let http = http.clone();
        tokio::spawn(
            async move { post(&http, &base, completion("A long answer, please:", 80)).await },
        )
    };
    let (a, b) = (spawn(gw.http.clone()), spawn(strict.http.clone()));
    wait_for("both running on w1", 10, async || {
        status(&http, &w1).await["load"]["running"].as_u64() == Some(2)
    })
    .await;
    let _w2 = kvmesh().worker(&etcd, "h6", "w2", &steps);
    wait_for("w2 routable", 15, async || {
        routable(&http, &gw).await.len() == 2
    })
    .await;
    w1.kill();
    let (st, body) = a.await.unwrap();
    assert_eq!(st, 200, "{body}");
    assert_eq!(body["usage"]["completion_tokens"], 80);
    let (st, body) = b.await.unwrap();
    assert_eq!(st, 502, "{body}");
    assert_eq!(body["error"]["code"], "worker_lost", "{body}");
    assert!(
        body["error"]["message"].as_str().unwrap().contains("w1"),
        "{body}"
    );
}

/// `--replicas N` (scale tests): one process hosts N sim workers, each a member of its own
/// (record, QUIC endpoint, engine); the router spreads load over all of them and counts
/// its decisions; SIGTERM takes every one out of the registry. Flags it cannot honour are
/// refused by name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_process_hosts_many_workers_each_a_member() {
    for (extra, says) in [
        (
            &[
                "--roles",
                "worker,router",
                "--backend",
                "sim",
                "--replicas",
                "3",
            ][..],
            "--roles worker alone",
        ),
        (
            &["--roles", "worker", "--backend", "cpu", "--replicas", "3"][..],
            "--backend sim",
        ),
        (&["--roles", "worker", "--replicas", "0"][..], "at least 1"),
    ] {
        let out = Command::new(bin())
            .args(["node", "--etcd", "http://127.0.0.1:9"])
            .args(extra)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains("--replicas") && err.contains(says),
            "{extra:?}: unclear refusal: {err}"
        );
    }

    let etcd = Etcd::start();
    let http = client();
    let gw = kvmesh().gateway(&etcd, "h7", "gw", "least-loaded");
    let mut w = kvmesh().worker(
        &etcd,
        "h7",
        "w",
        &[
            "--replicas",
            "4",
            "--num-kv-blocks",
            "64",
            "--sim-decode-ms",
            "20",
        ],
    );
    wait_for("four workers routable", 15, async || {
        let mut ids = routable(&http, &gw).await;
        ids.sort();
        ids == ["w", "w.1", "w.2", "w.3"]
    })
    .await;
    // Eight at once, long enough to overlap: least-loaded spreads them.
    let reqs: Vec<_> = (0..8)
        .map(|i| {
            let (http, base) = (http.clone(), gw.http.clone());
            tokio::spawn(async move {
                post(&http, &base, completion(&format!("Replica test {i}:"), 24)).await
            })
        })
        .collect();
    for r in reqs {
        let (st, body) = r.await.unwrap();
        assert_eq!(st, 200, "{body}");
        assert_eq!(body["usage"]["completion_tokens"], 24, "{body}");
    }
    let r = routed(&http, &gw).await;
    assert_eq!(r.values().sum::<u64>(), 8, "{r:?}");
    assert!(
        r.values().filter(|&&n| n > 0).count() >= 3,
        "load was not spread over the replicas: {r:?}"
    );
    let picks = &status(&http, &gw).await["router"]["pick_time"];
    // One decision per request (more only if one was retried).
    assert!(picks["count"].as_u64().unwrap() >= 8, "{picks}");
    assert!(picks["recent_p50_us"].as_f64().unwrap() > 0.0, "{picks}");
    assert!(picks["mean_us"].as_f64().unwrap() > 0.0, "{picks}");

    // SIGTERM: every replica leaves the registry, not after its lease.
    w.terminate();
    wait_for("every replica deregistered", 10, async || {
        workers(&http, &gw).await.is_empty()
    })
    .await;
    assert!(
        !kvmesh()
            .cluster_status(&etcd, "h7")
            .lines()
            .any(|l| l.starts_with('w')),
        "{}",
        kvmesh().cluster_status(&etcd, "h7")
    );
}
