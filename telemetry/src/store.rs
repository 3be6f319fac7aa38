//! Recent spans in memory, bounded by count and by bytes: what the trace viewer reads.
//! Oldest spans go first when either bound is reached.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use opentelemetry::{KeyValue, Value};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{Span, SpanData, SpanProcessor};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use serde_json::Value as Json;

/// One finished span, as the viewer shows it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SpanRecord {
    pub trace_id: String,
    pub span_id: String,
    /// `None` for a trace's root.
    pub parent_id: Option<String>,
    pub name: String,
    /// The node that recorded it.
    pub node: String,
    /// Unix time in microseconds.
    pub start_us: u64,
    pub end_us: u64,
    /// Set when the span ended in error.
    pub error: Option<String>,
    pub attrs: serde_json::Map<String, Json>,
    pub events: Vec<EventRecord>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EventRecord {
    pub name: String,
    pub t_us: u64,
    pub attrs: serde_json::Map<String, Json>,
}

impl SpanRecord {
    pub fn duration_us(&self) -> u64 {
        self.end_us.saturating_sub(self.start_us)
    }

    /// Roughly what it takes in memory.
    fn size(&self) -> usize {
        let map = |m: &serde_json::Map<String, Json>| {
            m.iter()
                .map(|(k, v)| k.len() + 16 + json_size(v))
                .sum::<usize>()
        };
        200 + self.name.len()
            + self.node.len()
            + self.error.as_ref().map_or(0, String::len)
            + map(&self.attrs)
            + self
                .events
                .iter()
                .map(|e| 48 + e.name.len() + map(&e.attrs))
                .sum::<usize>()
    }
}

fn json_size(v: &Json) -> usize {
    match v {
        Json::String(s) => 24 + s.len(),
        Json::Array(a) => 24 + a.iter().map(json_size).sum::<usize>(),
        _ => 16,
    }
}

fn unix_us(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

fn to_json(v: &Value) -> Json {
    match v {
        Value::Bool(b) => Json::Bool(*b),
        Value::I64(i) => Json::from(*i),
        Value::F64(f) => serde_json::Number::from_f64(*f).map_or(Json::Null, Json::Number),
        // tracing-opentelemetry records unsigned integers as strings (they may not fit an
        // i64); numbers they are.
        Value::String(s) => match s.as_str().parse::<u64>() {
            Ok(n) if !s.as_str().starts_with('0') || s.as_str() == "0" => Json::from(n),
            _ => Json::String(s.as_str().to_string()),
        },
        other => Json::String(other.to_string()),
    }
}

/// Attributes worth showing: not the bookkeeping tracing-opentelemetry adds.
fn attrs(kvs: &[KeyValue]) -> serde_json::Map<String, Json> {
    kvs.iter()
        .filter(|kv| {
            let k = kv.key.as_str();
            !(k.starts_with("code.") || k.starts_with("thread.") || k == "level" || k == "target")
        })
        .map(|kv| (kv.key.as_str().to_string(), to_json(&kv.value)))
        .collect()
}

impl SpanRecord {
    fn from_data(d: &SpanData, node: &str) -> SpanRecord {
        use opentelemetry::trace::{SpanId, Status};
        SpanRecord {
            trace_id: d.span_context.trace_id().to_string(),
            span_id: d.span_context.span_id().to_string(),
            parent_id: (d.parent_span_id != SpanId::INVALID).then(|| d.parent_span_id.to_string()),
            name: d.name.to_string(),
            node: node.to_string(),
            start_us: unix_us(d.start_time),
            end_us: unix_us(d.end_time),
            error: match &d.status {
                Status::Error { description } => Some(description.to_string()),
                _ => None,
            },
            attrs: attrs(&d.attributes),
            events: d
                .events
                .iter()
                .map(|e| EventRecord {
                    name: e.name.to_string(),
                    t_us: unix_us(e.timestamp),
                    attrs: attrs(&e.attributes),
                })
                .collect(),
        }
    }
}

/// A request as the recent list shows it (from its root span on the gateway).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RequestSummary {
    pub trace_id: String,
    pub start_us: u64,
    pub duration_ms: f64,
    pub name: String,
    pub request_id: Option<String>,
    pub model: Option<String>,
    pub endpoint: Option<String>,
    pub status: Option<i64>,
    pub ttft_ms: Option<f64>,
    pub tokens: Option<i64>,
    pub error: Option<String>,
    /// Nodes that took part, as far as this node's spans say.
    pub nodes: Vec<String>,
}

#[derive(Default)]
struct Inner {
    spans: VecDeque<Arc<SpanRecord>>,
    by_trace: HashMap<String, Vec<Arc<SpanRecord>>>,
    bytes: usize,
}

pub struct SpanStore {
    node: String,
    max_spans: usize,
    max_bytes: usize,
    inner: Mutex<Inner>,
}

impl SpanStore {
    pub fn new(node: String, max_spans: usize, max_bytes: usize) -> SpanStore {
        SpanStore {
            node,
            max_spans: max_spans.max(1),
            max_bytes,
            inner: Mutex::new(Inner::default()),
        }
    }

    pub fn node(&self) -> &str {
        &self.node
    }

    pub fn push(&self, r: SpanRecord) {
        let size = r.size();
        let r = Arc::new(r);
        let mut g = self.inner.lock();
        g.bytes += size;
        g.by_trace
            .entry(r.trace_id.clone())
            .or_default()
            .push(r.clone());
        g.spans.push_back(r);
        while g.spans.len() > self.max_spans || (g.bytes > self.max_bytes && g.spans.len() > 1) {
            let old = g.spans.pop_front().expect("non-empty");
            g.bytes = g.bytes.saturating_sub(old.size());
            if let Some(v) = g.by_trace.get_mut(&old.trace_id) {
                v.retain(|s| !Arc::ptr_eq(s, &old));
                if v.is_empty() {
                    g.by_trace.remove(&old.trace_id);
                }
            }
        }
    }

