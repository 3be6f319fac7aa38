// Gated DeltaNet (Qwen3.5's linear-attention layers): the causal convolution and the gated
// delta rule with the gated norm after it. The CPU reference is delta::mix
// (gpu/src/backend/cpu/delta.rs); the layouts are the CPU's, so a state moves between the
// backends unchanged.
// Part of the kernels' one source: common.cuh, then layers.cu, attention_decode.cu,
// attention_prefill.cu, sampling.cu and delta.cu, joined in that order (kernels.rs).
//
// Layouts (T tokens in the step, S sequences):
//   proj      f32 [T, row]  the stacked input projections: q/k/v (cd), z (vd), b (nv), a (nv)
//   mixed     f32 [T, cd]   q/k/v after the convolution and SiLU: q (kd), k (kd), v (vd)
//   states    f32           slot s, linear layer l at s * slot_stride + l * layer_stride:
//                           the window [kw - 1, cd] (oldest first), then the delta state
//                           [nv, dk, dv]
//   seqs      i32 [S, 4]    first row in the step, rows, state slot, fresh (1: the
//                           sequence's first tokens, which start from zeros)

#if !defined(CONV_THREADS) || !defined(MAX_CONV_KERNEL) || !defined(DELTA_THREADS) || \
    !defined(MAX_DELTA_DK)
#error "the delta-rule kernels are compiled with the launch figures of shapes.rs"
#endif
#if DELTA_THREADS != 2 * MAX_DELTA_DK
#error "gated_delta_rule holds each state column in a pair of threads"
#endif

#define CONV_HIST (MAX_CONV_KERNEL - 1)
#define DELTA_L2_EPS 1e-6f

// Channel ch's convolution and SiLU over tokens [t0, t1) of the sequence whose first row is
// `first`: hist holds the inputs before t0 (newest last), taps their weights, wlast the
// current input's; hist is left holding the inputs before t1.
__device__ __forceinline__ void conv_tokens(const float* __restrict__ proj, int row,
                                            float* __restrict__ mixed, int cd, int ch, int first,
                                            int t0, int t1, const float* taps, float wlast,
                                            float* hist) {
    for (int t = t0; t < t1; ++t) {
        long long r = (long long)(first + t);
        float x = proj[r * row + ch];
        float acc = wlast * x;
#pragma unroll
        for (int j = 0; j < CONV_HIST; ++j) acc += taps[j] * hist[j];
        mixed[r * cd + ch] = acc / (1.0f + expf(-acc));
#pragma unroll
        for (int j = 0; j + 1 < CONV_HIST; ++j) hist[j] = hist[j + 1];
        hist[CONV_HIST - 1] = x;
    }
}

// The depthwise causal convolution and SiLU for each sequence of the step, continuing the
// window its slot keeps (zeros for fresh sequences), and the window left for the next step.
// One thread a channel walks its sequence's tokens in order, the last inputs in registers,
// right-aligned so every index is fixed at compile time.
// Grid (ceil(cd / CONV_THREADS), S).
extern "C" __global__ void __launch_bounds__(CONV_THREADS)
delta_conv_silu(const float* __restrict__ proj, int row,
                const float* __restrict__ w, int kw,
                float* __restrict__ states, long long slot_stride, long long layer_off,
                const int* __restrict__ seqs,
                float* __restrict__ mixed, int cd) {
    int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= cd) return;
    const int* sq = seqs + 4 * blockIdx.y;
    int first = sq[0], n = sq[1], slot = sq[2], fresh = sq[3];
    float* win = states + (long long)slot * slot_stride + layer_off;
    // hist[CONV_HIST - 1] is the newest input; taps[j] meets hist[j], wlast the current one.
    int lead = CONV_HIST - (kw - 1);
    float hist[CONV_HIST];
    float taps[CONV_HIST];
#pragma unroll
    for (int j = 0; j < CONV_HIST; ++j) {
        bool used = j >= lead;
        taps[j] = used ? w[(long long)ch * kw + (j - lead)] : 0.0f;
        hist[j] = (used && !fresh) ? win[(long long)(j - lead) * cd + ch] : 0.0f;
    }
    float wlast = w[(long long)ch * kw + kw - 1];
    conv_tokens(proj, row, mixed, cd, ch, first, 0, n, taps, wlast, hist);
#pragma unroll
    for (int j = 0; j < CONV_HIST; ++j) {
        if (j >= lead) win[(long long)(j - lead) * cd + ch] = hist[j];
    }
}

