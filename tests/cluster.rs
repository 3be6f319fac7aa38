//! Cluster mode end to end: a real etcd (Debian's `etcd-server`, started here) and real
//! `kvmesh node` processes talking QUIC on loopback. Workers use the `sim` backend, so these
//! tests measure nothing about speed; they check who gets which request and what happens
//! when something dies.

mod common;

use std::time::{Duration, Instant};

use common::kvmesh;
use kvmesh_bench::harness::{client, connected_workers, post, routed, sse, status, wait_for, Proc};
use kvmesh_discovery::testing::Etcd;
use serde_json::{json, Value};

fn completion(max_tokens: u32) -> Value {
    json!({"model": "shakespeare", "prompt": "Now is the winter of our discontent",
           "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true})
}

/// A streamed completion: (tokens received, the error event's message if one came, done).
async fn stream(
    http: &reqwest::Client,
    base: &str,
    max_tokens: u32,
) -> (usize, Option<String>, bool) {
    let mut body = completion(max_tokens);
    body["stream"] = json!(true);
    let (chunks, error, done) = sse(http, base, body).await;
    let tokens = chunks
        .iter()
        .filter(|v| v["choices"][0]["text"].is_string())
        .count();
    (tokens, error, done)
}

/// A streamed greedy completion of `prompt` with its token ids: (ids, error, done).
async fn stream_ids(
    http: &reqwest::Client,
    base: &str,
    prompt: &str,
    max_tokens: u32,
) -> (Vec<u64>, Option<String>, bool) {
    let body = json!({"model": "shakespeare", "prompt": prompt, "max_tokens": max_tokens,
        "temperature": 0, "ignore_eos": true, "stream": true, "return_token_ids": true});
    let (chunks, error, done) = sse(http, base, body).await;
    let ids = chunks
        .iter()
        .filter_map(|v| v["choices"][0]["token_ids"].as_array())
        .flatten()
        .filter_map(|x| x.as_u64())
        .collect();
    (ids, error, done)
}

/// Membership, spreading, 503 without workers, a crashed role restarted, a node with a
/// certificate that does not match its record refused, SIGTERM leaving at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_forms_spreads_requests_and_refuses_impostors() {
    let etcd = Etcd::start();
    let http = client();
    let gw = kvmesh().gateway(&etcd, "c1", "gw", "round-robin");

    // No worker yet: a request waits for one (up to 10 s) and is served when it joins.
    let early = {
        let (http, base) = (http.clone(), gw.http.clone());
        tokio::spawn(async move { post(&http, &base, completion(4)).await })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let w1 = kvmesh().worker(&etcd, "c1", "w1", &[]);
    let (st, body) = early.await.unwrap();
    assert_eq!(st, 200, "a request sent before any worker joined: {body}");
    // In a cluster that gets none: 503 with a clear error and Retry-After after the wait,
    // not a hang.
    let lonely = kvmesh().gateway(&etcd, "c1-empty", "gw", "round-robin");
    let t = Instant::now();
    let r = http
        .post(format!("{}/v1/completions", lonely.http))
        .json(&completion(4))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 503);
    assert_eq!(r.headers()["retry-after"], "1");
    let waited = t.elapsed();
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "no_worker_available", "{body}");
    assert!(
        waited >= Duration::from_secs(8),
        "refused after {waited:?}, not after waiting for a worker"
    );
    drop(lonely);
    let mut w2 = kvmesh().worker(&etcd, "c1", "w2", &[]);
    // An impostor: its record names a certificate it does not hold.
    let _bad = kvmesh().worker(
        &etcd,
        "c1",
        "bad",
        &["--debug-advertise-fingerprint", &"ab".repeat(32)],
    );
    // The impostor is listed once its record reaches the router (membership views are
    // published at most every 100 ms), and never connected.
    let joined = wait_for(
        "both workers routable, the impostor listed",
        10,
        async || {
            connected_workers(&http, &gw).await.len() == 2
                && routed(&http, &gw).await.contains_key("bad")
        },
    )
    .await;
    println!("workers routable {joined:?} after start");

    let reqs = (0..8).map(|_| post(&http, &gw.http, completion(6)));
    for (st, body) in futures::future::join_all(reqs).await {
        assert_eq!(st, 200, "{body}");
        assert_eq!(body["usage"]["completion_tokens"], 6);
    }
    let r = routed(&http, &gw).await;
    // w1 also served the request sent before any worker joined.
    assert_eq!(r.get("w1"), Some(&5), "round-robin split: {r:?}");
    assert_eq!(r.get("w2"), Some(&4), "round-robin split: {r:?}");
    assert_eq!(r.get("bad"), Some(&0), "the impostor got traffic: {r:?}");
    assert!(!connected_workers(&http, &gw)
        .await
        .contains(&"bad".to_string()));
    let served = status(&http, &w1).await["load"]["requests_served"].as_u64();
    assert_eq!(served, Some(5));

    let table = kvmesh().cluster_status(&etcd, "c1");
    println!("{table}");
    for id in ["gw", "w1", "w2", "bad"] {
        assert!(
            table.lines().any(|l| l.starts_with(id)),
            "{id} missing:\n{table}"
        );
    }
    assert!(
        table.contains("gateway,router") && table.contains("sim"),
        "{table}"
    );

    // The router role panics; the supervisor restarts it and requests keep working.
    let r = http
        .post(format!("{}/debug/crash/router", gw.http))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    wait_for("router restart counted", 10, async || {
        status(&http, &gw).await["role_restarts"]["router"] == 1
    })
    .await;
    let (st, body) = post(&http, &gw.http, completion(3)).await;
    assert_eq!(st, 200, "after the router restart: {body}");
    let metrics = http
        .get(format!("{}/metrics", gw.http))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("kvmesh:role_restarts_total{role=\"router\"} 1"),
        "{metrics}"
    );

    // SIGTERM: w2 revokes its lease and leaves the table before its TTL could expire.
    w2.terminate();
    let t = Instant::now();
    while kvmesh()
        .cluster_status(&etcd, "c1")
        .lines()
        .any(|l| l.starts_with("w2"))
    {
        assert!(t.elapsed() < Duration::from_millis(1500), "w2 still listed");
        std::thread::sleep(Duration::from_millis(100));
    }
    drop(w1);
}

