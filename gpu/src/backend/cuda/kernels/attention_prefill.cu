// Paged attention for prefill and prompt chunks, on the tensor cores where the head size
// has a specialisation.
// Part of the kernels' one source: common.cuh, then layers.cu, attention_decode.cu,
// attention_prefill.cu and sampling.cu, joined in that order (kernels.rs, KERNELS_CU).

// The query rows a prefill block of `rows` rows takes (grid (S, nq, tiles): sequence
// blockIdx.x, tile gridDim.z - 1 - blockIdx.z), its sequence's block table, and the keys the block needs: up
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
    // The last tiles of a causal prompt see the most keys: they are the grid's first blocks,
    // so the long ones start first and the short ones fill the tail of the launch.
    b.first = seq_starts[s] + (gridDim.z - 1 - blockIdx.z) * rows;
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
    pdl_start();
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

// Two floats as bf16, lo in the low half: one cvt on the device (round to nearest even,
// as f2bf, for every value but NaN's payload), f2bf in the emulator.
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
#ifdef __CUDA_ARCH__
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return (unsigned)f2bf(lo) | ((unsigned)f2bf(hi) << 16);
#endif
}

// 2^x for a softmax weight: the multi-function unit's approximation alone (results under
// 2^-126 flush to zero, which no weight summed with a 1 notices); exp2f in the emulator.
__device__ __forceinline__ float softmax_exp2(float x) {
#ifdef __CUDA_ARCH__
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
#else
    return exp2f(x);
#endif
}

// c += a * b on the tensor cores: a 16x16 bf16 tile (row-major fragments), b 16x8 (column
// fragments), c 16x8 f32. Fragment layout (g = lane / 4, t = lane % 4): a holds rows g and
// g + 8 at columns 2t, 2t + 1 (a[0], a[1]) and 2t + 8, 2t + 9 (a[2], a[3]); b holds rows
// 2t, 2t + 1 (b0) and 2t + 8, 2t + 9 (b1) of column g; c holds row g (c[0], c[1]) and row
// g + 8 (c[2], c[3]) at columns 2t, 2t + 1.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                         unsigned b1) {
#ifdef __CUDA_ARCH__
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    kvmesh_emu_mma_bf16(c, a, b0, b1);  // gpu/emu: the CPU emulator's
#endif
}

// Four 8x8 bf16 matrices from shared memory, transposed: lanes 8i .. 8i + 7 give the
// addresses of matrix i's eight rows (16 bytes each); r[i] is then, for lane (g, t), the
// elements at (row 2t, column g) and (row 2t + 1, column g) of matrix i: with rows as keys
// and columns as dimensions, an mma's b fragment of V.
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const bf16* p) {
#ifdef __CUDA_ARCH__
    unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
#else
    kvmesh_emu_ldmatrix_x4_trans(r, p);
#endif
}

// The same four matrices not transposed: r[i] is, for lane (g, t), the elements at (row g,
// columns 2t and 2t + 1) of matrix i. With rows as keys and columns as dimensions, an mma's b
// fragment of K (matrices 0 and 1: one 16-dimension step; 2 and 3: the next).
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const bf16* p) {
#ifdef __CUDA_ARCH__
    unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
#else
    kvmesh_emu_ldmatrix_x4(r, p);
#endif
}

// 16 bytes from global to shared memory without passing through registers; `bytes` 0 fills
// them with zeros instead (keys past the end).
__device__ __forceinline__ void cp_async16(bf16* dst, const bf16* src, int bytes) {
#ifdef __CUDA_ARCH__
    unsigned a = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(a), "l"(src), "r"(bytes));
#else
    kvmesh_emu_cp_async16(dst, src, bytes);
#endif
}
#ifdef __CUDA_ARCH__
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
#else
__device__ __forceinline__ void cp_async_commit() {}
template <int N>
__device__ __forceinline__ void cp_async_wait() {}
#endif

// A cache block's size, for finding a position's block and slot: a shift and a mask where
// it is a power of two (the engine's default 16), a division otherwise.
struct BlockSize {
    int size;
    int shift;  // -1: not a power of two
};

__device__ __forceinline__ BlockSize block_size_of(int block_size) {
    return {block_size, (block_size & (block_size - 1)) == 0 ? __ffs(block_size) - 1 : -1};
}

