//! Qwen3.5's hybrid model served by the engine on the CPU: the same layers as
//! [`HybridModel`], run over a batch of sequences at once.
//!
//! What each sequence carries from step to step is kept the way the engine budgets it:
//!
//! - K and V of the full-attention layers only, in paged blocks (a [`HostKvPool`] of f32,
//!   as the dense backend's, resident only once written, and lent to transfers in the same
//!   way) addressed through the sequence's block table; the linear layers keep nothing that
//!   grows with the sequence. A transfer moves the state too: the engine reads it from the
//!   prefill side's slot after the prompt and writes it into the decode side's
//!   ([`Backend::read_state`], [`Backend::write_state`]).
//! - The recurrent state of every linear layer in one fixed-size slot per running sequence
//!   (see [`StateLayout`]), from a pool of slots the engine hands out
//!   ([`Backend::num_state_slots`]). A sequence's first chunk (`start_pos` 0) starts its
//!   slot from zero; every later chunk or decode token continues it.
//! - Saved states for the prefix cache in more slots after those
//!   ([`Backend::num_state_snapshots`]), copied to and from by [`Backend::copy_state`].
//!
//! Projections and MLPs run over every token of the step in one product, as in the dense
//! backend; the delta rule runs per sequence (chunk-wise over a prompt chunk, one recurrent
//! step for a decode token), sequences in parallel.

use std::sync::Arc;

use rayon::prelude::*;

use super::hybrid::{add, mlp, HybridModel, Mixer, StateLayout};
use super::hybrid_layers::attend;
use super::ops;
use crate::backend::error::{BatchError, StateError};
use crate::backend::{Backend, ForwardBatch, KvBudget};
use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::kv_pool::{HostKvPool, KvDtype, KvSpec};

/// How [`HybridBackend::split_budget`] divides memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StateBudget {
    /// KV blocks of the full-attention layers.
    pub blocks: usize,
    /// Recurrent-state slots for running sequences.
    pub slots: usize,
    /// Saved states for the prefix cache.
    pub snapshots: usize,
}

pub struct HybridBackend {
    /// Shared like `CpuBackend`'s.
    model: Arc<HybridModel>,
    block_size: usize,
    /// K and V of the full-attention layers, shared with KV transfers (see `kv_pool` for
    /// who may touch what).
    kv: Arc<HostKvPool>,
    layout: StateLayout,
    /// Every slot's state, `[slots + snapshots, layout.floats_per_slot()]`: the running
    /// slots first, then the saved ones.
    states: Vec<f32>,
    num_slots: usize,
    num_snapshots: usize,
}

impl HybridBackend {
    /// A backend with `num_slots` state slots for running sequences and `num_snapshots` for
    /// the prefix cache's saved states.
    pub fn new(
        model: impl Into<Arc<HybridModel>>,
        num_blocks: usize,
        block_size: usize,
        num_slots: usize,
        num_snapshots: usize,
    ) -> Result<HybridBackend> {
        if num_blocks == 0 || block_size == 0 || num_slots == 0 {
            return Err(EngineError::InvalidRequest(format!(
                "a hybrid model needs KV blocks and state slots (got {num_blocks} blocks of \
                 {block_size} tokens, {num_slots} slots)"
            )));
        }
        let model = model.into();
        let kv = Arc::new(HostKvPool::new(
            Self::kv_spec_for(model.config(), block_size),
            num_blocks,
        )?);
        let layout = model.state_layout();
        let states = vec![0f32; (num_slots + num_snapshots) * layout.floats_per_slot()];
        Ok(HybridBackend {
            model,
            block_size,
            kv,
            layout,
            states,
            num_slots,
            num_snapshots,
        })
    }

    /// The KV cache's shape: the full-attention layers only, f32.
    pub fn kv_spec_for(cfg: &ModelConfig, block_size: usize) -> KvSpec {
        KvSpec {
            num_layers: cfg.hybrid.as_ref().map_or(0, |h| h.num_full_layers()),
            block_size,
            num_kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
            dtype: KvDtype::F32,
        }
    }

