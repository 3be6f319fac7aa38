//! `exp` over slices, 16 lanes at a time on AVX-512: the softmax of a prompt's attention and
//! the MLP's SiLU. A 2,048-token prefill of the Qwen2.5-0.5B shape takes about 10^9 of them;
//! through libm's scalar `expf` they were a tenth of the `perf` profile.
//!
//! Every level computes the same function: `exp(x) = 2^n · p(r)`, `n = round(x · log2 e)`,
//! `r = x − n · ln 2` (ln 2 split in two so `r` is exact), `p` the degree-7 Taylor
//! polynomial of `exp` on `|r| ≤ ln 2 / 2` (truncation under 2^-29 relative), then the
//! exponent applied by `vscalefps` (AVX-512) or by building `2^n` in two halves (portable),
//! which keeps subnormal results and turns `x ≤ -150` into 0. Relative error is within a few
//! ulp of libm's; the tests hold each level to `f64::exp`.

use super::ops::Isa;

const LOG2E: f32 = std::f32::consts::LOG2_E;
/// ln 2 = LN2_HI + LN2_LO, LN2_HI with trailing zero bits so `n · LN2_HI` is exact.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// Below this exp underflows to 0 in f32 (and above the next it overflows).
const MIN_X: f32 = -150.0;
const MAX_X: f32 = 88.8;
/// 1/k! for k = 7 down to 2.
const C: [f32; 6] = [
    1.0 / 5040.0,
    1.0 / 720.0,
    1.0 / 120.0,
    1.0 / 24.0,
    1.0 / 6.0,
    0.5,
];

/// `p(r) = 1 + r + r²/2! + … + r⁷/7!` by Horner's rule.
#[inline(always)]
fn poly(r: f32) -> f32 {
    let mut p = C[0];
    for c in &C[1..] {
        p = p.mul_add(r, *c);
    }
    p = p.mul_add(r, 1.0);
    p.mul_add(r, 1.0)
}

/// exp(x), the portable level (NaN stays NaN).
#[inline]
pub fn exp(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    let x = x.clamp(MIN_X, MAX_X);
    let n = (x * LOG2E).round();
    let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, x));
    let p = poly(r);
    // 2^n in two factors, each a normal f32, so subnormal results come out right.
    let n = n as i32;
    let (a, b) = (n / 2, n - n / 2);
    let pow2 = |e: i32| f32::from_bits(((e + 127) as u32) << 23);
    p * pow2(a) * pow2(b)
}

/// `xs[i] = exp(xs[i] − shift)`; returns their sum.
pub fn exp_shifted(xs: &mut [f32], shift: f32) -> f32 {
    exp_shifted_with(Isa::detected(), xs, shift)
}

/// [`exp_shifted`] on the kernels of `isa` (at most [`Isa::detected`]).
pub fn exp_shifted_with(isa: Isa, xs: &mut [f32], shift: f32) -> f32 {
    debug_assert!(isa <= Isa::detected());
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 {
        // SAFETY: AVX-512F was detected (`isa` is at most what was).
        return unsafe { exp_shifted_avx512(xs, shift) };
    }
    let mut sum = 0f32;
    for x in xs {
        *x = exp(*x - shift);
        sum += *x;
    }
    sum
}

/// `out[i] = silu(gate[i]) · up[i]`, `silu(x) = x / (1 + exp(−x))`.
pub fn silu_mul(out: &mut [f32], gate: &[f32], up: &[f32]) {
    silu_mul_with(Isa::detected(), out, gate, up)
}

/// [`silu_mul`] on the kernels of `isa` (at most [`Isa::detected`]).
pub fn silu_mul_with(isa: Isa, out: &mut [f32], gate: &[f32], up: &[f32]) {
    debug_assert!(isa <= Isa::detected());
    assert!(gate.len() == out.len() && up.len() == out.len());
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 {
        // SAFETY: AVX-512F was detected; the three slices have one length (checked).
        return unsafe { silu_mul_avx512(out, gate, up) };
    }
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = g / (1.0 + exp(-g)) * u;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn exp16(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    // NaN lanes pass through unchanged (max/min would drop them).
    let nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    let xc = _mm512_min_ps(
        _mm512_max_ps(x, _mm512_set1_ps(MIN_X)),
        _mm512_set1_ps(MAX_X),
    );
    let n = _mm512_roundscale_ps(
        _mm512_mul_ps(xc, _mm512_set1_ps(LOG2E)),
        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
    );
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), xc);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
    let mut p = _mm512_set1_ps(C[0]);
    for c in &C[1..] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(*c));
    }
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0));
    _mm512_mask_blend_ps(nan, _mm512_scalef_ps(p, n), x)
}

/// # Safety
/// AVX-512F must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn exp_shifted_avx512(xs: &mut [f32], shift: f32) -> f32 {
    use std::arch::x86_64::*;
    let s = _mm512_set1_ps(shift);
    let mut acc = _mm512_setzero_ps();
    let mut chunks = xs.chunks_exact_mut(16);
    for c in &mut chunks {
        let e = exp16(_mm512_sub_ps(_mm512_loadu_ps(c.as_ptr()), s));
        _mm512_storeu_ps(c.as_mut_ptr(), e);
        acc = _mm512_add_ps(acc, e);
    }
    let rest = chunks.into_remainder();
    if !rest.is_empty() {
        let m: __mmask16 = (1u32 << rest.len()).wrapping_sub(1) as __mmask16;
        let v = _mm512_maskz_loadu_ps(m, rest.as_ptr());
        let e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(v, s)));
        _mm512_mask_storeu_ps(rest.as_mut_ptr(), m, e);
        acc = _mm512_add_ps(acc, e);
    }
    _mm512_reduce_add_ps(acc)
}

