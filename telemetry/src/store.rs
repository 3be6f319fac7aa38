//! Recent spans in memory, bounded by count and by bytes: what the trace viewer reads.
//! Oldest spans go first when either bound is reached. Spans are kept as the SDK hands
//! them over and turned into [`SpanRecord`]s only when someone asks, so a request pays for a
//! move into a queue, not for a conversion.

use std::borrow::Cow;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use opentelemetry::trace::TraceId;
use opentelemetry::{Key, KeyValue, Value};
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

/// The longest text a kept span holds in one place (its name, status message, an attribute's
/// key or value, an event's name); longer text is cut there, with a marker ([`clip`]).
pub const MAX_TEXT: usize = 1024;

/// The most one kept span may cost ([`Kept::new`]'s estimate): attributes, events and links
/// past it are dropped, and counted in the span's dropped counts.
pub const MAX_SPAN_BYTES: usize = 64 << 10;

/// `s` if it is at most `max` bytes long; else its first `max` bytes at most (cut on a char
/// boundary), then `… (N bytes)` with its whole length.
pub fn clip(s: &str, max: usize) -> Cow<'_, str> {
    if s.len() <= max {
        return Cow::Borrowed(s);
    }
    let mut cut = max;
    while !s.is_char_boundary(cut) {
        cut -= 1;
    }
    Cow::Owned(format!("{}… ({} bytes)", &s[..cut], s.len()))
}

/// Cuts a kept text to [`MAX_TEXT`]; its length after.
fn clip_cow(c: &mut Cow<'static, str>) -> usize {
    if c.len() > MAX_TEXT {
        *c = Cow::Owned(clip(c, MAX_TEXT).into_owned());
    }
    c.len()
}

/// Cuts an attribute's key and value to [`MAX_TEXT`] (an array that would show longer
/// becomes the text it shows, cut); what it costs then.
fn clip_kv(kv: &mut KeyValue) -> usize {
    if kv.key.as_str().len() > MAX_TEXT {
        kv.key = Key::from(clip(kv.key.as_str(), MAX_TEXT).into_owned());
    }
    let value = match &kv.value {
        Value::String(s) if s.as_str().len() > MAX_TEXT => {
            Some(Value::from(clip(s.as_str(), MAX_TEXT).into_owned()))
        }
        Value::Array(a) => {
            let shown = a.to_string();
            (shown.len() > MAX_TEXT).then(|| Value::from(clip(&shown, MAX_TEXT).into_owned()))
        }
        _ => None,
    };
    if let Some(v) = value {
        kv.value = v;
    }
    48 + kv.key.as_str().len()
        + match &kv.value {
            Value::String(s) => s.as_str().len(),
            Value::Array(a) => a.to_string().len(),
            _ => 0,
        }
}

/// Keeps the attributes that fit in `left` bytes (each cut first), counting the others in
/// `dropped`; what the kept ones cost.
fn keep_kvs(kvs: &mut Vec<KeyValue>, dropped: &mut u32, left: &mut usize) -> usize {
    let mut cost = 0;
    kvs.retain_mut(|kv| {
        let c = clip_kv(kv);
        let fits = c <= *left;
        if fits {
            *left -= c;
            cost += c;
        } else {
            *dropped = dropped.saturating_add(1);
        }
        fits
    });
    cost
}

/// A finished span as kept: the SDK's data, cut to its bounds, and what it costs.
struct Kept {
    data: SpanData,
    size: usize,
}

