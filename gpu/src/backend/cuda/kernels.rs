//! The kernels of `kernels/*.cu`, one typed launch each.
//!
//! Each kernel has a struct naming its arguments and a `launch` that looks the function up,
//! builds the grid, checks that every buffer holds what the grid touches and pushes the
//! arguments in the kernel's order, in one `unsafe` block. A kernel's argument list is
//! written once, here, so a change to its signature in `kernels/*.cu` has one place to follow.
//!
//! What the host cannot check from lengths alone, the indices inside the buffers (token ids,
//! cache slots, block tables), was checked when the batch was laid out (`batch::build`), or
//! is a decode graph's padding, which points at the scratch block (`graphs`).

use std::sync::Arc;

use cudarc::driver::sys::CUresult;
use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, CudaView, DriverError};
use cudarc::nvrtc::Ptx;

use super::buffers::{StepDims, StepInputs};
use super::device::drv;
use super::launch::{Launch, Null};
use super::ptx_cache;
use super::shapes::{self, grid, KernelShape};
use crate::backend::error::{BackendError, LaunchError, ToolchainError};
use crate::config::ModelConfig;
use crate::error::{EngineError, Result};

/// The kernels' source, compiled by NVRTC on first use and then cached (see `ptx_cache`):
/// one file per family, joined into one translation unit (one module, one compile, one
/// cache entry) after the shared definitions.
pub const KERNELS_CU: &str = concat!(
    include_str!("kernels/common.cuh"),
    include_str!("kernels/layers.cu"),
    include_str!("kernels/attention_decode.cu"),
    include_str!("kernels/attention_prefill.cu"),
    include_str!("kernels/sampling.cu"),
    include_str!("kernels/delta.cu"),
    include_str!("kernels/skinny.cu"),
    include_str!("kernels/hybrid.cu"),
    include_str!("kernels/fp8.cu"),
    include_str!("kernels/kv_copy.cu"),
);

/// The compiled module's functions.
pub struct Kernels {
    embed_gather: CudaFunction,
    rmsnorm: CudaFunction,
    add_rmsnorm: CudaFunction,
    bias_add: CudaFunction,
    rope_kv_write: CudaFunction,
    attention_decode: CudaFunction,
    /// `paged_attention_decode_d*`, by head dimension.
    attention_decode_vec: Vec<(usize, CudaFunction)>,
    attention_prefill: CudaFunction,
    /// `paged_attention_prefill_mma_d*`, by head dimension.
    attention_prefill_mma: Vec<(usize, CudaFunction)>,
    silu_mul: CudaFunction,
    silu_mul_bf16: CudaFunction,
    gather_rows: CudaFunction,
    sample_rows: CudaFunction,
    constrain_rows: CudaFunction,
    /// Gated DeltaNet's (see `delta`).
    pub(super) delta_conv: CudaFunction,
    pub(super) gated_delta: CudaFunction,
    /// The scan path of steps with prompts (`CudaOptions::gdn_scan`).
    pub(super) delta_conv_chunks: CudaFunction,
    pub(super) delta_conv_window: CudaFunction,
    pub(super) delta_qk_gates: CudaFunction,
    pub(super) delta_scan: CudaFunction,
    pub(super) delta_gated_norm: CudaFunction,
    /// The chunked form's two (`CudaOptions::gdn_chunked`).
    pub(super) delta_chunk_prep: CudaFunction,
    pub(super) delta_chunk_scan: CudaFunction,
    /// `skinny_gemm_m*`, by the most rows each takes.
    pub(super) skinny: Vec<(usize, CudaFunction)>,
    /// `skinny_silu_m*`, likewise.
    pub(super) skinny_silu: Vec<(usize, CudaFunction)>,
    /// `skinny_norm_m*` and `skinny_norm_silu_m*`, likewise.
    pub(super) skinny_norm: Vec<(usize, CudaFunction)>,
    pub(super) skinny_norm_silu: Vec<(usize, CudaFunction)>,
    /// `skinny_rope_m*` and `skinny_norm_rope_m*`, likewise.
    pub(super) skinny_rope: Vec<(usize, CudaFunction)>,
    pub(super) skinny_norm_rope: Vec<(usize, CudaFunction)>,
    /// Qwen3.5's gated attention (`kernels/hybrid.cu`).
    pub(super) gated_rope_kv_write: CudaFunction,
    pub(super) gate_sigmoid_mul: CudaFunction,
    /// FP8 linear layers (`kernels/fp8.cu`, launched by `fp8_gemm`).
    pub(super) fp8: Fp8Kernels,
    /// The in-process KV handover's copy (`kernels/kv_copy.cu`, launched by `handover`).
    pub(super) kv_copy: CudaFunction,
    /// Whether launches carry programmatic dependent launch (`launch`): on Hopper and later
    /// by default, off with `CudaOptions::pdl` false.
    pub pdl: bool,
}

