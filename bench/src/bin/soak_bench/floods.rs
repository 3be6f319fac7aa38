//! Floods against one `kvmesh serve` (the embedded model on the `sim` backend, which still
//! compiles every `response_format` grammar over the model's vocabulary): distinct JSON
//! schemas, requests offering 300 tools, 1 MB model names, pipelining clients that read a
//! trickle, and 3 MB bodies. Each phase runs beside normal requests and a `/health` poll,
//! and the server's memory is sampled through it; a quiet row, with no flood, comes first.
//!
//! Bounded: a fixed number of flood requests per phase, no new one started after
//! [`FLOOD_DEADLINE`], slow readers given up after [`SLOW_READ_LIMIT`]; loopback only.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvmesh_bench::harness::abuse::rss_mib;
use kvmesh_bench::harness::load::{pct, run_load, shakespeare_lines, Sample};
use kvmesh_bench::harness::{load_client, Kvmesh, Proc};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::task::JoinHandle;

/// A phase's flood starts no request after this long.
const FLOOD_DEADLINE: Duration = Duration::from_secs(120);
/// A slow reader gives up after this long.
const SLOW_READ_LIMIT: Duration = Duration::from_secs(30);
/// Normal requests per phase, their output tokens and concurrency.
const NORMAL_REQUESTS: usize = 80;
const NORMAL_TOKENS: u32 = 16;
const NORMAL_CONCURRENCY: usize = 4;
/// Requests each slow reader pipelines: their answers (~370 B each, ~14 MB in all) are more
/// than loopback's socket buffers hold (the server's send buffer grows to 4 MiB), so the
/// server's writes wait on the reader and `--http-send-timeout` applies.
const SLOW_READER_REQUESTS: usize = 40_000;
/// Slow readers at once.
/// Distinct schemas sent: past the compiled-grammar cache's budget (256 MiB, ~220 KiB each),
/// so that memory is seen to level off.
const DISTINCT_SCHEMAS: usize = 3_000;
const SLOW_READERS: usize = 4;

/// One flood request's outcome.
struct Outcome {
    /// 0: no answer.
    status: u16,
    ms: f64,
    /// The answer's body, in bytes.
    bytes: usize,
    /// The error's message when it was not a success (its first 200 characters).
    error: Option<String>,
}

/// Builds a flood's request number `i`.
type MakeRequest = Arc<dyn Fn(&reqwest::Client, usize) -> reqwest::RequestBuilder + Send + Sync>;

/// What a flood reports: its figures, and a line for the table.
type FloodReport = (Value, String);

/// The flood phases against one `kvmesh serve`; prints their table and returns its rows.
pub async fn run(km: &Kvmesh) -> Value {
    let server = km.serve(&[
        // A checkpoint whose chat template does not put tools into the prompt, so that 300
        // tools fit its 512-token context and reach the grammar compiler (the embedded
        // model's template lists every tool); served under the name the load generator
        // asks for. `--tool-call-parser` makes tool_choice "auto" usable on it.
        "--model",
        "tests/fixtures/models/tiny-llama",
        "--served-model-name",
        "shakespeare",
        "--backend",
        "sim",
        "--http-send-timeout",
        "2",
        "--tool-call-parser",
        "hermes",
    ]);
    let http = load_client(Duration::from_secs(60));
    let base = server.http.clone();
    let addr = base.trim_start_matches("http://").to_string();
    warm_up(&http, &base).await;
    let lines = shakespeare_lines();
    let prompts = |phase: usize| -> Vec<String> {
        (0..NORMAL_REQUESTS)
            .map(|i| lines[(i + phase * NORMAL_REQUESTS) % lines.len()].clone())
            .collect()
    };
    let quiet = async { (json!({}), "(no flood)".to_string()) };
    let rows = vec![
        measure(&server, &http, "quiet", prompts(0), quiet).await,
        measure(
            &server,
            &http,
            "distinct schemas",
            prompts(1),
            distinct_schemas(&http, &base),
        )
        .await,
        measure(
            &server,
            &http,
            "tools flood",
            prompts(2),
            tools_flood(&http, &base),
        )
        .await,
        measure(
            &server,
            &http,
            "huge model names",
            prompts(3),
            huge_model_names(&http, &base),
        )
        .await,
        measure(
            &server,
            &http,
            "slow readers",
            prompts(4),
            slow_readers(addr),
        )
        .await,
        measure(
            &server,
            &http,
            "oversized bodies",
            prompts(5),
            oversized_bodies(&http, &base),
        )
        .await,
    ];
    print_table(&rows);
    json!(rows)
}

