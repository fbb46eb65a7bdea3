/* arena.c: bookkeeping and validation of page arenas; the backends do the OS or driver work.
 *
 * Every public function takes the arena's lock, checks its arguments against the current state
 * before touching anything, and only then calls the backend, so a refused call changes nothing.
 * The two multi-page operations (grow, shrink) check the whole range first and roll back if the
 * backend fails half-way. */
#include "arena.h"
#include "../core/alloc.h"
#include "../core/fault.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "arena_backend.h"

/* Largest reservation we accept: far beyond any budget, small enough that offsets never
 * overflow and a typo in n_slots is caught. */
#define GY_ARENA_MAX_RANGE ((uint64_t)1 << 46)

enum { GY_PAGE_FREE = 0, GY_PAGE_CREATED = 1 };

struct gy_arena {
    gy_arena_config config;
    const gy_arena_backend_ops *ops;
    void *backend_state;
    uintptr_t base;
    uint64_t max_pages;
    int64_t *slot_page;  /* (n_slots) physical page mapped at the slot, or -1 */
    int32_t *slot_pins;  /* (n_slots) live views covering the slot */
    int64_t *page_slot;  /* (max_pages) slot the page is mapped at, or -1 */
    uint8_t *page_state; /* (max_pages) GY_PAGE_FREE or GY_PAGE_CREATED */
    uint8_t *page_tag;   /* (max_pages) gy_page_tag of created pages */
    uint64_t next_free_hint; /* no free page id below this one */
    gy_arena_stats stats;
    pthread_mutex_t lock;
};

static int gy_is_power_of_two(uint64_t x) { return x != 0 && (x & (x - 1)) == 0; }

static const gy_arena_backend_ops *gy_arena_ops_for(gy_arena_backend_kind kind) {
    switch (kind) {
    case GY_ARENA_BACKEND_CPU: return &gy_arena_cpu_ops;
    case GY_ARENA_BACKEND_CUDA: return &gy_arena_cuda_ops;
    default: return NULL;
    }
}

static gy_status gy_arena_check_config(const gy_arena_config *c) {
    if (!gy_is_power_of_two(c->page_size) || c->page_size < GY_ARENA_MIN_PAGE_SIZE)
        return GY_FAIL(GY_ERR_INVALID,
                       "page_size must be a power of two of at least 4096 bytes, got %llu",
                       (unsigned long long)c->page_size);
    if (c->n_slots == 0)
        return GY_FAIL(GY_ERR_INVALID, "an arena needs at least one virtual slot (n_slots=0)");
    if (c->n_slots > GY_ARENA_MAX_RANGE / c->page_size)
        return GY_FAIL(GY_ERR_INVALID,
                       "n_slots=%llu of %llu bytes reserves more than 64 TiB of address space",
                       (unsigned long long)c->n_slots, (unsigned long long)c->page_size);
    if (c->budget_bytes % c->page_size != 0)
        return GY_FAIL(GY_ERR_INVALID, "budget %llu bytes is not a multiple of page_size %llu",
                       (unsigned long long)c->budget_bytes, (unsigned long long)c->page_size);
    if (c->budget_bytes > GY_ARENA_MAX_RANGE)
        return GY_FAIL(GY_ERR_INVALID, "budget %llu bytes is larger than 64 TiB",
                       (unsigned long long)c->budget_bytes);
    return GY_OK;
}

