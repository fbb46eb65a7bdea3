/* emu.cpp: the fiber scheduler behind emu.h, and the runtime calls of csrc/kernels/device.cu on
 * host memory (a "device" whose memory is malloc'd and whose streams are already finished).
 *
 * Scheduling: the fibers of a block run in thread order, each until it waits at a barrier or
 * ends; a barrier opens once every thread of the block (__syncthreads) or every lane of the warp
 * (shuffles, ballots, __syncwarp) waits at it. Nothing runnable while some fibers wait is a
 * deadlock: the program prints where each thread waits and aborts. */
#include <setjmp.h>
#include <ucontext.h>

#include <chrono>
#include <vector>

#include "emu.h"
#include "../../csrc/kernels/kernels.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#define GY_EMU_ASAN 1
#else
#define GY_EMU_ASAN 0
#endif

gy_emu_dim gy_emu_block_idx, gy_emu_block_dim, gy_emu_grid_dim;

namespace {

enum { RUNNING, WAIT_BLOCK, WAIT_WARP, DONE };

constexpr size_t kStack = 512 * 1024;

/* A fiber is entered the first time through makecontext/swapcontext and afterwards with
 * _setjmp/_longjmp, which switch stacks without the signal-mask system calls of swapcontext. */
struct Fiber {
    ucontext_t ctx;
    jmp_buf jb;
    bool started = false;
    char *stack = nullptr;
    int state = RUNNING;
    const char *where = "";
};

struct Block {
    std::vector<Fiber> fibers;
    ucontext_t scheduler;
    jmp_buf scheduler_jb;
    int current = -1;
    std::vector<uint64_t> slots; /* 32 per warp */
    std::vector<unsigned char> smem;
    const std::function<void()> *body = nullptr;
    void *sched_fake_stack = nullptr;
};

Block *g_block = nullptr;
#if GY_EMU_ASAN
const void *g_sched_bottom = nullptr; /* the scheduler's stack, as ASan reports it */
size_t g_sched_size = 0;
#endif

void fiber_main() {
#if GY_EMU_ASAN
    __sanitizer_finish_switch_fiber(nullptr, &g_sched_bottom, &g_sched_size);
#endif
    (*g_block->body)();
    Fiber &f = g_block->fibers[g_block->current];
    f.state = DONE;
#if GY_EMU_ASAN
    __sanitizer_start_switch_fiber(nullptr, g_sched_bottom, g_sched_size); /* never resumes */
#endif
    _longjmp(g_block->scheduler_jb, 1);
}

/* Back to the scheduler from the current fiber (its state says why). */
void yield_to_scheduler() {
    Fiber &f = g_block->fibers[g_block->current];
#if GY_EMU_ASAN
    void *fake = nullptr;
    __sanitizer_start_switch_fiber(&fake, g_sched_bottom, g_sched_size);
#endif
    if (_setjmp(f.jb) == 0) _longjmp(g_block->scheduler_jb, 1);
#if GY_EMU_ASAN
    __sanitizer_finish_switch_fiber(fake, &g_sched_bottom, &g_sched_size);
#endif
}

void run_fiber(int i) {
    Block &b = *g_block;
    Fiber &f = b.fibers[i];
    b.current = i;
#if GY_EMU_ASAN
    __sanitizer_start_switch_fiber(&b.sched_fake_stack, f.stack, kStack);
#endif
    if (_setjmp(b.scheduler_jb) == 0) {
        if (!f.started) {
            f.started = true;
            swapcontext(&b.scheduler, &f.ctx);
        } else {
            _longjmp(f.jb, 1);
        }
    }
#if GY_EMU_ASAN
    __sanitizer_finish_switch_fiber(b.sched_fake_stack, nullptr, nullptr);
#endif
}

[[noreturn]] void deadlock() {
    Block &b = *g_block;
    fprintf(stderr, "cuda_emu: deadlock in block %u of %u (%u threads):\n", gy_emu_block_idx.x,
            gy_emu_grid_dim.x, gy_emu_block_dim.x);
    for (size_t i = 0; i < b.fibers.size(); i++)
        fprintf(stderr, "  thread %zu (warp %zu lane %zu): %s %s\n", i, i / 32, i % 32,
                b.fibers[i].state == DONE ? "ended" : "waits at", b.fibers[i].where);
    abort();
}

void run_block(unsigned threads, size_t smem, const std::function<void()> &body) {
    Block b;
    g_block = &b;
    b.body = &body;
    b.fibers.resize(threads);
    b.slots.assign((threads + 31) / 32 * 32, 0);
    b.smem.assign(smem ? smem : 1, 0xff); /* NaN bytes: unwritten shared memory shows */
    for (unsigned i = 0; i < threads; i++) {
        Fiber &f = b.fibers[i];
        f.stack = (char *)malloc(kStack);
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = f.stack;
        f.ctx.uc_stack.ss_size = kStack;
        f.ctx.uc_link = nullptr;
        makecontext(&f.ctx, fiber_main, 0);
    }
    const unsigned warps = (threads + 31) / 32;
    for (;;) {
        bool ran = false;
        for (unsigned i = 0; i < threads; i++)
            if (b.fibers[i].state == RUNNING) {
                run_fiber((int)i);
                ran = true;
            }
        /* open the barriers everyone has reached */
        unsigned done = 0, at_block = 0;
        for (auto &f : b.fibers) {
            done += f.state == DONE;
            at_block += f.state == WAIT_BLOCK;
        }
        if (done == threads) break;
        bool opened = false;
        if (at_block == threads) {
            for (auto &f : b.fibers) f.state = RUNNING;
            opened = true;
        } else {
            for (unsigned w = 0; w < warps; w++) {
                unsigned at_warp = 0, lanes = 0;
                for (unsigned l = 32 * w; l < threads && l < 32 * w + 32; l++, lanes++)
                    at_warp += b.fibers[l].state == WAIT_WARP;
                if (at_warp == lanes) {
                    for (unsigned l = 32 * w; l < 32 * w + lanes; l++) b.fibers[l].state = RUNNING;
                    opened = true;
                }
            }
        }
        /* every fiber ran until it waits or ends: a barrier must open now */
        (void)ran;
        if (!opened) deadlock();
    }
    for (auto &f : b.fibers) free(f.stack);
    g_block = nullptr;
}

} // namespace

