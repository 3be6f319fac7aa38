//! How the host launches each kernel (`kernels/*.cu`), and what the devices it claims allow.
//!
//! One place holds every figure the host and the kernels must agree on: threads per block,
//! queries per prefill block, the largest head. The host launches with them, and NVRTC
//! compiles the kernels (`kernels/*.cu`) with them (`defines`, passed as `-D` options), where each kernel
//! declares its block size in `__launch_bounds__`, so ptxas never gives a kernel more
//! registers than a block of that size can have. The kernels refuse to compile without
//! them.
//!
//! `gpu/tests/cuda_offline` compiles the kernels for every architecture in `ARCHS`,
//! assembles them with ptxas and checks each kernel's registers, shared memory and spills
//! against `ArchLimits::fit`: a GPU is not needed for any of it.

use cudarc::driver::LaunchConfig;

use crate::backend::error::LaunchError;
use crate::error::Result;

/// One kernel as the host launches it.
#[derive(Clone, Copy, Debug)]
pub struct KernelShape {
    /// The `extern "C"` name in `kernels/*.cu`.
    pub name: &'static str,
    /// Threads per block: every launch uses exactly this, and the kernel's
    /// `__launch_bounds__` says the same.
    pub threads: u32,
    /// Static shared memory per block, bytes, as the kernel's `__shared__` arrays come to
    /// from the figures here (ptxas's report must say the same).
    pub static_smem: u32,
    /// Dynamic shared memory per block (all kernels size theirs statically today).
    pub dynamic_smem: u32,
    /// On every token's path in every layer (attention, the norms, sampling): a register
    /// spill there costs every step, so the offline check refuses one.
    pub hot: bool,
}

const fn shape(name: &'static str, threads: u32, static_smem: usize, hot: bool) -> KernelShape {
    KernelShape {
        name,
        threads,
        static_smem: static_smem as u32,
        dynamic_smem: 0,
        hot,
    }
}

const F32: usize = 4;
const BF16: usize = 2;
/// `block_sum`'s scratch: one f32 per warp of the largest block.
const BLOCK_SUM: usize = 32 * F32;
/// Keys per shared-memory tile of `paged_attention_prefill` (its `PF_K`, one per lane).
const PREFILL_KEYS_PER_TILE: usize = 32;

/// The attention kernels keep one head in fixed-size shared arrays.
pub const MAX_HEAD_DIM: usize = 256;

/// Queries per block of `paged_attention_prefill` (its `PF_Q`), one warp each: every
/// key/value tile staged in shared memory serves this many queries, so the cache traffic of
/// a prompt of L tokens is about L^2 / PREFILL_QUERIES_PER_BLOCK rows per head.
pub const PREFILL_QUERIES_PER_BLOCK: usize = 8;

pub const EMBED: KernelShape = shape("embed_gather", 256, 0, false);
pub const RMSNORM: KernelShape = shape("rmsnorm_to_bf16", 256, BLOCK_SUM, true);
/// float4s of its row each `add_rmsnorm_to_bf16` thread keeps in registers between its two
/// passes: rows up to 4 x 8 x 256 = 8,192 wide (wider ones loop over global memory).
const NORM_CACHED: usize = 8;
pub const ADD_RMSNORM: KernelShape = shape("add_rmsnorm_to_bf16", 256, BLOCK_SUM, true);
pub const BIAS_ADD: KernelShape = shape("bias_add", 256, 0, false);
/// A warp a head (`threads / 32` heads a block).
pub const ROPE_KV_WRITE: KernelShape = shape("rope_kv_write", 128, 0, true);
/// Four warps, whose partial softmaxes the kernel merges: the scaled query, and each warp's
/// running max, sum and weighted V row.
pub const ATTENTION_DECODE: KernelShape = shape(
    "paged_attention_decode",
    128,
    MAX_HEAD_DIM * F32 + 2 * 4 * F32 + 4 * MAX_HEAD_DIM * F32,
    true,
);
/// A warp per query: the block's queries, and a tile of keys and one of values as bf16 in
/// rows padded by two elements (an odd number of 32-bit words, against bank conflicts).
pub const ATTENTION_PREFILL: KernelShape = shape(
    "paged_attention_prefill",
    32 * PREFILL_QUERIES_PER_BLOCK as u32,
    PREFILL_QUERIES_PER_BLOCK * MAX_HEAD_DIM * F32
        + 2 * PREFILL_KEYS_PER_TILE * (MAX_HEAD_DIM + 2) * BF16,
    true,
);
const fn decode_vec(name: &'static str, d: usize) -> KernelShape {
    // Per lane group (D / 8 lanes, 4 * 32 / (D / 8) groups): its running max and sum and
    // its weighted V row; for a split decode's merge, each split's weight, their total and
    // whether this block merges.
    shape(
        name,
        128,
        (4 * 32 / (d / 8)) * (d + 2) * F32 + MAX_DECODE_SPLITS * F32 + F32 + 4,
        true,
    )
}
/// Decode attention reading 16 bytes a lane, one kernel per head dimension it is built for.
/// 256 is Qwen3.5's full-attention head: with the general kernel (one block a head, never
/// split) its served batch-1 token took 9.32 ms on an H200 at 1,024-token histories against
/// 5.62 ms for `gpu-bench`'s 128-token ones.
pub const ATTENTION_DECODE_VEC: [(usize, KernelShape); 5] = [
    (16, decode_vec("paged_attention_decode_d16", 16)),
    (32, decode_vec("paged_attention_decode_d32", 32)),
    (64, decode_vec("paged_attention_decode_d64", 64)),
    (128, decode_vec("paged_attention_decode_d128", 128)),
    (256, decode_vec("paged_attention_decode_d256", 256)),
];
/// (sequence, split) pairs a split decode may use, which sizes its partials buffer: a batch
/// of `seqs` sequences gets `decode_splits(seqs)` splits per head.
pub const DECODE_SPLIT_SLOTS: usize = 128;
/// Most splits of one sequence's history: at most 32, since one warp merges them.
pub const MAX_DECODE_SPLITS: usize = 32;
const _: () = assert!(MAX_DECODE_SPLITS <= 32);
/// Positions whose loads each lane group of a decode block has in flight at once.
const DECODE_UNROLL: usize = 4;
/// Fewest positions a split takes: a short history uses fewer splits than the grid has
/// (the rest exit at once).
const DECODE_MIN_SPLIT_KEYS: usize = 64;

