/* run_order.c: each run copied once, in an order that reads every source before it is overwritten
 * (see run_order.h). */
#include "run_order.h"
#include "../core/alloc.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "../core/grow.h"

/* A run of the chains and cycles: `after` is the run whose source is at this run's destination
 * (read it first), `before` the run whose destination is this run's source (it waits for this
 * one); -1 for none. */
typedef struct gy_run_link {
    int64_t after, before;
} gy_run_link;

/* Where one component's copying starts: a chain at its free end (then `before` links lead back
 * to its start), a cycle at the run it parks. */
typedef struct gy_run_component {
    int64_t first;
    int64_t runs;
    int cycle;
} gy_run_component;

struct gy_run_order {
    gy_run_link *links;
    int64_t links_cap;
    int64_t *table; /* open addressing: source address -> run index + 1 (0: empty) */
    int64_t table_cap;
    int64_t *dst_table; /* the same for destinations (to refuse one written twice) */
    int64_t dst_table_cap;
    uint8_t *seen;
    int64_t seen_cap;
    gy_run_component *comps;
    int64_t comps_cap;
};

static gy_status gy_run_order_reserve(void **buf, int64_t *cap, int64_t n, size_t size) {
    return gy_grow(buf, cap, n, size, "ordering runs");
}

gy_status gy_run_order_init(gy_run_order **out) {
    if (out == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_run_order_init: NULL argument");
    *out = gy_calloc(1, sizeof **out);
    if (*out == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory");
    return GY_OK;
}

void gy_run_order_free(gy_run_order *o) {
    if (o == NULL) return;
    free(o->links);
    free(o->table);
    free(o->dst_table);
    free(o->seen);
    free(o->comps);
    free(o);
}

static uint64_t gy_run_slot(const void *addr, int64_t grid, uint64_t mask) {
    return (((uint64_t)(uintptr_t)addr / (uint64_t)grid) * 0x9E3779B97F4A7C15ull >> 17) & mask;
}

/* The run whose source starts at `addr`, or -1. */
static int64_t gy_run_lookup(const gy_run_order *o, const gy_run *runs, const void *addr,
                             int64_t grid, uint64_t mask) {
    for (uint64_t s = gy_run_slot(addr, grid, mask);; s = (s + 1) & mask) {
        const int64_t v = o->table[s];
        if (v == 0) return -1;
        if (runs[v - 1].src == addr) return v - 1;
    }
}

/* Enters run i in `table` under `addr` (its source or destination); 0 if another run is there. */
static int gy_run_insert(int64_t *table, const gy_run *runs, int64_t i, const void *addr,
                         int64_t grid, uint64_t mask, int by_dst) {
    uint64_t s = gy_run_slot(addr, grid, mask);
    for (; table[s] != 0; s = (s + 1) & mask) {
        const gy_run *other = &runs[table[s] - 1];
        if ((by_dst ? (const void *)other->dst : other->src) == addr) return 0;
    }
    table[s] = i + 1;
    return 1;
}

/* Fills the links; 0 when the runs do not follow the rule. */
static int gy_run_link_all(gy_run_order *o, const gy_run *runs, int64_t n, int64_t grid,
                           uint64_t mask) {
    memset(o->table, 0, (mask + 1) * sizeof *o->table);
    memset(o->dst_table, 0, (mask + 1) * sizeof *o->dst_table);
    for (int64_t i = 0; i < n; i++) {
        const gy_run *r = &runs[i];
        if (r->bytes <= 0 || r->bytes > grid || (uintptr_t)r->src % (uint64_t)grid ||
            (uintptr_t)r->dst % (uint64_t)grid)
            return 0;
        o->links[i] = (gy_run_link){-1, -1};
        /* A source read twice or a place written twice has no single order (an in-place run
         * counts as both: it stays, so nothing else may write there). */
        if (!gy_run_insert(o->dst_table, runs, i, r->dst, grid, mask, 1)) return 0;
        if (r->src == r->dst) continue; /* already in place: neither read nor written */
        if (!gy_run_insert(o->table, runs, i, r->src, grid, mask, 0)) return 0;
    }
    for (int64_t i = 0; i < n; i++) {
        if (runs[i].src == runs[i].dst) continue;
        const int64_t q = gy_run_lookup(o, runs, runs[i].dst, grid, mask);
        if (q < 0) continue;
        o->links[i].after = q;
        o->links[q].before = i;
    }
    return 1;
}

/* Splits the runs into chains and cycles. */
static int64_t gy_run_components(gy_run_order *o, const gy_run *runs, int64_t n) {
    memset(o->seen, 0, (size_t)n);
    int64_t k = 0;
    for (int64_t i = 0; i < n; i++) {
        if (runs[i].src == runs[i].dst || o->links[i].before >= 0) continue;
        int64_t e = i, len = 1; /* i waits for no one's reading: the chain's last copy */
        o->seen[i] = 1;
        while (o->links[e].after >= 0) {
            e = o->links[e].after;
            o->seen[e] = 1;
            len++;
        }
        o->comps[k++] = (gy_run_component){e, len, 0};
    }
    for (int64_t i = 0; i < n; i++) { /* whatever is left waits in a circle */
        if (o->seen[i] || runs[i].src == runs[i].dst) continue;
        int64_t len = 0;
        for (int64_t j = i; !o->seen[j]; j = o->links[j].after) {
            o->seen[j] = 1;
            len++;
        }
        o->comps[k++] = (gy_run_component){i, len, 1};
    }
    return k;
}

typedef struct gy_run_part {
    const gy_run_order *o;
    const gy_run *runs;
    int64_t first, end; /* components */
    void *park;
} gy_run_part;

static void *gy_run_copy_part(void *arg) {
    const gy_run_part *p = arg;
    const gy_run_link *links = p->o->links;
    const gy_run *runs = p->runs;
    for (int64_t c = p->first; c < p->end; c++) {
        const gy_run_component *comp = &p->o->comps[c];
        int64_t r = comp->first;
        if (comp->cycle) {
            memcpy(p->park, runs[r].src, (size_t)runs[r].bytes);
            r = links[r].before;
        }
        /* Each copy reads a source whose own destination-writer comes next. */
        while (r >= 0 && !(comp->cycle && r == comp->first)) {
            memcpy(runs[r].dst, runs[r].src, (size_t)runs[r].bytes);
            r = links[r].before;
        }
        if (comp->cycle) memcpy(runs[comp->first].dst, p->park, (size_t)runs[comp->first].bytes);
    }
    return NULL;
}

gy_status gy_run_order_copy(gy_run_order *o, const gy_run *runs, int64_t n, int64_t grid,
                            int threads, int *copied, gy_run_order_stats *stats) {
    if (o == NULL || copied == NULL || (runs == NULL && n > 0))
        return GY_FAIL(GY_ERR_INVALID, "gy_run_order_copy: NULL argument");
    if (n < 0 || grid <= 0) return GY_FAIL(GY_ERR_INVALID, "gy_run_order_copy: bad sizes");
    *copied = 0;
    uint64_t cap = 64;
    while (cap < 2 * (uint64_t)n) cap *= 2;
    GY_TRY(gy_run_order_reserve((void **)&o->links, &o->links_cap, n, sizeof *o->links));
    GY_TRY(gy_run_order_reserve((void **)&o->table, &o->table_cap, (int64_t)cap, sizeof *o->table));
    GY_TRY(gy_run_order_reserve((void **)&o->dst_table, &o->dst_table_cap, (int64_t)cap,
                                sizeof *o->dst_table));
    GY_TRY(gy_run_order_reserve((void **)&o->seen, &o->seen_cap, n, 1));
    GY_TRY(gy_run_order_reserve((void **)&o->comps, &o->comps_cap, n, sizeof *o->comps));
    if (!gy_run_link_all(o, runs, n, grid, cap - 1)) return GY_OK;
    const int64_t k = gy_run_components(o, runs, n);
    gy_run_order_stats st = {0};
    int64_t total = 0;
    for (int64_t c = 0; c < k; c++) {
        total += o->comps[c].runs;
        st.runs_parked += o->comps[c].cycle;
        if (o->comps[c].runs > st.longest_chain) st.longest_chain = o->comps[c].runs;
    }
    /* Two halves by runs; components stay whole. */
    int64_t half = 0;
    for (int64_t acc = 0; half < k && threads > 1 && acc + o->comps[half].runs <= total / 2; half++)
        acc += o->comps[half].runs;
    void *parks = gy_malloc(2 * (size_t)grid);
    if (parks == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory");
    gy_run_part parts[2] = {{o, runs, 0, half, parks},
                            {o, runs, half, k, (char *)parks + grid}};
    pthread_t helper;
    const int threaded = half > 0 && half < k &&
                         pthread_create(&helper, NULL, gy_run_copy_part, &parts[0]) == 0;
    if (!threaded) gy_run_copy_part(&parts[0]);
    gy_run_copy_part(&parts[1]);
    if (threaded) pthread_join(helper, NULL);
    free(parks);
    st.runs_copied = n;
    *copied = 1;
    if (stats) *stats = st;
    return GY_OK;
}
