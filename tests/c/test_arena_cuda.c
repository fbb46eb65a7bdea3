/* test_arena_cuda.c: the CUDA arena backend as arena.c sees it.
 *
 * `make ctest` compiles the core without GY_WITH_CUDA, so here the backend must refuse cleanly:
 * GY_ERR_UNAVAILABLE with a message, no arena, nothing leaked (ASan checks the last part). Built
 * with GY_WITH_CUDA on a machine with a GPU, the same file also runs the backend through
 * create / map / remap / copy / unmap / release with the arena's accounting. */
#include <string.h>

#include "../../csrc/mem/arena.h"
#include "gytest.h"

static gy_arena_config gy_test_cuda_config(uint64_t page_size, uint64_t n_slots, uint64_t pages,
                                           uint32_t pool_pages) {
    gy_arena_config config;
    memset(&config, 0, sizeof config);
    config.backend = GY_ARENA_BACKEND_CUDA;
    config.device = 0;
    config.page_size = page_size;
    config.n_slots = n_slots;
    config.budget_bytes = pages * page_size;
    config.pool_pages = pool_pages;
    return config;
}

/* GY_OK with an arena, or GY_ERR_UNAVAILABLE with a reason and no arena; nothing else. */
static gy_status gy_test_cuda_open(gy_arena **arena, const gy_arena_config *config) {
    gy_status s = gy_arena_init(arena, config);
    if (s == GY_OK) {
        CHECK(*arena != NULL);
        return s;
    }
    CHECK_STATUS(s, GY_ERR_UNAVAILABLE);
    CHECK(*arena == NULL);
    CHECK(strlen(gy_error_message()) > 0);
    CHECK(strstr(gy_error_message(), "CUDA") != NULL);
    return s;
}

GYTEST(test_arena_cuda_init_is_unavailable_or_works) {
    gy_arena_config config = gy_test_cuda_config(GY_ARENA_DEFAULT_PAGE_SIZE, 8, 4, 2);
    gy_arena *arena = (gy_arena *)0x1; /* must be overwritten either way */
    gy_status s = gy_test_cuda_open(&arena, &config);
#ifndef GY_WITH_CUDA
    CHECK_STATUS(s, GY_ERR_UNAVAILABLE);
    CHECK(strstr(gy_error_message(), "not built with CUDA") != NULL);
#endif
    if (s == GY_OK) {
        CHECK(gy_arena_backend(arena) == GY_ARENA_BACKEND_CUDA);
        CHECK(gy_arena_base_address(arena) != 0);
        CHECK(gy_arena_host_ptr(arena, 0) == NULL); /* device memory is not host memory */
        gy_arena_free(arena);
    }
}

GYTEST(test_arena_cuda_refusals_leak_nothing) {
    /* A thousand refused inits: ASan's leak check fails the run if any of them leaks. */
    for (int i = 0; i < 1000; i++) {
        gy_arena_config config = gy_test_cuda_config(GY_ARENA_DEFAULT_PAGE_SIZE, 4, 2, 1);
        gy_arena *arena = NULL;
        if (gy_test_cuda_open(&arena, &config) == GY_OK) {
            gy_arena_free(arena);
            break; /* a GPU is here: the other tests cover it */
        }
    }
}

GYTEST(test_arena_cuda_config_checked_before_the_backend) {
    /* arena.c's own checks come first, whatever the backend: not a power of two. */
    gy_arena_config config = gy_test_cuda_config(3 * 4096, 4, 2, 0);
    gy_arena *arena = NULL;
    CHECK_STATUS(gy_arena_init(&arena, &config), GY_ERR_INVALID);
    CHECK(arena == NULL);
}

GYTEST(test_arena_cuda_page_size_below_granularity) {
    /* 4 KiB is a valid arena page size but below any CUDA device's VMM granularity (2 MiB on
     * current GPUs): the backend refuses it and names the granularity. */
    gy_arena_config config = gy_test_cuda_config(4096, 4, 2, 0);
    gy_arena *arena = NULL;
    gy_status s = gy_arena_init(&arena, &config);
    CHECK(arena == NULL);
    if (s == GY_ERR_UNAVAILABLE) return;
    CHECK_STATUS(s, GY_ERR_INVALID);
    CHECK(strstr(gy_error_message(), "granularity") != NULL);
}