    /// Memory one block takes across the full-attention layers (K and V, f32).
    pub fn kv_bytes_per_block(cfg: &ModelConfig, block_size: usize) -> usize {
        Self::kv_spec_for(cfg, block_size).bytes_per_token() * block_size
    }

    /// How a host memory budget is split between KV blocks, recurrent-state slots and saved
    /// states: a [`StateBudget`].
    ///
    /// Slots: one for each sequence the engine may run at once (`max_num_seqs`), since a
    /// running sequence holds exactly one and no sequence runs without one; more would never
    /// be used, fewer would cap the batch below what was asked. With `snapshots` (prefix
    /// caching on) as many saved states again, so that each running sequence's latest
    /// block-boundary state can stay cached after it ends (the prefix cache evicts the
    /// least recently used). States take at most half of a budget given in bytes, running
    /// slots first (at least one), so that a model with a large state under a small budget
    /// still keeps room for its contexts' KV; the engine then runs fewer sequences at once
    /// and caches fewer prefixes. The KV blocks get the rest. A budget given in blocks
    /// counts the blocks alone, the states coming on top.
    pub fn split_budget(
        cfg: &ModelConfig,
        block_size: usize,
        kv: KvBudget,
        max_num_seqs: usize,
        snapshots: bool,
    ) -> Result<StateBudget> {
        let hy = cfg.hybrid.as_ref().ok_or_else(|| {
            EngineError::BadModel(format!(
                "{} has no recurrent state to budget",
                cfg.arch.architecture_name()
            ))
        })?;
        let per_slot = StateLayout::new(hy).bytes_per_slot().max(1);
        let per_block = Self::kv_bytes_per_block(cfg, block_size).max(1);
        match kv {
            KvBudget::Blocks(n) => Ok(StateBudget {
                blocks: n,
                slots: max_num_seqs.max(1),
                snapshots: if snapshots { max_num_seqs.max(1) } else { 0 },
            }),
            KvBudget::Bytes(b) => Ok(Self::split_bytes(
                b,
                per_slot,
                per_block,
                max_num_seqs,
                snapshots,
            )),
            KvBudget::Share(_) => Err(EngineError::InvalidRequest(
                "a share of device memory sizes a GPU's KV cache; give this backend its KV \
                 cache in bytes or blocks"
                    .into(),
            )),
        }
    }

    /// [`Self::split_budget`]'s rule for `bytes` of memory, slots of `per_slot` bytes and
    /// blocks of `per_block` (the CUDA backend's are bf16, this backend's f32).
    pub fn split_bytes(
        bytes: usize,
        per_slot: usize,
        per_block: usize,
        max_num_seqs: usize,
        snapshots: bool,
    ) -> StateBudget {
        let (per_slot, per_block) = (per_slot.max(1), per_block.max(1));
        let max_num_seqs = max_num_seqs.max(1);
        let wanted_snapshots = if snapshots { max_num_seqs } else { 0 };
        let states = bytes / 2 / per_slot;
        let slots = max_num_seqs.min(states).max(1);
        let snapshots = wanted_snapshots.min(states.saturating_sub(slots));
        let used = (slots + snapshots) * per_slot;
        StateBudget {
            blocks: (bytes.saturating_sub(used) / per_block).max(1),
            slots,
            snapshots,
        }
    }

    pub fn model(&self) -> &HybridModel {
        &self.model
    }

    /// Slot `slot`'s state (running or saved).
    fn state_of(&mut self, slot: u32) -> Result<&mut [f32]> {
        let total = self.num_slots + self.num_snapshots;
        let n = self.layout.floats_per_slot();
        let s = slot as usize;
        if s >= total {
            return Err(StateError::OutOfPool { slot: s, total }.into());
        }
        Ok(&mut self.states[s * n..(s + 1) * n])
    }

