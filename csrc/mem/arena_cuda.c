/* arena_cuda.c: the CUDA virtual-memory backend of the arena (not yet written: every call
 * reports that the backend is unavailable). */
#include "arena_backend.h"

static gy_status gy_cuda_unavailable(const gy_arena_config *config, void **state, uintptr_t *base) {
    (void)config; (void)state; (void)base;
    return GY_FAIL(GY_ERR_UNAVAILABLE, "the CUDA arena backend is not built into this gyges");
}

const gy_arena_backend_ops gy_arena_cuda_ops = {
    .name = "cuda",
    .init = gy_cuda_unavailable,
};
