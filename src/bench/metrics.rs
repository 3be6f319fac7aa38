//! The numbers a serving benchmark reports, computed from what each request measured.
//!
//! Definitions follow the ones serving engines are compared by, so kvmesh's figures can sit
//! beside other servers' in one table:
//! - TTFT: from sending the request to the first chunk that carries text.
//! - ITL: the gap between consecutive text-carrying chunks (one entry per gap, all requests).
//! - TPOT: a request's decode time per token after the first, `(e2el - ttft) / (n - 1)`.
//! - E2EL: from sending the request to the end of its stream.
//!
//! Only successful requests enter the latency statistics and token totals; failures are
//! counted beside them.

use serde::{Deserialize, Serialize};

/// What one request measured. Times are seconds since the request was sent.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Outcome {
    pub ok: bool,
    pub ttft: f64,
    pub itl: Vec<f64>,
    pub e2el: f64,
    /// Generated tokens: the usage the server reported, else the text-carrying chunks counted.
    pub output_tokens: usize,
    /// The prompt length the server reported in its usage, where it did.
    pub server_prompt_tokens: Option<usize>,
    pub error: Option<String>,
}

impl Outcome {
    pub fn failed(error: impl Into<String>, e2el: f64) -> Outcome {
        Outcome {
            ok: false,
            e2el,
            error: Some(error.into()),
            ..Outcome::default()
        }
    }
}

/// Summary statistics of one latency, in milliseconds.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    /// How many values the statistics are over (0 means the others are 0 by convention).
    pub count: usize,
    pub mean: f64,
    pub median: f64,
    pub std: f64,
    /// `(p, value)` for each requested percentile.
    pub percentiles: Vec<(f64, f64)>,
}

impl Stats {
    /// Statistics of `values` given in seconds, reported in milliseconds.
    pub fn of_seconds(values: &[f64], percentiles: &[f64]) -> Stats {
        let mut ms: Vec<f64> = values.iter().map(|v| v * 1e3).collect();
        if ms.is_empty() {
            return Stats {
                percentiles: percentiles.iter().map(|&p| (p, 0.0)).collect(),
                ..Stats::default()
            };
        }
        ms.sort_by(f64::total_cmp);
        let n = ms.len() as f64;
        let mean = ms.iter().sum::<f64>() / n;
        let var = ms.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
        Stats {
            count: ms.len(),
            mean,
            median: percentile(&ms, 50.0),
            std: var.sqrt(),
            percentiles: percentiles
                .iter()
                .map(|&p| (p, percentile(&ms, p)))
                .collect(),
        }
    }

    /// The value at percentile `p`, if it was requested.
    pub fn p(&self, p: f64) -> Option<f64> {
        self.percentiles
            .iter()
            .find(|(q, _)| (q - p).abs() < 1e-9)
            .map(|&(_, v)| v)
    }
}

/// Percentile `p` (0..=100) of sorted values, interpolating linearly between the two nearest
/// ranks: numpy's default, so results compare with tools built on it.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    match sorted.len() {
        0 => 0.0,
        1 => sorted[0],
        n => {
            let rank = (p / 100.0).clamp(0.0, 1.0) * (n - 1) as f64;
            let lo = rank.floor() as usize;
            let hi = rank.ceil() as usize;
            sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
        }
    }
}

/// The metrics of one benchmark run (one concurrency or one request rate).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Metrics {
    pub completed: usize,
    pub failed: usize,
    pub duration_s: f64,
    /// Prompt tokens of the successful requests, as the benchmark's tokenizer counted them.
    pub total_input_tokens: usize,
    /// The same, as the server's usage reported it (chat templates add tokens), where it did.
    pub server_input_tokens: Option<usize>,
    pub total_output_tokens: usize,
    pub request_throughput: f64,
    pub output_throughput: f64,
    pub total_token_throughput: f64,
    pub ttft_ms: Stats,
    pub tpot_ms: Stats,
    pub itl_ms: Stats,
    pub e2el_ms: Stats,
}

impl Metrics {
    /// `prompt_lens[i]` is request i's prompt length; `duration` the wall time of the run.
    pub fn compute(
        outcomes: &[Outcome],
        prompt_lens: &[usize],
        duration: f64,
        percentiles: &[f64],
    ) -> Metrics {
        let mut m = Metrics {
            duration_s: duration,
            ..Metrics::default()
        };
        let (mut ttft, mut tpot, mut itl, mut e2el) = (vec![], vec![], vec![], vec![]);
        let mut server_input = Some(0);
        for (o, &plen) in outcomes.iter().zip(prompt_lens) {
            if !o.ok {
                m.failed += 1;
                continue;
            }
            m.completed += 1;
            m.total_input_tokens += plen;
            m.total_output_tokens += o.output_tokens;
            server_input = server_input.zip(o.server_prompt_tokens).map(|(a, b)| a + b);
            ttft.push(o.ttft);
            e2el.push(o.e2el);
            itl.extend_from_slice(&o.itl);
            // A single token has no decode time to spread.
            if o.output_tokens > 1 {
                tpot.push((o.e2el - o.ttft) / (o.output_tokens - 1) as f64);
            }
        }
        m.server_input_tokens = server_input.filter(|_| m.completed > 0);
        if duration > 0.0 {
            m.request_throughput = m.completed as f64 / duration;
            m.output_throughput = m.total_output_tokens as f64 / duration;
            m.total_token_throughput =
                (m.total_input_tokens + m.total_output_tokens) as f64 / duration;
        }
        m.ttft_ms = Stats::of_seconds(&ttft, percentiles);
        m.tpot_ms = Stats::of_seconds(&tpot, percentiles);
        m.itl_ms = Stats::of_seconds(&itl, percentiles);
        m.e2el_ms = Stats::of_seconds(&e2el, percentiles);
        m
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9 * b.abs().max(1.0)
    }

