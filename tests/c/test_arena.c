/* test_arena.c: the page arena's operations, refusals and accounting, through the C API. */
#include <string.h>

#include "gytest.h"
#include "mem/arena.h"

static gy_arena *make_arena(uint64_t page_size, uint64_t n_slots, uint64_t pages) {
    gy_arena_config c = {.backend = GY_ARENA_BACKEND_CPU, .page_size = page_size,
                         .n_slots = n_slots, .budget_bytes = pages * page_size};
    gy_arena *a = NULL;
    CHECK_OK(gy_arena_init(&a, &c));
    return a;
}

GYTEST(arena_rejects_bad_configs) {
    gy_arena *a = (gy_arena *)1;
    gy_arena_config c = {.backend = GY_ARENA_BACKEND_CPU, .page_size = 3000, .n_slots = 4, .budget_bytes = 12000};
    CHECK_STATUS(gy_arena_init(&a, &c), GY_ERR_INVALID);
    CHECK(a == NULL);
    CHECK(strstr(gy_error_message(), "power of two") != NULL);
    c.page_size = 4096; c.budget_bytes = 4097;
    CHECK_STATUS(gy_arena_init(&a, &c), GY_ERR_INVALID);
    c.budget_bytes = 8192; c.n_slots = 0;
    CHECK_STATUS(gy_arena_init(&a, &c), GY_ERR_INVALID);
    c.n_slots = 4; c.backend = (gy_arena_backend_kind)7;
    CHECK_STATUS(gy_arena_init(&a, &c), GY_ERR_INVALID);
    c.backend = GY_ARENA_BACKEND_CPU; c.page_size = 2048;
    CHECK_STATUS(gy_arena_init(&a, &c), GY_ERR_INVALID);
}

GYTEST(arena_map_write_remap_keeps_bytes) {
    gy_arena *a = make_arena(4096, 8, 4);
    int64_t p0, p1;
    CHECK_OK(gy_arena_create_page(a, GY_PAGE_TAG_KV, &p0));
    CHECK_OK(gy_arena_create_page(a, GY_PAGE_TAG_WEIGHTS, &p1));
    CHECK(p0 == 0 && p1 == 1);
    CHECK_OK(gy_arena_map(a, 2, p0));
    unsigned char *at2 = gy_arena_host_ptr(a, 2 * 4096);
    CHECK(at2[0] == 0 && at2[4095] == 0); /* fresh pages read as zeros */
    memset(at2, 0xAB, 4096);
    CHECK_OK(gy_arena_remap(a, 2, 6));
    unsigned char *at6 = gy_arena_host_ptr(a, 6 * 4096);
    CHECK(at6[0] == 0xAB && at6[4095] == 0xAB);
    CHECK(gy_arena_page_at(a, 2) == -1 && gy_arena_page_at(a, 6) == p0);
    CHECK(gy_arena_slot_of(a, p0) == 6 && gy_arena_slot_of(a, p1) == -1);
    gy_arena_stats st;
    gy_arena_stats_get(a, &st);
    CHECK(st.bytes_in_use == 8192 && st.bytes_by_tag[GY_PAGE_TAG_KV] == 4096 &&
          st.bytes_by_tag[GY_PAGE_TAG_WEIGHTS] == 4096 && st.pages_mapped == 1 &&
          st.remaps_total == 1 && st.bytes_copied_total == 0);
    gy_arena_free(a);
}

