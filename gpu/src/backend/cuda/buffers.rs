//! The device buffers a step reads and writes besides the weights and the KV cache: the
//! batch's index arrays, the activations, and the rows that produce logits.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};

use super::batch::BatchLayout;
use super::device::drv;
use super::shapes::SAMPLE_MAX_CHUNKS;

/// Most rows a skinny product with the norm as its prologue takes (`shapes::SKINNY_NORM`).
const NORM_ROWS: usize = super::shapes::SKINNY_NORM[1].0;
use crate::config::ModelConfig;
use crate::error::Result;

/// A step's index arrays on the device, as `batch::BatchLayout` lays them out.
pub struct StepInputs {
    pub token_ids: CudaSlice<i32>,
    pub positions: CudaSlice<i32>,
    pub slots: CudaSlice<i32>,
    pub seq_starts: CudaSlice<i32>,
    pub seq_lens: CudaSlice<i32>,
    pub tables: CudaSlice<i32>,
    pub logits_rows: CudaSlice<i32>,
}

impl StepInputs {
    /// A fresh copy of `layout`'s arrays, for a step launched eagerly.
    pub fn upload(stream: &Arc<CudaStream>, layout: &BatchLayout) -> Result<StepInputs> {
        let up = |v: &[i32]| {
            // A zero-length allocation is an error in the driver; an unused array gets one
            // dummy entry instead.
            let v = if v.is_empty() { &[0][..] } else { v };
            stream.clone_htod(v).map_err(|e| drv("batch upload", e))
        };
        Ok(StepInputs {
            token_ids: up(&layout.token_ids)?,
            positions: up(&layout.positions)?,
            slots: up(&layout.slot_mapping)?,
            seq_starts: up(&layout.seq_starts)?,
            seq_lens: up(&layout.seq_lens)?,
            tables: up(&layout.block_tables)?,
            logits_rows: up(&layout.logits_rows)?,
        })
    }

    /// Copies a step's token-wise inputs into these buffers (a graph's fixed ones); `what`
    /// names them in an error. Pageable host memory: each copy has taken the data when it
    /// returns.
    pub fn upload_tokens(
        &mut self,
        stream: &Arc<CudaStream>,
        (token_ids, positions, slots): (&[i32], &[i32], &[i32]),
        what: &str,
    ) -> Result<()> {
        let e = |e| drv(&format!("{what} input upload"), e);
        stream
            .memcpy_htod(token_ids, &mut self.token_ids)
            .map_err(e)?;
        stream
            .memcpy_htod(positions, &mut self.positions)
            .map_err(e)?;
        stream.memcpy_htod(slots, &mut self.slots).map_err(e)
    }

    /// Zeroed buffers for `seqs` single-token sequences with block tables `width` wide: the
    /// fixed inputs of a decode graph.
    pub fn zeroed(stream: &Arc<CudaStream>, seqs: usize, width: usize) -> Result<StepInputs> {
        let a = |len: usize| {
            stream
                .alloc_zeros::<i32>(len)
                .map_err(|e| drv("decode graph input buffers", e))
        };
        Ok(StepInputs {
            token_ids: a(seqs)?,
            positions: a(seqs)?,
            slots: a(seqs)?,
            seq_starts: a(seqs + 1)?,
            seq_lens: a(seqs)?,
            tables: a(seqs * width)?,
            logits_rows: a(seqs)?,
        })
    }
}

/// The sizes a step launches with; for a graph they are the bucket's, fixed at capture.
pub struct StepDims {
    pub tokens: usize,
    pub seqs: usize,
    /// Row width of `StepInputs::tables`.
    pub max_blocks: usize,
    pub max_query_len: usize,
    pub logits: usize,
}

impl StepDims {
    /// The sizes of `layout` itself, for a step launched eagerly.
    pub fn of(layout: &BatchLayout) -> StepDims {
        StepDims {
            tokens: layout.num_tokens(),
            seqs: layout.num_seqs(),
            max_blocks: layout.max_blocks,
            max_query_len: layout.max_query_len,
            logits: layout.logits_rows.len(),
        }
    }

    /// A pure decode step of `seqs` sequences, each wanting logits, with block tables `width`
    /// wide.
    pub fn decode(seqs: usize, width: usize) -> StepDims {
        StepDims {
            tokens: seqs,
            seqs,
            max_blocks: width,
            max_query_len: 1,
            logits: seqs,
        }
    }
}

/// Activation buffers for up to `tokens` tokens, grown (never shrunk) as steps need, so a
/// steady decode loop allocates nothing.
pub struct Workspace {
    pub tokens: usize,
    /// The residual stream, `[tokens, hidden]`.
    pub x: CudaSlice<f32>,
    /// Where a product with the norm as its prologue writes the summed residual (the other
    /// blocks still read `x`): `[NORM_ROWS, hidden]`, swapped with `x` for the rest of the
    /// step and back at its end (`forward`).
    pub x2: CudaSlice<f32>,
    /// A normed copy of `x` in bf16, the next product's input.
    pub xn: CudaSlice<u16>,
    pub qkv: CudaSlice<f32>,
    pub attn: CudaSlice<u16>,
    /// A projection's output before it is added to `x`.
    pub tmp: CudaSlice<f32>,
    pub gate_up: CudaSlice<f32>,
    pub act: CudaSlice<u16>,
    /// A split decode's partials: for each (sequence, q head, split) its max, sum and
    /// unnormalised weighted V row, `shapes::DECODE_SPLIT_SLOTS` (sequence, split) pairs.
    pub part: CudaSlice<f32>,
    /// A split decode's tickets: a counter per (sequence, q head) that the blocks of its
    /// splits count up and the last one sets back to 0, so zero between steps.
    pub ticks: CudaSlice<i32>,
    /// A fused q/k/v product's tickets (`skinny::RopeIn`): a counter per q and k head that
    /// the warps of its rotation pairs count up and the last one sets back to 0.
    pub rope_ticks: CudaSlice<i32>,
}

