//! Qwen3.5's two token mixers on the CPU, each over the `t` new tokens of one sequence.

use rayon::prelude::*;

use super::delta::{self, sigmoid, DeltaParams};
use super::ops::{self, Linear, Matrix};
use crate::checkpoint::Projection;
use crate::config::ModelConfig;
use crate::hybrid_checkpoint::{AttentionTensors, DeltaTensors};

pub(super) fn linear(p: Projection) -> Linear {
    Linear::new(Matrix::from_data(p.weight), p.out, p.inp, p.bias)
}

/// A Gated DeltaNet layer.
pub(super) struct DeltaLayer {
    /// `in_proj_qkv`, `in_proj_z`, `in_proj_b` and `in_proj_a` stacked: they read the same
    /// input, so one product serves them. Rows `[conv_dim | value_dim | heads | heads]`.
    in_proj: Linear,
    /// Everything between the two projections.
    params: DeltaParams,
    out_proj: Linear,
}

impl DeltaLayer {
    /// The input and output products.
    pub(super) fn products_mut(&mut self) -> [&mut Linear; 2] {
        [&mut self.in_proj, &mut self.out_proj]
    }

    pub(super) fn from_tensors(t: DeltaTensors) -> DeltaLayer {
        DeltaLayer {
            in_proj: linear(t.in_proj),
            params: t.params,
            out_proj: linear(t.out_proj),
        }
    }

    /// The layer over `t` tokens `xn` (`[t, hidden]`, normed), carrying `window` (the
    /// convolution's) and `state` (`[value heads, dk, dv]`) from the tokens before.
    pub(super) fn forward(
        &self,
        xn: &[f32],
        t: usize,
        window: &mut [f32],
        state: &mut [f32],
        chunk: usize,
    ) -> Vec<f32> {
        let proj = self.project(xn, t);
        let core = self.mix(&proj, t, window, state, chunk);
        self.out(&core, t)
    }

    /// The stacked input projections of `t` rows (any number of sequences': each row is
    /// its token's own), `[t, conv_dim + value_dim + 2 * value heads]`.
    pub(super) fn project(&self, xn: &[f32], t: usize) -> Vec<f32> {
        self.in_proj.forward(xn, t)
    }

    /// `out_proj` of the mixed rows (`[t, value_dim]`).
    pub(super) fn out(&self, core: &[f32], t: usize) -> Vec<f32> {
        self.out_proj.forward(core, t)
    }

    /// What one sequence's `t` consecutive tokens mix to (see [`delta::mix`]).
    pub(super) fn mix(
        &self,
        proj: &[f32],
        t: usize,
        window: &mut [f32],
        state: &mut [f32],
        chunk: usize,
    ) -> Vec<f32> {
        delta::mix(&self.params, proj, t, window, state, chunk)
    }
}

/// A gated full-attention layer: `q_proj` gives, per head, the query and then a gate that
/// scales the head's output by its sigmoid; q and k have per-head (1 + w) RMSNorms and RoPE
/// on their first `rotary_dim` dimensions only.
pub(super) struct GatedAttention {
    /// `q_proj` (query and gate, `2 * q_dim`), `k_proj`, `v_proj` stacked.
    qkv: Linear,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
    o_proj: Linear,
}

impl GatedAttention {
    /// The input (q, gate, k, v) and output products.
    pub(super) fn products_mut(&mut self) -> [&mut Linear; 2] {
        [&mut self.qkv, &mut self.o_proj]
    }

    pub(super) fn from_tensors(t: AttentionTensors) -> GatedAttention {
        GatedAttention {
            qkv: linear(t.qkv),
            q_norm: t.q_norm,
            k_norm: t.k_norm,
            o_proj: linear(t.o_proj),
        }
    }

