//! The CPU backend: the transformer forward pass in plain Rust over a paged KV cache.
//!
//! Weights are converted to f32 once at load. Each step runs every scheduled token of every
//! sequence through the layers together (one matrix product per projection for the whole
//! batch); attention reads each sequence's history through its block table.

mod attn_blocked;
pub mod delta;
pub mod fp8_acts;
mod gemm_bf16;
mod hybrid;
mod hybrid_backend;
mod hybrid_layers;
mod ops;
mod vexp;

use rayon::prelude::*;

pub use hybrid::{argmax, HybridModel, HybridSequence, HybridState, StateLayout, DEFAULT_CHUNK};
pub use hybrid_backend::{HybridBackend, StateBudget};
pub use ops::{Linear, Matrix};

use std::sync::Arc;

use self::fp8_acts::Fp8Activations;
use super::{sample_all, Backend, ForwardBatch, SampleSpec};
use crate::checkpoint::{Checkpoint, Projection};
use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::kv_pool::{HostKvPool, KvDtype, KvSpec};
use crate::safetensors::{TensorData, WeightStore};
use crate::sampler::Sampled;

struct Layer {
    input_layernorm: Vec<f32>,
    /// q, k and v projections stacked: `[q_dim + 2 * kv_dim, hidden]`.
    qkv_proj: Linear,
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    o_proj: Linear,
    post_attention_layernorm: Vec<f32>,
    /// gate and up projections stacked: `[2 * intermediate, hidden]`.
    gate_up_proj: Linear,
    down_proj: Linear,
}

pub struct CpuModel {
    cfg: ModelConfig,
    embed_tokens: Matrix,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    lm_head: Linear,
    inv_freq: Vec<f32>,
}

impl CpuModel {
    /// Prompt-sized products of the layers' bf16 projections round their inputs to bf16 and
    /// run on AVX512-BF16 (`gemm_bf16`), as GPU engines and llama.cpp multiply bf16 weights;
    /// where the CPU lacks it, or weights are f32, nothing changes. Off unless asked for:
    /// the default keeps f32 activations, within 2e-3 of transformers in f32. The LM head
    /// (one row a sequence) streams either way.
    pub fn with_bf16_products(mut self) -> CpuModel {
        for l in &mut self.layers {
            for p in [
                &mut l.qkv_proj,
                &mut l.o_proj,
                &mut l.gate_up_proj,
                &mut l.down_proj,
            ] {
                p.bf16_products = true;
            }
        }
        self
    }

    /// The products of the layers the checkpoint quantizes round their input as an FP8 GEMM
    /// does when they have more than `above_rows` rows (`fp8_acts`): the model a GPU's FP8
    /// path computes, to hold it to more closely than to the dequantized model. `w` is the
    /// store the model was loaded from (for static schemes' `input_scale`s).
    pub fn with_fp8_activations(mut self, w: &WeightStore, above_rows: usize) -> Result<CpuModel> {
        let ck = Checkpoint::new(&self.cfg, w);
        let acts = |parts: &[(String, usize)]| {
            Fp8Activations::of_parts(&self.cfg, w, parts, above_rows).map(|a| a.map(Arc::new))
        };
        for (i, l) in self.layers.iter_mut().enumerate() {
            let stacks = ck.stacks(i)?;
            let products = [
                &mut l.qkv_proj,
                &mut l.o_proj,
                &mut l.gate_up_proj,
                &mut l.down_proj,
            ];
            for (p, s) in products.into_iter().zip(&stacks) {
                p.fp8_activations = acts(&s.parts)?;
            }
        }
        if !self.cfg.tie_word_embeddings {
            self.lm_head.fp8_activations = acts(&[("lm_head".into(), self.cfg.vocab_size)])?;
        }
        Ok(self)
    }

    /// Whether `with_bf16_products` was asked for and its products run here (bf16 weights,
    /// a CPU with AVX512-BF16).
    pub fn bf16_products_run(&self) -> bool {
        self.layers
            .first()
            .is_some_and(|l| l.qkv_proj.takes_bf16_products())
    }

    /// Whether `with_bf16_products` would change how this model multiplies here: bf16
    /// weights and a CPU with AVX512-BF16.
    pub fn bf16_products_available(&self) -> bool {
        self.layers.first().is_some_and(|l| {
            let p = &l.qkv_proj;
            matches!(p.w, ops::Matrix::Bf16(_)) && p.inp.is_multiple_of(2) && gemm_bf16::available()
        })
    }