    #[test]
    fn percentiles_interpolate_linearly_like_numpy() {
        // numpy.percentile([1, 2, 3, 4], [0, 25, 50, 90, 99, 100]) ==
        // [1, 1.75, 2.5, 3.7, 3.97, 4]
        let v = [1.0, 2.0, 3.0, 4.0];
        for (p, want) in [
            (0.0, 1.0),
            (25.0, 1.75),
            (50.0, 2.5),
            (90.0, 3.7),
            (99.0, 3.97),
            (100.0, 4.0),
        ] {
            assert!(
                close(percentile(&v, p), want),
                "p{p}: {}",
                percentile(&v, p)
            );
        }
        // numpy.percentile(range(1, 101), 99) == 99.01
        let hundred: Vec<f64> = (1..=100).map(f64::from).collect();
        assert!(close(percentile(&hundred, 99.0), 99.01));
        assert_eq!(percentile(&[7.0], 99.0), 7.0);
        assert_eq!(percentile(&[], 50.0), 0.0);
    }

    #[test]
    fn stats_are_in_milliseconds_and_sorted_first() {
        let s = Stats::of_seconds(&[0.004, 0.001, 0.003, 0.002], &[50.0, 99.0]);
        assert_eq!(s.count, 4);
        assert!(close(s.mean, 2.5));
        assert!(close(s.median, 2.5));
        assert!(close(s.p(99.0).unwrap(), 3.97));
        assert!(close(s.std, 1.25f64.sqrt()));
        assert_eq!(s.p(90.0), None);
        let empty = Stats::of_seconds(&[], &[99.0]);
        assert_eq!(
            (empty.count, empty.mean, empty.p(99.0)),
            (0, 0.0, Some(0.0))
        );
    }

    #[test]
    fn metrics_from_known_timings() {
        let ok = |ttft: f64, itl: Vec<f64>, e2el: f64, n: usize| Outcome {
            ok: true,
            ttft,
            itl,
            e2el,
            output_tokens: n,
            server_prompt_tokens: Some(11),
            error: None,
        };
        let outcomes = vec![
            // TPOT (0.5 - 0.1) / 4 = 0.1
            ok(0.1, vec![0.1, 0.1, 0.1, 0.1], 0.5, 5),
            // TPOT (0.9 - 0.3) / 2 = 0.3
            ok(0.3, vec![0.2, 0.4], 0.9, 3),
            // One token: a TTFT and an E2EL, no TPOT.
            ok(0.2, vec![], 0.2, 1),
            Outcome::failed("HTTP 500: boom", 0.05),
        ];
        let m = Metrics::compute(&outcomes, &[10, 20, 30, 40], 2.0, &[99.0]);
        assert_eq!((m.completed, m.failed), (3, 1));
        assert_eq!(
            m.total_input_tokens, 60,
            "the failed request's prompt is not counted"
        );
        assert_eq!(m.server_input_tokens, Some(33));
        assert_eq!(m.total_output_tokens, 9);
        assert!(close(m.request_throughput, 1.5));
        assert!(close(m.output_throughput, 4.5));
        assert!(close(m.total_token_throughput, 34.5));
        assert!(close(m.ttft_ms.mean, 200.0));
        assert!(close(m.ttft_ms.median, 200.0));
        assert_eq!(m.tpot_ms.count, 2);
        assert!(close(m.tpot_ms.mean, 200.0));
        assert!(close(m.tpot_ms.p(99.0).unwrap(), 100.0 + 200.0 * 0.99));
        assert_eq!(m.itl_ms.count, 6);
        assert!(close(m.itl_ms.mean, 1000.0 / 6.0));
        assert!(close(m.itl_ms.median, 100.0));
        assert!(close(m.e2el_ms.mean, 1600.0 / 3.0));
    }

    #[test]
    fn a_run_where_everything_failed_reports_zeros_not_nans() {
        let m = Metrics::compute(
            &[
                Outcome::failed("refused", 0.0),
                Outcome::failed("refused", 0.0),
            ],
            &[5, 5],
            0.5,
            &[99.0],
        );
        assert_eq!((m.completed, m.failed), (0, 2));
        assert_eq!(m.server_input_tokens, None);
        assert_eq!(m.request_throughput, 0.0);
        assert_eq!(m.ttft_ms.mean, 0.0);
        assert!(serde_json::to_string(&m).unwrap().contains("\"failed\":2"));
    }
}
