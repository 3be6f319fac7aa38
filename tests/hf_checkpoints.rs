//! Checkpoints as transformers writes them, used the way a user uses them: `kvmesh serve
//! --model DIR` answering over HTTP, `kvmesh model inspect DIR`, and refusals of what kvmesh
//! does not understand.
//!
//! The `hf-*` folders were written by transformers' `save_pretrained` (see
//! `scripts/reference_logits.py`), whose greedy continuations are in
//! `tests/fixtures/reference/`. Each is served twice: with its own config.json (the
//! `rope_parameters` layout) and with the same config in the legacy layout. Qwen3.5's
//! hybrid checkpoints (`scripts/qwen35_fixtures.py`, which has no legacy layout to write)
//! are served once each, alone and in concurrent batches.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{ModelWithConfig, Server};
use serde_json::{json, Value};

/// Below this gap between transformers' best two logits a different greedy token is a
/// rounding tie (bf16 weights upcast on both sides still round differently in places).
const TIE_GAP: f64 = 1e-3;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every dense checkpoint scripts/reference_logits.py wrote with transformers.
fn hf_models() -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(repo().join("tests/fixtures/models"))
        .expect("fixtures")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        // FP8 checkpoints have their own reference (tests/fp8_reference.rs, no legacy layout).
        .filter(|n| n.starts_with("hf-") && !is_hybrid(n) && !n.contains("-fp8"))
        .collect();
    v.sort();
    assert!(v.len() >= 9, "hf-* fixtures missing: {v:?}");
    v
}

/// Every hybrid (Qwen3.5) checkpoint scripts/qwen35_fixtures.py wrote with transformers.
fn hybrid_models() -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(repo().join("tests/fixtures/models"))
        .expect("fixtures")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("hf-") && is_hybrid(n))
        .collect();
    v.sort();
    assert!(v.len() >= 4, "hf-qwen35-* fixtures missing: {v:?}");
    v
}

/// Qwen3.5's hybrid checkpoints: their fixtures have no legacy layout and record their
/// near-ties per generated token (`greedy_gaps`).
fn is_hybrid(name: &str) -> bool {
    let text = std::fs::read_to_string(model_dir(name).join("config.json")).expect("config");
    let cfg: Value = serde_json::from_str(&text).expect("config json");
    cfg["model_type"]
        .as_str()
        .is_some_and(|t| t.starts_with("qwen3_5"))
}

fn model_dir(name: &str) -> PathBuf {
    repo().join("tests/fixtures/models").join(name)
}

fn fixture(name: &str) -> Value {
    let p = repo().join(format!("tests/fixtures/reference/{name}.json"));
    serde_json::from_str(&std::fs::read_to_string(&p).expect("fixture")).expect("fixture json")
}

fn ids(v: &Value) -> Vec<u64> {
    serde_json::from_value(v.clone()).expect("token ids")
}

