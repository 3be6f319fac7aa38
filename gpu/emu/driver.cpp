// kvmesh's CUDA emulator, host side: the CUDA driver, NVRTC and cuBLAS functions the CUDA
// backend calls (gpu/src/backend/cuda/library_calls.txt), on the CPU, in one shared library
// that scripts/cuda_emulated.sh puts first on LD_LIBRARY_PATH as libcuda.so, libnvrtc.so and
// libcublas.so. cudarc loads it as it would load NVIDIA's, so the backend's own host code,
// launch arguments and graphs are what runs; only the device is emulated.
//
// - "Device" memory is host memory: each allocation ends at a page that cannot be touched,
//   so a kernel that reads or writes past the end of a buffer stops with a fault naming the
//   kernel, not a silent wrong answer.
// - Every operation runs when it is issued, in issue order, on the calling thread: a valid
//   order for any stream, event and graph dependencies the host sets up.
// - "NVRTC" compiles the kernel source with the host's C++ compiler (CXX, else g++) and
//   kernel_prelude.h into a shared library; the "PTX" it returns names that library, and
//   loading the module opens it.
// - Graph capture records the launches (their argument values copied, as CUDA copies them),
//   copies and sets; a launch of the graph replays them.
// - What the emulator does not do (IPC between processes, green contexts, cuBLASLt) fails
//   with CUDA_ERROR_NOT_SUPPORTED, which the backend reports by name.

#include <dlfcn.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#ifndef KVMESH_EMU_DIR
#error "build with -DKVMESH_EMU_DIR=\"<the folder holding kernel_prelude.h>\""
#endif

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
enum : int {
    OK = 0,
    INVALID_VALUE = 1,
    OUT_OF_MEMORY = 2,
    INVALID_DEVICE = 101,
    INVALID_IMAGE = 200,
    INVALID_HANDLE = 400,
    NOT_FOUND = 500,
    LAUNCH_FAILED = 719,
    NOT_SUPPORTED = 801,
    CAPTURE_INVALIDATED = 901,
};

