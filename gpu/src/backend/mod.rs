//! The seam between the engine and the hardware. The scheduler decides which tokens of which
//! sequences run in a step and which KV blocks they use; a backend owns the weights and the
//! KV memory and turns that batch into next-token choices.
//!
//! `cpu` does the math in plain Rust; a `cuda` backend keeps the same batch shape and samples
//! on the device by overriding `forward_sample`; a `sim` backend can answer from a timing
//! model without any math.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod cuda_flags;
pub mod error;
pub mod sim;
pub mod sm_split;

use std::sync::Arc;

use crate::error::Result;
use crate::kv_cache::BlockId;
use crate::kv_pool::{HostKvPool, KvSpec};
use crate::sampler::{sample, Rng, Sampled, SamplingParams};
use error::{BackendError, Capability};

/// How the CUDA backend runs: on which device, and whether pure decode steps replay CUDA
/// graphs. It lives here rather than in `cuda` so that builds without the `cuda` feature can
/// still name it (`model::BackendKind::Cuda`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CudaOptions {
    /// The device, as in `--device cuda:N`.
    pub ordinal: usize,
    /// Whether decode steps replay CUDA graphs (the default); `--enforce-eager` turns this
    /// off so that every step launches its kernels one by one.
    pub graphs: bool,
    /// Most tokens one step runs (the engine's `max_num_batched_tokens`) and most rows that
    /// want logits (its `max_num_seqs`): the activations for them are allocated and counted
    /// at start, so a step within the engine's limits never runs out of device memory
    /// halfway through serving.
    pub reserve_tokens: usize,
    pub reserve_rows: usize,
    /// Products of at most this many rows (decode steps of small batches) stream the weights
    /// through the engine's own skinny kernels rather than cuBLAS; 0 sends every product to
    /// cuBLAS. Kernels exist up to 8 rows; `gpu-bench --skinny-max-rows` measures the choice.
    pub skinny_max_rows: usize,
    /// Whether decode steps of few sequences split each history over several blocks per
    /// head (`paged_attention_decode_d*`, merged by the block that finishes last), for head
    /// sizes with a 16-byte decode kernel. On by default: on an H100 (Qwen3-8B, 2,048
    /// positions of history) batch-1 steps took 6.67 ms split against 12.71 ms with one
    /// block per head. `gpu-bench --no-split-decode` measures the other way.
    pub split_decode: bool,
    /// Whether the engine's own kernels are launched with programmatic dependent launch on
    /// GPUs that have it (compute capability 9.0 and later): each may start while the one
    /// before it finishes, overlapping a launch's start-up (and a skinny product's first
    /// weight loads) with the previous kernel's tail. `gpu-bench --pdl on|off` measures it.
    pub pdl: Pdl,
    /// Whether a decode step of at most 2 rows runs each residual add and RMSNorm between
    /// layers as the prologue of the product after it (`skinny_norm*`, and `fp8_norm*` for
    /// an FP8 product of one FP8 part: every block normalises the row into shared memory,
    /// bit for bit as `add_rmsnorm_to_bf16`), saving two launches a layer; a layer whose
    /// product has no such kernel keeps its launches. Off by default until a GPU run has
    /// measured it (`gpu-bench --fuse-norms`).
    pub fuse_norms: bool,
    /// Whether a decode step of at most `skinny_max_rows` rows (2 for FP8 products) takes
    /// the rotary embedding and the new K/V's write to the cache as its q/k/v product's
    /// epilogue (`skinny_rope*`, `fp8_rope*`, bit for bit as `rope_kv_write`), one launch
    /// fewer a layer. Qwen3's q/k norms come with it: the last warp to finish a head's
    /// pairs normalises and rotates the head. Off by default until a GPU run has measured
    /// it (`gpu-bench --fuse-rope`).
    pub fuse_rope: bool,
    /// Whether steps with prompts run a hybrid model's Gated DeltaNet layers through the
    /// scan path (`cuda::delta`: the recurrence with each value column over 4 threads, the
    /// normalisation, gates and gated norm in launches of their own) rather than
    /// `gated_delta_rule` alone; decode steps keep the latter. Off by default until a GPU run
    /// has checked and measured it (`gpu-bench --gdn-scan`, `--gated-deltanet`): the first
    /// H200 run measured the one-kernel path at 35.0 ms a layer for an 8,192-token prompt of
    /// Qwen3.5-9B's shape, 16.6x flash-linear-attention's chunked kernels.
    pub gdn_scan: bool,
    /// Whether steps with prompts run the Gated DeltaNet recurrence in the chunked form
    /// (`delta_chunk_prep`, `delta_chunk_scan`: chunks of 32 tokens, each chunk's
    /// `(I + A)^-1` computed for all chunks at once, then the chunks in order as small matrix
    /// products), inside the scan path's other launches; layers too narrow for it (fewer than
    /// 64 value-head columns of q/k/v per value head) keep `delta_scan`. Off by default until
    /// a GPU run has checked and measured it (`gpu-bench --gdn-chunked`).
    pub gdn_chunked: bool,
    /// Whether FP8 prefill products have cuBLASLt write f32 straight into the product's
    /// columns, where it has such a GEMM for the scales, rather than bf16 that `fp8_out_cols`
    /// widens: one pass over every output less. The first H200 profile of Qwen3-8B FP8
    /// (512-token prefill) spent 24% of its kernel time in `fp8_out_cols`. Off by default
    /// until a GPU run has checked and measured it (`gpu-bench --fp8-f32-out`).
    pub fp8_f32_out: bool,
    /// Whether FP8 products of 1 to 16 rows (decode steps) run on the tensor cores
    /// (`fp8_mma_*`: bf16 mma, the e4m3 weights widened exactly, the activations as bf16)
    /// rather than `fp8_gemv_*` (up to `skinny_max_rows`) and cuBLASLt with quantized
    /// activations (more rows). An H200 measured the FP8 8B step at batch 8 at 5.11 ms
    /// against bf16's 5.28 though it reads half the bytes. The fused FP8 forms are
    /// `fp8_gemv_*`'s, so this turns them off. Off by default until a GPU run has checked
    /// and measured it (`gpu-bench --fp8-mma`).
    pub fp8_mma: bool,
    /// Whether steps with prompts of up to 512 tokens replay CUDA graphs of everything but
    /// their attention, captured per token bucket in a segment per layer, the attention
    /// launched eagerly between them (vLLM's "piecewise" graphs; `cuda::prefill_graphs`).
    /// Needs `graphs`. Off by default until a GPU run has checked and measured it
    /// (`gpu-bench --prefill-graphs`, with `--prefill-concurrency`).
    pub prefill_graphs: bool,
    /// Run on one side of an SM split (a green context holding only that side's SMs),
    /// rather than on the whole device. `gpu-bench --sm-split` measures a side alone.
    pub sm_partition: Option<sm_split::SmPartition>,
    /// Allocate the KV cache as one region another process of this host can map (CUDA
    /// IPC), so a prefill process copies into it on the device (`--kv-transport cuda-ipc`
    /// on a decode node).
    pub kv_exportable: bool,
    /// Allocate the KV cache as one `cuMemAlloc` region where the driver allows it, which
    /// UCX's CUDA lanes register and map (`--kv-transport ucx` on a decode node); where it
    /// does not, the cache is allocated per layer as usual, with a warning, and KV moves
    /// through host memory. Unlike `kv_exportable`, nothing fails for want of it.
    pub kv_one_allocation: bool,
}

