//! Choosing the next token from logits: greedy, temperature, top-k, top-p, per-request seeds,
//! and the log-probabilities a client may ask for.

/// How a request wants its tokens chosen and when it wants them to stop.
#[derive(Clone, Debug)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 means no limit.
    pub top_k: usize,
    pub top_p: f32,
    pub seed: Option<u64>,
    pub max_tokens: usize,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// How many top alternatives to report with each token; `None` reports no logprobs.
    pub logprobs: Option<usize>,
    /// Draws of the seeded generator already spent on this sequence's tokens elsewhere (a
    /// sequence continued on another worker after its first one was lost): the generator
    /// skips them, so a seeded request goes on exactly as it would have.
    pub resume_draws: u64,
    /// Added to a token's logit before sampling (OpenAI's `logit_bias`: -100 bans a token in
    /// practice, +100 forces it).
    pub logit_bias: Vec<(u32, f32)>,
    /// The grammar the output must follow (see [`crate::guided`]).
    pub guide: Option<crate::guided::Guide>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: None,
            max_tokens: 16,
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            resume_draws: 0,
            logit_bias: Vec::new(),
            guide: None,
        }
    }
}

/// xoshiro256**: small, fast, and the same sequence for the same seed on every machine.
#[derive(Clone, Debug)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    pub fn seeded(seed: u64) -> Rng {
        let mut z = seed;
        let mut next = || {
            z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut x = z;
            x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            x ^ (x >> 31)
        };
        Rng {
            s: [next(), next(), next(), next()],
        }
    }

    /// Seeded from the clock and a counter, for requests without a seed.
    pub fn from_entropy() -> Rng {
        use std::sync::atomic::{AtomicU64, Ordering};
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        Rng::seeded(
            t ^ COUNTER
                .fetch_add(1, Ordering::Relaxed)
                .wrapping_mul(0x2545_f491_4f6c_dd1d),
        )
    }

    /// Spends `n` draws, as sampling `n` tokens at a temperature does.
    pub fn skip(&mut self, n: u64) {
        for _ in 0..n {
            self.next_u64();
        }
    }

    /// The generator's state, so another process can continue the same sequence (a decode
    /// worker taking over from the prefill worker that drew a request's first token).
    pub fn state(&self) -> [u64; 4] {
        self.s
    }

    pub fn from_state(s: [u64; 4]) -> Rng {
        Rng { s }
    }

    pub fn next_u64(&mut self) -> u64 {
        let r = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        r
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Normally distributed, mean 0, deviation 1 (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = self.next_f64().max(1e-300);
        let u2 = self.next_f64();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
}

/// One chosen token, with the logprobs asked for (of the model's distribution, before
/// temperature and truncation, as vLLM reports them).
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

fn log_sum_exp(logits: &[f32]) -> f32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&x| ((x - max) as f64).exp()).sum();
    max + sum.ln() as f32
}

/// The index of the highest logit (the first of ties).
pub fn argmax_of(logits: &[f32]) -> u32 {
    argmax(logits)
}

/// What a request does to the model's logits before a token is chosen: its `logit_bias`,
/// then its grammar's mask (see [`crate::guided`]).
pub fn constrain(logits: &mut [f32], bias: &[(u32, f32)], mask: Option<&[u32]>) {
    for &(t, b) in bias {
        if let Some(l) = logits.get_mut(t as usize) {
            *l += b;
        }
    }
    if let Some(m) = mask {
        crate::guided::apply_mask(logits, m);
    }
}

fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// The `n` highest logits, highest first.
fn top_n(logits: &[f32], n: usize) -> Vec<(u32, f32)> {
    let n = n.min(logits.len());
    if n == 0 {
        return Vec::new();
    }
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    let by_logit = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]);
    if n < idx.len() {
        idx.select_nth_unstable_by(n - 1, by_logit);
        idx.truncate(n);
    }
    idx.sort_by(by_logit);
    idx.into_iter().map(|i| (i, logits[i as usize])).collect()
}

