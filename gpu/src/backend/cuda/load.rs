//! Bringing the backend up: what is refused before anything is allocated, the memory check,
//! then the context, kernels, cuBLAS handle, weights and KV cache, in that order.

use cudarc::cublas::CudaBlas;
use cudarc::driver::CudaContext;

use super::device::{device_count, drv, GIB};
use super::graphs::DecodeGraphs;
use super::kernels::Kernels;
use super::kv::KvCache;
use super::shapes::MAX_HEAD_DIM;
use super::weights::DevWeights;
use super::CudaBackend;
use crate::backend::CudaOptions;
use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::safetensors::WeightStore;

impl CudaBackend {
    /// Loads the model onto device `opts.ordinal` and allocates `num_blocks` KV blocks of
    /// `block_size` tokens. Checks free memory first so an oversized request fails with the
    /// numbers rather than with an allocation error halfway through the upload.
    pub fn new(
        cfg: &ModelConfig,
        weights: &WeightStore,
        opts: CudaOptions,
        num_blocks: usize,
        block_size: usize,
    ) -> Result<CudaBackend> {
        let ordinal = opts.ordinal;
        refuse_unsupported(cfg, ordinal, num_blocks, block_size)?;
        let ctx = CudaContext::new(ordinal).map_err(|e| drv("context creation", e))?;
        let stream = ctx.new_stream().map_err(|e| drv("stream creation", e))?;
        let need = MemoryNeed::of(cfg, num_blocks, block_size);
        need.check(&ctx, ordinal, num_blocks)?;

        let (k, arch) = Kernels::load(&ctx)?;
        let blas = CudaBlas::new(stream.clone())
            .map_err(|e| EngineError::Backend(format!("cuBLAS initialisation: {e:?}")))?;
        let w = DevWeights::upload(&stream, ordinal, cfg, weights)?;
        // One block more than asked for: the scratch block decode graphs pad with.
        let kv = KvCache::alloc(&stream, ordinal, cfg, num_blocks, block_size)?;
        let graphs = DecodeGraphs::new(opts.graphs, cfg, num_blocks, block_size);
        stream
            .synchronize()
            .map_err(|e| drv("finishing the upload", e))?;
        tracing::info!(
            device = ordinal,
            arch = %arch,
            weights_gib = need.weights as f64 / GIB,
            kv_gib = need.kv as f64 / GIB,
            "CUDA backend ready"
        );
        Ok(CudaBackend {
            cfg: cfg.clone(),
            ordinal,
            ctx,
            stream,
            blas,
            k,
            w,
            kv,
            ws: None,
            ls: None,
            graphs,
        })
    }

    /// Device memory one block takes across all layers (K and V, bf16).
    pub fn kv_bytes_per_block(cfg: &ModelConfig, block_size: usize) -> usize {
        2 * cfg.num_layers * block_size * cfg.kv_dim() * 2
    }
}

/// What the backend cannot run, refused before any device memory is touched.
fn refuse_unsupported(
    cfg: &ModelConfig,
    ordinal: usize,
    num_blocks: usize,
    block_size: usize,
) -> Result<()> {
    let count = device_count()?;
    if ordinal >= count {
        return Err(EngineError::Backend(format!(
            "cuda:{ordinal} was asked for but {count} CUDA device(s) are visible \
             (check CUDA_VISIBLE_DEVICES and the NVIDIA driver)"
        )));
    }
    let d = cfg.head_dim;
    if d > MAX_HEAD_DIM || !d.is_multiple_of(2) || d == 0 {
        return Err(EngineError::Backend(format!(
            "head_dim {d} is not supported by the CUDA kernels (even, at most {MAX_HEAD_DIM})"
        )));
    }
    if block_size == 0 || num_blocks == 0 {
        return Err(EngineError::Backend(
            "the KV cache needs at least one block of at least one token".into(),
        ));
    }
    if cfg.rope_depends_on_length() {
        // The kernels rotate by one frequency table for the whole batch; dynamic NTK
        // needs one per sequence length. Refused rather than rotated wrongly.
        return Err(EngineError::Backend(format!(
            "RoPE type `{}` (frequencies that change with the sequence length) is not \
             implemented by the CUDA backend; run this model with --device cpu",
            cfg.rope.scaling.type_name()
        )));
    }
    Ok(())
}

/// Device memory the backend will take, in bytes.
struct MemoryNeed {
    weights: usize,
    kv: usize,
    /// cuBLAS workspaces, activations of a large prefill and the module.
    headroom: usize,
}

impl MemoryNeed {
    fn of(cfg: &ModelConfig, num_blocks: usize, block_size: usize) -> MemoryNeed {
        MemoryNeed {
            weights: 2 * cfg.num_params()
                + 4 * (cfg.num_layers * (2 * cfg.hidden_size + 2 * cfg.head_dim) + cfg.hidden_size),
            kv: CudaBackend::kv_bytes_per_block(cfg, block_size) * num_blocks,
            headroom: 512 << 20,
        }
    }

    /// Refuses, with the numbers, a need beyond the device's free memory.
    fn check(&self, ctx: &CudaContext, ordinal: usize, num_blocks: usize) -> Result<()> {
        let need = self.kv + self.weights + self.headroom;
        let (free, total) = ctx.mem_get_info().map_err(|e| drv("memory query", e))?;
        if need > free {
            return Err(EngineError::Backend(format!(
                "not enough GPU memory: cuda:{ordinal} has {:.2} GiB free of {:.2} GiB, but this \
                 needs {:.2} GiB \
                 (weights {:.2} GiB + KV cache {:.2} GiB for {num_blocks} blocks + {:.2} GiB \
                 working space); ask for fewer KV blocks or use a larger GPU",
                free as f64 / GIB,
                total as f64 / GIB,
                need as f64 / GIB,
                self.weights as f64 / GIB,
                self.kv as f64 / GIB,
                self.headroom as f64 / GIB
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