impl Workspace {
    /// Bytes `alloc(.., c, cap)` takes.
    pub fn bytes(c: &ModelConfig, cap: usize) -> usize {
        let f32s = c.hidden_size * 2 + c.q_dim() + 2 * c.kv_dim() + 2 * c.intermediate_size;
        let bf16s = c.hidden_size + c.q_dim() + c.intermediate_size;
        if cap == 0 {
            return 0; // no workspace at all
        }
        cap * (4 * f32s + 2 * bf16s)
            + 4 * Self::part_len(c)
            + 4 * (Self::ticks_len(c) + c.num_heads + c.num_kv_heads)
            + 4 * NORM_ROWS * c.hidden_size
    }

    /// f32s of `part`.
    fn part_len(c: &ModelConfig) -> usize {
        super::shapes::DECODE_SPLIT_SLOTS * c.num_heads * (c.head_dim + 2)
    }

    /// i32s of `ticks`: a split decode has at most DECODE_SPLIT_SLOTS sequences.
    fn ticks_len(c: &ModelConfig) -> usize {
        super::shapes::DECODE_SPLIT_SLOTS * c.num_heads
    }

    /// Buffers for `cap` tokens of a model shaped like `c`.
    pub fn alloc(stream: &Arc<CudaStream>, c: &ModelConfig, cap: usize) -> Result<Workspace> {
        let f = |n: usize| {
            stream
                .alloc_zeros::<f32>(n)
                .map_err(|e| drv(&format!("activations for {cap} tokens"), e))
        };
        let b = |n: usize| {
            stream
                .alloc_zeros::<u16>(n)
                .map_err(|e| drv(&format!("activations for {cap} tokens"), e))
        };
        Ok(Workspace {
            tokens: cap,
            x: f(cap * c.hidden_size)?,
            x2: f(NORM_ROWS * c.hidden_size)?,
            xn: b(cap * c.hidden_size)?,
            qkv: f(cap * (c.q_dim() + 2 * c.kv_dim()))?,
            attn: b(cap * c.q_dim())?,
            tmp: f(cap * c.hidden_size)?,
            gate_up: f(cap * 2 * c.intermediate_size)?,
            act: b(cap * c.intermediate_size)?,
            part: f(Self::part_len(c))?,
            ticks: stream
                .alloc_zeros::<i32>(Self::ticks_len(c))
                .map_err(|e| drv(&format!("activations for {cap} tokens"), e))?,
            rope_ticks: stream
                .alloc_zeros::<i32>(c.num_heads + c.num_kv_heads)
                .map_err(|e| drv(&format!("activations for {cap} tokens"), e))?,
        })
    }
}

/// Buffers for the rows that produce logits.
pub struct LogitsSpace {
    pub rows: usize,
    /// The normed hidden rows that want logits, gathered.
    pub xr: CudaSlice<u16>,
    pub logits: CudaSlice<f32>,
    /// What `sample_rows` picked: each row's token id at `[0, rows)`, its logprob's bits at
    /// `[rows, 2 rows)`, so that one copy brings both back.
    pub picked: CudaSlice<i32>,
    /// Per-row sampling parameters: temperatures, top_p and uniforms, three runs of `rows`.
    pub params_f: CudaSlice<f32>,
    pub top_k: CudaSlice<i32>,
    /// `sample_rows`'s per-share results (3 floats per row and share) and its per-row
    /// tickets, zero between launches.
    pub sample_stats: CudaSlice<f32>,
    pub sample_ticks: CudaSlice<i32>,
    /// What `params_f` and `top_k` hold, once copied: a step whose parameters are the same
    /// (greedy rows draw nothing) copies nothing.
    pub params_held: Option<(Vec<f32>, Vec<i32>)>,
}

impl LogitsSpace {
    /// Bytes `alloc(.., c, cap)` takes.
    pub fn bytes(c: &ModelConfig, cap: usize) -> usize {
        cap * (2 * c.hidden_size + 4 * c.vocab_size + 4 * 7 + 4 * 3 * SAMPLE_MAX_CHUNKS)
    }

    /// Buffers for `cap` rows of a model shaped like `c`.
    pub fn alloc(stream: &Arc<CudaStream>, c: &ModelConfig, cap: usize) -> Result<LogitsSpace> {
        let e = |x| drv(&format!("logits for {cap} rows"), x);
        Ok(LogitsSpace {
            rows: cap,
            xr: stream.alloc_zeros::<u16>(cap * c.hidden_size).map_err(e)?,
            logits: stream.alloc_zeros::<f32>(cap * c.vocab_size).map_err(e)?,
            picked: stream.alloc_zeros::<i32>(2 * cap).map_err(e)?,
            params_f: stream.alloc_zeros::<f32>(3 * cap).map_err(e)?,
            top_k: stream.alloc_zeros::<i32>(cap).map_err(e)?,
            sample_stats: stream
                .alloc_zeros::<f32>(cap * 3 * SAMPLE_MAX_CHUNKS)
                .map_err(e)?,
            sample_ticks: stream.alloc_zeros::<i32>(cap).map_err(e)?,
            params_held: None,
        })
    }
}