namespace {

std::recursive_mutex big_lock;
#define LOCK std::lock_guard<std::recursive_mutex> guard(big_lock)

// ---- memory -------------------------------------------------------------------------------

struct Region {
    char* map;
    size_t map_len;
    size_t len;
};
std::map<uintptr_t, Region> regions;
size_t allocated = 0;
std::map<uintptr_t, int> exported;  // allocation -> memfd (cuIpcGetMemHandle)
const size_t PAGE = 4096;

size_t total_memory() {
    const char* v = getenv("KVMESH_EMU_MEMORY_MIB");
    size_t mib = v ? strtoull(v, nullptr, 10) : 4096;
    return mib << 20;
}

// What a fresh allocation holds: a GPU's is whatever was there before, so here every byte
// is 0xff (an f32 or bf16 NaN, an i32 -1) unless KVMESH_EMU_FILL names another byte: a
// kernel that reads what nobody wrote shows it rather than reading zeros.
int fill_byte() {
    const char* v = getenv("KVMESH_EMU_FILL");
    return v ? (int)strtol(v, nullptr, 0) & 0xff : 0xff;
}

// `len` bytes ending 256-byte-aligned right before a page that faults when touched.
void* alloc_region(size_t len) {
    size_t body = ((len + 255) / 256) * 256;
    if (body == 0) body = 256;
    size_t map_len = ((body + PAGE - 1) / PAGE) * PAGE + PAGE;
    void* m = mmap(nullptr, map_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return nullptr;
    char* base = (char*)m;
    mprotect(base + map_len - PAGE, PAGE, PROT_NONE);
    char* p = base + map_len - PAGE - body;
    memset(p, fill_byte(), body);
    regions[(uintptr_t)p] = Region{base, map_len, len};
    allocated += body;
    return p;
}

CUresult free_region(uintptr_t p) {
    auto it = regions.find(p);
    if (it == regions.end()) return INVALID_VALUE;
    allocated -= ((it->second.len + 255) / 256) * 256;
    auto ex = exported.find(p);
    if (ex != exported.end()) {
        close(ex->second);
        exported.erase(ex);
    }
    munmap(it->second.map, it->second.map_len);
    regions.erase(it);
    return OK;
}

// ---- kernels ------------------------------------------------------------------------------

typedef int (*RunFn)(void (*)(void**), const unsigned*, const unsigned*, void**, char*, int);
typedef int (*SizesFn)(unsigned long*, int);

struct Module {
    void* lib;
    RunFn run;
};
struct Function {
    Module* module;
    std::string name;
    void (*entry)(void**);
    std::vector<unsigned long> sizes;
};

thread_local const char* running_kernel = nullptr;

void on_fault(int sig, siginfo_t* info, void*) {
    char msg[512];
    int n = snprintf(msg, sizeof msg,
                     "kvmesh CUDA emulator: %s at address %p%s%s%s\n",
                     sig == SIGSEGV ? "a memory fault" : "a bus error", info->si_addr,
                     running_kernel ? " in kernel `" : " outside any kernel",
                     running_kernel ? running_kernel : "", running_kernel ? "`" : "");
    if (n > 0) {
        ssize_t w = write(2, msg, (size_t)n);
        (void)w;
    }
    signal(sig, SIG_DFL);
    raise(sig);
}

void install_fault_handler() {
    static std::once_flag once;
    std::call_once(once, [] {
        static char alt[64 * 1024];
        stack_t ss{};
        ss.ss_sp = alt;
        ss.ss_size = sizeof alt;
        sigaltstack(&ss, nullptr);
        struct sigaction sa {};
        sa.sa_sigaction = on_fault;
        sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
        sigaction(SIGSEGV, &sa, nullptr);
        sigaction(SIGBUS, &sa, nullptr);
    });
}

struct Op {
    enum Kind { LAUNCH, COPY, SET, CALL } kind;
    Function* f = nullptr;
    unsigned grid[3] = {1, 1, 1}, block[3] = {1, 1, 1};
    std::vector<std::vector<char>> args;
    void* dst = nullptr;
    const void* src = nullptr;
    size_t len = 0;
    unsigned char value = 0;
    std::function<void()> call;
};

CUresult run_launch(Function* f, const unsigned* grid, const unsigned* block, void** args) {
    char err[512] = {0};
    running_kernel = f->name.c_str();
    int rc = f->module->run(f->entry, grid, block, args, err, sizeof err);
    running_kernel = nullptr;
    if (rc != 0) {
        fprintf(stderr, "kvmesh CUDA emulator: kernel `%s` failed: %s\n", f->name.c_str(), err);
        return LAUNCH_FAILED;
    }
    return OK;
}

CUresult run_op(const Op& op) {
    switch (op.kind) {
        case Op::LAUNCH: {
            std::vector<void*> ptrs;
            for (auto& a : op.args) ptrs.push_back((void*)a.data());
            return run_launch(op.f, op.grid, op.block, ptrs.data());
        }
        case Op::COPY:
            memmove(op.dst, op.src, op.len);
            return OK;
        case Op::SET:
            memset(op.dst, op.value, op.len);
            return OK;
        case Op::CALL:
            op.call();
            return OK;
    }
    return INVALID_VALUE;
}

struct Graph {
    std::vector<Op> ops;
};
struct Stream {
    Graph* capturing = nullptr;
};
Stream default_stream;

Stream* stream_of(void* s) { return s ? (Stream*)s : &default_stream; }

// Runs `op` now, or records it in the stream's graph while the stream captures.
CUresult issue(void* stream, Op op) {
    Stream* s = stream_of(stream);
    if (s->capturing) {
        s->capturing->ops.push_back(std::move(op));
        return OK;
    }
    return run_op(op);
}

CUresult launch(Function* f, const unsigned* grid, const unsigned* block, void* stream,
                void** params) {
    if (!f || !params) return INVALID_VALUE;
    Op op;
    op.kind = Op::LAUNCH;
    op.f = f;
    for (int i = 0; i < 3; i++) {
        op.grid[i] = grid[i];
        op.block[i] = block[i];
    }
    for (size_t i = 0; i < f->sizes.size(); i++) {
        const char* p = (const char*)params[i];
        op.args.emplace_back(p, p + f->sizes[i]);
    }
    return issue(stream, std::move(op));
}

// ---- NVRTC: the kernel source to a shared library -----------------------------------------

struct Program {
    std::string source;
    std::string ptx;
    std::string log;
};

uint64_t fnv(const std::string& s, uint64_t h = 1469598103934665603ull) {
    for (unsigned char c : s) {
        h ^= c;
        h *= 1099511628211ull;
    }
    return h;
}

std::string read_file(const std::string& path) {
    std::ifstream in(path);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
}

std::string cache_dir() {
    const char* d = getenv("KVMESH_EMU_CACHE");
    if (d && *d) return d;
    return "/tmp/kvmesh-emu-" + std::to_string(getuid());
}

std::string shell_quote(const std::string& s) {
    std::string r = "'";
    for (char c : s) {
        if (c == '\'') r += "'\\''";
        else r += c;
    }
    return r + "'";
}

// The kernels' names: every `extern "C" __global__` function of the preprocessed source.
std::vector<std::string> kernel_names(const std::string& pre) {
    std::regex re(R"(extern\s+"C"\s+__global__\s+void\s+(__launch_bounds__\s*\([^)]*\)\s*)?([A-Za-z_]\w*)\s*\()");
    std::vector<std::string> names;
    std::set<std::string> seen;
    for (std::sregex_iterator it(pre.begin(), pre.end(), re), end; it != end; ++it) {
        std::string n = (*it)[2];
        if (seen.insert(n).second) names.push_back(n);
    }
    return names;
}

int compile(Program& p, const std::vector<std::string>& options) {
    std::string defines;
    for (auto& o : options) {
        if (o.rfind("-D", 0) == 0) defines += " " + shell_quote(o);
    }
    std::string prelude = KVMESH_EMU_DIR;
    std::string cxx = getenv("CXX") ? getenv("CXX") : "g++";
    std::string key = std::to_string(fnv(read_file(prelude + "/kernel_prelude.h") +
                                         read_file(prelude + "/kernel_runtime.h") + defines +
                                         cxx, fnv(p.source)));
    std::string dir = cache_dir() + "/" + key;
    std::string lib = dir + "/kernels.so";
    if (access(lib.c_str(), R_OK) != 0) {
        std::string tmp = dir + ".tmp" + std::to_string(getpid());
        std::string mk = "mkdir -p " + shell_quote(tmp);
        if (system(mk.c_str()) != 0) {
            p.log = "cannot create " + tmp;
            return 1;
        }
        std::ofstream(tmp + "/kernels.cu") << p.source;
        std::string pre_cmd = cxx + " -E -P -x c++" + defines + " " + shell_quote(tmp + "/kernels.cu") +
                              " -o " + shell_quote(tmp + "/kernels.i") + " 2> " +
                              shell_quote(tmp + "/log.txt");
        if (system(pre_cmd.c_str()) != 0) {
            p.log = read_file(tmp + "/log.txt");
            return 1;
        }
        auto names = kernel_names(read_file(tmp + "/kernels.i"));
        std::ofstream gen(tmp + "/emulated.cpp");
        gen << "#include \"" << prelude << "/kernel_prelude.h\"\n"
            << "#include \"kernels.cu\"\n";
        for (auto& n : names) gen << "KVMESH_EMU_ENTRY(" << n << ")\n";
        gen << "#include \"" << prelude << "/kernel_runtime.h\"\n";
        gen.close();
        std::string opt = getenv("KVMESH_EMU_OPT") ? getenv("KVMESH_EMU_OPT") : "-O1";
        std::string cc = cxx + " -std=c++17 " + opt +
                         " -g0 -fPIC -shared -ffp-contract=off -fno-strict-aliasing -U_FORTIFY_SOURCE -w" + defines +
                         " " + shell_quote(tmp + "/emulated.cpp") + " -o " +
                         shell_quote(tmp + "/kernels.so") + " 2> " + shell_quote(tmp + "/log.txt");
        if (system(cc.c_str()) != 0) {
            p.log = read_file(tmp + "/log.txt");
            return 1;
        }
        std::string mv = "rm -rf " + shell_quote(dir) + " && mv " + shell_quote(tmp) + " " +
                         shell_quote(dir);
        if (system(mv.c_str()) != 0 && access(lib.c_str(), R_OK) != 0) {
            p.log = "cannot move the compiled kernels to " + dir;
            return 1;
        }
    }
    // Looks enough like PTX for the backend's cache (".entry") and ISA check (".version").
    p.ptx = "// kvmesh CUDA emulator\n.version 9.0\n.target emulated\n.entry emulated\nLIB " + lib +
            "\n";
    return 0;
}

// ---- cuBLAS -------------------------------------------------------------------------------

float load_as_f32(const void* base, int type, size_t i) {
    switch (type) {
        case 0:  // CUDA_R_32F
            return ((const float*)base)[i];
        case 14: {  // CUDA_R_16BF
            unsigned u = (unsigned)((const unsigned short*)base)[i] << 16;
            float f;
            memcpy(&f, &u, 4);
            return f;
        }
    }
    return NAN;
}

}  // namespace

// ================================== the driver API =========================================

extern "C" {

typedef struct {
    unsigned gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
    void* hStream;
    void* attrs;
    unsigned numAttrs;
} CUlaunchConfig;

CUresult cuInit(unsigned) {
    install_fault_handler();
    return OK;
}
CUresult cuDriverGetVersion(int* v) {
    *v = 13000;
    return OK;
}
CUresult cuDeviceGetCount(int* n) {
    *n = 1;
    return OK;
}
CUresult cuDeviceGet(int* d, int ordinal) {
    if (ordinal != 0) return INVALID_DEVICE;
    *d = 0;
    return OK;
}
CUresult cuDeviceGetName(char* name, int len, int) {
    snprintf(name, (size_t)len, "kvmesh CUDA emulator");
    return OK;
}
CUresult cuDeviceTotalMem_v2(size_t* bytes, int) {
    *bytes = total_memory();
    return OK;
}
CUresult cuDeviceGetAttribute(int* v, int attr, int) {
    switch (attr) {
        case 1: *v = 1024; break;      // max threads per block
        case 8: *v = 48 * 1024; break;  // shared memory per block
        case 10: *v = 32; break;        // warp size
        case 16: *v = 132; break;       // multiprocessors
        case 75: *v = 9; break;         // compute capability
        case 76: *v = 0; break;
        case 97: *v = 227 * 1024; break;  // opt-in shared memory per block
        case 115: *v = 0; break;          // memory pools: cudarc then allocates synchronously
        default: *v = 0;
    }
    return OK;
}
static int the_context;
CUresult cuDevicePrimaryCtxRetain(void** ctx, int) {
    *ctx = &the_context;
    return OK;
}
CUresult cuDevicePrimaryCtxRelease_v2(int) { return OK; }
CUresult cuCtxSetCurrent(void*) { return OK; }
CUresult cuCtxGetCurrent(void** ctx) {
    *ctx = &the_context;
    return OK;
}
CUresult cuCtxPushCurrent_v2(void*) { return OK; }
CUresult cuCtxPopCurrent_v2(void** ctx) {
    if (ctx) *ctx = &the_context;
    return OK;
}
CUresult cuCtxGetDevice(int* d) {
    *d = 0;
    return OK;
}
CUresult cuCtxSynchronize() { return OK; }
CUresult cuCtxDestroy_v2(void*) { return OK; }

CUresult cuStreamCreate(void** s, unsigned) {
    LOCK;
    *s = new Stream();
    return OK;
}
CUresult cuStreamCreateWithPriority(void** s, unsigned, int) { return cuStreamCreate(s, 0); }
CUresult cuStreamDestroy_v2(void* s) {
    LOCK;
    if (s) delete (Stream*)s;
    return OK;
}
CUresult cuStreamSynchronize(void*) { return OK; }
CUresult cuStreamQuery(void*) { return OK; }
CUresult cuStreamWaitEvent(void*, void*, unsigned) { return OK; }

struct Event {
    double at;
};
static double now_ms() {
    timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}
CUresult cuEventCreate(void** e, unsigned) {
    *e = new Event{now_ms()};
    return OK;
}
CUresult cuEventDestroy_v2(void* e) {
    delete (Event*)e;
    return OK;
}
CUresult cuEventRecord(void* e, void*) {
    ((Event*)e)->at = now_ms();
    return OK;
}
CUresult cuEventRecordWithFlags(void* e, void* s, unsigned) { return cuEventRecord(e, s); }
CUresult cuEventSynchronize(void*) { return OK; }
CUresult cuEventQuery(void*) { return OK; }
CUresult cuEventElapsedTime(float* ms, void* a, void* b) {
    *ms = (float)(((Event*)b)->at - ((Event*)a)->at);
    return OK;
}
CUresult cuEventElapsedTime_v2(float* ms, void* a, void* b) { return cuEventElapsedTime(ms, a, b); }

CUresult cuMemGetInfo_v2(size_t* free_b, size_t* total_b) {
    LOCK;
    size_t t = total_memory();
    *total_b = t;
    *free_b = allocated < t ? t - allocated : 0;
    return OK;
}
CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t len) {
    LOCK;
    if (allocated + len > total_memory()) return OUT_OF_MEMORY;
    void* r = alloc_region(len);
    if (!r) return OUT_OF_MEMORY;
    *p = (CUdeviceptr)(uintptr_t)r;
    return OK;
}
CUresult cuMemAllocAsync(CUdeviceptr* p, size_t len, void*) { return cuMemAlloc_v2(p, len); }
CUresult cuMemFree_v2(CUdeviceptr p) {
    LOCK;
    return free_region((uintptr_t)p);
}
CUresult cuMemFreeAsync(CUdeviceptr p, void*) { return cuMemFree_v2(p); }
CUresult cuMemHostAlloc(void** p, size_t len, unsigned) {
    *p = aligned_alloc(4096, ((len + 4095) / 4096) * 4096 + 4096);
    return *p ? OK : OUT_OF_MEMORY;
}
CUresult cuMemAllocHost_v2(void** p, size_t len) { return cuMemHostAlloc(p, len, 0); }
CUresult cuMemFreeHost(void* p) {
    free(p);
    return OK;
}

static CUresult copy(void* dst, const void* src, size_t len, void* stream) {
    LOCK;
    Op op;
    op.kind = Op::COPY;
    op.dst = dst;
    op.src = src;
    op.len = len;
    return issue(stream, std::move(op));
}
CUresult cuMemcpyAsync(CUdeviceptr d, CUdeviceptr s, size_t n, void* st) {
    return copy((void*)(uintptr_t)d, (const void*)(uintptr_t)s, n, st);
}
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr d, CUdeviceptr s, size_t n, void* st) {
    return cuMemcpyAsync(d, s, n, st);
}
CUresult cuMemcpyDtoD_v2(CUdeviceptr d, CUdeviceptr s, size_t n) {
    return cuMemcpyAsync(d, s, n, nullptr);
}
CUresult cuMemcpyDtoHAsync_v2(void* d, CUdeviceptr s, size_t n, void* st) {
    return copy(d, (const void*)(uintptr_t)s, n, st);
}
CUresult cuMemcpyDtoH_v2(void* d, CUdeviceptr s, size_t n) {
    return copy(d, (const void*)(uintptr_t)s, n, nullptr);
}
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void* s, size_t n, void* st) {
    return copy((void*)(uintptr_t)d, s, n, st);
}
CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void* s, size_t n) {
    return copy((void*)(uintptr_t)d, s, n, nullptr);
}
CUresult cuMemcpyPeerAsync(CUdeviceptr d, void*, CUdeviceptr s, void*, size_t n, void* st) {
    return cuMemcpyAsync(d, s, n, st);
}
CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, void* st) {
    LOCK;
    Op op;
    op.kind = Op::SET;
    op.dst = (void*)(uintptr_t)d;
    op.value = v;
    op.len = n;
    return issue(st, std::move(op));
}
CUresult cuMemsetD8_v2(CUdeviceptr d, unsigned char v, size_t n) {
    return cuMemsetD8Async(d, v, n, nullptr);
}
CUresult cuPointerGetAttribute(void* data, int attr, CUdeviceptr) {
    if (attr == 9) {  // CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
        *(int*)data = 0;
        return OK;
    }
    return NOT_SUPPORTED;
}

