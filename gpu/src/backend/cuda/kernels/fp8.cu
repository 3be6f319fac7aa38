// FP8 (e4m3) linear layers: weights [n, k] as stored by a checkpoint, one byte each, with f32
// scales (see gpu/src/quant.rs for what they mean and gpu/src/backend/cuda/fp8.rs for how
// they are laid out on the device).
//
// - fp8_gemv_*: products of a few rows (a decode step's), x bf16 as the skinny kernels take
//   it, the weights streamed once with 16-byte loads (16 weights a load), f32 sums. Block
//   scales multiply each 128-wide k block's partial sum; per-channel scales multiply the row's
//   sum at the end. Activations are not quantized: this is the dequantized product the CPU
//   reference computes, in another order of summation.
// - fp8_quant_rows: activations quantized for cuBLASLt's FP8 GEMM (prefill), per token in
//   groups of 128 columns or per token, scale = amax / 448.
// - fp8_out_cols: cuBLASLt's bf16 output widened into columns of the f32 product rows, with
//   the bias.

#if !defined(FP8_THREADS) || !defined(FP8_ROWS) || !defined(FP8_UNROLL) || \
    !defined(FP8_QUANT_THREADS) || !defined(FP8_OUT_THREADS) || !defined(FP8_MMA_THREADS) || \
    !defined(FP8_MMA_WARPS) || !defined(FP8_MMA_UNROLL)
#error "the FP8 kernels are compiled with shapes.rs's FP8_* figures"
#endif
#if FP8_QUANT_THREADS % 32 != 0 || FP8_QUANT_THREADS > 1024
#error "fp8_quant_rows reduces whole warps with block_max"
#endif

// The largest finite e4m3 magnitude.
#define E4M3_MAX 448.0f

// Two e4m3 bytes (the low two of v) as f16x2, low byte in the low half, each value scaled by
// 2^-8: e4m3 and f16 share the layout sign | exponent | mantissa with 3 and 10 mantissa bits
// and biases 7 and 15, so the byte's bits moved into place are the f16 of value * 2^-8,
// subnormals included. Exact, and the same on every architecture (sm_89's cvt.f16x2.e4m3x2
// would save two instructions a pair).
__device__ __forceinline__ unsigned int e4m3x2_to_f16x2_lo(unsigned int v) {
    unsigned int t = __byte_perm(v, 0u, 0x1404);  // byte 0 -> bits 8..15, byte 1 -> 24..31
    return (t & 0x80008000u) | ((t >> 1) & 0x3f803f80u);
}

// sm_89 and later convert a pair in one instruction, exactly (no 2^-8): an H200's batch-1
// FP8 step spent 69% of its time in fp8_gemv_block_m1 at 61% of the copy bandwidth, about
// 80 instructions a 16-byte load, half of them this widening; the instruction takes 7 of
// them a pair to 3 with the f32 conversions. ptxas 13.0 for sm_90 now gives the one-row
// kernel's loop 501 instructions for its 8 loads a lane (63 a load: 16 FFMA, 16 HADD2 to
// f32, 8 F2FP), fp8_mma_block_n1's 512 for as many (64: 8 F2FP, 16 shifts and masks to
// bf16, 2 HMMA) but for up to 8 rows rather than 1.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define E4M3_HW_CVT 1
#endif

// Two e4m3 bytes (the low two of v) as f16x2, low byte in the low half, exact.
__device__ __forceinline__ unsigned int e4m3x2_to_f16x2_hw(unsigned int v) {
#ifdef E4M3_HW_CVT
    unsigned int r;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"((unsigned short)(v & 0xffffu)));
    return r;
#else
    return e4m3x2_to_f16x2_lo(v);
#endif
}

// The same for the high two bytes of v: the halves split inside the asm, so the conversion
// reads the upper half of the register itself (no shift before it).
__device__ __forceinline__ unsigned int e4m3x2_hi_to_f16x2_hw(unsigned int v) {
#ifdef E4M3_HW_CVT
    unsigned int r;
    asm("{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, %1;\n\tcvt.rn.f16x2.e4m3x2 %0, h;\n\t}"
        : "=r"(r)
        : "r"(v));
    return r;
#else
    return e4m3x2_to_f16x2_lo(v >> 16);
#endif
}

// Undoes the 2^-8 of e4m3x2_to_f16x2_lo, applied once per sum (1 where the instruction
// converts).
#ifdef E4M3_HW_CVT
#define E4M3_UNIT 1.0f
#else
#define E4M3_UNIT 256.0f
#endif

__device__ __forceinline__ void f16x2_to_f32(unsigned int h, float& lo, float& hi) {
#ifdef __CUDA_ARCH__
    asm("{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.f32.f16 %0, l;\n\tcvt.f32.f16 %1, h;\n\t}"
        : "=f"(lo), "=f"(hi)
        : "r"(h));
#else
    lo = kvmesh_emu_half((unsigned short)(h & 0xffffu));  // gpu/emu: the CPU emulator
    hi = kvmesh_emu_half((unsigned short)(h >> 16));
#endif
}