/// A few normal requests and one constrained one, so that the model's grammar machinery
/// (built on first use) is in the memory measured before the first flood.
async fn warm_up(http: &reqwest::Client, base: &str) {
    let _ = run_load(http, base, vec!["Warm up, good sir.".into(); 8], 16, 4).await;
    let body = json!({"model": "shakespeare", "max_tokens": 8,
        "messages": [{"role": "user", "content": "Warm up."}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {
            "type": "object", "properties": {"w": {"type": "string", "maxLength": 8}}}}}});
    let r = http
        .post(format!("{base}/v1/chat/completions"))
        .json(&body)
        .send()
        .await;
    assert!(
        r.is_ok_and(|r| r.status().is_success()),
        "a constrained warm-up request failed"
    );
}

/// Runs `flood` beside [`NORMAL_REQUESTS`] normal requests and a `/health` poll every
/// 100 ms, sampling the server's memory every 200 ms, until both have finished.
async fn measure<F>(
    server: &Proc,
    http: &reqwest::Client,
    name: &str,
    prompts: Vec<String>,
    flood: F,
) -> Value
where
    F: Future<Output = FloodReport> + Send + 'static,
{
    let base = server.http.clone();
    let rss_before = rss_mib(server);
    let t0 = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let health = tokio::spawn(poll_health(base.clone(), stop.clone(), t0));
    let flood = tokio::spawn(async move {
        let t = Instant::now();
        let r = flood.await;
        (r, t.elapsed().as_secs_f64())
    });
    let load = {
        let (http, base) = (http.clone(), base.clone());
        tokio::spawn(async move {
            run_load(&http, &base, prompts, NORMAL_TOKENS, NORMAL_CONCURRENCY).await
        })
    };
    let both = async { (flood.await.unwrap(), load.await.unwrap()) };
    tokio::pin!(both);
    // The memory every 200 ms: (seconds into the phase, MiB).
    let mut rss = Vec::new();
    let (((details, mut got), flood_s), (samples, load_wall)) = loop {
        tokio::select! {
            r = &mut both => break r,
            _ = tokio::time::sleep(Duration::from_millis(200)) => {
                rss.push((t0.elapsed().as_secs_f64(), rss_mib(server)));
            }
        }
    };
    stop.store(true, Ordering::Relaxed);
    let (polls, health_failed) = health.await.unwrap();
    let rss_after = rss_mib(server);
    let peak = rss
        .iter()
        .map(|r| r.1)
        .fold(rss_before.max(rss_after), f64::max);
    let ok: Vec<f64> = samples
        .iter()
        .filter(|s| s.ok)
        .map(|s| s.e2e * 1e3)
        .collect();
    let health_ms: Vec<f64> = polls.iter().map(|p| p.1).collect();
    let (beside, beside_text) = beside_flood(&samples, &polls, flood_s);
    let no_flood = details.as_object().is_some_and(|o| o.is_empty());
    if !no_flood {
        got = format!("{got}; {beside_text}");
    }
    let row = json!({
        "phase": name,
        "normal": {
            "requests": samples.len(), "failed": samples.len() - ok.len(), "wall_s": load_wall,
            "p50_ms": pct(&ok, 50.0), "p99_ms": pct(&ok, 99.0),
        },
        "health": {
            "answered": health_ms.len(), "failed": health_failed,
            "p50_ms": pct(&health_ms, 50.0), "p99_ms": pct(&health_ms, 99.0),
            "max_ms": health_ms.iter().copied().fold(f64::NAN, f64::max),
        },
        "rss_mib": {"before": rss_before, "peak": peak, "after": rss_after},
        "rss_series_mib": rss.iter()
            .map(|(t, m)| json!([(t * 10.0).round() / 10.0, (m * 10.0).round() / 10.0]))
            .collect::<Vec<_>>(),
        "flood_s": flood_s,
        "beside_flood": beside,
        "flood": details,
        "got": got,
    });
    eprintln!("soak floods: {name} done in {flood_s:.1} s: {got}");
    row
}

