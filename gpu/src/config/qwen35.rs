//! Qwen3.5's text model: three Gated DeltaNet (linear attention) layers to each gated
//! full-attention layer, read from either file transformers writes for it:
//!
//! - `Qwen3_5ForCausalLM` (`model_type` `qwen3_5_text`): the fields at the top level, the
//!   tensors under `model.`;
//! - `Qwen3_5ForConditionalGeneration` (`model_type` `qwen3_5`): the text model's fields
//!   nested in `text_config`, its tensors under `model.language_model.`, beside a vision
//!   tower (`vision_config`, `model.visual.*`) and a multi-token-prediction head (`mtp.*`).
//!   kvmesh serves text only, so both are present on purpose and not read; prompts with
//!   images are for the serving layer to refuse.
//!
//! The details follow transformers' `modeling_qwen3_5.py` and `configuration_qwen3_5.py`
//! (5.x): defaults are the config class's, `layer_types` comes from
//! `full_attention_interval` when absent (layer `i` is full attention when `(i + 1)` is a
//! multiple of it, default 4), `partial_rotary_factor` defaults to 0.25, and the multimodal
//! RoPE sections (`mrope_section`, `mrope_interleaved`) only choose which position axis each
//! frequency reads: text gives every axis the same position, so they reduce to plain RoPE
//! and are checked for shape only.

use serde_json::{Map, Value};

use super::arch::Arch;
use super::error::{ConfigError, Result};
use super::fields::screen;
use super::hybrid::{HybridConfig, HybridLayout, LayerType};
use super::model::{
    check_activation, read_max_position_embeddings, read_rms_norm_eps, Heads, ModelConfig,
    TensorRole, TensorSpec,
};
use super::reader::{shown, token_ids, Fields};
use super::rope::{read_rope, Rope, RopeScaling};

/// Fields of the mixture-of-experts variants (Qwen3.5-35B-A3B and up): refused by name
/// with the reason rather than as unknown fields.
const MOE_FIELDS: &[&str] = &[
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "decoder_sparse_step",
    "mlp_only_layers",
    "norm_topk_prob",
    "router_aux_loss_coef",
    "output_router_logits",
];

/// The wrapper's own fields (`Qwen3_5Config`): the text model's, read; the vision tower's
/// and the image/video marker ids, skipped (text only).
const WRAPPER_READ: &[&str] = &[
    "architectures",
    "model_type",
    "text_config",
    "tie_word_embeddings",
    "quantization_config",
];
const WRAPPER_SKIPPED: &[&str] = &[
    "vision_config",
    "image_token_id",
    "video_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
];

