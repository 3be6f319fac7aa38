//! Prometheus metrics, exposed through the `prometheus` crate in the text format (0.0.4)
//! scrapers and vLLM's dashboards read: names, labels and types as written, values and label
//! values escaped by the encoder, not by hand.
//!
//! Most of kvmesh's figures live in atomics where they are counted (an engine's stats, a
//! router's, a KV side's) and are read at scrape time: each scrape builds an [`Exposition`],
//! every part of the node adds its families to it, and it renders once. Histograms that
//! are observed as things happen (latencies, pick times) are long-lived `prometheus`
//! collectors, added to the exposition by reference.

use std::collections::HashMap;

use prometheus::core::{Collector, Desc};
use prometheus::proto::{self, LabelPair, Metric, MetricFamily, MetricType};
use prometheus::{Encoder, Registry, TextEncoder};

pub use prometheus::{Histogram, HistogramOpts, HistogramVec};

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
        self.counters(name, help, &[], [(Vec::new(), value)]);
    }

    /// A gauge with one sample.
    pub fn gauge(&self, name: &str, help: &str, value: f64) {
        self.gauges(name, help, &[], [(Vec::new(), value)]);
    }

    /// One histogram family from several histograms of the same name, each sample given
    /// `label` = its value (e.g. one router pool's pick times per `model_name`).
    #[allow(deprecated)] // get_metric has no non-deprecated equivalent returning a slice
    pub fn labelled_histograms<'a>(
        &self,
        label: &str,
        histograms: impl IntoIterator<Item = (&'a str, &'a Histogram)>,
    ) {
        let mut family: Option<MetricFamily> = None;
        let mut metrics = Vec::new();
        for (value, h) in histograms {
            for mf in h.collect() {
                for mut m in mf.get_metric().iter().cloned() {
                    let mut pair = LabelPair::default();
                    pair.set_name(label.to_string());
                    pair.set_value(value.to_string());
                    let mut pairs = vec![pair];
                    pairs.extend(m.take_label());
                    m.set_label(pairs);
                    metrics.push(m);
                }
                family.get_or_insert(mf);
            }
        }
        let Some(mut mf) = family else {
            return;
        };
        let desc = match Desc::new(
            mf.name().into(),
            mf.help().into(),
            vec![label.to_string()],
            HashMap::new(),
        ) {
            Ok(d) => d,
            Err(e) => {
                tracing::error!("a metric family was left out of the exposition: {e}");
                return;
            }
        };
        mf.set_metric(metrics);
        self.add(Family { desc, mf });
    }

    /// A counter family with one sample per set of `labels`' values (written in the order
    /// `labels` names them).
    pub fn counters<'a>(
        &self,
        name: &str,
        help: &str,
        labels: &[&str],
        samples: impl IntoIterator<Item = (Vec<&'a str>, f64)>,
    ) {
        self.family(name, help, MetricType::COUNTER, labels, samples);
    }

    /// A gauge family with one sample per set of `labels`' values.
    pub fn gauges<'a>(
        &self,
        name: &str,
        help: &str,
        labels: &[&str],
        samples: impl IntoIterator<Item = (Vec<&'a str>, f64)>,
    ) {
        self.family(name, help, MetricType::GAUGE, labels, samples);
    }

    fn family<'a>(
        &self,
        name: &str,
        help: &str,
        kind: MetricType,
        labels: &[&str],
        samples: impl IntoIterator<Item = (Vec<&'a str>, f64)>,
    ) {
        let names: Vec<String> = labels.iter().map(|l| l.to_string()).collect();
        let desc = match Desc::new(name.into(), help.into(), names, HashMap::new()) {
            Ok(d) => d,
            Err(e) => {
                tracing::error!("a metric family was left out of the exposition: {e}");
                return;
            }
        };
        let metrics = samples
            .into_iter()
            .map(|(values, v)| {
                let mut m = Metric::default();
                m.set_label(
                    labels
                        .iter()
                        .zip(values)
                        .map(|(n, v)| {
                            let mut p = LabelPair::default();
                            p.set_name(n.to_string());
                            p.set_value(v.to_string());
                            p
                        })
                        .collect(),
                );
                if kind == MetricType::COUNTER {
                    let mut c = proto::Counter::default();
                    c.set_value(v.max(0.0));
                    m.set_counter(c);
                } else {
                    let mut g = proto::Gauge::default();
                    g.set_value(v);
                    m.set_gauge(g);
                }
                m
            })
            .collect();
        let mut mf = MetricFamily::default();
        mf.set_name(name.into());
        mf.set_help(help.into());
        mf.set_field_type(kind);
        mf.set_metric(metrics);
        self.add(Family { desc, mf });
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

/// A family whose samples were read at scrape time: its labels stay in the order the code
/// names them (the prometheus crate's own vectors sort them by name).
struct Family {
    desc: Desc,
    mf: MetricFamily,
}

impl Collector for Family {
    fn desc(&self) -> Vec<&Desc> {
        vec![&self.desc]
    }

    fn collect(&self) -> Vec<MetricFamily> {
        vec![self.mf.clone()]
    }
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
        // Labels keep the order the code names them in.
        m.counters(
            "kvmesh:d_total",
            "Ordered labels.",
            &["model_name", "finished_reason"],
            [(vec!["m", "stop"], 1.0)],
        );
        let text = m.render();
        assert!(
            text.contains("kvmesh:d_total{model_name=\"m\",finished_reason=\"stop\"} 1\n"),
            "{text}"
        );
        // A second family of the same name is left out, not a failed scrape.
        m.counter("kvmesh:a_total", "Again.", 5.0);
        assert_eq!(m.render(), text);
    }
}
