//! Tracing at the gateway: every API request gets a root span (continuing a client's
//! `traceparent` when it sends one) and its trace id back in the response headers; and the
//! trace viewer: a page at `/traces` and the JSON it reads.
//!
//! - `GET /traces`: the page (no build step, no CDN: one HTML file with its script). It
//!   holds no data, so it is open; the API below is behind the server's API key (see
//!   [`api_routes`]), which the page asks its user for when the API answers 401.
//! - `GET /traces/api/recent?limit=&min_ms=&failed=`: recent requests seen here.
//! - `GET /traces/api/spans/{trace}`: this node's spans of a trace.
//! - `GET /traces/api/trace/{trace}`: the whole trace, gathered from every node of the
//!   cluster (each serves its own spans), in waterfall order.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, Query, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use kvmesh_telemetry::store::{RequestSummary, SpanRecord, SpanStore};
use kvmesh_telemetry::{set_remote_parent, traceparent, TARGET, TRACE_ID_HEADER};
use serde::Deserialize;
use serde_json::json;
use tracing::Instrument;

use crate::error::{quoted, ErrorNote};
use crate::http;

/// What the viewer reads: this node's store, and the other nodes' HTTP servers.
pub struct Traces {
    pub store: Arc<SpanStore>,
    /// Base URLs of the cluster's other nodes (empty for a single-process server).
    pub peers: Box<dyn Fn() -> Vec<String> + Send + Sync>,
    http: reqwest::Client,
}

impl Traces {
    pub fn new(
        store: Arc<SpanStore>,
        peers: Box<dyn Fn() -> Vec<String> + Send + Sync>,
    ) -> Arc<Traces> {
        Arc::new(Traces {
            store,
            peers,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(2))
                .build()
                .expect("an HTTP client"),
        })
    }

    /// Every node's spans of a trace, deduplicated, in start order. `auth` (the asker's
    /// `Authorization` header) goes with the questions to the other nodes, whose span
    /// routes check the same key.
    pub async fn gather(&self, trace_id: &str, auth: Option<&HeaderValue>) -> Vec<SpanRecord> {
        let mut spans = self.store.trace(trace_id);
        let asks = (self.peers)().into_iter().map(|base| {
            let url = format!("{}/traces/api/spans/{trace_id}", base.trim_end_matches('/'));
            let mut ask = self.http.get(&url);
            if let Some(a) = auth {
                ask = ask.header(header::AUTHORIZATION, a.clone());
            }
            async move {
                match ask.send().await {
                    Ok(r) if r.status().is_success() => {
                        r.json::<Vec<SpanRecord>>().await.unwrap_or_default()
                    }
                    _ => Vec::new(),
                }
            }
        });
        for more in futures::future::join_all(asks).await {
            for s in more {
                if !spans.iter().any(|x| x.span_id == s.span_id) {
                    spans.push(s);
                }
            }
        }
        spans.sort_by_key(|s| s.start_us);
        spans
    }
}

/// The root span of an API request; its trace id goes back in `x-trace-id` and W3C's
/// `traceresponse` headers.
pub async fn trace_request(req: Request, next: Next) -> Response {
    let endpoint = req.uri().path().to_string();
    let span = tracing::info_span!(
        target: TARGET,
        "request",
        otel.kind = "server",
        endpoint = endpoint.as_str(),
        http.status_code = tracing::field::Empty,
        request_id = tracing::field::Empty,
        model = tracing::field::Empty,
        prompt_tokens = tracing::field::Empty,
        max_tokens = tracing::field::Empty,
        stream = tracing::field::Empty,
        ttft_ms = tracing::field::Empty,
        completion_tokens = tracing::field::Empty,
        cached_tokens = tracing::field::Empty,
        finish_reason = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
        otel.status_description = tracing::field::Empty,
    );
    // W3C: a request with more than one `traceparent` carries no context to continue.
    let mut parents = req.headers().get_all("traceparent").iter();
    let parent = match (parents.next(), parents.next()) {
        (Some(one), None) => one.to_str().ok(),
        _ => None,
    };
    set_remote_parent(&span, parent);
    let tp = traceparent(&span);
    let late = req.extensions().get::<http::BodyLate>().cloned();
    let method = req.method().clone();
    let mut resp = next.run(req).instrument(span.clone()).await;
    // A body that missed its deadline failed the handler's read (a 400); the client is
    // answered 408, and so is the trace.
    if let Some(r) = late.and_then(|l| l.response()) {
        resp = r;
    }
    let failed = resp.status().is_server_error() || resp.status().is_client_error();
    if failed && resp.extensions().get::<ErrorNote>().is_none() {
        // axum's own rejections (plain text): the OpenAI shape, and a message to record.
        resp = http::openai_errors(resp, &method, &endpoint).await;
    }
    span.record("http.status_code", resp.status().as_u16());
    if failed {
        span.record("otel.status_code", "ERROR");
        if let Some(ErrorNote(message)) = resp.extensions().get::<ErrorNote>() {
            span.record("otel.status_description", message.as_str());
        }
    }
    if let Some(tp) = tp {
        let headers = resp.headers_mut();
        if let Some(id) = tp.split('-').nth(1) {
            if let Ok(v) = HeaderValue::from_str(id) {
                headers.insert(TRACE_ID_HEADER, v);
            }
        }
        if let Ok(v) = HeaderValue::from_str(&tp) {
            headers.insert("traceresponse", v);
        }
    }
    resp
}

