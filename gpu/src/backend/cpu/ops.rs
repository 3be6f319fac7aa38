//! The numeric kernels of the CPU backend. Matrix products go to the `gemm` crate; for the
//! few-row products of decode, a dot-product kernel streams each weight row once and reuses
//! it for every row of the batch, which is what bounds decode: reading the weights.

use rayon::prelude::*;

/// A dense layer: `y = x · Wᵀ + b`, with `W` stored row-major as `[out, inp]`.
pub struct Linear {
    pub w: std::sync::Arc<Vec<f32>>,
    pub out: usize,
    pub inp: usize,
    pub bias: Option<Vec<f32>>,
}

/// At or below this many rows, products stream weight rows (memory-bound decode); above it,
/// `gemm`'s blocked kernel wins.
const STREAM_ROWS: usize = 4;

impl Linear {
    pub fn new(w: Vec<f32>, out: usize, inp: usize, bias: Option<Vec<f32>>) -> Linear {
        assert_eq!(w.len(), out * inp);
        Linear { w: std::sync::Arc::new(w), out, inp, bias }
    }

    /// Rows of several layers stacked into one product (fused q/k/v, gate/up).
    pub fn stacked(parts: Vec<(Vec<f32>, usize, Option<Vec<f32>>)>, inp: usize) -> Linear {
        let out = parts.iter().map(|p| p.1).sum();
        let any_bias = parts.iter().any(|p| p.2.is_some());
        let mut w = Vec::with_capacity(out * inp);
        let mut bias = Vec::with_capacity(out);
        for (pw, rows, pb) in parts {
            w.extend_from_slice(&pw);
            bias.extend(pb.unwrap_or_else(|| vec![0.0; rows]));
        }
        Linear::new(w, out, inp, any_bias.then_some(bias))
    }

    pub fn bytes(&self) -> usize {
        self.w.len() * 4
    }

    /// `x` is `[m, inp]`; returns `[m, out]`.
    pub fn forward(&self, x: &[f32], m: usize) -> Vec<f32> {
        debug_assert_eq!(x.len(), m * self.inp);
        let mut y = vec![0f32; m * self.out];
        if m == 0 {
            return y;
        }
        if m <= STREAM_ROWS {
            self.stream(x, m, &mut y);
        } else {
            // SAFETY: the strides describe the row-major buffers exactly; dst does not alias.
            unsafe {
                gemm::gemm(
                    m,
                    self.out,
                    self.inp,
                    y.as_mut_ptr(),
                    1,
                    self.out as isize,
                    false,
                    x.as_ptr(),
                    1,
                    self.inp as isize,
                    self.w.as_ptr(),
                    self.inp as isize,
                    1,
                    0.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm::Parallelism::Rayon(rayon::current_num_threads()),
                );
            }
        }
        if let Some(b) = &self.bias {
            for row in y.chunks_exact_mut(self.out) {
                for (v, bb) in row.iter_mut().zip(b) {
                    *v += bb;
                }
            }
        }
        y
    }

    fn stream(&self, x: &[f32], m: usize, y: &mut [f32]) {
        const CHUNK: usize = 64;
        let mut yt = vec![0f32; self.out * m];
        yt.par_chunks_mut(CHUNK * m).enumerate().for_each(|(c, out)| {
            let n0 = c * CHUNK;
            for (j, cell) in out.chunks_exact_mut(m).enumerate() {
                let wrow = &self.w[(n0 + j) * self.inp..(n0 + j + 1) * self.inp];
                for (i, v) in cell.iter_mut().enumerate() {
                    *v = dot(&x[i * self.inp..(i + 1) * self.inp], wrow);
                }
            }
        });
        for n in 0..self.out {
            for i in 0..m {
                y[i * self.out + n] = yt[n * m + i];
            }
        }
    }
}

pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            // SAFETY: the features were just detected.
            return unsafe { dot_avx2(a, b) };
        }
    }
    dot_portable(a, b)
}

fn dot_portable(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let mut acc = [0f32; 8];
    let (ca, cb) = (a[..n].chunks_exact(8), b[..n].chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for k in 0..8 {
            acc[k] += x[k] * y[k];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let n = a.len().min(b.len());
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    while i + 32 <= n {
        for (k, a_k) in acc.iter_mut().enumerate() {
            let va = _mm256_loadu_ps(pa.add(i + 8 * k));
            let vb = _mm256_loadu_ps(pb.add(i + 8 * k));
            *a_k = _mm256_fmadd_ps(va, vb, *a_k);
        }
        i += 32;
    }
    while i + 8 <= n {
        acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc[0]);
        i += 8;
    }
    let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), s);
    let mut total: f32 = lanes.iter().sum();
    while i < n {
        total += *pa.add(i) * *pb.add(i);
        i += 1;
    }
    total
}

/// `y += a * x`
pub fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (v, &xx) in y.iter_mut().zip(x) {
        *v += a * xx;
    }
}

/// RMSNorm of each `dim`-long row of `x`, scaled by `w`.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let dim = w.len();
    let mut out = vec![0f32; x.len()];
    for (row, o) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
        let ms: f32 = row.iter().map(|v| v * v).sum::<f32>() / dim as f32;
        let r = 1.0 / (ms + eps).sqrt();
        for ((o, &v), &ww) in o.iter_mut().zip(row).zip(w) {
            *o = v * r * ww;
        }
    }
    out
}

/// RMSNorm in place over each `w.len()`-long piece of `x` (per-head q/k norms).
pub fn rms_norm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let dim = w.len();
    for row in x.chunks_exact_mut(dim) {
        let ms: f32 = row.iter().map(|v| v * v).sum::<f32>() / dim as f32;
        let r = 1.0 / (ms + eps).sqrt();
        for (v, &ww) in row.iter_mut().zip(w) {
            *v = *v * r * ww;
        }
    }
}

/// Rotary embedding on one head, rotate-half layout: the first half of the head pairs with
/// the second.
pub fn rope(head: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = head.len() / 2;
    let (a, b) = head.split_at_mut(half);
    for i in 0..half {
        let (x1, x2) = (a[i], b[i]);
        a[i] = x1 * cos[i] - x2 * sin[i];
        b[i] = x2 * cos[i] + x1 * sin[i];
    }
}

pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streamed_and_blocked_products_agree_with_naive() {
        let (out, inp) = (37, 70);
        let w: Vec<f32> = (0..out * inp).map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.1).collect();
        let bias: Vec<f32> = (0..out).map(|i| i as f32 * 0.01).collect();
        let lin = Linear::new(w.clone(), out, inp, Some(bias.clone()));
        for m in [1, 3, 9] {
            let x: Vec<f32> = (0..m * inp).map(|i| ((i * 5 % 11) as f32 - 5.0) * 0.2).collect();
            let y = lin.forward(&x, m);
            for i in 0..m {
                for n in 0..out {
                    let want: f32 =
                        (0..inp).map(|k| x[i * inp + k] * w[n * inp + k]).sum::<f32>() + bias[n];
                    assert!((y[i * out + n] - want).abs() < 1e-3, "m={m} i={i} n={n}");
                }
            }
        }
    }

    #[test]
    fn dot_matches_portable() {
        let a: Vec<f32> = (0..101).map(|i| i as f32 * 0.5).collect();
        let b: Vec<f32> = (0..101).map(|i| 1.0 - i as f32 * 0.01).collect();
        assert!((dot(&a, &b) - dot_portable(&a, &b)).abs() < 1e-2);
    }
}
