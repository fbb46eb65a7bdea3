/* kernel_emu.cpp: the launches of kernel_emu.h: a grid's blocks one after the other, a block's
 * threads as fibers (or one after the other, built with GY_EMU_SERIAL), on the stream of the
 * emulated runtime (runtime.c: gy_emu_launch puts the launch in the stream's order).
 *
 * Scheduling: the fibers of a block run in thread order, each until it waits at a barrier or
 * ends; a barrier opens once every thread of the block (__syncthreads) or every lane of the warp
 * (shuffles, ballots, __syncwarp) waits at it. Nothing runnable while some fibers wait is a
 * deadlock: the program prints where each thread waits and aborts. Fiber launches run one at a
 * time (a lock), since __shared__ variables are statics. */
#include <mutex>
#include <vector>

#ifndef GY_EMU_SERIAL
#include <ucontext.h>
#endif

#include "kernel_emu.h"
#include "gpu_emu.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#define GY_EMU_ASAN 1
#else
#define GY_EMU_ASAN 0
#endif

thread_local gy_emu_dim gy_emu_thread_idx, gy_emu_block_idx, gy_emu_block_dim, gy_emu_grid_dim;

namespace {

#ifndef GY_EMU_SERIAL

enum { RUNNING, WAIT_BLOCK, WAIT_WARP, DONE };

constexpr size_t kStack = 512 * 1024;

/* A fiber runs thread after thread: once a block's thread ends, the fiber waits for the next
 * block and runs its thread of the same index there, so stacks and contexts are made once, not
 * once a block. It is entered the first time through makecontext/swapcontext and afterwards
 * with the compiler's __builtin_setjmp/__builtin_longjmp, which switch stacks without the
 * signal-mask system calls of swapcontext, nor the whole-stack unpoisoning AddressSanitizer
 * does in the longjmp it intercepts (no frame is ever abandoned here: every switch resumes). */
struct Fiber {
    ucontext_t ctx;
    void *jb[5];
    bool started = false;
    char *stack = nullptr;
    int state = RUNNING;
    const char *where = "";
};

struct Block {
    std::vector<Fiber *> fibers;
    int current = -1;
    std::vector<uint64_t> slots; /* 32 per warp */
    std::vector<unsigned char> smem;
    const std::function<void()> *body = nullptr;
};

/* Every fiber made so far, the first `threads` of which run a block; used under g_launches. */
std::vector<Fiber *> g_fibers;
ucontext_t g_scheduler;
void *g_scheduler_jb[5];
Block *g_block = nullptr;
#if GY_EMU_ASAN
void *g_sched_fake_stack = nullptr;
const void *g_sched_bottom = nullptr; /* the scheduler's stack, as ASan reports it */
size_t g_sched_size = 0;
#endif

/* The two functions that switch stacks: not instrumented, so that the compiler puts no
 * __asan_handle_no_return (a system call and the unpoisoning of the whole stack) before their
 * __builtin_longjmp. */
#define GY_EMU_SWITCHES __attribute__((no_sanitize_address))

/* Back to the scheduler from the current fiber (its state says why). */
GY_EMU_SWITCHES void yield_to_scheduler() {
    Fiber &f = *g_block->fibers[g_block->current];
#if GY_EMU_ASAN
    void *fake = nullptr;
    __sanitizer_start_switch_fiber(&fake, g_sched_bottom, g_sched_size);
#endif
    if (__builtin_setjmp(f.jb) == 0) __builtin_longjmp(g_scheduler_jb, 1);
#if GY_EMU_ASAN
    __sanitizer_finish_switch_fiber(fake, &g_sched_bottom, &g_sched_size);
#endif
}

void fiber_main() {
#if GY_EMU_ASAN
    __sanitizer_finish_switch_fiber(nullptr, &g_sched_bottom, &g_sched_size);
#endif
    for (;;) {
        (*g_block->body)();
        g_block->fibers[g_block->current]->state = DONE;
        yield_to_scheduler(); /* resumed for the same thread of a later block */
    }
}

GY_EMU_SWITCHES void run_fiber(int i) {
    Block &b = *g_block;
    Fiber &f = *b.fibers[i];
    b.current = i;
    gy_emu_thread_idx = {(unsigned)i, 0, 0};
#if GY_EMU_ASAN
    __sanitizer_start_switch_fiber(&g_sched_fake_stack, f.stack, kStack);
#endif
    if (__builtin_setjmp(g_scheduler_jb) == 0) {
        if (!f.started) {
            f.started = true;
            swapcontext(&g_scheduler, &f.ctx);
        } else {
            __builtin_longjmp(f.jb, 1);
        }
    }
#if GY_EMU_ASAN
    __sanitizer_finish_switch_fiber(g_sched_fake_stack, nullptr, nullptr);
#endif
}

Fiber *new_fiber() {
    Fiber *f = new Fiber;
    f->stack = (char *)malloc(kStack);
    getcontext(&f->ctx);
    f->ctx.uc_stack.ss_sp = f->stack;
    f->ctx.uc_stack.ss_size = kStack;
    f->ctx.uc_link = nullptr;
    makecontext(&f->ctx, fiber_main, 0);
    return f;
}

[[noreturn]] void deadlock() {
    Block &b = *g_block;
    fprintf(stderr, "kernel_emu: deadlock in block %u of %u (%u threads):\n", gy_emu_block_idx.x,
            gy_emu_grid_dim.x, gy_emu_block_dim.x);
    for (size_t i = 0; i < b.fibers.size(); i++)
        fprintf(stderr, "  thread %zu (warp %zu lane %zu): %s %s\n", i, i / 32, i % 32,
                b.fibers[i]->state == DONE ? "ended" : "waits at", b.fibers[i]->where);
    abort();
}

void run_block(unsigned threads, size_t smem, const std::function<void()> &body) {
    Block b;
    g_block = &b;
    b.body = &body;
    while (g_fibers.size() < threads) g_fibers.push_back(new_fiber());
    b.fibers.assign(g_fibers.begin(), g_fibers.begin() + threads);
    for (Fiber *f : b.fibers) f->state = RUNNING;
    b.slots.assign((threads + 31) / 32 * 32, 0);
    b.smem.assign(smem ? smem : 1, 0xff); /* NaN bytes: unwritten shared memory shows */
    const unsigned warps = (threads + 31) / 32;
    for (;;) {
        for (unsigned i = 0; i < threads; i++)
            if (b.fibers[i]->state == RUNNING) run_fiber((int)i);
        /* every fiber ran until it waits or ends: open the barriers everyone has reached */
        unsigned done = 0, at_block = 0;
        for (Fiber *f : b.fibers) {
            done += f->state == DONE;
            at_block += f->state == WAIT_BLOCK;
        }
        if (done == threads) break;
        bool opened = false;
        if (at_block == threads) {
            for (Fiber *f : b.fibers) f->state = RUNNING;
            opened = true;
        } else {
            for (unsigned w = 0; w < warps; w++) {
                unsigned at_warp = 0, lanes = 0;
                for (unsigned l = 32 * w; l < threads && l < 32 * w + 32; l++, lanes++)
                    at_warp += b.fibers[l]->state == WAIT_WARP;
                if (at_warp == lanes) {
                    for (unsigned l = 32 * w; l < 32 * w + lanes; l++) b.fibers[l]->state = RUNNING;
                    opened = true;
                }
            }
        }
        if (!opened) deadlock(); /* a barrier must open now */
    }
    g_block = nullptr;
}

std::mutex g_launches; /* one fiber launch at a time: __shared__ variables are statics */

#else /* GY_EMU_SERIAL */

thread_local std::vector<unsigned char> g_smem;

void run_block(unsigned threads, size_t smem, const std::function<void()> &body) {
    g_smem.assign(smem ? smem : 1, 0xff); /* NaN bytes: unwritten shared memory shows */
    for (unsigned i = 0; i < threads; i++) {
        gy_emu_thread_idx = {i, 0, 0};
        body();
    }
}

[[noreturn]] void serial_refuses(const char *what) {
    fprintf(stderr,
            "kernel_emu: %s in a serial build (GY_EMU_SERIAL): it runs only kernels without "
            "barriers and warp collectives; the kernel emulator (run.py kernels) runs the rest\n",
            what);
    abort();
}

#endif

struct Launch {
    unsigned grid, block;
    size_t smem;
    std::function<void()> body;
};

void run_launch(void *p) {
    Launch *l = static_cast<Launch *>(p);
    {
#ifndef GY_EMU_SERIAL
        std::lock_guard<std::mutex> one_at_a_time(g_launches);
#endif
        gy_emu_grid_dim = {l->grid, 1, 1};
        gy_emu_block_dim = {l->block, 1, 1};
        for (unsigned b = 0; b < l->grid; b++) {
            gy_emu_block_idx = {b, 0, 0};
            run_block(l->block, l->smem, l->body);
        }
    }
    delete l;
}

} // namespace

