/* test_kv_patch.c: PipeLive's KV pieces: the dirty bitmap (no slot lost with a concurrent
 * sender), the KV move between caches of other layer ranges (whole blocks or dirty slots),
 * compaction and the layer range of a cache. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "gytest.h"
#include "kv/kv_dirty.h"
#include "kv/kv_move.h"

/* block = 2 * 4 tokens * 2 heads * 8 dims * 4 bytes = 512 bytes: 8 blocks a page */
static gy_kv_cache *make_stage(gy_arena **arena, int64_t first_layer, int64_t n_layers) {
    gy_arena_config c = {.backend = GY_ARENA_BACKEND_CPU, .page_size = 4096, .n_slots = 64,
                         .budget_bytes = 24 * 4096};
    CHECK_OK(gy_arena_init(arena, &c));
    /* model layer l at slot 2 + 6 l, whichever layers the cache holds */
    gy_kv_config k = {.layout = GY_KV_LAYOUT_HEAD, .n_layers = n_layers, .first_layer = first_layer,
                      .n_heads = 2, .head_dim = 8, .block_size = 4, .elem_size = 4,
                      .first_slot = 2 + 6 * first_layer, .slots_per_layer = 6};
    gy_kv_cache *kv = NULL;
    CHECK_OK(gy_kv_init(&kv, *arena, &k));
    return kv;
}

static float value(int64_t layer, int64_t token, int64_t i, int kv) {
    return (float)(layer * 1000 + token) + (float)i / 64.0f + (kv ? 0.5f : 0.0f);
}

static void write_tokens(gy_kv_cache *kv, int64_t seq, int64_t layer, int64_t pos, int64_t n, float bias) {
    float k[16 * 16], v[16 * 16];
    for (int64_t t = 0; t < n; t++)
        for (int64_t i = 0; i < 16; i++) {
            k[t * 16 + i] = value(layer, pos + t, i, 0) + bias;
            v[t * 16 + i] = value(layer, pos + t, i, 1) + bias;
        }
    CHECK_OK(gy_kv_write(kv, seq, layer - gy_kv_config_of(kv)->first_layer, pos, n, k, v));
}

static int tokens_are(const gy_kv_cache *kv, int64_t seq, int64_t layer, int64_t pos, int64_t n, float bias) {
    float k[16 * 16], v[16 * 16];
    CHECK_OK(gy_kv_gather(kv, seq, layer - gy_kv_config_of(kv)->first_layer, pos, n, k, v));
    for (int64_t t = 0; t < n; t++)
        for (int64_t i = 0; i < 16; i++)
            if (k[t * 16 + i] != value(layer, pos + t, i, 0) + bias ||
                v[t * 16 + i] != value(layer, pos + t, i, 1) + bias)
                return 0;
    return 1;
}

GYTEST(kv_dirty_marks_the_slots_of_a_sequence_and_take_drains_them) {
    gy_arena *arena;
    gy_kv_cache *kv = make_stage(&arena, 0, 2);
    CHECK_OK(gy_kv_grow(kv, 1));
    int64_t a, b;
    CHECK_OK(gy_kv_seq_new(kv, &a));
    CHECK_OK(gy_kv_seq_new(kv, &b));
    CHECK_OK(gy_kv_seq_reserve(kv, a, 6)); /* blocks 0, 1 */
    CHECK_OK(gy_kv_seq_reserve(kv, b, 3)); /* block 2 */
    gy_kv_dirty *d;
    CHECK_OK(gy_kv_dirty_init(&d, 8 * 4));
    CHECK_OK(gy_kv_dirty_mark(d, kv, a, 3, 3)); /* slots 3, 4, 5 */
    CHECK_OK(gy_kv_dirty_mark(d, kv, b, 1, 1)); /* slot 9 */
    CHECK_STATUS(gy_kv_dirty_mark(d, kv, b, 3, 2), GY_ERR_INVALID); /* past its room */
    CHECK(gy_kv_dirty_count(d) == 4 && gy_kv_dirty_marked(d) == 4);
    uint64_t words[1];
    CHECK(gy_kv_dirty_take(d, words) == 4);
    CHECK(words[0] == ((1u << 3) | (1u << 4) | (1u << 5) | (1u << 9)));
    CHECK(gy_kv_dirty_count(d) == 0 && gy_kv_dirty_take(d, words) == 0 && words[0] == 0);
    CHECK_STATUS(gy_kv_dirty_mark_slot(d, 32), GY_ERR_INVALID);
    gy_kv_dirty_free(d);
    gy_kv_free(kv);
    gy_arena_free(arena);
}

/* A marker and a sender on two threads: every slot marked is taken exactly... at least once, and
 * none is taken that was not marked. */