impl Kernels {
    /// Compiles the kernels (`kernels/*.cu`) for the device's architecture (or reads the cached PTX) and
    /// loads it. Returns the kernels and the architecture they were built for.
    pub fn load(ctx: &Arc<CudaContext>) -> Result<(Kernels, String)> {
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| drv("compute capability query", e))?;
        let (min_major, min_minor) = shapes::MIN_COMPUTE_CAPABILITY;
        if (major, minor) < (min_major, min_minor) {
            return Err(ToolchainError::Capability {
                major,
                minor,
                need_major: min_major,
                need_minor: min_minor,
            }
            .into());
        }
        let arch = ptx_cache::arch_for(major, minor);
        let ptx = ptx_cache::load_or_compile(KERNELS_CU, &arch)?;
        let isa = ptx_cache::ptx_isa(&ptx).unwrap_or("?").to_string();
        let module = ctx.load_module(Ptx::from_src(ptx)).map_err(|e| {
            if e.0 == CUresult::CUDA_ERROR_UNSUPPORTED_PTX_VERSION {
                // A newer NVRTC than the driver: the PTX names an ISA the driver predates.
                ToolchainError::PtxIsa {
                    isa,
                    nvrtc: ptx_cache::nvrtc_version(),
                }
                .into()
            } else {
                drv("loading the compiled kernels", e)
            }
        })?;
        let f = |k: KernelShape| {
            module
                .load_function(k.name)
                .map_err(|e| drv(&format!("kernel `{}` lookup", k.name), e))
        };
        let by_size = |ks: &[(usize, KernelShape)]| {
            ks.iter()
                .map(|&(d, k)| f(k).map(|func| (d, func)))
                .collect::<Result<Vec<_>>>()
        };
        let k = Kernels {
            embed_gather: f(shapes::EMBED)?,
            rmsnorm: f(shapes::RMSNORM)?,
            add_rmsnorm: f(shapes::ADD_RMSNORM)?,
            bias_add: f(shapes::BIAS_ADD)?,
            rope_kv_write: f(shapes::ROPE_KV_WRITE)?,
            attention_decode: f(shapes::ATTENTION_DECODE)?,
            attention_prefill: f(shapes::ATTENTION_PREFILL)?,
            attention_decode_vec: by_size(&shapes::ATTENTION_DECODE_VEC)?,
            attention_prefill_mma: by_size(&shapes::ATTENTION_PREFILL_MMA)?,
            silu_mul: f(shapes::SILU_MUL)?,
            silu_mul_bf16: f(shapes::SILU_MUL_BF16)?,
            gather_rows: f(shapes::GATHER_ROWS)?,
            sample_rows: f(shapes::SAMPLE_ROWS)?,
            constrain_rows: f(shapes::CONSTRAIN_ROWS)?,
            delta_conv: f(shapes::DELTA_CONV)?,
            gated_delta: f(shapes::GATED_DELTA)?,
            delta_conv_chunks: f(shapes::DELTA_CONV_CHUNKS)?,
            delta_conv_window: f(shapes::DELTA_CONV_WINDOW)?,
            delta_qk_gates: f(shapes::DELTA_QK_GATES)?,
            delta_scan: f(shapes::DELTA_SCAN)?,
            delta_gated_norm: f(shapes::DELTA_GATED_NORM)?,
            delta_chunk_prep: f(shapes::DELTA_CHUNK_PREP)?,
            delta_chunk_scan: f(shapes::DELTA_CHUNK_SCAN)?,
            skinny: by_size(&shapes::SKINNY_GEMM)?,
            skinny_silu: by_size(&shapes::SKINNY_SILU)?,
            skinny_norm: by_size(&shapes::SKINNY_NORM)?,
            skinny_norm_silu: by_size(&shapes::SKINNY_NORM_SILU)?,
            skinny_rope: by_size(&shapes::SKINNY_ROPE)?,
            skinny_norm_rope: by_size(&shapes::SKINNY_NORM_ROPE)?,
            gated_rope_kv_write: f(shapes::GATED_ROPE_KV_WRITE)?,
            gate_sigmoid_mul: f(shapes::GATE_SIGMOID_MUL)?,
            fp8: Fp8Kernels {
                gemv_block: by_size(&shapes::FP8_GEMV_BLOCK)?,
                gemv_channel: by_size(&shapes::FP8_GEMV_CHANNEL)?,
                quant: f(shapes::FP8_QUANT)?,
                out: f(shapes::FP8_OUT)?,
                mma: [by_size(&shapes::FP8_MMA[0])?, by_size(&shapes::FP8_MMA[1])?],
                fused: Fp8Fused {
                    silu: [
                        by_size(&shapes::FP8_SILU[0])?,
                        by_size(&shapes::FP8_SILU[1])?,
                    ],
                    rope: [
                        by_size(&shapes::FP8_ROPE[0])?,
                        by_size(&shapes::FP8_ROPE[1])?,
                    ],
                    norm: [
                        by_size(&shapes::FP8_NORM[0])?,
                        by_size(&shapes::FP8_NORM[1])?,
                    ],
                    norm_silu: [
                        by_size(&shapes::FP8_NORM_SILU[0])?,
                        by_size(&shapes::FP8_NORM_SILU[1])?,
                    ],
                    norm_rope: [
                        by_size(&shapes::FP8_NORM_ROPE[0])?,
                        by_size(&shapes::FP8_NORM_ROPE[1])?,
                    ],
                },
            },
            kv_copy: f(shapes::KV_COPY)?,
            pdl: major >= 9,
        };
        Ok((k, arch))
    }
}

