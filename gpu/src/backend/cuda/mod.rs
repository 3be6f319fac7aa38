//! The CUDA backend, through `cudarc` with the driver, NVRTC and cuBLAS libraries loaded at
//! run time, so building with `--features cuda` needs no CUDA toolkit and a binary built that
//! way still starts (and reports "no CUDA device") on a machine without one.
//!
//! It mirrors the CPU backend's forward pass step for step (`cpu/mod.rs` is the reference):
//! weights live on the device as bf16, the hidden stream stays f32, matrix products go
//! through cuBLAS with bf16 inputs and f32 accumulation, and the rest is the NVRTC-compiled
//! kernels in `kernels.cu`. The KV pool is bf16, per layer
//! `[num_blocks, block_size, num_kv_heads, head_dim]` for K and for V, as on the CPU.
//!
//! Status: written and compiled without a GPU; the kernels compile under NVRTC 13 and the
//! host-side layout is unit-tested, but nothing here has run on a device yet. The first GPU
//! run should compare `forward` against `CpuBackend` on a small checkpoint.
//!
//! Pure decode steps replay one CUDA graph per batch-size bucket (`batch::bucket_for`),
//! captured on first use with fixed input buffers and padded to the bucket; every other step
//! runs eagerly, and `KVMESH_CUDA_GRAPHS=0` turns graphs off (see `run_graph`).
//!
//! Sampling (greedy, temperature, top-k, top-p) runs on the device; only top logprobs fall
//! back to copying logits. Prefill attention is flash-style over the paged cache with 8
//! queries per key tile; a prompt's key traffic is still quadratic over 8, which a
//! tensor-core (mma) version would cut further. Activations are sized for the step's token count, so the
//! scheduler's per-step token budget bounds their memory.

pub mod batch;
pub mod ptx_cache;

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublas::{result as blas_result, sys as blas_sys, CudaBlas};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaGraph, CudaSlice, CudaStream, DevicePtr, DevicePtrMut,
    DriverError, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;

use super::{Backend, ForwardBatch, SampleSpec};
use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::kv_cache::BlockId;
use crate::safetensors::{TensorData, WeightStore};
use crate::sampler::{sample, Sampled};
use batch::BatchLayout;

/// The kernels' source, compiled by NVRTC on first use and then cached (see `ptx_cache`).
const KERNELS_CU: &str = include_str!("kernels.cu");

/// The attention kernels keep one head in fixed-size shared arrays.
const MAX_HEAD_DIM: usize = 256;

const GIB: f64 = (1u64 << 30) as f64;

fn drv(what: &str, e: DriverError) -> EngineError {
    EngineError::Backend(format!("CUDA {what}: {e:?}"))
}

/// Number of CUDA devices, for `--device auto`. 0 when the driver library is not installed
/// or the driver sees no device; an error only when the driver is present but fails.
pub fn device_count() -> Result<usize> {
    // SAFETY: only probes whether libcuda can be opened; nothing is called through it.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Ok(0);
    }
    match CudaContext::device_count() {
        Ok(n) => Ok(n.max(0) as usize),
        Err(DriverError(cudarc::driver::sys::CUresult::CUDA_ERROR_NO_DEVICE)) => Ok(0),
        Err(e) => Err(drv(
            "driver initialisation failed (is the NVIDIA driver loaded?)",
            e,
        )),
    }
}

/// A weight matrix `[out, inp]`, row-major bf16, with an optional f32 bias.
struct DevLinear {
    w: CudaSlice<u16>,
    out: usize,
    inp: usize,
    bias: Option<CudaSlice<f32>>,
}

struct DevLayer {
    input_layernorm: CudaSlice<f32>,
    /// q, k and v stacked: `[q_dim + 2 * kv_dim, hidden]`.
    qkv_proj: DevLinear,
    q_norm: Option<CudaSlice<f32>>,
    k_norm: Option<CudaSlice<f32>>,
    o_proj: DevLinear,
    post_attention_layernorm: CudaSlice<f32>,
    /// gate and up stacked: `[2 * intermediate, hidden]`.
    gate_up_proj: DevLinear,
    down_proj: DevLinear,
}

struct Kernels {
    embed_gather: CudaFunction,
    rmsnorm: CudaFunction,
    add_rmsnorm: CudaFunction,
    bias_add: CudaFunction,
    qk_norm: CudaFunction,
    rope_kv_write: CudaFunction,
    attention_decode: CudaFunction,
    attention_prefill: CudaFunction,
    silu_mul: CudaFunction,
    gather_rows: CudaFunction,
    sample_rows: CudaFunction,
}

/// Activation buffers for up to `tokens` tokens, grown (never shrunk) as steps need, so a
/// steady decode loop allocates nothing.
struct Workspace {
    tokens: usize,
    x: CudaSlice<f32>,
    xn: CudaSlice<u16>,
    qkv: CudaSlice<f32>,
    attn: CudaSlice<u16>,
    tmp: CudaSlice<f32>,
    gate_up: CudaSlice<f32>,
    act: CudaSlice<u16>,
}

/// Buffers for the rows that produce logits.
struct LogitsSpace {
    rows: usize,
    xr: CudaSlice<u16>,
    logits: CudaSlice<f32>,
    token: CudaSlice<i32>,
    logprob: CudaSlice<f32>,
    /// Per-row sampling parameters: temperatures, top_p and uniforms, three runs of `rows`.
    params_f: CudaSlice<f32>,
    top_k: CudaSlice<i32>,
}

/// A step's index arrays on the device, as `batch::BatchLayout` lays them out.
struct StepInputs {
    token_ids: CudaSlice<i32>,
    positions: CudaSlice<i32>,
    slots: CudaSlice<i32>,
    seq_starts: CudaSlice<i32>,
    seq_lens: CudaSlice<i32>,
    tables: CudaSlice<i32>,
    logits_rows: CudaSlice<i32>,
}

/// The sizes `enqueue` launches with; for a graph they are the bucket's, fixed at capture.
struct StepDims {
    tokens: usize,
    seqs: usize,
    /// Row width of `StepInputs::tables`.
    max_blocks: usize,
    max_query_len: usize,
    logits: usize,
}

/// `CudaGraph` holds raw driver handles and so is not `Send`. The backend must be `Send`
/// (the engine moves it to its own thread) and touches a graph only through `&mut self`,
/// one thread at a time, which is all the driver asks: graphs must not be used
/// concurrently, not never from another thread.
struct SendGraph(CudaGraph);

// SAFETY: see above; the graph is never shared, only moved with its owner.
unsafe impl Send for SendGraph {}

/// One decode bucket: the fixed device buffers its graph reads its inputs from (a replay
/// sees whatever was copied into them just before), and the graph once captured.
struct DecodeGraph {
    inputs: StepInputs,
    /// `None` until captured, and again whenever the workspace or logits buffers are
    /// reallocated, since the captured launches hold their old addresses.
    exec: Option<SendGraph>,
}

/// A pure decode step's inputs padded to a bucket of `bucket` sequences with block tables
/// `width` wide, built on the host. The padding sequences each run one token at position 0
/// whose K and V go to the scratch block (one block past the scheduler's pool), and attend
/// over that one slot, so they touch no real sequence's cache; their logits rows are
/// computed and ignored.
#[derive(Debug, PartialEq, Eq)]
struct GraphHostInputs {
    token_ids: Vec<i32>,
    positions: Vec<i32>,
    slots: Vec<i32>,
    seq_starts: Vec<i32>,
    seq_lens: Vec<i32>,
    tables: Vec<i32>,
    logits_rows: Vec<i32>,
}

/// See `GraphHostInputs`. The caller guarantees `layout` is pure decode with every sequence
/// wanting logits, `num_seqs <= bucket` and `max_blocks <= width`.
fn graph_inputs(
    layout: &BatchLayout,
    bucket: usize,
    width: usize,
    scratch_block: i32,
    block_size: usize,
) -> GraphHostInputs {
    let n = layout.num_seqs();
    let pad = |v: &[i32], fill: i32| {
        let mut v = v.to_vec();
        v.resize(bucket, fill);
        v
    };
    let mut tables = vec![scratch_block; bucket * width];
    let mb = layout.max_blocks;
    for s in 0..n {
        tables[s * width..s * width + mb]
            .copy_from_slice(&layout.block_tables[s * mb..(s + 1) * mb]);
    }
    GraphHostInputs {
        token_ids: pad(&layout.token_ids, 0),
        positions: pad(&layout.positions, 0),
        slots: pad(&layout.slot_mapping, scratch_block * block_size as i32),
        seq_starts: (0..=bucket as i32).collect(),
        seq_lens: pad(&layout.seq_lens, 1),
        tables,
        logits_rows: (0..bucket as i32).collect(),
    }
}

