//! Qwen3.5's text model on the CPU: Gated DeltaNet layers (`hybrid_layers::DeltaLayer`)
//! between gated full-attention layers (`hybrid_layers::GatedAttention`), each followed by
//! the SwiGLU MLP, with the (1 + w) RMSNorms of the family.
//!
//! What a sequence carries between steps comes in two kinds, kept apart so that the engine
//! can later hold them the way each is best held:
//!
//! - [`HybridState`]: one fixed-size slot per sequence, the recurrent state of every linear
//!   layer (the convolution's last `kernel - 1` inputs and a `dk x dv` delta-rule state per
//!   value head). Its size comes from the config alone ([`StateLayout`]), so an engine can
//!   allocate a pool of them beside its KV blocks and budget both from the model.
//! - K and V of the full-attention layers only, which grow with the sequence. Here
//!   [`HybridSequence`] keeps them contiguous; the serving backend (`hybrid_backend`) keeps
//!   them in paged KV blocks and the states in a pool of slots, one per running sequence.
//!
//! Prefill runs the delta rule chunk-wise (`delta::chunked`), decode one step at a time
//! (`delta::step`), as transformers does.

use std::sync::Arc;

use rayon::prelude::*;

use super::fp8_acts::Fp8Activations;
use super::hybrid_layers::{linear, DeltaLayer, GatedAttention};
use super::ops::{self, Linear, Matrix};
use crate::config::{HybridConfig, ModelConfig};
use crate::error::{EngineError, Result};
use crate::hybrid_checkpoint::{HybridTensors, MixerTensors};
use crate::safetensors::WeightStore;

/// transformers' chunk for the delta rule's prefill.
pub const DEFAULT_CHUNK: usize = 64;

/// Where each linear layer's state sits in a sequence's slot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateLayout {
    /// f32 values of the convolution window of one layer (`conv_dim * (kernel - 1)`).
    pub conv: usize,
    /// f32 values of the delta-rule state of one layer (`value heads * dk * dv`).
    pub delta: usize,
    /// Linear-attention layers.
    pub layers: usize,
}

impl StateLayout {
    pub fn new(hy: &HybridConfig) -> StateLayout {
        StateLayout {
            conv: hy.conv_dim() * (hy.linear_conv_kernel_dim - 1),
            delta: hy.linear_num_value_heads * hy.linear_key_head_dim * hy.linear_value_head_dim,
            layers: hy.num_linear_layers(),
        }
    }

    pub fn floats_per_slot(&self) -> usize {
        (self.conv + self.delta) * self.layers
    }

    pub fn bytes_per_slot(&self) -> usize {
        4 * self.floats_per_slot()
    }

    /// The `i`th linear layer's convolution window and delta-rule state within a slot of
    /// [`Self::floats_per_slot`] values.
    pub(super) fn layer_of<'a>(
        &self,
        slot: &'a mut [f32],
        i: usize,
    ) -> (&'a mut [f32], &'a mut [f32]) {
        let per = self.conv + self.delta;
        slot[i * per..(i + 1) * per].split_at_mut(self.conv)
    }
}

/// One sequence's recurrent state: a slot of [`StateLayout::floats_per_slot`] f32 values,
/// zero for a sequence that has seen no token.
#[derive(Clone, Debug, PartialEq)]
pub struct HybridState {
    layout: StateLayout,
    data: Vec<f32>,
}

impl HybridState {
    pub fn new(layout: StateLayout) -> HybridState {
        let data = vec![0f32; layout.floats_per_slot()];
        HybridState { layout, data }
    }

    /// The `i`th linear layer's convolution window and delta-rule state.
    fn layer_mut(&mut self, i: usize) -> (&mut [f32], &mut [f32]) {
        self.layout.layer_of(&mut self.data, i)
    }

    /// The whole slot, as an engine would copy it (to move a sequence, or to snapshot it).
    pub fn as_slice(&self) -> &[f32] {
        &self.data
    }
}

