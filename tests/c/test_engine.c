/* test_engine.c: the serving loop under the sanitizers: a small random model served by one rank
 * and by two TP ranks on their own threads must give the same tokens, with no leak. */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "comm/comm.h"
#include "cpu/rope.h"
#include "engine/engine.h"
#include "engine/forward_cuda.h"
#include "engine/handover.h"
#include "engine/peer.h"
#include "engine/remote.h"
#include "engine/resplit.h"
#include "gytest.h"
#include "kv/kv_move.h"

enum { V = 97, H = 32, I = 48, L = 2, NH = 4, NKV = 2, D = 8, MAX_TP = 2 };

static float *random_tensor(int64_t n, uint32_t *state, float scale) {
    float *t = malloc((size_t)n * sizeof(float));
    for (int64_t i = 0; i < n; i++) {
        *state = *state * 1664525u + 1013904223u;
        t[i] = scale * ((float)(*state >> 8) / 16777216.0f - 0.5f);
    }
    return t;
}

typedef struct { float *tensors[64]; int n; } owned;

static float *keep(owned *o, float *t) { o->tensors[o->n++] = t; return t; }

/* A random model of n_layers; the same n_layers give the same weights (in new memory). */
static void build_model_layers(gy_model *m, owned *o, int n_layers) {
    uint32_t state = 7;
    memset(m, 0, sizeof *m);
    m->vocab = V; m->hidden = H; m->intermediate = I; m->n_layers = n_layers; m->n_heads = NH;
    m->n_kv_heads = NKV; m->head_dim = D; m->max_tp = MAX_TP; m->max_pos = 64;
    m->rms_eps = 1e-5f; m->weight_dtype = GY_DTYPE_F32;
    double inv_freq[D / 2];
    CHECK_OK(gy_cpu_rope_inv_freq(inv_freq, D, 10000.0));
    CHECK_OK(gy_model_init(m, inv_freq, 1.0, NULL));
    m->embed = keep(o, random_tensor(V * H, &state, 2.0f));
    m->lm_head = keep(o, random_tensor(V * H, &state, 1.0f));
    m->final_norm = keep(o, random_tensor(H, &state, 0.2f));
    for (int l = 0; l < n_layers; l++) {
        gy_layer_weights *w = &m->layers[l];
        float *an = keep(o, random_tensor(H, &state, 0.1f)), *fn = keep(o, random_tensor(H, &state, 0.1f));
        for (int i = 0; i < H; i++) an[i] += 1.0f, fn[i] += 1.0f;
        w->attn_norm = an;
        w->ffn_norm = fn;
        w->wq = keep(o, random_tensor(NH * D * H, &state, 0.6f));
        w->wk = keep(o, random_tensor(NKV * D * H, &state, 0.6f));
        w->wv = keep(o, random_tensor(NKV * D * H, &state, 0.6f));
        w->wo_t = keep(o, random_tensor(NH * D * H, &state, 0.6f));
        for (int s = 0; s < MAX_TP; s++) {
            w->gate[s] = keep(o, random_tensor(I / MAX_TP * H, &state, 0.6f));
            w->up[s] = keep(o, random_tensor(I / MAX_TP * H, &state, 0.6f));
            w->down_t[s] = keep(o, random_tensor(I / MAX_TP * H, &state, 0.6f));
        }
    }
}

static void build_model(gy_model *m, owned *o) { build_model_layers(m, o, L); }

/* A cache of the model's layers [first_layer, first_layer + n_layers). */
static void make_kv_range(gy_arena **arena, gy_kv_cache **kv, int64_t heads, int64_t first_layer,
                          int64_t n_layers) {
    gy_arena_config ac = {.backend = GY_ARENA_BACKEND_CPU, .page_size = 4096, .n_slots = 256,
                          .budget_bytes = 64 * 4096};
    CHECK_OK(gy_arena_init(arena, &ac));
    gy_kv_config kc = {.layout = GY_KV_LAYOUT_HEAD, .n_layers = n_layers, .first_layer = first_layer,
                       .n_heads = heads,
                       .head_dim = D, .block_size = 4, .elem_size = 4, .first_slot = 0,
                       .slots_per_layer = 256 / n_layers};
    CHECK_OK(gy_kv_init(kv, *arena, &kc));
}

static void make_kv_layers(gy_arena **arena, gy_kv_cache **kv, int64_t heads, int64_t n_layers) {
    make_kv_range(arena, kv, heads, 0, n_layers);
}

static void make_kv(gy_arena **arena, gy_kv_cache **kv, int64_t heads) {
    make_kv_layers(arena, kv, heads, L);
}

/* Adds the three requests every test serves: greedy ones and a seeded sampled one. */
static void add_requests(gy_engine *e) {
    const int32_t prompts[3][5] = {{1, 2, 3, 4, 5}, {9, 8, 7, 0, 0}, {50, 60, 70, 80, 90}};
    const int64_t lengths[3] = {5, 3, 5};
    for (int r = 0; r < 3; r++) {
        gy_engine_params p = {.sampler = {.temperature = r == 2 ? 0.9 : 0.0, .top_p = 1.0, .seed = 5},
                              .max_new_tokens = 12};
        CHECK_OK(gy_engine_add(e, r, prompts[r], lengths[r], &p, 0.0));
    }
}

/* Collects the step's tokens into out[3][12] (produced[] counts them). */
static void collect(const gy_engine_step_out *o, int32_t out[3][12], int64_t produced[3]) {
    for (int64_t i = 0; i < o->n_tokens; i++) {
        const int64_t id = o->token_ids[i];
        if (produced[id] < 12) out[id][produced[id]++] = o->tokens[i];
    }
}

