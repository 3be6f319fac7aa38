// Paged attention for decode steps: one query per sequence over its cached history.
// Part of the kernels' one source: common.cuh, then layers.cu, attention_decode.cu,
// attention_prefill.cu and sampling.cu, joined in that order (kernels.rs, KERNELS_CU).

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
    float* __restrict__ partials, int* __restrict__ ticks, int nq, int nkv, int d, int block_size,
    float scale, int window) {
    pdl_start();
    (void)partials;  // the split decode's partials and tickets: this kernel never splits
    (void)ticks;
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
// the groups' partial results are merged at the end. Each lane group issues the loads of
// DECODE_UNROLL positions before it uses the first: one position at a time, a block was a
// chain of dependent loads (a block table entry, then the row), 175 µs a layer at 2,048
// positions on an H100. Grid (S, nq, splits), block 128.
// splits > 1 (few sequences: one block per head would leave most of the GPU idle) splits the
// history into `splits` chunks, one block each. Each writes its unnormalised partial (max,
// sum, weighted V row) to `partials` and takes a ticket from ticks[s, h]; the block that
// draws the last merges every split's partial into the output and sets the counter back
// to 0 for the next step (no second kernel to launch, and a captured graph replays as is).
template <int D>
__device__ __forceinline__ void decode_vec(
    const float* __restrict__ qkv, int row_stride, const int* __restrict__ seq_starts,
    const int* __restrict__ seq_lens, const int* __restrict__ block_tables, int max_blocks,
    const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache, bf16* __restrict__ out,
    float* __restrict__ partials, int* __restrict__ ticks, int nq, int nkv, int block_size,
    float scale, int window) {
    pdl_start();
    constexpr int LPP = D / 8;        // lanes per position
    constexpr int PPW = 32 / LPP;     // positions per warp and step
    constexpr int PARTS = 4 * PPW;    // lane groups in the block
    constexpr int U = DECODE_UNROLL;  // steps whose loads are in flight together
    __shared__ float part_m[PARTS];
    __shared__ float part_l[PARTS];
    __shared__ float part_acc[PARTS][D];
    __shared__ float split_w[DECODE_MAX_SPLITS];
    __shared__ float split_total;
    __shared__ int merges;

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
    int hi = len;
    const int splits = gridDim.z;
    if (splits > 1) {
        // This block's share of the history: equal chunks of at least DECODE_MIN_SPLIT_KEYS
        // positions, so a short history leaves the last splits empty.
        int chunk = max(DECODE_MIN_SPLIT_KEYS, (len - lo + splits - 1) / splits);
        int from = lo + (int)blockIdx.z * chunk;
        lo = min(from, len);
        hi = min(from + chunk, len);
    }
    // Every lane runs every step (the shuffles need the whole warp); a lane group past the
    // end scores nothing. Step u of an iteration takes the positions 4 * PPW * u further on,
    // so each group sees its positions in the same order as without the unrolling.
    for (int base = lo + warp * PPW; base < hi; base += 4 * PPW * U) {
        uint4 k4[U];
        uint4 v4[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            int p = base + u * 4 * PPW + grp;
            k4[u] = make_uint4(0u, 0u, 0u, 0u);
            v4[u] = make_uint4(0u, 0u, 0u, 0u);
            if (p < hi) {
                long long off =
                    ((long long)table[p / block_size] * block_size + p % block_size) * kvd
                    + (long long)kvh * D + sub * 8;
                k4[u] = *reinterpret_cast<const uint4*>(k_cache + off);
                v4[u] = *reinterpret_cast<const uint4*>(v_cache + off);
            }
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            bool valid = base + u * 4 * PPW + grp < hi;
            unsigned kw[4] = {k4[u].x, k4[u].y, k4[u].z, k4[u].w};
            unsigned vw[4] = {v4[u].x, v4[u].y, v4[u].z, v4[u].w};
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
    }
    if (sub == 0) {
        part_m[part] = m;
        part_l[part] = l;
    }
#pragma unroll
    for (int x = 0; x < 8; x++) part_acc[part][sub * 8 + x] = acc[x];
    __syncthreads();
    // A group that saw no position has m = -inf, l = 0 and contributes exp(-inf) = 0; a split
    // whose share is empty (every group) subtracts 0 instead of -inf, and its partial is
    // m = -inf, l = 0, zeros.
    float mm = NEG_INF;
    for (int k = 0; k < PARTS; k++) mm = fmaxf(mm, part_m[k]);
    float base = mm == NEG_INF ? 0.0f : mm;
    float total = 0.0f;
    for (int k = 0; k < PARTS; k++) total += part_l[k] * expf(part_m[k] - base);
    bf16* o = out + (long long)t * nq * D + (long long)h * D;
    if (splits == 1) {
        float inv = 1.0f / total;
        for (int i = threadIdx.x; i < D; i += blockDim.x) {
            float v = 0.0f;
            for (int k = 0; k < PARTS; k++) v += part_acc[k][i] * expf(part_m[k] - mm);
            o[i] = f2bf(v * inv);
        }
        return;
    }
    const long long row = D + 2;
    float* pp = partials + ((long long)s * nq + h) * splits * row;
    if (threadIdx.x == 0) {
        pp[blockIdx.z * row] = mm;
        pp[blockIdx.z * row + 1] = total;
    }
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        float v = 0.0f;
        for (int k = 0; k < PARTS; k++) v += part_acc[k][i] * expf(part_m[k] - base);
        pp[blockIdx.z * row + 2 + i] = v;
    }
    // Every thread's writes are visible device-wide before the ticket is taken.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        int* tick = ticks + (long long)s * nq + h;
        merges = atomicAdd(tick, 1) == splits - 1;
        if (merges) *tick = 0;
    }
    __syncthreads();
    if (!merges) return;
    __threadfence();
    // The merge reads the other blocks' partials past L1 (__ldcg): one warp weighs the
    // splits (there are at most DECODE_MAX_SPLITS <= 32), then a thread per dimension sums.
    if (warp == 0) {
        float mk = lane < splits ? __ldcg(pp + lane * row) : NEG_INF;
        float lk = lane < splits ? __ldcg(pp + lane * row + 1) : 0.0f;
        float top = warp_max(mk);  // finite: some split holds a position (len >= 1)
        float wk = lane < splits ? expf(mk - top) : 0.0f;
        float sum = warp_sum(lk * wk);
        split_w[lane] = wk;
        if (lane == 0) split_total = sum;
    }
    __syncthreads();
    float inv = 1.0f / split_total;
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        float v = 0.0f;
#pragma unroll 8
        for (int k = 0; k < splits; k++) v += __ldcg(pp + k * row + 2 + i) * split_w[k];
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
        bf16* __restrict__ out, float* __restrict__ partials, int* __restrict__ ticks, int nq,    \
        int nkv, int d, int block_size, float scale, int window) {                             \
        decode_vec<D>(qkv, row_stride, seq_starts, seq_lens, block_tables, max_blocks,         \
                      k_cache, v_cache, out, partials, ticks, nq, nkv, block_size, scale,      \
                      window);                                                                 \
    }
DECODE_VEC(16)
DECODE_VEC(32)
DECODE_VEC(64)
DECODE_VEC(128)
DECODE_VEC(256)
