/* test_kv_move.c: the one KV move (kv/kv_move.h) on host caches: exact bytes against a plain
 * reference written here (one head_dim row at a time, every address through
 * gy_kv_layout_offset) for every layout pair, odd sizes and value sizes, block lists and
 * sequences, token limits and dirty bitmaps; copies inside one cache; refusals that change
 * nothing; OVERLAP moves through a shadow (the early read
 * reused, remade sequences noticed, a rank's own heads left in place, runs copied in an order
 * that reads every source first); one copy event per move, and the backend table. (The device
 * backend runs the same moves in tests/gpu_emu/harness.c; moves between caches of other layer
 * ranges are PipeLive's, in test_kv_patch.c.) */
#include <stdlib.h>
#include <string.h>

#include "core/fault.h"
#include "gytest.h"
#include "kv/kv_move.h"
#include "kv/kv_move_backend.h"

enum { L = 3, B = 3, D = 5 };

static gy_kv_cache *make(gy_arena **arena, gy_kv_layout_kind layout, int64_t heads, int64_t es) {
    gy_arena_config c = {.backend = GY_ARENA_BACKEND_CPU, .page_size = 4096, .n_slots = 64,
                         .budget_bytes = 32 * 4096};
    CHECK_OK(gy_arena_init(arena, &c));
    gy_kv_config k = {.layout = layout, .n_layers = L, .n_heads = heads, .head_dim = D,
                      .block_size = B, .elem_size = es, .first_slot = 2, .slots_per_layer = 12};
    gy_kv_cache *kv = NULL;
    CHECK_OK(gy_kv_init(&kv, *arena, &k));
    CHECK_OK(gy_kv_grow(kv, 1));
    return kv;
}