/// Reads a Qwen3.5 config (either layout) into a [`ModelConfig`] with its
/// [`HybridConfig`].
pub(super) fn read_qwen35(root: &Map<String, Value>) -> Result<ModelConfig> {
    let (text, layout, wrapper_ignored) = unwrap_layout(root)?;
    let named = root.get("architectures").and_then(Value::as_array);
    if let Some(a) = named.and_then(|a| a.first()).and_then(Value::as_str) {
        if a != layout.architecture_name() {
            return Err(ConfigError::LayoutMismatch {
                named: a.to_string(),
                layout: layout.architecture_name(),
                fields: match layout {
                    HybridLayout::CausalLm => "at the top level",
                    HybridLayout::ConditionalGeneration => "nested in text_config",
                },
            });
        }
    }
    let f = Fields { obj: text };
    refuse_moe(&f)?;
    let mut ignored_fields = wrapper_ignored;
    ignored_fields.extend(screen(text, Arch::Qwen35)?);
    let heads = Heads::read(&f, Arch::Qwen35)?;
    check_activation(&f)?;
    check_gates(&f)?;
    let max_position_embeddings = read_max_position_embeddings(&f, Arch::Qwen35)?;
    let (rope, partial) = read_partial_rope(text, max_position_embeddings)?;
    let rotary_dim = (heads.head_dim as f64 * partial) as usize;
    if rotary_dim == 0 || !rotary_dim.is_multiple_of(2) {
        return Err(ConfigError::RotaryDim {
            partial,
            head_dim: heads.head_dim,
            rotary_dim,
        });
    }
    let num_layers = f.need("num_hidden_layers")?;
    let hybrid = HybridConfig {
        layout,
        layer_types: read_layer_types(&f, num_layers)?,
        linear_num_key_heads: positive(&f, "linear_num_key_heads", 16)?,
        linear_num_value_heads: positive(&f, "linear_num_value_heads", 32)?,
        linear_key_head_dim: positive(&f, "linear_key_head_dim", 128)?,
        linear_value_head_dim: positive(&f, "linear_value_head_dim", 128)?,
        linear_conv_kernel_dim: positive(&f, "linear_conv_kernel_dim", 4)?,
        rotary_dim,
    };
    if !hybrid
        .linear_num_value_heads
        .is_multiple_of(hybrid.linear_num_key_heads)
    {
        return Err(ConfigError::LinearHeads {
            value_heads: hybrid.linear_num_value_heads,
            key_heads: hybrid.linear_num_key_heads,
        });
    }
    let attention_bias = f.bool("attention_bias")?.unwrap_or(false);
    let top = Fields { obj: root };
    let tie_word_embeddings = match layout {
        // transformers ties the wrapper's head by the wrapper's flag; the text config's
        // own is not read.
        HybridLayout::ConditionalGeneration => top.bool("tie_word_embeddings")?,
        HybridLayout::CausalLm => f.bool("tie_word_embeddings")?,
    }
    .unwrap_or(false);
    ModelConfig {
        arch: Arch::Qwen35,
        vocab_size: f.need("vocab_size")?,
        hidden_size: heads.hidden_size,
        intermediate_size: f.need("intermediate_size")?,
        num_layers,
        num_heads: heads.num_heads,
        num_kv_heads: heads.num_kv_heads,
        head_dim: heads.head_dim,
        rms_norm_eps: read_rms_norm_eps(&f)? as f32,
        rope,
        max_position_embeddings,
        tie_word_embeddings,
        qkv_bias: attention_bias,
        o_bias: attention_bias,
        mlp_bias: false,
        qk_norm: true,
        sliding_window: None,
        sliding_layers: None,
        bos_token_id: f
            .get("bos_token_id")
            .and_then(|v| token_ids(v).first().copied()),
        eos_token_ids: f.get("eos_token_id").map(token_ids).unwrap_or_default(),
        declared_dtype: f
            .str("dtype")?
            .or(top.str("dtype")?)
            .or(f.str("torch_dtype")?)
            .map(String::from),
        ignored_fields,
        hybrid: Some(hybrid),
        quantization: None,
    }
    .with_quantization(read_quantization_field(root, text, layout)?)
}

/// The checkpoint's `quantization_config`: at the top level of config.json in either layout,
/// where `save_pretrained` writes it. One inside `text_config` is refused by name rather
/// than ignored (nothing writes it there, and the weights would be misread without it).
fn read_quantization_field<'a>(
    root: &'a Map<String, Value>,
    text: &Map<String, Value>,
    layout: HybridLayout,
) -> Result<Option<&'a Value>> {
    if layout == HybridLayout::ConditionalGeneration {
        if let Some(v) = text.get("quantization_config").filter(|v| !v.is_null()) {
            return Err(ConfigError::UnknownField {
                field: "text_config.quantization_config".into(),
                value: shown(v),
                model_type: Arch::Qwen35.model_type(),
            });
        }
    }
    Ok(root.get("quantization_config"))
}