/// Splits per head for a decode step of `seqs` sequences: enough blocks for the GPU at small
/// batches, none at large ones. A function of the batch alone, so a CUDA graph captured for
/// a batch size stays valid as the histories grow.
pub const fn decode_splits(seqs: usize) -> usize {
    let s = DECODE_SPLIT_SLOTS / if seqs == 0 { 1 } else { seqs };
    if s > MAX_DECODE_SPLITS {
        MAX_DECODE_SPLITS
    } else if s < 1 {
        1
    } else {
        s
    }
}

/// Query rows per block of `paged_attention_prefill_mma_d*` (its `PFM_ROWS`): four warps of
/// sixteen, the rows of one tensor-core product each.
pub const PREFILL_MMA_ROWS: usize = 64;
const fn prefill_mma(name: &'static str, d: usize, keys: usize) -> KernelShape {
    // Two stages (one used while the next loads) of a key tile and a value tile of `keys`
    // keys (its `KEYS`), both row-major bf16 with rows padded by 8.
    shape(name, 128, 2 * 2 * keys * (d + 8) * BF16, true)
}
/// The tensor-core prefill, one kernel per head dimension it is built for; tiles of 32
/// keys, 16 for head size 256 (two stages of 32 would pass the 48 KB of static shared memory).
pub const ATTENTION_PREFILL_MMA: [(usize, KernelShape); 5] = [
    (16, prefill_mma("paged_attention_prefill_mma_d16", 16, 32)),
    (32, prefill_mma("paged_attention_prefill_mma_d32", 32, 32)),
    (64, prefill_mma("paged_attention_prefill_mma_d64", 64, 32)),
    (
        128,
        prefill_mma("paged_attention_prefill_mma_d128", 128, 32),
    ),
    (
        256,
        prefill_mma("paged_attention_prefill_mma_d256", 256, 16),
    ),
];
pub const SILU_MUL: KernelShape = shape("silu_mul", 256, 0, true);
/// `silu_mul` from bf16 products, 8 columns a thread.
pub const SILU_MUL_BF16: KernelShape = shape("silu_mul_bf16", SILU_MUL.threads, 0, true);
pub const GATHER_ROWS: KernelShape = shape("gather_rows_bf16", 256, 0, false);
/// Per thread a best value, its index and a chunk start (one more for the total), the
/// gathered keys and their count, the chosen token, the merged log-sum-exp, and
/// `block_sum`'s scratch.
pub const SAMPLE_ROWS: KernelShape = shape(
    "sample_rows",
    SAMPLE_THREADS,
    SAMPLE_THREADS as usize * (F32 + 4)
        + (SAMPLE_THREADS as usize + 1) * F32
        + SAMPLE_GATHER * 4
        + 4
        + 4
        + F32
        + BLOCK_SUM,
    true,
);
const SAMPLE_THREADS: u32 = 512;
/// Logits `sample_rows` gathers into shared memory to decide top-k and top-p there: enough
/// for top-k up to a few hundred, and for the top-p sets of a trained model's usual
/// distributions; a row whose kept set does not fit is decided over the whole row.
const SAMPLE_GATHER: usize = 2048;
pub const CONSTRAIN_ROWS: KernelShape = shape("constrain_rows", 256, 0, false);
/// Gated DeltaNet's causal convolution: a thread a channel.
pub const DELTA_CONV: KernelShape = shape("delta_conv_silu", 128, 0, true);
/// The longest convolution `delta_conv_silu` keeps in registers (Qwen3.5's is 4).
pub const MAX_CONV_KERNEL: usize = 8;
/// The largest key and value head `gated_delta_rule` takes (Qwen3.5's are 128): two threads
/// a value column, each with half its state column in registers, the block's q and k in
/// shared memory.
pub const MAX_DELTA_HEAD: usize = 128;
pub const GATED_DELTA: KernelShape = shape(
    "gated_delta_rule",
    2 * MAX_DELTA_HEAD as u32,
    2 * MAX_DELTA_HEAD * F32 + BLOCK_SUM,
    true,
);

