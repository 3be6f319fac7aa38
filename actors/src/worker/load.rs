//! What a worker tells its routers about its load: queue, KV use and its measured speeds.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kvmesh_gpu::engine::EngineHandle;
use kvmesh_transport::wire::{LoadReport, PrefillLoad};

/// How often a worker pushes its load to each connected router, in a small cluster (see
/// [`crate::pace`]).
pub const LOAD_REPORT_INTERVAL: Duration = crate::pace::LOAD_EVERY;

/// Generation rate over report intervals. Capacity is the rate one running sequence gets:
/// steps per second of the steps that computed no prompt (smoothed; all steps until there
/// has been a decode-only one), so the prompts a node happens to be computing do not make
/// it look slow to a router that also counts them as queued work. It falls as a node fills,
/// so a router weighting by it settles where each node's sequences progress equally fast,
/// which gives a node three times faster about three times the work. The prefill rate is
/// prompt tokens per second of the steps that computed prompts.
pub(super) struct Meter {
    last_tokens: u64,
    last_steps: u64,
    last_busy_us: u64,
    last_decode_steps: u64,
    last_decode_busy_us: u64,
    last_prefill_busy_us: u64,
    last_prompt: u64,
    last_at: Instant,
    rate: f64,
    per_seq: f64,
    prefill_rate: f64,
}

fn smooth(old: f64, sample: f64) -> f64 {
    if old == 0.0 {
        sample
    } else {
        0.7 * old + 0.3 * sample
    }
}

impl Meter {
    /// Starts measuring from the engine's counters as they are now.
    pub(super) fn new(engine: &EngineHandle) -> Meter {
        let s = &engine.stats;
        Meter {
            last_tokens: s.generation_tokens.load(Ordering::Relaxed),
            last_steps: s.steps.load(Ordering::Relaxed),
            last_busy_us: s.busy_us.load(Ordering::Relaxed),
            last_decode_steps: s.decode_steps.load(Ordering::Relaxed),
            last_decode_busy_us: s.decode_busy_us.load(Ordering::Relaxed),
            last_prefill_busy_us: s.prefill_busy_us.load(Ordering::Relaxed),
            last_prompt: s.prompt_tokens.load(Ordering::Relaxed),
            last_at: Instant::now(),
            rate: 0.0,
            per_seq: 0.0,
            prefill_rate: 0.0,
        }
    }

    /// Folds in what the engine did since the last measurement, at most every half report
    /// interval, so many router connections asking at once share one measurement.
    fn update(&mut self, engine: &EngineHandle) {
        let s = &engine.stats;
        let now = Instant::now();
        let dt = (now - self.last_at).as_secs_f64();
        if dt < LOAD_REPORT_INTERVAL.as_secs_f64() / 2.0 {
            return;
        }
        let tokens = s.generation_tokens.load(Ordering::Relaxed);
        self.rate = (tokens - self.last_tokens) as f64 / dt;
        let steps = s.steps.load(Ordering::Relaxed);
        let busy_us = s.busy_us.load(Ordering::Relaxed);
        let prompt = s.prompt_tokens.load(Ordering::Relaxed);
        let (d_steps, d_busy) = (steps - self.last_steps, busy_us - self.last_busy_us);
        let d_prompt = prompt - self.last_prompt;
        let decode_steps = s.decode_steps.load(Ordering::Relaxed);
        let decode_busy = s.decode_busy_us.load(Ordering::Relaxed);
        let prefill_busy = s.prefill_busy_us.load(Ordering::Relaxed);
        let (d_dsteps, d_dbusy) = (
            decode_steps - self.last_decode_steps,
            decode_busy - self.last_decode_busy_us,
        );
        let d_pbusy = prefill_busy - self.last_prefill_busy_us;
        self.last_steps = steps;
        self.last_busy_us = busy_us;
        self.last_prompt = prompt;
        self.last_decode_steps = decode_steps;
        self.last_decode_busy_us = decode_busy;
        self.last_prefill_busy_us = prefill_busy;
        // Only busy time says what the node can do; an idle interval says nothing.
        if d_dsteps > 0 && d_dbusy > 0 {
            self.per_seq = smooth(self.per_seq, d_dsteps as f64 / (d_dbusy as f64 / 1e6));
        } else if self.per_seq == 0.0 && d_steps > 0 && d_busy > 0 {
            self.per_seq = d_steps as f64 / (d_busy as f64 / 1e6);
        }
        if d_prompt > 0 && d_pbusy > 0 {
            self.prefill_rate = smooth(self.prefill_rate, d_prompt as f64 / (d_pbusy as f64 / 1e6));
        }
        self.last_tokens = tokens;
        self.last_at = now;
    }

