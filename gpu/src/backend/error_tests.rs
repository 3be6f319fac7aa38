//! `BackendError`'s texts are what the sites printed when they built the error as free text:
//! each expected string below is that site's old `format!`, with `backend: ` in front as
//! `EngineError::Backend` shows it. Refusals made by pure functions are also checked by
//! variant, so a caller can match on the rule instead of the words.

use super::*;
use crate::backend::sim::{SimBackend, SimTiming};
use crate::backend::Backend;
use crate::error::EngineError;
use crate::kv_cache::BlockId;
use crate::kv_pool::{HostKvPool, KvDtype, KvSpec};

/// What a user reads: the error as the engine reports it.
fn shown(e: impl Into<EngineError>) -> String {
    e.into().to_string()
}

fn spec() -> KvSpec {
    KvSpec {
        num_layers: 2,
        block_size: 4,
        num_kv_heads: 2,
        head_dim: 8,
        dtype: KvDtype::Bf16,
    }
}

#[test]
fn build_and_device_refusals_read_as_before() {
    assert_eq!(
        shown(BackendError::NoCuda),
        "backend: this kvmesh was built without CUDA support; rebuild with `cargo build \
         --release --features cuda`"
    );
    let none = BackendError::NoDevice {
        spec: "cuda:1".into(),
        found: 0,
    };
    assert_eq!(
        shown(none),
        "backend: --device cuda:1: no CUDA device was found (no driver library, or no GPU \
         visible)"
    );
    let two = BackendError::NoDevice {
        spec: "cuda:2".into(),
        found: 2,
    };
    assert_eq!(
        shown(two),
        "backend: --device cuda:2: only 2 CUDA device(s) are visible (cuda:0..cuda:1)"
    );
    assert_eq!(
        shown(BackendError::NotVisible {
            ordinal: 3,
            count: 1
        }),
        "backend: cuda:3 was asked for but 1 CUDA device(s) are visible (check \
         CUDA_VISIBLE_DEVICES and the NVIDIA driver)"
    );
}

#[test]
fn toolchain_and_model_refusals_read_as_before() {
    let cc = ToolchainError::Capability {
        major: 7,
        minor: 5,
        need_major: 8,
        need_minor: 0,
    };
    assert_eq!(
        shown(cc),
        "backend: the GPU has compute capability 7.5; the CUDA backend needs 8.0 or newer (its \
         matrix products are bf16 GEMMs)"
    );
    for (nvrtc, shows) in [(Some((13, 0)), "13.0"), (None, "?")] {
        let e = shown(ToolchainError::PtxIsa {
            isa: "9.0".into(),
            nvrtc,
        });
        assert_eq!(
            e,
            format!(
                "backend: the NVIDIA driver cannot load PTX ISA 9.0, which NVRTC {shows} \
                 produced: update the driver, or use an NVRTC no newer than the driver's CUDA \
                 version (nvidia-smi shows it)"
            )
        );
    }
    assert_eq!(
        shown(ToolchainError::NoNvrtc),
        "backend: the NVRTC library (libnvrtc.so) was not found; install the CUDA runtime \
         libraries or add their folder to LD_LIBRARY_PATH"
    );
    // The UTF-8 error is kept as the source, not printed.
    let utf8 = String::from_utf8(vec![0xff]).unwrap_err();
    let e = ToolchainError::PtxNotUtf8(utf8);
    assert!(std::error::Error::source(&e).is_some());
    assert_eq!(
        shown(e),
        "backend: NVRTC returned PTX that is not valid UTF-8"
    );
    assert_eq!(
        shown(ModelRefusal::HeadDim { dim: 7, max: 256 }),
        "backend: head_dim 7 is not supported by the CUDA kernels (even, at most 256)"
    );
    assert_eq!(
        shown(ModelRefusal::Rope { rope: "dynamic" }),
        "backend: RoPE type `dynamic` (frequencies that change with the sequence length) is \
         not implemented by the CUDA backend; run this model with --device cpu"
    );
}

