/* test_run_order.c: runs copied once in dependency order give what reading everything first and
 * writing afterwards gives (the reference), for chains, cycles and random permutations of the
 * cells of one buffer; runs that break the rule are left alone. */
#include <stdlib.h>
#include <string.h>

#include "gytest.h"
#include "kv/run_order.h"

#define GRID 64
#define CELLS 96

static uint64_t order_rng = 88172645463325252ull;
static uint64_t order_next(void) {
    order_rng ^= order_rng << 13;
    order_rng ^= order_rng >> 7;
    order_rng ^= order_rng << 17;
    return order_rng;
}

/* A buffer of CELLS grid-aligned cells, each byte telling its cell and offset apart. */
static unsigned char *cells(void) {
    unsigned char *b = aligned_alloc(GRID, CELLS * GRID);
    for (int i = 0; i < CELLS * GRID; i++) b[i] = (unsigned char)(i * 7 + i / GRID);
    return b;
}

/* What the runs must leave: every source read before anything is written. */
static void reference(const gy_run *runs, int64_t n) {
    unsigned char *stage = malloc((size_t)(n * GRID) + 1);
    for (int64_t i = 0; i < n; i++) memcpy(stage + i * GRID, runs[i].src, (size_t)runs[i].bytes);
    for (int64_t i = 0; i < n; i++) memcpy(runs[i].dst, stage + i * GRID, (size_t)runs[i].bytes);
    free(stage);
}

static gy_run run(unsigned char *b, int src_cell, int dst_cell, int64_t bytes) {
    return (gy_run){b + src_cell * GRID, b + dst_cell * GRID, bytes};
}

GYTEST(run_order_copies_chains_and_cycles_once_in_order) {
    unsigned char *got = cells(), *want = cells();
    /* A cycle 0 -> 1 -> 2 -> 0 (run i's destination is run i+1's source), a chain 3 -> 4 -> 5
     * into a free cell, one run alone, one in place. */
    gy_run r_got[8], r_want[8];
    const int src[8] = {10, 11, 12, 20, 21, 22, 40, 50};
    const int dst[8] = {11, 12, 10, 21, 22, 30, 41, 50};
    for (int i = 0; i < 8; i++) {
        const int64_t bytes = i == 5 ? GRID / 2 : GRID; /* a partial run */
        r_got[i] = run(got, src[i], dst[i], bytes);
        r_want[i] = run(want, src[i], dst[i], bytes);
    }
    for (int threads = 1; threads <= 2; threads++) {
        gy_run_order *o;
        CHECK_OK(gy_run_order_init(&o));
        int copied = 0;
        gy_run_order_stats st;
        CHECK_OK(gy_run_order_copy(o, r_got, 8, GRID, threads, &copied, &st));
        reference(r_want, 8);
        CHECK(copied == 1);
        CHECK(memcmp(got, want, CELLS * GRID) == 0);
        CHECK(st.runs_copied == 8 && st.runs_parked == 1 && st.longest_chain == 3);
        gy_run_order_free(o);
    }
    free(got);
    free(want);
}

GYTEST(run_order_matches_the_staged_reference_on_random_permutations) {
    gy_run_order *o;
    CHECK_OK(gy_run_order_init(&o));
    for (int trial = 0; trial < 200; trial++) {
        unsigned char *got = cells(), *want = cells();
        int perm_src[CELLS], perm_dst[CELLS];
        for (int i = 0; i < CELLS; i++) perm_src[i] = perm_dst[i] = i;
        for (int i = CELLS - 1; i > 0; i--) { /* two independent shuffles */
            int j = (int)(order_next() % (uint64_t)(i + 1)), t = perm_src[i];
            perm_src[i] = perm_src[j];
            perm_src[j] = t;
            j = (int)(order_next() % (uint64_t)(i + 1));
            t = perm_dst[i];
            perm_dst[i] = perm_dst[j];
            perm_dst[j] = t;
        }
        const int64_t n = 1 + (int64_t)(order_next() % CELLS);
        gy_run r_got[CELLS], r_want[CELLS];
        for (int64_t i = 0; i < n; i++) {
            const int64_t bytes = 1 + (int64_t)(order_next() % GRID);
            r_got[i] = run(got, perm_src[i], perm_dst[i], bytes);
            r_want[i] = run(want, perm_src[i], perm_dst[i], bytes);
        }
        int copied = 0;
        CHECK_OK(gy_run_order_copy(o, r_got, n, GRID, 1 + trial % 2, &copied, NULL));
        reference(r_want, n);
        CHECK(copied == 1);
        CHECK(memcmp(got, want, CELLS * GRID) == 0);
        free(got);
        free(want);
    }
    gy_run_order_free(o);
}

GYTEST(run_order_leaves_runs_that_break_its_rule_alone) {
    unsigned char *b = cells(), *before = cells();
    gy_run_order *o;
    CHECK_OK(gy_run_order_init(&o));
    gy_run bad[6][2] = {
        {run(b, 1, 2, GRID), {b + 3 * GRID + 8, b + 4 * GRID, 8}}, /* off the grid */
        {run(b, 1, 2, GRID), run(b, 3, 4, GRID + 1)},              /* longer than a cell */
        {run(b, 1, 2, GRID), run(b, 3, 4, 0)},                     /* empty */
        {run(b, 1, 2, GRID), run(b, 1, 4, GRID)},                  /* a source read twice */
        {run(b, 1, 2, GRID), run(b, 3, 2, GRID)},                  /* a place written twice */
        {run(b, 1, 2, GRID), run(b, 2, 2, GRID)},                  /* over a run kept in place */
    };
    for (int i = 0; i < 6; i++) {
        int copied = 1;
        CHECK_OK(gy_run_order_copy(o, bad[i], 2, GRID, 2, &copied, NULL));
        CHECK(copied == 0);
        CHECK(memcmp(b, before, CELLS * GRID) == 0);
    }
    int copied = 0;
    CHECK_STATUS(gy_run_order_copy(o, NULL, 2, GRID, 1, &copied, NULL), GY_ERR_INVALID);
    CHECK_STATUS(gy_run_order_copy(o, bad[0], 2, 0, 1, &copied, NULL), GY_ERR_INVALID);
    CHECK_OK(gy_run_order_copy(o, NULL, 0, GRID, 1, &copied, NULL));
    CHECK(copied == 1);
    gy_run_order_free(o);
    free(b);
    free(before);
}
