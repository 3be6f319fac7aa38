//! Distributed tracing end to end: a real etcd, a gateway, a prefill and a decode node
//! (sim backends), an OTLP/HTTP receiver started here, and the trace viewer in a real
//! browser (Debian's Chromium, headless; `scripts/test.sh` installs it).
//!
//! - One request leaves one trace with spans from all three processes, every parent link
//!   resolved, the client's `traceparent` kept, and the trace id in the response headers.
//! - The gateway gathers the trace from every node (`/traces/api/trace`), `kvmesh trace`
//!   prints it, and the spans reach the OTLP receiver from every node.
//! - Sampling is parent-based: with `--trace-sample-ratio 0` nothing is kept unless the
//!   caller's context says sampled; a malformed `traceparent` starts a fresh trace.
//! - The page loads in Chromium, lists the request and draws its waterfall.

mod common;

use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};

use common::{bin, kvmesh, Server};
use kvmesh_bench::harness::{client, wait_for};
use kvmesh_discovery::testing::Etcd;
use serde_json::{json, Value};

/// Spans an OTLP/HTTP receiver got: (node, trace id, span name).
type Received = Arc<Mutex<Vec<(String, String, String)>>>;

/// A minimal OTLP/HTTP (protobuf) traces receiver on loopback.
async fn otlp_receiver() -> (SocketAddr, Received) {
    use axum::body::Bytes;
    use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
    use prost::Message;
    let got: Received = Arc::default();
    let store = got.clone();
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |body: Bytes| {
            let store = store.clone();
            async move {
                let req = ExportTraceServiceRequest::decode(body.as_ref())
                    .expect("an OTLP trace export");
                for rs in req.resource_spans {
                    let node = rs
                        .resource
                        .iter()
                        .flat_map(|r| &r.attributes)
                        .find(|kv| kv.key == "service.instance.id")
                        .and_then(|kv| kv.value.as_ref())
                        .and_then(|v| v.value.as_ref())
                        .map(|v| match v {
                            opentelemetry_proto::tonic::common::v1::any_value::Value::StringValue(s) => s.clone(),
                            other => format!("{other:?}"),
                        })
                        .unwrap_or_default();
                    for ss in rs.scope_spans {
                        for s in ss.spans {
                            let tid: String = s.trace_id.iter().map(|b| format!("{b:02x}")).collect();
                            store.lock().unwrap().push((node.clone(), tid, s.name));
                        }
                    }
                }
                axum::http::StatusCode::OK
            }
        }),
    );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
    (addr, got)
}

const CLIENT_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";

fn prompt(n: usize) -> Vec<u64> {
    (0..n as u64).map(|i| 5 + (i * 13) % 90).collect()
}

async fn get_json(http: &reqwest::Client, url: &str) -> Value {
    http.get(url).send().await.unwrap().json().await.unwrap()
}

