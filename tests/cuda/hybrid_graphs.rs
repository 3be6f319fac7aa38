//! Qwen3.5's decode steps through CUDA graphs: a batch padded to its bucket (the padding
//! sequences on the scratch state slot and KV block) gives the eager step's logits, and
//! leaves the real sequences' states as the eager steps do.

use super::*;

fn hybrid_gpu(m: &LoadedModel, graphs: bool) -> Box<dyn Backend> {
    build_backend(
        BackendKind::Cuda(CudaOptions {
            graphs,
            ..CudaOptions::device(0)
        }),
        m,
        BLOCK_SIZE,
        KvBudget::Blocks(64),
    )
    .expect("a CUDA device")
}

/// Three sequences (slots 0..3, blocks of their own) prefilled, then decoded together for
/// `steps` steps fed the eager backend's greedy tokens: every step's logits.
fn decode_three(be: &mut dyn Backend, m: &LoadedModel, steps: usize) -> Vec<Vec<Vec<f32>>> {
    let name = m.config.arch.architecture_name();
    let prompts: Vec<Vec<u32>> = (0..3u32)
        .map(|s| (0..9 + 3 * s).map(|i| 5 + (7 * i + 11 * s) % 200).collect())
        .collect();
    let tables: Vec<Vec<BlockId>> = (0..3u32)
        .map(|s| (0..4).map(|b| BlockId(4 * s + b)).collect())
        .collect();
    let mut next = Vec::new();
    for s in 0..3 {
        let l = forward_slot(be, &prompts[s], 0, &tables[s], s as u32);
        next.push(argmax(&l) as u32);
    }
    let mut out = Vec::new();
    for step in 0..steps {
        let toks: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
        let batch = ForwardBatch {
            seqs: (0..3)
                .map(|s| SeqInput {
                    tokens: &toks[s],
                    start_pos: prompts[s].len() + step,
                    context_len: 0,
                    block_table: &tables[s],
                    want_logits: true,
                    state_slot: Some(s as u32),
                })
                .collect(),
        };
        let logits = be.forward(&batch).unwrap_or_else(|e| panic!("{name}: {e}"));
        next = logits.iter().map(|l| argmax(l) as u32).collect();
        out.push(logits);
    }
    out
}

/// An f32 fixture, and an FP8 one (its products through `fp8_gemv_*` in the graphs).
#[test]
fn hybrid_decode_graphs_match_eager_steps() {
    for name in ["hf-qwen35-f32", "hf-qwen35-fp8-block-cg"] {
        let m = load(name);
        let eager = decode_three(hybrid_gpu(&m, false).as_mut(), &m, 6);
        let graphed = decode_three(hybrid_gpu(&m, true).as_mut(), &m, 6);
        let mut worst = 0f32;
        for (step, (e, g)) in eager.iter().zip(&graphed).enumerate() {
            for (s, (le, lg)) in e.iter().zip(g).enumerate() {
                let ctx = format!("{name}: step {step}, sequence {s}");
                worst = worst.max(assert_close(&ctx, lg, le));
                assert_eq!(argmax(lg), argmax(le), "{ctx}: greedy token");
            }
        }
        println!("{name}: 3 sequences in a bucket of 4, graphed within {worst:.2e} of eager");
    }
}

/// A prefix snapshot's copies between state slots (`Backend::copy_state`), from a lower slot
/// to a higher one and back, move exactly the slot's values and nothing around them; a
/// slot beyond the pool is refused by name.
#[test]
fn hybrid_state_copies_move_one_slot_exactly() {
    let m = load("hf-qwen35-f32");
    let mut be = hybrid_gpu(&m, false);
    let total = (be.num_state_slots() + be.num_state_snapshots()) as u32;
    assert!(total >= 3, "{total} slots");
    let n = be.read_state(0).unwrap().len();
    let fill = |slot: u32| -> Vec<f32> {
        (0..n)
            .map(|i| (slot * 1000) as f32 + i as f32 * 0.5)
            .collect()
    };
    for s in 0..total {
        be.write_state(s, &fill(s)).unwrap();
    }
    let (lo, hi) = (1, total - 1);
    be.copy_state(lo, hi).unwrap();
    assert_eq!(
        be.read_state(hi).unwrap(),
        fill(lo),
        "slot {lo} copied up to {hi}"
    );
    be.write_state(lo, &fill(7)).unwrap();
    be.copy_state(hi, lo).unwrap();
    assert_eq!(
        be.read_state(lo).unwrap(),
        fill(1),
        "slot {hi} copied down to {lo}"
    );
    for s in (0..total).filter(|&s| s != lo && s != hi) {
        assert_eq!(be.read_state(s).unwrap(), fill(s), "slot {s} untouched");
    }
    let e = be.copy_state(0, total).unwrap_err().to_string();
    assert!(e.contains(&total.to_string()), "{e}");
    println!("state copies between slots {lo} and {hi} of {total}: exact, neighbours untouched");
}
