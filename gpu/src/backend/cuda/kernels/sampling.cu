// Sampling on the device: greedy, temperature, top-k and top-p, and constrained masks.
// Part of the kernels' one source: common.cuh, then layers.cu, attention_decode.cu,
// attention_prefill.cu and sampling.cu, joined in that order (kernels.rs, KERNELS_CU).

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
// Grid (rows, chunks <= 32), block SAMPLE_THREADS; with chunks > 1, `stats` holds 3 floats
// per (row, chunk) and `ticks` a counter per row, zero between launches (the first pass's
// shares, merged by the last block of each row: one block reading a 152k vocabulary took
// 53 µs on an H100, a tenth of a small model's decode step).
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
sample_rows(const float* __restrict__ logits, int vocab,
            const float* __restrict__ temps,
            const int* __restrict__ top_ks,
            const float* __restrict__ top_ps,
            const float* __restrict__ uniforms,
            int* __restrict__ token, float* __restrict__ logprob,
            float* __restrict__ stats, int* __restrict__ ticks) {
    pdl_start();
    __shared__ float best_v[SAMPLE_THREADS];
    __shared__ int best_i[SAMPLE_THREADS];
    __shared__ float chunk_start[SAMPLE_THREADS + 1];
    __shared__ unsigned int gathered[SAMPLE_GATHER];
    __shared__ int n_gathered;
    __shared__ int chosen;
    __shared__ float row_lse;
    int r = blockIdx.x;
    int tid = threadIdx.x;
    const float* x = logits + (long long)r * vocab;
    const int chunks = gridDim.y;

    // Argmax (lowest index on ties, NaN never wins) and the log-sum-exp of the raw logits, in
    // one pass: each thread keeps its running max and its sum of exp(v - that max), rescaled
    // when the max moves (16-byte loads where the rows allow them). With chunks > 1 the
    // pass is spread over the grid's y: block c takes the c-th share of the row (a multiple
    // of 4 long, so the 16-byte loads stay aligned), and the last block of the row to finish
    // merges the shares' results and goes on alone.
    int per = ((vocab + chunks - 1) / chunks + 3) & ~3;
    int lo = min((int)blockIdx.y * per, vocab);
    int hi = min(lo + per, vocab);
    float bv = NEG_INF;
    int bi = 0x7fffffff;
    float tse = 0.0f;
    if ((vocab & 3) == 0) {
        const float4* x4 = reinterpret_cast<const float4*>(x);
        for (int i = lo / 4 + tid; i < hi / 4; i += blockDim.x) {
            float4 q = x4[i];
            float vs[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
            for (int c = 0; c < 4; c++) online_max_sum(vs[c], 4 * i + c, bv, bi, tse);
        }
    } else {
        for (int i = lo + tid; i < hi; i += blockDim.x) online_max_sum(x[i], i, bv, bi, tse);
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
    int arg = best_i[0];
    // Each thread's sum rescaled to the share's max (a thread that saw only -inf adds 0).
    float sum = block_sum(bv == NEG_INF ? 0.0f : tse * expf(bv - mx));
    float lse;
    if (chunks == 1) {
        lse = mx + logf(sum);
    } else {
        float* st = stats + (long long)r * chunks * 3;
        if (tid == 0) {
            st[blockIdx.y * 3] = mx;
            st[blockIdx.y * 3 + 1] = __int_as_float(arg);
            st[blockIdx.y * 3 + 2] = sum;
        }
        // The share's result is visible device-wide before the ticket is taken.
        __threadfence();
        __syncthreads();
        if (tid == 0) {
            int last = atomicAdd(ticks + r, 1) == chunks - 1;
            if (last) ticks[r] = 0;  // ready for the next step (and a graph's replay)
            chosen = last;
        }
        __syncthreads();
        if (!chosen) return;
        __threadfence();
        // One warp merges the shares (at most 32), past L1 since other blocks wrote them.
        if (tid < 32) {
            bool has = tid < chunks;
            float v = has ? __ldcg(st + tid * 3) : NEG_INF;
            int i = has ? __float_as_int(__ldcg(st + tid * 3 + 1)) : 0x7fffffff;
            float sm = has ? __ldcg(st + tid * 3 + 2) : 0.0f;
            float mv = v;
            int mi = i;
            for (int o = 16; o > 0; o >>= 1) {
                float ov = __shfl_xor_sync(0xffffffffu, mv, o);
                int oi = __shfl_xor_sync(0xffffffffu, mi, o);
                if (ov > mv || (ov == mv && oi < mi)) {
                    mv = ov;
                    mi = oi;
                }
            }
            float total = warp_sum(v == NEG_INF ? 0.0f : sm * expf(v - mv));
            if (tid == 0) {
                best_v[0] = mv;
                best_i[0] = mi;
                row_lse = mv + logf(total);
            }
        }
        __syncthreads();
        mx = best_v[0];
        arg = best_i[0];
        lse = row_lse;
        // Every thread has read them before thread 0 reuses best_v and best_i below (the
        // chunk totals, the sorted maxima): without this, a warp that ran ahead could
        // overwrite best_v[0] before a slower one read the row's maximum.
        __syncthreads();
    }
    if (arg == 0x7fffffff) arg = 0;

    float temp = temps[r];
    int k = top_ks[r];
    if (temp <= 1e-5f || k == 1) {
        if (tid == 0) {
            token[r] = arg;
            logprob[r] = x[arg] - lse;
        }
        return;
    }
    if (chunks > 1) {
        // The bound below is taken from each thread's maximum over the whole row.
        own_max = NEG_INF;
        for (int i = tid; i < vocab; i += blockDim.x) own_max = fmaxf(own_max, x[i]);
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
    pdl_start();
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
