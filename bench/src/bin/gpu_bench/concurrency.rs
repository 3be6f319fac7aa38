//! `gpu-bench --prefill-concurrency`: prefill throughput when `c` prompts arrive at once, the
//! steps packed as the engine's scheduler packs them (whole prompts, at most
//! `--concurrency-step-tokens` tokens a step). Small prompts at concurrency 1 are a step of a
//! few hundred launches and little arithmetic, where launch overhead shows; large
//! concurrency fills each step. Run with and without `--prefill-graphs` it gives the shape
//! of vLLM's "no CUDA graph" against "piecewise" prefill table.

use kvmesh_gpu::backend::{ForwardBatch, SeqInput};
use kvmesh_gpu::kv_cache::BlockId;

use super::{greedy, median, timed_step, Args, Runner, BLOCK_SIZE};

/// One concurrency's measurement.
pub struct Concurrency {
    pub prompts: usize,
    pub prompt_len: usize,
    pub steps: usize,
    /// Median seconds for all the prompts' steps.
    pub secs: f64,
}

/// Prompts one step takes: whole prompts, at most the step's token limit (at least one).
pub fn per_step(args: &Args) -> usize {
    (args.concurrency_step_tokens / args.concurrency_prompt_len.max(1)).max(1)
}

/// The concurrencies asked for (`0` in the list stands for none).
pub fn asked(args: &Args) -> impl Iterator<Item = usize> + '_ {
    args.prefill_concurrency.iter().copied().filter(|&c| c > 0)
}

/// Tokens the largest step of the sweep runs (0 without a sweep).
pub fn step_tokens(args: &Args) -> usize {
    asked(args)
        .map(|c| c.min(per_step(args)) * args.concurrency_prompt_len)
        .max()
        .unwrap_or(0)
}

/// Sequences (and KV blocks) the largest step of the sweep holds at once.
pub fn step_seqs_and_blocks(args: &Args) -> (usize, usize) {
    let seqs = asked(args)
        .map(|c| c.min(per_step(args)))
        .max()
        .unwrap_or(0);
    (
        seqs,
        seqs * args.concurrency_prompt_len.div_ceil(BLOCK_SIZE),
    )
}

impl Runner<'_> {
    /// Every asked concurrency: one warm-up pass, then `--prefill-reps` passes, the median
    /// counted.
    pub fn prefill_concurrency(&mut self) -> anyhow::Result<Vec<Concurrency>> {
        let args = self.args;
        let len = args.concurrency_prompt_len;
        let blocks = len.div_ceil(BLOCK_SIZE);
        let mut out = Vec::new();
        for c in asked(args) {
            let prompts: Vec<Vec<u32>> = (0..c)
                .map(|s| (0..len).map(|i| self.token(i + 31 * s)).collect())
                .collect();
            let per = per_step(args);
            let tables: Vec<Vec<BlockId>> = (0..per)
                .map(|s| {
                    (0..blocks)
                        .map(|b| BlockId((s * blocks + b) as u32))
                        .collect()
                })
                .collect();
            let mut times = Vec::new();
            let mut steps = 0;
            for rep in 0..=args.prefill_reps {
                let mut total = 0.0;
                steps = 0;
                for group in prompts.chunks(per) {
                    let batch = ForwardBatch {
                        seqs: group
                            .iter()
                            .enumerate()
                            .map(|(i, p)| SeqInput {
                                tokens: p,
                                start_pos: 0,
                                context_len: 0,
                                block_table: &tables[i],
                                want_logits: true,
                                state_slot: self.backend.slot(i),
                            })
                            .collect(),
                    };
                    total += timed_step(&mut self.backend, &batch, &mut self.rngs, &greedy())?.0;
                    steps += 1;
                }
                if rep > 0 {
                    times.push(total);
                }
            }
            let secs = median(times);
            eprintln!(
                "{}: {c} prompts of {len} tokens in {steps} steps, {:.1} ms, {:.0} tokens/s",
                self.name,
                secs * 1e3,
                (c * len) as f64 / secs
            );
            out.push(Concurrency {
                prompts: c,
                prompt_len: len,
                steps,
                secs,
            });
        }
        Ok(out)
    }
}

/// The sweep's table lines and JSON.
pub fn summary(sweep: &[Concurrency], graphs: bool) -> (Vec<String>, serde_json::Value) {
    let mut lines = Vec::new();
    let mut json = Vec::new();
    let mode = if graphs { "piecewise graphs" } else { "eager" };
    for r in sweep {
        let tps = (r.prompts * r.prompt_len) as f64 / r.secs;
        lines.push(format!(
            "prefill      concurrency {:>3} x {} tokens ({mode}): {} steps, {:.2} ms, {:.0} tokens/s",
            r.prompts,
            r.prompt_len,
            r.steps,
            r.secs * 1e3,
            tps
        ));
        json.push(serde_json::json!({
            "concurrency": r.prompts,
            "prompt_tokens": r.prompt_len,
            "steps": r.steps,
            "ms": r.secs * 1e3,
            "tokens_per_s": tps,
            "prefill_graphs": graphs,
        }));
    }
    (lines, serde_json::Value::Array(json))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn parse(args: &[&str]) -> Args {
        Args::try_parse_from(std::iter::once("gpu-bench").chain(args.iter().copied())).unwrap()
    }

    #[test]
    fn the_sweep_packs_whole_prompts_into_steps_of_at_most_the_step_limit() {
        let a = parse(&[]);
        assert_eq!(asked(&a).count(), 0, "no sweep by default");
        assert_eq!((step_tokens(&a), step_seqs_and_blocks(&a)), (0, (0, 0)));
        let a = parse(&[
            "--prefill-concurrency",
            "1, 8,128",
            "--concurrency-prompt-len",
            "100",
        ]);
        assert_eq!(asked(&a).collect::<Vec<_>>(), [1, 8, 128]);
        // 81 prompts of 100 tokens fit 8,192; the largest step holds 81 of them, 7 blocks each.
        assert_eq!(per_step(&a), 81);
        assert_eq!(step_tokens(&a), 8100);
        assert_eq!(step_seqs_and_blocks(&a), (81, 81 * 7));
        // A prompt longer than the limit still runs, alone in its step.
        let a = parse(&[
            "--prefill-concurrency",
            "4",
            "--concurrency-prompt-len",
            "9000",
        ]);
        assert_eq!((per_step(&a), step_tokens(&a)), (1, 9000));
        let (lines, json) = summary(
            &[Concurrency {
                prompts: 8,
                prompt_len: 100,
                steps: 1,
                secs: 0.01,
            }],
            false,
        );
        assert!(lines[0].contains("80000 tokens/s"), "{}", lines[0]);
        assert_eq!(json[0]["concurrency"], 8);
    }
}
