/* test_kv_mover.c: a layer read early, patched and written (under the sanitizers): the staged
 * tokens of an unchanged sequence are reused, a freed-and-remade one is read again. */
#include <string.h>

#include "gytest.h"
#include "kv/kv_mover.h"

static void fill(gy_kv_cache *kv, int64_t seq, int64_t pos, int64_t n, float base) {
    float k[16 * 2 * 8], v[16 * 2 * 8];
    for (int64_t i = 0; i < n * 2 * 8; i++) {
        k[i] = base + (float)i;
        v[i] = -base - (float)i;
    }
    CHECK_OK(gy_kv_seq_reserve(kv, seq, pos + n));
    for (int64_t layer = 0; layer < 2; layer++) CHECK_OK(gy_kv_write(kv, seq, layer, pos, n, k, v));
}

static gy_arena *new_arena(void) {
    gy_arena_config c = {.backend = GY_ARENA_BACKEND_CPU, .page_size = 4096, .n_slots = 64,
                         .budget_bytes = 32 * 4096};
    gy_arena *arena = NULL;
    CHECK_OK(gy_arena_init(&arena, &c));
    return arena;
}

/* Two layers of two heads, header-centric, blocks of 4 tokens. */
static gy_kv_config kv_config(void) {
    return (gy_kv_config){.layout = GY_KV_LAYOUT_HEAD, .n_layers = 2, .n_heads = 2, .head_dim = 8,
                          .block_size = 4, .elem_size = 4, .first_slot = 0, .slots_per_layer = 16};
}

GYTEST(kv_mover_reuses_early_reads_and_notices_remade_sequences) {
    gy_arena *arena = new_arena();
    gy_kv_config k = kv_config();
    gy_kv_cache *old, *dst;
    CHECK_OK(gy_kv_init(&old, arena, &k));
    CHECK_OK(gy_kv_grow(old, 2));
    k.first_slot = 32;
    CHECK_OK(gy_kv_init(&dst, arena, &k));
    CHECK_OK(gy_kv_grow(dst, 2));
    int64_t a, b, da, db;
    CHECK_OK(gy_kv_seq_new(old, &a));
    CHECK_OK(gy_kv_seq_new(old, &b));
    CHECK_OK(gy_kv_seq_new(dst, &da));
    CHECK_OK(gy_kv_seq_new(dst, &db));
    fill(old, a, 0, 6, 1.0f);
    fill(old, b, 0, 5, 100.0f);
    CHECK_OK(gy_kv_seq_reserve(dst, da, 16));
    CHECK_OK(gy_kv_seq_reserve(dst, db, 16));
    gy_kv_move_item items[2] = {
        {.src = old, .dst = dst, .src_seq = a, .dst_seq = da, .src_head = 0, .n_heads = 2, .n_tokens = 6},
        {.src = old, .dst = dst, .src_seq = b, .dst_seq = db, .src_head = 0, .n_heads = 2, .n_tokens = 5},
    };
    gy_kv_mover *m;
    CHECK_OK(gy_kv_mover_init(&m));
    CHECK_OK(gy_kv_mover_plan(m, items, 2, 1));
    CHECK_OK(gy_kv_mover_read(m));
    fill(old, a, 6, 3, 50.0f);          /* a step adds 3 tokens to a */
    CHECK_OK(gy_kv_seq_free(old, b));   /* b is freed and made again */
    int64_t b2;
    CHECK_OK(gy_kv_seq_new(old, &b2));
    CHECK(b2 == b);
    fill(old, b2, 0, 7, 200.0f);
    items[0].n_tokens = 9;
    items[1].n_tokens = 7;
    gy_kv_move_stats st;
    CHECK_OK(gy_kv_mover_finish(m, items, 2, 1, 2, &st));
    CHECK(st.items_reused == 1 && st.items_stale == 1);
    CHECK(st.bytes_early == 6 * 2 * 2 * 8 * 4);
    CHECK(st.bytes_moved == (9 + 7) * 2 * 2 * 8 * 4);
    float k0[16 * 16], v0[16 * 16], k1[16 * 16], v1[16 * 16];
    CHECK_OK(gy_kv_gather(old, a, 1, 0, 9, k0, v0));
    CHECK_OK(gy_kv_gather(dst, da, 1, 0, 9, k1, v1));
    CHECK(memcmp(k0, k1, 9 * 16 * sizeof(float)) == 0 && memcmp(v0, v1, 9 * 16 * sizeof(float)) == 0);
    CHECK_OK(gy_kv_gather(old, b2, 1, 0, 7, k0, v0));
    CHECK_OK(gy_kv_gather(dst, db, 1, 0, 7, k1, v1));
    CHECK(memcmp(k0, k1, 7 * 16 * sizeof(float)) == 0 && memcmp(v0, v1, 7 * 16 * sizeof(float)) == 0);
    items[1].src_head = 1; /* heads [1, 3) of 2: refused */
    CHECK_STATUS(gy_kv_mover_plan(m, items, 2, 0), GY_ERR_INVALID);
    CHECK_STATUS(gy_kv_mover_finish(m, items, 2, 0, 2, NULL), GY_ERR_INVALID);
    gy_kv_mover_free(m);
    gy_kv_free(dst);
    gy_kv_free(old);
    gy_arena_free(arena);
}

