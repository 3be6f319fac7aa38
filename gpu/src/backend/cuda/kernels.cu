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
    !defined(SAMPLE_THREADS) || !defined(CONSTRAIN_THREADS) || !defined(PFM_THREADS) ||   \
    !defined(SAMPLE_GATHER)
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

// Decode attention for head dimension D (16, 32, 64 or 128): the inputs, masks and output of
// paged_attention_decode, with the history read 16 bytes a lane. A position's row is D / 8
// lanes (eight dimensions each), so a warp scores 32 / (D / 8) positions at once and the four
// warps 4x that, each lane group keeping its own online softmax over the positions it took;
// the groups' partial results are merged at the end. Grid (S, nq), block 128.
template <int D>
__device__ __forceinline__ void decode_vec(
    const float* __restrict__ qkv, int row_stride, const int* __restrict__ seq_starts,
    const int* __restrict__ seq_lens, const int* __restrict__ block_tables, int max_blocks,
    const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache, bf16* __restrict__ out,
    int nq, int nkv, int block_size, float scale, int window) {
    constexpr int LPP = D / 8;        // lanes per position
    constexpr int PPW = 32 / LPP;     // positions per warp and step
    constexpr int PARTS = 4 * PPW;    // lane groups in the block
    __shared__ float part_m[PARTS];
    __shared__ float part_l[PARTS];
    __shared__ float part_acc[PARTS][D];

    int s = blockIdx.x;
    int h = blockIdx.y;
    int t = seq_starts[s];
    if (seq_starts[s + 1] == t) return;  // a sequence with no token this step
    int len = seq_lens[s];
    int kvh = h / (nq / nkv);
    long long kvd = (long long)nkv * D;
    const int* table = block_tables + (long long)s * max_blocks;
    int lane = threadIdx.x & 31;
    int warp = threadIdx.x >> 5;
    int grp = lane / LPP;
    int sub = lane % LPP;
    int part = warp * PPW + grp;

    float qv[8];
    const float* q = qkv + (long long)t * row_stride + (long long)h * D + sub * 8;
#pragma unroll
    for (int x = 0; x < 8; x++) qv[x] = q[x] * scale;

    float m = NEG_INF;
    float l = 0.0f;
    float acc[8];
#pragma unroll
    for (int x = 0; x < 8; x++) acc[x] = 0.0f;
    int lo = window > 0 ? max(0, len - window) : 0;
    // Every lane runs every step (the shuffles need the whole warp); a lane group past the
    // end scores nothing.
    for (int base = lo + warp * PPW; base < len; base += 4 * PPW) {
        int p = base + grp;
        bool valid = p < len;
        uint4 k4 = make_uint4(0u, 0u, 0u, 0u);
        uint4 v4 = make_uint4(0u, 0u, 0u, 0u);
        if (valid) {
            long long off = ((long long)table[p / block_size] * block_size + p % block_size) * kvd
                            + (long long)kvh * D + sub * 8;
            k4 = *reinterpret_cast<const uint4*>(k_cache + off);
            v4 = *reinterpret_cast<const uint4*>(v_cache + off);
        }
        unsigned kw[4] = {k4.x, k4.y, k4.z, k4.w};
        unsigned vw[4] = {v4.x, v4.y, v4.z, v4.w};
        float dot = 0.0f;
#pragma unroll
        for (int x = 0; x < 8; x++) dot += qv[x] * bf2f((bf16)(kw[x >> 1] >> ((x & 1) * 16)));
#pragma unroll
        for (int o = LPP / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
        if (valid) {
            float m_new = fmaxf(m, dot);
            float corr = expf(m - m_new);
            float pr = expf(dot - m_new);
            l = l * corr + pr;
#pragma unroll
            for (int x = 0; x < 8; x++) {
                acc[x] = acc[x] * corr + pr * bf2f((bf16)(vw[x >> 1] >> ((x & 1) * 16)));
            }
            m = m_new;
        }
    }
    if (sub == 0) {
        part_m[part] = m;
        part_l[part] = l;
    }
#pragma unroll
    for (int x = 0; x < 8; x++) part_acc[part][sub * 8 + x] = acc[x];
    __syncthreads();
    // A group that saw no position has m = -inf, l = 0 and contributes exp(-inf) = 0.
    float mm = NEG_INF;
    for (int k = 0; k < PARTS; k++) mm = fmaxf(mm, part_m[k]);
    float total = 0.0f;
    for (int k = 0; k < PARTS; k++) total += part_l[k] * expf(part_m[k] - mm);
    float inv = 1.0f / total;
    bf16* o = out + (long long)t * nq * D + (long long)h * D;
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        float v = 0.0f;
        for (int k = 0; k < PARTS; k++) v += part_acc[k][i] * expf(part_m[k] - mm);
        o[i] = f2bf(v * inv);
    }
}

