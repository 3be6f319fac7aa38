// kvmesh's CUDA emulator, kernel side: what the kernels (gpu/src/backend/cuda/kernels/*.cu)
// need of CUDA C, in host C++, so the same source compiles with g++ and runs on the CPU.
//
// The emulated driver (driver.cpp) compiles the kernel source NVRTC would have compiled with
// this header in front, then runs a launch here, one block at a time on the calling thread:
// every CUDA thread of the block is a fiber with its own stack, switched only at
// the points where threads meet (__syncthreads, and each warp-wide exchange: shuffles,
// reductions, mma fragments). So the kernels' own code, register arrays and shared memory
// run as written; what they cannot have here is concurrency between blocks, which no correct
// kernel relies on. Floating point is the host's: products and sums rounded one by one
// (-ffp-contract=off), the libm's expf and friends in place of the device's approximations,
// so figures agree with a GPU's within the tolerances the parity tests state, not bit for bit.

#ifndef KVMESH_EMU_PRELUDE
#define KVMESH_EMU_PRELUDE

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <utility>
#include <sys/mman.h>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __align__(n) __attribute__((aligned(n)))
// One launch runs at a time in the process (the driver's lock), so plain statics serve.
#define __shared__ static
#define __constant__ static
#define warpSize 32

struct dim3 {
    unsigned int x, y, z;
};
struct alignas(16) uint4 {
    unsigned int x, y, z, w;
};
struct alignas(8) uint2 {
    unsigned int x, y;
};
struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(8) float2 {
    float x, y;
};
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline float2 make_float2(float a, float b) { return {a, b}; }

namespace emu {

enum State { RUN, BLOCK_WAIT, WARP_WAIT, DONE };

// Where a stopped fiber (or the scheduler) goes on: its stack pointer, with its callee-saved
// registers pushed there (kvmesh_emu_switch, kernel_runtime.h).
struct Context {
    void* sp;
};
extern "C" void kvmesh_emu_switch(Context* from, Context* to);

struct Fiber {
    Context ctx;
    bool started;
    int gen;  // which of the two exchange buffers its warp's next exchange uses
    dim3 tid;
    int lane, warp;
    State state;
};

// The launch in progress on this thread.
struct Launch {
    dim3 grid, block, block_idx;
    int threads;
    Fiber* fibers;
    Context scheduler;
    void (*entry)(void**);
    void** args;
    // Each warp's exchange slots: a lane writes its word, meets its warp, reads another's.
    // Two of each, used in turn: a lane that has read can go on to write the next
    // exchange's without overwriting what a slower lane has still to read (it cannot pass
    // that exchange's meeting before every lane has finished reading this one).
    unsigned long long slots[2][32][32];
    unsigned long long extra[2][32][32][4];
};

extern Launch* launch;
extern Fiber* cur;

// Stops this thread here until the scheduler releases it.
inline void wait(State s) {
    cur->state = s;
    kvmesh_emu_switch(&cur->ctx, &launch->scheduler);
}

template <class T>
inline unsigned long long bits(T v) {
    unsigned long long b = 0;
    std::memcpy(&b, &v, sizeof(T));
    return b;
}
template <class T>
inline T from_bits(unsigned long long b) {
    T v;
    std::memcpy(&v, &b, sizeof(T));
    return v;
}

// Every lane of the warp puts `v`; returns lane `src`'s (its own where src is outside).
// This lane's exchange buffers for its warp's next exchange.
inline unsigned long long* slots() {
    Fiber* f = cur;
    f->gen ^= 1;
    return launch->slots[f->gen][f->warp];
}

template <class T>
inline T exchange(T v, int src) {
    unsigned long long* s = slots();
    s[cur->lane] = bits(v);
    wait(WARP_WAIT);
    return (src >= 0 && src < 32) ? from_bits<T>(s[src]) : v;
}

inline int segment(int lane, int src, int width) {
    int base = lane & ~(width - 1);
    return (src < base || src >= base + width) ? lane : src;
}

}  // namespace emu

#define threadIdx (emu::cur->tid)
#define blockIdx (emu::launch->block_idx)
#define blockDim (emu::launch->block)
#define gridDim (emu::launch->grid)

inline void __syncthreads() { emu::wait(emu::BLOCK_WAIT); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::wait(emu::WARP_WAIT); }
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block() {}