/// The scan path of steps with prompts (`CudaOptions::gdn_scan`, `kernels/delta.cu`): the
/// convolution a thread per channel and `DCONV_TOKENS` tokens, the window after it, q/k
/// normalisation and the gates a block per token, the recurrence with each value column
/// over 4 threads (`SCAN_COLS` columns a block, `SCAN_TOK` tokens staged at a time), and the
/// gated norm a block per token.
pub const DELTA_CONV_CHUNKS: KernelShape = shape("delta_conv_chunks", 128, 0, false);
pub const DELTA_CONV_WINDOW: KernelShape = shape("delta_conv_window", 128, 0, false);
pub const DCONV_TOKENS: usize = 64;
pub const DELTA_QK_GATES: KernelShape = shape("delta_qk_gates", 128, 0, false);
pub const SCAN_COLS: usize = 32;
pub const SCAN_TOK: usize = 32;
pub const DELTA_SCAN: KernelShape = shape(
    "delta_scan",
    4 * SCAN_COLS as u32,
    (2 * SCAN_TOK * MAX_DELTA_HEAD + SCAN_TOK * SCAN_COLS + 2 * SCAN_TOK) * F32,
    false,
);
pub const DELTA_GATED_NORM: KernelShape = shape("delta_gated_norm", 128, 0, false);
/// The chunked form (`CudaOptions::gdn_chunked`): chunks of `CHUNK_LEN` tokens (a warp's
/// width), q and k of a chunk staged in rows padded by one value (against bank conflicts),
/// the chunk's `(I + A)^-1` and `P` (`CHUNK_LEN` square, padded likewise), its gates; the scan
/// also the right-hand side for `SCAN_COLS` columns. 8 threads a state column.
pub const CHUNK_LEN: usize = 32;
const CHUNK_QK: usize = 2 * CHUNK_LEN * (MAX_DELTA_HEAD + 1) * F32;
const CHUNK_SQUARE: usize = CHUNK_LEN * (CHUNK_LEN + 1) * F32;
pub const DELTA_CHUNK_PREP: KernelShape = shape(
    "delta_chunk_prep",
    8 * SCAN_COLS as u32,
    CHUNK_QK + CHUNK_SQUARE + 2 * CHUNK_LEN * F32,
    false,
);
pub const DELTA_CHUNK_SCAN: KernelShape = shape(
    "delta_chunk_scan",
    8 * SCAN_COLS as u32,
    CHUNK_QK + 2 * CHUNK_SQUARE + CHUNK_LEN * (SCAN_COLS + 1) * F32 + 2 * CHUNK_LEN * F32,
    false,
);

/// Warps per block of the skinny products, rows of the weights each warp streams, and 16-byte
/// loads each lane has in flight per row: 8 x 2 x 4 x 512 bytes = 32 KiB in flight a block.
const SKINNY_THREADS: u32 = 256;
pub const SKINNY_ROWS: usize = 2;
const SKINNY_UNROLL: usize = 4;
const fn skinny(name: &'static str) -> KernelShape {
    shape(name, SKINNY_THREADS, 0, true)
}
/// `skinny_gemm_m*`: products of at most this many rows (a decode step's) that stream the
/// weights once, by the most rows each takes; more rows go to cuBLAS.
pub const SKINNY_GEMM: [(usize, KernelShape); 4] = [
    (1, skinny("skinny_gemm_m1")),
    (2, skinny("skinny_gemm_m2")),
    (4, skinny("skinny_gemm_m4")),
    (8, skinny("skinny_gemm_m8")),
];
/// `skinny_silu_m*`: the MLP's gate/up product with the SiLU-gated product as its epilogue.
pub const SKINNY_SILU: [(usize, KernelShape); 4] = [
    (1, skinny("skinny_silu_m1")),
    (2, skinny("skinny_silu_m2")),
    (4, skinny("skinny_silu_m4")),
    (8, skinny("skinny_silu_m8")),
];
/// `skinny_rope_m*`: a layer's q/k/v product with the rotary embedding and the new K/V
/// written to the cache as its epilogue (`rope_kv_write`'s work; `CudaOptions::fuse_rope`).
pub const SKINNY_ROPE: [(usize, KernelShape); 4] = [
    (1, skinny("skinny_rope_m1")),
    (2, skinny("skinny_rope_m2")),
    (4, skinny("skinny_rope_m4")),
    (8, skinny("skinny_rope_m8")),
];
/// Widest row `add_rmsnorm_to_bf16` holds in registers (its `NORM_MAX`), and so the widest
/// a skinny product's norm prologue takes.
pub const NORM_MAX: usize = NORM_CACHED * 4 * ADD_RMSNORM.threads as usize;
const fn skinny_norm(name: &'static str, rows: usize) -> KernelShape {
    // The normed rows as bf16, and `block_sum`'s scratch.
    shape(
        name,
        SKINNY_THREADS,
        rows * NORM_MAX * BF16 + BLOCK_SUM,
        true,
    )
}
/// `skinny_norm_m*` and `skinny_norm_silu_m*`: the products above with the residual add and
/// RMSNorm before them as a prologue, by the most rows each takes.
pub const SKINNY_NORM: [(usize, KernelShape); 2] = [
    (1, skinny_norm("skinny_norm_m1", 1)),
    (2, skinny_norm("skinny_norm_m2", 2)),
];
pub const SKINNY_NORM_SILU: [(usize, KernelShape); 2] = [
    (1, skinny_norm("skinny_norm_silu_m1", 1)),
    (2, skinny_norm("skinny_norm_silu_m2", 2)),
];
pub const SKINNY_NORM_ROPE: [(usize, KernelShape); 2] = [
    (1, skinny_norm("skinny_norm_rope_m1", 1)),
    (2, skinny_norm("skinny_norm_rope_m2", 2)),
];
const _: () = assert!(SKINNY_THREADS == ADD_RMSNORM.threads);
/// Weight rows one block of a skinny product covers.
pub const SKINNY_ROWS_PER_BLOCK: usize = SKINNY_THREADS as usize / 32 * SKINNY_ROWS;

