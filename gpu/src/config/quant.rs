//! `quantization_config`: which linear layers a checkpoint stores in FP8, with which scales,
//! and how activations are meant to meet them. Two published formats are read:
//!
//! - `quant_method: "fp8"`, the block-scaled format of Qwen's and DeepSeek's `-FP8`
//!   checkpoints (transformers' `FineGrainedFP8Config`): every linear layer but the skipped
//!   ones holds an e4m3 `weight` and an f32 (or bf16) `weight_scale_inv` with one value per
//!   128x128 block, the last block of a side partial when the side is not a multiple of
//!   128 (`[ceil(out/128), ceil(in/128)]`, as DeepSeek's reference dequantizer and
//!   compressed-tensors' `FP8BlockDequantizer` read it); activations are quantized at run
//!   time per token in groups of 128. Without `modules_to_not_convert` (or its alias
//!   `ignored_layers`) transformers leaves the output head unquantized, so kvmesh does too.
//! - `quant_method: "compressed-tensors"` with `format` `float-quantized` or
//!   `naive-quantized` (llm-compressor's FP8 recipes): config groups each give a scheme and
//!   the modules it targets (`Linear`, exact names, or `re:` regexes matched from the start
//!   as Python's `re.match` does), minus the `ignore` list; weights are e4m3 with a
//!   `weight_scale` per output channel (`[out, 1]`) or per tensor (`[1]`), activations are
//!   dynamic per token, static per tensor (`input_scale`), or left unquantized.
//!
//! In both, the weight is the e4m3 value times its scale (see `crate::quant`). Every field
//! is read, known not to change the weights' meaning (calibration settings, versions), or
//! refused by name: an unknown method, format, block size, scale format, skip pattern,
//! activation scheme, strategy or KV-cache scheme is an error, never a quiet fallback to
//! running something else. Layers left unquantized stay in the dtype they are stored in.

use regex::Regex;
use serde_json::Value;

use super::error::{ConfigError, PatternError, Result};
use super::reader::shown;

/// The block side of the block-scaled format: what every published checkpoint uses and the
/// FP8 GEMMs with block scales take.
pub const FP8_BLOCK: usize = 128;

/// The format a checkpoint's quantization is written in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantMethod {
    /// `quant_method: "fp8"` (block scales, `weight_scale_inv`).
    Fp8,
    /// `quant_method: "compressed-tensors"` (`weight_scale`).
    CompressedTensors,
}

impl QuantMethod {
    pub fn name(self) -> &'static str {
        match self {
            QuantMethod::Fp8 => "fp8",
            QuantMethod::CompressedTensors => "compressed-tensors",
        }
    }
}

/// What one scale of a quantized weight covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightScale {
    /// A `rows x cols` block of the `[out, in]` weight (the last ones partial).
    Block { rows: usize, cols: usize },
    /// One output channel (a row of the weight).
    Channel,
    /// The whole tensor.
    Tensor,
}

/// How activations are meant to be quantized before they meet the FP8 weights. The CPU
/// reference computes with unquantized activations in every case; this says what a GPU's
/// FP8 GEMM must do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActivationScheme {
    /// At run time, per token, one scale per group of this many channels.
    DynamicTokenGroup(usize),
    /// At run time, one scale per token.
    DynamicToken,
    /// At run time, one scale for the whole tensor.
    DynamicTensor,
    /// One calibrated scale per layer, stored as `{layer}.input_scale`.
    StaticTensor,
    /// Weight-only: activations stay in the compute dtype.
    Unquantized,
}

/// The quantization of one linear layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Scheme {
    pub weights: WeightScale,
    pub activations: ActivationScheme,
}

