/* test_kv_cache.c: KV layouts against hand-written formulas, growth cost per layout, block
 * tables, and refusals. */
#include <string.h>

#include "gytest.h"
#include "kv/kv_cache.h"

GYTEST(kv_layout_offsets_match_hand_formulas) {
    const int64_t B = 3, H = 5, D = 7, N = 11;
    gy_kv_layout raw, page, head;
    CHECK_OK(gy_kv_layout_init(&raw, GY_KV_LAYOUT_RAW, B, H, D, 4, N));
    CHECK_OK(gy_kv_layout_init(&page, GY_KV_LAYOUT_PAGE, B, H, D, 4, N));
    CHECK_OK(gy_kv_layout_init(&head, GY_KV_LAYOUT_HEAD, B, H, D, 4, N));
    int ok = 1;
    for (int64_t kv = 0; kv < 2; kv++)
        for (int64_t b = 0; b < N; b++)
            for (int64_t t = 0; t < B; t++)
                for (int64_t h = 0; h < H; h++) {
                    ok &= gy_kv_layout_offset(&raw, kv, b, t, h) == (((kv * N + b) * B + t) * H + h) * D;
                    ok &= gy_kv_layout_offset(&page, kv, b, t, h) == (((b * 2 + kv) * B + t) * H + h) * D;
                    ok &= gy_kv_layout_offset(&head, kv, b, t, h) == (((b * H + h) * 2 + kv) * B + t) * D;
                }
    CHECK(ok);
    int32_t order[4];
    gy_kv_layout_stride_order(GY_KV_LAYOUT_HEAD, order);
    CHECK(order[0] == GY_KV_DIM_BLOCK && order[1] == GY_KV_DIM_HEAD && order[2] == GY_KV_DIM_KV &&
          order[3] == GY_KV_DIM_TOKEN);
    CHECK_STATUS(gy_kv_layout_init(&raw, (gy_kv_layout_kind)9, B, H, D, 4, N), GY_ERR_INVALID);
    CHECK_STATUS(gy_kv_layout_init(&raw, GY_KV_LAYOUT_RAW, 0, H, D, 4, N), GY_ERR_INVALID);
}

static gy_kv_cache *make_kv(gy_arena **arena, gy_kv_layout_kind layout) {
    gy_arena_config c = {.backend = GY_ARENA_BACKEND_CPU, .page_size = 4096, .n_slots = 64,
                         .budget_bytes = 16 * 4096};
    CHECK_OK(gy_arena_init(arena, &c));
    /* block = 2 * 4 tokens * 2 heads * 8 dims * 4 bytes = 512 bytes: 8 blocks a page */
    gy_kv_config k = {.layout = layout, .n_layers = 3, .n_heads = 2, .head_dim = 8,
                      .block_size = 4, .elem_size = 4, .first_slot = 1, .slots_per_layer = 10};
    gy_kv_cache *kv = NULL;
    CHECK_OK(gy_kv_init(&kv, *arena, &k));
    return kv;
}

static void fill(float *x, int64_t n, float seed) {
    for (int64_t i = 0; i < n; i++) x[i] = seed + (float)i * 0.25f;
}

GYTEST(kv_values_survive_growth_in_every_layout) {
    for (int layout = 0; layout < GY_KV_LAYOUT_COUNT; layout++) {
        gy_arena *arena;
        gy_kv_cache *kv = make_kv(&arena, (gy_kv_layout_kind)layout);
        CHECK_OK(gy_kv_grow(kv, 1));
        int64_t s;
        CHECK_OK(gy_kv_seq_new(kv, &s));
        CHECK_OK(gy_kv_seq_reserve(kv, s, 13)); /* 4 blocks */
        float k[13 * 16], v[13 * 16], k2[13 * 16], v2[13 * 16];
        for (int64_t l = 0; l < 3; l++) {
            fill(k, 13 * 16, 100.0f * (float)l);
            fill(v, 13 * 16, -100.0f * (float)l - 1.0f);
            CHECK_OK(gy_kv_write(kv, s, l, 0, 13, k, v));
        }
        gy_kv_stats st;
        gy_kv_stats_get(kv, &st);
        CHECK(st.n_blocks == 8 && st.free_blocks == 4 && st.bytes_moved == 0);
        CHECK_OK(gy_kv_grow(kv, 2));
        gy_kv_stats_get(kv, &st);
        CHECK(st.n_blocks == 24 && st.free_blocks == 20);
        /* Raw: every layer's 8 V blocks of 256 bytes moved; the others move nothing. */
        CHECK(st.bytes_moved == (layout == GY_KV_LAYOUT_RAW ? 3u * 8 * 256 : 0u));
        for (int64_t l = 0; l < 3; l++) {
            fill(k, 13 * 16, 100.0f * (float)l);
            fill(v, 13 * 16, -100.0f * (float)l - 1.0f);
            CHECK_OK(gy_kv_gather(kv, s, l, 0, 13, k2, v2));
            CHECK(memcmp(k, k2, sizeof k) == 0 && memcmp(v, v2, sizeof v) == 0);
        }
        gy_kv_free(kv);
        gy_arena_stats ast;
        gy_arena_stats_get(arena, &ast);
        CHECK(ast.bytes_in_use == 0); /* the cache gave every page back */
        gy_arena_free(arena);
    }
}