/// The text model's fields, which layout they came in, and the wrapper's skipped fields.
fn unwrap_layout(
    root: &Map<String, Value>,
) -> Result<(&Map<String, Value>, HybridLayout, Vec<String>)> {
    let Some(text) = root.get("text_config").filter(|v| !v.is_null()) else {
        if root.get("model_type").and_then(Value::as_str) == Some("qwen3_5") {
            return Err(ConfigError::NoTextConfig);
        }
        return Ok((root, HybridLayout::CausalLm, Vec::new()));
    };
    let Value::Object(text) = text else {
        return Err(ConfigError::Mistyped {
            field: "text_config".into(),
            value: shown(text),
            expected: "an object",
        });
    };
    if root.get("model_type").and_then(Value::as_str) == Some("qwen3_5_text") {
        return Err(ConfigError::NestedTextConfig);
    }
    match text.get("model_type").and_then(Value::as_str) {
        None | Some("qwen3_5_text") => {}
        Some(t) if t.contains("moe") => {
            return Err(ConfigError::MoeRefused {
                what: format!("text_config.model_type {t:?}"),
            })
        }
        Some(t) => {
            return Err(ConfigError::TextModelType {
                model_type: t.to_string(),
            })
        }
    }
    let mut skipped = Vec::new();
    for (k, v) in root {
        let key = k.as_str();
        if WRAPPER_READ.contains(&key) {
            continue;
        }
        if WRAPPER_SKIPPED.contains(&key)
            || super::IGNORED_FIELDS.contains(&key)
            || key.starts_with('_')
            || key.ends_with("_version")
            || v.is_null()
        {
            skipped.push(k.clone());
            continue;
        }
        return Err(ConfigError::UnknownWrapperField {
            field: key.to_string(),
            value: shown(v),
        });
    }
    Ok((text, HybridLayout::ConditionalGeneration, skipped))
}

fn refuse_moe(f: &Fields) -> Result<()> {
    for &k in MOE_FIELDS {
        if let Some(v) = f.get(k) {
            let off = matches!(v, Value::Bool(false))
                || v.as_u64() == Some(0)
                || v.as_array().is_some_and(|a| a.is_empty());
            if !off {
                return Err(ConfigError::MoeRefused {
                    what: format!("`{k}` = {}: this", shown(v)),
                });
            }
        }
    }
    Ok(())
}

/// The output gates transformers' Qwen3.5 always applies: sigmoid on attention outputs
/// (`attn_output_gate`) and SiLU in the linear layers' gated norm (`output_gate_type`);
/// and the recurrent state's dtype, which kvmesh keeps in f32 as transformers does.
fn check_gates(f: &Fields) -> Result<()> {
    if f.bool("attn_output_gate")? == Some(false) {
        return Err(ConfigError::UngatedAttention);
    }
    match f.str("output_gate_type")? {
        None | Some("swish") | Some("silu") => {}
        Some(other) => {
            return Err(ConfigError::OutputGate {
                gate: other.to_string(),
            })
        }
    }
    match f.str("mamba_ssm_dtype")? {
        None | Some("float32") => Ok(()),
        Some(other) => Err(ConfigError::StateDtype {
            dtype: other.to_string(),
        }),
    }
}

fn positive(f: &Fields, k: &str, default: usize) -> Result<usize> {
    let v = f.usize(k)?.unwrap_or(default);
    if v == 0 {
        return Err(ConfigError::Zero {
            field: k.to_string(),
        });
    }
    Ok(v)
}

/// `layer_types`, or the pattern `full_attention_interval` gives; both given must agree.
fn read_layer_types(f: &Fields, num_layers: usize) -> Result<Vec<LayerType>> {
    let interval = match f.usize("full_attention_interval")? {
        Some(0) => return Err(ConfigError::ZeroLayerInterval),
        i => i,
    };
    let from_interval = |n: usize| -> Vec<LayerType> {
        (0..num_layers)
            .map(|i| {
                if (i + 1).is_multiple_of(n) {
                    LayerType::FullAttention
                } else {
                    LayerType::LinearAttention
                }
            })
            .collect()
    };
    let Some(v) = f.get("layer_types") else {
        return Ok(from_interval(interval.unwrap_or(4)));
    };
    let Value::Array(list) = v else {
        return Err(ConfigError::Mistyped {
            field: "layer_types".into(),
            value: shown(v),
            expected: "a list of layer types",
        });
    };
    let mut types = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        types.push(match t.as_str() {
            Some("linear_attention") => LayerType::LinearAttention,
            Some("full_attention") => LayerType::FullAttention,
            _ => {
                return Err(ConfigError::UnknownHybridLayerType {
                    layer: i,
                    value: shown(t),
                })
            }
        });
    }
    if types.len() != num_layers {
        return Err(ConfigError::LayerCount {
            listed: types.len(),
            num_layers,
        });
    }
    if let Some(n) = interval {
        if from_interval(n) != types {
            return Err(ConfigError::IntervalMismatch { interval: n });
        }
    }
    Ok(types)
}