// The cache row (block table entry times the block size, plus the slot) of position p: a
// token of the cache, an i32 as the step's slots are (StepInputs::slots).
__device__ __forceinline__ int cache_row(const int* __restrict__ table, BlockSize bs, int p) {
    if (bs.shift >= 0) return (table[p >> bs.shift] << bs.shift) + (p & (bs.size - 1));
    int blk = p / bs.size;
    return table[blk] * bs.size + (p - blk * bs.size);
}

// Keys k0 .. k0 + KEYS of one KV head (kc, vc: the caches from that head's first
// dimension) copied into the K and V tiles (rows of D + 8) in 16-byte pieces, as one
// cp.async group. Keys at or past kv_end are zeros (kv_lo is any key the sequence has, whose
// address stands in for theirs). PFM_THREADS / KEYS threads share a key: each finds its row
// once and copies every (PFM_THREADS / KEYS)-th piece of it, so a warp's copy reads whole
// 64-byte runs of eight keys.
template <int D, int KEYS>
__device__ __forceinline__ void prefill_tile(bf16* k_t, bf16* v_t, const bf16* __restrict__ kc,
                                             const bf16* __restrict__ vc,
                                             const int* __restrict__ table, BlockSize bs,
                                             int kvd, int k0, int kv_lo, int kv_end) {
    constexpr int VEC = D / 8;               // pieces a key
    constexpr int TPK = PFM_THREADS / KEYS;  // threads a key
    static_assert(PFM_THREADS % KEYS == 0, "a tile's keys share the block's threads evenly");
    const int j = threadIdx.x / TPK;
    const int c0 = threadIdx.x % TPK;
    const int p = k0 + j;
    const int live = p < kv_end ? 16 : 0;
    const long long src = (long long)cache_row(table, bs, live ? p : kv_lo) * kvd + c0 * 8;
    const bf16* ks = kc + src;
    const bf16* vs = vc + src;
    bf16* kd = k_t + j * (D + 8) + c0 * 8;
    bf16* vd = v_t + j * (D + 8) + c0 * 8;
#pragma unroll
    for (int i = 0; i < (VEC + TPK - 1) / TPK; i++) {
        // head size 16: two pieces a key, four threads
        if (VEC % TPK != 0 && c0 + i * TPK >= VEC) break;
        cp_async16(kd + i * TPK * 8, ks + i * TPK * 8, live);
        cp_async16(vd + i * TPK * 8, vs + i * TPK * 8, live);
    }
    cp_async_commit();
}

// Whether the query at position `pos` (-1: no query) sees key position p.
__device__ __forceinline__ bool sees(int p, int pos, int kv_end, int window) {
    return p < kv_end && p <= pos && (window <= 0 || p > pos - window);
}

// Prefill attention on the tensor cores, for head dimension D (16, 32, 64, 128 or 256) and
// KEYS keys a tile (32; 16 for D = 256, whose two stages of 32 would pass the 48 KB of static
// shared memory, and whose output fragments take 128 registers a lane); the same inputs,
// masks and output as paged_attention_prefill. Each warp owns 16 query rows: Q (scaled by
// the softmax scale and log2(e), bf16) stays in registers as mma fragments, S = Q K^T for a
// tile of KEYS keys is KEYS / 8 m16n8k16 products per 16 dims, the online softmax
// runs on S's fragments in base 2 (a row's four lanes agree on its max by shuffles), and P,
// rounded to bf16, is fed straight back as the A operand of P V, so scores never leave
// registers. K and V tiles are copied row-major into shared memory by cp.async, two tiles in
// flight (the next loads while this one is used); K's b fragments are 32-bit shared loads,
// V's come transposed by ldmatrix. Keys past the block's last position are zeros in the
// tiles and masked in S.
// Grid (S, nq, ceil(max_query_len / 64)), block 128.
template <int D, int KEYS>
__device__ __forceinline__ void prefill_mma(
    const float* __restrict__ qkv, int row_stride, const int* __restrict__ positions,
    const int* __restrict__ seq_starts, const int* __restrict__ seq_lens,
    const int* __restrict__ block_tables, int max_blocks, const bf16* __restrict__ k_cache,
    const bf16* __restrict__ v_cache, bf16* __restrict__ out, int nq, int nkv,
    int block_size, float scale, int window) {
    pdl_start();
    constexpr int KS = D + 8;     // tile row, bf16: 16-byte aligned, no bank conflicts
    static_assert(KEYS % 16 == 0, "a tile is whole 16-key steps of P V");
    constexpr int TILE = KEYS * KS;
    constexpr int NT = KEYS / 8;  // n-tiles of S
    __shared__ __align__(16) bf16 k_s[2 * TILE];
    __shared__ __align__(16) bf16 v_s[2 * TILE];

    int h = blockIdx.y;
    PrefillRows b;
    // The whole block exits together: no barrier is skipped.
    if (!prefill_rows(PFM_ROWS, positions, seq_starts, seq_lens, block_tables, max_blocks,
                      window, b))
        return;
    int first = b.first;
    int last = b.last;
    int kvh = h / (nq / nkv);
    int kvd = nkv * D;  // a cache row: every KV head's dimensions
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
    // The lowest position of the warp's rows (rows past the block's last have none): a tile
    // of keys none past it, none at kv_end or beyond and none before the highest row's
    // window is seen whole by every row, and needs no mask.
    int warp_lo = (int)__reduce_min_sync(
        0xffffffffu, (unsigned)min(pos0 < 0 ? 0x7fffffff : pos0, pos1 < 0 ? 0x7fffffff : pos1));
    int warp_from = 0;
    if (window > 0) {
        warp_from = warp_lo - window + 1;
    }

    // Scores in base 2: exp(s * scale) = exp2(s * scale * log2(e)).
    const float qscale = scale * 1.4426950408889634f;
    unsigned qa[D / 16][4];
    {
        const float* q0 = qkv + (long long)r0 * row_stride + (long long)h * D;
        const float* q1 = qkv + (long long)r1 * row_stride + (long long)h * D;
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            int c = kk * 16 + 2 * tq;
            qa[kk][0] = pos0 < 0 ? 0u : pack_bf16(q0[c] * qscale, q0[c + 1] * qscale);
            qa[kk][1] = pos1 < 0 ? 0u : pack_bf16(q1[c] * qscale, q1[c + 1] * qscale);
            qa[kk][2] = pos0 < 0 ? 0u : pack_bf16(q0[c + 8] * qscale, q0[c + 9] * qscale);
            qa[kk][3] = pos1 < 0 ? 0u : pack_bf16(q1[c + 8] * qscale, q1[c + 9] * qscale);
        }
    }

    float o[D / 8][4];
