//! The forward pass on the device, launch by launch; it follows the CPU backend's `run`
//! (`cpu/mod.rs`), which is the reference. The residual adds are fused with the norm that
//! follows them (`AddRmsNorm`), so the stream keeps `x` (f32) and its normed copy `xn`
//! (bf16), the next product's input.

use cudarc::driver::{CudaSlice, CudaStream};

use super::buffers::{LogitsSpace, StepDims, StepInputs, Workspace};
use super::gemm::Products;
use super::kernels::{
    AddRmsNorm, Attention, EmbedGather, GatherRows, Heads, Kernels, RmsNorm, RopeKvWrite,
};
use super::kernels::{RopeIn, SkinnyIn};
use super::kv::KvCache;
use super::shapes;
use super::weights::{DevLayer, DevWeights, Linear};
use super::CudaBackend;
use crate::backend::error::BackendError;
use crate::config::ModelConfig;
use crate::error::Result;

impl CudaBackend {
    /// Enqueues the whole forward pass for a step whose inputs are in `inp` (device arrays
    /// laid out as `batch::BatchLayout` describes), leaving the logits in `self.ls`. It
    /// neither allocates nor synchronises, so it can be recorded into a CUDA graph.
    pub(super) fn enqueue(&mut self, dims: &StepDims, inp: &StepInputs) -> Result<usize> {
        self.with_pass(dims, inp, |pass, kv, ws, ls| {
            pass.embed(ws)?;
            let mut swapped = false;
            for (li, layer) in pass.w.layers.iter().enumerate() {
                swapped ^= pass.layer(li, layer, kv, ws)?;
            }
            // The fused norms write the residual to the other buffer each time (see
            // `Pass::layer`): the handles go back, so a step (captured or not) always starts
            // from the same ones. Nothing carries over between steps: each starts from the
            // embeddings.
            if swapped {
                std::mem::swap(&mut ws.x, &mut ws.x2);
            }
            pass.logits(ws, ls)
        })
    }

    /// Piecewise prefill (`prefill_graphs`): segment `seg` of `L + 1` for a step of
    /// `dims.tokens` tokens whose token-wise inputs are in `inp`: segment 0 is the
    /// embedding and layer 0 up to its attention, segment `i` the rest of layer `i - 1` and
    /// layer `i` up to its attention, segment `L` the rest of the last layer and the final
    /// norm. Nothing in it depends on the sequences, so it can be captured for the token
    /// count alone. The norms are never fused here (no prefill is a skinny step).
    pub(super) fn enqueue_segment(
        &mut self,
        dims: &StepDims,
        inp: &StepInputs,
        seg: usize,
    ) -> Result<()> {
        self.with_pass(dims, inp, |pass, kv, ws, _| {
            let layers = &pass.w.layers;
            if pass.fuse_norms {
                return Err(BackendError::Invariant("a prefill segment with fused norms").into());
            }
            if seg == 0 {
                pass.embed(ws)?;
            } else {
                pass.post_attention(seg - 1, &layers[seg - 1], ws)?;
            }
            if let Some(layer) = layers.get(seg) {
                pass.pre_attention(seg, layer, kv, ws)?;
            }
            Ok(())
        })
    }

    /// Piecewise prefill: layer `li`'s attention over the step's sequences (`inp`, `dims`
    /// the step's own), between the segments around it.
    pub(super) fn enqueue_attention(
        &mut self,
        dims: &StepDims,
        inp: &StepInputs,
        li: usize,
    ) -> Result<()> {
        self.with_pass(dims, inp, |pass, kv, ws, _| pass.attention(li, kv, ws))
    }

    /// Piecewise prefill: the logits of the step's rows that want them, after the last
    /// segment. Returns how many.
    pub(super) fn enqueue_logits(&mut self, dims: &StepDims, inp: &StepInputs) -> Result<usize> {
        self.with_pass(dims, inp, |pass, _, ws, ls| pass.logits(ws, ls))
    }

