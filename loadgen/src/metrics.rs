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
    /// Prompt tokens the server found in its prefix cache
    /// (`usage.prompt_tokens_details.cached_tokens`), where it reported them.
    pub cached_tokens: Option<usize>,
    /// The generated text as streamed (a conversation sends it back in the next turn).
    pub text: String,
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
    /// Prompt tokens the server served from its prefix cache, summed over the successful
    /// requests; `None` unless the server reported it for every one of them.
    #[serde(default)]
    pub cached_tokens: Option<usize>,
    /// `cached_tokens / server_input_tokens`; `None` (JSON null) where either is unknown.
    #[serde(default)]
    pub prefix_cache_hit_rate: Option<f64>,
    pub request_throughput: f64,
    pub output_throughput: f64,
    pub total_token_throughput: f64,
    pub ttft_ms: Stats,
    pub tpot_ms: Stats,
    pub itl_ms: Stats,
    pub e2el_ms: Stats,
    /// A `--dataset conversation` run: the same figures split by turn.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conversation: Option<ConversationMetrics>,
}

/// What the server reported of its prompts and its prefix cache over some requests.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CacheUse {
    /// Σ usage.prompt_tokens, `None` unless every successful request reported it.
    pub prompt_tokens: Option<usize>,
    /// Σ usage.prompt_tokens_details.cached_tokens, likewise.
    pub cached_tokens: Option<usize>,
}

impl CacheUse {
    /// Over the successful ones of `outcomes`; with none, everything is unknown.
    pub fn of<'a>(outcomes: impl IntoIterator<Item = &'a Outcome>) -> CacheUse {
        let (mut prompt, mut cached, mut any) = (Some(0), Some(0), false);
        for o in outcomes.into_iter().filter(|o| o.ok) {
            any = true;
            prompt = prompt.zip(o.server_prompt_tokens).map(|(a, b)| a + b);
            cached = cached.zip(o.cached_tokens).map(|(a, b)| a + b);
        }
        if !any {
            return CacheUse::default();
        }
        CacheUse {
            prompt_tokens: prompt,
            cached_tokens: cached,
        }
    }

    /// The share of prompt tokens served from the cache; unknown unless both sums are.
    pub fn hit_rate(&self) -> Option<f64> {
        match (self.prompt_tokens, self.cached_tokens) {
            (Some(p), Some(c)) if p > 0 => Some(c as f64 / p as f64),
            _ => None,
        }
    }
}

/// One group of a conversation run's requests (a turn, or several).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TurnMetrics {
    pub completed: usize,
    pub failed: usize,
    /// Σ usage.prompt_tokens of the successful requests; null where the server did not say.
    pub server_input_tokens: Option<usize>,
    /// Σ usage.prompt_tokens_details.cached_tokens; null where the server did not say.
    pub cached_tokens: Option<usize>,
    /// `cached_tokens / server_input_tokens`; null where either is unknown.
    pub prefix_cache_hit_rate: Option<f64>,
    pub ttft_ms: Stats,
}

impl TurnMetrics {
    fn of(outcomes: &[&Outcome], percentiles: &[f64]) -> TurnMetrics {
        let cache = CacheUse::of(outcomes.iter().copied());
        let ttft: Vec<f64> = outcomes.iter().filter(|o| o.ok).map(|o| o.ttft).collect();
        TurnMetrics {
            completed: ttft.len(),
            failed: outcomes.len() - ttft.len(),
            server_input_tokens: cache.prompt_tokens,
            cached_tokens: cache.cached_tokens,
            prefix_cache_hit_rate: cache.hit_rate(),
            ttft_ms: Stats::of_seconds(&ttft, percentiles),
        }
    }
}

/// A conversation run split by turn: the first turn (a fresh prompt) against the later ones
/// (the history so far plus a new message), where a prefix cache should hit.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ConversationMetrics {
    pub conversations: usize,
    pub turns: usize,
    pub first_turn: TurnMetrics,
    /// Turns 2 and on; empty (null hit rate) with one turn per conversation.
    pub later_turns: TurnMetrics,
    /// Turn by turn, from the first.
    pub per_turn: Vec<TurnMetrics>,
}