// The gated delta rule for one value head of one sequence over its tokens of the step, then
// the gated norm, written as bf16 for the output projection. Column j of the head's dk x dv
// state is held by a pair of adjacent threads, rows [0, dk/2) and [dk/2, dk), in registers
// for the whole step (a whole column a thread spills). Per token each reads q and k
// (L2-normalised here, q scaled by 1/sqrt(dk)) from shared memory and
//   delta_j = beta (v_j - e^g sum_i S_ij k_i);  S_ij = e^g S_ij + k_i delta_j;
//   o_j = sum_i S_ij q_i;  out_j = o_j / rms(o) * w_j * silu(z_j),
// the pair adding their halves of each sum with one shuffle. Tokens run one after another
// (a prompt too: the recurrence, not the chunked form).
// Grid (nv, S), block DELTA_THREADS = 2 * MAX_DELTA_DK.
#define DELTA_ROWS (MAX_DELTA_DK / 2)
extern "C" __global__ void __launch_bounds__(DELTA_THREADS)
gated_delta_rule(const float* __restrict__ mixed, int cd,
                 const float* __restrict__ proj, int row,
                 const float* __restrict__ neg_a, const float* __restrict__ dt_bias,
                 const float* __restrict__ norm_w,
                 float* __restrict__ states, long long slot_stride, long long layer_off,
                 const int* __restrict__ seqs,
                 bf16* __restrict__ out,
                 int nk, int nv, int dk, int dv, float eps) {
    __shared__ float qs[MAX_DELTA_DK];
    __shared__ float ks[MAX_DELTA_DK];
    int hv = blockIdx.x;
    const int* sq = seqs + 4 * blockIdx.y;
    int first = sq[0], n = sq[1], slot = sq[2], fresh = sq[3];
    int tid = threadIdx.x;
    int j = tid >> 1;
    int i0 = (tid & 1) * DELTA_ROWS;
    int kd = nk * dk, vd = nv * dv;
    int kh = hv / (nv / nk);
    float scale = 1.0f / sqrtf((float)dk);
    float* st = states + (long long)slot * slot_stride + layer_off + (long long)hv * dk * dv;
    bool col = j < dv;
    float s[DELTA_ROWS];
#pragma unroll
    for (int ii = 0; ii < DELTA_ROWS; ++ii) {
        int i = i0 + ii;
        s[ii] = (col && i < dk && !fresh) ? st[(long long)i * dv + j] : 0.0f;
    }
    float a_neg = neg_a[hv], bias = dt_bias[hv];
    float wj = col ? norm_w[j] : 0.0f;
    for (int t = 0; t < n; ++t) {
        long long r = (long long)(first + t);
        const float* m = mixed + r * cd;
        const float* p = proj + r * row;
        float qv = tid < dk ? m[kh * dk + tid] : 0.0f;
        float kv = tid < dk ? m[kd + kh * dk + tid] : 0.0f;
        float sq2 = block_sum(qv * qv);
        float sk2 = block_sum(kv * kv);
        if (tid < dk) {
            qs[tid] = qv * (scale / sqrtf(sq2 + DELTA_L2_EPS));
            ks[tid] = kv * (1.0f / sqrtf(sk2 + DELTA_L2_EPS));
        }
        __syncthreads();
        float beta = 1.0f / (1.0f + expf(-p[cd + vd + hv]));
        float x = p[cd + vd + nv + hv] + bias;
        float sp = x > 20.0f ? x : log1pf(expf(x));
        float decay = expf(a_neg * sp);
        float mem = 0.0f;
#pragma unroll
        for (int ii = 0; ii < DELTA_ROWS; ++ii) {
            if (i0 + ii < dk) mem += s[ii] * ks[i0 + ii];
        }
        mem += __shfl_xor_sync(0xffffffffu, mem, 1);
        float v = col ? m[2 * kd + hv * dv + j] : 0.0f;
        float delta = beta * (v - decay * mem);
        float o = 0.0f;
#pragma unroll
        for (int ii = 0; ii < DELTA_ROWS; ++ii) {
            if (i0 + ii < dk) {
                s[ii] = decay * s[ii] + ks[i0 + ii] * delta;
                o += s[ii] * qs[i0 + ii];
            }
        }
        o += __shfl_xor_sync(0xffffffffu, o, 1);
        bool writer = col && (tid & 1) == 0;
        float so2 = block_sum(writer ? o * o : 0.0f);
        if (writer) {
            float inv = 1.0f / sqrtf(so2 / (float)dv + eps);
            float z = p[cd + hv * dv + j];
            out[r * vd + hv * dv + j] = f2bf(o * inv * wj * (z / (1.0f + expf(-z))));
        }
        // qs and ks are rewritten by the next token only after block_sum's barriers.
    }
    if (col) {
#pragma unroll
        for (int ii = 0; ii < DELTA_ROWS; ++ii) {
            int i = i0 + ii;
            if (i < dk) st[(long long)i * dv + j] = s[ii];
        }
    }
}

