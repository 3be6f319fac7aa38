//! Bringing the backend up: what is refused before anything is allocated, the memory check,
//! then the context, kernels, cuBLAS handle, weights and KV cache, in that order.

use std::sync::Arc;

use cudarc::cublas::CudaBlas;

use super::buffers::{LogitsSpace, Workspace};
use super::device::{device_count, drv, GIB};
use super::fp8;
use super::fp8_gemm::{Fp8Ctx, LT_WORKSPACE};
use super::graphs::DecodeGraphs;
use super::kernels::Kernels;
use super::kv::KvCache;
use super::prefill_graphs::PrefillGraphs;
use super::shapes::MAX_HEAD_DIM;
use super::weights::DevWeights;
use super::CudaBackend;
use crate::backend::error::{BackendError, MemoryError, ModelRefusal, PlanSizes};
use crate::backend::{CudaOptions, DeviceWeightCache, KvBudget};
use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::safetensors::WeightStore;

impl CudaBackend {
    /// Loads the model onto device `opts.ordinal` with a KV cache of blocks of `block_size`
    /// tokens, as many as `kv` says. Plans the device's memory first (weights, the
    /// activations of the largest step the engine will run, the KV cache) so that a model or
    /// a cache that does not fit is refused with the sizes, before anything is uploaded and
    /// not with an allocation error halfway through serving.
    pub fn new(
        cfg: &ModelConfig,
        weights: &WeightStore,
        opts: CudaOptions,
        kv: KvBudget,
        block_size: usize,
    ) -> Result<CudaBackend> {
        Self::build(cfg, Source::Store(weights), opts, kv, block_size)
    }

    /// [`CudaBackend::new`] for a backend of a model that shares the device copy of its
    /// weights with the model's other backends on the same device (`cache`, the model's), if
    /// one holds one (a node's prefill and decode engines on one GPU: the weights are on it
    /// once). Its memory plan then counts no weights.
    pub fn of_model(
        cfg: &ModelConfig,
        weights: &WeightStore,
        cache: &DeviceWeightCache,
        opts: CudaOptions,
        kv: KvBudget,
        block_size: usize,
    ) -> Result<CudaBackend> {
        Self::build(cfg, Source::Model(weights, cache), opts, kv, block_size)
    }

    fn build(
        cfg: &ModelConfig,
        source: Source<'_>,
        opts: CudaOptions,
        kv: KvBudget,
        block_size: usize,
    ) -> Result<CudaBackend> {
        let ordinal = opts.ordinal;
        refuse_unsupported(cfg, ordinal, block_size)?;
        let ctx = super::green::context(ordinal, opts.sm_partition)?;
        let stream = ctx.new_stream().map_err(|e| drv("stream creation", e))?;
        let (free, total) = ctx.mem_get_info().map_err(|e| drv("memory query", e))?;
        let mut plan = MemoryPlan::of(cfg, &opts, block_size);
        let held = match source {
            Source::Model(_, cache) => cache.held::<DevWeights>(ordinal),
            Source::Store(_) => None,
        };
        if held.is_some() {
            plan.weights = 0;
        }
        let num_blocks = plan.blocks(kv, ordinal, free, total)?;

        let fp8 = fp8_ctx(&ctx, &stream, cfg, plan.tokens, &opts)?;
        let (mut k, arch) = Kernels::load(&ctx)?;
        let blas = CudaBlas::new(stream.clone())
            .map_err(|e| EngineError::device("cuBLAS initialisation", e))?;
        let w = match (held, source) {
            (Some(w), _) => {
                tracing::info!(
                    device = ordinal,
                    "weights shared with this model's other engine"
                );
                w
            }
            (None, Source::Store(weights)) => {
                Arc::new(DevWeights::upload(&stream, ordinal, cfg, weights)?)
            }
            (None, Source::Model(weights, cache)) => {
                // Read by other contexts' streams too (a green context per engine): made
                // without cudarc's per-slice events, which belong to one context; the stream
                // is synchronized below before any engine runs.
                // SAFETY: tracking is back on before anything else is made in this context.
                unsafe { ctx.disable_event_tracking() };
                let w = DevWeights::upload(&stream, ordinal, cfg, weights);
                unsafe { ctx.enable_event_tracking() };
                let w = Arc::new(w?);
                cache.hold(ordinal, &w);
                w
            }
        };
        k.pdl &= opts.pdl.enabled(w.bytes_per_step());
        // One block more than asked for: the scratch block decode graphs pad with.
        let kv = KvCache::alloc_as(
            &opts,
            &stream,
            (ordinal, cfg, cfg.num_layers),
            num_blocks,
            block_size,
        )?;
        let device_kv = super::handover::device_pool(&kv, &ctx, ordinal, k.kv_copy.clone())?;
        let (graphs, prefill_graphs) = graphs(&opts, cfg, num_blocks, block_size);
        let ws = match plan.tokens {
            0 => None,
            t => Some(Workspace::alloc(&stream, cfg, t)?),
        };
        let ls = match plan.rows {
            0 => None,
            r => Some(LogitsSpace::alloc(&stream, cfg, r)?),
        };
        stream
            .synchronize()
            .map_err(|e| drv("finishing the upload", e))?;
        tracing::info!(
            device = ordinal,
            arch = %arch,
            weights_gib = plan.weights as f64 / GIB,
            activations_gib = plan.activations as f64 / GIB,
            kv_gib = (num_blocks * plan.per_block) as f64 / GIB,
            kv_tokens = num_blocks * block_size,
            cuda_options = %opts.switches(),
            "CUDA backend ready"
        );
        if opts.gdn_scan || opts.gdn_chunked {
            tracing::warn!(
                "--cuda-options gdn-scan / gdn-chunked: the model has no Gated DeltaNet layers"
            );
        }
        Ok(CudaBackend {
            cfg: cfg.clone(),
            ordinal,
            ctx,
            stream,
            blas,
            k,
            w,
            kv,
            ws,
            ls,
            graphs,
            prefill_graphs,
            skinny_max_rows: opts.skinny_max_rows,
            split_decode: opts.split_decode,
            fuse_norms: opts.fuse_norms,
            fuse_rope: opts.fuse_rope,
            fp8,
            device_kv,
        })
    }

