//! FP8 checkpoints on the CPU against Hugging Face transformers.
//!
//! `scripts/fp8_fixtures.py` wrote three FP8 checkpoints by quantizing `save_pretrained`
//! ones with the published recipes (the block-scaled `fp8` format with partial 128x128
//! blocks and an unquantized head; the same with bf16 scales, tied embeddings and a layer
//! left unquantized by `modules_to_not_convert`; compressed-tensors' float8 with a
//! per-channel and a per-tensor group and an `ignore` list) and recorded what transformers
//! computes with the dequantized weights in `tests/fixtures/reference/<model>.json` (the
//! script says, per fixture, which loader produced the weights it ran). Here kvmesh's
//! reader dequantizes the files at load and its CPU backend answers the same questions as
//! `forward_reference.rs` asks of the bf16 and f32 checkpoints:
//!
//! - one prefill over a shuffled block table, chunked prefill (7-token chunks), and both
//!   prompts in one batch: the last position's logits;
//! - the teacher-forced sequence (prompt + transformers' greedy continuation) at every
//!   position: 24 fixed columns, the top 8, the log-sum-exp and the argmax;
//! - greedy generation through the engine.
//!
//! Floats are compared within `2e-3 + 2e-3 * |reference|` (the dequantized weights are the
//! same f32 products on both sides). Then the same model stored in bf16: its logits stay
//! within a bf16 tolerance of the FP8 model's (2⁻⁶ of the largest logit), and its
//! fingerprint differs from it.

mod common;

use std::path::{Path, PathBuf};

use common::reference::{self, fnv1a64, model_dir, repo, Prompt};
use kvmesh_gpu::backend::cpu::{CpuBackend, CpuModel};
use kvmesh_gpu::backend::{Backend, ForwardBatch, SeqInput};
use kvmesh_gpu::card::ModelCard;
use kvmesh_gpu::engine::{self, EngineConfig, FinishReason, Request, SeqEvent};
use kvmesh_gpu::kv_cache::BlockId;
use kvmesh_gpu::model::{build_backend, BackendKind, CpuOptions, KvBudget, LoadedModel, Numerics};
use kvmesh_gpu::safetensors::{write_file, DType};
use kvmesh_gpu::sampler::SamplingParams;
use serde::Deserialize;

const BLOCK_SIZE: usize = 16;
const BLOCKS: usize = 8;
/// Block ids handed out shuffled, so a prompt's blocks are neither contiguous nor ascending.
const BLOCK_ORDER: [u32; BLOCKS] = [5, 2, 7, 0, 3, 6, 1, 4];
const CHUNK: usize = 7;
/// Below this gap between the reference's best two logits, another argmax is a tie.
const TIE_GAP: f32 = 1e-3;

#[derive(Deserialize)]
struct Fixture {
    model: String,
    architecture: String,
    transformers_version: String,
    compressed_tensors_version: String,
    safetensors_fnv1a64: String,
    reference_from: String,
    quant_method: String,
    quantized_weights: Vec<String>,
    new_tokens: usize,
    columns: Vec<usize>,
    prompts: Vec<Prompt>,
}

fn fixture(name: &str) -> Fixture {
    let fx: Fixture = reference::read(name, 1, "scripts/fp8_fixtures.py");
    assert_eq!(fx.model, name);
    fx
}

/// The fixture's model, checked to be the file the reference was made from and to be read
/// as the quantization the script wrote.
fn load(dir: &Path, fx: &Fixture) -> LoadedModel {
    let st = std::fs::read(dir.join("model.safetensors")).expect("read model.safetensors");
    assert_eq!(
        fnv1a64(&st),
        fx.safetensors_fnv1a64,
        "{}/model.safetensors is not the file the reference was computed from; rerun \
         scripts/fp8_fixtures.py",
        dir.display()
    );
    let model = LoadedModel::from_dir(dir).expect("load model");
    assert_eq!(model.config.arch.architecture_name(), fx.architecture);
    let q = model.config.quantization.as_ref().expect("quantized");
    assert_eq!(q.method.name(), fx.quant_method);
    // Exactly the layers stored in FP8 are the ones the config quantizes.
    assert_eq!(reference::quantized_weights(&model), fx.quantized_weights);
    model
}

