//! `ModelConfig`, the one normalised view of a model's shape the backends use, and the order
//! in which `config.json` is read into it.

use serde_json::{Map, Value};

use super::arch::Arch;
use super::error::{ConfigError, Result};
use super::fields::screen;
use super::quant_read::read_quantization;
use super::reader::{token_ids, Fields};
use super::rope::{read_rope, Rope, RopeScaling};
use super::window::read_window;

#[derive(Clone, Debug)]
pub struct ModelConfig {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub rope: Rope,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Bias on the q, k and v projections (Qwen2 always; `attention_bias` in Llama and Qwen3).
    pub qkv_bias: bool,
    /// Bias on the output projection (`attention_bias` in Llama and Qwen3).
    pub o_bias: bool,
    /// Biases on gate, up and down projections (Llama's `mlp_bias`).
    pub mlp_bias: bool,
    /// RMSNorm over each head of q and k before RoPE (Qwen3).
    pub qk_norm: bool,
    /// The attention window: a query sees itself and the `w - 1` positions before it.
    pub sliding_window: Option<usize>,
    /// Which layers use the window (`None`: all of them, when there is a window).
    pub sliding_layers: Option<Vec<bool>>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// The dtype the file declares (`dtype` or `torch_dtype`); the weights' own dtype is what
    /// is loaded, this is only reported.
    pub declared_dtype: Option<String>,
    /// Fields present in the file and skipped because they do not change the math.
    pub ignored_fields: Vec<String>,
    /// Qwen3.5's linear-attention layers and what else sets it apart (`None` for the dense
    /// families).
    pub hybrid: Option<super::hybrid::HybridConfig>,
    /// FP8 weights and their scales (`quantization_config`); `None` when every weight is
    /// stored as it is computed with. Part of the config's `Debug`, so of the fingerprint:
    /// an FP8 worker and a bf16 one never share one.
    pub quantization: Option<super::quant::Quantization>,
}

/// The attention heads' shape.
pub(super) struct Heads {
    pub(super) hidden_size: usize,
    pub(super) num_heads: usize,
    pub(super) num_kv_heads: usize,
    pub(super) head_dim: usize,
}

impl Heads {
    pub(super) fn read(f: &Fields, arch: Arch) -> Result<Heads> {
        let hidden_size = f.need("hidden_size")?;
        let num_heads = f.need("num_attention_heads")?;
        if num_heads == 0 || hidden_size == 0 {
            return Err(ConfigError::ZeroWidth);
        }
        let num_kv_heads = f
            .usize("num_key_value_heads")?
            .unwrap_or(arch.default_num_kv_heads(num_heads));
        if num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
            return Err(ConfigError::KvHeads {
                heads: num_heads,
                kv_heads: num_kv_heads,
            });
        }
        let head_dim = f
            .usize("head_dim")?
            .unwrap_or(arch.default_head_dim(hidden_size, num_heads));
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(ConfigError::HeadDim { head_dim });
        }
        Ok(Heads {
            hidden_size,
            num_heads,
            num_kv_heads,
            head_dim,
        })
    }
}

/// The families kvmesh runs all use SwiGLU; any other activation is refused.
pub(super) fn check_activation(f: &Fields) -> Result<()> {
    let act = f.str("hidden_act")?.unwrap_or("silu");
    if act != "silu" && act != "swish" {
        return Err(ConfigError::Activation {
            act: act.to_string(),
        });
    }
    Ok(())
}

pub(super) fn read_max_position_embeddings(f: &Fields, arch: Arch) -> Result<usize> {
    let max = f
        .usize("max_position_embeddings")?
        .unwrap_or_else(|| arch.default_max_position_embeddings());
    if max == 0 {
        return Err(ConfigError::Zero {
            field: "max_position_embeddings".into(),
        });
    }
    Ok(max)
}

pub(super) fn read_rms_norm_eps(f: &Fields) -> Result<f64> {
    let eps = f.f64("rms_norm_eps")?.unwrap_or(1e-6);
    if !(eps > 0.0 && eps.is_finite()) {
        return Err(ConfigError::RmsNormEps { eps });
    }
    Ok(eps)
}

