// Matrix products with few rows (a decode step's), where reading the weights once is the
// whole cost: y[m, n] = sum_k x[m, k] * w[n, k], x and w bf16 row-major, y f32, for
// m < rows <= M. cuBLAS at one row splits k and reduces in a second kernel, and reached
// 2.5 TB/s on an H100 (Qwen3-8B's projections, Nsight Compute); here each warp streams
// SKINNY_ROWS rows of w with 16-byte loads, SKINNY_UNROLL of them in flight per lane and row,
// and keeps M x SKINNY_ROWS sums in registers, reduced across the warp at the end.
//
// Block SKINNY_THREADS. The host launches these only when k is a multiple of 8 (16-byte
// rows; allocations are 256-byte aligned) and rows <= M. Three epilogues save a decode step
// launches: the q/k/v biases added as the sums are written, the MLP's SiLU-gated product
// taken straight from the gate/up sums (skinny_silu_m*), and the rotary embedding with the
// new K/V written to the paged cache, what rope_kv_write does after the q/k/v product, q/k
// norms included (skinny_rope_m*).

#if !defined(SKINNY_THREADS) || !defined(SKINNY_ROWS) || !defined(SKINNY_UNROLL)
#error "the skinny products are compiled with shapes.rs's SKINNY_* figures"
#endif

// 16 bytes of weights, read once: through the non-coherent path, not kept in L1.
__device__ __forceinline__ uint4 ld_once16(const uint4* p) {
#ifdef __CUDA_ARCH__
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
#else
    return *p;  // gpu/emu: the CPU emulator
#endif
}

// Brings the 16 bytes at p (their cache line) into L2, holding no register.
__device__ __forceinline__ void prefetch_l2(const uint4* p) {
#ifdef __CUDA_ARCH__
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#endif
}

// acc + the dot product of two words of two bf16 each (low half first, as stored).
__device__ __forceinline__ float dot2(unsigned int a, unsigned int b, float acc) {
    acc = fmaf(__uint_as_float(a << 16), __uint_as_float(b << 16), acc);
    return fmaf(__uint_as_float(a & 0xffff0000u), __uint_as_float(b & 0xffff0000u), acc);
}

__device__ __forceinline__ float dot8(uint4 a, uint4 b, float acc) {
    acc = dot2(a.x, b.x, acc);
    acc = dot2(a.y, b.y, acc);
    acc = dot2(a.z, b.z, acc);
    return dot2(a.w, b.w, acc);
}

// SILU: the gate/up product of an MLP, whose weights hold `n` gate rows and then `n` up
// rows. Warp j streams gate row j and up row j (SKINNY_ROWS must be 2) and writes
// act[m, j] = bf16(silu(gate) * up), what silu_mul computes from the f32 products, so the
// [rows, 2n] f32 products are never written. Otherwise warp j streams rows
// SKINNY_ROWS * j ..., and y = the sums + bias (when bias is not null), as bias_add adds it.
//
// Norm (not null): the product's input is not x but bf16(rmsnorm(norm->res_in +
// norm->delta) * norm->w), each of the `rows` rows computed by every block into shared
// memory with add_rmsnorm_to_bf16's sums (add_row_inv_rms reads the row twice rather than
// hold it, leaving the registers to the product), and block 0 writes
// res_in + delta to norm->res_out (another buffer: the other blocks still read res_in).
// The decode step's residual add and norm then cost no launch of their own.
struct NormIn {
    const float* res_in;
    const float* delta;
    const float* w;
    float* res_out;
    float eps;
};

// The norm prologue of a fused product (NormIn): every block writes the `rows` normed rows
// of k to xs with add_rmsnorm_to_bf16's sums, and block 0 writes res_in + delta to res_out.
// Every thread of the block takes part; xs is ready when it returns.
__device__ __forceinline__ void norm_rows_to_shared(const NormIn* norm, int rows, int k,
                                                    bf16* xs) {
    const int n4 = k >> 2;
    const float4* g4 = reinterpret_cast<const float4*>(norm->w);
    for (int m = 0; m < rows; m++) {
        long long off = (long long)m * k;
        float inv = add_row_inv_rms(norm->res_in + off, norm->delta + off, k, norm->eps);
        const float4* a4 = reinterpret_cast<const float4*>(norm->res_in + off);
        const float4* d4 = reinterpret_cast<const float4*>(norm->delta + off);
        uint2* o = reinterpret_cast<uint2*>(xs + off);
        float4* r4 = reinterpret_cast<float4*>(norm->res_out + off);
        for (int i = threadIdx.x; i < n4; i += ADD_RMSNORM_THREADS) {
            float4 a = a4[i];
            float4 b = d4[i];
            float4 v = make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
            float4 g = g4[i];
            o[i] = pack_bf16x4(v.x * inv * g.x, v.y * inv * g.y, v.z * inv * g.z,
                               v.w * inv * g.w);
            if (blockIdx.x == 0) r4[i] = v;
        }
    }
    __syncthreads();
}