// ---- The scan path for steps with prompts (CudaOptions::gdn_scan) ----
//
// gated_delta_rule walks a prompt one token at a time in one block per value head: each
// token waits on two block-wide sums and a global load, so a long prompt runs at a few µs a
// token on a few dozen SMs. The scan path splits that work so the serial part is short:
//   delta_conv_chunks   the convolution, a thread per channel and DCONV_TOKENS tokens;
//   delta_conv_window   the windows left for the next step (after every chunk read them);
//   delta_qk_gates      q and k L2-normalised in place (q scaled), beta and the decay
//                       written over b and a in proj;
//   delta_scan          the recurrence, each value column's state split over 4 threads and
//                       the block's columns spread over blocks, tokens staged in shared
//                       memory SCAN_TOK at a time; the raw output o written over v in mixed
//                       (each v is read by the one block that writes its o, before);
//   delta_gated_norm    o / rms(o) * w * silu(z), as bf16.
// The same rule in the same order per column; only the sums' association differs.

#if !defined(DCONV_THREADS) || !defined(DCONV_TOKENS) || !defined(QK_THREADS) || \
    !defined(SCAN_COLS) || !defined(SCAN_TOK) || !defined(SCAN_THREADS) || !defined(GNORM_THREADS)
#error "the scan-path kernels are compiled with the launch figures of shapes.rs"
#endif
#if SCAN_THREADS != 4 * SCAN_COLS || MAX_DELTA_DK % 4 != 0
#error "delta_scan holds each state column in 4 threads"
#endif

// The input of channel ch at index i of its sequence (negative: before this step, from the
// window its slot keeps, or zero for a fresh sequence).
__device__ __forceinline__ float conv_input(const float* proj, int row, const float* win,
                                            int cd, int kw, int first, int fresh, int ch,
                                            int i) {
    if (i >= 0) return proj[(long long)(first + i) * row + ch];
    int w = i + kw - 1;  // the window's index, oldest first
    return (fresh || w < 0) ? 0.0f : win[(long long)w * cd + ch];
}

// Grid (ceil(cd / DCONV_THREADS), ceil(max tokens / DCONV_TOKENS), S).
extern "C" __global__ void __launch_bounds__(DCONV_THREADS)
delta_conv_chunks(const float* __restrict__ proj, int row,
                  const float* __restrict__ w, int kw,
                  const float* __restrict__ states, long long slot_stride, long long layer_off,
                  const int* __restrict__ seqs,
                  float* __restrict__ mixed, int cd) {
    int ch = blockIdx.x * blockDim.x + threadIdx.x;
    const int* sq = seqs + 4 * blockIdx.z;
    int first = sq[0], n = sq[1], slot = sq[2], fresh = sq[3];
    int t0 = blockIdx.y * DCONV_TOKENS;
    if (ch >= cd || t0 >= n) return;
    const float* win = states + (long long)slot * slot_stride + layer_off;
    int lead = CONV_HIST - (kw - 1);
    float hist[CONV_HIST];
    float taps[CONV_HIST];
#pragma unroll
    for (int j = 0; j < CONV_HIST; ++j) {
        bool used = j >= lead;
        taps[j] = used ? w[(long long)ch * kw + (j - lead)] : 0.0f;
        hist[j] = used ? conv_input(proj, row, win, cd, kw, first, fresh, ch,
                                    t0 - (kw - 1) + (j - lead))
                       : 0.0f;
    }
    float wlast = w[(long long)ch * kw + kw - 1];
    conv_tokens(proj, row, mixed, cd, ch, first, t0, min(n, t0 + DCONV_TOKENS), taps, wlast, hist);
}

// The window after the step: the last kw - 1 inputs of each channel, read before any is
// written. Grid (ceil(cd / DCONV_THREADS), S); after delta_conv_chunks, which reads the old one.
extern "C" __global__ void __launch_bounds__(DCONV_THREADS)
delta_conv_window(const float* __restrict__ proj, int row, int kw,
                  float* __restrict__ states, long long slot_stride, long long layer_off,
                  const int* __restrict__ seqs, int cd) {
    int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= cd) return;
    const int* sq = seqs + 4 * blockIdx.y;
    int first = sq[0], n = sq[1], slot = sq[2], fresh = sq[3];
    float* win = states + (long long)slot * slot_stride + layer_off;
    float next[CONV_HIST];
