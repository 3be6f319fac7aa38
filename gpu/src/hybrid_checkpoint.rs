//! Qwen3.5's tensors as both backends take them: one layer at a time, each projection (its
//! parts stacked where they read the same input) still in the checkpoint's dtype, the norms
//! with the family's `1 +` added, `A_log` turned into `-exp(A_log)`. The CPU keeps them as
//! they are; the CUDA backend uploads each layer and drops it before reading the next.

use crate::backend::cpu::delta::DeltaParams;
use crate::checkpoint::{Checkpoint, Projection, Stack};
use crate::config::{HybridConfig, LayerType, ModelConfig};
use crate::error::{EngineError, Result};
use crate::safetensors::{TensorData, WeightStore};

/// A Gated DeltaNet layer's tensors, each product as `P` (a host `Projection`, or what a
/// backend made of its `Stack`: see [`HybridTensors::layer_as`]).
pub struct DeltaTensors<P = Projection> {
    /// `in_proj_qkv`, `in_proj_z`, `in_proj_b` and `in_proj_a` stacked (they read the same
    /// input): rows `[conv_dim | value_dim | heads | heads]`.
    pub in_proj: P,
    /// Everything between the two projections.
    pub params: DeltaParams,
    pub out_proj: P,
}

/// A gated full-attention layer's tensors.
pub struct AttentionTensors<P = Projection> {
    /// `q_proj` (query and gate per head, `2 * q_dim`), `k_proj`, `v_proj` stacked.
    pub qkv: P,
    /// `1 + w`.
    pub q_norm: Vec<f32>,
    pub k_norm: Vec<f32>,
    pub o_proj: P,
}

pub enum MixerTensors<P = Projection> {
    Delta(DeltaTensors<P>),
    Attention(AttentionTensors<P>),
}

pub struct LayerTensors<P = Projection> {
    /// `1 + w`.
    pub input_norm: Vec<f32>,
    pub mixer: MixerTensors<P>,
    pub post_norm: Vec<f32>,
    /// gate and up stacked: `[2 * intermediate, hidden]`.
    pub gate_up: P,
    pub down: P,
}

/// `1 + w`: Qwen3.5's RMSNorms scale by it (their weights are stored centred on 0).
pub fn one_plus(w: Vec<f32>) -> Vec<f32> {
    w.into_iter().map(|x| 1.0 + x).collect()
}

/// Reads a Qwen3.5 checkpoint (either layout: its tensors under `model.` or under
/// `model.language_model.`), checked against the config's shapes.
pub struct HybridTensors<'a> {
    cfg: &'a ModelConfig,
    hy: &'a HybridConfig,
    w: &'a WeightStore,
    prefix: String,
}