    /// Checks the batch against the pools and lays it out: for each token its sequence,
    /// position and KV slot.
    fn layout_batch(&self, batch: &ForwardBatch) -> Result<Vec<(usize, usize, usize)>> {
        let (bs, vocab) = (self.block_size, self.model.config().vocab_size);
        let mut tokens = Vec::with_capacity(batch.num_tokens());
        let mut seen = vec![false; self.num_slots];
        for (si, s) in batch.seqs.iter().enumerate() {
            let slot = s
                .state_slot
                .map(|x| x as usize)
                .filter(|&x| x < self.num_slots);
            match slot {
                Some(x) if !seen[x] => seen[x] = true,
                _ => {
                    return Err(StateError::NotOwn {
                        seq: si,
                        slot: s.state_slot,
                        slots: self.num_slots,
                    }
                    .into())
                }
            }
            // Raw slot access in `run` relies on every block being in the pool.
            self.kv.check_table(s.block_table)?;
            for (j, &tok) in s.tokens.iter().enumerate() {
                if tok as usize >= vocab {
                    return Err(EngineError::InvalidRequest(format!(
                        "token id {tok} is outside the vocabulary (size {vocab})"
                    )));
                }
                let pos = s.start_pos + j;
                let block = s
                    .block_table
                    .get(pos / bs)
                    .ok_or(BatchError::NoBlockForPosition { seq: si, pos })?;
                tokens.push((si, pos, block.0 as usize * bs + pos % bs));
            }
        }
        Ok(tokens)
    }

    /// The step: next-token logits for each sequence that wants them, in batch order.
    fn run(&mut self, batch: &ForwardBatch) -> Result<Vec<Vec<f32>>> {
        let t = batch.num_tokens();
        if t == 0 {
            return Ok(Vec::new());
        }
        let tokens = self.layout_batch(batch)?;
        let HybridBackend {
            model,
            kv,
            layout,
            states,
            block_size,
            ..
        } = self;
        let (cfg, bs) = (&model.cfg, *block_size);
        let (h, kvd) = (cfg.hidden_size, cfg.kv_dim());
        let per_slot = layout.floats_per_slot();
        // Each sequence's own slot, mutably (the slots are distinct: checked above); a
        // sequence at its first token starts from no state.
        let mut pool: Vec<Option<&mut [f32]>> = states.chunks_mut(per_slot).map(Some).collect();
        let mut slots: Vec<&mut [f32]> = batch
            .seqs
            .iter()
            .map(|s| {
                pool[s.state_slot.expect("checked") as usize]
                    .take()
                    .expect("checked")
            })
            .collect();
        for (slot, s) in slots.iter_mut().zip(&batch.seqs) {
            if s.start_pos == 0 {
                slot.fill(0.0);
            }
        }
        // Each sequence's rows of the step.
        let mut ranges = Vec::with_capacity(batch.seqs.len());
        let mut at = 0;
        for s in &batch.seqs {
            ranges.push(at..at + s.tokens.len());
            at += s.tokens.len();
        }
        let positions: Vec<usize> = tokens.iter().map(|&(_, p, _)| p).collect();

        let mut x = vec![0f32; t * h];
        for (i, tok) in batch.seqs.iter().flat_map(|s| s.tokens).enumerate() {
            model
                .embed_tokens
                .read(*tok as usize * h, &mut x[i * h..(i + 1) * h]);
        }
        let (mut linear_i, mut full_i) = (0, 0);
        for layer in &model.layers {
            let xn = ops::rms_norm(&x, &layer.input_norm, cfg.rms_norm_eps);
            let mixed = match &layer.mixer {
                Mixer::Delta(d) => {
                    let proj = d.project(&xn, t);
                    let row = proj.len() / t;
                    let li = linear_i;
                    linear_i += 1;
                    let cores: Vec<Vec<f32>> = slots
                        .par_iter_mut()
                        .zip(ranges.par_iter())
                        .map(|(slot, r)| {
                            let (window, state) = layout.layer_of(slot, li);
                            let rows = &proj[r.start * row..r.end * row];
                            d.mix(rows, r.len(), window, state, model.chunk)
                        })
                        .collect();
                    d.out(&cores.concat(), t)
                }
                Mixer::Attention(a) => {
                    let rows = a.project(cfg, &xn, &positions, &model.inv_freq);
                    // SAFETY: an f32 pool; this step writes only the slots of the positions it
                    // computes, which the engine gives to no one else meanwhile (see
                    // `kv_pool`), before any read of them, then only reads.
                    let cache = unsafe { kv.f32_layer(full_i) };
                    full_i += 1;
                    for (i, &(_, _, slot)) in tokens.iter().enumerate() {
                        let r = i * kvd..(i + 1) * kvd;
                        // SAFETY: as above; the batch's blocks are checked to be in the pool.
                        unsafe { cache.write(slot, &rows.k[r.clone()], &rows.v[r]) };
                    }
                    let attn = attend(
                        cfg,
                        &rows,
                        |i| positions[i] + 1,
                        |i, p| {
                            let table = batch.seqs[tokens[i].0].block_table;
                            let slot = table[p / bs].0 as usize * bs + p % bs;
                            // SAFETY: positions the sequence computed, read with no writer.
                            unsafe { (cache.k(slot, 0, kvd), cache.v(slot, 0, kvd)) }
                        },
                    );
                    a.out(&attn, t)
                }
            };
            add(&mut x, &mixed);
            let xn = ops::rms_norm(&x, &layer.post_norm, cfg.rms_norm_eps);
            add(&mut x, &mlp(layer, &xn, t, cfg.intermediate_size));
        }

        // Logits only for the last token of sequences that sample.
        let mut rows = Vec::new();
        for (s, r) in batch.seqs.iter().zip(&ranges) {
            if s.want_logits {
                rows.extend_from_slice(&x[(r.end - 1) * h..r.end * h]);
            }
        }
        let m = rows.len() / h;
        let xn = ops::rms_norm(&rows, &model.norm, cfg.rms_norm_eps);
        let logits = model.lm_head.forward(&xn, m);
        Ok(logits
            .chunks_exact(cfg.vocab_size)
            .map(<[f32]>::to_vec)
            .collect())
    }
}