    /// Device memory one block takes across all layers (K and V, bf16).
    pub fn kv_bytes_per_block(cfg: &ModelConfig, block_size: usize) -> usize {
        2 * cfg.num_layers * block_size * cfg.kv_dim() * 2
    }
}

/// Where a backend's weights come from: a checkpoint's tensors (a copy of its own), or a
/// model whose other backends on the device may already hold them.
#[derive(Clone, Copy)]
enum Source<'a> {
    Store(&'a WeightStore),
    Model(&'a WeightStore, &'a DeviceWeightCache),
}

/// cuBLASLt and scratch for an FP8 checkpoint's products in steps of `tokens` tokens, after
/// the device's refusals (`fp8::refuse_device`); `None` for a model without FP8 layers.
pub(super) fn fp8_ctx(
    ctx: &Arc<cudarc::driver::CudaContext>,
    stream: &Arc<cudarc::driver::CudaStream>,
    cfg: &ModelConfig,
    tokens: usize,
    opts: &crate::backend::CudaOptions,
) -> Result<Option<Fp8Ctx>> {
    if cfg.quantization.is_none() {
        return Ok(None);
    }
    let cc = ctx
        .compute_capability()
        .map_err(|e| drv("compute capability query", e))?;
    fp8::refuse_device(cfg, cc, Fp8Ctx::lt_version()?)?;
    Fp8Ctx::new(stream, cfg, tokens, opts.fp8_f32_out).map(|c| Some(c.with_mma(opts.fp8_mma)))
}

/// What the backend cannot run, refused before any device memory is touched.
pub(super) fn refuse_unsupported(
    cfg: &ModelConfig,
    ordinal: usize,
    block_size: usize,
) -> Result<()> {
    // FP8 weights stay FP8 on the device (`fp8`); what that path does not run is refused
    // here by name, the rest once the device's capability is known (`fp8::refuse_device`).
    fp8::refuse_schemes(cfg)?;
    let count = device_count()?;
    if ordinal >= count {
        return Err(BackendError::NotVisible { ordinal, count }.into());
    }
    let d = cfg.head_dim;
    if d > MAX_HEAD_DIM || !d.is_multiple_of(2) || d == 0 {
        return Err(ModelRefusal::HeadDim {
            dim: d,
            max: MAX_HEAD_DIM,
        }
        .into());
    }
    if block_size == 0 {
        return Err(MemoryError::ZeroBlockSize.into());
    }
    if cfg.rope_depends_on_length() {
        // The kernels rotate by one frequency table for the whole batch; dynamic NTK
        // needs one per sequence length. Refused rather than rotated wrongly.
        let rope = cfg.rope.scaling.type_name();
        return Err(ModelRefusal::Rope { rope }.into());
    }
    Ok(())
}

