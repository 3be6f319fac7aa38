
// In-process KV handover (handover.rs): a prompt's K and V copied from one engine's cache
// into the blocks another engine of this process reserved, on the device. The run table
// holds, for run r, the source address at 3r, the destination at 3r + 1 and the length in
// bytes at 3r + 2; every address and length is a multiple of 16 (the host checks, and
// copies run by run through the driver otherwise). Grid (runs), any block size: each block
// copies one run, 16 bytes a thread at a time.
extern "C" __global__ void __launch_bounds__(KV_COPY_THREADS)
kv_copy_runs(const unsigned long long* __restrict__ table, int runs) {
    pdl_start();
    int r = blockIdx.x;
    if (r >= runs) return;
    const uint4* __restrict__ src = (const uint4*)table[3 * r];
    uint4* __restrict__ dst = (uint4*)table[3 * r + 1];
    long long n = (long long)(table[3 * r + 2] >> 4);
    for (long long i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}
