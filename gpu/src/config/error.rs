//! Why a `config.json` is refused: one variant per rule of the reader, each holding the
//! values its message shows. The message is the whole explanation (the field, its value and
//! what kvmesh reads instead); `EngineError::Config` prefixes it with `model: config.json:`.
//!
//! Values shown as they stand in the file are kept as that text (`value: String`, cut short
//! as `reader::shown` cuts it); numbers kvmesh computed with are kept as numbers.

use thiserror::Error;

/// The result of a read that may refuse the file.
pub(crate) type Result<T, E = ConfigError> = std::result::Result<T, E>;

/// Appended to every refusal of an unknown or ambiguous family.
const SUPPORTED: &str = "kvmesh runs LlamaForCausalLM (llama), Qwen2ForCausalLM (qwen2), \
                         Qwen3ForCausalLM (qwen3), MistralForCausalLM (mistral), and \
                         Qwen3.5's text model: Qwen3_5ForCausalLM (qwen3_5_text) or \
                         Qwen3_5ForConditionalGeneration (qwen3_5)";

#[derive(Debug, Error)]
pub enum ConfigError {
    // The file and its top-level fields.
    /// The file is not JSON.
    #[error("not valid JSON: {0}")]
    NotJson(serde_json::Error),
    /// The file is JSON but not an object.
    #[error("expected a JSON object at the top level")]
    NotAnObject,
    /// A value of the wrong type: `field` names it (`rope_scaling.factor` inside a dict).
    #[error("`{field}` is {value}; expected {expected}")]
    Mistyped {
        field: String,
        value: String,
        expected: &'static str,
    },
    /// A field the model cannot be built without.
    #[error("missing `{field}`")]
    Missing { field: String },
    /// A field set that the family does not read and that may change the math.
    #[error(
        "`{field}` = {value} is not a field kvmesh knows for {model_type} models, and it may \
         change the model's math, so the model is refused rather than run differently from \
         how it was trained. If it does not change the forward pass, delete it from config.json"
    )]
    UnknownField {
        field: String,
        value: String,
        model_type: &'static str,
    },
    /// A quantized checkpoint of a family (or a `compression_config`) kvmesh reads no
    /// quantization for. `method`: the `quant_method` (or `format`) as shown, when given.
    #[error(
        "the checkpoint is quantized ({}); kvmesh reads FP8 `quantization_config`s (of Llama, \
         Qwen2, Qwen3, Mistral and Qwen3.5 models) only, and otherwise bf16, f16 and f32 \
         weights",
        quantized_what(.method, .value)
    )]
    QuantizedModel {
        method: Option<String>,
        value: String,
    },
    /// An encoder-decoder switch (or pruned heads) turned on.
    #[error("`{field}` is {value}; kvmesh runs decoder-only models")]
    NotDecoderOnly { field: String, value: String },

    // The family.
    #[error(
        "unsupported architecture {architecture:?} (model_type {model_type:?}); {}",
        SUPPORTED
    )]
    UnknownArchitecture {
        architecture: String,
        model_type: String,
    },
    #[error(
        "`architectures` names several classes {names:?}; a checkpoint for kvmesh names one: {}",
        SUPPORTED
    )]
    SeveralArchitectures { names: Vec<String> },
    #[error(
        "unsupported model_type {model_type:?} (architectures {architectures:?}); {}",
        SUPPORTED
    )]
    UnknownModelType {
        model_type: String,
        architectures: Vec<String>,
    },
    /// `architectures` and `model_type` name different families.
    #[error(
        "`architectures` says {architecture} but `model_type` says {model_type:?}; transformers \
         builds the model from model_type, so the file is ambiguous: make them agree"
    )]
    FamilyMismatch {
        architecture: &'static str,
        model_type: &'static str,
    },
    #[error("neither `architectures` nor `model_type` is set; {}", SUPPORTED)]
    NoFamily,
    /// An entry of `architectures` that is not a class name.
    #[error("`architectures` holds {value}; expected class names")]
    ArchitectureNotAName { value: String },
    /// Qwen3.5's mixture-of-experts variants, by what names them (`what`).
    #[error(
        "{what} is a Qwen3.5 mixture-of-experts model; kvmesh runs the dense Qwen3.5 models \
         (Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration) and does not implement expert \
         routing yet"
    )]
    MoeRefused { what: String },

    // The shape.
    #[error("zero hidden_size or num_attention_heads")]
    ZeroWidth,
    #[error("num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")]
    KvHeads { heads: usize, kv_heads: usize },
    #[error("head_dim is {head_dim}; rotary embeddings need an even, non-zero head size")]
    HeadDim { head_dim: usize },
    #[error(
        "`hidden_act` is {act:?}; the families kvmesh runs use silu (SwiGLU), and it \
         implements no other activation"
    )]
    Activation { act: String },
    /// A size that must be positive is 0.
    #[error("`{field}` is 0")]
    Zero { field: String },
    #[error("`rms_norm_eps` is {eps}; expected a small positive number")]
    RmsNormEps { eps: f64 },
    #[error("dynamic RoPE needs head_dim above 2")]
    DynamicRopeHeadDim,
    /// `layer_types` and `num_hidden_layers` disagree (every family that has both).
    #[error("`layer_types` lists {listed} layers but num_hidden_layers is {num_layers}")]
    LayerCount { listed: usize, num_layers: usize },

    // Sliding windows.
    #[error(
        "`sliding_window` is {value} on a llama model; Llama attends over the whole context \
         (transformers' Llama ignores the field, so a window here means the checkpoint is \
         something else)"
    )]
    LlamaWindow { value: String },
    #[error(
        "`layer_types` is {value} on a mistral model; transformers' Mistral applies one window \
         to every layer and ignores per-layer types (those are Ministral's)"
    )]
    MistralLayerTypes { value: String },
    #[error(
        "`layer_types[{layer}]` is sliding_attention but use_sliding_window is false; \
         transformers would then find no window size"
    )]
    SlidingWithoutWindow { layer: usize },
    #[error("use_sliding_window is true but `sliding_window` is null; name the window size")]
    NoWindowSize,
    #[error("`sliding_window` is 0; expected a window of at least 1 token")]
    ZeroWindow,
    /// A dense family's layer type other than full or sliding attention.
    #[error(
        "`layer_types[{layer}]` is {value}; kvmesh runs full_attention and sliding_attention layers"
    )]
    UnknownLayerType { layer: usize, value: String },

    // Qwen3.5.
    /// `architectures` names the other layout's class. `fields`: where this file has them.
    #[error(
        "`architectures` names {named} but the file has the layout {layout} writes (fields \
         {fields}); make them agree"
    )]
    LayoutMismatch {
        named: String,
        layout: &'static str,
        fields: &'static str,
    },
    #[error(
        "model_type is \"qwen3_5\" (Qwen3_5ForConditionalGeneration) but there is no \
         `text_config`; that class keeps the text model's fields there"
    )]
    NoTextConfig,
    #[error(
        "model_type is \"qwen3_5_text\" (Qwen3_5ForCausalLM, fields at the top level) but the \
         file nests a `text_config`; make them agree"
    )]
    NestedTextConfig,
    #[error(
        "`text_config.model_type` is {model_type:?}; a Qwen3.5 checkpoint's text model is \
         \"qwen3_5_text\""
    )]
    TextModelType { model_type: String },
    #[error(
        "`{field}` = {value} is not a field kvmesh knows at the top level of a \
         Qwen3_5ForConditionalGeneration config (it reads `text_config`), and it may change \
         the model's math, so the model is refused"
    )]
    UnknownWrapperField { field: String, value: String },
    #[error(
        "`attn_output_gate` is false; Qwen3.5's full-attention layers always gate their output \
         (q_proj holds the gate), and kvmesh implements no ungated variant"
    )]
    UngatedAttention,
    #[error(
        "`output_gate_type` is {gate:?}; the linear layers' norm is gated by swish (SiLU) in \
         Qwen3.5, and kvmesh implements no other gate"
    )]
    OutputGate { gate: String },
    #[error(
        "`mamba_ssm_dtype` is {dtype:?}; kvmesh keeps the recurrent (delta rule) state in \
         float32, and a state kept in another dtype would give other numbers"
    )]
    StateDtype { dtype: String },
    #[error(
        "`partial_rotary_factor` {partial} of head_dim {head_dim} rotates {rotary_dim} \
         dimensions; RoPE needs an even, non-zero number"
    )]
    RotaryDim {
        partial: f64,
        head_dim: usize,
        rotary_dim: usize,
    },
    #[error(
        "linear_num_value_heads {value_heads} is not a multiple of linear_num_key_heads \
         {key_heads}; each key head serves a whole number of value heads"
    )]
    LinearHeads {
        value_heads: usize,
        key_heads: usize,
    },
    #[error("`full_attention_interval` is 0")]
    ZeroLayerInterval,
    #[error(
        "`layer_types[{layer}]` is {value}; Qwen3.5 layers are \"linear_attention\" (Gated \
         DeltaNet) or \"full_attention\", and kvmesh implements no other"
    )]
    UnknownHybridLayerType { layer: usize, value: String },
    #[error(
        "`layer_types` and `full_attention_interval` = {interval} describe different layers; \
         transformers follows layer_types and ignores the interval, so the file is ambiguous: \
         make them agree or drop one"
    )]
    IntervalMismatch { interval: usize },
    /// The RoPE dict's `partial_rotary_factor` and the top-level one disagree.
    #[error(
        "`rope_parameters.partial_rotary_factor` is {dict} but the top-level one is {top}; \
         make them agree"
    )]
    PartialRotaryDisagrees { dict: f64, top: f64 },
    /// A `partial_rotary_factor` outside (0, 1]; `value` as the file writes the number.
    #[error("`{field}` is {value}; expected a fraction in (0, 1]")]
    PartialRotaryRange { field: String, value: String },
    #[error(
        "rope type `{rope_type}` on a Qwen3.5 model; kvmesh runs Qwen3.5 with plain (default) \
         RoPE on the rotated part of each head"
    )]
    HybridRopeType { rope_type: &'static str },

    // RoPE. `dict`: `rope_parameters` or `rope_scaling`.
    #[error(
        "both `rope_parameters` ({parameters}) and the legacy `rope_scaling` ({scaling}) are \
         set; transformers would take rope_scaling and drop rope_parameters, which is rarely \
         what was meant. Keep one: move rope_scaling's fields into rope_parameters"
    )]
    BothRopeLayouts { parameters: String, scaling: String },
    /// The dict could not be deserialized at all (every entry reads, so this is serde's).
    #[error("`{dict}`: {error}")]
    RopeDict {
        dict: &'static str,
        error: serde_json::Error,
    },
    #[error(
        "`{dict}.{key}` is a nested RoPE dict (RoPE per layer type); the families kvmesh runs \
         use one RoPE for every layer"
    )]
    NestedRope { dict: &'static str, key: String },
    #[error(
        "`{dict}.rope_theta` is {dict_theta} but the top-level `rope_theta` is {top_theta}; \
         make them agree"
    )]
    ThetaDisagrees {
        dict: &'static str,
        dict_theta: f64,
        top_theta: f64,
    },
    #[error("`rope_theta` is {theta}; expected a number above 1")]
    RopeTheta { theta: f64 },
    #[error(
        "`{dict}.rope_type` is {rope_type:?} but `{dict}.type` is {legacy_type:?}; make them agree"
    )]
    RopeTypeDisagrees {
        dict: &'static str,
        rope_type: String,
        legacy_type: String,
    },
    /// RoPE on part of each head, in a dense family.
    #[error(
        "`partial_rotary_factor` is {factor}: RoPE on part of each head is not how Llama, \
         Qwen2, Qwen3 or Mistral models work, and kvmesh rotates whole heads"
    )]
    PartialRotary { factor: f64 },
    #[error(
        "`{dict}` has rope type {rope_type:?}, which kvmesh does not implement; supported: \
         default, linear, dynamic, llama3, yarn"
    )]
    UnknownRopeType {
        dict: &'static str,
        rope_type: String,
    },
    /// A parameter (not null) the rope type does not take; `takes`: those it does.
    #[error(
        "`{dict}.{key}` = {value} is not a parameter of rope type `{rope_type}` (it takes: {}); \
         kvmesh will not guess what it means",
        takes_list(.takes)
    )]
    ForeignRopeParam {
        dict: &'static str,
        key: String,
        value: String,
        rope_type: &'static str,
        takes: &'static [&'static str],
    },
    #[error("`{dict}` is rope type `{rope_type}` but has no `{key}`, which that type requires")]
    MissingRopeParam {
        dict: &'static str,
        rope_type: &'static str,
        key: &'static str,
    },
    #[error("`{dict}.factor` is {factor}; rope type `{rope_type}` needs a factor of 1 or more")]
    RopeFactor {
        dict: &'static str,
        factor: f64,
        rope_type: &'static str,
    },
    #[error(
        "`{dict}.original_max_position_embeddings` is {dict_value} but the top-level one is \
         {top}; make them agree"
    )]
    OriginalDisagrees {
        dict: &'static str,
        dict_value: f64,
        top: f64,
    },
    #[error("`{dict}`: llama3 needs 0 < low_freq_factor < high_freq_factor, got {low} and {high}")]
    Llama3Freqs {
        dict: &'static str,
        low: f64,
        high: f64,
    },
    #[error("`{dict}.original_max_position_embeddings` is {original}; expected a positive length")]
    YarnOriginal { dict: &'static str, original: f64 },
    #[error("`{dict}.attention_factor` is {factor}; expected a positive number")]
    YarnAttentionFactor { dict: &'static str, factor: f64 },

    // `quantization_config`. `field`: the path under it (`config_groups.g.weights.type`).
    #[error(
        "the checkpoint is quantized with quantization_config.quant_method {method:?}; kvmesh \
         reads FP8 checkpoints in the formats \"fp8\" (block-scaled) and \"compressed-tensors\" \
         (float8), and runs no other quantization"
    )]
    UnknownQuantMethod { method: String },
    #[error(
        "quantization_config has no quant_method ({value}); cannot tell how the weights are stored"
    )]
    NoQuantMethod { value: String },
    /// A field the method's format (`fp8`, `compressed-tensors`) does not have.
    #[error(
        "quantization_config.{field} is {value}: not a field of the {format} format kvmesh \
         knows, and it may change how the weights are read; refused rather than ignored"
    )]
    UnknownQuantField {
        field: String,
        value: String,
        format: &'static str,
    },
    /// A field whose value kvmesh does not read, for the fixed reason `why` (e4m3 only, no
    /// sparsity, 8 bits, symmetric, ...).
    #[error("quantization_config.{field} is {value}: {why}")]
    Quant {
        field: String,
        value: String,
        why: &'static str,
    },
    #[error(
        "quantization_config.activation_scheme is {value}: static activation scales \
         (`activation_scale` tensors) are not read by kvmesh yet; it reads the dynamic scheme"
    )]
    StaticActivations { value: String },
    #[error("quantization_config.activation_scheme is {value}: expected \"dynamic\"")]
    UnknownActivationScheme { value: String },
    #[error(
        "quantization_config.weight_block_size is absent: a per-tensor fp8 checkpoint; kvmesh \
         reads the block-scaled one ([128, 128])"
    )]
    NoBlockSize,
    #[error(
        "quantization_config.weight_block_size is {value}: kvmesh reads 128x128 blocks, the \
         size published checkpoints and the FP8 GEMMs' block scales use"
    )]
    BlockSize { value: String },
    #[error(
        "quantization_config gives both modules_to_not_convert {modules_to_not_convert} and \
         ignored_layers {ignored_layers} and they differ; transformers reads only the first, \
         so which layers stay unquantized is ambiguous"
    )]
    SkipListsDisagree {
        modules_to_not_convert: String,
        ignored_layers: String,
    },
    /// A skip, ignore or target entry kvmesh cannot match as its format means it.
    #[error("quantization_config.{field} is {value}: {why}")]
    UnreadablePattern {
        field: String,
        value: String,
        why: PatternError,
    },
    #[error(
        "quantization_config.quantization_status is absent; kvmesh reads checkpoints saved \
         \"compressed\""
    )]
    NoQuantizationStatus,
    #[error(
        "quantization_config.kv_cache_scheme is {value}: kvmesh keeps the KV cache in bf16 \
         (f32 on the CPU) and reads no KV-cache scales"
    )]
    KvCacheScheme { value: String },
    #[error("quantization_config.{field} is {value}: not a scheme field kvmesh knows")]
    UnknownSchemeField { field: String, value: String },
    #[error("quantization_config.{field} is {value}: not an argument kvmesh knows")]
    UnknownQuantArgument { field: String, value: String },
    /// `group`: `config_groups.<name>`.
    #[error("quantization_config.{group} has no targets")]
    NoTargets { group: String },
    #[error("quantization_config.{group} quantizes no weights; kvmesh reads FP8 weights")]
    NoWeights { group: String },
    #[error(
        "quantization_config.{field} has strategy {strategy:?} with dynamic {dynamic}: kvmesh \
         reads static per-channel and per-tensor FP8 weight scales"
    )]
    WeightStrategy {
        field: String,
        strategy: String,
        dynamic: bool,
    },
    #[error(
        "quantization_config.{field} has strategy {strategy:?} with dynamic {dynamic}: kvmesh \
         reads dynamic per-token, dynamic per-tensor and static per-tensor FP8 activations"
    )]
    ActivationStrategy {
        field: String,
        strategy: String,
        dynamic: bool,
    },
    /// A layer that config groups with different schemes both claim.
    #[error(
        "quantization_config: layer {layer} is targeted by config groups with different \
         schemes (targets {targets:?}); which applies is ambiguous"
    )]
    AmbiguousLayer { layer: String, targets: Vec<String> },
}

/// Why a skip, ignore or target entry of a `quantization_config` cannot be matched.
#[derive(Debug, Error)]
pub enum PatternError {
    /// transformers' skip lists are regexes matched whole.
    #[error("kvmesh cannot read it as the regex transformers matches it as ({0})")]
    HfRegex(regex::Error),
    /// compressed-tensors' `re:` entries.
    #[error("kvmesh cannot read it as the regex compressed-tensors matches ({0})")]
    CtRegex(regex::Error),
    /// A class other than `Linear` as a target.
    #[error(
        "class target {0:?}: kvmesh matches the class `Linear`, module names and `re:` regexes"
    )]
    ClassTarget(String),
}

/// What [`ConfigError::QuantizedModel`] says the quantization is.
fn quantized_what(method: &Option<String>, value: &str) -> String {
    match method {
        Some(m) => format!("quant_method {m}"),
        None => value.to_string(),
    }
}

/// The parameters a rope type takes, as [`ConfigError::ForeignRopeParam`] lists them.
fn takes_list(takes: &[&str]) -> String {
    if takes.is_empty() {
        "rope_theta only".to_string()
    } else {
        takes.join(", ")
    }
}

#[cfg(test)]
#[path = "error_tests.rs"]
mod tests;