/// The normal requests sent and the health polls made while the flood ran (its first
/// `flood_s` seconds): how many, and their latency.
fn beside_flood(samples: &[Sample], polls: &[(f64, f64)], flood_s: f64) -> (Value, String) {
    let normal: Vec<f64> = samples
        .iter()
        .filter(|s| s.ok && s.sent_at < flood_s)
        .map(|s| s.e2e * 1e3)
        .collect();
    let health: Vec<f64> = polls
        .iter()
        .filter(|p| p.0 < flood_s)
        .map(|p| p.1)
        .collect();
    let health_max = health.iter().copied().fold(f64::NAN, f64::max);
    let text = format!(
        "beside the flood: {} normal requests (p99 {:.0} ms), {} health polls (max {:.1} ms)",
        normal.len(),
        pct(&normal, 99.0),
        health.len(),
        health_max
    );
    let value = json!({
        "normal_requests": normal.len(), "normal_p50_ms": pct(&normal, 50.0),
        "normal_p99_ms": pct(&normal, 99.0),
        "health_polls": health.len(), "health_p99_ms": pct(&health, 99.0),
        "health_max_ms": health_max,
    });
    (value, text)
}

/// `GET /health` every 100 ms until `stop`: each answered poll's start (seconds from
/// `t0`) and milliseconds, and how many got no 200.
async fn poll_health(base: String, stop: Arc<AtomicBool>, t0: Instant) -> (Vec<(f64, f64)>, usize) {
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let (mut ms, mut failed) = (Vec::new(), 0);
    while !stop.load(Ordering::Relaxed) {
        tick.tick().await;
        let t = Instant::now();
        let answered = match http.get(format!("{base}/health")).send().await {
            Ok(r) => r.status().is_success() && r.bytes().await.is_ok(),
            Err(_) => false,
        };
        if answered {
            let start = t.duration_since(t0).as_secs_f64();
            ms.push((start, t.elapsed().as_secs_f64() * 1e3));
        } else {
            failed += 1;
        }
    }
    (ms, failed)
}

/// `n` requests made by `make`, from `clients` concurrent clients each taking the next
/// number; none is started after [`FLOOD_DEADLINE`].
async fn flood_requests(
    http: &reqwest::Client,
    n: usize,
    clients: usize,
    make: MakeRequest,
) -> Vec<Outcome> {
    let next = Arc::new(AtomicUsize::new(0));
    let deadline = Instant::now() + FLOOD_DEADLINE;
    let tasks: Vec<JoinHandle<Vec<Outcome>>> = (0..clients)
        .map(|_| {
            let (http, next, make) = (http.clone(), next.clone(), make.clone());
            tokio::spawn(async move {
                let mut out = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= n || Instant::now() >= deadline {
                        return out;
                    }
                    let t = Instant::now();
                    let (status, body) = match make(&http, i).send().await {
                        Ok(r) => (r.status().as_u16(), r.bytes().await.unwrap_or_default()),
                        Err(_) => (0, Default::default()),
                    };
                    let error = (!(200..300).contains(&status)).then(|| {
                        let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                        let m = v["error"]["message"].as_str().unwrap_or("(no message)");
                        m.chars().take(200).collect()
                    });
                    out.push(Outcome {
                        status,
                        ms: t.elapsed().as_secs_f64() * 1e3,
                        bytes: body.len(),
                        error,
                    });
                }
            })
        })
        .collect();
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    all
}

/// How many outcomes had each of the `named` statuses, any other status, or no answer.
fn status_counts(outcomes: &[Outcome], named: &[u16]) -> BTreeMap<String, usize> {
    let mut counts: BTreeMap<String, usize> = named.iter().map(|s| (s.to_string(), 0)).collect();
    for o in outcomes {
        let key = match &o.status {
            0 => "no_answer".to_string(),
            s if named.contains(s) => s.to_string(),
            _ => "other".to_string(),
        };
        *counts.entry(key).or_default() += 1;
    }
    counts
}

