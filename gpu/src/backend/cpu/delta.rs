//! The gated delta rule (Gated DeltaNet's token mixer) and the short causal convolution in
//! front of it, for one value head of one sequence.
//!
//! The state `S` is `dk x dv` (row `i` for key dimension `i`), f32. Each token with query
//! `q`, key `k` (both L2-normalised, `q` also scaled by `1/sqrt(dk)` by the caller), value
//! `v`, log-decay `g <= 0` and write strength `beta` in (0, 1) does:
//!
//! ```text
//! S <- e^g S;   delta = beta (v - S^T k);   S <- S + k delta^T;   o = S^T q
//! ```
//!
//! Three ways to run it, which must agree (the tests hold them to it):
//! - [`reference`]: the rule as written, token by token, accumulating in f64. It exists to
//!   check the other two.
//! - [`step`]: one token, as decode runs it, reading and writing the state once.
//! - [`chunked`]: prefill. Within a chunk of `L` tokens the updates are one lower-triangular
//!   system: with `G_t` the cumulative log-decay from the chunk's start (inclusive) and `S0`
//!   the state before it,
//!
//!   ```text
//!   delta_t = beta_t (v_t - e^{G_t} S0^T k_t) - sum_{s<t} beta_t e^{G_t - G_s} (k_t . k_s) delta_s
//!   o_t     = e^{G_t} S0^T q_t + sum_{s<=t} e^{G_t - G_s} (q_t . k_s) delta_s
//!   S_L     = e^{G_L} S0 + sum_s e^{G_L - G_s} k_s delta_s^T
//!   ```
//!
//!   which is the chunk-wise (WY / UT-transform) form of the Gated DeltaNet paper, solved
//!   here by forward substitution on the right-hand side instead of inverting the matrix:
//!   the same products, no inverse kept. The state is read and written once per chunk
//!   instead of once per token, and every exponent is of a difference `G_t - G_s <= 0`, so
//!   nothing overflows however long the chunk.

use rayon::prelude::*;

use crate::config::HybridConfig;

/// transformers' epsilon inside the L2 norm of q and k (the same as flash-linear-attention's),
/// fixed, not `rms_norm_eps`.
pub const L2_EPS: f32 = 1e-6;

/// One Gated DeltaNet layer's weights between its input and output projections.
#[derive(Clone, Debug)]
pub struct DeltaParams {
    /// The depthwise convolution's taps, `[conv_dim, kernel]`.
    pub conv: Vec<f32>,
    /// `-exp(A_log)` per value head: the decay rate `g` scales.
    pub neg_a: Vec<f32>,
    pub dt_bias: Vec<f32>,
    /// The gated RMSNorm's weight (plain, not `1 + w`), `[value_head_dim]`.
    pub norm: Vec<f32>,
    pub hy: HybridConfig,
    /// The gated RMSNorm's epsilon (`rms_norm_eps`).
    pub eps: f32,
}

impl DeltaParams {
    /// A layer of `hy`'s shape with pseudo-random weights drawn from `seed`: convolution taps
    /// in ±0.6, decays from slow (`A_log` near -3) to fast (near 2), `dt_bias` in ±1, norm
    /// weights in [0.5, 1.5). What the GPU parity test and the kernel benchmark run on.
    pub fn random(hy: HybridConfig, eps: f32, seed: u64) -> DeltaParams {
        let mut r = crate::sampler::Rng::seeded(seed);
        let mut draw = |n: usize, lo: f32, hi: f32| -> Vec<f32> {
            (0..n)
                .map(|_| lo + (hi - lo) * (r.next_u64() >> 40) as f32 / (1u64 << 24) as f32)
                .collect()
        };
        let nv = hy.linear_num_value_heads;
        DeltaParams {
            conv: draw(hy.conv_dim() * hy.linear_conv_kernel_dim, -0.6, 0.6),
            neg_a: draw(nv, -3.0, 2.0).into_iter().map(|a| -a.exp()).collect(),
            dt_bias: draw(nv, -1.0, 1.0),
            norm: draw(hy.linear_value_head_dim, 0.5, 1.5),
            hy,
            eps,
        }
    }
}