impl Scheme {
    /// The suffix of the weight's scale tensor: block scales are stored inverted in name
    /// only (`weight_scale_inv` multiplies, as `weight_scale` does).
    pub fn scale_suffix(&self) -> &'static str {
        match self.weights {
            WeightScale::Block { .. } => "weight_scale_inv",
            _ => "weight_scale",
        }
    }

    /// The shapes a weight `[out, inp]`'s scale may be stored in.
    pub fn scale_shapes(&self, out: usize, inp: usize) -> Vec<Vec<usize>> {
        match self.weights {
            WeightScale::Block { rows, cols } => vec![vec![out.div_ceil(rows), inp.div_ceil(cols)]],
            WeightScale::Channel => vec![vec![out, 1], vec![out]],
            WeightScale::Tensor => vec![vec![1], vec![]],
        }
    }

    /// The shapes a static activation scale may be stored in, when the scheme has one.
    pub fn input_scale_shapes(&self) -> Option<Vec<Vec<usize>>> {
        (self.activations == ActivationScheme::StaticTensor).then(|| vec![vec![1], vec![]])
    }

    /// For messages and `model inspect`.
    pub fn describe(&self) -> String {
        let w = match self.weights {
            WeightScale::Block { rows, cols } => {
                format!("e4m3 weights, {rows}x{cols} block scales")
            }
            WeightScale::Channel => "e4m3 weights, per-channel scales".into(),
            WeightScale::Tensor => "e4m3 weights, per-tensor scale".into(),
        };
        let a = match self.activations {
            ActivationScheme::DynamicTokenGroup(g) => {
                format!("dynamic per-token-group ({g}) activations")
            }
            ActivationScheme::DynamicToken => "dynamic per-token activations".into(),
            ActivationScheme::DynamicTensor => "dynamic per-tensor activations".into(),
            ActivationScheme::StaticTensor => "static per-tensor activations".into(),
            ActivationScheme::Unquantized => "unquantized activations".into(),
        };
        format!("{w}, {a}")
    }
}

/// One entry of a skip or target list, as its format matches it against a module's name
/// (`model.layers.0.self_attn.q_proj`).
#[derive(Clone, Debug)]
pub(super) enum Pattern {
    /// transformers' `should_convert_module`: the pattern, as a regex, matches the name from
    /// its start up to a module boundary (`layers.1` matches `layers.1.mlp`, not
    /// `layers.11`), or the name ends with it as plain text.
    Hf { text: String, whole: Regex },
    /// compressed-tensors: a name without `re:` matches only itself.
    Exact(String),
    /// compressed-tensors `re:`: Python's `re.match`, anchored at the start only.
    Re { text: String, start: Regex },
    /// compressed-tensors' class target `Linear`: every linear layer.
    Linear,
}

impl Pattern {
    fn matches(&self, name: &str) -> bool {
        match self {
            Pattern::Hf { text, whole } => {
                let b = name.as_bytes();
                name.ends_with(text.as_str())
                    || (0..=b.len())
                        .filter(|&p| p == b.len() || b[p] == b'.' || (p > 0 && b[p - 1] == b'.'))
                        .any(|p| whole.is_match(&name[..p]))
            }
            Pattern::Exact(t) => t == name,
            Pattern::Re { start, .. } => start.is_match(name),
            Pattern::Linear => true,
        }
    }

    fn text(&self) -> &str {
        match self {
            Pattern::Hf { text, .. } | Pattern::Exact(text) | Pattern::Re { text, .. } => text,
            Pattern::Linear => "Linear",
        }
    }
}

/// A checkpoint's quantization, as read from its `quantization_config`.
#[derive(Clone, Debug)]
pub struct Quantization {
    pub method: QuantMethod,
    /// Schemes and the modules each targets, in the file's order.
    groups: Vec<(Vec<Pattern>, Scheme)>,
    /// Modules left in their stored dtype whatever targets them.
    ignore: Vec<Pattern>,
    /// The object as read: written back with the config.
    pub json: Value,
}

impl Quantization {
    /// The scheme of linear layer `module`, or `None` when it stays in its stored dtype.
    pub fn scheme_of(&self, module: &str) -> Option<Scheme> {
        if self.ignore.iter().any(|p| p.matches(module)) {
            return None;
        }
        self.groups
            .iter()
            .find(|(targets, _)| targets.iter().any(|p| p.matches(module)))
            .map(|&(_, s)| s)
    }