/// A sequence as this module runs it: its recurrent slot, and K/V of the full-attention
/// layers (`[tokens, kv_dim]` each).
pub struct HybridSequence {
    pub state: HybridState,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    len: usize,
}

impl HybridSequence {
    /// Tokens run so far.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

pub(super) enum Mixer {
    Delta(DeltaLayer),
    Attention(GatedAttention),
}

pub(super) struct HybridLayer {
    /// Norm weights with the family's `1 +` already added.
    pub(super) input_norm: Vec<f32>,
    pub(super) mixer: Mixer,
    pub(super) post_norm: Vec<f32>,
    /// gate and up stacked: `[2 * intermediate, hidden]`.
    gate_up: Linear,
    down: Linear,
}

pub struct HybridModel {
    pub(super) cfg: ModelConfig,
    hy: HybridConfig,
    pub(super) embed_tokens: Matrix,
    pub(super) layers: Vec<HybridLayer>,
    pub(super) norm: Vec<f32>,
    pub(super) lm_head: Linear,
    pub(super) inv_freq: Vec<f32>,
    pub(super) chunk: usize,
}

impl HybridModel {
    /// Loads a Qwen3.5 checkpoint (either layout), keeping bf16 weights as bf16.
    pub fn load(cfg: &ModelConfig, w: &WeightStore) -> Result<HybridModel> {
        let r = HybridTensors::new(cfg, w)?;
        let hy = r.hybrid().clone();
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..hy.layer_types.len() {
            let l = r.layer(i)?;
            let mixer = match l.mixer {
                MixerTensors::Delta(d) => Mixer::Delta(DeltaLayer::from_tensors(d)),
                MixerTensors::Attention(a) => Mixer::Attention(GatedAttention::from_tensors(a)),
            };
            layers.push(HybridLayer {
                input_norm: l.input_norm,
                mixer,
                post_norm: l.post_norm,
                gate_up: linear(l.gate_up),
                down: linear(l.down),
            });
        }
        let h = cfg.hidden_size;
        let embed_tokens = Matrix::from_data(r.embed_tokens()?);
        let lm_head = match r.lm_head()? {
            None => Linear::new(embed_tokens.clone(), cfg.vocab_size, h, None),
            Some(head) => Linear::new(Matrix::from_data(head), cfg.vocab_size, h, None),
        };
        Ok(HybridModel {
            cfg: cfg.clone(),
            embed_tokens,
            layers,
            norm: r.norm()?,
            lm_head,
            inv_freq: cfg.rope_inv_freq(),
            chunk: DEFAULT_CHUNK,
            hy,
        })
    }

    /// The products of the layers the checkpoint quantizes round their input as an FP8 GEMM
    /// does when they have more than `above_rows` rows, as `CpuModel::with_fp8_activations`
    /// (a sequence's tokens are one product here; a GPU batches sequences, so the two agree
    /// on steps of one sequence).
    pub fn with_fp8_activations(
        mut self,
        w: &WeightStore,
        above_rows: usize,
    ) -> Result<HybridModel> {
        let r = HybridTensors::new(&self.cfg, w)?;
        let acts = |parts: &[(String, usize)]| {
            Fp8Activations::of_parts(&self.cfg, w, parts, above_rows).map(|a| a.map(Arc::new))
        };
        for (i, l) in self.layers.iter_mut().enumerate() {
            let [mixer_in, mixer_out, gate_up, down] = r.stacks(i)?;
            let [a, b] = match &mut l.mixer {
                Mixer::Delta(d) => d.products_mut(),
                Mixer::Attention(g) => g.products_mut(),
            };
            a.fp8_activations = acts(&mixer_in.parts)?;
            b.fp8_activations = acts(&mixer_out.parts)?;
            l.gate_up.fp8_activations = acts(&gate_up.parts)?;
            l.down.fp8_activations = acts(&down.parts)?;
        }
        if !self.cfg.tie_word_embeddings {
            self.lm_head.fp8_activations = acts(&[("lm_head".into(), self.cfg.vocab_size)])?;
        }
        Ok(self)
    }

