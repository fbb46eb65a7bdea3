/* fault.c: the counters behind fault.h. */
#include "fault.h"

typedef struct gy_fault_state {
    int64_t armed;  /* 1 while counting */
    int64_t target; /* the event that fails (0: none) */
    int64_t count;
} gy_fault_state;

static gy_fault_state gy_faults[GY_FAULT_SITE_COUNT];
static int64_t gy_faults_fired;
int gy_fault_enabled;

static void gy_fault_refresh(void) {
    int any = 0;
    for (int s = 0; s < GY_FAULT_SITE_COUNT; s++) any |= __atomic_load_n(&gy_faults[s].armed, __ATOMIC_ACQUIRE) != 0;
    __atomic_store_n(&gy_fault_enabled, any, __ATOMIC_RELEASE);
}

void gy_fault_arm(gy_fault_site site, int64_t n) {
    if ((unsigned)site >= GY_FAULT_SITE_COUNT) return;
    gy_fault_state *f = &gy_faults[site];
    __atomic_store_n(&f->count, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&f->target, n > 0 ? n : 0, __ATOMIC_RELAXED);
    __atomic_store_n(&f->armed, 1, __ATOMIC_RELEASE);
    gy_fault_refresh();
}

void gy_fault_disarm_all(void) {
    for (int s = 0; s < GY_FAULT_SITE_COUNT; s++) {
        __atomic_store_n(&gy_faults[s].armed, 0, __ATOMIC_RELEASE);
        __atomic_store_n(&gy_faults[s].target, 0, __ATOMIC_RELAXED);
    }
    gy_fault_refresh();
}

int64_t gy_fault_count(gy_fault_site site) {
    return (unsigned)site < GY_FAULT_SITE_COUNT ? __atomic_load_n(&gy_faults[site].count, __ATOMIC_RELAXED) : 0;
}

int64_t gy_fault_fired(void) { return __atomic_load_n(&gy_faults_fired, __ATOMIC_RELAXED); }

const char *gy_fault_site_name(gy_fault_site site) {
    switch (site) {
    case GY_FAULT_ALLOC: return "alloc";
    case GY_FAULT_PAGE_CREATE: return "page_create";
    case GY_FAULT_PAGE_MAP: return "page_map";
    case GY_FAULT_COPY: return "copy";
    case GY_FAULT_COMM: return "comm";
    default: return "?";
    }
}

int gy_fault_check_slow(gy_fault_site site) {
    gy_fault_state *f = &gy_faults[site];
    if (!__atomic_load_n(&f->armed, __ATOMIC_ACQUIRE)) return 0;
    const int64_t n = __atomic_add_fetch(&f->count, 1, __ATOMIC_RELAXED);
    const int64_t target = __atomic_load_n(&f->target, __ATOMIC_RELAXED);
    /* Exactly one event fires: the one that takes the target away. */
    if (target == 0 || n != target) return 0;
    int64_t expected = target;
    if (!__atomic_compare_exchange_n(&f->target, &expected, 0, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
        return 0;
    __atomic_add_fetch(&gy_faults_fired, 1, __ATOMIC_RELAXED);
    return 1;
}