#[test]
fn fp8_refusals_read_as_before() {
    let quant = || "quant_method fp8, block 128x128".to_string();
    let not_run = |module: &str, why: &str| {
        format!(
            "backend: FP8 layer {module} is not run by the CUDA backend ({why}); run with \
             --device cpu"
        )
    };
    let head = Fp8Refusal::OutputHead {
        module: "lm_head".into(),
    };
    assert_eq!(
        shown(head),
        not_run(
            "lm_head",
            "an FP8 output head: the logits products are bf16"
        )
    );
    let scheme = Fp8Refusal::Scheme {
        module: "model.layers.0.mlp.up_proj".into(),
        scheme: "e4m3 weights, per-tensor scale".into(),
    };
    assert_eq!(
        shown(scheme),
        not_run(
            "model.layers.0.mlp.up_proj",
            "e4m3 weights, per-tensor scale: the CUDA backend's FP8 GEMMs run 128x128 block \
             scales with dynamic per-token-group (128) activations, and per-channel or \
             per-tensor weight scales with dynamic per-token or static per-tensor activations"
        )
    );
    let sides = Fp8Refusal::Sides {
        module: "m".into(),
        out: 24,
        inp: 40,
    };
    assert_eq!(
        shown(sides),
        not_run(
            "m",
            "[24, 40]: FP8 GEMMs take sides that are multiples of 16"
        )
    );
    let old = Fp8Refusal::OldCublasLt {
        quant: quant(),
        version: 120_801,
    };
    assert_eq!(
        shown(old),
        "backend: FP8 weights (quant_method fp8, block 128x128): cuBLASLt 12.8.1 is loaded; \
         FP8 GEMMs with block and per-row scales need cuBLASLt 12.9 or newer (CUDA 12.9); \
         update the CUDA libraries"
    );
    let off = Fp8Refusal::OffHopper {
        quant: quant(),
        major: 10,
        minor: 0,
    };
    assert!(shown(off).ends_with(
        "scales on compute capability 9.0 (Hopper) only; this GPU has 10.0; run with --device \
         cpu"
    ));
    assert_eq!(
        shown(Fp8Refusal::NoGemv { rows: 9 }),
        "backend: fp8_gemv: no kernel for 9 rows"
    );
}

#[test]
fn memory_refusals_read_as_before() {
    const GIB: usize = 1 << 30;
    let sizes = PlanSizes {
        weights: 15 * GIB,
        activations: GIB / 2,
        tokens: 8192,
        rows: 256,
        fixed: GIB / 2,
    };
    let said = "weights 15.00 GiB + activations 0.50 GiB (steps of up to 8192 tokens, 256 rows \
                of logits) + 0.50 GiB working space";
    assert_eq!(sizes.to_string(), said);
    let over = MemoryError::ShareOverFree {
        ordinal: 0,
        free: 40 * GIB,
        total: 80 * GIB,
        budget: 72 * GIB,
        share: 0.9,
    };
    assert_eq!(
        shown(over),
        "backend: cuda:0 has 40.00 GiB free of 80.00 GiB, less than the 72.00 GiB \
         --gpu-memory-utilization 0.9 asks for (something else holds the rest); lower it to \
         at most 0.50 or free the GPU"
    );
    let not_enough = MemoryError::NotEnough {
        ordinal: 1,
        free: 20 * GIB,
        total: 24 * GIB,
        need: 30 * GIB,
        sizes,
        kv: 14 * GIB,
        blocks: 1000,
    };
    assert_eq!(
        shown(not_enough),
        format!(
            "backend: not enough GPU memory: cuda:1 has 20.00 GiB free of 24.00 GiB, but this \
             needs 30.00 GiB ({said} + KV cache 14.00 GiB for 1000 blocks); ask for fewer KV \
             blocks or use a larger GPU"
        )
    );
    let alloc = MemoryError::HostAlloc {
        blocks: 64,
        layers: 3,
        layer_bytes: GIB,
    };
    assert_eq!(
        shown(alloc),
        "backend: cannot allocate a KV cache of 64 blocks (6.00 GiB); ask for fewer"
    );
    assert_eq!(
        shown(MemoryError::NoBlocks),
        "backend: the KV cache needs at least one block"
    );
}

#[test]
fn step_layout_and_launch_refusals_read_as_before() {
    let short = BatchError::TooFewBlocks {
        seq: 1,
        blocks: 2,
        positions: 9,
        block_size: 4,
    };
    assert_eq!(
        shown(short),
        "backend: sequence 1 has 2 blocks for 9 positions (block size 4); the scheduler must \
         allocate blocks before the step"
    );
    let wide = BatchError::Over32Bits {
        what: "KV slot count",
        value: 1 << 32,
    };
    assert_eq!(
        shown(wide),
        "backend: KV slot count 4294967296 does not fit the 32-bit indices the CUDA kernels \
         use; use fewer KV blocks"
    );
    assert_eq!(
        shown(BatchError::NoBlockForPosition { seq: 2, pos: 17 }),
        "backend: no block for position 17 of sequence 2"
    );
    let words = LaunchError::MaskWords {
        kernel: "constrain_rows",
        words: 3,
        vocab: 100,
    };
    assert_eq!(
        shown(words),
        "backend: constrain_rows: 3 mask words cover 96 tokens, fewer than the vocabulary's 100"
    );
    let cols = LaunchError::GemmColumns {
        m: 2,
        n: 8,
        k: 16,
        col0: 4,
        ld: 10,
    };
    assert_eq!(
        shown(cols),
        "backend: cuBLAS GEMM (2x16 by 8x16): columns 4..12 do not fit rows of 10"
    );
    let short = LaunchError::Short {
        kernel: "rmsnorm",
        what: "x",
        len: 3,
        need: 4,
    };
    assert_eq!(
        shown(short),
        "backend: rmsnorm: `x` holds 3 elements but the launch needs 4"
    );
}

