/* arena.h: one worker's memory, managed the way CUDA's virtual memory management API does it.
 *
 * An arena is a reserved range of virtual address space cut into `n_slots` slots of `page_size`
 * bytes, plus a budget of physical pages (the worker's "GPU memory"). Physical pages are created
 * up to the budget, mapped into any free slot, unmapped, moved to another slot without copying
 * (remap), and released. Unmapped slots are inaccessible, so a stray access faults instead of
 * reading stale data.
 *
 * Physical page ids are 0 .. max_pages-1 (max_pages = budget / page_size); creation always takes
 * the lowest free id, so a sequence of operations gives the same ids every time.
 *
 * The bookkeeping and every check live here; a backend (cpu: memfd + mmap, cuda: cuMem*) does
 * only the OS or driver work. A refused call leaves the arena exactly as it was. */
#ifndef GY_MEM_ARENA_H
#define GY_MEM_ARENA_H

#include <stddef.h>
#include <stdint.h>

#include "../core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum gy_arena_backend_kind {
    GY_ARENA_BACKEND_CPU = 0,
    GY_ARENA_BACKEND_CUDA = 1,
} gy_arena_backend_kind;

/* Who owns a physical page; used for accounting only. */
typedef enum gy_page_tag {
    GY_PAGE_TAG_WEIGHTS = 0,
    GY_PAGE_TAG_KV = 1,
    GY_PAGE_TAG_STAGING = 2,
    GY_PAGE_TAG_OTHER = 3,
    GY_PAGE_TAG_COUNT
} gy_page_tag;

#define GY_ARENA_MIN_PAGE_SIZE ((uint64_t)4096)
#define GY_ARENA_DEFAULT_PAGE_SIZE ((uint64_t)2 << 20) /* CUDA's VMM granularity */

typedef struct gy_arena_config {
    gy_arena_backend_kind backend;
    int32_t device;        /* CUDA device ordinal; ignored by the cpu backend */
    uint64_t page_size;    /* bytes; a power of two >= 4 KiB (cuda: a multiple of its granularity) */
    uint64_t n_slots;      /* virtual slots reserved */
    uint64_t budget_bytes; /* physical budget; a multiple of page_size */
    uint32_t pool_pages;   /* released pages kept ready (cuda: handles, also made ahead of need;
                            * cpu: their memory, not punched out of the file) */
} gy_arena_config;

typedef struct gy_arena_stats {
    uint64_t page_size;
    uint64_t n_slots;
    uint64_t max_pages;                       /* budget_bytes / page_size */
    uint64_t budget_bytes;
    uint64_t bytes_in_use;                    /* created (not yet released) pages * page_size */
    uint64_t peak_bytes;                      /* highest bytes_in_use seen (reset_peak lowers it) */
    uint64_t bytes_by_tag[GY_PAGE_TAG_COUNT]; /* bytes_in_use split by owner tag */
    uint64_t pages_mapped;                    /* slots currently backed by a page */
    uint64_t pages_created_total;             /* counters since creation */
    uint64_t pages_released_total;
    uint64_t maps_total;
    uint64_t unmaps_total;
    uint64_t remaps_total;
    uint64_t bytes_copied_total;              /* bytes moved by gy_arena_copy (layout shifts) */
} gy_arena_stats;

/* The backend's own calls on the caller's path, each counted and timed alone: the CUDA
 * backend's virtual memory calls (cuMemCreate when the pool is empty, cuMemMap, cuMemSetAccess,
 * cuMemUnmap, cuMemRelease when the pool is full), which kvcached reports one by one; the cpu
 * backend has none (all zero). The pool thread's creates are not on the path, nor counted. */
typedef enum gy_arena_driver_call {
    GY_ARENA_DRIVER_CREATE = 0,
    GY_ARENA_DRIVER_MAP = 1,
    GY_ARENA_DRIVER_SET_ACCESS = 2,
    GY_ARENA_DRIVER_UNMAP = 3,
    GY_ARENA_DRIVER_RELEASE = 4,
    GY_ARENA_DRIVER_CALL_COUNT
} gy_arena_driver_call;

typedef struct gy_arena_driver_times {
    int64_t calls[GY_ARENA_DRIVER_CALL_COUNT];
    double seconds[GY_ARENA_DRIVER_CALL_COUNT]; /* wall time inside them, summed */
} gy_arena_driver_times;

/* One row of the page table: the state of a virtual slot. */
typedef struct gy_page_entry {
    int64_t slot;
    int64_t page; /* physical page id, or -1 when the slot is unmapped */
    int32_t tag;  /* gy_page_tag of that page, or -1 */
    int32_t pins; /* live zero-copy views covering the slot */
} gy_page_entry;

/* One row of the physical table: a created page and where it is mapped. */
typedef struct gy_phys_entry {
    int64_t page;
    int64_t slot; /* -1 when created but not mapped */
    int32_t tag;
    int32_t reserved;
} gy_phys_entry;