/// A request through gateway → router → decode node ⇄ prefill node is one trace across the
/// three processes, with the client's context kept, and reaches the OTLP receiver.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_request_is_one_trace_across_every_process() {
    let (otlp, received) = otlp_receiver().await;
    let otlp_url = format!("http://{otlp}");
    let etcd = Etcd::start();
    let http = client();
    let sim = [
        "--backend",
        "sim",
        "--max-num-batched-tokens",
        "32",
        "--otlp-endpoint",
        otlp_url.as_str(),
    ];
    let with = |roles: &str, extra: &[&str]| {
        let mut v = vec!["--roles", roles];
        v.extend_from_slice(&sim);
        v.extend_from_slice(extra);
        v.iter().map(|s| s.to_string()).collect::<Vec<_>>()
    };
    let start = |id: &str, args: Vec<String>| {
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        kvmesh().node(&etcd, "tr", id, &a)
    };
    let _p = start("p1", with("prefill", &[]));
    let _d = start("d1", with("decode", &[]));
    let gw = start(
        "gw",
        with(
            "gateway,router",
            &[
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--disagg-min-tokens",
                "16",
            ],
        ),
    );
    wait_for("the router connected to both roles", 20, async || {
        let m = http
            .get(format!("{}/metrics", gw.http))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        m.contains("kvmesh:router_workers_routable{model_name=\"shakespeare\"} 1")
            && m.contains("kvmesh:router_prefill_workers_connected{model_name=\"shakespeare\"} 1")
    })
    .await;

    let r = http
        .post(format!("{}/v1/completions", gw.http))
        .header("traceparent", format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"))
        .json(
            &json!({"prompt": prompt(80), "max_tokens": 6, "temperature": 0,
                      "ignore_eos": true, "stream": true}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(
        r.headers()["x-trace-id"].to_str().unwrap(),
        CLIENT_TRACE,
        "the client's trace is continued"
    );
    let tr = r.headers()["traceresponse"].to_str().unwrap().to_string();
    assert!(tr.starts_with(&format!("00-{CLIENT_TRACE}-")), "{tr}");
    let body = r.text().await.unwrap();
    assert!(body.contains("[DONE]"), "{body}");

    // The whole trace, gathered by the gateway from every node.
    let mut spans: Vec<Value> = Vec::new();
    wait_for("every node's spans of the trace", 10, async || {
        let v = get_json(
            &http,
            &format!("{}/traces/api/trace/{CLIENT_TRACE}", gw.http),
        )
        .await;
        spans = v["spans"].as_array().cloned().unwrap_or_default();
        let names: BTreeSet<&str> = spans.iter().filter_map(|s| s["name"].as_str()).collect();
        [
            "request",
            "route",
            "attempt",
            "worker",
            "kv.pull",
            "prefill.remote",
            "kv.layer",
            "decode",
        ]
        .iter()
        .all(|n| names.contains(n))
    })
    .await;
    let by_id: HashMap<&str, &Value> = spans
        .iter()
        .map(|s| (s["span_id"].as_str().unwrap(), s))
        .collect();
    let nodes: BTreeSet<&str> = spans.iter().filter_map(|s| s["node"].as_str()).collect();
    assert_eq!(
        nodes,
        BTreeSet::from(["d1", "gw", "p1"]),
        "spans from every process"
    );
    for s in &spans {
        assert_eq!(s["trace_id"], CLIENT_TRACE, "one trace: {s}");
        let parent = s["parent_id"]
            .as_str()
            .expect("every span has a parent here");
        if s["name"] == "request" {
            assert_eq!(parent, CLIENT_SPAN, "the root continues the client's span");
        } else {
            assert!(
                by_id.contains_key(parent),
                "{}'s parent is in the trace",
                s["name"]
            );
        }
    }
    let parent_name = |name: &str| -> String {
        let s = spans.iter().find(|s| s["name"] == name).unwrap();
        by_id[s["parent_id"].as_str().unwrap()]["name"]
            .as_str()
            .unwrap()
            .to_string()
    };
    // The hops, in order: request → route → attempt → worker → kv.pull → prefill.remote.
    assert_eq!(parent_name("route"), "request");
    assert_eq!(parent_name("attempt"), "route");
    assert_eq!(parent_name("worker"), "attempt");
    assert_eq!(parent_name("kv.pull"), "worker");
    assert_eq!(parent_name("prefill.remote"), "kv.pull");
    assert_eq!(parent_name("kv.layer"), "prefill.remote");
    assert_eq!(parent_name("decode"), "worker");
    // The route names the model and its pool (the model's fingerprint).
    let route = spans.iter().find(|s| s["name"] == "route").unwrap();
    assert_eq!(route["attrs"]["model"], "shakespeare", "{route}");
    assert!(
        route["attrs"]["pool"]
            .as_str()
            .is_some_and(|p| p.len() == 16),
        "{route}"
    );
    let layer = spans.iter().find(|s| s["name"] == "kv.layer").unwrap();
    assert!(layer["attrs"]["bytes"].as_u64().unwrap() > 0, "{layer}");
    assert!(layer["attrs"]["gb_per_s"].as_f64().is_some(), "{layer}");
    let decode = spans.iter().find(|s| s["name"] == "decode").unwrap();
    assert_eq!(
        decode["events"].as_array().unwrap().len(),
        6,
        "one event per token"
    );
    let attempt = spans.iter().find(|s| s["name"] == "attempt").unwrap();
    assert_eq!(attempt["attrs"]["disagg"], "remote");
    assert_eq!(attempt["attrs"]["prefill_worker"], "p1");
    assert!(attempt["attrs"]["candidates"]
        .as_str()
        .unwrap()
        .contains("d1: cost"));

    // The recent list names the nodes; `kvmesh trace` prints the waterfall.
    let recent = get_json(&http, &format!("{}/traces/api/recent", gw.http)).await;
    let mine = recent["requests"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["trace_id"] == CLIENT_TRACE)
        .expect("the request is listed");
    assert_eq!(mine["nodes"], json!(["gw", "d1", "p1"]));
    assert_eq!(mine["status"], 200);
    let out = Command::new(bin())
        .args(["trace", CLIENT_TRACE, "--url", &gw.http])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("on 3 nodes (gw, d1, p1)") || text.contains("on 3 nodes"),
        "{text}"
    );
    for name in ["request", "kv.pull", "prefill.remote", "decode"] {
        assert!(text.contains(name), "{name} missing from:\n{text}");
    }
    let bad = Command::new(bin())
        .args(["trace", "not-an-id", "--url", &gw.http])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("32 hex digits"));

    // Every node exported its spans of the trace by OTLP (the batch exporter sends every
    // few seconds).
    wait_for("OTLP spans from every node", 20, async || {
        let got = received.lock().unwrap();
        let nodes: BTreeSet<&str> = got
            .iter()
            .filter(|(_, t, _)| t == CLIENT_TRACE)
            .map(|(n, _, _)| n.as_str())
            .collect();
        nodes == BTreeSet::from(["d1", "gw", "p1"])
    })
    .await;
}

