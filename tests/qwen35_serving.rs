//! Qwen3.5's hybrid models served by the engine on the CPU: each running sequence holds a
//! recurrent-state slot beside KV blocks for its full-attention layers only.
//!
//! Held to transformers' greedy continuations (`tests/fixtures/reference/hf-qwen35-*.json`,
//! as `qwen35_reference.rs` holds the standalone model) with the engine doing what it does
//! under load: prompts chunked across steps (a step budget below the long prompt), several
//! sequences in one batch, preemption for lack of KV blocks (a preempted sequence drops its
//! state slot and is recomputed), and prompts that repeat or extend earlier ones, which
//! resume from cached KV blocks only where the recurrent state after them was saved, and
//! must answer the same.

use std::path::PathBuf;
use std::sync::atomic::Ordering;

use kvmesh_gpu::backend::CudaOptions;
use kvmesh_gpu::engine::{
    self, EngineConfig, EngineHandle, FinishReason, Landed, Request, SeqEvent,
};
use kvmesh_gpu::model::{build_backend, build_backend_for, BackendKind, KvBudget, LoadedModel};
use kvmesh_gpu::sampler::{Sampled, SamplingParams};
use serde::Deserialize;

const TIE_GAP: f32 = 1e-3;
const BLOCK_SIZE: usize = 4;

#[derive(Deserialize)]
struct Fixture {
    new_tokens: usize,
    prompts: Vec<Prompt>,
}

#[derive(Deserialize)]
struct Prompt {
    name: String,
    ids: Vec<u32>,
    greedy: Vec<u32>,
    greedy_gaps: Vec<f32>,
}

/// The bf16 and f32 fixtures, and FP8 ones (`scripts/qwen35_fp8_fixtures.py`: the CPU
/// dequantizes them at load; transformers' reference ran the same dequantized weights).
const MODELS: [&str; 6] = [
    "hf-qwen35-f32",
    "hf-qwen35-gqa-bias-f32",
    "hf-qwen35-interval-bf16",
    "hf-qwen35-cg-bf16",
    "hf-qwen35-fp8-ct",
    "hf-qwen35-fp8-block-cg",
];

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn fixture(name: &str) -> Fixture {
    let p = repo().join(format!("tests/fixtures/reference/{name}.json"));
    serde_json::from_str(&std::fs::read_to_string(&p).expect("fixture")).expect("fixture json")
}

fn load(name: &str) -> LoadedModel {
    LoadedModel::from_dir(&repo().join("tests/fixtures/models").join(name))
        .unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// An engine over the CPU backend with `blocks` KV blocks of 4 tokens.
fn engine(model: &LoadedModel, blocks: usize, cfg: EngineConfig) -> EngineHandle {
    let cfg = EngineConfig {
        block_size: BLOCK_SIZE,
        ..cfg
    };
    let be = build_backend_for(
        BackendKind::Cpu(Default::default()),
        model,
        KvBudget::Blocks(blocks),
        &cfg,
    )
    .expect("the CPU backend serves Qwen3.5");
    assert_eq!(
        be.num_state_slots(),
        cfg.max_num_seqs,
        "one slot per sequence"
    );
    engine::spawn(
        be,
        EngineConfig {
            block_size: BLOCK_SIZE,
            ..cfg
        },
        vec![],
        model.config.vocab_size,
    )
}

fn submit(h: &EngineHandle, prompt: &[u32], n: usize) -> engine::Submission {
    h.submit(Request {
        prompt: prompt.to_vec(),
        params: SamplingParams {
            temperature: 0.0,
            max_tokens: n,
            ignore_eos: true,
            ..Default::default()
        },
    })
    .expect("submit")
}

/// A submission's tokens, and how many prompt tokens it found cached.
fn drain(ctx: &str, mut sub: engine::Submission) -> (Vec<u32>, usize) {
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
                    assert_eq!(f, FinishReason::Length, "{ctx}");
                    sub.finished();
                    return (out, cached_tokens);
                }
            }
            Some(SeqEvent::Failed(e)) => panic!("{ctx}: failed: {e}"),
            None => panic!("{ctx}: the stream closed after {out:?}"),
        }
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
            return;
        }
    }
    assert_eq!(got.len(), p.greedy.len(), "{ctx}: length");
}