pub struct CudaBackend {
    cfg: ModelConfig,
    ordinal: usize,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    k: Kernels,
    embed_tokens: CudaSlice<u16>,
    layers: Vec<DevLayer>,
    norm: CudaSlice<f32>,
    /// `None` when tied to `embed_tokens`.
    lm_head: Option<DevLinear>,
    inv_freq: CudaSlice<f32>,
    k_cache: Vec<CudaSlice<u16>>,
    v_cache: Vec<CudaSlice<u16>>,
    num_blocks: usize,
    block_size: usize,
    ws: Option<Workspace>,
    ls: Option<LogitsSpace>,
    /// Decode graphs by bucket size, captured on first use.
    graphs: HashMap<usize, DecodeGraph>,
    /// Off with `KVMESH_CUDA_GRAPHS=0`, or after a capture failed.
    graphs_enabled: bool,
    /// Block-table width of every graph: enough blocks for the model's context length
    /// (or the whole pool, if smaller). Longer sequences decode eagerly.
    graph_width: usize,
    /// The extra KV block, outside the scheduler's pool, that padding sequences write to.
    scratch_block: i32,
}

/// A checkpoint tensor as bf16 bits: bf16 as stored, f32 (and f16, which the loader widens
/// to f32) rounded to nearest even on the host, so the device holds one format.
fn to_bf16(d: TensorData) -> Vec<u16> {
    match d {
        TensorData::Bf16(v) => v,
        TensorData::F32(v) => v
            .into_iter()
            .map(|x| half::bf16::from_f32(x).to_bits())
            .collect(),
    }
}

fn launch_1d(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, 1 << 16) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn grid(x: usize, y: usize, z: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (x as u32, y as u32, z as u32),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `y[m, n] = x[m, k] · W[n, k]ᵀ (+ beta · y)`, everything row-major, x and W bf16, y f32,
/// accumulated in f32.
///
/// cuBLAS is column-major. A row-major `[r, c]` matrix is the column-major `[c, r]` matrix,
/// its transpose, with leading dimension `c`. So the row-major product `y = x · Wᵀ` is the
/// column-major `yᵀ = W · xᵀ` where, in column-major terms:
///   - `yᵀ` is `[n, m]`, ld `n`: exactly y's memory (C, ldc = n);
///   - `xᵀ` is `[k, m]`, ld `k`: exactly x's memory, used as is (B, op N, ldb = k);
///   - `W` is `[n, k]`, which W's memory holds as the column-major `[k, n]` matrix `Wᵀ`
///     (ld `k`), so A is W's memory with op T (A, op T, lda = k).
///
/// giving `gemm(opA = T, opB = N, m = n, n = m, k = k, A = W, lda = k, B = x, ldb = k,
/// C = y, ldc = n)`.
///
/// # Safety
/// The pointers must be device allocations of at least `n * k` (w), `m * k` (x) and `m * n`
/// (y) elements on the handle's stream's context.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_bf16_f32(
    blas: &CudaBlas,
    m: usize,
    n: usize,
    k: usize,
    x: u64,
    w: u64,
    y: u64,
    beta: f32,
) -> Result<()> {
    let alpha = 1.0f32;
    let (mi, ni, ki) = (
        i32::try_from(m).map_err(|_| too_big("m"))?,
        i32::try_from(n).map_err(|_| too_big("n"))?,
        i32::try_from(k).map_err(|_| too_big("k"))?,
    );
    blas_result::gemm_ex(
        *blas.handle(),
        blas_sys::cublasOperation_t::CUBLAS_OP_T,
        blas_sys::cublasOperation_t::CUBLAS_OP_N,
        ni,
        mi,
        ki,
        &alpha as *const f32 as *const c_void,
        w as *const c_void,
        blas_sys::cudaDataType::CUDA_R_16BF,
        ki,
        x as *const c_void,
        blas_sys::cudaDataType::CUDA_R_16BF,
        ki,
        &beta as *const f32 as *const c_void,
        y as *mut c_void,
        blas_sys::cudaDataType::CUDA_R_32F,
        ni,
        blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
    )
    .map_err(|e| EngineError::Backend(format!("cuBLAS GEMM ({m}x{k} by {n}x{k}): {e:?}")))
}

fn oom_bw(bytes: usize, e: DriverError) -> EngineError {
    drv(
        &format!(
            "allocating two {:.2} GiB buffers for the bandwidth test",
            bytes as f64 / GIB
        ),
        e,
    )
}

fn too_big(what: &str) -> EngineError {
    EngineError::Backend(format!(
        "GEMM dimension {what} exceeds the 32-bit range cuBLAS takes"
    ))
}

/// Runs `y = x · Wᵀ` (+ bias) for a `DevLinear` over the first `m` rows.
fn linear(
    blas: &CudaBlas,
    stream: &Arc<CudaStream>,
    bias_add: &CudaFunction,
    l: &DevLinear,
    m: usize,
    x: &CudaSlice<u16>,
    y: &mut CudaSlice<f32>,
) -> Result<()> {
    {
        let (xp, _gx) = x.device_ptr(stream);
        let (wp, _gw) = l.w.device_ptr(stream);
        let (yp, _gy) = y.device_ptr_mut(stream);
        // SAFETY: the workspace holds at least m rows of x and y; W is [out, inp].
        unsafe { gemm_bf16_f32(blas, m, l.out, l.inp, xp, wp, yp, 0.0)? };
    }
    if let Some(b) = &l.bias {
        let (rows, cols) = (m as i32, l.out as i32);
        // SAFETY: y has m * out f32 elements, b has out.
        unsafe {
            stream
                .launch_builder(bias_add)
                .arg(y)
                .arg(b)
                .arg(&rows)
                .arg(&cols)
                .launch(launch_1d(m * l.out))
        }
        .map_err(|e| drv("bias_add launch", e))?;
    }
    Ok(())
}