#[test]
fn kv_state_and_capability_refusals_read_as_before() {
    assert_eq!(
        shown(KvCopyError::NoBlocks { positions: 3..9 }),
        "backend: no blocks for positions 3..9"
    );
    let (pool, cache) = (
        spec(),
        KvSpec {
            head_dim: 4,
            ..spec()
        },
    );
    let shape = KvCopyError::StagingShape {
        pool: format!("{pool:?}"),
        cache: format!("{cache:?}"),
    };
    assert_eq!(
        shown(shape),
        format!(
            "backend: a staging pool of shape {:?} does not match the cache's {:?}",
            &pool,
            Some(&cache)
        )
    );
    let not_own = |slot| StateError::NotOwn {
        seq: 1,
        slot,
        slots: 4,
    };
    assert_eq!(
        shown(not_own(Some(7))),
        "backend: sequence 1 of the step holds no state slot of its own (Some(7) of 4)"
    );
    assert_eq!(
        shown(not_own(None)),
        "backend: sequence 1 of the step holds no state slot of its own (None of 4)"
    );
    let cannot = |what| BackendError::Cannot {
        backend: "cpu".into(),
        what,
    };
    assert_eq!(
        shown(cannot(Capability::WriteState {
            slot: 2,
            values: 10
        })),
        "backend: the cpu backend has no recurrent state to write (10 values for slot 2)"
    );
    assert_eq!(
        shown(cannot(Capability::KvFromHost)),
        "backend: the cpu backend cannot copy KV from host memory"
    );
}

#[test]
fn sm_split_sim_and_invariant_texts_read_as_before() {
    assert_eq!(
        shown(GreenContextError::OldDriver { driver: 12_030 }),
        "backend: --sm-split needs green contexts, which came with CUDA 12.4; this driver \
         supports CUDA 12.3: update the NVIDIA driver, or leave --sm-split out"
    );
    let split: SmSplit = "decode:32".parse().unwrap();
    let mismatch = GreenContextError::Mismatch {
        split,
        want: 32,
        groups: 1,
        got: 40,
        left: 92,
    };
    assert_eq!(
        shown(mismatch),
        format!(
            "backend: --sm-split {split}: asked the driver for a group of 32 SMs and got 1 \
             group(s) of 40 SMs (92 left); refusing a split other than the one asked for"
        )
    );
    assert_eq!(
        shown(SimError::OutsideVocab {
            token: 120,
            vocab: 120
        }),
        "backend: the sim backend was given token id 120 to emit, outside the vocabulary of 120"
    );
    assert_eq!(
        shown(BackendError::Invariant("workspace missing")),
        "backend: workspace missing"
    );
}

#[test]
fn the_sim_backend_refuses_its_outputs_by_rule() {
    let new = |outputs| SimBackend::new(SimTiming::zero(), spec(), 8, 120, outputs);
    assert!(matches!(
        new(vec![]),
        Err(EngineError::Backend(BackendError::Sim(SimError::NoOutputs)))
    ));
    assert!(matches!(
        new(vec![5, 120]),
        Err(EngineError::Backend(BackendError::Sim(
            SimError::OutsideVocab {
                token: 120,
                vocab: 120
            }
        )))
    ));
}

#[test]
fn a_backend_without_recurrent_state_or_host_copies_says_which() {
    let mut b = SimBackend::new(SimTiming::zero(), spec(), 8, 120, vec![1]).unwrap();
    let e = b.read_state(3).unwrap_err();
    assert!(matches!(
        &e,
        EngineError::Backend(BackendError::Cannot {
            what: Capability::ReadState { slot: 3 },
            ..
        })
    ));
    assert_eq!(
        e.to_string(),
        format!(
            "backend: the {} backend has no recurrent state to read (slot 3)",
            b.device()
        )
    );
    let e = b.copy_state(1, 2).unwrap_err();
    assert!(matches!(
        e,
        EngineError::Backend(BackendError::Cannot {
            what: Capability::CopyState { from: 1, to: 2 },
            ..
        })
    ));
}

