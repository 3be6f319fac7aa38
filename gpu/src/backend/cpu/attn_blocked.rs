//! Causal attention of one sequence's prompt chunk as matrix products: for each KV head and
//! each block of the chunk's queries, the scores of every query of the block (all the heads
//! that share the KV head) against the keys they may see in one GEMM, a masked softmax, and
//! the weighted values in a second GEMM. The same arithmetic as the per-token path in
//! `mod.rs` (scores, a max-subtracted softmax in f32, weights times values), with each key
//! and value read once per block instead of once per query and head, and the products on
//! the GEMM kernels' vector units: a 2,048-token prompt spent most of its time in the
//! per-token loop (`perf`), not in the projections.

use rayon::prelude::*;

use crate::kv_cache::BlockId;
use crate::kv_pool::F32Layer;

/// Queries of one block: the scores of a block are `QUERY_BLOCK * group` rows by at most the
/// sequence's length, a few MB at the longest prompts.
const QUERY_BLOCK: usize = 32;

/// Prompt chunks at least this long take the blocked path; shorter ones (decode tokens)
/// are cheaper one by one.
pub(super) const MIN_TOKENS: usize = 16;

/// One sequence's chunk and where it is.
pub(super) struct Chunk<'a> {
    /// Its block table and the cache's block size.
    pub table: &'a [BlockId],
    pub block_size: usize,
    /// Position of its first token, and how many tokens the step runs.
    pub start_pos: usize,
    pub len: usize,
    /// Its first row in the step's `qkv` and attention output.
    pub first_row: usize,
}

/// The attention layer's shape.
pub(super) struct Shape {
    pub head_dim: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub scale: f32,
    /// A sliding window's length, for layers with one.
    pub window: Option<usize>,
}

/// Writes the chunk's attention into `attn` (`[step tokens, q_dim]`), reading the queries
/// from `qkv` (`[step tokens, row]`) and K and V from `cache`, where the chunk's own
/// positions are already written.
///
/// # Safety
/// `cache` must hold K and V of every position below `start_pos + len` at the slots the
/// table names, with no writer while this runs.
pub(super) unsafe fn attend(
    c: &Chunk,
    s: &Shape,
    cache: &F32Layer,
    qkv: &[f32],
    row: usize,
    attn: &mut [f32],
) {
    let (d, nq, nkv) = (s.head_dim, s.num_heads, s.num_kv_heads);
    let group = nq / nkv;
    let qd = nq * d;
    let n_ctx = c.start_pos + c.len;
    // Each KV head's keys and values, contiguous: [n_ctx, d].
    let gathered: Vec<(Vec<f32>, Vec<f32>)> = (0..nkv)
        .into_par_iter()
        .map(|g| {
            let (mut k, mut v) = (Vec::with_capacity(n_ctx * d), Vec::with_capacity(n_ctx * d));
            for p in 0..n_ctx {
                let slot = c.table[p / c.block_size].0 as usize * c.block_size + p % c.block_size;
                // SAFETY: the caller's contract: written, and no writer.
                unsafe {
                    k.extend_from_slice(cache.k(slot, g * d, d));
                    v.extend_from_slice(cache.v(slot, g * d, d));
                }
            }
            (k, v)
        })
        .collect();
    let blocks = c.len.div_ceil(QUERY_BLOCK);
    let outs: Vec<(usize, usize, Vec<f32>)> = (0..nkv * blocks)
        .into_par_iter()
        .map(|task| {
            let (g, b) = (task / blocks, task % blocks);
            let (t0, t1) = (b * QUERY_BLOCK, ((b + 1) * QUERY_BLOCK).min(c.len));
            let (k, v) = &gathered[g];
            (g, b, block(c, s, qkv, row, k, v, g, t0..t1, group))
        })
        .collect();
    for (g, b, o) in outs {
        let t0 = b * QUERY_BLOCK;
        for (r, orow) in o.chunks_exact(d).enumerate() {
            let (t, hh) = (t0 + r / group, r % group);
            let h = g * group + hh;
            let at = (c.first_row + t) * qd + h * d;
            attn[at..at + d].copy_from_slice(orow);
        }
    }
}

/// One query block of KV head `g`: rows `(token, head of the group)`, `[rows, d]`.
#[allow(clippy::too_many_arguments)]
fn block(
    c: &Chunk,
    s: &Shape,
    qkv: &[f32],
    row: usize,
    k: &[f32],
    v: &[f32],
    g: usize,
    tokens: std::ops::Range<usize>,
    group: usize,
) -> Vec<f32> {
    let d = s.head_dim;
    let lo_of = |p: usize| s.window.map_or(0, |w| (p + 1).saturating_sub(w));
    let (p_first, p_last) = (c.start_pos + tokens.start, c.start_pos + tokens.end - 1);
    // The keys any query of the block sees.
    let (k_lo, k_hi) = (lo_of(p_first), p_last + 1);
    let nk = k_hi - k_lo;
    let rows = tokens.len() * group;
    let mut q = Vec::with_capacity(rows * d);
    for t in tokens.clone() {
        let r = (c.first_row + t) * row;
        q.extend_from_slice(&qkv[r + g * group * d..r + (g + 1) * group * d]);
    }
    let mut scores = vec![0f32; rows * nk];
    // The keys k[k_lo..k_hi] as the columns of a [d, nk] matrix: column j at (k_lo + j) * d,
    // consecutive rows 1 apart.
    product(&mut scores, &q, (rows, nk, d), &k[k_lo * d..], (d, 1));
    let mut sums = vec![0f32; rows];
    for (r, srow) in scores.chunks_exact_mut(nk).enumerate() {
        let p = c.start_pos + tokens.start + r / group;
        // Keys this query sees, as indices into the block's key range.
        let (a, e) = (lo_of(p) - k_lo, p + 1 - k_lo);
        // Scaled after the product, as the per-token path does.
        for x in &mut srow[a..e] {
            *x *= s.scale;
        }
        let max = srow[a..e].iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        srow[..a].fill(0.0);
        srow[e..].fill(0.0);
        sums[r] = super::vexp::exp_shifted(&mut srow[a..e], max);
    }
    let mut out = vec![0f32; rows * d];
    // The values v[k_lo..k_hi], row-major [nk, d].
    product(&mut out, &scores, (rows, d, nk), &v[k_lo * d..], (1, d));
    for (orow, &sum) in out.chunks_exact_mut(d).zip(&sums) {
        let inv = 1.0 / sum;
        for x in orow {
            *x *= inv;
        }
    }
    out
}

