//! Prompt-sized products of bf16 weights on AVX512-BF16, with the activations rounded to
//! bf16 too: `vdpbf16ps` multiplies pairs of bf16 and adds both products to an f32 lane, 32
//! multiply-adds an instruction where an f32 FMA does 16. This is how llama.cpp and the GPU
//! engines multiply bf16 weights; it is *not* the CPU backend's default, whose f32
//! activations keep it within 2e-3 of transformers in f32 (the reference tests). A model
//! opts in with `CpuModel::with_bf16_products`.
//!
//! Layout: `y[m, n] = x[m, k] · w[n, k]ᵀ`. x is rounded once to bf16 rows (a pair of
//! neighbouring k is one 32-bit word). Each task takes 64 output columns (weight rows) and
//! packs them into two panels of 32 rows, pair-major: for each k pair, 32 words, one per
//! row, so one 64-byte load is the pair for 16 rows. The micro-kernel holds a 12 x 32 block
//! of y in 24 registers; per k pair it loads the two halves of the panel, broadcasts each of
//! its 12 rows' pairs and issues 24 `vdpbf16ps`. k is walked in blocks of `KC` pairs so the
//! panel block stays in L1.

use rayon::prelude::*;

/// Rows of x per micro-kernel call (24 accumulators, 2 panel registers, 1 broadcast).
const MR: usize = 12;
/// Weight rows per panel: two 16-lane registers.
const NR: usize = 32;
/// Weight rows per parallel task.
const TASK_ROWS: usize = 2 * NR;
/// k pairs per block: a panel block is 32 x 128 words = 16 KiB.
const KC: usize = 128;