/// One tensor of a checkpoint.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub role: TensorRole,
}

/// What a tensor is to the model (how a random checkpoint initialises it, for one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorRole {
    Embedding,
    /// An RMSNorm's weight in a layer (input, post-attention, q/k per head).
    Norm,
    /// A projection's weight, `[out, in]`.
    Dense,
    Bias,
    /// The RMSNorm before the output head.
    FinalNorm,
    /// The output head, `[vocab, hidden]`.
    Head,
}

impl ModelConfig {
    /// The dense families' fields, once `arch` is known (see `parse`).
    pub(super) fn read_dense(obj: &Map<String, Value>, arch: Arch) -> Result<ModelConfig> {
        let f = Fields { obj };
        let ignored_fields = screen(obj, arch)?;
        let heads = Heads::read(&f, arch)?;
        check_activation(&f)?;
        let max_position_embeddings = read_max_position_embeddings(&f, arch)?;
        let rope = read_rope(&f, max_position_embeddings)?;
        if matches!(rope.scaling, RopeScaling::Dynamic { .. }) && heads.head_dim <= 2 {
            return Err(ConfigError::DynamicRopeHeadDim);
        }
        let attention_bias = f.bool("attention_bias")?.unwrap_or(false);
        let mlp_bias = f.bool("mlp_bias")?.unwrap_or(false);
        let (qkv_bias, o_bias) = arch.attention_biases(attention_bias);
        let (sliding_window, sliding_layers) = read_window(&f, arch)?;
        let rms_norm_eps = read_rms_norm_eps(&f)?;
        let num_layers = f.need("num_hidden_layers")?;
        if let Some(l) = &sliding_layers {
            if l.len() != num_layers {
                return Err(ConfigError::LayerCount {
                    listed: l.len(),
                    num_layers,
                });
            }
        }
        let cfg = ModelConfig {
            arch,
            vocab_size: f.need("vocab_size")?,
            hidden_size: heads.hidden_size,
            intermediate_size: f.need("intermediate_size")?,
            num_layers,
            num_heads: heads.num_heads,
            num_kv_heads: heads.num_kv_heads,
            head_dim: heads.head_dim,
            rms_norm_eps: rms_norm_eps as f32,
            rope,
            max_position_embeddings,
            tie_word_embeddings: f.bool("tie_word_embeddings")?.unwrap_or(false),
            qkv_bias,
            o_bias,
            mlp_bias,
            qk_norm: arch == Arch::Qwen3,
            sliding_window,
            sliding_layers,
            bos_token_id: f
                .get("bos_token_id")
                .and_then(|v| token_ids(v).first().copied()),
            eos_token_ids: f.get("eos_token_id").map(token_ids).unwrap_or_default(),
            declared_dtype: f.str("dtype")?.or(f.str("torch_dtype")?).map(String::from),
            ignored_fields,
            hybrid: None,
            quantization: None,
        };
        cfg.with_quantization(f.get("quantization_config"))
    }

    /// Reads `quantization_config` (null or empty: none) against this config's layers.
    pub(super) fn with_quantization(mut self, v: Option<&Value>) -> Result<ModelConfig> {
        let Some(v) = v.filter(|v| v.as_object().is_none_or(|o| !o.is_empty())) else {
            return Ok(self);
        };
        let q = read_quantization(v)?;
        q.check_layers(self.linear_layers().iter().map(|(m, _, _)| m.as_str()))?;
        self.quantization = Some(q);
        Ok(self)
    }

