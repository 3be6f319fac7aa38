//! The host side of a CUDA step: a `ForwardBatch` flattened into the plain integer arrays the
//! kernels index by. Kept free of any CUDA type so the layout (the part that is easy to get
//! subtly wrong and silently corrupts the KV cache) is tested on machines without a GPU.

use crate::backend::error::BatchError;
use crate::backend::ForwardBatch;
use crate::error::{EngineError, Result};

/// One step's token batch, flattened. Every array is `i32` because that is what the kernels
/// take; `build` rejects batches whose indices would not fit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchLayout {
    /// `[num_tokens]`: the token ids of every scheduled token, sequence after sequence.
    pub token_ids: Vec<i32>,
    /// `[num_tokens]`: each token's position in its sequence.
    pub positions: Vec<i32>,
    /// `[num_tokens]`: the KV-cache slot each token's K and V are written to:
    /// `block_table[pos / block_size] * block_size + pos % block_size`.
    pub slot_mapping: Vec<i32>,
    /// `[num_tokens]`: the index of the sequence each token belongs to.
    pub token_seq: Vec<i32>,
    /// `[num_seqs + 1]`: where each sequence's tokens start in the flattened batch (the last
    /// entry is `num_tokens`).
    pub seq_starts: Vec<i32>,
    /// `[num_seqs]`: the length of each sequence once this step is done
    /// (`start_pos + tokens.len()`), which is how far its attention reaches.
    pub seq_lens: Vec<i32>,
    /// `[num_seqs, max_blocks]`, row-major: each sequence's blocks, padded with block 0 so
    /// a stray read stays inside the pool (kernels never read past `seq_lens`).
    pub block_tables: Vec<i32>,
    /// Width of a `block_tables` row: the most blocks any sequence needs this step.
    pub max_blocks: usize,
    /// `[num_logits]`: the flattened rows (each a sequence's last token) that need logits,
    /// in batch order.
    pub logits_rows: Vec<i32>,
    /// The most tokens one sequence runs this step (1 for a pure decode step).
    pub max_query_len: usize,
    /// The longest `seq_lens` entry.
    pub max_seq_len: usize,
}

impl BatchLayout {
    pub fn num_tokens(&self) -> usize {
        self.token_ids.len()
    }

    pub fn num_seqs(&self) -> usize {
        self.seq_lens.len()
    }

    /// Every sequence runs exactly one token: the decode-attention kernel applies, and the
    /// step can later be replayed from a CUDA graph of the bucketed size.
    pub fn is_decode(&self) -> bool {
        self.max_query_len == 1
    }
}

fn to_i32(v: usize, what: &'static str) -> Result<i32> {
    i32::try_from(v).map_err(|_| BatchError::Over32Bits { what, value: v }.into())
}