/// Whether this CPU runs these products.
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *AVAILABLE.get_or_init(|| {
            std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bf16")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// f32 to bf16 bits, rounding to nearest even (as torch does); NaN stays NaN.
pub fn f32_to_bf16(v: f32) -> u16 {
    let u = v.to_bits();
    if (u & 0x7fff_ffff) > 0x7f80_0000 {
        return ((u >> 16) | 0x40) as u16;
    }
    ((u + 0x7fff + ((u >> 16) & 1)) >> 16) as u16
}

/// `y[m, n] = bf16(x)[m, k] · w[n, k]ᵀ` with f32 sums, `y` `[m, n]` overwritten. Needs
/// [`available`] and an even `k`.
pub fn gemm(x: &[f32], m: usize, w: &[u16], n: usize, k: usize, y: &mut [f32]) {
    assert!(available(), "AVX512-BF16 is not available on this CPU");
    assert!(
        k.is_multiple_of(2) && k > 0,
        "k = {k}: the pairs need an even k"
    );
    assert_eq!(x.len(), m * k);
    assert_eq!(w.len(), n * k);
    assert_eq!(y.len(), m * n);
    let pairs = k / 2;
    // x as bf16 rows, padded with zero rows to whole micro-kernel blocks.
    let mp = m.div_ceil(MR) * MR;
    let mut xb = vec![0u16; mp * k];
    xb[..m * k]
        .par_chunks_mut(k)
        .zip(x.par_chunks(k))
        .for_each(|(o, i)| {
            for (o, &v) in o.iter_mut().zip(i) {
                *o = f32_to_bf16(v);
            }
        });
    let tiles: Vec<(usize, Vec<f32>)> = (0..n.div_ceil(TASK_ROWS))
        .into_par_iter()
        .map(|t| {
            let n0 = t * TASK_ROWS;
            let rows = TASK_ROWS.min(n - n0);
            // Two panels, pair-major, rows past the end zero.
            let mut panel = vec![0u32; 2 * pairs * NR];
            for r in 0..rows {
                let src = &w[(n0 + r) * k..(n0 + r + 1) * k];
                let (half, lane) = (r / NR, r % NR);
                let base = half * pairs * NR;
                for p in 0..pairs {
                    panel[base + p * NR + lane] = src[2 * p] as u32 | (src[2 * p + 1] as u32) << 16;
                }
            }
            // y for these columns, [mp, TASK_ROWS].
            let mut yt = vec![0f32; mp * TASK_ROWS];
            for half in 0..2 {
                if half * NR >= rows {
                    break;
                }
                let pan = &panel[half * pairs * NR..(half + 1) * pairs * NR];
                for kb in (0..pairs).step_by(KC) {
                    let kn = KC.min(pairs - kb);
                    for i0 in (0..mp).step_by(MR) {
                        // SAFETY: `available()` was asserted; the x rows i0..i0 + MR exist
                        // (padded), hold pairs kb..kb + kn, the panel holds NR words for
                        // each of those pairs, and y's block is inside `yt`.
                        unsafe {
                            kernel(
                                xb.as_ptr().add(i0 * k + 2 * kb),
                                k,
                                pan.as_ptr().add(kb * NR),
                                kn,
                                yt.as_mut_ptr().add(i0 * TASK_ROWS + half * NR),
                                TASK_ROWS,
                                kb == 0,
                            )
                        };
                    }
                }
            }
            (n0, yt)
        })
        .collect();
    for (n0, yt) in tiles {
        let rows = TASK_ROWS.min(n - n0);
        for i in 0..m {
            y[i * n + n0..i * n + n0 + rows]
                .copy_from_slice(&yt[i * TASK_ROWS..i * TASK_ROWS + rows]);
        }
    }
}

/// The 12 x 32 block: `y[r, c] (+)= sum over kn pairs of x[r, pair] · panel[pair, c]`, x rows
/// `ldx` bf16 apart, y rows `ldy` floats apart; `first` overwrites instead of adding.
///
/// # Safety
/// AVX512F and AVX512-BF16 must be available; x must hold 12 rows of `2 * kn` bf16 at `ldx`
/// apart, the panel `kn * 32` words, y 12 rows of 32 floats at `ldy` apart.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn kernel(
    x: *const u16,
    ldx: usize,
    panel: *const u32,
    kn: usize,
    y: *mut f32,
    ldy: usize,
    first: bool,
) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    if !first {
        for (r, a) in acc.iter_mut().enumerate() {
            a[0] = _mm512_loadu_ps(y.add(r * ldy));
            a[1] = _mm512_loadu_ps(y.add(r * ldy + 16));
        }
    }
    let xw = x as *const u32;
    let ldw = ldx / 2;
    for p in 0..kn {
        let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(panel.add(p * NR) as *const _));
        let b1: __m512bh =
            std::mem::transmute(_mm512_loadu_si512(panel.add(p * NR + 16) as *const _));
        for (r, a) in acc.iter_mut().enumerate() {
            let xa: __m512bh = std::mem::transmute(_mm512_set1_epi32(
                xw.add(r * ldw + p).read_unaligned() as i32,
            ));
            a[0] = _mm512_dpbf16_ps(a[0], xa, b0);
            a[1] = _mm512_dpbf16_ps(a[1], xa, b1);
        }
    }
    for (r, a) in acc.iter().enumerate() {
        _mm512_storeu_ps(y.add(r * ldy), a[0]);
        _mm512_storeu_ps(y.add(r * ldy + 16), a[1]);
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn kernel(_: *const u16, _: usize, _: *const u32, _: usize, _: *mut f32, _: usize, _: bool) {
    unreachable!("available() is false off x86_64")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bf16_to_f32(b: u16) -> f32 {
        f32::from_bits((b as u32) << 16)
    }

    #[test]
    fn rounding_to_bf16_is_to_nearest_even() {
        assert_eq!(f32_to_bf16(1.0), 0x3f80);
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even (1.0).
        assert_eq!(f32_to_bf16(1.0 + 1.0 / 256.0), 0x3f80);
        // Just above halfway rounds up.
        assert_eq!(f32_to_bf16(1.0 + 1.0 / 256.0 + 1.0 / 65536.0), 0x3f81);
        assert_eq!(f32_to_bf16(-2.5), 0xc020);
        assert!(bf16_to_f32(f32_to_bf16(f32::NAN)).is_nan());
        assert_eq!(f32_to_bf16(f32::INFINITY), 0x7f80);
    }

    #[test]
    fn products_equal_a_float64_sum_of_the_rounded_inputs() {
        if !available() {
            eprintln!("no AVX512-BF16 here: the kernel is not run");
            return;
        }
        let mut s = 0x1234_5678_9abc_def0u64;
        let mut draw = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        };
        // Ragged everything: m not a multiple of 12, n of 32 or 64, k past one k block.
        for (m, n, k) in [(1, 5, 2), (13, 70, 258), (25, 64, 512), (40, 129, 900)] {
            let x: Vec<f32> = (0..m * k).map(|_| draw()).collect();
            let w: Vec<u16> = (0..n * k).map(|_| f32_to_bf16(draw())).collect();
            let mut y = vec![f32::NAN; m * n];
            gemm(&x, m, &w, n, k, &mut y);
            for i in 0..m {
                for j in 0..n {
                    let (mut want, mut scale) = (0f64, 0f64);
                    for p in 0..k {
                        let a = bf16_to_f32(f32_to_bf16(x[i * k + p])) as f64;
                        let b = bf16_to_f32(w[j * k + p]) as f64;
                        want += a * b;
                        scale += (a * b).abs();
                    }
                    let got = y[i * n + j] as f64;
                    assert!(
                        (got - want).abs() <= 1e-5 * scale + 1e-30,
                        "m {m} n {n} k {k}: y[{i}, {j}] = {got}, float64 {want}"
                    );
                }
            }
        }
    }
}
