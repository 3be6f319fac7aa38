//! Asking `kvmesh` processes over HTTP: completions, streamed events, `/status`, and waiting
//! for a condition to hold.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde_json::Value;

use super::Proc;

/// An HTTP client whose requests give up after a minute.
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap()
}

/// An HTTP client for load: many idle connections kept per host.
pub fn load_client(timeout: Duration) -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(512)
        .timeout(timeout)
        .build()
        .unwrap()
}

/// Sends a completion request to `base`; panics when nothing answers.
async fn send_completion(http: &reqwest::Client, base: &str, body: Value) -> reqwest::Response {
    http.post(format!("{base}/v1/completions"))
        .json(&body)
        .send()
        .await
        .expect("gateway reachable")
}

/// POSTs a completion request to `base`: the status and the JSON body (Null if none).
pub async fn post(http: &reqwest::Client, base: &str, body: Value) -> (u16, Value) {
    let r = send_completion(http, base, body).await;
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// A process's `/status`.
pub async fn status(http: &reqwest::Client, p: &Proc) -> Value {
    get_json(http, p, "/status").await
}

/// A JSON page of a process, e.g. `/status?workers=0`.
pub async fn get_json(http: &reqwest::Client, p: &Proc, path: &str) -> Value {
    http.get(format!("{}{path}", p.http))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// Polls `cond` every 50 ms until it holds, and returns how long that took; panics, naming
/// `what`, after `secs` seconds.
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

/// Waits (20 s at most) until the gateway's router is connected to `n` nodes of any worker
/// role.
pub async fn wait_workers(http: &reqwest::Client, gw: &Proc, n: usize) {
    let t = Instant::now();
    loop {
        let up = status(http, gw).await["router"]["workers_summary"]["connected"]
            .as_u64()
            .unwrap_or(0) as usize;
        if up >= n {
            return;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "workers did not connect"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// How many requests the gateway's router sent to each worker.
pub async fn routed(http: &reqwest::Client, gw: &Proc) -> BTreeMap<String, u64> {
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

/// The workers the gateway's router is connected to.
pub async fn connected_workers(http: &reqwest::Client, gw: &Proc) -> Vec<String> {
    let s = status(http, gw).await;
    s["router"]["workers"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|w| w["connected"].as_bool() == Some(true))
        .map(|w| w["node_id"].as_str().unwrap().to_string())
        .collect()
}

/// A streamed completion's chunks, the error event's message if one came (or the HTTP
/// error), and whether `[DONE]` ended it.
pub async fn sse(
    http: &reqwest::Client,
    base: &str,
    body: Value,
) -> (Vec<Value>, Option<String>, bool) {
    let r = send_completion(http, base, body).await;
    if r.status().as_u16() != 200 {
        let s = r.status();
        let text = r.text().await.unwrap_or_default();
        return (Vec::new(), Some(format!("HTTP {s}: {text}")), false);
    }
    let (mut chunks, mut error, mut done) = (Vec::new(), None, false);
    let mut events = Events::new(r);
    while let Some(data) = events.next().await {
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let v: Value = serde_json::from_str(&data).unwrap_or(Value::Null);
        match v.get("error") {
            Some(e) => error = Some(e["message"].as_str().unwrap_or("").to_string()),
            None => chunks.push(v),
        }
    }
    (chunks, error, done)
}

/// The `data:` payloads of a server-sent event stream, each as soon as its chunk arrives.
pub struct Events {
    response: reqwest::Response,
    buf: String,
}

impl Events {
    pub fn new(response: reqwest::Response) -> Events {
        Events {
            response,
            buf: String::new(),
        }
    }

    /// The next event's payload; `None` once the stream ends or breaks.
    pub async fn next(&mut self) -> Option<String> {
        loop {
            if let Some(i) = self.buf.find("\n\n") {
                let event: String = self.buf.drain(..i + 2).collect();
                return Some(event.trim().trim_start_matches("data: ").to_string());
            }
            match self.response.chunk().await {
                Ok(Some(chunk)) => self.buf.push_str(&String::from_utf8_lossy(&chunk)),
                _ => return None,
            }
        }
    }
}
