//! What an engine measures of itself: counters and gauges for `/metrics`, and the fit of
//! its decode step's time against its batch that routers weigh it by.

use std::sync::atomic::{AtomicU64, AtomicUsize};

/// Counters and gauges the engine keeps for `/metrics`.
#[derive(Default)]
pub struct EngineStats {
    pub running: AtomicUsize,
    pub waiting: AtomicUsize,
    pub free_blocks: AtomicUsize,
    /// Recurrent-state slots no running sequence holds (of `EngineInfo::num_state_slots`).
    pub free_state_slots: AtomicUsize,
    /// Recurrent states the prefix cache holds now (of `EngineInfo::num_state_snapshots`).
    pub saved_states: AtomicUsize,
    pub prefix_queries: AtomicU64,
    pub prefix_hits: AtomicU64,
    pub preemptions: AtomicU64,
    pub steps: AtomicU64,
    /// Wall time spent in steps, in microseconds: steps / busy time is how fast one running
    /// sequence advances while the engine works (what a router weighs nodes by).
    pub busy_us: AtomicU64,
    /// Steps with no prompt tokens in them, and their wall time: how fast decoding goes
    /// apart from the prompts a node happens to be computing.
    pub decode_steps: AtomicU64,
    pub decode_busy_us: AtomicU64,
    /// Of those steps: the time the backend's forward and sampling took (the model's step as
    /// `gpu-bench` measures it, plus waiting for its tokens), and the whole cycle from
    /// planning the step to its tokens sent. Cycle less forward is what the engine adds to
    /// a served token's time (`/metrics`: `kvmesh:engine_decode_*_seconds_total`).
    pub decode_forward_us: AtomicU64,
    pub decode_cycle_us: AtomicU64,
    /// Wall time prompt tokens took: steps that computed them, less the decode part of a
    /// mixed step (see [`prefill_part_us`]).
    pub prefill_busy_us: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    /// Sequences holding reserved blocks while their prompt's KV arrives from elsewhere.
    pub awaiting_kv: AtomicUsize,
    /// Blocks of finished sequences still lent to a transfer.
    pub held_blocks: AtomicUsize,
    /// How a decode step's time grows with its batch, fitted over recent steps: what a
    /// router needs to tell whether one more sequence here costs little (batching) or a
    /// share of the node (a saturated one).
    pub step_fit: parking_lot::Mutex<StepFit>,
}

/// A decode step's wall time as `base + per_seq * batch`, by least squares over recent
/// pure-decode steps, each weighing [`StepFit::DECAY`] times the one after it (about the
/// last 200 steps count). Batch sizes that never varied leave the slope unknown: the fit
/// then says the mean step and no slope, rather than guessing one.
#[derive(Clone, Debug, Default)]
pub struct StepFit {
    w: f64,
    sn: f64,
    st: f64,
    snn: f64,
    snt: f64,
}

/// A fitted step model, in seconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepModel {
    pub base_s: f64,
    pub per_seq_s: f64,
    /// The weight of the steps behind it (each older one counts less).
    pub samples: f64,
}

impl StepFit {
    pub const DECAY: f64 = 0.995;
    /// The weight of steps behind a fit before a step's decode part is predicted from it.
    pub const TRUSTED: f64 = 5.0;

    pub fn add(&mut self, batch: usize, took_s: f64) {
        let (n, t, d) = (batch as f64, took_s, Self::DECAY);
        self.w = self.w * d + 1.0;
        self.sn = self.sn * d + n;
        self.st = self.st * d + t;
        self.snn = self.snn * d + n * n;
        self.snt = self.snt * d + n * t;
    }

