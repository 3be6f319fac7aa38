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

#[test]
fn hybrid_decode_graphs_match_eager_steps() {
    let name = "hf-qwen35-f32";
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