#pragma unroll
    for (int j = 0; j < CONV_HIST; ++j) {
        next[j] = j < kw - 1 ? conv_input(proj, row, win, cd, kw, first, fresh, ch,
                                          n - (kw - 1) + j)
                             : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < CONV_HIST; ++j) {
        if (j < kw - 1) win[(long long)j * cd + ch] = next[j];
    }
}

// A head vector of d <= MAX_DELTA_DK values spread over a warp (lane + 32 u into v[u], zeros
// past d): returns its sum of squares, the whole warp's.
__device__ __forceinline__ float warp_head(const float* x, int d, int lane, float* v) {
    float ss = 0.0f;
#pragma unroll
    for (int u = 0; u < MAX_DELTA_DK / 32; ++u) {
        int i = lane + 32 * u;
        v[u] = i < d ? x[i] : 0.0f;
        ss += v[u] * v[u];
    }
    return warp_sum(ss);
}

// Per token row: q and k of each key head L2-normalised in place in mixed (q also scaled by
// 1/sqrt(dk)), a warp a vector; beta = sigmoid(b) and decay = exp(-A softplus(a + dt_bias))
// of each value head written over b and a in proj (with log_gate, the log-decay g =
// -A softplus(a + dt_bias) itself, which the chunked form sums). Grid (T).
extern "C" __global__ void __launch_bounds__(QK_THREADS)
delta_qk_gates(float* __restrict__ mixed, int cd, float* __restrict__ proj, int row,
               const float* __restrict__ neg_a, const float* __restrict__ dt_bias,
               int nk, int nv, int dk, int dv, int log_gate) {
    long long r = blockIdx.x;
    float* m = mixed + r * cd;
    float* p = proj + r * row;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float scale = 1.0f / sqrtf((float)dk);
    for (int vec = warp; vec < 2 * nk; vec += QK_THREADS / 32) {
        // vec < nk: q of key head vec; else k of key head vec - nk.
        float* x = m + (long long)vec * dk;
        float v[MAX_DELTA_DK / 32];
        float ss = warp_head(x, dk, lane, v);
        float f = (vec < nk ? scale : 1.0f) / sqrtf(ss + DELTA_L2_EPS);
#pragma unroll
        for (int u = 0; u < MAX_DELTA_DK / 32; ++u) {
            int i = lane + 32 * u;
            if (i < dk) x[i] = v[u] * f;
        }
    }
    int vd = nv * dv;
    for (int hv = threadIdx.x; hv < nv; hv += QK_THREADS) {
        float b = p[cd + vd + hv];
        float x = p[cd + vd + nv + hv] + dt_bias[hv];
        float sp = x > 20.0f ? x : log1pf(expf(x));
        p[cd + vd + hv] = 1.0f / (1.0f + expf(-b));
        float g = neg_a[hv] * sp;
        p[cd + vd + nv + hv] = log_gate ? g : expf(g);
    }
}

// A value column's state in registers, rows i = STEP ii + part (ii < ROWS) of column j of
// one value head's state st (dk x dv): read (zeros for a fresh sequence, and for a column or
// rows past the head), and written back.
template <int ROWS, int STEP>
__device__ __forceinline__ void state_col_load(const float* st, int dk, int dv, int j, int part,
                                               bool col, int fresh, float* s) {
#pragma unroll
    for (int ii = 0; ii < ROWS; ++ii) {
        int i = STEP * ii + part;
        s[ii] = (col && i < dk && !fresh) ? st[(long long)i * dv + j] : 0.0f;
    }
}
template <int ROWS, int STEP>
__device__ __forceinline__ void state_col_store(float* st, int dk, int dv, int j, int part,
                                                bool col, const float* s) {
    if (!col) return;
#pragma unroll
    for (int ii = 0; ii < ROWS; ++ii) {
        int i = STEP * ii + part;
        if (i < dk) st[(long long)i * dv + j] = s[ii];
    }
}