    /// `None` before any step. With no spread in batch sizes (variance below a quarter of
    /// a sequence squared) the slope is 0 and the base the mean step.
    pub fn model(&self) -> Option<StepModel> {
        if self.w < 1e-9 {
            return None;
        }
        let (mean_n, mean_t) = (self.sn / self.w, self.st / self.w);
        let var = self.snn / self.w - mean_n * mean_n;
        let cov = self.snt / self.w - mean_n * mean_t;
        let mut per_seq = if var > 0.25 { cov / var } else { 0.0 };
        // Timing noise can tilt a flat fit below zero; a step never gets faster with more.
        per_seq = per_seq.max(0.0);
        let mut base = mean_t - per_seq * mean_n;
        if base < 0.0 {
            // All of the time is per sequence.
            base = 0.0;
            per_seq = if mean_n > 0.0 { mean_t / mean_n } else { 0.0 };
        }
        Some(StepModel {
            base_s: base,
            per_seq_s: per_seq,
            samples: self.w,
        })
    }
}

/// The part of a step's time its prompt tokens took: all of it when nothing decoded in
/// it; otherwise what is left after the decode fit's prediction for its decoding
/// sequences (while there is a fit). Counting a mixed step's whole time as prefill would
/// rate short prompts as slow as a decode step: a 16-token prompt beside a batch on an
/// 8 ms step would measure some 2,000 tokens per second where the device does 50,000.
/// The remainder is floored at a fiftieth of the step, as noise can put the prediction
/// above the step.
pub fn prefill_part_us(took_us: u64, decode_seqs: usize, fit: Option<StepModel>) -> u64 {
    match fit {
        Some(m) if decode_seqs > 0 && m.samples >= StepFit::TRUSTED => {
            let predicted = (m.base_s + m.per_seq_s * decode_seqs as f64) * 1e6;
            let rest = took_us as f64 - predicted;
            (rest.max(took_us as f64 / 50.0)).round() as u64
        }
        _ => took_us,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_fit_recovers_base_and_slope_and_admits_an_unknown_slope() {
        let mut f = StepFit::default();
        assert!(f.model().is_none());
        // One batch size only: its mean, no slope.
        for _ in 0..50 {
            f.add(4, 0.010);
        }
        let m = f.model().unwrap();
        assert_eq!(m.per_seq_s, 0.0);
        assert!((m.base_s - 0.010).abs() < 1e-9, "{m:?}");
        // Varied batches on 8 ms + 0.1 ms per sequence.
        let mut f = StepFit::default();
        for k in 0..400 {
            let n = 1 + k % 48;
            f.add(n, 0.008 + 0.0001 * n as f64);
        }
        let m = f.model().unwrap();
        assert!((m.base_s - 0.008).abs() < 1e-6, "{m:?}");
        assert!((m.per_seq_s - 0.0001).abs() < 1e-8, "{m:?}");
        // Purely per sequence, with noise pushing the intercept below zero: all per seq.
        let mut f = StepFit::default();
        for k in 0..200 {
            let n = 10 + k % 3;
            f.add(n, 0.001 * n as f64 - 0.002 * (k % 2) as f64 + 0.001);
        }
        let m = f.model().unwrap();
        assert!(m.base_s >= 0.0 && m.per_seq_s >= 0.0, "{m:?}");
    }

    #[test]
    fn a_mixed_steps_prompt_share_is_what_the_decode_fit_leaves() {
        let mut f = StepFit::default();
        for k in 0..100 {
            f.add(1 + k % 8, 0.008 + 0.0001 * (1 + k % 8) as f64);
        }
        let fit = f.model();
        // 8 ms + 4 x 0.1 ms of decode in a 9 ms step: 0.6 ms of prompt.
        assert_eq!(prefill_part_us(9_000, 4, fit), 600);
        // A prompt-only step is all prompt; so is a mixed step with no fit to split by.
        assert_eq!(prefill_part_us(9_000, 0, fit), 9_000);
        assert_eq!(prefill_part_us(9_000, 4, None), 9_000);
        let mut young = StepFit::default();
        young.add(4, 0.0084);
        assert_eq!(prefill_part_us(9_000, 4, young.model()), 9_000);
        // Noise that puts the prediction above the step leaves a floor, not zero.
        assert_eq!(prefill_part_us(8_000, 4, fit), 160);
    }
}
