//! Where each part of the model sits in a Hugging Face checkpoint: the one walk over the
//! tensor names (`model.layers.{i}.self_attn.q_proj.weight`, the biases and q/k norms the
//! config turns on, the output head unless it is tied to the embeddings) that every backend
//! loads from. A backend only converts what it is given to its own storage (f32 or bf16 on
//! the host, bf16 on a device), so the backends cannot drift apart on which tensor feeds
//! which product.
//!
//! `config::ModelConfig::expected_tensors` lists the same names for `model::check_tensors`,
//! which runs first and refuses a checkpoint with a tensor missing or one too many; the
//! tests here tie the two together.

use crate::config::ModelConfig;
use crate::error::Result;
use crate::safetensors::{TensorData, WeightStore};

/// Why a dense loader refuses a Qwen3.5 model: its layers are not dense layers.
pub const HYBRID_NOT_SERVED: &str = "Qwen3.5 hybrid (Gated DeltaNet) layers are not dense \
    layers and are not served by a dense loader: both backends serve these models through \
    their hybrid paths (recurrent state slots beside paged KV; `HybridBackend` on the CPU, \
    `CudaHybridBackend` on a GPU)";

/// A dense layer as the checkpoint holds it: `y = x · Wᵀ (+ b)` with `W` row-major
/// `[out, inp]`, bf16 as stored or f32 (see `WeightStore::load`).
pub struct Projection {
    pub weight: TensorData,
    pub out: usize,
    pub inp: usize,
    pub bias: Option<Vec<f32>>,
}

impl Projection {
    /// Projections that read the same input, stacked row-wise into one product (q, k and v;
    /// gate and up). The weight stays bf16 only when every part is bf16 (else every part is
    /// widened to f32, exactly); when any part has a bias, the others get zeros.
    pub(crate) fn stack(parts: Vec<Projection>) -> Projection {
        let inp = parts.first().map_or(0, |p| p.inp);
        debug_assert!(parts.iter().all(|p| p.inp == inp));
        let out = parts.iter().map(|p| p.out).sum();
        let bias = parts.iter().any(|p| p.bias.is_some()).then(|| {
            parts
                .iter()
                .flat_map(|p| p.bias.clone().unwrap_or_else(|| vec![0.0; p.out]))
                .collect()
        });
        let all_bf16 = parts
            .iter()
            .all(|p| matches!(p.weight, TensorData::Bf16(_)));
        let weight = if all_bf16 {
            let mut v = Vec::with_capacity(out * inp);
            for p in parts {
                if let TensorData::Bf16(w) = p.weight {
                    v.extend(w);
                }
            }
            TensorData::Bf16(v)
        } else {
            let mut v = Vec::with_capacity(out * inp);
            for p in parts {
                match p.weight {
                    TensorData::F32(w) => v.extend(w),
                    TensorData::Bf16(w) => {
                        v.extend(w.into_iter().map(|b| half::bf16::from_bits(b).to_f32()))
                    }
                }
            }
            TensorData::F32(v)
        };
        Projection {
            weight,
            out,
            inp,
            bias,
        }
    }
}

/// One product of a dense layer: the projections that read the same input, stacked
/// row-wise in this order (q, k and v; gate and up), or one alone.
pub struct Stack {
    /// Each part's module name (`model.layers.0.self_attn.q_proj`) and rows.
    pub parts: Vec<(String, usize)>,
    pub inp: usize,
    /// Whether every part has a bias (`{name}.bias`).
    pub bias: bool,
}

impl Stack {
    /// Rows of the stacked product.
    pub fn out(&self) -> usize {
        self.parts.iter().map(|(_, r)| r).sum()
    }
}

/// A decoder layer's norms.
pub struct LayerNorms {
    pub input_layernorm: Vec<f32>,
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    pub post_attention_layernorm: Vec<f32>,
}

