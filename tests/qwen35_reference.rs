//! Qwen3.5's hybrid text model on the CPU against Hugging Face transformers.
//!
//! `scripts/qwen35_fixtures.py` wrote the `hf-qwen35-*` checkpoints with transformers'
//! own `save_pretrained` (both layouts: `Qwen3_5ForCausalLM`, and
//! `Qwen3_5ForConditionalGeneration` with its vision tower and an `mtp.*` head kvmesh must
//! leave unread) and recorded what transformers computes on them in
//! `tests/fixtures/reference/<model>.json`. Here kvmesh's config reader and
//! `HybridModel` answer the same questions with no PyTorch involved:
//!
//! - the last prompt position's logits, prefilling the delta rule in chunks of 64
//!   (transformers' own), 16 and 7 (so the 45-token prompt crosses chunk boundaries at
//!   places that do not divide it), in two calls (a prefill continued mid-chunk), and one
//!   token at a time (the recurrent step alone);
//! - the greedy continuation of 24 tokens: prefill, then one decode step per token.
//!
//! Floats are compared within `2e-3 + 2e-3 * |reference|`, as `forward_reference.rs`
//! does; a greedy token may differ only after a position where transformers' best two
//! logits were within `TIE_GAP`. Both the f32 and the bf16 checkpoints are held to that:
//! bf16 weights are widened to f32 on both sides, so the math is the same.
//!
//! Then what must be refused: configs with an unknown layer type, a mixture-of-experts
//! variant or a state dtype kvmesh does not keep, each naming the field. How the engine
//! serves these models is `qwen35_serving.rs`'s.

mod common;

use std::path::Path;

use common::reference::{self, fnv1a64, model_dir};
use common::ModelWithConfig;
use kvmesh_gpu::backend::cpu::{argmax, HybridModel};
use kvmesh_gpu::config::{HybridLayout, LayerType};
use kvmesh_gpu::model::LoadedModel;
use kvmesh_gpu::safetensors::{write_file_typed, DType};
use serde::Deserialize;
use serde_json::Value;

const TIE_GAP: f32 = 1e-3;

#[derive(Deserialize)]
struct Fixture {
    model: String,
    architecture: String,
    layer_types: Vec<String>,
    transformers_version: String,
    torch_version: String,
    safetensors_fnv1a64: String,
    new_tokens: usize,
    prompts: Vec<Prompt>,
}

#[derive(Deserialize)]
struct Prompt {
    name: String,
    ids: Vec<u32>,
    last_logits: Vec<f32>,
    argmax_top2_gap: Vec<f32>,
    argmax: Vec<u32>,
    greedy: Vec<u32>,
    greedy_gaps: Vec<f32>,
}

/// The script that writes fixture `name`.
fn script(name: &str) -> &'static str {
    if name.contains("-fp8-") {
        "scripts/qwen35_fp8_fixtures.py"
    } else {
        "scripts/qwen35_fixtures.py"
    }
}

fn fixture(name: &str) -> Fixture {
    reference::read(name, 1, script(name))
}

fn load(name: &str, fx: &Fixture) -> LoadedModel {
    let dir = model_dir(name);
    let st = std::fs::read(dir.join("model.safetensors")).expect("read model.safetensors");
    assert_eq!(
        fnv1a64(&st),
        fx.safetensors_fnv1a64,
        "{name}: model.safetensors is not the file the reference was computed from; rerun \
         {} (the fixture is stale, this is not a forward-pass bug)",
        script(name)
    );
    LoadedModel::from_dir(&dir).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn assert_close(ctx: &str, got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len(), "{ctx}: logits length");
    let mut worst = 0f32;
    for (i, (&a, &b)) in got.iter().zip(want).enumerate() {
        let d = (a - b).abs();
        assert!(
            d <= 2e-3 + 2e-3 * b.abs(),
            "{ctx}: logit {i} is {a}, transformers {b} (diff {d})"
        );
        worst = worst.max(d);
    }
    worst
}

fn assert_last_argmax(ctx: &str, got: &[f32], p: &Prompt) {
    let n = p.ids.len() - 1;
    let g = argmax(got);
    if p.argmax_top2_gap[n] >= TIE_GAP {
        assert_eq!(g, p.argmax[n], "{ctx}: argmax");
    }
}

/// Equal to transformers' continuation, or equal up to a near-tie of theirs.
fn assert_greedy(ctx: &str, got: &[u32], p: &Prompt) {
    for (k, (&g, &w)) in got.iter().zip(&p.greedy).enumerate() {
        if g != w {
            let gap = p.greedy_gaps[k];
            assert!(
                gap < TIE_GAP,
                "{ctx}: token {k} is {g}, transformers chose {w} (their gap {gap}); got \
                 {got:?}, want {:?}",
                p.greedy
            );
            eprintln!("{ctx}: parts from transformers at token {k} on a near-tie (gap {gap})");
            return;
        }
    }
    assert_eq!(got.len(), p.greedy.len(), "{ctx}: length");
}