// 16 weights (one 16-byte load) as f32, each scaled by 2^-8 (by 1 with E4M3_HW_CVT).
__device__ __forceinline__ void widen16(uint4 v, float* f) {
    unsigned int words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; j++) {
        f16x2_to_f32(e4m3x2_to_f16x2_hw(words[j]), f[4 * j], f[4 * j + 1]);
        f16x2_to_f32(e4m3x2_hi_to_f16x2_hw(words[j]), f[4 * j + 2], f[4 * j + 3]);
    }
}

// acc + the dot product of 16 widened weights and 16 bf16 activations (two 16-byte words).
__device__ __forceinline__ float dot16(const float* f, uint4 a, uint4 b, float acc) {
    unsigned int xs[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
    for (int j = 0; j < 8; j++) {
        acc = fmaf(f[2 * j], __uint_as_float(xs[j] << 16), acc);
        acc = fmaf(f[2 * j + 1], __uint_as_float(xs[j] & 0xffff0000u), acc);
    }
    return acc;
}

// y[m, col0 + j] = sum_k x[m, k] * w[j, k] * scale (+ bias[j]) for j < n and m < rows, y's
// rows ldy apart. Warp j streams weight rows FP8_ROWS * j ..., FP8_UNROLL 16-byte loads in
// flight per lane and row (4 x 2 x 512 bytes a warp, as the skinny kernels have).
//
// BLOCK: ws holds one scale per 128 x 128 block, row-major with rows ws_stride apart: the
// 16-byte chunk i of row r is in block (r / 128, i / 8), so each chunk's partial sum is scaled
// before it joins the row's. Otherwise ws holds one scale per row, applied to the sum.
// The host launches these for k a multiple of 16 (16-byte rows of w, 32-byte rows of x).
//
// The fused forms take skinny_gemm's prologue and epilogues (skinny.cu), with the rows'
// sums as the plain kernel writes them (scale and bias applied), so each gives what the
// plain kernel and the separate launch after it give, bit for bit:
// - SILU: w holds n gate rows then n up rows; warp j streams gate row j and up row j and
//   writes act[m, j] = bf16(silu(gate) * up), as silu_mul does (ldy = n, col0 = 0).
// - ROPE: a layer's q/k/v (RopeIn), warp j a rotation pair or two v rows, as rope_kv_write
//   leaves y and the cache, q/k norms included (ldy = n, col0 = 0).
// - norm (not null): the input is the residual add and RMSNorm (NormIn), computed by every
//   block into xs, block 0 writing the summed residual.
template <int M, bool BLOCK, bool SILU, bool ROPE>
__device__ __forceinline__ void fp8_gemv(const bf16* __restrict__ x,
                                         const unsigned char* __restrict__ w,
                                         const float* __restrict__ ws, int ws_stride,
                                         const float* __restrict__ bias, float* __restrict__ y,
                                         int ldy, int col0, bf16* __restrict__ act, int rows,
                                         int n, int k, const NormIn* norm, bf16* xs,
                                         const RopeIn* rope) {
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int j = blockIdx.x * (FP8_THREADS / 32) + warp;
    const int n0 = SILU ? j : j * FP8_ROWS;
    // The whole warp leaves, unless the block computes the norm first, which every thread
    // takes part in.
    if (n0 >= n && norm == nullptr) return;
    const int k16 = k >> 4;
    const uint4* w16 = reinterpret_cast<const uint4*>(w);
    const uint4* x16 = reinterpret_cast<const uint4*>(x);
    // Rows past the end read the last one again; their sums are not written.
    int rr[FP8_ROWS];
    bool pair = false;
    if (ROPE) {
        pair = rope_rows(rope, min(j, n / 2 - 1), &rr[0], &rr[1]);
    } else {
#pragma unroll
        for (int r = 0; r < FP8_ROWS; r++) {
            rr[r] = SILU ? min(n0, n - 1) + r * n : min(n0 + r, n - 1);
        }
    }
    long long wrow[FP8_ROWS];
    int srow[FP8_ROWS];  // BLOCK: the first scale of the row's block row
#pragma unroll
    for (int r = 0; r < FP8_ROWS; r++) {
        wrow[r] = (long long)rr[r] * k16;
        srow[r] = BLOCK ? (rr[r] >> 7) * ws_stride : rr[r];
    }
    float acc[FP8_ROWS][M];
#pragma unroll
    for (int r = 0; r < FP8_ROWS; r++) {
#pragma unroll
        for (int m = 0; m < M; m++) acc[r][m] = 0.0f;
    }
    // The weights and scales depend on no earlier kernel: the first loads go to L2 before
    // the wait for the kernel that wrote x (as skinny_gemm does).
    pdl_trigger();
#pragma unroll
    for (int u = 0; u < FP8_UNROLL; u++) {
        int i = lane + u * 32;
#pragma unroll
        for (int r = 0; r < FP8_ROWS; r++) {
            if (i < k16 && n0 < n) prefetch_l2(w16 + wrow[r] + i);
        }
    }
    pdl_wait();
    if (norm != nullptr) {
        norm_rows_to_shared(norm, rows, k, xs);
        if (n0 >= n) return;
        x16 = reinterpret_cast<const uint4*>(xs);
    }
    for (int i0 = lane; i0 < k16; i0 += 32 * FP8_UNROLL) {
        uint4 wv[FP8_UNROLL][FP8_ROWS];
#pragma unroll
        for (int u = 0; u < FP8_UNROLL; u++) {
            int i = i0 + u * 32;
#pragma unroll
            for (int r = 0; r < FP8_ROWS; r++) {
                wv[u][r] = i < k16 ? ld_once16(w16 + wrow[r] + i) : make_uint4(0u, 0u, 0u, 0u);
            }
        }
#pragma unroll
        for (int u = 0; u < FP8_UNROLL; u++) {
            int i = i0 + u * 32;
            if (i < k16) {
#pragma unroll
                for (int r = 0; r < FP8_ROWS; r++) {
                    float f[16];
                    widen16(wv[u][r], f);
                    float s = BLOCK ? ws[srow[r] + (i >> 3)] : 1.0f;
#pragma unroll
                    for (int m = 0; m < M; m++) {
                        const uint4* xr = x16 + (long long)min(m, rows - 1) * 2 * k16 + 2 * i;
                        float part = dot16(f, xr[0], xr[1], 0.0f);
                        acc[r][m] = BLOCK ? fmaf(s, part, acc[r][m]) : acc[r][m] + part;
                    }
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < FP8_ROWS; r++) {
#pragma unroll
        for (int m = 0; m < M; m++) acc[r][m] = warp_sum(acc[r][m]);
    }
    // warp_sum leaves every lane the same bits: lane m writes the step's row m, so a lane
    // holds one row's sums across the epilogue's calls (division, sincos), not M rows'.
    // A rotated product with q/k norms keeps the whole warp for its head's ticket
    // (rope_norm_last); the lanes past the rows take row 0's sums and write nothing.
    const bool writes = lane < M && lane < rows;
    if (!(ROPE && rope->q_w != nullptr) && !writes) return;
    const int m = writes ? lane : 0;
    // The row's sums as the plain kernel writes them: scaled, the bias added.
    float v[FP8_ROWS];
#pragma unroll
    for (int r = 0; r < FP8_ROWS; r++) {
        float a = acc[r][0];
#pragma unroll
        for (int mm = 1; mm < M; mm++) a = mm == m ? acc[r][mm] : a;
        float s = (BLOCK ? 1.0f : ws[srow[r]]) * E4M3_UNIT;
        v[r] = fmaf(a, s, bias != nullptr ? bias[rr[r]] : 0.0f);
    }
    if (ROPE) {
        if (writes) rope_write(rope, m, rr[0], rr[1], pair, v[0], v[1], y, n);
        rope_norm_last(rope, rr[0], pair, y, n, rows);
    } else if (SILU) {
        act[(long long)m * n + n0] = f2bf(v[0] / (1.0f + expf(-v[0])) * v[1]);
    } else {
#pragma unroll
        for (int r = 0; r < FP8_ROWS; r++) {
            if (n0 + r < n) y[(long long)m * ldy + col0 + n0 + r] = v[r];
        }
    }
}

#if FP8_ROWS != 2
#error "the fused FP8 products stream one gate row and one up row a warp, or a rotation pair"
#endif
#if FP8_THREADS != ADD_RMSNORM_THREADS
#error "an FP8 product's norm prologue must reduce as add_rmsnorm_to_bf16 does"
#endif

// Grid (ceil(n / (FP8_THREADS / 32 * FP8_ROWS))). With the converting instruction sm_90's
// one-row kernel takes 72 registers (3 blocks an SM, 96 KiB of loads in flight); holding it
// to 64 for a fourth block spills.
#define FP8_GEMV_KERNEL(KIND, BLOCK, M)                                                         \
    extern "C" __global__ void __launch_bounds__(FP8_THREADS) fp8_gemv_##KIND##_m##M(           \
        const bf16* __restrict__ x, const unsigned char* __restrict__ w,                        \
        const float* __restrict__ ws, int ws_stride, const float* __restrict__ bias,            \
        float* __restrict__ y, int ldy, int col0, int rows, int n, int k) {                     \
        fp8_gemv<M, BLOCK, false, false>(x, w, ws, ws_stride, bias, y, ldy, col0, nullptr,     \
                                         rows, n, k, nullptr, nullptr, nullptr);               \
    }
FP8_GEMV_KERNEL(block, true, 1)
FP8_GEMV_KERNEL(block, true, 2)
FP8_GEMV_KERNEL(block, true, 4)
FP8_GEMV_KERNEL(channel, false, 1)
FP8_GEMV_KERNEL(channel, false, 2)
FP8_GEMV_KERNEL(channel, false, 4)

// The fused forms, with skinny_silu_m*'s, skinny_rope_m*'s and skinny_norm*'s arguments, w
// as (w, ws, ws_stride). Grids: fp8_gemv_*'s, and ceil(n / (FP8_THREADS / 32)) for SILU.
// MINB, the least blocks an SM (3 for one row, 2 for two), keeps ptxas from holding
// registers to a higher occupancy by spilling a few bytes around the epilogue's calls
// (division, sincos), as it did on sm_80 to sm_100 without it.
#define FP8_SILU_KERNEL(KIND, BLOCK, M, MINB)                                                      \
    extern "C" __global__ void __launch_bounds__(FP8_THREADS, MINB) fp8_silu_##KIND##_m##M(        \
        const bf16* __restrict__ x, const unsigned char* __restrict__ w,                           \
        const float* __restrict__ ws, int ws_stride, bf16* __restrict__ act, int rows, int n,      \
        int k) {                                                                                   \
        fp8_gemv<M, BLOCK, true, false>(x, w, ws, ws_stride, nullptr, nullptr, n, 0, act,          \
                                        rows, n, k, nullptr, nullptr, nullptr);                    \
    }
#define FP8_ROPE_KERNEL(KIND, BLOCK, M, MINB)                                                      \
    extern "C" __global__ void __launch_bounds__(FP8_THREADS, MINB) fp8_rope_##KIND##_m##M(        \
        const bf16* __restrict__ x, const unsigned char* __restrict__ w,                           \
        const float* __restrict__ ws, int ws_stride, const float* __restrict__ bias,               \
        float* __restrict__ y, ROPE_PARAMS, int rows, int n, int k) {                           \
        RopeIn rope = ROPE_IN;                                                                  \
        fp8_gemv<M, BLOCK, false, true>(x, w, ws, ws_stride, bias, y, n, 0, nullptr, rows, n,      \
                                        k, nullptr, nullptr, &rope);                               \
    }
#define FP8_NORM_KERNEL(KIND, BLOCK, M, MINB)                                                      \
    extern "C" __global__ void __launch_bounds__(FP8_THREADS, MINB) fp8_norm_##KIND##_m##M(        \
        const float* __restrict__ res_in, const float* __restrict__ delta,                         \
        const float* __restrict__ norm_w, float eps, float* __restrict__ res_out,                  \
        const unsigned char* __restrict__ w, const float* __restrict__ ws, int ws_stride,          \
        const float* __restrict__ bias, float* __restrict__ y, int rows, int n, int k) {           \
        __shared__ __align__(16) bf16 xs[M * NORM_MAX];                                            \
        NormIn norm = {res_in, delta, norm_w, res_out, eps};                                       \
        fp8_gemv<M, BLOCK, false, false>(nullptr, w, ws, ws_stride, bias, y, n, 0, nullptr,        \
                                         rows, n, k, &norm, xs, nullptr);                          \
    }
