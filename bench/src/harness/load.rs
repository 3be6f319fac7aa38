//! Load through the OpenAI API: streamed requests timed chunk by chunk, run at a set
//! concurrency, and summarised into the figures the bench programs print and write.

use std::sync::Arc;
use std::time::Instant;

use serde_json::{json, Value};
use tokio::sync::Semaphore;

use super::http::Events;

/// One streamed request's timings.
#[derive(Clone, Debug, Default)]
pub struct Sample {
    pub ok: bool,
    pub ttft: f64,
    pub e2e: f64,
    pub output_tokens: u64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// When each chunk with text arrived, in seconds from the start.
    pub token_times: Vec<f64>,
    /// When it was sent, in seconds from the start of its run (set by [`run_load`]).
    pub sent_at: f64,
}

impl Sample {
    /// Time per output token after the first: (E2E - TTFT) / (n - 1).
    pub fn tpot(&self) -> Option<f64> {
        (self.output_tokens > 1).then(|| (self.e2e - self.ttft) / (self.output_tokens - 1) as f64)
    }

    /// Gaps between consecutive text chunks.
    pub fn itls(&self) -> impl Iterator<Item = f64> + '_ {
        self.token_times.windows(2).map(|w| w[1] - w[0])
    }
}

/// A streamed completion request for `prompt` (text or token ids).
pub fn completion(prompt: Value, max_tokens: u32) -> Value {
    json!({"model": "shakespeare", "prompt": prompt, "max_tokens": max_tokens,
        "temperature": 0, "ignore_eos": true, "stream": true,
        "stream_options": {"include_usage": true}})
}

/// A streamed completion of `prompt`, timed.
pub async fn one(http: &reqwest::Client, base: &str, prompt: &str, max_tokens: u32) -> Sample {
    one_body(http, base, completion(json!(prompt), max_tokens)).await
}

/// A streamed completion request of any body, timed; a failure is a sample that is not ok.
pub async fn one_body(http: &reqwest::Client, base: &str, body: Value) -> Sample {
    let t0 = Instant::now();
    let Ok(r) = http
        .post(format!("{base}/v1/completions"))
        .json(&body)
        .send()
        .await
    else {
        return Sample::default();
    };
    if !r.status().is_success() {
        return Sample::default();
    }
    let mut out = Sample::default();
    let mut events = Events::new(r);
    while let Some(data) = events.next().await {
        if data == "[DONE]" {
            out.ok = true;
            continue;
        }
        let v: Value = serde_json::from_str(&data).unwrap_or(Value::Null);
        if v["choices"][0]["text"].is_string() {
            let t = t0.elapsed().as_secs_f64();
            if out.token_times.is_empty() {
                out.ttft = t;
            }
            out.token_times.push(t);
        }
        if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
            out.output_tokens = u["completion_tokens"].as_u64().unwrap_or(0);
            out.prompt_tokens = u["prompt_tokens"].as_u64().unwrap_or(0);
            out.cached_tokens = u["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap_or(0);
        }
        if v.get("error").is_some() {
            out.ok = false;
            return out;
        }
    }
    out.e2e = t0.elapsed().as_secs_f64();
    out
}

/// Percentile `p` (0..=100) of `v`, interpolated linearly between ranks; NaN when empty.
pub fn pct(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let x = p / 100.0 * (v.len() - 1) as f64;
    let (lo, hi) = (x.floor() as usize, x.ceil() as usize);
    v[lo] + (v[hi] - v[lo]) * (x - lo as f64)
}

/// The mean of `v`; 0 when empty.
pub fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

