/* arena_cpu.c: the CPU twin of CUDA's virtual memory API.
 *
 * Physical memory is one memfd per arena, sized to the budget and sparse: page p lives at byte
 * p * page_size of the file. Creating a page allocates its backing (fallocate), releasing it
 * punches a hole so the memory really goes back to the system and the page reads zeros when it is
 * created again. With pool_pages > 0, up to that many released pages keep their memory instead
 * (the twin of the CUDA backend's pool of ready handles): releasing and creating them again costs
 * no system call, and they keep their old contents, as a recycled CUDA handle does. Punching a
 * hole frees the file's pages in the kernel, about 0.5 us per 4 KiB, which a layer-staggered
 * transformation pays on the serving path each time it drops a layer's FFN shards. The file is
 * sized to the budget, so kept pages never take the worker past it. The virtual range is a PROT_NONE
 * reservation; mapping a slot places the page's part of the file over it (MAP_FIXED|MAP_SHARED),
 * unmapping puts PROT_NONE back, so a stray access to an unmapped slot faults.
 *
 * Each mapped slot can split the reservation into up to two more kernel VMAs, and a process may
 * hold only vm.max_map_count of them: mappings are counted across all arenas and refused with
 * GY_ERR_LIMIT well before the kernel would fail in the middle of an operation. */
#include <errno.h>
#include "../core/alloc.h"
#include <fcntl.h>
#include <linux/falloc.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "arena_backend.h"

typedef struct gy_cpu_arena {
    int fd;
    uint64_t page_size;
    uint64_t n_slots;
    uint8_t *base;         /* page_size-aligned start of the usable range */
    uint8_t *reservation;  /* what mmap returned (base lies inside it) */
    uint64_t reserved_bytes;
    uint8_t *kept;         /* (budget pages) released pages whose memory the pool kept */
    uint64_t kept_count, pool_cap;
} gy_cpu_arena;

/* Mapped slots of every CPU arena in the process, against the kernel's VMA limit. */
static atomic_llong gy_cpu_mapped_slots;
static long long gy_cpu_slot_limit = -1;

static long long gy_cpu_mapping_limit(void) {
    if (gy_cpu_slot_limit >= 0) return gy_cpu_slot_limit;
    long long max_map_count = 65530; /* the kernel's default */
    FILE *f = fopen("/proc/sys/vm/max_map_count", "r");
    if (f != NULL) {
        if (fscanf(f, "%lld", &max_map_count) != 1) max_map_count = 65530;
        fclose(f);
    }
    /* Two VMAs a mapping in the worst case; keep 4096 for the rest of the process. */
    long long limit = (max_map_count - 4096) / 2;
    gy_cpu_slot_limit = limit > 0 ? limit : 0;
    return gy_cpu_slot_limit;
}