#define FP8_NORM_SILU_KERNEL(KIND, BLOCK, M, MINB)                                                 \
    extern "C" __global__ void __launch_bounds__(FP8_THREADS, MINB) fp8_norm_silu_##KIND##_m##M(   \
        const float* __restrict__ res_in, const float* __restrict__ delta,                         \
        const float* __restrict__ norm_w, float eps, float* __restrict__ res_out,                  \
        const unsigned char* __restrict__ w, const float* __restrict__ ws, int ws_stride,          \
        bf16* __restrict__ act, int rows, int n, int k) {                                          \
        __shared__ __align__(16) bf16 xs[M * NORM_MAX];                                            \
        NormIn norm = {res_in, delta, norm_w, res_out, eps};                                       \
        fp8_gemv<M, BLOCK, true, false>(nullptr, w, ws, ws_stride, nullptr, nullptr, n, 0,         \
                                        act, rows, n, k, &norm, xs, nullptr);                      \
    }
#define FP8_NORM_ROPE_KERNEL(KIND, BLOCK, M, MINB)                                                 \
    extern "C" __global__ void __launch_bounds__(FP8_THREADS, MINB) fp8_norm_rope_##KIND##_m##M(   \
        const float* __restrict__ res_in, const float* __restrict__ delta,                         \
        const float* __restrict__ norm_w, float eps, float* __restrict__ res_out,                  \
        const unsigned char* __restrict__ w, const float* __restrict__ ws, int ws_stride,          \
        const float* __restrict__ bias, float* __restrict__ y,                                     \
        ROPE_PARAMS, int rows, int n, int k) {                                                  \
        __shared__ __align__(16) bf16 xs[M * NORM_MAX];                                            \
        NormIn norm = {res_in, delta, norm_w, res_out, eps};                                       \
        RopeIn rope = ROPE_IN;                                                                  \
        fp8_gemv<M, BLOCK, false, true>(nullptr, w, ws, ws_stride, bias, y, n, 0, nullptr,         \
                                        rows, n, k, &norm, xs, &rope);                             \
    }
