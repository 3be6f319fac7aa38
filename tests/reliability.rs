//! What strangers and unlucky peers do to a node's open ports: real etcd, real `kvmesh node`
//! processes on loopback.
//!
//! - A decode node's KV listener (`--kv-transport tcp`) is reachable by anyone on the
//!   network: connections that declare a huge hello, or send nothing, commit no memory, are
//!   closed fast, and beyond a bound are closed as they arrive.

mod common;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::kvmesh;
use kvmesh_bench::harness::abuse::{
    free_port, frozen_prefill_peer, kv_listener_node, kv_listener_strangers,
};
use kvmesh_bench::harness::{client, status, wait_for, wait_ready, Proc, Ready};
use kvmesh_discovery::testing::Etcd;
use kvmesh_transport::{AllowList, NodeEndpoint, NodeIdentity};
use serde_json::{json, Value};

async fn healthy(node: &Proc) -> bool {
    let http = client();
    matches!(
        http.get(format!("{}/health", node.http)).send().await,
        Ok(r) if r.status().is_success()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kv_listener_commits_nothing_to_strangers() {
    let etcd = Etcd::start();
    let kv = format!("127.0.0.1:{}", free_port());
    let node = kv_listener_node(&kvmesh(), &etcd, "kv-strangers", &kv);
    let r = tokio::task::block_in_place(|| kv_listener_strangers(&node, &kv));
    println!("{r:?}");
    for (n, during, closed) in &r.rounds {
        assert!(
            *during < r.rss_before_mib + 32.0,
            "{n} hostile hellos grew the node from {:.1} to {during:.1} MiB",
            r.rss_before_mib
        );
        assert_eq!(closed, n, "hostile connections still open after 3 s");
    }
    // The 16 over the bound of 64 waiting for a hello are closed as they arrive; the rest
    // when their 2 s run out.
    assert!(
        (16..=20).contains(&r.silent_closed_at_once),
        "{} of 80 silent connections were closed at once",
        r.silent_closed_at_once
    );
    assert_eq!(r.silent_closed, r.silent, "silent connections still open");
    assert!(
        r.silent_all_closed_s < 5.0,
        "closing took {:.1} s",
        r.silent_all_closed_s
    );
    assert!(healthy(&node).await, "the node stopped answering");
    assert!(
        r.rss_after_mib < r.rss_before_mib + 32.0,
        "{:.1} -> {:.1} MiB",
        r.rss_before_mib,
        r.rss_after_mib
    );
}

/// One hung prefill peer must not stall the decode node's other remote prefills.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_hung_prefill_peer_stalls_only_its_own_requests() {
    let etcd = Etcd::start();
    let r = frozen_prefill_peer(&kvmesh(), &etcd, "hung-prefill", &client()).await;
    let mut times: Vec<Duration> = r.finished.iter().map(|f| f.1).collect();
    times.sort();
    println!("completion times with one prefill peer frozen: {times:?}");
    println!(
        "decode node: {} remote prefills, {} fallbacks",
        r.remote, r.fallbacks
    );
    assert!(r.finished.iter().all(|f| f.0 == 200), "{:?}", r.finished);
    assert!(r.fallbacks >= 1.0, "no request was sent to the frozen peer");
    // Those the router sent to the healthy prefill node did not wait for the frozen one's
    // handshake: one dial at a time held every remote prefill behind it.
    let quick = times
        .iter()
        .filter(|t| **t < Duration::from_secs(2))
        .count();
    assert!(
        quick as f64 >= r.remote.min(8.0) && quick >= 4,
        "{quick} of 16 finished within 2 s though {} were prefilled remotely: {times:?}",
        r.remote
    );
}

/// A node's QUIC port refuses outsiders; a flood of foreign handshakes leaves a log line
/// every few seconds, naming the address, not a line each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_handshakes_are_logged_with_the_address_and_rate_limited() {
    let etcd = Etcd::start();
    let mut child = kvmesh()
        .command()
        .args(["node", "--etcd", &etcd.url(), "--cluster", "outsiders"])
        .args(["--node-id", "w1", "--roles", "worker", "--backend", "sim"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let log = Arc::new(Mutex::new(String::new()));
    {
        let (log, stderr) = (log.clone(), child.stderr.take().unwrap());
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let mut l = log.lock().unwrap();
                l.push_str(&line);
                l.push('\n');
            }
        });
    }
    let http = wait_ready(&mut child, Ready::Node, "w1");
    let node = Proc { child, http };
    let quic: SocketAddr = status(&client(), &node).await["quic_addr"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    let outsider = NodeEndpoint::bind(
        "127.0.0.1:0".parse().unwrap(),
        NodeIdentity::generate("outsider").unwrap(),
        AllowList::default(),
    )
    .unwrap();
    for _ in 0..100 {
        let _ = outsider.connect(quic, &"0".repeat(64)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    drop(node);
    let log = log.lock().unwrap().clone();
    let refusals: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("refused a QUIC connection"))
        .collect();
    assert!(!refusals.is_empty(), "no refusal logged:\n{log}");
    assert!(
        refusals.len() <= 3,
        "{} refusal lines for 100 handshakes:\n{}",
        refusals.len(),
        refusals.join("\n")
    );
    assert!(
        refusals.iter().all(|l| l.contains("127.0.0.1:")),
        "{refusals:?}"
    );
}

/// SIGTERM with a stream that outlives the grace period: the stream ends with an error
/// event saying so, not with a bare close.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_cut_by_the_end_of_the_grace_period_is_told_so() {
    use futures::StreamExt;
    let server = kvmesh().serve(&[
        "--backend",
        "sim",
        "--sim-decode-ms",
        "100",
        "--shutdown-grace",
        "1",
    ]);
    // 20 s of tokens: far past the 1 s grace period.
    let body = json!({"prompt": "To be", "max_tokens": 200, "ignore_eos": true, "stream": true});
    let resp = client()
        .post(format!("{}/v1/completions", server.http))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let mut bytes = resp.bytes_stream();
    let mut text = String::new();
    // A few tokens in, then SIGTERM.
    while text.matches("data: ").count() < 3 {
        let chunk = tokio::time::timeout(Duration::from_secs(10), bytes.next())
            .await
            .expect("tokens")
            .expect("the stream is open")
            .unwrap();
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    server.signal("TERM");
    let t = Instant::now();
    while let Ok(Some(Ok(chunk))) =
        tokio::time::timeout(Duration::from_secs(10), bytes.next()).await
    {
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    let events: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(events.last(), Some(&"[DONE]"), "{text}");
    let error: Value = serde_json::from_str(events[events.len() - 2]).unwrap();
    assert_eq!(error["error"]["code"], "server_shutting_down", "{error}");
    assert_eq!(error["error"]["type"], "service_unavailable", "{error}");
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "cut after {:?}",
        t.elapsed()
    );
}

/// A stream's data events, each with when it arrived (seconds from `start`).
async fn timed_stream(
    http: reqwest::Client,
    url: String,
    body: Value,
    start: Instant,
) -> Vec<(f64, String)> {
    use futures::StreamExt;
    let resp = http.post(url).json(&body).send().await.unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let mut bytes = resp.bytes_stream();
    let (mut buf, mut out) = (String::new(), Vec::new());
    while let Ok(Some(Ok(chunk))) =
        tokio::time::timeout(Duration::from_secs(30), bytes.next()).await
    {
        buf.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            if let Some(data) = event.trim().strip_prefix("data: ") {
                out.push((start.elapsed().as_secs_f64(), data.to_string()));
            }
        }
    }
    out
}