// The recurrence of one value head's SCAN_COLS columns for one sequence. Thread tid holds
// column tid / 4's rows i = 4 * ii + tid % 4 (ii < MAX_DELTA_DK / 4) in registers; per token
//   mem_j = sum_i S_ij k_i;  delta_j = beta (v_j - decay mem_j);
//   S_ij = decay S_ij + k_i delta_j;  o_j = sum_i S_ij q_i,
// each sum over the column's 4 threads by two shuffles. Grid (nv, ceil(dv / SCAN_COLS), S).
#define SCAN_ROWS (MAX_DELTA_DK / 4)
extern "C" __global__ void __launch_bounds__(SCAN_THREADS)
delta_scan(float* __restrict__ mixed, int cd, const float* __restrict__ proj, int row,
           float* __restrict__ states, long long slot_stride, long long layer_off,
           const int* __restrict__ seqs, int nk, int nv, int dk, int dv) {
    __shared__ float ks[SCAN_TOK][MAX_DELTA_DK];
    __shared__ float qs[SCAN_TOK][MAX_DELTA_DK];
    __shared__ float vs[SCAN_TOK][SCAN_COLS];
    __shared__ float gs[2][SCAN_TOK];
    int hv = blockIdx.x;
    int j0 = blockIdx.y * SCAN_COLS;
    const int* sq = seqs + 4 * blockIdx.z;
    int first = sq[0], n = sq[1], slot = sq[2], fresh = sq[3];
    int tid = threadIdx.x;
    int c = tid >> 2, part = tid & 3;
    int j = j0 + c;
    bool col = j < dv;
    int kd = nk * dk, vd = nv * dv;
    int kh = hv / (nv / nk);
    float* st = states + (long long)slot * slot_stride + layer_off + (long long)hv * dk * dv;
    // Rows past dk stay zero in shared memory and in the state, so no sum needs a guard.
    for (int i = tid; i < SCAN_TOK * MAX_DELTA_DK; i += SCAN_THREADS) {
        if (i % MAX_DELTA_DK >= dk) {
            ks[i / MAX_DELTA_DK][i % MAX_DELTA_DK] = 0.0f;
            qs[i / MAX_DELTA_DK][i % MAX_DELTA_DK] = 0.0f;
        }
    }
    float s[SCAN_ROWS];
    state_col_load<SCAN_ROWS, 4>(st, dk, dv, j, part, col, fresh, s);
    for (int t0 = 0; t0 < n; t0 += SCAN_TOK) {
        int nt = min(SCAN_TOK, n - t0);
        __syncthreads();  // the previous chunk's reads are done
        for (int i = tid; i < nt * dk; i += SCAN_THREADS) {
            int t = i / dk, e = i - t * dk;
            const float* m = mixed + (long long)(first + t0 + t) * cd;
            ks[t][e] = m[kd + kh * dk + e];
            qs[t][e] = m[kh * dk + e];
        }
        for (int i = tid; i < nt * SCAN_COLS; i += SCAN_THREADS) {
            int t = i / SCAN_COLS, cc = i - t * SCAN_COLS;
            vs[t][cc] = j0 + cc < dv
                            ? mixed[(long long)(first + t0 + t) * cd + 2 * kd + hv * dv + j0 + cc]
                            : 0.0f;
        }
        for (int t = tid; t < nt; t += SCAN_THREADS) {
            const float* p = proj + (long long)(first + t0 + t) * row;
            gs[0][t] = p[cd + vd + hv];
            gs[1][t] = p[cd + vd + nv + hv];
        }
        __syncthreads();
        for (int t = 0; t < nt; ++t) {
            float beta = gs[0][t], decay = gs[1][t];
            // Four partial sums each (the rows ii + u), for four chains of FMAs at once.
            float m4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int ii = 0; ii < SCAN_ROWS; ii += 4) {
#pragma unroll
                for (int u = 0; u < 4; ++u) m4[u] += s[ii + u] * ks[t][4 * (ii + u) + part];
            }
            float mem = (m4[0] + m4[1]) + (m4[2] + m4[3]);
            mem += __shfl_xor_sync(0xffffffffu, mem, 1);
            mem += __shfl_xor_sync(0xffffffffu, mem, 2);
            float delta = beta * (vs[t][c] - decay * mem);
            float o4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int ii = 0; ii < SCAN_ROWS; ii += 4) {
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    int i = 4 * (ii + u) + part;
                    s[ii + u] = decay * s[ii + u] + ks[t][i] * delta;
                    o4[u] += s[ii + u] * qs[t][i];
                }
            }
            float o = (o4[0] + o4[1]) + (o4[2] + o4[3]);
            o += __shfl_xor_sync(0xffffffffu, o, 1);
            o += __shfl_xor_sync(0xffffffffu, o, 2);
            if (col && part == 0) {
                mixed[(long long)(first + t0 + t) * cd + 2 * kd + hv * dv + j] = o;
            }
        }
    }
    state_col_store<SCAN_ROWS, 4>(st, dk, dv, j, part, col, s);
}