    /// Every linear layer (a module holding a `[out, in]` `.weight` that a product reads):
    /// its name, `out` and `in`. What a `quantization_config` may quantize.
    pub fn linear_layers(&self) -> Vec<(String, usize, usize)> {
        self.tensors()
            .into_iter()
            .filter(|t| matches!(t.role, TensorRole::Dense | TensorRole::Head))
            .filter_map(|t| {
                let module = t.name.strip_suffix(".weight")?.to_string();
                match t.shape[..] {
                    [out, inp] => Some((module, out, inp)),
                    _ => None,
                }
            })
            .collect()
    }

    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// The attention window of layer `layer`, if it has one.
    pub fn layer_window(&self, layer: usize) -> Option<usize> {
        let w = self.sliding_window?;
        match &self.sliding_layers {
            None => Some(w),
            Some(l) => l.get(layer).copied().unwrap_or(false).then_some(w),
        }
    }

    /// The longest context the model serves. RoPE scaling that stretches positions extends
    /// it the way vLLM does: `linear` and `dynamic` multiply `max_position_embeddings` by the
    /// factor; `yarn` multiplies `original_max_position_embeddings` by it; `llama3` models
    /// already state the extended length. A sliding window does not shorten it: older
    /// positions are masked, not forgotten.
    pub fn max_context(&self) -> usize {
        let m = self.max_position_embeddings as f64;
        let n = match &self.rope.scaling {
            RopeScaling::Default | RopeScaling::Llama3 { .. } => m,
            RopeScaling::Linear { factor } | RopeScaling::Dynamic { factor } => m * factor,
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                ..
            } => original_max_position_embeddings * factor,
        };
        (n.floor() as usize).max(1)
    }

    /// Whether RoPE frequencies depend on the sequence length (dynamic NTK), so a token's
    /// rotation is not a function of its position alone.
    pub fn rope_depends_on_length(&self) -> bool {
        matches!(self.rope.scaling, RopeScaling::Dynamic { .. })
    }

    /// The factor on cos and sin (yarn's attention factor; 1 otherwise).
    pub fn rope_attention_factor(&self) -> f64 {
        match &self.rope.scaling {
            RopeScaling::Yarn {
                attention_factor, ..
            } => *attention_factor,
            _ => 1.0,
        }
    }

    /// What attention scores are multiplied by: 1/sqrt(head_dim), times the square of the
    /// RoPE attention factor (transformers multiplies both q's and k's cos/sin by it; applying
    /// it to the scores instead is the same product and leaves the cached K unscaled).
    pub fn attention_scale(&self) -> f32 {
        let a = self.rope_attention_factor();
        ((a * a) / (self.head_dim as f64).sqrt()) as f32
    }

    /// Number of parameters the weights hold (embeddings counted once when tied).
    pub fn num_params(&self) -> usize {
        if self.hybrid.is_some() {
            return self
                .tensors()
                .iter()
                .map(|t| t.shape.iter().product::<usize>())
                .sum();
        }
        let h = self.hidden_size;
        let per_layer = h * self.q_dim()
            + 2 * h * self.kv_dim()
            + self.q_dim() * h
            + 3 * h * self.intermediate_size
            + 2 * h
            + if self.qkv_bias {
                self.q_dim() + 2 * self.kv_dim()
            } else {
                0
            }
            + if self.o_bias { h } else { 0 }
            + if self.mlp_bias {
                2 * self.intermediate_size + h
            } else {
                0
            }
            + if self.qk_norm { 2 * self.head_dim } else { 0 };
        let emb = self.vocab_size * h;
        emb + if self.tie_word_embeddings { 0 } else { emb } + self.num_layers * per_layer + h
    }

    /// Every tensor a checkpoint of this config holds, with its shape and what it is, in the
    /// order transformers' modules hold them.
    pub fn tensors(&self) -> Vec<TensorSpec> {
        if let Some(hy) = &self.hybrid {
            return self.hybrid_tensors(hy);
        }
        let (h, q, kv, inter, d) = (
            self.hidden_size,
            self.q_dim(),
            self.kv_dim(),
            self.intermediate_size,
            self.head_dim,
        );
        let mut v = Vec::new();
        let mut add = |name: String, shape: Vec<usize>, role: TensorRole| {
            v.push(TensorSpec { name, shape, role })
        };
        add(
            "model.embed_tokens.weight".into(),
            vec![self.vocab_size, h],
            TensorRole::Embedding,
        );
        for i in 0..self.num_layers {
            let p = format!("model.layers.{i}");
            add(
                format!("{p}.input_layernorm.weight"),
                vec![h],
                TensorRole::Norm,
            );
            for (name, rows) in [("q_proj", q), ("k_proj", kv), ("v_proj", kv)] {
                let w = format!("{p}.self_attn.{name}");
                add(format!("{w}.weight"), vec![rows, h], TensorRole::Dense);
                if self.qkv_bias {
                    add(format!("{w}.bias"), vec![rows], TensorRole::Bias);
                }
            }
            if self.qk_norm {
                add(
                    format!("{p}.self_attn.q_norm.weight"),
                    vec![d],
                    TensorRole::Norm,
                );
                add(
                    format!("{p}.self_attn.k_norm.weight"),
                    vec![d],
                    TensorRole::Norm,
                );
            }
            add(
                format!("{p}.self_attn.o_proj.weight"),
                vec![h, q],
                TensorRole::Dense,
            );
            if self.o_bias {
                add(
                    format!("{p}.self_attn.o_proj.bias"),
                    vec![h],
                    TensorRole::Bias,
                );
            }
            add(
                format!("{p}.post_attention_layernorm.weight"),
                vec![h],
                TensorRole::Norm,
            );
            let mlp = [
                ("gate_proj", inter, h),
                ("up_proj", inter, h),
                ("down_proj", h, inter),
            ];
            for (name, rows, cols) in mlp {
                add(
                    format!("{p}.mlp.{name}.weight"),
                    vec![rows, cols],
                    TensorRole::Dense,
                );
            }
            if self.mlp_bias {
                for (name, rows, _) in mlp {
                    add(format!("{p}.mlp.{name}.bias"), vec![rows], TensorRole::Bias);
                }
            }
        }
        add("model.norm.weight".into(), vec![h], TensorRole::FinalNorm);
        if !self.tie_word_embeddings {
            add(
                "lm_head.weight".into(),
                vec![self.vocab_size, h],
                TensorRole::Head,
            );
        }
        v
    }

    /// The names of [`ModelConfig::tensors`]: what `model::check_tensors` holds a
    /// checkpoint's tensors against.
    /// With a `quantization_config`, each quantized layer's scale (and static input scale)
    /// too.
    pub fn expected_tensors(&self) -> Vec<String> {
        let mut names: Vec<String> = self.tensors().into_iter().map(|t| t.name).collect();
        if let Some(q) = &self.quantization {
            for (m, _, _) in self.linear_layers() {
                let Some(s) = q.scheme_of(&m) else { continue };
                names.push(format!("{m}.{}", s.scale_suffix()));
                if s.input_scale_shapes().is_some() {
                    names.push(format!("{m}.input_scale"));
                }
            }
        }
        names
    }
}

#[cfg(test)]
mod tests {
    use crate::config::testing::{err, llama, qwen2};
    use crate::config::{Arch, RopeLayout};

    #[test]
    fn parses_qwen2_with_defaults() {
        let c = qwen2(
            r#","tie_word_embeddings":true,"sliding_window":4096,"use_sliding_window":false,
               "eos_token_id":[5,6]"#,
        )
        .unwrap();
        assert_eq!(c.arch, Arch::Qwen2);
        assert!(c.qkv_bias && !c.o_bias && !c.qk_norm);
        assert_eq!(c.head_dim, 16);
        assert_eq!(c.sliding_window, None);
        assert_eq!(c.eos_token_ids, vec![5, 6]);
        assert_eq!(c.max_position_embeddings, 32_768);
        assert_eq!(c.rope.layout, RopeLayout::Absent);
        assert_eq!(c.rope.theta, 10_000.0);
    }

    #[test]
    fn other_activations_are_refused() {
        let e = err(llama(r#","hidden_act":"gelu_pytorch_tanh""#));
        assert!(
            e.contains("hidden_act") && e.contains("gelu_pytorch_tanh"),
            "{e}"
        );
        llama(r#","hidden_act":"swish""#).unwrap();
    }
}