/// Flattens `batch`. `num_blocks` and `vocab_size` bound the ids so that a bad block table
/// or token id is an error here rather than an out-of-bounds write on the device.
pub fn build(
    batch: &ForwardBatch,
    block_size: usize,
    num_blocks: usize,
    vocab_size: usize,
) -> Result<BatchLayout> {
    if block_size == 0 {
        return Err(BatchError::ZeroBlockSize.into());
    }
    let t = batch.num_tokens();
    let n = batch.seqs.len();
    let mut l = BatchLayout {
        token_ids: Vec::with_capacity(t),
        positions: Vec::with_capacity(t),
        slot_mapping: Vec::with_capacity(t),
        token_seq: Vec::with_capacity(t),
        seq_starts: Vec::with_capacity(n + 1),
        seq_lens: Vec::with_capacity(n),
        block_tables: Vec::new(),
        max_blocks: 0,
        logits_rows: Vec::new(),
        max_query_len: 0,
        max_seq_len: 0,
    };
    // Check the whole slot range fits i32 once, so the per-token conversions below cannot fail.
    to_i32(num_blocks.saturating_mul(block_size), "KV slot count")?;
    let mut needed = Vec::with_capacity(n);
    for (si, s) in batch.seqs.iter().enumerate() {
        let len = s.start_pos + s.tokens.len();
        let nb = len.div_ceil(block_size);
        if s.block_table.len() < nb {
            return Err(BatchError::TooFewBlocks {
                seq: si,
                blocks: s.block_table.len(),
                positions: len,
                block_size,
            }
            .into());
        }
        for b in &s.block_table[..nb] {
            if b.0 as usize >= num_blocks {
                return Err(BatchError::BlockOutsidePool {
                    seq: si,
                    block: b.0,
                    num_blocks,
                }
                .into());
            }
        }
        needed.push(nb);
        l.max_blocks = l.max_blocks.max(nb);
        l.max_query_len = l.max_query_len.max(s.tokens.len());
        l.max_seq_len = l.max_seq_len.max(len);
    }
    to_i32(t, "token count")?;
    to_i32(l.max_seq_len, "sequence length")?;
    to_i32(n.saturating_mul(l.max_blocks), "block table size")?;

    l.block_tables = vec![0; n * l.max_blocks];
    for (si, s) in batch.seqs.iter().enumerate() {
        l.seq_starts.push(l.token_ids.len() as i32);
        for (j, &tok) in s.tokens.iter().enumerate() {
            if tok as usize >= vocab_size {
                return Err(EngineError::InvalidRequest(format!(
                    "token id {tok} is outside the vocabulary (size {vocab_size})"
                )));
            }
            let pos = s.start_pos + j;
            let block = s.block_table[pos / block_size].0 as usize;
            l.token_ids.push(tok as i32);
            l.positions.push(pos as i32);
            l.slot_mapping
                .push((block * block_size + pos % block_size) as i32);
            l.token_seq.push(si as i32);
        }
        let len = s.start_pos + s.tokens.len();
        l.seq_lens.push(len as i32);
        for (k, b) in s.block_table[..needed[si]].iter().enumerate() {
            l.block_tables[si * l.max_blocks + k] = b.0 as i32;
        }
        if s.want_logits {
            if s.tokens.is_empty() {
                return Err(BatchError::LogitsWithoutTokens { seq: si }.into());
            }
            l.logits_rows.push(l.token_ids.len() as i32 - 1);
        }
    }
    l.seq_starts.push(l.token_ids.len() as i32);
    Ok(l)
}

/// Decode batch sizes a CUDA graph would be captured for; a decode step of `n` sequences
/// runs at the smallest bucket `>= n`, padded with dummy rows. Powers of two keep the number
/// of captured graphs (and their memory) small while wasting at most half a bucket.
pub const DECODE_BUCKETS: [usize; 10] = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512];