// out[r, hv * dv + j] = o_j / rms(o) * w_j * silu(z_j) for the raw o delta_scan left over v
// in mixed, a warp a value head. Grid (T).
extern "C" __global__ void __launch_bounds__(GNORM_THREADS)
delta_gated_norm(const float* __restrict__ mixed, int cd, const float* __restrict__ proj,
                 int row, const float* __restrict__ norm_w, bf16* __restrict__ out,
                 int nk, int nv, int dk, int dv, float eps) {
    long long r = blockIdx.x;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int kd = nk * dk, vd = nv * dv;
    for (int hv = warp; hv < nv; hv += GNORM_THREADS / 32) {
        const float* o = mixed + r * cd + 2 * kd + hv * dv;
        float v[MAX_DELTA_DK / 32];
        float ss = warp_head(o, dv, lane, v);
        float inv = 1.0f / sqrtf(ss / (float)dv + eps);
#pragma unroll
        for (int u = 0; u < MAX_DELTA_DK / 32; ++u) {
            int j = lane + 32 * u;
            if (j < dv) {
                float z = proj[r * row + cd + hv * dv + j];
                out[r * vd + hv * dv + j] = f2bf(v[u] * inv * norm_w[j] * (z / (1.0f + expf(-z))));
            }
        }
    }
}

// ---- The chunked form for steps with prompts (CudaOptions::gdn_chunked) ----
//
// The scan path with delta_scan's token-by-token recurrence replaced by the chunk-wise form
// the CPU runs (cpu/delta.rs, `chunked`): chunks of CH_L tokens of a sequence, G_t the
// log-decay summed from the chunk's start (inclusive), S the state before the chunk, with
//   A_ts = beta_t e^(G_t - G_s) k_t.k_s  (s < t),   P_ts = e^(G_t - G_s) q_t.k_s  (s <= t),
//   T = (I + A)^-1,   delta = T (beta (v - e^G S^T k)),   o = e^G S^T q + P delta,
//   S' = e^(G_last) S + sum_s e^(G_last - G_s) k_s delta_s^T.
// Two launches between delta_qk_gates (with log_gate) and delta_gated_norm:
//   delta_chunk_prep   every (value head, chunk) at once: A, P and T = (I + A)^-1, which
//                      depend on no state, into mats [T, 2 CH_L nv]: the chunk's row t holds
//                      head hv's T_t. at columns hv 2 CH_L .. and P_t. after them (rows past
//                      the sequence's end are neither written nor read);
//   delta_chunk_scan   the chunks of each sequence in order, SCAN_COLS value columns a block
//                      with each column's state over 8 threads: S^T k and S^T q for the
//                      chunk's tokens, then delta, the outputs and the next state as small
//                      matrix products in shared memory; the raw o written over v in mixed,
//                      as delta_scan leaves it.
// Only these two launches' serial part walks the chunks, not the tokens.

#if !defined(CH_L) || !defined(CHUNK_THREADS)
#error "the chunked form's kernels are compiled with the launch figures of shapes.rs"
#endif
#if CH_L != 32 || CHUNK_THREADS != 8 * SCAN_COLS || CHUNK_THREADS != 256 || MAX_DELTA_DK % 8 != 0
#error "the chunked kernels take chunks of a warp's width, 8 threads a state column"
#endif

// The inclusive sum of gs[0..CH_L) into gs, by warp 0 (every thread calls it; it syncs).
__device__ __forceinline__ void chunk_cumsum(float* gs) {
    __syncthreads();
    if (threadIdx.x < 32) {
        float v = gs[threadIdx.x];
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            float u = __shfl_up_sync(0xffffffffu, v, o);
            if ((int)threadIdx.x >= o) v += u;
        }
        gs[threadIdx.x] = v;
    }
    __syncthreads();
}

