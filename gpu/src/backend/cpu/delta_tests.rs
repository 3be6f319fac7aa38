//! The three runs of the gated delta rule against each other, and the convolution's carried
//! window against one pass over the whole input, on random inputs of the shapes the model
//! gives them (unit-norm q and k, q scaled, g <= 0, beta in (0, 1)).

use super::*;
use crate::sampler::Rng;

struct Inputs {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
    state: Vec<f32>,
}

fn unit_rows(rng: &mut Rng, t: usize, d: usize, scale: f32) -> Vec<f32> {
    let mut x: Vec<f32> = (0..t * d).map(|_| rng.normal() as f32).collect();
    for r in x.chunks_exact_mut(d) {
        let n = r.iter().map(|a| a * a).sum::<f32>().sqrt();
        for a in r {
            *a *= scale / n;
        }
    }
    x
}

fn inputs(seed: u64, t: usize, dk: usize, dv: usize) -> Inputs {
    let mut rng = Rng::seeded(seed);
    let q = unit_rows(&mut rng, t, dk, 1.0 / (dk as f32).sqrt());
    let k = unit_rows(&mut rng, t, dk, 1.0);
    let v = (0..t * dv).map(|_| rng.normal() as f32).collect();
    // Decays from near 1 to strong, as softplus and A_log give them.
    let g = (0..t).map(|_| -(rng.next_f64() as f32) * 2.0).collect();
    let beta = (0..t).map(|_| 0.05 + 0.9 * rng.next_f64() as f32).collect();
    let state = (0..dk * dv).map(|_| 0.3 * rng.normal() as f32).collect();
    Inputs {
        q,
        k,
        v,
        g,
        beta,
        state,
    }
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

const TOL: f32 = 2e-5;

/// The reference's outputs and final state for `x` (of `dk`, `dv` heads).
fn run_reference(x: &Inputs, dk: usize, dv: usize) -> (Vec<f32>, Vec<f32>) {
    let mut s = x.state.clone();
    let mut o = vec![0f32; x.g.len() * dv];
    reference(&mut s, dk, dv, &x.q, &x.k, &x.v, &x.g, &x.beta, &mut o);
    (o, s)
}

/// Token by token (f64), step by step and chunked (several chunk sizes, none of which
/// divides the length) give the same outputs and the same final state.
#[test]
fn chunked_equals_recurrent_equals_reference() {
    for (seed, t, dk, dv) in [
        (1, 45, 16, 8),
        (2, 130, 32, 32),
        (3, 7, 8, 16),
        (4, 1, 8, 8),
    ] {
        let x = inputs(seed, t, dk, dv);
        let (o_ref, s_ref) = run_reference(&x, dk, dv);

        let mut s_step = x.state.clone();
        let mut o_step = vec![0f32; t * dv];
        for i in 0..t {
            step(
                &mut s_step,
                dk,
                dv,
                &x.q[i * dk..(i + 1) * dk],
                &x.k[i * dk..(i + 1) * dk],
                &x.v[i * dv..(i + 1) * dv],
                x.g[i],
                x.beta[i],
                &mut o_step[i * dv..(i + 1) * dv],
            );
        }
        assert!(max_diff(&o_step, &o_ref) < TOL, "step outputs, t={t}");
        assert!(max_diff(&s_step, &s_ref) < TOL, "step state, t={t}");

        for chunk in [64, 16, 5, 1] {
            let mut s = x.state.clone();
            let mut o = vec![0f32; t * dv];
            chunked(
                &mut s, dk, dv, &x.q, &x.k, &x.v, &x.g, &x.beta, chunk, &mut o,
            );
            let (dout, dstate) = (max_diff(&o, &o_ref), max_diff(&s, &s_ref));
            assert!(
                dout < TOL && dstate < TOL,
                "chunk {chunk}, t={t}: outputs differ by {dout}, states by {dstate}"
            );
        }
    }
}

/// A prompt prefilled in chunks (its length not a multiple of the chunk), then decoded a
/// token at a time from the state it left, equals the whole run token by token.
#[test]
fn prefill_then_decode_continues_the_same_sequence() {
    let (t, prompt, dk, dv) = (100, 71, 16, 16);
    let x = inputs(9, t, dk, dv);
    let mut s_ref = x.state.clone();
    let mut o_ref = vec![0f32; t * dv];
    reference(
        &mut s_ref, dk, dv, &x.q, &x.k, &x.v, &x.g, &x.beta, &mut o_ref,
    );

    let mut s = x.state.clone();
    let mut o = vec![0f32; t * dv];
    // The prompt in two calls, the second starting mid-chunk, as chunked prefill of a
    // long prompt by the engine would.
    for (a, b) in [(0, 40), (40, prompt)] {
        chunked(
            &mut s,
            dk,
            dv,
            &x.q[a * dk..b * dk],
            &x.k[a * dk..b * dk],
            &x.v[a * dv..b * dv],
            &x.g[a..b],
            &x.beta[a..b],
            16,
            &mut o[a * dv..b * dv],
        );
    }
    for i in prompt..t {
        step(
            &mut s,
            dk,
            dv,
            &x.q[i * dk..(i + 1) * dk],
            &x.k[i * dk..(i + 1) * dk],
            &x.v[i * dv..(i + 1) * dv],
            x.g[i],
            x.beta[i],
            &mut o[i * dv..(i + 1) * dv],
        );
    }
    assert!(max_diff(&o, &o_ref) < TOL);
    assert!(max_diff(&s, &s_ref) < TOL);
}

/// Strong decays over a long chunk: every exponent is of a non-positive number, so
/// nothing overflows and the result still matches.
#[test]
fn long_chunks_with_strong_decay_stay_finite() {
    let (t, dk, dv) = (256, 8, 8);
    let mut x = inputs(5, t, dk, dv);
    for g in x.g.iter_mut() {
        *g *= 10.0;
    }
    let mut s_ref = x.state.clone();
    let mut o_ref = vec![0f32; t * dv];
    reference(
        &mut s_ref, dk, dv, &x.q, &x.k, &x.v, &x.g, &x.beta, &mut o_ref,
    );
    let mut s = x.state.clone();
    let mut o = vec![0f32; t * dv];
    chunked(&mut s, dk, dv, &x.q, &x.k, &x.v, &x.g, &x.beta, 256, &mut o);
    assert!(o.iter().chain(&s).all(|v| v.is_finite()));
    assert!(max_diff(&o, &o_ref) < TOL && max_diff(&s, &s_ref) < TOL);
}

/// The convolution over a whole sequence at once, from a zero window, written out from its
/// definition.
fn conv_whole(x: &[f32], c: usize, w: &[f32], kw: usize) -> Vec<f32> {
    let t = x.len() / c;
    let mut y = vec![0f32; t * c];
    for ti in 0..t {
        for ch in 0..c {
            let mut acc = 0f32;
            for j in 0..kw {
                // Tap j meets the input kw - 1 - j steps back.
                let back = kw - 1 - j;
                if ti >= back {
                    acc += w[ch * kw + j] * x[(ti - back) * c + ch];
                }
            }
            y[ti * c + ch] = acc / (1.0 + (-acc).exp());
        }
    }
    y
}

/// The convolution in pieces (a prefill in two chunks, then single tokens) carrying its
/// window equals one pass over the whole input.
#[test]
fn conv_with_carried_window_equals_one_pass() {
    let mut rng = Rng::seeded(3);
    let (c, kw, t) = (12, 4, 30);
    let x: Vec<f32> = (0..t * c).map(|_| rng.normal() as f32).collect();
    let w: Vec<f32> = (0..c * kw).map(|_| rng.normal() as f32).collect();
    let want = conv_whole(&x, c, &w, kw);
    let mut window = vec![0f32; (kw - 1) * c];
    let mut got = Vec::new();
    // Pieces shorter than the window too (2 tokens), so it carries inputs from two calls.
    for (a, b) in [(0, 2), (2, 17), (17, 19)] {
        got.extend(causal_conv(&x[a * c..b * c], c, &w, kw, &mut window));
    }
    for i in 19..t {
        got.extend(causal_conv(&x[i * c..(i + 1) * c], c, &w, kw, &mut window));
    }
    assert!(max_diff(&got, &want) < 1e-5);
    // The window holds the last kw - 1 inputs.
    assert_eq!(window, x[(t - kw + 1) * c..].to_vec());
}

/// What `delta_chunk_prep` and `delta_chunk_scan` (kernels/delta.cu) compute, step for step
/// on the host: chunks of `l` padded with tokens that add nothing (k, q, v, beta, g zero),
/// T = (I + A)^-1 by column-wise substitution, delta = T rhs, o = e^G S^T q + P delta, and the
/// state from e^(G_last - G_t). The kernels' algebra, checked here where it can run.
// Index loops on purpose: the kernels' loops, written the same way.
#[allow(clippy::needless_range_loop)]
fn inverse_form(state: &mut [f32], dk: usize, dv: usize, x: &Inputs, l: usize, out: &mut [f32]) {
    let n = x.g.len();
    for t0 in (0..n).step_by(l) {
        let nt = l.min(n - t0);
        // Padded rows: zeros past nt.
        let row = |v: &[f32], t: usize, d: usize| -> Vec<f32> {
            if t < nt {
                v[(t0 + t) * d..(t0 + t + 1) * d].to_vec()
            } else {
                vec![0.0; d]
            }
        };
        let (k, q, v): (Vec<_>, Vec<_>, Vec<_>) = (
            (0..l).map(|t| row(&x.k, t, dk)).collect(),
            (0..l).map(|t| row(&x.q, t, dk)).collect(),
            (0..l).map(|t| row(&x.v, t, dv)).collect(),
        );
        let beta: Vec<f32> = (0..l)
            .map(|t| if t < nt { x.beta[t0 + t] } else { 0.0 })
            .collect();
        let mut gc: Vec<f32> = (0..l)
            .map(|t| if t < nt { x.g[t0 + t] } else { 0.0 })
            .collect();
        for t in 1..l {
            gc[t] += gc[t - 1];
        }
        let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
        let mut a = vec![vec![0f32; l]; l];
        let mut p = vec![vec![0f32; l]; l];
        for t in 0..l {
            for s in 0..=t {
                let decay = (gc[t] - gc[s]).exp();
                if s < t {
                    a[t][s] = beta[t] * decay * dot(&k[t], &k[s]);
                }
                p[t][s] = decay * dot(&q[t], &k[s]);
            }
        }
        let mut tm = vec![vec![0f32; l]; l];
        for j in 0..l {
            let mut xs = vec![0f32; l];
            for r in 0..l {
                let acc: f32 = (0..r).map(|s| a[r][s] * xs[s]).sum();
                xs[r] = if r == j {
                    1.0
                } else if r < j {
                    0.0
                } else {
                    -acc
                };
                tm[r][j] = xs[r];
            }
        }
        let sk = |t: usize, c: usize, v: &[Vec<f32>]| -> f32 {
            (0..dk).map(|i| v[t][i] * state[i * dv + c]).sum()
        };
        let mut rhs = vec![vec![0f32; dv]; l];
        let mut qkeep = vec![vec![0f32; dv]; l];
        for t in 0..l {
            for c in 0..dv {
                let eg = gc[t].exp();
                qkeep[t][c] = eg * sk(t, c, &q);
                rhs[t][c] = beta[t] * (v[t][c] - eg * sk(t, c, &k));
            }
        }
        let delta: Vec<Vec<f32>> = (0..l)
            .map(|t| {
                (0..dv)
                    .map(|c| (0..l).map(|u| tm[t][u] * rhs[u][c]).sum())
                    .collect()
            })
            .collect();
        for t in 0..nt {
            for c in 0..dv {
                let o: f32 = (0..l).map(|u| p[t][u] * delta[u][c]).sum();
                out[(t0 + t) * dv + c] = qkeep[t][c] + o;
            }
        }
        let glast = gc[l - 1];
        for i in 0..dk {
            for c in 0..dv {
                let mut s = glast.exp() * state[i * dv + c];
                for t in 0..l {
                    s += (glast - gc[t]).exp() * delta[t][c] * k[t][i];
                }
                state[i * dv + c] = s;
            }
        }
    }
}

/// The chunked form as the CUDA kernels compute it (`inverse_form`) gives the reference's
/// outputs and state: whole chunks, a partial last chunk, one token, at the kernels' chunk
/// of 32 tokens.
#[test]
fn the_kernels_inverse_form_equals_the_reference() {
    for (seed, t, dk, dv) in [
        (11, 70, 16, 8),
        (12, 32, 32, 16),
        (13, 1, 8, 8),
        (14, 45, 8, 24),
    ] {
        let x = inputs(seed, t, dk, dv);
        let (o_ref, s_ref) = run_reference(&x, dk, dv);
        let mut s = x.state.clone();
        let mut o = vec![0f32; t * dv];
        inverse_form(&mut s, dk, dv, &x, 32, &mut o);
        let (dout, dstate) = (max_diff(&o, &o_ref), max_diff(&s, &s_ref));
        assert!(
            dout < 1e-4 && dstate < 1e-4,
            "t={t} dk={dk} dv={dv}: outputs differ by {dout}, states by {dstate}"
        );
    }
}
