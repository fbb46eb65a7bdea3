/* arena_backend.h (private): the table of functions a memory backend provides to arena.c.
 *
 * arena.c has already validated every argument and holds the arena's lock when it calls these;
 * a backend only talks to the OS or the driver and reports what they refused. */
#ifndef GY_MEM_ARENA_BACKEND_H
#define GY_MEM_ARENA_BACKEND_H

#include "arena.h"

typedef struct gy_arena_backend_ops {
    const char *name;
    /* Reserves n_slots * page_size bytes of address space; fills *state and *base. */
    gy_status (*init)(const gy_arena_config *config, void **state, uintptr_t *base);
    void (*destroy)(void *state, uintptr_t base, const gy_arena_config *config);
    /* Backs physical page `page` with memory (on the cpu backend it reads as zeros unless the pool
     * kept it when it was released). */
    gy_status (*create)(void *state, int64_t page);
    gy_status (*release)(void *state, int64_t page);
    gy_status (*map)(void *state, int64_t slot, int64_t page);
    gy_status (*unmap)(void *state, int64_t slot);
    /* Optional (NULL: arena.c unmaps slot by slot): unmaps the n consecutive mapped slots from
     * `slot` in one call. On the cpu backend each unmapping call flushes the TLBs of every core
     * running the process's threads (the serving threads included), so a run is one flush. */
    gy_status (*unmap_run)(void *state, int64_t slot, int64_t n);
    /* memmove inside the range; both ends mapped. */
    gy_status (*copy)(void *state, uint64_t dst_offset, uint64_t src_offset, uint64_t bytes);
    /* Host memory to the range and back (mapped); synchronous, and ordered after everything
     * issued to the memory before (a device backend waits for its context first). */
    gy_status (*write)(void *state, uint64_t offset, const void *src, uint64_t bytes);
    gy_status (*read)(void *state, void *dst, uint64_t offset, uint64_t bytes);
    /* Optional (NULL: host arenas, which arena.c copies with memmove): runs from another arena
     * of this backend and device, checked mapped, run i being bytes[i] bytes from src_offsets[i]
     * of src to dst_offsets[i] of dst (dst may be src; runs may then overlap, memmove-like).
     * Synchronous and ordered like `copy`. */
    gy_status (*copy_runs_from)(void *dst_state, void *src_state, const uint64_t *dst_offsets,
                                const uint64_t *src_offsets, const uint64_t *bytes, int64_t n);
    /* Optional: its driver calls so far (arena.h: gy_arena_driver_times); NULL: none. */
    void (*driver_times)(const void *state, gy_arena_driver_times *out);
    /* Non-zero when the range is host memory that C and NumPy may touch directly. */
    int host_accessible;
} gy_arena_backend_ops;

extern const gy_arena_backend_ops gy_arena_cpu_ops;
/* NULL-equivalent table when the CUDA backend is not compiled in; see arena_cuda.c. */
extern const gy_arena_backend_ops gy_arena_cuda_ops;

#endif
