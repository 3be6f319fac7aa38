// Qwen3.5's gated full attention, the parts the dense layers do not have.
// Part of the kernels' one source (kernels.rs, KERNELS_CU).

// Per (token, head) of a gated attention layer's q and k heads. The projected row holds each
// q head's query then its gate ([q_0 | g_0 | q_1 | g_1 | ...], 2 * nq * d), then the k heads,
// then the v heads. Each head is RMS-normed over its d dimensions with w (the family's
// 1 + weight, added on the host) and rotated on its first `rot` dimensions (rotate-half
// within them, frequencies inv_freq[rot / 2], the rest unrotated). Queries go to q_out
// [T, nq * d] (so attention reads them at a stride of nq * d) and gates to gate_out; keys,
// with the token's v, go to the paged cache at its slot, as bf16.
// Grid (T, nq + nkv), block GATED_ROPE_THREADS (a multiple of 32: every warp sums the head).
extern "C" __global__ void __launch_bounds__(GATED_ROPE_THREADS)
gated_rope_kv_write(const float* __restrict__ qkv,
                    const int* __restrict__ positions,
                    const float* __restrict__ inv_freq,
                    const int* __restrict__ slot_mapping,
                    bf16* __restrict__ k_cache, bf16* __restrict__ v_cache,
                    const float* __restrict__ q_w, const float* __restrict__ k_w, float eps,
                    float* __restrict__ q_out, float* __restrict__ gate_out,
                    int row_stride, int nq, int nkv, int d, int rot) {
    pdl_start();
    int t = blockIdx.x;
    int h = blockIdx.y;
    const float* row = qkv + (long long)t * row_stride;
    bool is_q = h < nq;
    int kh = h - nq;
    const float* src = is_q ? row + (long long)h * 2 * d : row + (long long)2 * nq * d + (long long)kh * d;
    const float* w = is_q ? q_w : k_w;
    float ss = 0.0f;
    for (int i = threadIdx.x & 31; i < d; i += 32) ss += src[i] * src[i];
    ss = warp_sum(ss);
    float inv = 1.0f / sqrtf(ss / (float)d + eps);
    float pos = (float)positions[t];
    int half = rot / 2;
    long long slot_off = (long long)slot_mapping[t] * nkv * d;
    long long qo = (long long)t * nq * d + (long long)h * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float x = src[i] * inv * w[i];
        float y = x;
        if (i < rot) {
            bool first = i < half;
            int j = first ? i : i - half;
            int p = first ? i + half : i - half;
            float other = src[p] * inv * w[p];
            float s, c;
            sincosf(pos * inv_freq[j], &s, &c);
            y = first ? x * c - other * s : x * c + other * s;
        }
        if (is_q) {
            q_out[qo + i] = y;
            gate_out[qo + i] = src[d + i];
        } else {
            long long o = slot_off + (long long)kh * d + i;
            k_cache[o] = f2bf(y);
            v_cache[o] = f2bf(row[(long long)2 * nq * d + (long long)nkv * d + (long long)kh * d + i]);
        }
    }
}

// attn[r, i] = bf16(attn[r, i] * sigmoid(gate[r, i])): a gated layer's output gate, on the
// attention's bf16 rows before o_proj. Grid (rows, ceil(cols / GATE_THREADS)).
extern "C" __global__ void __launch_bounds__(GATE_THREADS)
gate_sigmoid_mul(bf16* __restrict__ attn, const float* __restrict__ gate, int cols) {
    pdl_start();
    int i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i >= cols) return;
    long long o = (long long)blockIdx.x * cols + i;
    float g = gate[o];
    attn[o] = f2bf(bf2f(attn[o]) / (1.0f + expf(-g)));
}