CUresult cuModuleLoadData(void** module, const void* image) {
    LOCK;
    std::string text = (const char*)image;
    auto at = text.find("\nLIB ");
    if (text.rfind("// kvmesh CUDA emulator", 0) != 0 || at == std::string::npos) {
        return INVALID_IMAGE;
    }
    std::string path = text.substr(at + 5);
    path = path.substr(0, path.find('\n'));
    void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        fprintf(stderr, "kvmesh CUDA emulator: %s\n", dlerror());
        return INVALID_IMAGE;
    }
    auto run = (RunFn)dlsym(lib, "kvmesh_emu_run");
    if (!run) return INVALID_IMAGE;
    *module = new Module{lib, run};
    return OK;
}
CUresult cuModuleLoad(void**, const char*) { return NOT_SUPPORTED; }
CUresult cuModuleUnload(void*) { return OK; }
CUresult cuModuleGetFunction(void** f, void* module, const char* name) {
    LOCK;
    Module* m = (Module*)module;
    std::string n = name;
    auto entry = (void (*)(void**))dlsym(m->lib, ("kvmesh_emu_entry_" + n).c_str());
    auto sizes = (SizesFn)dlsym(m->lib, ("kvmesh_emu_sizes_" + n).c_str());
    if (!entry || !sizes) return NOT_FOUND;
    auto* fn = new Function{m, n, entry, {}};
    fn->sizes.resize(64);
    int count = sizes(fn->sizes.data(), 64);
    fn->sizes.resize((size_t)count);
    *f = fn;
    return OK;
}
CUresult cuFuncGetAttribute(int* v, int, void*) {
    *v = 0;
    return OK;
}
CUresult cuFuncSetAttribute(void*, int, int) { return OK; }
CUresult cuFuncSetCacheConfig(void*, int) { return OK; }

