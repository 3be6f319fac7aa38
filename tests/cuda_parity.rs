//! The CUDA backend against the CPU backend, which `forward_reference.rs` ties to Hugging
//! Face transformers. Built only with `--features cuda`, and meant for a machine with a GPU:
//!
//! ```text
//! cargo test --release --features cuda --test cuda_parity -- --test-threads=1
//! ```
//!
//! On a GPU machine without Rust, build the test binary here with `--no-run`, copy it and the
//! `kvmesh` binary there, and run it from the repository root with `KVMESH_BIN` pointing at
//! the `kvmesh` binary. Without a CUDA device every test fails: on purpose, since a pass
//! would claim a parity nobody measured.
//!
//! For each tiny checkpoint (one per family) and the trained default model:
//! - prefill logits and eight teacher-forced decode steps within bf16 tolerance of the CPU
//!   (also for the transformers-written `hf-*` checkpoints: sliding windows, yarn's attention
//!   factor, linear RoPE, attention and MLP biases);
//! - greedy generation through the engine token-identical to the CPU, with CUDA graphs on
//!   and off;
//! - seeded sampling (temperature, top-k, top-p) on the device: every token inside the CPU's
//!   kept set, and mostly the same token per seed (same uniform, same walk order);
//! - the KV-transfer hooks: blocks copied out and into other blocks decode the same, and a
//!   prompt exported by one CUDA engine through host staging decodes on another exactly as
//!   on one engine (disaggregated prefill on the GPU backend);
//! - a KV budget larger than the GPU is a clear error, and HTTP answers match the CPU's;
//! - the skinny products (decode steps of up to 8 rows) equal cuBLAS's and a float64
//!   reference at the 8B models' shapes and at ragged ones;
//! - FP8 checkpoints kept in FP8 (block-scaled and compressed-tensors fixtures) against the
//!   CPU's dequantized model, with the FP8 decode kernels, the activation quantizer and
//!   cuBLASLt's FP8 GEMMs each held to a host computation of the same product.
//! - each side of an SM split (green contexts) computing what the whole GPU does, and a
//!   region exported by CUDA IPC read and written by a second process (`cuda/split.rs`);
//! - KV handed from one engine to another of the process on the device, directly and
//!   through a `kvmesh node` with both roles on one GPU, whole and split, and between two
//!   processes by CUDA IPC (`cuda/handover.rs`);
//! - Qwen3.5's decode steps through CUDA graphs, padded to their bucket, against eager
//!   steps (`cuda/hybrid_graphs.rs`);
//! - Qwen3's q/k norms taken into the q/k/v product's rotary epilogue, bf16 and FP8, bit for
//!   bit with `rope_kv_write`'s launch at 1-3 rows (`cuda/fused_rope.rs`).
#![cfg(feature = "cuda")]

mod common;
#[path = "cuda/fp8_fused.rs"]
mod fp8_fused;
#[path = "cuda/fp8_twin.rs"]
mod fp8_twin;
#[path = "cuda/fused_rope.rs"]
mod fused_rope;
#[path = "cuda/handover.rs"]
mod handover;
#[path = "cuda/hybrid.rs"]
mod hybrid;
#[path = "cuda/hybrid_graphs.rs"]
mod hybrid_graphs;
#[path = "cuda/prefill_graphs.rs"]
mod prefill_graphs;
#[path = "cuda/split.rs"]
mod split;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use kvmesh_gpu::backend::cpu::delta::DeltaParams;
use kvmesh_gpu::backend::cuda::delta::{mix_on_device, mix_on_host, DeltaDims, DeltaPath};
use kvmesh_gpu::backend::cuda::{
    fp8_fused_products, fp8_product, fp8_quantize, sample_host_logits, silu_mul_bf16_and_f32,
    skinny_and_cublas, skinny_epilogues, skinny_norm_prologues, CudaBackend, Fp8Path,
    FusedProducts,
};
use kvmesh_gpu::backend::{Backend, CudaOptions, ForwardBatch, Pdl, SampleSpec, SeqInput};
use kvmesh_gpu::config::{Arch, HybridConfig, HybridLayout, LayerType};
use kvmesh_gpu::engine::{self, EngineConfig, Request, SeqEvent};
use kvmesh_gpu::guided::{grammar, Guide, LazyGuides};
use kvmesh_gpu::kv_cache::BlockId;
use kvmesh_gpu::model::{build_backend, BackendKind, CpuOptions, KvBudget, LoadedModel};
use kvmesh_gpu::safetensors::DType;
use kvmesh_gpu::sampler::{self, Rng, SamplingParams};
use serde_json::{json, Value};

const BLOCK_SIZE: usize = 16;
const MODELS: [&str; 5] = [
    "tiny-llama",
    "tiny-qwen2",
    "tiny-qwen3",
    "tiny-mistral",
    "shakespeare",
];

/// Checkpoints `save_pretrained` wrote (scripts/reference_logits.py) that the dense CUDA
/// backend runs: every `hf-*` fixture but those with dynamic RoPE, which it refuses, the FP8
/// ones and Qwen3.5's hybrid ones (their own tests below).
fn hf_models() -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(repo().join("tests/fixtures/models"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("hf-"))
        .filter(|n| {
            let c = load(n).config;
            !c.rope_depends_on_length() && c.hybrid.is_none() && c.quantization.is_none()
        })
        .collect();
    v.sort();
    v
}

/// The repository root: the working directory when it holds the fixtures (a carried test
/// binary on another machine), else where this crate was built.
fn repo() -> PathBuf {
    if Path::new("tests/fixtures/reference").is_dir() {
        std::env::current_dir().unwrap()
    } else {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
    }
}

fn model_dir(name: &str) -> PathBuf {
    if name == "shakespeare" {
        repo().join("models/shakespeare")
    } else {
        repo().join("tests/fixtures/models").join(name)
    }
}

/// The fixture prompts (5 and 45 tokens) of `forward_reference.rs`.
fn prompts(name: &str) -> Vec<Vec<u32>> {
    let path = repo().join(format!("tests/fixtures/reference/{name}.json"));
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    v["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            p["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect()
        })
        .collect()
}

