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

/* What a caller can see of a cache's sequences: each live one's table, then the order the next
 * allocations would take (reserving the free blocks one by one). */
typedef struct {
    int64_t n_blocks[32], tokens[32];
    int32_t blocks[32][64];
    uint64_t gens[32];
    int64_t free_blocks;
    int32_t next[64]; /* the free blocks in the order they would be handed out (unmarked only) */
} kv_view;
static void kv_look(const gy_kv_cache *kv, kv_view *v) {
    memset(v, 0, sizeof *v);
    for (int64_t s = 0; s < 32; s++) {
        v->n_blocks[s] = gy_kv_seq_n_blocks(kv, s);
        if (v->n_blocks[s] < 0) continue;
        if (v->n_blocks[s] > 0)
            memcpy(v->blocks[s], gy_kv_seq_blocks(kv, s), (size_t)v->n_blocks[s] * sizeof(int32_t));
        v->tokens[s] = gy_kv_seq_n_tokens(kv, s);
        v->gens[s] = gy_kv_seq_generation(kv, s);
    }
    gy_kv_stats st;
    gy_kv_stats_get(kv, &st);
    v->free_blocks = st.free_blocks;
}

/* A probe sequence takes every free block and gives them back (a free pushes them back in the
 * order they were taken, so the stack ends as it was). */
static void kv_look_free_order(gy_kv_cache *kv, kv_view *v) {
    int64_t s;
    if (v->free_blocks == 0 || gy_kv_seq_new(kv, &s) != GY_OK) return;
    if (gy_kv_seq_reserve(kv, s, v->free_blocks * 4) == GY_OK)
        memcpy(v->next, gy_kv_seq_blocks(kv, s), (size_t)v->free_blocks * sizeof(int32_t));
    gy_kv_seq_free(kv, s);
}

static uint64_t kv_lcg(uint64_t *x) {
    *x = *x * 6364136223846793005ULL + 1442695040888963407ULL;
    return *x >> 33;
}

/* Random sequence calls after a mark, then undo: every table, token count, generation and the
 * free stack (the blocks a new sequence gets next) are as at the mark; calls past a point are
 * taken back alone by undo_to; unmark keeps the changes and frees held-back ids. */
GYTEST(kv_undo_takes_back_every_sequence_change) {
    gy_arena *arena;
    gy_kv_cache *kv = make_kv(&arena, GY_KV_LAYOUT_HEAD);
    CHECK_OK(gy_kv_grow(kv, 2)); /* 16 blocks */
    uint64_t seed = 3;
    int ok = 1;
    for (int trial = 0; trial < 200; trial++) {
        /* some state to start from */
        for (int k = 0; k < 3; k++) {
            int64_t s;
            if (gy_kv_seq_new(kv, &s) == GY_OK && gy_kv_seq_reserve(kv, s, (int64_t)(kv_lcg(&seed) % 9)) != GY_OK)
                gy_kv_seq_free(kv, s);
        }
        kv_view before, after, middle;
        kv_look(kv, &before);
        kv_look_free_order(kv, &before);
        CHECK_OK(gy_kv_mark(kv, 64));
        int64_t point = -1;
        for (int op = 0; op < 12; op++) {
            if (op == 6) {
                point = gy_kv_undo_point(kv);
                kv_look(kv, &middle);
            }
            const int64_t s = (int64_t)(kv_lcg(&seed) % 12);
            switch (kv_lcg(&seed) % 4) {
            case 0: {
                int64_t id;
                gy_kv_seq_new(kv, &id);
                break;
            }
            case 1:
            case 2: gy_kv_seq_reserve(kv, s, (int64_t)(kv_lcg(&seed) % 20)); break;
            default: gy_kv_seq_free(kv, s); break;
            }
            gy_error_clear();
        }
        if (kv_lcg(&seed) % 2) {
            gy_kv_undo_to(kv, point);
            kv_look(kv, &after);
            ok &= memcmp(&middle, &after, sizeof after) == 0;
        }
        gy_kv_undo(kv);
        kv_look(kv, &after);
        kv_look_free_order(kv, &after);
        ok &= memcmp(&before, &after, sizeof after) == 0;
        /* free everything, marked half the time (then unmarked: the ids come back) */
        if (trial % 2) CHECK_OK(gy_kv_mark(kv, 4));
        for (int64_t s = 0; s < 32; s++)
            if (gy_kv_seq_n_blocks(kv, s) >= 0) gy_kv_seq_free(kv, s);
        gy_kv_unmark(kv);
        gy_kv_stats st;
        gy_kv_stats_get(kv, &st);
        ok &= st.free_blocks == 16 && st.n_sequences == 0;
    }
    CHECK(ok);
    /* While marked: adopt, shrink and reshape are refused; growing is allowed. */
    CHECK_OK(gy_kv_mark(kv, 4));
    int32_t b0 = 0;
    int64_t s;
    CHECK_STATUS(gy_kv_seq_adopt(kv, &b0, 1, 1, &s), GY_ERR_BUSY);
    CHECK_STATUS(gy_kv_shrink(kv, 1), GY_ERR_BUSY);
    CHECK_STATUS(gy_kv_reshape(kv, 1), GY_ERR_BUSY);
    CHECK_OK(gy_kv_grow(kv, 1));
    gy_kv_undo(kv);
    CHECK_OK(gy_kv_shrink(kv, 1));
    gy_kv_free(kv);
    gy_arena_free(arena);
}

