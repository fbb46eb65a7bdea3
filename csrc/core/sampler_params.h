/* sampler_params.h: a request's sampling parameters, as one struct that the CPU sampler
 * (sched/sampler.h, which says what each step does with them) and its CUDA twin
 * (kernels/sampling.h, which reads an array of them on the device) both take. In core/ so that
 * kernels/ needs nothing from sched/; a change of layout here is a change of both, at once. */
#ifndef GY_CORE_SAMPLER_PARAMS_H
#define GY_CORE_SAMPLER_PARAMS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct gy_sampler_params {
    double temperature; /* finite, >= 0; 0 = greedy */
    double top_p;       /* (0, 1]; 1 = off */
    int64_t top_k;      /* [0, vocab]; 0 = off */
    uint64_t seed;      /* per request */
    double min_p;       /* [0, 1]; 0 = off */
    /* vLLM's penalties (sched/logits.h applies them to a row before the sampler reads it). The
     * engine applies them on the host, where it samples for every backend, so the CUDA sampler
     * reads none of them. A zeroed struct means no penalties: repetition_penalty 0 reads as 1. */
    double repetition_penalty; /* > 0; 1 (or 0) = off */
    double frequency_penalty;  /* [-2, 2]; 0 = off */
    double presence_penalty;   /* [-2, 2]; 0 = off */
} gy_sampler_params;

#ifdef __cplusplus
}
#endif
#endif