    /// The prefill chunk of the delta rule (transformers' 64 by default); any size gives
    /// the same numbers up to rounding, which the tests use to cross chunk boundaries with
    /// short prompts.
    pub fn with_chunk(mut self, chunk: usize) -> HybridModel {
        self.chunk = chunk.max(1);
        self
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    pub fn state_layout(&self) -> StateLayout {
        StateLayout::new(&self.hy)
    }

    /// A sequence that has seen no token.
    pub fn new_sequence(&self) -> HybridSequence {
        let n = self.hy.num_full_layers();
        HybridSequence {
            state: HybridState::new(self.state_layout()),
            k: vec![Vec::new(); n],
            v: vec![Vec::new(); n],
            len: 0,
        }
    }

    /// Runs `tokens` after what `seq` has seen (a prompt, a piece of one, or one decode
    /// token) and returns the logits after the last of them.
    pub fn forward(&self, seq: &mut HybridSequence, tokens: &[u32]) -> Result<Vec<f32>> {
        let cfg = &self.cfg;
        let (h, t) = (cfg.hidden_size, tokens.len());
        if t == 0 {
            return Err(EngineError::InvalidRequest("no tokens to run".into()));
        }
        let mut x = vec![0f32; t * h];
        for (i, &tok) in tokens.iter().enumerate() {
            if tok as usize >= cfg.vocab_size {
                return Err(EngineError::InvalidRequest(format!(
                    "token id {tok} is outside the vocabulary (size {})",
                    cfg.vocab_size
                )));
            }
            self.embed_tokens
                .read(tok as usize * h, &mut x[i * h..(i + 1) * h]);
        }
        let (mut linear_i, mut full_i) = (0, 0);
        for layer in &self.layers {
            let xn = ops::rms_norm(&x, &layer.input_norm, cfg.rms_norm_eps);
            let mixed = match &layer.mixer {
                Mixer::Delta(d) => {
                    let (window, state) = seq.state.layer_mut(linear_i);
                    linear_i += 1;
                    d.forward(&xn, t, window, state, self.chunk)
                }
                Mixer::Attention(a) => {
                    let (k, v) = (&mut seq.k[full_i], &mut seq.v[full_i]);
                    full_i += 1;
                    a.forward(cfg, &xn, t, seq.len, k, v, &self.inv_freq)
                }
            };
            add(&mut x, &mixed);
            let xn = ops::rms_norm(&x, &layer.post_norm, cfg.rms_norm_eps);
            add(&mut x, &mlp(layer, &xn, t, cfg.intermediate_size));
        }
        seq.len += t;
        let last = ops::rms_norm(&x[(t - 1) * h..], &self.norm, cfg.rms_norm_eps);
        Ok(self.lm_head.forward(&last, 1))
    }

    /// Prefill of `prompt`, then `n` greedy tokens, one decode step each.
    pub fn greedy(&self, prompt: &[u32], n: usize) -> Result<Vec<u32>> {
        let mut seq = self.new_sequence();
        let mut logits = self.forward(&mut seq, prompt)?;
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let next = argmax(&logits);
            out.push(next);
            if out.len() < n {
                logits = self.forward(&mut seq, &[next])?;
            }
        }
        Ok(out)
    }
}

pub(super) fn add(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// `down(silu(gate(xn)) * up(xn))` over `t` rows.
pub(super) fn mlp(layer: &HybridLayer, xn: &[f32], t: usize, inter: usize) -> Vec<f32> {
    let gu = layer.gate_up.forward(xn, t);
    let mut act = vec![0f32; t * inter];
    act.par_chunks_mut(inter)
        .zip(gu.par_chunks(2 * inter))
        .for_each(|(a, g)| {
            let (gate, up) = g.split_at(inter);
            super::vexp::silu_mul(a, gate, up);
        });
    layer.down.forward(&act, t)
}

/// The first index of the largest value (greedy decoding's choice).
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}
