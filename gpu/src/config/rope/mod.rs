//! Rotary position embeddings: the settings as resolved from `config.json`, how they are
//! read (a typed pass in `typed`, then kvmesh's own refusals in `read`), and the
//! frequencies they give (`freq`).

mod freq;
mod read;
#[cfg(test)]
mod tests;
mod typed;

pub(super) use read::read_rope;

/// How rotary position embeddings are scaled, with each type's own parameters.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE: `inv_freq[i] = theta^(-2i/d)`.
    Default,
    /// Position interpolation: every frequency divided by `factor`.
    Linear { factor: f64 },
    /// Dynamic NTK: past `max_position_embeddings` the base grows with the sequence length,
    /// `theta * (factor * len / max - (factor - 1))^(d / (d - 2))`; below it, plain RoPE.
    Dynamic { factor: f64 },
    /// Llama 3.1: low frequencies divided by `factor`, high ones kept, a smooth ramp between.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
    /// YaRN (Qwen2.5 / Qwen3 long context): per-frequency blend of interpolation and
    /// extrapolation over a ramp set by `beta_fast` / `beta_slow`, and cos/sin multiplied by
    /// `attention_factor` (so attention scores by its square).
    Yarn {
        factor: f64,
        original_max_position_embeddings: f64,
        beta_fast: f64,
        beta_slow: f64,
        /// Resolved: the config's own value, or the one its `factor` / `mscale` imply.
        attention_factor: f64,
        truncate: bool,
    },
}

impl RopeScaling {
    pub fn type_name(&self) -> &'static str {
        match self {
            RopeScaling::Default => "default",
            RopeScaling::Linear { .. } => "linear",
            RopeScaling::Dynamic { .. } => "dynamic",
            RopeScaling::Llama3 { .. } => "llama3",
            RopeScaling::Yarn { .. } => "yarn",
        }
    }
}

/// Which of transformers' layouts the RoPE settings were read from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeLayout {
    /// transformers 5: `rope_parameters`.
    Parameters,
    /// Older files: top-level `rope_theta` and `rope_scaling`.
    Legacy,
    /// Neither is present: plain RoPE at the default theta.
    Absent,
}

impl RopeLayout {
    pub fn describe(self) -> &'static str {
        match self {
            RopeLayout::Parameters => "rope_parameters",
            RopeLayout::Legacy => "rope_theta + rope_scaling (legacy layout)",
            RopeLayout::Absent => "none in config.json (transformers' default)",
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Rope {
    pub theta: f64,
    pub scaling: RopeScaling,
    pub layout: RopeLayout,
}

impl Rope {
    pub fn plain(theta: f64) -> Rope {
        Rope {
            theta,
            scaling: RopeScaling::Default,
            layout: RopeLayout::Parameters,
        }
    }
}
