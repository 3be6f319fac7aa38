//! What a backend refuses or reports, one variant per rule, grouped by what the rule is
//! about: the build and the device, the CUDA toolchain, the model, FP8 weights, memory, a
//! step's layout, a kernel's arguments, KV copies, recurrent state, `--sm-split` and the sim
//! backend. The texts are what a user reads after `backend: `
//! ([`EngineError::Backend`](crate::error::EngineError::Backend)).
//!
//! The module names no other module of the crate but `sm_split` (`crate::error` names this
//! one), so it holds no `KvSpec`, whose module reports through `crate::error`: a staging
//! pool's shape is kept as the text `KvSpec`'s `Debug` gives.

use std::ops::Range;

use crate::backend::sm_split::SmSplit;

/// Bytes in a GiB, as the sizes in the texts are given.
const GIB: f64 = (1u64 << 30) as f64;

fn gib(bytes: &usize) -> f64 {
    *bytes as f64 / GIB
}

/// Why a backend cannot run, or cannot run this step.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// `--device cuda` on a build without the `cuda` feature.
    #[error(
        "this kvmesh was built without CUDA support; rebuild with `cargo build --release \
         --features cuda`"
    )]
    NoCuda,
    /// `--device` names a CUDA device that is not there: `found` devices are visible.
    #[error("--device {spec}: {}", no_device(.found))]
    NoDevice { spec: String, found: usize },
    /// The CUDA backend was asked for device `ordinal`, and `count` are visible.
    #[error(
        "cuda:{ordinal} was asked for but {count} CUDA device(s) are visible (check \
         CUDA_VISIBLE_DEVICES and the NVIDIA driver)"
    )]
    NotVisible { ordinal: usize, count: usize },
    #[error(transparent)]
    Toolchain(#[from] ToolchainError),
    #[error(transparent)]
    Model(#[from] ModelRefusal),
    #[error(transparent)]
    Fp8(#[from] Fp8Refusal),
    #[error(transparent)]
    Memory(#[from] MemoryError),
    #[error(transparent)]
    Batch(#[from] BatchError),
    #[error(transparent)]
    Launch(#[from] LaunchError),
    #[error(transparent)]
    Kv(#[from] KvCopyError),
    #[error(transparent)]
    State(#[from] StateError),
    /// A backend without a capability another backend has (`Backend`'s default methods).
    #[error("the {backend} backend {what}")]
    Cannot { backend: String, what: Capability },
    #[error(transparent)]
    SmSplit(#[from] GreenContextError),
    #[error(transparent)]
    Sim(#[from] SimError),
    /// An internal invariant broke: no input reaches these, only a bug.
    #[error("{0}")]
    Invariant(&'static str),
}

fn no_device(found: &usize) -> String {
    match found {
        0 => "no CUDA device was found (no driver library, or no GPU visible)".into(),
        n => format!(
            "only {n} CUDA device(s) are visible (cuda:0..cuda:{})",
            n - 1
        ),
    }
}

/// The driver, NVRTC or GPU cannot run the CUDA backend's kernels.
#[derive(Debug, thiserror::Error)]
pub enum ToolchainError {
    #[error(
        "the GPU has compute capability {major}.{minor}; the CUDA backend needs \
         {need_major}.{need_minor} or newer (its matrix products are bf16 GEMMs)"
    )]
    Capability {
        major: i32,
        minor: i32,
        need_major: i32,
        need_minor: i32,
    },
    /// The PTX names an ISA the driver predates (a newer NVRTC than the driver).
    #[error(
        "the NVIDIA driver cannot load PTX ISA {isa}, which NVRTC {} produced: update the \
         driver, or use an NVRTC no newer than the driver's CUDA version (nvidia-smi shows it)",
        nvrtc_version(.nvrtc)
    )]
    PtxIsa {
        isa: String,
        nvrtc: Option<(i32, i32)>,
    },
    #[error(
        "the NVRTC library (libnvrtc.so) was not found; install the CUDA runtime libraries or \
         add their folder to LD_LIBRARY_PATH"
    )]
    NoNvrtc,
    #[error("NVRTC returned PTX that is not valid UTF-8")]
    PtxNotUtf8(#[source] std::string::FromUtf8Error),
    #[error("NVRTC returned no PTX image")]
    NoPtx,
}

fn nvrtc_version(v: &Option<(i32, i32)>) -> String {
    v.map_or("?".to_string(), |(a, b)| format!("{a}.{b}"))
}

/// A model the CUDA backend does not run (`--device cpu` does).
#[derive(Debug, thiserror::Error)]
pub enum ModelRefusal {
    #[error("head_dim {dim} is not supported by the CUDA kernels (even, at most {max})")]
    HeadDim { dim: usize, max: usize },
    /// RoPE whose frequencies change with the sequence length (dynamic NTK).
    #[error(
        "RoPE type `{rope}` (frequencies that change with the sequence length) is not \
         implemented by the CUDA backend; run this model with --device cpu"
    )]
    Rope { rope: &'static str },
}

/// FP8 weights the CUDA backend does not run, on this model, device or cuBLASLt. `quant`
/// is the checkpoint's quantization in short (`QuantConfig::summary`).
#[derive(Debug, thiserror::Error)]
pub enum Fp8Refusal {
    #[error(
        "FP8 layer {module} is not run by the CUDA backend (an FP8 output head: the logits \
         products are bf16); run with --device cpu"
    )]
    OutputHead { module: String },
    /// A scheme (`Scheme::describe`) the backend has no FP8 GEMM for.
    #[error(
        "FP8 layer {module} is not run by the CUDA backend ({scheme}: the CUDA backend's FP8 \
         GEMMs run 128x128 block scales with dynamic per-token-group (128) activations, and \
         per-channel or per-tensor weight scales with dynamic per-token or static per-tensor \
         activations); run with --device cpu"
    )]
    Scheme { module: String, scheme: String },
    #[error(
        "FP8 layer {module} is not run by the CUDA backend ([{out}, {inp}]: FP8 GEMMs take \
         sides that are multiples of 16); run with --device cpu"
    )]
    Sides {
        module: String,
        out: usize,
        inp: usize,
    },
    /// Compute capability below 8.9: no FP8 tensor cores.
    #[error(
        "FP8 weights ({quant}) need FP8 tensor cores (compute capability 8.9 or newer); this \
         GPU has {major}.{minor}; run with --device cpu"
    )]
    Capability {
        quant: String,
        major: i32,
        minor: i32,
    },
    /// cuBLASLt takes block and outer-vector scales on sm_90 only.
    #[error(
        "FP8 weights ({quant}): cuBLASLt runs FP8 GEMMs with 128x128 block and per-row \
         (outer-vector) scales on compute capability 9.0 (Hopper) only; this GPU has \
         {major}.{minor}; run with --device cpu"
    )]
    OffHopper {
        quant: String,
        major: i32,
        minor: i32,
    },
    /// `version` as `cublasLtGetVersion` gives it (`120801` for 12.8.1).
    #[error(
        "FP8 weights ({quant}): cuBLASLt {} is loaded; FP8 GEMMs with block and per-row \
         scales need cuBLASLt 12.9 or newer (CUDA 12.9); update the CUDA libraries",
        lt_version(.version)
    )]
    OldCublasLt { quant: String, version: usize },
    #[error("FP8 weights need cuBLASLt (libcublasLt), which could not be loaded")]
    NoCublasLt,
    /// More rows than the largest `fp8_gemv_*` kernel takes.
    #[error("fp8_gemv: no kernel for {rows} rows")]
    NoGemv { rows: usize },
}