FP8_SILU_KERNEL(block, true, 1, 3)
FP8_SILU_KERNEL(block, true, 2, 2)
FP8_ROPE_KERNEL(block, true, 1, 3)
FP8_ROPE_KERNEL(block, true, 2, 2)
FP8_NORM_KERNEL(block, true, 1, 3)
FP8_NORM_KERNEL(block, true, 2, 2)
FP8_NORM_SILU_KERNEL(block, true, 1, 3)
FP8_NORM_SILU_KERNEL(block, true, 2, 2)
FP8_NORM_ROPE_KERNEL(block, true, 1, 3)
FP8_NORM_ROPE_KERNEL(block, true, 2, 2)
FP8_SILU_KERNEL(channel, false, 1, 3)
FP8_SILU_KERNEL(channel, false, 2, 2)
FP8_ROPE_KERNEL(channel, false, 1, 3)
FP8_ROPE_KERNEL(channel, false, 2, 2)
FP8_NORM_KERNEL(channel, false, 1, 3)
FP8_NORM_KERNEL(channel, false, 2, 2)
FP8_NORM_SILU_KERNEL(channel, false, 1, 3)
FP8_NORM_SILU_KERNEL(channel, false, 2, 2)
FP8_NORM_ROPE_KERNEL(channel, false, 1, 3)
FP8_NORM_ROPE_KERNEL(channel, false, 2, 2)