gy_status gy_arena_init(gy_arena **out, const gy_arena_config *config) {
    if (out == NULL || config == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_arena_init: NULL argument");
    *out = NULL;
    const gy_arena_backend_ops *ops = gy_arena_ops_for(config->backend);
    if (ops == NULL)
        return GY_FAIL(GY_ERR_INVALID, "unknown arena backend %d (0=cpu, 1=cuda)",
                       (int)config->backend);
    GY_TRY(gy_arena_check_config(config));

    gy_arena *a = gy_calloc(1, sizeof *a);
    if (a == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for the arena");
    a->config = *config;
    a->ops = ops;
    a->max_pages = config->budget_bytes / config->page_size;
    const uint64_t n = config->n_slots, m = a->max_pages ? a->max_pages : 1;
    a->slot_page = gy_malloc(n * sizeof *a->slot_page);
    a->slot_pins = gy_calloc(n, sizeof *a->slot_pins);
    a->page_slot = gy_malloc(m * sizeof *a->page_slot);
    a->page_state = gy_calloc(m, 1);
    a->page_tag = gy_calloc(m, 1);
    if (!a->slot_page || !a->slot_pins || !a->page_slot || !a->page_state || !a->page_tag) {
        a->ops = NULL; /* no backend state yet: nothing to unmap or destroy */
        gy_arena_free(a);
        return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for a page table of %llu slots",
                       (unsigned long long)n);
    }
    for (uint64_t i = 0; i < n; i++) a->slot_page[i] = -1;
    for (uint64_t i = 0; i < m; i++) a->page_slot[i] = -1;
    a->stats.page_size = config->page_size;
    a->stats.n_slots = n;
    a->stats.max_pages = a->max_pages;
    a->stats.budget_bytes = config->budget_bytes;
    gy_status s = ops->init(config, &a->backend_state, &a->base);
    if (s != GY_OK) {
        a->ops = NULL; /* nothing to destroy */
        gy_arena_free(a);
        return s;
    }
    pthread_mutex_init(&a->lock, NULL);
    *out = a;
    return GY_OK;
}

void gy_arena_free(gy_arena *a) {
    if (a == NULL) return;
    if (a->ops != NULL) {
        /* Unmap and release everything so the backend sees a clean teardown. */
        for (uint64_t s = 0; s < a->config.n_slots; s++)
            if (a->slot_page[s] >= 0) a->ops->unmap(a->backend_state, (int64_t)s);
        for (uint64_t p = 0; p < a->max_pages; p++)
            if (a->page_state[p] == GY_PAGE_CREATED) a->ops->release(a->backend_state, (int64_t)p);
        a->ops->destroy(a->backend_state, a->base, &a->config);
        pthread_mutex_destroy(&a->lock);
    }
    free(a->slot_page);
    free(a->slot_pins);
    free(a->page_slot);
    free(a->page_state);
    free(a->page_tag);
    free(a);
}

/* ---- checks shared by the operations (lock held) ---- */

static gy_status gy_check_slot(const gy_arena *a, int64_t slot) {
    if (slot < 0 || (uint64_t)slot >= a->config.n_slots)
        return GY_FAIL(GY_ERR_INVALID, "slot %lld is out of range [0, %llu)", (long long)slot,
                       (unsigned long long)a->config.n_slots);
    return GY_OK;
}

static gy_status gy_check_page(const gy_arena *a, int64_t page) {
    if (page < 0 || (uint64_t)page >= a->max_pages)
        return GY_FAIL(GY_ERR_INVALID, "page %lld is out of range [0, %llu)", (long long)page,
                       (unsigned long long)a->max_pages);
    if (a->page_state[page] != GY_PAGE_CREATED)
        return GY_FAIL(GY_ERR_STATE, "page %lld has not been created (or was released)",
                       (long long)page);
    return GY_OK;
}

static gy_status gy_check_range(const gy_arena *a, int64_t slot, int64_t n) {
    if (n <= 0) return GY_FAIL(GY_ERR_INVALID, "page count must be positive, got %lld", (long long)n);
    if (slot < 0 || (uint64_t)slot > a->config.n_slots || (uint64_t)n > a->config.n_slots - (uint64_t)slot)
        return GY_FAIL(GY_ERR_INVALID, "slots [%lld, %lld) are out of range [0, %llu)",
                       (long long)slot, (long long)slot + (long long)n,
                       (unsigned long long)a->config.n_slots);
    return GY_OK;
}

/* ---- unlocked operations ---- */

static uint64_t gy_pages_created(const gy_arena *a) {
    return a->stats.bytes_in_use / a->config.page_size;
}

static gy_status gy_create_locked(gy_arena *a, gy_page_tag tag, int64_t *page_out) {
    if ((int)tag < 0 || tag >= GY_PAGE_TAG_COUNT)
        return GY_FAIL(GY_ERR_INVALID, "unknown page tag %d", (int)tag);
    if (gy_pages_created(a) >= a->max_pages)
        return GY_FAIL(GY_ERR_OUT_OF_MEMORY,
                       "physical budget exhausted: %llu of %llu pages (%llu bytes) in use",
                       (unsigned long long)gy_pages_created(a), (unsigned long long)a->max_pages,
                       (unsigned long long)a->config.budget_bytes);
    if (gy_fault_hit(GY_FAULT_PAGE_CREATE))
        return GY_FAIL(GY_ERR_SYSTEM, "injected fault: creating a physical page failed");
    uint64_t p = a->next_free_hint;
    while (a->page_state[p] != GY_PAGE_FREE) p++; /* a free page exists: checked above */
    GY_TRY(a->ops->create(a->backend_state, (int64_t)p));
    a->page_state[p] = GY_PAGE_CREATED;
    a->page_tag[p] = (uint8_t)tag;
    a->page_slot[p] = -1;
    a->next_free_hint = p + 1;
    const uint64_t ps = a->config.page_size;
    a->stats.bytes_in_use += ps;
    a->stats.bytes_by_tag[tag] += ps;
    if (a->stats.bytes_in_use > a->stats.peak_bytes) a->stats.peak_bytes = a->stats.bytes_in_use;
    a->stats.pages_created_total++;
    *page_out = (int64_t)p;
    return GY_OK;
}

static gy_status gy_release_locked(gy_arena *a, int64_t page) {
    GY_TRY(gy_check_page(a, page));
    if (a->page_slot[page] >= 0)
        return GY_FAIL(GY_ERR_STATE, "page %lld is still mapped at slot %lld; unmap it first",
                       (long long)page, (long long)a->page_slot[page]);
    GY_TRY(a->ops->release(a->backend_state, page));
    const uint64_t ps = a->config.page_size;
    a->stats.bytes_in_use -= ps;
    a->stats.bytes_by_tag[a->page_tag[page]] -= ps;
    a->stats.pages_released_total++;
    a->page_state[page] = GY_PAGE_FREE;
    if ((uint64_t)page < a->next_free_hint) a->next_free_hint = (uint64_t)page;
    return GY_OK;
}

static gy_status gy_map_locked(gy_arena *a, int64_t slot, int64_t page) {
    GY_TRY(gy_check_slot(a, slot));
    GY_TRY(gy_check_page(a, page));
    if (a->slot_page[slot] >= 0)
        return GY_FAIL(GY_ERR_STATE, "slot %lld is already mapped (to page %lld)", (long long)slot,
                       (long long)a->slot_page[slot]);
    if (a->page_slot[page] >= 0)
        return GY_FAIL(GY_ERR_STATE, "page %lld is already mapped at slot %lld", (long long)page,
                       (long long)a->page_slot[page]);
    if (gy_fault_hit(GY_FAULT_PAGE_MAP))
        return GY_FAIL(GY_ERR_SYSTEM, "injected fault: mapping page %lld at slot %lld failed",
                       (long long)page, (long long)slot);
    GY_TRY(a->ops->map(a->backend_state, slot, page));
    a->slot_page[slot] = page;
    a->page_slot[page] = slot;
    a->stats.pages_mapped++;
    a->stats.maps_total++;
    return GY_OK;
}

static gy_status gy_check_unmappable(const gy_arena *a, int64_t slot) {
    GY_TRY(gy_check_slot(a, slot));
    if (a->slot_page[slot] < 0)
        return GY_FAIL(GY_ERR_STATE, "slot %lld is not mapped", (long long)slot);
    if (a->slot_pins[slot] > 0)
        return GY_FAIL(GY_ERR_BUSY,
                       "slot %lld is under %d live NumPy view(s); delete them before unmapping",
                       (long long)slot, (int)a->slot_pins[slot]);
    return GY_OK;
}

/* The bookkeeping of a slot the backend has unmapped. */
static void gy_forget_mapping(gy_arena *a, int64_t slot) {
    a->page_slot[a->slot_page[slot]] = -1;
    a->slot_page[slot] = -1;
    a->stats.pages_mapped--;
    a->stats.unmaps_total++;
}

static gy_status gy_unmap_locked(gy_arena *a, int64_t slot) {
    GY_TRY(gy_check_unmappable(a, slot));
    GY_TRY(a->ops->unmap(a->backend_state, slot));
    gy_forget_mapping(a, slot);
    return GY_OK;
}

/* ---- public operations ---- */

#define GY_LOCKED(a, expr)                                                                         \
    do {                                                                                           \
        if ((a) == NULL) return GY_FAIL(GY_ERR_INVALID, "NULL arena");                             \
        pthread_mutex_lock(&(a)->lock);                                                            \
        gy_status gy_locked_status_ = (expr);                                                      \
        pthread_mutex_unlock(&(a)->lock);                                                          \
        return gy_locked_status_;                                                                  \
    } while (0)

gy_status gy_arena_create_page(gy_arena *a, gy_page_tag tag, int64_t *page_out) {
    if (page_out == NULL) return GY_FAIL(GY_ERR_INVALID, "NULL page_out");
    GY_LOCKED(a, gy_create_locked(a, tag, page_out));
}

gy_status gy_arena_release_page(gy_arena *a, int64_t page) { GY_LOCKED(a, gy_release_locked(a, page)); }

gy_status gy_arena_map(gy_arena *a, int64_t slot, int64_t page) { GY_LOCKED(a, gy_map_locked(a, slot, page)); }

gy_status gy_arena_unmap(gy_arena *a, int64_t slot) { GY_LOCKED(a, gy_unmap_locked(a, slot)); }

static gy_status gy_remap_locked(gy_arena *a, int64_t from_slot, int64_t to_slot) {
    GY_TRY(gy_check_unmappable(a, from_slot));
    GY_TRY(gy_check_slot(a, to_slot));
    if (a->slot_page[to_slot] >= 0)
        return GY_FAIL(GY_ERR_STATE, "slot %lld is already mapped (to page %lld)",
                       (long long)to_slot, (long long)a->slot_page[to_slot]);
    const int64_t page = a->slot_page[from_slot];
    /* Map the new place first: if that fails the page is still where it was. */
    if (gy_fault_hit(GY_FAULT_PAGE_MAP))
        return GY_FAIL(GY_ERR_SYSTEM, "injected fault: remapping slot %lld to %lld failed",
                       (long long)from_slot, (long long)to_slot);
    GY_TRY(a->ops->map(a->backend_state, to_slot, page));
    gy_status s = a->ops->unmap(a->backend_state, from_slot);
    if (s != GY_OK) {
        a->ops->unmap(a->backend_state, to_slot);
        return s;
    }
    a->slot_page[from_slot] = -1;
    a->slot_page[to_slot] = page;
    a->page_slot[page] = to_slot;
    a->stats.remaps_total++;
    return GY_OK;
}

gy_status gy_arena_remap(gy_arena *a, int64_t from_slot, int64_t to_slot) {
    GY_LOCKED(a, gy_remap_locked(a, from_slot, to_slot));
}

static gy_status gy_grow_locked(gy_arena *a, int64_t slot, int64_t n, gy_page_tag tag) {
    GY_TRY(gy_check_range(a, slot, n));
    if ((int)tag < 0 || tag >= GY_PAGE_TAG_COUNT)
        return GY_FAIL(GY_ERR_INVALID, "unknown page tag %d", (int)tag);
    for (int64_t s = slot; s < slot + n; s++)
        if (a->slot_page[s] >= 0)
            return GY_FAIL(GY_ERR_STATE, "slot %lld is already mapped (to page %lld)",
                           (long long)s, (long long)a->slot_page[s]);
    if (gy_pages_created(a) + (uint64_t)n > a->max_pages)
        return GY_FAIL(GY_ERR_OUT_OF_MEMORY,
                       "growing by %lld pages needs %llu bytes but only %llu of the %llu-byte "
                       "budget are free",
                       (long long)n, (unsigned long long)n * a->config.page_size,
                       (unsigned long long)(a->config.budget_bytes - a->stats.bytes_in_use),
                       (unsigned long long)a->config.budget_bytes);
    for (int64_t i = 0; i < n; i++) {
        int64_t page;
        gy_status s = gy_create_locked(a, tag, &page);
        if (s == GY_OK) {
            s = gy_map_locked(a, slot + i, page);
            if (s != GY_OK) gy_release_locked(a, page);
        }
        if (s != GY_OK) {
            char message[512];
            snprintf(message, sizeof message, "%s", gy_error_message());
            for (int64_t j = i - 1; j >= 0; j--) {
                const int64_t p = a->slot_page[slot + j];
                gy_unmap_locked(a, slot + j);
                gy_release_locked(a, p);
            }
            return GY_FAIL(s, "grow rolled back: %s", message);
        }
    }
    return GY_OK;
}

gy_status gy_arena_grow(gy_arena *a, int64_t slot, int64_t n, gy_page_tag tag) {
    GY_LOCKED(a, gy_grow_locked(a, slot, n, tag));
}

static gy_status gy_shrink_locked(gy_arena *a, int64_t slot, int64_t n) {
    GY_TRY(gy_check_range(a, slot, n));
    for (int64_t s = slot; s < slot + n; s++) GY_TRY(gy_check_unmappable(a, s));
    if (a->ops->unmap_run != NULL && n > 1) {
        GY_TRY(a->ops->unmap_run(a->backend_state, slot, n));
        for (int64_t s = slot; s < slot + n; s++) {
            const int64_t page = a->slot_page[s];
            gy_forget_mapping(a, s);
            GY_TRY(gy_release_locked(a, page));
        }
        return GY_OK;
    }
    for (int64_t s = slot; s < slot + n; s++) {
        const int64_t page = a->slot_page[s];
        GY_TRY(gy_unmap_locked(a, s));
        GY_TRY(gy_release_locked(a, page));
    }
    return GY_OK;
}

gy_status gy_arena_shrink(gy_arena *a, int64_t slot, int64_t n) {
    GY_LOCKED(a, gy_shrink_locked(a, slot, n));
}

static gy_status gy_pin_locked(gy_arena *a, int64_t slot, int64_t n) {
    GY_TRY(gy_check_range(a, slot, n));
    for (int64_t s = slot; s < slot + n; s++)
        if (a->slot_page[s] < 0)
            return GY_FAIL(GY_ERR_STATE, "slot %lld is not mapped; a view needs mapped memory",
                           (long long)s);
    for (int64_t s = slot; s < slot + n; s++) a->slot_pins[s]++;
    return GY_OK;
}

gy_status gy_arena_pin(gy_arena *a, int64_t slot, int64_t n) { GY_LOCKED(a, gy_pin_locked(a, slot, n)); }

void gy_arena_unpin(gy_arena *a, int64_t slot, int64_t n) {
    if (a == NULL || slot < 0 || n <= 0 || (uint64_t)(slot + n) > a->config.n_slots) return;
    pthread_mutex_lock(&a->lock);
    for (int64_t s = slot; s < slot + n; s++)
        if (a->slot_pins[s] > 0) a->slot_pins[s]--;
    pthread_mutex_unlock(&a->lock);
}

int gy_arena_any_pinned(const gy_arena *a, int64_t slot, int64_t n) {
    int pinned = 0;
    pthread_mutex_lock((pthread_mutex_t *)&a->lock);
    for (int64_t s = slot < 0 ? 0 : slot; s < slot + n && (uint64_t)s < a->config.n_slots; s++)
        if (a->slot_pins[s] > 0) pinned = 1;
    pthread_mutex_unlock((pthread_mutex_t *)&a->lock);
    return pinned;
}

static int gy_is_mapped_locked(const gy_arena *a, uint64_t offset, uint64_t bytes) {
    const uint64_t total = a->config.n_slots * a->config.page_size;
    if (bytes == 0 || offset >= total || bytes > total - offset) return 0;
    const uint64_t first = offset / a->config.page_size;
    const uint64_t last = (offset + bytes - 1) / a->config.page_size;
    for (uint64_t s = first; s <= last; s++)
        if (a->slot_page[s] < 0) return 0;
    return 1;
}

static gy_status gy_copy_locked(gy_arena *a, uint64_t dst, uint64_t src, uint64_t bytes) {
    if (bytes == 0) return GY_OK;
    if (!gy_is_mapped_locked(a, dst, bytes) || !gy_is_mapped_locked(a, src, bytes))
        return GY_FAIL(GY_ERR_INVALID,
                       "copy of %llu bytes from offset %llu to %llu touches unmapped slots",
                       (unsigned long long)bytes, (unsigned long long)src, (unsigned long long)dst);
    GY_TRY(a->ops->copy(a->backend_state, dst, src, bytes));
    a->stats.bytes_copied_total += bytes;
    return GY_OK;
}

gy_status gy_arena_copy(gy_arena *a, uint64_t dst_offset, uint64_t src_offset, uint64_t bytes) {
    GY_LOCKED(a, gy_copy_locked(a, dst_offset, src_offset, bytes));
}

static gy_status gy_check_host_copy(const gy_arena *a, uint64_t offset, uint64_t bytes,
                                    const void *host, const char *what) {
    if (host == NULL) return GY_FAIL(GY_ERR_INVALID, "%s: NULL host buffer", what);
    if (!gy_is_mapped_locked(a, offset, bytes))
        return GY_FAIL(GY_ERR_INVALID, "%s of %llu bytes at offset %llu touches unmapped slots",
                       what, (unsigned long long)bytes, (unsigned long long)offset);
    return GY_OK;
}

static gy_status gy_write_locked(gy_arena *a, uint64_t offset, const void *src, uint64_t bytes) {
    if (bytes == 0) return GY_OK;
    GY_TRY(gy_check_host_copy(a, offset, bytes, src, "arena write"));
    return a->ops->write(a->backend_state, offset, src, bytes);
}

gy_status gy_arena_write(gy_arena *a, uint64_t offset, const void *src, uint64_t bytes) {
    GY_LOCKED(a, gy_write_locked(a, offset, src, bytes));
}

static gy_status gy_read_locked(const gy_arena *a, void *dst, uint64_t offset, uint64_t bytes) {
    if (bytes == 0) return GY_OK;
    GY_TRY(gy_check_host_copy(a, offset, bytes, dst, "arena read"));
    return a->ops->read(a->backend_state, dst, offset, bytes);
}

gy_status gy_arena_read(const gy_arena *a, void *dst, uint64_t offset, uint64_t bytes) {
    gy_arena *m = (gy_arena *)a; /* the lock only */
    GY_LOCKED(m, gy_read_locked(a, dst, offset, bytes));
}

/* ---- queries ---- */

void gy_arena_stats_get(const gy_arena *a, gy_arena_stats *out) {
    pthread_mutex_lock((pthread_mutex_t *)&a->lock);
    *out = a->stats;
    pthread_mutex_unlock((pthread_mutex_t *)&a->lock);
}

void gy_arena_driver_times_get(const gy_arena *a, gy_arena_driver_times *out) {
    memset(out, 0, sizeof *out);
    pthread_mutex_lock((pthread_mutex_t *)&a->lock);
    if (a->ops != NULL && a->ops->driver_times != NULL) a->ops->driver_times(a->backend_state, out);
    pthread_mutex_unlock((pthread_mutex_t *)&a->lock);
}

void gy_arena_reset_peak(gy_arena *a) {
    pthread_mutex_lock(&a->lock);
    a->stats.peak_bytes = a->stats.bytes_in_use;
    pthread_mutex_unlock(&a->lock);
}

uint64_t gy_arena_page_size(const gy_arena *a) { return a->config.page_size; }
uint64_t gy_arena_n_slots(const gy_arena *a) { return a->config.n_slots; }
gy_arena_backend_kind gy_arena_backend(const gy_arena *a) { return a->config.backend; }
int32_t gy_arena_device(const gy_arena *a) {
    return a->config.backend == GY_ARENA_BACKEND_CUDA ? a->config.device : 0;
}
uintptr_t gy_arena_base_address(const gy_arena *a) { return a->base; }

int64_t gy_arena_page_at(const gy_arena *a, int64_t slot) {
    if (slot < 0 || (uint64_t)slot >= a->config.n_slots) return -1;
    pthread_mutex_lock((pthread_mutex_t *)&a->lock);
    const int64_t page = a->slot_page[slot];
    pthread_mutex_unlock((pthread_mutex_t *)&a->lock);
    return page;
}

int64_t gy_arena_slot_of(const gy_arena *a, int64_t page) {
    if (page < 0 || (uint64_t)page >= a->max_pages) return -1;
    pthread_mutex_lock((pthread_mutex_t *)&a->lock);
    const int64_t slot = a->page_state[page] == GY_PAGE_CREATED ? a->page_slot[page] : -1;
    pthread_mutex_unlock((pthread_mutex_t *)&a->lock);
    return slot;
}

void *gy_arena_host_ptr(const gy_arena *a, uint64_t offset) {
    if (!a->ops->host_accessible || offset > a->config.n_slots * a->config.page_size) return NULL;
    return (void *)(a->base + offset);
}

int gy_arena_is_mapped(const gy_arena *a, uint64_t offset, uint64_t bytes) {
    pthread_mutex_lock((pthread_mutex_t *)&a->lock);
    const int mapped = gy_is_mapped_locked(a, offset, bytes);
    pthread_mutex_unlock((pthread_mutex_t *)&a->lock);
    return mapped;
}

int64_t gy_arena_page_table(const gy_arena *a, gy_page_entry *rows, int64_t capacity) {
    pthread_mutex_lock((pthread_mutex_t *)&a->lock);
    int64_t n = (int64_t)a->config.n_slots < capacity ? (int64_t)a->config.n_slots : capacity;
    for (int64_t s = 0; s < n; s++) {
        const int64_t page = a->slot_page[s];
        rows[s].slot = s;
        rows[s].page = page;
        rows[s].tag = page >= 0 ? (int32_t)a->page_tag[page] : -1;
        rows[s].pins = a->slot_pins[s];
    }
    pthread_mutex_unlock((pthread_mutex_t *)&a->lock);
    return n;
}

int64_t gy_arena_physical_table(const gy_arena *a, gy_phys_entry *rows, int64_t capacity) {
    pthread_mutex_lock((pthread_mutex_t *)&a->lock);
    int64_t n = 0;
    for (uint64_t p = 0; p < a->max_pages && n < capacity; p++) {
        if (a->page_state[p] != GY_PAGE_CREATED) continue;
        rows[n].page = (int64_t)p;
        rows[n].slot = a->page_slot[p];
        rows[n].tag = (int32_t)a->page_tag[p];
        rows[n].reserved = 0;
        n++;
    }
    pthread_mutex_unlock((pthread_mutex_t *)&a->lock);
    return n;
}

gy_status gy_arena_copy_runs(gy_arena *dst, gy_arena *src, const uint64_t *dst_offsets,
                             const uint64_t *src_offsets, const uint64_t *bytes, int64_t n) {
    if (dst == NULL || src == NULL || (n > 0 && (!dst_offsets || !src_offsets || !bytes)))
        return GY_FAIL(GY_ERR_INVALID, "gy_arena_copy_runs: NULL argument");
    if (dst->ops != src->ops || (!dst->ops->host_accessible && dst->ops->copy_runs_from == NULL))
        return GY_FAIL(GY_ERR_UNAVAILABLE,
                       "copies between a %s arena and a %s arena are not implemented",
                       src->ops->name, dst->ops->name);
    for (int64_t i = 0; i < n; i++)
        if (!gy_arena_is_mapped(dst, dst_offsets[i], bytes[i]) ||
            !gy_arena_is_mapped(src, src_offsets[i], bytes[i]))
            return GY_FAIL(GY_ERR_INVALID, "run %lld (%llu bytes from %llu to %llu) touches unmapped slots",
                           (long long)i, (unsigned long long)bytes[i],
                           (unsigned long long)src_offsets[i], (unsigned long long)dst_offsets[i]);
    if (n > 0 && gy_fault_hit(GY_FAULT_COPY))
        return GY_FAIL(GY_ERR_SYSTEM, "injected fault: a copy of %lld runs between workers failed",
                       (long long)n);
    if (!dst->ops->host_accessible)
        return dst->ops->copy_runs_from(dst->backend_state, src->backend_state, dst_offsets,
                                        src_offsets, bytes, n);
    for (int64_t i = 0; i < n; i++)
        memmove((char *)dst->base + dst_offsets[i], (const char *)src->base + src_offsets[i], bytes[i]);
    return GY_OK;
}
