//! Tracing for kvmesh: every request leaves one trace across the nodes it touched.
//!
//! Request-path code opens `tracing` spans with the target [`TARGET`]; those (and only those)
//! become OpenTelemetry spans, through `tracing-opentelemetry`, and are
//! - kept in this node's bounded [`SpanStore`] (by count and by bytes), which the trace
//!   viewer reads;
//! - exported by OTLP/HTTP to a collector (Jaeger, Tempo, …) when `--otlp-endpoint` is set.
//!
//! Sampling is parent-based: a request whose caller sampled it is sampled on every node; a
//! request that starts here is sampled with `--trace-sample-ratio`. W3C trace context moves
//! between nodes as a `traceparent` string ([`traceparent`], [`set_remote_parent`]).
//!
//! Log lines (every other target) go to stderr as before, filtered by `RUST_LOG`.

pub mod metrics;
pub mod phases;
pub mod store;
pub mod view;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use opentelemetry::KeyValue;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};
use opentelemetry_sdk::Resource;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::{EnvFilter, Layer};

pub use store::{clip, SpanRecord, SpanStore};

/// The `tracing` target of request-path spans and their events.
pub const TARGET: &str = "kvmesh_trace";

/// The header a response's trace id is in, besides W3C's `traceresponse`.
pub const TRACE_ID_HEADER: &str = "x-trace-id";

#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("--trace-sample-ratio {0} is not between 0 and 1")]
    Ratio(f64),
    #[error("the OTLP exporter for {endpoint}: {reason}")]
    Otlp { endpoint: String, reason: String },
    #[error("a global tracing subscriber is already set: {0}")]
    Installed(String),
}

#[derive(Clone, Debug)]
pub struct TelemetryConfig {
    /// How spans name their node.
    pub node_id: String,
    /// OTLP/HTTP traces endpoint (`http://host:4318/v1/traces`; a base URL gets the path).
    pub otlp_endpoint: Option<String>,
    /// Fraction of requests starting here that are traced (0 to 1).
    pub sample_ratio: f64,
    /// Bounds of the in-memory store.
    pub store_spans: usize,
    pub store_bytes: usize,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        TelemetryConfig {
            node_id: "kvmesh".into(),
            otlp_endpoint: None,
            sample_ratio: 1.0,
            store_spans: 50_000,
            store_bytes: 32 << 20,
        }
    }
}

/// The running pipeline; `shutdown` flushes what the exporter still holds.
pub struct Telemetry {
    pub store: Arc<SpanStore>,
    provider: SdkTracerProvider,
}

impl Telemetry {
    pub fn shutdown(&self) {
        let _ = self.provider.force_flush();
        let _ = self.provider.shutdown_with_timeout(Duration::from_secs(3));
    }
}

/// Installs the global subscriber: log lines to stderr (`RUST_LOG`, default `info`) and
/// request spans to the store and the exporter.
pub fn init(cfg: TelemetryConfig) -> Result<Telemetry, TelemetryError> {
    if !(0.0..=1.0).contains(&cfg.sample_ratio) || cfg.sample_ratio.is_nan() {
        return Err(TelemetryError::Ratio(cfg.sample_ratio));
    }
    let store = Arc::new(SpanStore::new(
        cfg.node_id.clone(),
        cfg.store_spans,
        cfg.store_bytes,
    ));
    let mut builder = SdkTracerProvider::builder()
        .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
            cfg.sample_ratio,
        ))))
        .with_resource(
            Resource::builder()
                .with_service_name("kvmesh")
                .with_attribute(KeyValue::new("service.instance.id", cfg.node_id.clone()))
                .build(),
        )
        .with_span_processor(store::StoreProcessor(store.clone()));
    if let Some(endpoint) = &cfg.otlp_endpoint {
        use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
        let url = otlp_traces_url(endpoint);
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_endpoint(url.clone())
            .with_timeout(Duration::from_secs(5))
            .with_headers(HashMap::new())
            .build()
            .map_err(|e| TelemetryError::Otlp {
                endpoint: url,
                reason: e.to_string(),
            })?;
        builder = builder.with_batch_exporter(exporter);
    }
    let provider = builder.build();
    let tracer = provider.tracer("kvmesh");
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());

    let spans = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_location(false)
        .with_threads(false)
        .with_tracked_inactivity(false)
        .with_filter(Targets::new().with_target(TARGET, tracing::Level::TRACE));
    let filter = log_filter();
    // Libraries that log through the `log` crate are bridged at the level the log filter
    // wants, not at the request spans' TRACE (which would turn every debug line of every
    // library into a filtered-out event: a measurable cost per request).
    let log_level = {
        use tracing_log::AsLog;
        filter
            .max_level_hint()
            .unwrap_or(tracing_subscriber::filter::LevelFilter::TRACE)
            .as_log()
    };
    let logs = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_filter(filter);
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(logs).with(spans))
        .map_err(|e| TelemetryError::Installed(e.to_string()))?;
    tracing_log::LogTracer::builder()
        .with_max_level(log_level)
        .init()
        .map_err(|e| TelemetryError::Installed(e.to_string()))?;
    Ok(Telemetry { store, provider })
}

