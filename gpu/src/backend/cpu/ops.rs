//! The numeric kernels of the CPU backend. Matrix products go to the `gemm` crate; for the
//! few-row products of decode, a dot-product kernel streams each weight row once and reuses
//! it for every row of the batch, which is what bounds decode: reading the weights.

use std::sync::Arc;

use rayon::prelude::*;

use super::fp8_acts::{fake_quantize, Fp8Activations};
use crate::safetensors::TensorData;

/// A weight matrix, row-major `[rows, cols]`: f32, or bf16 kept as raw bits and widened on
/// the fly (exact: bf16 is the top half of an f32).
#[derive(Clone)]
pub enum Matrix {
    F32(Arc<Vec<f32>>),
    Bf16(Arc<Vec<u16>>),
}

impl Matrix {
    pub fn from_data(d: TensorData) -> Matrix {
        match d {
            TensorData::F32(v) => Matrix::F32(Arc::new(v)),
            TensorData::Bf16(v) => Matrix::Bf16(Arc::new(v)),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn len(&self) -> usize {
        match self {
            Matrix::F32(v) => v.len(),
            Matrix::Bf16(v) => v.len(),
        }
    }

    pub fn bytes(&self) -> usize {
        match self {
            Matrix::F32(v) => v.len() * 4,
            Matrix::Bf16(v) => v.len() * 2,
        }
    }

    /// Elements `[start, start + out.len())` as f32.
    pub fn read(&self, start: usize, out: &mut [f32]) {
        match self {
            Matrix::F32(v) => out.copy_from_slice(&v[start..start + out.len()]),
            Matrix::Bf16(v) => {
                let n = out.len();
                for (o, &b) in out.iter_mut().zip(&v[start..start + n]) {
                    *o = bf16_to_f32(b);
                }
            }
        }
    }

    /// The same values, stored as f32.
    pub fn to_f32(&self) -> Matrix {
        let mut v = vec![0f32; self.len()];
        self.read(0, &mut v);
        Matrix::F32(Arc::new(v))
    }
}

#[inline]
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// A dense layer: `y = x · Wᵀ + b`, with `W` stored row-major as `[out, inp]`.
pub struct Linear {
    pub w: Matrix,
    pub out: usize,
    pub inp: usize,
    pub bias: Option<Vec<f32>>,
    /// Prompt-sized products of bf16 weights round the activations to bf16 and run on
    /// AVX512-BF16 where the CPU has it (`gemm_bf16`); off by default.
    pub bf16_products: bool,
    /// Products of more rows than it says round their input as an FP8 GEMM does
    /// (`fp8_acts`); `None` by default.
    pub fp8_activations: Option<Arc<Fp8Activations>>,
}

/// At or below this many rows, products stream weight rows (memory-bound decode); above it,
/// `gemm`'s blocked kernel wins.
const STREAM_ROWS: usize = 4;

/// With AVX-512, bf16 weight rows are widened once and reused for up to 8 batch rows at a
/// time, so streaming stays ahead of `gemm` up to decode batches of this size.
const STREAM_ROWS_BF16_AVX512: usize = 16;

/// The vector instructions the hand-written kernels here use, decided once per process from
/// what the CPU has ([`Isa::detected`]). Each kernel has a portable version, which is what
/// runs on other CPUs; the tests run every level this machine has, the portable one
/// included, against the same expected values. (The `gemm` crate dispatches its own
/// kernels the same way.)
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    Portable,
    /// AVX2 with FMA.
    Avx2,
    /// AVX-512F (with AVX2 and FMA).
    Avx512,
}

impl Isa {
    /// The best level this CPU has.
    pub fn detected() -> Isa {
        static DETECTED: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *DETECTED.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            {
                let avx2 = std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma");
                if avx2 && std::arch::is_x86_feature_detected!("avx512f") {
                    return Isa::Avx512;
                }
                if avx2 {
                    return Isa::Avx2;
                }
            }
            Isa::Portable
        })
    }

    /// Every level this CPU can run, the portable one first.
    pub fn available() -> Vec<Isa> {
        [Isa::Portable, Isa::Avx2, Isa::Avx512]
            .into_iter()
            .filter(|&i| i <= Isa::detected())
            .collect()
    }
}