// One entry point per head dimension; `d` is there so the host passes the arguments of
// paged_attention_decode unchanged (it equals D).
#define DECODE_VEC(D)                                                                          \
    extern "C" __global__ void __launch_bounds__(DECODE_THREADS) paged_attention_decode_d##D(  \
        const float* __restrict__ qkv, int row_stride, const int* __restrict__ seq_starts,     \
        const int* __restrict__ seq_lens, const int* __restrict__ block_tables,                \
        int max_blocks, const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache,    \
        bf16* __restrict__ out, int nq, int nkv, int d, int block_size, float scale,           \
        int window) {                                                                          \
        decode_vec<D>(qkv, row_stride, seq_starts, seq_lens, block_tables, max_blocks,         \
                      k_cache, v_cache, out, nq, nkv, block_size, scale, window);              \
    }
DECODE_VEC(16)
DECODE_VEC(32)
DECODE_VEC(64)
DECODE_VEC(128)

// The query rows a prefill block of `rows` rows takes (grid (S, nq, tiles): sequence
// blockIdx.x, tile blockIdx.z), its sequence's block table, and the keys the block needs: up
// to the last row's position (within the sequence) and, with a window, from the first
// row's window start. False when the tile is past the sequence's rows.
struct PrefillRows {
    int first;
    int last;
    int kv_lo;
    int kv_end;
    const int* table;
};

__device__ __forceinline__ bool prefill_rows(int rows, const int* __restrict__ positions,
                                             const int* __restrict__ seq_starts,
                                             const int* __restrict__ seq_lens,
                                             const int* __restrict__ block_tables,
                                             int max_blocks, int window, PrefillRows& b) {
    int s = blockIdx.x;
    int end = seq_starts[s + 1];
    b.first = seq_starts[s] + blockIdx.z * rows;
    if (b.first >= end) return false;
    b.last = min(b.first + rows, end) - 1;
    b.kv_end = min(positions[b.last] + 1, seq_lens[s]);
    b.kv_lo = window > 0 ? max(0, positions[b.first] - window + 1) : 0;
    b.table = block_tables + (long long)s * max_blocks;
    return true;
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

    int h = blockIdx.y;
    PrefillRows b;
    // The whole block exits together: no barrier is skipped.
    if (!prefill_rows(PF_Q, positions, seq_starts, seq_lens, block_tables, max_blocks, window, b))
        return;
    int first = b.first;
    int last = b.last;
    int g = h / (nq / nkv);
    long long kvd = (long long)nkv * d;
    const int* table = b.table;
    int kv_end = b.kv_end;
    int kv_lo = b.kv_lo;

    int lane = threadIdx.x & 31;
    int warp = threadIdx.x >> 5;
    int row = first + warp;
    bool active = row <= last;
    int my_pos = active ? positions[row] : -1;

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

#if PFM_THREADS != 128
#error "paged_attention_prefill_mma gives each of its four warps 16 query rows"
#endif
#define PFM_ROWS 64        // query rows per block: 16 per warp, the m of an m16n8k16 product
#define PFM_KEYS 32        // keys per shared-memory tile
#define PFM_VT (PFM_KEYS + 8)  // row of the transposed V tile, in bf16: 16-byte aligned

__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    return (unsigned)f2bf(lo) | ((unsigned)f2bf(hi) << 16);
}