GYTEST(arena_refusals_change_nothing) {
    gy_arena *a = make_arena(4096, 4, 2);
    int64_t p, q, r;
    CHECK_OK(gy_arena_create_page(a, GY_PAGE_TAG_KV, &p));
    CHECK_OK(gy_arena_create_page(a, GY_PAGE_TAG_KV, &q));
    CHECK_STATUS(gy_arena_create_page(a, GY_PAGE_TAG_KV, &r), GY_ERR_OUT_OF_MEMORY);
    CHECK_OK(gy_arena_map(a, 0, p));
    gy_page_entry before[4], after[4];
    gy_arena_page_table(a, before, 4);
    CHECK_STATUS(gy_arena_map(a, 0, q), GY_ERR_STATE);      /* slot taken */
    CHECK_STATUS(gy_arena_map(a, 1, p), GY_ERR_STATE);      /* page already mapped */
    CHECK_STATUS(gy_arena_map(a, 4, q), GY_ERR_INVALID);    /* slot out of range */
    CHECK_STATUS(gy_arena_map(a, 1, 9), GY_ERR_INVALID);    /* page out of range */
    CHECK_STATUS(gy_arena_unmap(a, 1), GY_ERR_STATE);       /* not mapped */
    CHECK_STATUS(gy_arena_release_page(a, p), GY_ERR_STATE);/* still mapped */
    CHECK_STATUS(gy_arena_remap(a, 0, 0), GY_ERR_STATE);    /* target taken */
    CHECK_STATUS(gy_arena_grow(a, 2, 1, GY_PAGE_TAG_KV), GY_ERR_OUT_OF_MEMORY);
    CHECK_OK(gy_arena_pin(a, 0, 1));
    CHECK_STATUS(gy_arena_unmap(a, 0), GY_ERR_BUSY);
    CHECK_STATUS(gy_arena_remap(a, 0, 3), GY_ERR_BUSY);
    gy_arena_page_table(a, after, 4);
    CHECK(memcmp(before, after, sizeof before) != 0); /* pins show in the table... */
    gy_arena_unpin(a, 0, 1);
    gy_arena_page_table(a, after, 4);
    CHECK(memcmp(before, after, sizeof before) == 0); /* ...and nothing else changed */
    CHECK_OK(gy_arena_release_page(a, q));
    CHECK_STATUS(gy_arena_release_page(a, q), GY_ERR_STATE); /* double release */
    gy_arena_free(a);
}

GYTEST(arena_grow_is_all_or_nothing) {
    gy_arena *a = make_arena(4096, 8, 4);
    int64_t p;
    CHECK_OK(gy_arena_create_page(a, GY_PAGE_TAG_OTHER, &p));
    CHECK_OK(gy_arena_map(a, 5, p));
    CHECK_STATUS(gy_arena_grow(a, 3, 3, GY_PAGE_TAG_KV), GY_ERR_STATE); /* slot 5 is taken */
    gy_arena_stats st;
    gy_arena_stats_get(a, &st);
    CHECK(st.bytes_in_use == 4096 && st.pages_mapped == 1);
    CHECK_OK(gy_arena_grow(a, 0, 3, GY_PAGE_TAG_KV));
    gy_arena_stats_get(a, &st);
    CHECK(st.bytes_in_use == 4 * 4096 && st.peak_bytes == 4 * 4096 && st.pages_mapped == 4);
    CHECK_OK(gy_arena_shrink(a, 0, 3));
    gy_arena_stats_get(a, &st);
    CHECK(st.bytes_in_use == 4096 && st.peak_bytes == 4 * 4096);
    gy_arena_reset_peak(a);
    gy_arena_stats_get(a, &st);
    CHECK(st.peak_bytes == 4096);
    gy_arena_free(a); /* frees mapped pages too: ASan would report a leak otherwise */
}

GYTEST(arena_copy_moves_bytes_and_counts_them) {
    gy_arena *a = make_arena(4096, 4, 4);
    CHECK_OK(gy_arena_grow(a, 0, 3, GY_PAGE_TAG_KV));
    unsigned char *base = gy_arena_host_ptr(a, 0);
    for (int i = 0; i < 6000; i++) base[i] = (unsigned char)(i * 7);
    CHECK_OK(gy_arena_copy(a, 100, 0, 6000)); /* overlapping, forward */
    int ok = 1;
    for (int i = 0; i < 6000; i++) ok &= base[100 + i] == (unsigned char)(i * 7);
    CHECK(ok);
    CHECK_STATUS(gy_arena_copy(a, 3 * 4096, 0, 10), GY_ERR_INVALID); /* slot 3 unmapped */
    gy_arena_stats st;
    gy_arena_stats_get(a, &st);
    CHECK(st.bytes_copied_total == 6000);
    gy_arena_free(a);
}