typedef struct gy_arena gy_arena;

gy_status gy_arena_init(gy_arena **out, const gy_arena_config *config);
void gy_arena_free(gy_arena *arena);

/* Physical pages. */
gy_status gy_arena_create_page(gy_arena *arena, gy_page_tag tag, int64_t *page_out);
gy_status gy_arena_release_page(gy_arena *arena, int64_t page);
/* Mapping. map: an unmapped page into a free slot. remap: move the page at `from_slot` to the free
 * slot `to_slot`, no bytes copied. */
gy_status gy_arena_map(gy_arena *arena, int64_t slot, int64_t page);
gy_status gy_arena_unmap(gy_arena *arena, int64_t slot);
gy_status gy_arena_remap(gy_arena *arena, int64_t from_slot, int64_t to_slot);

/* Conveniences built on the above, all-or-nothing: create and map `n` pages at slots
 * [slot, slot+n); unmap and release the pages at [slot, slot+n). */
gy_status gy_arena_grow(gy_arena *arena, int64_t slot, int64_t n, gy_page_tag tag);
gy_status gy_arena_shrink(gy_arena *arena, int64_t slot, int64_t n);

/* Views pin the slots they cover: a pinned slot cannot be unmapped or remapped away. */
gy_status gy_arena_pin(gy_arena *arena, int64_t slot, int64_t n);
void gy_arena_unpin(gy_arena *arena, int64_t slot, int64_t n);
/* Non-zero when any slot of [slot, slot+n) is pinned (out-of-range slots are ignored). */
int gy_arena_any_pinned(const gy_arena *arena, int64_t slot, int64_t n);

/* Moves `bytes` inside the arena's virtual range (overlap allowed), counting them as copied.
 * Every slot touched must be mapped. */
gy_status gy_arena_copy(gy_arena *arena, uint64_t dst_offset, uint64_t src_offset, uint64_t bytes);

/* Copies `bytes` of host memory into the arena at `offset`, or out of it into `dst`: the way
 * the host reaches an arena whatever its backend (a device arena's memory has no host pointer).
 * Every slot touched must be mapped. Synchronous; not counted in bytes_copied_total. */
gy_status gy_arena_write(gy_arena *arena, uint64_t offset, const void *src, uint64_t bytes);
gy_status gy_arena_read(const gy_arena *arena, void *dst, uint64_t offset, uint64_t bytes);

/* Copies `n` runs between two arenas (a peer-to-peer copy between workers): run i is bytes[i]
 * bytes from src_offsets[i] of `src` to dst_offsets[i] of `dst`. Every range is checked to be
 * mapped before anything is copied. Both arenas on one backend: host memory, or CUDA arenas on
 * one device (virtual workers sharing a GPU: device-to-device copies) or on two (peer copies);
 * finished on return; GY_ERR_UNAVAILABLE for other pairs. Counts one GY_FAULT_COPY event. */
gy_status gy_arena_copy_runs(gy_arena *dst, gy_arena *src, const uint64_t *dst_offsets,
                             const uint64_t *src_offsets, const uint64_t *bytes, int64_t n);

/* Queries. */
void gy_arena_stats_get(const gy_arena *arena, gy_arena_stats *out);
void gy_arena_reset_peak(gy_arena *arena);
void gy_arena_driver_times_get(const gy_arena *arena, gy_arena_driver_times *out);
uint64_t gy_arena_page_size(const gy_arena *arena);
uint64_t gy_arena_n_slots(const gy_arena *arena);
gy_arena_backend_kind gy_arena_backend(const gy_arena *arena);
int32_t gy_arena_device(const gy_arena *arena); /* the CUDA device ordinal (0 on the cpu backend) */
int64_t gy_arena_page_at(const gy_arena *arena, int64_t slot); /* -1 when unmapped or out of range */
int64_t gy_arena_slot_of(const gy_arena *arena, int64_t page); /* -1 when unmapped or not created */
/* Base of the virtual range: a host pointer for cpu, a device address for cuda. */
uintptr_t gy_arena_base_address(const gy_arena *arena);
/* Host pointer to byte `offset` of the range, or NULL when the memory is not host memory. */
void *gy_arena_host_ptr(const gy_arena *arena, uint64_t offset);
/* True when [offset, offset+bytes) lies in the range and every slot it touches is mapped. */
int gy_arena_is_mapped(const gy_arena *arena, uint64_t offset, uint64_t bytes);
/* Fills `rows` (capacity n_slots) with the page table; returns the number of rows written. */
int64_t gy_arena_page_table(const gy_arena *arena, gy_page_entry *rows, int64_t capacity);
/* Fills `rows` with every created page in id order; returns the number written. */
int64_t gy_arena_physical_table(const gy_arena *arena, gy_phys_entry *rows, int64_t capacity);

#ifdef __cplusplus
}
#endif
#endif