/// `kernels/fp8.cu`'s functions.
pub(super) struct Fp8Kernels {
    /// `fp8_gemv_block_m*` and `fp8_gemv_channel_m*`, by the most rows each takes.
    pub gemv_block: Vec<(usize, CudaFunction)>,
    pub gemv_channel: Vec<(usize, CudaFunction)>,
    pub quant: CudaFunction,
    pub out: CudaFunction,
    /// `fp8_mma_block_n*` and `fp8_mma_channel_n*`, by the most rows each takes.
    pub mma: [Vec<(usize, CudaFunction)>; 2],
    /// The fused forms (`skinny::SkinnyGemm` launches them).
    pub fused: Fp8Fused,
}

/// `fp8_silu_*`, `fp8_rope_*`, `fp8_norm_*`, `fp8_norm_silu_*` and `fp8_norm_rope_*`:
/// block-scaled, then a scale per row, each by the most rows it takes.
pub(super) struct Fp8Fused {
    pub silu: [Vec<(usize, CudaFunction)>; 2],
    pub rope: [Vec<(usize, CudaFunction)>; 2],
    pub norm: [Vec<(usize, CudaFunction)>; 2],
    pub norm_silu: [Vec<(usize, CudaFunction)>; 2],
    pub norm_rope: [Vec<(usize, CudaFunction)>; 2],
}

/// The head layout the per-head kernels index by.
#[derive(Clone, Copy)]
pub struct Heads {
    pub q: usize,
    pub kv: usize,
    pub dim: usize,
}

impl Heads {
    pub fn of(cfg: &ModelConfig) -> Heads {
        Heads {
            q: cfg.num_heads,
            kv: cfg.num_kv_heads,
            dim: cfg.head_dim,
        }
    }

    /// Width of a fused q/k/v row: `q_dim + 2 * kv_dim`.
    pub fn row(&self) -> usize {
        (self.q + 2 * self.kv) * self.dim
    }
}

pub(super) fn failed(kernel: &'static str) -> impl Fn(DriverError) -> EngineError {
    move |e| drv(&format!("{kernel} launch"), e)
}

/// A buffer must hold what the launch's grid touches. A shortfall is a bug on the host side,
/// reported here rather than left to read or write past the allocation on the device.
pub(super) fn holds(
    kernel: &'static str,
    what: &'static str,
    len: usize,
    need: usize,
) -> Result<()> {
    if len < need {
        return Err(LaunchError::Short {
            kernel,
            what,
            len,
            need,
        }
        .into());
    }
    Ok(())
}

/// `out[t] = table[ids[t]]`, widened to f32: the embeddings of `tokens` tokens.
pub struct EmbedGather<'a> {
    pub table: &'a CudaSlice<u16>,
    pub ids: &'a CudaSlice<i32>,
    pub out: &'a mut CudaSlice<f32>,
    pub tokens: usize,
    pub hidden: usize,
}

impl EmbedGather<'_> {
    pub fn launch(self, k: &Kernels, s: &CudaStream) -> Result<()> {
        let n = "embed_gather";
        holds(n, "ids", self.ids.len(), self.tokens)?;
        holds(n, "out", self.out.len(), self.tokens * self.hidden)?;
        let hidden = self.hidden as i32;
        let mut b = Launch::new(s, &k.embed_gather, k.pdl);
        b.arg(self.table).arg(self.ids).arg(self.out).arg(&hidden);
        let cfg = grid(&shapes::EMBED, self.tokens, 1, 1)?;
        // SAFETY: the arguments match `embed_gather`'s signature in order and type; `ids` and
        // `out` hold the grid's `tokens` rows (checked above) and every id is below the
        // table's rows (see the module docs).
        unsafe { b.launch(cfg) }.map_err(failed(n))?;
        Ok(())
    }
}

