//! The CUDA backend, through `cudarc` with the driver, NVRTC and cuBLAS libraries loaded at
//! run time, so building with `--features cuda` needs no CUDA toolkit and a binary built that
//! way still starts (and reports "no CUDA device") on a machine without one.
//!
//! It mirrors the CPU backend's forward pass step for step (`cpu/mod.rs` is the reference):
//! weights live on the device as bf16, the hidden stream stays f32, matrix products go
//! through cuBLAS with bf16 inputs and f32 accumulation, and the rest is the NVRTC-compiled
//! kernels in `kernels/*.cu`. The KV pool is bf16, per layer
//! `[num_blocks, block_size, num_kv_heads, head_dim]` for K and for V, as on the CPU, plus
//! one scratch block that decode graphs pad with (see `kv`).
//!
//! Checked on every commit without a GPU: the host-side layouts, graph padding, sampling
//! parameters, PTX cache keys, launch shapes and the memory plan are unit-tested, and
//! `gpu/tests/cuda_offline` compiles and assembles the kernels for every claimed architecture
//! within its register and shared-memory limits and resolves every NVRTC and cuBLAS function
//! called. On a GPU, `tests/cuda_parity.rs` compares every path here against `CpuBackend`
//! (`scripts/gpu_verify.sh run`).
//!
//! Where things are:
//! - `load`: `CudaBackend::new`, the checks and the memory plan before anything is
//!   uploaded, the upload;
//! - `weights`: the model on the device, from the `checkpoint` walk both backends share;
//! - `kernels`: one typed launch per kernel of `kernels/*.cu`; `gemm`: the cuBLAS products;
//!   `fp8`, `fp8_gemm`: FP8 checkpoints' layers kept in FP8 and their products (decode
//!   kernels reading e4m3 weights, cuBLASLt's FP8 GEMMs for longer steps);
//!   `delta`: Gated DeltaNet's mixing (Qwen3.5's linear-attention layers), checked against
//!   the CPU's on a GPU, not yet part of a forward pass;
//! - `step`: one step, from the batch to logits, eager or through a graph (`graphs`);
//! - `forward`: the forward pass itself, launch by launch;
//! - `sampling`: sampling on the device; `kv`: the cache and its host copies;
//!   `handover`: its copies into another engine's cache in this process, on the device;
//! - `buffers`: the step's device buffers; `batch`: the batch flattened on the host;
//! - `shapes`: each kernel's launch figures, shared with `kernels/*.cu`, and device limits.
//!
//! Pure decode steps replay one CUDA graph per batch-size bucket (see `graphs`) unless
//! `CudaOptions::graphs` is off (`--enforce-eager`); with `CudaOptions::prefill_graphs`,
//! other steps of up to 512 tokens replay piecewise graphs around their attention launches
//! (`prefill_graphs`); every other step runs eagerly.
//!
//! Sampling (greedy, temperature, top-k, top-p) runs on the device; only top logprobs fall
//! back to copying logits. Prefill attention runs on the tensor cores over the paged cache.
//! The activations of the engine's largest step are allocated at start and counted in the
//! memory plan (`load::MemoryPlan`), so serving never grows them.

pub mod batch;
mod blas;
mod buffers;
pub mod delta;
pub mod delta_timing;
mod device;
mod forward;
mod fp8;
mod fp8_check;
mod fp8_gemm;
mod gemm;
mod graphs;
pub mod green;
mod handover;
mod hybrid;
mod hybrid_forward;
mod hybrid_weights;
pub mod ipc;
mod kernels;
mod kv;
mod launch;
mod load;
mod measure;
mod prefill_graphs;
mod product_timing;
pub mod ptx_cache;
mod sampling;
pub mod shapes;
mod skinny;
mod step;
mod weights;

pub use device::device_count;
pub use forward::FusedProducts;
pub use fp8_check::{fp8_fused_products, fp8_product, fp8_quantize, Fp8Path};
pub use gemm::{silu_mul_bf16_and_f32, skinny_and_cublas, skinny_epilogues, skinny_norm_prologues};
pub use hybrid::CudaHybridBackend;
pub use kernels::KERNELS_CU;
pub use load::MemoryPlan;
pub use measure::Device;
pub use product_timing::ProductTiming;
pub use sampling::sample_host_logits;

use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaStream};

use super::{Backend, ForwardBatch, SampleSpec};
use crate::config::ModelConfig;
use crate::error::Result;
use crate::kv_cache::BlockId;
use crate::kv_pool::{HostKvPool, KvSpec};
use crate::sampler::Sampled;
use buffers::{LogitsSpace, Workspace};
use graphs::DecodeGraphs;
use kernels::Kernels;
use kv::KvCache;
use weights::DevWeights;

