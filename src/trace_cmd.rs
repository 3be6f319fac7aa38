//! `kvmesh trace [ID]`: a request's trace as a text waterfall, gathered by a gateway from
//! every node that took part (the same data the `/traces` page shows); without an id, the
//! gateway's recent requests.

use anyhow::{bail, Context};
use clap::Args;
use kvmesh_telemetry::store::{RequestSummary, SpanRecord};

#[derive(Args, Debug)]
pub struct TraceArgs {
    /// A trace id (32 hex digits, from a response's `x-trace-id` header). Without one, the
    /// recent requests are listed.
    pub id: Option<String>,
    /// The gateway (or `kvmesh serve`) base URL.
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub url: String,
    /// Print the spans as JSON.
    #[arg(long)]
    pub json: bool,
    /// Width of the waterfall's bars, in characters.
    #[arg(long, default_value_t = 40)]
    pub width: usize,
    /// Recent list: only requests slower than this many milliseconds.
    #[arg(long, default_value_t = 0.0)]
    pub min_ms: f64,
    /// Recent list: only failed requests.
    #[arg(long)]
    pub failed: bool,
    /// The server's API key, when it has one: its trace API is behind it.
    #[arg(long, env = "KVMESH_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
}

pub fn run(args: TraceArgs) -> anyhow::Result<()> {
    let http = reqwest::Client::builder()
        .timeout(std::time::Duration::from_secs(10))
        .build()?;
    let base = args.url.trim_end_matches('/');
    let Some(id) = args.id.as_deref() else {
        let url = format!(
            "{base}/traces/api/recent?min_ms={}&failed={}",
            args.min_ms, args.failed
        );
        let v: serde_json::Value = get(&http, &url, args.api_key.as_deref())?;
        let list: Vec<RequestSummary> =
            serde_json::from_value(v["requests"].clone()).context("reading the recent requests")?;
        if args.json {
            println!("{}", serde_json::to_string_pretty(&list)?);
            return Ok(());
        }
        println!(
            "{:<32}  {:<24} {:>6} {:>9} {:>11}  nodes",
            "trace", "request", "status", "TTFT ms", "duration ms"
        );
        for r in list {
            println!(
                "{:<32}  {:<24} {:>6} {:>9} {:>11.1}  {}",
                r.trace_id,
                r.request_id.unwrap_or_default(),
                r.status.map_or("-".to_string(), |s| s.to_string()),
                r.ttft_ms.map_or("-".to_string(), |t| format!("{t:.1}")),
                r.duration_ms,
                r.nodes.join(",")
            );
        }
        return Ok(());
    };
    if id.len() != 32 || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
        bail!("'{id}' is not a trace id: 32 hex digits, as in a response's x-trace-id header");
    }
    let url = format!("{base}/traces/api/trace/{id}");
    let v: serde_json::Value = get(&http, &url, args.api_key.as_deref())?;
    let spans: Vec<SpanRecord> =
        serde_json::from_value(v["spans"].clone()).context("reading the trace's spans")?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&spans)?);
    } else {
        print!(
            "{}",
            kvmesh_telemetry::view::render_text(&spans, args.width.clamp(10, 200))
        );
    }
    Ok(())
}

fn get(http: &reqwest::Client, url: &str, key: Option<&str>) -> anyhow::Result<serde_json::Value> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let mut ask = http.get(url);
        if let Some(k) = key {
            ask = ask.bearer_auth(k);
        }
        let r = ask
            .send()
            .await
            .with_context(|| format!("cannot reach {url}"))?;
        let status = r.status();
        let v: serde_json::Value = r
            .json()
            .await
            .with_context(|| format!("{url} answered no JSON"))?;
        if !status.is_success() {
            bail!(
                "{url}: {}",
                v["error"]["message"].as_str().unwrap_or(status.as_str())
            );
        }
        Ok(v)
    })
}
