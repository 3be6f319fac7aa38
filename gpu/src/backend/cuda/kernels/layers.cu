// Per-layer elementwise and row kernels: embedding, norms, bias, RoPE with the KV write,
// SiLU-gated product, row gather.
// Part of the kernels' one source: common.cuh, then layers.cu, attention_decode.cu,
// attention_prefill.cu and sampling.cu, joined in that order (kernels.rs, KERNELS_CU).

// out[t, :] = table[ids[t], :] widened to f32. Grid (T), any block size.
extern "C" __global__ void __launch_bounds__(EMBED_THREADS)
embed_gather(const bf16* __restrict__ table,
             const int* __restrict__ ids,
             float* __restrict__ out, int hidden) {
    pdl_start();
    int t = blockIdx.x;
    long long src = (long long)ids[t] * hidden;
    long long dst = (long long)t * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) out[dst + i] = bf2f(table[src + i]);
}

// out = bf16(rmsnorm(x) * w), one row per block. Grid (rows), block multiple of 32.
extern "C" __global__ void __launch_bounds__(RMSNORM_THREADS)
rmsnorm_to_bf16(const float* __restrict__ x,
                const float* __restrict__ w,
                bf16* __restrict__ out, int hidden, float eps) {
    pdl_start();
    long long off = (long long)blockIdx.x * hidden;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        float v = x[off + i];
        ss += v * v;
    }
    ss = block_sum(ss);
    float inv = 1.0f / sqrtf(ss / (float)hidden + eps);
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) out[off + i] = f2bf(x[off + i] * inv * w[i]);
}

// Four bf16 (rounded from f32) packed into 8 bytes, first in the low half.
__device__ __forceinline__ uint2 pack_bf16x4(float a, float b, float c, float d) {
    return make_uint2((unsigned int)f2bf(a) | ((unsigned int)f2bf(b) << 16),
                      (unsigned int)f2bf(c) | ((unsigned int)f2bf(d) << 16));
}

// Rows this wide take the register-held path below (and only they can have the norm as a
// skinny product's prologue): a multiple of 4, at most NORM_CACHED float4 per thread.
#define NORM_MAX (NORM_CACHED * 4 * ADD_RMSNORM_THREADS)

// A float4's sum of squares, its rounding pinned (no contraction into fused multiply-adds),
// so that every kernel that sums a row this way gets the same bits.
__device__ __forceinline__ float sq4(float4 v) {
    return __fadd_rn(__fadd_rn(__fadd_rn(__fmul_rn(v.x, v.x), __fmul_rn(v.y, v.y)),
                               __fmul_rn(v.z, v.z)),
                     __fmul_rn(v.w, v.w));
}

// The register-held half of add_rmsnorm_to_bf16, for a block of ADD_RMSNORM_THREADS
// threads: v = one row of residual + delta (thread t holding float4s t, t + threads, ...),
// and the row's 1 / rms.
__device__ __forceinline__ float add_row_cached(const float* __restrict__ residual,
                                                const float* __restrict__ delta,
                                                float4 (&v)[NORM_CACHED], int hidden,
                                                float eps) {
    const int n4 = hidden >> 2;
    const float4* r4 = reinterpret_cast<const float4*>(residual);
    const float4* d4 = reinterpret_cast<const float4*>(delta);
#pragma unroll
    for (int j = 0; j < NORM_CACHED; j++) {
        int i = threadIdx.x + j * ADD_RMSNORM_THREADS;
        v[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (i < n4) {
            float4 a = r4[i];
            float4 b = d4[i];
            v[j] = make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
        }
    }
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < NORM_CACHED; j++) {
        if (threadIdx.x + j * ADD_RMSNORM_THREADS < n4) ss = __fadd_rn(ss, sq4(v[j]));
    }
    ss = block_sum(ss);
    return 1.0f / sqrtf(ss / (float)hidden + eps);
}

// The same 1 / rms without holding the row (for kernels that need their registers for
// something else): the same sums in the same order, so the same bits.
__device__ __forceinline__ float add_row_inv_rms(const float* __restrict__ residual,
                                                 const float* __restrict__ delta, int hidden,
                                                 float eps) {
    const int n4 = hidden >> 2;
    const float4* r4 = reinterpret_cast<const float4*>(residual);
    const float4* d4 = reinterpret_cast<const float4*>(delta);
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < NORM_CACHED; j++) {
        int i = threadIdx.x + j * ADD_RMSNORM_THREADS;
        if (i < n4) {
            float4 a = r4[i];
            float4 b = d4[i];
            ss = __fadd_rn(ss, sq4(make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w)));
        }
    }
    ss = block_sum(ss);
    return 1.0f / sqrtf(ss / (float)hidden + eps);
}