pub struct CudaBackend {
    cfg: ModelConfig,
    ordinal: usize,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    k: Kernels,
    w: Arc<DevWeights>,
    kv: KvCache,
    /// Grown on demand by `step`; `None` until the first step.
    ws: Option<Workspace>,
    ls: Option<LogitsSpace>,
    graphs: DecodeGraphs,
    /// Piecewise graphs for steps with prompts (`CudaOptions::prefill_graphs`).
    prefill_graphs: prefill_graphs::PrefillGraphs,
    /// Products of at most this many rows use the skinny kernels
    /// (`CudaOptions::skinny_max_rows`).
    skinny_max_rows: usize,
    /// `CudaOptions::split_decode`.
    split_decode: bool,
    /// `CudaOptions::fuse_norms`.
    fuse_norms: bool,
    /// `CudaOptions::fuse_rope`.
    fuse_rope: bool,
    /// cuBLASLt and scratch for an FP8 checkpoint's products (`fp8_gemm`).
    fp8: Option<fp8_gemm::Fp8Ctx>,
    /// The cache as transfers to and from another engine of this process address it.
    device_kv: Arc<crate::device_kv::DeviceKvPool>,
}

impl CudaBackend {
    /// Whether pure decode steps replay CUDA graphs: false with `--enforce-eager` or after a
    /// capture failed, so benchmarks can say which path they measured.
    pub fn cuda_graphs_enabled(&self) -> bool {
        self.graphs.enabled()
    }

    /// Times every decode-graph replay from now on (`DecodeGraphs::time_replays`).
    pub fn time_graph_replays(&mut self) -> Result<()> {
        self.graphs.time_replays(&self.ctx)
    }

    /// The device's seconds over the last decode-graph replay, when timed and one ran since
    /// the previous reading.
    pub fn last_graph_replay_secs(&mut self) -> Result<Option<f64>> {
        self.graphs.last_replay_secs()
    }

    /// Whether steps with prompts of up to `prefill_graphs::MAX_TOKENS` tokens replay
    /// piecewise graphs (off after a failed capture).
    pub fn prefill_graphs_enabled(&self) -> bool {
        self.prefill_graphs.enabled()
    }

    /// KV-transfer hook: the K and V of `blocks` in `layer`, as little-endian bf16 bytes,
    /// block after block, each block its K `[block_size, num_kv_heads, head_dim]` then its V
    /// (see `kv::KvCache::copy_blocks_out`).
    pub fn copy_blocks_out(&mut self, layer: usize, blocks: &[BlockId]) -> Result<Vec<u8>> {
        self.kv.copy_blocks_out(layer, blocks)
    }

    /// KV-transfer hook, the inverse of `copy_blocks_out`: writes `bytes` (the same layout)
    /// into `blocks` of `layer`.
    pub fn copy_blocks_in(&mut self, layer: usize, blocks: &[BlockId], bytes: &[u8]) -> Result<()> {
        self.kv.copy_blocks_in(layer, blocks, bytes)
    }
}

impl Backend for CudaBackend {
    fn device(&self) -> String {
        format!("cuda:{}", self.ordinal)
    }

    fn num_blocks(&self) -> usize {
        self.kv.num_blocks
    }

    /// The prefill attention kernel's query tiles are its grid's z dimension.
    fn max_step_tokens(&self) -> Option<usize> {
        Some(shapes::MAX_PREFILL_QUERIES)
    }

    /// bf16 K and V in device memory. There is no host view of it (`host_kv` is `None`): KV
    /// transfers go through host staging pools (`kv_staging`).
    fn kv_spec(&self) -> Option<KvSpec> {
        Some(self.kv.spec().clone())
    }

    /// Transfers go through host staging pools: `copy_blocks_out`/`copy_blocks_in` move
    /// whole blocks through a pinned buffer, and only the asked-for positions are written on
    /// the host side.
    fn kv_staging(&self) -> bool {
        true
    }

    fn device_kv(&self) -> Option<Arc<crate::device_kv::DeviceKvPool>> {
        Some(self.device_kv.clone())
    }

    fn kv_to_host(
        &mut self,
        table: &[BlockId],
        positions: std::ops::Range<usize>,
        dst: &HostKvPool,
        dst_table: &[BlockId],
    ) -> Result<()> {
        self.kv.copy_positions_out(table, positions, dst, dst_table)
    }

    fn kv_from_host(
        &mut self,
        src: &HostKvPool,
        src_table: &[BlockId],
        positions: std::ops::Range<usize>,
        table: &[BlockId],
    ) -> Result<()> {
        self.kv.copy_positions_in(src, src_table, positions, table)
    }

    fn forward(&mut self, batch: &ForwardBatch) -> Result<Vec<Vec<f32>>> {
        sampling::forward_logits(self, batch)
    }

    /// Samples on the device (see `sampling::forward_sampled`).
    fn forward_sample(
        &mut self,
        batch: &ForwardBatch,
        specs: &mut [SampleSpec],
    ) -> Result<Vec<Sampled>> {
        sampling::forward_sampled(self, batch, specs)
    }
}

impl sampling::LogitsStep for CudaBackend {
    fn run_step(&mut self, batch: &ForwardBatch) -> Result<usize> {
        self.run(batch)
    }

    fn logits(&mut self) -> (&Arc<CudaStream>, &Kernels, Option<&mut LogitsSpace>, usize) {
        (&self.stream, &self.k, self.ls.as_mut(), self.cfg.vocab_size)
    }
}