/// The trace viewer's page: static, no data in it.
pub fn page_route<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new().route("/traces", get(page))
}

/// The trace viewer's API; without `traces` (tracing off) it says so. What it answers
/// quotes requests (their error messages), so the router puts it behind the API key.
pub fn api_routes<S: Clone + Send + Sync + 'static>(traces: Option<Arc<Traces>>) -> Router<S> {
    Router::new()
        .route("/traces/api/recent", get(recent))
        .route("/traces/api/spans/{trace}", get(local_spans))
        .route("/traces/api/trace/{trace}", get(whole_trace))
        .with_state(traces)
}

async fn page() -> Response {
    (
        [(header::CACHE_CONTROL, "no-store")],
        Html(include_str!("../assets/traces.html")),
    )
        .into_response()
}

fn off() -> Response {
    (
        StatusCode::NOT_FOUND,
        Json(json!({"error": {"message": "tracing is off on this node", "type": "invalid_request_error", "param": null, "code": "tracing_off"}})),
    )
        .into_response()
}

#[derive(Deserialize)]
struct RecentQuery {
    limit: Option<usize>,
    min_ms: Option<f64>,
    failed: Option<bool>,
}

async fn recent(
    State(traces): State<Option<Arc<Traces>>>,
    Query(q): Query<RecentQuery>,
) -> Response {
    let Some(t) = &traces else { return off() };
    let list: Vec<RequestSummary> = t.store.recent(
        q.limit.unwrap_or(100).min(1000),
        q.min_ms.unwrap_or(0.0),
        q.failed.unwrap_or(false),
    );
    let (spans, bytes) = t.store.usage();
    Json(json!({"node": t.store.node(), "requests": list, "store": {"spans": spans, "bytes": bytes}}))
        .into_response()
}

fn valid_trace_id(id: &str) -> bool {
    id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit())
}

async fn local_spans(
    State(traces): State<Option<Arc<Traces>>>,
    Path(trace): Path<String>,
) -> Response {
    let Some(t) = &traces else { return off() };
    if !valid_trace_id(&trace) {
        return bad_id(&trace);
    }
    Json(t.store.trace(&trace)).into_response()
}

fn bad_id(id: &str) -> Response {
    (
        StatusCode::BAD_REQUEST,
        Json(json!({"error": {"message": format!("{} is not a trace id (32 hex digits)", quoted(id)), "type": "invalid_request_error", "param": "trace", "code": null}})),
    )
        .into_response()
}

async fn whole_trace(
    State(traces): State<Option<Arc<Traces>>>,
    Path(trace): Path<String>,
    headers: HeaderMap,
) -> Response {
    let Some(t) = &traces else { return off() };
    if !valid_trace_id(&trace) {
        return bad_id(&trace);
    }
    let auth = headers.get(header::AUTHORIZATION);
    let spans = t.gather(&trace.to_ascii_lowercase(), auth).await;
    if spans.is_empty() {
        return (
            StatusCode::NOT_FOUND,
            Json(json!({"error": {"message": format!("no spans of trace {trace} on any node (not sampled, or evicted)"), "type": "invalid_request_error", "param": "trace", "code": "trace_not_found"}})),
        )
            .into_response();
    }
    let order: Vec<serde_json::Value> = kvmesh_telemetry::view::waterfall(&spans)
        .into_iter()
        .map(|(depth, s)| {
            let mut v = serde_json::to_value(s).unwrap_or_default();
            v["depth"] = json!(depth);
            v
        })
        .collect();
    Json(json!({"trace_id": trace, "spans": order})).into_response()
}