/* Serves the three requests to completion; writes each one's 12 tokens into out[3][12]. */
static void serve(gy_engine *e, int32_t out[3][12]) {
    int64_t produced[3] = {0, 0, 0};
    add_requests(e);
    for (int step = 0; step < 100; step++) {
        gy_engine_step_out o;
        CHECK_OK(gy_engine_step(e, (double)step, &o));
        collect(&o, out, produced);
        for (int64_t i = 0; i < o.n_finished; i++) CHECK_OK(gy_engine_release(e, o.finished[i]));
    }
    CHECK(produced[0] == 12 && produced[1] == 12 && produced[2] == 12);
}

/* serve() on a one-rank engine: the tokens every other arrangement must give. */
static void serve_tp1(const gy_model *model, int32_t out[3][12]) {
    gy_arena *arena;
    gy_kv_cache *kv;
    make_kv_layers(&arena, &kv, NKV, model->n_layers);
    gy_engine *e;
    const gy_engine_rank one = {.model = model, .kv = kv};
    const gy_engine_config cfg = {.max_batch_tokens = 16, .max_running = 8};
    CHECK_OK(gy_engine_init(&e, &one, 1, NULL, &cfg));
    serve(e, out);
    gy_engine_free(e);
    gy_kv_free(kv);
    gy_arena_free(arena);
}

/* A TP2 engine over two workers' arenas and KV caches joined by a shm communicator. */
typedef struct {
    gy_arena *arenas[2];
    gy_kv_cache *kvs[2];
    gy_comm *comm;
    gy_engine *e;
} tp2;

static void tp2_init(tp2 *t, const gy_model *model) {
    CHECK_OK(gy_comm_init(&t->comm, 2));
    gy_engine_rank two[2];
    for (int r = 0; r < 2; r++) {
        make_kv(&t->arenas[r], &t->kvs[r], NKV / 2);
        two[r] = (gy_engine_rank){.model = model, .kv = t->kvs[r]};
    }
    const gy_engine_config cfg = {.max_batch_tokens = 16, .max_running = 8};
    CHECK_OK(gy_engine_init(&t->e, two, 2, t->comm, &cfg));
}

/* Frees it all; returns 1 when every KV page had gone back to the arenas. */
static int tp2_free(tp2 *t) {
    int clean = 1;
    gy_engine_free(t->e);
    for (int r = 0; r < 2; r++) {
        gy_arena_stats st;
        gy_arena_stats_get(t->arenas[r], &st);
        clean &= st.bytes_in_use == 0;
        gy_kv_free(t->kvs[r]);
        gy_arena_free(t->arenas[r]);
    }
    gy_comm_free(t->comm);
    return clean;
}

/* A max_pos whose rotary tables cannot exist is refused before anything is allocated (2^62
 * positions once wrapped the table's size into a small buffer and crashed); the frequencies are
 * data, and a table made with the same ones is copied bit for bit. */
GYTEST(model_init_refuses_tables_that_cannot_fit) {
    double inv_freq[D / 2];
    CHECK_OK(gy_cpu_rope_inv_freq(inv_freq, D, 10000.0));
    const int64_t huge[] = {(int64_t)1 << 62, (int64_t)INT32_MAX + 1, INT64_MAX};
    for (int i = 0; i < 3; i++) {
        gy_model m = {.vocab = V, .hidden = H, .intermediate = I, .n_layers = L, .n_heads = NH,
                      .n_kv_heads = NKV, .head_dim = D, .max_tp = MAX_TP, .max_pos = huge[i]};
        CHECK_STATUS(gy_model_init(&m, inv_freq, 1.0, NULL), GY_ERR_INVALID);
        CHECK(m.layers == NULL && m.rope_cos == NULL && m.rope_inv_freq == NULL);
    }
    /* Within int32 but past any machine's memory: 2^31 - 1 positions x 2^16 pairs (1 PiB). */
    gy_model big = {.vocab = V, .hidden = H, .intermediate = I, .n_layers = L, .n_heads = NH,
                    .n_kv_heads = NKV, .head_dim = (int64_t)1 << 17, .max_tp = MAX_TP,
                    .max_pos = INT32_MAX};
    double *many = calloc((size_t)1 << 16, sizeof(double));
    CHECK(many != NULL);
    for (int64_t i = 0; many != NULL && i < ((int64_t)1 << 16); i++) many[i] = 1.0;
    CHECK_STATUS(gy_model_init(&big, many, 1.0, NULL), GY_ERR_OUT_OF_MEMORY);
    CHECK(strstr(gy_error_message(), "max_pos=2147483647") != NULL);
    free(many);
    /* Bad frequencies and mscale are refused. */
    gy_model m = {.vocab = V, .hidden = H, .intermediate = I, .n_layers = L, .n_heads = NH,
                  .n_kv_heads = NKV, .head_dim = D, .max_tp = MAX_TP, .max_pos = 16};
    CHECK_STATUS(gy_model_init(&m, NULL, 1.0, NULL), GY_ERR_INVALID);
    CHECK_STATUS(gy_model_init(&m, inv_freq, 0.0, NULL), GY_ERR_INVALID);
    double bad[D / 2];
    memcpy(bad, inv_freq, sizeof bad);
    bad[3] = -1.0;
    CHECK_STATUS(gy_model_init(&m, bad, 1.0, NULL), GY_ERR_INVALID);
    /* A scaled table: mscale multiplies cos and sin; copied from a model with the same data. */
    CHECK_OK(gy_model_init(&m, inv_freq, 1.5, NULL));
    gy_model m2 = m, m3 = m;
    m2.layers = NULL; m2.rope_cos = m2.rope_sin = NULL; m2.rope_inv_freq = NULL;
    m3.layers = NULL; m3.rope_cos = m3.rope_sin = NULL; m3.rope_inv_freq = NULL;
    CHECK_OK(gy_model_init(&m2, inv_freq, 1.5, &m));
    CHECK(memcmp(m.rope_cos, m2.rope_cos, 16 * (D / 2) * sizeof(float)) == 0);
    CHECK_OK(gy_model_init(&m3, inv_freq, 1.0, &m)); /* another mscale: computed anew */
    CHECK(m.rope_cos[0] == 1.5f && m3.rope_cos[0] == 1.0f);
    gy_model_free(&m);
    gy_model_free(&m2);
    gy_model_free(&m3);
}

