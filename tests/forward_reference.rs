//! The CPU forward pass against an independent reference: Hugging Face transformers.
//!
//! `scripts/reference_logits.py` ran each model folder below through `transformers` (f32,
//! eager attention) and committed what it saw to `tests/fixtures/reference/<model>.json`:
//! two prompts (5 and 45 tokens, the longer spanning three 16-token KV blocks), the logits
//! at the last prompt position, the argmax at every position, and the greedy continuation.
//! Here kvmesh's own code answers the same questions, with no PyTorch involved:
//!
//! - one prefill over a shuffled, non-contiguous block table (paging);
//! - the same prompt as chunked prefill (7-token chunks), and as token-by-token decode;
//! - both prompts in one batch (sequences must not mix);
//! - greedy generation through the real engine, one request at a time and two at once.
//!
//! The four `tiny-*` folders are random-weight checkpoints made by `kvmesh model
//! init-random` (one per architecture); `models/shakespeare` is the trained default model.
//! Regenerate the fixtures whenever one of those folders changes (see the script's docstring).

use std::path::{Path, PathBuf};

use kvmesh_gpu::backend::cpu::{CpuBackend, CpuModel};
use kvmesh_gpu::backend::{Backend, ForwardBatch, SeqInput};
use kvmesh_gpu::engine::{self, EngineConfig, EngineHandle, FinishReason, Request, SeqEvent};
use kvmesh_gpu::kv_cache::BlockId;
use kvmesh_gpu::model::LoadedModel;
use kvmesh_gpu::sampler::SamplingParams;
use serde::Deserialize;

const BLOCK_SIZE: usize = 16;
/// Blocks in the backend of the direct forward checks.
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
    new_tokens: usize,
    prompts: Vec<Prompt>,
}