    /// Loads the weights, keeping bf16 ones as bf16.
    pub fn load(cfg: &ModelConfig, w: &WeightStore) -> Result<CpuModel> {
        Self::load_with(cfg, w, true)
    }

    /// With `keep_bf16` false every weight is widened to f32 at load (twice the memory and
    /// the bytes per decode step; kept for comparison).
    pub fn load_with(cfg: &ModelConfig, w: &WeightStore, keep_bf16: bool) -> Result<CpuModel> {
        let ck = Checkpoint::new(cfg, w);
        let mat = |d: TensorData| {
            let m = Matrix::from_data(d);
            if keep_bf16 {
                m
            } else {
                m.to_f32()
            }
        };
        let linear = |p: Projection| Linear::new(mat(p.weight), p.out, p.inp, p.bias);
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let l = ck.layer(i)?;
            layers.push(Layer {
                input_layernorm: l.input_layernorm,
                qkv_proj: linear(l.qkv_proj),
                q_norm: l.q_norm,
                k_norm: l.k_norm,
                o_proj: linear(l.o_proj),
                post_attention_layernorm: l.post_attention_layernorm,
                gate_up_proj: linear(l.gate_up_proj),
                down_proj: linear(l.down_proj),
            });
        }
        let embed_tokens = mat(ck.embed_tokens()?);
        // Tied: the head reads the embedding matrix itself (shared, not copied).
        let lm_head = match ck.lm_head()? {
            Some(head) => linear(head),
            None => Linear::new(embed_tokens.clone(), cfg.vocab_size, cfg.hidden_size, None),
        };
        Ok(CpuModel {
            cfg: cfg.clone(),
            embed_tokens,
            layers,
            norm: ck.norm()?,
            lm_head,
            inv_freq: cfg.rope_inv_freq(),
        })
    }

    /// Bytes of weights one decode step reads (every layer, the final norm and the lm head;
    /// one embedding row per token is negligible).
    pub fn weight_bytes_per_step(&self) -> usize {
        self.layers
            .iter()
            .map(|l| {
                l.qkv_proj.bytes()
                    + l.o_proj.bytes()
                    + l.gate_up_proj.bytes()
                    + l.down_proj.bytes()
                    + 4 * (l.input_layernorm.len() + l.post_attention_layernorm.len())
            })
            .sum::<usize>()
            + self.lm_head.bytes()
            + 4 * self.norm.len()
    }
}

pub struct CpuBackend {
    /// Shared by every engine built from the same `LoadedModel` (a node's prefill and decode
    /// engines): the weights are read-only during a step.
    model: Arc<CpuModel>,
    /// K and V in f32, shared with KV transfers (see `kv_pool` for who may touch what).
    kv: Arc<HostKvPool>,
}

