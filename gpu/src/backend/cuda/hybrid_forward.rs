//! A Qwen3.5 step on the device, launch by launch; it follows the CPU's
//! `HybridBackend::run` (the reference): embed, then per layer the (1 + w) input norm, the
//! token mixer (Gated DeltaNet, or gated full attention), the residual, the post norm, the
//! SwiGLU MLP and the residual again; the final norm and the output head for the rows that
//! want logits.

use cudarc::driver::{CudaSlice, CudaStream};

use super::batch;
use super::buffers::{LogitsSpace, StepDims, StepInputs};
use super::delta::{seq_table, DeltaMix, StateAt};
use super::device::drv;
use super::gemm::Products;
use super::graphs::{self, DecodeGraph, GraphHostInputs};
use super::hybrid::CudaHybridBackend;
use super::hybrid_weights::{DevHybridLayer, DevMixer, HybridSpace};
use super::kernels::{
    failed, holds, AddRmsNorm, Attention, EmbedGather, GatherRows, Heads, Kernels, RmsNorm,
};
use super::launch::Launch;
use super::shapes::{self, grid};
use crate::backend::error::{BackendError, LaunchError};
use crate::backend::ForwardBatch;
use crate::config::ModelConfig;
use crate::error::Result;

impl CudaHybridBackend {
    /// Runs the step up to the logits, left in `self.ls.logits` (rows in batch order), and
    /// returns how many rows have them.
    pub(super) fn run(&mut self, batch: &ForwardBatch) -> Result<usize> {
        let t = batch.num_tokens();
        if t == 0 {
            return Ok(0);
        }
        self.check_slots(batch)?;
        let layout = batch::build(
            batch,
            self.kv.block_size(),
            self.kv.num_blocks,
            self.cfg.vocab_size,
        )?;
        self.ctx
            .bind_to_thread()
            .map_err(|e| drv("binding the context", e))?;
        if let Some(n) = self.run_graph(&layout, batch)? {
            return Ok(n);
        }
        self.ensure_space(t)?;
        let dims = StepDims::of(&layout);
        self.ensure_logits_space(dims.logits)?;
        let inputs = StepInputs::upload(&self.stream, &layout)?;
        // The delta kernels' table: each sequence's first row, rows, slot and whether it
        // starts from no state (its first chunk).
        let mut first = 0;
        let rows: Vec<(usize, usize, u32, bool)> = batch
            .seqs
            .iter()
            .map(|s| {
                let r = (
                    first,
                    s.tokens.len(),
                    s.state_slot.expect("check_slots"),
                    s.start_pos == 0,
                );
                first += s.tokens.len();
                r
            })
            .collect();
        let max_slot = rows.iter().map(|r| r.2 as usize).max().unwrap_or(0);
        let seqs = self
            .stream
            .clone_htod(&seq_table(&rows))
            .map_err(|e| drv("batch upload", e))?;
        self.enqueue(&dims, &inputs, &seqs, max_slot)?;
        Ok(dims.logits)
    }

    /// A pure decode step through its bucket's CUDA graph, as the dense backend's
    /// (`step::run_graph`): the step's inputs padded to the bucket go into the graph's
    /// buffers, and so does its delta-rule table, the padding rows on the scratch slot from
    /// no state. `None` when the step does not qualify or a capture failed (graphs are then
    /// off, and the step runs eagerly).
    fn run_graph(
        &mut self,
        layout: &batch::BatchLayout,
        batch: &ForwardBatch,
    ) -> Result<Option<usize>> {
        let Some(b) = self.graphs.bucket(layout) else {
            return Ok(None);
        };
        self.ensure_space(b)?;
        self.ensure_logits_space(b)?;
        let host = self.graphs.host_inputs(layout, b);
        let scratch = self.scratch_slot;
        let rows: Vec<(usize, usize, u32, bool)> = (0..b)
            .map(|i| match batch.seqs.get(i) {
                Some(s) => (i, 1, s.state_slot.expect("check_slots"), s.start_pos == 0),
                None => (i, 1, scratch, true),
            })
            .collect();
        let table = seq_table(&rows);
        let mut seqs = match self.graph_seqs.remove(&b) {
            Some(s) => s,
            None => self
                .stream
                .alloc_zeros::<i32>(table.len())
                .map_err(|e| drv("decode graph sequence table", e))?,
        };
        self.stream
            .memcpy_htod(&table, &mut seqs)
            .map_err(|e| drv("decode graph sequence table", e))?;
        let mut g = self.graphs.take(&self.stream, b)?;
        let r = self.replay(&mut g, &host, &seqs, b);
        self.graphs.put_back(b, g);
        if self.graphs.enabled() {
            self.graph_seqs.insert(b, seqs);
        }
        Ok(r?.map(|()| layout.num_seqs()))
    }

