//! Qwen3.5's hybrid models on the device: the CPU's `HybridBackend` (the reference) with its
//! layers' work in kernels. Three of every four layers are Gated DeltaNet (`delta`: the
//! causal convolution and the gated delta rule, reading and updating each sequence's
//! recurrent state in a slot of a device pool laid out as the CPU's `StateLayout`, so a state
//! moves between the backends unchanged); the rest are gated full attention over a paged bf16
//! KV cache that holds those layers only (`hybrid_forward`).
//!
//! Steps run eagerly (no CUDA graphs yet); products of few rows take the skinny kernels as in
//! the dense backend. Memory is planned as the dense backend plans it, the state slots (one
//! per running sequence, and as many again for the prefix cache's saved states) taking at
//! most half of what is left for KV, as on the CPU.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};

use super::buffers::LogitsSpace;
use super::device::{drv, upload_err};
use super::fp8;
use super::fp8_gemm::Fp8Ctx;
use super::graphs::DecodeGraphs;
use super::hybrid_weights::{HybridSpace, HybridWeights};
use super::kernels::Kernels;
use super::kv::KvCache;
use super::load::MemoryPlan;
use super::sampling;
use super::shapes;
use crate::backend::cpu::{HybridBackend, StateBudget, StateLayout};
use crate::backend::error::StateError;
use crate::backend::{Backend, CudaOptions, ForwardBatch, KvBudget, SampleSpec};
use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::kv_pool::{HostKvPool, KvSpec};
use crate::safetensors::WeightStore;
use crate::sampler::Sampled;

pub struct CudaHybridBackend {
    pub(super) cfg: ModelConfig,
    ordinal: usize,
    pub(super) ctx: Arc<CudaContext>,
    pub(super) stream: Arc<CudaStream>,
    pub(super) blas: CudaBlas,
    pub(super) k: Kernels,
    pub(super) w: HybridWeights,
    pub(super) kv: KvCache,
    pub(super) space: Option<HybridSpace>,
    pub(super) ls: Option<LogitsSpace>,
    /// Every slot's state, `[slots + snapshots, layout.floats_per_slot()]`.
    pub(super) states: CudaSlice<f32>,
    pub(super) layout: StateLayout,
    /// cuBLASLt and scratch for an FP8 checkpoint's products.
    pub(super) fp8: Option<Fp8Ctx>,
    num_slots: usize,
    num_snapshots: usize,
    pub(super) skinny_max_rows: usize,
    pub(super) split_decode: bool,
    /// `CudaOptions::gdn_scan`.
    pub(super) gdn_scan: bool,
    /// `CudaOptions::gdn_chunked`.
    pub(super) gdn_chunked: bool,
    /// The full-attention layers' cache as transfers in this process address it.
    device_kv: Arc<crate::device_kv::DeviceKvPool>,
    /// Pure decode steps' CUDA graphs, by bucket (as the dense backend's), with each
    /// bucket's delta-rule sequence table: padding rows run on `scratch_slot`.
    pub(super) graphs: DecodeGraphs,
    pub(super) graph_seqs: HashMap<usize, CudaSlice<i32>>,
    /// The state slot past the pool's (running slots and snapshots) that a decode graph's
    /// padding sequences read and write, so they touch no sequence's state.
    pub(super) scratch_slot: u32,
}

/// The CUDA options a hybrid model cannot take, refused by name.
fn refuse_options(cfg: &ModelConfig, opts: &CudaOptions) -> Result<()> {
    if opts.fuse_norms || opts.fuse_rope || opts.prefill_graphs {
        return Err(EngineError::InvalidRequest(
            "fused norms, the fused rotary embedding and piecewise prefill graphs are not \
             implemented for Qwen3.5's hybrid layers; leave those options off"
                .into(),
        ));
    }
    // The chunked form keeps its chunks' matrices in the MLP's gate/up products, which no
    // mixer uses: a row of those must hold a row of the matrices.
    let nv = cfg.hybrid.as_ref().map_or(0, |h| h.linear_num_value_heads);
    let mats_row = 2 * shapes::CHUNK_LEN * nv;
    if opts.gdn_chunked && mats_row > 2 * cfg.intermediate_size {
        return Err(EngineError::InvalidRequest(format!(
            "the chunked Gated DeltaNet prefill needs {mats_row} values a token of scratch and \
             this model's MLP buffers hold {}; leave the option off",
            2 * cfg.intermediate_size
        )));
    }
    Ok(())
}