// q and k rows [t0, t0 + CH_L) of key head kh of the sequence at `first` (zeros past nt and
// past dk), its gates beta and g for value head hv (zeros past nt: padding that adds
// nothing), staged in shared memory. The caller syncs before (the last reads are done).
__device__ __forceinline__ void chunk_stage(const float* mixed, int cd, const float* proj,
                                            int row, int first, int t0, int nt, int kh, int hv,
                                            int nk, int nv, int dk, int dv,
                                            float (*ks)[MAX_DELTA_DK + 1],
                                            float (*qs)[MAX_DELTA_DK + 1], float* bs,
                                            float* gs) {
    int kd = nk * dk, vd = nv * dv;
    for (int i = threadIdx.x; i < CH_L * MAX_DELTA_DK; i += blockDim.x) {
        int t = i / MAX_DELTA_DK, e = i - t * MAX_DELTA_DK;
        bool in = t < nt && e < dk;
        const float* m = mixed + (long long)(first + t0 + t) * cd;
        ks[t][e] = in ? m[kd + kh * dk + e] : 0.0f;
        qs[t][e] = in ? m[kh * dk + e] : 0.0f;
    }
    if (threadIdx.x < CH_L) {
        int t = threadIdx.x;
        const float* p = proj + (long long)(first + t0 + t) * row;
        bs[t] = t < nt ? p[cd + vd + hv] : 0.0f;
        gs[t] = t < nt ? p[cd + vd + nv + hv] : 0.0f;
    }
}

// Grid (nv, ceil(longest / CH_L), S).
extern "C" __global__ void __launch_bounds__(CHUNK_THREADS)
delta_chunk_prep(const float* __restrict__ mixed, int cd, const float* __restrict__ proj, int row,
                 float* __restrict__ mats, const int* __restrict__ seqs, int nk, int nv, int dk,
                 int dv) {
    __shared__ float ks[CH_L][MAX_DELTA_DK + 1];
    __shared__ float qs[CH_L][MAX_DELTA_DK + 1];
    __shared__ float as[CH_L][CH_L + 1];
    __shared__ float bs[CH_L];
    __shared__ float gs[CH_L];
    int hv = blockIdx.x;
    const int* sq = seqs + 4 * blockIdx.z;
    int first = sq[0], n = sq[1];
    int t0 = blockIdx.y * CH_L;
    if (t0 >= n) return;
    int nt = min(CH_L, n - t0);
    int kh = hv / (nv / nk);
    chunk_stage(mixed, cd, proj, row, first, t0, nt, kh, hv, nk, nv, dk, dv, ks, qs, bs, gs);
    chunk_cumsum(gs);
    // A (into shared memory) and P (into mats), four (t, s) pairs a thread.
    int t = threadIdx.x >> 3;
    long long mrow = 2LL * CH_L * nv;
    float* prow = mats + (long long)(first + t0 + t) * mrow + hv * 2 * CH_L;
#pragma unroll
    for (int m = 0; m < 4; m++) {
        int s = (threadIdx.x & 7) + 8 * m;
        float kk = 0.0f, qk = 0.0f;
        for (int i = 0; i < dk; i++) {
            float kv = ks[s][i];
            kk += ks[t][i] * kv;
            qk += qs[t][i] * kv;
        }
        float decay = s <= t ? expf(gs[t] - gs[s]) : 0.0f;
        as[t][s] = s < t ? bs[t] * decay * kk : 0.0f;
        if (t < nt) prow[CH_L + s] = decay * qk;
    }
    __syncthreads();
    // T = (I + A)^-1 by forward substitution, column j by thread j: x_j = 1, and below it
    // x_t = -sum_{s<t} A_ts x_s (A is strictly lower, so column j is zero above j).
    if (threadIdx.x < CH_L) {
        int j = threadIdx.x;
        float x[CH_L];
#pragma unroll
        for (int r = 0; r < CH_L; r++) {
            float acc = 0.0f;
#pragma unroll
            for (int s = 0; s < r; s++) acc += as[r][s] * x[s];
            x[r] = r == j ? 1.0f : (r < j ? 0.0f : -acc);
        }
#pragma unroll
        for (int r = 0; r < CH_L; r++) {
            if (r < nt) mats[(long long)(first + t0 + r) * mrow + hv * 2 * CH_L + j] = x[r];
        }
    }
}