/// Device memory the backend takes besides its KV cache, and what one KV block takes.
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryPlan {
    pub weights: usize,
    /// Activations for `tokens` tokens a step and logits for `rows` rows, allocated at
    /// start (the engine's step limits, rounded up as the buffers are).
    pub activations: usize,
    pub tokens: usize,
    pub rows: usize,
    /// cuBLAS's workspaces, the kernels' module, graphs and step inputs.
    pub fixed: usize,
    pub per_block: usize,
}

/// Working space beyond what is counted buffer by buffer.
const FIXED_BYTES: usize = 512 << 20;

impl MemoryPlan {
    pub fn of(cfg: &ModelConfig, opts: &CudaOptions, block_size: usize) -> MemoryPlan {
        let round = |n: usize| if n == 0 { 0 } else { n.next_power_of_two() };
        let (tokens, rows) = (round(opts.reserve_tokens), round(opts.reserve_rows));
        // An FP8 checkpoint keeps its quantized layers at one byte a weight, and its
        // products need cuBLASLt's workspace and the quantized activations' scratch.
        let lt = if cfg.quantization.is_some() {
            LT_WORKSPACE
        } else {
            0
        };
        MemoryPlan {
            weights: fp8::weight_bytes(cfg)
                + 4 * (cfg.num_layers * (2 * cfg.hidden_size + 2 * cfg.head_dim) + cfg.hidden_size),
            activations: Workspace::bytes(cfg, tokens)
                + LogitsSpace::bytes(cfg, rows)
                + fp8::scratch_bytes(cfg, tokens),
            tokens,
            rows,
            fixed: FIXED_BYTES + lt,
            per_block: CudaBackend::kv_bytes_per_block(cfg, block_size),
        }
    }

    /// Everything but the KV cache.
    pub fn base(&self) -> usize {
        self.weights + self.activations + self.fixed
    }

    /// The sizes, as a refusal shows them.
    fn sizes(&self) -> PlanSizes {
        PlanSizes {
            weights: self.weights,
            activations: self.activations,
            tokens: self.tokens,
            rows: self.rows,
            fixed: self.fixed,
        }
    }

    /// The KV blocks `kv` gives on device `ordinal` with `free` of `total` bytes free, or
    /// the refusal, with the sizes, of a plan that does not fit.
    pub fn blocks(&self, kv: KvBudget, ordinal: usize, free: usize, total: usize) -> Result<usize> {
        let blocks = match kv {
            KvBudget::Blocks(n) => n,
            KvBudget::Bytes(b) => (b / self.per_block).max(1),
            KvBudget::Share(share) => {
                if !(share > 0.0 && share <= 1.0) {
                    return Err(EngineError::InvalidRequest(format!(
                        "--gpu-memory-utilization {share} must be above 0 and at most 1"
                    )));
                }
                let budget = (share * total as f64) as usize;
                if budget > free {
                    return Err(MemoryError::ShareOverFree {
                        ordinal,
                        free,
                        total,
                        budget,
                        share,
                    }
                    .into());
                }
                if budget < self.base() + self.per_block {
                    return Err(MemoryError::ModelOverShare {
                        ordinal,
                        share,
                        total,
                        budget,
                        sizes: self.sizes(),
                        base: self.base(),
                    }
                    .into());
                }
                (budget - self.base()) / self.per_block
            }
        };
        if blocks == 0 {
            return Err(MemoryError::NoBlocks.into());
        }
        let need = self.base() + blocks * self.per_block;
        if need > free {
            return Err(MemoryError::NotEnough {
                ordinal,
                free,
                total,
                need,
                sizes: self.sizes(),
                kv: blocks * self.per_block,
                blocks,
            }
            .into());
        }
        Ok(blocks)
    }
}