// residual += delta, then out = bf16(rmsnorm(residual) * w): the residual add after o_proj
// and down_proj fused with the norm that follows it. Grid (rows), block ADD_RMSNORM_THREADS.
// A row of up to NORM_MAX (8,192 at 256 threads) is read with 16-byte loads, all issued
// before the first is used, and kept in registers for the second pass (add_row_cached): at
// one row a step (batch-1 decode) the kernel is two memory latencies, not one per element a
// thread handles (the loop below, which other widths still take, measured 16 µs a launch
// at 4,096 on an H100).
extern "C" __global__ void __launch_bounds__(ADD_RMSNORM_THREADS)
add_rmsnorm_to_bf16(float* __restrict__ residual,
                    const float* __restrict__ delta,
                    const float* __restrict__ w,
                    bf16* __restrict__ out, int hidden, float eps) {
    pdl_start();
    long long off = (long long)blockIdx.x * hidden;
    if ((hidden & 3) == 0 && hidden <= NORM_MAX) {
        const int n4 = hidden >> 2;
        float4 v[NORM_CACHED];
        float inv = add_row_cached(residual + off, delta + off, v, hidden, eps);
        float4* r4 = reinterpret_cast<float4*>(residual + off);
        const float4* w4 = reinterpret_cast<const float4*>(w);
        uint2* o = reinterpret_cast<uint2*>(out + off);
#pragma unroll
        for (int j = 0; j < NORM_CACHED; j++) {
            int i = threadIdx.x + j * ADD_RMSNORM_THREADS;
            if (i < n4) {
                r4[i] = v[j];
                float4 g = w4[i];
                o[i] = pack_bf16x4(v[j].x * inv * g.x, v[j].y * inv * g.y, v[j].z * inv * g.z,
                                   v[j].w * inv * g.w);
            }
        }
        return;
    }
    float ss = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        float v = residual[off + i] + delta[off + i];
        residual[off + i] = v;
        ss += v * v;
    }
    ss = block_sum(ss);
    float inv = 1.0f / sqrtf(ss / (float)hidden + eps);
    // Each thread reads back only the elements it wrote above.
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        out[off + i] = f2bf(residual[off + i] * inv * w[i]);
    }
}

// y[r, c] += b[c] for a [rows, cols] f32 matrix (the q/k/v biases). Grid (rows).
extern "C" __global__ void __launch_bounds__(BIAS_ADD_THREADS)
bias_add(float* __restrict__ y, const float* __restrict__ b, int cols) {
    pdl_start();
    float* row = y + (long long)blockIdx.x * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) row[c] += b[c];
}

// Rotary embedding (rotate-half: element i pairs with i + d/2) on the q and k heads of each
// token, in place; for k heads the rotated k and the token's v are also written, as bf16,
// to the paged cache at the token's slot (rope_pair: the angle positions * inv_freq[i]).
// q_w, k_w (both, or both null): Qwen3's RMSNorm over each q and k head first. A warp takes
// a head: lane l sums the squares of elements l, l + 32, ... (the order the fused form,
// skinny.cu's rope_norm_last, keeps), and rotates pairs l, l + 32, ..., each element read
// and written by one lane, so no barrier is needed; every element is scaled by inv * w[i]
// before it is rotated. ROPE_THREADS / 32 heads a block: a prompt's launch has that many
// times fewer, longer blocks than one head a block would.
// Grid (T, ceil((nq + nkv) / (ROPE_THREADS / 32))), block ROPE_THREADS (a multiple of 32).
extern "C" __global__ void __launch_bounds__(ROPE_THREADS)
rope_kv_write(float* __restrict__ qkv,
              const int* __restrict__ positions,
              const float* __restrict__ inv_freq,
              const int* __restrict__ slot_mapping,
              bf16* __restrict__ k_cache, bf16* __restrict__ v_cache,
              const float* __restrict__ q_w, const float* __restrict__ k_w, float eps,
              int row_stride, int nq, int nkv, int d) {
    pdl_start();
    int t = blockIdx.x;
    int h = blockIdx.y * (ROPE_THREADS / 32) + (threadIdx.x >> 5);
    if (h >= nq + nkv) return;  // the whole warp
    int lane = threadIdx.x & 31;
    int half = d / 2;
    float* row = qkv + (long long)t * row_stride;
    float* p = row + (long long)h * d;
    float pos = (float)positions[t];
    long long kvd = (long long)nkv * d;
    long long slot_off = (long long)slot_mapping[t] * kvd;
    const float* nw = h < nq ? q_w : k_w;
    float inv = 1.0f;
    if (nw != nullptr) {
        float ss = 0.0f;
        for (int i = lane; i < d; i += 32) ss += p[i] * p[i];
        // Every lane's reads are done when the sum is: the writes below come after.
        ss = warp_sum(ss);
        inv = 1.0f / sqrtf(ss / (float)d + eps);
    }
    for (int i = lane; i < half; i += 32) {
        float x1 = p[i];
        float x2 = p[i + half];
        if (nw != nullptr) {
            x1 = x1 * inv * nw[i];
            x2 = x2 * inv * nw[i + half];
        }
        float y1, y2;
        rope_pair(x1, x2, pos, inv_freq[i], &y1, &y2);
        p[i] = y1;
        p[i + half] = y2;
        if (h >= nq) {
            int kh = h - nq;
            long long o = slot_off + (long long)kh * d;
            const float* v = row + (long long)(nq + nkv) * d + (long long)kh * d;
            k_cache[o + i] = f2bf(y1);
            k_cache[o + i + half] = f2bf(y2);
            v_cache[o + i] = f2bf(v[i]);
            v_cache[o + i + half] = f2bf(v[i + half]);
        }
    }
}