impl Backend for HybridBackend {
    fn device(&self) -> String {
        format!("cpu ({} threads)", rayon::current_num_threads())
    }

    fn occupies_host_cores(&self) -> bool {
        true
    }

    fn num_blocks(&self) -> usize {
        self.kv.num_blocks()
    }

    fn num_state_slots(&self) -> usize {
        self.num_slots
    }

    fn num_state_snapshots(&self) -> usize {
        self.num_snapshots
    }

    fn read_state(&mut self, slot: u32) -> Result<Vec<f32>> {
        Ok(self.state_of(slot)?.to_vec())
    }

    fn write_state(&mut self, slot: u32, state: &[f32]) -> Result<()> {
        let dst = self.state_of(slot)?;
        if state.len() != dst.len() {
            return Err(StateError::Size {
                values: state.len(),
                slot_len: dst.len(),
            }
            .into());
        }
        dst.copy_from_slice(state);
        Ok(())
    }

    fn copy_state(&mut self, from: u32, to: u32) -> Result<()> {
        let total = self.num_slots + self.num_snapshots;
        let (from, to) = (from as usize, to as usize);
        if from >= total || to >= total {
            let slot = from.max(to);
            return Err(StateError::OutOfPool { slot, total }.into());
        }
        if from != to {
            let n = self.layout.floats_per_slot();
            self.states.copy_within(from * n..(from + 1) * n, to * n);
        }
        Ok(())
    }

    fn kv_depends_on_context(&self) -> bool {
        self.model.config().rope_depends_on_length()
    }

    /// The full-attention layers' KV shape: what a transfer moves, beside the state.
    fn kv_spec(&self) -> Option<KvSpec> {
        Some(Self::kv_spec_for(self.model.config(), self.block_size))
    }

    fn host_kv(&self) -> Option<Arc<HostKvPool>> {
        Some(self.kv.clone())
    }

    fn forward(&mut self, batch: &ForwardBatch) -> Result<Vec<Vec<f32>>> {
        self.run(batch)
    }
}