fn backend(model: &LoadedModel, blocks: usize) -> CpuBackend {
    let m = CpuModel::load(&model.config, &model.weights).expect("CpuModel::load");
    CpuBackend::new(m, blocks, BLOCK_SIZE).expect("CpuBackend::new")
}

fn table(n: usize) -> Vec<BlockId> {
    BLOCK_ORDER[..n.div_ceil(BLOCK_SIZE)]
        .iter()
        .map(|&i| BlockId(i))
        .collect()
}

fn step(be: &mut dyn Backend, tokens: &[u32], start: usize, ctx: usize, t: &[BlockId]) -> Vec<f32> {
    let batch = ForwardBatch {
        seqs: vec![SeqInput {
            tokens,
            start_pos: start,
            context_len: ctx,
            block_table: t,
            want_logits: true,
            state_slot: None,
        }],
    };
    be.forward(&batch).expect("forward").pop().expect("logits")
}

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

fn close(a: f32, b: f32) -> bool {
    (a - b).abs() <= 2e-3 + 2e-3 * b.abs()
}

fn assert_close(ctx: &str, got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len(), "{ctx}: vocabulary");
    let mut worst = 0f32;
    for (i, (&a, &b)) in got.iter().zip(want).enumerate() {
        assert!(close(a, b), "{ctx}: logit {i} is {a}, transformers {b}");
        worst = worst.max((a - b).abs());
    }
    worst
}

fn assert_argmax(ctx: &str, got: &[f32], want: u32, gap: f32) {
    let g = argmax(got);
    if gap >= TIE_GAP {
        assert_eq!(g, want, "{ctx}: argmax is {g}, transformers {want}");
    }
}

fn log_sum_exp(v: &[f32]) -> f32 {
    let m = v.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    m + v.iter().map(|x| ((x - m) as f64).exp()).sum::<f64>().ln() as f32
}

/// Whole-prompt prefill, chunked prefill, and both prompts in one batch.
fn check_prompts(model: &LoadedModel, fx: &Fixture) -> f32 {
    let mut worst = 0f32;
    for p in &fx.prompts {
        let n = p.ids.len();
        let ctx = format!("{} {}", fx.model, p.name);
        let got = step(&mut backend(model, BLOCKS), &p.ids, 0, n, &table(n));
        worst = worst.max(assert_close(
            &format!("{ctx} prefill"),
            &got,
            &p.last_logits,
        ));
        assert_argmax(&ctx, &got, p.argmax[n - 1], p.argmax_top2_gap[n - 1]);
        let mut be = backend(model, BLOCKS);
        let mut last = Vec::new();
        for start in (0..n).step_by(CHUNK) {
            let end = (start + CHUNK).min(n);
            last = step(&mut be, &p.ids[start..end], start, n, &table(n));
        }
        worst = worst.max(assert_close(
            &format!("{ctx} chunked"),
            &last,
            &p.last_logits,
        ));
    }
    let tables: Vec<Vec<BlockId>> = {
        let mut next = 0;
        fx.prompts
            .iter()
            .map(|p| {
                let k = p.ids.len().div_ceil(BLOCK_SIZE);
                next += k;
                BLOCK_ORDER[next - k..next]
                    .iter()
                    .map(|&i| BlockId(i))
                    .collect()
            })
            .collect()
    };
    let batch = ForwardBatch {
        seqs: fx
            .prompts
            .iter()
            .zip(&tables)
            .map(|(p, t)| SeqInput {
                tokens: &p.ids,
                start_pos: 0,
                context_len: p.ids.len(),
                block_table: t,
                want_logits: true,
                state_slot: None,
            })
            .collect(),
    };
    let out = backend(model, BLOCKS)
        .forward(&batch)
        .expect("batched forward");
    for (p, got) in fx.prompts.iter().zip(&out) {
        let ctx = format!("{} {} batched", fx.model, p.name);
        worst = worst.max(assert_close(&ctx, got, &p.last_logits));
    }
    worst
}

