//! One exponential backoff with jitter for everything that retries a peer: etcd's watch and
//! lease keeper, the router's links to workers, a request's rounds over the workers.
//!
//! Each delay is drawn uniformly from the top `jitter` share of the current step (with the
//! default 0.25: between 75% and 100% of it), then the step doubles up to `max`. Drawing
//! below the step, never above, keeps `max` a hard bound callers can reason with (a
//! request's patience, a lease's TTL) while still spreading out peers that failed together.
//! The draw is a small seeded generator: `seeded` makes the sequence reproducible in tests.

use std::time::Duration;

#[derive(Clone, Debug)]
pub struct Backoff {
    first: Duration,
    max: Duration,
    step: Duration,
    jitter: f64,
    state: u64,
}

impl Backoff {
    /// Starts at `first`, doubles up to `max` (at least `first`), jittered 25%, seeded from
    /// the clock, the process and a count of backoffs made, so peers (and the links of one
    /// process) that start together still spread out.
    pub fn new(first: Duration, max: Duration) -> Backoff {
        static MADE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let clock = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        let made = MADE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let seed = clock
            ^ u64::from(std::process::id()).rotate_left(32)
            ^ made.wrapping_mul(0xD6E8_FEB8_6659_FD93);
        Backoff::seeded(first, max, seed)
    }

    /// The same with a fixed seed.
    pub fn seeded(first: Duration, max: Duration, seed: u64) -> Backoff {
        Backoff {
            first,
            max: max.max(first),
            step: first,
            jitter: 0.25,
            state: seed ^ 0x9E37_79B9_7F4A_7C15,
        }
    }

    /// The share of each step the delay may fall short of it by, in `0..=1` (0: no jitter).
    pub fn with_jitter(mut self, jitter: f64) -> Backoff {
        self.jitter = jitter.clamp(0.0, 1.0);
        self
    }

    /// The step the next delay is drawn from, before jitter.
    pub fn step(&self) -> Duration {
        self.step
    }

    /// The next delay; the step then doubles, up to the maximum.
    pub fn next_delay(&mut self) -> Duration {
        let base = self.step;
        self.step = (self.step * 2).min(self.max);
        base.mul_f64(1.0 - self.jitter * self.uniform())
    }

    /// Back to the first step, after a success.
    pub fn reset(&mut self) {
        self.step = self.first;
    }

    /// Uniform in `[0, 1)` (splitmix64).
    fn uniform(&mut self) -> f64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn steps_double_up_to_the_maximum_and_delays_stay_within_the_step() {
        let mut b = Backoff::seeded(100 * MS, 1000 * MS, 1);
        let mut steps = Vec::new();
        for _ in 0..8 {
            let step = b.step();
            let d = b.next_delay();
            assert!(d <= step && d >= step.mul_f64(0.75), "{d:?} from {step:?}");
            steps.push(step.as_millis());
        }
        assert_eq!(steps, [100, 200, 400, 800, 1000, 1000, 1000, 1000]);
        b.reset();
        assert_eq!(b.step(), 100 * MS);
    }

    #[test]
    fn jitter_spreads_peers_and_a_seed_repeats() {
        let delays = |seed| {
            let mut b = Backoff::seeded(MS * 1000, MS * 1000, seed);
            (0..64).map(|_| b.next_delay()).collect::<Vec<_>>()
        };
        assert_eq!(delays(7), delays(7));
        assert_ne!(delays(7), delays(8));
        // Spread over the whole quarter below the step, not bunched.
        let d = delays(3);
        let (lo, hi) = (d.iter().min().unwrap(), d.iter().max().unwrap());
        assert!(*lo < MS * 800 && *hi > MS * 950, "{lo:?}..{hi:?}");
        // Two unseeded backoffs made together still differ.
        let (mut a, mut b) = (
            Backoff::new(MS * 1000, MS * 1000),
            Backoff::new(MS * 1000, MS * 1000),
        );
        let (va, vb): (Vec<_>, Vec<_>) = (0..8).map(|_| (a.next_delay(), b.next_delay())).unzip();
        assert_ne!(va, vb);
    }

    #[test]
    fn no_jitter_gives_the_steps_and_a_small_maximum_is_raised_to_the_first() {
        let mut b = Backoff::seeded(MS * 300, MS * 10, 0).with_jitter(0.0);
        assert_eq!([b.next_delay(), b.next_delay()], [MS * 300, MS * 300]);
    }
}