/// RoPE with Qwen3.5's extra entries taken out first: the multimodal sections (checked for
/// shape; see the module's comment) and `partial_rotary_factor` (returned; 0.25 when
/// absent). Only plain RoPE is read: the rotary embedding applies other types to the
/// partial head in ways no Qwen3.5 checkpoint uses, and kvmesh does not guess at them.
fn read_partial_rope(text: &Map<String, Value>, max_pos: usize) -> Result<(Rope, f64)> {
    let mut obj = text.clone();
    let mut partial = None;
    for dict_name in ["rope_parameters", "rope_scaling"] {
        let Some(Value::Object(dict)) = obj.get_mut(dict_name) else {
            continue;
        };
        if let Some(s) = dict.remove("mrope_section") {
            let ok = s
                .as_array()
                .is_some_and(|a| a.len() == 3 && a.iter().all(|x| x.as_u64().is_some()));
            if !ok && !s.is_null() {
                return Err(ConfigError::Mistyped {
                    field: format!("{dict_name}.mrope_section"),
                    value: shown(&s),
                    expected: "three non-negative integers",
                });
            }
        }
        if let Some(i) = dict.remove("mrope_interleaved") {
            if !(i.is_boolean() || i.is_null()) {
                return Err(ConfigError::Mistyped {
                    field: format!("{dict_name}.mrope_interleaved"),
                    value: shown(&i),
                    expected: "true or false",
                });
            }
        }
        if let Some(p) = dict.remove("partial_rotary_factor") {
            partial = partial_value(&format!("{dict_name}.partial_rotary_factor"), &p)?;
        }
        // A legacy dict left with only its type ("mrope" or "default") says plain RoPE.
        if dict.get("type").and_then(Value::as_str) == Some("mrope") {
            dict.insert("type".into(), "default".into());
        }
    }
    if let Some(p) = obj.remove("partial_rotary_factor") {
        let top = partial_value("partial_rotary_factor", &p)?;
        if let (Some(a), Some(b)) = (partial, top) {
            if a != b {
                return Err(ConfigError::PartialRotaryDisagrees { dict: a, top: b });
            }
        }
        partial = partial.or(top);
    }
    let rope = read_rope(&Fields { obj: &obj }, max_pos)?;
    if rope.scaling != RopeScaling::Default {
        return Err(ConfigError::HybridRopeType {
            rope_type: rope.scaling.type_name(),
        });
    }
    Ok((rope, partial.unwrap_or(0.25)))
}

fn partial_value(name: &str, v: &Value) -> Result<Option<f64>> {
    match v {
        Value::Null => Ok(None),
        Value::Number(n) => match n.as_f64() {
            Some(x) if x > 0.0 && x <= 1.0 => Ok(Some(x)),
            _ => Err(ConfigError::PartialRotaryRange {
                field: name.to_string(),
                value: n.to_string(),
            }),
        },
        other => Err(ConfigError::Mistyped {
            field: name.to_string(),
            value: shown(other),
            expected: "a number",
        }),
    }
}

impl ModelConfig {
    /// Leading dimensions of each attention head that RoPE rotates: all of them, but for
    /// Qwen3.5's partial rotary embedding.
    pub fn rotary_dim(&self) -> usize {
        self.hybrid.as_ref().map_or(self.head_dim, |h| h.rotary_dim)
    }