/// `CudaOptions::pdl`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Pdl {
    /// On for models whose decode step reads under `PDL_AUTO_MAX_BYTES` of weights. On an
    /// H100, side by side in one run: batch-1 steps of the Qwen2.5-0.5B and Llama-3.2-1B
    /// shapes took 0.953 and 1.290 ms with it against 1.005 and 1.370 without; Qwen3-8B's
    /// 6.35 against 6.19, where a launch gap is a far smaller share of a step.
    #[default]
    Auto,
    On,
    Off,
}

/// `Pdl::Auto`'s limit: between the shapes it gained on (2.5 GB a step) and the one it lost
/// on (15.1 GB); sizes in between are not measured.
pub const PDL_AUTO_MAX_BYTES: usize = 8 << 30;

impl Pdl {
    /// Whether a model reading `step_bytes` of weights a decode step launches with it.
    pub fn enabled(self, step_bytes: usize) -> bool {
        match self {
            Pdl::On => true,
            Pdl::Off => false,
            Pdl::Auto => step_bytes < PDL_AUTO_MAX_BYTES,
        }
    }
}

impl std::str::FromStr for Pdl {
    type Err = UnknownPdl;
    fn from_str(s: &str) -> std::result::Result<Pdl, UnknownPdl> {
        match s {
            "auto" => Ok(Pdl::Auto),
            "on" => Ok(Pdl::On),
            "off" => Ok(Pdl::Off),
            other => Err(UnknownPdl(other.to_string())),
        }
    }
}