/// The backend's decode graphs and piecewise prefill graphs, as the options ask.
fn graphs(
    opts: &CudaOptions,
    cfg: &ModelConfig,
    num_blocks: usize,
    block_size: usize,
) -> (DecodeGraphs, PrefillGraphs) {
    let prefill = opts.graphs && opts.prefill_graphs;
    (
        DecodeGraphs::new(opts.graphs, cfg, num_blocks, block_size),
        PrefillGraphs::new(prefill, cfg.num_layers, num_blocks, block_size),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const GB: usize = 1 << 30;

    fn qwen3_8b() -> ModelConfig {
        crate::init::preset(None, "qwen3-8b").unwrap()
    }

    fn plan(tokens: usize, rows: usize) -> MemoryPlan {
        let opts = CudaOptions {
            reserve_tokens: tokens,
            reserve_rows: rows,
            ..CudaOptions::device(0)
        };
        MemoryPlan::of(&qwen3_8b(), &opts, 16)
    }

    /// FP8 checkpoints are planned at one byte a quantized weight, never widened; what the
    /// FP8 path does not run is refused before the driver is asked anything, so this holds
    /// on a machine without one (the device refusals are `fp8`'s tests).
    #[test]
    fn fp8_checkpoints_are_planned_in_fp8_and_refused_only_by_name() {
        let mut v = qwen3_8b().to_hf_json();
        v["quantization_config"] = serde_json::json!({"quant_method": "fp8", "fmt": "e4m3",
            "activation_scheme": "dynamic", "weight_block_size": [128, 128]});
        let cfg = ModelConfig::from_json(&v.to_string()).unwrap();
        let opts = CudaOptions {
            reserve_tokens: 2048,
            reserve_rows: 64,
            ..CudaOptions::device(0)
        };
        let (fp8, bf16) = (
            MemoryPlan::of(&cfg, &opts, 16),
            MemoryPlan::of(&qwen3_8b(), &opts, 16),
        );
        // 6.95 B of the 8.19 B parameters are the layers' products: 16.4 GB in bf16, 9.4 GB
        // with those in FP8.
        assert!(
            fp8.weights > 9_400_000_000 && fp8.weights < 9_500_000_000,
            "{fp8:?}"
        );
        assert_eq!(fp8.fixed, bf16.fixed + LT_WORKSPACE);
        assert_eq!(
            fp8.activations,
            bf16.activations + fp8::scratch_bytes(&cfg, 2048)
        );
        // A hybrid model's FP8 layers stay FP8 too: its plan counts them at one byte a
        // weight, and its Gated DeltaNet projections among the widest products.
        let mut h: serde_json::Value = serde_json::from_str(include_str!(
            "../../../../tests/fixtures/models/hf-qwen35-f32/config.json"
        ))
        .unwrap();
        let plain = ModelConfig::from_json(&h.to_string()).unwrap();
        h["quantization_config"] = v["quantization_config"].clone();
        // Every linear layer quantized: the Gated DeltaNet gate inputs have a row per value
        // head, 4 here, which FP8 GEMMs do not take, and are refused by name.
        let all = ModelConfig::from_json(&h.to_string()).unwrap();
        let e = fp8::refuse_schemes(&all).unwrap_err().to_string();
        assert!(
            e.contains("linear_attn.in_proj_a") && e.contains("[4, 64]"),
            "{e}"
        );
        // Left bf16, as the published Qwen3.5 FP8 recipes leave them.
        h["quantization_config"]["modules_to_not_convert"] =
            serde_json::json!(["lm_head", "in_proj_a", "in_proj_b"]);
        let hcfg = ModelConfig::from_json(&h.to_string()).unwrap();
        fp8::refuse_schemes(&hcfg).unwrap();
        assert!(fp8::weight_bytes(&hcfg) < fp8::weight_bytes(&plain));
        let hy = hcfg.hybrid.as_ref().unwrap();
        let delta_in = hy.conv_dim() + hy.value_dim() + 2 * hy.linear_num_value_heads;
        assert!(fp8::widest(&hcfg).1 >= delta_in.max(2 * hcfg.q_dim() + 2 * hcfg.kv_dim()));
    }

    #[test]
    fn an_8b_model_at_the_default_share_of_an_h100_gets_the_rest_as_kv() {
        let p = plan(2048, 64);
        // 8.19 B bf16 parameters; 36 layers of 8 KV heads of 128, K and V in bf16.
        assert!(p.weights > 16_381_000_000 && p.weights < 16_383_000_000);
        assert_eq!(p.per_block, 2 * 36 * 16 * 1024 * 2);
        // The activations of a 2,048-token step are counted: ~0.4 GB, not a guess.
        assert!(
            p.activations > 300 << 20 && p.activations < 600 << 20,
            "{p:?}"
        );
        let (total, free) = (80 * GB, 79 * GB);
        let blocks = p.blocks(KvBudget::Share(0.9), 0, free, total).unwrap();
        let used = p.base() + blocks * p.per_block;
        assert!(used <= (0.9 * total as f64) as usize);
        assert!(used + p.per_block > (0.9 * total as f64) as usize);
        // ~60 GB of KV at 144 KiB a token: ~400k tokens.
        assert!((350_000..420_000).contains(&(blocks * 16)), "{blocks}");
    }

    #[test]
    fn a_plan_that_does_not_fit_is_refused_with_its_sizes() {
        let p = plan(8192, 256);
        // A 16 GB card at 0.9: the weights alone are 16.4 GB.
        let e = p
            .blocks(KvBudget::Share(0.9), 1, 15 * GB, 16 * GB)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("does not fit") && e.contains("weights 15.2"),
            "{e}"
        );
        assert!(e.contains("8192 tokens") && e.contains("cuda:1"), "{e}");
        // Another process holds memory: the share cannot be had.
        let e = p
            .blocks(KvBudget::Share(0.9), 0, 40 * GB, 80 * GB)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("40.00 GiB free of 80.00") && e.contains("at most 0.5"),
            "{e}"
        );
        // Fixed sizes beyond the free memory name every part.
        let e = p
            .blocks(KvBudget::Blocks(100_000), 0, 40 * GB, 80 * GB)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("100000 blocks") && e.contains("activations"),
            "{e}"
        );
        for bad in [0.0, -0.5, 1.5, f64::NAN] {
            let e = p.blocks(KvBudget::Share(bad), 0, 80 * GB, 80 * GB);
            assert!(e.unwrap_err().to_string().contains("at most 1"));
        }
    }

    /// The example the README gives, word for word.
    #[test]
    fn the_readme_quotes_the_refusal_as_it_is() {
        let e = plan(2048, 64)
            .blocks(KvBudget::Share(0.9), 0, 16 * GB, 16 * GB)
            .unwrap_err()
            .to_string();
        let quoted = "the model does not fit in 0.9 of cuda:0's 16.00 GiB (14.40 GiB): it \
                      needs weights 15.26 GiB + activations 0.41 GiB (steps of up to 2048 \
                      tokens, 64 rows of logits) + 0.50 GiB working space = 16.17 GiB before \
                      any KV cache; raise --gpu-memory-utilization, lower \
                      --max-num-batched-tokens, or use a larger GPU";
        assert!(e.ends_with(quoted), "{e}");
        let readme = include_str!("../../../../README.md")
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ");
        assert!(
            readme.contains(quoted),
            "README.md no longer quotes: {quoted}"
        );
    }

    #[test]
    fn blocks_and_bytes_are_taken_as_asked_when_they_fit() {
        let p = plan(0, 0);
        assert_eq!((p.tokens, p.rows, p.activations), (0, 0, 0));
        assert_eq!(
            p.blocks(KvBudget::Blocks(10), 0, 80 * GB, 80 * GB).unwrap(),
            10
        );
        let b = p.blocks(KvBudget::Bytes(GB), 0, 80 * GB, 80 * GB).unwrap();
        assert_eq!(b, GB / p.per_block);
        assert_eq!(
            p.blocks(KvBudget::Bytes(1), 0, 80 * GB, 80 * GB).unwrap(),
            1
        );
        assert!(p.blocks(KvBudget::Blocks(0), 0, 80 * GB, 80 * GB).is_err());
    }

    #[test]
    fn kv_block_bytes_are_bf16_k_and_v_for_every_layer() {
        let cfg = ModelConfig::from_json(
            r#"{"architectures":["Qwen3ForCausalLM"],"vocab_size":10,"hidden_size":64,
               "intermediate_size":8,"num_hidden_layers":3,"num_attention_heads":4,
               "num_key_value_heads":2,"head_dim":32}"#,
        )
        .unwrap();
        // 2 (K and V) * 3 layers * 16 tokens * 64 (2 kv heads * 32) * 2 bytes.
        assert_eq!(
            CudaBackend::kv_bytes_per_block(&cfg, 16),
            2 * 3 * 16 * 64 * 2
        );
    }
}
