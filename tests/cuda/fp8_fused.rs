//! The fused FP8 decode kernels (`fp8_silu_*`, `fp8_rope_*`, `fp8_norm*`: `fp8_gemv_*` with
//! the skinny kernels' prologue and epilogues) against the launches they replace, bit for
//! bit: on their own at a model's widths, and through whole decode steps of the FP8
//! fixtures under `CudaOptions::fuse_norms` and `fuse_rope`.

use super::*;

/// The residual add and RMSNorm as an FP8 product's prologue, and the SiLU-gated product as
/// its epilogue, give the bits of `add_rmsnorm_to_bf16`, `fp8_gemv_*` and `silu_mul`, for
/// both scale kinds.
#[test]
fn fp8_fused_products_equal_the_launches_they_replace() {
    let mut r = Rng::seeded(31);
    // Qwen2.5-0.5B's MLP at 1 row, a 4,096-wide stream at 2, ragged 128 x 128 blocks, and
    // the narrowest width the kernels take.
    for (m, n, k) in [(1, 4864, 896), (2, 1024, 4096), (2, 200, 336), (1, 40, 16)] {
        for block in [true, false] {
            let mut vals = |len: usize, scale: f64| -> Vec<f32> {
                (0..len).map(|_| (r.normal() * scale) as f32).collect()
            };
            let (res, delta, norm) = (vals(m * k, 1.0), vals(m * k, 0.5), vals(k, 0.2));
            let w = fp8_bytes(&mut r, 2 * n * k);
            let grid = if block {
                (2 * n).div_ceil(128) * k.div_ceil(128)
            } else {
                2 * n
            };
            let scales = fp8_scales(&mut r, grid);
            let [res_f, res_s, y_f, y_s, act_f, act_s, act_x, act_xs] =
                fp8_fused_products(0, &res, &delta, &norm, &w, &scales, block, (m, n, k)).unwrap();
            let ctx = format!("block {block} m {m} n {n} k {k}");
            assert!(
                y_f.iter().all(|&b| f32::from_bits(b).is_finite()),
                "{ctx}: a product left unwritten"
            );
            assert!(
                act_f.iter().chain(&act_x).all(|&b| b != 0x7fc0),
                "{ctx}: a SiLU-gated product left unwritten"
            );
            assert_eq!(res_f, res_s, "{ctx}: the residual written");
            assert_eq!(
                y_f, y_s,
                "{ctx}: fp8_norm vs add_rmsnorm_to_bf16 + fp8_gemv"
            );
            assert_eq!(act_f, act_s, "{ctx}: fp8_norm_silu vs the launches");
            assert_eq!(act_x, act_xs, "{ctx}: fp8_silu vs fp8_gemv + silu_mul");
            println!("{ctx}: residual, products and SiLU-gated products bit-identical");
        }
    }
}

/// Decode steps of the dense FP8 fixtures with the norms and the rotary embedding (q/k
/// norms included: `fused_rope.rs`) fused into the FP8 products give the bits of the separate
/// launches, and so does the step after (which reads the K/V the fused step wrote). Each
/// layer fuses what its products' kernels take: a product of several parts (block-scaled
/// parts whose rows are no multiple of 128, or an unquantized `up_proj` beside an FP8
/// `gate_proj`) keeps its own launches.
#[test]
fn fp8_models_decode_the_same_bits_with_the_products_fused() {
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let table: Vec<BlockId> = (0..16).map(BlockId).collect();
    // Per fixture, what fuses with both switches on (two layers each): products taking
    // the norm (layer 1's q/k/v, and each gate/up), and q/k/v products rotating.
    let expected = [
        // q 192 rows, gate 320: block-scaled parts that cannot be one.
        ("hf-qwen3-fp8-block", FusedProducts::default()),
        // Every stacked product one FP8 part (layer 1's bf16 down_proj fuses nothing).
        (
            "hf-llama-fp8-block-ignore",
            FusedProducts {
                normed: 3,
                rotated: 2,
            },
        ),
        // Layer 1's up_proj unquantized: its gate/up product has two parts.
        (
            "hf-qwen2-fp8-ct",
            FusedProducts {
                normed: 2,
                rotated: 2,
            },
        ),
    ];
    for (name, both) in expected {
        let m = load(name);
        let prompt = &prompts(name)[0];
        let n = prompt.len();
        let backend = |fuse_norms, fuse_rope| fused_backend(&m, (fuse_norms, fuse_rope), 16);
        let mut plain = backend(false, false);
        assert_eq!(plain.fused_decode(1), FusedProducts::default(), "{name}");
        forward(&mut plain, prompt, 0, &table);
        let want = forward(&mut plain, &prompt[..1], n, &table);
        let want_next = forward(&mut plain, &prompt[1..2], n + 1, &table);
        for (what, norms, rope) in [
            ("the norms", true, false),
            ("the rotary embedding", false, true),
            ("the norms and the rotary embedding", true, true),
        ] {
            let mut fused = backend(norms, rope);
            let asked = FusedProducts {
                normed: if norms { both.normed } else { 0 },
                rotated: if rope { both.rotated } else { 0 },
            };
            assert_eq!(fused.fused_decode(1), asked, "{name}: with {what} asked");
            forward(&mut fused, prompt, 0, &table);
            let got = forward(&mut fused, &prompt[..1], n, &table);
            assert_eq!(bits(&got), bits(&want), "{name}: decode with {what} fused");
            let next = forward(&mut fused, &prompt[1..2], n + 1, &table);
            assert_eq!(
                bits(&next),
                bits(&want_next),
                "{name}: the step after a decode with {what} fused"
            );
        }
        println!("{name}: {both:?} fused, decode steps bit-identical to the separate launches");
    }
}

/// A CUDA backend of `m` with `CudaOptions::fuse_norms` and `fuse_rope` as given, and a KV
/// cache of `blocks` blocks.
pub(crate) fn fused_backend(
    m: &LoadedModel,
    (norms, rope): (bool, bool),
    blocks: usize,
) -> CudaBackend {
    let opts = CudaOptions {
        fuse_norms: norms,
        fuse_rope: rope,
        ..CudaOptions::device(0)
    };
    CudaBackend::new(
        &m.config,
        &m.weights,
        opts,
        KvBudget::Blocks(blocks),
        BLOCK_SIZE,
    )
    .expect("a CUDA device")
}