/// A worker killed under load: requests it had not started go elsewhere; those it was
/// streaming move to the other worker and finish; nothing hangs. Then a worker added under
/// load gets traffic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_worker_loses_no_request_and_new_worker_gets_traffic() {
    let etcd = Etcd::start();
    let http = client();
    let gw = kvmesh().gateway(&etcd, "c2", "gw", "least-loaded");
    // Two sequences at a time, 40 ms per step: most requests wait in the queue.
    let slow = ["--max-num-seqs", "2", "--sim-decode-ms", "40"];
    let mut w1 = kvmesh().worker(&etcd, "c2", "w1", &slow);
    let w2 = kvmesh().worker(&etcd, "c2", "w2", &slow);
    wait_for("both workers routable", 10, async || {
        connected_workers(&http, &gw).await.len() == 2
    })
    .await;

    let n = 12;
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let (http, base) = (http.clone(), gw.http.clone());
            tokio::spawn(async move { stream(&http, &base, 20).await })
        })
        .collect();
    // Let w1 start two and queue the rest of its share, then kill it.
    wait_for("w1 busy", 10, async || {
        status(&http, &w1).await["load"]["running"].as_u64() == Some(2)
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let killed_at = Instant::now();
    w1.kill();
    let mut finished = 0;
    for t in tasks {
        let (tokens, error, done) = t.await.unwrap();
        assert_eq!(error, None, "a request was lost with its worker");
        assert!(done, "a stream ended without [DONE]");
        assert_eq!(tokens, 20);
        finished += 1;
    }
    let migrated = gw.metric(&http, "kvmesh:migrations_total").await;
    assert!(
        (1.0..=2.0).contains(&migrated),
        "w1's running requests (1 or 2 of them) migrate: {migrated}"
    );
    println!(
        "{finished} finished ({migrated} migrated); all done {:?} after the kill",
        killed_at.elapsed()
    );
    assert_eq!(finished, n);
    let st = status(&http, &gw).await;
    println!("router after kill: {}", st["router"]);
    assert!(!connected_workers(&http, &gw)
        .await
        .contains(&"w1".to_string()));

    // Under steady load, a new worker joins and gets traffic within about a second.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let load: Vec<_> = (0..6)
        .map(|_| {
            let (http, base, stop) = (http.clone(), gw.http.clone(), stop.clone());
            tokio::spawn(async move {
                let mut bad = Vec::new();
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let (st, body) = post(&http, &base, completion(10)).await;
                    if st != 200 {
                        bad.push(body);
                    }
                }
                bad
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let w3 = kvmesh().worker(&etcd, "c2", "w3", &slow);
    let took = wait_for("w3 gets traffic", 10, async || {
        status(&http, &w3).await["load"]["requests_served"].as_u64() > Some(0)
    })
    .await;
    println!("w3 served its first request {took:?} after it registered");
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for t in load {
        let bad = t.await.unwrap();
        assert!(bad.is_empty(), "requests failed under load: {bad:?}");
    }
    let r = routed(&http, &gw).await;
    println!("routed after the join: {r:?}");
    drop(w2);
}

/// etcd goes away and comes back: serving continues meanwhile, and membership works after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_restart_is_survived_without_restarting_nodes() {
    let mut etcd = Etcd::start();
    let http = client();
    let gw = kvmesh().gateway(&etcd, "c3", "gw", "least-loaded");
    let _w1 = kvmesh().worker(&etcd, "c3", "w1", &[]);
    wait_for("w1 routable", 10, async || {
        connected_workers(&http, &gw).await.len() == 1
    })
    .await;

    etcd.kill();
    // Connections are the truth while the registry is gone.
    for _ in 0..3 {
        let (st, body) = post(&http, &gw.http, completion(4)).await;
        assert_eq!(st, 200, "with etcd down: {body}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    etcd.restart();
    let _w2 = kvmesh().worker(&etcd, "c3", "w2", &[]);
    wait_for("w2 (joined after the restart) routable", 15, async || {
        connected_workers(&http, &gw).await.len() == 2
    })
    .await;
    let table = kvmesh().cluster_status(&etcd, "c3");
    for id in ["gw", "w1", "w2"] {
        assert!(
            table.lines().any(|l| l.starts_with(id)),
            "{id} missing:\n{table}"
        );
    }
    let (st, body) = post(&http, &gw.http, completion(4)).await;
    assert_eq!(st, 200, "{body}");
}

/// The only worker dies with one request running and one queued: both wait for a worker
/// and complete on the one that replaces it (the running one continuing where it was cut),
/// instead of failing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unstarted_request_waits_for_a_replacement_worker() {
    let etcd = Etcd::start();
    let http = client();
    let gw = kvmesh().gateway(&etcd, "c4", "gw", "least-loaded");
    let one_at_a_time = ["--max-num-seqs", "1", "--sim-decode-ms", "40"];
    let mut w1 = kvmesh().worker(&etcd, "c4", "w1", &one_at_a_time);
    wait_for("w1 routable", 10, async || {
        connected_workers(&http, &gw).await.len() == 1
    })
    .await;
    let (h1, b1) = (http.clone(), gw.http.clone());
    let prompt = "Now is the winter of our discontent";
    let (reference, ..) = stream_ids(&http, &gw.http, prompt, 100).await;
    let running = tokio::spawn(async move { stream_ids(&h1, &b1, prompt, 100).await });
    wait_for("first request running", 10, async || {
        status(&http, &w1).await["load"]["running"].as_u64() == Some(1)
    })
    .await;
    let (h2, b2) = (http.clone(), gw.http.clone());
    let queued = tokio::spawn(async move { stream(&h2, &b2, 10).await });
    wait_for("second request queued", 10, async || {
        status(&http, &w1).await["load"]["waiting"].as_u64() == Some(1)
    })
    .await;
    w1.kill();
    // Only once the router has dropped w1 (and so had nowhere to send the request) does a
    // replacement start.
    wait_for("w1 out of routing", 10, async || {
        connected_workers(&http, &gw).await.is_empty()
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _w2 = kvmesh().worker(&etcd, "c4", "w2", &one_at_a_time);
    // The running request moves to the replacement and goes on where it stopped.
    let (ids, error, done) = running.await.unwrap();
    assert_eq!(error, None, "the running request was lost");
    assert!(done);
    assert_eq!(ids, reference);
    let (tokens, error, done) = queued.await.unwrap();
    assert_eq!(error, None, "the queued request was lost");
    assert!(done);
    assert_eq!(tokens, 10);
}

/// Eight greedy streams running on one worker when it is SIGKILLed: every stream moves to
/// the other worker and completes with exactly the tokens of an undisturbed run; the
/// migrations are counted. With `--migration-limit 0` a stream cut the same way ends with
/// an error event instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_on_a_killed_worker_migrate_and_finish_token_identical() {
    let etcd = Etcd::start();
    let http = client();
    let gw = kvmesh().gateway(&etcd, "c5", "gw", "least-loaded");
    let strict = kvmesh().node(
        &etcd,
        "c5",
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
    // 80 tokens at 50 ms a step: four seconds of streaming, for w2 to join and the kill.
    let steps = ["--max-num-seqs", "16", "--sim-decode-ms", "50"];
    let mut w1 = kvmesh().worker(&etcd, "c5", "w1", &steps);
    wait_for("w1 routable", 10, async || {
        connected_workers(&http, &gw).await.len() == 1
            && connected_workers(&http, &strict).await.len() == 1
    })
    .await;
    let prompts: Vec<String> = (0..8)
        .map(|i| format!("To be, or not to be, that is question number {i}:"))
        .collect();
    let max_tokens = 80;
    // Undisturbed: the reference tokens.
    let reference: Vec<Vec<u64>> = futures::future::join_all(
        prompts
            .iter()
            .map(|p| stream_ids(&http, &gw.http, p, max_tokens)),
    )
    .await
    .into_iter()
    .map(|(ids, error, done)| {
        assert!(error.is_none() && done);
        assert_eq!(ids.len(), max_tokens as usize);
        ids
    })
    .collect();
    // All eight (and one through the strict gateway) run on w1, the only worker.
    let tasks: Vec<_> = prompts
        .iter()
        .map(|p| {
            let (http, base, p) = (http.clone(), gw.http.clone(), p.clone());
            tokio::spawn(async move { stream_ids(&http, &base, &p, max_tokens).await })
        })
        .collect();
    let (h, b, p0) = (http.clone(), strict.http.clone(), prompts[0].clone());
    let strict_task = tokio::spawn(async move { stream_ids(&h, &b, &p0, max_tokens).await });
    wait_for("nine streams running on w1", 10, async || {
        status(&http, &w1).await["load"]["running"].as_u64() == Some(9)
    })
    .await;
    let _w2 = kvmesh().worker(&etcd, "c5", "w2", &steps);
    wait_for("w2 routable", 10, async || {
        connected_workers(&http, &gw).await.len() == 2
    })
    .await;
    // Some tokens have been streamed, and the streams are still running there.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        status(&http, &w1).await["load"]["running"].as_u64(),
        Some(9),
        "the streams ended before the kill: the test would prove nothing"
    );
    w1.kill();
    for (t, want) in tasks.into_iter().zip(&reference) {
        let (ids, error, done) = t.await.unwrap();
        assert_eq!(error, None, "a stream was cut");
        assert!(done);
        assert_eq!(
            &ids, want,
            "a migrated stream differs from the undisturbed run"
        );
    }
    assert_eq!(gw.metric(&http, "kvmesh:migrations_total").await, 8.0);
    let (ids, error, _) = strict_task.await.unwrap();
    let error = error.expect("with --migration-limit 0 the cut stream ends with an error");
    assert!(!ids.is_empty() && ids.len() < max_tokens as usize);
    assert!(
        error.contains("w1") && error.contains("limit"),
        "unclear error: {error}"
    );
    assert_eq!(strict.metric(&http, "kvmesh:migrations_total").await, 0.0);
    assert_eq!(
        strict
            .metric(&http, "kvmesh:router_midstream_failures_total")
            .await,
        1.0
    );
}

/// Prefix routing from the workers' own account: each worker streams the blocks it stores
/// and evicts, the router's view matches what the worker then reports as cached, and a
/// conversation's next turn goes where its history is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_routing_follows_the_workers_kv_events() {
    let etcd = Etcd::start();
    let http = client();
    let gw = kvmesh().gateway(&etcd, "c6", "gw", "prefix");
    let _w1 = kvmesh().worker(&etcd, "c6", "w1", &[]);
    let _w2 = kvmesh().worker(&etcd, "c6", "w2", &[]);
    wait_for("both workers routable and synced", 10, async || {
        let s = status(&http, &gw).await;
        let ws = s["router"]["workers"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        ws.len() == 2
            && ws
                .iter()
                .all(|w| w["connected"] == json!(true) && w["kv_events_synced"] == json!(true))
    })
    .await;
    let history =
        "First Citizen: Before we proceed any further, hear me speak. All: Speak, speak. \
                   First Citizen: You are all resolved rather to die than to famish?";
    let ask = |prompt: String| {
        let (http, base) = (http.clone(), gw.http.clone());
        async move {
            let (st, body) = post(
                &http,
                &base,
                json!({"model": "shakespeare", "prompt": prompt, "max_tokens": 8,
                       "temperature": 0, "ignore_eos": true}),
            )
            .await;
            assert_eq!(st, 200, "{body}");
            body["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap()
        }
    };
    assert_eq!(ask(history.to_string()).await, 0);
    // The worker reports the blocks it stored; wait for the router to have them.
    wait_for("the first worker's blocks reported", 10, async || {
        let s = status(&http, &gw).await;
        s["router"]["workers"]
            .as_array()
            .unwrap()
            .iter()
            .any(|w| w["kv_blocks_reported"].as_u64() > Some(0))
    })
    .await;
    let mut turn = history.to_string();
    for k in 0..4 {
        turn.push_str(&format!(" All: Resolved, resolved, turn {k}."));
        let cached = ask(turn.clone()).await;
        assert!(
            cached > 16,
            "turn {k} missed its history: {cached} cached tokens"
        );
    }
    let s = status(&http, &gw).await;
    let p = &s["router"]["prefix_predictions"];
    println!("predictions: {p}");
    assert_eq!(
        p["exact"].as_u64().unwrap(),
        5,
        "the router's view matches the worker's account: {p}"
    );
    // All turns went to one worker.
    let r = routed(&http, &gw).await;
    assert!(r.values().any(|&n| n == 5), "{r:?}");
}

/// Waits for the process to exit; panics after `secs`.
fn wait_exit(node: &mut Proc, secs: u64) -> Duration {
    let t = Instant::now();
    loop {
        if let Ok(Some(_)) = node.child.try_wait() {
            return t.elapsed();
        }
        assert!(
            t.elapsed() < Duration::from_secs(secs),
            "still running {secs} s after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// SIGTERM on a worker: routers stop sending it requests at once, its running streams
/// finish there (not migrated), then it leaves. With a short grace period the streams still
/// running at its end move to another worker and finish. SIGTERM on a gateway: it stops
/// accepting connections and finishes the streams it has.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_workers_and_gateways_without_cutting_streams() {
    let etcd = Etcd::start();
    let http = client();
    let gw = kvmesh().gateway(&etcd, "c7", "gw", "least-loaded");
    // 100 tokens at 50 ms a step: five seconds of streaming, for w2 to join and the drain.
    let steps = ["--max-num-seqs", "16", "--sim-decode-ms", "50"];
    let mut w1 = kvmesh().worker(&etcd, "c7", "w1", &steps);
    wait_for("w1 routable", 10, async || {
        connected_workers(&http, &gw).await.len() == 1
    })
    .await;
    let spawn_streams = |n: usize, base: &str, max_tokens: u32| -> Vec<_> {
        (0..n)
            .map(|i| {
                let (http, base) = (http.clone(), base.to_string());
                let p = format!("Stream {i} of the drain test:");
                tokio::spawn(async move { stream_ids(&http, &base, &p, max_tokens).await })
            })
            .collect()
    };
    let streams = spawn_streams(4, &gw.http, 100);
    wait_for("four streams running on w1", 10, async || {
        status(&http, &w1).await["load"]["running"].as_u64() == Some(4)
    })
    .await;
    let mut w2 = kvmesh().worker(
        &etcd,
        "c7",
        "w2",
        &[&steps[..], &["--shutdown-grace", "1"]].concat(),
    );
    wait_for("w2 routable", 10, async || {
        connected_workers(&http, &gw).await.len() == 2
    })
    .await;

    assert_eq!(
        status(&http, &w1).await["load"]["running"].as_u64(),
        Some(4),
        "the streams ended before the drain: the test would prove nothing"
    );
    w1.signal("TERM");
    let seen = wait_for("the router sees w1 draining", 2, async || {
        status(&http, &gw).await["router"]["workers"]
            .as_array()
            .unwrap()
            .iter()
            .any(|w| w["node_id"] == "w1" && w["draining"] == true)
    })
    .await;
    println!("router saw the drain after {seen:?}");
    let health = http
        .get(format!("{}/health", w1.http))
        .send()
        .await
        .unwrap();
    assert_eq!(
        health.status().as_u16(),
        503,
        "a draining worker is not ready"
    );
    let before = routed(&http, &gw).await;
    for _ in 0..4 {
        let (st, body) = post(&http, &gw.http, completion(2)).await;
        assert_eq!(st, 200, "{body}");
    }
    let after = routed(&http, &gw).await;
    assert_eq!(
        after["w1"], before["w1"],
        "a draining worker got new requests"
    );
    assert_eq!(after["w2"], before["w2"] + 4);
    for t in streams {
        let (ids, error, done) = t.await.unwrap();
        assert_eq!(error, None, "a stream on the draining worker was cut");
        assert!(done && ids.len() == 100);
    }
    assert_eq!(gw.metric(&http, "kvmesh:migrations_total").await, 0.0);
    wait_exit(&mut w1, 10);
    assert!(!kvmesh()
        .cluster_status(&etcd, "c7")
        .lines()
        .any(|l| l.starts_with("w1")));

    // A grace period shorter than the streams: at its end they move to w3 and finish.
    let _w3 = kvmesh().worker(&etcd, "c7", "w3", &steps);
    wait_for("w3 routable", 10, async || {
        connected_workers(&http, &gw).await.len() == 2
    })
    .await;
    let streams = spawn_streams(2, &gw.http, 60);
    wait_for("streams running", 10, async || {
        status(&http, &w2).await["load"]["running"]
            .as_u64()
            .unwrap_or(0)
            + status(&http, &_w3).await["load"]["running"]
                .as_u64()
                .unwrap_or(0)
            == 2
    })
    .await;
    let on_w2 = status(&http, &w2).await["load"]["running"]
        .as_u64()
        .unwrap();
    assert!(on_w2 >= 1, "no stream on w2: the test would prove nothing");
    w2.signal("TERM");
    let exited = wait_exit(&mut w2, 10);
    assert!(
        exited < Duration::from_secs(4),
        "the grace period was not kept: {exited:?}"
    );
    for t in streams {
        let (ids, error, done) = t.await.unwrap();
        assert_eq!(
            error, None,
            "a stream was cut at the end of the grace period"
        );
        assert!(done && ids.len() == 60);
    }
    assert_eq!(
        gw.metric(&http, "kvmesh:migrations_total").await,
        on_w2 as f64
    );

    // The gateway: open streams finish, new connections are refused, then it exits.
    let mut gw = gw;
    let streams = spawn_streams(2, &gw.http, 40);
    wait_for("streams running on w3", 10, async || {
        status(&http, &_w3).await["load"]["running"].as_u64() == Some(2)
    })
    .await;
    gw.signal("TERM");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let fresh = reqwest::Client::new();
    assert!(
        fresh
            .get(format!("{}/health", gw.http))
            .send()
            .await
            .is_err(),
        "a gateway shutting down still accepts connections"
    );
    for t in streams {
        let (ids, error, done) = t.await.unwrap();
        assert_eq!(error, None, "the gateway cut a stream when told to stop");
        assert!(done && ids.len() == 40);
    }
    wait_exit(&mut gw, 10);
}

/// A client that leaves mid-stream cancels its sequence on the worker: the router's
/// forwarding runs inside the client's request and ends with it, and the worker sees its
/// stream stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_mid_stream_cancels_its_sequence_on_the_worker() {
    let etcd = Etcd::start();
    let http = client();
    let gw = kvmesh().gateway(&etcd, "c8", "gw", "round-robin");
    let w = kvmesh().worker(&etcd, "c8", "w1", &["--sim-decode-ms", "20"]);
    wait_for("the worker routable", 10, async || {
        connected_workers(&http, &gw).await.len() == 1
    })
    .await;
    let mut body = completion(400);
    body["stream"] = json!(true);
    let mut resp = http
        .post(format!("{}/v1/completions", gw.http))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut got = 0;
    while got < 3 {
        if resp.chunk().await.unwrap().is_some() {
            got += 1;
        }
    }
    assert_eq!(
        w.metric(&http, "kvmesh:num_requests_running").await,
        1.0,
        "the sequence runs on the worker"
    );
    drop(resp);
    wait_for("the worker's sequence cancelled", 10, async || {
        w.metric(&http, "kvmesh:num_requests_running").await == 0.0
    })
    .await;
    let generated = w.metric(&http, "kvmesh:generation_tokens_total").await;
    assert!(generated < 400.0, "generation ran on: {generated} tokens");
    assert_eq!(w.metric(&http, "kvmesh:kv_cache_usage_perc").await, 0.0);
}

/// A burst on a cluster where one worker has decoded and the others have not yet: the
/// router costs the new ones like the measured one (its step fit, their queued prompts)
/// until they stream a token, so the burst spreads instead of piling onto the one it knows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_spreads_over_workers_the_router_has_not_heard_from_yet() {
    let etcd = Etcd::start();
    let http = client();
    let gw = kvmesh().gateway(&etcd, "c9", "gw", "least-loaded");
    // Prompts cost 0.4 ms a token: a burst's first tokens come well after it is routed.
    let slow_prefill = ["--sim-prefill-us-per-token", "400"];
    let _ws: Vec<Proc> = (0..4)
        .map(|i| kvmesh().worker(&etcd, "c9", &format!("w{i}"), &slow_prefill))
        .collect();
    wait_for("four workers routable", 10, async || {
        connected_workers(&http, &gw).await.len() == 4
    })
    .await;
    // One request: one worker decodes and reports its prompt rate and step fit.
    let (st, body) = post(&http, &gw.http, completion(8)).await;
    assert_eq!(st, 200, "{body}");
    wait_for("the first worker's speeds reported", 10, async || {
        let s = status(&http, &gw).await;
        s["router"]["workers"]
            .as_array()
            .unwrap()
            .iter()
            .any(|w| w["prompt_tokens_per_s"].as_f64() > Some(0.0))
    })
    .await;
    let before = routed(&http, &gw).await;
    // 16 requests at once, each a different passage of about 150 tokens (60 ms of prefill).
    let lines: Vec<&str> = include_str!("../data/tinyshakespeare.txt")
        .lines()
        .filter(|l| l.len() > 30)
        .take(400)
        .collect();
    let reqs = (0..16).map(|i| {
        let prompt = lines[i * 20..i * 20 + 8].join(" ");
        let (http, base) = (http.clone(), gw.http.clone());
        async move {
            post(
                &http,
                &base,
                json!({"model": "shakespeare", "prompt": prompt, "max_tokens": 8,
                       "temperature": 0, "ignore_eos": true}),
            )
            .await
        }
    });
    for (st, body) in futures::future::join_all(reqs).await {
        assert_eq!(st, 200, "{body}");
    }
    let after = routed(&http, &gw).await;
    let burst: Vec<u64> = after.iter().map(|(id, n)| n - before[id]).collect();
    println!("burst split {burst:?} (before it: {before:?})");
    assert_eq!(burst.iter().sum::<u64>(), 16);
    assert!(
        burst.iter().all(|&n| (3..=5).contains(&n)),
        "the burst piled up: {burst:?}"
    );
}
