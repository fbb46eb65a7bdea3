/* fault.h: fault injection, the test hook behind the reliability contract.
 *
 * Every fallible resource call of the core passes one of a few sites: a host allocation
 * (gy_malloc and friends, alloc.h), creating a physical page, mapping one, copying KV or weights
 * between caches or workers, and a communicator collective. A test arms a site with n: the n-th event
 * of that site from then on fails as the real resource would (NULL, GY_ERR_OUT_OF_MEMORY for a
 * page, GY_ERR_SYSTEM for a map, a copy or a collective), once, and the site disarms itself.
 * Sweeping n over every event an operation has (gy_fault_count after a clean run) checks that
 * each failure leaves a consistent state.
 *
 * Disarmed (the default) the check is one relaxed atomic load. Events are counted from any
 * thread, so with several threads the n-th event is whichever comes n-th. */
#ifndef GY_CORE_FAULT_H
#define GY_CORE_FAULT_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum gy_fault_site {
    GY_FAULT_ALLOC = 0,       /* host memory: gy_malloc, gy_calloc, gy_realloc */
    GY_FAULT_PAGE_CREATE = 1, /* gy_arena_create_page (and everything that creates pages) */
    GY_FAULT_PAGE_MAP = 2,    /* gy_arena_map and remap (unmapping never fails) */
    GY_FAULT_COPY = 3,        /* KV and weights between caches or workers: arena copy_runs,
                               * each KV move (gy_kv_move_run) */
    GY_FAULT_COMM = 4,        /* a rank's collective (its peers see the failure too) */
    GY_FAULT_SITE_COUNT
} gy_fault_site;

/* Starts counting the site's events from 0 and makes the n-th one fail (n >= 1); n = 0 counts
 * without failing. */
void gy_fault_arm(gy_fault_site site, int64_t n);
/* Stops counting and failing at every site. */
void gy_fault_disarm_all(void);
/* Events the site has seen since it was armed. */
int64_t gy_fault_count(gy_fault_site site);
/* Faults fired since the process started (all sites). */
int64_t gy_fault_fired(void);
const char *gy_fault_site_name(gy_fault_site site);

/* At a site: 1 when this event must fail. */
int gy_fault_check_slow(gy_fault_site site);
extern int gy_fault_enabled; /* any site counting; read relaxed */
static inline int gy_fault_hit(gy_fault_site site) {
    return __atomic_load_n(&gy_fault_enabled, __ATOMIC_RELAXED) ? gy_fault_check_slow(site) : 0;
}

#ifdef __cplusplus
}
#endif
#endif
