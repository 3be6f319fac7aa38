//! What a router counts: requests, retries, migrations, refusals, disaggregation decisions,
//! prefix-hit predictions and how long its picks take; and its metrics.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kvmesh_telemetry::metrics::{histogram, Exposition, Histogram};
use parking_lot::Mutex;

use super::links::WorkerLink;

#[derive(Default)]
pub struct RouterStats {
    pub routed: AtomicU64,
    pub retries: AtomicU64,
    pub failed_midstream: AtomicU64,
    /// Requests moved to another worker after tokens were streamed.
    pub migrations: AtomicU64,
    /// Prefix routing: the cached prompt tokens the router expected from the worker's
    /// events against what the worker reported: equal, more, fewer.
    pub predictions: [AtomicU64; 3],
    pub no_worker: AtomicU64,
    /// Requests refused because every worker's queue was full.
    pub full: AtomicU64,
    /// Requests routed to decode nodes, by disaggregation decision.
    pub disagg: [AtomicU64; Decision::COUNT],
    /// How long routing decisions take.
    pub picks: PickTimes,
}

/// Upper bounds of the pick-time histogram's buckets, in seconds (1 µs to 1 ms).
const PICK_BUCKETS_S: [f64; 10] = [
    0.000001, 0.000002, 0.000005, 0.00001, 0.00002, 0.00005, 0.0001, 0.0002, 0.0005, 0.001,
];

/// The time each routing decision took: from reading the worker set to the policy's pick
/// (building every candidate and the prompt's cached blocks included; describing the
/// candidates for a sampled trace not).
pub struct PickTimes {
    pub count: AtomicU64,
    pub sum_ns: AtomicU64,
    pub max_ns: AtomicU64,
    /// `kvmesh:router_pick_seconds`.
    histogram: Histogram,
    /// The last [`RECENT_PICKS`] times, in ns (a ring), for percentiles.
    recent: Mutex<(Vec<u32>, usize)>,
}

impl Default for PickTimes {
    fn default() -> PickTimes {
        PickTimes {
            count: AtomicU64::new(0),
            sum_ns: AtomicU64::new(0),
            max_ns: AtomicU64::new(0),
            histogram: histogram(
                "kvmesh:router_pick_seconds",
                "Time a routing decision takes (every candidate built and the policy's pick).",
                &PICK_BUCKETS_S,
            ),
            recent: Mutex::new((Vec::new(), 0)),
        }
    }
}

/// How many recent pick times the percentiles are taken over.
const RECENT_PICKS: usize = 1024;

impl PickTimes {
    pub(crate) fn record(&self, took: Duration) {
        let ns = took.as_nanos().min(u128::from(u64::MAX)) as u64;
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(ns, Ordering::Relaxed);
        self.max_ns.fetch_max(ns, Ordering::Relaxed);
        self.histogram.observe(took.as_secs_f64());
        let mut recent = self.recent.lock();
        let (ring, next) = &mut *recent;
        let v = ns.min(u64::from(u32::MAX)) as u32;
        if ring.len() < RECENT_PICKS {
            ring.push(v);
        } else {
            ring[*next] = v;
        }
        *next = (*next + 1) % RECENT_PICKS;
    }

    /// Percentiles (0..=100) of the recent pick times, in microseconds (empty before the
    /// first pick).
    pub fn recent_percentiles_us(&self, ps: &[f64]) -> Vec<f64> {
        let mut v = self.recent.lock().0.clone();
        if v.is_empty() {
            return Vec::new();
        }
        v.sort_unstable();
        ps.iter()
            .map(|p| {
                let i = ((p / 100.0) * (v.len() - 1) as f64).round() as usize;
                f64::from(v[i.min(v.len() - 1)]) / 1e3
            })
            .collect()
    }

    /// Mean pick time in microseconds (0 before the first).
    pub fn mean_us(&self) -> f64 {
        let n = self.count.load(Ordering::Relaxed);
        if n == 0 {
            return 0.0;
        }
        self.sum_ns.load(Ordering::Relaxed) as f64 / n as f64 / 1e3
    }
}

/// What the router decided about prefilling a request routed to a decode node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// A prefill node computes the prompt and streams its KV to the decode node.
    Remote,
    /// Too little of the prompt is uncached: the decode node prefills it.
    ShortPrompt,
    /// No prefill node with this model and KV layout is connected.
    NoPrefillWorker,
    /// Every such prefill node has a full queue or no KV room for the prompt.
    PrefillBusy,
}

impl Decision {
    pub(crate) const COUNT: usize = 4;
    const ALL: [Decision; 4] = [
        Decision::Remote,
        Decision::ShortPrompt,
        Decision::NoPrefillWorker,
        Decision::PrefillBusy,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Decision::Remote => "remote",
            Decision::ShortPrompt => "short_prompt",
            Decision::NoPrefillWorker => "no_prefill_worker",
            Decision::PrefillBusy => "prefill_busy",
        }
    }
}

/// One pool's part of the router's metrics: its model, stats and workers.
pub struct PoolView<'a> {
    pub model: &'a str,
    pub stats: &'a RouterStats,
    pub workers: Vec<Arc<WorkerLink>>,
}

/// A router with more workers than this leaves the per-worker families out of `/metrics`.
pub const PER_WORKER_SERIES: usize = 256;

