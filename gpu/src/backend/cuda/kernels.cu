// kvmesh CUDA kernels, compiled at run time by NVRTC (see ptx_cache.rs).
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
    !defined(RMSNORM_THREADS) || !defined(ADD_RMSNORM_THREADS) ||                      \
    !defined(BIAS_ADD_THREADS) || !defined(QK_NORM_THREADS) || !defined(ROPE_THREADS) || \
    !defined(DECODE_THREADS) || !defined(SILU_MUL_THREADS) || !defined(GATHER_THREADS) || \
    !defined(SAMPLE_THREADS) || !defined(CONSTRAIN_THREADS)
#error "kernels.cu is compiled with the launch figures of shapes.rs (defines()) as -D options"
#endif
#if QK_NORM_THREADS != 32
#error "qk_norm reduces one head with a single warp"
#endif
#if DECODE_THREADS != 128
#error "paged_attention_decode merges the partial softmaxes of exactly four warps"
#endif

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

// out[t, :] = table[ids[t], :] widened to f32. Grid (T), any block size.
extern "C" __global__ void __launch_bounds__(EMBED_THREADS)
embed_gather(const bf16* __restrict__ table,
             const int* __restrict__ ids,
             float* __restrict__ out, int hidden) {
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

// residual += delta, then out = bf16(rmsnorm(residual) * w): the residual add after o_proj
// and down_proj fused with the norm that follows it. Grid (rows), block multiple of 32.
extern "C" __global__ void __launch_bounds__(ADD_RMSNORM_THREADS)
add_rmsnorm_to_bf16(float* __restrict__ residual,
                    const float* __restrict__ delta,
                    const float* __restrict__ w,
                    bf16* __restrict__ out, int hidden, float eps) {
    long long off = (long long)blockIdx.x * hidden;
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
    float* row = y + (long long)blockIdx.x * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) row[c] += b[c];
}

// Qwen3's RMSNorm over each q and k head, in place in the qkv rows. Because k heads follow
// q heads directly, head h (q for h < nq, k after) starts at h * d.
// Grid (T, nq + nkv), block 32.
extern "C" __global__ void __launch_bounds__(QK_NORM_THREADS)
qk_norm(float* __restrict__ qkv, const float* __restrict__ q_w,
        const float* __restrict__ k_w, int row_stride, int nq, int d,
        float eps) {
    int h = blockIdx.y;
    float* p = qkv + (long long)blockIdx.x * row_stride + (long long)h * d;
    const float* w = h < nq ? q_w : k_w;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < d; i += 32) ss += p[i] * p[i];
    ss = warp_sum(ss);
    float inv = 1.0f / sqrtf(ss / (float)d + eps);
    for (int i = threadIdx.x; i < d; i += 32) p[i] = p[i] * inv * w[i];
}