    /// Uploads `host` into `g`'s buffers, captures `g` if needed, and launches it.
    fn replay(
        &mut self,
        g: &mut DecodeGraph,
        host: &GraphHostInputs,
        seqs: &CudaSlice<i32>,
        b: usize,
    ) -> Result<Option<()>> {
        g.upload(&self.stream, host)?;
        if g.exec.is_none() {
            let dims = self.graphs.dims(b);
            let (ctx, stream) = (self.ctx.clone(), self.stream.clone());
            let scratch = self.scratch_slot as usize;
            let record = || self.enqueue(&dims, &g.inputs, seqs, scratch).map(|()| 0);
            match graphs::capture(&ctx, &stream, record) {
                Ok(graph) => g.exec = Some(graph),
                Err(e) => {
                    tracing::warn!(
                        error = %e,
                        bucket = b,
                        "CUDA graph capture failed; decode steps run eagerly from now on"
                    );
                    self.graphs.disable();
                    self.graph_seqs.clear();
                    return Ok(None);
                }
            }
        }
        self.graphs.launch(g, &self.stream)?;
        Ok(Some(()))
    }

    /// Activations for at least `t` tokens (none for 0).
    pub(super) fn ensure_space(&mut self, t: usize) -> Result<()> {
        if t == 0 || self.space.as_ref().is_some_and(|s| s.tokens >= t) {
            return Ok(());
        }
        // The old buffers go first, so their memory can be reused; graphs captured with them
        // would launch on freed memory.
        self.space = None;
        self.graphs.drop_captured();
        self.space = Some(HybridSpace::alloc(
            &self.stream,
            &self.cfg,
            t.next_power_of_two(),
        )?);
        if let Some(f) = &mut self.fp8 {
            f.ensure_tokens(&self.stream, t.next_power_of_two())?;
        }
        Ok(())
    }

    /// Logits buffers for at least `rows` rows (none for 0).
    pub(super) fn ensure_logits_space(&mut self, rows: usize) -> Result<()> {
        if rows == 0 || self.ls.as_ref().is_some_and(|l| l.rows >= rows) {
            return Ok(());
        }
        self.ls = None;
        self.graphs.drop_captured();
        self.ls = Some(LogitsSpace::alloc(
            &self.stream,
            &self.cfg,
            rows.next_power_of_two(),
        )?);
        Ok(())
    }