typedef struct {
    gy_kv_dirty *d;
    int64_t n_slots, rounds;
} marker_args;

static void *marker(void *p) {
    marker_args *m = p;
    uint64_t x = 12345;
    for (int64_t r = 0; r < m->rounds; r++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        gy_kv_dirty_mark_slot(m->d, (int64_t)(x >> 33) % m->n_slots);
    }
    return NULL;
}

GYTEST(kv_dirty_threads_lose_no_slot_to_a_concurrent_sender) {
    const int64_t n_slots = 4096, rounds = 200000;
    gy_kv_dirty *d;
    CHECK_OK(gy_kv_dirty_init(&d, n_slots));
    marker_args m = {.d = d, .n_slots = n_slots, .rounds = rounds};
    pthread_t t;
    CHECK(pthread_create(&t, NULL, marker, &m) == 0);
    const int64_t n_words = gy_kv_dirty_words(d);
    uint64_t *words = calloc((size_t)n_words, 8), *seen = calloc((size_t)n_words, 8);
    int64_t taken = 0;
    for (int i = 0; i < 200; i++) {
        taken += gy_kv_dirty_take(d, words);
        for (int64_t w = 0; w < n_words; w++) seen[w] |= words[w];
    }
    pthread_join(t, NULL);
    taken += gy_kv_dirty_take(d, words);
    for (int64_t w = 0; w < n_words; w++) seen[w] |= words[w];
    /* the same sequence of slots, replayed: every one of them was taken, and nothing else */
    uint64_t *want = calloc((size_t)n_words, 8), x = 12345;
    for (int64_t r = 0; r < rounds; r++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        const int64_t s = (int64_t)(x >> 33) % n_slots;
        want[s / 64] |= (uint64_t)1 << (s % 64);
    }
    CHECK(memcmp(seen, want, (size_t)n_words * 8) == 0);
    CHECK(taken >= 1 && taken <= rounds && gy_kv_dirty_marked(d) == rounds);
    free(words);
    free(seen);
    free(want);
    gy_kv_dirty_free(d);
}

GYTEST(kv_move_between_stages_whole_or_dirty) {
    /* source holds layers [0, 3), destination [2, 4): layer 2 moves */
    gy_arena *sa, *da;
    gy_kv_cache *src = make_stage(&sa, 0, 3), *dst = make_stage(&da, 2, 2);
    CHECK_OK(gy_kv_grow(src, 1));
    CHECK_OK(gy_kv_grow(dst, 1));
    int64_t s, q, other;
    CHECK_OK(gy_kv_seq_new(dst, &other));
    CHECK_OK(gy_kv_seq_reserve(dst, other, 4)); /* so the block ids differ between the caches */
    CHECK_OK(gy_kv_seq_new(src, &s));
    CHECK_OK(gy_kv_seq_new(dst, &q));
    CHECK_OK(gy_kv_seq_reserve(src, s, 7));
    CHECK_OK(gy_kv_seq_reserve(dst, q, 7));
    write_tokens(src, s, 2, 0, 7, 0.0f);
    const gy_kv_move_item it = {.src = src, .dst = dst, .src_seq = s, .dst_seq = q, .n_heads = 2,
                                .n_tokens = GY_KV_MOVE_ALL_TOKENS};
    gy_kv_move move = {.items = &it, .n_items = 1, .first_layer = 2, .end_layer = 3};
    gy_kv_move_stats st;
    CHECK_OK(gy_kv_move_run(&move, NULL, &st));
    CHECK(st.slots == 8 && tokens_are(dst, q, 2, 0, 7, 0.0f));
    /* tokens 5, 6 change on the source and are marked: a patch copies only them */
    gy_kv_dirty *d;
    CHECK_OK(gy_kv_dirty_init(&d, 8 * 4));
    write_tokens(src, s, 2, 5, 2, 7.0f);
    CHECK_OK(gy_kv_dirty_mark(d, src, s, 5, 2));
    write_tokens(src, s, 2, 0, 1, 9.0f); /* written, not marked: must not be copied */
    uint64_t words[1];
    CHECK(gy_kv_dirty_take(d, words) == 2);
    move.dirty = words;
    move.dirty_slots = 32;
    CHECK_OK(gy_kv_move_run(&move, NULL, &st));
    CHECK(st.slots == 2 && tokens_are(dst, q, 2, 5, 2, 7.0f) && tokens_are(dst, q, 2, 0, 5, 0.0f));
    /* refusals: a layer one cache lacks, a bitmap too small */
    move.first_layer = 1;
    CHECK_STATUS(gy_kv_move_run(&move, NULL, NULL), GY_ERR_INVALID);
    move.first_layer = 2;
    move.dirty_slots = 4;
    CHECK_STATUS(gy_kv_move_run(&move, NULL, NULL), GY_ERR_INVALID);
    gy_kv_dirty_free(d);
    gy_kv_free(src);
    gy_kv_free(dst);
    gy_arena_free(sa);
    gy_arena_free(da);
}

