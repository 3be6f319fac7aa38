//! The CPU forward pass and the config reader against an independent reference: Hugging Face
//! transformers.
//!
//! `scripts/reference_logits.py` ran each model folder below through transformers (f32,
//! eager attention) and committed what it saw to `tests/fixtures/reference/<model>.json`.
//! The `hf-*` folders were written by transformers' own `save_pretrained` (the current
//! `rope_parameters` layout); the script also wrote each config in the legacy layout
//! (top-level `rope_theta` + `rope_scaling`, `torch_dtype`) to
//! `tests/fixtures/legacy-configs/` and checked transformers reads both alike. Here kvmesh's
//! own code answers the same questions for both layouts, with no PyTorch involved:
//!
//! - the RoPE tables (inverse frequencies, attention factor; for dynamic RoPE at each length);
//! - one prefill over a shuffled, non-contiguous block table (paging), the same prompt as
//!   chunked prefill (7-token chunks), and token by token;
//! - both prompts in one batch (sequences must not mix);
//! - the teacher-forced sequence (prompt + transformers' greedy continuation) at every
//!   position: logits at 24 fixed columns, the top 8, the log-sum-exp and the argmax;
//! - greedy generation through the real engine, the prompts together and one at a time.
//!
//! Floats are compared within `2e-3 + 2e-3 * |reference|`; an argmax may differ only where
//! the reference's best two logits are within `TIE_GAP`.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use common::reference::{self, fnv1a64, repo, Prompt};
use common::ModelWithConfig;
use kvmesh_gpu::backend::cpu::{CpuBackend, CpuModel};
use kvmesh_gpu::backend::{Backend, ForwardBatch, SeqInput};
use kvmesh_gpu::config::RopeLayout;
use kvmesh_gpu::engine::{self, EngineConfig, EngineHandle, FinishReason, Request, SeqEvent};
use kvmesh_gpu::kv_cache::BlockId;
use kvmesh_gpu::model::LoadedModel;
use kvmesh_gpu::sampler::SamplingParams;
use serde::Deserialize;

const BLOCK_SIZE: usize = 16;
/// Blocks in the backend of the direct forward checks (the 68-token teacher-forced sequence
/// needs 5).
const DIRECT_BLOCKS: usize = 8;
/// The order block ids are handed out in: shuffled, so a prompt's blocks are neither
/// contiguous nor ascending, and do not start at 0.
const BLOCK_ORDER: [u32; DIRECT_BLOCKS] = [5, 2, 7, 0, 3, 6, 1, 4];
const CHUNK: usize = 7;
/// Below this gap between the best and second-best reference logit, a different argmax is
/// a rounding tie, not a bug.
const TIE_GAP: f32 = 1e-3;

#[derive(Deserialize)]
struct Fixture {
    model: String,
    architecture: String,
    transformers_version: String,
    torch_version: String,
    safetensors_fnv1a64: String,
    legacy_config: String,
    rope: RopeRef,
    new_tokens: usize,
    columns: Vec<usize>,
    prompts: Vec<Prompt>,
}

#[derive(Deserialize)]
struct RopeRef {
    rope_type: String,
    inv_freq: Vec<f64>,
    attention_scaling: f64,
    #[serde(default)]
    inv_freq_at_length: BTreeMap<String, Vec<f64>>,
}

fn fixture(name: &str) -> Fixture {
    reference::read(name, 2, "scripts/reference_logits.py")
}

fn load(dir: &Path, fx: &Fixture) -> LoadedModel {
    let st = std::fs::read(dir.join("model.safetensors")).expect("read model.safetensors");
    assert_eq!(
        fnv1a64(&st),
        fx.safetensors_fnv1a64,
        "{}/model.safetensors is not the file the reference was computed from; rerun \
         scripts/reference_logits.py (the fixture is stale, this is not a forward-pass bug)",
        dir.display()
    );
    let model = LoadedModel::from_dir(dir).expect("load model");
    assert_eq!(model.config.arch.architecture_name(), fx.architecture);
    model
}

