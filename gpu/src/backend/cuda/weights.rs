//! The model on the device: what `checkpoint::Checkpoint` reads, converted to bf16 matrices
//! and f32 norms and biases, uploaded layer by layer; an FP8 checkpoint's quantized layers
//! as stored, one byte a weight, with their scales (`fp8`).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};

use super::device::upload_err;
use super::fp8::{self, Fp8Linear};
use crate::checkpoint::{Checkpoint, LayerWeights, Projection, Stack};
use crate::config::ModelConfig;
use crate::error::Result;
use crate::safetensors::{TensorData, WeightStore};

/// A weight matrix `[out, inp]`, row-major bf16, with an optional f32 bias.
pub struct DevLinear {
    pub w: CudaSlice<u16>,
    pub out: usize,
    pub inp: usize,
    pub bias: Option<CudaSlice<f32>>,
}

/// A dense layer's product: bf16, or with FP8 parts (see `fp8`).
pub enum Linear {
    Bf16(DevLinear),
    Fp8(Fp8Linear),
}

impl Linear {
    /// Outputs and inputs: `[out, inp]`.
    pub fn shape(&self) -> (usize, usize) {
        match self {
            Linear::Bf16(l) => (l.out, l.inp),
            Linear::Fp8(l) => (l.out, l.inp),
        }
    }

    /// Whether it adds a bias.
    pub fn has_bias(&self) -> bool {
        match self {
            Linear::Bf16(l) => l.bias.is_some(),
            Linear::Fp8(l) => l.bias.is_some(),
        }
    }

    /// Bytes a decode step reads.
    pub(super) fn step_bytes(&self) -> usize {
        match self {
            Linear::Bf16(l) => 2 * l.w.len() + 4 * l.bias.as_ref().map_or(0, |b| b.len()),
            Linear::Fp8(l) => l.bytes(),
        }
    }
}

pub struct DevLayer {
    pub input_layernorm: CudaSlice<f32>,
    /// q, k and v stacked: `[q_dim + 2 * kv_dim, hidden]`.
    pub qkv_proj: Linear,
    pub q_norm: Option<CudaSlice<f32>>,
    pub k_norm: Option<CudaSlice<f32>>,
    pub o_proj: Linear,
    pub post_attention_layernorm: CudaSlice<f32>,
    /// gate and up stacked: `[2 * intermediate, hidden]`.
    pub gate_up_proj: Linear,
    pub down_proj: Linear,
}

pub struct DevWeights {
    pub embed_tokens: CudaSlice<u16>,
    pub layers: Vec<DevLayer>,
    pub norm: CudaSlice<f32>,
    /// `None` when tied to `embed_tokens`.
    pub lm_head: Option<DevLinear>,
    /// RoPE inverse frequencies, `[head_dim / 2]`.
    pub inv_freq: CudaSlice<f32>,
}

/// Copies to the device, naming what failed (most likely: out of memory).
pub(super) struct Upload<'a> {
    pub(super) stream: &'a Arc<CudaStream>,
    pub(super) ordinal: usize,
}

impl Upload<'_> {
    pub(super) fn f32s(&self, what: &str, v: &[f32]) -> Result<CudaSlice<f32>> {
        self.stream
            .clone_htod(v)
            .map_err(|e| upload_err(self.ordinal, what, e))
    }

    fn opt_f32s(&self, what: &str, v: Option<Vec<f32>>) -> Result<Option<CudaSlice<f32>>> {
        v.map(|v| self.f32s(what, &v)).transpose()
    }

    pub(super) fn bf16s(&self, what: &str, d: TensorData) -> Result<CudaSlice<u16>> {
        self.stream
            .clone_htod(&to_bf16(d))
            .map_err(|e| upload_err(self.ordinal, what, e))
    }

    pub(super) fn linear(&self, what: &str, p: Projection) -> Result<DevLinear> {
        Ok(DevLinear {
            w: self.bf16s(what, p.weight)?,
            out: p.out,
            inp: p.inp,
            bias: self.opt_f32s(&format!("{what} bias"), p.bias)?,
        })
    }

    fn layer(&self, i: usize, l: LayerWeights) -> Result<DevLayer> {
        let p = format!("model.layers.{i}");
        let lin = |what: String, proj| self.linear(&what, proj).map(Linear::Bf16);
        Ok(DevLayer {
            input_layernorm: self.f32s(&format!("{p}.input_layernorm"), &l.input_layernorm)?,
            qkv_proj: lin(format!("{p}.self_attn qkv"), l.qkv_proj)?,
            q_norm: self.opt_f32s(&format!("{p}.self_attn.q_norm.weight"), l.q_norm)?,
            k_norm: self.opt_f32s(&format!("{p}.self_attn.k_norm.weight"), l.k_norm)?,
            o_proj: lin(format!("{p}.self_attn.o_proj"), l.o_proj)?,
            post_attention_layernorm: self.f32s(
                &format!("{p}.post_attention_layernorm"),
                &l.post_attention_layernorm,
            )?,
            gate_up_proj: lin(format!("{p} gate/up"), l.gate_up_proj)?,
            down_proj: lin(format!("{p}.mlp.down_proj"), l.down_proj)?,
        })
    }

    /// Layer `i` of an FP8 checkpoint: each product's quantized parts uploaded as stored
    /// (`fp8::upload_stack`), a product with none through the bf16 path.
    fn fp8_layer(
        &self,
        ck: &Checkpoint,
        cfg: &ModelConfig,
        store: &WeightStore,
        i: usize,
    ) -> Result<DevLayer> {
        let p = format!("model.layers.{i}");
        let q = cfg.quantization.as_ref();
        let product = |s: &Stack| -> Result<Linear> {
            let quantized = s
                .parts
                .iter()
                .any(|(name, _)| q.and_then(|q| q.scheme_of(name)).is_some());
            if quantized {
                fp8::upload_stack(self.stream, self.ordinal, ck, cfg, store, s).map(Linear::Fp8)
            } else {
                let what = s.parts.first().map_or("", |(n, _)| n.as_str());
                self.linear(what, ck.stacked(s)?).map(Linear::Bf16)
            }
        };
        let [qkv, o, gate_up, down] = ck.stacks(i)?;
        let norms = ck.norms(i)?;
        Ok(DevLayer {
            input_layernorm: self.f32s(&format!("{p}.input_layernorm"), &norms.input_layernorm)?,
            qkv_proj: product(&qkv)?,
            q_norm: self.opt_f32s(&format!("{p}.self_attn.q_norm.weight"), norms.q_norm)?,
            k_norm: self.opt_f32s(&format!("{p}.self_attn.k_norm.weight"), norms.k_norm)?,
            o_proj: product(&o)?,
            post_attention_layernorm: self.f32s(
                &format!("{p}.post_attention_layernorm"),
                &norms.post_attention_layernorm,
            )?,
            gate_up_proj: product(&gate_up)?,
            down_proj: product(&down)?,
        })
    }
}

