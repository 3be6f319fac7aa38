// kvmesh CUDA kernels, compiled at run time by NVRTC (see ptx_cache.rs) as one source: this
// file, then layers.cu, attention_decode.cu, attention_prefill.cu, sampling.cu and delta.cu,
// joined in that order (kernels.rs, KERNELS_CU). This part: the figures the host passes, the shared
// helpers.
//
// Plain CUDA C with no #include: bf16 values are carried as `unsigned short` and converted
// with bit operations, so NVRTC needs no header search path. Every kernel mirrors a step of
// the CPU backend (gpu/src/backend/cpu/mod.rs), which is the reference for the math.
//
// Layouts (row-major, T = tokens in the step, S = sequences):
//   hidden stream   x      f32  [T, hidden]
//   GEMM inputs            bf16 [T, in]
//   qkv                    f32  [T, q_dim + 2 * kv_dim]  (q heads, then k heads, then v heads)
//   KV cache (per layer)   bf16 [num_blocks, block_size, num_kv_heads, head_dim]
//   block tables           i32  [S, max_blocks]
//
// Launch shapes are chosen on the host (shapes.rs), which also passes the figures both sides
// must agree on as macros (-DMAX_HEAD_DIM=256 -DSAMPLE_THREADS=512 ...). Each kernel declares
// its block size in __launch_bounds__, so ptxas never gives it more registers than a block of
// that size can have; gpu/tests/cuda_offline checks the result for every architecture.

typedef unsigned short bf16;

#if !defined(MAX_HEAD_DIM) || !defined(PF_Q) || !defined(PF_K) || !defined(EMBED_THREADS) || \
    !defined(RMSNORM_THREADS) || !defined(ADD_RMSNORM_THREADS) || !defined(NORM_CACHED) || \
    !defined(BIAS_ADD_THREADS) || !defined(ROPE_THREADS) || !defined(DECODE_THREADS) ||     \
    !defined(SILU_MUL_THREADS) || !defined(GATHER_THREADS) || !defined(SAMPLE_THREADS) ||   \
    !defined(CONSTRAIN_THREADS) || !defined(PFM_THREADS) || !defined(SAMPLE_GATHER) ||      \
    !defined(DECODE_MIN_SPLIT_KEYS) || !defined(DECODE_MAX_SPLITS) || !defined(DECODE_UNROLL)
#error "the kernels are compiled with the launch figures of shapes.rs (defines()) as -D options"
#endif
#if ROPE_THREADS % 32 != 0
#error "rope_kv_write's head norm has every warp sum the whole head"
#endif
#if DECODE_THREADS != 128
#error "paged_attention_decode merges the partial softmaxes of exactly four warps"
#endif

// Programmatic dependent launch (launch.rs): a kernel launched with it may start while the
// kernel before it in the stream is still running. pdl_trigger lets the next kernel be
// scheduled; pdl_wait returns once the previous kernel has completed and its writes are
// visible. Every kernel waits before it reads what an earlier kernel wrote and before it
// writes anything. Both are no-ops before Hopper and for a launch without the attribute.
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// The start of a kernel with nothing to do before its inputs are ready.
__device__ __forceinline__ void pdl_start() {
    pdl_trigger();
    pdl_wait();
}

#define NEG_INF __int_as_float(0xff800000)
#define HEAD_SLOTS (MAX_HEAD_DIM / 32)

__device__ __forceinline__ float bf2f(bf16 b) {
    return __uint_as_float(((unsigned int)b) << 16);
}

// Round to nearest even, as torch does; NaN stays a (quiet) NaN.
__device__ __forceinline__ bf16 f2bf(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (bf16)((u >> 16) | 0x0040u);
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

// The rotate-half rotary embedding of one pair (x1 at i, x2 at i + d/2) at position pos with
// frequency freq: the angle in f32 with the precise sincosf, as the CPU backend computes it,
// and each product and sum rounded on its own (never contracted into an FMA), so every
// kernel that rotates (rope_kv_write, the skinny products' rope epilogue) gives the same bits.
__device__ __forceinline__ void rope_pair(float x1, float x2, float pos, float freq, float* y1,
                                          float* y2) {
    float s, c;
    sincosf(pos * freq, &s, &c);
    *y1 = __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s));
    *y2 = __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s));
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
__device__ float block_sum(float v) {
    __shared__ float scratch[32];
    int lane = threadIdx.x & 31;
    int warp = threadIdx.x >> 5;
    int nwarps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // a previous call may still be reading scratch[0]
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float w = lane < nwarps ? scratch[lane] : 0.0f;
        w = warp_sum(w);
        if (lane == 0) scratch[0] = w;
    }
    __syncthreads();
    return scratch[0];
}
