/* test_kv_copy.c: gy_kv_copy_heads on host caches against values written and gathered token by
 * token: every layout pair, odd sizes, a copy inside one cache, and refusals that copy nothing.
 * (The device path runs the same plumbing in tests/gpu_emu/harness.c.) */
#include <string.h>

#include "gytest.h"
#include "kv/kv_copy.h"

enum { L = 3, B = 3, D = 5 };

static gy_kv_cache *make(gy_arena **arena, gy_kv_layout_kind layout, int64_t heads) {
    gy_arena_config c = {.backend = GY_ARENA_BACKEND_CPU, .page_size = 4096, .n_slots = 64,
                         .budget_bytes = 32 * 4096};
    CHECK_OK(gy_arena_init(arena, &c));
    gy_kv_config k = {.layout = layout, .n_layers = L, .n_heads = heads, .head_dim = D,
                      .block_size = B, .elem_size = 4, .first_slot = 2, .slots_per_layer = 12};
    gy_kv_cache *kv = NULL;
    CHECK_OK(gy_kv_init(&kv, *arena, &k));
    CHECK_OK(gy_kv_grow(kv, 1));
    return kv;
}

/* A value that names its place: layer, K/V, token, head, d. */
static float tag(int64_t layer, int kv, int64_t token, int64_t head, int64_t d) {
    return (float)(layer * 100000 + kv * 10000 + token * 100 + head * 10 + d);
}

/* Writes tagged values into `n_tokens` tokens of a new sequence; returns it. */
static int64_t filled(gy_kv_cache *kv, int64_t heads, int64_t n_tokens, float offset) {
    int64_t seq;
    CHECK_OK(gy_kv_seq_new(kv, &seq));
    CHECK_OK(gy_kv_seq_reserve(kv, seq, n_tokens));
    float k[64 * 8 * D], v[64 * 8 * D];
    for (int64_t l = 0; l < L; l++) {
        for (int64_t t = 0; t < n_tokens; t++)
            for (int64_t h = 0; h < heads; h++)
                for (int64_t d = 0; d < D; d++) {
                    k[(t * heads + h) * D + d] = offset + tag(l, 0, t, h, d);
                    v[(t * heads + h) * D + d] = offset + tag(l, 1, t, h, d);
                }
        CHECK_OK(gy_kv_write(kv, seq, l, 0, n_tokens, k, v));
    }
    return seq;
}

GYTEST(kv_copy_heads_moves_head_ranges_between_every_layout_pair) {
    for (int sl = 0; sl < GY_KV_LAYOUT_COUNT; sl++)
        for (int dl = 0; dl < GY_KV_LAYOUT_COUNT; dl++) {
            gy_arena *sa, *da;
            gy_kv_cache *src = make(&sa, (gy_kv_layout_kind)sl, 3);
            gy_kv_cache *dst = make(&da, (gy_kv_layout_kind)dl, 4);
            const int64_t n = 7; /* three blocks, the last one partly used */
            int64_t first;
            CHECK_OK(gy_kv_seq_new(src, &first)); /* takes blocks: the copied ones are not 0.. */
            CHECK_OK(gy_kv_seq_reserve(src, first, 2 * B));
            const int64_t s = filled(src, 3, n, 0.0f);
            const int64_t d = filled(dst, 4, n, 0.5f);
            const int32_t *sb = gy_kv_seq_blocks(src, s), *db = gy_kv_seq_blocks(dst, d);
            /* heads 1..2 of the source -> heads 2..3 of the destination, layers 1..2 */
            CHECK_OK(gy_kv_copy_heads(dst, db, 2, src, sb, 1, 2, 3, 1, 2));
            float k[64 * 4 * D], v[64 * 4 * D];
            int ok = 1;
            for (int64_t l = 0; l < L; l++) {
                CHECK_OK(gy_kv_gather(dst, d, l, 0, n, k, v));
                for (int64_t t = 0; t < n; t++)
                    for (int64_t h = 0; h < 4; h++)
                        for (int64_t dd = 0; dd < D; dd++) {
                            const int moved = l >= 1 && h >= 2;
                            const float want_k = moved ? tag(l, 0, t, h - 1, dd) : 0.5f + tag(l, 0, t, h, dd);
                            const float want_v = moved ? tag(l, 1, t, h - 1, dd) : 0.5f + tag(l, 1, t, h, dd);
                            ok &= k[(t * 4 + h) * D + dd] == want_k && v[(t * 4 + h) * D + dd] == want_v;
                        }
            }
            CHECK(ok);
            gy_kv_free(src);
            gy_kv_free(dst);
            gy_arena_free(sa);
            gy_arena_free(da);
        }
}

