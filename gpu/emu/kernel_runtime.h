// kvmesh's CUDA emulator, kernel side: the block scheduler, compiled after the kernels and
// their entry points (see kernel_prelude.h). `kvmesh_emu_run` runs one launch on the calling
// thread and returns 0, or 1 with a message in `err`.

#if !defined(__x86_64__)
#error "the emulator's fiber switch is written for x86-64"
#endif

// Saves the callee-saved registers on the current stack and its pointer in *from, then
// takes *to's stack and registers and returns there: a function call's worth of work, where
// swapcontext makes a system call and longjmp unwinds cleanup handlers.
asm(R"(
    .text
    .globl kvmesh_emu_switch
    .type kvmesh_emu_switch, @function
kvmesh_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq (%rsi), %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size kvmesh_emu_switch, .-kvmesh_emu_switch
)");

namespace emu {

Launch* launch = nullptr;
Fiber* cur = nullptr;

// Each fiber's stack: room for a kernel's register arrays many times over; pages are only
// backed once touched.
constexpr unsigned long STACK = 256 * 1024;
constexpr int MAX_THREADS = 1024;

// This thread's fibers, started once and kept from launch to launch: after a block a fiber
// waits, and the next block or launch resumes it where it waits (starting a fiber costs
// system calls, resuming one does not). A launch that fails leaves them mid-kernel, so they
// are all started afresh after one.
struct Pool {
    char* stacks = nullptr;
    Fiber* fibers = nullptr;
    bool get() {
        if (!stacks) {
            void* p = mmap(nullptr, MAX_THREADS * STACK, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
            if (p == MAP_FAILED) return false;
            stacks = (char*)p;
            fibers = new Fiber[MAX_THREADS];
            restart();
        }
        return true;
    }
    void restart() {
        for (int i = 0; i < MAX_THREADS; i++) fibers[i].started = false;
    }
};
thread_local Pool pool;

// A fiber runs the kernel once per block of the launch: after each, it waits to be started
// again with the next block's index.
[[noreturn]] void fiber_main() {
    for (;;) {
        launch->entry(launch->args);
        wait(DONE);
    }
}

void resume(Launch& L, Fiber& f) {
    cur = &f;
    kvmesh_emu_switch(&L.scheduler, &f.ctx);
}

// A fresh fiber on `stack`: its first resume "returns" into fiber_main, entered as a call
// is (the stack 16-byte aligned before the return address), with zeros for the registers.
void start(Fiber& f, char* stack_end) {
    void** sp = (void**)((uintptr_t)stack_end & ~(uintptr_t)15);
    *--sp = nullptr;               // fiber_main's own return address: it never returns
    *--sp = (void*)&fiber_main;    // where kvmesh_emu_switch's ret goes
    for (int i = 0; i < 6; i++) *--sp = nullptr;  // rbp, rbx, r12 .. r15
    f.ctx.sp = sp;
    f.started = true;
}

// Lets every fiber run to its next meeting point (in thread order, or the reverse with
// KVMESH_EMU_SCHEDULE=reverse: a thread that reads shared memory another overwrites with no
// barrier between shows up in one order or the other, since each runs on to its next
// barrier before the next thread starts), then releases the warps whose live lanes
// all wait at a warp exchange, else the block if all its live threads wait at
// __syncthreads. Returns false where neither holds: threads waiting at different barriers.
bool run_block(Launch& L, bool reverse) {
    for (;;) {
        for (int n = 0; n < L.threads; n++) {
            int i = reverse ? L.threads - 1 - n : n;
            if (L.fibers[i].state == RUN) resume(L, L.fibers[i]);
        }
        int live = 0, at_block = 0;
        bool released = false;
        for (int w = 0; w * 32 < L.threads; w++) {
            Fiber* lane = L.fibers + w * 32;
            int n = L.threads - w * 32 < 32 ? L.threads - w * 32 : 32;
            int lanes = 0, waiting = 0;
            for (int l = 0; l < n; l++) {
                State st = lane[l].state;
                lanes += st != DONE;
                waiting += st == WARP_WAIT;
                at_block += st == BLOCK_WAIT;
            }
            live += lanes;
            if (lanes > 0 && waiting == lanes) {
                for (int l = 0; l < n; l++) {
                    if (lane[l].state == WARP_WAIT) lane[l].state = RUN;
                }
                released = true;
            }
        }
        if (live == 0) return true;
        if (!released && at_block == live) {
            for (int i = 0; i < L.threads; i++) {
                if (L.fibers[i].state == BLOCK_WAIT) L.fibers[i].state = RUN;
            }
            released = true;
        }
        if (!released) return false;
    }
}

}  // namespace emu

extern "C" int kvmesh_emu_run(void (*entry)(void**), const unsigned* grid, const unsigned* block,
                              void** args, char* err, int errlen) {
    using namespace emu;
    int threads = (int)(block[0] * block[1] * block[2]);
    if (threads <= 0 || threads > MAX_THREADS) {
        snprintf(err, errlen, "a block of %d threads", threads);
        return 1;
    }
    if (!pool.get()) {
        snprintf(err, errlen, "no memory for %d fiber stacks", MAX_THREADS);
        return 1;
    }
    Launch* L = new Launch();
    L->grid = {grid[0], grid[1], grid[2]};
    L->block = {block[0], block[1], block[2]};
    L->threads = threads;
    L->fibers = pool.fibers;
    L->entry = entry;
    L->args = args;
    Launch* outer = launch;
    launch = L;
    for (int i = 0; i < threads; i++) {
        Fiber& f = L->fibers[i];
        if (!f.started) start(f, pool.stacks + (unsigned long)(i + 1) * STACK);
        f.tid = {(unsigned)i % block[0], ((unsigned)i / block[0]) % block[1],
                 (unsigned)i / (block[0] * block[1])};
        f.lane = i % 32;
        f.warp = i / 32;
    }
    const char* schedule = getenv("KVMESH_EMU_SCHEDULE");
    bool reverse = schedule && strcmp(schedule, "reverse") == 0;
    int rc = 0;
    // Blocks one after another (in reverse order too with the reverse schedule: no block may
    // count on another having run first).
    unsigned long blocks = (unsigned long)grid[0] * grid[1] * grid[2];
    for (unsigned long n = 0; n < blocks && rc == 0; n++) {
        unsigned long b = reverse ? blocks - 1 - n : n;
        unsigned x = (unsigned)(b % grid[0]), y = (unsigned)((b / grid[0]) % grid[1]);
        unsigned z = (unsigned)(b / ((unsigned long)grid[0] * grid[1]));
        L->block_idx = {x, y, z};
        for (int i = 0; i < threads; i++) {
            L->fibers[i].state = RUN;
            L->fibers[i].gen = 0;
        }
        if (!run_block(*L, reverse)) {
            snprintf(err, errlen,
                     "block (%u, %u, %u): its threads wait at different barriers "
                     "(__syncthreads against a warp exchange)",
                     x, y, z);
            rc = 1;
        }
    }
    if (rc != 0) pool.restart();
    launch = outer;
    delete L;
    return rc;
}