impl CudaHybridBackend {
    /// Loads a Qwen3.5 checkpoint onto device `opts.ordinal`: KV blocks of `block_size`
    /// tokens for its full-attention layers, a state slot for each of `max_num_seqs`
    /// sequences, and as many saved states again with `snapshots` (prefix caching), within
    /// `kv` as [`HybridBackend::split_bytes`] divides it.
    pub fn new(
        cfg: &ModelConfig,
        weights: &WeightStore,
        opts: CudaOptions,
        kv: KvBudget,
        block_size: usize,
        max_num_seqs: usize,
        snapshots: bool,
    ) -> Result<CudaHybridBackend> {
        let hy = cfg
            .hybrid
            .as_ref()
            .ok_or_else(|| EngineError::BadModel("not a hybrid (Qwen3.5) model".into()))?;
        super::load::refuse_unsupported(cfg, opts.ordinal, block_size)?;
        refuse_options(cfg, &opts)?;
        let ordinal = opts.ordinal;
        let layout = StateLayout::new(hy);
        let per_slot = layout.bytes_per_slot();
        let full_layers = hy.num_full_layers();
        let per_block = (2 * full_layers * block_size * cfg.kv_dim() * 2).max(1);
        let ctx = super::green::context(ordinal, opts.sm_partition)?;
        let stream = ctx.new_stream().map_err(|e| drv("stream creation", e))?;
        let (free, total) = ctx.mem_get_info().map_err(|e| drv("memory query", e))?;
        let mut plan = MemoryPlan::of(cfg, &opts, block_size);
        plan.activations = HybridSpace::bytes(cfg, plan.tokens)
            + LogitsSpace::bytes(cfg, plan.rows)
            + fp8::scratch_bytes(cfg, plan.tokens);
        plan.per_block = per_block;
        let split = match kv {
            KvBudget::Blocks(n) => StateBudget {
                blocks: n,
                slots: max_num_seqs.max(1),
                snapshots: if snapshots { max_num_seqs.max(1) } else { 0 },
            },
            _ => {
                // What the dense plan gives the KV cache, less the graphs' scratch slot, then
                // divided as on the CPU.
                let blocks = plan.blocks(kv, ordinal, free, total)?;
                HybridBackend::split_bytes(
                    (blocks * per_block).saturating_sub(per_slot),
                    per_slot,
                    per_block,
                    max_num_seqs,
                    snapshots,
                )
            }
        };
        if matches!(kv, KvBudget::Blocks(_)) {
            // Blocks given exactly: the states come on top, and must fit too.
            plan.fixed += (split.slots + split.snapshots + 1) * per_slot;
            plan.blocks(kv, ordinal, free, total)?;
        }
        if split.slots < max_num_seqs {
            tracing::warn!(
                "the GPU's KV budget holds recurrent state for {} sequences at once, fewer than \
                 --max-num-seqs {max_num_seqs} ({} MiB each)",
                split.slots,
                per_slot >> 20
            );
        }
        let fp8 = super::load::fp8_ctx(&ctx, &stream, cfg, plan.tokens, &opts)?;
        let (mut k, _arch) = Kernels::load(&ctx)?;
        let blas = CudaBlas::new(stream.clone())
            .map_err(|e| EngineError::device("cuBLAS initialisation", e))?;
        let w = HybridWeights::upload(&stream, ordinal, cfg, weights)?;
        k.pdl &= opts.pdl.enabled(w.bytes_per_step());
        let kv = KvCache::alloc_as(
            &opts,
            &stream,
            (ordinal, cfg, full_layers),
            split.blocks,
            block_size,
        )?;
        // Every slot, and the scratch slot after them.
        let scratch_slot = split.slots + split.snapshots;
        let states = stream
            .alloc_zeros::<f32>((scratch_slot + 1) * layout.floats_per_slot())
            .map_err(|e| upload_err(ordinal, "the recurrent-state slots", e))?;
        let device_kv = super::handover::device_pool(&kv, &ctx, ordinal, k.kv_copy.clone())?;
        let mut be = CudaHybridBackend {
            cfg: cfg.clone(),
            ordinal,
            ctx,
            stream,
            blas,
            k,
            w,
            kv,
            space: None,
            ls: None,
            states,
            layout,
            fp8,
            num_slots: split.slots,
            num_snapshots: split.snapshots,
            skinny_max_rows: opts.skinny_max_rows,
            split_decode: opts.split_decode,
            gdn_scan: opts.gdn_scan,
            gdn_chunked: opts.gdn_chunked,
            device_kv,
            graphs: DecodeGraphs::new(opts.graphs, cfg, split.blocks, block_size),
            graph_seqs: HashMap::new(),
            scratch_slot: scratch_slot as u32,
        };
        // The activations of the largest step the engine runs, allocated now (as planned).
        be.ensure_space(plan.tokens)?;
        be.ensure_logits_space(plan.rows)?;
        be.stream
            .synchronize()
            .map_err(|e| drv("uploading the weights", e))?;
        Ok(be)
    }

    /// Whether pure decode steps replay CUDA graphs (see `DecodeGraphs`).
    pub fn cuda_graphs_enabled(&self) -> bool {
        self.graphs.enabled()
    }

    /// Times every decode-graph replay from now on (`DecodeGraphs::time_replays`).
    pub fn time_graph_replays(&mut self) -> Result<()> {
        self.graphs.time_replays(&self.ctx)
    }

    /// The device's seconds over the last decode-graph replay (see `CudaBackend`'s).
    pub fn last_graph_replay_secs(&mut self) -> Result<Option<f64>> {
        self.graphs.last_replay_secs()
    }

