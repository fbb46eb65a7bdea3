/* isa.c: the process-wide choice of kernel path (tests flip it to compare the paths' bits). */
#include "isa.h"

#include <stdatomic.h>

static _Atomic int gy_cpu_isa_current = GY_CPU_HAVE_AVX512 ? GY_CPU_ISA_AVX512 : GY_CPU_ISA_PORTABLE;

gy_cpu_isa gy_cpu_isa_best(void) {
    return GY_CPU_HAVE_AVX512 ? GY_CPU_ISA_AVX512 : GY_CPU_ISA_PORTABLE;
}

gy_cpu_isa gy_cpu_isa_get(void) {
    return (gy_cpu_isa)atomic_load_explicit(&gy_cpu_isa_current, memory_order_relaxed);
}

gy_status gy_cpu_isa_set(gy_cpu_isa isa) {
    if ((int)isa < 0 || isa >= GY_CPU_ISA_COUNT)
        return GY_FAIL(GY_ERR_INVALID, "unknown CPU kernel path %d (0=portable, 1=avx512)", (int)isa);
    if (isa == GY_CPU_ISA_AVX512 && !GY_CPU_HAVE_AVX512)
        return GY_FAIL(GY_ERR_UNAVAILABLE,
                       "the AVX-512 kernels are not compiled into this build (needs -march with "
                       "avx512f/bw/vl/dq)");
    atomic_store_explicit(&gy_cpu_isa_current, (int)isa, memory_order_relaxed);
    return GY_OK;
}

const char *gy_cpu_isa_name(gy_cpu_isa isa) {
    switch (isa) {
    case GY_CPU_ISA_PORTABLE: return "portable";
    case GY_CPU_ISA_AVX512: return "avx512";
    default: return "unknown";
    }
}
