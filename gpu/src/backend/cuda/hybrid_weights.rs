//! Qwen3.5's weights on the device, and a step's activations (`hybrid_forward` runs them).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};

use super::delta::DeltaDims;
use super::device::drv;
use super::fp8;
use super::shapes;
use super::weights::{DevLinear, Linear, Upload};
use crate::checkpoint::{Checkpoint, Stack};
use crate::config::ModelConfig;
use crate::error::Result;
use crate::hybrid_checkpoint::{HybridTensors, MixerTensors};
use crate::safetensors::WeightStore;

pub(super) enum DevMixer {
    Delta {
        in_proj: Linear,
        conv: CudaSlice<f32>,
        neg_a: CudaSlice<f32>,
        dt_bias: CudaSlice<f32>,
        norm: CudaSlice<f32>,
        eps: f32,
        dims: DeltaDims,
        out_proj: Linear,
    },
    Attention {
        /// q (query and gate per head), k and v stacked.
        qkv: Linear,
        q_norm: CudaSlice<f32>,
        k_norm: CudaSlice<f32>,
        o_proj: Linear,
    },
}

pub(super) struct DevHybridLayer {
    /// `1 + w`, as every norm here.
    pub(super) input_norm: CudaSlice<f32>,
    pub(super) mixer: DevMixer,
    pub(super) post_norm: CudaSlice<f32>,
    pub(super) gate_up: Linear,
    pub(super) down: Linear,
}

pub struct HybridWeights {
    pub(super) embed_tokens: CudaSlice<u16>,
    pub(super) layers: Vec<DevHybridLayer>,
    pub(super) norm: CudaSlice<f32>,
    /// `None` when tied to `embed_tokens`.
    pub(super) lm_head: Option<DevLinear>,
    /// `[rotary_dim / 2]`.
    pub(super) inv_freq: CudaSlice<f32>,
}

impl HybridWeights {
    /// Reads and uploads one layer at a time, as the dense weights are; an FP8
    /// checkpoint's quantized parts as stored (`fp8::upload_stack`), never widened.
    pub fn upload(
        stream: &Arc<CudaStream>,
        ordinal: usize,
        cfg: &ModelConfig,
        store: &WeightStore,
    ) -> Result<HybridWeights> {
        let r = HybridTensors::new(cfg, store)?;
        let ck = Checkpoint::new(cfg, store);
        let up = Upload { stream, ordinal };
        let q = cfg.quantization.as_ref();
        let product = |s: &Stack| -> Result<Linear> {
            if s.parts
                .iter()
                .any(|(n, _)| q.and_then(|q| q.scheme_of(n)).is_some())
            {
                return fp8::upload_stack(stream, ordinal, &ck, cfg, store, s).map(Linear::Fp8);
            }
            let what = s.parts.first().map_or("", |(n, _)| n.as_str());
            up.linear(what, ck.stacked(s)?).map(Linear::Bf16)
        };
        let n = r.hybrid().layer_types.len();
        let mut layers = Vec::with_capacity(n);
        for i in 0..n {
            let l = r.layer_as(i, product)?;
            let p = format!("layers.{i}");
            let mixer = match l.mixer {
                MixerTensors::Delta(d) => DevMixer::Delta {
                    dims: DeltaDims::of(&d.params)?,
                    in_proj: d.in_proj,
                    conv: up.f32s(&format!("{p}.linear_attn.conv1d"), &d.params.conv)?,
                    neg_a: up.f32s(&format!("{p}.linear_attn.A_log"), &d.params.neg_a)?,
                    dt_bias: up.f32s(&format!("{p}.linear_attn.dt_bias"), &d.params.dt_bias)?,
                    norm: up.f32s(&format!("{p}.linear_attn.norm"), &d.params.norm)?,
                    eps: d.params.eps,
                    out_proj: d.out_proj,
                },
                MixerTensors::Attention(a) => DevMixer::Attention {
                    qkv: a.qkv,
                    q_norm: up.f32s(&format!("{p}.self_attn.q_norm"), &a.q_norm)?,
                    k_norm: up.f32s(&format!("{p}.self_attn.k_norm"), &a.k_norm)?,
                    o_proj: a.o_proj,
                },
            };
            layers.push(DevHybridLayer {
                input_norm: up.f32s(&format!("{p}.input_layernorm"), &l.input_norm)?,
                mixer,
                post_norm: up.f32s(&format!("{p}.post_attention_layernorm"), &l.post_norm)?,
                gate_up: l.gate_up,
                down: l.down,
            });
        }
        Ok(HybridWeights {
            embed_tokens: up.bf16s("embed_tokens", r.embed_tokens()?)?,
            lm_head: r
                .lm_head()?
                .map(|w| {
                    up.linear(
                        "lm_head",
                        crate::checkpoint::Projection {
                            weight: w,
                            out: cfg.vocab_size,
                            inp: cfg.hidden_size,
                            bias: None,
                        },
                    )
                })
                .transpose()?,
            norm: up.f32s("norm", &r.norm()?)?,
            inv_freq: up.f32s("rope frequencies", &cfg.rope_inv_freq())?,
            layers,
        })
    }