pub(super) fn softplus(x: f32) -> f32 {
    // torch's softplus returns x itself above its threshold of 20.
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

pub(super) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Scales `x` to unit L2 norm (with `L2_EPS`), times `scale`.
fn l2_normalize(x: &mut [f32], scale: f32) {
    let r = scale / (x.iter().map(|v| v * v).sum::<f32>() + L2_EPS).sqrt();
    for v in x {
        *v *= r;
    }
}

/// What one sequence's `t` consecutive tokens mix to in a Gated DeltaNet layer, from their
/// rows of the stacked input projections (`proj`, `[t, conv_dim + value_dim + 2 * value
/// heads]`: q/k/v, z, b, a): the causal convolution continuing `window`, the delta rule
/// continuing `state` (`[value heads, dk, dv]`; one recurrent step for one token, chunks of
/// `chunk` for more), and the gated norm `RMSNorm(o) * w * silu(z)` per head. Returns
/// `[t, value_dim]`, the output projection's input.
pub fn mix(
    p: &DeltaParams,
    proj: &[f32],
    t: usize,
    window: &mut [f32],
    state: &mut [f32],
    chunk: usize,
) -> Vec<f32> {
    let hy = &p.hy;
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
    let mixed = causal_conv(&qkv, cd, &p.conv, hy.linear_conv_kernel_dim, window);
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
                let r = &proj[i * row + cd + vd..(i + 1) * row];
                beta.push(sigmoid(r[hv]));
                g.push(p.neg_a[hv] * softplus(r[nv + hv] + p.dt_bias[hv]));
            }
            let mut o = vec![0f32; t * dv];
            if t == 1 {
                step(s, dk, dv, &q, &k, &v, g[0], beta[0], &mut o);
            } else {
                chunked(s, dk, dv, &q, &k, &v, &g, &beta, chunk, &mut o);
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
            super::ops::rms_norm_inplace(out, &p.norm, p.eps);
            let z = &proj[i * row + cd + hv * dv..i * row + cd + (hv + 1) * dv];
            for (x, &zz) in out.iter_mut().zip(z) {
                *x *= super::ops::silu(zz);
            }
        }
    }
    core
}

/// The state update of one token (see the module's comment). `q` is already normalised and
/// scaled. Writes the token's output to `out` (`dv`).
#[allow(clippy::too_many_arguments)]
pub fn step(
    state: &mut [f32],
    dk: usize,
    dv: usize,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: f32,
    beta: f32,
    out: &mut [f32],
) {
    let decay = g.exp();
    // delta = beta (v - (e^g S)^T k)
    let mut delta = vec![0f32; dv];
    for (i, &ki) in k.iter().enumerate().take(dk) {
        let row = &state[i * dv..(i + 1) * dv];
        for (d, &s) in delta.iter_mut().zip(row) {
            *d += s * ki;
        }
    }
    for (d, &vj) in delta.iter_mut().zip(v) {
        *d = beta * (vj - decay * *d);
    }
    out[..dv].fill(0.0);
    for i in 0..dk {
        let row = &mut state[i * dv..(i + 1) * dv];
        let (ki, qi) = (k[i], q[i]);
        for ((s, &d), o) in row.iter_mut().zip(&delta).zip(out.iter_mut()) {
            *s = decay * *s + ki * d;
            *o += *s * qi;
        }
    }
}

/// The rule token by token exactly as written, in f64; `state` is updated. `q`, `k` are
/// `[t, dk]`, `v` and `out` `[t, dv]`.
#[allow(clippy::too_many_arguments)]
pub fn reference(
    state: &mut [f32],
    dk: usize,
    dv: usize,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    out: &mut [f32],
) {
    let mut s: Vec<f64> = state.iter().map(|&x| x as f64).collect();
    for t in 0..g.len() {
        let (qt, kt, vt) = (
            &q[t * dk..(t + 1) * dk],
            &k[t * dk..(t + 1) * dk],
            &v[t * dv..(t + 1) * dv],
        );
        let decay = (g[t] as f64).exp();
        for x in s.iter_mut() {
            *x *= decay;
        }
        for j in 0..dv {
            let mem: f64 = (0..dk).map(|i| s[i * dv + j] * kt[i] as f64).sum();
            let delta = beta[t] as f64 * (vt[j] as f64 - mem);
            for i in 0..dk {
                s[i * dv + j] += kt[i] as f64 * delta;
            }
        }
        for j in 0..dv {
            let o: f64 = (0..dk).map(|i| s[i * dv + j] * qt[i] as f64).sum();
            out[t * dv + j] = o as f32;
        }
    }
    for (a, b) in state.iter_mut().zip(&s) {
        *a = *b as f32;
    }
}

/// Prefill of `g.len()` tokens in chunks of `chunk` (see the module's comment); `state` is
/// updated. Shapes as for [`reference`].
#[allow(clippy::too_many_arguments)]
pub fn chunked(
    state: &mut [f32],
    dk: usize,
    dv: usize,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    chunk: usize,
    out: &mut [f32],
) {
    let n = g.len();
    let chunk = chunk.max(1);
    let mut start = 0;
    while start < n {
        let end = (start + chunk).min(n);
        one_chunk(
            state,
            dk,
            dv,
            &q[start * dk..end * dk],
            &k[start * dk..end * dk],
            &v[start * dv..end * dv],
            &g[start..end],
            &beta[start..end],
            &mut out[start * dv..end * dv],
        );
        start = end;
    }
}