GYTEST(engine_tp1_and_tp2_give_the_same_tokens) {
    owned o = {0};
    gy_model model;
    build_model(&model, &o);
    int32_t tp1[3][12], tp2_tokens[3][12];

    serve_tp1(&model, tp1);

    tp2 t;
    tp2_init(&t, &model);
    serve(t.e, tp2_tokens);
    CHECK(tp2_free(&t)); /* every KV page went back when the requests finished */
    CHECK(memcmp(tp1, tp2_tokens, sizeof tp1) == 0);

    gy_engine *e;
    gy_engine_rank bad = {.model = &model, .kv = NULL};
    const gy_engine_config cfg = {.max_batch_tokens = 16, .max_running = 8};
    CHECK_STATUS(gy_engine_init(&e, &bad, 1, NULL, &cfg), GY_ERR_INVALID);
    gy_model_free(&model);
    for (int i = 0; i < o.n; i++) free(o.tensors[i]);
}

/* A cuda model in a build without the CUDA forward pass: every call is refused with the reason,
 * the engine stays consistent, and nothing leaks. TP on CUDA over the shm communicator (it adds
 * host buffers) and mixed backends are refused at engine creation whatever the build; the
 * pairings with device communicators are checked by tests/gpu_emu/harness.c. */
GYTEST(engine_refuses_what_the_cuda_backend_cannot_do_here) {
    owned o = {0};
    gy_model model;
    build_model(&model, &o);
    gy_arena *arena;
    gy_kv_cache *kv;
    make_kv(&arena, &kv, NKV);
    gy_model cuda = model; /* the same host pointers: nothing may dereference them */
    cuda.backend = GY_MODEL_BACKEND_CUDA;
    const gy_engine_config cfg = {.max_batch_tokens = 16, .max_running = 8};
    gy_engine *e = NULL;
#ifndef GY_WITH_CUDA
    CHECK_STATUS(gy_forward_cuda_attach(&cuda, 0), GY_ERR_UNAVAILABLE);
    CHECK(strstr(gy_error_message(), "not built with CUDA") != NULL);
    const gy_engine_rank one = {.model = &cuda, .kv = kv};
    CHECK_OK(gy_engine_init(&e, &one, 1, NULL, &cfg));
    const int32_t prompt[3] = {1, 2, 3};
    const gy_engine_params p = {.sampler = {.temperature = 0.0, .top_p = 1.0}, .max_new_tokens = 4};
    CHECK_OK(gy_engine_add(e, 0, prompt, 3, &p, 0.0));
    gy_engine_step_out out;
    CHECK_STATUS(gy_engine_step(e, 0.0, &out), GY_ERR_UNAVAILABLE);
    CHECK(strstr(gy_error_message(), "CUDA forward pass") != NULL);
    gy_engine_free(e);
#endif
    gy_comm *comm;
    CHECK_OK(gy_comm_init(&comm, 2));
    gy_engine_rank two[2] = {{.model = &cuda, .kv = kv}, {.model = &cuda, .kv = kv}};
    CHECK_STATUS(gy_engine_init(&e, two, 2, comm, &cfg), GY_ERR_INVALID);
    CHECK(strstr(gy_error_message(), "device communicator") != NULL);
    CHECK(strstr(gy_error_message(), "shm adds host buffers") != NULL);
    CHECK(e == NULL);
    CHECK(gy_comm_stream(comm, 0) == NULL && gy_comm_own_stream(comm, 1) == NULL);
    two[1].model = &model;
    CHECK_STATUS(gy_engine_init(&e, two, 2, comm, &cfg), GY_ERR_INVALID);
    gy_comm_free(comm);
    gy_kv_free(kv);
    gy_arena_free(arena);
    gy_model_free(&model);
    for (int i = 0; i < o.n; i++) free(o.tensors[i]);
}

/* ---- failures and threads ---- */

#include <pthread.h>

#include "core/fault.h"

/* What a caller can see of an engine's requests: state, progress and each rank's table. */
typedef struct {
    gy_sched_info info[3];
    int64_t n_tokens[3];
    int32_t tables[3][2][16];
    int64_t n_blocks[3][2];
} engine_view;

static void engine_look(gy_engine *e, gy_kv_cache *const *kvs, int n_ranks, engine_view *v) {
    memset(v, 0, sizeof *v);
    for (int64_t id = 0; id < 3; id++) {
        gy_engine_request_view r;
        if (gy_engine_request_get(e, id, &r) != GY_OK) continue;
        v->info[id] = r.info;
        v->n_tokens[id] = r.n_tokens;
        for (int k = 0; k < n_ranks; k++) {
            v->n_blocks[id][k] = r.seqs[k] >= 0 ? gy_kv_seq_n_blocks(kvs[k], r.seqs[k]) : -1;
            if (v->n_blocks[id][k] > 0)
                memcpy(v->tables[id][k], gy_kv_seq_blocks(kvs[k], r.seqs[k]),
                       (size_t)v->n_blocks[id][k] * sizeof(int32_t));
        }
    }
}

/* serve() with the n-th event of `site` failing during step `at`: a failed step must leave every
 * request and table as it was, and the run must still give the tokens of `want`. */