// An f16x2 pair widened from e4m3 (e4m3x2_to_f16x2_hw) as bf16x2 of value * 2^-112 (and the
// 2^-8 of e4m3x2_to_f16x2_lo where the instruction is missing, E4M3_UNIT): every e4m3 value
// is a normal f16, or zero, whose exponent and top mantissa bits move into bf16's places
// (the exponent field as it is, 15 biases apart from bf16's 127: 2^-112), landing on a normal
// bf16 or zero; the 3 mantissa bits fit. Exact.
__device__ __forceinline__ unsigned int f16x2_to_bf16x2_scaled(unsigned int h) {
    return ((h >> 3) & 0x0fff0fffu) | (h & 0x80008000u);
}

// 2^112, the scale f16x2_to_bf16x2_scaled takes off, times E4M3_UNIT.
#define E4M3_MMA_UNIT (5.192296858534828e33f * E4M3_UNIT)

// fp8_mma_*: fp8_gemv_*'s product (same arguments, same result up to the order of
// summation) for 1 to 8 rows (NT = 1) or 9 to 16 (NT = 2) on the tensor cores: bf16 mma
// m16n8k16, the weights widened exactly (f16x2_to_bf16x2_scaled, a 2^-112 taken off at the
// end), the activations read as bf16 as they are, f32 sums. A block is FP8_MMA_WARPS warps
// over 16 weight rows, warp w taking k blocks of 128 w, w + FP8_MMA_WARPS, ...; their sums
// are added in warp order (deterministic) and written by warp 0. Grid (ceil(n / 16)).
//
// Lane (g, t) = (lane / 4, lane % 4) streams rows g and g + 8 of the 16 with 16-byte loads
// at k = 128 kb + 16 t and 128 kb + 64 + 16 t: the k order inside each 16-wide mma step is
// permuted (a sum does not mind) so that a lane's 16 bytes are its A fragments for four
// steps: step s takes bytes 4s, 4s + 1 as k 2t, 2t + 1 and 4s + 2, 4s + 3 as k 2t + 8,
// 2t + 9, and the B fragment of column (row of x) g the same positions of x, two 32-bit
// words of it. Rows past n read the last one again; columns past `rows` the last row of x;
// neither is written.
//
// BLOCK: the 16 rows lie in one 128-row block; each k block's sums are scaled as they join.
template <int NT, bool BLOCK>
__device__ __forceinline__ void fp8_mma(const bf16* __restrict__ x,
                                        const unsigned char* __restrict__ w,
                                        const float* __restrict__ ws, int ws_stride,
                                        const float* __restrict__ bias, float* __restrict__ y,
                                        int ldy, int col0, int rows, int n, int k,
                                        float* part) {
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int n0 = blockIdx.x * 16;
    const int k16 = k >> 4;
    const int kblocks = (k + 127) >> 7;
    // The lane's rows of w and x, at its first 16 bytes (chunk t of a k block); chunk i of
    // the row is then pa[i - t] (16-byte units; x's two a chunk).
    const uint4* pa = reinterpret_cast<const uint4*>(w) + (long long)min(n0 + g, n - 1) * k16 + t;
    const uint4* pb =
        reinterpret_cast<const uint4*>(w) + (long long)min(n0 + g + 8, n - 1) * k16 + t;
    const uint4* px[NT];
#pragma unroll
    for (int j = 0; j < NT; j++) {
        px[j] = reinterpret_cast<const uint4*>(x) + (long long)min(j * 8 + g, rows - 1) * 2 * k16 +
                2 * t;
    }
    const float* wsr = ws + (BLOCK ? (n0 >> 7) * ws_stride : 0);
    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; j++) {
#pragma unroll
        for (int r = 0; r < 4; r++) acc[j][r] = 0.0f;
    }
    pdl_trigger();
