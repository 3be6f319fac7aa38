//! A static-activation twin of `hf-qwen2-fp8-ct`, made at test time: the same files, its
//! config's activations turned into llm-compressor's static per-tensor scheme
//! (`strategy: tensor`, `dynamic: false`) and an `input_scale` written for every quantized
//! layer in a second shard. q, k and v get different scales, so their parts of the stacked
//! product are quantized apart. The CPU reference ignores activation scales (it is the
//! dequantized model), so the twin is held to it as the dynamic fixtures are.

use super::*;

/// The fixture it is made from (its prompts are the twin's).
pub const STATIC_BASE: &str = "hf-qwen2-fp8-ct";

pub fn fp8_static_twin() -> LoadedModel {
    let src = model_dir(STATIC_BASE);
    static MADE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = MADE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dst = std::env::temp_dir().join(format!("kvmesh-fp8-static-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dst).unwrap();
    for e in std::fs::read_dir(&src).unwrap() {
        let path = e.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if name != "config.json" && !name.ends_with(".safetensors") {
            std::fs::copy(&path, dst.join(&name)).unwrap();
        }
    }
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let groups = cfg["quantization_config"]["config_groups"]
        .as_object_mut()
        .unwrap();
    for g in groups.values_mut() {
        g["input_activations"] = json!({"num_bits": 8, "type": "float", "symmetric": true,
            "strategy": "tensor", "dynamic": false, "group_size": null});
    }
    std::fs::write(dst.join("config.json"), cfg.to_string()).unwrap();
    let base = load(STATIC_BASE);
    let q = base.config.quantization.as_ref().unwrap();
    let scales: Vec<(String, Vec<usize>, Vec<f32>)> = base
        .config
        .linear_layers()
        .into_iter()
        .filter(|(m, _, _)| q.scheme_of(m).is_some())
        .enumerate()
        .map(|(i, (m, _, _))| {
            (
                format!("{m}.input_scale"),
                vec![1],
                vec![0.01 + 0.005 * (i % 3) as f32],
            )
        })
        .collect();
    let (one, two) = (
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    );
    std::fs::copy(src.join("model.safetensors"), dst.join(one)).unwrap();
    kvmesh_gpu::safetensors::write_file(&dst.join(two), &scales, DType::F32).unwrap();
    let mut map = serde_json::Map::new();
    for n in base.weights.names() {
        map.insert(n.to_string(), json!(one));
    }
    for (n, _, _) in &scales {
        map.insert(n.clone(), json!(two));
    }
    std::fs::write(
        dst.join("model.safetensors.index.json"),
        json!({"metadata": {}, "weight_map": map}).to_string(),
    )
    .unwrap();
    let twin = LoadedModel::from_dir(&dst).unwrap_or_else(|e| panic!("the static twin: {e}"));
    let _ = std::fs::remove_dir_all(&dst);
    twin
}
