//! The inverse frequencies each RoPE type gives, computed in f64 the way transformers'
//! rotary embedding computes them, then rounded to f32 once.

use std::f64::consts::PI;

use super::RopeScaling;
use crate::config::model::ModelConfig;

impl ModelConfig {
    /// Inverse frequencies for rotary embeddings at positions within
    /// `max_position_embeddings` (for every RoPE type but `dynamic`, at any position).
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        self.rope_inv_freq_for_len(0)
    }

    /// Inverse frequencies for a forward pass over a sequence `seq_len` tokens long: only
    /// `dynamic` RoPE looks at the length, as transformers' rotary embedding does when it
    /// recomputes its frequencies for the longest position in the pass.
    pub fn rope_inv_freq_for_len(&self, seq_len: usize) -> Vec<f32> {
        let d = self.rotary_dim();
        let theta = self.rope.theta;
        let freqs: Vec<f64> = match &self.rope.scaling {
            RopeScaling::Default => plain(theta, d),
            RopeScaling::Linear { factor } => plain(theta, d).iter().map(|f| f / factor).collect(),
            RopeScaling::Dynamic { factor } => {
                let max = self.max_position_embeddings as f64;
                let len = (seq_len as f64).max(max);
                let base = theta
                    * ((factor * len / max) - (factor - 1.0)).powf(d as f64 / (d as f64 - 2.0));
                plain(base, d)
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => llama3(
                plain(theta, d),
                *factor,
                (*low_freq_factor, *high_freq_factor),
                *original_max_position_embeddings,
            ),
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: orig,
                beta_fast,
                beta_slow,
                truncate,
                ..
            } => {
                let (low, high) = yarn_ramp(theta, d, *orig, (*beta_fast, *beta_slow), *truncate);
                plain(theta, d)
                    .into_iter()
                    .enumerate()
                    .map(|(i, extrapolated)| {
                        let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                        let keep = 1.0 - ramp;
                        let interpolated = extrapolated / factor;
                        interpolated * (1.0 - keep) + extrapolated * keep
                    })
                    .collect()
            }
        };
        freqs.into_iter().map(|f| f as f32).collect()
    }
}

/// Plain RoPE over a head of `d` dimensions: `base^(-2i/d)`.
fn plain(base: f64, d: usize) -> Vec<f64> {
    (0..d / 2)
        .map(|i| 1.0 / base.powf((2 * i) as f64 / d as f64))
        .collect()
}

/// Llama 3.1: wavelengths shorter than `old / high_freq_factor` kept, longer than
/// `old / low_freq_factor` divided by `factor`, a smooth blend between.
fn llama3(plain: Vec<f64>, factor: f64, (low, high): (f64, f64), old: f64) -> Vec<f64> {
    let low_wavelen = old / low;
    let high_wavelen = old / high;
    plain
        .into_iter()
        .map(|base| {
            let wavelen = 2.0 * PI / base;
            if wavelen < high_wavelen {
                base
            } else if wavelen > low_wavelen {
                base / factor
            } else {
                let smooth = (old / wavelen - low) / (high - low);
                (1.0 - smooth) * base / factor + smooth * base
            }
        })
        .collect()
}

/// YaRN's ramp: the dimensions between which frequencies go from kept (extrapolated) to
/// divided by the factor (interpolated), set by how often they turn over the original context.
fn yarn_ramp(
    theta: f64,
    d: usize,
    orig: f64,
    (beta_fast, beta_slow): (f64, f64),
    truncate: bool,
) -> (f64, f64) {
    let dim = d as f64;
    // The dimension at which a frequency turns `rotations` times over the original context.
    let correction_dim =
        |rotations: f64| dim * (orig / (rotations * 2.0 * PI)).ln() / (2.0 * theta.ln());
    let (mut low, mut high) = (correction_dim(beta_fast), correction_dim(beta_slow));
    if truncate {
        low = low.floor();
        high = high.ceil();
    }
    let low = low.max(0.0);
    let mut high = high.min(dim - 1.0);
    if low == high {
        high += 0.001;
    }
    (low, high)
}