/// The bucket a decode step of `n` sequences runs at, or `None` when `n` is 0 or larger than
/// the largest bucket (such steps run without a graph).
pub fn bucket_for(n: usize) -> Option<usize> {
    if n == 0 {
        return None;
    }
    DECODE_BUCKETS.iter().copied().find(|&b| b >= n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::SeqInput;
    use crate::kv_cache::BlockId;

    fn ids(v: &[u32]) -> Vec<BlockId> {
        v.iter().map(|&b| BlockId(b)).collect()
    }

    #[test]
    fn slot_mapping_follows_shuffled_block_tables() {
        let t0 = ids(&[7, 2, 5]);
        let t1 = ids(&[3]);
        let toks0 = [1u32, 2, 3, 4, 5];
        let toks1 = [9u32];
        let batch = ForwardBatch {
            seqs: vec![
                // Positions 6..11 with block size 4: blocks 1 and 2 of the table (2 and 5).
                SeqInput {
                    tokens: &toks0,
                    start_pos: 6,
                    context_len: 0,
                    block_table: &t0,
                    want_logits: true,
                    state_slot: None,
                },
                SeqInput {
                    tokens: &toks1,
                    start_pos: 2,
                    context_len: 0,
                    block_table: &t1,
                    want_logits: false,
                    state_slot: None,
                },
            ],
        };
        let l = build(&batch, 4, 8, 100).unwrap();
        assert_eq!(l.token_ids, vec![1, 2, 3, 4, 5, 9]);
        assert_eq!(l.positions, vec![6, 7, 8, 9, 10, 2]);
        // pos 6 -> block 2 slot 2*4+2; pos 7 -> 11; pos 8..10 -> block 5: 20, 21, 22; pos 2 of
        // sequence 1 -> block 3: 14.
        assert_eq!(l.slot_mapping, vec![10, 11, 20, 21, 22, 14]);
        assert_eq!(l.token_seq, vec![0, 0, 0, 0, 0, 1]);
        assert_eq!(l.seq_starts, vec![0, 5, 6]);
        assert_eq!(l.seq_lens, vec![11, 3]);
        assert_eq!(l.max_query_len, 5);
        assert_eq!(l.max_seq_len, 11);
        assert!(!l.is_decode());
    }

    #[test]
    fn block_tables_are_padded_to_the_widest_sequence() {
        let t0 = ids(&[4]);
        let t1 = ids(&[6, 1, 3]);
        let batch = ForwardBatch {
            seqs: vec![
                SeqInput {
                    tokens: &[1],
                    start_pos: 0,
                    context_len: 0,
                    block_table: &t0,
                    want_logits: true,
                    state_slot: None,
                },
                SeqInput {
                    tokens: &[2],
                    start_pos: 8,
                    context_len: 0,
                    block_table: &t1,
                    want_logits: true,
                    state_slot: None,
                },
            ],
        };
        let l = build(&batch, 4, 8, 10).unwrap();
        assert_eq!(l.max_blocks, 3);
        assert_eq!(l.block_tables, vec![4, 0, 0, 6, 1, 3]);
        assert!(l.is_decode());
        assert_eq!(l.logits_rows, vec![0, 1]);
    }

    #[test]
    fn only_the_needed_prefix_of_a_longer_table_is_used() {
        let t0 = ids(&[2, 3, 4, 5]);
        let batch = ForwardBatch {
            seqs: vec![SeqInput {
                tokens: &[1, 2],
                start_pos: 0,
                context_len: 0,
                block_table: &t0,
                want_logits: true,
                state_slot: None,
            }],
        };
        let l = build(&batch, 4, 8, 10).unwrap();
        assert_eq!(l.max_blocks, 1);
        assert_eq!(l.block_tables, vec![2]);
    }

    #[test]
    fn logits_rows_are_the_last_token_of_sampling_sequences() {
        let t = ids(&[0, 1, 2]);
        let batch = ForwardBatch {
            seqs: vec![
                SeqInput {
                    tokens: &[1, 2, 3],
                    start_pos: 0,
                    context_len: 0,
                    block_table: &t[..1],
                    want_logits: false,
                    state_slot: None,
                },
                SeqInput {
                    tokens: &[4, 5],
                    start_pos: 0,
                    context_len: 0,
                    block_table: &t[1..2],
                    want_logits: true,
                    state_slot: None,
                },
                SeqInput {
                    tokens: &[6],
                    start_pos: 3,
                    context_len: 0,
                    block_table: &t[2..3],
                    want_logits: true,
                    state_slot: None,
                },
            ],
        };
        let l = build(&batch, 4, 3, 10).unwrap();
        assert_eq!(l.logits_rows, vec![4, 5]);
        assert_eq!(l.seq_starts, vec![0, 3, 5, 6]);
    }

    #[test]
    fn bad_ids_are_errors_not_device_writes() {
        let t = ids(&[9]);
        fn seq<'a>(tok: &'a [u32], table: &'a [BlockId]) -> SeqInput<'a> {
            SeqInput {
                tokens: tok,
                start_pos: 0,
                context_len: 0,
                block_table: table,
                want_logits: true,
                state_slot: None,
            }
        }
        let out_of_pool = ForwardBatch {
            seqs: vec![seq(&[1], &t)],
        };
        assert!(build(&out_of_pool, 4, 8, 10).is_err());
        let ok_table = ids(&[1]);
        let bad_token = ForwardBatch {
            seqs: vec![seq(&[10], &ok_table)],
        };
        assert!(build(&bad_token, 4, 8, 10).is_err());
        let too_short = ForwardBatch {
            seqs: vec![seq(&[1, 2, 3, 4, 5], &ok_table)],
        };
        assert!(build(&too_short, 4, 8, 10).is_err());
    }

    #[test]
    fn buckets_round_up_to_a_power_of_two() {
        assert_eq!(bucket_for(0), None);
        assert_eq!(bucket_for(1), Some(1));
        assert_eq!(bucket_for(2), Some(2));
        assert_eq!(bucket_for(3), Some(4));
        assert_eq!(bucket_for(9), Some(16));
        assert_eq!(bucket_for(128), Some(128));
        assert_eq!(bucket_for(129), Some(256));
        assert_eq!(bucket_for(512), Some(512));
        assert_eq!(bucket_for(513), None);
        for n in 1..=512 {
            let b = bucket_for(n).unwrap();
            assert!(b >= n && b < 2 * n);
        }
    }
}