#pragma unroll
    for (int c = 0; c < 2; c++) {
        int i = warp * 8 + c * 4;
        if (i + t < k16) {
            prefetch_l2(pa + i);
            prefetch_l2(pb + i);
        }
    }
    pdl_wait();
    for (int kb0 = warp; kb0 < kblocks; kb0 += FP8_MMA_WARPS * FP8_MMA_UNROLL) {
        // Every weight load of the iteration first (FP8_MMA_UNROLL k blocks, 4 loads each).
        uint4 wv[FP8_MMA_UNROLL][2][2];
#pragma unroll
        for (int u = 0; u < FP8_MMA_UNROLL; u++) {
#pragma unroll
            for (int c = 0; c < 2; c++) {
                int i = (kb0 + u * FP8_MMA_WARPS) * 8 + c * 4;
                bool in = i + t < k16;
                wv[u][c][0] = in ? ld_once16(pa + i) : make_uint4(0u, 0u, 0u, 0u);
                wv[u][c][1] = in ? ld_once16(pb + i) : make_uint4(0u, 0u, 0u, 0u);
            }
        }
#pragma unroll
        for (int u = 0; u < FP8_MMA_UNROLL; u++) {
            const int kb = kb0 + u * FP8_MMA_WARPS;
            if (kb >= kblocks) break;
            float d[NT][4];
#pragma unroll
            for (int j = 0; j < NT; j++) {
#pragma unroll
                for (int r = 0; r < 4; r++) d[j][r] = 0.0f;
            }
#pragma unroll
            for (int c = 0; c < 2; c++) {
                int i = kb * 8 + c * 4;
                bool in = i + t < k16;
                unsigned int xa[NT][8];
#pragma unroll
                for (int j = 0; j < NT; j++) {
                    uint4 lo = in ? px[j][2 * i] : make_uint4(0u, 0u, 0u, 0u);
                    uint4 hi = in ? px[j][2 * i + 1] : make_uint4(0u, 0u, 0u, 0u);
                    xa[j][0] = lo.x, xa[j][1] = lo.y, xa[j][2] = lo.z, xa[j][3] = lo.w;
                    xa[j][4] = hi.x, xa[j][5] = hi.y, xa[j][6] = hi.z, xa[j][7] = hi.w;
                }
                const unsigned int ra[4] = {wv[u][c][0].x, wv[u][c][0].y, wv[u][c][0].z,
                                            wv[u][c][0].w};
                const unsigned int rb[4] = {wv[u][c][1].x, wv[u][c][1].y, wv[u][c][1].z,
                                            wv[u][c][1].w};
#pragma unroll
                for (int st = 0; st < 4; st++) {
                    const unsigned a[4] = {
                        f16x2_to_bf16x2_scaled(e4m3x2_to_f16x2_hw(ra[st])),
                        f16x2_to_bf16x2_scaled(e4m3x2_to_f16x2_hw(rb[st])),
                        f16x2_to_bf16x2_scaled(e4m3x2_hi_to_f16x2_hw(ra[st])),
                        f16x2_to_bf16x2_scaled(e4m3x2_hi_to_f16x2_hw(rb[st]))};
#pragma unroll
                    for (int j = 0; j < NT; j++) {
                        if (BLOCK) {
                            mma_bf16(d[j], a, xa[j][2 * st], xa[j][2 * st + 1]);
                        } else {
                            mma_bf16(acc[j], a, xa[j][2 * st], xa[j][2 * st + 1]);
                        }
                    }
                }
            }
            if (BLOCK) {
                float s = wsr[kb];
#pragma unroll
                for (int j = 0; j < NT; j++) {
#pragma unroll
                    for (int r = 0; r < 4; r++) acc[j][r] = fmaf(s, d[j][r], acc[j][r]);
                }
            }
        }
    }
    // The warps' sums, added in warp order by warp 0: part is [warps][NT][4][32].
#pragma unroll
    for (int j = 0; j < NT; j++) {
#pragma unroll
        for (int r = 0; r < 4; r++) part[((warp * NT + j) * 4 + r) * 32 + lane] = acc[j][r];
    }
    __syncthreads();
    if (warp != 0) return;