gy_emu_dim gy_emu_thread_idx() { return {(unsigned)g_block->current, 0, 0}; }

int gy_emu_lane() { return g_block->current % 32; }

uint64_t *gy_emu_warp_slots() { return &g_block->slots[g_block->current / 32 * 32]; }

void *gy_emu_dynamic_smem() { return g_block->smem.data(); }

void gy_emu_check_mask(unsigned mask, const char *what) {
    if (mask != 0xffffffffu) {
        fprintf(stderr, "cuda_emu: %s with a partial mask %#x is not emulated\n", what, mask);
        abort();
    }
}

void gy_emu_sync(int kind, const char *what) {
    if (kind == 1 && gy_emu_block_dim.x % 32 != 0) {
        fprintf(stderr, "cuda_emu: %s in a block of %u threads\n", what, gy_emu_block_dim.x);
        abort();
    }
    Fiber &f = g_block->fibers[g_block->current];
    f.state = kind == 0 ? WAIT_BLOCK : WAIT_WARP;
    f.where = what;
    yield_to_scheduler();
}

void gy_emu_run_grid(unsigned grid, unsigned block, size_t smem,
                     const std::function<void()> &body) {
    if (grid == 0 || block == 0 || block > 1024) {
        fprintf(stderr, "cuda_emu: bad launch <<<%u, %u>>>\n", grid, block);
        abort();
    }
    /* GY_EMU_MAX_GRID caps the grid: the kernels are grid-stride loops, so the result must not
     * change, and a small grid exercises the loops. */
    const char *cap = getenv("GY_EMU_MAX_GRID");
    if (cap != nullptr && atoi(cap) > 0 && grid > (unsigned)atoi(cap)) grid = (unsigned)atoi(cap);
    gy_emu_grid_dim = {grid, 1, 1};
    gy_emu_block_dim = {block, 1, 1};
    for (unsigned b = 0; b < grid; b++) {
        gy_emu_block_idx = {b, 0, 0};
        run_block(block, smem, body);
    }
}

