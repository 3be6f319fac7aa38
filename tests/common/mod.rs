//! What the end-to-end tests share: the `kvmesh` binary under test, started through
//! kvmesh-bench's process harness, and a `kvmesh serve` process with a client for it.

#![allow(dead_code)]

use std::time::{Duration, Instant};

use kvmesh_bench::harness::{Kvmesh, Proc};
use serde_json::Value;

/// The binary under test. KVMESH_BIN: a test binary carried to another machine runs the
/// kvmesh found there.
pub fn bin() -> String {
    std::env::var("KVMESH_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_kvmesh").into())
}

/// The binary under test, as the tests start it: every node on a 2 s lease, so that a lost
/// node leaves the registry soon; every gateway open to fault injection.
pub fn kvmesh() -> Kvmesh {
    Kvmesh::new(bin())
        .node_flags(&["--lease-ttl", "2"])
        .gateway_flags(&["--enable-fault-injection"])
}

pub struct Server {
    proc: Proc,
    pub base: String,
    pub http: reqwest::Client,
}

impl Server {
    /// Starts `kvmesh serve` on a free loopback port with extra flags.
    pub fn start(args: &[&str]) -> Server {
        let proc = kvmesh().serve(args);
        Server {
            base: proc.http.clone(),
            proc,
            http: reqwest::Client::new(),
        }
    }

    pub async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        self.post_raw(path, &body.to_string()).await
    }

    pub async fn post_raw(&self, path: &str, body: &str) -> (u16, Value) {
        let r = self
            .http
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await
            .expect("send");
        let status = r.status().as_u16();
        (status, r.json().await.expect("json body"))
    }

    /// The `data:` payloads of a streamed response, `[DONE]` included.
    pub async fn stream(&self, path: &str, body: Value) -> Vec<String> {
        let r = self
            .http
            .post(format!("{}{path}", self.base))
            .json(&body)
            .send()
            .await
            .expect("send");
        assert_eq!(r.status().as_u16(), 200);
        let text = r.text().await.expect("body");
        text.lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .map(String::from)
            .collect()
    }

    pub async fn metrics(&self) -> String {
        self.proc.metrics(&self.http).await
    }

    /// A metric's value (the first series with that name).
    pub async fn metric(&self, name: &str) -> f64 {
        let m = self.metrics().await;
        m.lines()
            .find(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("metric {name} not found in:\n{m}"))
    }

    /// Waits until `cond` holds for a metric, up to `secs`.
    pub async fn wait_metric(&self, name: &str, secs: u64, cond: impl Fn(f64) -> bool) -> f64 {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            let v = self.metric(name).await;
            if cond(v) || Instant::now() > deadline {
                return v;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Joins the text of streamed chunks (chat deltas or completion text).
pub fn streamed_text(events: &[String]) -> String {
    let mut out = String::new();
    for e in events {
        if e == "[DONE]" {
            continue;
        }
        let v: Value = serde_json::from_str(e).expect("chunk json");
        for c in v["choices"].as_array().expect("choices") {
            if let Some(t) = c["delta"]["content"].as_str() {
                out.push_str(t);
            }
            if let Some(t) = c["text"].as_str() {
                out.push_str(t);
            }
        }
    }
    out
}

pub fn text_of(v: &Value) -> String {
    let c = &v["choices"][0];
    c["message"]["content"]
        .as_str()
        .or(c["text"].as_str())
        .expect("text")
        .to_string()
}

/// A model folder seen through another config.json: a temporary folder with links to every
/// file of `dir` but its config, and `config` in its place. Removed on drop.
pub struct ModelWithConfig {
    pub path: std::path::PathBuf,
}

impl ModelWithConfig {
    pub fn new(dir: &std::path::Path, config: &std::path::Path) -> ModelWithConfig {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let name = dir.file_name().expect("folder name").to_string_lossy();
        let path = std::env::temp_dir().join(format!(
            "kvmesh-test-{}-{}/{name}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&path).expect("create temp model folder");
        for e in std::fs::read_dir(dir).expect("read model folder") {
            let e = e.expect("entry");
            if e.file_name() != "config.json" {
                let src = std::fs::canonicalize(e.path()).expect("canonical path");
                std::os::unix::fs::symlink(src, path.join(e.file_name())).expect("link");
            }
        }
        std::fs::copy(config, path.join("config.json")).expect("copy config");
        ModelWithConfig { path }
    }
}

impl Drop for ModelWithConfig {
    fn drop(&mut self) {
        if let Some(parent) = self.path.parent() {
            let _ = std::fs::remove_dir_all(parent);
        }
    }
}

pub mod reference;
