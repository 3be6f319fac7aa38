//! What a prefill costs in arithmetic, and what this CPU can do of it: the model's FLOPs per
//! prompt, and the cores' peak rates for the two kinds of product the CPU engine runs — f32
//! fused multiply-adds (the reference numerics) and bf16 dot products (`vdpbf16ps`, what
//! `--cpu-bf16-products` and llama.cpp use for bf16 weights). A bench program prints a
//! prefill's rate as a share of these, as the GPU bench prints a share of the GEMM peak.

use std::time::Instant;

use kvmesh_gpu::config::ModelConfig;
use rayon::prelude::*;

/// FLOPs of a `len`-token prefill that wants one row of logits: 2 × the linear layers'
/// parameters per token (not the embedding; the LM head for one row), plus causal
/// attention's 4 × q_dim × T²/2 per softmax-attention layer; in a hybrid model (Qwen3.5)
/// only its full-attention layers have that, and each linear-attention layer's delta rule
/// costs 6 × dk × dv per value head per token (decay, Sᵀk, the rank-one update, Sᵀq).
pub fn prefill_flops(cfg: &ModelConfig, len: usize) -> f64 {
    let head = cfg.vocab_size * cfg.hidden_size;
    let embed_and_head = if cfg.tie_word_embeddings {
        head
    } else {
        2 * head
    };
    let linear = (cfg.num_params() - embed_and_head) as f64;
    let t = len as f64;
    let (full, delta) = match &cfg.hybrid {
        Some(h) => (
            h.num_full_layers(),
            6.0 * (h.num_linear_layers()
                * h.linear_num_value_heads
                * h.linear_key_head_dim
                * h.linear_value_head_dim) as f64
                * t,
        ),
        None => (cfg.num_layers, 0.0),
    };
    let attn = 4.0 * (full * cfg.q_dim()) as f64 * t * t / 2.0;
    2.0 * linear * t + 2.0 * head as f64 + attn + delta
}

/// Peak arithmetic rates, FLOP/s, with every rayon thread busy. `None`: the CPU lacks the
/// instructions (the probes use AVX-512F and AVX512-BF16).
#[derive(Clone, Copy, Debug)]
pub struct ComputePeaks {
    /// f32 fused multiply-adds, 16 lanes, 2 FLOP each.
    pub f32_fma: Option<f64>,
    /// `vdpbf16ps`: 16 lanes, each two bf16 products added to an f32, 4 FLOP each.
    pub bf16_dot: Option<f64>,
}

/// Instructions each thread issues per probe pass; at the peak a pass lasts ~0.1 s.
const PROBE_OPS: u64 = 1 << 26;

impl ComputePeaks {
    /// Best of three passes of each probe.
    pub fn measure() -> ComputePeaks {
        let best = |f: fn(u64) -> f32, flop_per_op: f64| {
            (0..3)
                .map(|_| {
                    let threads = rayon::current_num_threads();
                    let t = Instant::now();
                    let sums: Vec<f32> =
                        (0..threads).into_par_iter().map(|_| f(PROBE_OPS)).collect();
                    std::hint::black_box(sums);
                    (threads as u64 * PROBE_OPS) as f64 * flop_per_op / t.elapsed().as_secs_f64()
                })
                .fold(0f64, f64::max)
        };
        #[cfg(target_arch = "x86_64")]
        {
            let f32_fma =
                std::arch::is_x86_feature_detected!("avx512f").then(|| best(probe::f32_fma, 32.0));
            let bf16_dot = (std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bf16"))
            .then(|| best(probe::bf16_dot, 64.0));
            ComputePeaks { f32_fma, bf16_dot }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = best;
            ComputePeaks {
                f32_fma: None,
                bf16_dot: None,
            }
        }
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "f32_fma_gflop_s": self.f32_fma.map(|f| f / 1e9),
            "bf16_dot_gflop_s": self.bf16_dot.map(|f| f / 1e9),
            "note": "every thread issuing independent 512-bit vfmadd231ps / vdpbf16ps (12 accumulators, no loads): the cores' arithmetic peak, which no GEMM reaches",
        })
    }
}

#[cfg(target_arch = "x86_64")]
mod probe {
    use std::arch::x86_64::*;

    /// Twelve independent accumulators hide the instruction's latency on both FMA pipes.
    const ACC: usize = 12;