static uint64_t rng = 88172645463325252ull;
static uint64_t next(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

/* Every byte of every layer of the cache, random. */
static void scramble(gy_kv_cache *kv) {
    const gy_kv_layout *Lo = gy_kv_layout_of(kv);
    for (int64_t l = 0; l < L; l++) {
        unsigned char *p = gy_kv_layer_ptr(kv, l);
        for (int64_t i = 0; i < gy_kv_layout_layer_elems(Lo) * Lo->elem_size; i++) p[i] = (unsigned char)next();
    }
}

/* The plain reference: item `it` of a move over layer l into `ref` (a copy of the destination
 * layer), one head_dim row at a time. */
static void reference(char *ref, const gy_kv_cache *dst, const gy_kv_cache *src, int64_t l,
                      const gy_kv_move_item *it, const int32_t *sb, const int32_t *db,
                      int64_t n_pairs, const uint64_t *dirty) {
    const gy_kv_layout *ld = gy_kv_layout_of(dst), *ls = gy_kv_layout_of(src);
    const char *sbase = gy_kv_layer_ptr(src, l);
    const int64_t es = ls->elem_size;
    for (int64_t j = 0; j < n_pairs; j++) {
        const int64_t t_end = it->n_tokens < 0 ? B : (it->n_tokens - j * B < B ? it->n_tokens - j * B : B);
        for (int64_t kv = 0; kv < 2; kv++)
            for (int64_t t = 0; t < t_end; t++) {
                if (dirty && !(dirty[(sb[j] * B + t) / 64] >> ((sb[j] * B + t) % 64) & 1)) continue;
                for (int64_t h = 0; h < it->n_heads; h++)
                    memcpy(ref + gy_kv_layout_offset(ld, kv, db[j], t, it->dst_head + h) * es,
                           sbase + gy_kv_layout_offset(ls, kv, sb[j], t, it->src_head + h) * es,
                           (size_t)(D * es));
            }
    }
}

/* The three kinds of move a case runs: block lists of whole blocks, sequences with a token
 * limit, and a dirty bitmap. */
static void one_case(gy_kv_layout_kind sl, gy_kv_layout_kind dl, int64_t es, int kind) {
    gy_arena *sa, *da;
    gy_kv_cache *src = make(&sa, sl, 3, es), *dst = make(&da, dl, 4, es);
    int64_t spacer, s, d;
    CHECK_OK(gy_kv_seq_new(src, &spacer)); /* so the source's block ids are not 0.. */
    CHECK_OK(gy_kv_seq_reserve(src, spacer, 2 * B));
    CHECK_OK(gy_kv_seq_new(src, &s));
    CHECK_OK(gy_kv_seq_reserve(src, s, 3 * B));
    CHECK_OK(gy_kv_seq_new(dst, &d));
    CHECK_OK(gy_kv_seq_reserve(dst, d, 3 * B));
    scramble(src);
    scramble(dst);
    gy_kv_stats st;
    gy_kv_stats_get(src, &st);
    uint64_t dirty[4] = {0};
    for (int64_t slot = 0; slot < st.n_blocks * B && slot < 256; slot++)
        if (next() % 3 == 0) dirty[slot / 64] |= (uint64_t)1 << (slot % 64);
    const int32_t lists_s[3] = {4, 0, 3}, lists_d[3] = {2, 5, 0};
    gy_kv_move_item it = {.src = src, .dst = dst, .src_seq = s, .dst_seq = d};
    if (kind == 0) { /* heads 1..2 -> 2..3, whole blocks of two lists */
        it.src_blocks = lists_s, it.dst_blocks = lists_d, it.n_blocks = 3;
        it.src_head = 1, it.dst_head = 2, it.n_heads = 2, it.n_tokens = GY_KV_MOVE_ALL_TOKENS;
    } else { /* every source head -> heads 1..3; 7 tokens, the last block partly */
        it.src_head = 0, it.dst_head = 1, it.n_heads = 3, it.n_tokens = kind == 1 ? 7 : -1;
    }
    const gy_kv_move move = {.items = &it, .n_items = 1, .first_layer = 1, .end_layer = L,
                             .dirty = kind == 2 ? dirty : NULL, .dirty_slots = 256};
    const int32_t *sb, *db;
    const int64_t n = gy_kv_move_item_pairs(&it, &sb, &db);
    const size_t layer_bytes = (size_t)(gy_kv_layout_layer_elems(gy_kv_layout_of(dst)) * es);
    char *want = malloc(layer_bytes * L);
    for (int64_t l = 0; l < L; l++) {
        memcpy(want + l * layer_bytes, gy_kv_layer_ptr(dst, l), layer_bytes);
        if (l >= 1) reference(want + l * layer_bytes, dst, src, l, &it, sb, db, n, move.dirty);
    }
    gy_kv_move_stats ms;
    CHECK_OK(gy_kv_move_run(&move, NULL, &ms));
    int same = 1;
    for (int64_t l = 0; l < L; l++)
        same &= memcmp(want + l * layer_bytes, gy_kv_layer_ptr(dst, l), layer_bytes) == 0;
    CHECK(same);
    int64_t slots = kind == 0 ? 3 * B : 7;
    if (kind == 2) {
        slots = 0;
        for (int64_t j = 0; j < n; j++)
            for (int64_t t = 0; t < B; t++) slots += (int64_t)(dirty[(sb[j] * B + t) / 64] >> ((sb[j] * B + t) % 64) & 1);
    }
    CHECK(ms.slots == slots && ms.backend == GY_KV_MOVE_BACKEND_HOST);
    CHECK(ms.bytes == (uint64_t)(slots * 2 * it.n_heads * D * es * (L - 1)) && ms.bytes_in_place == 0);
    if (!same || ms.slots != slots)
        fprintf(stderr, "  case: layouts %d -> %d, %lld-byte values, kind %d\n", (int)sl, (int)dl,
                (long long)es, kind);
    free(want);
    gy_kv_free(src);
    gy_kv_free(dst);
    gy_arena_free(sa);
    gy_arena_free(da);
}

GYTEST(kv_move_matches_the_reference_on_every_layout_pair) {
    for (int sl = 0; sl < GY_KV_LAYOUT_COUNT; sl++)
        for (int dl = 0; dl < GY_KV_LAYOUT_COUNT; dl++)
            for (int kind = 0; kind < 3; kind++) {
                one_case((gy_kv_layout_kind)sl, (gy_kv_layout_kind)dl, 4, kind);
                one_case((gy_kv_layout_kind)sl, (gy_kv_layout_kind)dl, 2, kind);
            }
}

/* Runs as the layouts allow them: a header-centric pair of whole blocks is one run. */
GYTEST(kv_move_runs_merge_what_the_layouts_make_contiguous) {
    gy_kv_layout h4, h2, p4, r4;
    CHECK_OK(gy_kv_layout_init(&h4, GY_KV_LAYOUT_HEAD, B, 4, D, 4, 16));
    CHECK_OK(gy_kv_layout_init(&h2, GY_KV_LAYOUT_HEAD, B, 2, D, 4, 32));
    CHECK_OK(gy_kv_layout_init(&p4, GY_KV_LAYOUT_PAGE, B, 4, D, 4, 16));
    CHECK_OK(gy_kv_layout_init(&r4, GY_KV_LAYOUT_RAW, B, 4, D, 4, 16));
    gy_kv_move_runs r;
    gy_kv_move_runs_init(&r, &h4, &h2, 2, B); /* two heads of a block: one run */
    CHECK(r.run == 2 * 2 * B * D * 4 && r.count[0] * r.count[1] * r.count[2] == 1);
    gy_kv_move_runs_init(&r, &h4, &h2, 2, 2); /* two of three tokens: a run per head and K/V */
    CHECK(r.run == 2 * D * 4 && r.count[0] * r.count[1] * r.count[2] == 4);
    gy_kv_move_runs_init(&r, &p4, &p4, 4, B); /* a page-layout block of every head: one run */
    CHECK(r.run == 2 * B * 4 * D * 4 && r.count[0] * r.count[1] * r.count[2] == 1);
    gy_kv_move_runs_init(&r, &p4, &p4, 2, B); /* some heads: a run per K/V and token */
    CHECK(r.run == 2 * D * 4 && r.count[0] * r.count[1] * r.count[2] == 2 * B);
    gy_kv_move_runs_init(&r, &r4, &r4, 4, B); /* raw: K and V apart */
    CHECK(r.run == B * 4 * D * 4 && r.count[0] * r.count[1] * r.count[2] == 2);
    gy_kv_move_runs_init(&r, &h4, &p4, 4, B); /* across layouts: a row each */
    CHECK(r.run == D * 4 && r.count[0] * r.count[1] * r.count[2] == 2 * B * 4);
}

/* Writes tagged values into `n_tokens` tokens of a new sequence; returns it. */
static float tag(int64_t layer, int kv, int64_t token, int64_t head, int64_t d) {
    return (float)(layer * 100000 + kv * 10000 + token * 100 + head * 10 + d);
}

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

static gy_status move_lists(gy_kv_cache *dst, const int32_t *db, int64_t dh, const gy_kv_cache *src,
                            const int32_t *sb, int64_t sh, int64_t heads, int64_t n, int64_t first,
                            int64_t end) {
    const gy_kv_move_item it = {.src = src, .dst = dst, .src_blocks = sb, .dst_blocks = db,
                                .n_blocks = n, .src_head = sh, .dst_head = dh, .n_heads = heads,
                                .n_tokens = GY_KV_MOVE_ALL_TOKENS};
    const gy_kv_move move = {.items = &it, .n_items = 1, .first_layer = first, .end_layer = end};
    return gy_kv_move_run(&move, NULL, NULL);
}

GYTEST(kv_move_within_one_cache_and_refusals_that_change_nothing) {
    gy_arena *a, *b;
    gy_kv_cache *kv = make(&a, GY_KV_LAYOUT_HEAD, 2, 4);
    const int64_t s = filled(kv, 2, 6, 0.0f);
    int64_t t;
    CHECK_OK(gy_kv_seq_new(kv, &t));
    CHECK_OK(gy_kv_seq_reserve(kv, t, 6));
    const int32_t sb[2] = {gy_kv_seq_blocks(kv, s)[0], gy_kv_seq_blocks(kv, s)[1]};
    const int32_t tb[2] = {gy_kv_seq_blocks(kv, t)[0], gy_kv_seq_blocks(kv, t)[1]};
    CHECK_OK(move_lists(kv, tb, 0, kv, sb, 0, 2, 2, 0, L));
    float k0[6 * 2 * D], v0[6 * 2 * D], k1[6 * 2 * D], v1[6 * 2 * D];
    for (int64_t l = 0; l < L; l++) {
        CHECK_OK(gy_kv_gather(kv, s, l, 0, 6, k0, v0));
        CHECK_OK(gy_kv_gather(kv, t, l, 0, 6, k1, v1));
        CHECK(memcmp(k0, k1, sizeof k0) == 0 && memcmp(v0, v1, sizeof v0) == 0);
    }
    gy_kv_cache *other = make(&b, GY_KV_LAYOUT_HEAD, 2, 4);
    float before[6 * 2 * D], after[6 * 2 * D];
    CHECK_OK(gy_kv_gather(kv, t, 0, 0, 6, before, v1));
    const int32_t far[2] = {tb[0], 999};
    CHECK_STATUS(move_lists(kv, far, 0, kv, sb, 0, 2, 2, 0, L), GY_ERR_INVALID);
    CHECK(strstr(gy_error_message(), "destination block 999") != NULL);
    CHECK_STATUS(move_lists(kv, tb, 1, kv, sb, 0, 2, 2, 0, L), GY_ERR_INVALID);
    CHECK(strstr(gy_error_message(), "out of range") != NULL);
    CHECK_STATUS(move_lists(kv, tb, 0, kv, sb, 0, 2, 2, 1, L + 1), GY_ERR_INVALID);
    CHECK(strstr(gy_error_message(), "not held by both") != NULL);
    CHECK_STATUS(move_lists(kv, tb, 0, kv, sb, 0, -1, 2, 0, L), GY_ERR_INVALID);
    CHECK_STATUS(move_lists(kv, NULL, 0, kv, sb, 0, 2, 2, 0, L), GY_ERR_INVALID);
    CHECK_STATUS(move_lists(kv, tb, 0, kv, sb, 0, 2, 2, 2, 1), GY_ERR_INVALID);
    /* a bitmap too small for the source blocks, or over two source caches */
    uint64_t words[1] = {~0ull};
    gy_kv_move_item two[2] = {
        {.src = kv, .dst = kv, .src_blocks = sb, .dst_blocks = tb, .n_blocks = 2, .n_heads = 2, .n_tokens = -1},
        {.src = other, .dst = kv, .src_blocks = sb, .dst_blocks = tb, .n_blocks = 2, .n_heads = 2, .n_tokens = -1},
    };
    gy_kv_move move = {.items = two, .n_items = 1, .first_layer = 0, .end_layer = L,
                       .dirty = words, .dirty_slots = 2};
    CHECK_STATUS(gy_kv_move_run(&move, NULL, NULL), GY_ERR_INVALID);
    CHECK(strstr(gy_error_message(), "past the bitmap") != NULL);
    move.dirty_slots = 64;
    move.n_items = 2;
    CHECK_STATUS(gy_kv_move_run(&move, NULL, NULL), GY_ERR_INVALID);
    CHECK(strstr(gy_error_message(), "one source cache") != NULL);
    /* a sequence that is not live, or without room for the tokens */
    gy_kv_move_item q = {.src = kv, .dst = kv, .src_seq = s, .dst_seq = 42, .n_heads = 2, .n_tokens = 6};
    gy_kv_move seqs = {.items = &q, .n_items = 1, .first_layer = 0, .end_layer = L};
    CHECK_STATUS(gy_kv_move_run(&seqs, NULL, NULL), GY_ERR_STATE);
    CHECK(strstr(gy_error_message(), "does not exist") != NULL);
    q.dst_seq = t;
    q.n_tokens = 7;
    CHECK_STATUS(gy_kv_move_run(&seqs, NULL, NULL), GY_ERR_INVALID);
    CHECK(strstr(gy_error_message(), "room for 6 tokens") != NULL);
    CHECK_OK(gy_kv_gather(kv, t, 0, 0, 6, after, v1));
    CHECK(memcmp(before, after, sizeof before) == 0);
    CHECK_OK(move_lists(other, tb, 0, kv, sb, 0, 2, 0, 0, L)); /* nothing to copy */
    gy_kv_free(other);
    gy_arena_free(b);
    /* another value size is refused */
    other = make(&b, GY_KV_LAYOUT_HEAD, 2, 2);
    CHECK_STATUS(move_lists(other, tb, 0, kv, sb, 0, 2, 2, 0, L), GY_ERR_INVALID);
    CHECK(strstr(gy_error_message(), "value size") != NULL);
    gy_kv_free(other);
    gy_arena_free(b);
    gy_kv_free(kv);
    gy_arena_free(a);
}

/* ---- OVERLAP moves through a shadow (layer-staggered transformations) ---- */

static void fill(gy_kv_cache *kv, int64_t seq, int64_t pos, int64_t n, float base) {
    float k[16 * 4 * 8], v[16 * 4 * 8];
    const int64_t H = gy_kv_config_of(kv)->n_heads;
    for (int64_t i = 0; i < n * H * 8; i++) {
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

/* Two layers at `first_slot` of the arena, blocks of 4 tokens, head_dim 8, `pages` grown. */
static gy_kv_cache *grown(gy_arena *arena, gy_kv_layout_kind layout, int64_t heads,
                          int64_t first_slot, int64_t pages) {
    const gy_kv_config k = {.layout = layout, .n_layers = 2, .n_heads = heads, .head_dim = 8,
                            .block_size = 4, .elem_size = 4, .first_slot = first_slot,
                            .slots_per_layer = 16};
    gy_kv_cache *kv = NULL;
    CHECK_OK(gy_kv_init(&kv, arena, &k));
    CHECK_OK(gy_kv_grow(kv, pages));
    return kv;
}

static gy_kv_move_item seq_item(gy_kv_cache *src, int64_t ss, int64_t sh, gy_kv_cache *dst,
                                int64_t ds, int64_t dh, int64_t heads, int64_t n) {
    return (gy_kv_move_item){.src = src, .dst = dst, .src_seq = ss, .dst_seq = ds, .src_head = sh,
                             .dst_head = dh, .n_heads = heads, .n_tokens = n};
}

GYTEST(kv_move_overlap_reuses_early_reads_and_notices_remade_sequences) {
    gy_arena *arena = new_arena();
    gy_kv_cache *old = grown(arena, GY_KV_LAYOUT_HEAD, 2, 0, 2);
    gy_kv_cache *dst = grown(arena, GY_KV_LAYOUT_HEAD, 2, 32, 2);
    int64_t a, b, da, db;
    CHECK_OK(gy_kv_seq_new(old, &a));
    CHECK_OK(gy_kv_seq_new(old, &b));
    CHECK_OK(gy_kv_seq_new(dst, &da));
    CHECK_OK(gy_kv_seq_new(dst, &db));
    fill(old, a, 0, 6, 1.0f);
    fill(old, b, 0, 5, 100.0f);
    CHECK_OK(gy_kv_seq_reserve(dst, da, 16));
    CHECK_OK(gy_kv_seq_reserve(dst, db, 16));
    gy_kv_move_item items[2] = {seq_item(old, a, 0, dst, da, 0, 2, 6), seq_item(old, b, 0, dst, db, 0, 2, 5)};
    gy_kv_move move = {.items = items, .n_items = 2, .first_layer = 1, .end_layer = 2,
                       .flags = GY_KV_MOVE_OVERLAP, .threads = 2};
    gy_kv_move_stage *stage;
    CHECK_OK(gy_kv_move_stage_init(&stage));
    CHECK_OK(gy_kv_move_plan(stage, &move));
    CHECK_OK(gy_kv_move_read(stage));
    fill(old, a, 6, 3, 50.0f);          /* a step adds 3 tokens to a */
    CHECK_OK(gy_kv_seq_free(old, b));   /* b is freed and made again */
    int64_t b2;
    CHECK_OK(gy_kv_seq_new(old, &b2));
    CHECK(b2 == b);
    fill(old, b2, 0, 7, 200.0f);
    items[0].n_tokens = 9;
    items[1].n_tokens = 7;
    gy_kv_move_stats st;
    CHECK_OK(gy_kv_move_run(&move, stage, &st));
    CHECK(st.items_reused == 1 && st.items_stale == 1);
    CHECK(st.bytes_early == 6 * 2 * 2 * 8 * 4);
    CHECK(st.bytes == (9 + 7) * 2 * 2 * 8 * 4 && st.bytes_late == st.bytes - st.bytes_early);
    float k0[16 * 16], v0[16 * 16], k1[16 * 16], v1[16 * 16];
    CHECK_OK(gy_kv_gather(old, a, 1, 0, 9, k0, v0));
    CHECK_OK(gy_kv_gather(dst, da, 1, 0, 9, k1, v1));
    CHECK(memcmp(k0, k1, 9 * 16 * sizeof(float)) == 0 && memcmp(v0, v1, 9 * 16 * sizeof(float)) == 0);
    CHECK_OK(gy_kv_gather(old, b2, 1, 0, 7, k0, v0));
    CHECK_OK(gy_kv_gather(dst, db, 1, 0, 7, k1, v1));
    CHECK(memcmp(k0, k1, 7 * 16 * sizeof(float)) == 0 && memcmp(v0, v1, 7 * 16 * sizeof(float)) == 0);
    /* the plan was used and forgotten: the next run reads everything itself */
    CHECK_OK(gy_kv_move_run(&move, stage, &st));
    CHECK(st.items_reused == 0 && st.bytes_early == 0);
    items[1].src_head = 1; /* heads [1, 3) of 2: refused */
    CHECK_STATUS(gy_kv_move_plan(stage, &move), GY_ERR_INVALID);
    CHECK_STATUS(gy_kv_move_run(&move, stage, NULL), GY_ERR_INVALID);
    items[1].src_head = 0;
    move.flags = 0; /* an early read is the first phase of an OVERLAP move */
    CHECK_STATUS(gy_kv_move_plan(stage, &move), GY_ERR_INVALID);
    gy_kv_move_stage_free(stage);
    gy_kv_free(dst);
    gy_kv_free(old);
    gy_arena_free(arena);
}

GYTEST(kv_move_overlap_leaves_a_ranks_own_heads_in_place) {
    gy_arena *arena = new_arena();
    gy_kv_cache *old = grown(arena, GY_KV_LAYOUT_HEAD, 2, 0, 2), *shadow;
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
    const gy_kv_move_item items[2] = {seq_item(old, a, 1, shadow, own, 0, 1, 7),
                                      seq_item(old, a, 0, shadow, peer, 0, 1, 7)};
    const gy_kv_move move = {.items = items, .n_items = 2, .first_layer = 1, .end_layer = 2,
                             .flags = GY_KV_MOVE_OVERLAP, .threads = 1};
    gy_kv_move_stats st;
    CHECK_OK(gy_kv_move_run(&move, NULL, &st));
    CHECK(st.bytes_in_place == 7 * 2 * 8 * 4);
    CHECK(st.bytes == 7 * 2 * 8 * 4);
    for (int64_t h = 0; h < 2; h++) {
        CHECK_OK(gy_kv_gather(shadow, h ? own : peer, 1, 0, 7, k1, v1));
        for (int64_t t = 0; t < 7; t++)
            CHECK(memcmp(k1 + t * 8, k0 + t * 16 + h * 8, 8 * sizeof(float)) == 0 &&
                  memcmp(v1 + t * 8, v0 + t * 16 + h * 8, 8 * sizeof(float)) == 0);
    }
    gy_kv_free(shadow);
    gy_kv_free(old);
    gy_arena_free(arena);
}

/* New blocks over head runs that other items still have to read: a's heads [0, 2) go where b's
 * heads [2, 4) are and b's where a's were (a cycle), a's heads [2, 4) where c's heads [0, 2) are,
 * and c's to free blocks (a chain). Header-centric caches copy each run once in an order that
 * reads every source first, page caches go through the stage, and so does a move read early:
 * every way lands the old contents, in both layers. */
static void overlap_order_case(gy_kv_layout_kind layout, int early) {
    gy_arena *arena = new_arena();
    gy_kv_cache *old = grown(arena, layout, 4, 0, 4), *shadow;
    CHECK_OK(gy_kv_init_shadow(&shadow, old, 2));
    int64_t s[3];
    for (int i = 0; i < 3; i++) {
        CHECK_OK(gy_kv_seq_new(old, &s[i]));
        fill(old, s[i], 0, 8, 1000.0f * (float)(i + 1));
    }
    int32_t blocks[3][2], over[4][2];
    for (int i = 0; i < 3; i++) memcpy(blocks[i], gy_kv_seq_blocks(old, s[i]), sizeof blocks[i]);
    for (int j = 0; j < 2; j++) {
        over[0][j] = 2 * blocks[1][j] + 1; /* a's heads [0, 2) over b's heads [2, 4) */
        over[1][j] = 2 * blocks[0][j];     /* b's heads [2, 4) over a's heads [0, 2) */
        over[2][j] = 2 * blocks[2][j];     /* a's heads [2, 4) over c's heads [0, 2) */
        over[3][j] = 28 + j;               /* c's heads [0, 2): free blocks */
    }
    const int64_t from[4] = {0, 1, 0, 2}, head[4] = {0, 2, 2, 0};
    float want[4][2][8 * 4 * 8], wantv[4][2][8 * 4 * 8];
    for (int i = 0; i < 3; i++)
        for (int l = 0; l < 2; l++) CHECK_OK(gy_kv_gather(old, s[i], l, 0, 8, want[i][l], wantv[i][l]));
    gy_kv_move_item items[4];
    int64_t dst[4];
    for (int m = 0; m < 4; m++) {
        CHECK_OK(gy_kv_seq_adopt(shadow, over[m], 2, 8, &dst[m]));
        items[m] = seq_item(old, s[from[m]], head[m], shadow, dst[m], 0, 2, 8);
    }
    const gy_kv_move move = {.items = items, .n_items = 4, .first_layer = 0, .end_layer = 2,
                             .flags = GY_KV_MOVE_OVERLAP, .threads = 2};
    gy_kv_move_stage *stage;
    CHECK_OK(gy_kv_move_stage_init(&stage));
    if (early) {
        CHECK_OK(gy_kv_move_plan(stage, &move));
        CHECK_OK(gy_kv_move_read(stage));
    }
    gy_kv_move_stats st;
    CHECK_OK(gy_kv_move_run(&move, stage, &st));
    const int direct = layout == GY_KV_LAYOUT_HEAD && !early;
    CHECK(st.runs_direct == (direct ? 2 * 4 * 2 * 2 * 2 : 0)); /* layers x items x heads x K/V x blocks */
    CHECK(st.runs_parked == (direct ? 2 * 2 * 2 * 2 : 0));     /* every run of the swap: cycles of 2 */
    CHECK(st.bytes == 2 * 4 * 8 * 2 * 2 * 8 * 4);
    CHECK(st.bytes_early == (early ? st.bytes : 0));
    int same = 1;
    for (int m = 0; m < 4; m++)
        for (int l = 0; l < 2; l++) {
            float kk[8 * 2 * 8], vv[8 * 2 * 8];
            CHECK_OK(gy_kv_gather(shadow, dst[m], l, 0, 8, kk, vv));
            for (int t = 0; t < 8; t++)
                same &= memcmp(kk + t * 16, want[from[m]][l] + t * 32 + head[m] * 8, 16 * sizeof(float)) == 0 &&
                        memcmp(vv + t * 16, wantv[from[m]][l] + t * 32 + head[m] * 8, 16 * sizeof(float)) == 0;
        }
    CHECK(same);
    gy_kv_move_stage_free(stage);
    gy_kv_free(shadow);
    gy_kv_free(old);
    gy_arena_free(arena);
}

GYTEST(kv_move_overlap_on_two_threads_reads_every_source_before_writing) {
    overlap_order_case(GY_KV_LAYOUT_HEAD, 0);
    overlap_order_case(GY_KV_LAYOUT_HEAD, 1);
    overlap_order_case(GY_KV_LAYOUT_PAGE, 0);
    overlap_order_case(GY_KV_LAYOUT_PAGE, 1);
}

/* ---- one entry point: one copy event per move, and the backend table ---- */

static int copies;
static gy_status counting_copy(const gy_kv_move *move, gy_kv_move_stats *st) {
    (void)move, (void)st;
    copies++;
    return GY_OK;
}

GYTEST(kv_move_is_one_copy_event_and_goes_to_the_registered_backend) {
    gy_arena *sa, *da;
    gy_kv_cache *src = make(&sa, GY_KV_LAYOUT_PAGE, 2, 4), *dst = make(&da, GY_KV_LAYOUT_PAGE, 2, 4);
    scramble(src);
    scramble(dst);
    const int32_t sb[3] = {0, 1, 2}, db[3] = {3, 4, 5};
    char before[4096];
    memcpy(before, gy_kv_layer_ptr(dst, 0), sizeof before);
    gy_fault_arm(GY_FAULT_COPY, 0);
    CHECK_OK(move_lists(dst, db, 0, src, sb, 0, 2, 3, 0, L));
    CHECK_OK(move_lists(dst, db, 0, src, sb, 0, 1, 3, 0, 1));
    CHECK_OK(move_lists(dst, db, 0, src, sb, 0, 2, 3, 1, 1)); /* no layer: nothing to copy */
    CHECK(gy_fault_count(GY_FAULT_COPY) == 2);
    memcpy(gy_kv_layer_ptr(dst, 0), before, sizeof before);
    gy_fault_arm(GY_FAULT_COPY, 1);
    CHECK_STATUS(move_lists(dst, db, 0, src, sb, 0, 2, 3, 0, L), GY_ERR_SYSTEM);
    CHECK(strstr(gy_error_message(), "injected fault") != NULL);
    CHECK(memcmp(before, gy_kv_layer_ptr(dst, 0), sizeof before) == 0);
    gy_fault_disarm_all();
    /* a registered backend takes the moves of its kind; one without OVERLAP refuses those */
    const gy_kv_move_backend counting = {.name = "counting", .copy = counting_copy};
    CHECK_OK(gy_kv_move_set_backend(GY_KV_MOVE_BACKEND_HOST, &counting));
    CHECK(strcmp(gy_kv_move_backend_name(GY_KV_MOVE_BACKEND_HOST), "counting") == 0);
    CHECK_OK(move_lists(dst, db, 0, src, sb, 0, 2, 3, 0, L));
    CHECK(copies == 1 && memcmp(before, gy_kv_layer_ptr(dst, 0), sizeof before) == 0);
    const gy_kv_move_item it = {.src = src, .dst = dst, .src_blocks = sb, .dst_blocks = db,
                                .n_blocks = 3, .n_heads = 2, .n_tokens = -1};
    const gy_kv_move overlap = {.items = &it, .n_items = 1, .first_layer = 0, .end_layer = 1,
                                .flags = GY_KV_MOVE_OVERLAP};
    CHECK_STATUS(gy_kv_move_run(&overlap, NULL, NULL), GY_ERR_UNAVAILABLE);
    CHECK(strstr(gy_error_message(), "counting") != NULL);
    CHECK_OK(gy_kv_move_set_backend(GY_KV_MOVE_BACKEND_HOST, NULL)); /* the default again */
    CHECK(strcmp(gy_kv_move_backend_name(GY_KV_MOVE_BACKEND_HOST), "host") == 0);
    CHECK(strcmp(gy_kv_move_backend_name(GY_KV_MOVE_BACKEND_COMM), "none") == 0);
    const gy_kv_move_backend nameless = {.copy = counting_copy};
    CHECK_STATUS(gy_kv_move_set_backend(GY_KV_MOVE_BACKEND_DEVICE, &nameless), GY_ERR_INVALID);
    CHECK_STATUS(gy_kv_move_set_backend(GY_KV_MOVE_BACKEND_COUNT, NULL), GY_ERR_INVALID);
    CHECK_OK(move_lists(dst, db, 0, src, sb, 0, 2, 3, 0, L));
    CHECK(copies == 1 && memcmp(before, gy_kv_layer_ptr(dst, 0), sizeof before) != 0);
    gy_kv_free(src);
    gy_kv_free(dst);
    gy_arena_free(sa);
    gy_arena_free(da);
}