/// The prompt and transformers' continuation, one token at a time, every position checked.
fn check_teacher_forced(model: &LoadedModel, fx: &Fixture) -> f32 {
    let mut worst = 0f32;
    for p in &fx.prompts {
        let seq: Vec<u32> = p.ids.iter().chain(&p.greedy).copied().collect();
        let t = table(seq.len());
        let mut be = backend(model, BLOCKS);
        for pos in 0..seq.len() - 1 {
            let at = format!("{} {} teacher-forced position {pos}", fx.model, p.name);
            let got = step(
                &mut be,
                &seq[pos..pos + 1],
                pos,
                (pos + 1).max(p.ids.len()),
                &t,
            );
            let cols = fx.columns.iter().zip(&p.steps.columns[pos]);
            let tops = p.steps.top_ids[pos].iter().zip(&p.steps.top_logits[pos]);
            for (&id, &want) in cols.chain(tops) {
                assert!(
                    close(got[id], want),
                    "{at}: logit {id} is {}, transformers {want}",
                    got[id]
                );
                worst = worst.max((got[id] - want).abs());
            }
            let lse = log_sum_exp(&got);
            assert!(
                close(lse, p.steps.lse[pos]),
                "{at}: log-sum-exp {lse} vs {}",
                p.steps.lse[pos]
            );
            assert_argmax(&at, &got, p.steps.argmax[pos], p.steps.gap[pos]);
        }
    }
    worst
}

/// Greedy generation through the engine, all prompts at once.
fn check_engine(model: &LoadedModel, fx: &Fixture) {
    let h = engine::spawn(
        Box::new(backend(model, 64)),
        EngineConfig {
            max_model_len: 512,
            block_size: BLOCK_SIZE,
            ..Default::default()
        },
        vec![],
        model.config.vocab_size,
    );
    let params = SamplingParams {
        temperature: 0.0,
        max_tokens: fx.new_tokens,
        ignore_eos: true,
        ..Default::default()
    };
    let subs: Vec<_> = fx
        .prompts
        .iter()
        .map(|p| {
            h.submit(Request {
                prompt: p.ids.clone(),
                params: params.clone(),
            })
            .expect("submit")
        })
        .collect();
    for (p, mut sub) in fx.prompts.iter().zip(subs) {
        let mut got = Vec::new();
        loop {
            match sub.events.blocking_recv() {
                Some(SeqEvent::Token {
                    sampled, finish, ..
                }) => {
                    got.push(sampled.token);
                    if let Some(f) = finish {
                        assert_eq!(f, FinishReason::Length);
                        sub.finished();
                        break;
                    }
                }
                Some(SeqEvent::Failed(e)) => panic!("{}: engine failed: {e}", fx.model),
                None => panic!("{}: the stream closed after {got:?}", fx.model),
            }
        }
        let parted = got.iter().zip(&p.greedy).position(|(a, b)| a != b);
        if let Some(k) = parted {
            let gap = p.steps.gap[p.ids.len() - 1 + k];
            assert!(
                gap < TIE_GAP,
                "{} {}: token {k} is {}, transformers {} (gap {gap})",
                fx.model,
                p.name,
                got[k],
                p.greedy[k]
            );
        } else {
            assert_eq!(got, p.greedy, "{} {}", fx.model, p.name);
        }
    }
}