#pragma unroll
    for (int nd = 0; nd < D / 8; nd++) o[nd][0] = o[nd][1] = o[nd][2] = o[nd][3] = 0.0f;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.0f, l1 = 0.0f;

    const bf16* kc = k_cache + (long long)kvh * D;
    const bf16* vc = v_cache + (long long)kvh * D;
    const BlockSize bs = block_size_of(block_size);
    prefill_tile<D, KEYS>(k_s, v_s, kc, vc, table, bs, kvd, kv_lo, kv_lo, kv_end);
    int st = 0;
    for (int k0 = kv_lo; k0 < kv_end; k0 += KEYS, st ^= 1) {
        if (k0 + KEYS < kv_end) {
            // Stage st ^ 1 was last read in the previous iteration, before its closing barrier.
            prefill_tile<D, KEYS>(k_s + (st ^ 1) * TILE, v_s + (st ^ 1) * TILE, kc, vc, table,
                                  bs, kvd, k0 + KEYS, kv_lo, kv_end);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();  // every thread's copies of this tile have landed
        // Warp-uniform: every row of the warp is before this tile, or past its window.
        if (warp_hi >= k0 && k0 + KEYS > warp_from) {
            const bf16* kt = k_s + st * TILE;
            const bf16* vt = v_s + st * TILE;
            float sc[NT][4];
#pragma unroll
            for (int nt = 0; nt < NT; nt++) sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.0f;
            if constexpr (D % 32 == 0) {
                // K's b fragments of two 16-dimension steps per ldmatrix: lane l addresses
                // key (l % 8) of the n-tile, dimensions kk2 * 32 + (l / 8) * 8 ...
#pragma unroll
                for (int kk2 = 0; kk2 < D / 32; kk2++) {
#pragma unroll
                    for (int nt = 0; nt < NT; nt++) {
                        unsigned kb[4];
                        ldmatrix_x4(kb, kt + (nt * 8 + (lane & 7)) * KS + kk2 * 32 + (lane >> 3) * 8);
                        mma_bf16(sc[nt], qa[2 * kk2], kb[0], kb[1]);
                        mma_bf16(sc[nt], qa[2 * kk2 + 1], kb[2], kb[3]);
                    }
                }
            } else {
#pragma unroll
                for (int kk = 0; kk < D / 16; kk++) {
#pragma unroll
                    for (int nt = 0; nt < NT; nt++) {
                        const bf16* kr = kt + (nt * 8 + gq) * KS + kk * 16 + 2 * tq;
                        mma_bf16(sc[nt], qa[kk], *reinterpret_cast<const unsigned*>(kr),
                                 *reinterpret_cast<const unsigned*>(kr + 8));
                    }
                }
            }
            float mx0 = NEG_INF;
            float mx1 = NEG_INF;
            // Warp-uniform: most tiles of a long prompt are seen whole by every row.
            bool whole = k0 + KEYS <= kv_end && k0 + KEYS - 1 <= warp_lo &&
                         (window <= 0 || k0 > warp_hi - window);
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
#pragma unroll
                for (int c = 0; c < 2; c++) {
                    if (!whole) {
                        int p = k0 + nt * 8 + 2 * tq + c;
                        if (!sees(p, pos0, kv_end, window)) sc[nt][c] = NEG_INF;
                        if (!sees(p, pos1, kv_end, window)) sc[nt][2 + c] = NEG_INF;
                    }
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
            // A row that has seen no key yet subtracts 0: every exp2 is then exp2(-inf) = 0.
            float b0 = n0 == NEG_INF ? 0.0f : n0;
            float b1 = n1 == NEG_INF ? 0.0f : n1;
            float c0 = exp2f(m0 - b0);
            float c1 = exp2f(m1 - b1);
            m0 = n0;
            m1 = n1;
            l0 *= c0;
            l1 *= c1;
            // Once the rows' maxima settle (most tiles of a long prompt), the factors are 1
            // for the whole warp and the outputs keep their values: skip the products.
            if (!__all_sync(0xffffffffu, c0 == 1.0f && c1 == 1.0f)) {
#pragma unroll
                for (int nd = 0; nd < D / 8; nd++) {
                    o[nd][0] *= c0;
                    o[nd][1] *= c0;
                    o[nd][2] *= c1;
                    o[nd][3] *= c1;
                }
            }
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
#pragma unroll
                for (int c = 0; c < 2; c++) {
                    sc[nt][c] = softmax_exp2(sc[nt][c] - b0);
                    sc[nt][2 + c] = softmax_exp2(sc[nt][2 + c] - b1);
                    l0 += sc[nt][c];
                    l1 += sc[nt][2 + c];
                }
            }
            // ldmatrix: lane l addresses row (l % 8) of matrix l / 8; matrices 0 and 1 are
            // keys 0-7 and 8-15 of the 16-key step at dims nd * 8 .., 2 and 3 the same keys at
            // the next 8 dims.
            const int lrow = (lane & 7) + ((lane >> 3) & 1) * 8;
            const int lcol = (lane >> 4) * 8;
#pragma unroll
            for (int ks = 0; ks < KEYS / 16; ks++) {
                unsigned pa[4] = {pack_bf16(sc[2 * ks][0], sc[2 * ks][1]),
                                  pack_bf16(sc[2 * ks][2], sc[2 * ks][3]),
                                  pack_bf16(sc[2 * ks + 1][0], sc[2 * ks + 1][1]),
                                  pack_bf16(sc[2 * ks + 1][2], sc[2 * ks + 1][3])};
#pragma unroll
                for (int nd = 0; nd < D / 8; nd += 2) {
                    unsigned vb[4];
                    ldmatrix_x4_trans(vb, vt + (ks * 16 + lrow) * KS + nd * 8 + lcol);
                    mma_bf16(o[nd], pa, vb[0], vb[1]);
                    mma_bf16(o[nd + 1], pa, vb[2], vb[3]);
                }
            }
        }
        __syncthreads();  // this stage is read; the next iteration may refill it
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
#define PREFILL_MMA(D, KEYS)                                                                  \
    extern "C" __global__ void __launch_bounds__(PFM_THREADS) paged_attention_prefill_mma_d##D(\
        const float* __restrict__ qkv, int row_stride, const int* __restrict__ positions,     \
        const int* __restrict__ seq_starts, const int* __restrict__ seq_lens,                 \
        const int* __restrict__ block_tables, int max_blocks,                                 \
        const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache,                   \
        bf16* __restrict__ out, int nq, int nkv, int d, int block_size, float scale,          \
        int window) {                                                                         \
        prefill_mma<D, KEYS>(qkv, row_stride, positions, seq_starts, seq_lens, block_tables,  \
                       max_blocks, k_cache, v_cache, out, nq, nkv, block_size, scale,         \
                       window);                                                               \
    }
PREFILL_MMA(16, 32)
PREFILL_MMA(32, 32)
PREFILL_MMA(64, 32)
PREFILL_MMA(128, 32)
PREFILL_MMA(256, 16)