CUresult cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned, void* stream, void** params, void**) {
    LOCK;
    unsigned grid[3] = {gx, gy, gz}, block[3] = {bx, by, bz};
    return launch((Function*)f, grid, block, stream, params);
}
CUresult cuLaunchKernelEx(const CUlaunchConfig* c, void* f, void** params, void**) {
    LOCK;
    unsigned grid[3] = {c->gridDimX, c->gridDimY, c->gridDimZ};
    unsigned block[3] = {c->blockDimX, c->blockDimY, c->blockDimZ};
    return launch((Function*)f, grid, block, c->hStream, params);
}

CUresult cuStreamBeginCapture_v2(void* s, int) {
    LOCK;
    Stream* st = stream_of(s);
    if (st->capturing) return INVALID_VALUE;
    st->capturing = new Graph();
    return OK;
}
CUresult cuStreamEndCapture(void* s, void** graph) {
    LOCK;
    Stream* st = stream_of(s);
    if (!st->capturing) return INVALID_VALUE;
    *graph = st->capturing;
    st->capturing = nullptr;
    return OK;
}
CUresult cuStreamIsCapturing(void* s, int* status) {
    *status = stream_of(s)->capturing ? 1 : 0;
    return OK;
}
CUresult cuGraphInstantiateWithFlags(void** exec, void* graph, unsigned long long) {
    LOCK;
    *exec = new Graph(*(Graph*)graph);
    return OK;
}
CUresult cuGraphLaunch(void* exec, void* stream) {
    LOCK;
    Stream* st = stream_of(stream);
    if (st->capturing) return NOT_SUPPORTED;
    for (const Op& op : ((Graph*)exec)->ops) {
        CUresult r = run_op(op);
        if (r != OK) return r;
    }
    return OK;
}
CUresult cuGraphDestroy(void* g) {
    delete (Graph*)g;
    return OK;
}
CUresult cuGraphExecDestroy(void* g) {
    delete (Graph*)g;
    return OK;
}