impl DevWeights {
    /// Reads the checkpoint one layer at a time and uploads each before reading the next, so
    /// the host holds at most one layer's converted copy. Returns once the copies are queued
    /// (the caller synchronises).
    pub fn upload(
        stream: &Arc<CudaStream>,
        ordinal: usize,
        cfg: &ModelConfig,
        store: &WeightStore,
    ) -> Result<DevWeights> {
        let ck = Checkpoint::new(cfg, store);
        let up = Upload { stream, ordinal };
        let mut layers = Vec::with_capacity(cfg.num_layers);
        let fp8 = cfg.quantization.is_some();
        for i in 0..cfg.num_layers {
            layers.push(if fp8 {
                up.fp8_layer(&ck, cfg, store, i)?
            } else {
                up.layer(i, ck.layer(i)?)?
            });
        }
        Ok(DevWeights {
            embed_tokens: up.bf16s("embed_tokens", ck.embed_tokens()?)?,
            lm_head: ck
                .lm_head()?
                .map(|head| up.linear("lm_head", head))
                .transpose()?,
            norm: up.f32s("model.norm", &ck.norm()?)?,
            inv_freq: up.f32s("rope frequencies", &cfg.rope_inv_freq())?,
            layers,
        })
    }

    /// Bytes of weights one decode step reads: every layer's matrices and norms, the final
    /// norm and the output head (the embedding matrix when tied; the embedding gather itself
    /// touches only the batch's rows and is not counted). This is the traffic that bounds
    /// batch-1 decode, for comparing against the device's memory bandwidth.
    pub fn bytes_per_step(&self) -> usize {
        let lin = |l: &DevLinear| 2 * l.w.len() + 4 * l.bias.as_ref().map_or(0, |b| b.len());
        let norm_len = |n: &Option<CudaSlice<f32>>| n.as_ref().map_or(0, |s| s.len());
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                l.qkv_proj.step_bytes()
                    + l.o_proj.step_bytes()
                    + l.gate_up_proj.step_bytes()
                    + l.down_proj.step_bytes()
                    + 4 * (l.input_layernorm.len()
                        + l.post_attention_layernorm.len()
                        + norm_len(&l.q_norm)
                        + norm_len(&l.k_norm))
            })
            .sum();
        let head = match &self.lm_head {
            Some(l) => lin(l),
            None => 2 * self.embed_tokens.len(),
        };
        layers + head + 4 * self.norm.len()
    }
}

/// A checkpoint tensor as bf16 bits: bf16 as stored, f32 (and f16, which the loader widens
/// to f32) rounded to nearest even on the host, so the device holds one format.
fn to_bf16(d: TensorData) -> Vec<u16> {
    match d {
        TensorData::Bf16(v) => v,
        TensorData::F32(v) => v
            .into_iter()
            .map(|x| half::bf16::from_f32(x).to_bits())
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_conversion_to_bf16_rounds_to_nearest_even() {
        let v = to_bf16(TensorData::F32(vec![1.0, -2.5, 1.0 + 1.0 / 256.0]));
        // 1 + 2^-8 is halfway between two bf16 values; the even one (1.0) wins.
        assert_eq!(v, vec![0x3f80, 0xc020, 0x3f80]);
        assert_eq!(to_bf16(TensorData::Bf16(vec![7, 8])), vec![7, 8]);
    }
}