// c += a * b on the tensor cores: a 16x16 bf16 tile (row-major fragments), b 16x8 (column
// fragments), c 16x8 f32. Fragment layout (g = lane / 4, t = lane % 4): a holds rows g and
// g + 8 at columns 2t, 2t + 1 (a[0], a[1]) and 2t + 8, 2t + 9 (a[2], a[3]); b holds rows
// 2t, 2t + 1 (b0) and 2t + 8, 2t + 9 (b1) of column g; c holds row g (c[0], c[1]) and row
// g + 8 (c[2], c[3]) at columns 2t, 2t + 1.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                         unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Whether the query at position `pos` (-1: no query) sees key position p.
__device__ __forceinline__ bool sees(int p, int pos, int kv_end, int window) {
    return p < kv_end && p <= pos && (window <= 0 || p > pos - window);
}

// Prefill attention on the tensor cores, for head dimension D (16, 32, 64 or 128); the same
// inputs, masks and output as paged_attention_prefill. Each warp owns 16 query rows: Q
// (scaled, bf16) stays in registers as mma fragments, S = Q K^T for a tile of 32 keys is
// four m16n8k16 products per 16 dims, the online softmax runs on S's fragments (a row's
// four lanes agree on its max by shuffles), and P, rounded to bf16, is fed straight back as
// the A operand of P V, so scores never leave registers. K is staged row-major and V
// transposed, so both B operands are 32-bit shared loads. Keys past the block's last
// position are zeros in the tiles and masked in S.
// Grid (S, nq, ceil(max_query_len / 64)), block 128.
template <int D>
__device__ __forceinline__ void prefill_mma(
    const float* __restrict__ qkv, int row_stride, const int* __restrict__ positions,
    const int* __restrict__ seq_starts, const int* __restrict__ seq_lens,
    const int* __restrict__ block_tables, int max_blocks, const bf16* __restrict__ k_cache,
    const bf16* __restrict__ v_cache, bf16* __restrict__ out, int nq, int nkv,
    int block_size, float scale, int window) {
    constexpr int KS = D + 8;     // K tile row, bf16: 16-byte aligned, no bank conflicts
    constexpr int VEC = D / 8;    // 16-byte vectors in one key's row
    __shared__ __align__(16) bf16 k_s[PFM_KEYS * KS];
    __shared__ __align__(16) bf16 vt_s[D * PFM_VT];

    int h = blockIdx.y;
    PrefillRows b;
    // The whole block exits together: no barrier is skipped.
    if (!prefill_rows(PFM_ROWS, positions, seq_starts, seq_lens, block_tables, max_blocks,
                      window, b))
        return;
    int first = b.first;
    int last = b.last;
    int kvh = h / (nq / nkv);
    long long kvd = (long long)nkv * D;
    const int* table = b.table;
    int kv_end = b.kv_end;
    int kv_lo = b.kv_lo;

    int lane = threadIdx.x & 31;
    int warp = threadIdx.x >> 5;
    int gq = lane >> 2;
    int tq = lane & 3;
    int r0 = first + warp * 16 + gq;  // the row of c[0], c[1]
    int r1 = r0 + 8;                  // the row of c[2], c[3]
    int pos0 = r0 <= last ? positions[r0] : -1;
    int pos1 = r1 <= last ? positions[r1] : -1;
    // The keys the warp's rows see, together, bound the tiles it computes: none past its
    // highest position, and with a window none before its lowest position's window.
    int warp_hi = __reduce_max_sync(0xffffffffu, max(pos0, pos1));
    int warp_from = 0;
    if (window > 0) {
        unsigned lo = __reduce_min_sync(0xffffffffu, (unsigned)min(pos0 < 0 ? 0x7fffffff : pos0,
                                                                    pos1 < 0 ? 0x7fffffff : pos1));
        warp_from = (int)lo - window + 1;
    }

    unsigned qa[D / 16][4];
    {
        const float* q0 = qkv + (long long)r0 * row_stride + (long long)h * D;
        const float* q1 = qkv + (long long)r1 * row_stride + (long long)h * D;
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            int c = kk * 16 + 2 * tq;
            qa[kk][0] = pos0 < 0 ? 0u : pack_bf16(q0[c] * scale, q0[c + 1] * scale);
            qa[kk][1] = pos1 < 0 ? 0u : pack_bf16(q1[c] * scale, q1[c + 1] * scale);
            qa[kk][2] = pos0 < 0 ? 0u : pack_bf16(q0[c + 8] * scale, q0[c + 9] * scale);
            qa[kk][3] = pos1 < 0 ? 0u : pack_bf16(q1[c + 8] * scale, q1[c + 9] * scale);
        }
    }

    float o[D / 8][4];