/// `out = rmsnorm(x) * w` in bf16, over `rows` rows of `hidden`.
pub struct RmsNorm<'a> {
    pub x: &'a CudaSlice<f32>,
    pub w: &'a CudaSlice<f32>,
    pub out: &'a mut CudaSlice<u16>,
    pub rows: usize,
    pub hidden: usize,
    pub eps: f32,
}

impl RmsNorm<'_> {
    pub fn launch(self, k: &Kernels, s: &CudaStream) -> Result<()> {
        let n = "rmsnorm_to_bf16";
        holds(n, "x", self.x.len(), self.rows * self.hidden)?;
        holds(n, "w", self.w.len(), self.hidden)?;
        holds(n, "out", self.out.len(), self.rows * self.hidden)?;
        let hidden = self.hidden as i32;
        let mut b = Launch::new(s, &k.rmsnorm, k.pdl);
        b.arg(self.x)
            .arg(self.w)
            .arg(self.out)
            .arg(&hidden)
            .arg(&self.eps);
        let cfg = grid(&shapes::RMSNORM, self.rows, 1, 1)?;
        // SAFETY: the arguments match `rmsnorm_to_bf16`'s signature in order and type, and
        // every buffer holds the grid's rows (checked above).
        unsafe { b.launch(cfg) }.map_err(failed(n))?;
        Ok(())
    }
}

/// `residual += delta`, then `out = rmsnorm(residual) * w` in bf16: a residual add fused
/// with the norm that follows it.
pub struct AddRmsNorm<'a> {
    pub residual: &'a mut CudaSlice<f32>,
    pub delta: &'a CudaSlice<f32>,
    pub w: &'a CudaSlice<f32>,
    pub out: &'a mut CudaSlice<u16>,
    pub rows: usize,
    pub hidden: usize,
    pub eps: f32,
}

impl AddRmsNorm<'_> {
    pub fn launch(self, k: &Kernels, s: &CudaStream) -> Result<()> {
        let n = "add_rmsnorm_to_bf16";
        let need = self.rows * self.hidden;
        holds(n, "residual", self.residual.len(), need)?;
        holds(n, "delta", self.delta.len(), need)?;
        holds(n, "w", self.w.len(), self.hidden)?;
        holds(n, "out", self.out.len(), need)?;
        let hidden = self.hidden as i32;
        let mut b = Launch::new(s, &k.add_rmsnorm, k.pdl);
        b.arg(self.residual)
            .arg(self.delta)
            .arg(self.w)
            .arg(self.out)
            .arg(&hidden)
            .arg(&self.eps);
        let cfg = grid(&shapes::ADD_RMSNORM, self.rows, 1, 1)?;
        // SAFETY: the arguments match `add_rmsnorm_to_bf16`'s signature in order and type,
        // and every buffer holds the grid's rows (checked above).
        unsafe { b.launch(cfg) }.map_err(failed(n))?;
        Ok(())
    }
}

/// `y[r, c] += bias[c]` over `rows` rows of `cols`.
pub struct BiasAdd<'a> {
    pub y: &'a mut CudaSlice<f32>,
    pub bias: &'a CudaSlice<f32>,
    pub rows: usize,
    pub cols: usize,
}

impl BiasAdd<'_> {
    pub fn launch(self, k: &Kernels, s: &CudaStream) -> Result<()> {
        let n = "bias_add";
        holds(n, "y", self.y.len(), self.rows * self.cols)?;
        holds(n, "bias", self.bias.len(), self.cols)?;
        let cols = self.cols as i32;
        let cfg = grid(&shapes::BIAS_ADD, self.rows, 1, 1)?;
        let mut b = Launch::new(s, &k.bias_add, k.pdl);
        b.arg(self.y).arg(self.bias).arg(&cols);
        // SAFETY: the arguments match `bias_add`'s signature in order and type; the grid's
        // `rows` rows of `cols` fit y, and the bias holds `cols` (checked above).
        unsafe { b.launch(cfg) }.map_err(failed(n))?;
        Ok(())
    }
}