fn check(name: &str) {
    let fx = fixture(name);
    assert_eq!(fx.model, name);
    println!(
        "{name}: reference from transformers {} / torch {}",
        fx.transformers_version, fx.torch_version
    );
    let model = load(name, &fx);
    let cfg = &model.config;
    let hy = cfg.hybrid.as_ref().expect("a hybrid config");
    let layout_name = hy.layout.architecture_name();
    assert_eq!(layout_name, fx.architecture);
    let types: Vec<&str> = hy.layer_types.iter().map(|t| t.name()).collect();
    assert_eq!(
        types, fx.layer_types,
        "{name}: layer types as transformers read them"
    );

    let base = HybridModel::load(cfg, &model.weights).expect("HybridModel::load");
    let mut worst = 0f32;
    for p in &fx.prompts {
        let ctx = format!("{name} {}", p.name);
        let n = p.ids.len();
        for chunk in [64, 16, 7] {
            let m = HybridModel::load(cfg, &model.weights)
                .unwrap()
                .with_chunk(chunk);
            let mut seq = m.new_sequence();
            let got = m.forward(&mut seq, &p.ids).expect("prefill");
            let c = format!("{ctx} prefill (chunk {chunk})");
            worst = worst.max(assert_close(&c, &got, &p.last_logits));
            assert_last_argmax(&c, &got, p);
        }
        // A prefill continued mid-chunk: the state of the first call carries.
        let m = HybridModel::load(cfg, &model.weights)
            .unwrap()
            .with_chunk(16);
        let mut seq = m.new_sequence();
        let cut = n / 2 + 1;
        m.forward(&mut seq, &p.ids[..cut]).expect("first part");
        let got = m.forward(&mut seq, &p.ids[cut..]).expect("second part");
        worst = worst.max(assert_close(
            &format!("{ctx} prefill in two calls"),
            &got,
            &p.last_logits,
        ));
        // Token by token: the recurrent step only.
        let mut seq = base.new_sequence();
        let mut got = Vec::new();
        for &t in &p.ids {
            got = base.forward(&mut seq, &[t]).expect("step");
        }
        assert_eq!(seq.len(), n);
        worst = worst.max(assert_close(
            &format!("{ctx} token by token"),
            &got,
            &p.last_logits,
        ));

        let cont = base.greedy(&p.ids, fx.new_tokens).expect("greedy");
        assert_greedy(&format!("{ctx} greedy"), &cont, p);
    }
    println!("{name}: prompts max |diff| {worst:.2e}; greedy matches");
}

#[test]
fn hf_qwen35_f32() {
    check("hf-qwen35-f32");
}

#[test]
fn hf_qwen35_interval_bf16() {
    check("hf-qwen35-interval-bf16");
}

#[test]
fn hf_qwen35_gqa_bias_f32() {
    check("hf-qwen35-gqa-bias-f32");
}

#[test]
fn hf_qwen35_cg_bf16() {
    let fx = fixture("hf-qwen35-cg-bf16");
    let model = load("hf-qwen35-cg-bf16", &fx);
    let hy = model.config.hybrid.as_ref().unwrap();
    assert_eq!(hy.layout, HybridLayout::ConditionalGeneration);
    // The vision tower and the mtp head are in the file, and knowingly unread.
    let names = model.weights.names();
    assert!(names.iter().any(|n| n.starts_with("model.visual.")));
    assert!(names.iter().any(|n| n.starts_with("mtp.")));
    assert!(model
        .config
        .ignored_fields
        .contains(&"vision_config".to_string()));
    check("hf-qwen35-cg-bf16");
}

/// What `scripts/qwen35_fp8_fixtures.py` records of an FP8 fixture beyond the others.
#[derive(Deserialize)]
struct Fp8Fixture {
    quant_method: String,
    quantized_weights: Vec<String>,
    reference_from: String,
}

/// An FP8 Qwen3.5 checkpoint: read, exactly the layers its config quantizes stored in FP8
/// (the fixture's list), dequantized at load, and held to transformers on the dequantized
/// weights as the bf16 checkpoints are held to it. Returns the model.
fn check_fp8(name: &str) -> LoadedModel {
    let f: Fp8Fixture = reference::read(name, 1, script(name));
    let model = load(name, &fixture(name));
    let q = model.config.quantization.as_ref().expect("quantized");
    assert_eq!(q.method.name(), f.quant_method);
    assert_eq!(
        reference::quantized_weights(&model),
        f.quantized_weights,
        "{name}: the FP8 layers"
    );
    println!("{name}: {} ({})", q.describe(), f.reference_from);
    check(name);
    model
}

