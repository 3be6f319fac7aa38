//! The KV capacity `gpu-bench` reports: what a served engine would give itself on the device.

use kvmesh_gpu::backend::cuda::{Device, MemoryPlan};
use kvmesh_gpu::backend::{CudaOptions, KvBudget};
use kvmesh_gpu::config::ModelConfig;

use super::{Args, BLOCK_SIZE};

/// The KV cache a served engine gives itself on this device at `--memory-share`, with the
/// engine's default step limits, the device otherwise empty.
pub struct KvCapacity {
    pub tokens: Option<usize>,
    pub plan: MemoryPlan,
    pub total: usize,
    /// Why there is none, when the model does not fit.
    pub refusal: Option<String>,
}

pub fn kv_line(kv: &KvCapacity) -> String {
    let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
    match (kv.tokens, &kv.refusal) {
        (Some(t), _) => format!(
            "KV capacity  {t} tokens at the default memory share of {:.1} GiB (weights {:.2} GiB, activations {:.2} GiB)",
            gib(kv.total),
            gib(kv.plan.weights),
            gib(kv.plan.activations)
        ),
        (None, Some(why)) => format!("KV capacity  none: {why}"),
        (None, None) => "KV capacity  unknown".into(),
    }
}

pub fn kv_json(kv: &KvCapacity, share: f64) -> serde_json::Value {
    serde_json::json!({
        "memory_share": share,
        "device_total_bytes": kv.total,
        "tokens": kv.tokens,
        "weights_bytes": kv.plan.weights,
        "activations_bytes": kv.plan.activations,
        "step_tokens": kv.plan.tokens,
        "logit_rows": kv.plan.rows,
        "fixed_bytes": kv.plan.fixed,
        "bytes_per_block": kv.plan.per_block,
        "refusal": kv.refusal,
    })
}

/// What a served engine would give itself for KV on this device (see [`KvCapacity`]).
pub fn kv_capacity(args: &Args, cfg: &ModelConfig, device: &Device) -> anyhow::Result<KvCapacity> {
    let (_, total) = device.memory_info()?;
    let plan = MemoryPlan::of(cfg, &CudaOptions::device(args.device), BLOCK_SIZE);
    if cfg.hybrid.is_some() {
        return Ok(KvCapacity {
            tokens: None,
            plan,
            total,
            refusal: Some(
                "not computed for a hybrid model here: its budget is split between the \
                 full-attention layers' KV and the recurrent-state slots when it is served"
                    .into(),
            ),
        });
    }
    let (tokens, refusal) = match plan.blocks(
        KvBudget::Share(args.memory_share),
        args.device,
        total,
        total,
    ) {
        Ok(b) => (Some(b * BLOCK_SIZE), None),
        Err(e) => (None, Some(e.to_string())),
    };
    Ok(KvCapacity {
        tokens,
        plan,
        total,
        refusal,
    })
}