/* Flying Serving's adaptor: a view of factor 2 reads blocks of 8 tokens of 1 head, the same 512
 * bytes, from the base's pool. DP and TP sequences share the pool without sharing a block, values
 * land where the view's layout says, growth through the view is the base's, and refusals. */
GYTEST(kv_views_share_one_block_pool) {
    for (int layout = 0; layout < GY_KV_LAYOUT_COUNT; layout++) {
        gy_arena *arena;
        gy_kv_cache *kv = make_kv(&arena, (gy_kv_layout_kind)layout);
        gy_kv_cache *view = NULL;
        CHECK_STATUS(gy_kv_init_view(&view, kv, 3), GY_ERR_INVALID); /* 3 does not divide 2 heads */
        CHECK_OK(gy_kv_init_view(&view, kv, 2));
        const gy_kv_layout *L = gy_kv_layout_of(view);
        CHECK(L->n_heads == 1 && L->block_size == 8 && L->block_elems == gy_kv_layout_of(kv)->block_elems);
        CHECK_OK(gy_kv_grow(view, 1)); /* the base's pages: 8 blocks, seen by both */
        CHECK(gy_kv_layout_of(kv)->n_blocks == 8 && gy_kv_layout_of(view)->n_blocks == 8);
        int64_t dp, tp;
        CHECK_OK(gy_kv_seq_new(kv, &dp));
        CHECK_OK(gy_kv_seq_reserve(kv, dp, 9)); /* 3 blocks of 4 tokens */
        CHECK_OK(gy_kv_seq_new(view, &tp));
        CHECK(gy_kv_blocks_needed(view, tp, 17) == 3); /* blocks of 8 tokens */
        CHECK_OK(gy_kv_seq_reserve(view, tp, 17));
        gy_kv_stats st;
        gy_kv_stats_get(kv, &st);
        CHECK(st.free_blocks == 2 && st.n_sequences == 2);
        const int32_t *a = gy_kv_seq_blocks(kv, dp), *b = gy_kv_seq_blocks(view, tp);
        int disjoint = 1;
        for (int i = 0; i < 3; i++)
            for (int j = 0; j < 3; j++) disjoint &= a[i] != b[j];
        CHECK(disjoint);
        /* A TP token's values sit at the view's offsets in the shared bytes. */
        float k[17 * 8], v[17 * 8], k2[17 * 8], v2[17 * 8];
        fill(k, 17 * 8, 3.0f);
        fill(v, 17 * 8, -7.0f);
        CHECK_OK(gy_kv_write(view, tp, 1, 0, 17, k, v));
        const float *base = gy_kv_layer_ptr(kv, 1);
        int placed = 1;
        for (int64_t t = 0; t < 17; t++)
            placed &= memcmp(base + gy_kv_layout_offset(L, 1, b[t / 8], t % 8, 0), v + t * 8,
                             8 * sizeof(float)) == 0;
        CHECK(placed);
        CHECK_OK(gy_kv_gather(view, tp, 1, 0, 17, k2, v2));
        CHECK(memcmp(k, k2, sizeof k) == 0 && memcmp(v, v2, sizeof v) == 0);
        /* The undo record is the pool's: marked through the base, a view's reserve comes back. */
        CHECK_OK(gy_kv_mark(kv, 4));
        CHECK_OK(gy_kv_seq_reserve(view, tp, 40)); /* the last 2 free blocks */
        CHECK_STATUS(gy_kv_seq_reserve(view, tp, 48), GY_ERR_OUT_OF_MEMORY);
        gy_kv_undo(kv);
        CHECK(gy_kv_seq_n_blocks(view, tp) == 3);
        /* Refused while viewed: reshape, a shadow, a view of a view. */
        gy_kv_cache *other = NULL;
        CHECK_STATUS(gy_kv_reshape(kv, 1), GY_ERR_BUSY);
        CHECK_STATUS(gy_kv_init_shadow(&other, kv, 1), GY_ERR_BUSY);
        CHECK_STATUS(gy_kv_init_view(&other, view, 1), GY_ERR_BUSY);
        /* Shrinking through the view stops at used blocks, then gives back the base's page. */
        CHECK_STATUS(gy_kv_shrink(view, 1), GY_ERR_BUSY);
        CHECK_OK(gy_kv_seq_free(view, tp));
        CHECK_OK(gy_kv_seq_free(kv, dp));
        CHECK(gy_kv_shrinkable_pages(view) == 1);
        CHECK_OK(gy_kv_shrink(view, 1));
        CHECK(gy_kv_layout_of(view)->n_blocks == 0);
        gy_kv_free(view);
        if (layout == GY_KV_LAYOUT_HEAD) CHECK_OK(gy_kv_reshape(kv, 1)); /* no views left */
        gy_kv_free(kv);
        gy_arena_free(arena);
    }
}