fn backend(model: &LoadedModel, num_blocks: usize) -> CpuBackend {
    let m = CpuModel::load(&model.config, &model.weights).expect("CpuModel::load");
    CpuBackend::new(m, num_blocks, BLOCK_SIZE).expect("CpuBackend::new")
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

/// Every entry within tolerance; returns the largest absolute difference.
fn assert_close(ctx: &str, got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(
        got.len(),
        want.len(),
        "{ctx}: {} logits, reference has {}",
        got.len(),
        want.len()
    );
    let mut max = 0f32;
    for (i, (&a, &b)) in got.iter().zip(want).enumerate() {
        assert!(
            close(a, b),
            "{ctx}: logit {i} is {a}, reference {b} (diff {})",
            (a - b).abs()
        );
        max = max.max((a - b).abs());
    }
    max
}

fn assert_argmax_at(ctx: &str, got: &[f32], want: u32, gap: f32) {
    let g = argmax(got);
    if gap >= TIE_GAP {
        assert_eq!(g, want, "{ctx}: argmax is {g}, reference {want}");
    } else if g != want {
        eprintln!("{ctx}: argmax {g} vs reference {want} on a near-tie (gap {gap}), not counted");
    }
}

fn assert_argmax(ctx: &str, got: &[f32], p: &Prompt, pos: usize) {
    assert_argmax_at(
        &format!("{ctx} position {pos}"),
        got,
        p.argmax[pos],
        p.argmax_top2_gap[pos],
    );
}

fn log_sum_exp(v: &[f32]) -> f32 {
    let m = v.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    m + v.iter().map(|x| ((x - m) as f64).exp()).sum::<f64>().ln() as f32
}

/// Takes `n` block ids from `order`, starting at `*next`.
fn blocks(next: &mut usize, n: usize) -> Vec<BlockId> {
    let b = BLOCK_ORDER[*next..*next + n]
        .iter()
        .map(|&i| BlockId(i))
        .collect();
    *next += n;
    b
}

fn one(
    backend: &mut CpuBackend,
    tokens: &[u32],
    start_pos: usize,
    context_len: usize,
    table: &[BlockId],
    want: bool,
) -> Option<Vec<f32>> {
    let batch = ForwardBatch {
        seqs: vec![SeqInput {
            tokens,
            start_pos,
            context_len,
            block_table: table,
            want_logits: want,
            state_slot: None,
        }],
    };
    let mut out = backend.forward(&batch).expect("forward");
    assert_eq!(
        out.len(),
        want as usize,
        "one logits row per sequence that wants one"
    );
    out.pop()
}

/// kvmesh's RoPE tables against the ones transformers built.
fn check_rope(ctx: &str, model: &LoadedModel, fx: &Fixture) {
    let c = &model.config;
    assert_eq!(
        c.rope.scaling.type_name(),
        fx.rope.rope_type,
        "{ctx}: rope type"
    );
    let same = |what: &str, got: &[f32], want: &[f64]| {
        assert_eq!(got.len(), want.len(), "{ctx}: {what} length");
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g as f64 - w).abs() <= 2e-6 * w.abs(),
                "{ctx}: {what}[{i}] is {g}, transformers has {w}"
            );
        }
    };
    same("inv_freq", &c.rope_inv_freq(), &fx.rope.inv_freq);
    assert!(
        (c.rope_attention_factor() - fx.rope.attention_scaling).abs() < 1e-6,
        "{ctx}: attention factor {} vs transformers' {}",
        c.rope_attention_factor(),
        fx.rope.attention_scaling
    );
    for (len, want) in &fx.rope.inv_freq_at_length {
        let n: usize = len.parse().expect("length");
        same(
            &format!("inv_freq at length {n}"),
            &c.rope_inv_freq_for_len(n),
            want,
        );
    }
}