// Green contexts: the SMs split as Hopper splits them (groups in multiples of 8 of the 132),
// each side a context of its own; everything still runs on this thread, so a split checks
// the host's set-up and that each side computes what the whole device does, not speed.
struct DevResource {  // CUdevResource as CUDA 13.0 lays it out: 144 bytes
    int type;
    unsigned char padding[92];
    unsigned sm_count, min_partition, alignment;
    unsigned char rest[36];
};
static_assert(sizeof(DevResource) == 144, "CUdevResource is 144 bytes in CUDA 13.0");
const unsigned SMS = 132, SM_GRANULE = 8;

CUresult cuDeviceGetDevResource(int, DevResource* r, int type) {
    if (type != 1) return NOT_SUPPORTED;  // CU_DEV_RESOURCE_TYPE_SM only
    memset(r, 0, sizeof *r);
    r->type = 1;
    r->sm_count = SMS;
    r->min_partition = SM_GRANULE;
    r->alignment = SM_GRANULE;
    return OK;
}
CUresult cuDevSmResourceSplitByCount(DevResource* groups, unsigned* n, const DevResource* in,
                                     DevResource* rest, unsigned, unsigned min_count) {
    if (!n || !in || in->type != 1) return INVALID_VALUE;
    unsigned each = ((min_count + SM_GRANULE - 1) / SM_GRANULE) * SM_GRANULE;
    if (each == 0) each = SM_GRANULE;
    unsigned made = 0, left = in->sm_count;
    while (made < *n && left >= each) {
        if (groups) {
            groups[made] = *in;
            groups[made].sm_count = each;
        }
        left -= each;
        made++;
    }
    *n = made;
    if (rest) {
        *rest = *in;
        rest->sm_count = left;
    }
    return OK;
}
CUresult cuDevResourceGenerateDesc(void** desc, DevResource* res, unsigned count) {
    if (count != 1 || !res) return NOT_SUPPORTED;
    *desc = new DevResource(*res);
    return OK;
}
static int green_contexts[64];
static std::atomic<int> green_made{0};
CUresult cuGreenCtxCreate(void** green, void*, int, unsigned) {
    int i = green_made++;
    if (i >= 64) return OUT_OF_MEMORY;
    *green = &green_contexts[i];
    return OK;
}
CUresult cuCtxFromGreenCtx(void** ctx, void* green) {
    *ctx = green;
    return OK;
}