GYTEST(test_arena_cuda_lifecycle_and_accounting) {
    const uint64_t ps = GY_ARENA_DEFAULT_PAGE_SIZE;
    gy_arena_config config = gy_test_cuda_config(ps, 8, 4, 2);
    gy_arena *arena = NULL;
    if (gy_test_cuda_open(&arena, &config) != GY_OK) return; /* no GPU: covered above */
    gy_arena_stats st;
    int64_t pages[5];
    for (int i = 0; i < 4; i++) {
        CHECK_OK(gy_arena_create_page(arena, GY_PAGE_TAG_KV, &pages[i]));
        CHECK(pages[i] == i); /* lowest free id first */
    }
    /* The pool is part of the budget: a fifth page does not exist. */
    CHECK_STATUS(gy_arena_create_page(arena, GY_PAGE_TAG_KV, &pages[4]), GY_ERR_OUT_OF_MEMORY);
    gy_arena_stats_get(arena, &st);
    CHECK(st.bytes_in_use == 4 * ps);
    CHECK(st.bytes_by_tag[GY_PAGE_TAG_KV] == 4 * ps);

    for (int i = 0; i < 4; i++) CHECK_OK(gy_arena_map(arena, i, pages[i]));
    CHECK(gy_arena_is_mapped(arena, 0, 4 * ps));
    /* Overlapping moves in both directions, near (staging) and far (direct chunks). */
    CHECK_OK(gy_arena_copy(arena, 4096, 0, 3 * ps));
    CHECK_OK(gy_arena_copy(arena, 0, 4096, 3 * ps));
    CHECK_OK(gy_arena_copy(arena, ps, 0, 3 * ps));
    CHECK_OK(gy_arena_copy(arena, 0, ps / 2, 3 * ps));

    CHECK_OK(gy_arena_remap(arena, 3, 7));
    CHECK(gy_arena_page_at(arena, 3) == -1);
    CHECK(gy_arena_page_at(arena, 7) == pages[3]);
    CHECK_OK(gy_arena_unmap(arena, 7));
    CHECK_OK(gy_arena_map(arena, 5, pages[3]));
    CHECK_OK(gy_arena_shrink(arena, 0, 2));
    gy_arena_stats_get(arena, &st);
    CHECK(st.bytes_in_use == 2 * ps);
    CHECK(st.pages_mapped == 2);
    CHECK(st.remaps_total == 1);

    /* Released pages come back (from the pool) and are usable again. */
    CHECK_OK(gy_arena_grow(arena, 0, 2, GY_PAGE_TAG_WEIGHTS));
    gy_arena_stats_get(arena, &st);
    CHECK(st.bytes_in_use == 4 * ps);
    CHECK(st.bytes_by_tag[GY_PAGE_TAG_WEIGHTS] == 2 * ps);
    CHECK(st.peak_bytes == 4 * ps);
    gy_arena_free(arena); /* with pages still mapped: the arena unmaps and releases them */
}

GYTEST(test_arena_cuda_pool_churn) {
    /* Many create/release rounds through a small pool and its refill thread. */
    const uint64_t ps = GY_ARENA_DEFAULT_PAGE_SIZE;
    gy_arena_config config = gy_test_cuda_config(ps, 16, 16, 4);
    gy_arena *arena = NULL;
    if (gy_test_cuda_open(&arena, &config) != GY_OK) return;
    for (int round = 0; round < 50; round++) {
        const int64_t n = 1 + round % 16;
        CHECK_OK(gy_arena_grow(arena, 0, n, GY_PAGE_TAG_KV));
        CHECK_OK(gy_arena_shrink(arena, 0, n));
    }
    gy_arena_stats st;
    gy_arena_stats_get(arena, &st);
    CHECK(st.bytes_in_use == 0);
    CHECK(st.pages_created_total == st.pages_released_total);
    gy_arena_free(arena);
}