    fn enqueue(
        &mut self,
        dims: &StepDims,
        inp: &StepInputs,
        seqs: &CudaSlice<i32>,
        max_slot: usize,
    ) -> Result<()> {
        let CudaHybridBackend {
            cfg,
            stream,
            blas,
            k,
            w,
            kv,
            space,
            ls,
            states,
            layout,
            fp8,
            skinny_max_rows,
            split_decode,
            gdn_scan,
            gdn_chunked,
            ..
        } = self;
        let sp = space
            .as_mut()
            .ok_or(BackendError::Invariant("activations missing"))?;
        let s = &**stream;
        let pass = Pass {
            cfg,
            s,
            k,
            mm: Products {
                blas,
                s,
                k,
                skinny_max_rows: *skinny_max_rows,
                fp8: fp8.as_ref(),
            },
            inp,
            dims,
            heads: Heads::of(cfg),
            splits: if *split_decode {
                shapes::decode_splits(dims.seqs)
            } else {
                1
            },
            // Steps with prompts only: a decode step (one token a sequence, its graphs too)
            // keeps the one-kernel recurrence.
            scan: ((*gdn_scan || *gdn_chunked) && dims.tokens > dims.seqs)
                .then_some(dims.max_query_len),
            chunked: *gdn_chunked,
        };
        let (t, h, eps) = (dims.tokens, cfg.hidden_size, cfg.rms_norm_eps);
        EmbedGather {
            table: &w.embed_tokens,
            ids: &inp.token_ids,
            out: &mut sp.x,
            tokens: t,
            hidden: h,
        }
        .launch(k, s)?;
        RmsNorm {
            x: &sp.x,
            w: w.layers.first().map_or(&w.norm, |l| &l.input_norm),
            out: &mut sp.xn,
            rows: t,
            hidden: h,
            eps,
        }
        .launch(k, s)?;
        let (mut linear_i, mut full_i) = (0, 0);
        for (li, layer) in w.layers.iter().enumerate() {
            match &layer.mixer {
                DevMixer::Delta { .. } => {
                    let at = StateAt {
                        slot_stride: layout.floats_per_slot(),
                        layer_off: linear_i * (layout.conv + layout.delta),
                    };
                    pass.delta(&layer.mixer, sp, states, at, seqs, max_slot)?;
                    linear_i += 1;
                }
                DevMixer::Attention { .. } => {
                    let bs = kv.block_size();
                    let (kc, vc) = (&mut kv.k[full_i], &mut kv.v[full_i]);
                    pass.attention(&layer.mixer, sp, kc, vc, bs, &w.inv_freq)?;
                    full_i += 1;
                }
            }
            let next = w.layers.get(li + 1).map_or(&w.norm, |n| &n.input_norm);
            pass.mlp(layer, next, sp)?;
        }
        if dims.logits == 0 {
            return Ok(());
        }
        let ls = ls
            .as_mut()
            .ok_or(BackendError::Invariant("logits space missing"))?;
        // Every token's row (a decode step): `xn`'s rows in order, as the dense pass has them.
        let every_row = dims.logits == dims.tokens;
        if !every_row {
            GatherRows {
                src: &sp.xn,
                rows: &inp.logits_rows,
                dst: &mut ls.xr,
                n: dims.logits,
                cols: h,
            }
            .launch(k, s)?;
        }
        let head = w.lm_head.as_ref().map_or(&w.embed_tokens, |l| &l.w);
        let x = if every_row { &sp.xn } else { &ls.xr };
        pass.mm
            .product(x, head, &mut ls.logits, (dims.logits, cfg.vocab_size, h))
    }
}

/// What every launch of one step reads.
struct Pass<'a> {
    cfg: &'a ModelConfig,
    s: &'a CudaStream,
    k: &'a Kernels,
    mm: Products<'a>,
    inp: &'a StepInputs,
    dims: &'a StepDims,
    heads: Heads,
    /// Splits of each history in a decode step's attention.
    splits: usize,
    /// `DeltaMix::scan` and `DeltaMix::chunked` for this step's Gated DeltaNet layers.
    scan: Option<usize>,
    chunked: bool,
}

