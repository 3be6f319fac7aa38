//! The same weights stored every way Hugging Face ships them — one file or sharded with an
//! index, bf16, f16 or f32 — load into the same model.

use std::path::{Path, PathBuf};

use kvmesh_gpu::backend::cpu::{CpuBackend, CpuModel};
use kvmesh_gpu::backend::{Backend, ForwardBatch, SeqInput};
use kvmesh_gpu::kv_cache::BlockId;
use kvmesh_gpu::model::LoadedModel;
use kvmesh_gpu::safetensors::{write_file, DType};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/tiny-llama")
}

fn last_logits(dir: &Path) -> Vec<f32> {
    let m = LoadedModel::from_dir(dir).unwrap();
    let cpu = CpuModel::load(&m.config, &m.weights).unwrap();
    let mut b = CpuBackend::new(cpu, 4, 16).unwrap();
    let ids: Vec<u32> = (0..20).map(|i| (i * 37 + 5) % 1000).collect();
    let table = [BlockId(3), BlockId(1)];
    let seqs = vec![SeqInput {
        tokens: &ids,
        start_pos: 0,
        context_len: 0,
        block_table: &table,
        want_logits: true,
        state_slot: None,
    }];
    b.forward(&ForwardBatch { seqs }).unwrap().remove(0)
}

/// Copies the fixture's side files into `dir` and returns its tensors as f32.
fn copy_with_tensors(dir: &Path) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).unwrap();
    for f in [
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        std::fs::copy(fixture().join(f), dir.join(f)).unwrap();
    }
    let m = LoadedModel::from_dir(&fixture()).unwrap();
    m.weights
        .names()
        .into_iter()
        .map(|n| {
            let shape = m.weights.info(n).unwrap().shape.clone();
            let data = m.weights.f32(n, &shape).unwrap();
            (n.to_string(), shape, data)
        })
        .collect()
}

fn tmp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("kvmesh-formats-{}-{name}", std::process::id()))
}

#[test]
fn sharded_checkpoints_load_like_single_files() {
    let want = last_logits(&fixture());
    let dir = tmp("sharded");
    let tensors = copy_with_tensors(&dir);
    let half = tensors.len() / 2;
    let (a, b) = tensors.split_at(half);
    let names = [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ];
    write_file(&dir.join(names[0]), a, DType::BF16).unwrap();
    write_file(&dir.join(names[1]), b, DType::BF16).unwrap();
    let map: serde_json::Map<String, serde_json::Value> = a
        .iter()
        .map(|t| (t.0.clone(), names[0].into()))
        .chain(b.iter().map(|t| (t.0.clone(), names[1].into())))
        .collect();
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::json!({"metadata": {}, "weight_map": map}).to_string(),
    )
    .unwrap();
    assert_eq!(
        last_logits(&dir),
        want,
        "the same bf16 values, split in two shards"
    );

    // A shard the index names but that is missing is named at load.
    std::fs::remove_file(dir.join(names[1])).unwrap();
    let err = LoadedModel::from_dir(&dir).err().unwrap().to_string();
    assert!(err.contains(names[1]), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn f32_and_f16_weights_give_the_same_logits() {
    let want = last_logits(&fixture());
    // f32 runs other kernels (another summation order); f16 rounds some bf16 values.
    for (dtype, tol) in [(DType::F32, 1e-4), (DType::F16, 2e-2)] {
        let dir = tmp(dtype.name());
        let tensors = copy_with_tensors(&dir);
        write_file(&dir.join("model.safetensors"), &tensors, dtype).unwrap();
        let got = last_logits(&dir);
        let max = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(max <= tol, "{}: max logit difference {max}", dtype.name());
        std::fs::remove_dir_all(&dir).ok();
    }
}
