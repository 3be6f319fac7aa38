//! Qwen3.5's tensors as both backends take them: one layer at a time, each projection (its
//! parts stacked where they read the same input) still in the checkpoint's dtype, the norms
//! with the family's `1 +` added, `A_log` turned into `-exp(A_log)`. The CPU keeps them as
//! they are; the CUDA backend uploads each layer and drops it before reading the next.

use crate::backend::cpu::delta::DeltaParams;
use crate::checkpoint::Projection;
use crate::config::{HybridConfig, LayerType, ModelConfig};
use crate::error::{EngineError, Result};
use crate::safetensors::{TensorData, WeightStore};

/// A Gated DeltaNet layer's tensors.
pub struct DeltaTensors {
    /// `in_proj_qkv`, `in_proj_z`, `in_proj_b` and `in_proj_a` stacked (they read the same
    /// input): rows `[conv_dim | value_dim | heads | heads]`.
    pub in_proj: Projection,
    /// Everything between the two projections.
    pub params: DeltaParams,
    pub out_proj: Projection,
}

/// A gated full-attention layer's tensors.
pub struct AttentionTensors {
    /// `q_proj` (query and gate per head, `2 * q_dim`), `k_proj`, `v_proj` stacked.
    pub qkv: Projection,
    /// `1 + w`.
    pub q_norm: Vec<f32>,
    pub k_norm: Vec<f32>,
    pub o_proj: Projection,
}

pub enum MixerTensors {
    Delta(DeltaTensors),
    Attention(AttentionTensors),
}

pub struct LayerTensors {
    /// `1 + w`.
    pub input_norm: Vec<f32>,
    pub mixer: MixerTensors,
    pub post_norm: Vec<f32>,
    /// gate and up stacked: `[2 * intermediate, hidden]`.
    pub gate_up: Projection,
    pub down: Projection,
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

    fn projection(&self, name: &str, out: usize, inp: usize, bias: bool) -> Result<Projection> {
        let full = format!("{}{name}", self.prefix);
        Ok(Projection {
            weight: self.w.load(&format!("{full}.weight"), &[out, inp])?,
            out,
            inp,
            bias: if bias {
                Some(self.w.f32(&format!("{full}.bias"), &[out])?)
            } else {
                None
            },
        })
    }

    /// Layer `i`.
    pub fn layer(&self, i: usize) -> Result<LayerTensors> {
        let (cfg, hy) = (self.cfg, self.hy);
        let (h, inter) = (cfg.hidden_size, cfg.intermediate_size);
        let p = format!("layers.{i}");
        let kind = hy.layer_types.get(i).ok_or_else(|| {
            EngineError::BadModel(format!("layer {i} is past the config's layer_types"))
        })?;
        let mixer = match kind {
            LayerType::LinearAttention => MixerTensors::Delta(self.delta(&p)?),
            LayerType::FullAttention => MixerTensors::Attention(self.attention(&p)?),
        };
        Ok(LayerTensors {
            input_norm: one_plus(self.f32(&format!("{p}.input_layernorm.weight"), &[h])?),
            mixer,
            post_norm: one_plus(self.f32(&format!("{p}.post_attention_layernorm.weight"), &[h])?),
            gate_up: Projection::stack(vec![
                self.projection(&format!("{p}.mlp.gate_proj"), inter, h, false)?,
                self.projection(&format!("{p}.mlp.up_proj"), inter, h, false)?,
            ]),
            down: self.projection(&format!("{p}.mlp.down_proj"), h, inter, false)?,
        })
    }

    fn delta(&self, p: &str) -> Result<DeltaTensors> {
        let (cfg, hy) = (self.cfg, self.hy);
        let h = cfg.hidden_size;
        let (nv, kw) = (hy.linear_num_value_heads, hy.linear_conv_kernel_dim);
        let a = format!("{p}.linear_attn");
        Ok(DeltaTensors {
            in_proj: Projection::stack(vec![
                self.projection(&format!("{a}.in_proj_qkv"), hy.conv_dim(), h, false)?,
                self.projection(&format!("{a}.in_proj_z"), hy.value_dim(), h, false)?,
                self.projection(&format!("{a}.in_proj_b"), nv, h, false)?,
                self.projection(&format!("{a}.in_proj_a"), nv, h, false)?,
            ]),
            params: DeltaParams {
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
            },
            out_proj: self.projection(&format!("{a}.out_proj"), h, hy.value_dim(), false)?,
        })
    }

    fn attention(&self, p: &str) -> Result<AttentionTensors> {
        let cfg = self.cfg;
        let (h, q, kv, d) = (cfg.hidden_size, cfg.q_dim(), cfg.kv_dim(), cfg.head_dim);
        let a = format!("{p}.self_attn");
        let b = cfg.qkv_bias;
        Ok(AttentionTensors {
            qkv: Projection::stack(vec![
                self.projection(&format!("{a}.q_proj"), 2 * q, h, b)?,
                self.projection(&format!("{a}.k_proj"), kv, h, b)?,
                self.projection(&format!("{a}.v_proj"), kv, h, b)?,
            ]),
            q_norm: one_plus(self.f32(&format!("{a}.q_norm.weight"), &[d])?),
            k_norm: one_plus(self.f32(&format!("{a}.k_norm.weight"), &[d])?),
            o_proj: self.projection(&format!("{a}.o_proj"), h, q, cfg.o_bias)?,
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
        Ok(Some(self.w.load(
            "lm_head.weight",
            &[self.cfg.vocab_size, self.cfg.hidden_size],
        )?))
    }

    /// The final norm, `1 + w`.
    pub fn norm(&self) -> Result<Vec<f32>> {
        Ok(one_plus(self.f32("norm.weight", &[self.cfg.hidden_size])?))
    }
}
