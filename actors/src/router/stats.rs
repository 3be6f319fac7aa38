//! What a router counts: requests, retries, migrations, refusals, disaggregation decisions,
//! prefix-hit predictions and how long its picks take; and its metrics.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

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

/// Upper bounds of the pick-time histogram's buckets, in microseconds.
const PICK_BUCKETS_US: [u64; 10] = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000];

/// The time each routing decision took: from reading the worker set to the policy's pick
/// (building every candidate and the prompt's cached blocks included; describing the
/// candidates for a sampled trace not).
#[derive(Default)]
pub struct PickTimes {
    pub count: AtomicU64,
    pub sum_ns: AtomicU64,
    pub max_ns: AtomicU64,
    /// Picks at most each of [`PICK_BUCKETS_US`] (not cumulative).
    buckets: [AtomicU64; PICK_BUCKETS_US.len()],
    /// The last [`RECENT_PICKS`] times, in ns (a ring), for percentiles.
    recent: Mutex<(Vec<u32>, usize)>,
}

/// How many recent pick times the percentiles are taken over.
const RECENT_PICKS: usize = 1024;

impl PickTimes {
    pub(crate) fn record(&self, took: Duration) {
        let ns = took.as_nanos().min(u128::from(u64::MAX)) as u64;
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(ns, Ordering::Relaxed);
        self.max_ns.fetch_max(ns, Ordering::Relaxed);
        if let Some(b) = PICK_BUCKETS_US.iter().position(|&us| ns <= us * 1000) {
            self.buckets[b].fetch_add(1, Ordering::Relaxed);
        }
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

    /// A Prometheus histogram, in seconds.
    fn render(&self, out: &mut String) {
        use std::fmt::Write;
        let name = "kvmesh:router_pick_seconds";
        let _ = writeln!(
            out,
            "# HELP {name} Time a routing decision takes (every candidate built and the \
             policy's pick).\n# TYPE {name} histogram"
        );
        let mut below = 0;
        for (us, b) in PICK_BUCKETS_US.iter().zip(&self.buckets) {
            below += b.load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{le=\"{}\"}} {below}", *us as f64 / 1e6);
        }
        let count = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
        let sum = self.sum_ns.load(Ordering::Relaxed) as f64 / 1e9;
        let _ = writeln!(out, "{name}_sum {sum}\n{name}_count {count}");
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

/// Prometheus lines for the router's view of the cluster.
pub fn render(s: &RouterStats, workers: &[Arc<WorkerLink>], out: &mut String) {
    use std::fmt::Write;
    let mut counter = |name: &str, help: &str, v: u64| {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}"
        );
    };
    counter(
        "kvmesh:router_requests_total",
        "Requests sent to workers, retries included.",
        s.routed.load(Ordering::Relaxed),
    );
    counter(
        "kvmesh:router_queue_full_total",
        "Requests refused with 429 because every worker's queue was full.",
        s.full.load(Ordering::Relaxed),
    );
    counter(
        "kvmesh:router_retries_total",
        "Requests moved to another worker before their first token.",
        s.retries.load(Ordering::Relaxed),
    );
    counter(
        "kvmesh:router_midstream_failures_total",
        "Requests that ended with an error because their worker was lost mid-stream and the \
         migration limit was reached.",
        s.failed_midstream.load(Ordering::Relaxed),
    );
    counter(
        "kvmesh:migrations_total",
        "Requests moved to another worker after tokens were streamed (their worker lost).",
        s.migrations.load(Ordering::Relaxed),
    );
    counter(
        "kvmesh:router_no_worker_total",
        "Requests refused because no worker could take them.",
        s.no_worker.load(Ordering::Relaxed),
    );
    let _ = writeln!(
        out,
        "# HELP kvmesh:disagg_decisions_total Requests routed to decode nodes, by whether \
         and why their prompt was prefilled elsewhere.\n# TYPE kvmesh:disagg_decisions_total counter"
    );
    for d in Decision::ALL {
        let _ = writeln!(
            out,
            "kvmesh:disagg_decisions_total{{reason=\"{}\"}} {}",
            d.as_str(),
            s.disagg[d as usize].load(Ordering::Relaxed)
        );
    }
    let _ = writeln!(
        out,
        "# HELP kvmesh:router_prefix_predictions_total Prefix routing: the cached prompt \
         tokens expected from the worker's KV events against those it reported.\n\
         # TYPE kvmesh:router_prefix_predictions_total counter"
    );
    for (k, outcome) in ["exact", "fewer", "more"].iter().enumerate() {
        let _ = writeln!(
            out,
            "kvmesh:router_prefix_predictions_total{{outcome=\"{outcome}\"}} {}",
            s.predictions[k].load(Ordering::Relaxed)
        );
    }
    s.picks.render(out);
    let _ = writeln!(
        out,
        "# HELP kvmesh:router_workers_routable Workers connected and in routing.\n\
         # TYPE kvmesh:router_workers_routable gauge\nkvmesh:router_workers_routable {}",
        workers
            .iter()
            .filter(|w| w.available() && w.generates())
            .count()
    );
    let _ = writeln!(
        out,
        "# HELP kvmesh:router_prefill_workers_connected Prefill nodes connected and reporting, available to decode nodes.\n\
         # TYPE kvmesh:router_prefill_workers_connected gauge\nkvmesh:router_prefill_workers_connected {}",
        workers.iter().filter(|w| w.prefill_ready()).count()
    );
    let _ = writeln!(out, "# TYPE kvmesh:prefill_routed_total counter");
    for w in workers.iter().filter(|w| w.prefills()) {
        let _ = writeln!(
            out,
            "kvmesh:prefill_routed_total{{worker=\"{}\"}} {}",
            w.record.node_id,
            w.prefilled.load(Ordering::Relaxed)
        );
    }
    let _ = writeln!(out, "# TYPE kvmesh:worker_routed_total counter");
    for w in workers {
        let _ = writeln!(
            out,
            "kvmesh:worker_routed_total{{worker=\"{}\"}} {}",
            w.record.node_id,
            w.routed.load(Ordering::Relaxed)
        );
    }
    let _ = writeln!(out, "# TYPE kvmesh:worker_load gauge");
    for w in workers {
        let _ = writeln!(
            out,
            "kvmesh:worker_load{{worker=\"{}\"}} {}",
            w.record.node_id,
            w.load()
        );
    }
    let _ = writeln!(out, "# TYPE kvmesh:worker_capacity_tokens_per_s gauge");
    for w in workers {
        let _ = writeln!(
            out,
            "kvmesh:worker_capacity_tokens_per_s{{worker=\"{}\"}} {:.1}",
            w.record.node_id,
            w.capacity()
        );
    }
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
        let mut out = String::new();
        t.render(&mut out);
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