    /// The engine's load now, with the measured rates (`declared_capacity` until the node
    /// has been busy); `prefill` adds the prefill role's own section.
    pub(super) fn report(
        &mut self,
        engine: &EngineHandle,
        declared_capacity: f64,
        prefill: bool,
    ) -> LoadReport {
        let s = &engine.stats;
        // Sequences waiting for their KV to arrive hold blocks and will decode here.
        let running =
            (s.running.load(Ordering::Relaxed) + s.awaiting_kv.load(Ordering::Relaxed)) as u32;
        let waiting = s.waiting.load(Ordering::Relaxed) as u32;
        let total = engine.info.num_blocks as u32;
        let free = s.free_blocks.load(Ordering::Relaxed) as u32;
        self.update(engine);
        let kv_usage = if total == 0 {
            0.0
        } else {
            1.0 - free as f32 / total as f32
        };
        // KV blocks in use, in tokens: what the sequences hold.
        let tokens_in_flight =
            (total.saturating_sub(free) as u64) * engine.info.config.block_size as u64;
        let step = s.step_fit.lock().model().unwrap_or_default();
        LoadReport {
            step_base_ms: (step.base_s * 1e3) as f32,
            step_per_seq_ms: (step.per_seq_s * 1e3) as f32,
            max_running: max_running(&engine.info).min(u32::MAX as usize) as u32,
            running,
            waiting,
            tokens_in_flight,
            kv_usage,
            total_blocks: total,
            gen_tokens_per_s: self.rate as f32,
            capacity_tokens_per_s: if self.per_seq > 0.0 {
                self.per_seq as f32
            } else {
                declared_capacity as f32
            },
            prompt_tokens_per_s: self.prefill_rate as f32,
            prefill: prefill.then_some(PrefillLoad {
                running,
                waiting,
                tokens_in_flight,
                kv_usage,
                tokens_per_s: self.prefill_rate as f32,
            }),
            draining: false,
        }
    }
}

/// Sequences an engine runs at once: its `max_num_seqs`, or fewer for a model with recurrent
/// state whose budget holds fewer state slots (each running sequence holds one), so a router
/// sees such a node full when its slots are.
fn max_running(info: &kvmesh_gpu::engine::EngineInfo) -> usize {
    match info.num_state_slots {
        0 => info.config.max_num_seqs,
        slots => info.config.max_num_seqs.min(slots),
    }
}

#[cfg(test)]
mod tests {
    use kvmesh_gpu::engine::{EngineConfig, EngineInfo};

    fn info(max_num_seqs: usize, num_state_slots: usize) -> EngineInfo {
        EngineInfo {
            device: "cpu".into(),
            num_blocks: 8,
            num_state_slots,
            num_state_snapshots: 0,
            config: EngineConfig {
                max_num_seqs,
                ..Default::default()
            },
            eos_ids: vec![],
            vocab_size: 16,
            kv_spec: None,
            kv_transfer: false,
            device_kv: None,
        }
    }

    #[test]
    fn state_slots_cap_what_a_router_sees_as_running_room() {
        assert_eq!(super::max_running(&info(8, 0)), 8, "a dense model");
        assert_eq!(super::max_running(&info(8, 3)), 3, "three state slots");
        assert_eq!(super::max_running(&info(2, 8)), 2);
    }
}
