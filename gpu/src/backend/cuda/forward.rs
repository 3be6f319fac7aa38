//! The forward pass on the device, launch by launch; it follows the CPU backend's `run`
//! (`cpu/mod.rs`), which is the reference. The residual adds are fused with the norm that
//! follows them (`AddRmsNorm`), so the stream keeps `x` (f32) and its normed copy `xn`
//! (bf16), the next product's input.

use cudarc::driver::{CudaSlice, CudaStream};

use super::buffers::{LogitsSpace, StepDims, StepInputs, Workspace};
use super::gemm::{Fused, Products};
use super::kernels::{
    AddRmsNorm, Attention, EmbedGather, GatherRows, Heads, Kernels, RmsNorm, RopeKvWrite,
};
use super::kv::KvCache;
use super::shapes;
use super::skinny::{RopeIn, SkinnyIn};
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
        self.with_pass(dims, inp, true, |pass, kv, ws, ls| {
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
        self.with_pass(dims, inp, false, |pass, kv, ws, _| {
            let layers = &pass.w.layers;
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
        self.with_pass(dims, inp, false, |pass, kv, ws, _| {
            pass.attention(li, kv, ws)
        })
    }

    /// Piecewise prefill: the logits of the step's rows that want them, after the last
    /// segment. Returns how many.
    pub(super) fn enqueue_logits(&mut self, dims: &StepDims, inp: &StepInputs) -> Result<usize> {
        self.with_pass(dims, inp, false, |pass, _, ws, ls| pass.logits(ws, ls))
    }

    /// Which products of a step of `tokens` rows take the residual add and norm before
    /// them as their prologue (`CudaOptions::fuse_norms`: each layer's gate/up product, and
    /// its q/k/v product past the first layer), and which layers' q/k/v products rotate q
    /// and k (after their q/k norms, where a layer has them) and write the new K/V as their
    /// epilogue (`CudaOptions::fuse_rope`): those whose products have such kernels (bf16 skinny ones, or FP8
    /// products of one FP8 part; `Products::fuses`). Layers decide one by one, so a layer
    /// that cannot (an FP8 product with an unquantized part) costs only its own launches.
    pub fn fused_decode(&self, tokens: usize) -> FusedProducts {
        let (fuse_norms, fuse_rope) = self.fusions_asked();
        let mm = Products {
            blas: &self.blas,
            s: &self.stream,
            k: &self.k,
            skinny_max_rows: self.skinny_max_rows,
            fp8: self.fp8.as_ref(),
        };
        let f = Fusions {
            norms: fuse_norms,
            rope: fuse_rope,
            tokens,
        };
        let mut out = FusedProducts::default();
        for (li, l) in self.w.layers.iter().enumerate() {
            let normed = [
                li > 0 && f.norm_before_qkv(&mm, l),
                f.norm_before_mlp(&mm, l),
            ];
            out.normed += normed.iter().filter(|&&b| b).count();
            out.rotated += usize::from(f.rotates(&mm, l));
        }
        out
    }

    /// `CudaOptions::fuse_norms` and `fuse_rope`, as far as the model allows them at all.
    fn fusions_asked(&self) -> (bool, bool) {
        (
            self.fuse_norms,
            self.fuse_rope && self.cfg.head_dim.is_multiple_of(2),
        )
    }

    /// Runs `f` with the pass over `dims` and `inp`, the cache, the workspace and the logits
    /// space (which `f` may use only when `dims.logits > 0`).
    fn with_pass<T>(
        &mut self,
        dims: &StepDims,
        inp: &StepInputs,
        fuse: bool,
        f: impl FnOnce(&Pass, &mut KvCache, &mut Workspace, Option<&mut LogitsSpace>) -> Result<T>,
    ) -> Result<T> {
        let (norms, rope) = self.fusions_asked();
        let fuse = Fusions {
            norms: fuse && norms,
            rope: fuse && rope,
            tokens: dims.tokens,
        };
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
            fuse,
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
    /// Which products take the residual add and norm before them, or the rotary embedding
    /// after them (`CudaBackend::fused_decode`).
    fuse: Fusions,
}

/// `CudaBackend::fused_decode`'s count for one step: products with the norm as their
/// prologue, and q/k/v products with the rotary embedding as their epilogue.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FusedProducts {
    pub normed: usize,
    pub rotated: usize,
}

/// What a step asks to fuse (`CudaOptions::fuse_norms`, `fuse_rope`), decided layer by
/// layer by what each product's kernels take.
#[derive(Clone, Copy)]
struct Fusions {
    norms: bool,
    rope: bool,
    tokens: usize,
}

impl Fusions {
    /// Whether the residual add and input norm before layer `l` are its q/k/v product's
    /// prologue (past the first layer), rather than a launch after the layer before.
    fn norm_before_qkv(&self, mm: &Products, l: &DevLayer) -> bool {
        self.norms && mm.fuses(&l.qkv_proj, self.tokens, Fused::Norm)
    }

    /// Whether the residual add and norm after layer `l`'s attention are its gate/up
    /// product's prologue.
    fn norm_before_mlp(&self, mm: &Products, l: &DevLayer) -> bool {
        self.norms && mm.fuses(&l.gate_up_proj, self.tokens, Fused::NormSilu)
    }

    /// Whether layer `l`'s q/k/v product normalises (q/k norms) and rotates q and k and
    /// writes the new K/V itself.
    fn rotates(&self, mm: &Products, l: &DevLayer) -> bool {
        self.rope && mm.fuses(&l.qkv_proj, self.tokens, Fused::Rope)
    }
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
        // K/V into the cache: the product's epilogue under `fuse_rope`, else a launch of its
        // own.
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
        let rope = self.fuse.rotates(&self.mm, layer).then(|| RopeIn {
            inputs: self.inp,
            inv_freq: &self.w.inv_freq,
            k_cache: &mut kv.k[li],
            v_cache: &mut kv.v[li],
            heads: self.heads,
            norms,
            ticks: &mut ws.rope_ticks,
        });
        let rotated = rope.is_some();
        let mut swaps = false;
        if li > 0 && self.fuse.norm_before_qkv(&self.mm, layer) {
            let input = SkinnyIn::Norm {
                res_in: &ws.x,
                delta: &ws.tmp,
                w: &layer.input_layernorm,
                eps: cfg.rms_norm_eps,
                res_out: &mut ws.x2,
            };
            self.mm
                .linear_normed(&layer.qkv_proj, t, input, &mut ws.qkv, rope)?;
            std::mem::swap(&mut ws.x, &mut ws.x2);
            swaps = !swaps;
        } else if let Some(rope) = rope {
            self.mm
                .linear_rope(&layer.qkv_proj, t, &ws.xn, &mut ws.qkv, rope)?;
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
        if self.fuse.norm_before_mlp(&self.mm, layer) {
            let input = SkinnyIn::Norm {
                res_in: &ws.x,
                delta: &ws.tmp,
                w: &layer.post_attention_layernorm,
                eps: cfg.rms_norm_eps,
                res_out: &mut ws.x2,
            };
            self.mm
                .gate_up_silu_normed(&layer.gate_up_proj, t, input, &mut ws.act)?;
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
            Some(next) if self.fuse.norm_before_qkv(&self.mm, next) => {}
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
