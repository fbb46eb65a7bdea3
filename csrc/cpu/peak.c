/* peak.c: the FMA-throughput probe. */
#include "peak.h"

#include <time.h>

#include "isa.h"
#include "simd.h"

#define GY_PEAK_CHAINS 12
#define GY_PEAK_MAX_TASKS 256

typedef struct {
    int64_t iters;                     /* per task; each iteration is GY_PEAK_CHAINS vector FMAs */
    float sink[GY_PEAK_MAX_TASKS];     /* keeps the chains' results alive */
} gy_peak_ctx;

static double gy_peak_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void gy_peak_task(void *ctx, int64_t task, int64_t n_tasks) {
    gy_peak_ctx *c = (gy_peak_ctx *)ctx;
    /* acc -> acc * a + b converges to b / (1 - a) = 1: no overflow, no subnormals. */
    const float a = 0.999f, b = 0.001f;
    float s = 0.0f;
#if GY_CPU_HAVE_AVX512
    if (gy_cpu_isa_get() == GY_CPU_ISA_AVX512) {
        const __m512 av = _mm512_set1_ps(a), bv = _mm512_set1_ps(b);
        __m512 acc[GY_PEAK_CHAINS];
#pragma GCC unroll 12
        for (int i = 0; i < GY_PEAK_CHAINS; i++) acc[i] = _mm512_set1_ps((float)(i + task));
        for (int64_t it = 0; it < c->iters; it++)
#pragma GCC unroll 12
            for (int i = 0; i < GY_PEAK_CHAINS; i++) acc[i] = _mm512_fmadd_ps(acc[i], av, bv);
#pragma GCC unroll 12
        for (int i = 0; i < GY_PEAK_CHAINS; i++) s += _mm512_reduce_add_ps(acc[i]);
        c->sink[task] = s;
        return;
    }
#endif
    float acc[GY_PEAK_CHAINS][16];
    for (int i = 0; i < GY_PEAK_CHAINS; i++)
        for (int l = 0; l < 16; l++) acc[i][l] = (float)(i + l + task);
    for (int64_t it = 0; it < c->iters; it++)
        for (int i = 0; i < GY_PEAK_CHAINS; i++)
            for (int l = 0; l < 16; l++) acc[i][l] = acc[i][l] * a + b; /* contracted to FMA by -O3 */
    for (int i = 0; i < GY_PEAK_CHAINS; i++)
        for (int l = 0; l < 16; l++) s += acc[i][l];
    c->sink[task] = s;
}

gy_status gy_cpu_fma_peak(double *flops_out, double seconds, gy_threadpool *pool) {
    if (flops_out == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_cpu_fma_peak: NULL output");
    if (!(seconds > 0 && seconds <= 10))
        return GY_FAIL(GY_ERR_INVALID, "gy_cpu_fma_peak: seconds=%g must be in (0, 10]", seconds);
    int64_t tasks = gy_threadpool_size(pool);
    if (tasks > GY_PEAK_MAX_TASKS) tasks = GY_PEAK_MAX_TASKS;
    gy_peak_ctx c = {.iters = 1 << 14};
    /* Warm up (wakes the workers, settles the clock) and calibrate the run length. */
    double elapsed = 0;
    while (elapsed < 0.005 && c.iters < ((int64_t)1 << 40)) {
        c.iters *= 2;
        const double t0 = gy_peak_now();
        GY_TRY(gy_threadpool_run(pool, gy_peak_task, &c, tasks));
        elapsed = gy_peak_now() - t0;
    }
    c.iters = (int64_t)((double)c.iters * seconds / elapsed) + 1;
    double best = 0;
    for (int rep = 0; rep < 3; rep++) {
        const double t0 = gy_peak_now();
        GY_TRY(gy_threadpool_run(pool, gy_peak_task, &c, tasks));
        const double t = gy_peak_now() - t0;
        const double flops = (double)tasks * (double)c.iters * GY_PEAK_CHAINS * 16.0 * 2.0 / t;
        if (flops > best) best = flops;
    }
    *flops_out = best;
    return GY_OK;
}