/// Rotates q and k by each token's position, in place, and writes k and v into the cache
/// slots of `inputs.slots`; first, with `norms` (Qwen3's q and k weights and epsilon), an
/// RMS norm over each q and k head.
pub struct RopeKvWrite<'a> {
    pub qkv: &'a mut CudaSlice<f32>,
    pub norms: Option<(&'a CudaSlice<f32>, &'a CudaSlice<f32>, f32)>,
    pub inputs: &'a StepInputs,
    pub inv_freq: &'a CudaSlice<f32>,
    pub k_cache: &'a mut CudaSlice<u16>,
    pub v_cache: &'a mut CudaSlice<u16>,
    pub tokens: usize,
    pub heads: Heads,
}

impl RopeKvWrite<'_> {
    pub fn launch(self, k: &Kernels, s: &CudaStream) -> Result<()> {
        let n = "rope_kv_write";
        let h = self.heads;
        holds(n, "qkv", self.qkv.len(), self.tokens * h.row())?;
        holds(n, "positions", self.inputs.positions.len(), self.tokens)?;
        holds(n, "slots", self.inputs.slots.len(), self.tokens)?;
        holds(n, "inv_freq", self.inv_freq.len(), h.dim / 2)?;
        let (row, nq, nkv, d) = (h.row() as i32, h.q as i32, h.kv as i32, h.dim as i32);
        let mut b = Launch::new(s, &k.rope_kv_write, k.pdl);
        b.arg(self.qkv)
            .arg(&self.inputs.positions)
            .arg(self.inv_freq)
            .arg(&self.inputs.slots)
            .arg(self.k_cache)
            .arg(self.v_cache);
        let eps = self.norms.map_or(0.0f32, |(_, _, eps)| eps);
        match self.norms {
            Some((q_w, k_w, _)) => {
                holds(n, "q_w", q_w.len(), h.dim)?;
                holds(n, "k_w", k_w.len(), h.dim)?;
                b.arg(q_w).arg(k_w);
            }
            None => {
                b.arg(Null).arg(Null);
            }
        }
        b.arg(&eps);
        b.arg(&row).arg(&nq).arg(&nkv).arg(&d);
        let per_block = shapes::ROPE_KV_WRITE.threads as usize / 32;
        let cfg = grid(
            &shapes::ROPE_KV_WRITE,
            self.tokens,
            (h.q + h.kv).div_ceil(per_block),
            1,
        )?;
        // SAFETY: the arguments match `rope_kv_write`'s signature in order and type (the
        // norm weights both given or both null); the per-token arrays hold the grid's tokens
        // and the norms a head (checked above), and every slot is inside the cache (see the
        // module docs).
        unsafe { b.launch(cfg) }.map_err(failed(n))?;
        Ok(())
    }
}

/// Paged attention of every query in the step over its sequence's cached keys and values.
/// One launch for both kernels: a pure decode step (one query per sequence) runs
/// `paged_attention_decode`; anything else `paged_attention_prefill`, which also reads each
/// query's position.
pub struct Attention<'a> {
    /// The step's queries: row `t` at `t * q_row`, head `h` at `h * head_dim` within it.
    pub qkv: &'a CudaSlice<f32>,
    /// The stride of `qkv`'s rows: `heads.row()` when they hold q, k and v (the dense
    /// layers), `q_dim` for queries alone (Qwen3.5's gated layers).
    pub q_row: usize,
    pub inputs: &'a StepInputs,
    pub dims: &'a StepDims,
    pub k_cache: &'a CudaSlice<u16>,
    pub v_cache: &'a CudaSlice<u16>,
    pub out: &'a mut CudaSlice<u16>,
    /// A split decode's partials (`Workspace::part`).
    pub part: &'a mut CudaSlice<f32>,
    /// A split decode's tickets, one per (sequence, q head), zero between steps
    /// (`Workspace::ticks`).
    pub ticks: &'a mut CudaSlice<i32>,
    /// Splits of each history for a decode step with a 16-byte kernel for the head size
    /// (`shapes::decode_splits`), 1 for none; ignored by every other step.
    pub splits: usize,
    pub heads: Heads,
    pub block_size: usize,
    pub scale: f32,
    /// The layer's sliding window; `None` attends over the whole sequence.
    pub window: Option<usize>,
}

