//! Clusters of real `kvmesh node` processes around a real etcd, for end-to-end tests.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvmesh_discovery::testing::Etcd;
use serde_json::Value;

pub fn bin() -> String {
    std::env::var("KVMESH_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_kvmesh").into())
}

/// A `kvmesh node` process; killed on drop.
pub struct Node {
    pub child: Child,
    pub http: String,
}

impl Node {
    pub fn start(etcd: &Etcd, cluster: &str, id: &str, args: &[&str]) -> Node {
        let mut child = Command::new(bin())
            .args([
                "node",
                "--etcd",
                &etcd.url(),
                "--cluster",
                cluster,
                "--node-id",
                id,
            ])
            .args(["--lease-ttl", "2"])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start kvmesh node");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(rest) = line.split(" ready: ").nth(1) {
                    let http = rest.split(" http ").nth(1).unwrap_or("").to_string();
                    let _ = tx.send(http);
                }
            }
        });
        let http = rx
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|_| {
                let _ = child.kill();
                panic!("node {id} did not become ready");
            });
        Node { child, http }
    }

    pub fn worker(etcd: &Etcd, cluster: &str, id: &str, extra: &[&str]) -> Node {
        let mut args = vec!["--roles", "worker", "--backend", "sim"];
        args.extend_from_slice(extra);
        Node::start(etcd, cluster, id, &args)
    }

    pub fn gateway(etcd: &Etcd, cluster: &str, id: &str, policy: &str) -> Node {
        Node::start(
            etcd,
            cluster,
            id,
            &[
                "--roles",
                "gateway,router",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--policy",
                policy,
                "--enable-fault-injection",
            ],
        )
    }

    /// Sends a signal (STOP, CONT, TERM, KILL) to the process.
    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([&format!("-{sig}"), &self.child.id().to_string()])
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        assert!(ok, "kill -{sig} failed");
    }

    /// A metric's value on this node's /metrics: the series whose name and labels start
    /// with `series` (e.g. `kvmesh:kv_cache_usage_perc{` or a full `name{labels}`).
    pub async fn metric(&self, http: &reqwest::Client, series: &str) -> f64 {
        let text = http
            .get(format!("{}/metrics", self.http))
            .send()
            .await
            .expect("metrics")
            .text()
            .await
            .expect("metrics text");
        text.lines()
            .find(|l| l.starts_with(series))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {series} in:\n{text}"))
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn terminate(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let _ = self.child.wait();
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.kill();
    }
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap()
}

pub async fn post(http: &reqwest::Client, base: &str, body: Value) -> (u16, Value) {
    let r = http
        .post(format!("{base}/v1/completions"))
        .json(&body)
        .send()
        .await
        .expect("gateway reachable");
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

pub async fn status(http: &reqwest::Client, node: &Node) -> Value {
    http.get(format!("{}/status", node.http))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

pub async fn wait_for(what: &str, secs: u64, mut cond: impl AsyncFnMut() -> bool) -> Duration {
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(secs) {
        if cond().await {
            return t.elapsed();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{what}: not within {secs} s");
}

pub fn cluster_status(etcd: &Etcd, cluster: &str) -> String {
    let out = Command::new(bin())
        .args([
            "cluster",
            "status",
            "--etcd",
            &etcd.url(),
            "--cluster",
            cluster,
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// A streamed completion's chunks, the error event's message if one came (or the HTTP
/// error), and whether `[DONE]` ended it.
pub async fn sse(
    http: &reqwest::Client,
    base: &str,
    body: Value,
) -> (Vec<Value>, Option<String>, bool) {
    let mut r = http
        .post(format!("{base}/v1/completions"))
        .json(&body)
        .send()
        .await
        .expect("gateway reachable");
    if r.status().as_u16() != 200 {
        let s = r.status();
        let text = r.text().await.unwrap_or_default();
        return (Vec::new(), Some(format!("HTTP {s}: {text}")), false);
    }
    let (mut chunks, mut error, mut done) = (Vec::new(), None, false);
    let mut buf = String::new();
    while let Ok(Some(chunk)) = r.chunk().await {
        buf.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(i) = buf.find("\n\n") {
            let event: String = buf.drain(..i + 2).collect();
            let data = event.trim().trim_start_matches("data: ");
            if data == "[DONE]" {
                done = true;
                continue;
            }
            let v: Value = serde_json::from_str(data).unwrap_or(Value::Null);
            match v.get("error") {
                Some(e) => error = Some(e["message"].as_str().unwrap_or("").to_string()),
                None => chunks.push(v),
            }
        }
    }
    (chunks, error, done)
}

/// How many requests the gateway's router sent to each worker.
pub async fn routed(http: &reqwest::Client, gw: &Node) -> std::collections::BTreeMap<String, u64> {
    let s = status(http, gw).await;
    s["router"]["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| {
            (
                w["node_id"].as_str().unwrap().to_string(),
                w["routed"].as_u64().unwrap(),
            )
        })
        .collect()
}

pub async fn connected_workers(http: &reqwest::Client, gw: &Node) -> Vec<String> {
    let s = status(http, gw).await;
    s["router"]["workers"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|w| w["connected"].as_bool() == Some(true))
        .map(|w| w["node_id"].as_str().unwrap().to_string())
        .collect()
}