/// `120900` as `12.9.0`.
fn lt_version(v: &usize) -> String {
    format!("{}.{}.{}", v / 10_000, v / 100 % 100, v % 100)
}

/// The model and its KV cache against the memory there is, and the cache's own sizes.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    #[error("the KV cache needs blocks of at least one token")]
    ZeroBlockSize,
    #[error("the KV cache needs at least one block")]
    NoBlocks,
    /// `--gpu-memory-utilization share` asks for a `budget` beyond what is free.
    #[error(
        "cuda:{ordinal} has {:.2} GiB free of {:.2} GiB, less than the {:.2} GiB \
         --gpu-memory-utilization {share} asks for (something else holds the rest); lower it \
         to at most {:.2} or free the GPU",
        gib(.free),
        gib(.total),
        gib(.budget),
        (*.free as f64 / *.total as f64 * 100.0).floor() / 100.0
    )]
    ShareOverFree {
        ordinal: usize,
        free: usize,
        total: usize,
        budget: usize,
        share: f64,
    },
    /// The model takes `base` bytes, more than `--gpu-memory-utilization` gives.
    #[error(
        "the model does not fit in {share} of cuda:{ordinal}'s {:.2} GiB ({:.2} GiB): it needs \
         {sizes} = {:.2} GiB before any KV cache; raise --gpu-memory-utilization, lower \
         --max-num-batched-tokens, or use a larger GPU",
        gib(.total),
        gib(.budget),
        gib(.base)
    )]
    ModelOverShare {
        ordinal: usize,
        share: f64,
        total: usize,
        budget: usize,
        sizes: PlanSizes,
        base: usize,
    },
    /// The model and `blocks` KV blocks (`kv` bytes) need `need` bytes, more than is free.
    #[error(
        "not enough GPU memory: cuda:{ordinal} has {:.2} GiB free of {:.2} GiB, but this \
         needs {:.2} GiB ({sizes} + KV cache {:.2} GiB for {blocks} blocks); ask for fewer KV \
         blocks or use a larger GPU",
        gib(.free),
        gib(.total),
        gib(.need),
        gib(.kv)
    )]
    NotEnough {
        ordinal: usize,
        free: usize,
        total: usize,
        need: usize,
        sizes: PlanSizes,
        kv: usize,
        blocks: usize,
    },
    /// A host KV pool whose size overflows.
    #[error("a KV cache of {blocks} blocks is too large")]
    HostTooLarge { blocks: usize },
    /// A host KV pool the allocator refused: `layers` layers of K and V, `layer_bytes` each.
    #[error(
        "cannot allocate a KV cache of {blocks} blocks ({:.2} GiB); ask for fewer",
        2.0 * *.layers as f64 * *.layer_bytes as f64 / GIB
    )]
    HostAlloc {
        blocks: usize,
        layers: usize,
        layer_bytes: usize,
    },
}