// CUDA IPC between processes: an exported allocation moves, in place, onto a memfd (its
// contents copied over), and the handle names the exporter's pid and that descriptor; the
// importer maps the same pages through /proc. Both processes then read and write one memory.
struct IpcHandle {  // within CUipcMemHandle's 64 bytes
    unsigned magic;
    int pid, fd;
    unsigned long long offset, len, body;
};
static_assert(sizeof(IpcHandle) <= 64, "CUipcMemHandle is 64 bytes");
const unsigned IPC_MAGIC = 0x6b766d65;

CUresult cuIpcGetMemHandle(void* handle, CUdeviceptr ptr) {
    LOCK;
    uintptr_t p = (uintptr_t)ptr;
    auto it = regions.find(p);
    if (it == regions.end()) return INVALID_VALUE;
    Region& r = it->second;
    size_t body = r.map_len - PAGE;
    int fd;
    auto ex = exported.find(p);
    if (ex != exported.end()) {
        fd = ex->second;
    } else {
        fd = memfd_create("kvmesh-emu-ipc", 0);
        if (fd < 0 || ftruncate(fd, (off_t)body) != 0) return OUT_OF_MEMORY;
        std::vector<char> keep(r.map, r.map + body);
        if (mmap(r.map, body, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0) == MAP_FAILED) {
            return OUT_OF_MEMORY;
        }
        memcpy(r.map, keep.data(), body);
        exported[p] = fd;
    }
    IpcHandle h{IPC_MAGIC, getpid(), fd, (unsigned long long)(p - (uintptr_t)r.map),
                (unsigned long long)r.len, (unsigned long long)body};
    memset(handle, 0, 64);
    memcpy(handle, &h, sizeof h);
    return OK;
}
struct RawIpcHandle {  // CUipcMemHandle, passed by value
    char reserved[64];
};
CUresult cuIpcOpenMemHandle_v2(CUdeviceptr* ptr, RawIpcHandle raw, unsigned) {
    LOCK;
    IpcHandle h;
    memcpy(&h, raw.reserved, sizeof h);
    if (h.magic != IPC_MAGIC) return INVALID_VALUE;
    std::string path = "/proc/" + std::to_string(h.pid) + "/fd/" + std::to_string(h.fd);
    int fd = open(path.c_str(), O_RDWR);
    if (fd < 0) return INVALID_VALUE;
    size_t map_len = h.body + PAGE;
    void* m = mmap(nullptr, map_len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED ||
        mmap(m, h.body, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0) == MAP_FAILED) {
        close(fd);
        return OUT_OF_MEMORY;
    }
    close(fd);
    char* p = (char*)m + h.offset;
    regions[(uintptr_t)p] = Region{(char*)m, map_len, (size_t)h.len};
    *ptr = (CUdeviceptr)(uintptr_t)p;
    return OK;
}
CUresult cuIpcCloseMemHandle(CUdeviceptr ptr) {
    LOCK;
    auto it = regions.find((uintptr_t)ptr);
    if (it == regions.end()) return INVALID_VALUE;
    munmap(it->second.map, it->second.map_len);
    regions.erase(it);
    return OK;
}