impl Attention<'_> {
    pub fn launch(self, k: &Kernels, s: &CudaStream) -> Result<()> {
        let (h, dims, inp) = (self.heads, self.dims, self.inputs);
        let decode = dims.max_query_len == 1;
        // The kernels built for the head dimension (decode reading 16 bytes a lane, prefill
        // on the tensor cores) where there is one; the general ones otherwise.
        let family: &[(usize, KernelShape)] = if decode {
            &shapes::ATTENTION_DECODE_VEC
        } else {
            &shapes::ATTENTION_PREFILL_MMA
        };
        let special = family.iter().position(|&(d, _)| d == h.dim);
        let n = match (decode, special) {
            (_, Some(i)) => family[i].1.name,
            (true, None) => "paged_attention_decode",
            (false, None) => "paged_attention_prefill",
        };
        holds(n, "qkv", self.qkv.len(), dims.tokens * self.q_row)?;
        holds(n, "out", self.out.len(), dims.tokens * h.q * h.dim)?;
        if self.q_row < h.q * h.dim {
            return Err(LaunchError::QueryRows {
                kernel: n,
                q_row: self.q_row,
                heads: h.q,
                dim: h.dim,
            }
            .into());
        }
        holds(n, "positions", inp.positions.len(), dims.tokens)?;
        holds(n, "seq_starts", inp.seq_starts.len(), dims.seqs + 1)?;
        holds(n, "seq_lens", inp.seq_lens.len(), dims.seqs)?;
        holds(n, "tables", inp.tables.len(), dims.seqs * dims.max_blocks)?;
        let (row, max_blocks) = (self.q_row as i32, dims.max_blocks as i32);
        let (nq, nkv, d, bs) = (
            h.q as i32,
            h.kv as i32,
            h.dim as i32,
            self.block_size as i32,
        );
        // 0: the layer attends over the whole sequence.
        let window = self.window.map_or(0, |w| w.min(i32::MAX as usize) as i32);
        let splits = if decode && special.is_some() {
            self.splits.clamp(1, shapes::MAX_DECODE_SPLITS)
        } else {
            1
        };
        if splits > 1 {
            holds(
                n,
                "part",
                self.part.len(),
                dims.seqs * h.q * splits * (h.dim + 2),
            )?;
            holds(n, "ticks", self.ticks.len(), dims.seqs * h.q)?;
        }
        let (f, cfg) = if let (true, Some(i)) = (decode, special) {
            (
                &k.attention_decode_vec[i].1,
                grid(&family[i].1, dims.seqs, h.q, splits)?,
            )
        } else if decode {
            (
                &k.attention_decode,
                grid(&shapes::ATTENTION_DECODE, dims.seqs, h.q, 1)?,
            )
        } else if let Some(i) = special {
            let tiles = dims.max_query_len.div_ceil(shapes::PREFILL_MMA_ROWS);
            (
                &k.attention_prefill_mma[i].1,
                grid(&family[i].1, dims.seqs, h.q, tiles)?,
            )
        } else {
            let tiles = dims
                .max_query_len
                .div_ceil(shapes::PREFILL_QUERIES_PER_BLOCK);
            (
                &k.attention_prefill,
                grid(&shapes::ATTENTION_PREFILL, dims.seqs, h.q, tiles)?,
            )
        };
        let mut b = Launch::new(s, f, k.pdl);
        b.arg(self.qkv).arg(&row);
        if !decode {
            b.arg(&inp.positions);
        }
        b.arg(&inp.seq_starts)
            .arg(&inp.seq_lens)
            .arg(&inp.tables)
            .arg(&max_blocks)
            .arg(self.k_cache)
            .arg(self.v_cache)
            .arg(&mut *self.out);
        if decode {
            b.arg(&mut *self.part).arg(&mut *self.ticks);
        }
        b.arg(&nq)
            .arg(&nkv)
            .arg(&d)
            .arg(&bs)
            .arg(&self.scale)
            .arg(&window);
        // SAFETY: the arguments match the chosen kernel's signature in order and type (the
        // prefill kernels share one, the decode kernels another, without `positions` and with
        // `part` and `ticks`); the per-token and per-sequence arrays hold what the grid reads
        // (checked above), `part` every split's partial and `ticks` a counter per (sequence,
        // head) when there are several splits, and the tables name only blocks inside the
        // cache (see the module docs).
        unsafe { b.launch(cfg) }.map_err(failed(n))?;
        Ok(())
    }
}

/// `out = silu(gate) * up` in bf16, from `[rows, 2 * inter]` rows holding gate then up.
pub struct SiluMul<'a> {
    pub gate_up: &'a CudaSlice<f32>,
    pub out: &'a mut CudaSlice<u16>,
    pub rows: usize,
    pub inter: usize,
}