fn kvmesh(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvmesh"))
        .args(args)
        .output()
        .expect("run kvmesh");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `dir` with a config.json edited by `edit`.
fn with_edited_config(dir: &Path, tag: &str, edit: impl FnOnce(&mut Value)) -> ModelWithConfig {
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    edit(&mut cfg);
    let path =
        std::env::temp_dir().join(format!("kvmesh-config-{}-{tag}.json", std::process::id()));
    std::fs::write(&path, cfg.to_string()).unwrap();
    let m = ModelWithConfig::new(dir, &path);
    std::fs::remove_file(&path).ok();
    m
}

#[tokio::test]
async fn greedy_over_http_matches_transformers_in_both_config_layouts() {
    for name in hf_models() {
        let name = name.as_str();
        let fx = fixture(name);
        let dir = model_dir(name);
        let legacy =
            ModelWithConfig::new(&dir, &repo().join(fx["legacy_config"].as_str().unwrap()));
        let f32_weights = name.ends_with("-f32");
        for (layout, path) in [
            ("config.json", dir.as_path()),
            ("legacy", legacy.path.as_path()),
        ] {
            let s = Server::start(&["--model", path.to_str().unwrap(), "--num-kv-blocks", "64"]);
            for p in fx["prompts"].as_array().unwrap() {
                let ctx = format!("{name} ({layout}) {}", p["name"]);
                let prompt = ids(&p["ids"]);
                let want = ids(&p["greedy"]);
                let (status, r) = s
                    .post(
                        "/v1/completions",
                        json!({"prompt": prompt, "max_tokens": want.len(), "temperature": 0,
                               "ignore_eos": true, "return_token_ids": true}),
                    )
                    .await;
                assert_eq!(status, 200, "{ctx}: {r}");
                let got = ids(&r["choices"][0]["token_ids"]);
                if f32_weights {
                    assert_eq!(got, want, "{ctx}: greedy tokens differ from transformers'");
                } else if let Some(k) = got.iter().zip(&want).position(|(a, b)| a != b) {
                    let gap = p["steps"]["gap"][prompt.len() - 1 + k].as_f64().unwrap();
                    assert!(
                        gap < TIE_GAP,
                        "{ctx}: token {k} differs from transformers' ({got:?} vs {want:?}) \
                         where their top two logits are {gap} apart"
                    );
                } else {
                    assert_eq!(got.len(), want.len(), "{ctx}");
                }
            }
            println!("{name} ({layout}): greedy continuations match transformers over HTTP");
        }
    }
}

/// Qwen3.5 served over HTTP: each prompt's greedy continuation is transformers' (exactly in
/// f32; up to a near-tie of theirs in bf16), then every prompt three times at once answers
/// as it did alone. The step budget of 16 tokens splits the long prompt over several steps
/// beside the others' decode tokens; the state slots are all free again at the end, and the
/// repeated long prompt was resumed from the prefix cache's saved state.
#[tokio::test]
async fn hybrid_models_serve_greedy_like_transformers_alone_and_batched() {
    for name in hybrid_models() {
        let name = name.as_str();
        let fx = fixture(name);
        let dir = model_dir(name);
        let s = Server::start(&[
            "--model",
            dir.to_str().unwrap(),
            "--num-kv-blocks",
            "64",
            "--max-num-batched-tokens",
            "16",
            "--max-num-seqs",
            "8",
        ]);
        let body = |prompt: &[u64], n: usize| {
            json!({"prompt": prompt, "max_tokens": n, "temperature": 0,
                   "ignore_eos": true, "return_token_ids": true})
        };
        let prompts = fx["prompts"].as_array().unwrap();
        let mut alone = Vec::new();
        for p in prompts {
            let ctx = format!("{name} {}", p["name"]);
            let prompt = ids(&p["ids"]);
            let want = ids(&p["greedy"]);
            let (status, r) = s.post("/v1/completions", body(&prompt, want.len())).await;
            assert_eq!(status, 200, "{ctx}: {r}");
            let got = ids(&r["choices"][0]["token_ids"]);
            if let Some(k) = got.iter().zip(&want).position(|(a, b)| a != b) {
                let gap = p["greedy_gaps"][k].as_f64().unwrap();
                assert!(
                    !name.ends_with("-f32") && gap < TIE_GAP,
                    "{ctx}: token {k} differs from transformers' ({got:?} vs {want:?}) \
                     where their top two logits are {gap} apart"
                );
            } else {
                assert_eq!(got, want, "{ctx}");
            }
            alone.push((prompt, got));
        }
        let batch: Vec<_> = alone.iter().cycle().take(3 * alone.len()).collect();
        let together = futures::future::join_all(
            batch
                .iter()
                .map(|(prompt, want)| s.post("/v1/completions", body(prompt, want.len()))),
        )
        .await;
        for ((status, r), (_, want)) in together.iter().zip(&batch) {
            assert_eq!(*status, 200, "{name}: {r}");
            assert_eq!(
                &ids(&r["choices"][0]["token_ids"]),
                want,
                "{name}: a request in a batch answers as alone"
            );
        }
        assert_eq!(s.metric("kvmesh:num_state_slots").await, 8.0, "{name}");
        let used = s
            .wait_metric("kvmesh:state_slots_used", 5, |v| v == 0.0)
            .await;
        assert_eq!(used, 0.0, "{name}: every state slot is free again");
        // The repeated prompts resumed from the states saved after their last full block
        // (the long prompt spans blocks of 16), and the saved states are shown.
        assert_eq!(s.metric("kvmesh:num_state_snapshots").await, 8.0, "{name}");
        assert!(
            s.metric("kvmesh:state_snapshots_used").await > 0.0,
            "{name}"
        );
        let hits = s.metric("kvmesh:prefix_cache_hits_total").await;
        assert!(hits >= 32.0, "{name}: {hits} prompt tokens resumed");
        println!("{name}: greedy continuations match transformers over HTTP, alone and batched");
    }
}

#[test]
fn model_inspect_shows_what_the_engine_uses() {
    let dir = model_dir("hf-qwen2-yarn-window-f32");
    let (ok, out, err) = kvmesh(&["model", "inspect", dir.to_str().unwrap()]);
    assert!(ok, "{err}");
    for want in [
        "qwen2 (Qwen2ForCausalLM)",
        "2 layers, hidden 64, intermediate 128, 4 heads / 2 kv heads of 16",
        "yarn, theta 10000",
        "factor 4",
        "original_max_position_embeddings 32",
        "read from rope_parameters",
        "sliding window of 8 tokens on layers 1, whole context on the others",
        "128 tokens (original_max_position_embeddings 32 x yarn factor 4)",
        "eos [1,2]",
        "512 bytes as f32",
        "chat_template.jinja",
    ] {
        assert!(out.contains(want), "missing {want:?} in:\n{out}");
    }
    let (ok, json_out, err) = kvmesh(&["model", "inspect", dir.to_str().unwrap(), "--json"]);
    assert!(ok, "{err}");
    let v: Value = serde_json::from_str(&json_out).expect("inspect --json is JSON");
    assert_eq!(v["rope"]["type"], "yarn");
    let af = 0.1 * 4f64.ln() + 1.0;
    assert!((v["rope"]["attention_factor"].as_f64().unwrap() - af).abs() < 1e-9);
    assert_eq!(v["layer_windows"], json!([null, 8]));
    assert_eq!(v["max_context"], 128);
    assert_eq!(v["kv_bytes_per_token"]["bf16"], 2 * 2 * 32 * 2);

    // The legacy layout of the same config reads to the same model.
    let fx = fixture("hf-qwen2-yarn-window-f32");
    let legacy = ModelWithConfig::new(&dir, &repo().join(fx["legacy_config"].as_str().unwrap()));
    let (ok, legacy_out, err) =
        kvmesh(&["model", "inspect", legacy.path.to_str().unwrap(), "--json"]);
    assert!(ok, "{err}");
    let mut a = v.clone();
    let mut b: Value = serde_json::from_str(&legacy_out).unwrap();
    for x in [&mut a, &mut b] {
        let o = x.as_object_mut().unwrap();
        for k in ["path", "declared_dtype", "ignored_config_fields"] {
            o.remove(k);
        }
        o["rope"].as_object_mut().unwrap().remove("read_from");
    }
    assert_eq!(a, b, "the two layouts read differently");
    assert!(legacy_out.contains("legacy layout"), "{legacy_out}");

    // The embedded model needs no folder.
    let (ok, out, err) = kvmesh(&["model", "inspect"]);
    assert!(ok && out.contains("shakespeare (embedded)"), "{out}{err}");
}

/// What kvmesh does not understand stops `serve` and `model inspect` with a message naming
/// the field, its value and what is supported.
#[test]
fn what_is_not_understood_is_refused_by_name() {
    let base = model_dir("hf-llama-llama3-f32");
    type Edit = Box<dyn FnOnce(&mut Value)>;
    let cases: Vec<(&str, Edit, Vec<&str>)> = vec![
        (
            "rope-type",
            Box::new(|c| c["rope_parameters"]["rope_type"] = json!("longrope")),
            vec!["rope_parameters", "longrope", "yarn"],
        ),
        (
            "quantized",
            Box::new(|c| c["quantization_config"] = json!({"quant_method": "gptq", "bits": 4})),
            vec!["quantized", "gptq"],
        ),
        (
            "activation",
            Box::new(|c| c["hidden_act"] = json!("gelu")),
            vec!["hidden_act", "gelu", "silu"],
        ),
        (
            "window",
            Box::new(|c| c["sliding_window"] = json!(4096)),
            vec!["sliding_window", "4096", "llama"],
        ),
        (
            "unknown-field",
            Box::new(|c| c["attn_logit_softcapping"] = json!(50.0)),
            vec!["attn_logit_softcapping", "50.0"],
        ),
        (
            "two-layouts",
            Box::new(|c| c["rope_scaling"] = json!({"type": "linear", "factor": 2.0})),
            vec!["rope_parameters", "rope_scaling"],
        ),
        (
            "untied-without-head",
            // The weights have their own lm_head; saying they are tied leaves it unexplained.
            Box::new(|c| c["tie_word_embeddings"] = json!(true)),
            vec!["tie_word_embeddings", "lm_head.weight"],
        ),
    ];
    for (tag, edit, wants) in cases {
        let m = with_edited_config(&base, tag, edit);
        let dir = m.path.to_str().unwrap();
        for args in [
            vec!["serve", "--model", dir, "--port", "0"],
            vec!["model", "inspect", dir],
        ] {
            let (ok, _, err) = kvmesh(&args);
            assert!(!ok, "{tag}: {args:?} should refuse");
            for w in &wants {
                assert!(
                    err.contains(w),
                    "{tag}: {args:?}: {w:?} not named in:\n{err}"
                );
            }
        }
    }

    // Tensors the config does not account for: biases present, attention_bias off.
    let m = with_edited_config(&model_dir("hf-llama-linear-bias-bf16"), "bias", |c| {
        c["attention_bias"] = json!(false)
    });
    let (ok, _, err) = kvmesh(&["serve", "--model", m.path.to_str().unwrap(), "--port", "0"]);
    assert!(!ok);
    assert!(
        err.contains("_proj.bias") && err.contains("attention_bias"),
        "{err}"
    );

    // Untied embeddings with no head to be found: never the embeddings in its place.
    let m = with_edited_config(&model_dir("hf-qwen2-bf16"), "untied", |c| {
        c["tie_word_embeddings"] = json!(false)
    });
    let (ok, _, err) = kvmesh(&["serve", "--model", m.path.to_str().unwrap(), "--port", "0"]);
    assert!(!ok);
    assert!(
        err.contains("missing") && err.contains("lm_head.weight"),
        "{err}"
    );

    // Dynamic RoPE is served on the CPU; the CUDA backend refuses it (see cuda_parity.rs).
    let (ok, out, err) = kvmesh(&[
        "model",
        "inspect",
        model_dir("hf-llama-dynamic-f32").to_str().unwrap(),
    ]);
    assert!(ok && out.contains("dynamic"), "{out}{err}");
}