pub fn sample(logits: &[f32], p: &SamplingParams, rng: &mut Rng) -> Sampled {
    let token = if p.temperature <= 1e-5 || p.top_k == 1 {
        argmax(logits)
    } else {
        sample_random(logits, p, rng)
    };
    let lse = log_sum_exp(logits);
    let top = match p.logprobs {
        Some(n) if n > 0 => top_n(logits, n)
            .into_iter()
            // Tokens a mask banned are not alternatives.
            .filter(|(_, l)| l.is_finite())
            .map(|(t, l)| (t, l - lse))
            .collect(),
        _ => Vec::new(),
    };
    Sampled {
        token,
        logprob: logits[token as usize] - lse,
        top,
    }
}

/// A float's bits as an unsigned key with the same order (negatives reversed). The CUDA
/// sampler finds its thresholds over these keys; the CPU uses the same keys so both keep
/// exactly the same set.
fn order_key(x: f32) -> u32 {
    let b = x.to_bits();
    if b & 0x8000_0000 != 0 {
        !b
    } else {
        b | 0x8000_0000
    }
}

/// The key threshold of the kept set `{x : order_key(x) >= threshold}` for top-k then
/// top-p. Ties at a threshold are kept together, so the set can be a little larger than k.
/// top-p keeps the smallest run of highest logits whose mass (at this temperature) reaches
/// `top_p` of the top-k mass.
fn keep_threshold(logits: &[f32], p: &SamplingParams, max: f32, inv_t: f32) -> u32 {
    let mut keys: Vec<u32> = logits.iter().map(|&x| order_key(x)).collect();
    let mut thr = 0u32;
    if p.top_k > 0 && p.top_k < keys.len() {
        let (_, kth, _) = keys.select_nth_unstable_by(p.top_k - 1, |a, b| b.cmp(a));
        thr = *kth;
    }
    if p.top_p < 1.0 {
        let mut kept: Vec<(u32, f64)> = logits
            .iter()
            .filter(|&&x| order_key(x) >= thr)
            .map(|&x| (order_key(x), (((x - max) * inv_t) as f64).exp()))
            .collect();
        kept.sort_unstable_by_key(|k| std::cmp::Reverse(k.0));
        let want = p.top_p as f64 * kept.iter().map(|k| k.1).sum::<f64>();
        let mut acc = 0.0;
        for &(key, w) in &kept {
            acc += w;
            if acc >= want {
                thr = thr.max(key);
                break;
            }
        }
    }
    thr
}

/// One draw from the kept weights, walked in vocabulary order (as the CUDA sampler walks
/// them), so a seed picks the same token on either backend up to float rounding.
fn sample_random(logits: &[f32], p: &SamplingParams, rng: &mut Rng) -> u32 {
    let inv_t = 1.0 / p.temperature;
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let truncate = p.top_k > 0 && p.top_k < logits.len() || p.top_p < 1.0;
    let thr = if truncate {
        keep_threshold(logits, p, max, inv_t)
    } else {
        0
    };
    let weights: Vec<f64> = logits
        .iter()
        .map(|&x| {
            if order_key(x) >= thr {
                (((x - max) * inv_t) as f64).exp()
            } else {
                0.0
            }
        })
        .collect();
    draw(&weights, rng) as u32
}