/// `200×580 400×20`: the counts that are not zero.
fn counts_text(counts: &BTreeMap<String, usize>) -> String {
    counts
        .iter()
        .filter(|(_, n)| **n > 0)
        .map(|(s, n)| format!("{s}×{n}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// A flood's statuses, latency and first error message of each status as JSON, and its
/// table line's start.
fn outcome_summary(outcomes: &[Outcome], named: &[u16]) -> (Value, String) {
    let counts = status_counts(outcomes, named);
    let ms: Vec<f64> = outcomes.iter().map(|o| o.ms).collect();
    let mut errors = BTreeMap::new();
    for o in outcomes {
        if let Some(e) = &o.error {
            errors
                .entry(o.status.to_string())
                .or_insert_with(|| e.clone());
        }
    }
    let text = format!(
        "{} sent: {}; p50 {:.0} ms, max {:.0} ms",
        outcomes.len(),
        counts_text(&counts),
        pct(&ms, 50.0),
        ms.iter().copied().fold(f64::NAN, f64::max)
    );
    let value = json!({
        "sent": outcomes.len(),
        "statuses": counts,
        "p50_ms": pct(&ms, 50.0),
        "p99_ms": pct(&ms, 99.0),
        "max_ms": ms.iter().copied().fold(f64::NAN, f64::max),
        "first_error_by_status": errors,
    });
    (value, text)
}

/// [`DISTINCT_SCHEMAS`] chat requests from 16 clients, each with a JSON schema of its own
/// (30 string properties of its own names): as many grammars to compile, and the
/// compiled-grammar cache (bounded in bytes) filling past its budget.
fn distinct_schemas(
    http: &reqwest::Client,
    base: &str,
) -> impl Future<Output = FloodReport> + Send + 'static {
    let (http, url) = (http.clone(), format!("{base}/v1/chat/completions"));
    let make: MakeRequest = Arc::new(move |http: &reqwest::Client, i: usize| {
        let props: serde_json::Map<String, Value> = (0..30)
            .map(|j| {
                (
                    format!("p{i}_{j}"),
                    json!({"type": "string", "maxLength": 8}),
                )
            })
            .collect();
        http.post(&url).json(&json!({
            "model": "shakespeare", "max_tokens": 8,
            "messages": [{"role": "user", "content": "Describe the stage."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "s",
                "schema": {"type": "object", "properties": props}}},
        }))
    });
    async move {
        let out = flood_requests(&http, DISTINCT_SCHEMAS, 16, make).await;
        outcome_summary(&out, &[200, 400, 429])
    }
}

/// 40 chat requests from 8 clients, each offering 300 tools of their own (names and small
/// parameter schemas), with tool_choice "auto".
fn tools_flood(
    http: &reqwest::Client,
    base: &str,
) -> impl Future<Output = FloodReport> + Send + 'static {
    let (http, url) = (http.clone(), format!("{base}/v1/chat/completions"));
    let make: MakeRequest = Arc::new(move |http: &reqwest::Client, i: usize| {
        let tools: Vec<Value> = (0..300)
            .map(|k| {
                json!({"type": "function", "function": {
                    "name": format!("fn_{i}_{k}"),
                    "description": format!("Tool {k} of request {i}."),
                    "parameters": {"type": "object",
                        "properties": {
                            format!("arg_{k}"): {"type": "string", "maxLength": 12},
                            "count": {"type": "integer", "minimum": 0, "maximum": k + 1},
                        },
                        "required": [format!("arg_{k}")]}}})
            })
            .collect();
        http.post(&url).json(&json!({
            "model": "shakespeare", "max_tokens": 8, "tools": tools, "tool_choice": "auto",
            "messages": [{"role": "user", "content": "Call whichever tool you like."}],
        }))
    });
    async move {
        let out = flood_requests(&http, 40, 8, make).await;
        outcome_summary(&out, &[200, 400, 429])
    }
}

/// 400 chat requests from 16 clients naming a model of 1 MB (each its own); then the size
/// of the recent-requests page and of /metrics, where such a name could be kept.
fn huge_model_names(
    http: &reqwest::Client,
    base: &str,
) -> impl Future<Output = FloodReport> + Send + 'static {
    let (http, base) = (http.clone(), base.to_string());
    let url = format!("{base}/v1/chat/completions");
    let filler = Arc::new("m".repeat(1 << 20));
    let make: MakeRequest = Arc::new(move |http: &reqwest::Client, i: usize| {
        let body = format!(
            r#"{{"model":"{i}-{filler}","max_tokens":4,"messages":[{{"role":"user","content":"Hello."}}]}}"#
        );
        http.post(&url)
            .header("content-type", "application/json")
            .body(body)
    });
    async move {
        let metrics_before = page_bytes(&http, &format!("{base}/metrics")).await;
        let out = flood_requests(&http, 400, 16, make).await;
        let (mut value, text) = outcome_summary(&out, &[404, 400, 413]);
        let largest = out
            .iter()
            .filter(|o| o.status != 200)
            .map(|o| o.bytes)
            .max()
            .unwrap_or(0);
        let recent = page_bytes(&http, &format!("{base}/traces/api/recent")).await;
        let metrics_after = page_bytes(&http, &format!("{base}/metrics")).await;
        value["largest_error_body_bytes"] = json!(largest);
        value["traces_recent_bytes"] = json!(recent);
        value["metrics_bytes"] = json!({"before": metrics_before, "after": metrics_after});
        let text = format!(
            "{text}; largest error body {largest} B; /traces/api/recent {recent} B; \
             /metrics {metrics_before} → {metrics_after} B"
        );
        (value, text)
    }
}