/// A `--pdl` value that is none of auto, on and off.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("`{0}`: expected auto, on or off")]
pub struct UnknownPdl(pub String);

/// The default `CudaOptions::skinny_max_rows`. On an H100 (Qwen3-8B's shapes, decode step
/// against every product through cuBLAS) the skinny kernels took 6.39 / 6.59 / 6.92 / 8.24 ms
/// at 1 / 2 / 4 / 8 rows, cuBLAS 6.90 / 6.91 / 6.98 / 7.05: ahead up to four rows, behind at
/// eight, where eight sums per weight cost more instructions than the loads hide.
pub const SKINNY_MAX_ROWS: usize = 4;

impl CudaOptions {
    /// Device `ordinal`, with CUDA graphs on and the engine's default step limits.
    pub fn device(ordinal: usize) -> CudaOptions {
        let d = crate::engine::EngineConfig::default();
        CudaOptions {
            ordinal,
            graphs: true,
            reserve_tokens: d.max_num_batched_tokens,
            reserve_rows: d.max_num_seqs,
            skinny_max_rows: SKINNY_MAX_ROWS,
            split_decode: true,
            pdl: Pdl::Auto,
            fuse_norms: false,
            fuse_rope: false,
            gdn_scan: false,
            gdn_chunked: false,
            fp8_f32_out: false,
            fp8_mma: false,
            prefill_graphs: false,
            sm_partition: None,
            kv_exportable: false,
            kv_one_allocation: false,
        }
    }
}

/// Device copies of a model's weights by device, while a backend holds one: the GPU backends
/// built from one model on one device (a node's prefill and decode engines) share one copy
/// rather than each uploading its own. Only a model's own backends see it, so no other
/// model's weights can ever be taken for its.
#[derive(Default)]
pub struct DeviceWeightCache {
    held: std::sync::Mutex<Vec<(usize, std::sync::Weak<dyn std::any::Any + Send + Sync>)>>,
}

impl DeviceWeightCache {
    /// The copy on device `ordinal` a backend holds, if one does.
    pub fn held<T: std::any::Any + Send + Sync>(
        &self,
        ordinal: usize,
    ) -> Option<std::sync::Arc<T>> {
        let held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        held.iter()
            .filter(|(o, _)| *o == ordinal)
            .find_map(|(_, w)| w.upgrade()?.downcast::<T>().ok())
    }

    /// Keeps `w`, a backend's copy on device `ordinal`, for the next backend there, for as
    /// long as one holds it.
    pub fn hold<T: std::any::Any + Send + Sync>(&self, ordinal: usize, w: &std::sync::Arc<T>) {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        held.retain(|(_, w)| w.strong_count() > 0);
        let any: std::sync::Arc<dyn std::any::Any + Send + Sync> = w.clone();
        held.push((ordinal, std::sync::Arc::downgrade(&any)));
    }
}