GYTEST(kv_copy_heads_within_one_cache_and_refusals) {
    gy_arena *a, *b;
    gy_kv_cache *kv = make(&a, GY_KV_LAYOUT_HEAD, 2);
    const int64_t s = filled(kv, 2, 6, 0.0f);
    int64_t t;
    CHECK_OK(gy_kv_seq_new(kv, &t));
    CHECK_OK(gy_kv_seq_reserve(kv, t, 6));
    const int32_t sb[2] = {gy_kv_seq_blocks(kv, s)[0], gy_kv_seq_blocks(kv, s)[1]};
    const int32_t tb[2] = {gy_kv_seq_blocks(kv, t)[0], gy_kv_seq_blocks(kv, t)[1]};
    CHECK_OK(gy_kv_copy_heads(kv, tb, 0, kv, sb, 0, 2, 2, 0, L));
    float k0[6 * 2 * D], v0[6 * 2 * D], k1[6 * 2 * D], v1[6 * 2 * D];
    for (int64_t l = 0; l < L; l++) {
        CHECK_OK(gy_kv_gather(kv, s, l, 0, 6, k0, v0));
        CHECK_OK(gy_kv_gather(kv, t, l, 0, 6, k1, v1));
        CHECK(memcmp(k0, k1, sizeof k0) == 0 && memcmp(v0, v1, sizeof v0) == 0);
    }
    gy_kv_cache *other = make(&b, GY_KV_LAYOUT_HEAD, 2);
    float before[6 * 2 * D], after[6 * 2 * D];
    CHECK_OK(gy_kv_gather(kv, t, 0, 0, 6, before, v1));
    const int32_t far[2] = {tb[0], 999};
    CHECK_STATUS(gy_kv_copy_heads(kv, far, 0, kv, sb, 0, 2, 2, 0, L), GY_ERR_INVALID);
    CHECK(strstr(gy_error_message(), "destination block 999") != NULL);
    CHECK_STATUS(gy_kv_copy_heads(kv, tb, 1, kv, sb, 0, 2, 2, 0, L), GY_ERR_INVALID);
    CHECK(strstr(gy_error_message(), "out of range") != NULL);
    CHECK_STATUS(gy_kv_copy_heads(kv, tb, 0, kv, sb, 0, 2, 2, 1, L), GY_ERR_INVALID);
    CHECK_STATUS(gy_kv_copy_heads(kv, tb, 0, kv, sb, 0, -1, 2, 0, L), GY_ERR_INVALID);
    CHECK_STATUS(gy_kv_copy_heads(kv, NULL, 0, kv, sb, 0, 2, 2, 0, L), GY_ERR_INVALID);
    CHECK_OK(gy_kv_gather(kv, t, 0, 0, 6, after, v1));
    CHECK(memcmp(before, after, sizeof before) == 0);
    CHECK_OK(gy_kv_copy_heads(other, tb, 0, kv, sb, 0, 2, 0, 0, L)); /* nothing to copy */
    gy_kv_free(other);
    gy_arena_free(b);
    /* another value size or block size is refused */
    gy_arena_config c = {.backend = GY_ARENA_BACKEND_CPU, .page_size = 4096, .n_slots = 64,
                         .budget_bytes = 32 * 4096};
    CHECK_OK(gy_arena_init(&b, &c));
    gy_kv_config k16 = {.layout = GY_KV_LAYOUT_HEAD, .n_layers = L, .n_heads = 2, .head_dim = D,
                        .block_size = B, .elem_size = 2, .first_slot = 0, .slots_per_layer = 12};
    CHECK_OK(gy_kv_init(&other, b, &k16));
    CHECK_OK(gy_kv_grow(other, 1));
    CHECK_STATUS(gy_kv_copy_heads(other, tb, 0, kv, sb, 0, 2, 2, 0, L), GY_ERR_INVALID);
    CHECK(strstr(gy_error_message(), "value size") != NULL);
    gy_kv_free(other);
    gy_arena_free(b);
    gy_kv_free(kv);
    gy_arena_free(a);
}