/// The FP8 products of a few rows (`kernels/fp8.cu`, `fp8_gemv_*`): warps per block, weight
/// rows each warp streams and 16-byte loads each lane has in flight per row, as the skinny
/// kernels have them (one load is 16 weights here, 8 there).
const FP8_THREADS: u32 = 256;
pub const FP8_ROWS: usize = 2;
const FP8_UNROLL: usize = 4;
const fn fp8_gemv(name: &'static str) -> KernelShape {
    shape(name, FP8_THREADS, 0, true)
}
/// `fp8_gemv_block_m*` (128 x 128 block scales) and `fp8_gemv_channel_m*` (a scale per
/// row), by the most rows each takes.
pub const FP8_GEMV_BLOCK: [(usize, KernelShape); 3] = [
    (1, fp8_gemv("fp8_gemv_block_m1")),
    (2, fp8_gemv("fp8_gemv_block_m2")),
    (4, fp8_gemv("fp8_gemv_block_m4")),
];
pub const FP8_GEMV_CHANNEL: [(usize, KernelShape); 3] = [
    (1, fp8_gemv("fp8_gemv_channel_m1")),
    (2, fp8_gemv("fp8_gemv_channel_m2")),
    (4, fp8_gemv("fp8_gemv_channel_m4")),
];
/// Weight rows one block of `fp8_gemv_*` covers.
pub const FP8_ROWS_PER_BLOCK: usize = FP8_THREADS as usize / 32 * FP8_ROWS;
/// The FP8 products of up to 16 rows on the tensor cores (`fp8_mma_*`,
/// `CudaOptions::fp8_mma`): warps per block (over 16 weight rows, splitting k), and k
/// blocks of 128 each warp has in flight (4 16-byte loads a lane each).
const FP8_MMA_WARPS: usize = 8;
const FP8_MMA_UNROLL: usize = 2;
const fn fp8_mma(name: &'static str, tiles: usize) -> KernelShape {
    // The warps' sums: [warps][tiles][4][32] f32.
    shape(
        name,
        32 * FP8_MMA_WARPS as u32,
        FP8_MMA_WARPS * tiles * 4 * 32 * F32,
        true,
    )
}
/// `fp8_mma_block_n*` and `fp8_mma_channel_n*` (block-scaled, then a scale per row), by the
/// most rows each takes: one 8-column mma tile, or two.
pub const FP8_MMA: Fp8Family = [
    [
        (8, fp8_mma("fp8_mma_block_n1", 1)),
        (16, fp8_mma("fp8_mma_block_n2", 2)),
    ],
    [
        (8, fp8_mma("fp8_mma_channel_n1", 1)),
        (16, fp8_mma("fp8_mma_channel_n2", 2)),
    ],
];
/// Weight rows one block of `fp8_mma_*` covers.
pub const FP8_MMA_ROWS_PER_BLOCK: usize = 16;
const fn fp8_fused(name: &'static str, rows: usize, normed: bool) -> KernelShape {
    // A norm prologue's rows as bf16, and `block_sum`'s scratch.
    let smem = if normed {
        rows * NORM_MAX * BF16 + BLOCK_SUM
    } else {
        0
    };
    shape(name, FP8_THREADS, smem, true)
}
/// A fused FP8 family: block-scaled, then a scale per row, each by the most rows it takes.
type Fp8Family = [[(usize, KernelShape); 2]; 2];
/// `fp8_gemv_*` with the skinny kernels' epilogues (`fp8_silu_*`: the SiLU-gated gate/up
/// product; `fp8_rope_*`: the rotary embedding and K/V write) and norm prologue
/// (`fp8_norm*`), for decode steps of one or two rows.
pub const FP8_SILU: Fp8Family = [
    [
        (1, fp8_fused("fp8_silu_block_m1", 1, false)),
        (2, fp8_fused("fp8_silu_block_m2", 2, false)),
    ],
    [
        (1, fp8_fused("fp8_silu_channel_m1", 1, false)),
        (2, fp8_fused("fp8_silu_channel_m2", 2, false)),
    ],
];
pub const FP8_ROPE: Fp8Family = [
    [
        (1, fp8_fused("fp8_rope_block_m1", 1, false)),
        (2, fp8_fused("fp8_rope_block_m2", 2, false)),
    ],
    [
        (1, fp8_fused("fp8_rope_channel_m1", 1, false)),
        (2, fp8_fused("fp8_rope_channel_m2", 2, false)),
    ],
];
pub const FP8_NORM: Fp8Family = [
    [
        (1, fp8_fused("fp8_norm_block_m1", 1, true)),
        (2, fp8_fused("fp8_norm_block_m2", 2, true)),
    ],
    [
        (1, fp8_fused("fp8_norm_channel_m1", 1, true)),
        (2, fp8_fused("fp8_norm_channel_m2", 2, true)),
    ],
];
pub const FP8_NORM_SILU: Fp8Family = [
    [
        (1, fp8_fused("fp8_norm_silu_block_m1", 1, true)),
        (2, fp8_fused("fp8_norm_silu_block_m2", 2, true)),
    ],
    [
        (1, fp8_fused("fp8_norm_silu_channel_m1", 1, true)),
        (2, fp8_fused("fp8_norm_silu_channel_m2", 2, true)),
    ],
];
pub const FP8_NORM_ROPE: Fp8Family = [
    [
        (1, fp8_fused("fp8_norm_rope_block_m1", 1, true)),
        (2, fp8_fused("fp8_norm_rope_block_m2", 2, true)),
    ],
    [
        (1, fp8_fused("fp8_norm_rope_channel_m1", 1, true)),
        (2, fp8_fused("fp8_norm_rope_channel_m2", 2, true)),
    ],
];
// The fused FP8 launches share the skinny kernels' output arguments and grids.
const _: () = assert!(FP8_ROWS == SKINNY_ROWS && FP8_ROWS_PER_BLOCK == SKINNY_ROWS_PER_BLOCK);
const _: () = assert!(FP8_THREADS == ADD_RMSNORM.threads);
/// The activations' quantizer before an FP8 GEMM: a block a row, a warp per 128-column
/// group; `block_max`'s scratch.
pub const FP8_QUANT: KernelShape = shape("fp8_quant_rows", 256, 32 * F32, true);
/// cuBLASLt's bf16 output widened into the f32 product, with the bias.
pub const FP8_OUT: KernelShape = shape("fp8_out_cols", 256, 0, true);

/// Most blocks `sample_rows` spreads a row's first pass over (one warp merges them), and
/// the fewest logits each takes.
pub const SAMPLE_MAX_CHUNKS: usize = 32;
const SAMPLE_CHUNK_MIN: usize = 4096;
const _: () = assert!(SAMPLE_MAX_CHUNKS <= 32);

