//! Qwen3.5's two token mixers on the CPU, each over the `t` new tokens of one sequence.

use rayon::prelude::*;

use super::delta;
use super::ops::{self, Linear, Matrix};
use crate::checkpoint::Projection;
use crate::config::{HybridConfig, ModelConfig};
use crate::error::Result;
use crate::safetensors::WeightStore;

/// transformers' epsilon inside the L2 norm of q and k (the same as flash-linear-attention's),
/// fixed, not `rms_norm_eps`.
const L2_EPS: f32 = 1e-6;

/// Reads `{prefix}{name}` tensors of one checkpoint, checked against their shapes.
pub(super) struct Reader<'a> {
    pub(super) w: &'a WeightStore,
    pub(super) prefix: String,
}

impl Reader<'_> {
    pub(super) fn f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        self.w.f32(&format!("{}{name}", self.prefix), shape)
    }

    pub(super) fn projection(
        &self,
        name: &str,
        out: usize,
        inp: usize,
        bias: bool,
    ) -> Result<Projection> {
        let full = format!("{}{name}", self.prefix);
        Ok(Projection {
            weight: self.w.load(&format!("{full}.weight"), &[out, inp])?,
            out,
            inp,
            bias: if bias {
                Some(self.w.f32(&format!("{full}.bias"), &[out])?)
            } else {
                None
            },
        })
    }
}

pub(super) fn linear(p: Projection) -> Linear {
    Linear::new(Matrix::from_data(p.weight), p.out, p.inp, p.bias)
}

/// A Gated DeltaNet layer.
pub(super) struct DeltaLayer {
    /// `in_proj_qkv`, `in_proj_z`, `in_proj_b` and `in_proj_a` stacked: they read the same
    /// input, so one product serves them. Rows `[conv_dim | value_dim | heads | heads]`.
    in_proj: Linear,
    /// The depthwise convolution's taps, `[conv_dim, kernel]`.
    conv: Vec<f32>,
    /// `-exp(A_log)` per value head: the decay rate `g` scales.
    neg_a: Vec<f32>,
    dt_bias: Vec<f32>,
    /// The gated RMSNorm's weight (plain, not `1 + w`), `[value_head_dim]`.
    norm: Vec<f32>,
    out_proj: Linear,
    hy: HybridConfig,
    eps: f32,
}