/// Waits for the engine thread to publish its gauges after the last sequence left.
fn settled(h: &EngineHandle, blocks: usize, slots: usize) {
    for _ in 0..200 {
        let s = &h.stats;
        if s.free_blocks.load(Ordering::Relaxed) == blocks
            && s.free_state_slots.load(Ordering::Relaxed) == slots
            && s.running.load(Ordering::Relaxed) == 0
        {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    panic!(
        "blocks or state slots were not all given back: {} of {blocks} blocks, {} of {slots} \
         slots free",
        h.stats.free_blocks.load(Ordering::Relaxed),
        h.stats.free_state_slots.load(Ordering::Relaxed)
    );
}

/// Every prompt twice at once, with a step budget that splits the 45-token prompt over
/// several steps beside the others' decode tokens; then each alone, from the prefix cache.
#[test]
fn greedy_through_the_engine_matches_transformers_chunked_and_batched() {
    for name in MODELS {
        let fx = fixture(name);
        let model = load(name);
        let cfg = EngineConfig {
            max_model_len: 256,
            max_num_seqs: 4,
            max_num_batched_tokens: 16,
            ..Default::default()
        };
        let h = engine(&model, 128, cfg);
        assert_eq!(h.info.num_state_slots, 4);
        let subs: Vec<_> = fx
            .prompts
            .iter()
            .chain(&fx.prompts)
            .map(|p| (p, submit(&h, &p.ids, fx.new_tokens)))
            .collect();
        let mut together = Vec::new();
        for (p, sub) in subs {
            let ctx = format!("{name} {} (batched)", p.name);
            let (got, _) = drain(&ctx, sub);
            assert_greedy(&ctx, &got, p);
            together.push(got);
        }
        // Alone, each resumes where its prompt's state was saved (the last block boundary
        // before its last token) if that is still cached (four saved states, least recently
        // used evicted), and answers the same either way.
        let mut resumed = 0;
        for (p, want) in fx.prompts.iter().zip(&together) {
            let ctx = format!("{name} {} (alone)", p.name);
            let (got, cached) = drain(&ctx, submit(&h, &p.ids, fx.new_tokens));
            assert_greedy(&ctx, &got, p);
            let boundary = (p.ids.len() - 1) / BLOCK_SIZE * BLOCK_SIZE;
            assert!(
                cached == 0 || cached == boundary,
                "{ctx}: resumed at {cached}, where no state was saved"
            );
            resumed += cached;
            if name.ends_with("-f32") {
                assert_eq!(&got, want, "{ctx}: alone differs from batched");
            }
        }
        assert!(
            resumed > 0,
            "{name}: no prompt resumed from the prefix cache"
        );
        settled(&h, 128, 4);
        println!("{name}: engine greedy matches transformers, chunked, batched and resumed");
    }
}

/// Too few KV blocks for every sequence at once: sequences are preempted (their state slot
/// freed with their blocks) and recomputed, and still answer exactly; every slot and block
/// is free again at the end.
#[test]
fn preempted_sequences_drop_their_state_and_still_answer_exactly() {
    let name = "hf-qwen35-f32";
    let fx = fixture(name);
    let model = load(name);
    let p = fx.prompts.iter().find(|p| p.name == "short").unwrap();
    // 5 prompt + 24 new tokens: 8 blocks of 4 each; 14 blocks hold one and most of another.
    let blocks = 14;
    let cfg = EngineConfig {
        max_model_len: 64,
        max_num_seqs: 3,
        max_num_batched_tokens: 64,
        ..Default::default()
    };
    let h = engine(&model, blocks, cfg);
    let subs: Vec<_> = (0..4).map(|_| submit(&h, &p.ids, fx.new_tokens)).collect();
    for (i, sub) in subs.into_iter().enumerate() {
        let ctx = format!("{name} copy {i}");
        let (got, _) = drain(&ctx, sub);
        assert_eq!(
            got, p.greedy,
            "{ctx}: a recomputed sequence continues exactly"
        );
    }
    assert!(
        h.stats.preemptions.load(Ordering::Relaxed) > 0,
        "the blocks were too few for three at once"
    );
    settled(&h, blocks, 3);
}

/// Fewer state slots than `max_num_seqs` (a byte budget their states would take more than
/// half of) cap the running batch; the rest waits its turn and answers the same.
#[test]
fn state_slots_bound_the_running_batch() {
    let name = "hf-qwen35-f32";
    let fx = fixture(name);
    let model = load(name);
    let hy = model.config.hybrid.as_ref().unwrap();
    let per_slot = hy.state_bytes_per_sequence();
    // Two slots' worth is half the budget.
    let limits = EngineConfig {
        max_num_seqs: 8,
        block_size: BLOCK_SIZE,
        ..Default::default()
    };
    let be = build_backend_for(
        BackendKind::Cpu(Default::default()),
        &model,
        KvBudget::Bytes(4 * per_slot),
        &limits,
    )
    .unwrap();
    assert_eq!(be.num_state_slots(), 2);
    assert!(be.num_blocks() > 0);
    let h = engine::spawn(
        be,
        EngineConfig {
            max_model_len: 64,
            max_num_seqs: 8,
            block_size: BLOCK_SIZE,
            ..Default::default()
        },
        vec![],
        model.config.vocab_size,
    );
    let p = &fx.prompts[0];
    let subs: Vec<_> = (0..5).map(|_| submit(&h, &p.ids, fx.new_tokens)).collect();
    let mut most_running = 0;
    for (i, sub) in subs.into_iter().enumerate() {
        most_running = most_running.max(h.stats.running.load(Ordering::Relaxed));
        let (got, _) = drain(&format!("copy {i}"), sub);
        assert_eq!(got, p.greedy);
    }
    assert!(most_running <= 2, "{most_running} ran with two state slots");
}

/// A repeated prompt and a second chat turn resume from the prefix cache: at the last
/// block boundary whose recurrent state was saved (the prompt's, and the first answer's
/// latest), and answer as an engine without prefix caching does.
#[test]
fn a_repeated_prefix_and_a_second_turn_resume_from_saved_states() {
    let name = "hf-qwen35-f32";
    let fx = fixture(name);
    let model = load(name);
    let cfg = EngineConfig {
        max_model_len: 256,
        max_num_seqs: 4,
        enable_prefix_caching: true,
        ..Default::default()
    };
    let h = engine(&model, 64, cfg.clone());
    assert!(h.info.config.enable_prefix_caching);
    assert_eq!(
        h.info.num_state_snapshots, 4,
        "one saved state per sequence"
    );
    let p = &fx.prompts[1];
    let boundary = (p.ids.len() - 1) / BLOCK_SIZE * BLOCK_SIZE;
    assert!(boundary > 0, "the fixture's prompt spans a block");
    let (first, cached) = drain("first", submit(&h, &p.ids, fx.new_tokens));
    assert_eq!((first.clone(), cached), (p.greedy.clone(), 0));
    let (again, cached) = drain("again", submit(&h, &p.ids, fx.new_tokens));
    assert_eq!((again, cached), (p.greedy.clone(), boundary));
    // The next turn: the history, the answer, and more. The first answer's last boundary
    // (the first sequence computed all but its last token) is where it resumes.
    let mut turn: Vec<u32> = p.ids.clone();
    turn.extend(&first);
    turn.extend([7, 11, 13, 17, 19]);
    let done = p.ids.len() + first.len() - 1;
    let (second, cached) = drain("second turn", submit(&h, &turn, 8));
    assert_eq!(cached, done / BLOCK_SIZE * BLOCK_SIZE);
    let fresh = engine(
        &model,
        64,
        EngineConfig {
            enable_prefix_caching: false,
            ..cfg
        },
    );
    assert_eq!(fresh.info.num_state_snapshots, 0);
    let (want, _) = drain("fresh engine", submit(&fresh, &turn, 8));
    assert_eq!(second, want, "the second turn answers as without the cache");
    let hits = h.stats.prefix_hits.load(Ordering::Relaxed) as usize;
    assert_eq!(hits, boundary + cached);
    assert!(h.stats.saved_states.load(Ordering::Relaxed) > 0);
}

/// The dense CPU loader never runs a hybrid model as a dense one; the CUDA backend runs it
/// (`tests/cuda_parity.rs` holds it to the CPU on a GPU), and a build or a machine without
/// CUDA says so rather than falling back to anything.
#[test]
fn the_dense_loader_refuses_hybrid_models_by_name() {
    let model = load("hf-qwen35-f32");
    if let Err(e) = build_backend(
        BackendKind::Cuda(CudaOptions::device(0)),
        &model,
        16,
        KvBudget::Blocks(8),
    ) {
        let e = e.to_string();
        assert!(e.contains("CUDA") || e.contains("cuda"), "{e}");
    }
    let e = kvmesh_gpu::backend::cpu::CpuModel::load(&model.config, &model.weights)
        .err()
        .expect("refused")
        .to_string();
    assert!(e.contains("Qwen3.5 hybrid (Gated DeltaNet)"), "{e}");
}

/// A decode engine whose transfer lands without the recurrent state, or with one of another
/// size, does not decode from the KV alone: it prefills the prompt itself (from its prefix
/// cache's saved state the second time) and answers exactly, the bogus first token dropped.
#[test]
fn a_transfer_that_lands_without_a_usable_state_is_prefilled_locally() {
    let name = "hf-qwen35-f32";
    let fx = fixture(name);
    let model = load(name);
    let cfg = EngineConfig {
        max_model_len: 256,
        max_num_seqs: 4,
        ..Default::default()
    };
    let d = engine(&model, 64, cfg);
    assert!(d.info.kv_transfer, "the hybrid backend lends its KV pool");
    let p = &fx.prompts[1];
    let bogus = (p.greedy[0] + 1) % model.config.vocab_size as u32;
    for (what, state) in [
        ("no state", None),
        ("a state of the wrong size", Some(vec![0.5f32; 3])),
    ] {
        let (sub, lease) = d
            .submit_remote_prefill(
                Request {
                    prompt: p.ids.clone(),
                    params: SamplingParams {
                        temperature: 0.0,
                        max_tokens: fx.new_tokens,
                        ignore_eos: true,
                        ..Default::default()
                    },
                },
                1,
            )
            .unwrap();
        let lease = lease.blocking_recv().expect("blocks lent");
        lease.landed(Landed {
            first: Sampled {
                token: bogus,
                logprob: 0.0,
                top: vec![],
            },
            rng: None,
            cached_tokens: 0,
            state,
        });
        let (got, _) = drain(what, sub);
        assert_eq!(got, p.greedy, "{what}: prefilled here instead");
    }
    settled(&d, 64, 4);
}