/// How much memory to give the KV cache.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KvBudget {
    /// Exactly this many blocks.
    Blocks(usize),
    /// As many blocks as fit in these bytes.
    Bytes(usize),
    /// A GPU's: this share of the device's total memory for everything the engine puts on
    /// it (weights, activations, KV cache), the KV cache taking what the rest leaves, as
    /// vLLM's `--gpu-memory-utilization` does.
    Share(f64),
}

/// One sequence's share of a step.
pub struct SeqInput<'a> {
    /// The tokens to run now (a whole prompt, a chunk of one, or one decode token).
    pub tokens: &'a [u32],
    /// Position of `tokens[0]`; positions before it are already in the cache.
    pub start_pos: usize,
    /// The sequence's length as the engine knows it this step (prompt plus the tokens
    /// generated so far): at least `start_pos + tokens.len()`, more for a prompt chunk.
    /// Only RoPE that depends on the length (dynamic NTK) reads it, so that every chunk of
    /// a prompt is rotated as the whole prompt would be in one pass. Values below
    /// `start_pos + tokens.len()` (0, say) mean exactly that.
    pub context_len: usize,
    /// Blocks holding positions `0..start_pos + tokens.len()`, in order.
    pub block_table: &'a [BlockId],
    /// Whether the step must produce a next token for this sequence (its last known token
    /// is in this chunk).
    pub want_logits: bool,
    /// The recurrent-state slot the sequence holds, for a model whose layers carry state
    /// between steps (Qwen3.5's Gated DeltaNet; see [`Backend::num_state_slots`]): the slot
    /// holds the state after the sequence's first `start_pos` tokens, and a backend starts
    /// it from zero when `start_pos` is 0. `None` for models without such state.
    pub state_slot: Option<u32>,
}

pub struct ForwardBatch<'a> {
    pub seqs: Vec<SeqInput<'a>>,
}

impl ForwardBatch<'_> {
    pub fn num_tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.tokens.len()).sum()
    }
}

/// A sequence's grammar mask (see [`crate::guided`]), computed on another thread while the
/// step runs: a backend waits for it only when it is about to sample.
pub type MaskSlot = std::sync::OnceLock<Vec<u32>>;

/// How a sequence that wants a token samples it.
pub struct SampleSpec<'a> {
    pub params: &'a SamplingParams,
    pub rng: &'a mut Rng,
    /// The tokens its grammar allows, when it has one.
    pub mask: Option<&'a MaskSlot>,
}

impl SampleSpec<'_> {
    /// The allowed-token bitmask, waiting for it if it is still being computed.
    pub fn mask(&self) -> Option<&[u32]> {
        self.mask.map(|m| m.wait().as_slice())
    }

    /// Whether anything changes the logits before sampling (a bias or a mask).
    pub fn constrained(&self) -> bool {
        self.mask.is_some() || !self.params.logit_bias.is_empty()
    }

    /// Samples from a row of logits after the request's bias and mask.
    pub fn sample(&mut self, logits: &[f32]) -> Sampled {
        if !self.constrained() {
            return sample(logits, self.params, self.rng);
        }
        let mut l = logits.to_vec();
        crate::sampler::constrain(&mut l, &self.params.logit_bias, self.mask());
        sample(&l, self.params, self.rng)
    }
}

pub trait Backend: Send {
    /// Where it runs, for logs and metrics: "cpu", "cuda:0", "sim".
    fn device(&self) -> String;

    /// KV blocks the backend allocated.
    fn num_blocks(&self) -> usize;

    /// Recurrent-state slots the backend allocated beside its KV blocks: one is held by each
    /// running sequence of a model whose layers carry a fixed-size state from step to step
    /// (Qwen3.5's linear-attention layers), so the engine admits no more sequences than
    /// there are slots. 0 for a model without such layers. A model with them cannot resume
    /// a sequence from cached KV blocks alone: it resumes only at a block boundary whose
    /// state was saved ([`Self::num_state_snapshots`]).
    fn num_state_slots(&self) -> usize {
        0
    }