// out[r, i] = bf16(silu(gu[r, i]) * gu[r, inter + i]) for the stacked gate/up output.
// Grid (rows, ceil(inter / (SILU_MUL_COLS(inter) * SILU_MUL_THREADS))): 4 columns a thread
// by 16-byte loads where inter is a multiple of 4 (every row then starts 16-byte aligned),
// else one. A decode step's few rows still spread over many multiprocessors (one block
// looping over a row was bound by its loads' latency). The row is the grid's x, so no flat
// index needs a 64-bit division, whose slow path made an earlier grid-stride version spill
// registers.
#define SILU_MUL_COLS(inter) (((inter) & 3) == 0 ? 4 : 1)
__device__ __forceinline__ float silu_times(float g, float u) { return g / (1.0f + expf(-g)) * u; }

extern "C" __global__ void __launch_bounds__(SILU_MUL_THREADS)
silu_mul(const float* __restrict__ gu, bf16* __restrict__ out, int inter) {
    pdl_start();
    const float* g = gu + (long long)blockIdx.x * 2 * inter;
    bf16* o = out + (long long)blockIdx.x * inter;
    int t = blockIdx.y * blockDim.x + threadIdx.x;
    if (SILU_MUL_COLS(inter) == 4) {
        int i = 4 * t;
        if (i >= inter) return;
        float4 a = *reinterpret_cast<const float4*>(g + i);
        float4 b = *reinterpret_cast<const float4*>(g + inter + i);
        *reinterpret_cast<uint2*>(o + i) =
            make_uint2((unsigned)f2bf(silu_times(a.x, b.x)) | ((unsigned)f2bf(silu_times(a.y, b.y)) << 16),
                       (unsigned)f2bf(silu_times(a.z, b.z)) | ((unsigned)f2bf(silu_times(a.w, b.w)) << 16));
        return;
    }
    if (t >= inter) return;
    o[t] = f2bf(silu_times(g[t], g[inter + t]));
}

// silu_mul for gate/up products held in bf16 (a bf16 model's cuBLAS products, past the rows
// the skinny kernels take): the products' f32 store and load become bf16, and each thread
// takes 8 columns by 16-byte loads and a 16-byte store. inter a multiple of 8.
// Grid (rows, ceil(inter / (8 * SILU_MUL_THREADS))).
extern "C" __global__ void __launch_bounds__(SILU_MUL_THREADS)
silu_mul_bf16(const bf16* __restrict__ gu, bf16* __restrict__ out, int inter) {
    pdl_start();
    int i = (blockIdx.y * blockDim.x + threadIdx.x) * 8;
    if (i >= inter) return;
    const bf16* g = gu + (long long)blockIdx.x * 2 * inter;
    uint4 gv = *reinterpret_cast<const uint4*>(g + i);
    uint4 uv = *reinterpret_cast<const uint4*>(g + inter + i);
    unsigned gw[4] = {gv.x, gv.y, gv.z, gv.w};
    unsigned uw[4] = {uv.x, uv.y, uv.z, uv.w};
    unsigned ow[4];
#pragma unroll
    for (int w = 0; w < 4; w++) {
        float g0 = __uint_as_float(gw[w] << 16), g1 = __uint_as_float(gw[w] & 0xffff0000u);
        float u0 = __uint_as_float(uw[w] << 16), u1 = __uint_as_float(uw[w] & 0xffff0000u);
        ow[w] = (unsigned)f2bf(silu_times(g0, u0)) | ((unsigned)f2bf(silu_times(g1, u1)) << 16);
    }
    *reinterpret_cast<uint4*>(out + (long long)blockIdx.x * inter + i) =
        make_uint4(ow[0], ow[1], ow[2], ow[3]);
}

// dst[k, :] = src[rows[k], :] (bf16): picks the rows that need logits. Grid (num rows).
extern "C" __global__ void __launch_bounds__(GATHER_THREADS)
gather_rows_bf16(const bf16* __restrict__ src,
                 const int* __restrict__ rows,
                 bf16* __restrict__ dst, int cols) {
    pdl_start();
    long long s = (long long)rows[blockIdx.x] * cols;
    long long o = (long long)blockIdx.x * cols;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) dst[o + i] = src[s + i];
}

// A float's bits mapped to an unsigned key with the same order (negative values reversed),