GYTEST(kv_shrink_needs_free_tail_blocks) {
    for (int layout = 0; layout < GY_KV_LAYOUT_COUNT; layout++) {
        gy_arena *arena;
        gy_kv_cache *kv = make_kv(&arena, (gy_kv_layout_kind)layout);
        CHECK_OK(gy_kv_grow(kv, 2)); /* 16 blocks */
        int64_t a, b;
        CHECK_OK(gy_kv_seq_new(kv, &a));
        CHECK_OK(gy_kv_seq_reserve(kv, a, 4 * 10)); /* blocks 0..9 */
        CHECK_STATUS(gy_kv_shrink(kv, 1), GY_ERR_BUSY); /* blocks 8, 9 in use */
        CHECK_OK(gy_kv_seq_new(kv, &b));
        CHECK_OK(gy_kv_seq_free(kv, a));
        CHECK_OK(gy_kv_seq_reserve(kv, b, 4 * 3)); /* reuses a's first blocks */
        const int32_t *bt = gy_kv_seq_blocks(kv, b);
        CHECK(bt[0] == 0 && bt[1] == 1 && bt[2] == 2);
        float k[12 * 16], v[12 * 16], k2[12 * 16], v2[12 * 16];
        fill(k, 12 * 16, 3.0f);
        fill(v, 12 * 16, 7.0f);
        CHECK_OK(gy_kv_write(kv, b, 2, 0, 12, k, v));
        CHECK_OK(gy_kv_shrink(kv, 1));
        gy_kv_stats st;
        gy_kv_stats_get(kv, &st);
        CHECK(st.n_blocks == 8 && st.free_blocks == 5 && st.pages_per_layer == 1);
        CHECK_OK(gy_kv_gather(kv, b, 2, 0, 12, k2, v2));
        CHECK(memcmp(k, k2, sizeof k) == 0 && memcmp(v, v2, sizeof v) == 0);
        gy_kv_free(kv);
        gy_arena_free(arena);
    }
}

GYTEST(kv_refusals) {
    gy_arena *arena;
    gy_kv_cache *kv = make_kv(&arena, GY_KV_LAYOUT_HEAD);
    int64_t s;
    CHECK_OK(gy_kv_seq_new(kv, &s));
    CHECK_STATUS(gy_kv_seq_reserve(kv, s, 1), GY_ERR_OUT_OF_MEMORY); /* no blocks yet */
    CHECK_OK(gy_kv_grow(kv, 1));
    CHECK_STATUS(gy_kv_seq_reserve(kv, s, 4 * 9), GY_ERR_OUT_OF_MEMORY); /* 9 > 8 blocks */
    CHECK(gy_kv_seq_n_blocks(kv, s) == 0);
    CHECK_STATUS(gy_kv_grow(kv, 10), GY_ERR_LIMIT);        /* past slots_per_layer */
    CHECK_STATUS(gy_kv_grow(kv, 0), GY_ERR_INVALID);
    CHECK_STATUS(gy_kv_grow(kv, 5), GY_ERR_OUT_OF_MEMORY); /* 3 layers * 5 > 13 free pages */
    CHECK_OK(gy_kv_seq_reserve(kv, s, 5));
    float k[16], v[16];
    fill(k, 16, 0.0f);
    fill(v, 16, 0.0f);
    CHECK_STATUS(gy_kv_write(kv, s, 3, 0, 1, k, v), GY_ERR_INVALID); /* layer out of range */
    CHECK_STATUS(gy_kv_write(kv, s, 0, 8, 1, k, v), GY_ERR_INVALID); /* past reserved blocks */
    CHECK_STATUS(gy_kv_write(kv, 99, 0, 0, 1, k, v), GY_ERR_STATE);  /* unknown sequence */
    CHECK_OK(gy_kv_seq_free(kv, s));
    CHECK_STATUS(gy_kv_seq_free(kv, s), GY_ERR_STATE);               /* double free */
    gy_kv_config bad = {.layout = GY_KV_LAYOUT_PAGE, .n_layers = 7, .n_heads = 2, .head_dim = 8,
                        .block_size = 4, .elem_size = 4, .first_slot = 0, .slots_per_layer = 10};
    gy_kv_cache *kv2 = NULL;
    CHECK_STATUS(gy_kv_init(&kv2, arena, &bad), GY_ERR_INVALID); /* 70 slots > 64 */
    gy_kv_free(kv);
    gy_arena_free(arena);
}