#pragma unroll
    for (int j = 0; j < NT; j++) {
#pragma unroll
        for (int r = 0; r < 4; r++) {
            float v = part[(j * 4 + r) * 32 + lane];
            for (int o = 1; o < FP8_MMA_WARPS; o++) v += part[((o * NT + j) * 4 + r) * 32 + lane];
            // c0, c1: row g, columns 2t, 2t + 1; c2, c3: row g + 8.
            const int row = n0 + g + (r >> 1) * 8;
            const int m = j * 8 + 2 * t + (r & 1);
            if (row < n && m < rows) {
                float sc = (BLOCK ? 1.0f : ws[row]) * E4M3_MMA_UNIT;
                float b = bias != nullptr ? bias[row] : 0.0f;
                y[(long long)m * ldy + col0 + row] = fmaf(v, sc, b);
            }
        }
    }
}

#define FP8_MMA_KERNEL(KIND, BLOCK, NT)                                                         \
    extern "C" __global__ void __launch_bounds__(FP8_MMA_THREADS) fp8_mma_##KIND##_n##NT(       \
        const bf16* __restrict__ x, const unsigned char* __restrict__ w,                        \
        const float* __restrict__ ws, int ws_stride, const float* __restrict__ bias,            \
        float* __restrict__ y, int ldy, int col0, int rows, int n, int k) {                     \
        __shared__ float part[FP8_MMA_WARPS * NT * 4 * 32];                                     \
        fp8_mma<NT, BLOCK>(x, w, ws, ws_stride, bias, y, ldy, col0, rows, n, k, part);         \
    }
#if FP8_MMA_THREADS != FP8_MMA_WARPS * 32
#error "fp8_mma_* blocks are FP8_MMA_WARPS warps"
#endif
FP8_MMA_KERNEL(block, true, 1)
FP8_MMA_KERNEL(block, true, 2)
FP8_MMA_KERNEL(channel, false, 1)
FP8_MMA_KERNEL(channel, false, 2)

// x as e4m3, rounded to nearest even and saturated to +-448 (NaN stays NaN), as PyTorch's
// clamp-then-cast quantizers and the host's f32_to_e4m3 do. sm_89 and later convert in one
// instruction; older GPUs never run an FP8 model (load.rs refuses them) but compile this too.
__device__ __forceinline__ unsigned int f32_to_e4m3(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    unsigned short h;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(h) : "f"(0.0f), "f"(x));
    return h & 0xffu;
#else
    unsigned int u = __float_as_uint(x);
    unsigned int sign = (u >> 24) & 0x80u;
    float a = fabsf(x);
    if (a != a) return 0x7fu;
    if (a >= E4M3_MAX) return sign | 0x7eu;
    if (a < 0.015625f) {  // below 2^-6: subnormal, steps of 2^-9 (8 rounds up to 2^-6)
        return sign | (unsigned int)__float2int_rn(a * 512.0f);
    }
    int e = (int)((u >> 23) & 0xffu) - 127;
    unsigned int m = (u >> 20) & 7u;
    unsigned int rest = u & 0xfffffu;
    if (rest > 0x80000u || (rest == 0x80000u && (m & 1u))) m++;
    if (m == 8u) {
        m = 0u;
        e++;
    }
    return sign | ((unsigned int)(e + 7) << 3) | m;
#endif
}

// The largest of v over the block (blockDim.x a multiple of 32); every thread gets it.
__device__ float block_max(float v) {
    __shared__ float scratch_max[32];
    int lane = threadIdx.x & 31;
    int warp = threadIdx.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch_max[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float m = lane < (int)(blockDim.x >> 5) ? scratch_max[lane] : 0.0f;
        m = warp_max(m);
        if (lane == 0) scratch_max[0] = m;
    }
    __syncthreads();
    return scratch_max[0];
}

// q[r, c] = e4m3(x[r, c] / s) with s = amax / 448 over the values s covers: with group (128),
// the row's 128-column group c / 128, s stored at scales[(c / 128) * ld + r] (cuBLASLt's
// VEC128_32F layout for the activations: each group's scales for every row together, ld at
// least the grid's rows: the GEMM's token count, padded to a multiple of 4); with
// group 0, the whole row, s at scales[r] (OUTER_VEC_32F). A group of zeros gets s = 0 and
// zeros, never 0 / 0. With `fixed` (a layer's calibrated `input_scale`, group 0), s is
// *fixed for every row and values past 448 s saturate, as the checkpoint's static scheme
// means. Grid (rows); k a multiple of 4 (the host checks 16).
// Four bf16 values (v) as e4m3 bytes of value / s, packed low byte first; zeros when s is 0
// (a group or row of zeros), never 0 / 0.
__device__ __forceinline__ unsigned int e4m3x4(uint2 v, float s) {
    float f[4] = {__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xffff0000u),
                  __uint_as_float(v.y << 16), __uint_as_float(v.y & 0xffff0000u)};
    unsigned int packed = 0u;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        unsigned int b = s > 0.0f ? f32_to_e4m3(__fdiv_rn(f[j], s)) : 0u;
        packed |= b << (8 * j);
    }
    return packed;
}