CUresult cuGetErrorString(CUresult r, const char** s) {
    switch (r) {
        case OK: *s = "no error"; break;
        case INVALID_VALUE: *s = "invalid argument"; break;
        case OUT_OF_MEMORY: *s = "out of memory (the emulator's KVMESH_EMU_MEMORY_MIB)"; break;
        case INVALID_IMAGE: *s = "not a module the kvmesh CUDA emulator compiled"; break;
        case NOT_FOUND: *s = "named symbol not found"; break;
        case LAUNCH_FAILED: *s = "the emulated kernel failed (see its message above)"; break;
        case NOT_SUPPORTED: *s = "operation not supported by the kvmesh CUDA emulator"; break;
        default: *s = "unknown error";
    }
    return OK;
}
CUresult cuGetErrorName(CUresult r, const char** s) { return cuGetErrorString(r, s); }

// ===================================== NVRTC ===============================================

int nvrtcVersion(int* major, int* minor) {
    // Not a real NVRTC's: the backend's PTX cache keys on it, so no real PTX is ever
    // mistaken for the emulator's, nor the other way round.
    *major = 99;
    *minor = 0;
    return 0;
}
int nvrtcCreateProgram(void** prog, const char* src, const char*, int, const char* const*,
                       const char* const*) {
    *prog = new Program{src, "", ""};
    return 0;
}
int nvrtcCompileProgram(void* prog, int n, const char* const* options) {
    std::vector<std::string> opts(options, options + n);
    return compile(*(Program*)prog, opts) == 0 ? 0 : 6;  // NVRTC_ERROR_COMPILATION
}
int nvrtcGetPTXSize(void* prog, size_t* n) {
    *n = ((Program*)prog)->ptx.size() + 1;
    return 0;
}
int nvrtcGetPTX(void* prog, char* out) {
    auto& s = ((Program*)prog)->ptx;
    memcpy(out, s.c_str(), s.size() + 1);
    return 0;
}
int nvrtcGetProgramLogSize(void* prog, size_t* n) {
    *n = ((Program*)prog)->log.size() + 1;
    return 0;
}
int nvrtcGetProgramLog(void* prog, char* out) {
    auto& s = ((Program*)prog)->log;
    memcpy(out, s.c_str(), s.size() + 1);
    return 0;
}
int nvrtcDestroyProgram(void** prog) {
    delete (Program*)*prog;
    *prog = nullptr;
    return 0;
}
const char* nvrtcGetErrorString(int r) { return r == 0 ? "NVRTC_SUCCESS" : "compilation failed"; }