/// Log lines as `RUST_LOG` says (default `info`), never the request spans' own events.
pub fn log_filter() -> EnvFilter {
    let user = std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into());
    EnvFilter::try_new(format!("{user},{TARGET}=off"))
        .unwrap_or_else(|_| EnvFilter::new(format!("info,{TARGET}=off")))
}

/// OTLP/HTTP wants the signal's path; a bare collector address gets `/v1/traces`.
fn otlp_traces_url(endpoint: &str) -> String {
    let e = endpoint.trim_end_matches('/');
    if e.ends_with("/v1/traces") {
        e.to_string()
    } else {
        format!("{e}/v1/traces")
    }
}

/// The W3C `traceparent` of `span`, to send to the next hop (`None` when no tracing is set
/// up or the span has no valid context).
pub fn traceparent(span: &tracing::Span) -> Option<String> {
    let cx = span.context();
    if !cx.span().span_context().is_valid() {
        return None;
    }
    let mut carrier = HashMap::new();
    TraceContextPropagator::new().inject_context(&cx, &mut carrier);
    carrier.remove("traceparent")
}

/// Whether `tp` is a `traceparent` W3C Trace Context lets a receiver continue: a version
/// (two lowercase hex digits, not `ff`), a trace id of 32 and a parent id of 16 lowercase hex
/// digits, neither all zeros, and flags of two; `-` between them. Version 00 has exactly those
/// four fields; a later version may add fields after another `-`.
pub fn valid_traceparent(tp: &str) -> bool {
    let hex = |s: &str, n: usize| {
        s.len() == n
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    let b = tp.as_bytes();
    if b.len() < 55 || [2, 35, 52].iter().any(|&i| b[i] != b'-') {
        return false;
    }
    let (version, trace, parent, flags) = (&tp[..2], &tp[3..35], &tp[36..52], &tp[53..55]);
    let nonzero = |s: &str| s.bytes().any(|c| c != b'0');
    let rest_ok = match version {
        "00" => b.len() == 55,
        _ => b.len() == 55 || b[55] == b'-',
    };
    hex(version, 2)
        && version != "ff"
        && hex(trace, 32)
        && nonzero(trace)
        && hex(parent, 16)
        && nonzero(parent)
        && hex(flags, 2)
        && rest_ok
}

/// Makes `span` the child of the remote span a `traceparent` names. Malformed or absent
/// context is ignored (`valid_traceparent`): the span then starts a trace of its own.
pub fn set_remote_parent(span: &tracing::Span, traceparent: Option<&str>) {
    let Some(tp) = traceparent.filter(|tp| valid_traceparent(tp)) else {
        return;
    };
    // A later version's extra fields are not ours to read: continue from the four we know.
    let tp = &tp[..55];
    let mut carrier = HashMap::new();
    carrier.insert("traceparent".to_string(), tp.to_string());
    let cx = TraceContextPropagator::new().extract(&carrier);
    if cx.span().span_context().is_valid() {
        let _ = span.set_parent(cx);
    }
}

/// The trace id of `span` as 32 hex digits (`None` without tracing).
pub fn trace_id(span: &tracing::Span) -> Option<String> {
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    sc.is_valid().then(|| sc.trace_id().to_string())
}

/// Whether `span` is recorded (sampled), so callers can skip work for unsampled requests.
pub fn is_sampled(span: &tracing::Span) -> bool {
    span.context().span().span_context().is_sampled()
}

/// Lets a repeated log line through once every 5 s, counting the ones held back.
#[derive(Default)]
pub struct RateLimited {
    last: Option<Instant>,
    suppressed: u64,
    noted: u64,
}

impl RateLimited {
    /// One for a `static` (behind a mutex).
    pub const fn new() -> RateLimited {
        RateLimited {
            last: None,
            suppressed: 0,
            noted: 0,
        }
    }

    pub fn ready(&mut self) -> bool {
        let now = Instant::now();
        if self
            .last
            .is_some_and(|t| now.duration_since(t) < Duration::from_secs(5))
        {
            self.suppressed += 1;
            return false;
        }
        self.last = Some(now);
        self.noted = std::mem::take(&mut self.suppressed);
        true
    }

    pub fn suppressed_note(&self) -> String {
        match self.noted {
            0 => String::new(),
            n => format!(" ({n} more since the last report)"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn otlp_urls_get_the_traces_path() {
        assert_eq!(otlp_traces_url("http://c:4318"), "http://c:4318/v1/traces");
        assert_eq!(
            otlp_traces_url("http://c:4318/v1/traces/"),
            "http://c:4318/v1/traces"
        );
    }

    #[test]
    fn only_well_formed_traceparents_are_continued() {
        let (t, p) = ("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331");
        assert!(valid_traceparent(&format!("00-{t}-{p}-01")));
        assert!(valid_traceparent(&format!("00-{t}-{p}-00")));
        assert!(valid_traceparent(&format!("01-{t}-{p}-01-future")));
        for bad in [
            "00-abc-def-00".to_string(),
            format!("00-+{}-{p}-01", &t[1..]),
            format!("00-{}-{p}-01", t.to_uppercase()),
            format!("00-{}-{p}-01", "0".repeat(32)),
            format!("00-{t}-{}-01", "0".repeat(16)),
            format!("ff-{t}-{p}-01"),
            format!("00-{t}-{p}-01-extra"),
            format!("01-{t}-{p}-01extra"),
            format!("0g-{t}-{p}-01"),
            format!("00-{t}-{p}-1"),
            format!(" 00-{t}-{p}-01"),
            String::new(),
        ] {
            assert!(!valid_traceparent(&bad), "{bad:?}");
        }
    }

    #[test]
    fn context_crosses_a_hop_and_survives_bad_input() {
        use tracing_subscriber::layer::SubscriberExt;
        let provider = SdkTracerProvider::builder()
            .with_sampler(Sampler::AlwaysOn)
            .build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("t")));
        tracing::subscriber::with_default(subscriber, || {
            let a = tracing::info_span!(target: TARGET, "a");
            let tp = traceparent(&a).expect("a context");
            let parts: Vec<&str> = tp.split('-').collect();
            assert_eq!(parts.len(), 4, "{tp}");
            assert_eq!(parts[1], trace_id(&a).unwrap());
            // Another process continues the trace.
            let b = tracing::info_span!(target: TARGET, "b");
            set_remote_parent(&b, Some(&tp));
            assert_eq!(trace_id(&b), trace_id(&a));
            // Garbage leaves a span on its own trace.
            let c = tracing::info_span!(target: TARGET, "c");
            set_remote_parent(&c, Some("00-not-a-context"));
            assert_ne!(trace_id(&c), trace_id(&a));
        });
    }
}