impl CudaBackend {
    /// Loads the model onto device `ordinal` and allocates `num_blocks` KV blocks of
    /// `block_size` tokens. Checks free memory first so an oversized request fails with the
    /// numbers rather than with an allocation error halfway through the upload.
    pub fn new(
        cfg: &ModelConfig,
        weights: &WeightStore,
        ordinal: usize,
        num_blocks: usize,
        block_size: usize,
    ) -> Result<CudaBackend> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(EngineError::Backend(format!(
                "cuda:{ordinal} was asked for but {count} CUDA device(s) are visible \
                 (check CUDA_VISIBLE_DEVICES and the NVIDIA driver)"
            )));
        }
        let d = cfg.head_dim;
        if d > MAX_HEAD_DIM || !d.is_multiple_of(2) || d == 0 {
            return Err(EngineError::Backend(format!(
                "head_dim {d} is not supported by the CUDA kernels (even, at most {MAX_HEAD_DIM})"
            )));
        }
        if block_size == 0 || num_blocks == 0 {
            return Err(EngineError::Backend(
                "the KV cache needs at least one block of at least one token".into(),
            ));
        }
        if cfg.rope_depends_on_length() {
            // The kernels rotate by one frequency table for the whole batch; dynamic NTK
            // needs one per sequence length. Refused rather than rotated wrongly.
            return Err(EngineError::Backend(format!(
                "RoPE type `{}` (frequencies that change with the sequence length) is not \
                 implemented by the CUDA backend; run this model with --device cpu",
                cfg.rope.scaling.type_name()
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| drv("context creation", e))?;
        let stream = ctx.new_stream().map_err(|e| drv("stream creation", e))?;

        // Memory check before any upload.
        let kv_bytes = Self::kv_bytes_per_block(cfg, block_size) * num_blocks;
        let weight_bytes = 2 * cfg.num_params()
            + 4 * (cfg.num_layers * (2 * cfg.hidden_size + 2 * d) + cfg.hidden_size);
        // Headroom for cuBLAS workspaces, activations of a large prefill and the module.
        let headroom = 512usize << 20;
        let need = kv_bytes + weight_bytes + headroom;
        let (free, total) = ctx.mem_get_info().map_err(|e| drv("memory query", e))?;
        if need > free {
            return Err(EngineError::Backend(format!(
                "cuda:{ordinal} has {:.2} GiB free of {:.2} GiB, but this needs {:.2} GiB \
                 (weights {:.2} GiB + KV cache {:.2} GiB for {num_blocks} blocks + {:.2} GiB \
                 working space); ask for fewer KV blocks or use a larger GPU",
                free as f64 / GIB,
                total as f64 / GIB,
                need as f64 / GIB,
                weight_bytes as f64 / GIB,
                kv_bytes as f64 / GIB,
                headroom as f64 / GIB
            )));
        }

        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| drv("compute capability query", e))?;
        let arch = ptx_cache::arch_for(major, minor);
        let ptx = ptx_cache::load_or_compile(KERNELS_CU, &arch)?;
        let module = ctx
            .load_module(Ptx::from_src(ptx))
            .map_err(|e| drv("loading the compiled kernels", e))?;
        let f = |name: &str| {
            module
                .load_function(name)
                .map_err(|e| drv(&format!("kernel `{name}` lookup"), e))
        };
        let k = Kernels {
            embed_gather: f("embed_gather")?,
            rmsnorm: f("rmsnorm_to_bf16")?,
            add_rmsnorm: f("add_rmsnorm_to_bf16")?,
            bias_add: f("bias_add")?,
            qk_norm: f("qk_norm")?,
            rope_kv_write: f("rope_kv_write")?,
            attention_decode: f("paged_attention_decode")?,
            attention_prefill: f("paged_attention_prefill")?,
            silu_mul: f("silu_mul")?,
            gather_rows: f("gather_rows_bf16")?,
            sample_rows: f("sample_rows")?,
        };
        let blas = CudaBlas::new(stream.clone())
            .map_err(|e| EngineError::Backend(format!("cuBLAS initialisation: {e:?}")))?;

        let oom = |what: &str, e: DriverError| {
            EngineError::Backend(format!(
                "cuda:{ordinal}: uploading {what} failed ({e:?}); if this is out of memory, \
                 ask for fewer KV blocks"
            ))
        };
        let up16 = |name: &str, v: &[u16]| stream.clone_htod(v).map_err(|e| oom(name, e));
        let up32 = |name: &str, v: &[f32]| stream.clone_htod(v).map_err(|e| oom(name, e));
        let mat = |name: &str, shape: &[usize]| -> Result<Vec<u16>> {
            Ok(to_bf16(weights.load(name, shape)?))
        };
        let (h, q, kv, inter) = (
            cfg.hidden_size,
            cfg.q_dim(),
            cfg.kv_dim(),
            cfg.intermediate_size,
        );
        // Biases exactly as the config says (`model::check_tensors` refuses weights that
        // disagree with it).
        let opt_bias = |on: bool, name: &str, n: usize| -> Result<Option<Vec<f32>>> {
            if on {
                weights.f32(name, &[n]).map(Some)
            } else {
                Ok(None)
            }
        };
        let up_bias = |name: &str, b: Option<Vec<f32>>| -> Result<Option<CudaSlice<f32>>> {
            b.map(|b| up32(name, &b)).transpose()
        };

        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let p = format!("model.layers.{i}");
            let a = format!("{p}.self_attn");
            let mut qkv = mat(&format!("{a}.q_proj.weight"), &[q, h])?;
            qkv.extend(mat(&format!("{a}.k_proj.weight"), &[kv, h])?);
            qkv.extend(mat(&format!("{a}.v_proj.weight"), &[kv, h])?);
            let biases = [
                opt_bias(cfg.qkv_bias, &format!("{a}.q_proj.bias"), q)?,
                opt_bias(cfg.qkv_bias, &format!("{a}.k_proj.bias"), kv)?,
                opt_bias(cfg.qkv_bias, &format!("{a}.v_proj.bias"), kv)?,
            ];
            // Any bias present: stack them, zeros standing in for a missing part.
            let qkv_bias = if biases.iter().any(Option::is_some) {
                let mut b = Vec::with_capacity(q + 2 * kv);
                for (part, n) in biases.into_iter().zip([q, kv, kv]) {
                    b.extend(part.unwrap_or_else(|| vec![0.0; n]));
                }
                Some(up32(&format!("{a} qkv bias"), &b)?)
            } else {
                None
            };
            let mut gate_up = mat(&format!("{p}.mlp.gate_proj.weight"), &[inter, h])?;
            gate_up.extend(mat(&format!("{p}.mlp.up_proj.weight"), &[inter, h])?);
            let gate_up_bias = match (
                opt_bias(cfg.mlp_bias, &format!("{p}.mlp.gate_proj.bias"), inter)?,
                opt_bias(cfg.mlp_bias, &format!("{p}.mlp.up_proj.bias"), inter)?,
            ) {
                (Some(mut g), Some(u)) => {
                    g.extend(u);
                    Some(g)
                }
                _ => None,
            };
            let norm = |name: String| -> Result<CudaSlice<f32>> {
                let v = weights.f32(&name, &[d])?;
                up32(&name, &v)
            };
            layers.push(DevLayer {
                input_layernorm: up32(
                    &format!("{p}.input_layernorm"),
                    &weights.f32(&format!("{p}.input_layernorm.weight"), &[h])?,
                )?,
                qkv_proj: DevLinear {
                    w: up16(&format!("{a} qkv"), &qkv)?,
                    out: q + 2 * kv,
                    inp: h,
                    bias: qkv_bias,
                },
                q_norm: if cfg.qk_norm {
                    Some(norm(format!("{a}.q_norm.weight"))?)
                } else {
                    None
                },
                k_norm: if cfg.qk_norm {
                    Some(norm(format!("{a}.k_norm.weight"))?)
                } else {
                    None
                },
                o_proj: DevLinear {
                    w: up16(
                        &format!("{a}.o_proj"),
                        &mat(&format!("{a}.o_proj.weight"), &[h, q])?,
                    )?,
                    out: h,
                    inp: q,
                    bias: up_bias(
                        &format!("{a}.o_proj.bias"),
                        opt_bias(cfg.o_bias, &format!("{a}.o_proj.bias"), h)?,
                    )?,
                },
                post_attention_layernorm: up32(
                    &format!("{p}.post_attention_layernorm"),
                    &weights.f32(&format!("{p}.post_attention_layernorm.weight"), &[h])?,
                )?,
                gate_up_proj: DevLinear {
                    w: up16(&format!("{p} gate/up"), &gate_up)?,
                    out: 2 * inter,
                    inp: h,
                    bias: up_bias(&format!("{p} gate/up bias"), gate_up_bias)?,
                },
                down_proj: DevLinear {
                    w: up16(
                        &format!("{p}.mlp.down_proj"),
                        &mat(&format!("{p}.mlp.down_proj.weight"), &[h, inter])?,
                    )?,
                    out: h,
                    inp: inter,
                    bias: up_bias(
                        &format!("{p}.mlp.down_proj.bias"),
                        opt_bias(cfg.mlp_bias, &format!("{p}.mlp.down_proj.bias"), h)?,
                    )?,
                },
            });
        }
        let embed_tokens = up16(
            "embed_tokens",
            &mat("model.embed_tokens.weight", &[cfg.vocab_size, h])?,
        )?;
        let lm_head = if cfg.tie_word_embeddings {
            None
        } else {
            Some(DevLinear {
                w: up16("lm_head", &mat("lm_head.weight", &[cfg.vocab_size, h])?)?,
                out: cfg.vocab_size,
                inp: h,
                bias: None,
            })
        };
        let norm = up32("model.norm", &weights.f32("model.norm.weight", &[h])?)?;
        let inv_freq = up32("rope frequencies", &cfg.rope_inv_freq())?;

        // One block more than asked for: the scratch block decode graphs pad with.
        // Graphs are on unless KVMESH_CUDA_GRAPHS=0, and need the scratch block's slots to
        // fit the kernels' 32-bit indices.
        let scratch_block = i32::try_from(num_blocks).unwrap_or(i32::MAX);
        let graphs_enabled = std::env::var("KVMESH_CUDA_GRAPHS").map_or(true, |v| v.trim() != "0")
            && (num_blocks + 1)
                .checked_mul(block_size)
                .is_some_and(|slots| i32::try_from(slots).is_ok());
        let graph_width = cfg.max_context().div_ceil(block_size).clamp(1, num_blocks);
        let per_layer = (num_blocks + 1) * block_size * kv;
        let mut k_cache = Vec::with_capacity(cfg.num_layers);
        let mut v_cache = Vec::with_capacity(cfg.num_layers);
        for _ in 0..cfg.num_layers {
            k_cache.push(
                stream
                    .alloc_zeros::<u16>(per_layer)
                    .map_err(|e| oom("the KV cache", e))?,
            );
            v_cache.push(
                stream
                    .alloc_zeros::<u16>(per_layer)
                    .map_err(|e| oom("the KV cache", e))?,
            );
        }
        stream
            .synchronize()
            .map_err(|e| drv("finishing the upload", e))?;
        tracing::info!(
            device = ordinal,
            arch = %arch,
            weights_gib = weight_bytes as f64 / GIB,
            kv_gib = kv_bytes as f64 / GIB,
            "CUDA backend ready"
        );
        Ok(CudaBackend {
            cfg: cfg.clone(),
            ordinal,
            ctx,
            stream,
            blas,
            k,
            embed_tokens,
            layers,
            norm,
            lm_head,
            inv_freq,
            k_cache,
            v_cache,
            num_blocks,
            block_size,
            ws: None,
            ls: None,
            graphs: HashMap::new(),
            graphs_enabled,
            graph_width,
            scratch_block,
        })
    }

    /// Device memory one block takes across all layers (K and V, bf16).
    pub fn kv_bytes_per_block(cfg: &ModelConfig, block_size: usize) -> usize {
        2 * cfg.num_layers * block_size * cfg.kv_dim() * 2
    }

    /// The device's name as the driver reports it ("NVIDIA H100 80GB HBM3"), so benchmark
    /// results say which GPU produced them.
    pub fn device_name(&self) -> Result<String> {
        self.ctx.name().map_err(|e| drv("device name query", e))
    }

    /// Whether pure decode steps replay CUDA graphs: false when `KVMESH_CUDA_GRAPHS=0` or
    /// after a capture failed, so benchmarks can say which path they measured.
    pub fn cuda_graphs_enabled(&self) -> bool {
        self.graphs_enabled
    }

    /// Waits until everything queued on the backend's stream has finished. Steps return once
    /// their results are copied back, but a caller timing work needs an explicit fence.
    pub fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| drv("stream synchronisation", e))
    }

    /// Bytes of weights one decode step reads: every layer's matrices and norms, the final
    /// norm and the output head (the embedding matrix when tied; the embedding gather itself
    /// touches only the batch's rows and is not counted). This is the traffic that bounds
    /// batch-1 decode, for comparing against the device's memory bandwidth.
    pub fn weight_bytes_per_step(&self) -> usize {
        let lin = |l: &DevLinear| 2 * l.w.len() + 4 * l.bias.as_ref().map_or(0, |b| b.len());
        let norm_len = |n: &Option<CudaSlice<f32>>| n.as_ref().map_or(0, |s| s.len());
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                lin(&l.qkv_proj)
                    + lin(&l.o_proj)
                    + lin(&l.gate_up_proj)
                    + lin(&l.down_proj)
                    + 4 * (l.input_layernorm.len()
                        + l.post_attention_layernorm.len()
                        + norm_len(&l.q_norm)
                        + norm_len(&l.k_norm))
            })
            .sum();
        let head = match &self.lm_head {
            Some(l) => lin(l),
            None => 2 * self.embed_tokens.len(),
        };
        layers + head + 4 * self.norm.len()
    }

    /// Device-to-device copy bandwidth in bytes/s: the best of `reps` timed copies of a
    /// `bytes`-byte buffer (after one untimed warm-up), timed with CUDA events on the
    /// backend's stream. Each copy reads and writes `bytes`, so `2 * bytes / time` is
    /// reported, the convention of NVIDIA's `bandwidthTest`: it is the DRAM traffic the
    /// copy sustains, the figure a weight-streaming decode step is compared against.
    pub fn copy_bandwidth(&self, bytes: usize, reps: usize) -> Result<f64> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| drv("binding the context", e))?;
        let s = &self.stream;
        let src = s.alloc_zeros::<u8>(bytes).map_err(|e| oom_bw(bytes, e))?;
        let mut dst = s.alloc_zeros::<u8>(bytes).map_err(|e| oom_bw(bytes, e))?;
        let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let mut best = 0f64;
        for i in 0..=reps {
            let start = s
                .record_event(timing)
                .map_err(|e| drv("bandwidth event", e))?;
            s.memcpy_dtod(&src, &mut dst)
                .map_err(|e| drv("bandwidth copy", e))?;
            let end = s
                .record_event(timing)
                .map_err(|e| drv("bandwidth event", e))?;
            let ms = start
                .elapsed_ms(&end)
                .map_err(|e| drv("bandwidth timing", e))?;
            // The first copy pays for first-touch page mapping; it is not a measurement.
            if i > 0 && ms > 0.0 {
                best = best.max(2.0 * bytes as f64 / (f64::from(ms) * 1e-3));
            }
        }
        Ok(best)
    }

    /// Forgets captured graphs (keeping their input buffers); the next decode step of each
    /// bucket captures again.
    fn drop_graphs(&mut self) {
        for g in self.graphs.values_mut() {
            g.exec = None;
        }
    }

    fn ensure_workspace(&mut self, t: usize) -> Result<()> {
        if self.ws.as_ref().is_some_and(|w| w.tokens >= t) {
            return Ok(());
        }
        // Drop the old buffers first so their memory can be reused; graphs captured with
        // them would launch on freed memory.
        self.ws = None;
        self.drop_graphs();
        let cap = t.next_power_of_two();
        let c = &self.cfg;
        let s = &self.stream;
        let f = |n: usize| {
            s.alloc_zeros::<f32>(n)
                .map_err(|e| drv(&format!("activations for {cap} tokens"), e))
        };
        let b = |n: usize| {
            s.alloc_zeros::<u16>(n)
                .map_err(|e| drv(&format!("activations for {cap} tokens"), e))
        };
        self.ws = Some(Workspace {
            tokens: cap,
            x: f(cap * c.hidden_size)?,
            xn: b(cap * c.hidden_size)?,
            qkv: f(cap * (c.q_dim() + 2 * c.kv_dim()))?,
            attn: b(cap * c.q_dim())?,
            tmp: f(cap * c.hidden_size)?,
            gate_up: f(cap * 2 * c.intermediate_size)?,
            act: b(cap * c.intermediate_size)?,
        });
        Ok(())
    }

    fn ensure_logits_space(&mut self, rows: usize) -> Result<()> {
        if self.ls.as_ref().is_some_and(|l| l.rows >= rows) {
            return Ok(());
        }
        self.ls = None;
        self.drop_graphs();
        let cap = rows.next_power_of_two();
        let s = &self.stream;
        let e = |x| drv(&format!("logits for {cap} rows"), x);
        self.ls = Some(LogitsSpace {
            rows: cap,
            xr: s
                .alloc_zeros::<u16>(cap * self.cfg.hidden_size)
                .map_err(e)?,
            logits: s.alloc_zeros::<f32>(cap * self.cfg.vocab_size).map_err(e)?,
            token: s.alloc_zeros::<i32>(cap).map_err(e)?,
            logprob: s.alloc_zeros::<f32>(cap).map_err(e)?,
            params_f: s.alloc_zeros::<f32>(3 * cap).map_err(e)?,
            top_k: s.alloc_zeros::<i32>(cap).map_err(e)?,
        });
        Ok(())
    }

    /// Runs the step up to the logits, which it leaves in `self.ls.logits` (rows in batch
    /// order). Returns how many rows have logits. A pure decode step that fits a bucket
    /// replays a captured CUDA graph (see `run_graph`); anything else is launched eagerly.
    fn run(&mut self, batch: &ForwardBatch) -> Result<usize> {
        let t = batch.num_tokens();
        if t == 0 {
            return Ok(0);
        }
        let layout = batch::build(batch, self.block_size, self.num_blocks, self.cfg.vocab_size)?;
        self.ctx
            .bind_to_thread()
            .map_err(|e| drv("binding the context", e))?;
        if let Some(n) = self.run_graph(&layout)? {
            return Ok(n);
        }
        self.ensure_workspace(t)?;
        let n_logits = layout.logits_rows.len();
        if n_logits > 0 {
            self.ensure_logits_space(n_logits)?;
        }
        let up = |v: &[i32]| {
            // A zero-length allocation is an error in the driver; an unused array gets one
            // dummy entry instead.
            let v = if v.is_empty() { &[0][..] } else { v };
            self.stream
                .clone_htod(v)
                .map_err(|e| drv("batch upload", e))
        };
        let inputs = StepInputs {
            token_ids: up(&layout.token_ids)?,
            positions: up(&layout.positions)?,
            slots: up(&layout.slot_mapping)?,
            seq_starts: up(&layout.seq_starts)?,
            seq_lens: up(&layout.seq_lens)?,
            tables: up(&layout.block_tables)?,
            logits_rows: up(&layout.logits_rows)?,
        };
        let dims = StepDims {
            tokens: t,
            seqs: layout.num_seqs(),
            max_blocks: layout.max_blocks,
            max_query_len: layout.max_query_len,
            logits: n_logits,
        };
        self.enqueue(&dims, &inputs)
    }

    /// The pure-decode fast path: copies the step's inputs, padded to the bucket, into the
    /// bucket's fixed device buffers and replays its graph, capturing it first if there is
    /// none yet (the first decode step of each bucket, and the first after the workspace
    /// grew). Returns `None`, and the caller runs the step eagerly, when graphs are off or
    /// the step does not qualify: not pure decode, a sequence that wants no logits, more
    /// sequences than the largest bucket, or a block table wider than `graph_width`.
    ///
    /// Why graphs: a decode step is a few hundred small launches whose CPU-side cost is
    /// comparable to the GPU work at small batch; a replay is one launch.
    fn run_graph(&mut self, layout: &BatchLayout) -> Result<Option<usize>> {
        let n = layout.num_seqs();
        if !self.graphs_enabled
            || !layout.is_decode()
            || layout.num_tokens() != n
            || layout.logits_rows.len() != n
            || layout.max_blocks > self.graph_width
        {
            return Ok(None);
        }
        let Some(b) = batch::bucket_for(n) else {
            return Ok(None);
        };
        self.ensure_workspace(b)?;
        self.ensure_logits_space(b)?;
        let w = self.graph_width;
        let host = graph_inputs(layout, b, w, self.scratch_block, self.block_size);
        if !self.graphs.contains_key(&b) {
            let s = &self.stream;
            let a = |len: usize| {
                s.alloc_zeros::<i32>(len)
                    .map_err(|e| drv("decode graph input buffers", e))
            };
            let inputs = StepInputs {
                token_ids: a(b)?,
                positions: a(b)?,
                slots: a(b)?,
                seq_starts: a(b + 1)?,
                seq_lens: a(b)?,
                tables: a(b * w)?,
                logits_rows: a(b)?,
            };
            self.graphs.insert(b, DecodeGraph { inputs, exec: None });
        }
        let mut g = self
            .graphs
            .remove(&b)
            .ok_or_else(|| EngineError::Backend("decode graph missing".into()))?;
        let r = self.replay(&mut g, &host, b, w);
        if self.graphs_enabled {
            self.graphs.insert(b, g);
        }
        Ok(r?.map(|()| n))
    }

    /// Uploads `host` into `g`'s buffers, captures `g` if needed, and launches it.
    /// `Ok(None)` when capture failed: graphs are then switched off for this backend (with a
    /// warning) and the step runs eagerly, so a driver or library that cannot capture costs
    /// speed, not correctness.
    fn replay(
        &mut self,
        g: &mut DecodeGraph,
        host: &GraphHostInputs,
        b: usize,
        w: usize,
    ) -> Result<Option<()>> {
        {
            let s = &self.stream;
            let i = &mut g.inputs;
            let e = |e| drv("decode graph input upload", e);
            // Pageable host memory: each copy has taken the data when it returns.
            s.memcpy_htod(&host.token_ids, &mut i.token_ids)
                .map_err(e)?;
            s.memcpy_htod(&host.positions, &mut i.positions)
                .map_err(e)?;
            s.memcpy_htod(&host.slots, &mut i.slots).map_err(e)?;
            s.memcpy_htod(&host.seq_starts, &mut i.seq_starts)
                .map_err(e)?;
            s.memcpy_htod(&host.seq_lens, &mut i.seq_lens).map_err(e)?;
            s.memcpy_htod(&host.tables, &mut i.tables).map_err(e)?;
            s.memcpy_htod(&host.logits_rows, &mut i.logits_rows)
                .map_err(e)?;
        }
        if g.exec.is_none() {
            let dims = StepDims {
                tokens: b,
                seqs: b,
                max_blocks: w,
                max_query_len: 1,
                logits: b,
            };
            // SAFETY: the backend issues all its work on one stream, which orders it without
            // cudarc's per-buffer events. Tracking is off only while capturing, because a
            // capture may not wait on events recorded before it began.
            unsafe { self.ctx.disable_event_tracking() };
            let captured = match self.stream.begin_capture(
                cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            ) {
                Err(e) => Err(drv("graph capture start", e)),
                Ok(()) => {
                    let r = self.enqueue(&dims, &g.inputs);
                    // End the capture whatever happened, so the stream leaves capture mode.
                    let end = self
                        .stream
                        .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0))
                        .map_err(|e| drv("graph capture", e));
                    r.and(end).and_then(|graph| {
                        graph.ok_or_else(|| {
                            EngineError::Backend("graph capture recorded nothing".into())
                        })
                    })
                }
            };
            // SAFETY: restores cudarc's default.
            unsafe { self.ctx.enable_event_tracking() };
            match captured {
                Ok(graph) => g.exec = Some(SendGraph(graph)),
                Err(e) => {
                    tracing::warn!(
                        error = %e,
                        bucket = b,
                        "CUDA graph capture failed; decode steps run eagerly from now on"
                    );
                    self.graphs_enabled = false;
                    self.graphs.clear();
                    return Ok(None);
                }
            }
        }
        if let Some(exec) = &g.exec {
            exec.0.launch().map_err(|e| drv("decode graph launch", e))?;
        }
        Ok(Some(()))
    }

    /// Enqueues the whole forward pass for a step whose inputs are in `inp` (device arrays
    /// laid out as `batch::BatchLayout` describes), leaving the logits in `self.ls`. It
    /// neither allocates nor synchronises, so it can be recorded into a CUDA graph.
    fn enqueue(&mut self, dims: &StepDims, inp: &StepInputs) -> Result<usize> {
        let t = dims.tokens;
        let n_logits = dims.logits;
        let Self {
            cfg,
            stream,
            blas,
            k,
            embed_tokens,
            layers,
            norm,
            lm_head,
            inv_freq,
            k_cache,
            v_cache,
            block_size,
            ws,
            ls,
            ..
        } = self;
        let ws = ws
            .as_mut()
            .ok_or_else(|| EngineError::Backend("workspace missing".into()))?;

        let (h, d) = (cfg.hidden_size, cfg.head_dim);
        let (nq, nkv) = (cfg.num_heads, cfg.num_kv_heads);
        let row = cfg.q_dim() + 2 * cfg.kv_dim();
        let num_seqs = dims.seqs;
        let (h_i, d_i, nq_i, nkv_i, row_i) =
            (h as i32, d as i32, nq as i32, nkv as i32, row as i32);
        let inter_i = cfg.intermediate_size as i32;
        let t_i = t as i32;
        let bs_i = *block_size as i32;
        let max_blocks_i = dims.max_blocks as i32;
        let eps = cfg.rms_norm_eps;
        let scale = cfg.attention_scale();
        let launch_err =
            |name: &'static str| move |e: DriverError| drv(&format!("{name} launch"), e);

        // SAFETY (all launches below): every buffer is sized for at least `t` tokens (the
        // workspace) or for the whole pool (the caches), the batch indices were bounds-checked
        // by `batch::build`, and the argument lists match the kernels' signatures in
        // kernels.cu in order and type (pointers, i32, f32).
        unsafe {
            stream
                .launch_builder(&k.embed_gather)
                .arg(&*embed_tokens)
                .arg(&inp.token_ids)
                .arg(&mut ws.x)
                .arg(&h_i)
                .launch(grid(t, 1, 1, 256))
        }
        .map_err(launch_err("embed_gather"))?;
        if let Some(first) = layers.first() {
            unsafe {
                stream
                    .launch_builder(&k.rmsnorm)
                    .arg(&ws.x)
                    .arg(&first.input_layernorm)
                    .arg(&mut ws.xn)
                    .arg(&h_i)
                    .arg(&eps)
                    .launch(grid(t, 1, 1, 256))
            }
            .map_err(launch_err("rmsnorm"))?;
        }

        for li in 0..layers.len() {
            let layer = &layers[li];
            linear(
                blas,
                stream,
                &k.bias_add,
                &layer.qkv_proj,
                t,
                &ws.xn,
                &mut ws.qkv,
            )?;
            if let (Some(qn), Some(kn)) = (&layer.q_norm, &layer.k_norm) {
                unsafe {
                    stream
                        .launch_builder(&k.qk_norm)
                        .arg(&mut ws.qkv)
                        .arg(qn)
                        .arg(kn)
                        .arg(&row_i)
                        .arg(&nq_i)
                        .arg(&d_i)
                        .arg(&eps)
                        .launch(grid(t, nq + nkv, 1, 32))
                }
                .map_err(launch_err("qk_norm"))?;
            }
            unsafe {
                stream
                    .launch_builder(&k.rope_kv_write)
                    .arg(&mut ws.qkv)
                    .arg(&inp.positions)
                    .arg(&*inv_freq)
                    .arg(&inp.slots)
                    .arg(&mut k_cache[li])
                    .arg(&mut v_cache[li])
                    .arg(&row_i)
                    .arg(&nq_i)
                    .arg(&nkv_i)
                    .arg(&d_i)
                    .launch(grid(t, nq + nkv, 1, 64))
            }
            .map_err(launch_err("rope_kv_write"))?;
            // 0: the layer attends over the whole sequence.
            let window_i = cfg
                .layer_window(li)
                .map_or(0, |w| w.min(i32::MAX as usize) as i32);
            if dims.max_query_len == 1 {
                unsafe {
                    stream
                        .launch_builder(&k.attention_decode)
                        .arg(&ws.qkv)
                        .arg(&row_i)
                        .arg(&inp.seq_starts)
                        .arg(&inp.seq_lens)
                        .arg(&inp.tables)
                        .arg(&max_blocks_i)
                        .arg(&k_cache[li])
                        .arg(&v_cache[li])
                        .arg(&mut ws.attn)
                        .arg(&nq_i)
                        .arg(&nkv_i)
                        .arg(&d_i)
                        .arg(&bs_i)
                        .arg(&scale)
                        .arg(&window_i)
                        .launch(grid(num_seqs, nq, 1, 128))
                }
                .map_err(launch_err("paged_attention_decode"))?;
            } else {
                let tiles = dims.max_query_len.div_ceil(PREFILL_QUERIES_PER_BLOCK);
                unsafe {
                    stream
                        .launch_builder(&k.attention_prefill)
                        .arg(&ws.qkv)
                        .arg(&row_i)
                        .arg(&inp.positions)
                        .arg(&inp.seq_starts)
                        .arg(&inp.seq_lens)
                        .arg(&inp.tables)
                        .arg(&max_blocks_i)
                        .arg(&k_cache[li])
                        .arg(&v_cache[li])
                        .arg(&mut ws.attn)
                        .arg(&nq_i)
                        .arg(&nkv_i)
                        .arg(&d_i)
                        .arg(&bs_i)
                        .arg(&scale)
                        .arg(&window_i)
                        .launch(grid(
                            num_seqs,
                            nq,
                            tiles,
                            32 * PREFILL_QUERIES_PER_BLOCK as u32,
                        ))
                }
                .map_err(launch_err("paged_attention_prefill"))?;
            }
            linear(
                blas,
                stream,
                &k.bias_add,
                &layer.o_proj,
                t,
                &ws.attn,
                &mut ws.tmp,
            )?;
            unsafe {
                stream
                    .launch_builder(&k.add_rmsnorm)
                    .arg(&mut ws.x)
                    .arg(&ws.tmp)
                    .arg(&layer.post_attention_layernorm)
                    .arg(&mut ws.xn)
                    .arg(&h_i)
                    .arg(&eps)
                    .launch(grid(t, 1, 1, 256))
            }
            .map_err(launch_err("add_rmsnorm"))?;
            linear(
                blas,
                stream,
                &k.bias_add,
                &layer.gate_up_proj,
                t,
                &ws.xn,
                &mut ws.gate_up,
            )?;
            unsafe {
                stream
                    .launch_builder(&k.silu_mul)
                    .arg(&ws.gate_up)
                    .arg(&mut ws.act)
                    .arg(&t_i)
                    .arg(&inter_i)
                    .launch(launch_1d(t * cfg.intermediate_size))
            }
            .map_err(launch_err("silu_mul"))?;
            linear(
                blas,
                stream,
                &k.bias_add,
                &layer.down_proj,
                t,
                &ws.act,
                &mut ws.tmp,
            )?;
            // The residual add, fused with the next layer's input norm, or with the final
            // norm after the last layer.
            let next_norm = match layers.get(li + 1) {
                Some(next) => &next.input_layernorm,
                None => &*norm,
            };
            unsafe {
                stream
                    .launch_builder(&k.add_rmsnorm)
                    .arg(&mut ws.x)
                    .arg(&ws.tmp)
                    .arg(next_norm)
                    .arg(&mut ws.xn)
                    .arg(&h_i)
                    .arg(&eps)
                    .launch(grid(t, 1, 1, 256))
            }
            .map_err(launch_err("add_rmsnorm"))?;
        }
        if layers.is_empty() {
            // No layer fused the final norm: apply it to the embeddings.
            unsafe {
                stream
                    .launch_builder(&k.rmsnorm)
                    .arg(&ws.x)
                    .arg(&*norm)
                    .arg(&mut ws.xn)
                    .arg(&h_i)
                    .arg(&eps)
                    .launch(grid(t, 1, 1, 256))
            }
            .map_err(launch_err("rmsnorm"))?;
        }

        if n_logits == 0 {
            return Ok(0);
        }
        let ls = ls
            .as_mut()
            .ok_or_else(|| EngineError::Backend("logits space missing".into()))?;
        unsafe {
            stream
                .launch_builder(&k.gather_rows)
                .arg(&ws.xn)
                .arg(&inp.logits_rows)
                .arg(&mut ls.xr)
                .arg(&h_i)
                .launch(grid(n_logits, 1, 1, 256))
        }
        .map_err(launch_err("gather_rows_bf16"))?;
        let head_w = match lm_head {
            Some(l) => &l.w,
            None => &*embed_tokens,
        };
        {
            let (xp, _gx) = ls.xr.device_ptr(stream);
            let (wp, _gw) = head_w.device_ptr(stream);
            let (yp, _gy) = ls.logits.device_ptr_mut(stream);
            // SAFETY: xr holds n_logits rows of h, the head is [vocab, h], logits holds
            // n_logits rows of vocab.
            unsafe { gemm_bf16_f32(blas, n_logits, cfg.vocab_size, h, xp, wp, yp, 0.0)? };
        }
        Ok(n_logits)
    }

    /// KV-transfer hook: the K and V of `blocks` in `layer`, as little-endian bf16 bytes,
    /// block after block, each block its K `[block_size, num_kv_heads, head_dim]` then its V.
    ///
    /// The blocks are gathered on the device into one buffer and copied out in a single
    /// transfer through page-locked (pinned) host memory, which the DMA engine reads
    /// directly; the pinned buffer is allocated per call (not kept) for now.
    pub fn copy_blocks_out(&mut self, layer: usize, blocks: &[BlockId]) -> Result<Vec<u8>> {
        let per = self.block_elems();
        self.check_blocks(layer, blocks)?;
        if blocks.is_empty() {
            return Ok(Vec::new());
        }
        self.ctx
            .bind_to_thread()
            .map_err(|e| drv("binding the context", e))?;
        let n = blocks.len() * 2 * per;
        let s = &self.stream;
        let mut staging = s
            .alloc_zeros::<u16>(n)
            .map_err(|e| drv("KV staging buffer", e))?;
        for (i, b) in blocks.iter().enumerate() {
            let src = b.0 as usize * per;
            let dst = i * 2 * per;
            s.memcpy_dtod(
                &self.k_cache[layer].slice(src..src + per),
                &mut staging.slice_mut(dst..dst + per),
            )
            .map_err(|e| drv("KV block copy", e))?;
            s.memcpy_dtod(
                &self.v_cache[layer].slice(src..src + per),
                &mut staging.slice_mut(dst + per..dst + 2 * per),
            )
            .map_err(|e| drv("KV block copy", e))?;
        }
        // SAFETY: the buffer is fully overwritten by the copy below before it is read.
        let mut pinned = unsafe { self.ctx.alloc_pinned_with_flags::<u16>(n, 0) }
            .map_err(|e| drv("pinned host buffer", e))?;
        s.memcpy_dtoh(&staging, &mut pinned)
            .map_err(|e| drv("KV copy to host", e))?;
        s.synchronize().map_err(|e| drv("KV copy to host", e))?;
        let host = pinned
            .as_slice()
            .map_err(|e| drv("reading the pinned buffer", e))?;
        let mut out = Vec::with_capacity(2 * n);
        for v in host {
            out.extend_from_slice(&v.to_le_bytes());
        }
        Ok(out)
    }

    /// KV-transfer hook, the inverse of `copy_blocks_out`: writes `bytes` (the same layout)
    /// into `blocks` of `layer`, through a pinned buffer and one host-to-device transfer.
    pub fn copy_blocks_in(&mut self, layer: usize, blocks: &[BlockId], bytes: &[u8]) -> Result<()> {
        let per = self.block_elems();
        self.check_blocks(layer, blocks)?;
        let n = blocks.len() * 2 * per;
        if bytes.len() != 2 * n {
            return Err(EngineError::Backend(format!(
                "KV transfer for {} blocks expects {} bytes, got {}",
                blocks.len(),
                2 * n,
                bytes.len()
            )));
        }
        if blocks.is_empty() {
            return Ok(());
        }
        self.ctx
            .bind_to_thread()
            .map_err(|e| drv("binding the context", e))?;
        // SAFETY: every element is written below before the copy reads it.
        let mut pinned = unsafe { self.ctx.alloc_pinned_with_flags::<u16>(n, 0) }
            .map_err(|e| drv("pinned host buffer", e))?;
        {
            let host = pinned
                .as_mut_slice()
                .map_err(|e| drv("writing the pinned buffer", e))?;
            for (dst, b) in host.iter_mut().zip(bytes.chunks_exact(2)) {
                *dst = u16::from_le_bytes([b[0], b[1]]);
            }
        }
        let s = &self.stream;
        let mut staging = s
            .alloc_zeros::<u16>(n)
            .map_err(|e| drv("KV staging buffer", e))?;
        s.memcpy_htod(&pinned, &mut staging)
            .map_err(|e| drv("KV copy to device", e))?;
        for (i, b) in blocks.iter().enumerate() {
            let dst = b.0 as usize * per;
            let src = i * 2 * per;
            s.memcpy_dtod(
                &staging.slice(src..src + per),
                &mut self.k_cache[layer].slice_mut(dst..dst + per),
            )
            .map_err(|e| drv("KV block copy", e))?;
            s.memcpy_dtod(
                &staging.slice(src + per..src + 2 * per),
                &mut self.v_cache[layer].slice_mut(dst..dst + per),
            )
            .map_err(|e| drv("KV block copy", e))?;
        }
        s.synchronize().map_err(|e| drv("KV copy to device", e))?;
        Ok(())
    }

    /// bf16 elements of one block in one layer, for K or for V.
    fn block_elems(&self) -> usize {
        self.block_size * self.cfg.kv_dim()
    }

    /// A staging pool must have this cache's shape.
    fn check_stage(&self, pool: &crate::kv_pool::HostKvPool) -> Result<()> {
        let own = crate::backend::Backend::kv_spec(self);
        if own.as_ref() != Some(pool.spec()) {
            return Err(EngineError::Backend(format!(
                "a staging pool of shape {:?} does not match the cache's {own:?}",
                pool.spec()
            )));
        }
        Ok(())
    }

    fn check_blocks(&self, layer: usize, blocks: &[BlockId]) -> Result<()> {
        if layer >= self.k_cache.len() {
            return Err(EngineError::Backend(format!(
                "layer {layer} does not exist (the model has {})",
                self.k_cache.len()
            )));
        }
        if let Some(b) = blocks.iter().find(|b| b.0 as usize >= self.num_blocks) {
            return Err(EngineError::Backend(format!(
                "block {} is outside the pool of {} blocks",
                b.0, self.num_blocks
            )));
        }
        Ok(())
    }
}