    /// Slots beyond [`Self::num_state_slots`] (ids `num_state_slots..num_state_slots + n`)
    /// that hold saved states for the prefix cache: the state after a block boundary of some
    /// sequence, copied there by [`Self::copy_state`], so that a later sequence with the same
    /// prefix resumes from the cached blocks and that state. 0 where the backend keeps none
    /// (prefix caching is then off for a model with recurrent state).
    fn num_state_snapshots(&self) -> usize {
        0
    }

    /// A slot's recurrent state, every layer's, to move it to another engine of the same
    /// model (disaggregated prefill and decode).
    fn read_state(&mut self, slot: u32) -> Result<Vec<f32>> {
        Err(cannot(self.device(), Capability::ReadState { slot }))
    }

    /// Sets a slot's recurrent state to what [`Self::read_state`] gave on another engine of
    /// the same model; refuses a state of another size.
    fn write_state(&mut self, slot: u32, state: &[f32]) -> Result<()> {
        let values = state.len();
        Err(cannot(
            self.device(),
            Capability::WriteState { slot, values },
        ))
    }

    /// Copies every layer's recurrent state from slot `from` to slot `to` (either kind of
    /// slot), in order with the steps around it: a step after the call sees the copy.
    fn copy_state(&mut self, from: u32, to: u32) -> Result<()> {
        Err(cannot(self.device(), Capability::CopyState { from, to }))
    }

    /// Whether a block's K/V depend on more than its tokens and positions (dynamic RoPE
    /// rotates keys by the sequence's length), which rules out sharing cached blocks between
    /// sequences; the engine then turns prefix caching off.
    fn kv_depends_on_context(&self) -> bool {
        false
    }

    /// The most tokens of one sequence a step may carry, where the backend has such a limit
    /// (the CUDA prefill kernel's grid); the engine caps its per-step token budget at it.
    fn max_step_tokens(&self) -> Option<usize> {
        None
    }

    /// Whether the step's math runs on every host core (the CPU backend): grammar masks
    /// computed beside it would then only take turns with it, plus a hand-off between
    /// threads, so the engine computes them just before the step instead.
    fn occupies_host_cores(&self) -> bool {
        false
    }

    /// A backend that models a step's time rather than spending it (`sim`) can hand the
    /// waiting to its driver: with this on, a step returns at once and [`Self::take_due`]
    /// says how long it takes, so that one timer thread serves thousands of engines instead
    /// of each sleeping on a thread of its own. Whether the backend can.
    fn defer_steps(&mut self) -> bool {
        false
    }

    /// With [`Self::defer_steps`] on: the modelled time of the step just computed.
    fn take_due(&mut self) -> Option<std::time::Duration> {
        None
    }

    /// Next-token logits for each sequence with `want_logits`, in batch order.
    fn forward(&mut self, batch: &ForwardBatch) -> Result<Vec<Vec<f32>>>;

    /// Runs the step and samples; `specs` has one entry per sequence with `want_logits`.
    /// Backends that can sample where the logits live override this.
    fn forward_sample(
        &mut self,
        batch: &ForwardBatch,
        specs: &mut [SampleSpec],
    ) -> Result<Vec<Sampled>> {
        let logits = self.forward(batch)?;
        Ok(sample_all(&logits, specs))
    }

    /// The shape and element type of the KV cache; `None` for a backend that cannot say.
    fn kv_spec(&self) -> Option<KvSpec> {
        None
    }

    /// The KV pool, when it lives in host memory where a transfer can read and write blocks
    /// directly while the engine runs (`cpu`, `sim`). `None`: this backend cannot take part
    /// in KV transfers.
    fn host_kv(&self) -> Option<Arc<HostKvPool>> {
        None
    }

    /// The KV cache in device memory, as a transfer to or from another engine of this process
    /// addresses it (copies on the device, no host staging). `None`: host memory, or a
    /// backend that cannot.
    fn device_kv(&self) -> Option<Arc<crate::device_kv::DeviceKvPool>> {
        None
    }

    /// For a backend whose KV is not in host memory (`host_kv` is `None`): whether it can
    /// copy K and V to and from a host pool of the same shape, so that transfers go through
    /// host staging buffers.
    fn kv_staging(&self) -> bool {
        false
    }

