//! Piecewise CUDA graphs for steps with prompts (`CudaOptions::prefill_graphs`): everything
//! of a step but its attention depends on the token count alone, so it is captured once per
//! token bucket, in `L + 1` segments between the layers' attention launches
//! (`CudaBackend::enqueue_segment`), and replayed with the step's token-wise inputs padded
//! to the bucket; the attention launches, which depend on the sequences, run eagerly
//! between the segments, and so do the logits after them. This is the "piecewise" mode of
//! vLLM's CUDA graphs.
//!
//! Padding tokens (past the step's own) embed token 0 at position 0 and write their K and V
//! to the scratch block, as decode graphs' padding sequences do; their rows of every
//! activation are computed and never read. Steps of more than `MAX_TOKENS` tokens, where a
//! launch's host cost is small beside its arithmetic, run eagerly.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::CudaStream;

use super::batch::BatchLayout;
use super::buffers::{StepDims, StepInputs};
use super::device::drv;
use super::graphs::SendGraph;
use crate::error::Result;

/// The largest step that replays segments; larger ones run eagerly.
pub const MAX_TOKENS: usize = 512;
/// The smallest bucket.
const MIN_TOKENS: usize = 16;

/// One bucket: the token-wise inputs its segments read (fixed buffers), and the segments
/// once captured.
pub struct PrefillGraph {
    pub inputs: StepInputs,
    /// `L + 1` segments, `None` until captured (and again after the workspace moved).
    pub segments: Vec<Option<SendGraph>>,
}

impl PrefillGraph {
    /// Copies the step's padded token-wise inputs into the bucket's buffers.
    pub fn upload(&mut self, stream: &Arc<CudaStream>, host: &PaddedTokens) -> Result<()> {
        let tokens = (&host.token_ids[..], &host.positions[..], &host.slots[..]);
        self.inputs.upload_tokens(stream, tokens, "prefill graph")
    }
}

/// The prefill graphs of one backend, by bucket.
pub struct PrefillGraphs {
    by_bucket: HashMap<usize, PrefillGraph>,
    enabled: bool,
    /// The KV slot padding tokens write to: the scratch block's first.
    scratch_slot: i32,
    segments: usize,
}

impl PrefillGraphs {
    /// Graphs for a model of `layers` layers and a cache of `num_blocks` blocks (plus the
    /// scratch block) of `block_size`, when `wanted`.
    pub fn new(wanted: bool, layers: usize, num_blocks: usize, block_size: usize) -> Self {
        let scratch = num_blocks
            .checked_mul(block_size)
            .and_then(|s| i32::try_from(s).ok());
        PrefillGraphs {
            by_bucket: HashMap::new(),
            enabled: wanted && scratch.is_some(),
            scratch_slot: scratch.unwrap_or(0),
            segments: layers + 1,
        }
    }

    pub fn enabled(&self) -> bool {
        self.enabled
    }

    pub fn segments(&self) -> usize {
        self.segments
    }

    /// The bucket a step of `layout` replays in, or `None` when it runs eagerly.
    pub fn bucket(&self, layout: &BatchLayout) -> Option<usize> {
        let t = layout.num_tokens();
        (self.enabled && t > 0 && t <= MAX_TOKENS).then(|| bucket_for(t))
    }

    /// What a bucket's segments are captured with: its token count (nothing else of the
    /// dimensions is read by a segment).
    pub fn dims(bucket: usize) -> StepDims {
        StepDims {
            tokens: bucket,
            seqs: 1,
            max_blocks: 1,
            max_query_len: bucket,
            logits: 0,
        }
    }

    /// `layout`'s token-wise inputs padded to `bucket`.
    pub fn padded(&self, layout: &BatchLayout, bucket: usize) -> PaddedTokens {
        padded_tokens(layout, bucket, self.scratch_slot)
    }

    /// Takes `bucket`'s graphs out (allocating its buffers the first time); `put_back`
    /// returns them.
    pub fn take(&mut self, stream: &Arc<CudaStream>, bucket: usize) -> Result<PrefillGraph> {
        if let Some(g) = self.by_bucket.remove(&bucket) {
            return Ok(g);
        }
        let a = |len: usize| {
            stream
                .alloc_zeros::<i32>(len)
                .map_err(|e| drv("prefill graph input buffers", e))
        };
        Ok(PrefillGraph {
            // Only the token-wise arrays are read by segments; the others are placeholders.
            inputs: StepInputs {
                token_ids: a(bucket)?,
                positions: a(bucket)?,
                slots: a(bucket)?,
                seq_starts: a(2)?,
                seq_lens: a(1)?,
                tables: a(1)?,
                logits_rows: a(1)?,
            },
            segments: (0..self.segments).map(|_| None).collect(),
        })
    }