static int serve_with_fault(gy_engine *e, gy_kv_cache *const *kvs, int n_ranks, gy_fault_site site,
                            int64_t n, int at, int32_t want[3][12], int *failed) {
    const int32_t prompts[3][5] = {{1, 2, 3, 4, 5}, {9, 8, 7, 0, 0}, {50, 60, 70, 80, 90}};
    const int64_t lengths[3] = {5, 3, 5};
    int32_t out[3][12];
    int64_t produced[3] = {0, 0, 0};
    int ok = 1;
    for (int r = 0; r < 3; r++) {
        gy_engine_params p = {.sampler = {.temperature = r == 2 ? 0.9 : 0.0, .top_p = 1.0, .seed = 5},
                              .max_new_tokens = 12};
        ok &= gy_engine_add(e, r, prompts[r], lengths[r], &p, 0.0) == GY_OK;
    }
    *failed = 0;
    for (int step = 0; step < 100; step++) {
        engine_view before, after;
        engine_look(e, kvs, n_ranks, &before);
        if (step == at) gy_fault_arm(site, n);
        gy_engine_step_out o;
        const gy_status s = gy_engine_step(e, (double)step, &o);
        gy_fault_disarm_all();
        if (s != GY_OK) {
            *failed = 1;
            engine_look(e, kvs, n_ranks, &after);
            ok &= memcmp(&before, &after, sizeof before) == 0;
            CHECK_OK(gy_engine_step(e, (double)step, &o)); /* the same step, again */
        }
        for (int64_t i = 0; i < o.n_tokens; i++) {
            const int64_t id = o.token_ids[i];
            if (produced[id] < 12) out[id][produced[id]++] = o.tokens[i];
        }
        for (int64_t i = 0; i < o.n_finished; i++) CHECK_OK(gy_engine_release(e, o.finished[i]));
    }
    ok &= produced[0] == 12 && produced[1] == 12 && produced[2] == 12;
    return ok && memcmp(out, want, sizeof out) == 0;
}

/* Every allocation, page, map and collective of a TP2 step fails once in turn: the step is taken
 * back (the same requests, states and block tables), the next try succeeds, the tokens are
 * those of a run without failures, and nothing leaks (ASan). */
GYTEST(engine_a_failed_step_changes_nothing) {
    owned o = {0};
    gy_model model;
    build_model(&model, &o);
    int32_t want[3][12];
    serve_tp1(&model, want);

    const gy_fault_site sites[] = {GY_FAULT_ALLOC, GY_FAULT_PAGE_CREATE, GY_FAULT_PAGE_MAP,
                                   GY_FAULT_COMM};
    int all_ok = 1, fired = 0;
    for (size_t k = 0; k < sizeof sites / sizeof sites[0]; k++)
        for (int at = 0; at < 3; at++)
            for (int64_t n = 1; n <= 24; n++) {
                tp2 t;
                tp2_init(&t, &model);
                int failed;
                all_ok &= serve_with_fault(t.e, t.kvs, 2, sites[k], n, at, want, &failed);
                fired += failed;
                all_ok &= tp2_free(&t);
            }
    CHECK(all_ok);
    CHECK(fired > 40); /* the sweep did reach the steps' resources */
    gy_model_free(&model);
    for (int i = 0; i < o.n; i++) free(o.tensors[i]);
}

/* Two threads on one TP2 engine: one steps, the other adds and aborts requests and reads them
 * back. The engine's lock takes them in turn (built under ThreadSanitizer by `make tsan`); every
 * request ends, and the ones nobody aborted give the tokens of a run on one thread. */
typedef struct {
    gy_engine *e;
    int32_t tokens[40][8];
    int64_t produced[40];
    int aborted[40];
    int stop;
    int finished;
    pthread_mutex_t lock; /* the test's own bookkeeping */
} thread_run;

/* Steps until told to stop. It used to stop after 4,000 steps: on a loaded machine the stepper
 * ran them before the adding thread got the CPU back, and the requests added later never ran
 * (seen three times here, the test then waiting its 60 s). */
static void *threads_stepper(void *arg) {
    thread_run *t = arg;
    for (int64_t step = 0; !__atomic_load_n(&t->stop, __ATOMIC_ACQUIRE); step++) {
        gy_engine_step_out o;
        if (gy_engine_step(t->e, (double)step, &o) != GY_OK) continue;
        pthread_mutex_lock(&t->lock);
        for (int64_t i = 0; i < o.n_tokens; i++) {
            const int64_t id = o.token_ids[i];
            if (t->produced[id] < 8) t->tokens[id][t->produced[id]++] = o.tokens[i];
        }
        pthread_mutex_unlock(&t->lock);
        for (int64_t i = 0; i < o.n_finished; i++) {
            gy_engine_release(t->e, o.finished[i]);
            __atomic_add_fetch(&t->finished, 1, __ATOMIC_ACQ_REL);
        }
    }
    return NULL;
}

static void threads_serve(gy_engine *e, thread_run *t, int abort_some) {
    pthread_t stepper;
    pthread_create(&stepper, NULL, threads_stepper, t);
    for (int id = 0; id < 40; id++) {
        const int32_t prompt[4] = {id % 97, (id * 7) % 97, 3, 5};
        const gy_engine_params p = {.sampler = {.temperature = 0.0, .top_p = 1.0}, .max_new_tokens = 8};
        CHECK_OK(gy_engine_add(e, id, prompt, 4, &p, 0.0));
        if (abort_some && id % 5 == 4 && gy_engine_abort(e, id - 2) == GY_OK) {
            t->aborted[id - 2] = 1;
            __atomic_add_fetch(&t->finished, 1, __ATOMIC_ACQ_REL);
        }
        int64_t ids[64];
        gy_engine_request_ids(e, ids, 64);
    }
    /* Up to 60 s: under ASan on two busy cores the 40 requests have taken over 10 s. */
    for (int i = 0; i < 600000 && __atomic_load_n(&t->finished, __ATOMIC_ACQUIRE) < 40; i++) {
        struct timespec ts = {0, 100000};
        nanosleep(&ts, NULL);
    }
    __atomic_store_n(&t->stop, 1, __ATOMIC_RELEASE);
    pthread_join(stepper, NULL);
    /* Aborted requests are released by the caller here; finished ones were by the stepper. */
    for (int id = 0; id < 40; id++)
        if (t->aborted[id]) gy_engine_release(e, id);
}