    /// `ops` 512-bit f32 FMAs (rounded down to a multiple of 12); returns a sum so that the
    /// work is not optimised away.
    pub fn f32_fma(ops: u64) -> f32 {
        // SAFETY: only called where AVX-512F was detected.
        unsafe { f32_fma_avx512(ops) }
    }

    #[target_feature(enable = "avx512f")]
    fn f32_fma_avx512(ops: u64) -> f32 {
        let b = _mm512_set1_ps(0.999_999);
        let c = _mm512_set1_ps(1e-7);
        let mut a = [_mm512_set1_ps(1.0); ACC];
        for _ in 0..ops / ACC as u64 {
            for x in &mut a {
                *x = _mm512_fmadd_ps(*x, b, c);
            }
        }
        a.iter().map(|&x| _mm512_reduce_add_ps(x)).sum()
    }

    /// `ops` 512-bit `vdpbf16ps` (rounded down to a multiple of 12).
    pub fn bf16_dot(ops: u64) -> f32 {
        // SAFETY: only called where AVX-512F and AVX512-BF16 were detected.
        unsafe { bf16_dot_avx512(ops) }
    }

    #[target_feature(enable = "avx512f,avx512bf16")]
    fn bf16_dot_avx512(ops: u64) -> f32 {
        // bf16 1.0 and 2^-20 in every half: the sums grow slowly and stay finite.
        let b: __m512bh = unsafe { std::mem::transmute(_mm512_set1_epi16(0x3f80)) };
        let c: __m512bh = unsafe { std::mem::transmute(_mm512_set1_epi16(0x3580)) };
        let mut a = [_mm512_setzero_ps(); ACC];
        for _ in 0..ops / ACC as u64 {
            for x in &mut a {
                *x = _mm512_dpbf16_ps(*x, b, c);
            }
        }
        a.iter().map(|&x| _mm512_reduce_add_ps(x)).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvmesh_gpu::init::preset;

    #[test]
    fn prefill_flops_count_the_linear_layers_and_causal_attention() {
        let cfg = preset(None, "qwen2.5-0.5b").unwrap();
        // Qwen2.5-0.5B: 494M parameters, 136M of them the (tied) embedding: each prompt token
        // costs 2 x 358M, and the one row of logits 2 x 136M once.
        let per_token = prefill_flops(&cfg, 2) - prefill_flops(&cfg, 1);
        assert!(
            (0.71e9..0.72e9).contains(&per_token),
            "{per_token:e} FLOP a token"
        );
        let head = prefill_flops(&cfg, 1) - per_token;
        assert!(
            (0.27e9..0.28e9).contains(&head),
            "{head:e} FLOP for the logits"
        );
        // Doubling the prompt more than doubles the cost: attention grows as T².
        let (a, b) = (prefill_flops(&cfg, 2048), prefill_flops(&cfg, 4096));
        assert!(b > 2.1 * a && b < 2.5 * a, "{a:e} → {b:e}");
    }

    #[test]
    fn a_hybrid_models_attention_is_its_full_layers_and_its_delta_rule_linear_in_t() {
        let cfg = preset(None, "qwen3.5-9b").unwrap();
        let h = cfg.hybrid.as_ref().unwrap();
        assert_eq!((h.num_full_layers(), h.num_linear_layers()), (8, 24));
        // The T² term comes from 8 layers of 16 x 256 query columns, not 32.
        let f = |t| prefill_flops(&cfg, t);
        let t2 = (f(4096) - 2.0 * f(2048) + f(0)) / (2.0 * 2048.0 * 2048.0);
        let want = 4.0 * 8.0 * 4096.0 / 2.0;
        assert!((t2 / want - 1.0).abs() < 1e-6, "{t2} vs {want}");
    }

    #[test]
    fn the_peaks_are_positive_where_the_instructions_exist() {
        let p = ComputePeaks::measure();
        #[cfg(target_arch = "x86_64")]
        {
            assert_eq!(
                p.f32_fma.is_some(),
                std::arch::is_x86_feature_detected!("avx512f")
            );
            if let (Some(f), Some(b)) = (p.f32_fma, p.bf16_dot) {
                // Both finite and above a gigaFLOP/s; which is larger depends on the CPU.
                assert!(
                    f > 1e9 && b > 1e9 && f.is_finite() && b.is_finite(),
                    "{p:?}"
                );
            }
        }
        assert!(p.json()["note"].is_string());
    }
}