    /// The layer over `t` tokens at positions `start..start + t`, appending their K and V
    /// (`[tokens, kv_dim]`) to `k_cache` and `v_cache`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn forward(
        &self,
        cfg: &ModelConfig,
        xn: &[f32],
        t: usize,
        start: usize,
        k_cache: &mut Vec<f32>,
        v_cache: &mut Vec<f32>,
        inv_freq: &[f32],
    ) -> Vec<f32> {
        let positions: Vec<usize> = (start..start + t).collect();
        let rows = self.project(cfg, xn, &positions, inv_freq);
        k_cache.extend_from_slice(&rows.k);
        v_cache.extend_from_slice(&rows.v);
        let kvd = cfg.kv_dim();
        let (kc, vc) = (&*k_cache, &*v_cache);
        let attn = attend(
            cfg,
            &rows,
            |i| start + i + 1,
            |_, p| (&kc[p * kvd..(p + 1) * kvd], &vc[p * kvd..(p + 1) * kvd]),
        );
        self.out(&attn, t)
    }

    /// The projections of `t` rows (any number of sequences'; row `i` is at position
    /// `positions[i]` of its own): queries and keys normed and rotated, and the gates.
    pub(super) fn project(
        &self,
        cfg: &ModelConfig,
        xn: &[f32],
        positions: &[usize],
        inv_freq: &[f32],
    ) -> AttnRows {
        let (d, nq) = (cfg.head_dim, cfg.num_heads);
        let (qd, kvd, rot) = (cfg.q_dim(), cfg.kv_dim(), cfg.rotary_dim());
        let t = positions.len();
        let row = 2 * qd + 2 * kvd;
        let proj = self.qkv.forward(xn, t);
        let mut out = AttnRows {
            q: vec![0f32; t * qd],
            gate: vec![0f32; t * qd],
            k: Vec::with_capacity(t * kvd),
            v: Vec::with_capacity(t * kvd),
        };
        for (i, &at) in positions.iter().enumerate() {
            let r = &proj[i * row..(i + 1) * row];
            let pos = at as f32;
            let (cos, sin): (Vec<f32>, Vec<f32>) = inv_freq
                .iter()
                .map(|f| ((pos * f).cos(), (pos * f).sin()))
                .unzip();
            for hq in 0..nq {
                let qh = &mut out.q[i * qd + hq * d..i * qd + (hq + 1) * d];
                qh.copy_from_slice(&r[hq * 2 * d..hq * 2 * d + d]);
                out.gate[i * qd + hq * d..i * qd + (hq + 1) * d]
                    .copy_from_slice(&r[hq * 2 * d + d..(hq + 1) * 2 * d]);
                ops::rms_norm_inplace(qh, &self.q_norm, cfg.rms_norm_eps);
                ops::rope(&mut qh[..rot], &cos, &sin);
            }
            let mut k = r[2 * qd..2 * qd + kvd].to_vec();
            ops::rms_norm_inplace(&mut k, &self.k_norm, cfg.rms_norm_eps);
            for head in k.chunks_exact_mut(d) {
                ops::rope(&mut head[..rot], &cos, &sin);
            }
            out.k.extend_from_slice(&k);
            out.v.extend_from_slice(&r[2 * qd + kvd..]);
        }
        out
    }

    /// `o_proj` of the attended rows (`[t, q_dim]`).
    pub(super) fn out(&self, attn: &[f32], t: usize) -> Vec<f32> {
        self.o_proj.forward(attn, t)
    }
}

/// A full-attention layer's rows: per token the query (normed, rotated) and its output gate,
/// `[t, q_dim]` each, and its key (normed, rotated) and value, `[t, kv_dim]` each.
pub(super) struct AttnRows {
    pub(super) q: Vec<f32>,
    pub(super) gate: Vec<f32>,
    pub(super) k: Vec<f32>,
    pub(super) v: Vec<f32>,
}

/// Gated softmax attention of every row of `rows` over its own sequence's first
/// `context(i)` positions, whose K and V rows (`kv_dim` each) `kv(i, p)` gives: wherever
/// they are kept (contiguous for one sequence, or paged for a batch), the math is this one.
/// Returns `[t, q_dim]`.
pub(super) fn attend<'a>(
    cfg: &ModelConfig,
    rows: &AttnRows,
    context: impl Fn(usize) -> usize + Sync,
    kv: impl Fn(usize, usize) -> (&'a [f32], &'a [f32]) + Sync,
) -> Vec<f32> {
    let (d, nq, nkv, qd) = (cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.q_dim());
    let scale = 1.0 / (d as f32).sqrt();
    let group = nq / nkv;
    let mut attn = vec![0f32; rows.q.len()];
    attn.par_chunks_mut(d).enumerate().for_each(|(idx, out)| {
        let (i, hq) = (idx / nq, idx % nq);
        let g = hq / group;
        let qh = &rows.q[i * qd + hq * d..i * qd + (hq + 1) * d];
        let n = context(i);
        let scores: Vec<f32> = (0..n)
            .map(|p| ops::dot(qh, &kv(i, p).0[g * d..(g + 1) * d]) * scale)
            .collect();
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let e: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
        let inv = 1.0 / e.iter().sum::<f32>();
        for (p, &w) in e.iter().enumerate() {
            ops::axpy(out, w * inv, &kv(i, p).1[g * d..(g + 1) * d]);
        }
        let gh = &rows.gate[i * qd + hq * d..i * qd + (hq + 1) * d];
        for (o, &gv) in out.iter_mut().zip(gh) {
            *o *= sigmoid(gv);
        }
    });
    attn
}