/// The metric families of the router's view of the cluster: each series carries its pool's
/// `model_name`, as vLLM's series do.
pub fn render(pools: &[PoolView], out: &Exposition) {
    let n = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64;
    let per_pool = |name: &str, help: &str, v: &dyn Fn(&RouterStats) -> f64| {
        out.counters(
            name,
            help,
            &["model_name"],
            pools.iter().map(|p| (vec![p.model], v(p.stats))),
        );
    };
    per_pool(
        "kvmesh:router_requests_total",
        "Requests sent to workers, retries included.",
        &|s| n(&s.routed),
    );
    per_pool(
        "kvmesh:router_queue_full_total",
        "Requests refused with 429 because every worker's queue was full.",
        &|s| n(&s.full),
    );
    per_pool(
        "kvmesh:router_retries_total",
        "Requests moved to another worker before their first token.",
        &|s| n(&s.retries),
    );
    per_pool(
        "kvmesh:router_midstream_failures_total",
        "Requests that ended with an error because their worker was lost mid-stream and the \
         migration limit was reached.",
        &|s| n(&s.failed_midstream),
    );
    per_pool(
        "kvmesh:migrations_total",
        "Requests moved to another worker after tokens were streamed (their worker lost).",
        &|s| n(&s.migrations),
    );
    per_pool(
        "kvmesh:router_no_worker_total",
        "Requests refused because no worker could take them.",
        &|s| n(&s.no_worker),
    );
    out.counters(
        "kvmesh:disagg_decisions_total",
        "Requests routed to decode nodes, by whether and why their prompt was prefilled \
         elsewhere.",
        &["model_name", "reason"],
        pools.iter().flat_map(|p| {
            Decision::ALL.map(|d| (vec![p.model, d.as_str()], n(&p.stats.disagg[d as usize])))
        }),
    );
    out.counters(
        "kvmesh:router_prefix_predictions_total",
        "Prefix routing: the cached prompt tokens expected from the worker's KV events \
         against those it reported.",
        &["model_name", "outcome"],
        pools.iter().flat_map(|p| {
            ["exact", "fewer", "more"]
                .iter()
                .zip(&p.stats.predictions)
                .map(|(o, v)| (vec![p.model, *o], n(v)))
        }),
    );
    out.counters(
        "kvmesh:router_load_reports_total",
        "Load reports read from workers, by every router of this process.",
        &[],
        [(vec![], n(&super::links::LOAD_REPORTS))],
    );
    out.labelled_histograms(
        "model_name",
        pools.iter().map(|p| (p.model, &p.stats.picks.histogram)),
    );
    out.gauges(
        "kvmesh:router_workers_routable",
        "Workers connected and in routing.",
        &["model_name"],
        pools.iter().map(|p| {
            let routable = p.workers.iter().filter(|w| w.available() && w.generates());
            (vec![p.model], routable.count() as f64)
        }),
    );
    out.gauges(
        "kvmesh:router_prefill_workers_connected",
        "Prefill nodes connected and reporting, available to decode nodes.",
        &["model_name"],
        pools.iter().map(|p| {
            let ready = p.workers.iter().filter(|w| w.prefill_ready());
            (vec![p.model], ready.count() as f64)
        }),
    );
    // One series per worker and metric is what a dashboard of a few workers wants, and a
    // page of megabytes for a router of thousands: those go to `/status?workers=all`.
    if pools.iter().map(|p| p.workers.len()).sum::<usize>() <= PER_WORKER_SERIES {
        render_per_worker(pools, out);
    }
}

/// The families with a series per worker.
fn render_per_worker(pools: &[PoolView], out: &Exposition) {
    let n = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64;
    let workers = || {
        pools
            .iter()
            .flat_map(|p| p.workers.iter().map(move |w| (p.model, w)))
    };
    fn id<'w>(model: &'w str, w: &'w WorkerLink) -> Vec<&'w str> {
        vec![model, w.record.node_id.as_str()]
    }
    out.counters(
        "kvmesh:prefill_routed_total",
        "Prompts sent to each prefill node.",
        &["model_name", "worker"],
        workers()
            .filter(|(_, w)| w.prefills())
            .map(|(m, w)| (id(m, w), n(&w.prefilled))),
    );
    out.counters(
        "kvmesh:worker_routed_total",
        "Requests sent to each worker.",
        &["model_name", "worker"],
        workers().map(|(m, w)| (id(m, w), n(&w.routed))),
    );
    out.gauges(
        "kvmesh:worker_load",
        "Requests queued or running on each worker, as this router counts them.",
        &["model_name", "worker"],
        workers().map(|(m, w)| (id(m, w), w.load())),
    );
    out.gauges(
        "kvmesh:worker_capacity_tokens_per_s",
        "Generated tokens per second one sequence gets on each worker, as it reported.",
        &["model_name", "worker"],
        workers().map(|(m, w)| (id(m, w), w.capacity())),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pick_times_give_percentiles_and_a_cumulative_histogram() {
        let t = PickTimes::default();
        assert!(t.recent_percentiles_us(&[50.0]).is_empty());
        for us in 1..=2000u64 {
            t.record(Duration::from_micros(us));
        }
        // The ring keeps the last 1024: 977..=2000 µs.
        assert_eq!(t.recent_percentiles_us(&[0.0, 100.0]), vec![977.0, 2000.0]);
        assert_eq!(t.count.load(Ordering::Relaxed), 2000);
        assert!((t.mean_us() - 1000.5).abs() < 1e-9);
        let exposition = Exposition::new();
        exposition.add(t.histogram.clone());
        let out = exposition.render();
        assert!(
            out.contains("kvmesh:router_pick_seconds_bucket{le=\"0.00001\"} 10\n"),
            "{out}"
        );
        assert!(
            out.contains("kvmesh:router_pick_seconds_bucket{le=\"0.001\"} 1000\n"),
            "{out}"
        );
        assert!(
            out.contains("kvmesh:router_pick_seconds_bucket{le=\"+Inf\"} 2000\n"),
            "{out}"
        );
        assert!(
            out.contains("kvmesh:router_pick_seconds_count 2000\n"),
            "{out}"
        );
    }
}