    /// Copies K and V of `positions` (every layer) from the sequence whose blocks are `table`
    /// into a host pool, at the same positions of `dst_table`. Only those positions' bytes
    /// are written: a transfer may be reading the positions before them.
    fn kv_to_host(
        &mut self,
        _table: &[BlockId],
        _positions: std::ops::Range<usize>,
        _dst: &HostKvPool,
        _dst_table: &[BlockId],
    ) -> Result<()> {
        Err(cannot(self.device(), Capability::KvToHost))
    }

    /// The reverse of `kv_to_host`: K and V of `positions` from a host pool into the
    /// sequence's blocks. Whole blocks may be written; `positions` starts on a block boundary
    /// and the blocks past its end hold nothing yet.
    fn kv_from_host(
        &mut self,
        _src: &HostKvPool,
        _src_table: &[BlockId],
        _positions: std::ops::Range<usize>,
        _table: &[BlockId],
    ) -> Result<()> {
        Err(cannot(self.device(), Capability::KvFromHost))
    }

    /// Like `forward_sample`, and calls `kv_ready(layer)` once that layer's K and V of every
    /// token in the batch are in the cache, so a transfer can send a layer while the next
    /// ones compute. This default reports every layer after the whole step.
    fn forward_sample_streaming(
        &mut self,
        batch: &ForwardBatch,
        specs: &mut [SampleSpec],
        kv_ready: &(dyn Fn(usize) + Sync),
    ) -> Result<Vec<Sampled>> {
        let out = self.forward_sample(batch, specs)?;
        for layer in 0..self.kv_spec().map_or(0, |s| s.num_layers) {
            kv_ready(layer);
        }
        Ok(out)
    }
}

/// A backend's refusals into the engine's error (`EngineError::Backend`): from
/// [`BackendError`] and from each of its families, so a site writes
/// `Err(BatchError::ZeroBlockSize.into())` or `?`.
macro_rules! into_engine_error {
    ($($family:ty),*) => {$(
        impl From<$family> for crate::error::EngineError {
            fn from(e: $family) -> crate::error::EngineError {
                crate::error::EngineError::Backend(e.into())
            }
        }
    )*};
}

into_engine_error!(
    BackendError,
    error::ToolchainError,
    error::ModelRefusal,
    error::Fp8Refusal,
    error::MemoryError,
    error::BatchError,
    error::LaunchError,
    error::KvCopyError,
    error::StateError,
    error::GreenContextError,
    error::SimError
);

/// What a backend on `device` without `what` says.
fn cannot(device: String, what: Capability) -> crate::error::EngineError {
    BackendError::Cannot {
        backend: device,
        what,
    }
    .into()
}

/// Samples one token per row of logits.
pub(crate) fn sample_all(logits: &[Vec<f32>], specs: &mut [SampleSpec]) -> Vec<Sampled> {
    logits
        .iter()
        .zip(specs.iter_mut())
        .map(|(l, s)| s.sample(l))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pdl_auto_is_on_for_the_sizes_it_was_measured_to_help() {
        // The measured shapes: 0.99 and 2.47 GB gained, 15.1 GB lost.
        assert!(Pdl::Auto.enabled(988_000_000));
        assert!(Pdl::Auto.enabled(2_472_000_000));
        assert!(!Pdl::Auto.enabled(15_137_000_000));
        assert!(Pdl::On.enabled(15_137_000_000));
        assert!(!Pdl::Off.enabled(1));
        assert_eq!(CudaOptions::device(0).pdl, Pdl::Auto);
        assert_eq!("on".parse::<Pdl>(), Ok(Pdl::On));
        assert_eq!("off".parse::<Pdl>(), Ok(Pdl::Off));
        assert_eq!("auto".parse::<Pdl>(), Ok(Pdl::Auto));
        let e = "yes".parse::<Pdl>().unwrap_err();
        assert_eq!(e, UnknownPdl("yes".into()));
        let e = e.to_string();
        assert!(e.contains("`yes`") && e.contains("auto, on or off"), "{e}");
    }
}