#pragma unroll
    for (int nd = 0; nd < D / 8; nd++) o[nd][0] = o[nd][1] = o[nd][2] = o[nd][3] = 0.0f;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.0f, l1 = 0.0f;

    for (int k0 = kv_lo; k0 < kv_end; k0 += PFM_KEYS) {
        __syncthreads();  // the previous tile is no longer read
        for (int e = threadIdx.x; e < PFM_KEYS * VEC; e += PFM_THREADS) {
            int j = e / VEC;
            int c = e % VEC;
            int p = k0 + j;
            uint4 kv4 = make_uint4(0u, 0u, 0u, 0u);
            uint4 vv4 = make_uint4(0u, 0u, 0u, 0u);
            if (p < kv_end) {
                long long src = ((long long)table[p / block_size] * block_size + p % block_size) * kvd
                                + (long long)kvh * D + c * 8;
                kv4 = *reinterpret_cast<const uint4*>(k_cache + src);
                vv4 = *reinterpret_cast<const uint4*>(v_cache + src);
            }
            *reinterpret_cast<uint4*>(k_s + j * KS + c * 8) = kv4;
            // (Halves taken by shifts: taking vv4's address would put it in local memory.)
            unsigned vw[4] = {vv4.x, vv4.y, vv4.z, vv4.w};
#pragma unroll
            for (int x = 0; x < 8; x++) {
                vt_s[(c * 8 + x) * PFM_VT + j] = (bf16)(vw[x >> 1] >> ((x & 1) * 16));
            }
        }
        __syncthreads();
        // Warp-uniform: every row of the warp is before this tile, or past its window.
        if (warp_hi < k0 || k0 + PFM_KEYS <= warp_from) continue;

        float sc[4][4];
#pragma unroll
        for (int nt = 0; nt < 4; nt++) sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
#pragma unroll
            for (int nt = 0; nt < 4; nt++) {
                const bf16* kr = k_s + (nt * 8 + gq) * KS + kk * 16 + 2 * tq;
                mma_bf16(sc[nt], qa[kk], *reinterpret_cast<const unsigned*>(kr),
                         *reinterpret_cast<const unsigned*>(kr + 8));
            }
        }
        float mx0 = NEG_INF;
        float mx1 = NEG_INF;
#pragma unroll
        for (int nt = 0; nt < 4; nt++) {
#pragma unroll
            for (int c = 0; c < 2; c++) {
                int p = k0 + nt * 8 + 2 * tq + c;
                if (!sees(p, pos0, kv_end, window)) sc[nt][c] = NEG_INF;
                if (!sees(p, pos1, kv_end, window)) sc[nt][2 + c] = NEG_INF;
                mx0 = fmaxf(mx0, sc[nt][c]);
                mx1 = fmaxf(mx1, sc[nt][2 + c]);
            }
        }
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        float n0 = fmaxf(m0, mx0);
        float n1 = fmaxf(m1, mx1);
        // A row that has seen no key yet subtracts 0: every exp is then exp(-inf) = 0.
        float b0 = n0 == NEG_INF ? 0.0f : n0;
        float b1 = n1 == NEG_INF ? 0.0f : n1;
        float c0 = expf(m0 - b0);
        float c1 = expf(m1 - b1);
        m0 = n0;
        m1 = n1;
        l0 *= c0;
        l1 *= c1;
#pragma unroll
        for (int nd = 0; nd < D / 8; nd++) {
            o[nd][0] *= c0;
            o[nd][1] *= c0;
            o[nd][2] *= c1;
            o[nd][3] *= c1;
        }
#pragma unroll
        for (int nt = 0; nt < 4; nt++) {
#pragma unroll
            for (int c = 0; c < 2; c++) {
                sc[nt][c] = expf(sc[nt][c] - b0);
                sc[nt][2 + c] = expf(sc[nt][2 + c] - b1);
                l0 += sc[nt][c];
                l1 += sc[nt][2 + c];
            }
        }