/// The forward pass alone: whole-prompt prefill, chunked prefill, token-by-token prefill,
/// and a two-sequence batch, each on a fresh backend so no stale cache can help.
fn check_prompts(model: &LoadedModel, fx: &Fixture, ctx: &str) -> f32 {
    let mut worst = 0f32;
    for p in &fx.prompts {
        let ctx = format!("{ctx} {}", p.name);
        let n = p.ids.len();
        let table = blocks(&mut 0, n.div_ceil(BLOCK_SIZE));

        // One prefill over the shuffled block table.
        let mut be = backend(model, DIRECT_BLOCKS);
        let got = one(&mut be, &p.ids, 0, n, &table, true).expect("logits");
        let d = assert_close(&format!("{ctx} prefill"), &got, &p.last_logits);
        assert_argmax(&format!("{ctx} prefill"), &got, p, n - 1);
        worst = worst.max(d);

        // Chunked prefill: logits only from the last chunk. Every chunk is told the prompt's
        // length, as the engine tells it, so length-dependent RoPE rotates them alike.
        let mut be = backend(model, DIRECT_BLOCKS);
        let mut last = None;
        for start in (0..n).step_by(CHUNK) {
            let end = (start + CHUNK).min(n);
            last = one(&mut be, &p.ids[start..end], start, n, &table, end == n);
        }
        let got = last.expect("logits from the last chunk");
        let d = assert_close(&format!("{ctx} chunked prefill"), &got, &p.last_logits);
        assert_argmax(&format!("{ctx} chunked prefill"), &got, p, n - 1);
        worst = worst.max(d);

        // Token by token: the argmax at every prompt position.
        let mut be = backend(model, DIRECT_BLOCKS);
        for pos in 0..n {
            let got = one(&mut be, &p.ids[pos..pos + 1], pos, n, &table, true).expect("logits");
            assert_argmax(&format!("{ctx} token by token"), &got, p, pos);
            if pos == n - 1 {
                worst = worst.max(assert_close(
                    &format!("{ctx} token by token"),
                    &got,
                    &p.last_logits,
                ));
            }
        }
    }

    // All prompts in one batch, each with its own blocks.
    let mut next = 0;
    let tables: Vec<Vec<BlockId>> = fx
        .prompts
        .iter()
        .map(|p| blocks(&mut next, p.ids.len().div_ceil(BLOCK_SIZE)))
        .collect();
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
    let mut be = backend(model, DIRECT_BLOCKS);
    let out = be.forward(&batch).expect("batched forward");
    assert_eq!(out.len(), fx.prompts.len());
    for (p, got) in fx.prompts.iter().zip(&out) {
        let ctx = format!("{ctx} {} batched", p.name);
        worst = worst.max(assert_close(&ctx, got, &p.last_logits));
        assert_argmax(&ctx, got, p, p.ids.len() - 1);
    }
    worst
}

/// The prompt and transformers' continuation fed token by token as generation feeds them
/// (prompt tokens told the prompt's length, continuation tokens their own), checked at every
/// position. Returns the largest difference seen.
fn check_teacher_forced(model: &LoadedModel, fx: &Fixture, ctx: &str) -> f32 {
    let mut worst = 0f32;
    for p in &fx.prompts {
        let ctx = format!("{ctx} {} teacher-forced", p.name);
        let seq: Vec<u32> = p.ids.iter().chain(&p.greedy).copied().collect();
        let positions = seq.len() - 1;
        assert_eq!(p.steps.argmax.len(), positions, "{ctx}: fixture length");
        let table = blocks(&mut 0, seq.len().div_ceil(BLOCK_SIZE));
        let mut be = backend(model, DIRECT_BLOCKS);
        for pos in 0..positions {
            let context_len = (pos + 1).max(p.ids.len());
            let got =
                one(&mut be, &seq[pos..pos + 1], pos, context_len, &table, true).expect("logits");
            let at = format!("{ctx} position {pos}");
            for (&col, &want) in fx.columns.iter().zip(&p.steps.columns[pos]) {
                assert!(
                    close(got[col], want),
                    "{at}: logit of token {col} is {}, transformers {want}",
                    got[col]
                );
                worst = worst.max((got[col] - want).abs());
            }
            for (&id, &want) in p.steps.top_ids[pos].iter().zip(&p.steps.top_logits[pos]) {
                assert!(
                    close(got[id], want),
                    "{at}: logit of top token {id} is {}, transformers {want}",
                    got[id]
                );
                worst = worst.max((got[id] - want).abs());
            }
            let lse = log_sum_exp(&got);
            assert!(
                close(lse, p.steps.lse[pos]),
                "{at}: log-sum-exp {lse}, transformers {}",
                p.steps.lse[pos]
            );
            assert_argmax_at(&at, &got, p.steps.argmax[pos], p.steps.gap[pos]);
        }
    }
    worst
}

fn greedy(new_tokens: usize) -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        max_tokens: new_tokens,
        ignore_eos: true,
        ..Default::default()
    }
}