#ifndef GY_EMU_SERIAL

int gy_emu_lane() { return g_block->current % 32; }

uint64_t *gy_emu_warp_slots() { return &g_block->slots[g_block->current / 32 * 32]; }

void *gy_emu_dynamic_smem() { return g_block->smem.data(); }

void gy_emu_sync(int kind, const char *what) {
    if (kind == 1 && gy_emu_block_dim.x % 32 != 0) {
        fprintf(stderr, "kernel_emu: %s in a block of %u threads\n", what, gy_emu_block_dim.x);
        abort();
    }
    Fiber &f = *g_block->fibers[g_block->current];
    f.state = kind == 0 ? WAIT_BLOCK : WAIT_WARP;
    f.where = what;
    yield_to_scheduler();
}

#else

int gy_emu_lane() { return (int)(gy_emu_thread_idx.x % 32); }

uint64_t *gy_emu_warp_slots() { serial_refuses("a warp collective"); }

void *gy_emu_dynamic_smem() { return g_smem.data(); }

void gy_emu_sync(int kind, const char *what) {
    (void)kind;
    serial_refuses(what);
}

#endif

void gy_emu_check_mask(unsigned mask, const char *what) {
    if (mask != 0xffffffffu) {
        fprintf(stderr, "kernel_emu: %s with a partial mask %#x is not emulated\n", what, mask);
        abort();
    }
}

void gy_emu_launch_grid(unsigned grid, unsigned block, size_t smem, cudaStream_t stream,
                        std::function<void()> body) {
    if (grid == 0 || block == 0 || block > 1024) {
        fprintf(stderr, "kernel_emu: bad launch <<<%u, %u>>>\n", grid, block);
        abort();
    }
    /* GY_EMU_MAX_GRID caps the grid: the kernels are grid-stride loops, so the result must not
     * change, and a small grid exercises the loops. */
    const char *cap = getenv("GY_EMU_MAX_GRID");
    if (cap != nullptr && atoi(cap) > 0 && grid > (unsigned)atoi(cap)) grid = (unsigned)atoi(cap);
    Launch *l = new Launch{grid, block, smem, std::move(body)};
    if (gy_emu_launch(stream, run_launch, l) != cudaSuccess) delete l; /* left for the check */
}