    /// Bytes of weights a decode step reads (every matrix once, the head's rows all).
    pub fn bytes_per_step(&self) -> usize {
        let lin = |l: &Linear| l.step_bytes();
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                lin(&l.gate_up)
                    + lin(&l.down)
                    + match &l.mixer {
                        DevMixer::Delta {
                            in_proj, out_proj, ..
                        } => lin(in_proj) + lin(out_proj),
                        DevMixer::Attention { qkv, o_proj, .. } => lin(qkv) + lin(o_proj),
                    }
            })
            .sum();
        layers
            + self
                .lm_head
                .as_ref()
                .map_or(2 * self.embed_tokens.len(), |h| 2 * h.w.len())
    }
}

/// A step's activations for up to `tokens` tokens.
pub struct HybridSpace {
    pub(super) tokens: usize,
    pub(super) x: CudaSlice<f32>,
    pub(super) xn: CudaSlice<u16>,
    pub(super) tmp: CudaSlice<f32>,
    /// A mixer's input projections, `[tokens, max(delta row, 2 q_dim + 2 kv_dim)]`.
    pub(super) proj: CudaSlice<f32>,
    /// The convolution's output, `[tokens, conv_dim]`.
    pub(super) mixed: CudaSlice<f32>,
    /// A mixer's output before its out projection, bf16 `[tokens, max(value_dim, q_dim)]`.
    pub(super) core: CudaSlice<u16>,
    pub(super) q: CudaSlice<f32>,
    pub(super) gate: CudaSlice<f32>,
    pub(super) gate_up: CudaSlice<f32>,
    pub(super) act: CudaSlice<u16>,
    pub(super) part: CudaSlice<f32>,
    pub(super) ticks: CudaSlice<i32>,
}

/// (f32s, bf16s) per token, and the fixed f32s and i32s of the split decode.
fn space_sizes(c: &ModelConfig) -> ((usize, usize), (usize, usize)) {
    let hy = c.hybrid.as_ref();
    let (cd, vd, nv) = hy.map_or((0, 0, 0), |h| {
        (h.conv_dim(), h.value_dim(), h.linear_num_value_heads)
    });
    let proj = (cd + vd + 2 * nv).max(2 * c.q_dim() + 2 * c.kv_dim());
    let core = vd.max(c.q_dim());
    let f32s = 2 * c.hidden_size + proj + cd + 2 * c.q_dim() + 2 * c.intermediate_size;
    let bf16s = c.hidden_size + core + c.intermediate_size;
    let part = shapes::DECODE_SPLIT_SLOTS * c.num_heads * (c.head_dim + 2);
    let ticks = shapes::DECODE_SPLIT_SLOTS * c.num_heads;
    ((f32s, bf16s), (part, ticks))
}

impl HybridSpace {
    pub fn bytes(c: &ModelConfig, tokens: usize) -> usize {
        let ((f, b), (part, ticks)) = space_sizes(c);
        if tokens == 0 {
            return 0;
        }
        tokens * (4 * f + 2 * b) + 4 * (part + ticks)
    }

    pub fn alloc(stream: &Arc<CudaStream>, c: &ModelConfig, cap: usize) -> Result<HybridSpace> {
        let hy = c.hybrid.as_ref();
        let (cd, vd, nv) = hy.map_or((0, 0, 0), |h| {
            (h.conv_dim(), h.value_dim(), h.linear_num_value_heads)
        });
        let proj = (cd + vd + 2 * nv).max(2 * c.q_dim() + 2 * c.kv_dim());
        let (_, (part, ticks)) = space_sizes(c);
        let e = |x| drv(&format!("activations for {cap} tokens"), x);
        let f = |n: usize| stream.alloc_zeros::<f32>(n.max(1)).map_err(e);
        let b = |n: usize| stream.alloc_zeros::<u16>(n.max(1)).map_err(e);
        Ok(HybridSpace {
            tokens: cap,
            x: f(cap * c.hidden_size)?,
            xn: b(cap * c.hidden_size)?,
            tmp: f(cap * c.hidden_size)?,
            proj: f(cap * proj)?,
            mixed: f(cap * cd)?,
            core: b(cap * vd.max(c.q_dim()))?,
            q: f(cap * c.q_dim())?,
            gate: f(cap * c.q_dim())?,
            gate_up: f(cap * 2 * c.intermediate_size)?,
            act: b(cap * c.intermediate_size)?,
            part: f(part)?,
            ticks: stream.alloc_zeros::<i32>(ticks.max(1)).map_err(e)?,
        })
    }
}