// ROPE: the q/k/v product of a layer of nq query heads and nkv key/value heads of size d
// (n = (nq + 2 nkv) d; d even), for one token a row. Warp j < (nq + nkv) d / 2 streams a
// rotation pair of a q or k head, rows h d + i and h d + i + d/2 (i < d/2), and rotates
// their sums (rope_pair, the angle positions[m] * inv_freq[i]); the warps after it stream
// two adjacent v rows. y gets what rope_kv_write leaves in the q/k/v rows (the rotated q
// and k, v as summed), and the cache at slots[m] the rotated k and v as bf16.
//
// With q/k norms (q_w, k_w not null: Qwen3), a head is normalised over all its d sums
// before it is rotated, and its d / 2 pairs are summed by as many warps, of several blocks.
// Each pair's warp writes its sums as they are and takes a ticket of the head (ticks, one
// counter a q and k head, zero between launches); the warp that takes the last one
// normalises and rotates the whole head for every row (rope_norm_last).
struct RopeIn {
    const int* positions;
    const float* inv_freq;
    const int* slots;
    bf16* k_cache;
    bf16* v_cache;
    const float* q_w;
    const float* k_w;
    float eps;
    int* ticks;
    int nq;
    int nkv;
    int d;
};

// A rotated product's kernel parameters, in RopeIn's order, and the RopeIn they make: one
// list for the bf16 and FP8 kernels, with and without the norm prologue.
#define ROPE_PARAMS                                                                             \
    const int* __restrict__ positions, const float* __restrict__ inv_freq,                      \
        const int* __restrict__ slots, bf16* __restrict__ k_cache, bf16* __restrict__ v_cache,  \
        const float* __restrict__ q_w, const float* __restrict__ k_w, float qk_eps,             \
        int* __restrict__ ticks, int nq, int nkv, int d
#define ROPE_IN {positions, inv_freq, slots, k_cache, v_cache, q_w, k_w, qk_eps, ticks, nq, nkv, d}

// The two rows of w warp j streams under ROPE, and whether they are a rotation pair.
__device__ __forceinline__ bool rope_rows(const RopeIn* rope, int j, int* r0, int* r1) {
    int half = rope->d >> 1;
    int pairs = (rope->nq + rope->nkv) * half;
    if (j < pairs) {
        int h = j / half;
        *r0 = h * rope->d + (j - h * half);
        *r1 = *r0 + half;
        return true;
    }
    *r0 = (rope->nq + rope->nkv) * rope->d + 2 * (j - pairs);
    *r1 = *r0 + 1;
    return false;
}

// ROPE's epilogue for row m of the step: a and b are the sums of rows r0 and r1 (bias
// added), written to y rotated (a q/k pair) or as they are (two v rows), and to the cache.
__device__ __forceinline__ void rope_write(const RopeIn* rope, int m, int r0, int r1,
                                           bool pair, float a, float b, float* y, int n) {
    long long kvd = (long long)rope->nkv * rope->d;
    long long slot = (long long)rope->slots[m] * kvd;
    int qd = rope->nq * rope->d;
    float* ym = y + (long long)m * n;
    if (pair && rope->q_w != nullptr) {  // normalised and rotated by rope_norm_last
        ym[r0] = a;
        ym[r1] = b;
        return;
    }
    if (pair) {
        int half = rope->d >> 1;
        int i = r0 % rope->d;
        float y1, y2;
        rope_pair(a, b, (float)rope->positions[m], rope->inv_freq[i], &y1, &y2);
        ym[r0] = y1;
        ym[r1] = y2;
        if (r0 >= qd) {
            long long o = slot + (r0 - qd);  // key head (r0 - qd) / d, element i
            rope->k_cache[o] = f2bf(y1);
            rope->k_cache[o + half] = f2bf(y2);
        }
        return;
    }
    ym[r0] = a;
    ym[r1] = b;
    long long o = slot + (r0 - qd - (long long)kvd);  // v head and element, as in the row
    rope->v_cache[o] = f2bf(a);
    rope->v_cache[o + 1] = f2bf(b);
}