GYTEST(kv_mover_leaves_a_ranks_own_heads_in_place) {
    gy_arena *arena = new_arena();
    gy_kv_config k = kv_config();
    gy_kv_cache *old, *shadow;
    CHECK_OK(gy_kv_init(&old, arena, &k));
    CHECK_OK(gy_kv_grow(old, 2));
    CHECK_OK(gy_kv_init_shadow(&shadow, old, 1));
    int64_t a, own, peer;
    CHECK_OK(gy_kv_seq_new(old, &a));
    fill(old, a, 0, 7, 3.0f);
    /* Head 1 of old block X is the shadow's block 2X + 1: head 1 stays where it is; head 0 goes
     * to blocks of its own elsewhere. */
    const int32_t *ob = gy_kv_seq_blocks(old, a);
    const int32_t in_place[2] = {2 * ob[0] + 1, 2 * ob[1] + 1};
    CHECK_OK(gy_kv_seq_adopt(shadow, in_place, 2, 7, &own));
    const int32_t elsewhere[2] = {20, 21}; /* not the run of any old block in use */
    CHECK_OK(gy_kv_seq_adopt(shadow, elsewhere, 2, 7, &peer));
    float k0[7 * 16], v0[7 * 16], k1[7 * 8], v1[7 * 8];
    CHECK_OK(gy_kv_gather(old, a, 1, 0, 7, k0, v0));
    gy_kv_move_item items[2] = {
        {.src = old, .dst = shadow, .src_seq = a, .dst_seq = own, .src_head = 1, .n_heads = 1, .n_tokens = 7},
        {.src = old, .dst = shadow, .src_seq = a, .dst_seq = peer, .src_head = 0, .n_heads = 1, .n_tokens = 7},
    };
    gy_kv_mover *m;
    CHECK_OK(gy_kv_mover_init(&m));
    gy_kv_move_stats st;
    CHECK_OK(gy_kv_mover_finish(m, items, 2, 1, 1, &st));
    CHECK(st.bytes_in_place == 7 * 2 * 8 * 4);
    CHECK(st.bytes_moved == 7 * 2 * 8 * 4);
    for (int64_t h = 0; h < 2; h++) {
        CHECK_OK(gy_kv_gather(shadow, h ? own : peer, 1, 0, 7, k1, v1));
        for (int64_t t = 0; t < 7; t++)
            CHECK(memcmp(k1 + t * 8, k0 + t * 16 + h * 8, 8 * sizeof(float)) == 0 &&
                  memcmp(v1 + t * 8, v0 + t * 16 + h * 8, 8 * sizeof(float)) == 0);
    }
    gy_kv_mover_free(m);
    gy_kv_free(shadow);
    gy_kv_free(old);
    gy_arena_free(arena);
}
