//! `gpu-bench --gated-deltanet`: kvmesh's Gated DeltaNet kernels timed alone on a hybrid
//! preset's linear-layer shape, one layer per case (`backend::cuda::delta_timing`), written as
//! the JSON `scripts/fla_peer_bench.py` reads to time flash-linear-attention's kernels on the
//! same shapes.

use std::path::Path;

use kvmesh_gpu::backend::cpu::delta::DeltaParams;
use kvmesh_gpu::backend::cuda::delta::DeltaPath;
use kvmesh_gpu::backend::cuda::delta_timing::{time_delta_mix, DELTA_CASES};
use kvmesh_gpu::init::preset;

use crate::programs::write_json;

/// Random layer weights of `preset`'s linear layers: decays from slow to fast, as the parity
/// test draws them.
fn params(preset_name: &str) -> anyhow::Result<DeltaParams> {
    let cfg = preset(None, preset_name)?;
    let Some(hy) = cfg.hybrid.clone() else {
        anyhow::bail!("--gated-deltanet times a hybrid (Qwen3.5) model's linear layers; {preset_name} has none");
    };
    Ok(DeltaParams::random(hy, cfg.rms_norm_eps as f32, 11))
}

/// Times every case on device `ordinal` for each preset and writes one JSON per preset
/// (`json`, with the preset's name before the extension when there are several).
pub fn run(presets: &[String], ordinal: usize, reps: usize, json: &Path) -> anyhow::Result<()> {
    for name in presets {
        let p = params(name)?;
        let hy = &p.hy;
        println!(
            "{name}: one Gated DeltaNet layer ({} key heads of {}, {} value heads of {}, conv {}), median of {reps}",
            hy.linear_num_key_heads,
            hy.linear_key_head_dim,
            hy.linear_num_value_heads,
            hy.linear_value_head_dim,
            hy.linear_conv_kernel_dim
        );
        let mut cases = Vec::new();
        println!(
            "{:<20} {:>12} {:>12} {:>12}",
            "case", "recurrent ms", "scan ms", "chunked ms"
        );
        for c in DELTA_CASES {
            let ms = time_delta_mix(ordinal, &p, c, reps, DeltaPath::Recurrent)?;
            let scan_ms = time_delta_mix(ordinal, &p, c, reps, DeltaPath::Scan)?;
            let chunked_ms = time_delta_mix(ordinal, &p, c, reps, DeltaPath::Chunked)?;
            println!(
                "{:<20} {ms:>12.3} {scan_ms:>12.3} {chunked_ms:>12.3}",
                c.label
            );
            cases.push(
                serde_json::json!({"label": c.label, "seqs": c.seqs, "tokens": c.tokens,
                "fresh": c.fresh, "ms": ms, "scan_ms": scan_ms, "chunked_ms": chunked_ms}),
            );
        }
        let path = if presets.len() > 1 {
            let stem = json.file_stem().and_then(|s| s.to_str()).unwrap_or("gdn");
            json.with_file_name(format!("{stem}-{name}.json"))
        } else {
            json.to_path_buf()
        };
        write_json(
            &path,
            &serde_json::json!({
                "benchmark": "gated-deltanet-kernels-kvmesh",
                "preset": name,
                "shape": {"nk": hy.linear_num_key_heads, "nv": hy.linear_num_value_heads,
                    "dk": hy.linear_key_head_dim, "dv": hy.linear_value_head_dim,
                    "kw": hy.linear_conv_kernel_dim},
                "timing": format!("CUDA events around one layer's mixing, median of {reps} after one warm-up; f32 projections in, bf16 out; prompts run the recurrence token by token. ms: delta_conv_silu + gated_delta_rule (with the gated norm); scan_ms: the scan path (CudaOptions::gdn_scan: delta_conv_chunks, delta_conv_window, delta_qk_gates, delta_scan, delta_gated_norm); chunked_ms: the same with the chunked form in place of delta_scan (CudaOptions::gdn_chunked: delta_chunk_prep, delta_chunk_scan; for the decode cases, what those launches would cost: the engine's decode steps run gated_delta_rule on every path)"),
                "cases": cases,
            }),
        )?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_9b_layer_is_what_the_kernels_take_and_dense_presets_are_refused() {
        let p = params("qwen3.5-9b").unwrap();
        let d = kvmesh_gpu::backend::cuda::delta::DeltaDims::of(&p).unwrap();
        assert_eq!((d.nk, d.nv, d.dk, d.dv, d.kw), (16, 32, 128, 128, 4));
        assert_eq!(p.conv.len(), 8192 * 4);
        assert!(p.neg_a.iter().all(|&a| a < 0.0));
        let e = params("qwen3-8b").unwrap_err().to_string();
        assert!(e.contains("qwen3-8b") && e.contains("hybrid"), "{e}");
    }
}