/// `dst[m, n] = lhs[m, k] · rhs[k, n]`, `dst` and `lhs` row-major, `rhs` element `(i, j)` at
/// `j * cs + i * rs` (`rhs_strides` = `(cs, rs)`), on this thread.
fn product(
    dst: &mut [f32],
    lhs: &[f32],
    (m, n, k): (usize, usize, usize),
    rhs: &[f32],
    (cs, rs): (usize, usize),
) {
    assert!(dst.len() >= m * n && lhs.len() >= m * k);
    assert!(k == 0 || n == 0 || rhs.len() > (n - 1) * cs + (k - 1) * rs);
    // SAFETY: the asserts bound every element the strides reach; dst aliases neither input.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            false,
            lhs.as_ptr(),
            1,
            k as isize,
            rhs.as_ptr(),
            cs as isize,
            rs as isize,
            0.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_pool::{HostKvPool, KvDtype, KvSpec};
    use crate::sampler::Rng;

    /// The rule written out: each query and head over its visible keys, in f64.
    #[allow(clippy::too_many_arguments)]
    fn reference(
        s: &Shape,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        start_pos: usize,
        len: usize,
        row: usize,
    ) -> Vec<f32> {
        let (d, nq, nkv) = (s.head_dim, s.num_heads, s.num_kv_heads);
        let kvd = nkv * d;
        let mut out = vec![0f32; len * nq * d];
        for t in 0..len {
            let p = start_pos + t;
            let lo = s.window.map_or(0, |w| (p + 1).saturating_sub(w));
            for h in 0..nq {
                let g = h / (nq / nkv);
                let qh = &q[t * row + h * d..t * row + (h + 1) * d];
                let sc: Vec<f64> = (lo..=p)
                    .map(|j| {
                        let kj = &k[j * kvd + g * d..j * kvd + (g + 1) * d];
                        qh.iter().zip(kj).map(|(a, b)| (a * b) as f64).sum::<f64>() * s.scale as f64
                    })
                    .collect();
                let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = sc.iter().map(|x| (x - m).exp()).collect();
                let sum: f64 = w.iter().sum();
                for (j, wj) in (lo..=p).zip(&w) {
                    for i in 0..d {
                        out[(t * nq + h) * d + i] +=
                            (wj / sum * v[j * kvd + g * d + i] as f64) as f32;
                    }
                }
            }
        }
        out
    }

    #[test]
    fn blocked_prompt_attention_matches_the_rule() {
        let mut r = Rng::seeded(11);
        let mut unit = || (r.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
        // (heads, kv heads, head dim, window, cached positions, chunk)
        for (nq, nkv, d, window, start, len) in [
            (4usize, 2usize, 16usize, None::<usize>, 0usize, 70usize),
            (6, 1, 8, Some(20), 13, 45),
            (2, 2, 32, None, 40, 16),
        ] {
            let bs: usize = 4;
            let n_ctx = start + len;
            let kvd = nkv * d;
            let spec = KvSpec {
                num_layers: 1,
                block_size: bs,
                num_kv_heads: nkv,
                head_dim: d,
                dtype: KvDtype::F32,
            };
            let blocks = n_ctx.div_ceil(bs) + 3;
            let pool = HostKvPool::new(spec, blocks).unwrap();
            // A shuffled block table, as a real cache's.
            let table: Vec<BlockId> = (0..n_ctx.div_ceil(bs))
                .map(|i| BlockId(((i * 5 + 2) % blocks) as u32))
                .collect();
            let k: Vec<f32> = (0..n_ctx * kvd).map(|_| unit()).collect();
            let v: Vec<f32> = (0..n_ctx * kvd).map(|_| unit()).collect();
            // SAFETY: a pool of our own, written before it is read.
            let cache = unsafe { pool.f32_layer(0) };
            for p in 0..n_ctx {
                let slot = table[p / bs].0 as usize * bs + p % bs;
                unsafe {
                    cache.write(slot, &k[p * kvd..(p + 1) * kvd], &v[p * kvd..(p + 1) * kvd])
                };
            }
            let row = nq * d + 2 * kvd;
            let qkv: Vec<f32> = (0..len * row).map(|_| unit()).collect();
            let shape = Shape {
                head_dim: d,
                num_heads: nq,
                num_kv_heads: nkv,
                scale: 1.0 / (d as f32).sqrt(),
                window,
            };
            let chunk = Chunk {
                table: &table,
                block_size: bs,
                start_pos: start,
                len,
                first_row: 0,
            };
            let mut attn = vec![0f32; len * nq * d];
            unsafe { attend(&chunk, &shape, &cache, &qkv, row, &mut attn) };
            let want = reference(&shape, &qkv, &k, &v, start, len, row);
            for (i, (a, b)) in attn.iter().zip(&want).enumerate() {
                assert!(
                    (a - b).abs() < 1e-5,
                    "{nq}/{nkv}/{d}/{window:?}: value {i}: {a} vs {b}"
                );
            }
        }
    }
}