// ROPE with q/k norms, after rope_write: every lane of the warp of pair r0 calls it once
// the warp's sums of the step's `rows` rows are in y. The warp counts itself in on its
// head's ticket; the last of the head's d / 2 warps reads the head's d sums back (from L2:
// other multiprocessors wrote them), and normalises and rotates them as rope_kv_write does
// (a lane's sum of squares over the same elements in the same order, the same warp sum,
// products and rotation, so the same bits), writes them to y and a key head to the cache,
// and sets the ticket back to zero for the next launch.
__device__ __forceinline__ void rope_norm_last(const RopeIn* rope, int r0, bool pair, float* y,
                                               int n, int rows) {
    if (rope->q_w == nullptr || !pair) return;
    const int lane = threadIdx.x & 31;
    const int d = rope->d;
    const int half = d >> 1;
    const int h = r0 / d;
    __threadfence();  // this warp's sums, before its ticket
    __syncwarp();
    int last = 0;
    if (lane == 0) last = atomicAdd(rope->ticks + h, 1) == half - 1;
    last = __shfl_sync(0xffffffffu, last, 0);
    if (!last) return;
    __threadfence();  // the other warps' sums, after their tickets
    const float* nw = h < rope->nq ? rope->q_w : rope->k_w;
    const long long kvd = (long long)rope->nkv * rope->d;
    for (int m = 0; m < rows; m++) {
        float* p = y + (long long)m * n + (long long)h * d;
        float ss = 0.0f;
        for (int i = lane; i < d; i += 32) {
            float v = __ldcg(p + i);
            ss += v * v;
        }
        ss = warp_sum(ss);
        float inv = 1.0f / sqrtf(ss / (float)d + rope->eps);
        float pos = (float)rope->positions[m];
        long long o = (long long)rope->slots[m] * kvd + (long long)(h - rope->nq) * d;
        for (int i = lane; i < half; i += 32) {
            float x1 = __ldcg(p + i) * inv * nw[i];
            float x2 = __ldcg(p + i + half) * inv * nw[i + half];
            float y1, y2;
            rope_pair(x1, x2, pos, rope->inv_freq[i], &y1, &y2);
            p[i] = y1;
            p[i + half] = y2;
            if (h >= rope->nq) {
                rope->k_cache[o + i] = f2bf(y1);
                rope->k_cache[o + i + half] = f2bf(y2);
            }
        }
    }
    if (lane == 0) rope->ticks[h] = 0;
}