// Rotary embedding (rotate-half: element i pairs with i + d/2) on the q and k heads of each
// token, in place; for k heads the rotated k and the token's v are also written, as bf16,
// to the paged cache at the token's slot. Angles are pos * inv_freq[i] in f32 with the
// precise sincosf, as the CPU backend computes them.
// Grid (T, nq + nkv), block 64.
extern "C" __global__ void __launch_bounds__(ROPE_THREADS)
rope_kv_write(float* __restrict__ qkv,
              const int* __restrict__ positions,
              const float* __restrict__ inv_freq,
              const int* __restrict__ slot_mapping,
              bf16* __restrict__ k_cache, bf16* __restrict__ v_cache,
              int row_stride, int nq, int nkv, int d) {
    int t = blockIdx.x;
    int h = blockIdx.y;
    int half = d / 2;
    float* row = qkv + (long long)t * row_stride;
    float* p = row + (long long)h * d;
    float pos = (float)positions[t];
    long long kvd = (long long)nkv * d;
    long long slot_off = (long long)slot_mapping[t] * kvd;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float s, c;
        sincosf(pos * inv_freq[i], &s, &c);
        float x1 = p[i];
        float x2 = p[i + half];
        float y1 = x1 * c - x2 * s;
        float y2 = x2 * c + x1 * s;
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

// Decode attention: each sequence runs one token (row seq_starts[s]); one block per
// (sequence, q head) reads the sequence's whole history through its block table. The four
// warps take every fourth position; each keeps an online softmax (running max m, sum l,
// weighted V sum spread over the lanes), and the four partial results are merged at the end.
// GQA: q head h reads kv head h / (nq / nkv). Output bf16 [T, nq * d] for o_proj.
// window > 0: a sliding-window layer; the query sees only the last `window` positions
// (itself included), as transformers' mask `kv > q - window` has it. 0: the whole history.
// Grid (S, nq), block 128. Requires d <= 256.
extern "C" __global__ void __launch_bounds__(DECODE_THREADS)
paged_attention_decode(
    const float* __restrict__ qkv, int row_stride, const int* __restrict__ seq_starts,
    const int* __restrict__ seq_lens, const int* __restrict__ block_tables, int max_blocks,
    const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache, bf16* __restrict__ out,
    int nq, int nkv, int d, int block_size, float scale, int window) {
    __shared__ float q_s[MAX_HEAD_DIM];
    __shared__ float part_m[4];
    __shared__ float part_l[4];
    __shared__ float part_acc[4][MAX_HEAD_DIM];

    int s = blockIdx.x;
    int h = blockIdx.y;
    int t = seq_starts[s];
    if (seq_starts[s + 1] == t) return;  // a sequence with no token this step
    int len = seq_lens[s];
    int g = h / (nq / nkv);
    long long kvd = (long long)nkv * d;
    const int* table = block_tables + (long long)s * max_blocks;
    const float* q = qkv + (long long)t * row_stride + (long long)h * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) q_s[i] = q[i] * scale;
    __syncthreads();

    int lane = threadIdx.x & 31;
    int warp = threadIdx.x >> 5;
    float m = NEG_INF;
    float l = 0.0f;
    float acc[HEAD_SLOTS];
#pragma unroll
    for (int j = 0; j < HEAD_SLOTS; j++) acc[j] = 0.0f;

    int lo = window > 0 ? max(0, len - window) : 0;
    for (int p = lo + warp; p < len; p += 4) {
        long long base = ((long long)table[p / block_size] * block_size + p % block_size) * kvd
                         + (long long)g * d;
        float sc = 0.0f;
#pragma unroll
        for (int j = 0; j < HEAD_SLOTS; j++) {
            int i = lane + 32 * j;
            if (i < d) sc += q_s[i] * bf2f(k_cache[base + i]);
        }
        sc = warp_sum(sc);
        float m_new = fmaxf(m, sc);
        float corr = expf(m - m_new);
        float pr = expf(sc - m_new);
        l = l * corr + pr;
#pragma unroll
        for (int j = 0; j < HEAD_SLOTS; j++) {
            int i = lane + 32 * j;
            if (i < d) acc[j] = acc[j] * corr + pr * bf2f(v_cache[base + i]);
        }
        m = m_new;
    }

    if (lane == 0) {
        part_m[warp] = m;
        part_l[warp] = l;
    }
#pragma unroll
    for (int j = 0; j < HEAD_SLOTS; j++) {
        int i = lane + 32 * j;
        if (i < d) part_acc[warp][i] = acc[j];
    }
    __syncthreads();
    // A warp that saw no position has m = -inf, l = 0 and contributes exp(-inf) = 0.
    float mm = fmaxf(fmaxf(part_m[0], part_m[1]), fmaxf(part_m[2], part_m[3]));
    float w[4];
    float total = 0.0f;
    for (int k = 0; k < 4; k++) {
        w[k] = expf(part_m[k] - mm);
        total += part_l[k] * w[k];
    }
    float inv = 1.0f / total;
    bf16* o = out + (long long)t * nq * d + (long long)h * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float v = 0.0f;
        for (int k = 0; k < 4; k++) v += part_acc[k][i] * w[k];
        o[i] = f2bf(v * inv);
    }
}

// PF_Q (from the host): queries (warps) per block; each tile of keys serves PF_Q queries.
// PF_K (from the host): keys per shared-memory tile, one per lane, so it must be 32.
#if PF_K != 32
#error "paged_attention_prefill scores one key of a tile per lane"
#endif
#define PF_STRIDE (MAX_HEAD_DIM + 2)  // padded row: an odd number of 32-bit words