    /// Runs `f` with the pass over `dims` and `inp`, the cache, the workspace and the logits
    /// space (which `f` may use only when `dims.logits > 0`).
    fn with_pass<T>(
        &mut self,
        dims: &StepDims,
        inp: &StepInputs,
        f: impl FnOnce(&Pass, &mut KvCache, &mut Workspace, Option<&mut LogitsSpace>) -> Result<T>,
    ) -> Result<T> {
        let Self {
            cfg,
            stream,
            blas,
            k,
            w,
            kv,
            ws,
            ls,
            skinny_max_rows,
            split_decode,
            fuse_norms,
            fuse_rope,
            fp8,
            ..
        } = self;
        let ws = ws
            .as_mut()
            .ok_or(BackendError::Invariant("workspace missing"))?;
        let pass = Pass {
            cfg,
            s: stream,
            k,
            mm: Products {
                blas,
                s: stream,
                k,
                skinny_max_rows: *skinny_max_rows,
                fp8: fp8.as_ref(),
            },
            w,
            dims,
            inp,
            heads: Heads::of(cfg),
            splits: if *split_decode {
                shapes::decode_splits(dims.seqs)
            } else {
                1
            },
            fuse_norms: false,
            fuse_rope: false,
        };
        let pass = Pass {
            // The fused norm prologues are bf16 products' only.
            fuse_norms: *fuse_norms
                && !w.fp8
                && pass.mm.norm_prologue(dims.tokens, cfg.hidden_size),
            // So is the rotary epilogue.
            fuse_rope: *fuse_rope
                && !w.fp8
                && cfg.head_dim % 2 == 0
                && pass.mm.takes_skinny(dims.tokens, cfg.hidden_size),
            ..pass
        };
        f(&pass, kv, ws, ls.as_mut())
    }
}

/// What every launch of one pass reads: the model, the kernels and the step's inputs.
struct Pass<'a> {
    cfg: &'a ModelConfig,
    s: &'a CudaStream,
    k: &'a Kernels,
    mm: Products<'a>,
    w: &'a DevWeights,
    dims: &'a StepDims,
    inp: &'a StepInputs,
    heads: Heads,
    /// Splits of each history in a decode step's attention.
    splits: usize,
    /// Whether the residual adds and norms between layers run as the next product's prologue
    /// (`CudaOptions::fuse_norms`, and a step the `skinny_norm*` kernels take).
    fuse_norms: bool,
    /// Whether the q/k/v product rotates q and k and writes the new K/V itself, for layers
    /// without a q/k norm (`CudaOptions::fuse_rope`, and a step the skinny kernels take).
    fuse_rope: bool,
}

