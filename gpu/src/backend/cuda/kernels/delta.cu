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
    for (int t = 0; t < n; ++t) {
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