impl Kept {
    /// Every text the span holds is cut to [`MAX_TEXT`], and the span to [`MAX_SPAN_BYTES`];
    /// `size` counts all it keeps: name, status message, attributes, events, links.
    fn new(mut data: SpanData) -> Kept {
        use opentelemetry::trace::Status;
        let d = &mut data;
        let mut base = 320 + clip_cow(&mut d.name);
        if let Status::Error { description } = &mut d.status {
            base += clip_cow(description);
        }
        // Two texts of MAX_TEXT and the fixed part always fit.
        let mut left = MAX_SPAN_BYTES - base;
        keep_kvs(
            &mut d.attributes,
            &mut d.dropped_attributes_count,
            &mut left,
        );
        let mut dropped_events = 0u32;
        d.events.events.retain_mut(|e| {
            let c = 64 + clip_cow(&mut e.name);
            if c > left {
                dropped_events += 1;
                return false;
            }
            left -= c;
            keep_kvs(
                &mut e.attributes,
                &mut e.dropped_attributes_count,
                &mut left,
            );
            true
        });
        d.events.dropped_count = d.events.dropped_count.saturating_add(dropped_events);
        let mut dropped_links = 0u32;
        d.links.links.retain_mut(|l| {
            if 96 > left {
                dropped_links += 1;
                return false;
            }
            left -= 96;
            keep_kvs(
                &mut l.attributes,
                &mut l.dropped_attributes_count,
                &mut left,
            );
            true
        });
        d.links.dropped_count = d.links.dropped_count.saturating_add(dropped_links);
        Kept {
            data,
            size: MAX_SPAN_BYTES - left,
        }
    }

    fn trace_id(&self) -> TraceId {
        self.data.span_context.trace_id()
    }
}

#[derive(Default)]
struct Inner {
    spans: VecDeque<Arc<Kept>>,
    by_trace: HashMap<TraceId, Vec<Arc<Kept>>>,
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

