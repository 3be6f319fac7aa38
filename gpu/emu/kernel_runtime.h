// kvmesh's CUDA emulator, kernel side: the block scheduler, compiled after the kernels and
// their entry points (see kernel_prelude.h). `kvmesh_emu_run` runs one launch on the calling
// thread and returns 0, or 1 with a message in `err`.

namespace emu {

thread_local Launch* launch = nullptr;
thread_local Fiber* cur = nullptr;

// Each fiber's stack: room for a kernel's register arrays many times over; pages are only
// backed once touched.
constexpr unsigned long STACK = 256 * 1024;

struct Stacks {
    char* base = nullptr;
    int count = 0;
    char* get(int threads) {
        if (threads > count) {
            if (base) munmap(base, (unsigned long)count * STACK);
            void* p = mmap(nullptr, (unsigned long)threads * STACK, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
            if (p == MAP_FAILED) return nullptr;
            base = (char*)p;
            count = threads;
        }
        return base;
    }
};
thread_local Stacks stacks;

// A fiber runs the kernel once per block of the launch: after each, it waits to be started
// again with the next block's index.
void fiber_main() {
    for (;;) {
        launch->entry(launch->args);
        wait(DONE);
    }
}

void resume(Launch& L, Fiber& f) {
    cur = &f;
    if (!_setjmp(L.scheduler)) {
        if (f.started) {
            _longjmp(f.at, 1);
        }
        f.started = true;
        ucontext_t from;
        swapcontext(&from, &f.ctx);
    }
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
        for (int i = 0; i < L.threads; i++) {
            live += L.fibers[i].state != DONE;
            at_block += L.fibers[i].state == BLOCK_WAIT;
        }
        if (live == 0) return true;
        bool released = false;
        for (int w = 0; w * 32 < L.threads; w++) {
            int lanes = 0, waiting = 0;
            for (int l = 0; l < 32 && w * 32 + l < L.threads; l++) {
                State s = L.fibers[w * 32 + l].state;
                lanes += s != DONE;
                waiting += s == WARP_WAIT;
            }
            if (lanes > 0 && waiting == lanes) {
                for (int l = 0; l < 32 && w * 32 + l < L.threads; l++) {
                    if (L.fibers[w * 32 + l].state == WARP_WAIT) L.fibers[w * 32 + l].state = RUN;
                }
                released = true;
            }
        }
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
    if (threads <= 0 || threads > 1024) {
        snprintf(err, errlen, "a block of %d threads", threads);
        return 1;
    }
    char* stack = stacks.get(threads);
    if (!stack) {
        snprintf(err, errlen, "no memory for %d fiber stacks", threads);
        return 1;
    }
    Launch* L = new Launch();
    L->grid = {grid[0], grid[1], grid[2]};
    L->block = {block[0], block[1], block[2]};
    L->threads = threads;
    L->fibers = new Fiber[threads];
    L->entry = entry;
    L->args = args;
    Launch* outer = launch;
    launch = L;
    for (int i = 0; i < threads; i++) {
        Fiber& f = L->fibers[i];
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = stack + (unsigned long)i * STACK;
        f.ctx.uc_stack.ss_size = STACK;
        f.ctx.uc_link = nullptr;
        makecontext(&f.ctx, fiber_main, 0);
        f.started = false;
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
        for (int i = 0; i < threads; i++) L->fibers[i].state = RUN;
        if (!run_block(*L, reverse)) {
            snprintf(err, errlen,
                     "block (%u, %u, %u): its threads wait at different barriers "
                     "(__syncthreads against a warp exchange)",
                     x, y, z);
            rc = 1;
        }
    }
    launch = outer;
    delete[] L->fibers;
    delete L;
    return rc;
}