#[derive(Deserialize)]
struct Prompt {
    name: String,
    ids: Vec<u32>,
    last_logits: Vec<f32>,
    argmax: Vec<u32>,
    argmax_top2_gap: Vec<f32>,
    greedy: Vec<u32>,
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn fixture(name: &str) -> Fixture {
    let path = repo()
        .join("tests/fixtures/reference")
        .join(format!("{name}.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// 64-bit FNV-1a, as the script computes it over `model.safetensors`.
fn fnv1a64(bytes: &[u8]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{h:016x}")
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

/// Every entry within `2e-3 + 2e-3 * |reference|`; returns the largest absolute difference.
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
        let d = (a - b).abs();
        assert!(
            d <= 2e-3 + 2e-3 * b.abs(),
            "{ctx}: logit {i} is {a}, reference {b} (diff {d})"
        );
        max = max.max(d);
    }
    max
}

fn assert_argmax(ctx: &str, got: &[f32], p: &Prompt, pos: usize) {
    let (g, w) = (argmax(got), p.argmax[pos]);
    if p.argmax_top2_gap[pos] >= TIE_GAP {
        assert_eq!(
            g, w,
            "{ctx}: argmax at position {pos} is {g}, reference {w}"
        );
    } else if g != w {
        eprintln!("{ctx}: position {pos}: argmax {g} vs reference {w} on a near-tie, not counted");
    }
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
    table: &[BlockId],
    want: bool,
) -> Option<Vec<f32>> {
    let batch = ForwardBatch {
        seqs: vec![SeqInput {
            tokens,
            start_pos,
            block_table: table,
            want_logits: want,
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

/// The forward pass alone: whole-prompt prefill, chunked prefill, token-by-token decode,
/// and a two-sequence batch, each on a fresh backend so no stale cache can help.
fn check_forward(model: &LoadedModel, fx: &Fixture) -> f32 {
    let mut worst = 0f32;
    for p in &fx.prompts {
        let ctx = format!("{} {}", fx.model, p.name);
        let n = p.ids.len();
        let table = blocks(&mut 0, n.div_ceil(BLOCK_SIZE));

        // One prefill over the shuffled block table.
        let mut be = backend(model, DIRECT_BLOCKS);
        let got = one(&mut be, &p.ids, 0, &table, true).expect("logits");
        let d = assert_close(&format!("{ctx} prefill"), &got, &p.last_logits);
        assert_argmax(&format!("{ctx} prefill"), &got, p, n - 1);
        println!(
            "{ctx}: prefill over blocks {:?}: max |logit diff| {d:.2e}",
            table.iter().map(|b| b.0).collect::<Vec<_>>()
        );
        worst = worst.max(d);

        // Chunked prefill: logits only from the last chunk.
        let mut be = backend(model, DIRECT_BLOCKS);
        let mut last = None;
        for start in (0..n).step_by(CHUNK) {
            let end = (start + CHUNK).min(n);
            last = one(&mut be, &p.ids[start..end], start, &table, end == n);
        }
        let got = last.expect("logits from the last chunk");
        let d = assert_close(&format!("{ctx} chunked prefill"), &got, &p.last_logits);
        assert_argmax(&format!("{ctx} chunked prefill"), &got, p, n - 1);
        println!("{ctx}: chunked prefill ({CHUNK}-token chunks): max |logit diff| {d:.2e}");
        worst = worst.max(d);

        // Token by token, as decode runs: the argmax at every position.
        let mut be = backend(model, DIRECT_BLOCKS);
        for pos in 0..n {
            let got = one(&mut be, &p.ids[pos..pos + 1], pos, &table, true).expect("logits");
            assert_argmax(&format!("{ctx} decode"), &got, p, pos);
            if pos == n - 1 {
                let d = assert_close(&format!("{ctx} decode"), &got, &p.last_logits);
                println!("{ctx}: token-by-token: argmax matches at all {n} positions, max |logit diff| {d:.2e}");
                worst = worst.max(d);
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
                block_table: t,
                want_logits: true,
            })
            .collect(),
    };
    let mut be = backend(model, DIRECT_BLOCKS);
    let out = be.forward(&batch).expect("batched forward");
    assert_eq!(out.len(), fx.prompts.len());
    for (p, got) in fx.prompts.iter().zip(&out) {
        let ctx = format!("{} {} batched", fx.model, p.name);
        let d = assert_close(&ctx, got, &p.last_logits);
        assert_argmax(&ctx, got, p, p.ids.len() - 1);
        println!("{ctx}: max |logit diff| {d:.2e}");
        worst = worst.max(d);
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
            Some(SeqEvent::Failed(e)) => panic!("{ctx}: the engine failed the request: {e}"),
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

/// Greedy generation through the engine: every prompt at once first (one batch of
/// different sequences), then each alone (the second run of a prompt reuses its cached
/// prefix blocks).
fn check_engine(model: &LoadedModel, fx: &Fixture) {
    let be = backend(model, 64);
    let h = engine::spawn(
        Box::new(be),
        EngineConfig {
            max_model_len: 512,
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
        let ctx = format!("{} {} engine (concurrent)", fx.model, p.name);
        let (got, _) = drain(&ctx, sub, fx.new_tokens);
        assert_eq!(
            got, p.greedy,
            "{ctx}: greedy continuation differs from transformers"
        );
        println!("{ctx}: {} greedy tokens match", got.len());
    }
    for p in &fx.prompts {
        let ctx = format!("{} {} engine (alone)", fx.model, p.name);
        let (got, cached) = drain(&ctx, submit(&h, p, fx.new_tokens), fx.new_tokens);
        assert_eq!(
            got, p.greedy,
            "{ctx}: greedy continuation differs from transformers"
        );
        println!(
            "{ctx}: {} greedy tokens match ({cached} prompt tokens from the prefix cache)",
            got.len()
        );
    }
}

fn check(dir: &str, name: &str) {
    let fx = fixture(name);
    assert_eq!(fx.model, name);
    println!(
        "{name}: reference from transformers {} / torch {}",
        fx.transformers_version, fx.torch_version
    );
    let model = load(&repo().join(dir), &fx);
    let worst = check_forward(&model, &fx);
    println!("{name}: max |logit diff| over all forward checks: {worst:.2e}");
    check_engine(&model, &fx);
}

#[test]
fn tiny_llama_matches_transformers() {
    check("tests/fixtures/models/tiny-llama", "tiny-llama");
}

#[test]
fn tiny_qwen2_matches_transformers() {
    check("tests/fixtures/models/tiny-qwen2", "tiny-qwen2");
}

#[test]
fn tiny_qwen3_matches_transformers() {
    check("tests/fixtures/models/tiny-qwen3", "tiny-qwen3");
}

#[test]
fn tiny_mistral_matches_transformers() {
    check("tests/fixtures/models/tiny-mistral", "tiny-mistral");
}

#[test]
fn shakespeare_matches_transformers() {
    check("models/shakespeare", "shakespeare");
}