/// Keeps freed memory in the process for the next step instead of returning it to the
/// system (glibc: no `mmap` for large blocks, no trimming of the heap's top).
///
/// A CPU step allocates tens of MB of activations a layer (a 2,048-token prompt's MLP rows
/// are 80 MB in f32). With glibc's defaults, blocks that large are mapped fresh and unmapped
/// when freed, so every layer of every step pays page faults on zeroed pages: with it, a
/// 2,048-token prefill of the 0.5B shape went from 271 to 387 tokens/s on 2 cores (the
/// page-fault handler was a tenth of the `perf` profile). The cost is that the process keeps
/// its peak memory, which a serving engine sizes up front anyway. Called by `kvmesh` and
/// `engine-bench` at start; a no-op on other C libraries. Returns whether it took effect.
pub fn keep_freed_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only sets allocator parameters; called before other threads
        // allocate much, and safe at any time in glibc.
        unsafe {
            libc::mallopt(libc::M_MMAP_MAX, 0) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

impl CpuBackend {
    pub fn new(
        model: impl Into<Arc<CpuModel>>,
        num_blocks: usize,
        block_size: usize,
    ) -> Result<CpuBackend> {
        let model = model.into();
        let kv = HostKvPool::new(Self::kv_spec_for(&model.cfg, block_size), num_blocks)?;
        Ok(CpuBackend {
            model,
            kv: Arc::new(kv),
        })
    }

    fn kv_spec_for(cfg: &ModelConfig, block_size: usize) -> KvSpec {
        KvSpec {
            num_layers: cfg.num_layers,
            block_size,
            num_kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
            dtype: KvDtype::F32,
        }
    }

    /// Memory one block takes across all layers (K and V, f32).
    pub fn kv_bytes_per_block(cfg: &ModelConfig, block_size: usize) -> usize {
        Self::kv_spec_for(cfg, block_size).bytes_per_token() * block_size
    }

    pub fn model(&self) -> &CpuModel {
        &self.model
    }
}

/// Where each scheduled token sits: its sequence, position, and cache slot.
struct TokenSlot {
    seq: usize,
    pos: usize,
    slot: usize,
}

impl Backend for CpuBackend {
    fn device(&self) -> String {
        format!("cpu ({} threads)", rayon::current_num_threads())
    }

    fn occupies_host_cores(&self) -> bool {
        true
    }

    fn num_blocks(&self) -> usize {
        self.kv.num_blocks()
    }

    fn kv_spec(&self) -> Option<KvSpec> {
        Some(self.kv.spec().clone())
    }

    fn host_kv(&self) -> Option<Arc<HostKvPool>> {
        Some(self.kv.clone())
    }

    fn kv_depends_on_context(&self) -> bool {
        self.model.cfg.rope_depends_on_length()
    }

    fn forward(&mut self, batch: &ForwardBatch) -> Result<Vec<Vec<f32>>> {
        self.run(batch, None)
    }

    fn forward_sample_streaming(
        &mut self,
        batch: &ForwardBatch,
        specs: &mut [SampleSpec],
        kv_ready: &(dyn Fn(usize) + Sync),
    ) -> Result<Vec<Sampled>> {
        let logits = self.run(batch, Some(kv_ready))?;
        Ok(sample_all(&logits, specs))
    }
}

impl CpuBackend {
    /// The forward pass; `kv_ready(layer)` is called as soon as each layer's K and V of the
    /// whole batch are in the cache.
    fn run(
        &mut self,
        batch: &ForwardBatch,
        kv_ready: Option<&(dyn Fn(usize) + Sync)>,
    ) -> Result<Vec<Vec<f32>>> {
        let cfg = &self.model.cfg;
        let h = cfg.hidden_size;
        let t = batch.num_tokens();
        if t == 0 {
            return Ok(Vec::new());
        }
        let (slots, tokens) = self.token_slots(batch)?;
        let (cos, sin) = self.rope_tables(batch, &slots);

        let mut x = vec![0f32; t * h];
        for (i, &tok) in tokens.iter().enumerate() {
            self.model
                .embed_tokens
                .read(tok as usize * h, &mut x[i * h..(i + 1) * h]);
        }

        for (li, layer) in self.model.layers.iter().enumerate() {
            let xn = ops::rms_norm(&x, &layer.input_layernorm, cfg.rms_norm_eps);
            let qkv = layer.qkv_rotated(cfg, &xn, t, &cos, &sin);
            self.write_kv(li, &slots, &qkv);
            // This layer's K and V of every token in the step are final: a transfer may send
            // them while the remaining layers compute.
            if let Some(notify) = kv_ready {
                notify(li);
            }
            let attn = self.attention(li, batch, &slots, &qkv);
            let o = layer.o_proj.forward(&attn, t);
            for (a, b) in x.iter_mut().zip(&o) {
                *a += b;
            }

            let xn = ops::rms_norm(&x, &layer.post_attention_layernorm, cfg.rms_norm_eps);
            let down = layer.mlp(&xn, t, cfg.intermediate_size);
            for (a, b) in x.iter_mut().zip(&down) {
                *a += b;
            }
        }

        // Logits only for the last token of sequences that sample.
        let mut rows = Vec::new();
        let mut end = 0;
        for s in &batch.seqs {
            end += s.tokens.len();
            if s.want_logits {
                rows.extend_from_slice(&x[(end - 1) * h..end * h]);
            }
        }
        let m = rows.len() / h;
        let xn = ops::rms_norm(&rows, &self.model.norm, cfg.rms_norm_eps);
        let logits = self.model.lm_head.forward(&xn, m);
        Ok(logits
            .chunks_exact(cfg.vocab_size)
            .map(<[f32]>::to_vec)
            .collect())
    }

    /// The step's token layout: where each scheduled token goes, and its id.
    fn token_slots(&self, batch: &ForwardBatch) -> Result<(Vec<TokenSlot>, Vec<u32>)> {
        let cfg = &self.model.cfg;
        let bs = self.kv.spec().block_size;
        let t = batch.num_tokens();
        let mut slots = Vec::with_capacity(t);
        let mut tokens = Vec::with_capacity(t);
        for (si, s) in batch.seqs.iter().enumerate() {
            // Raw slot access below relies on every block being in the pool.
            self.kv.check_table(s.block_table)?;
            for (j, &tok) in s.tokens.iter().enumerate() {
                if tok as usize >= cfg.vocab_size {
                    return Err(EngineError::InvalidRequest(format!(
                        "token id {tok} is outside the vocabulary (size {})",
                        cfg.vocab_size
                    )));
                }
                let pos = s.start_pos + j;
                let block = s
                    .block_table
                    .get(pos / bs)
                    .ok_or(super::error::BatchError::NoBlockForPosition { seq: si, pos })?;
                slots.push(TokenSlot {
                    seq: si,
                    pos,
                    slot: block.0 as usize * bs + pos % bs,
                });
                tokens.push(tok);
            }
        }
        Ok((slots, tokens))
    }

    /// Rotary tables (cos, then sin; `head_dim / 2` values per token) for each token's
    /// position. Dynamic RoPE's frequencies depend on the sequence's length, so each sequence
    /// gets its own.
    fn rope_tables(&self, batch: &ForwardBatch, slots: &[TokenSlot]) -> (Vec<f32>, Vec<f32>) {
        let cfg = &self.model.cfg;
        let half = cfg.head_dim / 2;
        let per_seq: Option<Vec<Vec<f32>>> = cfg.rope_depends_on_length().then(|| {
            batch
                .seqs
                .iter()
                .map(|s| cfg.rope_inv_freq_for_len(s.context_len.max(s.start_pos + s.tokens.len())))
                .collect()
        });
        let mut cos = vec![0f32; slots.len() * half];
        let mut sin = vec![0f32; slots.len() * half];
        for (i, ts) in slots.iter().enumerate() {
            let inv_freq = per_seq
                .as_ref()
                .map_or(&self.model.inv_freq, |v| &v[ts.seq]);
            for (j, f) in inv_freq.iter().enumerate() {
                let a = ts.pos as f32 * f;
                cos[i * half + j] = a.cos();
                sin[i * half + j] = a.sin();
            }
        }
        (cos, sin)
    }

    /// The new K and V of every token of the step into layer `li`'s cache.
    fn write_kv(&self, li: usize, slots: &[TokenSlot], qkv: &[f32]) {
        let cfg = &self.model.cfg;
        let (qd, kvd) = (cfg.q_dim(), cfg.kv_dim());
        let row = qd + 2 * kvd;
        // SAFETY: an f32 pool; this step writes only the slots of the positions it computes,
        // which the engine gives to no one else meanwhile (see `kv_pool`).
        let cache = unsafe { self.kv.f32_layer(li) };
        for (i, ts) in slots.iter().enumerate() {
            let r = &qkv[i * row..(i + 1) * row];
            // SAFETY: as above.
            unsafe { cache.write(ts.slot, &r[qd..qd + kvd], &r[qd + kvd..]) };
        }
    }

    /// Attention of layer `li`: each (token, head) over the sequence's positions up to its
    /// own, or, in a layer with a sliding window, over the last `window` of them. Returns
    /// `[tokens, q_dim]`.
    fn attention(
        &self,
        li: usize,
        batch: &ForwardBatch,
        slots: &[TokenSlot],
        qkv: &[f32],
    ) -> Vec<f32> {
        let cfg = &self.model.cfg;
        let d = cfg.head_dim;
        let (nq, nkv) = (cfg.num_heads, cfg.num_kv_heads);
        let qd = cfg.q_dim();
        let row = qd + 2 * cfg.kv_dim();
        let bs = self.kv.spec().block_size;
        let scale = cfg.attention_scale();
        let group = nq / nkv;
        let window = cfg.layer_window(li);
        // SAFETY: an f32 pool; this step reads only blocks of sequences in its batch, which
        // the engine gives to no one else meanwhile (see `kv_pool`).
        let cache = unsafe { self.kv.f32_layer(li) };
        let mut attn = vec![0f32; slots.len() * qd];
        // Prompt chunks as matrix products (see `attn_blocked`); decode tokens one by one.
        let mut blocked = vec![false; batch.seqs.len()];
        let mut first_row = 0;
        for (si, sq) in batch.seqs.iter().enumerate() {
            if sq.tokens.len() >= attn_blocked::MIN_TOKENS {
                blocked[si] = true;
                let chunk = attn_blocked::Chunk {
                    table: sq.block_table,
                    block_size: bs,
                    start_pos: sq.start_pos,
                    len: sq.tokens.len(),
                    first_row,
                };
                let shape = attn_blocked::Shape {
                    head_dim: d,
                    num_heads: nq,
                    num_kv_heads: nkv,
                    scale,
                    window,
                };
                // SAFETY: the sequence's positions up to its chunk's end are written (by
                // `write_kv` for this step) and nothing writes them meanwhile (see above).
                unsafe { attn_blocked::attend(&chunk, &shape, &cache, qkv, row, &mut attn) };
            }
            first_row += sq.tokens.len();
        }
        attn.par_chunks_mut(d).enumerate().for_each(|(idx, out)| {
            let (i, head) = (idx / nq, idx % nq);
            let ts = &slots[i];
            if blocked[ts.seq] {
                return;
            }
            let table = batch.seqs[ts.seq].block_table;
            let g = head / group;
            let q = &qkv[i * row + head * d..i * row + (head + 1) * d];
            let n = ts.pos + 1;
            let lo = window.map_or(0, |w| n.saturating_sub(w));
            let mut scores = Vec::with_capacity(n - lo);
            let mut max = f32::NEG_INFINITY;
            for p in lo..n {
                let slot = table[p / bs].0 as usize * bs + p % bs;
                // SAFETY: the sequence's own computed positions (see above).
                let k = unsafe { cache.k(slot, g * d, d) };
                let s = ops::dot(q, k) * scale;
                max = max.max(s);
                scores.push(s);
            }
            let sum = vexp::exp_shifted(&mut scores, max);
            let inv = 1.0 / sum;
            for (p, &s) in (lo..n).zip(&scores) {
                let slot = table[p / bs].0 as usize * bs + p % bs;
                // SAFETY: as for K.
                ops::axpy(out, s * inv, unsafe { cache.v(slot, g * d, d) });
            }
        });
        attn
    }
}

impl Layer {
    /// The fused q/k/v projection of `xn` (`[t, hidden]`), with the per-head norms and the
    /// rotary embedding applied to q and k: `[t, q_dim + 2 * kv_dim]`.
    fn qkv_rotated(
        &self,
        cfg: &ModelConfig,
        xn: &[f32],
        t: usize,
        cos: &[f32],
        sin: &[f32],
    ) -> Vec<f32> {
        let d = cfg.head_dim;
        let half = d / 2;
        let (qd, kvd) = (cfg.q_dim(), cfg.kv_dim());
        let mut qkv = self.qkv_proj.forward(xn, t);
        qkv.par_chunks_mut(qd + 2 * kvd)
            .enumerate()
            .for_each(|(i, r)| {
                let (q, rest) = r.split_at_mut(qd);
                let k = &mut rest[..kvd];
                if let (Some(qn), Some(kn)) = (&self.q_norm, &self.k_norm) {
                    ops::rms_norm_inplace(q, qn, cfg.rms_norm_eps);
                    ops::rms_norm_inplace(k, kn, cfg.rms_norm_eps);
                }
                let (c, s) = (
                    &cos[i * half..(i + 1) * half],
                    &sin[i * half..(i + 1) * half],
                );
                for head in q.chunks_exact_mut(d).chain(k.chunks_exact_mut(d)) {
                    ops::rope(head, c, s);
                }
            });
        qkv
    }

    /// `down(silu(gate(xn)) * up(xn))` over `t` rows.
    fn mlp(&self, xn: &[f32], t: usize, inter: usize) -> Vec<f32> {
        let gu = self.gate_up_proj.forward(xn, t);
        let mut act = vec![0f32; t * inter];
        act.par_chunks_mut(inter)
            .zip(gu.par_chunks(2 * inter))
            .for_each(|(a, g)| {
                let (gate, up) = g.split_at(inter);
                vexp::silu_mul(a, gate, up);
            });
        self.down_proj.forward(&act, t)
    }
}