/// Runs `prompts` at `concurrency`; returns (samples, wall seconds).
pub async fn run_load(
    http: &reqwest::Client,
    base: &str,
    prompts: Vec<String>,
    max_tokens: u32,
    concurrency: usize,
) -> (Vec<Sample>, f64) {
    let sem = Arc::new(Semaphore::new(concurrency));
    let t0 = Instant::now();
    let tasks: Vec<_> = prompts
        .into_iter()
        .map(|p| {
            let (http, base, sem) = (http.clone(), base.to_string(), sem.clone());
            tokio::spawn(async move {
                let _permit = sem.acquire_owned().await.unwrap();
                let sent_at = t0.elapsed().as_secs_f64();
                let mut s = one(&http, &base, &p, max_tokens).await;
                s.sent_at = sent_at;
                s
            })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    (out, t0.elapsed().as_secs_f64())
}

/// Output tokens per second while every slot of a closed-loop run was busy: from the first
/// request's end (each end starts the next request) to the last request's start (after
/// which the run drains). The ramp-up, with every request prefilling at once, and the
/// drain, with fewer requests in flight than the concurrency, are left out, so the figure
/// is comparable with a steady-state model. `None` when the window is empty (fewer
/// requests than twice the concurrency).
pub fn steady_tok_per_s(samples: &[Sample]) -> Option<f64> {
    let ok: Vec<&Sample> = samples.iter().filter(|s| s.ok).collect();
    let from = ok
        .iter()
        .map(|s| s.sent_at + s.e2e)
        .fold(f64::INFINITY, f64::min);
    let to = ok.iter().map(|s| s.sent_at).fold(0.0, f64::max);
    if to <= from {
        return None;
    }
    // Each text chunk stands for its request's share of output tokens.
    let tokens: f64 = ok
        .iter()
        .filter(|s| !s.token_times.is_empty())
        .map(|s| {
            let per_chunk = s.output_tokens as f64 / s.token_times.len() as f64;
            let inside = s
                .token_times
                .iter()
                .filter(|&&t| (from..to).contains(&(s.sent_at + t)))
                .count();
            inside as f64 * per_chunk
        })
        .sum();
    Some(tokens / (to - from))
}

/// A run's figures as JSON: requests, failures, throughput, and mean, P50 and P99 of
/// TTFT, E2E, TPOT and ITL in milliseconds.
pub fn summary(label: &str, samples: &[Sample], wall: f64) -> Value {
    let ok: Vec<&Sample> = samples.iter().filter(|s| s.ok).collect();
    let ttft: Vec<f64> = ok.iter().map(|s| s.ttft * 1e3).collect();
    let e2e: Vec<f64> = ok.iter().map(|s| s.e2e * 1e3).collect();
    let tpot: Vec<f64> = ok
        .iter()
        .filter_map(|s| s.tpot())
        .map(|t| t * 1e3)
        .collect();
    let itl: Vec<f64> = ok.iter().flat_map(|s| s.itls()).map(|t| t * 1e3).collect();
    let out_tokens: u64 = ok.iter().map(|s| s.output_tokens).sum();
    let prompt: u64 = ok.iter().map(|s| s.prompt_tokens).sum();
    let cached: u64 = ok.iter().map(|s| s.cached_tokens).sum();
    let stats = |v: &[f64]| json!({"mean": mean(v), "p50": pct(v, 50.0), "p99": pct(v, 99.0)});
    json!({
        "label": label, "requests": samples.len(), "failed": samples.len() - ok.len(),
        "wall_s": wall, "req_per_s": ok.len() as f64 / wall,
        "output_tok_per_s": out_tokens as f64 / wall,
        "steady_output_tok_per_s": steady_tok_per_s(samples),
        "ttft_ms": stats(&ttft), "e2e_ms": stats(&e2e), "tpot_ms": stats(&tpot),
        "itl_ms": stats(&itl),
        "prompt_tokens": prompt, "cached_tokens": cached,
        "cache_hit_rate": if prompt == 0 { 0.0 } else { cached as f64 / prompt as f64 },
    })
}

/// The lines of the Shakespeare corpus long enough to be a prompt.
pub fn shakespeare_lines() -> Vec<String> {
    include_str!("../../../data/tinyshakespeare.txt")
        .lines()
        .filter(|l| l.len() > 20)
        .map(str::to_string)
        .collect()
}
