//! Prometheus metrics, named as vLLM names them (with the `kvmesh:` prefix) where they mean
//! the same thing, so existing dashboards need only a prefix change.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

use kvmesh_gpu::engine::EngineHandle;

use parking_lot::Mutex;

pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<AtomicU64>,
    sum: Mutex<f64>,
}

const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
];

impl Histogram {
    fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum: Mutex::new(0.0),
        }
    }

    pub fn observe(&self, v: f64) {
        let i = self
            .bounds
            .iter()
            .position(|&b| v <= b)
            .unwrap_or(self.bounds.len());
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        *self.sum.lock() += v;
    }

    fn render(&self, out: &mut String, name: &str, help: &str, labels: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut acc = 0;
        for (i, b) in self.bounds.iter().enumerate() {
            acc += self.counts[i].load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{b}\"}} {acc}");
        }
        acc += self.counts[self.bounds.len()].load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {acc}");
        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", *self.sum.lock());
        let _ = writeln!(out, "{name}_count{{{labels}}} {acc}");
    }
}

pub struct Metrics {
    pub ttft: Histogram,
    pub itl: Histogram,
    pub e2e: Histogram,
    /// (endpoint, status) → count.
    http: Mutex<BTreeMap<(String, u16), u64>>,
    /// finish reason → count.
    finished: Mutex<BTreeMap<String, u64>>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            ttft: Histogram::new(LATENCY_BUCKETS),
            itl: Histogram::new(LATENCY_BUCKETS),
            e2e: Histogram::new(LATENCY_BUCKETS),
            http: Mutex::new(BTreeMap::new()),
            finished: Mutex::new(BTreeMap::new()),
        }
    }
}

impl Metrics {
    pub fn http(&self, endpoint: &str, status: u16) {
        *self
            .http
            .lock()
            .entry((endpoint.to_string(), status))
            .or_default() += 1;
    }

    pub fn finished(&self, reason: &str) {
        *self.finished.lock().entry(reason.to_string()).or_default() += 1;
    }

    /// The gateway's own lines: request latencies, outcomes and HTTP status counts.
    pub fn render(&self, model: &str) -> String {
        let mut o = String::new();
        let l = format!("model_name=\"{model}\"");
        self.ttft.render(
            &mut o,
            "kvmesh:time_to_first_token_seconds",
            "Time to first token.",
            &l,
        );
        self.itl.render(
            &mut o,
            "kvmesh:inter_token_latency_seconds",
            "Time between consecutive tokens.",
            &l,
        );
        self.e2e.render(
            &mut o,
            "kvmesh:e2e_request_latency_seconds",
            "Request latency, arrival to last token.",
            &l,
        );
        let _ = writeln!(o, "# HELP kvmesh:request_success_total Finished requests by reason.\n# TYPE kvmesh:request_success_total counter");
        for (reason, n) in self.finished.lock().iter() {
            let _ = writeln!(
                o,
                "kvmesh:request_success_total{{{l},finished_reason=\"{reason}\"}} {n}"
            );
        }
        let _ = writeln!(o, "# HELP kvmesh:http_requests_total HTTP requests by endpoint and status.\n# TYPE kvmesh:http_requests_total counter");
        for ((ep, st), n) in self.http.lock().iter() {
            let _ = writeln!(
                o,
                "kvmesh:http_requests_total{{endpoint=\"{ep}\",status=\"{st}\"}} {n}"
            );
        }
        o
    }
}

/// The engine's gauges and counters, for a gateway whose engine runs in this process (and
/// for a worker's own metrics page).
pub fn render_engine(o: &mut String, model: &str, engine: &EngineHandle) {
    render_engines(o, model, &[(None, engine)]);
}

/// Several engines of one node (a prefill and a decode role), one series each, told apart
/// by a `role` label.
pub fn render_engines(o: &mut String, model: &str, engines: &[(Option<&str>, &EngineHandle)]) {
    let labels: Vec<String> = engines
        .iter()
        .map(|(role, _)| match role {
            Some(r) => format!("model_name=\"{model}\",role=\"{r}\""),
            None => format!("model_name=\"{model}\""),
        })
        .collect();
    let family =
        |o: &mut String, kind: &str, name: &str, help: &str, v: &dyn Fn(&EngineHandle) -> f64| {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for (l, (_, e)) in labels.iter().zip(engines) {
                let _ = writeln!(o, "{name}{{{l}}} {}", v(e));
            }
        };
    let load = |a: &std::sync::atomic::AtomicUsize| a.load(Ordering::Relaxed) as f64;
    let count = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed) as f64;
    family(
        o,
        "gauge",
        "kvmesh:num_requests_running",
        "Sequences in the running batch.",
        &|e| load(&e.stats.running),
    );
    family(
        o,
        "gauge",
        "kvmesh:num_requests_waiting",
        "Sequences waiting to be scheduled.",
        &|e| load(&e.stats.waiting),
    );
    family(
        o,
        "gauge",
        "kvmesh:num_requests_awaiting_kv",
        "Sequences holding blocks while their prompt's KV arrives from a prefill worker.",
        &|e| load(&e.stats.awaiting_kv),
    );
    family(
        o,
        "gauge",
        "kvmesh:kv_cache_usage_perc",
        "Fraction of KV blocks held by live sequences or lent to transfers (1 = full).",
        &|e| 1.0 - load(&e.stats.free_blocks) / e.info.num_blocks.max(1) as f64,
    );
    family(
        o,
        "gauge",
        "kvmesh:num_kv_blocks",
        "KV blocks in the cache.",
        &|e| e.info.num_blocks.max(1) as f64,
    );
    family(
        o,
        "counter",
        "kvmesh:prefix_cache_queries_total",
        "Prompt tokens looked up in the prefix cache.",
        &|e| count(&e.stats.prefix_queries),
    );
    family(
        o,
        "counter",
        "kvmesh:prefix_cache_hits_total",
        "Prompt tokens found in the prefix cache.",
        &|e| count(&e.stats.prefix_hits),
    );
    family(
        o,
        "counter",
        "kvmesh:num_preemptions_total",
        "Sequences preempted for lack of KV blocks.",
        &|e| count(&e.stats.preemptions),
    );
    family(
        o,
        "counter",
        "kvmesh:prompt_tokens_total",
        "Prompt tokens computed (prefix cache hits excluded).",
        &|e| count(&e.stats.prompt_tokens),
    );
    family(
        o,
        "counter",
        "kvmesh:generation_tokens_total",
        "Tokens generated.",
        &|e| count(&e.stats.generation_tokens),
    );
    family(
        o,
        "counter",
        "kvmesh:engine_steps_total",
        "Engine steps run.",
        &|e| count(&e.stats.steps),
    );
}