/// Eight streams, one of their workers SIGKILLed: the router hears nothing from it for
/// 0.7 s, closes its connection, and the streams move; none pauses much over a second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_stalls_no_stream_for_more_than_a_second() {
    let etcd = Etcd::start();
    let http = client();
    let cluster = "killed-worker";
    let flags = ["--sim-decode-ms", "20"];
    let mut w1 = kvmesh().worker(&etcd, cluster, "w1", &flags);
    let _w2 = kvmesh().worker(&etcd, cluster, "w2", &flags);
    let gw = kvmesh().gateway(&etcd, cluster, "gw", "round-robin");
    wait_for("both workers routable", 20, async || {
        gw.try_metric(&http, "kvmesh:router_workers_routable").await == Some(2.0)
    })
    .await;
    let start = Instant::now();
    let streams: Vec<_> = (0..8)
        .map(|i| {
            let body = json!({"prompt": format!("stream {i}"), "max_tokens": 150,
                              "temperature": 0, "ignore_eos": true, "stream": true});
            tokio::spawn(timed_stream(
                http.clone(),
                format!("{}/v1/completions", gw.http),
                body,
                start,
            ))
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let killed_at = start.elapsed().as_secs_f64();
    w1.kill();
    let mut worst: f64 = 0.0;
    for (i, s) in streams.into_iter().enumerate() {
        let events = s.await.unwrap();
        assert_eq!(
            events.last().map(|e| e.1.as_str()),
            Some("[DONE]"),
            "stream {i}: {events:?}"
        );
        assert!(
            !events.iter().any(|e| e.1.contains("\"error\"")),
            "stream {i} ended in error: {events:?}"
        );
        let gap = events
            .windows(2)
            .filter(|w| w[1].0 > killed_at)
            .map(|w| w[1].0 - w[0].0)
            .fold(0.0, f64::max);
        worst = worst.max(gap);
    }
    println!("largest pause of 8 streams across a SIGKILL: {worst:.3} s");
    assert!(
        worst < 1.3,
        "a stream paused {worst:.3} s across the worker's death"
    );
}