/// One decoder layer, with the projections that share an input already stacked the way both
/// backends run them.
pub struct LayerWeights {
    pub input_layernorm: Vec<f32>,
    /// q, k and v stacked: `[q_dim + 2 * kv_dim, hidden]`.
    pub qkv_proj: Projection,
    /// Per-head RMS norms of q and k (Qwen3), each `[head_dim]`.
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    pub o_proj: Projection,
    pub post_attention_layernorm: Vec<f32>,
    /// gate and up stacked: `[2 * intermediate, hidden]`.
    pub gate_up_proj: Projection,
    pub down_proj: Projection,
}

/// A checkpoint read through its config: each method loads one part, checked against the
/// shape the config gives it.
pub struct Checkpoint<'a> {
    cfg: &'a ModelConfig,
    store: &'a WeightStore,
}

impl<'a> Checkpoint<'a> {
    pub fn new(cfg: &'a ModelConfig, store: &'a WeightStore) -> Checkpoint<'a> {
        Checkpoint { cfg, store }
    }

    /// `model.embed_tokens.weight`, `[vocab, hidden]`.
    pub fn embed_tokens(&self) -> Result<TensorData> {
        let c = self.cfg;
        self.store
            .load("model.embed_tokens.weight", &[c.vocab_size, c.hidden_size])
    }

    /// `lm_head.weight`, `[vocab, hidden]`; `None` when the head is tied to the embeddings
    /// (the caller reuses `embed_tokens`).
    pub fn lm_head(&self) -> Result<Option<Projection>> {
        let c = self.cfg;
        if c.tie_word_embeddings {
            return Ok(None);
        }
        self.projection("lm_head", c.vocab_size, c.hidden_size, false)
            .map(Some)
    }

    /// The final norm, `model.norm.weight`.
    pub fn norm(&self) -> Result<Vec<f32>> {
        self.store.f32("model.norm.weight", &[self.cfg.hidden_size])
    }

    /// Layer `i`, `model.layers.{i}.*`.
    pub fn layer(&self, i: usize) -> Result<LayerWeights> {
        let [qkv, o, gate_up, down] = self.stacks(i)?;
        let norms = self.norms(i)?;
        Ok(LayerWeights {
            input_layernorm: norms.input_layernorm,
            qkv_proj: self.stacked(&qkv)?,
            q_norm: norms.q_norm,
            k_norm: norms.k_norm,
            o_proj: self.stacked(&o)?,
            post_attention_layernorm: norms.post_attention_layernorm,
            gate_up_proj: self.stacked(&gate_up)?,
            down_proj: self.stacked(&down)?,
        })
    }

    /// The products of layer `i` as every backend runs them: q, k and v stacked, o, gate and
    /// up stacked, down. A backend that keeps FP8 weights reads each part itself from these
    /// names; the others take `layer`.
    pub fn stacks(&self, i: usize) -> Result<[Stack; 4]> {
        let c = self.cfg;
        if c.hybrid.is_some() {
            // Every serving backend loads its layers through here: refusing here keeps any
            // of them from running a hybrid checkpoint as if it were dense.
            return Err(crate::error::EngineError::BadModel(
                HYBRID_NOT_SERVED.into(),
            ));
        }
        let (h, q, kv, inter) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        let p = format!("model.layers.{i}");
        let a = format!("{p}.self_attn");
        let stack = |parts: &[(&str, usize)], inp: usize, bias: bool| Stack {
            parts: parts.iter().map(|&(n, r)| (n.to_string(), r)).collect(),
            inp,
            bias,
        };
        Ok([
            stack(
                &[
                    (&format!("{a}.q_proj"), q),
                    (&format!("{a}.k_proj"), kv),
                    (&format!("{a}.v_proj"), kv),
                ],
                h,
                c.qkv_bias,
            ),
            stack(&[(&format!("{a}.o_proj"), h)], q, c.o_bias),
            stack(
                &[
                    (&format!("{p}.mlp.gate_proj"), inter),
                    (&format!("{p}.mlp.up_proj"), inter),
                ],
                h,
                c.mlp_bias,
            ),
            stack(&[(&format!("{p}.mlp.down_proj"), h)], inter, c.mlp_bias),
        ])
    }

    /// The norms of layer `i`.
    pub fn norms(&self, i: usize) -> Result<LayerNorms> {
        let c = self.cfg;
        let (p, h) = (format!("model.layers.{i}"), c.hidden_size);
        let head_norm = |name: &str| -> Result<Option<Vec<f32>>> {
            if c.qk_norm {
                self.store
                    .f32(&format!("{p}.self_attn.{name}.weight"), &[c.head_dim])
                    .map(Some)
            } else {
                Ok(None)
            }
        };
        Ok(LayerNorms {
            input_layernorm: self
                .store
                .f32(&format!("{p}.input_layernorm.weight"), &[h])?,
            q_norm: head_norm("q_norm")?,
            k_norm: head_norm("k_norm")?,
            post_attention_layernorm: self
                .store
                .f32(&format!("{p}.post_attention_layernorm.weight"), &[h])?,
        })
    }

    /// A stack's parts read (dequantized where the config quantizes them) and stacked.
    pub fn stacked(&self, s: &Stack) -> Result<Projection> {
        let parts = s
            .parts
            .iter()
            .map(|(name, out)| self.projection(name, *out, s.inp, s.bias))
            .collect::<Result<Vec<_>>>()?;
        Ok(match parts.len() {
            1 => parts.into_iter().next().expect("one part"),
            _ => Projection::stack(parts),
        })
    }

    /// `{name}.weight` `[out, inp]`, and `{name}.bias` `[out]` exactly when the config says
    /// the projection has one (`model::check_tensors` refuses weights that disagree).
    ///
    /// A layer the `quantization_config` quantizes is dequantized here, to f32: every
    /// backend that loads through this walk gets the weights as the config means them (the
    /// CUDA backend reads the FP8 parts of `stacks` itself, so that it never uploads them
    /// widened, and only its unquantized parts through here).
    pub fn projection(&self, name: &str, out: usize, inp: usize, bias: bool) -> Result<Projection> {
        let scheme = self
            .cfg
            .quantization
            .as_ref()
            .and_then(|q| q.scheme_of(name));
        let weight = match scheme {
            Some(s) => TensorData::F32(crate::quant::dequantize(self.store, name, out, inp, &s)?),
            None => self.store.load(&format!("{name}.weight"), &[out, inp])?,
        };
        Ok(Projection {
            weight,
            out,
            inp,
            bias: if bias {
                Some(self.store.f32(&format!("{name}.bias"), &[out])?)
            } else {
                None
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::safetensors::{write_file, DType};

    fn values(d: &TensorData) -> Vec<f32> {
        match d {
            TensorData::F32(v) => v.clone(),
            TensorData::Bf16(v) => v
                .iter()
                .map(|&b| half::bf16::from_bits(b).to_f32())
                .collect(),
        }
    }

    /// A checkpoint holding exactly `cfg.expected_tensors()`, tensor `n` filled with the value
    /// `n + 1`, so every value read back names the tensor it came from.
    fn numbered(cfg: &ModelConfig, dtype: DType, tag: &str) -> (WeightStore, Vec<String>) {
        let names = cfg.expected_tensors();
        let (h, q, kv, inter) = (
            cfg.hidden_size,
            cfg.q_dim(),
            cfg.kv_dim(),
            cfg.intermediate_size,
        );
        let shape = |n: &str| -> Vec<usize> {
            let part = n.rsplit('.').nth(1).unwrap_or("");
            let weight = n.ends_with(".weight");
            match part {
                "embed_tokens" | "lm_head" => vec![cfg.vocab_size, h],
                "norm" | "input_layernorm" | "post_attention_layernorm" => vec![h],
                "q_norm" | "k_norm" => vec![cfg.head_dim],
                "q_proj" if weight => vec![q, h],
                "k_proj" | "v_proj" if weight => vec![kv, h],
                "o_proj" if weight => vec![h, q],
                "gate_proj" | "up_proj" if weight => vec![inter, h],
                "down_proj" if weight => vec![h, inter],
                "q_proj" => vec![q],
                "k_proj" | "v_proj" => vec![kv],
                "gate_proj" | "up_proj" => vec![inter],
                _ => vec![h],
            }
        };
        let tensors: Vec<(String, Vec<usize>, Vec<f32>)> = names
            .iter()
            .enumerate()
            .map(|(i, n)| {
                let s = shape(n);
                let len = s.iter().product();
                (n.clone(), s, vec![(i + 1) as f32; len])
            })
            .collect();
        let dir =
            std::env::temp_dir().join(format!("kvmesh-checkpoint-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        write_file(&dir.join("model.safetensors"), &tensors, dtype).unwrap();
        let store = WeightStore::open_dir(&dir).unwrap();
        std::fs::remove_dir_all(&dir).ok();
        (store, names)
    }

    /// Every tensor the config expects is read, and lands where its name says: a stacked
    /// projection holds its parts' rows in order, zeros stand in for no bias.
    fn walk_reads_every_expected_tensor_in_place(cfg: &ModelConfig, dtype: DType, tag: &str) {
        let (store, names) = numbered(cfg, dtype, tag);
        let id = |n: String| (names.iter().position(|x| *x == n).unwrap() + 1) as f32;
        let mut seen = std::collections::BTreeSet::new();
        let mut runs = |what: &str, got: &[f32], parts: &[(Option<String>, usize)]| {
            let mut want = Vec::new();
            for (name, len) in parts {
                let v = name.clone().map_or(0.0, |n| {
                    seen.insert(n.clone());
                    id(n)
                });
                want.extend(std::iter::repeat_n(v, *len));
            }
            assert_eq!(got, &want[..], "{what}");
        };
        let (h, q, kv, inter) = (
            cfg.hidden_size,
            cfg.q_dim(),
            cfg.kv_dim(),
            cfg.intermediate_size,
        );
        let ck = Checkpoint::new(cfg, &store);
        let n = |s: &str| Some(s.to_string());
        let emb = values(&ck.embed_tokens().unwrap());
        runs(
            "embed",
            &emb,
            &[(n("model.embed_tokens.weight"), cfg.vocab_size * h)],
        );
        runs("norm", &ck.norm().unwrap(), &[(n("model.norm.weight"), h)]);
        if let Some(head) = ck.lm_head().unwrap() {
            assert!(head.bias.is_none());
            runs(
                "head",
                &values(&head.weight),
                &[(n("lm_head.weight"), cfg.vocab_size * h)],
            );
        }
        for i in 0..cfg.num_layers {
            let l = ck.layer(i).unwrap();
            let p = format!("model.layers.{i}");
            let name = |part: &str, on: bool| on.then(|| format!("{p}.{part}"));
            runs(
                "ln1",
                &l.input_layernorm,
                &[(name("input_layernorm.weight", true), h)],
            );
            runs(
                "ln2",
                &l.post_attention_layernorm,
                &[(name("post_attention_layernorm.weight", true), h)],
            );
            let qkv = [("q_proj", q), ("k_proj", kv), ("v_proj", kv)];
            let w: Vec<_> = qkv
                .iter()
                .map(|(m, r)| (name(&format!("self_attn.{m}.weight"), true), r * h))
                .collect();
            runs("qkv", &values(&l.qkv_proj.weight), &w);
            assert_eq!((l.qkv_proj.out, l.qkv_proj.inp), (q + 2 * kv, h));
            let b: Vec<_> = qkv
                .iter()
                .map(|(m, r)| (name(&format!("self_attn.{m}.bias"), cfg.qkv_bias), *r))
                .collect();
            match &l.qkv_proj.bias {
                Some(bias) => runs("qkv bias", bias, &b),
                None => assert!(!cfg.qkv_bias),
            }
            for (got, which) in [(&l.q_norm, "q_norm"), (&l.k_norm, "k_norm")] {
                match got {
                    Some(v) => runs(
                        which,
                        v,
                        &[(
                            name(&format!("self_attn.{which}.weight"), true),
                            cfg.head_dim,
                        )],
                    ),
                    None => assert!(!cfg.qk_norm),
                }
            }
            runs(
                "o",
                &values(&l.o_proj.weight),
                &[(name("self_attn.o_proj.weight", true), h * q)],
            );
            match &l.o_proj.bias {
                Some(bias) => runs("o bias", bias, &[(name("self_attn.o_proj.bias", true), h)]),
                None => assert!(!cfg.o_bias),
            }
            let gu = [("gate_proj", inter), ("up_proj", inter)];
            let w: Vec<_> = gu
                .iter()
                .map(|(m, r)| (name(&format!("mlp.{m}.weight"), true), r * h))
                .collect();
            runs("gate/up", &values(&l.gate_up_proj.weight), &w);
            let b: Vec<_> = gu
                .iter()
                .map(|(m, r)| (name(&format!("mlp.{m}.bias"), true), *r))
                .collect();
            match &l.gate_up_proj.bias {
                Some(bias) => runs("gate/up bias", bias, &b),
                None => assert!(!cfg.mlp_bias),
            }
            runs(
                "down",
                &values(&l.down_proj.weight),
                &[(name("mlp.down_proj.weight", true), h * inter)],
            );
            match &l.down_proj.bias {
                Some(bias) => runs("down bias", bias, &[(name("mlp.down_proj.bias", true), h)]),
                None => assert!(!cfg.mlp_bias),
            }
        }
        let all: std::collections::BTreeSet<String> = names.into_iter().collect();
        assert_eq!(seen, all, "tensors the walk never read");
    }

    fn config(arch: &str, extra: &str) -> ModelConfig {
        ModelConfig::from_json(&format!(
            r#"{{"architectures":["{arch}"],"vocab_size":12,"hidden_size":16,
               "intermediate_size":8,"num_hidden_layers":2,"num_attention_heads":4,
               "num_key_value_heads":2,"head_dim":4{extra}}}"#
        ))
        .unwrap()
    }

    #[test]
    fn walk_matches_expected_tensors_for_every_layout() {
        let cases = [
            (
                "llama",
                config("LlamaForCausalLM", r#","tie_word_embeddings":false"#),
            ),
            (
                "llama-bias",
                config(
                    "LlamaForCausalLM",
                    r#","attention_bias":true,"mlp_bias":true,"tie_word_embeddings":false"#,
                ),
            ),
            (
                "qwen2",
                config("Qwen2ForCausalLM", r#","tie_word_embeddings":true"#),
            ),
            (
                "qwen3",
                config("Qwen3ForCausalLM", r#","tie_word_embeddings":true"#),
            ),
        ];
        for (tag, cfg) in &cases {
            for dtype in [DType::F32, DType::BF16] {
                walk_reads_every_expected_tensor_in_place(
                    cfg,
                    dtype,
                    &format!("{tag}-{}", dtype.name()),
                );
            }
        }
        assert!(cases[1].1.qkv_bias && cases[1].1.o_bias && cases[1].1.mlp_bias);
        assert!(cases[2].1.qkv_bias && cases[3].1.qk_norm);
    }

    #[test]
    fn stacking_keeps_bf16_only_when_every_part_is_bf16() {
        let part = |weight, bias| Projection {
            weight,
            out: 1,
            inp: 2,
            bias,
        };
        let s = Projection::stack(vec![
            part(TensorData::Bf16(vec![0x3f80, 0x4000]), None),
            part(TensorData::Bf16(vec![0xbf80, 0]), Some(vec![3.0])),
        ]);
        assert!(matches!(&s.weight, TensorData::Bf16(v) if v == &[0x3f80, 0x4000, 0xbf80, 0]));
        assert_eq!(s.bias, Some(vec![0.0, 3.0]));
        assert_eq!((s.out, s.inp), (2, 2));
        let s = Projection::stack(vec![
            part(TensorData::Bf16(vec![0x3f80, 0x4000]), None),
            part(TensorData::F32(vec![0.5, -1.0]), None),
        ]);
        assert!(matches!(&s.weight, TensorData::F32(v) if v == &[1.0, 2.0, 0.5, -1.0]));
        assert!(s.bias.is_none());
    }
}