impl SiluMul<'_> {
    pub fn launch(self, k: &Kernels, s: &CudaStream) -> Result<()> {
        let n = "silu_mul";
        holds(n, "gate_up", self.gate_up.len(), self.rows * 2 * self.inter)?;
        holds(n, "out", self.out.len(), self.rows * self.inter)?;
        let inter = self.inter as i32;
        // silu_mul's SILU_MUL_COLS: 4 columns a thread where whole rows are 16-byte aligned.
        let cols = if self.inter.is_multiple_of(4) { 4 } else { 1 };
        let chunks = self.inter.div_ceil(cols * shapes::SILU_MUL.threads as usize);
        let cfg = grid(&shapes::SILU_MUL, self.rows, chunks, 1)?;
        let mut b = Launch::new(s, &k.silu_mul, k.pdl);
        b.arg(self.gate_up).arg(self.out).arg(&inter);
        // SAFETY: the arguments match `silu_mul`'s signature in order and type, both buffers
        // hold the grid's `rows` rows (checked above), and its 16-byte loads (inter a
        // multiple of 4) start on 16-byte boundaries of 256-byte aligned buffers.
        unsafe { b.launch(cfg) }.map_err(failed(n))?;
        Ok(())
    }
}

/// `SiluMul` from bf16 products (`silu_mul_bf16`): `inter` a multiple of
/// `SILU_MUL_BF16_COLS`.
pub struct SiluMulBf16<'a> {
    pub gate_up: &'a CudaView<'a, u16>,
    pub out: &'a mut CudaSlice<u16>,
    pub rows: usize,
    pub inter: usize,
}

/// The columns a thread of `silu_mul_bf16` takes.
pub const SILU_MUL_BF16_COLS: usize = 8;

impl SiluMulBf16<'_> {
    pub fn launch(self, k: &Kernels, s: &CudaStream) -> Result<()> {
        let n = "silu_mul_bf16";
        if !self.inter.is_multiple_of(SILU_MUL_BF16_COLS) {
            return Err(BackendError::Invariant(
                "silu_mul_bf16 over a width that is no multiple of 8",
            )
            .into());
        }
        holds(n, "gate_up", self.gate_up.len(), self.rows * 2 * self.inter)?;
        holds(n, "out", self.out.len(), self.rows * self.inter)?;
        let inter = i32::try_from(self.inter).map_err(|_| LaunchError::Over32Bits {
            kernel: n,
            what: "inter",
        })?;
        let per_block = shapes::SILU_MUL_BF16.threads as usize * SILU_MUL_BF16_COLS;
        let cfg = grid(
            &shapes::SILU_MUL_BF16,
            self.rows,
            self.inter.div_ceil(per_block),
            1,
        )?;
        let mut b = Launch::new(s, &k.silu_mul_bf16, k.pdl);
        b.arg(self.gate_up).arg(self.out).arg(&inter);
        // SAFETY: the arguments match `silu_mul_bf16`'s signature in order and type, both
        // buffers hold the grid's `rows` rows (checked above), and with `inter` a multiple of
        // 8 every 16-byte access starts on a 16-byte boundary of a 256-byte aligned buffer.
        unsafe { b.launch(cfg) }.map_err(failed(n))?;
        Ok(())
    }
}

/// `dst[i] = src[rows[i]]` for `n` bf16 rows of `cols`: the rows that want logits.
pub struct GatherRows<'a> {
    pub src: &'a CudaSlice<u16>,
    pub rows: &'a CudaSlice<i32>,
    pub dst: &'a mut CudaSlice<u16>,
    pub n: usize,
    pub cols: usize,
}

impl GatherRows<'_> {
    pub fn launch(self, k: &Kernels, s: &CudaStream) -> Result<()> {
        let name = "gather_rows_bf16";
        holds(name, "rows", self.rows.len(), self.n)?;
        holds(name, "dst", self.dst.len(), self.n * self.cols)?;
        let cols = self.cols as i32;
        let mut b = Launch::new(s, &k.gather_rows, k.pdl);
        b.arg(self.src).arg(self.rows).arg(self.dst).arg(&cols);
        let cfg = grid(&shapes::GATHER_ROWS, self.n, 1, 1)?;
        // SAFETY: the arguments match `gather_rows_bf16`'s signature in order and type;
        // `rows` and `dst` hold the grid's `n` rows (checked above) and every row index is a
        // token of the step, inside `src` (see the module docs).
        unsafe { b.launch(cfg) }.map_err(failed(name))?;
        Ok(())
    }
}

/// One token and its logprob per row of logits, drawn with each row's own temperature,
/// top-k, top-p and uniform (a temperature of 0 is greedy).
pub struct SampleRows<'a> {
    pub logits: &'a CudaSlice<f32>,
    pub vocab: usize,
    pub temps: CudaView<'a, f32>,
    pub top_k: &'a CudaSlice<i32>,
    pub top_p: CudaView<'a, f32>,
    pub uniforms: CudaView<'a, f32>,
    /// `LogitsSpace::picked`, `2 * cap` long: token ids at `[0, cap)`, the logprobs' bits
    /// at `[cap, 2 cap)`.
    pub picked: &'a mut CudaSlice<i32>,
    pub cap: usize,
    /// Scratch of the first pass's shares, and per-row tickets that are zero between
    /// launches (`LogitsSpace::sample_stats`, `sample_ticks`).
    pub stats: &'a mut CudaSlice<f32>,
    pub ticks: &'a mut CudaSlice<i32>,
    pub rows: usize,
}