fn load(name: &str) -> LoadedModel {
    LoadedModel::from_dir(&model_dir(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn backends(m: &LoadedModel, blocks: usize) -> (Box<dyn Backend>, Box<dyn Backend>) {
    let cpu = build_backend(
        BackendKind::Cpu(Default::default()),
        m,
        BLOCK_SIZE,
        KvBudget::Blocks(blocks),
    )
    .unwrap();
    let gpu = build_backend(
        BackendKind::Cuda(CudaOptions::device(0)),
        m,
        BLOCK_SIZE,
        KvBudget::Blocks(blocks),
    )
    .expect("a CUDA device (this test is for a GPU machine)");
    (cpu, gpu)
}

fn forward(be: &mut dyn Backend, tokens: &[u32], start: usize, table: &[BlockId]) -> Vec<f32> {
    let batch = ForwardBatch {
        seqs: vec![SeqInput {
            tokens,
            start_pos: start,
            context_len: 0,
            block_table: table,
            want_logits: true,
            state_slot: None,
        }],
    };
    be.forward(&batch).unwrap().pop().unwrap()
}

/// `forward` for a model with recurrent state: the sequence holds state slot `slot`.
fn forward_slot(
    be: &mut dyn Backend,
    tokens: &[u32],
    start: usize,
    table: &[BlockId],
    slot: u32,
) -> Vec<f32> {
    let batch = ForwardBatch {
        seqs: vec![SeqInput {
            tokens,
            start_pos: start,
            context_len: 0,
            block_table: table,
            want_logits: true,
            state_slot: Some(slot),
        }],
    };
    be.forward(&batch).unwrap().pop().unwrap()
}

fn argmax(v: &[f32]) -> usize {
    (0..v.len()).fold(0, |b, i| if v[i] > v[b] { i } else { b })
}

/// bf16 activations and a bf16 KV cache on the GPU against f32 on the CPU: each logit within
/// 3% of the row's scale. Returns the largest difference.
fn assert_close(ctx: &str, gpu: &[f32], cpu: &[f32]) -> f32 {
    assert_eq!(gpu.len(), cpu.len(), "{ctx}: vocabulary sizes differ");
    let scale = cpu.iter().fold(1f32, |m, x| m.max(x.abs()));
    let mut worst = 0f32;
    for (i, (g, c)) in gpu.iter().zip(cpu).enumerate() {
        let d = (g - c).abs();
        assert!(d.is_finite(), "{ctx}: logit {i} is {g} on the GPU");
        assert!(
            d <= 0.03 * scale,
            "{ctx}: logit {i}: gpu {g} cpu {c} (scale {scale})"
        );
        worst = worst.max(d);
    }
    worst
}

#[test]
fn logits_match_the_cpu_within_bf16_tolerance() {
    let hf = hf_models();
    for name in MODELS.iter().copied().chain(hf.iter().map(String::as_str)) {
        let m = load(name);
        for (pi, prompt) in prompts(name).iter().enumerate() {
            let (mut cpu, mut gpu) = backends(&m, 16);
            // A shuffled block table, as in forward_reference.rs.
            let table: Vec<BlockId> = [5u32, 2, 7, 0, 3, 6, 1, 4, 9, 8]
                .iter()
                .map(|&b| BlockId(b))
                .collect();
            let ctx = format!("{name} prompt {pi}");
            let c = forward(cpu.as_mut(), prompt, 0, &table);
            let g = forward(gpu.as_mut(), prompt, 0, &table);
            let mut worst = assert_close(&format!("{ctx} prefill"), &g, &c);
            // Teacher-forced decode: both get the CPU's greedy token each step.
            let mut next = argmax(&c) as u32;
            for (step, pos) in (prompt.len()..prompt.len() + 8).enumerate() {
                let c = forward(cpu.as_mut(), &[next], pos, &table);
                let g = forward(gpu.as_mut(), &[next], pos, &table);
                worst = worst.max(assert_close(&format!("{ctx} decode {step}"), &g, &c));
                next = argmax(&c) as u32;
            }
            println!("{ctx}: max |gpu - cpu| logit {worst:.3e}");
        }
    }
}

fn run_engine(be: Box<dyn Backend>, vocab: usize, reqs: Vec<Request>) -> Vec<Vec<u32>> {
    run_engine_with(be, vocab, reqs, None)
}

fn run_engine_with(
    be: Box<dyn Backend>,
    vocab: usize,
    reqs: Vec<Request>,
    guides: Option<Arc<LazyGuides>>,
) -> Vec<Vec<u32>> {
    let mut h = engine::spawn(
        be,
        EngineConfig {
            max_model_len: 512,
            block_size: BLOCK_SIZE,
            ..Default::default()
        },
        vec![],
        vocab,
    );
    if let Some(g) = guides {
        h = h.with_guides(g);
    }
    let subs: Vec<_> = reqs.into_iter().map(|r| h.submit(r).unwrap()).collect();
    subs.into_iter()
        .map(|mut s| {
            let mut out = Vec::new();
            loop {
                match s.events.blocking_recv() {
                    Some(SeqEvent::Token {
                        sampled, finish, ..
                    }) => {
                        out.push(sampled.token);
                        if finish.is_some() {
                            s.finished();
                            return out;
                        }
                    }
                    Some(SeqEvent::Failed(e)) => {
                        panic!("engine failed a request: {e}")
                    }
                    None => panic!("event stream closed after {out:?}"),
                }
            }
        })
        .collect()
}

fn greedy_requests(name: &str, n: usize) -> Vec<Request> {
    prompts(name)
        .into_iter()
        .map(|prompt| Request {
            prompt,
            params: SamplingParams {
                temperature: 0.0,
                max_tokens: n,
                ignore_eos: true,
                ..Default::default()
            },
        })
        .collect()
}

#[test]
fn greedy_generation_is_token_identical_with_and_without_graphs() {
    for name in MODELS {
        let m = load(name);
        let vocab = m.config.vocab_size;
        let (cpu, gpu) = backends(&m, 64);
        let want = run_engine(cpu, vocab, greedy_requests(name, 24));
        let got = run_engine(gpu, vocab, greedy_requests(name, 24));
        assert_eq!(got, want, "{name}: CUDA (graphs on) vs CPU greedy");
        // Graphs off; and decode attention one block per head (the default splits the
        // history), through the graphs of every batch bucket.
        for (what, opts) in [
            (
                "graphs off",
                CudaOptions {
                    graphs: false,
                    ..CudaOptions::device(0)
                },
            ),
            (
                "unsplit decode",
                CudaOptions {
                    split_decode: false,
                    ..CudaOptions::device(0)
                },
            ),
            (
                "no programmatic dependent launch",
                CudaOptions {
                    pdl: Pdl::Off,
                    ..CudaOptions::device(0)
                },
            ),
            (
                "norms fused into the products",
                CudaOptions {
                    fuse_norms: true,
                    ..CudaOptions::device(0)
                },
            ),
            (
                "norms and the rotary embedding fused into the products",
                CudaOptions {
                    fuse_norms: true,
                    fuse_rope: true,
                    ..CudaOptions::device(0)
                },
            ),
        ] {
            let be = build_backend(
                BackendKind::Cuda(opts),
                &m,
                BLOCK_SIZE,
                KvBudget::Blocks(64),
            );
            let got = run_engine(be.unwrap(), vocab, greedy_requests(name, 24));
            assert_eq!(got, want, "{name}: CUDA ({what}) vs CPU greedy");
        }
        println!("{name}: greedy identical, {} tokens", 24 * want.len());
    }
}

/// Greedy requests under a regex, a JSON schema and a logit bias (and one asking for top
/// logprobs, which samples on the host): the device's `constrain_rows` gives the CPU's
/// tokens, and the text follows the grammar.
#[test]
fn constrained_generation_matches_the_cpu() {
    let name = "shakespeare";
    let m = load(name);
    let vocab = m.config.vocab_size;
    let guides = Arc::new(LazyGuides::new(m.tokenizer.clone(), vocab));
    let schema = json!({"type": "object", "properties": {"who": {"type": "string",
        "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["who", "age"], "additionalProperties": false});
    let grammars = [
        grammar::regex("[A-Z][a-z]{3,9} [a-z]{2,8}\\."),
        grammar::json_schema(schema),
    ];
    let reqs = || {
        let mut v = Vec::new();
        for (i, prompt) in prompts(name).into_iter().enumerate() {
            for (j, g) in grammars.iter().enumerate() {
                v.push(Request {
                    prompt: prompt.clone(),
                    params: SamplingParams {
                        temperature: 0.0,
                        max_tokens: 40,
                        guide: Some(Guide::new(g)),
                        logit_bias: vec![(70 + i as u32, -100.0), (90, 3.0)],
                        logprobs: (j == 1 && i == 0).then_some(3),
                        ..Default::default()
                    },
                });
            }
        }
        v
    };
    let (cpu, gpu) = backends(&m, 128);
    let want = run_engine_with(cpu, vocab, reqs(), Some(guides.clone()));
    let got = run_engine_with(gpu, vocab, reqs(), Some(guides));
    assert_eq!(got, want, "constrained greedy: CUDA vs CPU");
    for (k, out) in want.iter().enumerate() {
        let banned = 70 + (k / grammars.len()) as u32;
        assert!(
            !out.contains(&banned),
            "banned token {banned} sampled: {out:?}"
        );
    }
    println!(
        "{} constrained sequences identical on CUDA and CPU",
        want.len()
    );
}

/// A random-weight checkpoint of the tiny shape of `arch` with head dimension `d` (and a
/// sliding window when given), written once under the system temp dir.
fn random_model(arch: Arch, d: usize, window: Option<usize>) -> LoadedModel {
    let mut cfg = kvmesh_gpu::init::preset(Some(arch), "tiny").unwrap();
    cfg.head_dim = d;
    cfg.max_position_embeddings = 1024;
    cfg.sliding_window = window;
    let dir = std::env::temp_dir().join(format!(
        "kvmesh-parity-{}-d{d}-w{}",
        arch.model_type(),
        window.unwrap_or(0)
    ));
    kvmesh_gpu::init::write_random_checkpoint(
        cfg,
        7,
        DType::BF16,
        &kvmesh_gpu::embedded::default_tokenizer(),
        &dir,
    )
    .unwrap();
    LoadedModel::from_dir(&dir).unwrap()
}

/// Prefill attention over long prompts, for every head dimension the tensor-core kernel is
/// built for (16, 32, 64, 128, and Qwen3.5's 256 with tiles of 16 keys) and a sliding window:
/// a 700-token prompt in one step (eleven 64-query blocks, 22 key tiles of 32, 44 of 16),
/// and the same prompt as a 300-token prefill followed by a
/// 400-token chunk that attends over the cached 300, each against the CPU in one step; then
/// a decode step over the 700 (the decode kernels of the same head dimensions).
#[test]
fn long_prompts_match_the_cpu_for_every_head_dimension() {
    let cases = [
        (Arch::Llama, 16, None),
        (Arch::Qwen3, 32, None),
        (Arch::Qwen2, 64, None),
        (Arch::Llama, 128, None),
        (Arch::Llama, 256, None),
        (Arch::Mistral, 64, Some(100)),
    ];
    for (arch, d, window) in cases {
        let m = random_model(arch, d, window);
        let ctx = format!("{} d={d} window={window:?}", arch.model_type());
        let prompt: Vec<u32> = (0..700u32)
            .map(|i| (i * 7919 + 13) % m.config.vocab_size as u32)
            .collect();
        let (mut cpu, mut gpu) = backends(&m, 64);
        let table: Vec<BlockId> = (0..44).map(BlockId).collect();
        let want = forward(cpu.as_mut(), &prompt, 0, &table);
        let whole = forward(gpu.as_mut(), &prompt, 0, &table);
        let w1 = assert_close(&format!("{ctx}, one step"), &whole, &want);
        forward(gpu.as_mut(), &prompt[..300], 0, &table);
        let chunked = forward(gpu.as_mut(), &prompt[300..], 300, &table);
        let w2 = assert_close(&format!("{ctx}, chunked"), &chunked, &want);
        // And one decode step over the 700 cached positions.
        let next = [prompt[1]];
        let want = forward(cpu.as_mut(), &next, 700, &table);
        let step = forward(gpu.as_mut(), &next, 700, &table);
        let w3 = assert_close(&format!("{ctx}, decode"), &step, &want);
        // The default splits the history into chunks of at least 64 positions, one block
        // each (eleven here, and empty splits after them), merged by the block that finishes
        // last; the same step with one block per head:
        let mut split = build_backend(
            BackendKind::Cuda(CudaOptions {
                split_decode: false,
                ..CudaOptions::device(0)
            }),
            &m,
            BLOCK_SIZE,
            KvBudget::Blocks(64),
        )
        .unwrap();
        forward(split.as_mut(), &prompt, 0, &table);
        let step = forward(split.as_mut(), &next, 700, &table);
        let w4 = assert_close(&format!("{ctx}, unsplit decode"), &step, &want);
        // Programmatic dependent launch changes when kernels start, never what they compute:
        // the whole prompt and the decode step without it give the same bits.
        let mut serial = build_backend(
            BackendKind::Cuda(CudaOptions {
                pdl: Pdl::Off,
                ..CudaOptions::device(0)
            }),
            &m,
            BLOCK_SIZE,
            KvBudget::Blocks(64),
        )
        .unwrap();
        let serial_whole = forward(serial.as_mut(), &prompt, 0, &table);
        let serial_step = forward(serial.as_mut(), &next, 700, &table);
        let (pdl_whole, pdl_step) = {
            let mut g = gpu;
            let w = forward(g.as_mut(), &prompt, 0, &table);
            (w, forward(g.as_mut(), &next, 700, &table))
        };
        // The norms as the products' prologue, and the rotary embedding with the K/V write
        // as the q/k/v product's epilogue (Qwen3's q/k norms too), compute the same bits as
        // their own launches: decode steps after the first 100 tokens of the prompt (the
        // fusions change only steps of few rows), in blocks of their own.
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let short = &prompt[..100];
        let table2: Vec<BlockId> = (48..56).map(BlockId).collect();
        forward(serial.as_mut(), short, 0, &table2);
        let serial_short = forward(serial.as_mut(), &next, 100, &table2);
        let after = [prompt[2]];
        let serial_next = forward(serial.as_mut(), &after, 101, &table2);
        for (what, fuse_norms, fuse_rope) in [
            ("the norms", true, false),
            ("the rotary embedding", false, true),
            ("the norms and the rotary embedding", true, true),
        ] {
            let mut fused = build_backend(
                BackendKind::Cuda(CudaOptions {
                    fuse_norms,
                    fuse_rope,
                    ..CudaOptions::device(0)
                }),
                &m,
                BLOCK_SIZE,
                KvBudget::Blocks(64),
            )
            .unwrap();
            forward(fused.as_mut(), short, 0, &table2);
            let fused_step = forward(fused.as_mut(), &next, 100, &table2);
            assert_eq!(
                bits(&fused_step),
                bits(&serial_short),
                "{ctx}: decode with {what} fused into the products"
            );
            // The step wrote the new position's K/V: a second step reads it back.
            let fused_next = forward(fused.as_mut(), &after, 101, &table2);
            assert_eq!(
                bits(&fused_next),
                bits(&serial_next),
                "{ctx}: the step after a decode with {what} fused"
            );
        }
        assert_eq!(
            bits(&pdl_whole),
            bits(&serial_whole),
            "{ctx}: prefill with and without PDL"
        );
        assert_eq!(
            bits(&pdl_step),
            bits(&serial_step),
            "{ctx}: decode with and without PDL"
        );
        println!(
            "{ctx}: max |gpu - cpu| logit {w1:.3e} (one step), {w2:.3e} (chunked), \
             {w3:.3e} (split decode at 700), {w4:.3e} (unsplit decode)"
        );
    }
}

/// The 8B shapes' layers (Qwen3-8B: head size 128, q/k norms, 4 query heads per KV head,
/// 4,096 wide, 12,288 MLP; Llama-3.1-8B: 14,336 MLP, Llama-3 RoPE), two of each, against the
/// CPU: the kernels and cuBLAS shapes the 8B benchmarks time, checked where they run. The
/// vocabulary is the tokenizer's, not 152k, so the CPU side stays quick.
#[test]
fn the_8b_shapes_layers_match_the_cpu() {
    for preset in ["qwen3-8b", "llama-3.1-8b"] {
        let mut cfg = kvmesh_gpu::init::preset(None, preset).unwrap();
        cfg.num_layers = 2;
        cfg.vocab_size = 0;
        let dir = std::env::temp_dir().join(format!("kvmesh-parity-{preset}-2l"));
        kvmesh_gpu::init::write_random_checkpoint(
            cfg,
            11,
            DType::BF16,
            &kvmesh_gpu::embedded::default_tokenizer(),
            &dir,
        )
        .unwrap();
        let m = LoadedModel::from_dir(&dir).unwrap();
        let prompt: Vec<u32> = (0..300u32)
            .map(|i| (i * 7919 + 13) % m.config.vocab_size as u32)
            .collect();
        let (mut cpu, mut gpu) = backends(&m, 32);
        let table: Vec<BlockId> = (0..20).map(BlockId).collect();
        let want = forward(cpu.as_mut(), &prompt, 0, &table);
        let got = forward(gpu.as_mut(), &prompt, 0, &table);
        let w1 = assert_close(&format!("{preset} 2 layers, prefill"), &got, &want);
        let next = [prompt[7]];
        let want = forward(cpu.as_mut(), &next, 300, &table);
        let got = forward(gpu.as_mut(), &next, 300, &table);
        let w2 = assert_close(&format!("{preset} 2 layers, decode"), &got, &want);
        println!("{preset} (2 layers): max |gpu - cpu| logit {w1:.3e} prefill, {w2:.3e} decode");
        std::fs::remove_dir_all(&dir).ok();
    }
}

/// The probability of the likeliest token after temperature `t` over the `k` largest logits.
fn top_probability(logits: &[f32], t: f32, k: usize) -> (f32, Vec<usize>) {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    order.truncate(k);
    let mx = logits[order[0]];
    let total: f32 = order.iter().map(|&i| ((logits[i] - mx) / t).exp()).sum();
    (1.0 / total, order)
}

/// The prefix of `prompt` (at least two tokens) where the model is least sure of the next
/// token, by the CPU's logits: a trained model is nearly certain at many positions, and a
/// sampling test there would never leave the argmax. Returns it with its top `k` tokens.
fn least_certain_prefix(
    cpu: &mut dyn Backend,
    prompt: &[u32],
    t: f32,
    k: usize,
) -> (Vec<u32>, Vec<usize>, f32) {
    let table: Vec<BlockId> = (0..4).map(BlockId).collect();
    (2..=prompt.len())
        .map(|n| {
            let (p, top) = top_probability(&forward(cpu, &prompt[..n], 0, &table), t, k);
            (prompt[..n].to_vec(), top, p)
        })
        .min_by(|a, b| a.2.total_cmp(&b.2))
        .unwrap()
}

/// 400 seeded one-token requests per setting: the device sampler keeps the same set as the
/// CPU sampler and, fed the same uniform per seed, picks the same token except where bf16
/// rounding moves a boundary. The settings take each of the device's ways to its
/// thresholds: top-k then top-p (decided among the logits gathered into shared memory),
/// top-p alone, a top-k past what is gathered (decided over the whole row), and no
/// truncation. The prompt is the fixture's prefix where the CPU's next-token distribution
/// is flattest, so both samplers have a choice.
#[test]
fn device_sampling_follows_the_cpu_sampler() {
    let name = "shakespeare";
    let m = load(name);
    let vocab = m.config.vocab_size;
    let (mut cpu, _) = backends(&m, 128);
    let (prompt, top8, p1) = least_certain_prefix(cpu.as_mut(), &prompts(name).remove(1), 0.8, 8);
    println!(
        "{} prompt tokens; the likeliest next token has p = {p1:.3}",
        prompt.len()
    );
    assert!(
        p1 < 0.7,
        "no prefix of the fixture prompt leaves a choice (p = {p1})"
    );
    for (top_k, top_p) in [(8, 0.9), (0, 0.9), (600, 0.95), (0, 1.0)] {
        let reqs = || {
            (0..400u64)
                .map(|seed| Request {
                    prompt: prompt.clone(),
                    params: SamplingParams {
                        temperature: 0.8,
                        top_k,
                        top_p,
                        seed: Some(seed),
                        max_tokens: 1,
                        ignore_eos: true,
                        ..Default::default()
                    },
                })
                .collect::<Vec<_>>()
        };
        let (cpu, gpu) = backends(&m, 128);
        let want = run_engine(cpu, vocab, reqs());
        let got = run_engine(gpu, vocab, reqs());
        let distinct = |v: &[Vec<u32>]| {
            v.iter()
                .map(|g| g[0])
                .collect::<std::collections::HashSet<_>>()
                .len()
        };
        let ctx = format!("top-k {top_k}, top-p {top_p}");
        assert!(
            distinct(&want) > 1,
            "{ctx}: the CPU sampler never left the argmax"
        );
        let mut same = 0;
        for (w, g) in want.iter().zip(&got) {
            assert!(
                top_k != 8 || top8.contains(&(g[0] as usize)),
                "{ctx}: GPU sampled {} outside the top 8",
                g[0]
            );
            same += (w == g) as usize;
        }
        println!(
            "{ctx}: {same}/400 seeds give the same token; {} distinct on the GPU, {} on the CPU",
            distinct(&got),
            distinct(&want)
        );
        assert!(
            distinct(&got) > 1,
            "{ctx}: temperature 0.8 never left the argmax on the GPU"
        );
        assert!(
            same >= 360,
            "{ctx}: only {same}/400 seeds agree with the CPU sampler"
        );
    }
}

/// Rows of a real model's vocabulary size, whose first pass `sample_rows` spreads over
/// several blocks (the shakespeare fixture's vocabulary takes one): greedy rows give the
/// CPU's argmax (ties to the lowest index, across shares) and its logprob, rows masked to a
/// few tokens stay inside them, and sampled rows draw the CPU sampler's token for the same
/// seed (up to rounding at a boundary).
#[test]
fn device_sampling_of_large_vocabularies_follows_the_cpu() {
    // 151,936: Qwen's, a multiple of 4 (16-byte loads); 50,001: neither, 13 shares.
    for vocab in [151_936usize, 50_001] {
        let mut r = Rng::seeded(vocab as u64);
        let rows = 48;
        let mut logits: Vec<f32> = (0..rows * vocab)
            .map(|_| (r.normal() * 3.0) as f32)
            .collect();
        // Row 0: the maximum twice, in different shares (the lower index wins); rows 1
        // (greedy) and 17 (sampled): all but five tokens masked, spread over the row.
        logits[vocab - 7] = 40.0;
        logits[1234] = 40.0;
        for row in [1, 17] {
            let masked = &mut logits[row * vocab..(row + 1) * vocab];
            masked.iter_mut().for_each(|v| *v = f32::NEG_INFINITY);
            for (i, t) in [3usize, 9_000, 20_001, 33_333, vocab - 2]
                .into_iter()
                .enumerate()
            {
                masked[t] = i as f32 * 0.5;
            }
        }
        let greedy = SamplingParams {
            temperature: 0.0,
            ..Default::default()
        };
        let sampled = SamplingParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.9,
            ..Default::default()
        };
        let warm = SamplingParams {
            temperature: 1.0,
            ..Default::default()
        };
        // Rows 0..16 greedy, 16..32 top-k/top-p, 32..48 the whole distribution.
        let params: Vec<&SamplingParams> = (0..rows)
            .map(|i| match i {
                0..16 => &greedy,
                16..32 => &sampled,
                _ => &warm,
            })
            .collect();
        let mut rngs: Vec<Rng> = (0..rows as u64).map(Rng::seeded).collect();
        let mut cpu_rngs = rngs.clone();
        let mut specs: Vec<SampleSpec> = params
            .iter()
            .zip(rngs.iter_mut())
            .map(|(p, rng)| SampleSpec {
                params: p,
                rng,
                mask: None,
            })
            .collect();
        let got = sample_host_logits(0, &logits, vocab, &mut specs).unwrap();
        let mut same = 0;
        for (i, g) in got.iter().enumerate() {
            let row = &logits[i * vocab..(i + 1) * vocab];
            let want = sampler::sample(row, params[i], &mut cpu_rngs[i]);
            let ctx = format!("vocab {vocab}, row {i}");
            assert!(
                row[g.token as usize].is_finite(),
                "{ctx}: drew a masked token"
            );
            if i < 16 {
                assert_eq!(g.token, want.token, "{ctx}: greedy");
                assert!(
                    (g.logprob - want.logprob).abs() <= 1e-3 * want.logprob.abs().max(1.0),
                    "{ctx}: logprob {} on the device, {} on the CPU",
                    g.logprob,
                    want.logprob
                );
            }
            same += (g.token == want.token) as usize;
        }
        assert_eq!(
            got[0].token, 1234,
            "vocab {vocab}: the tie goes to the lower index"
        );
        assert_eq!(
            got[1].token as usize,
            vocab - 2,
            "vocab {vocab}: the masked row's argmax"
        );
        println!("vocab {vocab}: {same}/{rows} rows draw the CPU's token");
        assert!(
            same >= rows - 3,
            "vocab {vocab}: only {same}/{rows} rows agree"
        );
    }
}

#[test]
fn kv_blocks_copied_out_and_in_decode_the_same() {
    let m = load("shakespeare");
    let prompt = prompts("shakespeare").remove(1);
    let mut gpu = CudaBackend::new(
        &m.config,
        &m.weights,
        CudaOptions::device(0),
        KvBudget::Blocks(16),
        BLOCK_SIZE,
    )
    .expect("a CUDA device");
    let src: Vec<BlockId> = (0..3).map(BlockId).collect();
    let dst: Vec<BlockId> = (8..11).map(BlockId).collect();
    let a = forward(&mut gpu, &prompt[..prompt.len() - 1], 0, &src);
    assert_eq!(a.len(), m.config.vocab_size);
    for layer in 0..m.config.num_layers {
        let bytes = gpu.copy_blocks_out(layer, &src).unwrap();
        assert_eq!(
            bytes.len(),
            3 * CudaBackend::kv_bytes_per_block(&m.config, BLOCK_SIZE) / m.config.num_layers
        );
        gpu.copy_blocks_in(layer, &dst, &bytes).unwrap();
    }
    let last = &prompt[prompt.len() - 1..];
    let from_src = forward(&mut gpu, last, prompt.len() - 1, &src);
    let from_dst = forward(&mut gpu, last, prompt.len() - 1, &dst);
    assert_eq!(
        from_src, from_dst,
        "decoding from the copied blocks differs"
    );
    assert!(
        gpu.copy_blocks_out(m.config.num_layers, &src).is_err(),
        "layer out of range"
    );
    assert!(
        gpu.copy_blocks_out(0, &[BlockId(16)]).is_err(),
        "block out of range"
    );
}

#[test]
fn dynamic_rope_is_refused_by_name() {
    let m = load("hf-llama-dynamic-f32");
    let e = build_backend(
        BackendKind::Cuda(CudaOptions::device(0)),
        &m,
        BLOCK_SIZE,
        KvBudget::Blocks(16),
    )
    .err()
    .expect("the CUDA backend must refuse dynamic RoPE")
    .to_string();
    assert!(e.contains("dynamic") && e.contains("--device cpu"), "{e}");
}

#[test]
fn a_kv_budget_beyond_the_gpu_is_a_clear_error() {
    let m = load("tiny-llama");
    let t = std::time::Instant::now();
    let err = build_backend(
        BackendKind::Cuda(CudaOptions::device(0)),
        &m,
        BLOCK_SIZE,
        KvBudget::Bytes(1 << 50),
    )
    .err()
    .expect("a petabyte of KV cache cannot fit");
    let msg = err.to_string();
    println!("{msg}");
    assert!(
        msg.to_lowercase().contains("memory"),
        "unclear error: {msg}"
    );
    assert!(t.elapsed().as_secs() < 60);
}

#[test]
fn http_answers_match_the_cpu() {
    let dir = model_dir("tiny-llama");
    let dir = dir.to_str().unwrap();
    let cpu = common::Server::start(&["--model", dir, "--device", "cpu"]);
    let gpu = common::Server::start(&["--model", dir, "--device", "cuda"]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let body = json!({"model": "tiny-llama", "prompt": "To be, or not to be",
                          "max_tokens": 24, "temperature": 0, "ignore_eos": true,
                          "return_token_ids": true});
        let (sc, c) = cpu.post("/v1/completions", body.clone()).await;
        let (sg, g) = gpu.post("/v1/completions", body).await;
        assert_eq!((sc, sg), (200, 200), "{c} {g}");
        assert_eq!(common::text_of(&g), common::text_of(&c));
        let events = gpu
            .stream(
                "/v1/completions",
                json!({"model": "tiny-llama", "prompt": "To be",
                     "max_tokens": 16, "temperature": 0, "ignore_eos": true, "stream": true}),
            )
            .await;
        let (_, c) = cpu
            .post(
                "/v1/completions",
                json!({"model": "tiny-llama", "prompt": "To be",
                   "max_tokens": 16, "temperature": 0, "ignore_eos": true}),
            )
            .await;
        assert_eq!(common::streamed_text(&events), common::text_of(&c));
    });
}

/// Disaggregation through host staging: one CUDA engine exports a prompt (chunked), the
/// test copies its staged K and V into a second CUDA engine's lease, and the second decodes
/// from it exactly as one engine does end to end.
#[test]
fn staged_kv_transfer_between_cuda_engines_decodes_the_same() {
    use kvmesh_gpu::engine::{ExportEvent, Landed};
    use kvmesh_gpu::kv_pool::KvKind;
    for name in MODELS {
        let m = load(name);
        let vocab = m.config.vocab_size;
        let reqs = greedy_requests(name, 12);
        let (_, gpu) = backends(&m, 64);
        let want = run_engine(gpu, vocab, greedy_requests(name, 12));
        let (p, d) = (cuda_engine(&m, 16), cuda_engine(&m, 2048));
        assert!(p.info.kv_transfer, "cuda stages KV transfers");
        for (req, want) in reqs.into_iter().zip(want) {
            let n = req.prompt.len();
            let mut first_req = req.clone();
            first_req.params.max_tokens = 1;
            let (mut psub, mut pev) = p.submit_export(first_req, 0).unwrap();
            let Some(ExportEvent::Ready { lease: plo, .. }) = pev.blocking_recv() else {
                panic!("{name}: no Ready")
            };
            let first = match psub.events.blocking_recv() {
                Some(SeqEvent::Token { sampled, .. }) => sampled,
                other => panic!("{name}: {other:?}"),
            };
            psub.finished();
            let (mut dsub, dl) = d.submit_remote_prefill(req, 1).unwrap();
            let dlo = dl.blocking_recv().expect("a lease");
            let spec = plo.spec().clone();
            let bpp = spec.bytes_per_pos();
            for layer in 0..spec.num_layers {
                for kind in [KvKind::K, KvKind::V] {
                    for pos in 0..n {
                        let at = |blocks: &[BlockId]| {
                            (blocks[pos / BLOCK_SIZE].0 as usize * BLOCK_SIZE + pos % BLOCK_SIZE)
                                * bpp
                        };
                        // SAFETY: both staging pools hold these positions; the export is
                        // finished and the decode side is waiting for them.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                plo.host_pool()
                                    .unwrap()
                                    .base(layer, kind)
                                    .add(at(plo.blocks())),
                                dlo.host_pool()
                                    .unwrap()
                                    .base(layer, kind)
                                    .add(at(dlo.blocks())),
                                bpp,
                            )
                        };
                    }
                }
            }
            drop(plo);
            dlo.landed(Landed {
                first,
                rng: None,
                cached_tokens: 0,
                state: None,
            });
            let got = tokens_to_end(name, &mut dsub);
            assert_eq!(
                got, want,
                "{name}: staged disaggregation changed the tokens"
            );
        }
        println!("{name}: staged KV transfer between CUDA engines decodes identically");
    }
}

/// An engine on a CUDA backend of 64 blocks, prompts in chunks of `budget` tokens.
fn cuda_engine(m: &LoadedModel, budget: usize) -> engine::EngineHandle {
    let be = build_backend(
        BackendKind::Cuda(CudaOptions::device(0)),
        m,
        BLOCK_SIZE,
        KvBudget::Blocks(64),
    )
    .expect("a CUDA device");
    engine::spawn(
        be,
        EngineConfig {
            max_model_len: 512,
            block_size: BLOCK_SIZE,
            max_num_batched_tokens: budget,
            ..Default::default()
        },
        vec![],
        m.config.vocab_size,
    )
}

/// Every token a submission sends, to its last.
fn tokens_to_end(name: &str, sub: &mut kvmesh_gpu::engine::Submission) -> Vec<u32> {
    let mut got = Vec::new();
    loop {
        match sub.events.blocking_recv() {
            Some(SeqEvent::Token {
                sampled, finish, ..
            }) => {
                got.push(sampled.token);
                if finish.is_some() {
                    sub.finished();
                    return got;
                }
            }
            other => panic!("{name}: {other:?}"),
        }
    }
}

/// A Gated DeltaNet layer's random weights: `nk` key heads of `dk`, `nv` value heads of
/// `dv`, decays from slow (`A_log` near -3) to fast (near 2).
fn delta_params(nk: usize, nv: usize, dk: usize, dv: usize, seed: u64) -> DeltaParams {
    let hy = HybridConfig {
        layout: HybridLayout::CausalLm,
        layer_types: vec![LayerType::LinearAttention],
        linear_num_key_heads: nk,
        linear_num_value_heads: nv,
        linear_key_head_dim: dk,
        linear_value_head_dim: dv,
        linear_conv_kernel_dim: 4,
        rotary_dim: 0,
    };
    DeltaParams::random(hy, 1e-6, seed)
}

/// The device's Gated DeltaNet mixing (`delta_conv_silu`, then `gated_delta_rule`; the
/// scan path, `CudaOptions::gdn_scan`; and the scan path with the chunked form,
/// `CudaOptions::gdn_chunked`) against the CPU's `delta::mix` for one step of
/// several sequences: a fresh prompt, a prompt chunk and a decode token continuing a state, a
/// fresh single token, a 200-token continuation (several of the scan path's token chunks);
/// at Qwen3.5's head sizes and smaller ones, value heads that are no multiple of 32 among
/// them. Outputs within bf16 rounding; the states after the step (window and delta state)
/// within f32 accumulation-order differences, the recurrence against the chunked form.
#[test]
fn gated_deltanet_kernels_match_the_cpu() {
    let shapes = [
        (2, 4, 128, 128),
        (1, 2, 64, 32),
        (2, 2, 32, 128),
        (1, 4, 8, 24),
        (2, 2, 16, 32),
        (1, 2, 32, 40),
    ];
    let paths = [DeltaPath::Recurrent, DeltaPath::Scan, DeltaPath::Chunked];
    for ((nk, nv, dk, dv), path) in shapes.into_iter().flat_map(|s| paths.map(|p| (s, p))) {
        let p = delta_params(nk, nv, dk, dv, (nk * 1000 + nv * 100 + dk + dv) as u64);
        let d = DeltaDims::of(&p).unwrap();
        let seqs = [(70, true), (16, false), (1, false), (1, true), (200, false)];
        let tokens: usize = seqs.iter().map(|s| s.0).sum();
        let mut r = Rng::seeded(7);
        let mut unit = || (r.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
        let proj: Vec<f32> = (0..tokens * d.row).map(|_| 1.5 * unit()).collect();
        // Continuing sequences start from a state a previous prompt would leave.
        let mut start: Vec<Vec<f32>> = seqs
            .iter()
            .map(|_| (0..d.layer_floats()).map(|_| 0.3 * unit()).collect())
            .collect();
        let mut cpu_states = start.clone();
        let want = mix_on_host(&p, &proj, &seqs, &mut cpu_states, 64).unwrap();
        let got = mix_on_device(0, &p, &proj, &seqs, &mut start, path).unwrap();
        let ctx = format!("{path:?}: nk {nk} nv {nv} dk {dk} dv {dv}");
        assert_eq!(got.len(), want.len(), "{ctx}");
        let mut worst = 0f32;
        for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
            let err = (g - w).abs() / (1.0 + w.abs());
            worst = worst.max(err);
            assert!(err < 2e-2, "{ctx}: output {i}: gpu {g}, cpu {w}");
        }
        let mut worst_state = 0f32;
        for (s, (g, w)) in start.iter().zip(&cpu_states).enumerate() {
            for (i, (&a, &b)) in g.iter().zip(w).enumerate() {
                let err = (a - b).abs() / (1.0 + b.abs());
                worst_state = worst_state.max(err);
                assert!(
                    err < 1e-3,
                    "{ctx}: sequence {s} state value {i}: gpu {a}, cpu {b}"
                );
            }
        }
        println!("{ctx}: outputs within {worst:.1e}, states within {worst_state:.1e}");
    }
}

/// The skinny kernels' epilogues (the q/k/v bias added as the sums are written; the MLP's
/// SiLU-gated product straight from the gate and up sums) give bit for bit what the
/// separate `bias_add` and `silu_mul` launches they replace give.
#[test]
fn skinny_epilogues_equal_the_launches_they_replace() {
    let mut r = Rng::seeded(12);
    // Qwen2.5-0.5B's q/k/v and MLP at 1 and 4 rows, Qwen3-8B's MLP, an odd shape.
    for (m, n, k) in [(1, 576, 896), (4, 4864, 896), (2, 12288, 4096), (3, 37, 40)] {
        let mut bits = |len: usize, scale: f32| -> Vec<u16> {
            (0..len)
                .map(|_| {
                    let v = ((r.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale;
                    (v.to_bits() >> 16) as u16
                })
                .collect()
        };
        let (x, w) = (bits(m * k, 1.0), bits(2 * n * k, 0.1));
        let bias: Vec<f32> = bits(2 * n, 1.0)
            .into_iter()
            .map(|b| f32::from_bits((b as u32) << 16))
            .collect();
        let [fused, unfused, act_fused, act_unfused] =
            skinny_epilogues(0, &x, &w, &bias, (m, n, k)).unwrap();
        let ctx = format!("m {m} n {n} k {k}");
        assert!(
            fused.iter().all(|&b| f32::from_bits(b).is_finite()),
            "{ctx}: the bias epilogue left an element unwritten"
        );
        assert_eq!(fused, unfused, "{ctx}: bias in the epilogue vs bias_add");
        assert!(
            act_fused.iter().all(|&b| b != 0x7fc0),
            "{ctx}: the SiLU epilogue left an element unwritten"
        );
        assert_eq!(act_fused, act_unfused, "{ctx}: skinny_silu vs silu_mul");
        println!("{ctx}: both epilogues bit-identical to the separate launches");
    }
}

/// `silu_mul_bf16` (gate/up products cuBLAS wrote in bf16, 8 columns a thread) gives bit for
/// bit what `silu_mul` gives from the same values in f32: a prompt's MLP rounds its products
/// once, at the GEMM, and nowhere after.
#[test]
fn skinny_silu_mul_bf16_equals_silu_mul_on_the_same_values() {
    let mut r = Rng::seeded(14);
    // Qwen3-8B's MLP at 3 rows, Qwen2.5-0.5B's at 5, a narrow one; values past SiLU's
    // saturation and near zero among them.
    for (rows, inter) in [(3, 12288), (5, 4864), (2, 8)] {
        let gu: Vec<u16> = (0..rows * 2 * inter)
            .map(|_| ((r.normal() as f32 * 6.0).to_bits() >> 16) as u16)
            .collect();
        let [bf, wide] = silu_mul_bf16_and_f32(0, &gu, (rows, inter)).unwrap();
        assert!(
            bf.iter().all(|&b| b != 0x7fc0),
            "rows {rows} inter {inter}: silu_mul_bf16 left an element unwritten"
        );
        assert_eq!(
            bf, wide,
            "rows {rows} inter {inter}: silu_mul_bf16 vs silu_mul"
        );
        println!("rows {rows} inter {inter}: silu_mul_bf16 bit-identical to silu_mul");
    }
}

/// The norm as a skinny product's prologue (`skinny_norm*`: the residual add and RMSNorm
/// between layers, computed by every block) gives bit for bit the residual and the products
/// that `add_rmsnorm_to_bf16` followed by the plain skinny kernels give.
#[test]
fn skinny_norm_prologues_equal_the_norm_kernel_then_the_product() {
    let mut r = Rng::seeded(13);
    // Qwen2.5-0.5B's and Qwen3-8B's widths at 1 and 2 rows, the widest row a block holds,
    // and a narrow odd one.
    for (m, n, k) in [(1, 4864, 896), (2, 1024, 4096), (1, 64, 8192), (2, 37, 40)] {
        let mut vals = |len: usize, scale: f64| -> Vec<f32> {
            (0..len).map(|_| (r.normal() * scale) as f32).collect()
        };
        let (res, delta, norm) = (vals(m * k, 1.0), vals(m * k, 0.5), vals(k, 0.2));
        let w: Vec<u16> = vals(2 * n * k, 0.05)
            .into_iter()
            .map(|v| (v.to_bits() >> 16) as u16)
            .collect();
        let [res_f, res_s, y_f, y_s, act_f, act_s] =
            skinny_norm_prologues(0, &res, &delta, &norm, &w, (m, n, k)).unwrap();
        let ctx = format!("m {m} n {n} k {k}");
        assert!(
            y_f.iter().all(|&b| f32::from_bits(b).is_finite()),
            "{ctx}: an output left unwritten"
        );
        assert_eq!(res_f, res_s, "{ctx}: the residual written");
        assert_eq!(y_f, y_s, "{ctx}: the products");
        assert_eq!(act_f, act_s, "{ctx}: the SiLU-gated products");
        println!("{ctx}: residual, products and SiLU-gated products bit-identical");
    }
}

#[test]
fn skinny_products_match_cublas_and_a_float64_reference() {
    // Qwen3-8B's projections at 1, 3 and 8 rows; shapes that end mid-block, mid-warp and
    // mid-unroll; a row count the kernel for 4 pads.
    let shapes = [
        (1, 6144, 4096),
        (3, 4096, 4096),
        (8, 4096, 12288),
        (1, 24576, 4096),
        (5, 37, 24),
        (2, 1000, 8),
        (8, 17, 4104),
        (4, 33, 1032),
    ];
    let mut r = Rng::seeded(11);
    for (m, n, k) in shapes {
        let mut draw = |len: usize| -> (Vec<u16>, Vec<f32>) {
            let bits: Vec<u16> = (0..len)
                .map(|_| {
                    let v = ((r.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * 2.0;
                    (v.to_bits() >> 16) as u16
                })
                .collect();
            let vals = bits
                .iter()
                .map(|&b| f32::from_bits((b as u32) << 16))
                .collect();
            (bits, vals)
        };
        let (xb, x) = draw(m * k);
        let (wb, w) = draw(n * k);
        let (skinny, cublas) = skinny_and_cublas(0, &xb, &wb, (m, n, k)).unwrap();
        assert_eq!(skinny.len(), m * n);
        let mut worst = 0f64;
        for i in 0..m {
            for j in 0..n {
                let (xr, wr) = (&x[i * k..(i + 1) * k], &w[j * k..(j + 1) * k]);
                let want: f64 = xr.iter().zip(wr).map(|(&a, &b)| a as f64 * b as f64).sum();
                let scale: f64 = xr
                    .iter()
                    .zip(wr)
                    .map(|(&a, &b)| (a as f64 * b as f64).abs())
                    .sum();
                let (s, c) = (skinny[i * n + j] as f64, cublas[i * n + j] as f64);
                let ctx = format!("m {m} n {n} k {k}: y[{i}, {j}]");
                assert!(s.is_finite(), "{ctx}: the skinny kernel left {s}");
                let err = (s - want).abs() / scale.max(1e-30);
                worst = worst.max(err);
                assert!(
                    err < 1e-5,
                    "{ctx}: skinny {s}, float64 {want} (sum |x w| {scale})"
                );
                assert!(
                    (c - want).abs() / scale.max(1e-30) < 1e-5,
                    "{ctx}: cuBLAS {c}, float64 {want}"
                );
            }
        }
        println!("m {m} n {n} k {k}: skinny within {worst:.1e} of float64 (relative to sum |x w|)");
    }
}

/// The FP8 fixtures (block-scaled with an ignored layer, per-channel and per-tensor
/// compressed-tensors with an ignored `up_proj` and q/k/v biases), and Qwen3.5's
/// (compressed-tensors leaving the Gated DeltaNet layers bf16; block-scaled Gated DeltaNet
/// projections on the wrapper's layout).
const FP8_MODELS: [&str; 5] = [
    "hf-qwen3-fp8-block",
    "hf-llama-fp8-block-ignore",
    "hf-qwen2-fp8-ct",
    "hf-qwen35-fp8-ct",
    "hf-qwen35-fp8-block-cg",
];

/// FP8 on the GPU against the CPU's dequantized model. The weights are the same numbers on
/// both sides (the CPU multiplies the same e4m3 values by the same scales); what differs is
/// that prefill quantizes every activation to e4m3 before cuBLASLt's GEMMs, a relative
/// rounding of up to 2^-4 per element (3 mantissa bits), on top of the bf16 activations and
/// KV cache that cost the bf16 path its 3% (`assert_close`). Decode steps read e4m3 weights
/// with bf16 activations (`fp8_gemv_*`), but attend over keys and values written by the
/// quantized prefill.
///
/// How far the quantization moves a fixture's logits is measured in the same run: a second
/// CPU backend rounds the prefill's activations as the GEMM does
/// (`CpuOptions::fp8_activations_above`). That rounding is chaotic at these sizes: moving
/// every GEMM input by 2^-9 of itself (under bf16's own rounding) before it is quantized
/// moves that CPU model's logits by 4–10% of the row's largest (root mean square 1.0–3.1%),
/// as far as the dequantized model is from it; and the small random Qwen3.5 fixtures
/// amplify it further (the block-scaled one moves by over half its scale). So no reference
/// can be held to the GPU logit by logit more closely than the quantization's own size; what
/// can be held is the size, step by step:
///
/// - the root-mean-square difference from the dequantized model within `FP8_RMS_FACTOR`
///   times the CPU's own, plus `FP8_PREFILL_FLOOR` at prefill (the quantized step) and
///   `FP8_DECODE_FLOOR` at decode (bf16 activations, where the bf16 path's own difference
///   dominates: 0.8% on a Qwen3.5 fixture whose own quantization moved that step 0.2%);
/// - the largest logit difference within `FP8_RMS_FACTOR` times the CPU's own plus
///   `FP8_MAX_FLOOR`;
/// - the greedy token the dequantized model's, teacher-forced, in all but 2 of the steps
///   where the CPU's quantized model agrees with it.
///
/// In the CUDA emulator the root-mean-square ratio was 0.92–1.20 at every prefill of the
/// dense fixtures; with e4m3 rounding made to truncate instead (a bias that doubles the
/// rounding), 1.28–2.43, and with each token quantized by its neighbour's scale 5.9 and
/// more. The kernels themselves are held to float64 by
/// `fp8_cublaslt_products_match_the_quantized_product_on_the_host` and
/// `fp8_decode_kernels_match_a_float64_reference`. (The first H200 run, under the old fixed
/// limits, measured 4.0–8.1% largest differences on the three dense fixtures.)
const FP8_RMS_FACTOR: f32 = 1.5;
const FP8_PREFILL_FLOOR: f32 = 2e-3;
const FP8_DECODE_FLOOR: f32 = 1e-2;
const FP8_MAX_FLOOR: f32 = 0.05;

/// A CPU backend of `m` with `opts`.
fn cpu_backend(m: &LoadedModel, blocks: usize, opts: CpuOptions) -> Box<dyn Backend> {
    build_backend(
        BackendKind::Cpu(opts),
        m,
        BLOCK_SIZE,
        KvBudget::Blocks(blocks),
    )
    .unwrap()
}

/// The largest difference relative to the CPU row's scale, and the logit where it is.
fn fp8_error(ctx: &str, gpu: &[f32], cpu: &[f32]) -> (f32, String) {
    assert_eq!(gpu.len(), cpu.len(), "{ctx}: vocabulary sizes differ");
    let scale = row_scale(cpu);
    let (mut worst, mut at) = (0f32, String::new());
    for (i, (g, c)) in gpu.iter().zip(cpu).enumerate() {
        let d = (g - c).abs() / scale;
        if d.is_nan() || d > worst {
            worst = d;
            at = format!("{ctx}: logit {i}: gpu {g} cpu {c} (scale {scale})");
        }
    }
    (worst, at)
}

fn row_scale(v: &[f32]) -> f32 {
    v.iter().fold(1f32, |m, x| m.max(x.abs()))
}

/// The root mean square of `a - b`, relative to `b`'s largest.
fn rms_error(a: &[f32], b: &[f32]) -> f32 {
    let sq: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    (sq / a.len().max(1) as f64).sqrt() as f32 / row_scale(b)
}

/// One prompt's worst figures: the largest logit error and the root-mean-square one against
/// the dequantized model, the latter over the CPU's own (what quantizing moves it).
#[derive(Default)]
struct Fp8Worst {
    max: f32,
    rms: f32,
    ratio: f32,
}

impl Fp8Worst {
    /// Checks one step (`prefill`, or a decode step): `g` the GPU's logits, `c` the
    /// dequantized model's, `q` the CPU's with FP8 activations; failures go to `failed`.
    fn step(
        &mut self,
        ctx: &str,
        prefill: bool,
        (g, c, q): (&[f32], &[f32], &[f32]),
        failed: &mut Vec<String>,
    ) {
        let ((max, at), (own_max, _)) = (fp8_error(ctx, g, c), fp8_error(ctx, q, c));
        if max.is_nan() || max > FP8_RMS_FACTOR * own_max + FP8_MAX_FLOOR {
            failed.push(format!(
                "{at}: over {FP8_RMS_FACTOR} x the {own_max:.3e} that quantizing the \
                 activations moves the CPU's model, plus {FP8_MAX_FLOOR}"
            ));
        }
        let (rms, own) = (rms_error(g, c), rms_error(q, c));
        let floor = if prefill {
            FP8_PREFILL_FLOOR
        } else {
            FP8_DECODE_FLOOR
        };
        if rms.is_nan() || rms > FP8_RMS_FACTOR * own + floor {
            failed.push(format!(
                "{ctx}: root-mean-square logit error {rms:.3e} of the row's largest, over \
                 {FP8_RMS_FACTOR} x the {own:.3e} that quantizing the activations moves the \
                 CPU's model, plus {floor}"
            ));
        }
        self.max = self.max.max(max);
        self.rms = self.rms.max(rms);
        self.ratio = self.ratio.max(rms / own.max(f32::MIN_POSITIVE));
    }
}

#[test]
fn fp8_models_match_the_cpus_dequantized_model() {
    let mut failed = Vec::new();
    let models: Vec<_> = FP8_MODELS
        .iter()
        .map(|&n| (n, n.to_string(), load(n)))
        .chain(std::iter::once((
            fp8_twin::STATIC_BASE,
            format!("{} (static per-tensor activations)", fp8_twin::STATIC_BASE),
            fp8_twin::fp8_static_twin(),
        )))
        .collect();
    // The decode products through fp8_gemv_* (the default), then on the tensor cores
    // (fp8_mma_*), each against the CPU quantizing the activations as that path does. The
    // latter on prompts of more than 16 tokens only: shorter ones are not quantized at all
    // on that path, which leaves the floors alone to hold bf16's rounding, and the Qwen3.5
    // block fixture amplifies that past them (5.6% of the scale at one logit; its own
    // quantized model moves over 50%). fp8_decode_kernels_match_a_float64_reference holds
    // the kernel itself to 1e-5 at 1 to 16 rows.
    let paths = [
        ("", CudaOptions::device(0)),
        (
            ", tensor-core decode products",
            CudaOptions {
                fp8_mma: true,
                ..CudaOptions::device(0)
            },
        ),
    ];
    for ((base, name, m), (path, opts)) in models
        .iter()
        .flat_map(|m| paths.iter().map(move |p| (m, p)))
    {
        let (base, name) = (*base, format!("{name}{path}"));
        let fp8_cpu = CpuOptions {
            fp8_activations_above: Some(opts.fp8_gemv_max_rows()),
            ..Default::default()
        };
        assert!(
            m.config.quantization.is_some(),
            "{name} is not an FP8 fixture"
        );
        let (mut agree, mut agree_q, mut steps) = (0, 0, 0);
        let prompts = prompts(base);
        let longer = |p: &&Vec<u32>| !opts.fp8_mma || p.len() > opts.fp8_gemv_max_rows();
        for (pi, prompt) in prompts.iter().enumerate().filter(|(_, p)| longer(p)) {
            let mut cpu = cpu_backend(m, 16, CpuOptions::default());
            let mut gpu = build_backend(
                BackendKind::Cuda(*opts),
                m,
                BLOCK_SIZE,
                KvBudget::Blocks(16),
            )
            .expect("a CUDA device (this test is for a GPU machine)");
            let mut qcpu = cpu_backend(m, 16, fp8_cpu);
            let table: Vec<BlockId> = [5u32, 2, 7, 0, 3, 6, 1, 4, 9, 8]
                .iter()
                .map(|&b| BlockId(b))
                .collect();
            let ctx = format!("{name} prompt {pi} ({} tokens)", prompt.len());
            let mut w = Fp8Worst::default();
            // A hybrid model's sequence holds state slot 0.
            let hybrid = m.config.hybrid.is_some();
            let fwd = |be: &mut dyn Backend, tokens: &[u32], start: usize| match hybrid {
                true => forward_slot(be, tokens, start, &table, 0),
                false => forward(be, tokens, start, &table),
            };
            let (mut tokens, mut start) = (prompt.to_vec(), 0);
            for step in 0..9 {
                let c = fwd(cpu.as_mut(), &tokens, start);
                let q = fwd(qcpu.as_mut(), &tokens, start);
                let g = fwd(gpu.as_mut(), &tokens, start);
                let what = match step {
                    0 => "prefill".to_string(),
                    s => format!("decode {}", s - 1),
                };
                w.step(
                    &format!("{ctx} {what}"),
                    step == 0,
                    (&g, &c, &q),
                    &mut failed,
                );
                agree += (argmax(&g) == argmax(&c)) as usize;
                agree_q += (argmax(&q) == argmax(&c)) as usize;
                steps += 1;
                start += tokens.len();
                tokens = vec![argmax(&c) as u32];
            }
            println!(
                "{ctx}: largest logit error {:.3e} of the row's largest, root mean square \
                 {:.3e}, at most {:.2} x what quantizing the activations moves the CPU's model",
                w.max, w.rms, w.ratio
            );
        }
        println!(
            "{name}: greedy token agreed in {agree} of {steps} steps (teacher-forced); the \
             CPU's quantized model in {agree_q}"
        );
        if agree + 2 < agree_q {
            failed.push(format!(
                "{name}: greedy token agreed in {agree} of {steps} steps, the CPU's quantized \
                 model in {agree_q}"
            ));
        }
    }
    assert!(failed.is_empty(), "FP8 models off: {failed:#?}");
}

/// Random bf16 values in [-2, 2) (bits and values), random e4m3 bytes (NaN codes drawn
/// again), and scales in [2^-10, 2^-6).
fn fp8_draws(r: &mut Rng) -> impl FnMut(usize) -> (Vec<u16>, Vec<f32>) + '_ {
    move |len| {
        let bits: Vec<u16> = (0..len)
            .map(|_| {
                let v = ((r.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * 2.0;
                (v.to_bits() >> 16) as u16
            })
            .collect();
        let vals = bits
            .iter()
            .map(|&b| f32::from_bits((b as u32) << 16))
            .collect();
        (bits, vals)
    }
}

fn fp8_bytes(r: &mut Rng, len: usize) -> Vec<u8> {
    (0..len)
        .map(|_| {
            let b = (r.next_u64() >> 56) as u8;
            if b & 0x7f == 0x7f {
                b & 0xfe
            } else {
                b
            }
        })
        .collect()
}

fn fp8_scales(r: &mut Rng, len: usize) -> Vec<f32> {
    (0..len)
        .map(|_| 2f32.powi(-10) * (1.0 + 15.0 * (r.next_u64() >> 40) as f32 / (1u64 << 24) as f32))
        .collect()
}

/// The dequantized weight `[n, k]`, as the CPU reference computes it (`quant::dequantize`:
/// the e4m3 value times its scale, in f32).
fn fp8_dequantize(w: &[u8], scales: &[f32], block: bool, n: usize, k: usize) -> Vec<f32> {
    let table: Vec<f32> = (0..=255u8)
        .map(kvmesh_gpu::safetensors::e4m3_to_f32)
        .collect();
    let mut out = Vec::with_capacity(n * k);
    for j in 0..n {
        for c in 0..k {
            let s = if block {
                scales[(j / 128) * k.div_ceil(128) + c / 128]
            } else {
                scales[j]
            };
            out.push(table[w[j * k + c] as usize] * s);
        }
    }
    out
}

/// The decode kernels reading e4m3 weights, `fp8_gemv_*` (1 to 4 rows) and the tensor-core
/// `fp8_mma_*` (1 to 16, `CudaOptions::fp8_mma`), against a float64 product of the same
/// weights dequantized and the same bf16 activations.
#[test]
fn fp8_decode_kernels_match_a_float64_reference() {
    // Qwen3-8B's q/k/v and down projections, Qwen2.5-72B's down projection, and the
    // fixtures' ragged ones: partial 128 x 128 blocks in both directions, rows that end
    // mid-warp, k blocks fewer than the tensor-core kernel's warps.
    let shapes = [
        (6144, 4096),
        (4096, 12288),
        (320, 192),
        (64, 192),
        (192, 320),
        (48, 16),
    ];
    let mut r = Rng::seeded(23);
    for (n, k) in shapes {
        for block in [true, false] {
            let w = fp8_bytes(&mut r, n * k);
            let grid = if block {
                n.div_ceil(128) * k.div_ceil(128)
            } else {
                n
            };
            let scales = fp8_scales(&mut r, grid);
            let wd = fp8_dequantize(&w, &scales, block, n, k);
            // The tensor-core kernel at every column count that changes its work (one tile,
            // ragged tiles, two) on the small shapes, one and two full tiles on the large
            // (minutes of emulated mma otherwise).
            let mma: &[usize] = if n * k > 1 << 20 {
                &[1, 16]
            } else {
                &[1, 3, 8, 9, 16]
            };
            let runs = [1, 2, 3, 4]
                .map(|m| (m, Fp8Path::Gemv))
                .into_iter()
                .chain(mma.iter().map(|&m| (m, Fp8Path::Mma)));
            for (m, path) in runs {
                let (xb, x) = fp8_draws(&mut r)(m * k);
                let bias: Vec<f32> = (0..n).map(|j| j as f32 * 0.01 - 1.0).collect();
                let with_bias = m == 3;
                let y = fp8_product(
                    0,
                    &xb,
                    &w,
                    &scales,
                    block,
                    with_bias.then_some(&bias[..]),
                    (m, n, k),
                    path,
                    false,
                )
                .unwrap()
                .0;
                let mut worst = 0f64;
                for i in 0..m {
                    for j in 0..n {
                        let (mut want, mut mag) = (0f64, 0f64);
                        for c in 0..k {
                            let p = x[i * k + c] as f64 * wd[j * k + c] as f64;
                            want += p;
                            mag += p.abs();
                        }
                        if with_bias {
                            want += bias[j] as f64;
                            mag += (bias[j] as f64).abs();
                        }
                        let got = y[i * n + j] as f64;
                        let err = (got - want).abs() / mag.max(1e-30);
                        worst = worst.max(err);
                        assert!(
                            err < 1e-5,
                            "{path:?} block {block} m {m} n {n} k {k}: y[{i}, {j}] {got}, \
                             float64 {want}"
                        );
                    }
                }
                println!("{path:?} block {block} m {m} n {n} k {k}: within {worst:.1e} of float64");
            }
        }
    }
}

/// The host's activation quantizer, as `fp8_quant_rows` is meant to compute it: per token
/// (and per 128-column group), s = amax / 448, q = e4m3(x / s) rounded to nearest even and
/// saturated; a group of zeros gets s = 0 and zeros. Scales as the GEMM reads them.
fn host_quantize(x: &[f32], rows: usize, k: usize, per_group: bool) -> (Vec<u8>, Vec<f32>) {
    let width = if per_group { 128 } else { k };
    let groups = k.div_ceil(width);
    let mut q = vec![0u8; rows * k];
    let mut scales = vec![0f32; rows * groups];
    for r in 0..rows {
        for g in 0..groups {
            let cols = g * width..((g + 1) * width).min(k);
            let amax = cols.clone().fold(0f32, |a, c| a.max(x[r * k + c].abs()));
            let s = amax / 448.0;
            for c in cols {
                q[r * k + c] = if s > 0.0 {
                    kvmesh_gpu::safetensors::f32_to_e4m3(x[r * k + c] / s)
                } else {
                    0
                };
            }
            scales[if per_group { g * rows + r } else { r }] = s;
        }
    }
    (q, scales)
}

#[test]
fn fp8_activation_quantizer_matches_the_host_bit_for_bit() {
    let mut r = Rng::seeded(29);
    for (rows, k) in [(1, 4096), (3, 192), (37, 320), (5, 12288)] {
        let (mut xb, mut x) = fp8_draws(&mut r)(rows * k);
        // A row of zeros (scale 0, no NaN), a row with one large value (everything else
        // rounds towards zero or subnormal).
        for c in 0..k {
            xb[c] = 0;
            x[c] = 0.0;
        }
        if rows > 1 {
            xb[k + 7] = (3.0e4f32.to_bits() >> 16) as u16;
            x[k + 7] = f32::from_bits((xb[k + 7] as u32) << 16);
        }
        for per_group in [true, false] {
            let (q, s) = fp8_quantize(0, &xb, (rows, k), per_group, None).unwrap();
            let (hq, hs) = host_quantize(&x, rows, k, per_group);
            let ctx = format!("rows {rows} k {k} per_group {per_group}");
            assert_eq!(s.len(), hs.len(), "{ctx}");
            for (i, (a, b)) in s.iter().zip(&hs).enumerate() {
                assert_eq!(
                    a.to_bits(),
                    b.to_bits(),
                    "{ctx}: scale {i}: gpu {a} host {b}"
                );
            }
            let diff = q.iter().zip(&hq).position(|(a, b)| a != b);
            assert!(
                diff.is_none(),
                "{ctx}: byte {:?}: gpu {:#04x} host {:#04x} (x {})",
                diff,
                q[diff.unwrap()],
                hq[diff.unwrap()],
                x[diff.unwrap()]
            );
            println!("fp8_quant_rows {ctx}: bytes and scales identical to the host's");
        }
        // A static scale (llm-compressor's calibrated `input_scale`): every row by the same
        // scale, the large value saturating at 448.
        let fixed = 0.01f32;
        let (q, s) = fp8_quantize(0, &xb, (rows, k), false, Some(fixed)).unwrap();
        assert!(
            s.iter().all(|&v| v == fixed),
            "rows {rows} k {k}: static scales {s:?}"
        );
        let hq: Vec<u8> = x
            .iter()
            .map(|&v| kvmesh_gpu::safetensors::f32_to_e4m3(v / fixed))
            .collect();
        let diff = q.iter().zip(&hq).position(|(a, b)| a != b);
        assert!(
            diff.is_none(),
            "rows {rows} k {k} static: byte {diff:?}: gpu {:#04x} host {:#04x}",
            q[diff.unwrap()],
            hq[diff.unwrap()]
        );
        println!("fp8_quant_rows rows {rows} k {k} static: bytes identical to the host's");
    }
}

#[test]
fn fp8_cublaslt_products_match_the_quantized_product_on_the_host() {
    // cuBLASLt's block (BLK128x128 weights, VEC128 activations) and outer-vector GEMMs, at
    // Qwen3-8B's q/k/v shape and the fixtures' ragged ones, for token counts that are not
    // multiples of anything (cuBLASLt runs them padded to a multiple of 4, `lt_rows`). The
    // reference is the same quantized product in float64: the host quantizes x as the
    // kernel does (checked bit for bit above), so a wrong scale layout shows as an error of
    // the order of a 128-wide block's share of sum |x w| or more. cuBLASLt's own error is
    // the bf16 output's rounding (2^-8 of the value) plus the FP8 tensor cores' accumulation,
    // which on Hopper keeps about 14 bits inside each block before the f32 epilogue (the
    // limited accumulation precision the DeepSeek-V3 technical report measured, §3.3.2): the
    // first H200 run saw 2.1e-5 of sum |x w| where the values cancel (k 4096), so the limit
    // is |value| / 128 + sum |x w| / 4096, a sixth of a block's share at k 4096 and below.
    // Each product runs with bf16 output widened (`fp8_out_cols`) and with f32 output straight
    // into the columns (`CudaOptions::fp8_f32_out`; where cuBLASLt has no such GEMM for the
    // scales the product falls back to bf16, which is reported). Every shape is run and
    // reported before the test fails.
    let shapes = [
        (6144, 4096, &[5, 37][..]),
        (4096, 12288, &[5][..]),
        (320, 192, &[5, 37, 300][..]),
        (64, 192, &[5, 37, 300][..]),
        (192, 320, &[5, 37, 300][..]),
        // Output columns no multiple of 8: fp8_out_cols a column at a time.
        (36, 192, &[37][..]),
    ];
    let mut r = Rng::seeded(31);
    let mut failed = Vec::new();
    let mut direct = Vec::new();
    for (n, k, ms) in shapes {
        for (block, f32_out) in [(true, false), (false, false), (true, true), (false, true)] {
            let w = fp8_bytes(&mut r, n * k);
            let grid = if block {
                n.div_ceil(128) * k.div_ceil(128)
            } else {
                n
            };
            let scales = fp8_scales(&mut r, grid);
            let wd = fp8_dequantize(&w, &scales, block, n, k);
            for &m in ms {
                let (xb, x) = fp8_draws(&mut r)(m * k);
                let bias: Vec<f32> = (0..n).map(|j| 0.5 - j as f32 * 0.003).collect();
                let with_bias = m == 37;
                let mut ctx = format!("block {block} m {m} n {n} k {k}");
                let y = match fp8_product(
                    0,
                    &xb,
                    &w,
                    &scales,
                    block,
                    with_bias.then_some(&bias[..]),
                    (m, n, k),
                    Fp8Path::Lt,
                    f32_out,
                ) {
                    Ok((y, wrote_f32)) => {
                        if f32_out {
                            ctx += if wrote_f32 {
                                ", f32 out"
                            } else {
                                ", f32 out asked, bf16 ran"
                            };
                            direct.push((block, wrote_f32));
                        }
                        y
                    }
                    Err(e) => {
                        println!("cuBLASLt FP8 {ctx}: {e}");
                        failed.push(format!("{ctx}: {e}"));
                        continue;
                    }
                };
                let (q, qs) = host_quantize(&x, m, k, block);
                let xq = |i: usize, c: usize| -> f64 {
                    let s = if block { qs[(c / 128) * m + i] } else { qs[i] };
                    (kvmesh_gpu::safetensors::e4m3_to_f32(q[i * k + c]) * s) as f64
                };
                // The worst error as a share of its limit, and where.
                let (mut worst, mut at) = (0f64, String::new());
                for i in 0..m {
                    for j in 0..n {
                        let (mut want, mut mag) = (0f64, 0f64);
                        for c in 0..k {
                            let p = xq(i, c) * wd[j * k + c] as f64;
                            want += p;
                            mag += p.abs();
                        }
                        let got =
                            y[i * n + j] as f64 - if with_bias { bias[j] as f64 } else { 0.0 };
                        let limit = want.abs() / 128.0 + mag / 4096.0;
                        let share = (got - want).abs() / limit.max(1e-30);
                        if share.is_nan() || share > worst {
                            worst = share;
                            at = format!(
                                "y[{i}, {j}] {got}, quantized float64 {want} (sum |x w| {mag})"
                            );
                        }
                    }
                }
                println!(
                    "cuBLASLt FP8 {ctx}: worst error {:.0}% of its limit, at {at}",
                    100.0 * worst
                );
                if worst.is_nan() || worst > 1.0 {
                    failed.push(format!("{ctx}: {at}"));
                }
            }
        }
    }
    println!(
        "f32 output: {} of {} block-scaled and {} of {} per-channel products wrote it",
        direct.iter().filter(|&&(b, w)| b && w).count(),
        direct.iter().filter(|&&(b, _)| b).count(),
        direct.iter().filter(|&&(b, w)| !b && w).count(),
        direct.iter().filter(|&&(b, _)| !b).count(),
    );
    assert!(failed.is_empty(), "cuBLASLt FP8 products off: {failed:#?}");
}