impl<'a> HybridTensors<'a> {
    pub fn new(cfg: &'a ModelConfig, w: &'a WeightStore) -> Result<HybridTensors<'a>> {
        let hy = cfg.hybrid.as_ref().ok_or_else(|| {
            EngineError::BadModel(format!(
                "{} is not a hybrid (Qwen3.5) model",
                cfg.arch.architecture_name()
            ))
        })?;
        Ok(HybridTensors {
            cfg,
            hy,
            w,
            prefix: hy.layout.prefix().to_string(),
        })
    }

    pub fn hybrid(&self) -> &HybridConfig {
        self.hy
    }

    fn f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        self.w.f32(&format!("{}{name}", self.prefix), shape)
    }

    /// Layer `i`, its products read (dequantized where the `quantization_config` quantizes
    /// them, as the dense families' are: `Checkpoint::stacked`) and stacked.
    pub fn layer(&self, i: usize) -> Result<LayerTensors> {
        let ck = Checkpoint::new(self.cfg, self.w);
        self.layer_as(i, |s| ck.stacked(s))
    }

    /// Layer `i`, each product made by `product` from its [`Stack`] (a backend that keeps
    /// FP8 parts in FP8 reads them itself), the rest read here.
    pub fn layer_as<P>(
        &self,
        i: usize,
        mut product: impl FnMut(&Stack) -> Result<P>,
    ) -> Result<LayerTensors<P>> {
        let h = self.cfg.hidden_size;
        let [mixer_in, mixer_out, gate_up, down] = self.stacks(i)?;
        let p = format!("layers.{i}");
        let mixer = match self.layer_type(i)? {
            LayerType::LinearAttention => MixerTensors::Delta(DeltaTensors {
                in_proj: product(&mixer_in)?,
                params: self.delta_params(&p)?,
                out_proj: product(&mixer_out)?,
            }),
            LayerType::FullAttention => {
                let d = self.cfg.head_dim;
                let a = format!("{p}.self_attn");
                MixerTensors::Attention(AttentionTensors {
                    qkv: product(&mixer_in)?,
                    q_norm: one_plus(self.f32(&format!("{a}.q_norm.weight"), &[d])?),
                    k_norm: one_plus(self.f32(&format!("{a}.k_norm.weight"), &[d])?),
                    o_proj: product(&mixer_out)?,
                })
            }
        };
        Ok(LayerTensors {
            input_norm: one_plus(self.f32(&format!("{p}.input_layernorm.weight"), &[h])?),
            mixer,
            post_norm: one_plus(self.f32(&format!("{p}.post_attention_layernorm.weight"), &[h])?),
            gate_up: product(&gate_up)?,
            down: product(&down)?,
        })
    }

    fn layer_type(&self, i: usize) -> Result<LayerType> {
        self.hy.layer_types.get(i).copied().ok_or_else(|| {
            EngineError::BadModel(format!("layer {i} is past the config's layer_types"))
        })
    }

    /// The products of layer `i` as both backends run them, each part under its full name:
    /// the mixer's input (Gated DeltaNet: `in_proj_qkv`, `in_proj_z`, `in_proj_b`,
    /// `in_proj_a`; attention: `q_proj` with its gate, `k_proj`, `v_proj`), the mixer's
    /// output (`out_proj`, `o_proj`), gate and up, down.
    pub fn stacks(&self, i: usize) -> Result<[Stack; 4]> {
        let (cfg, hy) = (self.cfg, self.hy);
        let (h, inter, nv) = (
            cfg.hidden_size,
            cfg.intermediate_size,
            hy.linear_num_value_heads,
        );
        let p = format!("{}layers.{i}", self.prefix);
        let stack = |parts: &[(&str, usize)], inp: usize, bias: bool| Stack {
            parts: parts
                .iter()
                .map(|&(n, r)| (format!("{p}.{n}"), r))
                .collect(),
            inp,
            bias,
        };
        let (mixer_in, mixer_out) = match self.layer_type(i)? {
            LayerType::LinearAttention => (
                stack(
                    &[
                        ("linear_attn.in_proj_qkv", hy.conv_dim()),
                        ("linear_attn.in_proj_z", hy.value_dim()),
                        ("linear_attn.in_proj_b", nv),
                        ("linear_attn.in_proj_a", nv),
                    ],
                    h,
                    false,
                ),
                stack(&[("linear_attn.out_proj", h)], hy.value_dim(), false),
            ),
            LayerType::FullAttention => (
                stack(
                    &[
                        ("self_attn.q_proj", 2 * cfg.q_dim()),
                        ("self_attn.k_proj", cfg.kv_dim()),
                        ("self_attn.v_proj", cfg.kv_dim()),
                    ],
                    h,
                    cfg.qkv_bias,
                ),
                stack(&[("self_attn.o_proj", h)], cfg.q_dim(), cfg.o_bias),
            ),
        };
        Ok([
            mixer_in,
            mixer_out,
            stack(
                &[("mlp.gate_proj", inter), ("mlp.up_proj", inter)],
                h,
                false,
            ),
            stack(&[("mlp.down_proj", h)], inter, false),
        ])
    }

    /// What a Gated DeltaNet layer (`p`, `layers.{i}`) holds between its two products.
    fn delta_params(&self, p: &str) -> Result<DeltaParams> {
        let (cfg, hy) = (self.cfg, self.hy);
        let (nv, kw) = (hy.linear_num_value_heads, hy.linear_conv_kernel_dim);
        let a = format!("{p}.linear_attn");
        Ok(DeltaParams {
            conv: self.f32(&format!("{a}.conv1d.weight"), &[hy.conv_dim(), 1, kw])?,
            neg_a: self
                .f32(&format!("{a}.A_log"), &[nv])?
                .into_iter()
                .map(|x| -x.exp())
                .collect(),
            dt_bias: self.f32(&format!("{a}.dt_bias"), &[nv])?,
            norm: self.f32(&format!("{a}.norm.weight"), &[hy.linear_value_head_dim])?,
            hy: hy.clone(),
            eps: cfg.rms_norm_eps,
        })
    }

    pub fn embed_tokens(&self) -> Result<TensorData> {
        self.w.load(
            &format!("{}embed_tokens.weight", self.prefix),
            &[self.cfg.vocab_size, self.cfg.hidden_size],
        )
    }

    /// The output head, `None` when tied to the embeddings.
    pub fn lm_head(&self) -> Result<Option<TensorData>> {
        if self.cfg.tie_word_embeddings {
            return Ok(None);
        }
        let (v, h) = (self.cfg.vocab_size, self.cfg.hidden_size);
        let head = Checkpoint::new(self.cfg, self.w).projection("lm_head", v, h, false)?;
        Ok(Some(head.weight))
    }

    /// The final norm, `1 + w`.
    pub fn norm(&self) -> Result<Vec<f32>> {
        Ok(one_plus(self.f32("norm.weight", &[self.cfg.hidden_size])?))
    }
}