GYTEST(engine_threads_submit_abort_and_step_take_turns) {
    owned o = {0};
    gy_model model;
    build_model(&model, &o);
    static thread_run plain, racing;
    memset(&plain, 0, sizeof plain);
    memset(&racing, 0, sizeof racing);
    pthread_mutex_init(&plain.lock, NULL);
    pthread_mutex_init(&racing.lock, NULL);
    tp2 t;
    tp2_init(&t, &model);
    plain.e = t.e;
    threads_serve(t.e, &plain, 0);
    CHECK(plain.finished == 40);
    CHECK(tp2_free(&t));
    tp2_init(&t, &model);
    racing.e = t.e;
    threads_serve(t.e, &racing, 1);
    CHECK(racing.finished == 40);
    int same = 1, aborted = 0;
    for (int id = 0; id < 40; id++) {
        aborted += racing.aborted[id];
        if (!racing.aborted[id])
            same &= racing.produced[id] == 8 &&
                    memcmp(racing.tokens[id], plain.tokens[id], sizeof plain.tokens[id]) == 0;
    }
    CHECK(same && aborted > 0);
    CHECK(tp2_free(&t));
    pthread_mutex_destroy(&plain.lock);
    pthread_mutex_destroy(&racing.lock);
    gy_model_free(&model);
    for (int i = 0; i < o.n; i++) free(o.tensors[i]);
}

/* ---- plans of several stages ---- */

enum { PLAN_L = 4 };

/* A worker of a plan: its own copy of the model (same weights), arena and KV cache. */
typedef struct {
    owned o;
    gy_model model;
    gy_arena *arena;
    gy_kv_cache *kv;
} plan_worker;

/* Its cache holds the model's layers [first, end) only. */
static void plan_worker_init(plan_worker *w, int64_t kv_heads, int64_t first, int64_t end) {
    memset(w, 0, sizeof *w);
    build_model_layers(&w->model, &w->o, PLAN_L);
    make_kv_range(&w->arena, &w->kv, kv_heads, first, end - first);
}

/* Frees it; returns 1 when its arena had got every KV page back. */
static int plan_worker_free(plan_worker *w) {
    gy_arena_stats st;
    gy_arena_stats_get(w->arena, &st);
    gy_kv_free(w->kv);
    gy_arena_free(w->arena);
    gy_model_free(&w->model);
    for (int i = 0; i < w->o.n; i++) free(w->o.tensors[i]);
    return st.bytes_in_use == 0;
}

/* The worker's model holds layers [first, end) only, and the ends asked for: the others'
 * weights are gone (NULL), so a stage touching them would crash. */
static void plan_worker_keep(plan_worker *w, int64_t first, int64_t end, int embed, int head) {
    gy_model *m = &w->model;
    m->layer_begin = first;
    m->layer_end = end;
    m->has_embed = embed;
    m->has_head = head;
    for (int64_t l = 0; l < PLAN_L; l++)
        if (l < first || l >= end) memset(&m->layers[l], 0, sizeof m->layers[l]);
    if (!embed) m->embed = NULL;
    if (!head) m->final_norm = NULL, m->lm_head = NULL;
    CHECK_OK(gy_model_check(m, (1u << MAX_TP) - 1));
}

/* Serves the three requests on a plan of TP1 stages with the given layer counts, one worker a
 * stage, and checks the tokens against `want`. */
static void check_pipeline(const int *layers, int n_stages, int32_t want[3][12]) {
    plan_worker w[4];
    gy_engine_rank ranks[4];
    gy_engine_stage stages[4];
    int64_t first = 0;
    for (int s = 0; s < n_stages; s++) {
        plan_worker_init(&w[s], NKV, first, first + layers[s]);
        plan_worker_keep(&w[s], first, first + layers[s], s == 0, s == n_stages - 1);
        ranks[s] = (gy_engine_rank){.model = &w[s].model, .kv = w[s].kv};
        stages[s] = (gy_engine_stage){.first_layer = first, .end_layer = first + layers[s],
                                      .size = 1, .ranks = &ranks[s]};
        first += layers[s];
    }
    const gy_engine_config cfg = {.max_batch_tokens = 16, .max_running = 8};
    gy_engine *e;
    if (n_stages > 1) { /* the stages in the wrong order: each model lacks what it would need */
        gy_engine_stage swapped[4];
        memcpy(swapped, stages, sizeof swapped);
        const gy_engine_rank *r0 = swapped[0].ranks;
        swapped[0].ranks = swapped[n_stages - 1].ranks;
        swapped[n_stages - 1].ranks = r0;
        CHECK_STATUS(gy_engine_init_plan(&e, swapped, n_stages, &cfg), GY_ERR_INVALID);
        gy_error_clear();
    }
    CHECK_OK(gy_engine_init_plan(&e, stages, n_stages, &cfg));
    int32_t got[3][12];
    serve(e, got);
    CHECK(memcmp(got, want, sizeof got) == 0);
    gy_engine_free(e);
    for (int s = 0; s < n_stages; s++) CHECK(plan_worker_free(&w[s]));
}

GYTEST(engine_pipeline_plans_give_the_tokens_of_one_stage) {
    owned o = {0};
    gy_model model;
    build_model_layers(&model, &o, PLAN_L);
    int32_t want[3][12];
    serve_tp1(&model, want);
    const int splits[][4] = {{2, 2}, {3, 1}, {1, 3}, {1, 1, 1, 1}, {2, 1, 1}};
    const int counts[] = {2, 2, 2, 4, 3};
    for (int i = 0; i < 5; i++) check_pipeline(splits[i], counts[i], want);
    gy_model_free(&model);
    for (int i = 0; i < o.n; i++) free(o.tensors[i]);
}

/* Two stages on one worker (one model, two caches), and a TP2 stage feeding a TP1 stage: the
 * plan does not assume one rank a stage. */