/// Reads a submission's events to the end: its tokens and its prefix-cache hit.
fn drain(ctx: &str, mut sub: engine::Submission, new_tokens: usize) -> (Vec<u32>, usize) {
    let mut out = Vec::new();
    loop {
        match sub.events.blocking_recv() {
            Some(SeqEvent::Token {
                sampled,
                finish,
                cached_tokens,
            }) => {
                out.push(sampled.token);
                if let Some(f) = finish {
                    assert_eq!(
                        f,
                        FinishReason::Length,
                        "{ctx}: finished early ({f:?}) after {out:?}"
                    );
                    sub.finished();
                    return (out, cached_tokens);
                }
                assert!(
                    out.len() < new_tokens,
                    "{ctx}: no finish after {} tokens",
                    out.len()
                );
            }
            Some(SeqEvent::Failed(e)) => {
                panic!("{ctx}: the engine failed the request: {e}")
            }
            None => panic!("{ctx}: the event stream closed after {out:?}"),
        }
    }
}

fn submit(h: &EngineHandle, p: &Prompt, new_tokens: usize) -> engine::Submission {
    h.submit(Request {
        prompt: p.ids.clone(),
        params: greedy(new_tokens),
    })
    .expect("submit")
}

/// A greedy continuation against transformers': equal, or equal up to a position where the
/// reference's best two logits were within `TIE_GAP` (after which the two may part).
fn assert_greedy(ctx: &str, got: &[u32], p: &Prompt) {
    for (k, (&g, &w)) in got.iter().zip(&p.greedy).enumerate() {
        if g != w {
            let gap = p.steps.gap[p.ids.len() - 1 + k];
            assert!(
                gap < TIE_GAP,
                "{ctx}: token {k} is {g}, transformers chose {w} (their gap {gap}); \
                 got {got:?}, want {:?}",
                p.greedy
            );
            eprintln!("{ctx}: parts from transformers at token {k} on a near-tie (gap {gap})");
            return;
        }
    }
    assert_eq!(got.len(), p.greedy.len(), "{ctx}: length");
}

/// Greedy generation through the engine: every prompt at once first (one batch of
/// different sequences), then each alone (the second run of a prompt reuses its cached
/// prefix blocks, where the model allows it).
fn check_engine(model: &LoadedModel, fx: &Fixture, ctx: &str) {
    let be = backend(model, 64);
    let h = engine::spawn(
        Box::new(be),
        EngineConfig {
            max_model_len: model.config.max_context().min(512),
            block_size: BLOCK_SIZE,
            ..Default::default()
        },
        vec![],
        model.config.vocab_size,
    );
    let subs: Vec<_> = fx
        .prompts
        .iter()
        .map(|p| submit(&h, p, fx.new_tokens))
        .collect();
    for (p, sub) in fx.prompts.iter().zip(subs) {
        let ctx = format!("{ctx} {} engine (concurrent)", p.name);
        let (got, _) = drain(&ctx, sub, fx.new_tokens);
        assert_greedy(&ctx, &got, p);
    }
    for p in &fx.prompts {
        let ctx = format!("{ctx} {} engine (alone)", p.name);
        let (got, cached) = drain(&ctx, submit(&h, p, fx.new_tokens), fx.new_tokens);
        assert_greedy(&ctx, &got, p);
        if model.config.rope_depends_on_length() {
            assert_eq!(
                cached, 0,
                "{ctx}: dynamic RoPE must not reuse cached blocks"
            );
        }
    }
}

fn check(dir: &str, name: &str) {
    let fx = fixture(name);
    assert_eq!(fx.model, name);
    println!(
        "{name}: reference from transformers {} / torch {}",
        fx.transformers_version, fx.torch_version
    );
    let dir = repo().join(dir);
    let legacy = ModelWithConfig::new(&dir, &repo().join(&fx.legacy_config));
    for (layout, path, want) in [
        ("config.json", dir.as_path(), RopeLayout::Parameters),
        ("legacy config", legacy.path.as_path(), RopeLayout::Legacy),
    ] {
        let ctx = format!("{name} ({layout})");
        let model = load(path, &fx);
        assert_eq!(model.config.rope.layout, want, "{ctx}: layout read");
        check_rope(&ctx, &model, &fx);
        let a = check_prompts(&model, &fx, &ctx);
        let b = check_teacher_forced(&model, &fx, &ctx);
        check_engine(&model, &fx, &ctx);
        println!(
            "{ctx}: rope {} matches; prompts max |diff| {a:.2e}; {} teacher-forced positions \
             max |diff| {b:.2e}; engine greedy matches",
            fx.rope.rope_type,
            fx.prompts
                .iter()
                .map(|p| p.steps.argmax.len())
                .sum::<usize>()
        );
    }
}

