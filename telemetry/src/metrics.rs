//! Prometheus metrics, exposed through the `prometheus` crate in the text format (0.0.4)
//! scrapers and vLLM's dashboards read: names, labels and types as written, values and label
//! values escaped by the encoder, not by hand.
//!
//! Most of kvmesh's figures live in atomics where they are counted (an engine's stats, a
//! router's, a KV side's) and are read at scrape time: each scrape builds an [`Exposition`],
//! every part of the node adds its families to it, and it renders once. Histograms that
//! are observed as things happen (latencies, pick times) are long-lived `prometheus`
//! collectors, added to the exposition by reference.

use prometheus::core::Collector;
use prometheus::{Counter, CounterVec, Encoder, Gauge, GaugeVec, Opts, Registry, TextEncoder};

pub use prometheus::{Histogram, HistogramOpts, HistogramVec, IntCounterVec};

/// The content type of the text format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4";

/// One scrape's metric families, rendered together.
#[derive(Default)]
pub struct Exposition {
    registry: Registry,
}

impl Exposition {
    pub fn new() -> Exposition {
        Exposition::default()
    }

    /// Adds a family; a second family of the same name is a mistake in the code, logged and
    /// left out rather than failing the scrape.
    pub fn add(&self, c: impl Collector + 'static) {
        if let Err(e) = self.registry.register(Box::new(c)) {
            tracing::error!("a metric family was left out of the exposition: {e}");
        }
    }

    /// A counter with one sample, its value as counted elsewhere.
    pub fn counter(&self, name: &str, help: &str, value: f64) {
        if let Ok(c) = Counter::with_opts(Opts::new(name, help)) {
            c.inc_by(value.max(0.0));
            self.add(c);
        }
    }

    /// A gauge with one sample.
    pub fn gauge(&self, name: &str, help: &str, value: f64) {
        if let Ok(g) = Gauge::with_opts(Opts::new(name, help)) {
            g.set(value);
            self.add(g);
        }
    }

    /// A counter family with one sample per set of `labels`' values.
    pub fn counters<'a>(
        &self,
        name: &str,
        help: &str,
        labels: &[&str],
        samples: impl IntoIterator<Item = (Vec<&'a str>, f64)>,
    ) {
        if let Ok(c) = CounterVec::new(Opts::new(name, help), labels) {
            for (values, v) in samples {
                if let Ok(s) = c.get_metric_with_label_values(&values) {
                    s.inc_by(v.max(0.0));
                }
            }
            self.add(c);
        }
    }

    /// A gauge family with one sample per set of `labels`' values.
    pub fn gauges<'a>(
        &self,
        name: &str,
        help: &str,
        labels: &[&str],
        samples: impl IntoIterator<Item = (Vec<&'a str>, f64)>,
    ) {
        if let Ok(g) = GaugeVec::new(Opts::new(name, help), labels) {
            for (values, v) in samples {
                if let Ok(s) = g.get_metric_with_label_values(&values) {
                    s.set(v);
                }
            }
            self.add(g);
        }
    }

    /// Every family in the text format, sorted by name.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut out) {
            tracing::error!("encoding metrics: {e}");
        }
        String::from_utf8(out).unwrap_or_default()
    }
}

/// A histogram with these bucket bounds; the names are the code's own, so a bad one is a
/// mistake in the code and panics at start-up.
pub fn histogram(name: &str, help: &str, buckets: &[f64]) -> Histogram {
    Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets.to_vec()))
        .expect("a valid histogram")
}

/// A histogram family with these labels.
pub fn histogram_vec(name: &str, help: &str, labels: &[&str], buckets: &[f64]) -> HistogramVec {
    HistogramVec::new(
        HistogramOpts::new(name, help).buckets(buckets.to_vec()),
        labels,
    )
    .expect("a valid histogram family")
}

/// A counter family with these labels, counted as things happen.
pub fn counter_vec(name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    IntCounterVec::new(Opts::new(name, help), labels).expect("a valid counter family")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_render_with_their_types_and_escaped_labels() {
        let m = Exposition::new();
        m.counter("kvmesh:a_total", "A counter.", 3.0);
        m.gauges(
            "kvmesh:b",
            "A gauge.",
            &["worker"],
            [(vec!["w\"1\\\n"], 1.5), (vec!["w2"], 2.0)],
        );
        let h = histogram("kvmesh:c_seconds", "A histogram.", &[0.00001, 0.001]);
        h.observe(0.000005);
        h.observe(0.5);
        m.add(h.clone());
        let text = m.render();
        for line in [
            "# TYPE kvmesh:a_total counter\nkvmesh:a_total 3\n",
            "# TYPE kvmesh:b gauge\n",
            "kvmesh:b{worker=\"w\\\"1\\\\\\n\"} 1.5\n",
            "kvmesh:b{worker=\"w2\"} 2\n",
            "kvmesh:c_seconds_bucket{le=\"0.00001\"} 1\n",
            "kvmesh:c_seconds_bucket{le=\"+Inf\"} 2\n",
            "kvmesh:c_seconds_count 2\n",
        ] {
            assert!(text.contains(line), "{line:?} not in\n{text}");
        }
        // A second family of the same name is left out, not a failed scrape.
        m.counter("kvmesh:a_total", "Again.", 5.0);
        assert_eq!(m.render(), text);
    }
}