/// What the CUDA backend takes besides its KV cache, in bytes, as the memory refusals show
/// it: the weights, the activations of steps of up to `tokens` tokens and `rows` rows of
/// logits, and the fixed working space.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanSizes {
    pub weights: usize,
    pub activations: usize,
    pub tokens: usize,
    pub rows: usize,
    pub fixed: usize,
}

impl std::fmt::Display for PlanSizes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "weights {:.2} GiB + activations {:.2} GiB (steps of up to {} tokens, {} rows of \
             logits) + {:.2} GiB working space",
            gib(&self.weights),
            gib(&self.activations),
            self.tokens,
            self.rows,
            gib(&self.fixed)
        )
    }
}

/// A step laid out wrongly by the scheduler: the backend refuses it rather than read or
/// write past its pools.
#[derive(Debug, thiserror::Error)]
pub enum BatchError {
    #[error("block size is 0")]
    ZeroBlockSize,
    #[error(
        "sequence {seq} has {blocks} blocks for {positions} positions (block size \
         {block_size}); the scheduler must allocate blocks before the step"
    )]
    TooFewBlocks {
        seq: usize,
        blocks: usize,
        positions: usize,
        block_size: usize,
    },
    #[error("sequence {seq} uses block {block} but the pool has {num_blocks} blocks")]
    BlockOutsidePool {
        seq: usize,
        block: u32,
        num_blocks: usize,
    },
    #[error("no block for position {pos} of sequence {seq}")]
    NoBlockForPosition { seq: usize, pos: usize },
    /// A count of the step (`what`) past the CUDA kernels' 32-bit indices.
    #[error(
        "{what} {value} does not fit the 32-bit indices the CUDA kernels use; use fewer KV \
         blocks"
    )]
    Over32Bits { what: &'static str, value: usize },
    #[error("sequence {seq} wants logits but runs no tokens")]
    LogitsWithoutTokens { seq: usize },
    #[error("{seqs} sequences want a token but {specs} sampling specs were given")]
    SpecCount { seqs: usize, specs: usize },
    #[error("{logits} logits for {rows} rows of {vocab}")]
    LogitsShape {
        logits: usize,
        rows: usize,
        vocab: usize,
    },
}