// Grid (nv, ceil(dv / SCAN_COLS), S). Thread tid holds column tid / 8's state rows
// i = 8 ii + tid % 8 in registers.
#define CH_ROWS (MAX_DELTA_DK / 8)
extern "C" __global__ void __launch_bounds__(CHUNK_THREADS)
delta_chunk_scan(float* __restrict__ mixed, int cd, const float* __restrict__ proj, int row,
                 const float* __restrict__ mats, float* __restrict__ states,
                 long long slot_stride, long long layer_off, const int* __restrict__ seqs,
                 int nk, int nv, int dk, int dv) {
    __shared__ float ks[CH_L][MAX_DELTA_DK + 1];
    __shared__ float qs[CH_L][MAX_DELTA_DK + 1];
    __shared__ float tm[CH_L][CH_L + 1];
    __shared__ float pm[CH_L][CH_L + 1];
    __shared__ float rs[CH_L][SCAN_COLS + 1];
    __shared__ float bs[CH_L];
    __shared__ float gs[CH_L];
    int hv = blockIdx.x;
    int j0 = blockIdx.y * SCAN_COLS;
    const int* sq = seqs + 4 * blockIdx.z;
    int first = sq[0], n = sq[1], slot = sq[2], fresh = sq[3];
    int tid = threadIdx.x;
    int c = tid >> 3, part = tid & 7;
    int j = j0 + c;
    bool col = j < dv;
    int kd = nk * dk;
    int kh = hv / (nv / nk);
    float* st = states + (long long)slot * slot_stride + layer_off + (long long)hv * dk * dv;
    float s[CH_ROWS];
    state_col_load<CH_ROWS, 8>(st, dk, dv, j, part, col, fresh, s);
    for (int t0 = 0; t0 < n; t0 += CH_L) {
        int nt = min(CH_L, n - t0);
        __syncthreads();  // the previous chunk's reads are done
        chunk_stage(mixed, cd, proj, row, first, t0, nt, kh, hv, nk, nv, dk, dv, ks, qs, bs, gs);
        for (int i = tid; i < CH_L * CH_L; i += CHUNK_THREADS) {
            int t = i / CH_L, u = i - t * CH_L;
            const float* p = mats + (long long)(first + t0 + t) * (2LL * CH_L * nv) + hv * 2 * CH_L;
            tm[t][u] = t < nt ? p[u] : 0.0f;
            pm[t][u] = t < nt ? p[CH_L + u] : 0.0f;
        }
        chunk_cumsum(gs);
        // S^T k_t and S^T q_t for each token, summed over the column's 8 threads; the thread
        // with part t % 8 keeps e^G_t S^T q_t for the outputs and writes the right-hand side
        // beta_t (v_t - e^G_t S^T k_t).
        float qkeep[CH_L / 8];
#pragma unroll
        for (int t = 0; t < CH_L; t++) {
            float kp = 0.0f, qp = 0.0f;
#pragma unroll
            for (int ii = 0; ii < CH_ROWS; ++ii) {
                kp += ks[t][8 * ii + part] * s[ii];
                qp += qs[t][8 * ii + part] * s[ii];
            }
#pragma unroll
            for (int o = 1; o < 8; o <<= 1) {
                kp += __shfl_xor_sync(0xffffffffu, kp, o);
                qp += __shfl_xor_sync(0xffffffffu, qp, o);
            }
            if (part == (t & 7)) {
                float eg = expf(gs[t]);
                qkeep[t >> 3] = eg * qp;
                float v = (col && t < nt)
                              ? mixed[(long long)(first + t0 + t) * cd + 2 * kd + hv * dv + j]
                              : 0.0f;
                rs[t][c] = bs[t] * (v - eg * kp);
            }
        }
        __syncthreads();
        // delta = T r, rows t = part + 8 m of column c.
        float d[CH_L / 8];
#pragma unroll
        for (int m = 0; m < CH_L / 8; m++) {
            int t = part + 8 * m;
            float acc = 0.0f;
#pragma unroll
            for (int u = 0; u < CH_L; u++) acc += tm[t][u] * rs[u][c];
            d[m] = acc;
        }
        __syncthreads();
#pragma unroll
        for (int m = 0; m < CH_L / 8; m++) rs[part + 8 * m][c] = d[m];
        __syncthreads();
        // o = e^G S^T q + P delta, written over v.
#pragma unroll
        for (int m = 0; m < CH_L / 8; m++) {
            int t = part + 8 * m;
            float acc = qkeep[m];
#pragma unroll
            for (int u = 0; u < CH_L; u++) acc += pm[t][u] * rs[u][c];
            if (col && t < nt) {
                mixed[(long long)(first + t0 + t) * cd + 2 * kd + hv * dv + j] = acc;
            }
        }
        // S' = e^G_last S + sum_t e^(G_last - G_t) k_t delta_t (padding: delta 0).
        float glast = gs[CH_L - 1];
        float el = expf(glast);
#pragma unroll
        for (int ii = 0; ii < CH_ROWS; ++ii) s[ii] *= el;
        for (int t = 0; t < CH_L; t++) {
            float w = expf(glast - gs[t]) * rs[t][c];
#pragma unroll
            for (int ii = 0; ii < CH_ROWS; ++ii) s[ii] += w * ks[t][8 * ii + part];
        }
    }
    state_col_store<CH_ROWS, 8>(st, dk, dv, j, part, col, s);
}
