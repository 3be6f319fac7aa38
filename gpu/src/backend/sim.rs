//! The `sim` backend: no math, only time. A step takes as long as a timing model says a
//! real device would take for that batch, and each sequence's next token is a fixed
//! function of its last token and position, so outputs are deterministic and checkable.
//!
//! It lets routing, batching and cluster behaviour be tested and benchmarked at scale on a
//! machine without a GPU: the engine, scheduler, KV block budget and prefix cache are the
//! real ones; only the forward pass is modelled.
//!
//! The KV cache is real memory of the size the model's shape needs (bf16, as a GPU holds
//! it), though nothing is computed into it: KV transfers move the bytes a real model would
//! move, so their sizes and times are what a real deployment sees.

use std::sync::Arc;
use std::time::Duration;

use super::error::SimError;
use super::{Backend, ForwardBatch, SampleSpec};
use crate::error::Result;
use crate::kv_pool::{HostKvPool, KvSpec};
use crate::sampler::Sampled;

/// How long a step takes, at speed 1.
#[derive(Clone, Debug)]
pub struct SimTiming {
    /// Per prompt token computed in the step.
    pub prefill_per_token: Duration,
    /// Fixed cost of a step with any decode in it (weights read once).
    pub decode_base: Duration,
    /// Added per decoding sequence.
    pub decode_per_seq: Duration,
    /// Divides every cost: a node with speed 3 is three times as fast.
    pub speed: f64,
}

impl Default for SimTiming {
    /// Roughly a small model on one modern GPU.
    fn default() -> Self {
        SimTiming {
            prefill_per_token: Duration::from_micros(20),
            decode_base: Duration::from_millis(8),
            decode_per_seq: Duration::from_micros(100),
            speed: 1.0,
        }
    }
}

impl SimTiming {
    /// Costs nothing: measures the serving machinery alone.
    pub fn zero() -> SimTiming {
        SimTiming {
            prefill_per_token: Duration::ZERO,
            decode_base: Duration::ZERO,
            decode_per_seq: Duration::ZERO,
            speed: 1.0,
        }
    }

    pub fn step(&self, prefill_tokens: usize, decode_seqs: usize) -> Duration {
        let mut t = self.prefill_per_token * prefill_tokens as u32;
        if decode_seqs > 0 {
            t += self.decode_base + self.decode_per_seq * decode_seqs as u32;
        }
        t.div_f64(self.speed.max(1e-9))
    }
}

pub struct SimBackend {
    timing: SimTiming,
    kv: Arc<HostKvPool>,
    vocab: usize,
    /// The ids outputs are drawn from: never eos or another special token, so sequences run
    /// to max_tokens (see `model::sim_outputs` for how a model's are chosen).
    outputs: Vec<u32>,
    /// How far past their modelled time earlier steps' sleeps ran (see [`Overshoot`]).
    overshoot: Overshoot,
    /// Steps do not sleep: their modelled time waits here for the engine's driver
    /// ([`Backend::defer_steps`]).
    deferred: Option<Option<Duration>>,
}

/// A sleep ends late: by the kernel's timer slack (50 us by default) and the wake-up. Left
/// alone, every step would run that much over the model, which at a few milliseconds a step
/// is several percent of throughput that no device would lose. The lateness is carried:
/// the next step sleeps that much less, so steps average what the model says.
#[derive(Clone, Copy, Debug, Default)]
pub struct Overshoot {
    owed: Duration,
}

impl Overshoot {
    /// The most lateness carried to later steps (a long stall is not paid back by running
    /// the following steps in no time).
    const MAX_OWED: Duration = Duration::from_millis(1);

    /// How long to sleep for a step the model says takes `t`.
    pub fn plan(&self, t: Duration) -> Duration {
        t.saturating_sub(self.owed)
    }

    /// After a step of modelled time `t` that took `took` (planned with [`Self::plan`]).
    pub fn settle(&mut self, t: Duration, took: Duration) {
        self.owed = (self.owed + took).saturating_sub(t).min(Self::MAX_OWED);
    }
}