#pragma unroll
        for (int ks = 0; ks < 2; ks++) {
            unsigned pa[4] = {pack_bf16(sc[2 * ks][0], sc[2 * ks][1]),
                              pack_bf16(sc[2 * ks][2], sc[2 * ks][3]),
                              pack_bf16(sc[2 * ks + 1][0], sc[2 * ks + 1][1]),
                              pack_bf16(sc[2 * ks + 1][2], sc[2 * ks + 1][3])};
#pragma unroll
            for (int nd = 0; nd < D / 8; nd++) {
                const bf16* vr = vt_s + (nd * 8 + gq) * PFM_VT + ks * 16 + 2 * tq;
                mma_bf16(o[nd], pa, *reinterpret_cast<const unsigned*>(vr),
                         *reinterpret_cast<const unsigned*>(vr + 8));
            }
        }
    }

    // Each lane summed its own columns: the row's four lanes add theirs.
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    if (pos0 >= 0) {
        float inv = 1.0f / l0;
        unsigned* o0 = reinterpret_cast<unsigned*>(out + (long long)r0 * nq * D + (long long)h * D);
#pragma unroll
        for (int nd = 0; nd < D / 8; nd++) o0[nd * 4 + tq] = pack_bf16(o[nd][0] * inv, o[nd][1] * inv);
    }
    if (pos1 >= 0) {
        float inv = 1.0f / l1;
        unsigned* o1 = reinterpret_cast<unsigned*>(out + (long long)r1 * nq * D + (long long)h * D);
#pragma unroll
        for (int nd = 0; nd < D / 8; nd++) o1[nd * 4 + tq] = pack_bf16(o[nd][2] * inv, o[nd][3] * inv);
    }
}

// One entry point per head dimension; `d` is there so the host passes the arguments of
// paged_attention_prefill unchanged (it equals D).
#define PREFILL_MMA(D)                                                                        \
    extern "C" __global__ void __launch_bounds__(PFM_THREADS) paged_attention_prefill_mma_d##D( \
        const float* __restrict__ qkv, int row_stride, const int* __restrict__ positions,     \
        const int* __restrict__ seq_starts, const int* __restrict__ seq_lens,                 \
        const int* __restrict__ block_tables, int max_blocks,                                 \
        const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache,                   \
        bf16* __restrict__ out, int nq, int nkv, int d, int block_size, float scale,          \
        int window) {                                                                         \
        prefill_mma<D>(qkv, row_stride, positions, seq_starts, seq_lens, block_tables,        \
                       max_blocks, k_cache, v_cache, out, nq, nkv, block_size, scale,         \
                       window);                                                               \
    }
PREFILL_MMA(16)
PREFILL_MMA(32)
PREFILL_MMA(64)
PREFILL_MMA(128)

// out[r, i] = bf16(silu(gu[r, i]) * gu[r, inter + i]) for the stacked gate/up output.
// Grid (rows, ceil(inter / SILU_MUL_THREADS)), one element per thread: a decode step's few
// rows still spread over many multiprocessors (one block looping over a row was bound by
// its loads' latency). The row is the grid's x, so no flat index needs a 64-bit division,
// whose slow path made an earlier grid-stride version spill registers.
extern "C" __global__ void __launch_bounds__(SILU_MUL_THREADS)
silu_mul(const float* __restrict__ gu, bf16* __restrict__ out, int inter) {
    int i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i >= inter) return;
    const float* g = gu + (long long)blockIdx.x * 2 * inter;
    float x = g[i];
    out[(long long)blockIdx.x * inter + i] = f2bf(x / (1.0f + expf(-x)) * g[inter + i]);
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

// One logit into a thread's running argmax (bv, bi; strictly greater wins, so the lowest
// index on ties and never NaN) and its sum of exp(v - bv), rescaled when bv moves.
__device__ __forceinline__ void online_max_sum(float v, int i, float& bv, int& bi, float& se) {
    if (v > bv) {
        se = se * expf(bv - v) + 1.0f;  // bv = -inf at first: 0 * 0 + 1
        bv = v;
        bi = i;
    } else if (v > NEG_INF) {
        se += expf(v - bv);
    } else if (v != v) {
        se = v;  // NaN: the sum is NaN, as a two-pass sum would be
    }
}