// ===================================== cuBLAS ==============================================

struct Blas {
    void* stream;
};
int cublasCreate_v2(void** h) {
    *h = new Blas{nullptr};
    return 0;
}
int cublasDestroy_v2(void* h) {
    delete (Blas*)h;
    return 0;
}
int cublasSetStream_v2(void* h, void* s) {
    ((Blas*)h)->stream = s;
    return 0;
}
int cublasSetMathMode(void*, int) { return 0; }
int cublasSetWorkspace_v2(void*, void*, size_t) { return 0; }

// Round to nearest even, as the device's conversion does (NaN kept a quiet NaN).
static unsigned short f32_to_bf16(float f) {
    unsigned u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

// Column-major C = alpha op(A) op(B) + beta C with f32 sums, bf16 or f32 inputs, f32 output
// or (ct 14) bf16, rounded once from the f32 result (what gemm_bf16_f32 and gemm_bf16_bf16
// ask for); alpha and beta are read when called, as in host pointer mode.
static void gemm(int ta, int tb, int m, int n, int k, float al, const void* A, int at, int lda,
                 const void* B, int bt, int ldb, float be, void* C, int ct, int ldc) {
    std::vector<float> col((size_t)k);
    for (int j = 0; j < n; j++) {
        for (int p = 0; p < k; p++) {
            size_t bi = tb ? (size_t)j + (size_t)p * ldb : (size_t)p + (size_t)j * ldb;
            col[(size_t)p] = load_as_f32(B, bt, bi);
        }
        for (int i = 0; i < m; i++) {
            float acc = 0.0f;
            for (int p = 0; p < k; p++) {
                size_t ai = ta ? (size_t)p + (size_t)i * lda : (size_t)i + (size_t)p * lda;
                acc += load_as_f32(A, at, ai) * col[(size_t)p];
            }
            size_t ci = (size_t)i + (size_t)j * ldc;
            if (ct == 14) {
                unsigned short* c = (unsigned short*)C;
                float old = load_as_f32(C, 14, ci);
                c[ci] = f32_to_bf16(be == 0.0f ? al * acc : al * acc + be * old);
            } else {
                float& out = ((float*)C)[ci];
                out = be == 0.0f ? al * acc : al * acc + be * out;
            }
        }
    }
}

int cublasGemmEx(void* h, int ta, int tb, int m, int n, int k, const void* alpha, const void* A,
                 int at, int lda, const void* B, int bt, int ldb, const void* beta, void* C, int ct,
                 int ldc, int, int) {
    LOCK;
    if ((ct != 0 && ct != 14) || (at != 0 && at != 14) || (bt != 0 && bt != 14)) {
        return 15;  // CUBLAS_STATUS_NOT_SUPPORTED
    }
    float al = *(const float*)alpha, be = *(const float*)beta;
    Op op;
    op.kind = Op::CALL;
    op.call = [=] { gemm(ta, tb, m, n, k, al, A, at, lda, B, bt, ldb, be, C, ct, ldc); };
    return issue(((Blas*)h)->stream, std::move(op)) == OK ? 0 : 13;
}

#include "cublaslt.h"

}  // extern "C"