// Prefill attention over the paged cache (the step's own K/V were written by rope_kv_write
// first, so chunked prefill after a cached prefix works the same way). Causal: the query at
// position p sees positions 0..=p of its sequence. Flash-style: keys and values are staged
// PF_K at a time in shared memory (bf16), each warp owns one query, lane j scores key j of
// the tile, and an online softmax keeps the running max, sum and weighted V sum, so scores
// are never materialised. GQA as in decode. window > 0: the query at position p sees only
// positions p - window + 1 ..= p (sliding-window layers).
// Grid (S, nq, ceil(max_query_len / PF_Q)), block 256 (PF_Q warps). Requires d <= 256.
// Shared memory: 8 KiB of queries + 2 x 16.1 KiB of key/value tiles, under the 48 KiB static cap.
extern "C" __global__ void __launch_bounds__(PF_Q * 32)
paged_attention_prefill(
    const float* __restrict__ qkv, int row_stride, const int* __restrict__ positions,
    const int* __restrict__ seq_starts, const int* __restrict__ seq_lens,
    const int* __restrict__ block_tables, int max_blocks, const bf16* __restrict__ k_cache,
    const bf16* __restrict__ v_cache, bf16* __restrict__ out, int nq, int nkv, int d,
    int block_size, float scale, int window) {
    __shared__ float q_s[PF_Q][MAX_HEAD_DIM];
    __shared__ bf16 k_s[PF_K * PF_STRIDE];
    __shared__ bf16 v_s[PF_K * PF_STRIDE];

    int s = blockIdx.x;
    int h = blockIdx.y;
    int start = seq_starts[s];
    int end = seq_starts[s + 1];
    int first = start + blockIdx.z * PF_Q;
    if (first >= end) return;  // the whole block exits together: no barrier is skipped
    int last = min(first + PF_Q, end) - 1;
    int len = seq_lens[s];
    int g = h / (nq / nkv);
    long long kvd = (long long)nkv * d;
    const int* table = block_tables + (long long)s * max_blocks;

    int lane = threadIdx.x & 31;
    int warp = threadIdx.x >> 5;
    int row = first + warp;
    bool active = row <= last;
    int my_pos = active ? positions[row] : -1;
    // Keys needed by the block: up to the last query's position (within the sequence), and
    // with a window, from the first query's window start.
    int kv_end = min(positions[last] + 1, len);
    int kv_lo = window > 0 ? max(0, positions[first] - window + 1) : 0;

    if (active) {
        const float* q = qkv + (long long)row * row_stride + (long long)h * d;
        for (int i = lane; i < d; i += 32) q_s[warp][i] = q[i] * scale;
    }

    float m = NEG_INF;
    float l = 0.0f;
    float acc[HEAD_SLOTS];
#pragma unroll
    for (int j = 0; j < HEAD_SLOTS; j++) acc[j] = 0.0f;

    for (int k0 = kv_lo; k0 < kv_end; k0 += PF_K) {
        __syncthreads();  // the previous tile is no longer read
        int n = min(PF_K, kv_end - k0);
        for (int e = threadIdx.x; e < n * d; e += blockDim.x) {
            int j = e / d;
            int i = e - j * d;
            int p = k0 + j;
            long long src = ((long long)table[p / block_size] * block_size + p % block_size) * kvd
                            + (long long)g * d + i;
            k_s[j * PF_STRIDE + i] = k_cache[src];
            v_s[j * PF_STRIDE + i] = v_cache[src];
        }
        __syncthreads();
        if (!active || k0 > my_pos) continue;

        // Lane j scores key k0 + j.
        float sc = NEG_INF;
        int p = k0 + lane;
        if (lane < n && p <= my_pos && (window <= 0 || p > my_pos - window)) {
            float dot = 0.0f;
            const bf16* kr = k_s + lane * PF_STRIDE;
            for (int i = 0; i < d; i++) dot += q_s[warp][i] * bf2f(kr[i]);
            sc = dot;
        }
        float tile_max = warp_max(sc);
        float m_new = fmaxf(m, tile_max);
        // No key of this tile is in the query's window and none was before: nothing to add
        // (and exp(-inf - -inf) would be NaN). Uniform across the warp.
        if (m_new == NEG_INF) continue;
        float corr = expf(m - m_new);
        float pr = (sc == NEG_INF) ? 0.0f : expf(sc - m_new);
        l = l * corr + warp_sum(pr);
#pragma unroll
        for (int j = 0; j < HEAD_SLOTS; j++) acc[j] *= corr;
        for (int kk = 0; kk < n; kk++) {
            float pk = __shfl_sync(0xffffffffu, pr, kk);
            const bf16* vr = v_s + kk * PF_STRIDE;
#pragma unroll
            for (int j = 0; j < HEAD_SLOTS; j++) {
                int i = lane + 32 * j;
                if (i < d) acc[j] += pk * bf2f(vr[i]);
            }
        }
        m = m_new;
    }

    if (active) {
        float inv = 1.0f / l;
        bf16* o = out + (long long)row * nq * d + (long long)h * d;
#pragma unroll
        for (int j = 0; j < HEAD_SLOTS; j++) {
            int i = lane + 32 * j;
            if (i < d) o[i] = f2bf(acc[j] * inv);
        }
    }
}