fn draw(weights: &[f64], rng: &mut Rng) -> usize {
    let total: f64 = weights.iter().sum();
    let mut r = rng.next_f64() * total;
    let mut last = 0;
    for (i, &w) in weights.iter().enumerate() {
        if w > 0.0 {
            last = i;
            r -= w;
            if r < 0.0 {
                return i;
            }
        }
    }
    last
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(t: f32, k: usize, p: f32) -> SamplingParams {
        SamplingParams {
            temperature: t,
            top_k: k,
            top_p: p,
            ..Default::default()
        }
    }

    #[test]
    fn greedy_takes_the_max_and_reports_logprobs() {
        let logits = [0.0, 3.0, 1.0, 2.0];
        let mut rng = Rng::seeded(1);
        let s = sample(
            &logits,
            &SamplingParams {
                logprobs: Some(2),
                ..params(0.0, 0, 1.0)
            },
            &mut rng,
        );
        assert_eq!(s.token, 1);
        let lse = (0f32.exp() + 3f32.exp() + 1f32.exp() + 2f32.exp()).ln();
        assert!((s.logprob - (3.0 - lse)).abs() < 1e-5);
        assert_eq!(s.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 3]);
    }

    #[test]
    fn top_k_and_top_p_never_pick_outside_the_set() {
        let logits = [5.0, 4.9, 0.0, -1.0, 4.8];
        let mut rng = Rng::seeded(7);
        for _ in 0..500 {
            let t = sample(&logits, &params(1.0, 2, 1.0), &mut rng).token;
            assert!(t == 0 || t == 1, "top_k=2 picked {t}");
            let t = sample(&logits, &params(1.0, 0, 0.5), &mut rng).token;
            assert!(t == 0 || t == 1, "top_p=0.5 picked {t}");
        }
    }

    #[test]
    fn same_seed_same_draws_and_temperature_spreads() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let p = params(1.0, 0, 1.0);
        let run = |seed| {
            let mut rng = Rng::seeded(seed);
            (0..20)
                .map(|_| sample(&logits, &p, &mut rng).token)
                .collect::<Vec<_>>()
        };
        assert_eq!(run(42), run(42));
        assert_ne!(run(42), run(43));
        let distinct: std::collections::HashSet<_> = run(42).into_iter().collect();
        assert!(distinct.len() > 3);
    }

    #[test]
    fn order_keys_sort_like_the_floats() {
        let xs = [
            f32::NEG_INFINITY,
            -3.5,
            -1e-30,
            -0.0,
            0.0,
            1e-30,
            2.0,
            7.25,
            f32::INFINITY,
        ];
        for w in xs.windows(2) {
            assert!(order_key(w[0]) <= order_key(w[1]), "{} vs {}", w[0], w[1]);
        }
        assert!(order_key(-1.0) < order_key(1.0));
    }

    /// Frequencies over many draws match the truncated, renormalised softmax.
    #[test]
    fn truncated_draws_follow_the_renormalised_distribution() {
        let logits = [2.0f32, 1.0, 0.5, 3.0, -1.0, 2.5];
        let t = 0.8f32;
        let w = |i: usize| (((logits[i] - 3.0) / t) as f64).exp();
        // top_k 3 keeps ids 3, 5, 0; top_p 0.7 of that mass keeps 3 and 5.
        let cases: [(usize, f32, &[usize]); 3] =
            [(3, 1.0, &[3, 5, 0]), (0, 0.7, &[3, 5]), (3, 0.7, &[3, 5])];
        for (k, top_p, kept) in cases {
            let mass: f64 = logits.iter().map(|&x| (((x - 3.0) / t) as f64).exp()).sum();
            let kmass: f64 = [3usize, 5, 0].iter().map(|&i| w(i)).sum();
            assert!(w(3) / kmass < 0.7 && (w(3) + w(5)) / kmass >= 0.7);
            assert!((w(3) + w(5)) / mass >= 0.7);
            let mut rng = Rng::seeded(11);
            let n = 40_000;
            let mut counts = [0usize; 6];
            for _ in 0..n {
                counts[sample(&logits, &params(t, k, top_p), &mut rng).token as usize] += 1;
            }
            let total: f64 = kept.iter().map(|&i| w(i)).sum();
            for (i, &count) in counts.iter().enumerate() {
                let want = if kept.contains(&i) { w(i) / total } else { 0.0 };
                let got = count as f64 / n as f64;
                assert!(
                    (got - want).abs() < 0.01,
                    "k={k} p={top_p} id {i}: {got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn ties_at_the_top_k_threshold_are_kept_together() {
        let logits = [1.0f32, 4.0, 1.0, 1.0, 0.0];
        let mut rng = Rng::seeded(3);
        let mut seen = std::collections::HashSet::new();
        for _ in 0..2000 {
            seen.insert(sample(&logits, &params(5.0, 2, 1.0), &mut rng).token);
        }
        assert!(!seen.contains(&4), "below the threshold");
        assert!(seen.contains(&0) && seen.contains(&2) && seen.contains(&3));
    }
}