/// Blocks per row of `sample_rows` for a vocabulary of `vocab`.
pub const fn sample_chunks(vocab: usize) -> usize {
    let c = vocab.div_ceil(SAMPLE_CHUNK_MIN);
    if c > SAMPLE_MAX_CHUNKS {
        SAMPLE_MAX_CHUNKS
    } else if c < 1 {
        1
    } else {
        c
    }
}

/// Qwen3.5's gated attention: the per-head norm, partial RoPE and KV write (as
/// `rope_kv_write`, every warp summing the head), and the output gate.
pub const GATED_ROPE_KV_WRITE: KernelShape = shape("gated_rope_kv_write", 64, 0, true);
pub const GATE_SIGMOID_MUL: KernelShape = shape("gate_sigmoid_mul", 256, 0, false);

/// The in-process KV handover's copy (`kernels/kv_copy.cu`): one block per run of positions.
pub const KV_COPY: KernelShape = shape("kv_copy_runs", 256, 0, false);

/// Every kernel of `kernels/*.cu`. A kernel missing here is one the offline check refuses.
pub const KERNELS: &[KernelShape] = &[
    EMBED,
    RMSNORM,
    ADD_RMSNORM,
    BIAS_ADD,
    ROPE_KV_WRITE,
    ATTENTION_DECODE,
    ATTENTION_DECODE_VEC[0].1,
    ATTENTION_DECODE_VEC[1].1,
    ATTENTION_DECODE_VEC[2].1,
    ATTENTION_DECODE_VEC[3].1,
    ATTENTION_DECODE_VEC[4].1,
    ATTENTION_PREFILL,
    ATTENTION_PREFILL_MMA[0].1,
    ATTENTION_PREFILL_MMA[1].1,
    ATTENTION_PREFILL_MMA[2].1,
    ATTENTION_PREFILL_MMA[3].1,
    ATTENTION_PREFILL_MMA[4].1,
    SILU_MUL,
    SILU_MUL_BF16,
    GATHER_ROWS,
    SAMPLE_ROWS,
    CONSTRAIN_ROWS,
    DELTA_CONV,
    GATED_DELTA,
    DELTA_CONV_CHUNKS,
    DELTA_CONV_WINDOW,
    DELTA_QK_GATES,
    DELTA_SCAN,
    DELTA_GATED_NORM,
    DELTA_CHUNK_PREP,
    DELTA_CHUNK_SCAN,
    SKINNY_GEMM[0].1,
    SKINNY_GEMM[1].1,
    SKINNY_GEMM[2].1,
    SKINNY_GEMM[3].1,
    SKINNY_SILU[0].1,
    SKINNY_SILU[1].1,
    SKINNY_SILU[2].1,
    SKINNY_SILU[3].1,
    SKINNY_NORM[0].1,
    SKINNY_NORM[1].1,
    SKINNY_NORM_SILU[0].1,
    SKINNY_NORM_SILU[1].1,
    SKINNY_ROPE[0].1,
    SKINNY_ROPE[1].1,
    SKINNY_ROPE[2].1,
    SKINNY_ROPE[3].1,
    SKINNY_NORM_ROPE[0].1,
    SKINNY_NORM_ROPE[1].1,
    GATED_ROPE_KV_WRITE,
    GATE_SIGMOID_MUL,
    FP8_GEMV_BLOCK[0].1,
    FP8_GEMV_BLOCK[1].1,
    FP8_GEMV_BLOCK[2].1,
    FP8_GEMV_CHANNEL[0].1,
    FP8_GEMV_CHANNEL[1].1,
    FP8_GEMV_CHANNEL[2].1,
    FP8_QUANT,
    FP8_OUT,
    FP8_MMA[0][0].1,
    FP8_MMA[0][1].1,
    FP8_MMA[1][0].1,
    FP8_MMA[1][1].1,
    FP8_SILU[0][0].1,
    FP8_SILU[0][1].1,
    FP8_SILU[1][0].1,
    FP8_SILU[1][1].1,
    FP8_ROPE[0][0].1,
    FP8_ROPE[0][1].1,
    FP8_ROPE[1][0].1,
    FP8_ROPE[1][1].1,
    FP8_NORM[0][0].1,
    FP8_NORM[0][1].1,
    FP8_NORM[1][0].1,
    FP8_NORM[1][1].1,
    FP8_NORM_SILU[0][0].1,
    FP8_NORM_SILU[0][1].1,
    FP8_NORM_SILU[1][0].1,
    FP8_NORM_SILU[1][1].1,
    FP8_NORM_ROPE[0][0].1,
    FP8_NORM_ROPE[0][1].1,
    FP8_NORM_ROPE[1][0].1,
    FP8_NORM_ROPE[1][1].1,
    KV_COPY,
];