impl SimBackend {
    /// `vocab` is the model's; `outputs` the ids outputs are drawn from (each below
    /// `vocab`); `kv` the cache's shape (its memory is allocated, zeroed, and resident once
    /// written).
    pub fn new(
        timing: SimTiming,
        kv: KvSpec,
        num_blocks: usize,
        vocab: usize,
        outputs: Vec<u32>,
    ) -> Result<SimBackend> {
        if outputs.is_empty() {
            return Err(SimError::NoOutputs.into());
        }
        if let Some(bad) = outputs.iter().find(|&&t| t as usize >= vocab) {
            return Err(SimError::OutsideVocab { token: *bad, vocab }.into());
        }
        Ok(SimBackend {
            timing,
            kv: Arc::new(HostKvPool::new(kv, num_blocks)?),
            vocab,
            outputs,
            overshoot: Overshoot::default(),
            deferred: None,
        })
    }

    /// The token that follows `last` at position `pos`.
    pub fn next_token(&self, last: u32, pos: usize) -> u32 {
        let mut z = (last as u64) << 32 | pos as u64;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        self.outputs[((z ^ (z >> 31)) % self.outputs.len() as u64) as usize]
    }

    /// Sleeps the step's modelled time, split evenly over the layers when `kv_ready` wants
    /// to hear of each layer (so a transfer overlaps the rest of the step, as on a device).
    fn run(&mut self, batch: &ForwardBatch, kv_ready: Option<&(dyn Fn(usize) + Sync)>) -> Vec<u32> {
        let decode = batch
            .seqs
            .iter()
            .filter(|s| s.tokens.len() == 1 && s.start_pos > 0)
            .count();
        let prefill = batch.num_tokens() - decode;
        let t = self.timing.step(prefill, decode);
        if let Some(due) = &mut self.deferred {
            // The driver waits the step out, and tells transfers of its layers at its end.
            *due = Some(t);
            if let Some(ready) = kv_ready {
                (0..self.kv.spec().num_layers).for_each(ready);
            }
            return self.tokens(batch);
        }
        let started = std::time::Instant::now();
        let sleep = self.overshoot.plan(t);
        match kv_ready {
            Some(ready) => {
                let layers = self.kv.spec().num_layers.max(1);
                let per_layer = sleep / layers as u32;
                for layer in 0..layers {
                    if !per_layer.is_zero() {
                        std::thread::sleep(per_layer);
                    }
                    ready(layer);
                }
            }
            None if !sleep.is_zero() => std::thread::sleep(sleep),
            None => {}
        }
        if !t.is_zero() {
            self.overshoot.settle(t, started.elapsed());
        }
        self.tokens(batch)
    }

    /// Each sequence's next token, for those that want one.
    fn tokens(&self, batch: &ForwardBatch) -> Vec<u32> {
        batch
            .seqs
            .iter()
            .filter(|s| s.want_logits)
            .map(|s| {
                self.next_token(
                    *s.tokens.last().unwrap_or(&0),
                    s.start_pos + s.tokens.len() - 1,
                )
            })
            .collect()
    }

    /// The timing model's tokens; a request with a bias or a grammar samples from logits
    /// that favour the model's token, so its constraint holds here as on a real backend.
    fn sampled(&self, tokens: Vec<u32>, specs: &mut [SampleSpec]) -> Vec<Sampled> {
        tokens
            .into_iter()
            .enumerate()
            .map(
                |(i, token)| match specs.get_mut(i).filter(|s| s.constrained()) {
                    Some(s) => {
                        let mut l = vec![0f32; self.vocab];
                        l[token as usize] = 1.0;
                        s.sample(&l)
                    }
                    None => Sampled {
                        token,
                        logprob: 0.0,
                        top: Vec::new(),
                    },
                },
            )
            .collect()
    }
}

impl Backend for SimBackend {
    fn device(&self) -> String {
        format!("sim (speed {})", self.timing.speed)
    }

    fn num_blocks(&self) -> usize {
        self.kv.num_blocks()
    }

    fn kv_spec(&self) -> Option<KvSpec> {
        Some(self.kv.spec().clone())
    }