GYTEST(engine_plans_of_mixed_stages_give_the_tokens_of_one_stage) {
    owned o = {0};
    gy_model model;
    build_model_layers(&model, &o, PLAN_L);
    int32_t want[3][12], got[3][12];
    serve_tp1(&model, want);
    const gy_engine_config cfg = {.max_batch_tokens = 16, .max_running = 8};

    gy_arena *arenas[3];
    gy_kv_cache *kvs[3];
    make_kv_range(&arenas[0], &kvs[0], NKV, 0, 1);
    make_kv_range(&arenas[1], &kvs[1], NKV, 1, PLAN_L - 1);
    const gy_engine_rank lower = {.model = &model, .kv = kvs[0]}, upper = {.model = &model, .kv = kvs[1]};
    const gy_engine_stage one_worker[2] = {{.first_layer = 0, .end_layer = 1, .size = 1, .ranks = &lower},
                                           {.first_layer = 1, .end_layer = PLAN_L, .size = 1, .ranks = &upper}};
    gy_engine *e;
    CHECK_OK(gy_engine_init_plan(&e, one_worker, 2, &cfg));
    serve(e, got);
    CHECK(memcmp(got, want, sizeof got) == 0);
    gy_engine_free(e);
    for (int i = 0; i < 2; i++) {
        gy_kv_free(kvs[i]);
        gy_arena_free(arenas[i]);
    }

    plan_worker w[3];
    gy_comm *comm;
    CHECK_OK(gy_comm_init(&comm, 2));
    for (int i = 0; i < 3; i++) plan_worker_init(&w[i], i < 2 ? NKV / 2 : NKV, i < 2 ? 0 : 3, i < 2 ? 3 : PLAN_L);
    const gy_engine_rank tp2[2] = {{.model = &w[0].model, .kv = w[0].kv}, {.model = &w[1].model, .kv = w[1].kv}};
    const gy_engine_rank tp1 = {.model = &w[2].model, .kv = w[2].kv};
    const gy_engine_stage mixed[2] = {{.first_layer = 0, .end_layer = 3, .size = 2, .ranks = tp2, .comm = comm},
                                      {.first_layer = 3, .end_layer = PLAN_L, .size = 1, .ranks = &tp1}};
    CHECK_OK(gy_engine_init_plan(&e, mixed, 2, &cfg));
    CHECK(gy_engine_n_ranks(e) == 2);
    serve(e, got);
    CHECK(memcmp(got, want, sizeof got) == 0);
    gy_engine_free(e);
    for (int i = 0; i < 3; i++) CHECK(plan_worker_free(&w[i]));
    gy_comm_free(comm);
    gy_model_free(&model);
    for (int i = 0; i < o.n; i++) free(o.tensors[i]);
}

GYTEST(engine_refuses_plans_that_do_not_cover_the_model) {
    plan_worker w[2];
    for (int i = 0; i < 2; i++) plan_worker_init(&w[i], NKV, 0, PLAN_L);
    const gy_engine_rank r0 = {.model = &w[0].model, .kv = w[0].kv}, r1 = {.model = &w[1].model, .kv = w[1].kv};
    const gy_engine_config cfg = {.max_batch_tokens = 16, .max_running = 8};
    const int64_t bad[][4] = {{0, 2, 3, 4},  /* a gap */
                              {0, 3, 2, 4},  /* an overlap */
                              {0, 2, 2, 3},  /* short of the last layer */
                              {0, 0, 0, 4},  /* an empty stage */
                              {1, 2, 2, 4}}; /* not from layer 0 */
    for (int i = 0; i < 5; i++) {
        const gy_engine_stage plan[2] = {{.first_layer = bad[i][0], .end_layer = bad[i][1], .size = 1, .ranks = &r0},
                                         {.first_layer = bad[i][2], .end_layer = bad[i][3], .size = 1, .ranks = &r1}};
        gy_engine *e = (gy_engine *)&plan; /* must be cleared */
        CHECK_STATUS(gy_engine_init_plan(&e, plan, 2, &cfg), GY_ERR_INVALID);
        CHECK(e == NULL);
    }
    /* A two-rank stage without a communicator, and zero stages. */
    const gy_engine_rank both[2] = {r0, r1};
    const gy_engine_stage no_comm = {.first_layer = 0, .end_layer = PLAN_L, .size = 2, .ranks = both};
    gy_engine *e;
    CHECK_STATUS(gy_engine_init_plan(&e, &no_comm, 1, &cfg), GY_ERR_INVALID);
    CHECK_STATUS(gy_engine_init_plan(&e, &no_comm, 0, &cfg), GY_ERR_INVALID);
    /* A cache that does not hold its stage's layers. */
    gy_arena *arena;
    gy_kv_cache *upper;
    make_kv_range(&arena, &upper, NKV, 2, 2);
    const gy_engine_rank r1_upper = {.model = &w[1].model, .kv = upper};
    const gy_engine_stage short_kv[2] = {{.first_layer = 0, .end_layer = 1, .size = 1, .ranks = &r0},
                                         {.first_layer = 1, .end_layer = PLAN_L, .size = 1, .ranks = &r1_upper}};
    CHECK_STATUS(gy_engine_init_plan(&e, short_kv, 2, &cfg), GY_ERR_INVALID);
    CHECK(strstr(gy_error_message(), "holds layers [2, 4), not the stage's [1, 4)") != NULL);
    gy_kv_free(upper);
    gy_arena_free(arena);
    gy_error_clear();
    for (int i = 0; i < 2; i++) CHECK(plan_worker_free(&w[i]));
}

/* ---- moving requests between engines ---- */