GYTEST(arena_released_pages_come_back_zeroed_lowest_first) {
    gy_arena *a = make_arena(4096, 4, 3);
    int64_t p[3];
    for (int i = 0; i < 3; i++) CHECK_OK(gy_arena_create_page(a, GY_PAGE_TAG_KV, &p[i]));
    CHECK_OK(gy_arena_map(a, 0, p[1]));
    memset(gy_arena_host_ptr(a, 0), 0x5A, 4096);
    CHECK_OK(gy_arena_unmap(a, 0));
    CHECK_OK(gy_arena_release_page(a, p[1]));
    CHECK_OK(gy_arena_release_page(a, p[2]));
    int64_t again;
    CHECK_OK(gy_arena_create_page(a, GY_PAGE_TAG_KV, &again));
    CHECK(again == 1);
    CHECK_OK(gy_arena_map(a, 3, again));
    unsigned char *m = gy_arena_host_ptr(a, 3 * 4096);
    CHECK(m[0] == 0 && m[2048] == 0);
    gy_arena_free(a);
}

/* pool_pages = 1: the first released page keeps its memory (and contents: no hole is punched),
 * the second, past the pool, goes back to the system and reads zeros when created again. The
 * budget counts both as free. */
GYTEST(arena_cpu_pool_keeps_released_pages_up_to_its_size) {
    gy_arena_config c = {.backend = GY_ARENA_BACKEND_CPU, .page_size = 4096, .n_slots = 4,
                         .budget_bytes = 2 * 4096, .pool_pages = 1};
    gy_arena *a = NULL;
    CHECK_OK(gy_arena_init(&a, &c));
    CHECK_OK(gy_arena_grow(a, 0, 2, GY_PAGE_TAG_WEIGHTS));
    memset(gy_arena_host_ptr(a, 0), 0x5A, 2 * 4096);
    CHECK_OK(gy_arena_shrink(a, 0, 2)); /* page 0 kept, page 1 punched */
    gy_arena_stats st;
    gy_arena_stats_get(a, &st);
    CHECK(st.bytes_in_use == 0);
    CHECK_OK(gy_arena_grow(a, 2, 2, GY_PAGE_TAG_KV)); /* pages 0 and 1 again, lowest first */
    const unsigned char *m = gy_arena_host_ptr(a, 2 * 4096);
    CHECK(m[0] == 0x5A && m[4095] == 0x5A);
    CHECK(m[4096] == 0 && m[8191] == 0);
    CHECK_STATUS(gy_arena_grow(a, 0, 1, GY_PAGE_TAG_KV), GY_ERR_OUT_OF_MEMORY); /* still the budget */
    gy_arena_free(a);
}

GYTEST(arena_write_and_read_reach_mapped_memory_only) {
    gy_arena *a = make_arena(4096, 4, 4);
    CHECK_OK(gy_arena_grow(a, 1, 2, GY_PAGE_TAG_WEIGHTS)); /* slots 1 and 2 */
    unsigned char in[6000], out[6000];
    for (int i = 0; i < 6000; i++) in[i] = (unsigned char)(i * 7 + 3);
    /* Across the boundary between the two pages. */
    CHECK_OK(gy_arena_write(a, 4096 + 1000, in, sizeof in));
    memset(out, 0, sizeof out);
    CHECK_OK(gy_arena_read(a, out, 4096 + 1000, sizeof out));
    CHECK(memcmp(in, out, sizeof in) == 0);
    CHECK(memcmp((unsigned char *)gy_arena_host_ptr(a, 4096 + 1000), in, sizeof in) == 0);
    /* Zero bytes is a no-op anywhere; unmapped slots and NULL buffers are refused. */
    CHECK_OK(gy_arena_write(a, 0, in, 0));
    CHECK_STATUS(gy_arena_write(a, 4096 * 2 + 100, in, 4096), GY_ERR_INVALID);
    CHECK_STATUS(gy_arena_read(a, out, 0, 10), GY_ERR_INVALID);
    CHECK_STATUS(gy_arena_read(a, out, 4096 * 4, 1), GY_ERR_INVALID);
    CHECK_STATUS(gy_arena_write(a, 4096, NULL, 1), GY_ERR_INVALID);
    gy_arena_stats st;
    gy_arena_stats_get(a, &st);
    CHECK(st.bytes_copied_total == 0);
    CHECK(gy_arena_device(a) == 0);
    gy_arena_free(a);
}
