//! What sets Qwen3.5's hybrid text model apart from the dense families: which layers are
//! Gated DeltaNet (linear attention) and which gated full attention, the linear layers'
//! shape, partial RoPE, and which of transformers' classes wrote the file. How a config is
//! read into these is `qwen35`'s.

/// What mixes tokens in a layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerType {
    /// Gated DeltaNet: a fixed-size recurrent state per sequence.
    LinearAttention,
    /// Softmax attention over the whole context, gated per head; its K/V grow with the
    /// sequence.
    FullAttention,
}

impl LayerType {
    pub fn name(self) -> &'static str {
        match self {
            LayerType::LinearAttention => "linear_attention",
            LayerType::FullAttention => "full_attention",
        }
    }
}

/// Which of transformers' classes wrote the checkpoint, which decides where its text
/// model's tensors are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HybridLayout {
    CausalLm,
    ConditionalGeneration,
}

impl HybridLayout {
    /// The prefix of the text model's tensors (embeddings, layers, final norm).
    pub fn prefix(self) -> &'static str {
        match self {
            HybridLayout::CausalLm => "model.",
            HybridLayout::ConditionalGeneration => "model.language_model.",
        }
    }

    pub fn architecture_name(self) -> &'static str {
        match self {
            HybridLayout::CausalLm => "Qwen3_5ForCausalLM",
            HybridLayout::ConditionalGeneration => "Qwen3_5ForConditionalGeneration",
        }
    }
}

/// The parts of a Qwen3.5 text model the dense fields of [`ModelConfig`] do not describe.
/// The full-attention layers use `ModelConfig`'s heads (`num_heads`, `num_kv_heads`,
/// `head_dim`, q/k norms always on), with `q_proj` twice as wide: per head, the query and
/// then its output gate.
#[derive(Clone, Debug, PartialEq)]
pub struct HybridConfig {
    pub layout: HybridLayout,
    pub layer_types: Vec<LayerType>,
    pub linear_num_key_heads: usize,
    pub linear_num_value_heads: usize,
    pub linear_key_head_dim: usize,
    pub linear_value_head_dim: usize,
    pub linear_conv_kernel_dim: usize,
    /// How many leading dimensions of each full-attention head RoPE rotates
    /// (`head_dim * partial_rotary_factor`).
    pub rotary_dim: usize,
}

impl HybridConfig {
    /// q and k channels of a linear layer (all key heads).
    pub fn key_dim(&self) -> usize {
        self.linear_num_key_heads * self.linear_key_head_dim
    }

    /// v channels of a linear layer (all value heads).
    pub fn value_dim(&self) -> usize {
        self.linear_num_value_heads * self.linear_value_head_dim
    }

    /// Channels of the causal convolution: q, k and v together.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }

    pub fn num_linear_layers(&self) -> usize {
        self.count(LayerType::LinearAttention)
    }

    pub fn num_full_layers(&self) -> usize {
        self.count(LayerType::FullAttention)
    }

    fn count(&self, t: LayerType) -> usize {
        self.layer_types.iter().filter(|&&x| x == t).count()
    }

    /// f32 values of one sequence's recurrent state in one linear layer: the convolution's
    /// last `kernel - 1` inputs, and a `key_head_dim x value_head_dim` state per value head.
    pub fn state_floats_per_layer(&self) -> usize {
        self.conv_dim() * (self.linear_conv_kernel_dim - 1)
            + self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim
    }

    /// Bytes of one sequence's recurrent state across the model (f32, as transformers
    /// keeps it). It does not grow with the sequence.
    pub fn state_bytes_per_sequence(&self) -> usize {
        4 * self.state_floats_per_layer() * self.num_linear_layers()
    }
}

/// Fields of the text model read here, besides the shape and RoPE fields every family has.
pub(super) const OWN_FIELDS: &[&str] = &[
    "attention_bias",
    "head_dim",
    "layer_types",
    "full_attention_interval",
    "linear_conv_kernel_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "attn_output_gate",
    "output_gate_type",
    "mamba_ssm_dtype",
];

/// Fields of the text model skipped: the multi-token-prediction head, which plain decoding
/// never runs (its `mtp.*` tensors are not loaded).
pub(super) const SKIPPED_FIELDS: &[&str] =
    &["mtp_num_hidden_layers", "mtp_use_dedicated_embeddings"];