    /// The class that wrote the checkpoint: the family's, or for Qwen3.5 the one of its
    /// layout (the text model alone, or inside the vision-language wrapper).
    pub fn architecture_name(&self) -> &'static str {
        self.hybrid
            .as_ref()
            .map_or(self.arch.architecture_name(), |h| {
                h.layout.architecture_name()
            })
    }

    /// Whether a tensor in the checkpoint is knowingly left unread: Qwen3.5's vision tower
    /// and multi-token-prediction head (transformers skips both for text generation).
    pub fn ignores_tensor(&self, name: &str) -> bool {
        self.hybrid.is_some() && (name.starts_with("mtp.") || name.starts_with("model.visual."))
    }

    /// Qwen3.5's tensors, named and ordered as transformers' modules hold them.
    pub(super) fn hybrid_tensors(&self, hy: &HybridConfig) -> Vec<TensorSpec> {
        let (h, inter) = (self.hidden_size, self.intermediate_size);
        let p0 = hy.layout.prefix();
        let mut v = Vec::new();
        let mut add = |name: String, shape: Vec<usize>, role: TensorRole| {
            v.push(TensorSpec { name, shape, role })
        };
        add(
            format!("{p0}embed_tokens.weight"),
            vec![self.vocab_size, h],
            TensorRole::Embedding,
        );
        for (i, t) in hy.layer_types.iter().enumerate() {
            let p = format!("{p0}layers.{i}");
            add(
                format!("{p}.input_layernorm.weight"),
                vec![h],
                TensorRole::Norm,
            );
            match t {
                LayerType::LinearAttention => {
                    let a = format!("{p}.linear_attn");
                    let nv = hy.linear_num_value_heads;
                    // A_log and dt_bias are per-head scalars: `Bias` draws them small.
                    add(format!("{a}.A_log"), vec![nv], TensorRole::Bias);
                    add(
                        format!("{a}.conv1d.weight"),
                        vec![hy.conv_dim(), 1, hy.linear_conv_kernel_dim],
                        TensorRole::Dense,
                    );
                    add(format!("{a}.dt_bias"), vec![nv], TensorRole::Bias);
                    for (name, rows) in [
                        ("in_proj_a", nv),
                        ("in_proj_b", nv),
                        ("in_proj_qkv", hy.conv_dim()),
                        ("in_proj_z", hy.value_dim()),
                    ] {
                        add(
                            format!("{a}.{name}.weight"),
                            vec![rows, h],
                            TensorRole::Dense,
                        );
                    }
                    add(
                        format!("{a}.norm.weight"),
                        vec![hy.linear_value_head_dim],
                        TensorRole::Norm,
                    );
                    add(
                        format!("{a}.out_proj.weight"),
                        vec![h, hy.value_dim()],
                        TensorRole::Dense,
                    );
                }
                LayerType::FullAttention => self.gated_attention_tensors(&p, &mut add),
            }
            for (name, rows, cols) in [
                ("down_proj", h, inter),
                ("gate_proj", inter, h),
                ("up_proj", inter, h),
            ] {
                add(
                    format!("{p}.mlp.{name}.weight"),
                    vec![rows, cols],
                    TensorRole::Dense,
                );
            }
            add(
                format!("{p}.post_attention_layernorm.weight"),
                vec![h],
                TensorRole::Norm,
            );
        }
        add(format!("{p0}norm.weight"), vec![h], TensorRole::FinalNorm);
        if !self.tie_word_embeddings {
            add(
                "lm_head.weight".into(),
                vec![self.vocab_size, h],
                TensorRole::Head,
            );
        }
        v
    }

    /// A gated full-attention layer's tensors: `q_proj` holds each head's query and gate.
    fn gated_attention_tensors(
        &self,
        p: &str,
        add: &mut impl FnMut(String, Vec<usize>, TensorRole),
    ) {
        let (h, d) = (self.hidden_size, self.head_dim);
        let a = format!("{p}.self_attn");
        let projections = [
            ("k_proj", self.kv_dim(), h),
            ("o_proj", h, self.q_dim()),
            ("q_proj", 2 * self.q_dim(), h),
            ("v_proj", self.kv_dim(), h),
        ];
        add(format!("{a}.k_norm.weight"), vec![d], TensorRole::Norm);
        for (name, rows, cols) in projections {
            add(
                format!("{a}.{name}.weight"),
                vec![rows, cols],
                TensorRole::Dense,
            );
            if self.qkv_bias {
                add(format!("{a}.{name}.bias"), vec![rows], TensorRole::Bias);
            }
            if name == "o_proj" {
                add(format!("{a}.q_norm.weight"), vec![d], TensorRole::Norm);
            }
        }
    }
}

#[cfg(test)]
#[path = "qwen35_tests.rs"]
mod tests;