#[cfg(test)]
mod tests {
    use crate::config::testing::{llama, qwen2};

    #[test]
    fn llama3_scaling_keeps_high_freqs_and_divides_low_ones() {
        let plain = llama(r#","rope_theta":500000.0"#).unwrap().rope_inv_freq();
        let scaled = llama(
            r#","rope_theta":500000.0,"rope_scaling":{"rope_type":"llama3","factor":32.0,
               "low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":8192}"#,
        )
        .unwrap()
        .rope_inv_freq();
        assert_eq!(plain[0], scaled[0]);
        let last = plain.len() - 1;
        assert!((plain[last] / 32.0 - scaled[last]).abs() < 1e-12);
    }

    #[test]
    fn linear_divides_every_frequency() {
        let plain = llama("").unwrap().rope_inv_freq();
        let lin = llama(r#","rope_scaling":{"type":"linear","factor":4.0}"#).unwrap();
        for (a, b) in plain.iter().zip(lin.rope_inv_freq()) {
            assert!((a / 4.0 - b).abs() <= 1e-7 * a);
        }
        assert_eq!(lin.max_context(), 256);
    }

    #[test]
    fn dynamic_is_plain_within_the_context_and_grows_the_base_past_it() {
        let c = llama(r#","rope_scaling":{"type":"dynamic","factor":2.0}"#).unwrap();
        let plain = llama("").unwrap().rope_inv_freq();
        assert_eq!(c.rope_inv_freq_for_len(64), plain);
        assert_eq!(c.rope_inv_freq_for_len(10), plain);
        let long = c.rope_inv_freq_for_len(100);
        // base' = 10000 * (2 * 100 / 64 - 1)^(64 / 62)
        let base = 10000f64 * (2.0f64 * 100.0 / 64.0 - 1.0).powf(64.0 / 62.0);
        let want = base.powf(-2.0 / 64.0);
        assert!(
            (long[1] as f64 - want).abs() < 1e-6 * want,
            "{} vs {want}",
            long[1]
        );
        assert!(long[1] < plain[1]);
        assert!(c.rope_depends_on_length());
        assert_eq!(c.max_context(), 128);
    }

    #[test]
    fn yarn_blends_frequencies_and_scales_attention() {
        let c = qwen2(
            r#","rope_parameters":{"rope_type":"yarn","rope_theta":10000.0,"factor":4.0,
               "original_max_position_embeddings":32}"#,
        )
        .unwrap();
        let plain = qwen2("").unwrap().rope_inv_freq();
        let y = c.rope_inv_freq();
        // The highest frequencies turn many times over 32 positions: kept.
        assert_eq!(y[0], plain[0]);
        // The lowest turns less than once: interpolated, divided by the factor.
        let last = y.len() - 1;
        assert!((y[last] - plain[last] / 4.0).abs() < 1e-9);
        let af = 0.1 * 4f64.ln() + 1.0;
        assert!((c.rope_attention_factor() - af).abs() < 1e-12);
        assert!((c.attention_scale() - ((af * af) / 4.0) as f32).abs() < 1e-7);
        assert_eq!(c.max_context(), 128);
        // mscale / mscale_all_dim (DeepSeek style) and an explicit attention_factor.
        let m = qwen2(
            r#","rope_scaling":{"type":"yarn","factor":4.0,"original_max_position_embeddings":32,
               "mscale":1.0,"mscale_all_dim":1.0}"#,
        )
        .unwrap();
        assert_eq!(m.rope_attention_factor(), 1.0);
        let e = qwen2(
            r#","rope_scaling":{"type":"yarn","factor":4.0,"original_max_position_embeddings":32,
               "attention_factor":1.5}"#,
        )
        .unwrap();
        assert_eq!(e.rope_attention_factor(), 1.5);
    }
}