/// The same model with its weights dequantized and stored in bf16, no quantization_config:
/// what an FP8 worker must never be mixed up with.
fn bf16_twin(model: &LoadedModel, dir: &Path, tag: &str) -> PathBuf {
    let out = std::env::temp_dir().join(format!("kvmesh-fp8-twin-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "generation_config.json",
    ] {
        if dir.join(f).exists() {
            std::fs::copy(dir.join(f), out.join(f)).unwrap();
        }
    }
    let mut cfg: serde_json::Value = serde_json::from_str(&model.config_json).unwrap();
    cfg.as_object_mut().unwrap().remove("quantization_config");
    std::fs::write(out.join("config.json"), cfg.to_string()).unwrap();
    let q = model.config.quantization.as_ref().unwrap();
    let layers = model.config.linear_layers();
    let mut tensors = Vec::new();
    for name in model.weights.names() {
        if name.contains("_scale") {
            continue;
        }
        let shape = model.weights.info(name).unwrap().shape.clone();
        let module = name.strip_suffix(".weight").unwrap_or(name);
        let layer = layers.iter().find(|(m, _, _)| m == module);
        let vals = match (layer, q.scheme_of(module)) {
            (Some((m, o, i)), Some(s)) => {
                kvmesh_gpu::quant::dequantize(&model.weights, m, *o, *i, &s).unwrap()
            }
            _ => model.weights.f32(name, &shape).unwrap(),
        };
        tensors.push((name.to_string(), shape, vals));
    }
    write_file(&out.join("model.safetensors"), &tensors, DType::BF16).unwrap();
    out
}

/// The bf16 copy computes within a bf16 tolerance of the FP8 model, and is another model
/// to a router: its fingerprint differs.
fn check_bf16_twin(model: &LoadedModel, dir: &Path, fx: &Fixture) {
    let twin_dir = bf16_twin(model, dir, &fx.model);
    let twin = LoadedModel::from_dir(&twin_dir).expect("bf16 twin");
    assert!(twin.config.quantization.is_none());
    assert_ne!(
        twin.fingerprint(Numerics::Model),
        model.fingerprint(Numerics::Model),
        "{}: an FP8 model and its bf16 copy must not share a fingerprint",
        fx.model
    );
    assert_ne!(twin.weights_digest(), model.weights_digest());
    // A gateway reads the quantization from the card, and a card of the bf16 copy does not
    // pass for the FP8 model's.
    let fp = model.fingerprint(Numerics::Model);
    let card = ModelCard::of(model, Numerics::Model, &fx.model, 512, BLOCK_SIZE, None).unwrap();
    let loaded = ModelCard::from_bytes(&card.to_bytes())
        .unwrap()
        .load(&fp)
        .unwrap();
    let summary =
        |c: &kvmesh_gpu::config::ModelConfig| c.quantization.as_ref().map(|q| q.summary());
    assert_eq!(summary(&loaded.config), summary(&model.config));
    let twin_card =
        ModelCard::of(&twin, Numerics::Model, &fx.model, 512, BLOCK_SIZE, None).unwrap();
    assert!(twin_card.load(&fp).is_err());
    for p in &fx.prompts {
        let n = p.ids.len();
        let a = step(&mut backend(model, BLOCKS), &p.ids, 0, n, &table(n));
        let b = step(&mut backend(&twin, BLOCKS), &p.ids, 0, n, &table(n));
        // Rounding every weight to bf16 (8 significant bits) moves each logit by a few
        // bf16 steps of the largest one: allowed 4 (2⁻⁶ of it); measured about 1.
        let range = a.iter().fold(0f32, |m, x| m.max(x.abs()));
        let tol = range / 64.0;
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            assert!(
                (x - y).abs() <= tol,
                "{} {}: logit {i}: FP8 {x}, bf16 copy {y} (tolerance {tol})",
                fx.model,
                p.name
            );
        }
    }
    std::fs::remove_dir_all(&twin_dir).ok();
}

fn check(name: &str) {
    let fx = fixture(name);
    let dir = model_dir(name);
    let model = load(&dir, &fx);
    let a = check_prompts(&model, &fx);
    let b = check_teacher_forced(&model, &fx);
    check_engine(&model, &fx);
    check_bf16_twin(&model, &dir, &fx);
    println!(
        "{name}: {} against transformers {} (compressed-tensors {}), {}: prompts max |diff| \
         {a:.2e}, teacher-forced max |diff| {b:.2e}, engine greedy matches",
        model.config.quantization.as_ref().unwrap().describe(),
        fx.transformers_version,
        fx.compressed_tensors_version,
        fx.reference_from
    );
}