impl Pass<'_> {
    /// A Gated DeltaNet layer, from `xn` to its output in `tmp`, its state at `at`.
    fn delta(
        &self,
        mixer: &DevMixer,
        sp: &mut HybridSpace,
        states: &mut CudaSlice<f32>,
        at: StateAt,
        seqs: &CudaSlice<i32>,
        max_slot: usize,
    ) -> Result<()> {
        let DevMixer::Delta {
            in_proj,
            conv,
            neg_a,
            dt_bias,
            norm,
            eps,
            dims: d,
            out_proj,
        } = mixer
        else {
            return Err(BackendError::Invariant("not a Gated DeltaNet layer").into());
        };
        let t = self.dims.tokens;
        self.mm.proj(in_proj, t, &sp.xn, &mut sp.proj)?;
        DeltaMix {
            dims: *d,
            proj: &sp.proj,
            conv,
            neg_a,
            dt_bias,
            norm,
            eps: *eps,
            states,
            at,
            max_slot,
            seqs,
            num_seqs: self.dims.seqs,
            tokens: t,
            mixed: &mut sp.mixed,
            out: &mut sp.core,
            scan: self.scan,
            // The MLP's gate/up products are not in use while a mixer runs; the backend
            // checked at start that they hold the chunks' matrices (`gdn_chunked`).
            chunk_mats: (self.scan.is_some() && self.chunked).then_some(&mut sp.gate_up),
        }
        .launch(self.k, self.s)?;
        self.mm.proj(out_proj, t, &sp.core, &mut sp.tmp)
    }

    /// A gated full-attention layer, from `xn` to its output in `tmp`, its K and V into
    /// this layer's cache.
    fn attention(
        &self,
        mixer: &DevMixer,
        sp: &mut HybridSpace,
        k_cache: &mut CudaSlice<u16>,
        v_cache: &mut CudaSlice<u16>,
        block_size: usize,
        inv_freq: &CudaSlice<f32>,
    ) -> Result<()> {
        let DevMixer::Attention {
            qkv,
            q_norm,
            k_norm,
            o_proj,
        } = mixer
        else {
            return Err(BackendError::Invariant("not an attention layer").into());
        };
        let (cfg, t) = (self.cfg, self.dims.tokens);
        self.mm.proj(qkv, t, &sp.xn, &mut sp.proj)?;
        GatedRopeKvWrite {
            proj: &sp.proj,
            inputs: self.inp,
            inv_freq,
            k_cache,
            v_cache,
            q_w: q_norm,
            k_w: k_norm,
            eps: cfg.rms_norm_eps,
            q: &mut sp.q,
            gate: &mut sp.gate,
            tokens: t,
            heads: self.heads,
            rot: cfg.rotary_dim(),
        }
        .launch(self.k, self.s)?;
        Attention {
            qkv: &sp.q,
            q_row: cfg.q_dim(),
            inputs: self.inp,
            dims: self.dims,
            k_cache,
            v_cache,
            out: &mut sp.core,
            part: &mut sp.part,
            ticks: &mut sp.ticks,
            splits: self.splits,
            heads: self.heads,
            block_size,
            scale: cfg.attention_scale(),
            window: None,
        }
        .launch(self.k, self.s)?;
        GateSigmoidMul {
            attn: &mut sp.core,
            gate: &sp.gate,
            rows: t,
            cols: cfg.q_dim(),
        }
        .launch(self.k, self.s)?;
        self.mm.proj(o_proj, t, &sp.core, &mut sp.tmp)
    }

    /// The mixer's residual and the post norm, the MLP, its residual and `next` norm (the
    /// next layer's input norm, or the final one), leaving `xn` for what follows.
    fn mlp(
        &self,
        layer: &DevHybridLayer,
        next: &CudaSlice<f32>,
        sp: &mut HybridSpace,
    ) -> Result<()> {
        let (cfg, t) = (self.cfg, self.dims.tokens);
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        AddRmsNorm {
            residual: &mut sp.x,
            delta: &sp.tmp,
            w: &layer.post_norm,
            out: &mut sp.xn,
            rows: t,
            hidden: h,
            eps,
        }
        .launch(self.k, self.s)?;
        self.mm
            .gate_up_silu_proj(&layer.gate_up, t, &sp.xn, &mut sp.gate_up, &mut sp.act)?;
        self.mm.proj(&layer.down, t, &sp.act, &mut sp.tmp)?;
        AddRmsNorm {
            residual: &mut sp.x,
            delta: &sp.tmp,
            w: next,
            out: &mut sp.xn,
            rows: t,
            hidden: h,
            eps,
        }
        .launch(self.k, self.s)
    }
}

