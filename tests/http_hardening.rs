//! The HTTP front door under hostile clients: connection timeouts and the connection cap,
//! huge prompts, status codes and error shapes, API keys, unsupported fields, and the
//! admission edge of the engine's queue. Real `kvmesh serve` (and `kvmesh node`) processes
//! on loopback; every wait is bounded.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::kvmesh;
use kvmesh_bench::harness::{client, status, wait_for, wait_ready, Ready};
use kvmesh_discovery::testing::Etcd;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A `kvmesh serve` process whose log is kept (for what it must never say).
struct Proc {
    child: Child,
    base: String,
    addr: String,
    log: Arc<Mutex<String>>,
    http: reqwest::Client,
}

impl Proc {
    fn serve(args: &[&str]) -> Proc {
        Proc::spawn(Command::new(common::bin()), args)
    }

    /// `kvmesh serve` under an open-file limit of `files`.
    fn serve_with_file_limit(files: u32, args: &[&str]) -> Proc {
        let mut cmd = Command::new("sh");
        cmd.args([
            "-c",
            &format!("ulimit -n {files} && exec \"$0\" \"$@\""),
            &common::bin(),
        ]);
        Proc::spawn(cmd, args)
    }

    fn spawn(mut cmd: Command, args: &[&str]) -> Proc {
        let mut child = cmd
            .args(["serve", "--host", "127.0.0.1", "--port", "0"])
            .args(args)
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start kvmesh");
        let log = Arc::new(Mutex::new(String::new()));
        let stderr = child.stderr.take().expect("stderr");
        {
            let log = log.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                    eprintln!("{line}");
                    let mut l = log.lock().unwrap();
                    l.push_str(&line);
                    l.push('\n');
                }
            });
        }
        let base = wait_ready(
            &mut child,
            Ready::Listening,
            &format!("kvmesh serve {args:?}"),
        );
        let addr = base.trim_start_matches("http://").to_string();
        Proc {
            child,
            base,
            addr,
            log,
            // No idle pooled connections: they would count against --max-connections.
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(60))
                .pool_max_idle_per_host(0)
                .build()
                .unwrap(),
        }
    }

    fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// Waits (10 s at most) for the log to say `what`.
    fn wait_log(&self, what: &str) -> bool {
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(10) {
            if self.log().contains(what) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    /// Whether GET /health answers 200 within `secs` (connections just closed by clients
    /// may take a moment to leave the server's count).
    async fn healthy_within(&self, secs: u64) -> bool {
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(secs) {
            if let Ok(r) = self.http.get(format!("{}/health", self.base)).send().await {
                if r.status().as_u16() == 200 {
                    return true;
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        false
    }

    /// A line of /proc/PID/status, in kB.
    fn proc_kb(&self, field: &str) -> u64 {
        let s = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        s.lines()
            .find_map(|l| l.strip_prefix(field))
            .and_then(|v| {
                v.trim_start_matches(':')
                    .split_whitespace()
                    .next()?
                    .parse()
                    .ok()
            })
            .unwrap_or_else(|| panic!("{field} in {s}"))
    }

    async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        self.send(self.http.post(format!("{}{path}", self.base)).json(body))
            .await
    }

    async fn send(&self, req: reqwest::RequestBuilder) -> (u16, Value) {
        let r = req.send().await.expect("send");
        let st = r.status().as_u16();
        let text = r.text().await.expect("body");
        (
            st,
            serde_json::from_str(&text).unwrap_or_else(|_| json!({"raw": text})),
        )
    }

    fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Asserts the OpenAI error shape and returns the error object.
fn openai_error(v: &Value) -> &Value {
    let e = &v["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert!(e["type"].as_str().is_some(), "{v}");
    let obj = e.as_object().unwrap_or_else(|| panic!("{v}"));
    for k in ["message", "type", "param", "code"] {
        assert!(obj.contains_key(k), "`{k}` missing in {v}");
    }
    e
}

/// Reads until the peer closes (`Some(elapsed)`), or `None` if still open after `secs`.
/// Bytes received meanwhile are returned too.
async fn wait_closed(s: &mut TcpStream, secs: f64) -> (Option<Duration>, Vec<u8>) {
    let t = Instant::now();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let left = Duration::from_secs_f64(secs).saturating_sub(t.elapsed());
        match tokio::time::timeout(left, s.read(&mut buf)).await {
            Err(_) => return (None, got),
            Ok(Ok(0)) | Ok(Err(_)) => return (Some(t.elapsed()), got),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
        }
    }
}

/// Writes `bytes` one at a time, `gap` apart, until the peer closes or answers; returns
/// when it did (`None`: neither, all sent) and what it answered.
async fn drip(s: &mut TcpStream, bytes: &[u8], gap: Duration) -> (Option<Duration>, Vec<u8>) {
    let t = Instant::now();
    let mut buf = [0u8; 4096];
    for b in bytes {
        if s.write_all(&[*b]).await.is_err() {
            return (Some(t.elapsed()), Vec::new());
        }
        match tokio::time::timeout(gap, s.read(&mut buf)).await {
            Err(_) => {}
            Ok(Ok(0)) | Ok(Err(_)) => return (Some(t.elapsed()), Vec::new()),
            Ok(Ok(n)) => {
                let mut got = buf[..n].to_vec();
                // The rest of the answer, if any, then the close.
                let (_, more) = wait_closed(s, 3.0).await;
                got.extend(more);
                return (Some(t.elapsed()), got);
            }
        }
    }
    (None, Vec::new())
}

/// The JSON body of a raw HTTP response.
fn raw_json(resp: &[u8]) -> Value {
    let text = String::from_utf8_lossy(resp);
    let body = text.split("\r\n\r\n").nth(1).unwrap_or("");
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {text}"))
}

fn completion(prompt: &str, extra: Value) -> Value {
    let mut body = json!({"prompt": prompt});
    for (k, v) in extra.as_object().expect("object") {
        body[k] = v.clone();
    }
    body
}

/// Item 1: silent, header-dripping, idle keep-alive and body-dripping connections are
/// closed by their timeouts; a stream longer than every timeout runs to its end.
#[tokio::test]
async fn slow_and_idle_connections_time_out_but_streams_do_not() {
    let s = Proc::serve(&[
        "--backend",
        "sim",
        "--sim-decode-ms",
        "20",
        "--num-kv-blocks",
        "64",
        "--http-header-timeout",
        "1",
        "--http-idle-timeout",
        "3",
        "--http-body-timeout",
        "1",
    ]);
    // A connection that never says anything.
    let mut idle = TcpStream::connect(&s.addr).await.unwrap();
    let (closed, _) = wait_closed(&mut idle, 10.0).await;
    let took = closed.expect("a silent connection is closed by the header timeout");
    assert!(took < Duration::from_secs(8), "{took:?}");

    // A head dripped a byte every 300 ms never completes in time.
    let mut slow = TcpStream::connect(&s.addr).await.unwrap();
    let head =
        b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n\r\n";
    let (closed, answer) = drip(&mut slow, head, Duration::from_millis(300)).await;
    assert!(answer.is_empty(), "{}", String::from_utf8_lossy(&answer));
    let took = closed.expect("a dripping head is cut off");
    assert!(took < Duration::from_secs(8), "{took:?}");

    // Keep-alive: a request, then silence: closed by the idle timeout (3 s), not the
    // header timeout (1 s).
    let mut ka = TcpStream::connect(&s.addr).await.unwrap();
    ka.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 1024];
    let n = tokio::time::timeout(Duration::from_secs(10), ka.read(&mut buf))
        .await
        .expect("answer")
        .unwrap();
    assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
    let (closed, _) = wait_closed(&mut ka, 15.0).await;
    let took = closed.expect("an idle keep-alive connection is closed");
    assert!(
        took >= Duration::from_secs(2) && took < Duration::from_secs(12),
        "closed after {took:?}; the idle timeout is 3 s"
    );

    // A body dripped after its head gets 408 in the OpenAI shape, and the connection ends.
    let mut body = TcpStream::connect(&s.addr).await.unwrap();
    body.write_all(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\ncontent-length: 200\r\n\r\n{",
    )
    .await
    .unwrap();
    let (closed, answer) = drip(&mut body, &[b' '; 60], Duration::from_millis(300)).await;
    let took = closed.expect("a dripping body is cut off");
    assert!(took < Duration::from_secs(8), "{took:?}");
    assert!(
        answer.starts_with(b"HTTP/1.1 408"),
        "{}",
        String::from_utf8_lossy(&answer)
    );
    let v = raw_json(&answer);
    assert_eq!(openai_error(&v)["code"], "request_timeout", "{v}");

    // A stream of ~3 s (150 tokens at 20 ms) outlives every timeout and ends with [DONE].
    let t = Instant::now();
    let r = s
        .http
        .post(format!("{}/v1/completions", s.base))
        .json(&completion(
            "ROMEO:",
            json!({"max_tokens": 150, "ignore_eos": true, "stream": true}),
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let text = r.text().await.unwrap();
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    assert!(
        t.elapsed() > Duration::from_millis(1500),
        "{:?}",
        t.elapsed()
    );
    // Nothing was in the way of ordinary requests.
    let (st, _) = s.send(s.http.get(format!("{}/health", s.base))).await;
    assert_eq!(st, 200);
}

/// Item 1: beyond --max-connections new connections get a 503 at once; idle ones are closed
/// by the header timeout and the server goes on serving; it never runs out of descriptors.
#[tokio::test]
async fn the_connection_cap_answers_503_and_recovers() {
    let mut s = Proc::serve(&[
        "--backend",
        "sim",
        "--sim-decode-ms",
        "20",
        "--num-kv-blocks",
        "64",
        "--max-connections",
        "8",
        "--http-header-timeout",
        "1",
    ]);
    let mut socks = Vec::new();
    for _ in 0..20 {
        socks.push(TcpStream::connect(&s.addr).await.unwrap());
    }
    let (mut refused, mut closed) = (0, 0);
    for mut sock in socks {
        let (done, got) = wait_closed(&mut sock, 10.0).await;
        assert!(done.is_some(), "a connection left hanging");
        if got.is_empty() {
            closed += 1;
        } else {
            assert!(
                got.starts_with(b"HTTP/1.1 503"),
                "{}",
                String::from_utf8_lossy(&got)
            );
            assert_eq!(
                openai_error(&raw_json(&got))["code"],
                "too_many_connections"
            );
            refused += 1;
        }
    }
    assert!(
        refused >= 10 && closed >= 1,
        "{refused} refused, {closed} closed"
    );
    // The idle ones are gone: requests are served again.
    assert!(s.healthy_within(10).await);
    tokio::time::sleep(Duration::from_millis(300)).await;

    // Eight streams hold every place (no timeout cuts them); a ninth connection is refused
    // meanwhile, and served once they are done.
    let streams: Vec<_> = (0..8)
        .map(|i| {
            let (http, base) = (reqwest::Client::new(), s.base.clone());
            tokio::spawn(async move {
                let r = http
                    .post(format!("{base}/v1/completions"))
                    .json(&completion(
                        &format!("Stream {i}:"),
                        json!({"max_tokens": 150, "ignore_eos": true, "stream": true}),
                    ))
                    .send()
                    .await
                    .unwrap();
                (r.status().as_u16(), r.text().await.unwrap())
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(700)).await;
    let mut ninth = TcpStream::connect(&s.addr).await.unwrap();
    ninth
        .write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let (_, got) = wait_closed(&mut ninth, 10.0).await;
    assert!(
        got.starts_with(b"HTTP/1.1 503"),
        "{}",
        String::from_utf8_lossy(&got)
    );
    for st in streams {
        let (code, text) = st.await.unwrap();
        assert_eq!(code, 200, "{text}");
        assert!(text.trim_end().ends_with("data: [DONE]"));
    }
    assert!(s.healthy_within(10).await);
    assert!(s.alive());
    let log = s.log();
    assert!(!log.contains("Too many open files"), "{log}");
    assert!(
        !log.contains("accepting an HTTP connection failed"),
        "{log}"
    );
}

/// Item 1: --max-connections is capped below the open-file limit, so a flood of idle
/// connections meets 503s, not "Too many open files".
#[tokio::test]
async fn the_connection_cap_stays_below_the_open_file_limit() {
    let mut s = Proc::serve_with_file_limit(
        128,
        &[
            "--backend",
            "sim",
            "--num-kv-blocks",
            "64",
            "--max-connections",
            "100000",
            "--http-header-timeout",
            "2",
        ],
    );
    assert!(s.wait_log("serving at most 64 connections"), "{}", s.log());
    let mut socks = Vec::new();
    for _ in 0..100 {
        socks.push(TcpStream::connect(&s.addr).await.unwrap());
    }
    let mut refused = 0;
    for mut sock in socks {
        let (done, got) = wait_closed(&mut sock, 15.0).await;
        assert!(done.is_some(), "a connection left hanging");
        if got.starts_with(b"HTTP/1.1 503") {
            refused += 1;
        }
    }
    assert!(refused >= 30, "{refused} of 100 refused with a cap of 64");
    assert!(s.healthy_within(10).await);
    assert!(s.alive());
    let log = s.log();
    assert!(!log.contains("Too many open files"), "{log}");
}

/// A client that stops reading its answers holds its connection for the send timeout, not
/// for ever: with one connection allowed, a client pipelining requests (megabytes of
/// answers) and reading none is closed after `--http-send-timeout`, and others are served.
#[tokio::test]
async fn a_client_that_stops_reading_is_closed_after_the_send_timeout() {
    let mut s = Proc::serve(&[
        "--backend",
        "sim",
        "--num-kv-blocks",
        "64",
        "--max-connections",
        "1",
        "--http-send-timeout",
        "1",
    ]);
    let sock = TcpStream::connect(&s.addr).await.unwrap();
    let (unread, mut write) = sock.into_split();
    // 40,000 requests (1.5 MB), answered with ~14 MB: more than the sockets' buffers hold.
    let requests = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n".repeat(40_000);
    let writer = tokio::spawn(async move {
        let _ = tokio::time::timeout(Duration::from_secs(20), write.write_all(&requests)).await;
        write
    });
    // The only connection is taken: another client is refused meanwhile.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut other = TcpStream::connect(&s.addr).await.unwrap();
    other
        .write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let (_, got) = wait_closed(&mut other, 5.0).await;
    assert!(
        got.starts_with(b"HTTP/1.1 503"),
        "{}",
        String::from_utf8_lossy(&got)
    );
    // Then the stalled one is closed, and the place is free.
    let t = Instant::now();
    assert!(
        s.healthy_within(15).await,
        "a client that reads nothing still holds the only connection"
    );
    assert!(
        s.wait_log("took no byte of the answer for 1s"),
        "{}",
        s.log()
    );
    eprintln!("served again {:?} after the refused one", t.elapsed());
    drop((unread, writer.await.unwrap()));
    assert!(s.alive());
}

/// Item 2: prompts longer in bytes than the context could hold are refused before
/// tokenizing, quickly, while /health keeps answering, and memory stays small.
#[tokio::test]
async fn huge_prompts_are_refused_by_size_without_stalling_the_server() {
    let s = Proc::serve(&["--backend", "sim", "--num-kv-blocks", "64"]);
    let big = "Now is the winter of our discontent. ".repeat(1_900_000 / 37);
    assert!(big.len() > 1_800_000 && big.len() < 2_000_000);
    let bodies: Vec<(&str, Value)> = (0..8)
        .map(|i| {
            if i % 2 == 0 {
                ("/v1/completions", json!({"prompt": big}))
            } else {
                (
                    "/v1/chat/completions",
                    json!({"messages": [{"role": "user", "content": big}]}),
                )
            }
        })
        .collect();
    let t = Instant::now();
    let big_done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let health = {
        let (http, base, done) = (reqwest::Client::new(), s.base.clone(), big_done.clone());
        tokio::spawn(async move {
            let (mut answered, mut slowest) = (0, Duration::ZERO);
            for _ in 0..400 {
                let t = Instant::now();
                let r = http
                    .get(format!("{base}/health"))
                    .timeout(Duration::from_secs(30))
                    .send()
                    .await;
                if r.is_ok_and(|r| r.status().is_success()) {
                    answered += 1;
                    slowest = slowest.max(t.elapsed());
                }
                if done.load(std::sync::atomic::Ordering::Relaxed) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            (answered, slowest)
        })
    };
    let results = futures::future::join_all(bodies.iter().map(|(p, b)| s.post(p, b))).await;
    big_done.store(true, std::sync::atomic::Ordering::Relaxed);
    let took = t.elapsed();
    for (st, v) in &results {
        assert_eq!(*st, 400, "{v}");
        let e = openai_error(v);
        assert_eq!(e["code"], "context_length_exceeded", "{v}");
        let msg = e["message"].as_str().unwrap();
        assert!(
            msg.contains("bytes") && msg.contains("512"),
            "refused by size, with the numbers: {msg}"
        );
    }
    let (answered, slowest) = health.await.unwrap();
    assert!(
        answered >= 1,
        "/health never answered while the prompts were in flight"
    );
    assert!(
        slowest < Duration::from_secs(5),
        "/health took {slowest:?} at worst"
    );
    let peak_mb = s.proc_kb("VmHWM") / 1024;
    assert!(peak_mb < 300, "peak RSS {peak_mb} MB");
    eprintln!(
        "8 prompts of {} bytes refused in {took:?}; /health answered {answered} times, slowest {slowest:?}; peak RSS {peak_mb} MB",
        big.len()
    );
    // A long list of token ids is refused by its length, before anything else.
    let ids: Vec<u32> = vec![5; 600];
    let (st, v) = s.post("/v1/completions", &json!({"prompt": ids})).await;
    assert_eq!(st, 400, "{v}");
    assert_eq!(openai_error(&v)["code"], "context_length_exceeded");
    // Ordinary prompts are served as before.
    let (st, v) = s
        .post(
            "/v1/completions",
            &completion("ROMEO:", json!({"max_tokens": 4})),
        )
        .await;
    assert_eq!(st, 200, "{v}");
}

/// Item 3: out-of-vocabulary token ids are 400; 413, 405 and 404 come in the OpenAI shape.
#[tokio::test]
async fn status_codes_and_error_shapes() {
    let s = Proc::serve(&["--backend", "sim", "--num-kv-blocks", "64"]);
    for ids in [
        json!([1_000_000_000u32]),
        json!([5, 6, 2048]),
        json!([[7, 4_000_000_000u32]]),
    ] {
        for stream in [false, true] {
            let (st, v) = s
                .post(
                    "/v1/completions",
                    &json!({"prompt": ids, "max_tokens": 3, "stream": stream}),
                )
                .await;
            assert_eq!(st, 400, "{ids}: {v}");
            let e = openai_error(&v);
            assert_eq!(e["param"], "prompt", "{v}");
            assert!(
                e["message"].as_str().unwrap().contains("out of vocabulary"),
                "{v}"
            );
        }
    }
    // 413: more than 2 MiB.
    let huge = format!("{{\"prompt\": \"{}\"}}", "a".repeat(3 << 20));
    let (st, v) = s
        .send(
            s.http
                .post(format!("{}/v1/completions", s.base))
                .header("content-type", "application/json")
                .body(huge),
        )
        .await;
    assert_eq!(st, 413, "{v}");
    assert_eq!(openai_error(&v)["code"], "request_too_large");
    // 405 with Allow, for the API's routes and the others.
    for (method, path, allow) in [
        (reqwest::Method::GET, "/v1/completions", "POST"),
        (reqwest::Method::PUT, "/v1/chat/completions", "POST"),
        (reqwest::Method::POST, "/health", "GET"),
        (reqwest::Method::DELETE, "/v1/models", "GET"),
    ] {
        let r = s
            .http
            .request(method.clone(), format!("{}{path}", s.base))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 405, "{method} {path}");
        assert!(
            r.headers()["allow"].to_str().unwrap().contains(allow),
            "{method} {path}"
        );
        let v: Value = r.json().await.expect("a JSON body");
        assert_eq!(openai_error(&v)["code"], "method_not_allowed", "{v}");
    }
    // 404 for routes that do not exist.
    for path in ["/nope", "/v1/nope", "/v2/completions"] {
        let (st, v) = s.send(s.http.get(format!("{}{path}", s.base))).await;
        assert_eq!(st, 404, "{path}: {v}");
        assert_eq!(openai_error(&v)["code"], "unknown_url");
    }
}

/// What a raw exchange got back: the status, the head and the JSON body, read until the
/// server closed (at most `secs`), and how long that took.
async fn raw_exchange(addr: &str, request: &[u8], secs: f64) -> (u16, String, Value, Duration) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(request).await.unwrap();
    let (closed, got) = wait_closed(&mut s, secs).await;
    let took = closed.unwrap_or_else(|| panic!("no close within {secs} s: {got:?}"));
    let text = String::from_utf8_lossy(&got).to_string();
    let status = text
        .get(9..12)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status line: {text:?}"));
    let head = text.split("\r\n\r\n").next().unwrap_or("").to_string();
    (status, head, raw_json(&got), took)
}

/// Round 3, items 4 and 5: what the HTTP library refuses itself (unparseable heads, a URI
/// or header block over its limits) carries the OpenAI error shape like every other status,
/// and a body declared over the limit is refused at once, without inviting it with
/// `100 Continue`.
#[tokio::test]
async fn every_refusal_has_an_openai_body_and_oversized_bodies_are_refused_at_once() {
    let s = Proc::serve(&["--backend", "sim", "--num-kv-blocks", "64"]);
    let many_headers: String = (0..120).map(|i| format!("X-H{i}: y\r\n")).collect();
    let long_uri = format!("GET /{} HTTP/1.1\r\nHost: x\r\n\r\n", "a".repeat(100_000));
    let cases: Vec<(&str, Vec<u8>, u16)> = vec![
        ("garbage request line", b"GARBAGE\r\n\r\n".to_vec(), 400),
        ("bad version", b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n".to_vec(), 400),
        ("bad header name", b"GET /health HTTP/1.1\r\nHo st: x\r\n\r\n".to_vec(), 400),
        ("folded header", b"GET /health HTTP/1.1\r\nHost: x\r\n folded\r\n\r\n".to_vec(), 400),
        ("NUL in a header", b"GET /health HTTP/1.1\r\nHost: x\0y\r\n\r\n".to_vec(), 400),
        (
            "two Content-Lengths",
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabc".to_vec(),
            400,
        ),
        ("100 KB URI", long_uri.into_bytes(), 414),
        (
            "120 headers",
            format!("GET /health HTTP/1.1\r\nHost: x\r\n{many_headers}\r\n").into_bytes(),
            431,
        ),
    ];
    for (what, req, want) in cases {
        let (status, head, v, _) = raw_exchange(&s.addr, &req, 5.0).await;
        assert_eq!(status, want, "{what}: {head}");
        assert!(
            head.to_ascii_lowercase()
                .contains("content-type: application/json"),
            "{what}: {head}"
        );
        openai_error(&v);
        assert_eq!(v["error"]["type"], "invalid_request_error", "{what}: {v}");
    }

    // A declared body over the 2 MiB limit: 413 at once (not after the body timeout), with
    // the trace id, and never `100 Continue` first.
    for expect in ["", "Expect: 100-continue\r\n"] {
        let req = format!(
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
             {expect}Content-Length: 10000000\r\n\r\n"
        );
        let (status, head, v, took) = raw_exchange(&s.addr, req.as_bytes(), 10.0).await;
        assert_eq!(status, 413, "{expect:?}: {head}");
        assert!(head.starts_with("HTTP/1.1 413"), "{expect:?}: {head}");
        assert_eq!(openai_error(&v)["code"], "request_too_large", "{v}");
        assert!(head.to_ascii_lowercase().contains("x-trace-id: "), "{head}");
        assert!(
            took < Duration::from_secs(5),
            "{expect:?}: answered after {took:?}"
        );
    }
    assert!(s.healthy_within(5).await);
}

/// Item 4: the scheme of `Authorization` is case-insensitive; an empty key is refused at
/// start-up.
#[tokio::test]
async fn api_keys() {
    let s = Proc::serve(&[
        "--backend",
        "sim",
        "--num-kv-blocks",
        "64",
        "--api-key",
        "sekrit",
    ]);
    let url = format!("{}/v1/models", s.base);
    for (auth, want) in [
        (Some("Bearer sekrit"), 200),
        (Some("bearer sekrit"), 200),
        (Some("BEARER sekrit"), 200),
        (Some("Bearer   sekrit "), 200),
        (Some("Bearer wrong"), 401),
        (Some("Bearer sekrit2"), 401),
        (Some("Basic sekrit"), 401),
        (Some("sekrit"), 401),
        (Some("Bearer"), 401),
        (None, 401),
    ] {
        let mut req = s.http.get(&url);
        if let Some(a) = auth {
            req = req.header("authorization", a);
        }
        let (st, v) = s.send(req).await;
        assert_eq!(st, want, "{auth:?}: {v}");
        if want == 401 {
            assert_eq!(openai_error(&v)["type"], "authentication_error");
        }
    }
    // A lowercase scheme works for generation too.
    let (st, v) = s
        .send(
            s.http
                .post(format!("{}/v1/completions", s.base))
                .header("authorization", "bearer sekrit")
                .json(&completion("ROMEO:", json!({"max_tokens": 2}))),
        )
        .await;
    assert_eq!(st, 200, "{v}");

    // An empty key would lock every route: refused before anything starts.
    for args in [
        vec!["serve", "--api-key", ""],
        vec!["serve", "--api-key", " "],
        vec!["node", "--etcd", "http://127.0.0.1:9", "--api-key", ""],
    ] {
        let mut child = Command::new(common::bin())
            .args(&args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let t = Instant::now();
        let code = loop {
            if let Some(c) = child.try_wait().unwrap() {
                break Some(c);
            }
            if t.elapsed() > Duration::from_secs(20) {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let code = code.unwrap_or_else(|| panic!("kvmesh {args:?} started anyway"));
        assert!(!code.success(), "{args:?}");
        let mut err = String::new();
        std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
        assert!(
            err.contains("--api-key") && err.contains("API key"),
            "{args:?}: {err}"
        );
    }
}

/// Items 3 and 4 through a cluster gateway: bad token ids are 400 before dispatch (not a 500
/// or an error event), and /debug routes need the API key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_gateway_checks_token_ids_and_guards_debug_routes() {
    let etcd = Etcd::start();
    let http = client();
    let gw = kvmesh().node(
        &etcd,
        "hh",
        "gw",
        &[
            "--roles",
            "gateway,router",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--enable-fault-injection",
            "--api-key",
            "sekrit",
            "--http-header-timeout",
            "1",
        ],
    );
    let _w = kvmesh().worker(&etcd, "hh", "w1", &[]);
    wait_for("w1 routable", 20, async || {
        status(&http, &gw).await["router"]["workers"]
            .as_array()
            .is_some_and(|w| w.iter().any(|w| w["connected"] == true))
    })
    .await;
    let post = async |path: &str, auth: Option<&str>, body: Value| {
        let mut r = http.post(format!("{}{path}", gw.http)).json(&body);
        if let Some(a) = auth {
            r = r.header("authorization", a);
        }
        let r = r.send().await.unwrap();
        let st = r.status().as_u16();
        (st, r.json::<Value>().await.unwrap_or(Value::Null))
    };
    for stream in [false, true] {
        let (st, v) = post(
            "/v1/completions",
            Some("bearer sekrit"),
            json!({"prompt": [1, 1_000_000_000u32], "max_tokens": 3, "stream": stream}),
        )
        .await;
        assert_eq!(st, 400, "{v}");
        assert_eq!(openai_error(&v)["param"], "prompt");
    }
    let (st, v) = post(
        "/v1/completions",
        Some("bearer sekrit"),
        json!({"prompt": "Now is", "max_tokens": 3}),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    // /debug needs the key (a role that does not exist: nothing crashes here).
    for auth in [None, Some("Bearer wrong")] {
        let (st, v) = post("/debug/crash/nothing", auth, json!({})).await;
        assert_eq!(st, 401, "{auth:?}: {v}");
        assert_eq!(openai_error(&v)["code"], "invalid_api_key");
    }
    let (st, v) = post("/debug/crash/nothing", Some("Bearer sekrit"), json!({})).await;
    assert_eq!(st, 400, "{v}");
    openai_error(&v);
    // The node's HTTP limits apply: a silent connection is closed.
    let mut idle = TcpStream::connect(gw.http.trim_start_matches("http://"))
        .await
        .unwrap();
    let (closed, _) = wait_closed(&mut idle, 10.0).await;
    assert!(
        closed.is_some(),
        "the gateway node keeps a silent connection"
    );
}

/// Item 5: fields the server does not implement are refused by name, not ignored; values
/// that ask for nothing more than plain generation pass.
#[tokio::test]
async fn unsupported_fields_are_refused_by_name() {
    let s = Proc::serve(&["--backend", "sim", "--num-kv-blocks", "64"]);
    // Unsupported fields, and supported ones with values that cannot be followed.
    let refused = [
        ("functions", json!([{"name": "f"}])),
        ("function_call", json!("auto")),
        ("response_format", json!({"type": "wat"})),
        ("best_of", json!(2)),
        ("best_of", json!(0)),
        ("logit_bias", json!({"50256": -100})),
        ("logit_bias", json!({"5": 101})),
        ("guided_regex", json!("(unclosed")),
        ("guided_choice", json!([])),
        ("guided_grammar", json!("root ::= \"a\"")),
    ];
    let accepted = [
        ("tools", json!([])),
        ("tools", Value::Null),
        ("tool_choice", json!("none")),
        ("response_format", json!({"type": "text"})),
        ("response_format", json!({"type": "json_object"})),
        ("best_of", json!(1)),
        ("logit_bias", json!({})),
        ("logit_bias", json!({"5": -100})),
        ("structured_outputs", json!({"regex": "[a-z]+"})),
        ("guided_json", json!({"type": "object"})),
        ("guided_regex", json!("[a-z]+")),
        ("guided_choice", json!(["yes", "no"])),
        ("guided_grammar", json!("start: \"a\"+")),
    ];
    for path in ["/v1/completions", "/v1/chat/completions"] {
        let base = if path == "/v1/completions" {
            json!({"prompt": "ROMEO:", "max_tokens": 2})
        } else {
            json!({"messages": [{"role": "user", "content": "Hail!"}], "max_tokens": 2})
        };
        for (field, value) in &refused {
            let mut body = base.clone();
            body[*field] = value.clone();
            let (st, v) = s.post(path, &body).await;
            assert_eq!(st, 400, "{path} {field}={value}: {v}");
            let e = openai_error(&v);
            assert_eq!(e["param"], *field, "{v}");
            assert!(e["message"].as_str().unwrap().contains(field), "{v}");
        }
        for (field, value) in &accepted {
            let mut body = base.clone();
            body[*field] = value.clone();
            let (st, v) = s.post(path, &body).await;
            assert_eq!(st, 200, "{path} {field}={value}: {v}");
        }
    }
}

/// Item 6: with two running and two waiting places, four requests at once are always
/// served, clients that send their next request as soon as one ends are never refused, and
/// a fifth request while four are unfinished is.
#[tokio::test]
async fn the_queue_refuses_only_when_really_full() {
    let s = Proc::serve(&[
        "--backend",
        "sim",
        "--sim-decode-ms",
        "2",
        "--num-kv-blocks",
        "64",
        "--max-num-seqs",
        "2",
        "--max-waiting-seqs",
        "2",
    ]);
    let body = completion("ROMEO:", json!({"max_tokens": 8, "ignore_eos": true}));
    for round in 0..15 {
        let results =
            futures::future::join_all((0..4).map(|_| s.post("/v1/completions", &body))).await;
        for (st, v) in &results {
            assert_eq!(*st, 200, "round {round}: {v}");
        }
    }
    // Four clients, each sending its next request when the last one ends: 4 x 12 requests.
    let clients = (0..4).map(|_| async {
        let mut refused = Vec::new();
        for _ in 0..12 {
            let (st, v) = s.post("/v1/completions", &body).await;
            if st != 200 {
                refused.push((st, v));
            }
        }
        refused
    });
    let refused: Vec<_> = futures::future::join_all(clients)
        .await
        .into_iter()
        .flatten()
        .collect();
    assert!(refused.is_empty(), "{refused:?}");
    // Four long ones hold every place: a fifth is refused with 429.
    let long = completion("ROMEO:", json!({"max_tokens": 500, "ignore_eos": true}));
    let holders: Vec<_> = (0..4)
        .map(|_| {
            let (http, base, long) = (s.http.clone(), s.base.clone(), long.clone());
            tokio::spawn(async move {
                let r = http
                    .post(format!("{base}/v1/completions"))
                    .json(&long)
                    .send()
                    .await
                    .unwrap();
                r.status().as_u16()
            })
        })
        .collect();
    let t = Instant::now();
    loop {
        let m = s
            .http
            .get(format!("{}/metrics", s.base))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let gauge = |name: &str| -> f64 {
            m.lines()
                .find(|l| l.starts_with(name))
                .and_then(|l| l.rsplit(' ').next()?.parse().ok())
                .unwrap_or(0.0)
        };
        if gauge("kvmesh:num_requests_running") + gauge("kvmesh:num_requests_waiting") >= 4.0 {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "the four never arrived"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (st, v) = s.post("/v1/completions", &body).await;
    assert_eq!(st, 429, "{v}");
    assert_eq!(openai_error(&v)["code"], "queue_full");
    for h in holders {
        assert_eq!(h.await.unwrap(), 200);
    }
}