fn softplus(x: f32) -> f32 {
    // torch's softplus returns x itself above its threshold of 20.
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Scales `x` to unit L2 norm (with `L2_EPS`), times `scale`.
fn l2_normalize(x: &mut [f32], scale: f32) {
    let r = scale / (x.iter().map(|v| v * v).sum::<f32>() + L2_EPS).sqrt();
    for v in x {
        *v *= r;
    }
}

impl DeltaLayer {
    pub(super) fn load(
        cfg: &ModelConfig,
        hy: &HybridConfig,
        r: &Reader,
        p: &str,
    ) -> Result<DeltaLayer> {
        let h = cfg.hidden_size;
        let (nv, kw) = (hy.linear_num_value_heads, hy.linear_conv_kernel_dim);
        let a = format!("{p}.linear_attn");
        let in_proj = Projection::stack(vec![
            r.projection(&format!("{a}.in_proj_qkv"), hy.conv_dim(), h, false)?,
            r.projection(&format!("{a}.in_proj_z"), hy.value_dim(), h, false)?,
            r.projection(&format!("{a}.in_proj_b"), nv, h, false)?,
            r.projection(&format!("{a}.in_proj_a"), nv, h, false)?,
        ]);
        Ok(DeltaLayer {
            in_proj: linear(in_proj),
            conv: r.f32(&format!("{a}.conv1d.weight"), &[hy.conv_dim(), 1, kw])?,
            neg_a: r
                .f32(&format!("{a}.A_log"), &[nv])?
                .into_iter()
                .map(|x| -x.exp())
                .collect(),
            dt_bias: r.f32(&format!("{a}.dt_bias"), &[nv])?,
            norm: r.f32(&format!("{a}.norm.weight"), &[hy.linear_value_head_dim])?,
            out_proj: linear(r.projection(&format!("{a}.out_proj"), h, hy.value_dim(), false)?),
            hy: hy.clone(),
            eps: cfg.rms_norm_eps,
        })
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

    /// What one sequence's `t` consecutive tokens mix to, from their projected rows (see
    /// [`Self::project`]): the causal convolution continuing `window`, the delta rule
    /// continuing `state`, and the gated norm. Returns `[t, value_dim]`, for `out`.
    pub(super) fn mix(
        &self,
        proj: &[f32],
        t: usize,
        window: &mut [f32],
        state: &mut [f32],
        chunk: usize,
    ) -> Vec<f32> {
        let hy = &self.hy;
        let (cd, vd, nv) = (hy.conv_dim(), hy.value_dim(), hy.linear_num_value_heads);
        let (dk, dv, kd) = (
            hy.linear_key_head_dim,
            hy.linear_value_head_dim,
            hy.key_dim(),
        );
        let row = cd + vd + 2 * nv;
        let mut qkv = Vec::with_capacity(t * cd);
        for r in proj.chunks_exact(row) {
            qkv.extend_from_slice(&r[..cd]);
        }
        let mixed = delta::causal_conv(&qkv, cd, &self.conv, hy.linear_conv_kernel_dim, window);
        let per_key = nv / hy.linear_num_key_heads;
        let scale = 1.0 / (dk as f32).sqrt();
        // Each value head owns its part of the state, so heads run in parallel.
        let heads: Vec<Vec<f32>> = state
            .par_chunks_mut(dk * dv)
            .enumerate()
            .map(|(hv, s)| {
                let kh = hv / per_key;
                let (mut q, mut k, mut v) = (
                    Vec::with_capacity(t * dk),
                    Vec::with_capacity(t * dk),
                    Vec::with_capacity(t * dv),
                );
                let (mut g, mut beta) = (Vec::with_capacity(t), Vec::with_capacity(t));
                for i in 0..t {
                    let m = &mixed[i * cd..(i + 1) * cd];
                    let mut qi = m[kh * dk..(kh + 1) * dk].to_vec();
                    let mut ki = m[kd + kh * dk..kd + (kh + 1) * dk].to_vec();
                    l2_normalize(&mut qi, scale);
                    l2_normalize(&mut ki, 1.0);
                    q.extend(qi);
                    k.extend(ki);
                    v.extend_from_slice(&m[2 * kd + hv * dv..2 * kd + (hv + 1) * dv]);
                    let p = &proj[i * row + cd + vd..(i + 1) * row];
                    beta.push(sigmoid(p[hv]));
                    g.push(self.neg_a[hv] * softplus(p[nv + hv] + self.dt_bias[hv]));
                }
                let mut o = vec![0f32; t * dv];
                if t == 1 {
                    delta::step(s, dk, dv, &q, &k, &v, g[0], beta[0], &mut o);
                } else {
                    delta::chunked(s, dk, dv, &q, &k, &v, &g, &beta, chunk, &mut o);
                }
                o
            })
            .collect();
        // The gated norm per head: RMSNorm(o) * w * silu(z).
        let mut core = vec![0f32; t * vd];
        for i in 0..t {
            for (hv, o) in heads.iter().enumerate() {
                let out = &mut core[i * vd + hv * dv..i * vd + (hv + 1) * dv];
                out.copy_from_slice(&o[i * dv..(i + 1) * dv]);
                ops::rms_norm_inplace(out, &self.norm, self.eps);
                let z = &proj[i * row + cd + hv * dv..i * row + cd + (hv + 1) * dv];
                for (x, &zz) in out.iter_mut().zip(z) {
                    *x *= ops::silu(zz);
                }
            }
        }
        core
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
    pub(super) fn load(cfg: &ModelConfig, r: &Reader, p: &str) -> Result<GatedAttention> {
        let (h, q, kv, d) = (cfg.hidden_size, cfg.q_dim(), cfg.kv_dim(), cfg.head_dim);
        let a = format!("{p}.self_attn");
        let b = cfg.qkv_bias;
        let one_plus = |w: Vec<f32>| w.into_iter().map(|x| 1.0 + x).collect();
        Ok(GatedAttention {
            qkv: linear(Projection::stack(vec![
                r.projection(&format!("{a}.q_proj"), 2 * q, h, b)?,
                r.projection(&format!("{a}.k_proj"), kv, h, b)?,
                r.projection(&format!("{a}.v_proj"), kv, h, b)?,
            ])),
            q_norm: one_plus(r.f32(&format!("{a}.q_norm.weight"), &[d])?),
            k_norm: one_plus(r.f32(&format!("{a}.k_norm.weight"), &[d])?),
            o_proj: linear(r.projection(&format!("{a}.o_proj"), h, q, cfg.o_bias)?),
        })
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