/// # Safety
/// AVX-512F must be available and the slices of one length.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn silu_mul_avx512(out: &mut [f32], gate: &[f32], up: &[f32]) {
    use std::arch::x86_64::*;
    let one = _mm512_set1_ps(1.0);
    let step = |o: *mut f32, g: *const f32, u: *const f32, m: __mmask16| {
        let gv = _mm512_maskz_loadu_ps(m, g);
        let uv = _mm512_maskz_loadu_ps(m, u);
        let e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        let y = _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e)), uv);
        _mm512_mask_storeu_ps(o, m, y);
    };
    let n = out.len();
    let mut i = 0;
    while i < n {
        let left = n - i;
        let m: __mmask16 = if left >= 16 {
            0xffff
        } else {
            (1u32 << left).wrapping_sub(1) as __mmask16
        };
        step(
            out.as_mut_ptr().add(i),
            gate.as_ptr().add(i),
            up.as_ptr().add(i),
            m,
        );
        i += 16;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Relative error against f64's exp, in f32 ulps of the result.
    fn ulps(got: f32, x: f32) -> f64 {
        let want = (x as f64).exp();
        if want == 0.0 || got == 0.0 {
            return if (got as f64 - want).abs() < 1e-44 {
                0.0
            } else {
                f64::INFINITY
            };
        }
        let ulp = f32::EPSILON as f64 * want.abs().max(f32::MIN_POSITIVE as f64);
        (got as f64 - want).abs() / ulp
    }

    fn samples() -> Vec<f32> {
        let mut xs: Vec<f32> = (-20_000..=8_800).map(|i| i as f32 / 100.0).collect();
        xs.extend([-0.0, 1e-7, -1e-7, -87.3, -103.0, -149.0, -200.0, 88.7]);
        xs
    }

    #[test]
    fn every_level_is_within_a_few_ulp_of_f64() {
        let xs = samples();
        for isa in Isa::available() {
            let mut got = xs.clone();
            let sum = exp_shifted_with(isa, &mut got, 0.0);
            let mut worst = 0f64;
            for (&g, &x) in got.iter().zip(&xs) {
                // Normal results: a few ulp; subnormal ones: within the smallest normal's.
                let e = ulps(g, x);
                if (x as f64).exp() >= f32::MIN_POSITIVE as f64 {
                    worst = worst.max(e);
                    assert!(e <= 4.0, "{isa:?}: exp({x}) = {g}, {e:.1} ulp");
                } else {
                    let want = (x as f64).exp();
                    assert!(
                        (g as f64 - want).abs()
                            <= 2.0 * f32::MIN_POSITIVE as f64 * f32::EPSILON as f64 + want * 1e-6,
                        "{isa:?}: exp({x}) = {g}, want {want}"
                    );
                }
            }
            assert!(
                sum.is_infinite(),
                "{isa:?}: values near f32::MAX sum past it"
            );
            // The returned sum, over a softmax's range.
            let mut small: Vec<f32> = (0..1000).map(|i| -(i as f32) / 50.0).collect();
            let sum = exp_shifted_with(isa, &mut small, 0.0);
            let want: f64 = small.iter().map(|&v| v as f64).sum();
            assert!(
                ((sum as f64) - want).abs() <= 1e-5 * want,
                "{isa:?}: sum {sum}, {want}"
            );
            println!("{isa:?}: worst {worst:.2} ulp over {} points", xs.len());
        }
    }

    #[test]
    fn shifts_nan_infinities_and_tails_are_handled_on_every_level() {
        for isa in Isa::available() {
            // 37 values: two whole vectors and a tail of 5.
            let mut v: Vec<f32> = (0..37).map(|i| -(i as f32) * 0.5).collect();
            v[3] = f32::NEG_INFINITY;
            v[4] = f32::NAN;
            let mut got = v.clone();
            exp_shifted_with(isa, &mut got, 2.0);
            for (i, (&g, &x)) in got.iter().zip(&v).enumerate() {
                match i {
                    3 => assert_eq!(g, 0.0, "{isa:?}: exp(-inf)"),
                    4 => assert!(g.is_nan(), "{isa:?}: exp(NaN)"),
                    _ => assert!(ulps(g, x - 2.0) <= 4.0, "{isa:?}: element {i}"),
                }
            }
            let mut big = [100.0f32, 89.0];
            exp_shifted_with(isa, &mut big, 0.0);
            assert!(
                big.iter().all(|x| x.is_infinite() && *x > 0.0),
                "{isa:?}: {big:?}"
            );
        }
    }

    #[test]
    fn silu_mul_matches_f64_on_every_level() {
        let gate: Vec<f32> = (0..1001).map(|i| (i as f32 - 500.0) / 37.0).collect();
        let up: Vec<f32> = (0..1001)
            .map(|i| ((i * 7919) % 200) as f32 / 50.0 - 2.0)
            .collect();
        for isa in Isa::available() {
            let mut out = vec![f32::NAN; gate.len()];
            silu_mul_with(isa, &mut out, &gate, &up);
            for i in 0..gate.len() {
                let g = gate[i] as f64;
                let want = g / (1.0 + (-g).exp()) * up[i] as f64;
                assert!(
                    (out[i] as f64 - want).abs() <= 1e-6 * want.abs() + 1e-30,
                    "{isa:?}: silu({}) * {} = {}, want {want}",
                    gate[i],
                    up[i],
                    out[i]
                );
            }
        }
    }
}