template <int M, bool SILU, bool ROPE>
__device__ __forceinline__ void skinny_gemm(const bf16* __restrict__ x,
                                            const bf16* __restrict__ w,
                                            const float* __restrict__ bias,
                                            float* __restrict__ y, bf16* __restrict__ act,
                                            int rows, int n, int k, const NormIn* norm,
                                            bf16* xs, const RopeIn* rope) {
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int j = blockIdx.x * (SKINNY_THREADS / 32) + warp;
    const int n0 = SILU ? j : j * SKINNY_ROWS;
    // The whole warp leaves (n0 is the same for its lanes), unless the block computes the
    // norm first, which every thread takes part in.
    if (n0 >= n && norm == nullptr) return;
    const int k8 = k >> 3;
    // Rows past the end (of w, or of x's `rows`) read the last one again; their sums are
    // not written.
    const uint4* w16 = reinterpret_cast<const uint4*>(w);
    const uint4* x16 = reinterpret_cast<const uint4*>(x);
    int rr[SKINNY_ROWS];
    bool pair = false;
    if (ROPE) {
        pair = rope_rows(rope, min(j, n / 2 - 1), &rr[0], &rr[1]);
    } else {
#pragma unroll
        for (int r = 0; r < SKINNY_ROWS; r++) rr[r] = SILU ? n0 + r * n : min(n0 + r, n - 1);
    }
    long long wrow[SKINNY_ROWS];
#pragma unroll
    for (int r = 0; r < SKINNY_ROWS; r++) wrow[r] = (long long)rr[r] * k8;
    float acc[SKINNY_ROWS][M];
#pragma unroll
    for (int r = 0; r < SKINNY_ROWS; r++) {
#pragma unroll
        for (int m = 0; m < M; m++) acc[r][m] = 0.0f;
    }
    // The weights depend on no earlier kernel: the first of them are fetched into L2 before
    // the wait for the kernel that wrote x (programmatic dependent launch, common.cuh), not
    // into registers, which the loop needs for its own loads.
    pdl_trigger();
#pragma unroll
    for (int u = 0; u < SKINNY_UNROLL; u++) {
        int i = lane + u * 32;
#pragma unroll
        for (int r = 0; r < SKINNY_ROWS; r++) {
            if (i < k8 && n0 < n) prefetch_l2(w16 + wrow[r] + i);
        }
    }
    pdl_wait();
    if (norm != nullptr) {
        norm_rows_to_shared(norm, rows, k, xs);
        if (n0 >= n) return;
        x16 = reinterpret_cast<const uint4*>(xs);
    }
    for (int i0 = lane; i0 < k8; i0 += 32 * SKINNY_UNROLL) {
        uint4 wv[SKINNY_UNROLL][SKINNY_ROWS];
#pragma unroll
        for (int u = 0; u < SKINNY_UNROLL; u++) {
            int i = i0 + u * 32;
#pragma unroll
            for (int r = 0; r < SKINNY_ROWS; r++) {
                wv[u][r] = i < k8 ? ld_once16(w16 + wrow[r] + i) : make_uint4(0u, 0u, 0u, 0u);
            }
        }
#pragma unroll
        for (int u = 0; u < SKINNY_UNROLL; u++) {
            int i = i0 + u * 32;
            if (i < k8) {
#pragma unroll
                for (int m = 0; m < M; m++) {
                    uint4 xv = x16[(long long)min(m, rows - 1) * k8 + i];
#pragma unroll
                    for (int r = 0; r < SKINNY_ROWS; r++) acc[r][m] = dot8(wv[u][r], xv, acc[r][m]);
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < SKINNY_ROWS; r++) {
#pragma unroll
        for (int m = 0; m < M; m++) acc[r][m] = warp_sum(acc[r][m]);
    }
    if (ROPE) {
        if (lane == 0) {
#pragma unroll
            for (int m = 0; m < M; m++) {
                if (m < rows) {
                    float a = bias != nullptr ? acc[0][m] + bias[rr[0]] : acc[0][m];
                    float b = bias != nullptr ? acc[1][m] + bias[rr[1]] : acc[1][m];
                    rope_write(rope, m, rr[0], rr[1], pair, a, b, y, n);
                }
            }
        }
        rope_norm_last(rope, rr[0], pair, y, n, rows);
        return;
    }
    if (lane != 0) return;
    if (SILU) {
#pragma unroll
        for (int m = 0; m < M; m++) {
            float g = acc[0][m];
            if (m < rows) act[(long long)m * n + n0] = f2bf(g / (1.0f + expf(-g)) * acc[1][m]);
        }
        return;
    }
#pragma unroll
    for (int r = 0; r < SKINNY_ROWS; r++) {
        if (n0 + r < n) {
            float b = bias != nullptr ? bias[n0 + r] : 0.0f;
#pragma unroll
            for (int m = 0; m < M; m++) {
                if (m < rows) y[(long long)m * n + n0 + r] = bias != nullptr ? acc[r][m] + b : acc[r][m];
            }
        }
    }
}

#if SKINNY_ROWS != 2
#error "skinny_silu_m* stream one gate row and one up row a warp, skinny_rope_m* a pair"
#endif

// y = x . w^T (+ bias). Grid (ceil(n / (SKINNY_THREADS / 32 * SKINNY_ROWS))).
#define SKINNY_KERNEL(M)                                                                        \
    extern "C" __global__ void __launch_bounds__(SKINNY_THREADS) skinny_gemm_m##M(              \
        const bf16* __restrict__ x, const bf16* __restrict__ w, const float* __restrict__ bias, \
        float* __restrict__ y, int rows, int n, int k) {                                        \
        skinny_gemm<M, false, false>(x, w, bias, y, nullptr, rows, n, k, nullptr, nullptr,     \
                                      nullptr);                                                \
    }
SKINNY_KERNEL(1)
SKINNY_KERNEL(2)
SKINNY_KERNEL(4)
SKINNY_KERNEL(8)

// y = x . w^T (+ bias) for a layer's q/k/v, rotated and the new K/V written to the cache
// (RopeIn). Grid (ceil(n / (SKINNY_THREADS / 32 * SKINNY_ROWS))). MINB, the least blocks an
// SM, as for the fused FP8 kernels: without it ptxas held the 1- and 2-row forms to 64
// registers (four blocks) and spilled 4-20 bytes around the q/k norm tail on sm_80-sm_90.
#define SKINNY_ROPE_KERNEL(M, MINB)                                                             \
    extern "C" __global__ void __launch_bounds__(SKINNY_THREADS, MINB) skinny_rope_m##M(        \
        const bf16* __restrict__ x, const bf16* __restrict__ w, const float* __restrict__ bias, \
        float* __restrict__ y, ROPE_PARAMS, int rows, int n, int k) {                           \
        RopeIn rope = ROPE_IN;                                                                  \
        skinny_gemm<M, false, true>(x, w, bias, y, nullptr, rows, n, k, nullptr, nullptr,      \
                                    &rope);                                                     \
    }
SKINNY_ROPE_KERNEL(1, 3)
SKINNY_ROPE_KERNEL(2, 3)
SKINNY_ROPE_KERNEL(4, 3)
SKINNY_ROPE_KERNEL(8, 2)

// act = silu(x . gate^T) * (x . up^T), w holding the n gate rows then the n up rows.
// Grid (ceil(n / (SKINNY_THREADS / 32))).
#define SKINNY_SILU_KERNEL(M)                                                                   \
    extern "C" __global__ void __launch_bounds__(SKINNY_THREADS) skinny_silu_m##M(              \
        const bf16* __restrict__ x, const bf16* __restrict__ w, bf16* __restrict__ act,         \
        int rows, int n, int k) {                                                               \
        skinny_gemm<M, true, false>(x, w, nullptr, nullptr, act, rows, n, k, nullptr, nullptr, \
                                     nullptr);                                                 \
    }