/// llm-compressor's FP8_DYNAMIC recipe as published for Qwen3.5: the full-attention and MLP
/// projections per channel, the Gated DeltaNet layers and the head left bf16.
#[test]
fn hf_qwen35_fp8_ct() {
    let model = check_fp8("hf-qwen35-fp8-ct");
    let q = model.config.quantization.as_ref().unwrap();
    for (m, _, _) in model.config.linear_layers() {
        let fp8 = q.scheme_of(&m).is_some();
        assert_eq!(fp8, !m.contains("linear_attn") && m != "lm_head", "{m}");
    }
}

/// Qwen's block-scaled format on the wrapper's layout (vision tower and MTP head unread),
/// the Gated DeltaNet projections in FP8 but their per-head gate inputs.
#[test]
fn hf_qwen35_fp8_block_cg() {
    let model = check_fp8("hf-qwen35-fp8-block-cg");
    let hy = model.config.hybrid.as_ref().unwrap();
    assert_eq!(hy.layout, HybridLayout::ConditionalGeneration);
    let q = model.config.quantization.as_ref().unwrap();
    let p = "model.language_model.layers.0.linear_attn";
    assert!(q.scheme_of(&format!("{p}.in_proj_qkv")).is_some());
    assert!(q.scheme_of(&format!("{p}.in_proj_a")).is_none());
    // The CUDA backend keeps the FP8 parts in FP8 (tests/cuda_parity.rs runs it); a build
    // without CUDA refuses the device by name.
    if !cfg!(feature = "cuda") {
        let kind =
            kvmesh_gpu::model::BackendKind::Cuda(kvmesh_gpu::backend::CudaOptions::device(0));
        let budget = kvmesh_gpu::model::KvBudget::Blocks(8);
        let e = kvmesh_gpu::model::build_backend(kind, &model, 16, budget)
            .err()
            .expect("refused")
            .to_string();
        assert!(e.contains("without CUDA support"), "{e}");
    }
}

/// The recurrent slot's size follows from the config alone.
#[test]
fn state_slot_size_comes_from_the_config() {
    let fx = fixture("hf-qwen35-f32");
    let model = load("hf-qwen35-f32", &fx);
    let hy = model.config.hybrid.as_ref().unwrap();
    let m = HybridModel::load(&model.config, &model.weights).unwrap();
    let layout = m.state_layout();
    assert_eq!(layout.layers, 2);
    assert_eq!(layout.bytes_per_slot(), hy.state_bytes_per_sequence());
    // conv window: 3 x (2 * 2 * 16 + 4 * 16); state: 4 heads of 16 x 16; two layers.
    assert_eq!(layout.bytes_per_slot(), 4 * 2 * (3 * 128 + 4 * 16 * 16));
    assert_eq!(
        hy.layer_types
            .iter()
            .filter(|&&t| t == LayerType::FullAttention)
            .count(),
        2
    );
    let mut seq = m.new_sequence();
    assert!(seq.state.as_slice().iter().all(|&x| x == 0.0));
    m.forward(&mut seq, &[0, 5, 9]).unwrap();
    assert_eq!(seq.state.as_slice().len() * 4, layout.bytes_per_slot());
    assert!(seq.state.as_slice().iter().any(|&x| x != 0.0));
}

/// The CPU option that runs dense models' products only is refused by name on a hybrid
/// model, rather than ignored.
#[test]
fn dense_only_cpu_options_are_refused_for_a_hybrid_model() {
    use kvmesh_gpu::model::{build_backend, BackendKind, CpuOptions, KvBudget};
    let fx = fixture("hf-qwen35-f32");
    let model = load("hf-qwen35-f32", &fx);
    let refused = |opts: CpuOptions| {
        build_backend(BackendKind::Cpu(opts), &model, 16, KvBudget::Blocks(8))
            .err()
            .expect("refused")
            .to_string()
    };
    let e = refused(CpuOptions {
        bf16_products: true,
        ..Default::default()
    });
    assert!(e.contains("--cpu-bf16-products"), "{e}");
    assert!(build_backend(
        BackendKind::Cpu(CpuOptions::default()),
        &model,
        16,
        KvBudget::Blocks(8)
    )
    .is_ok());
}

