//! When requests are sent in request-rate mode.
//!
//! Arrivals form a renewal process with gamma-distributed gaps: shape `burstiness` and mean
//! `1 / rate`. Burstiness 1 is a Poisson process; below 1 the gaps vary more (bursts and lulls),
//! above 1 they grow more even, all at the same average rate.

use rand::rngs::StdRng;
use rand::SeedableRng;
use rand_distr::{Distribution, Gamma};

/// Seconds after the start at which each of `n` requests is sent. The first goes at once; an
/// infinite rate sends them all at once. The same seed gives the same schedule.
pub fn arrival_times(n: usize, rate: f64, burstiness: f64, seed: u64) -> Vec<f64> {
    if rate.is_infinite() {
        return vec![0.0; n];
    }
    // Scale so the mean gap, shape * scale, is 1 / rate whatever the shape.
    let gap = Gamma::new(burstiness, 1.0 / (rate * burstiness))
        .expect("rate and burstiness are checked positive and finite");
    // Its own stream, so the schedule does not shift when the prompts change.
    let mut rng = StdRng::seed_from_u64(seed ^ 0x5ca1_ab1e_0000_0001);
    let mut t = 0.0;
    (0..n)
        .map(|i| {
            if i > 0 {
                t += gap.sample(&mut rng);
            }
            t
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gaps(times: &[f64]) -> Vec<f64> {
        times.windows(2).map(|w| w[1] - w[0]).collect()
    }

    fn mean_var(v: &[f64]) -> (f64, f64) {
        let n = v.len() as f64;
        let mean = v.iter().sum::<f64>() / n;
        (mean, v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n)
    }

    #[test]
    fn poisson_arrivals_have_the_asked_mean_rate() {
        let t = arrival_times(20_001, 4.0, 1.0, 7);
        assert_eq!(t[0], 0.0);
        assert!(t.windows(2).all(|w| w[1] >= w[0]));
        let rate = 20_000.0 / t[20_000];
        assert!((rate - 4.0).abs() < 0.04 * 4.0, "rate {rate}");
        // Exponential gaps: the standard deviation equals the mean.
        let (mean, var) = mean_var(&gaps(&t));
        assert!(
            (var.sqrt() / mean - 1.0).abs() < 0.05,
            "cv {}",
            var.sqrt() / mean
        );
    }

    #[test]
    fn burstiness_changes_the_spread_not_the_rate() {
        for (burstiness, want_cv) in [(0.25f64, 2.0f64), (4.0, 0.5)] {
            let t = arrival_times(20_001, 10.0, burstiness, 3);
            let (mean, var) = mean_var(&gaps(&t));
            assert!((1.0 / mean - 10.0).abs() < 0.5, "rate {}", 1.0 / mean);
            // A gamma's coefficient of variation is 1 / sqrt(shape).
            let cv = var.sqrt() / mean;
            assert!((cv - want_cv).abs() < 0.1 * want_cv, "cv {cv}");
        }
    }

    #[test]
    fn schedules_are_reproducible_and_inf_sends_at_once() {
        assert_eq!(
            arrival_times(50, 2.0, 1.0, 9),
            arrival_times(50, 2.0, 1.0, 9)
        );
        assert_ne!(
            arrival_times(50, 2.0, 1.0, 9),
            arrival_times(50, 2.0, 1.0, 10)
        );
        assert_eq!(arrival_times(3, f64::INFINITY, 1.0, 0), vec![0.0; 3]);
    }
}