// The largest magnitude of four bf16 values.
__device__ __forceinline__ float bf16x4_amax(uint2 v) {
    return fmaxf(fmaxf(fabsf(__uint_as_float(v.x << 16)), fabsf(__uint_as_float(v.x & 0xffff0000u))),
                 fmaxf(fabsf(__uint_as_float(v.y << 16)), fabsf(__uint_as_float(v.y & 0xffff0000u))));
}

extern "C" __global__ void __launch_bounds__(FP8_QUANT_THREADS)
    fp8_quant_rows(const bf16* __restrict__ x, unsigned char* __restrict__ q,
                   float* __restrict__ scales, int ld, int k, int group,
                   const float* __restrict__ fixed) {
    pdl_start();
    const int r = blockIdx.x;
    const uint2* x4 = reinterpret_cast<const uint2*>(x + (long long)r * k);
    unsigned int* q4 = reinterpret_cast<unsigned int*>(q + (long long)r * k);
    const int k4 = k >> 2;
    if (group != 0 && fixed == nullptr) {
        // One warp a group: 32 lanes of 4 columns are 128.
        const int warps = FP8_QUANT_THREADS / 32;
        const int lane = threadIdx.x & 31;
        const int groups = (k + 127) >> 7;
        for (int g = threadIdx.x >> 5; g < groups; g += warps) {
            int i = g * 32 + lane;
            uint2 v = i < k4 ? x4[i] : make_uint2(0u, 0u);
            float s = __fdiv_rn(warp_max(bf16x4_amax(v)), E4M3_MAX);
            if (i < k4) q4[i] = e4m3x4(v, s);
            if (lane == 0) scales[(long long)g * ld + r] = s;
        }
        return;
    }
    float s;
    if (fixed != nullptr) {
        s = *fixed;
    } else {
        float amax = 0.0f;
        for (int i = threadIdx.x; i < k4; i += FP8_QUANT_THREADS) amax = fmaxf(amax, bf16x4_amax(x4[i]));
        s = __fdiv_rn(block_max(amax), E4M3_MAX);
    }
    for (int i = threadIdx.x; i < k4; i += FP8_QUANT_THREADS) q4[i] = e4m3x4(x4[i], s);
    if (threadIdx.x == 0) scales[r] = s;
}

// y[r, col0 + c] = d[r, c] (bf16, rows cols apart) + bias[c] (when not null), y's rows ldy
// apart; with d null, y[r, col0 + c] += bias[c] (a bf16 part's bias, after cuBLAS wrote its
// columns). Each thread takes 8 columns: one 16-byte load of d and two of the bias, two
// 16-byte stores, where cols, ldy and col0 are multiples of 8 (every real model's); one
// column at a time otherwise. Element loads and stores took 24% of an H200's FP8 prefill of
// 512 tokens (Qwen3-8B), 1.2 TB/s. Grid (rows, ceil(cols / (8 * FP8_OUT_THREADS))).
extern "C" __global__ void __launch_bounds__(FP8_OUT_THREADS)
    fp8_out_cols(const bf16* __restrict__ d, const float* __restrict__ bias,
                 float* __restrict__ y, int cols, int ldy, int col0) {
    pdl_start();
    const int r = blockIdx.x;
    const int c8 = (blockIdx.y * FP8_OUT_THREADS + threadIdx.x) * 8;
    if (c8 >= cols) return;
    float* out = y + (long long)r * ldy + col0 + c8;
    if (((cols | ldy | col0) & 7) == 0) {
        float v[8];
        if (d != nullptr) {
            uint4 h = *reinterpret_cast<const uint4*>(d + (long long)r * cols + c8);
            unsigned int hs[4] = {h.x, h.y, h.z, h.w};
#pragma unroll
            for (int j = 0; j < 4; j++) {
                v[2 * j] = __uint_as_float(hs[j] << 16);
                v[2 * j + 1] = __uint_as_float(hs[j] & 0xffff0000u);
            }
        } else {
            float4 a = *reinterpret_cast<const float4*>(out);
            float4 b = *reinterpret_cast<const float4*>(out + 4);
            v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
            v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
        }
        if (bias != nullptr) {
            float4 a = *reinterpret_cast<const float4*>(bias + c8);
            float4 b = *reinterpret_cast<const float4*>(bias + c8 + 4);
            v[0] += a.x, v[1] += a.y, v[2] += a.z, v[3] += a.w;
            v[4] += b.x, v[5] += b.y, v[6] += b.z, v[7] += b.w;
        }
        *reinterpret_cast<float4*>(out) = make_float4(v[0], v[1], v[2], v[3]);
        *reinterpret_cast<float4*>(out + 4) = make_float4(v[4], v[5], v[6], v[7]);
        return;
    }
    for (int e = 0; e < 8 && c8 + e < cols; e++) {
        int c = c8 + e;
        float v = d != nullptr ? bf2f(d[(long long)r * cols + c]) : out[e];
        if (bias != nullptr) v += bias[c];
        out[e] = v;
    }
}