GYTEST(engine_take_moves_requests_that_continue_bit_identically) {
    owned o = {0};
    gy_model model;
    build_model(&model, &o);
    int32_t want[3][12], got[3][12];
    serve_tp1(&model, want);
    gy_arena *arena;
    gy_kv_cache *kv;
    make_kv(&arena, &kv, NKV);
    const gy_engine_rank one = {.model = &model, .kv = kv};
    /* Two running at most, so that the third is still queued when they move. */
    const gy_engine_config cfg = {.max_batch_tokens = 16, .max_running = 2};
    gy_engine *a, *b;
    CHECK_OK(gy_engine_init(&a, &one, 1, NULL, &cfg));
    CHECK_OK(gy_engine_init(&b, &one, 1, NULL, &cfg)); /* a new instance over the same worker */
    add_requests(a);
    int64_t produced[3] = {0, 0, 0};
    int step = 0;
    for (; step < 3; step++) {
        gy_engine_step_out out;
        CHECK_OK(gy_engine_step(a, (double)step, &out));
        collect(&out, got, produced);
    }
    int states[3];
    for (int r = 0; r < 3; r++) {
        gy_engine_request_view v;
        CHECK_OK(gy_engine_request_get(a, r, &v));
        states[r] = v.info.state;
        /* A refusal changes neither engine: a sequence that does not exist. */
        const int64_t bogus[GY_MODEL_MAX_TP] = {999, -1, -1, -1, -1, -1, -1, -1};
        CHECK_STATUS(gy_engine_take(b, a, r, bogus), GY_ERR_STATE);
        CHECK_OK(gy_engine_request_get(a, r, &v));
        CHECK_OK(gy_engine_take(b, a, r, v.seqs));
        CHECK_STATUS(gy_engine_request_get(a, r, &v), GY_ERR_STATE);
        CHECK_STATUS(gy_engine_take(b, a, r, v.seqs), GY_ERR_STATE); /* a has it no more */
    }
    gy_error_clear();
    CHECK(states[0] == GY_SCHED_STATE_RUNNING && states[2] == GY_SCHED_STATE_WAITING);
    gy_sched_stats sa;
    gy_engine_stats(a, &sa);
    CHECK(sa.n_finished == 0 && sa.n_running == 0 && sa.n_waiting == 0); /* moved, not aborted */
    gy_engine_free(a); /* it let go of their KV: nothing of b's is freed */
    for (; step < 100; step++) {
        gy_engine_step_out out;
        CHECK_OK(gy_engine_step(b, (double)step, &out));
        collect(&out, got, produced);
        for (int64_t i = 0; i < out.n_finished; i++) CHECK_OK(gy_engine_release(b, out.finished[i]));
    }
    CHECK(produced[0] == 12 && produced[1] == 12 && produced[2] == 12);
    CHECK(memcmp(got, want, sizeof got) == 0);
    gy_engine_free(b);
    gy_arena_stats st;
    gy_arena_stats_get(arena, &st);
    CHECK(st.bytes_in_use == 0);
    gy_kv_free(kv);
    gy_arena_free(arena);
    gy_model_free(&model);
    for (int i = 0; i < o.n; i++) free(o.tensors[i]);
}

/* KunServe's remote attention: a pipeline PP[2,2] whose two caches hold every layer. All three
 * requests attend in stage 1's layers on stage 0's cache from the start (their KV is "still
 * there"); after 4 steps layer 2's KV moves to stage 1's cache and they attend there for it,
 * after 6 layer 3's: the tokens of one stage, and the remote calls counted. */
GYTEST(engine_remote_attention_gives_the_tokens_of_one_stage) {
    owned o = {0};
    gy_model model;
    build_model_layers(&model, &o, PLAN_L);
    int32_t want[3][12], got[3][12];
    int64_t produced[3] = {0, 0, 0};
    serve_tp1(&model, want);
    gy_arena *arenas[2];
    gy_kv_cache *kvs[2];
    for (int s = 0; s < 2; s++) make_kv_range(&arenas[s], &kvs[s], NKV, 0, PLAN_L);
    const gy_engine_rank ranks[2] = {{.model = &model, .kv = kvs[0]}, {.model = &model, .kv = kvs[1]}};
    const gy_engine_stage plan[2] = {{.first_layer = 0, .end_layer = 2, .size = 1, .ranks = &ranks[0]},
                                     {.first_layer = 2, .end_layer = PLAN_L, .size = 1, .ranks = &ranks[1]}};
    const gy_engine_config cfg = {.max_batch_tokens = 16, .max_running = 8};
    gy_engine *e;
    CHECK_OK(gy_engine_init_plan(&e, plan, 2, &cfg));
    CHECK_STATUS(gy_engine_set_remote(e, 0, 1, 0, 2, PLAN_L), GY_ERR_STATE); /* no request yet */
    add_requests(e);
    CHECK_STATUS(gy_engine_set_remote(e, 0, 1, 1, 2, PLAN_L), GY_ERR_INVALID); /* itself */
    CHECK_STATUS(gy_engine_set_remote(e, 0, 1, 2, 2, PLAN_L), GY_ERR_INVALID); /* no stage 2 */
    gy_error_clear();
    for (int r = 0; r < 3; r++) CHECK_OK(gy_engine_set_remote(e, r, 1, 0, 2, PLAN_L));
    CHECK_STATUS(gy_engine_replan(e, plan, 2), GY_ERR_BUSY);
    gy_error_clear();
    int64_t calls = 0, rows = 0;
    for (int step = 0; step < 100; step++) {
        if (step == 4 || step == 6) { /* one more layer has arrived */
            const int64_t l = step == 4 ? 2 : 3;
            int64_t pairs[2 * 8], n = 0;
            CHECK_OK(gy_engine_stage_pairs(e, 0, 1, 0, pairs, 8, &n));
            CHECK(n == 3);
            gy_kv_move_item items[8];
            for (int64_t i = 0; i < n; i++)
                items[i] = (gy_kv_move_item){.src = kvs[0], .dst = kvs[1], .src_seq = pairs[2 * i],
                                             .dst_seq = pairs[2 * i + 1], .n_heads = NKV,
                                             .n_tokens = GY_KV_MOVE_ALL_TOKENS};
            const gy_kv_move move = {.items = items, .n_items = n, .first_layer = l, .end_layer = l + 1};
            gy_kv_move_stats moved;
            CHECK_OK(gy_kv_move_run(&move, NULL, &moved));
            CHECK(moved.slots > 0);
            for (int r = 0; r < 3; r++) CHECK_OK(gy_engine_set_remote(e, r, 1, 0, l + 1, PLAN_L));
            if (step == 4) gy_engine_remote_stats(e, &calls, &rows);
        }
        gy_engine_step_out out;
        CHECK_OK(gy_engine_step(e, (double)step, &out));
        collect(&out, got, produced);
        for (int64_t i = 0; i < out.n_finished; i++) CHECK_OK(gy_engine_release(e, out.finished[i]));
    }
    CHECK(memcmp(got, want, sizeof got) == 0);
    /* 4 steps of 3 requests (prefill rows of up to 5 tokens) over 2 layers, then 2 over 1 */
    CHECK(calls == 4 * 3 * 2 && rows >= calls);
    int64_t calls_after = 0;
    gy_engine_remote_stats(e, &calls_after, &rows);
    CHECK(calls_after == calls + 2 * 3);
    CHECK_OK(gy_engine_replan(e, plan, 2)); /* the records left with the requests */
    gy_engine_free(e);
    for (int s = 0; s < 2; s++) {
        gy_kv_free(kvs[s]);
        gy_arena_free(arenas[s]);
    }
    gy_model_free(&model);
    for (int i = 0; i < o.n; i++) free(o.tensors[i]);
}