#[allow(clippy::too_many_arguments)]
fn one_chunk(
    state: &mut [f32],
    dk: usize,
    dv: usize,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    out: &mut [f32],
) {
    let l = g.len();
    let mut cum = vec![0f32; l];
    let mut acc = 0f32;
    for (c, &x) in cum.iter_mut().zip(g) {
        acc += x;
        *c = acc;
    }
    let row = |t: usize, d: usize| t * d..(t + 1) * d;
    // What the state before the chunk gives each token: S0^T k_t and S0^T q_t.
    let mut s0k = vec![0f32; l * dv];
    let mut s0q = vec![0f32; l * dv];
    for t in 0..l {
        let (kt, qt) = (&k[row(t, dk)], &q[row(t, dk)]);
        let (ak, aq) = (
            &mut s0k[t * dv..(t + 1) * dv],
            &mut s0q[t * dv..(t + 1) * dv],
        );
        for i in 0..dk {
            let srow = &state[i * dv..(i + 1) * dv];
            let (ki, qi) = (kt[i], qt[i]);
            for ((a, b), &s) in ak.iter_mut().zip(aq.iter_mut()).zip(srow) {
                *a += s * ki;
                *b += s * qi;
            }
        }
    }
    // delta by forward substitution.
    let mut delta = vec![0f32; l * dv];
    for t in 0..l {
        let et = cum[t].exp();
        let kt = &k[row(t, dk)];
        let mut d: Vec<f32> = (0..dv)
            .map(|j| beta[t] * (v[t * dv + j] - et * s0k[t * dv + j]))
            .collect();
        for s in 0..t {
            let a = beta[t] * (cum[t] - cum[s]).exp() * super::ops::dot(kt, &k[row(s, dk)]);
            super::ops::axpy(&mut d, -a, &delta[s * dv..(s + 1) * dv]);
        }
        delta[t * dv..(t + 1) * dv].copy_from_slice(&d);
    }
    // Outputs.
    for t in 0..l {
        let et = cum[t].exp();
        let qt = &q[row(t, dk)];
        let o = &mut out[t * dv..(t + 1) * dv];
        for (x, &a) in o.iter_mut().zip(&s0q[t * dv..(t + 1) * dv]) {
            *x = et * a;
        }
        for s in 0..=t {
            let a = (cum[t] - cum[s]).exp() * super::ops::dot(qt, &k[row(s, dk)]);
            super::ops::axpy(o, a, &delta[s * dv..(s + 1) * dv]);
        }
    }
    // The state after the chunk.
    let last = cum[l - 1];
    let el = last.exp();
    for x in state.iter_mut() {
        *x *= el;
    }
    for s in 0..l {
        let w = (last - cum[s]).exp();
        let ks = &k[row(s, dk)];
        let ds = &delta[s * dv..(s + 1) * dv];
        for (i, &ki) in ks.iter().enumerate() {
            super::ops::axpy(&mut state[i * dv..(i + 1) * dv], w * ki, ds);
        }
    }
}

/// The depthwise causal convolution (kernel `kw`) over `x` (`[t, c]`), then SiLU, carrying
/// the last `kw - 1` inputs across calls in `window` (`[kw - 1, c]`, oldest first; zeros
/// before a sequence's first token). `weight` is `[c, kw]`, as transformers' `conv1d`
/// holds it; its last tap meets the current input.
pub fn causal_conv(x: &[f32], c: usize, weight: &[f32], kw: usize, window: &mut [f32]) -> Vec<f32> {
    let t = x.len() / c;
    let hist = kw - 1;
    // The inputs the outputs read: the carried window, then this call's.
    let mut full = Vec::with_capacity((hist + t) * c);
    full.extend_from_slice(&window[..hist * c]);
    full.extend_from_slice(x);
    let mut y = vec![0f32; t * c];
    for (ti, out) in y.chunks_exact_mut(c).enumerate() {
        for (ch, o) in out.iter_mut().enumerate() {
            let w = &weight[ch * kw..(ch + 1) * kw];
            let mut acc = 0f32;
            for (j, &wj) in w.iter().enumerate() {
                acc += wj * full[(ti + j) * c + ch];
            }
            *o = super::ops::silu(acc);
        }
    }
    window[..hist * c].copy_from_slice(&full[t * c..(t + hist) * c]);
    y
}

#[cfg(test)]
#[path = "delta_tests.rs"]
mod tests;