    /// (spans, bytes) held.
    pub fn usage(&self) -> (usize, usize) {
        let g = self.inner.lock();
        (g.spans.len(), g.bytes)
    }

    /// This node's spans of one trace, in start order.
    pub fn trace(&self, trace_id: &str) -> Vec<SpanRecord> {
        let g = self.inner.lock();
        let mut v: Vec<SpanRecord> = g
            .by_trace
            .get(&trace_id.to_ascii_lowercase())
            .map(|v| v.iter().map(|s| (**s).clone()).collect())
            .unwrap_or_default();
        v.sort_by_key(|s| s.start_us);
        v
    }

    /// The newest requests (root `request` spans recorded here), newest first: at most
    /// `limit`, at least `min_ms` long, only failed ones when `failed_only`.
    pub fn recent(&self, limit: usize, min_ms: f64, failed_only: bool) -> Vec<RequestSummary> {
        let g = self.inner.lock();
        let mut out = Vec::new();
        for s in g.spans.iter().rev() {
            if out.len() >= limit {
                break;
            }
            if s.name != "request" {
                continue;
            }
            let ms = s.duration_us() as f64 / 1e3;
            let status = s.attrs.get("http.status_code").and_then(Json::as_i64);
            let failed = s.error.is_some() || status.is_some_and(|c| c >= 400);
            if ms < min_ms || (failed_only && !failed) {
                continue;
            }
            let mut nodes = vec![s.node.clone()];
            for other in g.by_trace.get(&s.trace_id).into_iter().flatten() {
                for key in ["worker", "prefill_worker"] {
                    if let Some(n) = other.attrs.get(key).and_then(Json::as_str) {
                        if !n.is_empty() && !nodes.iter().any(|x| x == n) {
                            nodes.push(n.to_string());
                        }
                    }
                }
            }
            let str_attr = |k: &str| s.attrs.get(k).and_then(Json::as_str).map(String::from);
            out.push(RequestSummary {
                trace_id: s.trace_id.clone(),
                start_us: s.start_us,
                duration_ms: ms,
                name: s.name.clone(),
                request_id: str_attr("request_id"),
                model: str_attr("model"),
                endpoint: str_attr("endpoint"),
                status,
                ttft_ms: s.attrs.get("ttft_ms").and_then(Json::as_f64),
                tokens: s.attrs.get("completion_tokens").and_then(Json::as_i64),
                error: s.error.clone(),
                nodes,
            });
        }
        out
    }
}

/// Feeds finished, sampled spans into a store.
#[derive(Debug)]
pub(crate) struct StoreProcessor(pub Arc<SpanStore>);

impl std::fmt::Debug for SpanStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (n, b) = self.usage();
        write!(f, "SpanStore({} spans, {b} bytes)", n)
    }
}

impl SpanProcessor for StoreProcessor {
    fn on_start(&self, _span: &mut Span, _cx: &opentelemetry::Context) {}

    fn on_end(&self, span: SpanData) {
        if span.span_context.is_sampled() {
            self.0.push(SpanRecord::from_data(&span, &self.0.node));
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }

    fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn rec(trace: &str, span: &str, parent: Option<&str>, name: &str) -> SpanRecord {
        SpanRecord {
            trace_id: trace.into(),
            span_id: span.into(),
            parent_id: parent.map(String::from),
            name: name.into(),
            node: "n".into(),
            start_us: 1_000,
            end_us: 3_000,
            error: None,
            attrs: Default::default(),
            events: vec![],
        }
    }

    #[test]
    fn bounded_by_count_and_bytes_oldest_first() {
        let s = SpanStore::new("n".into(), 3, usize::MAX);
        for i in 0..5 {
            s.push(rec(&format!("t{i}"), "s", None, "x"));
        }
        assert_eq!(s.usage().0, 3);
        assert!(s.trace("t0").is_empty() && s.trace("t1").is_empty());
        assert_eq!(s.trace("t4").len(), 1);
        let one = rec("a", "s", None, "x").size();
        let s = SpanStore::new("n".into(), 100, one * 2 + 1);
        for i in 0..5 {
            s.push(rec(&format!("t{i}"), "s", None, "x"));
        }
        assert_eq!(s.usage().0, 2);
        assert!(s.usage().1 <= one * 2 + 1);
    }

    #[test]
    fn recent_requests_filter_and_name_the_nodes() {
        let s = SpanStore::new("gw".into(), 100, usize::MAX);
        let mut ok = rec("t1", "r1", None, "request");
        ok.attrs.insert("http.status_code".into(), Json::from(200));
        let mut attempt = rec("t1", "a1", Some("r1"), "attempt");
        attempt.attrs.insert("worker".into(), Json::from("d1"));
        attempt
            .attrs
            .insert("prefill_worker".into(), Json::from("p1"));
        let mut bad = rec("t2", "r2", None, "request");
        bad.attrs.insert("http.status_code".into(), Json::from(503));
        bad.end_us = 500_000;
        for r in [ok, attempt, bad] {
            s.push(r);
        }
        let all = s.recent(10, 0.0, false);
        assert_eq!(all.len(), 2);
        assert_eq!(all[0].trace_id, "t2", "newest first");
        assert_eq!(all[1].nodes, vec!["n", "d1", "p1"]);
        assert_eq!(s.recent(10, 0.0, true).len(), 1);
        assert_eq!(s.recent(10, 100.0, false)[0].trace_id, "t2");
    }
}