/* ---- a pipeline split between two processes (peer.h) ---- */

typedef struct {
    gy_engine *follower;
    int calls, lose_reply_at, lose_request_at, cancels;
} outlet_state;

/* The leader's outlet: the follower called directly, a reply or a request lost on the calls
 * asked for (as a broken link would). */
static gy_status direct_outlet(void *ctx, const gy_peer_step *step, float *logits) {
    outlet_state *o = ctx;
    if (step->cancel) {
        o->cancels++;
        return gy_engine_follow(o->follower, step, logits);
    }
    o->calls++;
    if (o->calls == o->lose_request_at) return GY_FAIL(GY_ERR_STATE, "the request was lost");
    GY_TRY(gy_engine_follow(o->follower, step, logits));
    if (o->calls == o->lose_reply_at) return GY_FAIL(GY_ERR_STATE, "the reply was lost");
    return GY_OK;
}

/* One side of the split: a stage whose model holds layers [first, end) only. */
static void split_side(plan_worker *w, int64_t first, int64_t end, gy_engine_rank *rank) {
    plan_worker_init(w, NKV, 0, PLAN_L);   /* (its cache holds every layer, as a worker's does) */
    plan_worker_keep(w, first, end, first == 0, end == PLAN_L);
    *rank = (gy_engine_rank){.model = &w->model, .kv = w->kv};
}

GYTEST(engine_a_pipeline_split_between_two_engines_gives_the_tokens_of_one_stage) {
    owned o = {0};
    gy_model model;
    build_model_layers(&model, &o, PLAN_L);
    int32_t want[3][12];
    serve_tp1(&model, want);
    for (int lost = 0; lost < 3; lost++) { /* none, a lost reply, a lost request */
        plan_worker a, b;
        gy_engine_rank ra, rb;
        split_side(&a, 0, 2, &ra);
        split_side(&b, 2, PLAN_L, &rb);
        const gy_engine_stage lead_stage = {.first_layer = 0, .end_layer = 2, .size = 1, .ranks = &ra};
        const gy_engine_stage follow_stage = {.first_layer = 2, .end_layer = PLAN_L, .size = 1,
                                              .ranks = &rb};
        gy_engine_config cfg = {.max_batch_tokens = 16, .max_running = 8};
        gy_engine *lead, *follow;
        /* a part of the model is a plan only when it says which part */
        CHECK_STATUS(gy_engine_init_plan(&lead, &lead_stage, 1, &cfg), GY_ERR_INVALID);
        gy_error_clear();
        cfg.end_layer = 2;
        CHECK_OK(gy_engine_init_plan(&lead, &lead_stage, 1, &cfg));
        cfg.first_layer = 2;
        cfg.end_layer = 0;
        CHECK_OK(gy_engine_init_plan(&follow, &follow_stage, 1, &cfg));
        gy_engine_step_out out;
        CHECK_STATUS(gy_engine_step(lead, 0.0, &out), GY_ERR_STATE); /* no follower yet */
        CHECK_STATUS(gy_engine_step(follow, 0.0, &out), GY_ERR_STATE); /* it follows */
        CHECK_STATUS(gy_engine_set_outlet(follow, direct_outlet, NULL, 10), GY_ERR_INVALID);
        gy_error_clear();
        outlet_state st = {.follower = follow, .lose_reply_at = lost == 1 ? 3 : 0,
                           .lose_request_at = lost == 2 ? 3 : 0};
        CHECK_OK(gy_engine_set_outlet(lead, direct_outlet, &st, gy_engine_capacity_blocks(follow)));
        int32_t got[3][12];
        int64_t produced[3] = {0, 0, 0};
        add_requests(lead);
        int failures = 0;
        for (int step = 0; step < 100; step++) {
            const gy_status s = gy_engine_step(lead, (double)step, &out);
            if (s != GY_OK) {
                failures++;
                gy_error_clear();
                continue;
            }
            collect(&out, got, produced);
            for (int64_t i = 0; i < out.n_finished; i++) CHECK_OK(gy_engine_release(lead, out.finished[i]));
        }
        CHECK(produced[0] == 12 && produced[1] == 12 && produced[2] == 12);
        CHECK(memcmp(got, want, sizeof got) == 0);
        CHECK(failures == (lost ? 1 : 0) && st.cancels == failures);
        CHECK_OK(gy_engine_peer_flush(lead));
        gy_kv_stats ka, kb;
        gy_kv_stats_get(a.kv, &ka);
        gy_kv_stats_get(b.kv, &kb);
        CHECK(ka.n_sequences == 0 && kb.n_sequences == 0);
        gy_engine_free(lead);
        gy_engine_free(follow);
        CHECK(plan_worker_free(&a) && plan_worker_free(&b)); /* every KV page given back */
    }
    gy_model_free(&model);
    for (int i = 0; i < o.n; i++) free(o.tensors[i]);
}