impl Backend for CudaBackend {
    fn device(&self) -> String {
        format!("cuda:{}", self.ordinal)
    }

    fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// bf16 K and V in device memory. There is no host view of it (`host_kv` is `None`): KV
    /// transfers go through host staging pools (`kv_staging`).
    fn kv_spec(&self) -> Option<crate::kv_pool::KvSpec> {
        Some(crate::kv_pool::KvSpec {
            num_layers: self.cfg.num_layers,
            block_size: self.block_size,
            num_kv_heads: self.cfg.num_kv_heads,
            head_dim: self.cfg.head_dim,
            dtype: crate::kv_pool::KvDtype::Bf16,
        })
    }

    /// Transfers go through host staging pools: `copy_blocks_out`/`copy_blocks_in` move
    /// whole blocks through a pinned buffer, and only the asked-for positions are written on
    /// the host side.
    fn kv_staging(&self) -> bool {
        true
    }

    fn kv_to_host(
        &mut self,
        table: &[BlockId],
        positions: std::ops::Range<usize>,
        dst: &crate::kv_pool::HostKvPool,
        dst_table: &[BlockId],
    ) -> Result<()> {
        if positions.is_empty() {
            return Ok(());
        }
        self.check_stage(dst)?;
        let bs = self.block_size;
        let bpp = self.cfg.kv_dim() * 2;
        let block_bytes = bs * bpp;
        let (b0, b1) = (positions.start / bs, (positions.end - 1) / bs + 1);
        let blocks = table.get(b0..b1).ok_or_else(|| {
            EngineError::Backend(format!("no blocks for positions {positions:?}"))
        })?;
        dst.check_table(dst_table)?;
        for layer in 0..self.cfg.num_layers {
            // Per block: its K, then its V.
            let bytes = self.copy_blocks_out(layer, blocks)?;
            for pos in positions.clone() {
                let (i, off) = (pos / bs - b0, pos % bs);
                let dst_block = dst_table
                    .get(pos / bs)
                    .ok_or_else(|| EngineError::Backend(format!("no staging block for {pos}")))?;
                let at = (dst_block.0 as usize * bs + off) * bpp;
                for (kind, src_at) in [
                    (crate::kv_pool::KvKind::K, i * 2 * block_bytes + off * bpp),
                    (
                        crate::kv_pool::KvKind::V,
                        i * 2 * block_bytes + block_bytes + off * bpp,
                    ),
                ] {
                    // SAFETY: `check_stage` and `check_table` put the slot inside the staging
                    // pool, which the engine lends to no one for positions not yet reported.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            bytes[src_at..src_at + bpp].as_ptr(),
                            dst.base(layer, kind).add(at),
                            bpp,
                        )
                    };
                }
            }
        }
        Ok(())
    }

    fn kv_from_host(
        &mut self,
        src: &crate::kv_pool::HostKvPool,
        src_table: &[BlockId],
        positions: std::ops::Range<usize>,
        table: &[BlockId],
    ) -> Result<()> {
        if positions.is_empty() {
            return Ok(());
        }
        self.check_stage(src)?;
        src.check_table(src_table)?;
        let bs = self.block_size;
        let block_bytes = bs * self.cfg.kv_dim() * 2;
        let n = (positions.end - positions.start).div_ceil(bs);
        if src_table.len() < n || table.len() < n {
            return Err(EngineError::Backend(format!(
                "positions {positions:?} need {n} blocks"
            )));
        }
        for layer in 0..self.cfg.num_layers {
            let mut bytes = Vec::with_capacity(n * 2 * block_bytes);
            for b in &src_table[..n] {
                let at = b.0 as usize * block_bytes;
                for kind in [crate::kv_pool::KvKind::K, crate::kv_pool::KvKind::V] {
                    // SAFETY: inside the staging pool (checked), which the landed transfer no
                    // longer writes.
                    bytes.extend_from_slice(unsafe {
                        std::slice::from_raw_parts(src.base(layer, kind).add(at), block_bytes)
                    });
                }
            }
            self.copy_blocks_in(layer, &table[..n], &bytes)?;
        }
        Ok(())
    }

    fn forward(&mut self, batch: &ForwardBatch) -> Result<Vec<Vec<f32>>> {
        let n = self.run(batch)?;
        if n == 0 {
            return Ok(Vec::new());
        }
        let v = self.cfg.vocab_size;
        let ls = self
            .ls
            .as_ref()
            .ok_or_else(|| EngineError::Backend("logits space missing".into()))?;
        let host = self
            .stream
            .clone_dtoh(&ls.logits.slice(0..n * v))
            .map_err(|e| drv("logits copy", e))?;
        // A copy to pageable memory completes before returning, but say so explicitly.
        self.stream
            .synchronize()
            .map_err(|e| drv("logits copy", e))?;
        Ok(host.chunks_exact(v).map(<[f32]>::to_vec).collect())
    }

    /// Sampling on the device (greedy, temperature, top-k, top-p; see `sample_rows` in
    /// kernels.cu): only the chosen token and its logprob per sequence are copied back, not
    /// a vocabulary of logits. Each non-greedy row takes one uniform draw from its request's
    /// seeded generator here, as the CPU sampler does. A request that asks for top logprobs
    /// falls back to copying the logits and sampling with `sampler::sample`.
    fn forward_sample(
        &mut self,
        batch: &ForwardBatch,
        specs: &mut [SampleSpec],
    ) -> Result<Vec<Sampled>> {
        if specs
            .iter()
            .any(|s| !matches!(s.params.logprobs, None | Some(0)))
        {
            let logits = self.forward(batch)?;
            return Ok(logits
                .iter()
                .zip(specs.iter_mut())
                .map(|(l, s)| sample(l, s.params, s.rng))
                .collect());
        }
        let n = self.run(batch)?;
        if n != specs.len() {
            return Err(EngineError::Backend(format!(
                "{n} sequences want a token but {} sampling specs were given",
                specs.len()
            )));
        }
        if n == 0 {
            return Ok(Vec::new());
        }
        let vocab_i = self.cfg.vocab_size as i32;
        let ls = self
            .ls
            .as_mut()
            .ok_or_else(|| EngineError::Backend("logits space missing".into()))?;
        let host = sample_params(specs, ls.rows);
        self.stream
            .memcpy_htod(&host.floats, &mut ls.params_f)
            .map_err(|e| drv("sampling parameters copy", e))?;
        self.stream
            .memcpy_htod(&host.top_k, &mut ls.top_k)
            .map_err(|e| drv("sampling parameters copy", e))?;
        let rows = ls.rows;
        let temps = ls.params_f.slice(0..rows);
        let top_ps = ls.params_f.slice(rows..2 * rows);
        let uniforms = ls.params_f.slice(2 * rows..3 * rows);
        // SAFETY: logits holds n rows of vocab; every per-row buffer holds `rows` >= n entries.
        unsafe {
            self.stream
                .launch_builder(&self.k.sample_rows)
                .arg(&ls.logits)
                .arg(&vocab_i)
                .arg(&temps)
                .arg(&ls.top_k)
                .arg(&top_ps)
                .arg(&uniforms)
                .arg(&mut ls.token)
                .arg(&mut ls.logprob)
                .launch(grid(n, 1, 1, SAMPLE_THREADS))
        }
        .map_err(|e| drv("sample_rows launch", e))?;
        let tokens = self
            .stream
            .clone_dtoh(&ls.token.slice(0..n))
            .map_err(|e| drv("token copy", e))?;
        let logprobs = self
            .stream
            .clone_dtoh(&ls.logprob.slice(0..n))
            .map_err(|e| drv("logprob copy", e))?;
        self.stream
            .synchronize()
            .map_err(|e| drv("token copy", e))?;
        Ok(tokens
            .into_iter()
            .zip(logprobs)
            .map(|(t, lp)| Sampled {
                token: t.max(0) as u32,
                logprob: lp,
                top: Vec::new(),
            })
            .collect())
    }
}