/* Layer stacking (PipeLive 5.2): k layers' blocks side by side in one run of pages. */
GYTEST(kv_stacked_runs_hold_k_layers_side_by_side) {
    gy_arena_config ac = {.backend = GY_ARENA_BACKEND_CPU, .page_size = 4096, .n_slots = 64,
                          .budget_bytes = 16 * 4096};
    gy_arena *arena;
    CHECK_OK(gy_arena_init(&arena, &ac));
    /* block = 512 bytes; with k = 2 a page holds 4 blocks of each of the 2 layers of a run */
    gy_kv_config k = {.layout = GY_KV_LAYOUT_HEAD, .n_layers = 4, .n_heads = 2, .head_dim = 8,
                      .block_size = 4, .elem_size = 4, .first_slot = 1, .slots_per_layer = 10,
                      .stack = 2};
    gy_kv_cache *kv = NULL;
    gy_kv_config bad = k;
    bad.layout = GY_KV_LAYOUT_RAW;
    CHECK_STATUS(gy_kv_init(&kv, arena, &bad), GY_ERR_INVALID);
    bad = k;
    bad.n_layers = 3;
    CHECK_STATUS(gy_kv_init(&kv, arena, &bad), GY_ERR_INVALID);
    CHECK_OK(gy_kv_init(&kv, arena, &k));
    CHECK(gy_kv_n_runs(kv) == 2);
    CHECK_OK(gy_kv_grow(kv, 1)); /* 2 pages in all: 4 blocks */
    gy_arena_stats st;
    gy_arena_stats_get(arena, &st);
    CHECK(st.bytes_in_use == 2 * 4096 && gy_kv_layout_of(kv)->n_blocks == 4);
    CHECK(gy_kv_layer_offset(kv, 1) == gy_kv_layer_offset(kv, 0) + 512);
    CHECK(gy_kv_layer_offset(kv, 2) == (1 + 10) * 4096ull);
    CHECK(gy_kv_layout_of(kv)->stride_block == 2 * gy_kv_layout_of(kv)->block_elems);
    int64_t s;
    CHECK_OK(gy_kv_seq_new(kv, &s));
    CHECK_OK(gy_kv_seq_reserve(kv, s, 13));
    float x[13 * 16], y[13 * 16], x2[13 * 16], y2[13 * 16];
    for (int64_t l = 0; l < 4; l++) {
        fill(x, 13 * 16, 10.0f * (float)l);
        fill(y, 13 * 16, -10.0f * (float)l - 3.0f);
        CHECK_OK(gy_kv_write(kv, s, l, 0, 13, x, y));
    }
    CHECK_OK(gy_kv_grow(kv, 1)); /* growth keeps every layer's values */
    for (int64_t l = 0; l < 4; l++) {
        fill(x, 13 * 16, 10.0f * (float)l);
        fill(y, 13 * 16, -10.0f * (float)l - 3.0f);
        CHECK_OK(gy_kv_gather(kv, s, l, 0, 13, x2, y2));
        CHECK(memcmp(x, x2, sizeof x) == 0 && memcmp(y, y2, sizeof y) == 0);
    }
    /* ranges are whole runs; the stacked cache is never reshaped, shadowed or viewed */
    CHECK_STATUS(gy_kv_set_layers(kv, 1, 2), GY_ERR_INVALID);
    gy_kv_cache *other = NULL;
    CHECK_STATUS(gy_kv_reshape(kv, 1), GY_ERR_INVALID);
    CHECK_STATUS(gy_kv_init_shadow(&other, kv, 1), GY_ERR_INVALID);
    CHECK_STATUS(gy_kv_init_view(&other, kv, 2), GY_ERR_INVALID);
    CHECK_OK(gy_kv_set_layers(kv, 2, 2)); /* the second run stays, values and all */
    fill(x, 13 * 16, 30.0f);
    CHECK_OK(gy_kv_gather(kv, s, 1, 0, 13, x2, y2));
    CHECK(memcmp(x, x2, sizeof x) == 0);
    gy_arena_stats_get(arena, &st);
    CHECK(st.bytes_in_use == 2 * 4096);
    gy_kv_free(kv);
    gy_arena_stats_get(arena, &st);
    CHECK(st.bytes_in_use == 0);
    gy_arena_free(arena);
}