/* ---- the runtime of device.cu, on host memory ---- */

extern "C" cudaError_t cudaGetLastError(void) { return cudaSuccess; }

extern "C" gy_status gy_cuda_device_count(int32_t *count) {
    *count = 1;
    return GY_OK;
}

extern "C" gy_status gy_cuda_device_info_get(gy_cuda_device_info *out, int32_t device) {
    memset(out, 0, sizeof *out);
    if (device != 0) return GY_FAIL(GY_ERR_INVALID, "the emulator has one device");
    snprintf(out->name, sizeof out->name, "cuda_emu (host fibers)");
    out->major = 9;
    out->multiprocessors = 1;
    out->total_bytes = out->free_bytes = (uint64_t)1 << 34;
    return GY_OK;
}

extern "C" gy_status gy_cuda_set_device(int32_t device) {
    return device == 0 ? GY_OK : GY_FAIL(GY_ERR_INVALID, "the emulator has one device");
}

extern "C" gy_status gy_cuda_malloc(void **ptr, uint64_t bytes) {
    /* 256-byte aligned like cudaMalloc, filled with garbage */
    const size_t n = (bytes ? bytes : 1) + 255;
    *ptr = aligned_alloc(256, n / 256 * 256);
    if (*ptr == nullptr) return GY_FAIL(GY_ERR_OUT_OF_MEMORY, "emulated cudaMalloc");
    memset(*ptr, 0xa5, n / 256 * 256);
    return GY_OK;
}

extern "C" void gy_cuda_free(void *ptr) { free(ptr); }

extern "C" gy_status gy_cuda_memcpy_htod(void *dst, const void *src, uint64_t bytes) {
    if (bytes) memcpy(dst, src, bytes);
    return GY_OK;
}

extern "C" gy_status gy_cuda_memcpy_dtoh(void *dst, const void *src, uint64_t bytes) {
    if (bytes) memcpy(dst, src, bytes);
    return GY_OK;
}

extern "C" gy_status gy_cuda_memcpy_dtod(void *dst, const void *src, uint64_t bytes,
                                         gy_cuda_stream) {
    if (bytes) memmove(dst, src, bytes);
    return GY_OK;
}

extern "C" gy_status gy_cuda_memset(void *dst, int value, uint64_t bytes) {
    if (bytes) memset(dst, value, bytes);
    return GY_OK;
}

extern "C" gy_status gy_cuda_stream_synchronize(gy_cuda_stream) { return GY_OK; }

struct CUevent_st {
    std::chrono::steady_clock::time_point t;
};

extern "C" gy_status gy_cuda_event_create(gy_cuda_event *out) {
    *out = new CUevent_st;
    return GY_OK;
}

extern "C" void gy_cuda_event_destroy(gy_cuda_event event) { delete event; }

extern "C" gy_status gy_cuda_event_record(gy_cuda_event event, gy_cuda_stream) {
    event->t = std::chrono::steady_clock::now();
    return GY_OK;
}

extern "C" gy_status gy_cuda_event_elapsed_ms(float *ms, gy_cuda_event a, gy_cuda_event b) {
    *ms = std::chrono::duration<float, std::milli>(b->t - a->t).count();
    return GY_OK;
}

gy_status gy_cuda_status(cudaError_t error, const char *what, const char *file,
                         int line) { /* C++ linkage, as common.cuh declares it */
    return gy_error_set(GY_ERR_CUDA, file, line, "%s failed in the emulator (%d)", what,
                        (int)error);
}