    pub fn put_back(&mut self, bucket: usize, g: PrefillGraph) {
        if self.enabled {
            self.by_bucket.insert(bucket, g);
        }
    }

    /// Forgets captured segments (the workspace moved); the next step captures again.
    pub fn drop_captured(&mut self) {
        for g in self.by_bucket.values_mut() {
            g.segments.iter_mut().for_each(|s| *s = None);
        }
    }

    /// Turns the graphs off for good (after a failed capture).
    pub fn disable(&mut self) {
        self.enabled = false;
        self.by_bucket.clear();
    }
}

/// The bucket of a step of `t` tokens: the next power of two, at least `MIN_TOKENS`.
pub fn bucket_for(t: usize) -> usize {
    t.next_power_of_two().max(MIN_TOKENS)
}

/// A step's token-wise inputs padded to its bucket.
#[derive(Debug, PartialEq, Eq)]
pub struct PaddedTokens {
    token_ids: Vec<i32>,
    positions: Vec<i32>,
    slots: Vec<i32>,
}

fn padded_tokens(layout: &BatchLayout, bucket: usize, scratch_slot: i32) -> PaddedTokens {
    let pad = |v: &[i32], fill: i32| {
        let mut v = v.to_vec();
        v.resize(bucket, fill);
        v
    };
    PaddedTokens {
        token_ids: pad(&layout.token_ids, 0),
        positions: pad(&layout.positions, 0),
        slots: pad(&layout.slot_mapping, scratch_slot),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::batch;
    use crate::backend::{ForwardBatch, SeqInput};
    use crate::kv_cache::BlockId;

    /// Buckets are powers of two from 16; padding tokens embed token 0 at position 0 and
    /// write their K and V to the scratch block, never to a block the scheduler owns; steps
    /// past `MAX_TOKENS` run eagerly, and so does everything when the graphs are off.
    #[test]
    fn prefill_segments_pad_tokens_to_the_scratch_block() {
        assert_eq!(
            [1, 16, 17, 100, 512].map(bucket_for),
            [16, 16, 32, 128, 512]
        );
        let (t0, t1) = ([BlockId(3), BlockId(4)], [BlockId(7)]);
        let (p0, p1) = ([5u32, 6, 7, 8, 9], [1u32, 2]);
        let batch = ForwardBatch {
            seqs: vec![
                SeqInput {
                    tokens: &p0,
                    start_pos: 0,
                    context_len: 0,
                    block_table: &t0,
                    want_logits: true,
                    state_slot: None,
                },
                SeqInput {
                    tokens: &p1,
                    start_pos: 2,
                    context_len: 0,
                    block_table: &t1,
                    want_logits: false,
                    state_slot: None,
                },
            ],
        };
        let layout = batch::build(&batch, 4, 8, 100).unwrap();
        let g = PrefillGraphs::new(true, 2, 8, 4);
        assert_eq!((g.segments(), g.bucket(&layout)), (3, Some(16)));
        let p = g.padded(&layout, 16);
        let mut ids = vec![5, 6, 7, 8, 9, 1, 2];
        ids.resize(16, 0);
        assert_eq!(p.token_ids, ids);
        let mut pos = vec![0, 1, 2, 3, 4, 2, 3];
        pos.resize(16, 0);
        assert_eq!(p.positions, pos);
        // Sequence 0: block 3 (slots 12..16) then block 4; sequence 1 at positions 2, 3 of
        // block 7; the padding at slot 32, the scratch block's first.
        let mut slots = vec![12, 13, 14, 15, 16, 30, 31];
        slots.resize(16, 32);
        assert_eq!(p.slots, slots);
        assert!(!PrefillGraphs::new(false, 2, 8, 4).enabled());
        let long: Vec<u32> = (0..MAX_TOKENS as u32 + 1).map(|i| i % 100).collect();
        let table: Vec<BlockId> = (0..200).map(BlockId).collect();
        let batch = ForwardBatch {
            seqs: vec![SeqInput {
                tokens: &long,
                start_pos: 0,
                context_len: 0,
                block_table: &table,
                want_logits: true,
                state_slot: None,
            }],
        };
        let layout = batch::build(&batch, 4, 200, 100).unwrap();
        assert_eq!(g.bucket(&layout), None);
    }
}