    /// Refuses a layer two groups with different schemes both claim: which one the file
    /// means is not written down.
    pub fn check_layers<'a>(&self, modules: impl IntoIterator<Item = &'a str>) -> Result<()> {
        for m in modules {
            if self.ignore.iter().any(|p| p.matches(m)) {
                continue;
            }
            let claims: Vec<&(Vec<Pattern>, Scheme)> = self
                .groups
                .iter()
                .filter(|(t, _)| t.iter().any(|p| p.matches(m)))
                .collect();
            if claims.windows(2).any(|w| w[0].1 != w[1].1) {
                let targets = claims
                    .iter()
                    .flat_map(|(t, _)| t.iter().map(|p| p.text().to_string()))
                    .collect();
                return Err(ConfigError::AmbiguousLayer {
                    layer: m.to_string(),
                    targets,
                });
            }
        }
        Ok(())
    }

    /// The method and its weight scales, short: `quant_method fp8, block 128x128`.
    pub fn summary(&self) -> String {
        let mut scales: Vec<String> = Vec::new();
        for (_, s) in &self.groups {
            let d = match s.weights {
                WeightScale::Block { rows, cols } => format!("block {rows}x{cols}"),
                WeightScale::Channel => "per-channel".into(),
                WeightScale::Tensor => "per-tensor".into(),
            };
            if !scales.contains(&d) {
                scales.push(d);
            }
        }
        format!(
            "quant_method {}, {}",
            self.method.name(),
            scales.join(" and ")
        )
    }

    /// One line: the method and each scheme.
    pub fn describe(&self) -> String {
        let mut schemes: Vec<String> = Vec::new();
        for (_, s) in &self.groups {
            let d = s.describe();
            if !schemes.contains(&d) {
                schemes.push(d);
            }
        }
        format!("{} ({})", self.method.name(), schemes.join("; "))
    }
}

/// Null, false or empty: the field turns nothing on.
pub(super) fn off(v: Option<&Value>) -> bool {
    match v {
        None | Some(Value::Null) | Some(Value::Bool(false)) => true,
        Some(Value::Array(a)) => a.is_empty(),
        Some(Value::Object(o)) => o.is_empty(),
        _ => false,
    }
}

/// A list of pattern strings at `field`, each compiled by `make`.
pub(super) fn patterns(
    field: &str,
    v: &Value,
    make: impl Fn(&str) -> std::result::Result<Pattern, PatternError>,
) -> Result<Vec<Pattern>> {
    let list = v.as_array().ok_or_else(|| ConfigError::Quant {
        field: field.to_string(),
        value: shown(v),
        why: "expected a list of module names or patterns",
    })?;
    list.iter()
        .map(|p| {
            let s = p.as_str().ok_or_else(|| ConfigError::Quant {
                field: field.to_string(),
                value: shown(v),
                why: "every entry must be a string",
            })?;
            make(s).map_err(|why| ConfigError::UnreadablePattern {
                field: field.to_string(),
                value: shown(p),
                why,
            })
        })
        .collect()
}

/// A compressed-tensors target or ignore entry (see [`Pattern::Exact`], [`Pattern::Re`],
/// [`Pattern::Linear`]). Other class names (a decoder layer's, an attention module's) would
/// target modules that are not linear layers, which the format does not quantize.
pub(super) fn ct_pattern(s: &str, is_target: bool) -> std::result::Result<Pattern, PatternError> {
    if let Some(re) = s.strip_prefix("re:") {
        let start = Regex::new(&format!("^(?:{re})")).map_err(PatternError::CtRegex)?;
        return Ok(Pattern::Re {
            text: s.to_string(),
            start,
        });
    }
    if s == "Linear" {
        return Ok(Pattern::Linear);
    }
    let is_class = s.chars().next().is_some_and(char::is_uppercase) && !s.contains('.');
    if is_target && is_class {
        return Err(PatternError::ClassTarget(s.to_string()));
    }
    Ok(Pattern::Exact(s.to_string()))
}

/// Builds a quantization from its parts (see `quant_read` and `quant_ct`).
pub(super) fn quantization(
    method: QuantMethod,
    groups: Vec<(Vec<Pattern>, Scheme)>,
    ignore: Vec<Pattern>,
    json: Value,
) -> Quantization {
    Quantization {
        method,
        groups,
        ignore,
        json,
    }
}