SKINNY_SILU_KERNEL(1)
SKINNY_SILU_KERNEL(2)
SKINNY_SILU_KERNEL(4)
SKINNY_SILU_KERNEL(8)

// The same products with the residual add and RMSNorm before them as their prologue (see
// NormIn): res_in, delta [rows, k] f32, norm_w [k]; block 0 writes res_out. Up to
// 2 rows of k <= NORM_MAX, a multiple of 8; the normed rows live in shared memory.
// Grids as skinny_gemm_m* and skinny_silu_m*.
#if SKINNY_THREADS != ADD_RMSNORM_THREADS
#error "a skinny product's norm prologue must reduce as add_rmsnorm_to_bf16 does"
#endif
#define SKINNY_NORM_KERNEL(M)                                                                   \
    extern "C" __global__ void __launch_bounds__(SKINNY_THREADS) skinny_norm_m##M(              \
        const float* __restrict__ res_in, const float* __restrict__ delta,                      \
        const float* __restrict__ norm_w, float eps, float* __restrict__ res_out,               \
        const bf16* __restrict__ w, const float* __restrict__ bias, float* __restrict__ y,      \
        int rows, int n, int k) {                                                               \
        __shared__ __align__(16) bf16 xs[M * NORM_MAX];                                         \
        NormIn norm = {res_in, delta, norm_w, res_out, eps};                                    \
        skinny_gemm<M, false, false>(nullptr, w, bias, y, nullptr, rows, n, k, &norm, xs,      \
                                      nullptr);                                                \
    }
#define SKINNY_NORM_SILU_KERNEL(M)                                                              \
    extern "C" __global__ void __launch_bounds__(SKINNY_THREADS) skinny_norm_silu_m##M(         \
        const float* __restrict__ res_in, const float* __restrict__ delta,                      \
        const float* __restrict__ norm_w, float eps, float* __restrict__ res_out,               \
        const bf16* __restrict__ w, bf16* __restrict__ act, int rows, int n, int k) {           \
        __shared__ __align__(16) bf16 xs[M * NORM_MAX];                                         \
        NormIn norm = {res_in, delta, norm_w, res_out, eps};                                    \
        skinny_gemm<M, true, false>(nullptr, w, nullptr, nullptr, act, rows, n, k, &norm, xs,  \
                                     nullptr);                                                 \
    }
#define SKINNY_NORM_ROPE_KERNEL(M, MINB)                                                        \
    extern "C" __global__ void __launch_bounds__(SKINNY_THREADS, MINB) skinny_norm_rope_m##M(   \
        const float* __restrict__ res_in, const float* __restrict__ delta,                      \
        const float* __restrict__ norm_w, float eps, float* __restrict__ res_out,               \
        const bf16* __restrict__ w, const float* __restrict__ bias, float* __restrict__ y,      \
        ROPE_PARAMS, int rows, int n, int k) {                                                  \
        __shared__ __align__(16) bf16 xs[M * NORM_MAX];                                         \
        NormIn norm = {res_in, delta, norm_w, res_out, eps};                                    \
        RopeIn rope = ROPE_IN;                                                                  \
        skinny_gemm<M, false, true>(nullptr, w, bias, y, nullptr, rows, n, k, &norm, xs,       \
                                    &rope);                                                     \
    }
SKINNY_NORM_KERNEL(1)
SKINNY_NORM_KERNEL(2)
SKINNY_NORM_ROPE_KERNEL(1, 3)
SKINNY_NORM_ROPE_KERNEL(2, 3)
SKINNY_NORM_SILU_KERNEL(1)
SKINNY_NORM_SILU_KERNEL(2)