#[test]
fn host_kv_pools_refuse_by_rule() {
    assert!(matches!(
        HostKvPool::new(spec(), usize::MAX),
        Err(EngineError::Backend(BackendError::Memory(
            MemoryError::HostTooLarge { blocks: usize::MAX }
        )))
    ));
    let pool = HostKvPool::new(spec(), 4).unwrap();
    let e = pool.check_table(&[BlockId(1), BlockId(4)]).unwrap_err();
    assert!(matches!(
        e,
        EngineError::Backend(BackendError::Kv(KvCopyError::BlockOutsidePool {
            block: 4,
            num_blocks: 4
        }))
    ));
    assert_eq!(
        e.to_string(),
        "backend: block 4 is outside the pool of 4 blocks"
    );
}

/// A build without CUDA refuses `--device cuda:N` as `NoCuda`.
#[cfg(not(feature = "cuda"))]
#[test]
fn a_build_without_cuda_refuses_a_cuda_device_by_rule() {
    assert!(matches!(
        crate::model::resolve_device("cuda:0"),
        Err(EngineError::Backend(BackendError::NoCuda))
    ));
}

/// The CUDA backend's pure checks: a step's layout, a launch's grid, the memory plan.
#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use crate::backend::cuda::{batch, shapes, MemoryPlan};
    use crate::backend::{CudaOptions, ForwardBatch, KvBudget, SeqInput};

    fn seq<'a>(tokens: &'a [u32], table: &'a [BlockId], want_logits: bool) -> SeqInput<'a> {
        SeqInput {
            tokens,
            start_pos: 0,
            context_len: 0,
            block_table: table,
            want_logits,
            state_slot: None,
        }
    }

    fn batch_error(b: &ForwardBatch, block_size: usize) -> BatchError {
        match batch::build(b, block_size, 8, 10) {
            Err(EngineError::Backend(BackendError::Batch(e))) => e,
            other => panic!("not a batch refusal: {:?}", other.map(|_| ())),
        }
    }

    #[test]
    fn a_step_laid_out_wrongly_is_refused_by_rule() {
        let (table, outside) = ([BlockId(1)], [BlockId(9)]);
        let one = |s| ForwardBatch { seqs: vec![s] };
        assert!(matches!(
            batch_error(&one(seq(&[1], &table, true)), 0),
            BatchError::ZeroBlockSize
        ));
        assert!(matches!(
            batch_error(&one(seq(&[1], &outside, true)), 4),
            BatchError::BlockOutsidePool {
                seq: 0,
                block: 9,
                num_blocks: 8
            }
        ));
        assert!(matches!(
            batch_error(&one(seq(&[1, 2, 3, 4, 5], &table, true)), 4),
            BatchError::TooFewBlocks {
                blocks: 1,
                positions: 5,
                ..
            }
        ));
        assert!(matches!(
            batch_error(&one(seq(&[], &table, true)), 4),
            BatchError::LogitsWithoutTokens { seq: 0 }
        ));
    }

    #[test]
    fn a_grid_past_the_hardware_is_refused_with_its_kernel() {
        let e = shapes::grid(&shapes::RMSNORM, 1, 70_000, 1).unwrap_err();
        assert!(matches!(
            &e,
            EngineError::Backend(BackendError::Launch(LaunchError::Grid { y: 70_000, .. }))
        ));
        assert!(
            e.to_string().ends_with(
                "a grid of (1, 70000, 1) blocks is outside CUDA's limits (x 1..=2147483647, y \
                 and z 1..=65535); lower --max-num-batched-tokens"
            ),
            "{e}"
        );
    }

    #[test]
    fn a_memory_plan_that_does_not_fit_is_refused_by_rule() {
        const GB: usize = 1 << 30;
        let cfg = crate::init::preset(None, "qwen3-8b").unwrap();
        let opts = CudaOptions {
            reserve_tokens: 2048,
            reserve_rows: 64,
            ..CudaOptions::device(0)
        };
        let p = MemoryPlan::of(&cfg, &opts, 16);
        let refusal = |kv, free, total| match p.blocks(kv, 0, free, total) {
            Err(EngineError::Backend(BackendError::Memory(e))) => e,
            other => panic!("not a memory refusal: {other:?}"),
        };
        assert!(matches!(
            refusal(KvBudget::Share(0.9), 40 * GB, 80 * GB),
            MemoryError::ShareOverFree { free, .. } if free == 40 * GB
        ));
        assert!(matches!(
            refusal(KvBudget::Share(0.9), 16 * GB, 16 * GB),
            MemoryError::ModelOverShare { .. }
        ));
        assert!(matches!(
            refusal(KvBudget::Blocks(100_000), 40 * GB, 80 * GB),
            MemoryError::NotEnough {
                blocks: 100_000,
                ..
            }
        ));
        assert!(matches!(
            refusal(KvBudget::Blocks(0), 80 * GB, 80 * GB),
            MemoryError::NoBlocks
        ));
    }
}