    fn host_kv(&self) -> Option<Arc<HostKvPool>> {
        Some(self.kv.clone())
    }

    fn defer_steps(&mut self) -> bool {
        self.deferred = Some(None);
        true
    }

    fn take_due(&mut self) -> Option<Duration> {
        self.deferred.as_mut().and_then(Option::take)
    }

    fn forward(&mut self, batch: &ForwardBatch) -> Result<Vec<Vec<f32>>> {
        Ok(self
            .run(batch, None)
            .into_iter()
            .map(|t| {
                let mut l = vec![0f32; self.vocab];
                l[t as usize] = 1.0;
                l
            })
            .collect())
    }

    /// Tokens without building vocabulary-sized logits.
    fn forward_sample(
        &mut self,
        batch: &ForwardBatch,
        specs: &mut [SampleSpec],
    ) -> Result<Vec<Sampled>> {
        let tokens = self.run(batch, None);
        Ok(self.sampled(tokens, specs))
    }

    fn forward_sample_streaming(
        &mut self,
        batch: &ForwardBatch,
        specs: &mut [SampleSpec],
        kv_ready: &(dyn Fn(usize) + Sync),
    ) -> Result<Vec<Sampled>> {
        let tokens = self.run(batch, Some(kv_ready));
        Ok(self.sampled(tokens, specs))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn late_sleeps_are_paid_back_by_the_next_steps() {
        let ms = Duration::from_millis;
        let us = Duration::from_micros;
        let mut o = Overshoot::default();
        assert_eq!(o.plan(ms(4)), ms(4));
        // 100 us late: the next step sleeps 100 us less.
        o.settle(ms(4), ms(4) + us(100));
        assert_eq!(o.plan(ms(4)), ms(4) - us(100));
        // That one ran 60 us over its shortened sleep: 60 us owed, not 160.
        o.settle(ms(4), ms(4) - us(40));
        assert_eq!(o.plan(ms(4)), ms(4) - us(60));
        // On time: nothing owed.
        o.settle(ms(4), ms(4) - us(60));
        assert_eq!(o.plan(ms(4)), ms(4));
        // A stall is paid back only up to the cap, and never below zero sleep.
        o.settle(ms(4), ms(50));
        assert_eq!(o.plan(ms(4)), ms(3));
        assert_eq!(o.plan(us(300)), Duration::ZERO);
    }

    #[test]
    fn step_time_scales_with_work_and_speed() {
        let t = SimTiming::default();
        assert_eq!(t.step(0, 0), Duration::ZERO);
        assert!(t.step(1000, 0) > t.step(10, 0));
        assert!(t.step(0, 32) > t.step(0, 1));
        let fast = SimTiming {
            speed: 3.0,
            ..t.clone()
        };
        let ratio = t.step(100, 8).as_secs_f64() / fast.step(100, 8).as_secs_f64();
        assert!((ratio - 3.0).abs() < 1e-6);
    }

    #[test]
    fn tokens_are_deterministic_and_drawn_from_the_outputs() {
        let spec = KvSpec {
            num_layers: 2,
            block_size: 4,
            num_kv_heads: 1,
            head_dim: 8,
            dtype: crate::kv_pool::KvDtype::Bf16,
        };
        let b =
            SimBackend::new(SimTiming::zero(), spec.clone(), 8, 120, (4..100).collect()).unwrap();
        let mut seen = std::collections::HashSet::new();
        for last in 0..50 {
            for pos in 0..50 {
                let t = b.next_token(last, pos);
                assert_eq!(t, b.next_token(last, pos));
                assert!((4..100).contains(&t), "{t}");
                seen.insert(t);
            }
        }
        // Spread over the whole list, not stuck on a few ids.
        assert!(seen.len() > 80, "{}", seen.len());
        assert!(SimBackend::new(SimTiming::zero(), spec.clone(), 8, 120, vec![]).is_err());
        assert!(SimBackend::new(SimTiming::zero(), spec, 8, 120, vec![5, 120]).is_err());
    }
}