/// The macros the kernels (`kernels/*.cu`) are compiled with: the figures above, under the names the kernels
/// use. Each `*_THREADS` goes into that kernel's `__launch_bounds__`.
pub fn defines() -> Vec<(&'static str, usize)> {
    vec![
        ("MAX_HEAD_DIM", MAX_HEAD_DIM),
        ("PF_Q", PREFILL_QUERIES_PER_BLOCK),
        ("PF_K", PREFILL_KEYS_PER_TILE),
        ("EMBED_THREADS", EMBED.threads as usize),
        ("RMSNORM_THREADS", RMSNORM.threads as usize),
        ("ADD_RMSNORM_THREADS", ADD_RMSNORM.threads as usize),
        ("NORM_CACHED", NORM_CACHED),
        ("BIAS_ADD_THREADS", BIAS_ADD.threads as usize),
        ("ROPE_THREADS", ROPE_KV_WRITE.threads as usize),
        ("GATED_ROPE_THREADS", GATED_ROPE_KV_WRITE.threads as usize),
        ("GATE_THREADS", GATE_SIGMOID_MUL.threads as usize),
        ("KV_COPY_THREADS", KV_COPY.threads as usize),
        ("DECODE_THREADS", ATTENTION_DECODE.threads as usize),
        ("SILU_MUL_THREADS", SILU_MUL.threads as usize),
        ("GATHER_THREADS", GATHER_ROWS.threads as usize),
        ("SAMPLE_THREADS", SAMPLE_ROWS.threads as usize),
        ("SAMPLE_GATHER", SAMPLE_GATHER),
        ("CONSTRAIN_THREADS", CONSTRAIN_ROWS.threads as usize),
        ("PFM_THREADS", ATTENTION_PREFILL_MMA[0].1.threads as usize),
        ("CONV_THREADS", DELTA_CONV.threads as usize),
        ("MAX_CONV_KERNEL", MAX_CONV_KERNEL),
        ("DELTA_THREADS", GATED_DELTA.threads as usize),
        ("MAX_DELTA_DK", MAX_DELTA_HEAD),
        ("DCONV_THREADS", DELTA_CONV_CHUNKS.threads as usize),
        ("DCONV_TOKENS", DCONV_TOKENS),
        ("QK_THREADS", DELTA_QK_GATES.threads as usize),
        ("SCAN_COLS", SCAN_COLS),
        ("SCAN_TOK", SCAN_TOK),
        ("SCAN_THREADS", DELTA_SCAN.threads as usize),
        ("GNORM_THREADS", DELTA_GATED_NORM.threads as usize),
        ("CH_L", CHUNK_LEN),
        ("CHUNK_THREADS", DELTA_CHUNK_SCAN.threads as usize),
        ("DECODE_MIN_SPLIT_KEYS", DECODE_MIN_SPLIT_KEYS),
        ("DECODE_MAX_SPLITS", MAX_DECODE_SPLITS),
        ("DECODE_UNROLL", DECODE_UNROLL),
        ("SKINNY_THREADS", SKINNY_THREADS as usize),
        ("SKINNY_ROWS", SKINNY_ROWS),
        ("SKINNY_UNROLL", SKINNY_UNROLL),
        ("FP8_THREADS", FP8_THREADS as usize),
        ("FP8_ROWS", FP8_ROWS),
        ("FP8_UNROLL", FP8_UNROLL),
        ("FP8_QUANT_THREADS", FP8_QUANT.threads as usize),
        ("FP8_OUT_THREADS", FP8_OUT.threads as usize),
        ("FP8_MMA_THREADS", FP8_MMA[0][0].1.threads as usize),
        ("FP8_MMA_WARPS", FP8_MMA_WARPS),
        ("FP8_MMA_UNROLL", FP8_MMA_UNROLL),
    ]
}

/// Grid limits every architecture since 3.0 shares.
const MAX_GRID_X: usize = (1 << 31) - 1;
const MAX_GRID_YZ: usize = 65_535;

/// The launch of `k` over an `x * y * z` grid, refused when a dimension is outside what the
/// hardware takes (e.g. a prefill step so long that its query tiles pass 65,535), so the
/// error names the kernel and the figure instead of a bare CUDA_ERROR_INVALID_VALUE.
pub fn grid(k: &KernelShape, x: usize, y: usize, z: usize) -> Result<LaunchConfig> {
    let fits = |v: usize, max: usize| v >= 1 && v <= max;
    if !(fits(x, MAX_GRID_X) && fits(y, MAX_GRID_YZ) && fits(z, MAX_GRID_YZ)) {
        return Err(LaunchError::Grid {
            kernel: k.name,
            x,
            y,
            z,
            max_x: MAX_GRID_X,
            max_yz: MAX_GRID_YZ,
        }
        .into());
    }
    Ok(LaunchConfig {
        grid_dim: (x as u32, y as u32, z as u32),
        block_dim: (k.threads, 1, 1),
        shared_mem_bytes: k.dynamic_smem,
    })
}

/// The longest run of query tokens one step may give `paged_attention_prefill`.
pub const MAX_PREFILL_QUERIES: usize = MAX_GRID_YZ * PREFILL_QUERIES_PER_BLOCK;

/// What one GPU architecture allows a block and a multiprocessor (the CUDA C++ Programming
/// Guide's table of technical specifications per compute capability).
#[derive(Clone, Copy, Debug)]
pub struct ArchLimits {
    /// `sm_80` etc.: ptxas's `-arch`; NVRTC compiles for the matching `compute_XY`.
    pub sm: &'static str,
    pub max_threads_per_block: u32,
    pub max_threads_per_sm: u32,
    pub max_blocks_per_sm: u32,
    pub regs_per_sm: u32,
    pub max_regs_per_block: u32,
    pub max_regs_per_thread: u32,
    /// Static `__shared__` data per block (larger needs dynamic memory and an opt-in).
    pub max_static_smem_per_block: u32,
    /// Static plus dynamic shared memory per block, with the opt-in.
    pub max_smem_per_block: u32,
    pub smem_per_sm: u32,
}

const KIB: u32 = 1024;

const fn arch(
    sm: &'static str,
    threads_sm: u32,
    blocks_sm: u32,
    smem_block_kib: u32,
) -> ArchLimits {
    ArchLimits {
        sm,
        max_threads_per_block: 1024,
        max_threads_per_sm: threads_sm,
        max_blocks_per_sm: blocks_sm,
        regs_per_sm: 65_536,
        max_regs_per_block: 65_536,
        max_regs_per_thread: 255,
        max_static_smem_per_block: 48 * KIB,
        max_smem_per_block: smem_block_kib * KIB,
        smem_per_sm: (smem_block_kib + 1) * KIB,
    }
}