    fn push(&self, data: SpanData) {
        let k = Arc::new(Kept::new(data));
        let mut g = self.inner.lock();
        g.bytes += k.size;
        g.by_trace.entry(k.trace_id()).or_default().push(k.clone());
        g.spans.push_back(k);
        while g.spans.len() > self.max_spans || (g.bytes > self.max_bytes && g.spans.len() > 1) {
            let old = g.spans.pop_front().expect("non-empty");
            g.bytes = g.bytes.saturating_sub(old.size);
            let t = old.trace_id();
            if let Some(v) = g.by_trace.get_mut(&t) {
                v.retain(|s| !Arc::ptr_eq(s, &old));
                if v.is_empty() {
                    g.by_trace.remove(&t);
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
        let Ok(t) = TraceId::from_hex(trace_id) else {
            return Vec::new();
        };
        let kept: Vec<Arc<Kept>> = self
            .inner
            .lock()
            .by_trace
            .get(&t)
            .cloned()
            .unwrap_or_default();
        let mut v: Vec<SpanRecord> = kept
            .iter()
            .map(|k| SpanRecord::from_data(&k.data, &self.node))
            .collect();
        v.sort_by_key(|s| s.start_us);
        v
    }

    /// The newest requests (root `request` spans recorded here), newest first: at most
    /// `limit`, at least `min_ms` long, only failed ones when `failed_only`.
    pub fn recent(&self, limit: usize, min_ms: f64, failed_only: bool) -> Vec<RequestSummary> {
        // The candidates and their traces' spans under the lock; the conversion after.
        let picked: Vec<(Arc<Kept>, Vec<Arc<Kept>>)> = {
            let g = self.inner.lock();
            let mut out = Vec::new();
            for k in g.spans.iter().rev() {
                if out.len() >= limit {
                    break;
                }
                if k.data.name != "request" {
                    continue;
                }
                let ms = k
                    .data
                    .end_time
                    .duration_since(k.data.start_time)
                    .unwrap_or_default()
                    .as_secs_f64()
                    * 1e3;
                let failed = matches!(k.data.status, opentelemetry::trace::Status::Error { .. })
                    || k.data.attributes.iter().any(|kv| {
                        kv.key.as_str() == "http.status_code"
                            && kv.value.as_str().parse::<u16>().is_ok_and(|c| c >= 400)
                    });
                if ms < min_ms || (failed_only && !failed) {
                    continue;
                }
                let others = g.by_trace.get(&k.trace_id()).cloned().unwrap_or_default();
                out.push((k.clone(), others));
            }
            out
        };
        picked
            .into_iter()
            .map(|(k, others)| {
                let s = SpanRecord::from_data(&k.data, &self.node);
                let mut nodes = vec![s.node.clone()];
                for o in &others {
                    for kv in &o.data.attributes {
                        if matches!(kv.key.as_str(), "worker" | "prefill_worker") {
                            let n = kv.value.as_str();
                            let new = !nodes.iter().any(|x| x.as_str() == n);
                            if !n.is_empty() && new && nodes.len() < MAX_NODES {
                                nodes.push(n.to_string());
                            }
                        }
                    }
                }
                let str_attr =
                    |key: &str| s.attrs.get(key).and_then(Json::as_str).map(String::from);
                RequestSummary {
                    trace_id: s.trace_id.clone(),
                    start_us: s.start_us,
                    duration_ms: s.duration_us() as f64 / 1e3,
                    name: s.name.clone(),
                    request_id: str_attr("request_id"),
                    model: str_attr("model"),
                    endpoint: str_attr("endpoint"),
                    status: s.attrs.get("http.status_code").and_then(Json::as_i64),
                    ttft_ms: s.attrs.get("ttft_ms").and_then(Json::as_f64),
                    tokens: s.attrs.get("completion_tokens").and_then(Json::as_i64),
                    error: s.error.clone(),
                    nodes,
                }
            })
            .collect()
    }
}

/// The most nodes a request's summary names (a request crosses a few).
const MAX_NODES: usize = 64;

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
            self.0.push(span);
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
    use opentelemetry::trace::{SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceState};
    use std::time::{Duration, UNIX_EPOCH};

    fn data(
        trace: u128,
        span: u64,
        parent: u64,
        name: &str,
        ms: u64,
        attrs: Vec<KeyValue>,
    ) -> SpanData {
        let start = UNIX_EPOCH + Duration::from_secs(1_000);
        SpanData {
            span_context: SpanContext::new(
                TraceId::from(trace),
                SpanId::from(span),
                TraceFlags::SAMPLED,
                false,
                TraceState::default(),
            ),
            parent_span_id: SpanId::from(parent),
            parent_span_is_remote: false,
            span_kind: SpanKind::Internal,
            name: name.to_string().into(),
            start_time: start,
            end_time: start + Duration::from_millis(ms),
            attributes: attrs,
            dropped_attributes_count: 0,
            events: Default::default(),
            links: Default::default(),
            status: Status::Unset,
            instrumentation_scope: Default::default(),
        }
    }

    fn hex(t: u128) -> String {
        TraceId::from(t).to_string()
    }

    #[test]
    fn bounded_by_count_and_bytes_oldest_first() {
        let s = SpanStore::new("n".into(), 3, usize::MAX);
        for i in 1..=5 {
            s.push(data(i, 1, 0, "x", 1, vec![]));
        }
        assert_eq!(s.usage().0, 3);
        assert!(s.trace(&hex(1)).is_empty() && s.trace(&hex(2)).is_empty());
        assert_eq!(s.trace(&hex(5)).len(), 1);
        let one = Kept::new(data(9, 1, 0, "x", 1, vec![])).size;
        let s = SpanStore::new("n".into(), 100, one * 2 + 1);
        for i in 1..=5 {
            s.push(data(i, 1, 0, "x", 1, vec![]));
        }
        assert_eq!(s.usage().0, 2);
        assert!(s.usage().1 <= one * 2 + 1);
    }

    #[test]
    fn records_carry_numbers_and_parents() {
        let s = SpanStore::new("gw".into(), 100, usize::MAX);
        s.push(data(
            7,
            2,
            1,
            "attempt",
            3,
            vec![
                KeyValue::new("tokens", "42"),
                KeyValue::new("id", "0042"),
                KeyValue::new("worker", "d1"),
            ],
        ));
        let r = &s.trace(&hex(7))[0];
        assert_eq!(
            r.attrs["tokens"],
            Json::from(42),
            "unsigned numbers come back as numbers"
        );
        assert_eq!(
            r.attrs["id"],
            Json::from("0042"),
            "but not ids with leading zeros"
        );
        assert_eq!(
            r.parent_id.as_deref(),
            Some(SpanId::from(1).to_string().as_str())
        );
        assert_eq!((r.node.as_str(), r.duration_us()), ("gw", 3_000));
        assert!(s.trace("not hex").is_empty());
    }

    #[test]
    fn recent_requests_filter_and_name_the_nodes() {
        let s = SpanStore::new("gw".into(), 100, usize::MAX);
        s.push(data(
            1,
            1,
            0,
            "request",
            2,
            vec![KeyValue::new("http.status_code", "200")],
        ));
        s.push(data(
            1,
            2,
            1,
            "attempt",
            1,
            vec![
                KeyValue::new("worker", "d1"),
                KeyValue::new("prefill_worker", "p1"),
            ],
        ));
        s.push(data(
            2,
            3,
            0,
            "request",
            500,
            vec![KeyValue::new("http.status_code", "503")],
        ));
        let all = s.recent(10, 0.0, false);
        assert_eq!(all.len(), 2);
        assert_eq!(all[0].trace_id, hex(2), "newest first");
        assert_eq!(all[0].status, Some(503));
        assert_eq!(all[1].nodes, vec!["gw", "d1", "p1"]);
        assert_eq!(s.recent(10, 0.0, true).len(), 1);
        assert_eq!(s.recent(10, 100.0, false)[0].trace_id, hex(2));
    }
    #[test]
    fn clip_cuts_on_a_char_boundary_and_says_how_long() {
        assert_eq!(clip("short", 10), "short");
        let s = "é".repeat(100); // 200 bytes
        let c = clip(&s, 11);
        assert!(c.starts_with(&"é".repeat(5)), "{c}");
        assert!(c.ends_with("… (200 bytes)"), "{c}");
        assert_eq!(c.len(), 10 + "… (200 bytes)".len());
    }

    #[test]
    fn a_huge_status_message_is_cut_and_counted() {
        let big = "m".repeat(1 << 20);
        let mut d = data(1, 1, 0, "request", 1, vec![]);
        d.status = Status::error(big.clone());
        let plain = Kept::new(data(1, 1, 0, "request", 1, vec![])).size;
        let k = Kept::new(d);
        let Status::Error { description } = &k.data.status else {
            panic!("the status is kept");
        };
        assert!(description.len() <= MAX_TEXT + 32, "{}", description.len());
        assert!(description.ends_with("… (1048576 bytes)"));
        assert_eq!(k.size, plain + description.len(), "the message is counted");
        // A store of 10 such spans' worth holds about 10 of them, not 10 MB.
        let s = SpanStore::new("n".into(), 1000, k.size * 10);
        for i in 1..=100u128 {
            let mut d = data(i, 1, 0, "request", 1, vec![]);
            d.status = Status::error(big.clone());
            s.push(d);
        }
        let (n, bytes) = s.usage();
        assert_eq!(n, 10);
        assert!(bytes <= k.size * 10);
        let recent = s.recent(1000, 0.0, false);
        let json = serde_json::to_string(&recent).unwrap();
        assert!(json.len() < 10 * (MAX_TEXT + 1024), "{}", json.len());
    }

    #[test]
    fn one_span_is_bounded_whatever_it_holds() {
        let big = "v".repeat(4 * MAX_TEXT);
        let attrs: Vec<KeyValue> = (0..100)
            .map(|i| KeyValue::new(format!("k{i}"), big.clone()))
            .collect();
        let mut d = data(1, 1, 0, &"n".repeat(1 << 20), 1, attrs.clone());
        d.events.events = (0..50)
            .map(|_| opentelemetry::trace::Event::new(big.clone(), UNIX_EPOCH, attrs.clone(), 0))
            .collect();
        d.links.links = vec![opentelemetry::trace::Link::new(
            SpanContext::empty_context(),
            attrs,
            0,
        )];
        let k = Kept::new(d);
        assert!(k.size <= MAX_SPAN_BYTES, "{}", k.size);
        assert!(k.data.name.len() <= MAX_TEXT + 32);
        assert!(k
            .data
            .attributes
            .iter()
            .all(|kv| kv.value.as_str().len() <= MAX_TEXT + 32));
        assert!(
            k.data.dropped_attributes_count > 0,
            "what did not fit is counted"
        );
        assert!(k.data.events.dropped_count > 0);
        assert!(
            k.data.links.dropped_count > 0 || k.data.links[0].dropped_attributes_count > 0,
            "a link fits, or not, but not its attributes"
        );
        // What the store answers for it is as small.
        let s = SpanStore::new("n".into(), 10, usize::MAX);
        s.push(k.data.clone());
        let json = serde_json::to_string(&s.trace(&hex(1))).unwrap();
        assert!(json.len() < 2 * MAX_SPAN_BYTES, "{}", json.len());
    }
}