/// `gated_rope_kv_write`: a gated attention layer's q and k heads normed and rotated, the
/// queries and gates apart, K and V into the cache.
struct GatedRopeKvWrite<'a> {
    proj: &'a CudaSlice<f32>,
    inputs: &'a StepInputs,
    inv_freq: &'a CudaSlice<f32>,
    k_cache: &'a mut CudaSlice<u16>,
    v_cache: &'a mut CudaSlice<u16>,
    q_w: &'a CudaSlice<f32>,
    k_w: &'a CudaSlice<f32>,
    eps: f32,
    q: &'a mut CudaSlice<f32>,
    gate: &'a mut CudaSlice<f32>,
    tokens: usize,
    heads: Heads,
    rot: usize,
}

impl GatedRopeKvWrite<'_> {
    fn launch(self, k: &Kernels, s: &CudaStream) -> Result<()> {
        let n = "gated_rope_kv_write";
        let h = self.heads;
        let row = 2 * h.q * h.dim + 2 * h.kv * h.dim;
        let qd = h.q * h.dim;
        if self.rot > h.dim || !self.rot.is_multiple_of(2) {
            return Err(LaunchError::Rotary {
                kernel: n,
                rot: self.rot,
                dim: h.dim,
            }
            .into());
        }
        holds(n, "proj", self.proj.len(), self.tokens * row)?;
        holds(n, "positions", self.inputs.positions.len(), self.tokens)?;
        holds(n, "slots", self.inputs.slots.len(), self.tokens)?;
        holds(n, "inv_freq", self.inv_freq.len(), self.rot / 2)?;
        holds(n, "q_w", self.q_w.len(), h.dim)?;
        holds(n, "k_w", self.k_w.len(), h.dim)?;
        holds(n, "q", self.q.len(), self.tokens * qd)?;
        holds(n, "gate", self.gate.len(), self.tokens * qd)?;
        let (rowi, nq, nkv, d, rot) = (
            row as i32,
            h.q as i32,
            h.kv as i32,
            h.dim as i32,
            self.rot as i32,
        );
        let mut b = Launch::new(s, &k.gated_rope_kv_write, k.pdl);
        b.arg(self.proj)
            .arg(&self.inputs.positions)
            .arg(self.inv_freq)
            .arg(&self.inputs.slots)
            .arg(self.k_cache)
            .arg(self.v_cache)
            .arg(self.q_w)
            .arg(self.k_w)
            .arg(&self.eps)
            .arg(self.q)
            .arg(self.gate)
            .arg(&rowi)
            .arg(&nq)
            .arg(&nkv)
            .arg(&d)
            .arg(&rot);
        let cfg = grid(&shapes::GATED_ROPE_KV_WRITE, self.tokens, h.q + h.kv, 1)?;
        // SAFETY: the arguments match `gated_rope_kv_write`'s signature in order and type;
        // every buffer holds the grid's tokens (checked above) and every slot is inside the
        // cache (`batch::build` checked the tables).
        unsafe { b.launch(cfg) }.map_err(failed(n))?;
        Ok(())
    }
}

/// `gate_sigmoid_mul`: `attn *= sigmoid(gate)`, bf16 rows of `cols`.
struct GateSigmoidMul<'a> {
    attn: &'a mut CudaSlice<u16>,
    gate: &'a CudaSlice<f32>,
    rows: usize,
    cols: usize,
}

impl GateSigmoidMul<'_> {
    fn launch(self, k: &Kernels, s: &CudaStream) -> Result<()> {
        let n = "gate_sigmoid_mul";
        holds(n, "attn", self.attn.len(), self.rows * self.cols)?;
        holds(n, "gate", self.gate.len(), self.rows * self.cols)?;
        let cols = self.cols as i32;
        let chunks = self
            .cols
            .div_ceil(shapes::GATE_SIGMOID_MUL.threads as usize);
        let cfg = grid(&shapes::GATE_SIGMOID_MUL, self.rows, chunks, 1)?;
        let mut b = Launch::new(s, &k.gate_sigmoid_mul, k.pdl);
        b.arg(self.attn).arg(self.gate).arg(&cols);
        // SAFETY: the arguments match `gate_sigmoid_mul`'s signature in order and type, and
        // both buffers hold the grid's rows (checked above).
        unsafe { b.launch(cfg) }.map_err(failed(n))?;
        Ok(())
    }
}