static gy_status gy_cpu_init(const gy_arena_config *config, void **state, uintptr_t *base) {
    const long os_page = sysconf(_SC_PAGESIZE);
    if (os_page > 0 && config->page_size % (uint64_t)os_page != 0)
        return GY_FAIL(GY_ERR_INVALID, "page_size %llu is not a multiple of the OS page size %ld",
                       (unsigned long long)config->page_size, os_page);
    gy_cpu_arena *c = gy_calloc(1, sizeof *c);
    if (c == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory");
    c->page_size = config->page_size;
    c->n_slots = config->n_slots;
    const uint64_t max_pages = config->budget_bytes / config->page_size;
    c->pool_cap = config->pool_pages < max_pages ? config->pool_pages : max_pages;
    if (c->pool_cap > 0 && (c->kept = gy_calloc(max_pages, 1)) == NULL) {
        free(c);
        return GY_FAIL(GY_ERR_SYSTEM, "out of host memory");
    }
    c->fd = memfd_create("gyges-arena", MFD_CLOEXEC);
    if (c->fd < 0) {
        int e = errno;
        free(c->kept);
        free(c);
        return GY_FAIL(GY_ERR_SYSTEM, "memfd_create failed: %s", strerror(e));
    }
    if (ftruncate(c->fd, (off_t)config->budget_bytes) != 0) {
        int e = errno;
        close(c->fd);
        free(c->kept);
        free(c);
        return GY_FAIL(GY_ERR_SYSTEM, "sizing the arena's memfd to %llu bytes failed: %s",
                       (unsigned long long)config->budget_bytes, strerror(e));
    }
    /* Over-reserve by one page so the usable range can start on a page_size boundary, which
     * keeps the kernel free to use huge pages and mirrors CUDA's aligned reservations. */
    const uint64_t bytes = config->n_slots * config->page_size;
    c->reserved_bytes = bytes + config->page_size;
    void *r = mmap(NULL, c->reserved_bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    if (r == MAP_FAILED) {
        int e = errno;
        close(c->fd);
        free(c->kept);
        free(c);
        return GY_FAIL(GY_ERR_SYSTEM, "reserving %llu bytes of address space failed: %s",
                       (unsigned long long)bytes, strerror(e));
    }
    c->reservation = r;
    const uintptr_t aligned = ((uintptr_t)r + config->page_size - 1) & ~(uintptr_t)(config->page_size - 1);
    c->base = (uint8_t *)aligned;
    *state = c;
    *base = aligned;
    return GY_OK;
}

static void gy_cpu_destroy(void *state, uintptr_t base, const gy_arena_config *config) {
    gy_cpu_arena *c = state;
    (void)base;
    (void)config;
    munmap(c->reservation, c->reserved_bytes);
    close(c->fd);
    free(c->kept);
    free(c);
}

static gy_status gy_cpu_create(void *state, int64_t page) {
    gy_cpu_arena *c = state;
    if (c->kept != NULL && c->kept[page]) { /* still backed: nothing to allocate */
        c->kept[page] = 0;
        c->kept_count--;
        return GY_OK;
    }
    if (fallocate(c->fd, 0, (off_t)((uint64_t)page * c->page_size), (off_t)c->page_size) != 0) {
        int e = errno;
        return GY_FAIL(GY_ERR_SYSTEM, "allocating the memory of page %lld failed: %s",
                       (long long)page, strerror(e));
    }
    return GY_OK;
}

static gy_status gy_cpu_release(void *state, int64_t page) {
    gy_cpu_arena *c = state;
    if (c->kept_count < c->pool_cap) {
        c->kept[page] = 1;
        c->kept_count++;
        return GY_OK;
    }
    /* Punching the hole returns the memory and makes the next creation read zeros. */
    if (fallocate(c->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                  (off_t)((uint64_t)page * c->page_size), (off_t)c->page_size) != 0) {
        int e = errno;
        return GY_FAIL(GY_ERR_SYSTEM, "releasing the memory of page %lld failed: %s",
                       (long long)page, strerror(e));
    }
    return GY_OK;
}

static gy_status gy_cpu_map(void *state, int64_t slot, int64_t page) {
    gy_cpu_arena *c = state;
    const long long limit = gy_cpu_mapping_limit();
    if (atomic_fetch_add(&gy_cpu_mapped_slots, 1) >= limit) {
        atomic_fetch_sub(&gy_cpu_mapped_slots, 1);
        return GY_FAIL(GY_ERR_LIMIT,
                       "mapping slot %lld would pass %lld mapped pages in this process, the safe "
                       "share of vm.max_map_count; use a larger page_size",
                       (long long)slot, limit);
    }
    void *at = c->base + (uint64_t)slot * c->page_size;
    void *r = mmap(at, c->page_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, c->fd,
                   (off_t)((uint64_t)page * c->page_size));
    if (r == MAP_FAILED) {
        int e = errno;
        atomic_fetch_sub(&gy_cpu_mapped_slots, 1);
        return GY_FAIL(GY_ERR_SYSTEM, "mapping page %lld at slot %lld failed: %s", (long long)page,
                       (long long)slot, strerror(e));
    }
    return GY_OK;
}

/* Puts reserved, inaccessible address space back over the slots (the range stays ours). */
static gy_status gy_cpu_unmap_run(void *state, int64_t slot, int64_t n) {
    gy_cpu_arena *c = state;
    void *at = c->base + (uint64_t)slot * c->page_size;
    void *r = mmap(at, (size_t)n * c->page_size, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    if (r == MAP_FAILED) {
        int e = errno;
        return GY_FAIL(GY_ERR_SYSTEM, "unmapping slots [%lld, %lld) failed: %s", (long long)slot,
                       (long long)(slot + n), strerror(e));
    }
    atomic_fetch_sub(&gy_cpu_mapped_slots, n);
    return GY_OK;
}

static gy_status gy_cpu_unmap(void *state, int64_t slot) { return gy_cpu_unmap_run(state, slot, 1); }

static gy_status gy_cpu_copy(void *state, uint64_t dst, uint64_t src, uint64_t bytes) {
    gy_cpu_arena *c = state;
    memmove(c->base + dst, c->base + src, bytes);
    return GY_OK;
}

static gy_status gy_cpu_write(void *state, uint64_t offset, const void *src, uint64_t bytes) {
    gy_cpu_arena *c = state;
    memcpy(c->base + offset, src, bytes);
    return GY_OK;
}

static gy_status gy_cpu_read(void *state, void *dst, uint64_t offset, uint64_t bytes) {
    gy_cpu_arena *c = state;
    memcpy(dst, c->base + offset, bytes);
    return GY_OK;
}

const gy_arena_backend_ops gy_arena_cpu_ops = {
    .name = "cpu",
    .init = gy_cpu_init,
    .destroy = gy_cpu_destroy,
    .create = gy_cpu_create,
    .release = gy_cpu_release,
    .map = gy_cpu_map,
    .unmap = gy_cpu_unmap,
    .unmap_run = gy_cpu_unmap_run,
    .copy = gy_cpu_copy,
    .write = gy_cpu_write,
    .read = gy_cpu_read,
    .host_accessible = 1,
};