/// The architectures the backend claims: A100 (8.0), consumer Ampere and the A10/A40 (8.6),
/// Ada (8.9), Hopper (9.0), Blackwell data-centre (10.0) and consumer (12.0). Older ones are
/// refused when the backend starts (`MIN_COMPUTE_CAPABILITY`): cuBLAS's bf16 GEMMs need 8.0.
pub const ARCHS: &[ArchLimits] = &[
    arch("sm_80", 2048, 32, 163),
    arch("sm_86", 1536, 16, 99),
    arch("sm_89", 1536, 24, 99),
    arch("sm_90", 2048, 32, 227),
    arch("sm_100", 2048, 32, 227),
    arch("sm_120", 1536, 32, 99),
];

/// The oldest compute capability the backend runs on.
pub const MIN_COMPUTE_CAPABILITY: (i32, i32) = (8, 0);

/// What ptxas reported for one kernel on one architecture.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KernelUsage {
    pub registers: u32,
    /// Static shared memory, bytes.
    pub smem: u32,
    pub stack_frame: u32,
    pub spill_stores: u32,
    pub spill_loads: u32,
}

/// How a kernel fits an architecture: resident blocks per multiprocessor, and the share of
/// the multiprocessor's warp slots they fill.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Fit {
    pub blocks_per_sm: u32,
    pub occupancy: f64,
}

/// Why a kernel's block cannot launch on an architecture, one variant per limit.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NoFit {
    #[error("{name}: {threads} threads per block; {sm} takes a multiple of 32 up to {max}")]
    Threads {
        name: &'static str,
        sm: &'static str,
        threads: u32,
        max: u32,
    },
    #[error("{name}: {registers} registers per thread, above {sm}'s {max}")]
    RegistersPerThread {
        name: &'static str,
        sm: &'static str,
        registers: u32,
        max: u32,
    },
    #[error(
        "{name}: {registers} registers x {threads} threads = {per_block} per block, above \
         {sm}'s {max} (the launch would fail with CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES)"
    )]
    RegistersPerBlock {
        name: &'static str,
        sm: &'static str,
        registers: u32,
        threads: u32,
        per_block: u32,
        max: u32,
    },
    #[error(
        "{name}: {bytes} bytes of static shared memory, above the {max} bytes a block may declare"
    )]
    StaticSmem {
        name: &'static str,
        bytes: u32,
        max: u32,
    },
    #[error("{name}: {bytes} bytes of shared memory per block, above {sm}'s {max}")]
    Smem {
        name: &'static str,
        sm: &'static str,
        bytes: u32,
        max: u32,
    },
    #[error("{name}: not one block fits a multiprocessor of {sm}")]
    NoBlock {
        name: &'static str,
        sm: &'static str,
    },
}