    fn slot_range(&self, slot: u32) -> Result<std::ops::Range<usize>> {
        let total = self.num_slots + self.num_snapshots;
        let n = self.layout.floats_per_slot();
        let s = slot as usize;
        if s >= total {
            return Err(StateError::OutOfPool { slot: s, total }.into());
        }
        Ok(s * n..(s + 1) * n)
    }

    /// The running slots the batch's sequences hold, each its own (checked).
    pub(super) fn check_slots(&self, batch: &ForwardBatch) -> Result<()> {
        let mut seen = vec![false; self.num_slots];
        for (si, s) in batch.seqs.iter().enumerate() {
            match s
                .state_slot
                .map(|x| x as usize)
                .filter(|&x| x < self.num_slots)
            {
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
        }
        Ok(())
    }
}

impl Backend for CudaHybridBackend {
    fn device(&self) -> String {
        format!("cuda:{}", self.ordinal)
    }

    fn num_blocks(&self) -> usize {
        self.kv.num_blocks
    }

    fn max_step_tokens(&self) -> Option<usize> {
        Some(super::shapes::MAX_PREFILL_QUERIES)
    }

    fn num_state_slots(&self) -> usize {
        self.num_slots
    }

    fn num_state_snapshots(&self) -> usize {
        self.num_snapshots
    }

    fn read_state(&mut self, slot: u32) -> Result<Vec<f32>> {
        let r = self.slot_range(slot)?;
        let v = self
            .stream
            .clone_dtoh(&self.states.slice(r))
            .map_err(|e| drv("state copy", e))?;
        self.stream
            .synchronize()
            .map_err(|e| drv("state copy", e))?;
        Ok(v)
    }

    fn write_state(&mut self, slot: u32, state: &[f32]) -> Result<()> {
        let r = self.slot_range(slot)?;
        if state.len() != r.len() {
            return Err(StateError::Size {
                values: state.len(),
                slot_len: r.len(),
            }
            .into());
        }
        let mut dst = self.states.slice_mut(r);
        self.stream
            .memcpy_htod(state, &mut dst)
            .map_err(|e| drv("state copy", e))?;
        Ok(())
    }

    fn copy_state(&mut self, from: u32, to: u32) -> Result<()> {
        let (a, b) = (self.slot_range(from)?, self.slot_range(to)?);
        if a == b {
            return Ok(());
        }
        // One copy between the two slots, as two disjoint views of the pool split between
        // them (slots never overlap: a slot is a whole stride).
        let n = a.len();
        let r = if a.start < b.start {
            let (lo, mut hi) = self.states.split_at_mut(b.start);
            self.stream
                .memcpy_dtod(&lo.slice(a), &mut hi.slice_mut(0..n))
        } else {
            let (mut lo, hi) = self.states.split_at_mut(a.start);
            self.stream
                .memcpy_dtod(&hi.slice(0..n), &mut lo.slice_mut(b))
        };
        r.map_err(|e| drv("state copy", e))
    }

    fn kv_depends_on_context(&self) -> bool {
        self.cfg.rope_depends_on_length()
    }

    /// bf16 K and V of the full-attention layers; transfers go through host staging.
    fn kv_spec(&self) -> Option<KvSpec> {
        Some(self.kv.spec().clone())
    }

    fn kv_staging(&self) -> bool {
        true
    }

    fn device_kv(&self) -> Option<Arc<crate::device_kv::DeviceKvPool>> {
        Some(self.device_kv.clone())
    }

    fn kv_to_host(
        &mut self,
        table: &[crate::kv_cache::BlockId],
        positions: std::ops::Range<usize>,
        dst: &HostKvPool,
        dst_table: &[crate::kv_cache::BlockId],
    ) -> Result<()> {
        self.kv.copy_positions_out(table, positions, dst, dst_table)
    }

    fn kv_from_host(
        &mut self,
        src: &HostKvPool,
        src_table: &[crate::kv_cache::BlockId],
        positions: std::ops::Range<usize>,
        table: &[crate::kv_cache::BlockId],
    ) -> Result<()> {
        self.kv.copy_positions_in(src, src_table, positions, table)
    }

    fn forward(&mut self, batch: &ForwardBatch) -> Result<Vec<Vec<f32>>> {
        sampling::forward_logits(self, batch)
    }

    /// Samples on the device (see `sampling::forward_sampled`).
    fn forward_sample(
        &mut self,
        batch: &ForwardBatch,
        specs: &mut [SampleSpec],
    ) -> Result<Vec<Sampled>> {
        sampling::forward_sampled(self, batch, specs)
    }
}

impl sampling::LogitsStep for CudaHybridBackend {
    fn run_step(&mut self, batch: &ForwardBatch) -> Result<usize> {
        self.run(batch)
    }

    fn logits(&mut self) -> (&Arc<CudaStream>, &Kernels, Option<&mut LogitsSpace>, usize) {
        (&self.stream, &self.k, self.ls.as_mut(), self.cfg.vocab_size)
    }
}