/// Output rows a bf16 weight tile widens to f32 at a time before `gemm` runs on it.
const TILE_ROWS: usize = 64;

impl Linear {
    pub fn new(w: Matrix, out: usize, inp: usize, bias: Option<Vec<f32>>) -> Linear {
        assert_eq!(w.len(), out * inp);
        Linear {
            w,
            out,
            inp,
            bias,
            bf16_products: false,
            fp8_activations: None,
        }
    }

    pub fn bytes(&self) -> usize {
        self.w.bytes()
    }

    /// `x` is `[m, inp]`; returns `[m, out]`.
    pub fn forward(&self, x: &[f32], m: usize) -> Vec<f32> {
        self.forward_with(Isa::detected(), x, m)
    }

    /// [`Self::forward`] on the kernels of `isa`, one this CPU has ([`Isa::available`]).
    pub fn forward_with(&self, isa: Isa, x: &[f32], m: usize) -> Vec<f32> {
        assert!(
            isa <= Isa::detected(),
            "{isa:?} is not available on this CPU"
        );
        debug_assert_eq!(x.len(), m * self.inp);
        let mut y = vec![0f32; m * self.out];
        if m == 0 {
            return y;
        }
        let stream_rows = match &self.w {
            Matrix::Bf16(_) if isa == Isa::Avx512 => STREAM_ROWS_BF16_AVX512,
            _ => STREAM_ROWS,
        };
        if let Some(f) = self.fp8_activations.as_deref().filter(|f| m > f.above_rows) {
            self.forward_fp8_activations(x, m, f, &mut y);
        } else if m <= stream_rows {
            self.stream(isa, x, m, &mut y);
        } else if let (Matrix::Bf16(w), true) = (&self.w, self.takes_bf16_products()) {
            super::gemm_bf16::gemm(x, m, w, self.out, self.inp, &mut y);
        } else {
            match &self.w {
                Matrix::F32(w) => gemm_nt(x, m, w, self.out, self.inp, &mut y, self.out, true),
                Matrix::Bf16(w) => self.gemm_bf16_tiles(x, m, w, &mut y),
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

    /// Whether prompt-sized products go to `gemm_bf16`: asked for, bf16 weights, an even
    /// inner size and a CPU with AVX512-BF16.
    pub fn takes_bf16_products(&self) -> bool {
        self.bf16_products
            && matches!(self.w, Matrix::Bf16(_))
            && self.inp.is_multiple_of(2)
            && super::gemm_bf16::available()
    }

    /// Each part's rows from its input rounded as `f` says (`fp8_acts::fake_quantize`).
    fn forward_fp8_activations(&self, x: &[f32], m: usize, f: &Fp8Activations, y: &mut [f32]) {
        let inp = self.inp;
        assert_eq!(
            f.parts.iter().map(|(r, _)| r).sum::<usize>(),
            self.out,
            "FP8 activation parts cover the product's rows"
        );
        let mut r0 = 0;
        for &(rows, q) in &f.parts {
            let quantized;
            let xs = match q {
                Some(q) => {
                    quantized = fake_quantize(x, m, inp, q);
                    &quantized[..]
                }
                None => x,
            };
            let span = r0 * inp..(r0 + rows) * inp;
            let widened;
            let w = match &self.w {
                Matrix::F32(w) => &w[span],
                Matrix::Bf16(w) => {
                    widened = w[span].iter().map(|&b| bf16_to_f32(b)).collect::<Vec<_>>();
                    &widened[..]
                }
            };
            gemm_nt(xs, m, w, rows, inp, &mut y[r0..], self.out, true);
            r0 += rows;
        }
    }

    /// Widens a tile of rows to f32 (it stays in cache) and multiplies it, tiles in parallel.
    fn gemm_bf16_tiles(&self, x: &[f32], m: usize, w: &[u16], y: &mut [f32]) {
        let (out, inp) = (self.out, self.inp);
        let tiles: Vec<(usize, Vec<f32>)> = (0..out.div_ceil(TILE_ROWS))
            .into_par_iter()
            .map(|t| {
                let n0 = t * TILE_ROWS;
                let rows = TILE_ROWS.min(out - n0);
                let wt: Vec<f32> = w[n0 * inp..(n0 + rows) * inp]
                    .iter()
                    .map(|&b| bf16_to_f32(b))
                    .collect();
                let mut yt = vec![0f32; m * rows];
                gemm_nt(x, m, &wt, rows, inp, &mut yt, rows, false);
                (n0, yt)
            })
            .collect();
        for (n0, yt) in tiles {
            let rows = yt.len() / m;
            for i in 0..m {
                y[i * out + n0..i * out + n0 + rows].copy_from_slice(&yt[i * rows..(i + 1) * rows]);
            }
        }
    }

    fn stream(&self, isa: Isa, x: &[f32], m: usize, y: &mut [f32]) {
        const CHUNK: usize = 256;
        let mut yt = vec![0f32; self.out * m];
        let inp = self.inp;
        yt.par_chunks_mut(CHUNK * m)
            .enumerate()
            .for_each(|(c, out)| {
                let n0 = c * CHUNK;
                for (j, cell) in out.chunks_exact_mut(m).enumerate() {
                    let r = (n0 + j) * inp..(n0 + j + 1) * inp;
                    #[cfg(target_arch = "x86_64")]
                    if let Matrix::Bf16(w) = &self.w {
                        if m > 1 && isa == Isa::Avx512 {
                            for (g, cells) in cell.chunks_mut(8).enumerate() {
                                // SAFETY: avx512f was detected; the slices are in bounds.
                                unsafe {
                                    dot_rows_bf16_avx512(
                                        &x[g * 8 * inp..],
                                        inp,
                                        &w[r.clone()],
                                        cells,
                                    )
                                };
                            }
                            continue;
                        }
                    }
                    for (i, v) in cell.iter_mut().enumerate() {
                        let xi = &x[i * inp..(i + 1) * inp];
                        *v = match &self.w {
                            Matrix::F32(w) => dot_with(isa, xi, &w[r.clone()]),
                            Matrix::Bf16(w) => dot_bf16_with(isa, xi, &w[r.clone()]),
                        };
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

/// `y[m, n] = x[m, k] · w[n, k]ᵀ`, `y` with row stride `ldy`.
#[allow(clippy::too_many_arguments)]
fn gemm_nt(
    x: &[f32],
    m: usize,
    w: &[f32],
    n: usize,
    k: usize,
    y: &mut [f32],
    ldy: usize,
    parallel: bool,
) {
    let par = if parallel {
        gemm::Parallelism::Rayon(rayon::current_num_threads())
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: the strides describe the row-major buffers exactly; dst does not alias.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            y.as_mut_ptr(),
            1,
            ldy as isize,
            false,
            x.as_ptr(),
            1,
            k as isize,
            w.as_ptr(),
            k as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            par,
        );
    }
}

/// `a · b` for bf16 `b`, on the kernels of `isa` (at most [`Isa::detected`]).
fn dot_bf16_with(isa: Isa, a: &[f32], b: &[u16]) -> f32 {
    debug_assert!(isa <= Isa::detected());
    #[cfg(target_arch = "x86_64")]
    match isa {
        // SAFETY: `isa` is at most what was detected.
        Isa::Avx512 => return unsafe { dot_bf16_avx512(a, b) },
        // SAFETY: as above.
        Isa::Avx2 => return unsafe { dot_bf16_avx2(a, b) },
        Isa::Portable => {}
    }
    a.iter().zip(b).map(|(&x, &w)| x * bf16_to_f32(w)).sum()
}

/// `out[r] = x_r · w` for `out.len()` (at most 8) consecutive rows `x_r` of length `k`:
/// each 16 weights are widened once and used for every row.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dot_rows_bf16_avx512(x: &[f32], k: usize, w: &[u16], out: &mut [f32]) {
    match out.len() {
        1 => rows_kernel::<1>(x, k, w, out),
        2 => rows_kernel::<2>(x, k, w, out),
        3 => rows_kernel::<3>(x, k, w, out),
        4 => rows_kernel::<4>(x, k, w, out),
        5 => rows_kernel::<5>(x, k, w, out),
        6 => rows_kernel::<6>(x, k, w, out),
        7 => rows_kernel::<7>(x, k, w, out),
        _ => rows_kernel::<8>(x, k, w, out),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn rows_kernel<const M: usize>(x: &[f32], k: usize, w: &[u16], out: &mut [f32]) {
    use std::arch::x86_64::*;
    assert!(x.len() >= M * k && w.len() >= k && out.len() >= M);
    let (px, pw) = (x.as_ptr(), w.as_ptr());
    let mut acc = [_mm512_setzero_ps(); M];
    let mut i = 0;
    while i + 16 <= k {
        if i % 64 == 0 {
            _mm_prefetch::<_MM_HINT_T0>(pw.add(i + 2048) as *const i8);
        }
        let h = _mm256_loadu_si256(pw.add(i) as *const __m256i);
        let wv = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)));
        for (r, a) in acc.iter_mut().enumerate() {
            *a = _mm512_fmadd_ps(_mm512_loadu_ps(px.add(r * k + i)), wv, *a);
        }
        i += 16;
    }
    for (r, a) in acc.iter().enumerate() {
        let mut total = _mm512_reduce_add_ps(*a);
        for j in i..k {
            total += *px.add(r * k + j) * bf16_to_f32(*pw.add(j));
        }
        out[r] = total;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dot_bf16_avx512(a: &[f32], b: &[u16]) -> f32 {
    use std::arch::x86_64::*;
    let n = a.len().min(b.len());
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc = [_mm512_setzero_ps(); 4];
    let mut i = 0;
    while i + 64 <= n {
        _mm_prefetch::<_MM_HINT_T0>(pb.add(i + 2048) as *const i8);
        _mm_prefetch::<_MM_HINT_T0>(pb.add(i + 2080) as *const i8);
        for (k, a_k) in acc.iter_mut().enumerate() {
            let h = _mm256_loadu_si256(pb.add(i + 16 * k) as *const __m256i);
            let w = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)));
            *a_k = _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(i + 16 * k)), w, *a_k);
        }
        i += 64;
    }
    while i + 16 <= n {
        let h = _mm256_loadu_si256(pb.add(i) as *const __m256i);
        let w = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)));
        acc[0] = _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(i)), w, acc[0]);
        i += 16;
    }
    let s = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
    let mut total = _mm512_reduce_add_ps(s);
    while i < n {
        total += *pa.add(i) * bf16_to_f32(*pb.add(i));
        i += 1;
    }
    total
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_bf16_avx2(a: &[f32], b: &[u16]) -> f32 {
    use std::arch::x86_64::*;
    let n = a.len().min(b.len());
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc = [_mm256_setzero_ps(); 8];
    let mut i = 0;
    // 64 weights an iteration: eight independent FMA chains hide the FMA latency. Each 16
    // weights are widened with one 256-bit load: zero-extending each half to 32 bits and
    // shifting left by 16 turns bf16 bits into f32 bits.
    while i + 64 <= n {
        // Fetch ahead: the row after this one is what the next call reads.
        _mm_prefetch::<_MM_HINT_T0>(pb.add(i + 1024) as *const i8);
        _mm_prefetch::<_MM_HINT_T0>(pb.add(i + 1056) as *const i8);
        for k in 0..4 {
            let w = _mm256_loadu_si256(pb.add(i + 16 * k) as *const __m256i);
            let lo = _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm256_castsi256_si128(w)),
                16,
            ));
            let hi = _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm256_extracti128_si256(w, 1)),
                16,
            ));
            acc[2 * k] = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i + 16 * k)), lo, acc[2 * k]);
            acc[2 * k + 1] =
                _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i + 16 * k + 8)), hi, acc[2 * k + 1]);
        }
        i += 64;
    }
    while i + 8 <= n {
        let h = _mm_loadu_si128(pb.add(i) as *const __m128i);
        let wv = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), wv, acc[0]);
        i += 8;
    }
    let mut s = acc[0];
    for v in &acc[1..] {
        s = _mm256_add_ps(s, *v);
    }
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), s);
    let mut total: f32 = lanes.iter().sum();
    while i < n {
        total += *pa.add(i) * bf16_to_f32(*pb.add(i));
        i += 1;
    }
    total
}

pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    dot_with(Isa::detected(), a, b)
}

/// [`dot`] on the kernels of `isa` (at most [`Isa::detected`]); AVX-512 machines use the
/// AVX2 kernel, which keeps up with memory there.
fn dot_with(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    debug_assert!(isa <= Isa::detected());
    #[cfg(target_arch = "x86_64")]
    if isa >= Isa::Avx2 {
        // SAFETY: `isa` is at most what was detected, and AVX2 with FMA is part of both.
        return unsafe { dot_avx2(a, b) };
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
        acc[0] = _mm256_fmadd_ps(
            _mm256_loadu_ps(pa.add(i)),
            _mm256_loadu_ps(pb.add(i)),
            acc[0],
        );
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
        let w: Vec<f32> = (0..out * inp)
            .map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.1)
            .collect();
        let bias: Vec<f32> = (0..out).map(|i| i as f32 * 0.01).collect();
        let f32_lin = Linear::new(
            Matrix::F32(Arc::new(w.clone())),
            out,
            inp,
            Some(bias.clone()),
        );
        let bf16_w: Vec<u16> = w
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_bits())
            .collect();
        let w_round: Vec<f32> = bf16_w.iter().map(|&b| bf16_to_f32(b)).collect();
        let bf16_lin = Linear::new(Matrix::Bf16(Arc::new(bf16_w)), out, inp, Some(bias.clone()));
        // Every kernel level this CPU has, the portable one included.
        let isas = Isa::available();
        assert_eq!(isas[0], Isa::Portable);
        println!("kernel levels on this CPU: {isas:?}");
        for isa in isas {
            for (lin, w) in [(&f32_lin, &w), (&bf16_lin, &w_round)] {
                for m in [1, 3, 9, 16, 20, 32, 70] {
                    let x: Vec<f32> = (0..m * inp)
                        .map(|i| ((i * 5 % 11) as f32 - 5.0) * 0.2)
                        .collect();
                    let y = lin.forward_with(isa, &x, m);
                    for i in 0..m {
                        for n in 0..out {
                            let want: f32 = (0..inp)
                                .map(|k| x[i * inp + k] * w[n * inp + k])
                                .sum::<f32>()
                                + bias[n];
                            let got = y[i * out + n];
                            assert!((got - want).abs() < 1e-3, "{isa:?} m={m} i={i} n={n}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn bf16_dot_matches_scalar() {
        for n in [5, 16, 64, 100, 896] {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<u16> = (0..n)
                .map(|i| half::bf16::from_f32((i as f32 * 0.11).cos()).to_bits())
                .collect();
            let want: f32 = a.iter().zip(&b).map(|(&x, &w)| x * bf16_to_f32(w)).sum();
            for isa in Isa::available() {
                assert!(
                    (dot_bf16_with(isa, &a, &b) - want).abs() < 1e-3,
                    "{isa:?} n={n}"
                );
            }
        }
    }

    #[test]
    fn dot_matches_portable() {
        let a: Vec<f32> = (0..101).map(|i| i as f32 * 0.5).collect();
        let b: Vec<f32> = (0..101).map(|i| 1.0 - i as f32 * 0.01).collect();
        for isa in Isa::available() {
            assert!(
                (dot_with(isa, &a, &b) - dot_portable(&a, &b)).abs() < 1e-2,
                "{isa:?}"
            );
        }
    }
}