impl ArchLimits {
    /// Whether a block of `k` with ptxas's `usage` can launch at all here, and if so how
    /// many are resident per multiprocessor. Registers are allocated per warp in units of
    /// 256; every block on 8.0 and later also reserves 1 KiB of shared memory.
    pub fn fit(&self, k: &KernelShape, usage: &KernelUsage) -> std::result::Result<Fit, NoFit> {
        let (name, sm) = (k.name, self.sm);
        if k.threads == 0 || k.threads > self.max_threads_per_block || !k.threads.is_multiple_of(32)
        {
            return Err(NoFit::Threads {
                name,
                sm,
                threads: k.threads,
                max: self.max_threads_per_block,
            });
        }
        if usage.registers > self.max_regs_per_thread {
            return Err(NoFit::RegistersPerThread {
                name,
                sm,
                registers: usage.registers,
                max: self.max_regs_per_thread,
            });
        }
        let warps = k.threads / 32;
        let regs_per_warp = (usage.registers.max(1) * 32).div_ceil(256) * 256;
        let regs_per_block = regs_per_warp * warps;
        if regs_per_block > self.max_regs_per_block {
            return Err(NoFit::RegistersPerBlock {
                name,
                sm,
                registers: usage.registers,
                threads: k.threads,
                per_block: regs_per_block,
                max: self.max_regs_per_block,
            });
        }
        if usage.smem > self.max_static_smem_per_block {
            return Err(NoFit::StaticSmem {
                name,
                bytes: usage.smem,
                max: self.max_static_smem_per_block,
            });
        }
        let smem = usage.smem + k.dynamic_smem;
        if smem > self.max_smem_per_block {
            return Err(NoFit::Smem {
                name,
                sm,
                bytes: smem,
                max: self.max_smem_per_block,
            });
        }
        let by_threads = self.max_threads_per_sm / k.threads;
        let by_regs = self.regs_per_sm / regs_per_block;
        let by_smem = self.smem_per_sm / (smem + KIB);
        let blocks = by_threads
            .min(by_regs)
            .min(by_smem)
            .min(self.max_blocks_per_sm);
        if blocks == 0 {
            return Err(NoFit::NoBlock { name, sm });
        }
        Ok(Fit {
            blocks_per_sm: blocks,
            occupancy: (blocks * warps) as f64 / (self.max_threads_per_sm / 32) as f64,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_splits_fill_the_gpu_at_small_batches_and_fit_the_partials() {
        assert_eq!(decode_splits(1), MAX_DECODE_SPLITS);
        assert_eq!(decode_splits(8), 16);
        assert_eq!(decode_splits(32), 4);
        assert_eq!(decode_splits(128), 1);
        assert_eq!(decode_splits(1000), 1);
        for seqs in 1..=DECODE_SPLIT_SLOTS {
            let s = decode_splits(seqs);
            assert!((1..=MAX_DECODE_SPLITS).contains(&s));
            // The partials buffer holds DECODE_SPLIT_SLOTS (sequence, split) pairs.
            assert!(
                seqs * s <= DECODE_SPLIT_SLOTS,
                "{seqs} sequences x {s} splits"
            );
        }
    }

    #[test]
    fn every_kernel_has_a_launch_bound_define_and_a_unique_name() {
        let src = super::super::kernels::KERNELS_CU;
        let names: std::collections::BTreeSet<_> = KERNELS.iter().map(|k| k.name).collect();
        assert_eq!(names.len(), KERNELS.len(), "a kernel is listed twice");
        // Every `extern "C" __global__` in the source is listed, with a launch bound.
        // A kernel declared inside a macro (`name_d##D`, `a_##KIND##_m##M`) is there once
        // per invocation of that macro (`MACRO(16)` or `MACRO(16, 32)` on a line of its
        // own), named by the arguments in the pasted parameters' places.
        let mut in_source = std::collections::BTreeSet::new();
        let mut decls = src.split("extern \"C\" __global__");
        let mut before = decls.next().expect("the source");
        for decl in decls {
            let head = &decl[..decl.find('{').expect("a kernel body")];
            let bound = head
                .trim_start()
                .strip_prefix("void __launch_bounds__(")
                .unwrap_or_else(|| panic!("a kernel without __launch_bounds__: {head}"));
            let after = bound[bound.find(')').expect("the bound's end") + 1..].trim_start();
            let name = after[..after.find('(').expect("a parameter list")].to_string();
            if !name.contains("##") {
                in_source.insert(name);
            } else {
                let def = &before[before.rfind("#define ").expect("the macro")..];
                let open_at = def.find('(').unwrap();
                let mac = def["#define ".len()..open_at].to_string();
                let params: Vec<&str> = def[open_at + 1..def.find(')').unwrap()]
                    .split(',')
                    .map(str::trim)
                    .collect();
                let open = format!("{mac}(");
                let uses: Vec<_> = src
                    .lines()
                    .filter_map(|l| l.strip_prefix(open.as_str())?.strip_suffix(')'))
                    .collect();
                assert!(
                    !uses.is_empty(),
                    "{mac} (declaring {name}) is never invoked"
                );
                for u in uses {
                    let args: Vec<&str> = u.split(',').map(str::trim).collect();
                    assert_eq!(args.len(), params.len(), "{mac}({u})");
                    // Each pasted piece is a parameter (its argument) or text as it is.
                    let pasted: String = name
                        .split("##")
                        .map(
                            |piece| match params.iter().position(|&p| p == piece.trim()) {
                                Some(at) => args[at],
                                None => piece,
                            },
                        )
                        .collect();
                    in_source.insert(pasted);
                }
            }
            before = decl;
        }
        let listed: std::collections::BTreeSet<String> =
            names.iter().map(|s| s.to_string()).collect();
        assert_eq!(in_source, listed, "the kernels' source and KERNELS differ");
        for (name, _) in defines() {
            assert!(
                src.contains(name),
                "the kernels do not use the define {name}"
            );
        }
    }

    #[test]
    fn grid_refuses_what_the_hardware_does_not_take() {
        let ok = grid(
            &ATTENTION_PREFILL,
            4,
            32,
            MAX_PREFILL_QUERIES / PREFILL_QUERIES_PER_BLOCK,
        )
        .unwrap();
        assert_eq!(ok.block_dim, (256, 1, 1));
        let too_long = MAX_PREFILL_QUERIES + 1;
        let e = grid(
            &ATTENTION_PREFILL,
            1,
            32,
            too_long.div_ceil(PREFILL_QUERIES_PER_BLOCK),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("paged_attention_prefill") && e.contains("65535"),
            "{e}"
        );
        assert!(grid(&EMBED, 0, 1, 1).is_err());
        assert!(grid(&ROPE_KV_WRITE, 1, 65_536, 1).is_err());
    }

    #[test]
    fn sample_rows_spreads_large_vocabularies_over_at_most_32_blocks() {
        assert_eq!(sample_chunks(0), 1);
        assert_eq!(sample_chunks(1_000), 1);
        assert_eq!(sample_chunks(4_096), 1);
        assert_eq!(sample_chunks(4_097), 2);
        assert_eq!(sample_chunks(50_001), 13);
        assert_eq!(sample_chunks(151_936), SAMPLE_MAX_CHUNKS);
    }

    #[test]
    fn fit_counts_registers_per_warp_and_refuses_what_cannot_launch() {
        let sm90 = ARCHS.iter().find(|a| a.sm == "sm_90").unwrap();
        let usage = |registers, smem| KernelUsage {
            registers,
            smem,
            ..KernelUsage::default()
        };
        // 512 threads at 128 registers: exactly the 64K a block may have.
        let f = sm90.fit(&SAMPLE_ROWS, &usage(128, 6280)).unwrap();
        assert_eq!(f.blocks_per_sm, 1);
        assert!((f.occupancy - 0.25).abs() < 1e-9);
        // One register more and the launch fails for lack of registers.
        let e = sm90.fit(&SAMPLE_ROWS, &usage(129, 6280)).unwrap_err();
        assert!(
            matches!(
                e,
                NoFit::RegistersPerBlock {
                    per_block: 69_632,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("OUT_OF_RESOURCES"), "{e}");
        // 41 KiB of static shared memory: five blocks of 256 threads fit Hopper's 228 KiB...
        let f = sm90.fit(&ATTENTION_PREFILL, &usage(40, 41_216)).unwrap();
        assert_eq!(f.blocks_per_sm, 5);
        // ...and two fit an RTX 4090's 100 KiB.
        let sm89 = ARCHS.iter().find(|a| a.sm == "sm_89").unwrap();
        assert_eq!(
            sm89.fit(&ATTENTION_PREFILL, &usage(40, 41_216))
                .unwrap()
                .blocks_per_sm,
            2
        );
        assert!(matches!(
            sm90.fit(&ATTENTION_PREFILL, &usage(40, 49 * 1024)),
            Err(NoFit::StaticSmem { .. })
        ));
    }
}