GYTEST(kv_compact_moves_live_tail_blocks_below_keep_with_their_values) {
    gy_arena *arena;
    gy_kv_cache *kv = make_stage(&arena, 0, 2);
    CHECK_OK(gy_kv_grow(kv, 2)); /* 16 blocks */
    int64_t first, last;
    CHECK_OK(gy_kv_seq_new(kv, &first));
    CHECK_OK(gy_kv_seq_reserve(kv, first, 40)); /* blocks 0..9 */
    CHECK_OK(gy_kv_seq_new(kv, &last));
    CHECK_OK(gy_kv_seq_reserve(kv, last, 14)); /* blocks 10..13 */
    for (int64_t l = 0; l < 2; l++) write_tokens(kv, last, l, 0, 14, 0.5f);
    CHECK_OK(gy_kv_seq_free(kv, first));
    int64_t moved = -1;
    CHECK_STATUS(gy_kv_compact(kv, 3, &moved), GY_ERR_OUT_OF_MEMORY); /* 4 live, 3 below */
    CHECK(gy_kv_seq_blocks(kv, last)[0] == 10);
    CHECK_OK(gy_kv_compact(kv, 8, &moved));
    CHECK(moved == 4);
    for (int64_t i = 0; i < 4; i++) CHECK(gy_kv_seq_blocks(kv, last)[i] < 8);
    for (int64_t l = 0; l < 2; l++) CHECK(tokens_are(kv, last, l, 0, 14, 0.5f));
    CHECK(gy_kv_shrinkable_pages(kv) == 1);
    CHECK_OK(gy_kv_shrink(kv, 1));
    /* the cap: growth stops there, and it cannot go below what is mapped */
    CHECK_OK(gy_kv_set_page_cap(kv, 1));
    CHECK_STATUS(gy_kv_grow(kv, 1), GY_ERR_LIMIT);
    CHECK(gy_kv_page_room(kv) == 0 && gy_kv_blocks_if_grown(kv, 1) == 0);
    CHECK_STATUS(gy_kv_set_page_cap(kv, 0), GY_ERR_INVALID);
    CHECK_OK(gy_kv_set_page_cap(kv, -1));
    CHECK(gy_kv_page_room(kv) == 5);
    gy_kv_free(kv);
    gy_arena_free(arena);
}

GYTEST(kv_set_layers_adds_and_drops_layers_keeping_sequences) {
    gy_arena *arena;
    gy_kv_cache *kv = make_stage(&arena, 1, 2); /* layers 1, 2 */
    CHECK_OK(gy_kv_grow(kv, 2));
    int64_t s;
    CHECK_OK(gy_kv_seq_new(kv, &s));
    CHECK_OK(gy_kv_seq_reserve(kv, s, 9));
    write_tokens(kv, s, 2, 0, 9, 0.25f);
    gy_arena_stats st;
    gy_arena_stats_get(arena, &st);
    const uint64_t before = st.bytes_in_use;
    CHECK_OK(gy_kv_set_layers(kv, 0, 3)); /* layer 0 joins */
    gy_arena_stats_get(arena, &st);
    CHECK(st.bytes_in_use == before + 2 * 4096);
    CHECK(gy_kv_config_of(kv)->first_layer == 0 && tokens_are(kv, s, 2, 0, 9, 0.25f));
    write_tokens(kv, s, 0, 0, 9, 0.75f);
    CHECK_OK(gy_kv_set_layers(kv, 2, 1)); /* layers 0 and 1 leave */
    gy_arena_stats_get(arena, &st);
    CHECK(st.bytes_in_use == before - 2 * 4096);
    CHECK(tokens_are(kv, s, 2, 0, 9, 0.25f) && gy_kv_seq_n_blocks(kv, s) == 3);
    /* refused: past the slots reserved for model layers, or more than the budget holds */
    CHECK_STATUS(gy_kv_set_layers(kv, 2, 20), GY_ERR_INVALID);
    CHECK_OK(gy_kv_set_page_cap(kv, 6));
    CHECK_OK(gy_kv_grow(kv, 4));
    CHECK_STATUS(gy_kv_set_layers(kv, 0, 8), GY_ERR_OUT_OF_MEMORY);
    CHECK(gy_kv_config_of(kv)->first_layer == 2 && gy_kv_config_of(kv)->n_layers == 1);
    gy_kv_free(kv);
    gy_arena_free(arena);
}