/// The size of the page at `url` in bytes (0 when it does not answer).
async fn page_bytes(http: &reqwest::Client, url: &str) -> usize {
    match http.get(url).send().await {
        Ok(r) => r.bytes().await.map_or(0, |b| b.len()),
        Err(_) => 0,
    }
}

/// What one slow reader met.
struct SlowReader {
    /// When the server closed the connection, as its trickle of reads saw (a read gave the
    /// end or an error), from the connection's opening.
    closed_after_s: Option<f64>,
    /// Bytes read by the trickle.
    taken: usize,
    /// Given up: bytes already waiting, read at once, and whether the server's close was
    /// behind them (closed while its answers still sat in the socket buffers).
    drained: usize,
    closed_behind_buffer: bool,
}

/// One connection sending [`SLOW_READER_REQUESTS`] pipelined `GET /v1/models` at once, then reading 64 bytes
/// every 1.5 s; given up after [`SLOW_READ_LIMIT`].
async fn slow_reader(addr: String) -> SlowReader {
    let t0 = Instant::now();
    let gone = |taken| SlowReader {
        closed_after_s: Some(t0.elapsed().as_secs_f64()),
        taken,
        drained: 0,
        closed_behind_buffer: false,
    };
    let Ok(mut s) = tokio::net::TcpStream::connect(&addr).await else {
        return gone(0);
    };
    let requests = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n".repeat(SLOW_READER_REQUESTS);
    if s.write_all(&requests).await.is_err() {
        return gone(0);
    }
    let (mut buf, mut taken) = ([0u8; 64], 0);
    let until = t0 + SLOW_READ_LIMIT;
    loop {
        match tokio::time::timeout_at(until.into(), s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return gone(taken),
            Ok(Ok(n)) => taken += n,
            Err(_) => break,
        }
        if Instant::now() + Duration::from_millis(1500) >= until {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1500)).await;
    }
    // Given up: read what is already there, to see whether a close waits behind it.
    let (mut big, mut drained) = (vec![0u8; 64 << 10], 0);
    let drain_until = Instant::now() + Duration::from_secs(5);
    let closed_behind_buffer = loop {
        let r = tokio::time::timeout(Duration::from_millis(300), s.read(&mut big)).await;
        match r {
            Ok(Ok(0)) | Ok(Err(_)) => break true,
            Ok(Ok(n)) => drained += n,
            Err(_) => break false,
        }
        if Instant::now() >= drain_until {
            break false;
        }
    };
    SlowReader {
        closed_after_s: None,
        taken,
        drained,
        closed_behind_buffer,
    }
}

