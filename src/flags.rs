//! Process-level flags `serve` and `node` share: tracing, HTTP connection limits, the API
//! key, the tool-call parser, and the shutdown grace period.

use std::time::Duration;

use clap::Args;

use kvmesh_gateway::http::{self, HttpLimits};
use kvmesh_gateway::tools::{ToolFormat, UnknownToolParser};

/// On SIGTERM, seconds open streams get to finish (`serve` and `node`).
pub const SHUTDOWN_GRACE_S: f64 = 30.0;

/// Tracing flags `serve` and `node` share.
#[derive(Args, Debug, Clone)]
pub struct TraceFlags {
    /// Also send spans to an OpenTelemetry collector by OTLP/HTTP (Jaeger, Tempo, …), e.g.
    /// http://localhost:4318.
    #[arg(long, env = "KVMESH_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    /// Fraction of requests starting here that are traced (0 to 1); a request that arrives
    /// with a sampled `traceparent` is traced whatever this says.
    #[arg(long, default_value_t = 1.0)]
    pub trace_sample_ratio: f64,
    /// Spans kept in memory for the trace viewer, at most.
    #[arg(long, default_value_t = 50_000)]
    pub trace_store_spans: usize,
    /// Memory for kept spans, in MiB, at most.
    #[arg(long, default_value_t = 32)]
    pub trace_store_mib: usize,
}

impl TraceFlags {
    /// Sets up logging and tracing for a process named `node_id` in spans.
    pub fn init(&self, node_id: &str) -> anyhow::Result<kvmesh_telemetry::Telemetry> {
        Ok(kvmesh_telemetry::init(kvmesh_telemetry::TelemetryConfig {
            node_id: node_id.to_string(),
            otlp_endpoint: self.otlp_endpoint.clone(),
            sample_ratio: self.trace_sample_ratio,
            store_spans: self.trace_store_spans,
            store_bytes: self.trace_store_mib << 20,
        })?)
    }
}

/// HTTP connection limits `serve` and `node` share (0 turns a timeout off).
#[derive(Args, Debug, Clone)]
pub struct HttpArgs {
    /// Seconds a client has to send a whole request head, from the connection's opening or
    /// (on a keep-alive connection) the head's first byte; then the connection is closed.
    #[arg(long, value_name = "SECONDS", value_parser = seconds, default_value_t = http::DEFAULT_HEADER_TIMEOUT_S)]
    pub http_header_timeout: f64,
    /// Seconds a keep-alive connection may wait for its next request before it is closed.
    #[arg(long, value_name = "SECONDS", value_parser = seconds, default_value_t = http::DEFAULT_IDLE_TIMEOUT_S)]
    pub http_idle_timeout: f64,
    /// Seconds a client has to send a whole request body once its head is in; then 408.
    #[arg(long, value_name = "SECONDS", value_parser = seconds, default_value_t = http::DEFAULT_BODY_TIMEOUT_S)]
    pub http_body_timeout: f64,
    /// Seconds a client may take no byte of its answer while bytes wait for it; then the
    /// connection is closed and its request cancelled.
    #[arg(long, value_name = "SECONDS", value_parser = seconds, default_value_t = http::DEFAULT_SEND_TIMEOUT_S)]
    pub http_send_timeout: f64,
    /// Open HTTP connections at most (also capped below the open-file limit); beyond it,
    /// new connections get 503.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..), default_value_t = http::DEFAULT_MAX_CONNECTIONS as u64)]
    pub max_connections: u64,
}

impl HttpArgs {
    pub fn limits(&self) -> HttpLimits {
        let t = |s: f64| (s > 0.0).then(|| Duration::from_secs_f64(s));
        HttpLimits {
            header_timeout: t(self.http_header_timeout),
            idle_timeout: t(self.http_idle_timeout),
            body_timeout: t(self.http_body_timeout),
            send_timeout: t(self.http_send_timeout),
            max_connections: self.max_connections.min(usize::MAX as u64) as usize,
        }
    }
}

fn seconds(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && (0.0..=1e9).contains(&v) => Ok(v),
        _ => Err(format!(
            "`{s}` is not a number of seconds (0 or more; 0 turns it off)"
        )),
    }
}

/// `--api-key`: refused at start-up when it could never be sent (an empty key would lock
/// every route).
pub fn api_key(s: &str) -> Result<String, String> {
    kvmesh_gateway::check_api_key(s).map_err(|e| e.to_string())?;
    Ok(s.to_string())
}

/// `--tool-call-parser`: how tool calls are read out of the model's output (vLLM's names).
pub fn tool_call_parser(s: &str) -> Result<ToolFormat, UnknownToolParser> {
    ToolFormat::by_name(s)
}
