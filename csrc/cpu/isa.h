/* isa.h: which instruction set the CPU kernels use.
 *
 * Every kernel has a portable C path and, where the build enables it (-march=native on an AVX-512
 * machine), an AVX-512 path. Both perform the same IEEE operations in the same order, so they give
 * the same bits; the switch exists so that the tests can prove it. The default is the best path
 * compiled in. The choice is process-wide: change it only while no kernel is running. */
#ifndef GY_CPU_ISA_H
#define GY_CPU_ISA_H

#include <stdint.h>

#include "../core/status.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define GY_CPU_HAVE_AVX512 1
#else
#define GY_CPU_HAVE_AVX512 0
#endif

#ifdef __cplusplus
extern "C" {
#endif

typedef enum gy_cpu_isa {
    GY_CPU_ISA_PORTABLE = 0, /* plain C11 (fmaf, loops of 16 lanes the compiler may vectorise) */
    GY_CPU_ISA_AVX512 = 1,   /* AVX-512 F/BW/VL/DQ intrinsics */
    GY_CPU_ISA_COUNT
} gy_cpu_isa;

/* The best path compiled into this build. */
gy_cpu_isa gy_cpu_isa_best(void);
/* The path the kernels use now. */
gy_cpu_isa gy_cpu_isa_get(void);
/* Selects a path; GY_ERR_UNAVAILABLE when it is not compiled in. */
gy_status gy_cpu_isa_set(gy_cpu_isa isa);
const char *gy_cpu_isa_name(gy_cpu_isa isa);

#ifdef __cplusplus
}
#endif
#endif