// out[r, i] = bf16(silu(gu[r, i]) * gu[r, inter + i]) for the stacked gate/up output.
// Grid (rows). (A row per block needs no 64-bit division of a flat index, whose slow path
// made an earlier grid-stride version spill registers.)
extern "C" __global__ void __launch_bounds__(SILU_MUL_THREADS)
silu_mul(const float* __restrict__ gu, bf16* __restrict__ out, int inter) {
    const float* g = gu + (long long)blockIdx.x * 2 * inter;
    bf16* o = out + (long long)blockIdx.x * inter;
    for (int i = threadIdx.x; i < inter; i += blockDim.x) {
        float x = g[i];
        o[i] = f2bf(x / (1.0f + expf(-x)) * g[inter + i]);
    }
}

// dst[k, :] = src[rows[k], :] (bf16): picks the rows that need logits. Grid (num rows).
extern "C" __global__ void __launch_bounds__(GATHER_THREADS)
gather_rows_bf16(const bf16* __restrict__ src,
                 const int* __restrict__ rows,
                 bf16* __restrict__ dst, int cols) {
    long long s = (long long)rows[blockIdx.x] * cols;
    long long o = (long long)blockIdx.x * cols;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) dst[o + i] = src[s + i];
}

// A float's bits mapped to an unsigned key with the same order (negative values reversed),
// so "the k-th largest logit" can be found by deciding the key one bit at a time.
__device__ __forceinline__ unsigned int order_key(float x) {
    unsigned int b = __float_as_uint(x);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Sampling per row on the device, so only a token id and its logprob come back to the host.
// Row r: temperature temps[r] (<= 1e-5 or top_k 1 means greedy), top_k top_ks[r] (0 = all),
// top_p top_ps[r] (1 = all), and one uniform draw uniforms[r] in [0, 1) made by the
// request's own seeded generator on the host (the CPU sampler also draws exactly one per
// sampled token, so a seed consumes the same stream on either backend).
//
// No sort: the kept set is {x : key(x) >= threshold}. top-k's threshold is the k-th largest
// key, found by bisection over the 32 key bits (a count per bit); top-p's is the largest key
// whose kept mass still reaches top_p of the top-k mass, found the same way with sums. Ties
// at a threshold are kept together. The draw walks the kept weights in vocabulary order:
// each thread owns a contiguous chunk, thread 0 prefix-sums the chunk totals, and the thread
// whose range holds u * total finds the token in its chunk. Same distribution as the CPU
// sampler (which walks candidates by rank), not the same token for a given seed.
// The logprob reported is of the raw model distribution, as the CPU sampler reports it.
// Grid (rows), block SAMPLE_THREADS.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
sample_rows(const float* __restrict__ logits, int vocab,
            const float* __restrict__ temps,
            const int* __restrict__ top_ks,
            const float* __restrict__ top_ps,
            const float* __restrict__ uniforms,
            int* __restrict__ token, float* __restrict__ logprob) {
    __shared__ float best_v[SAMPLE_THREADS];
    __shared__ int best_i[SAMPLE_THREADS];
    __shared__ float chunk_start[SAMPLE_THREADS + 1];
    __shared__ int chosen;
    int r = blockIdx.x;
    int tid = threadIdx.x;
    const float* x = logits + (long long)r * vocab;

    // Argmax (lowest index on ties, NaN never wins) and the log-sum-exp of the raw logits.
    float bv = NEG_INF;
    int bi = 0x7fffffff;
    for (int i = tid; i < vocab; i += blockDim.x) {
        float v = x[i];
        if (v > bv) {
            bv = v;
            bi = i;
        }
    }
    best_v[tid] = bv;
    best_i[tid] = bi;
    __syncthreads();
    for (int step = blockDim.x / 2; step > 0; step >>= 1) {
        if (tid < step) {
            float ov = best_v[tid + step];
            int oi = best_i[tid + step];
            if (ov > best_v[tid] || (ov == best_v[tid] && oi < best_i[tid])) {
                best_v[tid] = ov;
                best_i[tid] = oi;
            }
        }
        __syncthreads();
    }
    float mx = best_v[0];
    int arg = best_i[0] == 0x7fffffff ? 0 : best_i[0];
    float se = 0.0f;
    for (int i = tid; i < vocab; i += blockDim.x) se += expf(x[i] - mx);
    float lse = mx + logf(block_sum(se));

    float temp = temps[r];
    int k = top_ks[r];
    if (temp <= 1e-5f || k == 1) {
        if (tid == 0) {
            token[r] = arg;
            logprob[r] = x[arg] - lse;
        }
        return;
    }
    float inv_t = 1.0f / temp;

    // top-k: the largest key K with at least k logits at or above it.
    unsigned int thr = 0u;
    if (k > 0 && k < vocab) {
        for (int bit = 31; bit >= 0; bit--) {
            unsigned int cand = thr | (1u << bit);
            float c = 0.0f;
            for (int i = tid; i < vocab; i += blockDim.x) c += order_key(x[i]) >= cand ? 1.0f : 0.0f;
            if (block_sum(c) >= (float)k) thr = cand;
        }
    }
    // top-p: the largest key P whose kept mass still reaches top_p of the top-k mass.
    float p = top_ps[r];
    if (p < 1.0f) {
        float m = 0.0f;
        for (int i = tid; i < vocab; i += blockDim.x) {
            float v = x[i];
            if (order_key(v) >= thr) m += expf((v - mx) * inv_t);
        }
        float want = p * block_sum(m);
        // Mass at key >= max(P, thr) only falls as P grows, so P is decided bit by bit
        // from the top, starting from 0 (not from thr, whose bits need not be in P).
        unsigned int pthr = 0u;
        for (int bit = 31; bit >= 0; bit--) {
            unsigned int cand = max(pthr | (1u << bit), thr);
            float s = 0.0f;
            for (int i = tid; i < vocab; i += blockDim.x) {
                float v = x[i];
                if (order_key(v) >= cand) s += expf((v - mx) * inv_t);
            }
            if (block_sum(s) >= want) pthr = pthr | (1u << bit);
        }
        thr = max(pthr, thr);
    }

    // The draw over the kept weights, in vocabulary order.
    int chunk = (vocab + blockDim.x - 1) / blockDim.x;
    int c0 = min(tid * chunk, vocab);
    int c1 = min(c0 + chunk, vocab);
    float cs = 0.0f;
    for (int i = c0; i < c1; i++) {
        float v = x[i];
        if (order_key(v) >= thr) cs += expf((v - mx) * inv_t);
    }
    best_v[tid] = cs;  // reused as the chunk totals
    if (tid == 0) chosen = -1;
    __syncthreads();
    if (tid == 0) {
        float acc = 0.0f;
        for (int t = 0; t < (int)blockDim.x; t++) {
            chunk_start[t] = acc;
            acc += best_v[t];
        }
        chunk_start[blockDim.x] = acc;
    }
    __syncthreads();
    float target = uniforms[r] * chunk_start[blockDim.x];
    if (cs > 0.0f && target >= chunk_start[tid] && target < chunk_start[tid] + cs) {
        float acc = chunk_start[tid];
        int pick = -1;
        for (int i = c0; i < c1; i++) {
            float v = x[i];
            if (order_key(v) >= thr) {
                pick = i;  // the last kept token so far: rounding never leaves the chunk empty
                acc += expf((v - mx) * inv_t);
                if (target < acc) break;
            }
        }
        chosen = pick;
    }
    __syncthreads();
    if (tid == 0) {
        // Rounding can put target past every chunk; the argmax is always in the kept set.
        int t = chosen >= 0 ? chosen : arg;
        token[r] = t;
        logprob[r] = x[t] - lse;
    }
}

// A request's logit bias and grammar mask, applied to its row of logits in place before
// sample_rows. Row r's (token, bias) pairs are bias_tok/bias_val[bias_off[r] .. bias_off[r+1]],
// added by one thread (a short list; no two threads race on one logit). Where has_mask[r],
// the row's `words` mask words allow token t by bit t % 32 of word t / 32; every other token
// becomes -inf, so neither the argmax nor a draw can pick it.
// Grid (rows), block CONSTRAIN_THREADS.
extern "C" __global__ void __launch_bounds__(CONSTRAIN_THREADS)
constrain_rows(float* __restrict__ logits, int vocab,
               const unsigned int* __restrict__ masks, int words,
               const int* __restrict__ has_mask,
               const int* __restrict__ bias_off,
               const int* __restrict__ bias_tok,
               const float* __restrict__ bias_val) {
    int r = blockIdx.x;
    float* x = logits + (long long)r * vocab;
    if (threadIdx.x == 0) {
        for (int i = bias_off[r]; i < bias_off[r + 1]; i++) {
            int t = bias_tok[i];
            if (t >= 0 && t < vocab) x[t] += bias_val[i];
        }
    }
    __syncthreads();
    if (has_mask[r]) {
        const unsigned int* m = masks + (long long)r * words;
        for (int t = threadIdx.x; t < vocab; t += blockDim.x) {
            if (!((m[t >> 5] >> (t & 31)) & 1u)) x[t] = NEG_INF;
        }
    }
}