/// `hf-qwen35-f32` with its config.json edited by `edit`; the refusal's message.
fn refusal(edit: impl FnOnce(&mut Value)) -> String {
    let dir = model_dir("hf-qwen35-f32");
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    edit(&mut cfg);
    let tmp = std::env::temp_dir().join(format!("kvmesh-qwen35-{}.json", std::process::id()));
    std::fs::write(&tmp, cfg.to_string()).unwrap();
    let m = ModelWithConfig::new(Path::new(&dir), &tmp);
    let _ = std::fs::remove_file(&tmp);
    // Names are checked as the folder loads; shapes as the weights are read.
    let loaded = LoadedModel::from_dir(&m.path)
        .and_then(|l| HybridModel::load(&l.config, &l.weights).map(|_| ()));
    match loaded {
        Ok(()) => panic!("the edited config was accepted"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_configs_are_refused_naming_the_field() {
    let e = refusal(|c| c["layer_types"][1] = "sliding_attention".into());
    assert!(
        e.contains("layer_types[1]") && e.contains("sliding_attention"),
        "{e}"
    );
    let e = refusal(|c| c["mamba_ssm_dtype"] = "float16".into());
    assert!(
        e.contains("mamba_ssm_dtype") && e.contains("float16"),
        "{e}"
    );
    let e = refusal(|c| {
        c["num_experts"] = 64.into();
        c["num_experts_per_tok"] = 8.into();
    });
    assert!(
        e.contains("num_experts") && e.contains("mixture-of-experts"),
        "{e}"
    );
    let e = refusal(|c| {
        c["model_type"] = "qwen3_5_moe_text".into();
        c["architectures"] = serde_json::json!(["Qwen3_5MoeForCausalLM"]);
    });
    assert!(
        e.contains("qwen3_5_moe_text") && e.contains("mixture-of-experts"),
        "{e}"
    );
    let e = refusal(|c| c["full_attention_interval"] = 3.into());
    assert!(e.contains("full_attention_interval"), "{e}");
    let e = refusal(|c| c["linear_conv_kernel_dim"] = 3.into());
    assert!(
        e.contains("conv1d"),
        "a kernel the weights do not have: {e}"
    );
    // A tensor of a part the config does not describe is still refused.
    let e = refusal(|c| c["num_hidden_layers"] = 3.into());
    assert!(e.contains("layer_types") || e.contains("layers"), "{e}");
}

/// `hf-qwen35-fp8-block-cg` rewritten with `change` applied to its tensors (name, shape,
/// values, dtype), in a folder of its own; the load's result.
fn fp8_rewritten(
    tag: &str,
    change: impl FnOnce(&mut Vec<(String, Vec<usize>, Vec<f32>, DType)>),
) -> Result<LoadedModel, String> {
    let name = "hf-qwen35-fp8-block-cg";
    let src = model_dir(name);
    let w = load(name, &fixture(name)).weights;
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>, DType)> = w
        .names()
        .into_iter()
        .map(|n| {
            let i = w.info(n).unwrap();
            let v = match i.dtype {
                DType::F8E4M3 => w.f8_e4m3(n, &i.shape),
                _ => w.f32(n, &i.shape),
            }
            .unwrap();
            (n.to_string(), i.shape.clone(), v, i.dtype)
        })
        .collect();
    change(&mut tensors);
    let dir = std::env::temp_dir().join(format!("kvmesh-q35fp8-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for e in std::fs::read_dir(&src).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_none_or(|x| x != "safetensors") {
            std::fs::copy(&p, dir.join(p.file_name().unwrap())).unwrap();
        }
    }
    write_file_typed(&dir.join("model.safetensors"), &tensors).unwrap();
    let r = LoadedModel::from_dir(&dir).map_err(|e| e.to_string());
    std::fs::remove_dir_all(&dir).ok();
    r
}

/// The parts a Qwen3.5 file carries unread (its multi-token-prediction head, its vision
/// tower) may hold FP8 weights of their own: let be. An FP8 weight in a text layer the
/// config leaves bf16 is refused, naming the tensor and the config's skip list.
#[test]
fn fp8_tensors_outside_the_text_model_are_let_be_and_inside_it_must_be_configured() {
    let as_fp8 = |t: &mut Vec<(String, Vec<usize>, Vec<f32>, DType)>, name: &str| {
        let e = t.iter_mut().find(|e| e.0 == name).unwrap();
        e.2 = vec![0.5; e.2.len()];
        e.3 = DType::F8E4M3;
    };
    let m = fp8_rewritten("mtp", |t| as_fp8(t, "mtp.fc.weight")).expect("an FP8 MTP head");
    HybridModel::load(&m.config, &m.weights).expect("the text model loads");
    let a = "model.language_model.layers.0.linear_attn.in_proj_a.weight";
    let e = fp8_rewritten("in-proj-a", |t| as_fp8(t, a))
        .err()
        .expect("refused");
    assert!(e.contains(a) && e.contains("unquantized"), "{e}");
}
