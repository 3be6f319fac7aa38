//! Piecewise prefill graphs (`CudaOptions::prefill_graphs`): the segments between the
//! attention launches, replayed per token bucket, against the eager step and the CPU.

use super::*;

fn piecewise(m: &LoadedModel) -> CudaBackend {
    CudaBackend::new(
        &m.config,
        &m.weights,
        CudaOptions {
            prefill_graphs: true,
            ..CudaOptions::device(0)
        },
        KvBudget::Blocks(64),
        BLOCK_SIZE,
    )
    .expect("a CUDA device")
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// A step of exactly a bucket's tokens (128) gives the eager step's logits bit for bit (the
/// same launches at the same sizes), and again when its captured segments are replayed a
/// second time. Steps that pad to their bucket match the CPU within the bf16 tolerance and
/// its greedy token: a 100-token prompt, the same prompt as 60 tokens then a 40-token chunk
/// over the cached 60 (the first chunk's padding would corrupt the positions the second
/// reads if it wrote anywhere but the scratch block), and two sequences of 30 and 50 tokens
/// in one step.
#[test]
fn prefill_graphs_replay_what_the_eager_step_computes() {
    let m = load("tiny-llama");
    let vocab = m.config.vocab_size as u32;
    let prompt = |n: usize, salt: u32| -> Vec<u32> {
        (0..n as u32)
            .map(|i| (i * 7919 + 13 + salt * 101) % vocab)
            .collect()
    };
    let table = |first: u32| -> Vec<BlockId> { (first..first + 16).map(BlockId).collect() };
    let (mut cpu, mut eager) = backends(&m, 64);
    let mut pw = piecewise(&m);
    assert!(pw.prefill_graphs_enabled());
    // A whole bucket: the eager step's bits, twice.
    let p128 = prompt(128, 0);
    let want = forward(eager.as_mut(), &p128, 0, &table(0));
    let first = forward(&mut pw, &p128, 0, &table(0));
    let again = forward(&mut pw, &p128, 0, &table(0));
    assert_eq!(
        bits(&first),
        bits(&want),
        "128 tokens: piecewise against eager"
    );
    assert_eq!(bits(&again), bits(&first), "128 tokens: a second replay");
    // Padded: 100 tokens in a bucket of 128, against the CPU.
    let p100 = prompt(100, 1);
    let want = forward(cpu.as_mut(), &p100, 0, &table(16));
    let got = forward(&mut pw, &p100, 0, &table(16));
    let w1 = assert_close("100 tokens, piecewise", &got, &want);
    assert_eq!(argmax(&got), argmax(&want), "100 tokens: greedy token");
    // Chunked: 60 tokens, then 40 over the cached 60.
    forward(&mut pw, &p100[..60], 0, &table(32));
    let got = forward(&mut pw, &p100[60..], 60, &table(32));
    let w2 = assert_close("60 + 40 tokens, piecewise", &got, &want);
    // Two sequences in one step.
    let (a, b) = (prompt(30, 2), prompt(50, 3));
    let (ta, tb) = (table(48), (0..4).map(BlockId).collect::<Vec<_>>());
    let batch = ForwardBatch {
        seqs: vec![
            SeqInput {
                tokens: &a,
                start_pos: 0,
                context_len: 0,
                block_table: &ta,
                want_logits: true,
                state_slot: None,
            },
            SeqInput {
                tokens: &b,
                start_pos: 0,
                context_len: 0,
                block_table: &tb,
                want_logits: true,
                state_slot: None,
            },
        ],
    };
    let got = pw.forward(&batch).unwrap();
    let wa = forward(cpu.as_mut(), &a, 0, &ta);
    let wb = forward(cpu.as_mut(), &b, 0, &tb);
    let w3 = assert_close("30 tokens beside 50, piecewise", &got[0], &wa);
    let w4 = assert_close("50 tokens beside 30, piecewise", &got[1], &wb);
    assert!(pw.prefill_graphs_enabled(), "every capture succeeded");
    println!(
        "piecewise prefill: bit-identical to eager at 128 tokens; max |gpu - cpu| logit \
         {w1:.3e} (100 tokens), {w2:.3e} (60 + 40), {w3:.3e} / {w4:.3e} (30 beside 50)"
    );
}
