//! Qwen3's q/k norms taken into the q/k/v product's rotary epilogue (`skinny_rope_*`,
//! `skinny_norm_rope_*`, `fp8_rope_*`, `fp8_norm_rope_*` with `RopeIn`'s norms): each head
//! is normalised by the last of its pairs' warps to finish, from sums other blocks wrote.
//! Decode steps of one, two and three sequences against `rope_kv_write`'s separate launch,
//! bit for bit, on bf16 and block-scaled FP8 Qwen3 checkpoints.

use super::fp8_fused::fused_backend;
use super::*;

/// A decode step of one token for each `(token, position, blocks)`; the logits per sequence.
fn decode_step(be: &mut dyn Backend, seqs: &[(u32, usize, &[BlockId])]) -> Vec<Vec<f32>> {
    let tokens: Vec<[u32; 1]> = seqs.iter().map(|s| [s.0]).collect();
    let batch = ForwardBatch {
        seqs: seqs
            .iter()
            .zip(&tokens)
            .map(|(&(_, start_pos, block_table), tokens)| SeqInput {
                tokens,
                start_pos,
                context_len: 0,
                block_table,
                want_logits: true,
                state_slot: None,
            })
            .collect(),
    };
    be.forward(&batch).unwrap()
}

/// A Qwen3 checkpoint of random weights: bf16 at the tiny shape with head size 128 (four q
/// heads, two KV heads), or block-scaled FP8 with q/k/v parts of whole 128-row blocks (two
/// q heads of 128, one KV head), so that the stacked product is one FP8 part and fuses.
fn qwen3(fp8: bool) -> LoadedModel {
    let mut cfg = kvmesh_gpu::init::preset(Some(Arch::Qwen3), "tiny").unwrap();
    cfg.head_dim = 128;
    cfg.max_position_embeddings = 1024;
    let tok = kvmesh_gpu::embedded::default_tokenizer();
    let dir = std::env::temp_dir().join(format!("kvmesh-parity-qwen3-qknorm-fp8-{fp8}"));
    if fp8 {
        cfg.hidden_size = 256;
        cfg.intermediate_size = 256;
        cfg.num_heads = 2;
        cfg.num_kv_heads = 1;
        kvmesh_gpu::init::write_random_fp8_checkpoint(cfg, 5, &tok, &dir).unwrap();
    } else {
        kvmesh_gpu::init::write_random_checkpoint(cfg, 5, DType::BF16, &tok, &dir).unwrap();
    }
    LoadedModel::from_dir(&dir).unwrap()
}

#[test]
fn skinny_rope_with_qk_norms_gives_the_separate_launches_bits() {
    let bits = |v: &[Vec<f32>]| -> Vec<Vec<u32>> {
        v.iter()
            .map(|r| r.iter().map(|x| x.to_bits()).collect())
            .collect()
    };
    // Three sequences of 16 blocks each; their prompts of 40, 23 and 57 tokens.
    let tables: Vec<Vec<BlockId>> = (0..3)
        .map(|s| (16 * s..16 * (s + 1)).map(BlockId).collect())
        .collect();
    for fp8 in [false, true] {
        let m = qwen3(fp8);
        let layers = m.config.num_layers;
        assert!(m.config.qk_norm, "the checkpoint has q/k norms");
        let vocab = m.config.vocab_size as u32;
        let prompts: Vec<Vec<u32>> = [40u32, 23, 57]
            .iter()
            .enumerate()
            .map(|(s, &n)| {
                (0..n)
                    .map(|i| (i * 7919 + 131 * s as u32 + 5) % vocab)
                    .collect()
            })
            .collect();
        let backend = |fuse_norms, fuse_rope| fused_backend(&m, (fuse_norms, fuse_rope), 48);
        // FP8's fused kernels take up to 2 rows; bf16's skinny ones up to 4.
        let most = if fp8 { 2 } else { 3 };
        // Steps of 1, 2, 3 sequences, each after the one before (so each reads the K/V the
        // step before it wrote), and a second pass of the same steps.
        let sizes: Vec<usize> = (1..=most).chain(1..=most).collect();
        let steps: Vec<Vec<(u32, usize, &[BlockId])>> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                (0..n)
                    .map(|s| {
                        let p = &prompts[s];
                        let done = sizes[..i].iter().filter(|&&k| s < k).count();
                        (p[(i + s) % p.len()], p.len() + done, tables[s].as_slice())
                    })
                    .collect()
            })
            .collect();
        let run = |be: &mut CudaBackend| -> Vec<Vec<Vec<u32>>> {
            for (s, p) in prompts.iter().enumerate().take(most) {
                forward(be, p, 0, &tables[s]);
            }
            steps.iter().map(|st| bits(&decode_step(be, st))).collect()
        };
        let mut plain = backend(false, false);
        assert_eq!(plain.fused_decode(1), FusedProducts::default());
        let want = run(&mut plain);
        for (what, norms) in [
            ("the rotary embedding", false),
            ("the norms and the rotary embedding", true),
        ] {
            let mut fused = backend(norms, true);
            for rows in 1..=most {
                let got = fused.fused_decode(rows);
                assert_eq!(
                    got.rotated, layers,
                    "fp8 {fp8}: q/k/v products rotating at {rows} rows"
                );
            }
            let got = run(&mut fused);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let differ: Vec<(usize, usize)> = (0..w.len())
                    .flat_map(|s| (0..w[s].len()).map(move |t| (s, t)))
                    .filter(|&(s, t)| g[s][t] != w[s][t])
                    .collect();
                assert!(
                    differ.is_empty(),
                    "fp8 {fp8}, {what} fused: decode step {i} of {} sequences: {} logits differ \
                     from the separate launches', the first (sequence, token) {:?}",
                    steps[i].len(),
                    differ.len(),
                    differ.first()
                );
            }
        }
        println!(
            "fp8 {fp8}: {} decode steps of 1 to {most} sequences bit-identical with the q/k norms \
             fused",
            steps.len()
        );
    }
}
