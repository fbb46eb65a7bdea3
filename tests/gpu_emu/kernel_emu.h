/* kernel_emu.h: just enough of CUDA's device side, on the host, to run gyges' kernels
 * (csrc/kernels/*.cu) unchanged without a GPU; kernel_emu.cpp runs the launches.
 *
 * build.py copies each .cu, includes this header instead of the CUDA runtime header and turns
 * every `kernel<<<grid, block, smem, stream>>>(args)` into
 * gy_emu_launch_kernel(grid, block, smem, stream, kernel, args): the arguments are copied, as a
 * launch copies them, and the launch is enqueued on the stream of the emulated runtime
 * (runtime.c), so it runs in the stream's order. Its blocks run one after the other; the threads
 * of a block are fibers (ucontext) scheduled cooperatively on one OS thread, each running until
 * it reaches __syncthreads or a warp collective (shuffle, ballot, __syncwarp), where it waits
 * until every thread of the block, or every lane of its warp, has arrived:
 *   - a barrier that not every participant reaches (a collective inside divergent code) is a
 *     deadlock here and aborts with the place of each thread: on a GPU it is undefined behaviour;
 *   - __shared__ variables are statics (one block at a time, launches one at a time), dynamic
 *     shared memory is a fresh buffer filled with NaN bytes per block, so reading what nobody
 *     wrote shows;
 *   - global memory is host memory, so AddressSanitizer (the kernel build uses it) catches any
 *     read or write out of bounds, in shared memory too.
 * Built with GY_EMU_SERIAL, the threads of a block run one after the other instead, without
 * fibers: for builds that only launch kernels without barriers (comm_d2d.cu's tree sum in the
 * harness, the emulated extension and test_comm.c, on any thread and under ThreadSanitizer);
 * a barrier there aborts and says so.
 * What it cannot show: data races (the schedule is one fixed interleaving), timing, and the
 * device's own arithmetic (expf, exp, division are the host libm's here). */
#ifndef GY_TESTS_KERNEL_EMU_H
#define GY_TESTS_KERNEL_EMU_H

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <functional>
#include <tuple>

using std::max; /* CUDA's integer max and min */
using std::min;

#undef __global__
#undef __device__
#undef __host__
#undef __shared__
#undef __forceinline__
#undef __launch_bounds__
#define __global__
#define __device__
#define __host__
#define __shared__ static
#define __forceinline__ inline
#define __launch_bounds__(...)

struct gy_emu_dim {
    unsigned x, y, z;
};

/* The running thread's place: per OS thread, since streams may run launches on threads of
 * their own. */
extern thread_local gy_emu_dim gy_emu_thread_idx, gy_emu_block_idx, gy_emu_block_dim,
    gy_emu_grid_dim;
#define threadIdx gy_emu_thread_idx
#define blockIdx gy_emu_block_idx
#define blockDim gy_emu_block_dim
#define gridDim gy_emu_grid_dim

/* Collectives: every thread of the block (kind 0) or lane of the warp (kind 1) must arrive. */
void gy_emu_sync(int kind, const char *what);
/* The current lane's slot in its warp's exchange area (8 bytes per lane). */
uint64_t *gy_emu_warp_slots();
int gy_emu_lane();
void gy_emu_check_mask(unsigned mask, const char *what);
/* Dynamic shared memory of the running block. */
void *gy_emu_dynamic_smem();

#define __syncthreads() gy_emu_sync(0, "__syncthreads")
#define __syncwarp(...) gy_emu_sync(1, "__syncwarp")

template <typename T> static inline T gy_emu_shfl(T v, int src) {
    static_assert(sizeof(T) <= 8, "8-byte lanes");
    uint64_t *slots = gy_emu_warp_slots();
    uint64_t bits = 0;
    memcpy(&bits, &v, sizeof v);
    slots[gy_emu_lane()] = bits;
    gy_emu_sync(1, "shuffle");
    T r;
    memcpy(&r, &slots[src & 31], sizeof r);
    gy_emu_sync(1, "shuffle (read)");
    return r;
}

template <typename T> static inline T __shfl_xor_sync(unsigned mask, T v, int off) {
    gy_emu_check_mask(mask, "__shfl_xor_sync");
    return gy_emu_shfl(v, gy_emu_lane() ^ off);
}
template <typename T> static inline T __shfl_up_sync(unsigned mask, T v, unsigned d) {
    gy_emu_check_mask(mask, "__shfl_up_sync");
    const int src = gy_emu_lane() - (int)d;
    return gy_emu_shfl(v, src < 0 ? gy_emu_lane() : src); /* below lane 0: its own value */
}
template <typename T> static inline T __shfl_sync(unsigned mask, T v, int src) {
    gy_emu_check_mask(mask, "__shfl_sync");
    return gy_emu_shfl(v, src);
}
static inline unsigned __ballot_sync(unsigned mask, int pred) {
    gy_emu_check_mask(mask, "__ballot_sync");
    uint64_t *slots = gy_emu_warp_slots();
    slots[gy_emu_lane()] = pred != 0;
    gy_emu_sync(1, "ballot");
    unsigned bits = 0;
    for (int l = 0; l < 32; l++) bits |= (unsigned)(slots[l] != 0) << l;
    gy_emu_sync(1, "ballot (read)");
    return bits;
}
static inline int __any_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) != 0; }

static inline int atomicAdd(int *p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
static inline int __ffs(int x) { return __builtin_ffs(x); }
static inline unsigned __umulhi(unsigned a, unsigned b) {
    return (unsigned)(((uint64_t)a * b) >> 32);
}
static inline float __uint_as_float(unsigned u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static inline unsigned __float_as_uint(float f) {
    unsigned u;
    memcpy(&u, &f, sizeof u);
    return u;
}
template <typename T> static inline T __ldg(const T *p) { return *p; }

/* device math the kernels use that the host libm lacks */
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
/* An add rounded to nearest that the device compiler may not contract into an FMA: on the host
 * every float add is one already. */
static inline float __fadd_rn(float a, float b) { return a + b; }

/* The runtime calls the launchers make. */
template <typename F> static inline cudaError_t cudaFuncSetAttribute(F *, cudaFuncAttribute, int) {
    return cudaSuccess;
}

/* Enqueues the launch of `body` on `stream`; a bad configuration is left for cudaGetLastError. */
void gy_emu_launch_grid(unsigned grid, unsigned block, size_t smem, cudaStream_t stream,
                        std::function<void()> body);

template <typename... P, typename... A>
static inline void gy_emu_launch_kernel(unsigned grid, unsigned block, size_t smem,
                                        cudaStream_t stream, void (*kernel)(P...), A &&...args) {
    /* the arguments converted once to the kernel's parameter types, as a launch copies them */
    std::tuple<P...> params(static_cast<P>(args)...);
    gy_emu_launch_grid(grid, block, smem, stream,
                       [kernel, params]() { std::apply(kernel, params); });
}

#endif
