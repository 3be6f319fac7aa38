//! Prometheus metrics, named as vLLM names them (with the `kvmesh:` prefix) where they mean
//! the same thing, so existing dashboards need only a prefix change.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use kvmesh_gpu::engine::EngineHandle;
use std::collections::BTreeMap;

use kvmesh_telemetry::metrics::{histogram_vec, Exposition, Histogram, HistogramVec};
use parking_lot::Mutex;

const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
];

/// What a gateway observes of the requests it serves.
pub struct Metrics {
    families: [HistogramVec; 3],
    /// (model, finish reason) → count.
    finished: Mutex<BTreeMap<(String, String), u64>>,
    /// (endpoint, status) → count.
    http: Mutex<BTreeMap<(String, u16), u64>>,
}

/// The latency series of one model, and where its requests' outcomes are counted.
pub struct ModelMetrics {
    pub ttft: Histogram,
    pub itl: Histogram,
    pub e2e: Histogram,
    model: String,
    all: Arc<Metrics>,
}

impl ModelMetrics {
    pub fn finished(&self, reason: &str) {
        *self
            .all
            .finished
            .lock()
            .entry((self.model.clone(), reason.to_string()))
            .or_default() += 1;
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A gateway's metrics; each model's series carry its name as `model_name`.
    pub fn new() -> Metrics {
        let family =
            |name: &str, help: &str| histogram_vec(name, help, &["model_name"], LATENCY_BUCKETS);
        let families = [
            family("kvmesh:time_to_first_token_seconds", "Time to first token."),
            family(
                "kvmesh:inter_token_latency_seconds",
                "Time between consecutive tokens.",
            ),
            family(
                "kvmesh:e2e_request_latency_seconds",
                "Request latency, arrival to last token.",
            ),
        ];
        Metrics {
            families,
            finished: Mutex::new(BTreeMap::new()),
            http: Mutex::new(BTreeMap::new()),
        }
    }

    /// The series of `model`.
    pub fn model(self: &Arc<Self>, model: &str) -> ModelMetrics {
        let child = |f: &HistogramVec| f.with_label_values(&[model]);
        ModelMetrics {
            ttft: child(&self.families[0]),
            itl: child(&self.families[1]),
            e2e: child(&self.families[2]),
            model: model.to_string(),
            all: self.clone(),
        }
    }

    pub fn http(&self, endpoint: &str, status: u16) {
        *self
            .http
            .lock()
            .entry((endpoint.to_string(), status))
            .or_default() += 1;
    }

    /// The gateway's own families: request latencies, outcomes and HTTP status counts.
    pub fn add_to(&self, out: &Exposition) {
        for f in &self.families {
            out.add(f.clone());
        }
        let finished = self.finished.lock().clone();
        out.counters(
            "kvmesh:request_success_total",
            "Finished requests by reason.",
            &["model_name", "finished_reason"],
            finished
                .iter()
                .map(|((model, reason), n)| (vec![model.as_str(), reason.as_str()], *n as f64)),
        );
        let statuses: Vec<(String, String, u64)> = self
            .http
            .lock()
            .iter()
            .map(|((endpoint, status), n)| (endpoint.clone(), status.to_string(), *n))
            .collect();
        out.counters(
            "kvmesh:http_requests_total",
            "HTTP requests by endpoint and status.",
            &["endpoint", "status"],
            statuses
                .iter()
                .map(|(e, s, n)| (vec![e.as_str(), s.as_str()], *n as f64)),
        );
    }
}

/// The engine's gauges and counters, for a gateway whose engine runs in this process (and
/// for a worker's own metrics page).
pub fn render_engine(o: &Exposition, model: &str, engine: &EngineHandle) {
    render_engines(o, model, &[(None, engine)]);
}

/// Several engines of one node (a prefill and a decode role), one series each, told apart
/// by a `role` label.
pub fn render_engines(o: &Exposition, model: &str, engines: &[(Option<&str>, &EngineHandle)]) {
    let labels: &[&str] = if engines.iter().any(|(role, _)| role.is_some()) {
        &["model_name", "role"]
    } else {
        &["model_name"]
    };
    let samples = |v: &dyn Fn(&EngineHandle) -> f64| {
        engines
            .iter()
            .map(|(role, e)| {
                let mut values = vec![model];
                values.extend(role);
                (values, v(e))
            })
            .collect::<Vec<_>>()
    };
    let gauge = |name: &str, help: &str, v: &dyn Fn(&EngineHandle) -> f64| {
        o.gauges(name, help, labels, samples(v))
    };
    let counter = |name: &str, help: &str, v: &dyn Fn(&EngineHandle) -> f64| {
        o.counters(name, help, labels, samples(v))
    };
    let load = |a: &AtomicUsize| a.load(Ordering::Relaxed) as f64;
    let count = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64;
    gauge(
        "kvmesh:num_requests_running",
        "Sequences in the running batch.",
        &|e| load(&e.stats.running),
    );
    gauge(
        "kvmesh:num_requests_waiting",
        "Sequences waiting to be scheduled.",
        &|e| load(&e.stats.waiting),
    );
    gauge(
        "kvmesh:num_requests_awaiting_kv",
        "Sequences holding blocks while their prompt's KV arrives from a prefill worker.",
        &|e| load(&e.stats.awaiting_kv),
    );
    gauge(
        "kvmesh:kv_cache_usage_perc",
        "Fraction of KV blocks held by live sequences or lent to transfers (1 = full).",
        &|e| 1.0 - load(&e.stats.free_blocks) / e.info.num_blocks.max(1) as f64,
    );
    gauge("kvmesh:num_kv_blocks", "KV blocks in the cache.", &|e| {
        e.info.num_blocks.max(1) as f64
    });
    gauge(
        "kvmesh:num_state_slots",
        "Recurrent-state slots beside the KV blocks, one per running sequence of a model with \
         linear-attention layers (0 for other models).",
        &|e| e.info.num_state_slots as f64,
    );
    gauge(
        "kvmesh:state_slots_used",
        "Recurrent-state slots held by running sequences.",
        &|e| {
            e.info
                .num_state_slots
                .saturating_sub(load(&e.stats.free_state_slots) as usize) as f64
        },
    );
    gauge(
        "kvmesh:num_state_snapshots",
        "Saved recurrent states the prefix cache can keep, so that a model with \
         linear-attention layers resumes cached prefixes (0 for other models).",
        &|e| e.info.num_state_snapshots as f64,
    );
    gauge(
        "kvmesh:state_snapshots_used",
        "Saved recurrent states the prefix cache holds.",
        &|e| load(&e.stats.saved_states),
    );
    counter(
        "kvmesh:prefix_cache_queries_total",
        "Prompt tokens looked up in the prefix cache.",
        &|e| count(&e.stats.prefix_queries),
    );
    counter(
        "kvmesh:prefix_cache_hits_total",
        "Prompt tokens found in the prefix cache.",
        &|e| count(&e.stats.prefix_hits),
    );
    counter(
        "kvmesh:num_preemptions_total",
        "Sequences preempted for lack of KV blocks.",
        &|e| count(&e.stats.preemptions),
    );
    counter(
        "kvmesh:prompt_tokens_total",
        "Prompt tokens computed (prefix cache hits excluded).",
        &|e| count(&e.stats.prompt_tokens),
    );
    counter(
        "kvmesh:generation_tokens_total",
        "Tokens generated.",
        &|e| count(&e.stats.generation_tokens),
    );
    step_counters(&counter);
}

/// A counter family of every engine: name, help, and the value of one engine.
type Counter<'a> = dyn Fn(&str, &str, &dyn Fn(&EngineHandle) -> f64) + 'a;

/// The engines' steps, and where a pure decode step's time goes.
fn step_counters(counter: &Counter) {
    let count = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64;
    counter("kvmesh:engine_steps_total", "Engine steps run.", &|e| {
        count(&e.stats.steps)
    });
    counter(
        "kvmesh:engine_decode_steps_total",
        "Engine steps with no prompt tokens in them.",
        &|e| count(&e.stats.decode_steps),
    );
    counter(
        "kvmesh:engine_decode_cycle_seconds_total",
        "Wall time of those steps from planning to their tokens sent.",
        &|e| count(&e.stats.decode_cycle_us) / 1e6,
    );
    counter(
        "kvmesh:engine_decode_step_seconds_total",
        "Of that, the step from its batch's start to its tokens back.",
        &|e| count(&e.stats.decode_busy_us) / 1e6,
    );
    counter(
        "kvmesh:engine_decode_forward_seconds_total",
        "Of that, the backend's forward and sampling (the model's step).",
        &|e| count(&e.stats.decode_forward_us) / 1e6,
    );
}