#[test]
fn hf_qwen3_fp8_block() {
    check("hf-qwen3-fp8-block");
}

#[test]
fn hf_llama_fp8_block_ignore() {
    check("hf-llama-fp8-block-ignore");
}

#[test]
fn hf_qwen2_fp8_ct() {
    check("hf-qwen2-fp8-ct");
}

/// `CpuOptions::fp8_activations_above`, the reference for a GPU's FP8 GEMMs: products of
/// more rows than the limit read their input rounded to e4m3 by its scales, as the GEMM
/// does; products of fewer rows (a GPU's decode GEMVs) read it as it is.
#[test]
fn the_cpus_fp8_activations_round_only_the_products_over_the_limit() {
    for name in [
        "hf-qwen3-fp8-block",
        "hf-llama-fp8-block-ignore",
        "hf-qwen2-fp8-ct",
    ] {
        let fx = fixture(name);
        let model = load(&model_dir(name), &fx);
        let p = fx.prompts.iter().max_by_key(|p| p.ids.len()).unwrap();
        let n = p.ids.len();
        // The last logits of the prompt run in chunks of `chunk` tokens.
        let logits = |above: Option<usize>, chunk: usize| {
            let opts = CpuOptions {
                fp8_activations_above: above,
                ..Default::default()
            };
            let mut be = build_backend(
                BackendKind::Cpu(opts),
                &model,
                BLOCK_SIZE,
                KvBudget::Blocks(BLOCKS),
            )
            .expect("CPU backend");
            let mut last = Vec::new();
            for start in (0..n).step_by(chunk) {
                let end = (start + chunk).min(n);
                last = step(be.as_mut(), &p.ids[start..end], start, n, &table(n));
            }
            last
        };
        let plain = logits(None, n);
        assert_eq!(
            logits(Some(n), n),
            plain,
            "{name}: a limit of the whole prompt"
        );
        assert_eq!(
            logits(Some(4), 4),
            logits(None, 4),
            "{name}: chunks of 4 rows under a limit of 4"
        );
        let rounded = logits(Some(4), n);
        let scale = plain.iter().fold(1f32, |m, x| m.max(x.abs()));
        let moved = rounded
            .iter()
            .zip(&plain)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()))
            / scale;
        // e4m3's 3 mantissa bits move these small models' logits by a few percent of the
        // row's largest, never by nothing (3.7-9.8% here).
        assert!(
            moved > 5e-3 && moved < 0.2,
            "{name}: FP8 activations moved the logits by {moved:.3e} of the row's largest"
        );
        println!("{name}: FP8 activations move the {n}-token prompt's logits by {moved:.3e}");
    }
}

/// The CUDA backend refuses an FP8 checkpoint by name before touching a device, rather
/// than uploading its weights widened to bf16 (a build without CUDA refuses the device).
#[test]
fn an_fp8_checkpoint_is_not_given_to_the_cuda_backend() {
    let dir = repo().join("tests/fixtures/models/hf-qwen3-fp8-block");
    let model = LoadedModel::from_dir(&dir).unwrap();
    let kind = kvmesh_gpu::model::BackendKind::Cuda(kvmesh_gpu::backend::CudaOptions::device(0));
    let e =
        kvmesh_gpu::model::build_backend(kind, &model, 16, kvmesh_gpu::model::KvBudget::Blocks(4))
            .err()
            .expect("refused")
            .to_string();
    if cfg!(feature = "cuda") {
        assert!(
            e.contains("FP8 weights (quant_method fp8, block 128x128)"),
            "{e}"
        );
        assert!(e.contains("--device cpu"), "{e}");
    } else {
        assert!(e.contains("without CUDA support"), "{e}");
    }
}