template <class T>
inline T __shfl_xor_sync(unsigned, T v, int mask, int width = 32) {
    int lane = emu::cur->lane;
    return emu::exchange(v, emu::segment(lane, lane ^ mask, width));
}
template <class T>
inline T __shfl_sync(unsigned, T v, int src, int width = 32) {
    int lane = emu::cur->lane;
    return emu::exchange(v, (lane & ~(width - 1)) + (src & (width - 1)));
}
template <class T>
inline T __shfl_up_sync(unsigned, T v, unsigned delta, int width = 32) {
    int lane = emu::cur->lane;
    return emu::exchange(v, emu::segment(lane, lane - (int)delta, width));
}
template <class T>
inline T __shfl_down_sync(unsigned, T v, unsigned delta, int width = 32) {
    int lane = emu::cur->lane;
    return emu::exchange(v, emu::segment(lane, lane + (int)delta, width));
}

namespace emu {
// Every live lane's value of a warp-wide reduction.
template <class T, class F>
inline T warp_reduce(T v, F op) {
    unsigned long long* s = slots();
    s[cur->lane] = bits(v);
    wait(WARP_WAIT);
    T r = v;
    int base = cur->warp * 32;
    for (int l = 0; l < 32 && base + l < launch->threads; l++) {
        if (launch->fibers[base + l].state != DONE) r = op(r, from_bits<T>(s[l]));
    }
    return r;
}
}  // namespace emu

inline unsigned __reduce_min_sync(unsigned, unsigned v) {
    return emu::warp_reduce(v, [](unsigned a, unsigned b) { return a < b ? a : b; });
}
inline int __reduce_min_sync(unsigned, int v) {
    return emu::warp_reduce(v, [](int a, int b) { return a < b ? a : b; });
}
inline unsigned __reduce_max_sync(unsigned, unsigned v) {
    return emu::warp_reduce(v, [](unsigned a, unsigned b) { return a > b ? a : b; });
}
inline int __reduce_max_sync(unsigned, int v) {
    return emu::warp_reduce(v, [](int a, int b) { return a > b ? a : b; });
}
inline int __all_sync(unsigned, int p) {
    return (int)emu::warp_reduce(p ? 1u : 0u, [](unsigned a, unsigned b) { return a & b; });
}
inline int __any_sync(unsigned, int p) {
    return (int)emu::warp_reduce(p ? 1u : 0u, [](unsigned a, unsigned b) { return a | b; });
}
inline unsigned __ballot_sync(unsigned, int p) {
    unsigned bit = p ? 1u << emu::cur->lane : 0u;
    return emu::warp_reduce(bit, [](unsigned a, unsigned b) { return a | b; });
}

// Blocks run one after another on one thread, so a read-modify-write is already atomic
// within a launch; the builtins keep it so should two host threads ever share a buffer.
template <class T>
inline T atomicAdd(T* p, T v) {
    return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
inline float atomicAdd(float* p, float v) {
    float old = *p;
    *p = old + v;
    return old;
}
template <class T>
inline T atomicExch(T* p, T v) {
    return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST);
}
template <class T>
inline T atomicCAS(T* p, T expected, T v) {
    __atomic_compare_exchange_n(p, &expected, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return expected;
}
template <class T>
inline T atomicMax(T* p, T v) {
    T old = *p;
    if (v > old) *p = v;
    return old;
}
template <class T>
inline T atomicMin(T* p, T v) {
    T old = *p;
    if (v < old) *p = v;
    return old;
}

template <class T>
inline T __ldcg(const T* p) {
    return *p;
}
template <class T>
inline T __ldg(const T* p) {
    return *p;
}

inline float __uint_as_float(unsigned u) { return emu::from_bits<float>(u); }
inline float __int_as_float(int i) { return emu::from_bits<float>((unsigned)i); }
inline unsigned __float_as_uint(float f) { return (unsigned)emu::bits(f); }
inline int __float_as_int(float f) { return (int)(unsigned)emu::bits(f); }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __frcp_rn(float a) { return 1.0f / a; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline int __float2int_rn(float f) { return (int)std::nearbyint(f); }
inline int __float2int_rz(float f) { return (int)f; }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __clz(unsigned v) { return v ? __builtin_clz(v) : 32; }
inline int __ffs(unsigned v) { return __builtin_ffs((int)v); }
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    unsigned long long b = ((unsigned long long)y << 32) | x;
    unsigned r = 0;
    for (int i = 0; i < 4; i++) {
        unsigned sel = (s >> (4 * i)) & 7u;
        r |= (unsigned)((b >> (8 * sel)) & 0xffu) << (8 * i);
    }
    return r;
}
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }

// An IEEE half to f32, exactly.
inline float kvmesh_emu_half(unsigned short h) {
    unsigned sign = (unsigned)(h & 0x8000u) << 16;
    unsigned e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    float v;
    if (e == 0) {
        v = std::ldexp((float)m, -24);
    } else if (e == 31) {
        v = m ? NAN : INFINITY;
    } else {
        v = std::ldexp((float)(m | 0x400u), (int)e - 25);
    }
    return __uint_as_float(__float_as_uint(v) | sign);
}