/// A kernel or library call given arguments it cannot take: a bug on the host side (or a
/// step past the hardware's limits), refused rather than left to read or write past an
/// allocation on the device.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// Buffer `what` of `kernel` is shorter than the launch's grid touches.
    #[error("{kernel}: `{what}` holds {len} elements but the launch needs {need}")]
    Short {
        kernel: &'static str,
        what: &'static str,
        len: usize,
        need: usize,
    },
    #[error("{kernel}: no skinny kernel for {rows} rows of {k} (by {n} outputs)")]
    NoSkinny {
        kernel: &'static str,
        rows: usize,
        k: usize,
        n: usize,
    },
    #[error("{kernel}: {what} exceeds the 32-bit range")]
    Over32Bits {
        kernel: &'static str,
        what: &'static str,
    },
    #[error("{kernel}: query rows of {q_row} hold fewer than {heads} heads of {dim}")]
    QueryRows {
        kernel: &'static str,
        q_row: usize,
        heads: usize,
        dim: usize,
    },
    #[error(
        "{kernel}: {words} mask words cover {} tokens, fewer than the vocabulary's {vocab}",
        .words * 32
    )]
    MaskWords {
        kernel: &'static str,
        words: usize,
        vocab: usize,
    },
    #[error("{kernel}: a rotary dimension of {rot} in heads of {dim}")]
    Rotary {
        kernel: &'static str,
        rot: usize,
        dim: usize,
    },
    /// A grid past CUDA's limits (`max_x` blocks in x, `max_yz` in y and z).
    #[error(
        "{kernel}: a grid of ({x}, {y}, {z}) blocks is outside CUDA's limits (x 1..={max_x}, \
         y and z 1..={max_yz}); lower --max-num-batched-tokens"
    )]
    Grid {
        kernel: &'static str,
        x: usize,
        y: usize,
        z: usize,
        max_x: usize,
        max_yz: usize,
    },
    #[error("a gate/up projection with a bias, or of an odd width, has no fused kernel")]
    NoFusedGateUp,
    /// Operand `what` of an `m x k` by `n x k` cuBLAS product is too short.
    #[error("cuBLAS GEMM ({m}x{k} by {n}x{k}): `{what}` holds {len} elements, needs {need}")]
    GemmShort {
        m: usize,
        n: usize,
        k: usize,
        what: &'static str,
        len: usize,
        need: usize,
    },
    #[error(
        "cuBLAS GEMM ({m}x{k} by {n}x{k}): columns {col0}..{} do not fit rows of {ld}",
        .col0 + .n
    )]
    GemmColumns {
        m: usize,
        n: usize,
        k: usize,
        col0: usize,
        ld: usize,
    },
    #[error("GEMM dimension {what} exceeds the 32-bit range cuBLAS takes")]
    GemmOver32Bits { what: &'static str },
    #[error("FP8 product: {what} {value} exceeds i32")]
    Fp8Over32Bits { what: &'static str, value: usize },
    #[error("{kernel}: {rows} rows of {k} by {n} outputs (k must be a multiple of 16)")]
    Fp8Gemv {
        kernel: &'static str,
        rows: usize,
        k: usize,
        n: usize,
    },
    #[error("{kernel}: rows of {k} (a multiple of 16 is needed)")]
    Fp8QuantRows { kernel: &'static str, k: usize },
    #[error("FP8 scratch holds {tokens} tokens, the step has {rows}")]
    Fp8Scratch { tokens: usize, rows: usize },
    #[error("{kernel}: a static activation scale quantizes whole rows, not 128-column groups")]
    Fp8StaticGroups { kernel: &'static str },
}

/// A KV copy or transfer of the wrong shape.
#[derive(Debug, thiserror::Error)]
pub enum KvCopyError {
    #[error("KV transfer for {blocks} blocks expects {expected} bytes, got {got}")]
    Bytes {
        blocks: usize,
        expected: usize,
        got: usize,
    },
    #[error("layer {layer} does not exist (the model has {layers})")]
    NoLayer { layer: usize, layers: usize },
    #[error("block {block} is outside the pool of {num_blocks} blocks")]
    BlockOutsidePool { block: u32, num_blocks: usize },
    #[error("no blocks for positions {positions:?}")]
    NoBlocks { positions: Range<usize> },
    #[error("positions {positions:?} need {need} blocks")]
    TooFewBlocks {
        positions: Range<usize>,
        need: usize,
    },
    #[error("no staging block for {pos}")]
    NoStagingBlock { pos: usize },
    /// The two shapes as `KvSpec`'s `Debug` prints them.
    #[error("a staging pool of shape {pool} does not match the cache's Some({cache})")]
    StagingShape { pool: String, cache: String },
    #[error("the backend has no KV layout to stage")]
    NoLayout,
}

/// A recurrent-state slot (hybrid models) that is not there, not the sequence's own, or of
/// another size.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("state slot {slot} is not in the pool of {total}")]
    OutOfPool { slot: usize, total: usize },
    #[error("sequence {seq} of the step holds no state slot of its own ({slot:?} of {slots})")]
    NotOwn {
        seq: usize,
        slot: Option<u32>,
        slots: usize,
    },
    #[error("a recurrent state of {values} values does not fit this model's slots of {slot_len}")]
    Size { values: usize, slot_len: usize },
    #[error("the prefill worker sent no recurrent state")]
    NotSent,
}

/// What a backend without recurrent state or host KV copies says it cannot do (after
/// "the {backend} backend").
#[derive(Debug, thiserror::Error)]
pub enum Capability {
    #[error("has no recurrent state to read (slot {slot})")]
    ReadState { slot: u32 },
    #[error("has no recurrent state to write ({values} values for slot {slot})")]
    WriteState { slot: u32, values: usize },
    #[error("cannot copy recurrent state (slot {from} to {to})")]
    CopyState { from: u32, to: u32 },
    #[error("cannot copy its KV to host memory")]
    KvToHost,
    #[error("cannot copy KV from host memory")]
    KvFromHost,
}

/// `--sm-split` on a driver without green contexts, or a split the driver did not give as
/// asked (what the flag itself says is `SmSplitError`'s).
#[derive(Debug, thiserror::Error)]
pub enum GreenContextError {
    /// `driver` as `cuDriverGetVersion` gives it (`12040` for 12.4).
    #[error(
        "--sm-split needs green contexts, which came with CUDA 12.4; this driver supports \
         CUDA {}.{}: update the NVIDIA driver, or leave --sm-split out",
        .driver / 1000,
        .driver % 1000 / 10
    )]
    OldDriver { driver: i32 },
    #[error(
        "--sm-split {split}: asked the driver for a group of {want} SMs and got {groups} \
         group(s) of {got} SMs ({left} left); refusing a split other than the one asked for"
    )]
    Mismatch {
        split: SmSplit,
        want: u32,
        groups: u32,
        got: u32,
        left: u32,
    },
}

/// The sim backend's token ids to emit.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("the sim backend needs at least one token id to emit")]
    NoOutputs,
    #[error(
        "the sim backend was given token id {token} to emit, outside the vocabulary of {vocab}"
    )]
    OutsideVocab { token: u32, vocab: usize },
}

#[cfg(test)]
#[path = "error_tests.rs"]
mod tests;