impl ConversationMetrics {
    /// `outcomes` conversation by conversation: turn t of conversation c at `c * turns + t`.
    pub fn compute(outcomes: &[Outcome], turns: usize, percentiles: &[f64]) -> ConversationMetrics {
        let turn_of = |i: usize| i % turns;
        let pick = |keep: &dyn Fn(usize) -> bool| -> Vec<&Outcome> {
            outcomes
                .iter()
                .enumerate()
                .filter(|&(i, _)| keep(turn_of(i)))
                .map(|(_, o)| o)
                .collect()
        };
        ConversationMetrics {
            conversations: outcomes.len() / turns,
            turns,
            first_turn: TurnMetrics::of(&pick(&|t| t == 0), percentiles),
            later_turns: TurnMetrics::of(&pick(&|t| t > 0), percentiles),
            per_turn: (0..turns)
                .map(|turn| TurnMetrics::of(&pick(&|t| t == turn), percentiles))
                .collect(),
        }
    }
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
        let cache = CacheUse::of(outcomes);
        m.cached_tokens = cache.cached_tokens;
        m.prefix_cache_hit_rate = cache.hit_rate();
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
            cached_tokens: Some(1),
            text: "x".repeat(n),
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
        assert_eq!(m.cached_tokens, Some(3));
        assert!(close(m.prefix_cache_hit_rate.unwrap(), 3.0 / 33.0));
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
        assert_eq!((m.cached_tokens, m.prefix_cache_hit_rate), (None, None));
        assert_eq!(m.request_throughput, 0.0);
        assert_eq!(m.ttft_ms.mean, 0.0);
        assert!(serde_json::to_string(&m).unwrap().contains("\"failed\":2"));
    }

    fn served(ttft: f64, prompt: usize, cached: Option<usize>) -> Outcome {
        Outcome {
            ok: true,
            ttft,
            e2el: ttft + 0.1,
            output_tokens: 4,
            server_prompt_tokens: Some(prompt),
            cached_tokens: cached,
            ..Outcome::default()
        }
    }

    #[test]
    fn the_hit_rate_is_unknown_unless_every_request_reported_cached_tokens() {
        let known = [served(0.1, 100, Some(0)), served(0.1, 300, Some(200))];
        let c = CacheUse::of(&known);
        assert_eq!((c.prompt_tokens, c.cached_tokens), (Some(400), Some(200)));
        assert_eq!(c.hit_rate(), Some(0.5));
        // Nothing cached is a rate of 0, not unknown.
        assert_eq!(CacheUse::of(&known[..1]).hit_rate(), Some(0.0));
        // One request without cached_tokens makes the sum, and the rate, unknown.
        let mixed = [served(0.1, 100, Some(50)), served(0.1, 100, None)];
        assert_eq!(CacheUse::of(&mixed).hit_rate(), None);
        // Failed requests are left out; none successful is unknown.
        let failed = [Outcome::failed("boom", 0.1), served(0.1, 10, Some(5))];
        assert_eq!(CacheUse::of(&failed).hit_rate(), Some(0.5));
        assert_eq!(CacheUse::of(&failed[..1]).hit_rate(), None);
        let m = Metrics::compute(&mixed, &[100, 100], 1.0, &[99.0]);
        let j = serde_json::to_value(&m).unwrap();
        assert!(j["prefix_cache_hit_rate"].is_null(), "{j}");
        assert!(
            j.get("conversation").is_none(),
            "only conversation runs carry it: {j}"
        );
    }

    #[test]
    fn conversation_metrics_split_the_first_turn_from_the_later_ones() {
        // Two conversations of three turns, conversation by conversation.
        let outcomes = [
            served(0.30, 100, Some(0)),
            served(0.10, 200, Some(96)),
            served(0.10, 300, Some(192)),
            served(0.50, 100, Some(16)),
            Outcome::failed("HTTP 500", 0.1),
            Outcome::failed("not sent", 0.0),
        ];
        let c = ConversationMetrics::compute(&outcomes, 3, &[99.0]);
        assert_eq!((c.conversations, c.turns), (2, 3));
        assert_eq!((c.first_turn.completed, c.first_turn.failed), (2, 0));
        assert_eq!(c.first_turn.prefix_cache_hit_rate, Some(16.0 / 200.0));
        assert!(close(c.first_turn.ttft_ms.mean, 400.0));
        assert_eq!((c.later_turns.completed, c.later_turns.failed), (2, 2));
        assert_eq!(c.later_turns.server_input_tokens, Some(500));
        assert_eq!(c.later_turns.prefix_cache_hit_rate, Some(288.0 / 500.0));
        assert!(close(c.later_turns.ttft_ms.mean, 100.0));
        assert_eq!(c.per_turn.len(), 3);
        assert_eq!(c.per_turn[2].prefix_cache_hit_rate, Some(192.0 / 300.0));
        // One turn per conversation: nothing later, so no later rate.
        let one = ConversationMetrics::compute(&outcomes[..2], 1, &[99.0]);
        assert_eq!(one.later_turns.completed, 0);
        assert_eq!(one.later_turns.prefix_cache_hit_rate, None);
        let j = serde_json::to_value(&one).unwrap();
        assert!(j["later_turns"]["prefix_cache_hit_rate"].is_null(), "{j}");
    }
}