/// [`SLOW_READERS`] slow readers at once: how many the server closed, and when.
async fn slow_readers(addr: String) -> FloodReport {
    let tasks: Vec<JoinHandle<SlowReader>> = (0..SLOW_READERS)
        .map(|_| tokio::spawn(slow_reader(addr.clone())))
        .collect();
    let mut readers = Vec::new();
    for t in tasks {
        readers.push(t.await.unwrap());
    }
    let closed: Vec<f64> = readers.iter().filter_map(|r| r.closed_after_s).collect();
    let behind = readers.iter().filter(|r| r.closed_behind_buffer).count();
    let taken: usize = readers.iter().map(|r| r.taken).sum();
    let drained: usize = readers.iter().map(|r| r.drained).sum();
    let max = closed.iter().copied().fold(f64::NAN, f64::max);
    let when = if closed.is_empty() {
        String::new()
    } else {
        format!(" (p50 {:.1} s, max {max:.1} s)", pct(&closed, 50.0))
    };
    let text = format!(
        "{} of {SLOW_READERS} closed by the server while reading{when}; of the {} others given up \
         at {} s, {behind} found closed behind their buffered answers ({drained} B \
         waiting in all); {taken} B read in the trickle",
        closed.len(),
        SLOW_READERS - closed.len(),
        SLOW_READ_LIMIT.as_secs()
    );
    let value = json!({
        "connections": SLOW_READERS,
        "pipelined_requests_each": SLOW_READER_REQUESTS,
        "closed_while_reading": closed.len(),
        "closed_after_s": {"p50": pct(&closed, 50.0), "max": max, "each": closed},
        "given_up_after_s": SLOW_READ_LIMIT.as_secs(),
        "found_closed_when_given_up": behind,
        "bytes_read_trickling": taken,
        "bytes_waiting_when_given_up": drained,
    });
    (value, text)
}

/// 64 chat requests from 16 clients with a 3 MB body (over the 2 MiB limit).
fn oversized_bodies(
    http: &reqwest::Client,
    base: &str,
) -> impl Future<Output = FloodReport> + Send + 'static {
    let (http, url) = (http.clone(), format!("{base}/v1/chat/completions"));
    let body = Arc::new(
        json!({"model": "shakespeare", "max_tokens": 4,
            "messages": [{"role": "user", "content": "x".repeat(3_000_000)}]})
        .to_string(),
    );
    let make: MakeRequest = Arc::new(move |http: &reqwest::Client, _: usize| {
        http.post(&url)
            .header("content-type", "application/json")
            .body(body.as_str().to_owned())
    });
    async move {
        let out = flood_requests(&http, 64, 16, make).await;
        outcome_summary(&out, &[413])
    }
}

/// The rows as a markdown table.
fn print_table(rows: &[Value]) {
    println!(
        "\n## Floods on one `kvmesh serve` (sim): normal requests ({NORMAL_REQUESTS}, \
         {NORMAL_TOKENS} tokens, concurrency {NORMAL_CONCURRENCY}) and /health every 100 ms \
         beside each\n"
    );
    println!(
        "| phase | normal p50 ms | normal p99 ms | health p99 ms | health max ms | \
         RSS before / peak / after MiB | what the flood got |"
    );
    println!("|---|---:|---:|---:|---:|---:|---|");
    let f = |v: &Value| v.as_f64().unwrap_or(f64::NAN);
    for r in rows {
        let (n, h, m) = (&r["normal"], &r["health"], &r["rss_mib"]);
        let failed = n["failed"].as_u64().unwrap_or(0);
        let hfailed = h["failed"].as_u64().unwrap_or(0);
        let mut got = r["got"].as_str().unwrap_or("").to_string();
        if failed > 0 {
            got = format!("{got}; {failed} normal requests failed");
        }
        if hfailed > 0 {
            got = format!("{got}; {hfailed} health polls failed");
        }
        println!(
            "| {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} / {:.1} / {:.1} | {got} |",
            r["phase"].as_str().unwrap_or(""),
            f(&n["p50_ms"]),
            f(&n["p99_ms"]),
            f(&h["p99_ms"]),
            f(&h["max_ms"]),
            f(&m["before"]),
            f(&m["peak"]),
            f(&m["after"]),
        );
    }
}