// The float a key came from (order_key's inverse).
__device__ __forceinline__ float from_key(unsigned int k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// Where sample_rows decides its thresholds: the whole row in global memory, or the logits
// gathered into shared memory at or above a bound that every kept logit is above.
struct RowKeys {
    const float* x;
    int n;
    __device__ unsigned int key(int i) const { return order_key(x[i]); }
};
struct GatheredKeys {
    const unsigned int* keys;
    int n;
    __device__ unsigned int key(int i) const { return keys[i]; }
};

// The keep threshold over `src`: top-k's is the largest key K with at least k keys at or
// above it (k 0: none), found by bisection over the 32 key bits (a count per bit); top-p's
// the largest key P whose mass at or above max(P, K) still reaches top_p of `total`
// (the row's mass; below 0: the mass kept by top-k, summed here over src), found the same
// way with sums. Ties
// at a threshold are kept together. Every thread of the block calls it.
template <typename Src>
__device__ unsigned int keep_threshold(Src src, int k, float p, float mx, float inv_t,
                                       float total) {
    int tid = threadIdx.x;
    unsigned int thr = 0u;
    if (k > 0) {
        for (int bit = 31; bit >= 0; bit--) {
            unsigned int cand = thr | (1u << bit);
            float c = 0.0f;
            for (int i = tid; i < src.n; i += blockDim.x) c += src.key(i) >= cand ? 1.0f : 0.0f;
            if (block_sum(c) >= (float)k) thr = cand;
        }
    }
    if (p < 1.0f) {
        if (total < 0.0f) {
            float m = 0.0f;
            for (int i = tid; i < src.n; i += blockDim.x) {
                unsigned int key = src.key(i);
                if (key >= thr) m += expf((from_key(key) - mx) * inv_t);
            }
            total = block_sum(m);
        }
        float want = p * total;
        // Mass at key >= max(P, thr) only falls as P grows, so P is decided bit by bit
        // from the top, starting from 0 (not from thr, whose bits need not be in P).
        unsigned int pthr = 0u;
        for (int bit = 31; bit >= 0; bit--) {
            unsigned int cand = max(pthr | (1u << bit), thr);
            float s = 0.0f;
            for (int i = tid; i < src.n; i += blockDim.x) {
                unsigned int key = src.key(i);
                if (key >= cand) s += expf((from_key(key) - mx) * inv_t);
            }
            if (block_sum(s) >= want) pthr = pthr | (1u << bit);
        }
        thr = max(pthr, thr);
    }
    return thr;
}

// Sampling per row on the device, so only a token id and its logprob come back to the host.
// Row r: temperature temps[r] (<= 1e-5 or top_k 1 means greedy), top_k top_ks[r] (0 = all),
// top_p top_ps[r] (1 = all), and one uniform draw uniforms[r] in [0, 1) made by the
// request's own seeded generator on the host (the CPU sampler also draws exactly one per
// sampled token, so a seed consumes the same stream on either backend).
//
// No sort: the kept set is {x : key(x) >= threshold} (keep_threshold). Deciding it over the
// whole row costs ~65 passes over the vocabulary, so first a bound G is taken from the
// threads' own maxima (sorted in shared memory): the k-th largest has k logits at or above
// it; for top-p alone, the largest whose maxima above it already hold top_p of the mass.
// The logits at or above G (a few k, typically) are gathered into shared memory and the
// thresholds decided there, when they fit and do bound the kept set; otherwise over the
// row. The draw walks the kept weights in vocabulary order: each thread owns a contiguous
// chunk, thread 0 prefix-sums the chunk totals, and the thread whose range holds u * total
// finds the token in its chunk. Same distribution as the CPU sampler (which walks the same
// kept weights in the same order), and for a given seed the same token up to rounding.
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
    __shared__ unsigned int gathered[SAMPLE_GATHER];
    __shared__ int n_gathered;
    __shared__ int chosen;
    int r = blockIdx.x;
    int tid = threadIdx.x;
    const float* x = logits + (long long)r * vocab;

    // Argmax (lowest index on ties, NaN never wins) and the log-sum-exp of the raw logits, in
    // one pass: each thread keeps its running max and its sum of exp(v - that max), rescaled
    // when the max moves (16-byte loads where the rows allow them).
    float bv = NEG_INF;
    int bi = 0x7fffffff;
    float tse = 0.0f;
    if ((vocab & 3) == 0) {
        const float4* x4 = reinterpret_cast<const float4*>(x);
        for (int i = tid; i < vocab / 4; i += blockDim.x) {
            float4 q = x4[i];
            float vs[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
            for (int c = 0; c < 4; c++) online_max_sum(vs[c], 4 * i + c, bv, bi, tse);
        }
    } else {
        for (int i = tid; i < vocab; i += blockDim.x) online_max_sum(x[i], i, bv, bi, tse);
    }
    float own_max = bv;
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
    // Each thread's sum rescaled to the row's max (a thread that saw only -inf adds 0).
    float lse = mx + logf(block_sum(bv == NEG_INF ? 0.0f : tse * expf(bv - mx)));

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
    float p = top_ps[r];
    if (k >= vocab) k = 0;

    unsigned int thr = 0u;
    if (k > 0 || p < 1.0f) {
        // top-p alone keeps top_p of the whole row's mass (after top-k, of what top-k keeps:
        // summed where the thresholds are decided).
        float total = -1.0f;
        if (k == 0) {
            float m = 0.0f;
            for (int i = tid; i < vocab; i += blockDim.x) m += expf((x[i] - mx) * inv_t);
            total = block_sum(m);
        }
        // The threads' maxima, sorted in descending order (bitonic, one per thread).
        unsigned int* sorted = reinterpret_cast<unsigned int*>(best_i);
        sorted[tid] = order_key(own_max);
        __syncthreads();
        for (int size = 2; size <= (int)blockDim.x; size <<= 1) {
            for (int stride = size >> 1; stride > 0; stride >>= 1) {
                int j = tid ^ stride;
                if (j > tid) {
                    unsigned int a = sorted[tid], b = sorted[j];
                    if ((tid & size) == 0 ? a < b : a > b) {
                        sorted[tid] = b;
                        sorted[j] = a;
                    }
                }
                __syncthreads();
            }
        }
        // The bound: top-k's k-th largest maximum; top-p's the first maximum where the
        // maxima so far hold top_p of the mass (a running sum, Hillis-Steele in best_v).
        unsigned int bound;
        if (k > 0) {
            bound = k <= (int)blockDim.x ? sorted[k - 1] : 0u;
        } else {
            best_v[tid] = expf((from_key(sorted[tid]) - mx) * inv_t);
            __syncthreads();
            for (int off = 1; off < (int)blockDim.x; off <<= 1) {
                float add = tid >= off ? best_v[tid - off] : 0.0f;
                __syncthreads();
                best_v[tid] += add;
                __syncthreads();
            }
            bool reached = best_v[tid] >= p * total;
            bool first = reached && (tid == 0 || best_v[tid - 1] < p * total);
            if (tid == 0) chosen = 0;
            __syncthreads();
            if (first) chosen = (int)sorted[tid];
            __syncthreads();
            bound = (unsigned int)chosen;
        }
        // Gather every logit at or above the bound. No bound (0), or one at -inf (a grammar
        // mask leaving fewer than k tokens), gathers nothing; nor does the rest of the row
        // once more than fit have been seen.
        if (tid == 0) n_gathered = 0;
        __syncthreads();
        bool bounded = bound > order_key(NEG_INF);
        if (bounded) {
            const volatile int* seen = &n_gathered;
            for (int i = tid; i < vocab && *seen <= SAMPLE_GATHER; i += blockDim.x) {
                unsigned int key = order_key(x[i]);
                if (key >= bound) {
                    int at = atomicAdd(&n_gathered, 1);
                    if (at < SAMPLE_GATHER) gathered[at] = key;
                }
            }
        }
        __syncthreads();
        int n = n_gathered;
        // They decide the thresholds if they fit and hold what is kept: at least k keys
        // (then the top-k set is among them), or for top-p alone top_p of the mass.
        bool fits = bounded && n > 0 && n <= SAMPLE_GATHER;
        if (fits && k > 0) {
            fits = n >= k;
        } else if (fits) {
            float m = 0.0f;
            for (int i = tid; i < n; i += blockDim.x) m += expf((from_key(gathered[i]) - mx) * inv_t);
            fits = block_sum(m) >= p * total;
        }
        thr = fits ? keep_threshold(GatheredKeys{gathered, n}, k, p, mx, inv_t, total)
                   : keep_threshold(RowKeys{x, vocab}, k, p, mx, inv_t, total);
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