/// The root span of trace `id` as the gateway has it (polled: spans are stored as they end).
async fn root_span(http: &reqwest::Client, base: &str, id: &str) -> Value {
    let mut last = Value::Null;
    for _ in 0..50 {
        last = get_json(http, &format!("{base}/traces/api/trace/{id}")).await;
        if let Some(root) = last["spans"]
            .as_array()
            .and_then(|a| a.iter().find(|s| s["parent_id"].is_null()))
        {
            return root.clone();
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    panic!("no root span for trace {id}: {last}");
}

/// Failed requests are traced with their status and their message: a 404 (unknown model),
/// a 400 (a body that is not JSON, refused by the HTTP framework), a 408 (a body that
/// stopped arriving) and a 413 (a body declared too large).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_are_traced_with_their_status_and_message() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let s = Server::start(&["--backend", "sim", "--http-body-timeout", "1"]);
    let http = client();
    let url = format!("{}/v1/completions", s.base);
    let addr = s.base.trim_start_matches("http://").to_string();
    let mut cases: Vec<(u16, String, &str)> = Vec::new();
    for (req, says) in [
        (
            http.post(&url)
                .json(&json!({"model": "no-such-model", "prompt": "hi", "max_tokens": 2})),
            "no-such-model",
        ),
        (
            http.post(&url)
                .header("content-type", "application/json")
                .body("{not json"),
            "JSON",
        ),
    ] {
        let r = req.send().await.unwrap();
        let id = r.headers()["x-trace-id"].to_str().unwrap().into();
        cases.push((r.status().as_u16(), id, says));
    }
    // Raw: a body that stops arriving, and one declared over the limit.
    for (head, body) in [
        ("Content-Length: 100", "{\"prompt\": "),
        ("Content-Length: 10000000", ""),
    ] {
        let mut t = tokio::net::TcpStream::connect(&addr).await.unwrap();
        let req = format!(
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{head}\r\n\r\n{body}"
        );
        t.write_all(req.as_bytes()).await.unwrap();
        let mut got = Vec::new();
        let _ =
            tokio::time::timeout(std::time::Duration::from_secs(10), t.read_to_end(&mut got)).await;
        let text = String::from_utf8_lossy(&got).to_string();
        let status: u16 = text
            .get(9..12)
            .and_then(|c| c.parse().ok())
            .unwrap_or_else(|| panic!("{text}"));
        let id = text
            .lines()
            .find_map(|l| {
                l.to_ascii_lowercase()
                    .strip_prefix("x-trace-id: ")
                    .map(str::to_string)
            })
            .unwrap_or_else(|| panic!("no trace id: {text}"));
        cases.push((
            status,
            id,
            if status == 408 {
                "did not arrive"
            } else {
                "larger than"
            },
        ));
    }
    let statuses: Vec<u16> = cases.iter().map(|c| c.0).collect();
    assert_eq!(statuses, [404, 400, 408, 413]);
    for (status, id, says) in cases {
        let root = root_span(&http, &s.base, &id).await;
        assert_eq!(root["attrs"]["http.status_code"], status, "{root}");
        let error = root["error"].as_str().unwrap_or_default();
        assert!(
            error.contains(says),
            "{status}: the trace says {error:?}: {root}"
        );
    }
}

/// Parent-based sampling and bad context.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampling_follows_the_caller_and_bad_context_starts_a_new_trace() {
    let s = Server::start(&["--backend", "sim", "--trace-sample-ratio", "0"]);
    let http = client();
    let send = |tp: Option<String>| {
        let mut r = http
            .post(format!("{}/v1/completions", s.base))
            .json(&json!({"prompt": [5, 6, 7], "max_tokens": 2}));
        if let Some(tp) = tp {
            r = r.header("traceparent", tp);
        }
        r.send()
    };
    // Not sampled here, but the trace id still comes back.
    let r = send(None).await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let id = r.headers()["x-trace-id"].to_str().unwrap().to_string();
    assert_eq!(id.len(), 32);
    let v = get_json(&http, &format!("{}/traces/api/trace/{id}", s.base)).await;
    assert_eq!(v["error"]["code"], "trace_not_found", "{v}");
    // The caller sampled it: kept.
    let sampled = "0af7651916cd43dd8448eb211c80319c";
    let r = send(Some(format!("00-{sampled}-b7ad6b7169203331-01")))
        .await
        .unwrap();
    assert_eq!(r.headers()["x-trace-id"].to_str().unwrap(), sampled);
    let v = get_json(&http, &format!("{}/traces/api/trace/{sampled}", s.base)).await;
    assert!(v["spans"].as_array().is_some_and(|a| !a.is_empty()), "{v}");
    // The caller did not sample it: not kept.
    let unsampled = "1af7651916cd43dd8448eb211c80319c";
    let r = send(Some(format!("00-{unsampled}-b7ad6b7169203331-00")))
        .await
        .unwrap();
    assert_eq!(r.headers()["x-trace-id"].to_str().unwrap(), unsampled);
    let v = get_json(&http, &format!("{}/traces/api/trace/{unsampled}", s.base)).await;
    assert_eq!(v["error"]["code"], "trace_not_found");
    // Garbage context: the request is served on a trace of its own.
    let r = send(Some("00-zzzz-not-a-context".into())).await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert_ne!(r.headers()["x-trace-id"].to_str().unwrap(), sampled);
    // So is context W3C does not let a receiver continue: short or signed ids, uppercase,
    // all-zero ids, version ff, extra fields on version 00.
    let parent = "b7ad6b7169203331";
    for bad in [
        "00-abc-def-00".to_string(),
        format!("00-+{}-{parent}-01", &sampled[1..]),
        format!("00-{}-{parent}-01", sampled.to_uppercase()),
        format!("00-{}-{parent}-01", "0".repeat(32)),
        format!("00-{sampled}-{}-01", "0".repeat(16)),
        format!("ff-{sampled}-{parent}-01"),
        format!("00-{sampled}-{parent}-01-extra"),
    ] {
        let r = send(Some(bad.clone())).await.unwrap();
        assert_eq!(r.status().as_u16(), 200, "{bad}");
        let id = r.headers()["x-trace-id"].to_str().unwrap().to_string();
        assert!(
            id.len() == 32 && id != sampled && !id.ends_with("abc") && id != "0".repeat(32),
            "{bad} was continued as trace {id}"
        );
    }
    // Two traceparent headers: neither is continued.
    let r = http
        .post(format!("{}/v1/completions", s.base))
        .header("traceparent", format!("00-{sampled}-{parent}-01"))
        .header("traceparent", format!("00-{unsampled}-{parent}-01"))
        .json(&json!({"prompt": [5, 6, 7], "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let id = r.headers()["x-trace-id"].to_str().unwrap();
    assert!(id != sampled && id != unsampled, "{id}");
    // Bad ids are refused by name.
    let v = get_json(&http, &format!("{}/traces/api/trace/xyz", s.base)).await;
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("32 hex digits"));
}

fn chromium() -> PathBuf {
    for c in [
        "/usr/bin/chromium",
        "/usr/bin/chromium-browser",
        "/usr/bin/google-chrome",
    ] {
        if Path::new(c).exists() {
            return PathBuf::from(c);
        }
    }
    panic!(
        "no Chromium for the trace viewer's browser test: scripts/test.sh installs Debian's \
         `chromium`, or apt-get install chromium"
    );
}

/// Runs headless Chromium on `url`; returns the DOM after the page's scripts ran, and saves
/// a screenshot to `shot`.
fn browse(url: &str, shot: &Path) -> String {
    let profile = std::env::temp_dir().join(format!("kvmesh-chromium-{}", std::process::id()));
    let flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
        "--virtual-time-budget=8000",
        "--window-size=1400,900",
    ];
    let run = |extra: &str| {
        let out = Command::new(chromium())
            .args(flags)
            .arg(format!("--user-data-dir={}", profile.display()))
            .arg(extra)
            .arg(url)
            .output()
            .expect("run chromium");
        assert!(
            out.status.success(),
            "chromium failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let dom = run("--dump-dom");
    run(&format!("--screenshot={}", shot.display()));
    let _ = std::fs::remove_dir_all(&profile);
    dom
}

/// The viewer in a real browser: it loads, lists the request, and draws its waterfall.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_trace_viewer_lists_the_request_and_draws_its_waterfall() {
    let s = Server::start(&["--backend", "sim", "--max-num-batched-tokens", "16"]);
    let http = client();
    let r = http
        .post(format!("{}/v1/completions", s.base))
        .json(&json!({"prompt": prompt(40), "max_tokens": 5, "ignore_eos": true}))
        .send()
        .await
        .unwrap();
    let id = r.headers()["x-trace-id"].to_str().unwrap().to_string();
    let body: Value = r.json().await.unwrap();
    let request_id = body["id"].as_str().unwrap().to_string();
    let shot = std::env::temp_dir().join(format!("kvmesh-traces-{}.png", std::process::id()));
    let url = format!("{}/traces#trace={id}", s.base);
    let dom = tokio::task::spawn_blocking(move || browse(&url, &shot).to_string())
        .await
        .unwrap();
    assert!(dom.contains(&request_id), "the request is listed:\n{dom}");
    assert!(
        dom.contains(&format!("Trace {id}")),
        "its trace is open:\n{dom}"
    );
    let rows = dom.matches("class=\"wf-row").count();
    assert!(
        rows >= 6,
        "the waterfall has a row per span ({rows}):\n{dom}"
    );
    for name in ["request", "tokenize", "detokenize_stream"] {
        assert!(dom.contains(&format!(">{name}<")), "{name} is drawn");
    }
    let png = std::fs::read(
        std::env::temp_dir().join(format!("kvmesh-traces-{}.png", std::process::id())),
    )
    .expect("a screenshot");
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 10_000,
        "a real screenshot"
    );
}