macro_rules! reference_tests {
    ($($test:ident: $dir:literal,)*) => {$(
        #[test]
        fn $test() {
            let dir: &str = $dir;
            let name = dir.rsplit('/').next().expect("name");
            check(dir, name);
        }
    )*};
}

reference_tests! {
    hf_llama_llama3_f32: "tests/fixtures/models/hf-llama-llama3-f32",
    hf_llama_linear_bias_bf16: "tests/fixtures/models/hf-llama-linear-bias-bf16",
    hf_llama_dynamic_f32: "tests/fixtures/models/hf-llama-dynamic-f32",
    hf_qwen2_bf16: "tests/fixtures/models/hf-qwen2-bf16",
    hf_qwen2_yarn_window_f32: "tests/fixtures/models/hf-qwen2-yarn-window-f32",
    hf_qwen3_yarn_bf16: "tests/fixtures/models/hf-qwen3-yarn-bf16",
    hf_qwen3_bias_f32: "tests/fixtures/models/hf-qwen3-bias-f32",
    hf_mistral_window_f32: "tests/fixtures/models/hf-mistral-window-f32",
    hf_mistral_bf16: "tests/fixtures/models/hf-mistral-bf16",
    tiny_llama: "tests/fixtures/models/tiny-llama",
    tiny_qwen2: "tests/fixtures/models/tiny-qwen2",
    tiny_qwen3: "tests/fixtures/models/tiny-qwen3",
    tiny_mistral: "tests/fixtures/models/tiny-mistral",
    shakespeare: "models/shakespeare",
}

/// `--cpu-bf16-products` against the same transformers f32 references: the 45-token prompts'
/// prefill runs its projections on AVX512-BF16 with bf16-rounded activations, so the logits
/// move by bf16 rounding (a looser bound than the default path's 2e-3), and the next token
/// stays transformers' wherever its best two logits are not within that rounding. On a CPU
/// without AVX512-BF16 the option must change nothing.
#[test]
fn bf16_products_stay_within_bf16_rounding_of_transformers() {
    for dir in [
        "tests/fixtures/models/hf-qwen2-bf16",
        "tests/fixtures/models/hf-mistral-bf16",
        "tests/fixtures/models/hf-llama-linear-bias-bf16",
        "models/shakespeare",
    ] {
        let name = dir.rsplit('/').next().expect("name");
        let fx = fixture(name);
        let model = load(&repo().join(dir), &fx);
        let cpu = CpuModel::load(&model.config, &model.weights)
            .expect("CpuModel::load")
            .with_bf16_products();
        let runs = cpu.bf16_products_run();
        let mut be = CpuBackend::new(cpu, DIRECT_BLOCKS, BLOCK_SIZE).expect("backend");
        for p in fx.prompts.iter().filter(|p| p.ids.len() > 16) {
            let n = p.ids.len();
            let table = blocks(&mut 0, n.div_ceil(BLOCK_SIZE));
            let got = one(&mut be, &p.ids, 0, n, &table, true).expect("logits");
            let ctx = format!("{name} {} (bf16 products: {runs})", p.name);
            if !runs {
                let mut plain = backend(&model, DIRECT_BLOCKS);
                let want = one(&mut plain, &p.ids, 0, n, &table, true).expect("logits");
                assert_eq!(got, want, "{ctx}: the option changed the f32 path");
                continue;
            }
            let mut worst = 0f32;
            for (i, (&a, &b)) in got.iter().zip(&p.last_logits).enumerate() {
                let d = (a - b).abs();
                assert!(
                    d <= 0.05 + 0.02 * b.abs(),
                    "{ctx}: logit {i} is {a}, transformers {b}"
                );
                worst = worst.max(d);
            }
            let gap = p.argmax_top2_gap[n - 1];
            if gap >= 0.1 {
                assert_eq!(argmax(&got), p.argmax[n - 1], "{ctx}: next token");
            }
            println!("{ctx}: max |logit - transformers f32| {worst:.3e}");
        }
    }
}