/// Queries per block of `paged_attention_prefill` (its PF_Q), one warp each: every key/value
/// tile staged in shared memory serves this many queries, so the cache traffic of a prompt
/// of L tokens is about L^2 / PREFILL_QUERIES_PER_BLOCK rows per head.
const PREFILL_QUERIES_PER_BLOCK: usize = 8;

/// Threads per block of the `sample_rows` kernel (its SAMPLE_THREADS).
const SAMPLE_THREADS: u32 = 512;

/// The host side of `sample_rows`'s parameters, padded to the buffers' `rows`.
struct SampleParamsHost {
    /// temperatures, then top_p, then uniforms: three runs of `rows`.
    floats: Vec<f32>,
    top_k: Vec<i32>,
}

/// Lays the sequences' sampling parameters out for `sample_rows`. Greedy rows (temperature
/// about 0 or top_k 1, as the CPU sampler decides) draw nothing from their generator; every
/// other row draws exactly one uniform, so a seed's stream advances as on the CPU.
fn sample_params(specs: &mut [SampleSpec], rows: usize) -> SampleParamsHost {
    let mut floats = vec![0.0f32; 3 * rows];
    let mut top_k = vec![0i32; rows];
    for (i, s) in specs.iter_mut().enumerate() {
        let p = s.params;
        let greedy = p.temperature <= 1e-5 || p.top_k == 1;
        floats[i] = if greedy { 0.0 } else { p.temperature };
        floats[rows + i] = p.top_p.clamp(0.0, 1.0);
        top_k[i] = p.top_k.min(i32::MAX as usize) as i32;
        if !greedy {
            // Below 1 after rounding to f32, so the draw never lands past the total.
            floats[2 * rows + i] = (s.rng.next_f64() as f32).min(1.0 - f32::EPSILON);
        }
    }
    SampleParamsHost { floats, top_k }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--device auto` probes this on every machine: without a driver it must say 0, not
    /// panic inside the dynamic loader.
    #[test]
    fn device_count_never_panics() {
        assert!(device_count().is_ok());
    }

    #[test]
    fn kv_block_bytes_are_bf16_k_and_v_for_every_layer() {
        let cfg = ModelConfig::from_json(
            r#"{"architectures":["Qwen3ForCausalLM"],"vocab_size":10,"hidden_size":64,
               "intermediate_size":8,"num_hidden_layers":3,"num_attention_heads":4,
               "num_key_value_heads":2,"head_dim":32}"#,
        )
        .unwrap();
        // 2 (K and V) * 3 layers * 16 tokens * 64 (2 kv heads * 32) * 2 bytes.
        assert_eq!(
            CudaBackend::kv_bytes_per_block(&cfg, 16),
            2 * 3 * 16 * 64 * 2
        );
    }

    /// Padding must never point a real sequence's table or a padding token's KV write at a
    /// block the scheduler owns: everything padded goes to the scratch block.
    #[test]
    fn decode_graph_inputs_pad_to_the_scratch_block() {
        use crate::backend::SeqInput;
        let (t0, t1) = ([BlockId(3), BlockId(4)], [BlockId(7)]);
        let batch = ForwardBatch {
            seqs: vec![
                SeqInput {
                    tokens: &[11],
                    start_pos: 5,
                    context_len: 0,
                    block_table: &t0,
                    want_logits: true,
                },
                SeqInput {
                    tokens: &[12],
                    start_pos: 2,
                    context_len: 0,
                    block_table: &t1,
                    want_logits: true,
                },
            ],
        };
        let layout = batch::build(&batch, 4, 8, 100).unwrap();
        let g = graph_inputs(&layout, 4, 3, 8, 4);
        assert_eq!(g.token_ids, vec![11, 12, 0, 0]);
        assert_eq!(g.positions, vec![5, 2, 0, 0]);
        assert_eq!(g.slots, vec![4 * 4 + 1, 7 * 4 + 2, 32, 32]);
        assert_eq!(g.seq_starts, vec![0, 1, 2, 3, 4]);
        assert_eq!(g.seq_lens, vec![6, 3, 1, 1]);
        // Sequence 1's row: its block, then the layout's padding (block 0, never read past
        // seq_lens), then the scratch block.
        assert_eq!(g.tables, vec![3, 4, 8, 7, 0, 8, 8, 8, 8, 8, 8, 8]);
        assert_eq!(g.logits_rows, vec![0, 1, 2, 3]);
    }

    #[test]
    fn sampling_parameters_draw_only_for_random_rows() {
        use crate::sampler::{Rng, SamplingParams};
        let greedy = SamplingParams {
            temperature: 0.0,
            ..Default::default()
        };
        let random = SamplingParams {
            temperature: 0.7,
            top_k: 40,
            top_p: 0.9,
            ..Default::default()
        };
        let (mut r0, mut r1) = (Rng::seeded(5), Rng::seeded(5));
        let mut specs = [
            SampleSpec {
                params: &greedy,
                rng: &mut r0,
            },
            SampleSpec {
                params: &random,
                rng: &mut r1,
            },
        ];
        let h = sample_params(&mut specs, 4);
        assert_eq!(h.floats.len(), 12);
        assert_eq!(&h.floats[0..2], &[0.0, 0.7]);
        assert_eq!(&h.floats[4..6], &[1.0, 0.9]);
        assert_eq!(h.top_k[..2], [0, 40]);
        let mut fresh = Rng::seeded(5);
        assert_eq!(h.floats[8], 0.0);
        assert_eq!(h.floats[9], fresh.next_f64() as f32);
        // The greedy row's generator was not touched; the random row's advanced once.
        assert_eq!(r0.next_u64(), Rng::seeded(5).next_u64());
        assert_eq!(r1.next_u64(), fresh.next_u64());
    }

    #[test]
    fn host_conversion_to_bf16_rounds_to_nearest_even() {
        let v = to_bf16(TensorData::F32(vec![1.0, -2.5, 1.0 + 1.0 / 256.0]));
        // 1 + 2^-8 is halfway between two bf16 values; the even one (1.0) wins.
        assert_eq!(v, vec![0x3f80, 0xc020, 0x3f80]);
        assert_eq!(to_bf16(TensorData::Bf16(vec![7, 8])), vec![7, 8]);
    }
}