impl Pass<'_> {
    /// `x = embed(tokens)`, and `xn` its norm for the first layer (the final norm when there
    /// is no layer).
    fn embed(&self, ws: &mut Workspace) -> Result<()> {
        let w = self.w;
        EmbedGather {
            table: &w.embed_tokens,
            ids: &self.inp.token_ids,
            out: &mut ws.x,
            tokens: self.dims.tokens,
            hidden: self.cfg.hidden_size,
        }
        .launch(self.k, self.s)?;
        let norm = w.layers.first().map_or(&w.norm, |l| &l.input_layernorm);
        RmsNorm {
            x: &ws.x,
            w: norm,
            out: &mut ws.xn,
            rows: self.dims.tokens,
            hidden: self.cfg.hidden_size,
            eps: self.cfg.rms_norm_eps,
        }
        .launch(self.k, self.s)
    }

    /// Layer `li`, from `xn` (its input, normed) to `x` with both residuals added and `xn`
    /// normed for the next layer (or by the final norm after the last).
    ///
    /// With `fuse_norms`, a residual add and the norm after it are instead the prologue of
    /// the next product (`skinny_norm*`): after attention, the gate/up product's; after the
    /// MLP, the next layer's q/k/v product's, so layer `li > 0` starts from `x` and `tmp`,
    /// not `xn`. Each such product writes the summed residual to `x2`, which is then swapped
    /// with `x`; returns whether the handles end up swapped (an odd number of times).
    fn layer(
        &self,
        li: usize,
        layer: &DevLayer,
        kv: &mut KvCache,
        ws: &mut Workspace,
    ) -> Result<bool> {
        let before = self.pre_attention(li, layer, kv, ws)?;
        self.attention(li, kv, ws)?;
        let after = self.post_attention(li, layer, ws)?;
        Ok(before ^ after)
    }

    /// Layer `li` up to its attention: the q/k/v product (with the residual add and input
    /// norm as its prologue under `fuse_norms`, past layer 0), the rotary embedding and the
    /// new K/V into the cache (the product's epilogue under `fuse_rope`). Returns whether it
    /// swapped `x` and `x2`.
    fn pre_attention(
        &self,
        li: usize,
        layer: &DevLayer,
        kv: &mut KvCache,
        ws: &mut Workspace,
    ) -> Result<bool> {
        let (cfg, t) = (self.cfg, self.dims.tokens);
        // Per-head rotary embedding (Qwen3: after a norm of each q and k head), then the new
        // K/V into the cache: the product's epilogue under `fuse_rope` where there is no
        // such norm, else a launch of its own.
        let norms = match (&layer.q_norm, &layer.k_norm) {
            (Some(q_w), Some(k_w)) => Some((q_w, k_w, cfg.rms_norm_eps)),
            (None, None) => None,
            _ => {
                return Err(BackendError::Invariant(
                    "a layer with a q norm and no k norm, or the other way round",
                )
                .into())
            }
        };
        let rope = (self.fuse_rope && norms.is_none()).then(|| RopeIn {
            inputs: self.inp,
            inv_freq: &self.w.inv_freq,
            k_cache: &mut kv.k[li],
            v_cache: &mut kv.v[li],
            heads: self.heads,
        });
        let rotated = rope.is_some();
        let mut swaps = false;
        if self.fuse_norms && li > 0 {
            let input = SkinnyIn::Norm {
                res_in: &ws.x,
                delta: &ws.tmp,
                w: &layer.input_layernorm,
                eps: cfg.rms_norm_eps,
                res_out: &mut ws.x2,
            };
            self.mm
                .linear_normed(layer.qkv_proj.bf16()?, t, input, &mut ws.qkv, rope)?;
            std::mem::swap(&mut ws.x, &mut ws.x2);
            swaps = !swaps;
        } else if let Some(rope) = rope {
            self.mm
                .linear_rope(layer.qkv_proj.bf16()?, t, &ws.xn, &mut ws.qkv, rope)?;
        } else {
            self.linear(&layer.qkv_proj, &ws.xn, &mut ws.qkv)?;
        }
        if !rotated {
            RopeKvWrite {
                qkv: &mut ws.qkv,
                norms,
                inputs: self.inp,
                inv_freq: &self.w.inv_freq,
                k_cache: &mut kv.k[li],
                v_cache: &mut kv.v[li],
                tokens: t,
                heads: self.heads,
            }
            .launch(self.k, self.s)?;
        }
        Ok(swaps)
    }

    /// Layer `li`'s attention over the paged cache, into `attn`.
    fn attention(&self, li: usize, kv: &KvCache, ws: &mut Workspace) -> Result<()> {
        let cfg = self.cfg;
        Attention {
            qkv: &ws.qkv,
            q_row: self.heads.row(),
            inputs: self.inp,
            dims: self.dims,
            k_cache: &kv.k[li],
            v_cache: &kv.v[li],
            out: &mut ws.attn,
            part: &mut ws.part,
            ticks: &mut ws.ticks,
            splits: self.splits,
            heads: self.heads,
            block_size: kv.block_size(),
            scale: cfg.attention_scale(),
            window: cfg.layer_window(li),
        }
        .launch(self.k, self.s)
    }

    /// Layer `li` after its attention: the output product, the residual add and norm, the
    /// MLP, and the residual add fused with the next layer's input norm (or the final norm).
    /// Returns whether it swapped `x` and `x2`.
    fn post_attention(&self, li: usize, layer: &DevLayer, ws: &mut Workspace) -> Result<bool> {
        let (cfg, t) = (self.cfg, self.dims.tokens);
        let mut swaps = false;
        self.linear(&layer.o_proj, &ws.attn, &mut ws.tmp)?;
        if self.fuse_norms {
            let input = SkinnyIn::Norm {
                res_in: &ws.x,
                delta: &ws.tmp,
                w: &layer.post_attention_layernorm,
                eps: cfg.rms_norm_eps,
                res_out: &mut ws.x2,
            };
            self.mm
                .gate_up_silu_normed(layer.gate_up_proj.bf16()?, t, input, &mut ws.act)?;
            std::mem::swap(&mut ws.x, &mut ws.x2);
            swaps = !swaps;
        } else {
            self.add_rms_norm(ws, &layer.post_attention_layernorm)?;
            self.mm.gate_up_silu_proj(
                &layer.gate_up_proj,
                t,
                &ws.xn,
                &mut ws.gate_up,
                &mut ws.act,
            )?;
        }
        self.linear(&layer.down_proj, &ws.act, &mut ws.tmp)?;
        // The residual add, fused with the next layer's input norm (as a launch, or left to
        // that layer's first product), or with the final norm after the last layer.
        match self.w.layers.get(li + 1) {
            Some(_) if self.fuse_norms => {}
            Some(next) => self.add_rms_norm(ws, &next.input_layernorm)?,
            None => self.add_rms_norm(ws, &self.w.norm)?,
        }
        Ok(swaps)
    }

    /// The logits of the rows that want them: those rows of `xn` gathered, times the head.
    /// Returns how many. When every token wants logits (a decode step's), the rows are
    /// `xn`'s own, in order (`batch::build` takes each sequence's last token, in order), and
    /// the head reads `xn` with no gather.
    fn logits(&self, ws: &Workspace, ls: Option<&mut LogitsSpace>) -> Result<usize> {
        let (n, h) = (self.dims.logits, self.cfg.hidden_size);
        if n == 0 {
            return Ok(0);
        }
        let ls = ls.ok_or(BackendError::Invariant("logits space missing"))?;
        let every_row = n == self.dims.tokens;
        if !every_row {
            GatherRows {
                src: &ws.xn,
                rows: &self.inp.logits_rows,
                dst: &mut ls.xr,
                n,
                cols: h,
            }
            .launch(self.k, self.s)?;
        }
        let head = match &self.w.lm_head {
            Some(l) => &l.w,
            None => &self.w.embed_tokens,
        };
        let vocab = self.cfg.vocab_size;
        let x = if every_row { &ws.xn } else { &ls.xr };
        self.mm.product(x, head, &mut ls.logits, (n, vocab, h))?;
        Ok(n)
    }

    /// `y = x · Wᵀ (+ b)` over the step's tokens.
    fn linear(&self, l: &Linear, x: &CudaSlice<u16>, y: &mut CudaSlice<f32>) -> Result<()> {
        self.mm.proj(l, self.dims.tokens, x, y)
    }

    /// `x += tmp`, then `xn = rmsnorm(x) * norm`.
    fn add_rms_norm(&self, ws: &mut Workspace, norm: &CudaSlice<f32>) -> Result<()> {
        AddRmsNorm {
            residual: &mut ws.x,
            delta: &ws.tmp,
            w: norm,
            out: &mut ws.xn,
            rows: self.dims.tokens,
            hidden: self.cfg.hidden_size,
            eps: self.cfg.rms_norm_eps,
        }
        .launch(self.k, self.s)
    }
}