impl SampleRows<'_> {
    pub fn launch(self, k: &Kernels, s: &CudaStream) -> Result<()> {
        let n = "sample_rows";
        let rows = self.rows;
        holds(n, "logits", self.logits.len(), rows * self.vocab)?;
        for (what, len) in [
            ("temps", self.temps.len()),
            ("top_k", self.top_k.len()),
            ("top_p", self.top_p.len()),
            ("uniforms", self.uniforms.len()),
            ("picked rows", self.cap),
            ("ticks", self.ticks.len()),
        ] {
            holds(n, what, len, rows)?;
        }
        holds(n, "picked", self.picked.len(), 2 * self.cap)?;
        let cap = self.cap;
        // Both halves of one buffer: the kernel writes ids through one, the logprobs (as
        // floats) through the other.
        let (token, logprob) = (self.picked.slice(0..cap), self.picked.slice(cap..2 * cap));
        let chunks = shapes::sample_chunks(self.vocab);
        holds(n, "stats", self.stats.len(), rows * chunks * 3)?;
        let vocab = self.vocab as i32;
        let mut b = Launch::new(s, &k.sample_rows, k.pdl);
        b.arg(self.logits)
            .arg(&vocab)
            .arg(&self.temps)
            .arg(self.top_k)
            .arg(&self.top_p)
            .arg(&self.uniforms)
            .arg(&token)
            .arg(&logprob)
            .arg(self.stats)
            .arg(self.ticks);
        let cfg = grid(&shapes::SAMPLE_ROWS, rows, chunks, 1)?;
        // SAFETY: the arguments match `sample_rows`'s signature in order and type (the
        // logprobs' half of `picked` is 4-byte words the kernel writes floats to), every
        // buffer holds the grid's rows, and `stats` three floats per row and chunk (checked
        // above).
        unsafe { b.launch(cfg) }.map_err(failed(n))?;
        Ok(())
    }
}

/// `constrain_rows`: rows' logit biases and grammar masks, applied in place.
pub struct ConstrainRows<'a> {
    pub logits: &'a mut CudaSlice<f32>,
    pub vocab: usize,
    /// `rows * words` mask words (zero for rows without a mask).
    pub masks: &'a CudaSlice<u32>,
    pub words: usize,
    pub has_mask: &'a CudaSlice<i32>,
    /// `rows + 1` offsets into `bias_tok` / `bias_val`.
    pub bias_off: &'a CudaSlice<i32>,
    pub bias_tok: &'a CudaSlice<i32>,
    pub bias_val: &'a CudaSlice<f32>,
    pub rows: usize,
}

impl ConstrainRows<'_> {
    pub fn launch(self, k: &Kernels, s: &CudaStream) -> Result<()> {
        let n = "constrain_rows";
        let rows = self.rows;
        holds(n, "logits", self.logits.len(), rows * self.vocab)?;
        holds(n, "masks", self.masks.len(), rows * self.words)?;
        holds(n, "has_mask", self.has_mask.len(), rows)?;
        holds(n, "bias_off", self.bias_off.len(), rows + 1)?;
        if self.words * 32 < self.vocab {
            return Err(LaunchError::MaskWords {
                kernel: n,
                words: self.words,
                vocab: self.vocab,
            }
            .into());
        }
        let (vocab, words) = (self.vocab as i32, self.words as i32);
        let mut b = Launch::new(s, &k.constrain_rows, k.pdl);
        b.arg(self.logits)
            .arg(&vocab)
            .arg(self.masks)
            .arg(&words)
            .arg(self.has_mask)
            .arg(self.bias_off)
            .arg(self.bias_tok)
            .arg(self.bias_val);
        let cfg = grid(&shapes::CONSTRAIN_ROWS, rows, 1, 1)?;
        // SAFETY: the arguments match `constrain_rows`'s signature in order and type; the
        // logits, masks and per-row arrays hold the grid's rows (checked above); bias ids
        // outside the vocabulary are skipped on the device, and the offsets were laid out
        // from the same lists as the ids (`sampling::constraints`).
        unsafe { b.launch(cfg) }.map_err(failed(n))?;
        Ok(())
    }
}