// The tensor-core tile product `mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32`, with
// PTX's fragment layout (g = lane / 4, t = lane % 4): a's registers hold A at (g, 2t..2t+1),
// (g+8, 2t..), (g, 2t+8..), (g+8, 2t+8..); b0 and b1 hold B at (2t..2t+1, g), (2t+8.., g);
// c at (g, 2t..2t+1), (g+8, 2t..). Each product is exact in f32; the sum runs in k order.
inline void kvmesh_emu_mma_bf16(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    unsigned long long* s = emu::slots();
    emu::Fiber* f = emu::cur;
    auto& x = emu::launch->extra[f->gen][f->warp];
    for (int i = 0; i < 4; i++) x[f->lane][i] = a[i];
    s[f->lane] = ((unsigned long long)b1 << 32) | b0;
    emu::wait(emu::WARP_WAIT);
    auto bf = [](unsigned w, int hi) { return __uint_as_float(hi ? (w & 0xffff0000u) : w << 16); };
    auto A = [&](int r, int k) {
        int lane = (r % 8) * 4 + (k % 8) / 2;
        int reg = (r >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
        return bf((unsigned)x[lane][reg], k & 1);
    };
    auto B = [&](int k, int n) {
        int lane = n * 4 + (k % 8) / 2;
        unsigned long long w = s[lane];
        return bf(k >= 8 ? (unsigned)(w >> 32) : (unsigned)w, k & 1);
    };
    int g = f->lane / 4, t = f->lane % 4;
    for (int i = 0; i < 4; i++) {
        int r = g + (i >= 2 ? 8 : 0), n = 2 * t + (i & 1);
        float acc = c[i];
        for (int k = 0; k < 16; k++) acc += A(r, k) * B(k, n);
        c[i] = acc;
    }
}

// `ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16`: lanes 8i .. 8i+7 give the rows of
// matrix i; lane (g, t) receives, of each, (row g, columns 2t and 2t+1), or transposed
// (row 2t, column g) and (row 2t+1, column g).
inline void kvmesh_emu_ldmatrix(unsigned (&r)[4], const unsigned short* p, bool trans) {
    unsigned long long* s = emu::slots();
    emu::Fiber* f = emu::cur;
    s[f->lane] = (unsigned long long)(uintptr_t)p;
    emu::wait(emu::WARP_WAIT);
    int g = f->lane / 4, t = f->lane % 4;
    for (int i = 0; i < 4; i++) {
        auto row = [&](int k) { return (const unsigned short*)(uintptr_t)s[8 * i + k]; };
        r[i] = trans ? (unsigned)row(2 * t)[g] | ((unsigned)row(2 * t + 1)[g] << 16)
                     : (unsigned)row(g)[2 * t] | ((unsigned)row(g)[2 * t + 1] << 16);
    }
}
inline void kvmesh_emu_ldmatrix_x4_trans(unsigned (&r)[4], const unsigned short* p) {
    kvmesh_emu_ldmatrix(r, p, true);
}
inline void kvmesh_emu_ldmatrix_x4(unsigned (&r)[4], const unsigned short* p) {
    kvmesh_emu_ldmatrix(r, p, false);
}

// `cp.async.cg.shared.global` of 16 bytes, `bytes` of them read and the rest zeros: done at
// once, which is all a later wait_group could promise.
inline void kvmesh_emu_cp_async16(void* dst, const void* src, int bytes) {
    std::memset(dst, 0, 16);
    if (bytes > 0) std::memcpy(dst, src, bytes < 16 ? bytes : 16);
}

namespace emu {

// Calls a kernel with the launch's arguments as cuLaunchKernel passes them: one pointer
// per parameter, to its value.
template <class... A, unsigned long... I>
inline void call_with(void (*k)(A...), void** args, std::integer_sequence<unsigned long, I...>) {
    k(*static_cast<std::remove_reference_t<A>*>(args[I])...);
}
template <class... A>
inline void call(void (*k)(A...), void** args) {
    call_with(k, args, std::make_integer_sequence<unsigned long, sizeof...(A)>{});
}
template <class... A>
inline int arg_sizes(void (*)(A...), unsigned long* out, int cap) {
    unsigned long s[] = {sizeof(A)..., 0};
    int n = (int)sizeof...(A);
    for (int i = 0; i < n && i < cap; i++) out[i] = s[i];
    return n;
}

}  // namespace emu

#define KVMESH_EMU_ENTRY(name)                                                  \
    extern "C" void kvmesh_emu_entry_##name(void** a) { emu::call(&name, a); } \
    extern "C" int kvmesh_emu_sizes_##name(unsigned long* out, int cap) {      \
        return emu::arg_sizes(&name, out, cap);                                 \
    }

#endif
