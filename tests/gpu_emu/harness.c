/* harness.c: csrc/engine/forward_cuda.c, compiled unchanged against the emulated device (the
 * runtime of runtime.c, the naive kernels of naive_kernels.c, the real device.cu and
 * comm_d2d.cu), against the CPU pass (forward.c) on a small random model: two sequences mixing
 * prefill chunks and decode steps (both attention entry points), every KV layout and several
 * block sizes, q/k/v biases, fp32 and bf16 (activations and KV in bf16), and tensor
 * parallelism: TP2 over the shm communicator on "device" buffers, and TP2/TP4 over the d2d
 * communicator itself (comm_d2d.c and comm_stream.c compiled with GY_WITH_CUDA), each rank with
 * its own model and stream. Logits and KV contents must agree: 1e-5 of the largest value in
 * fp32 (only the order of sums differs), 5e-2 in bf16 (8-bit activations against the CPU's
 * fp32 ones).
 *
 * Then the serving loop: an engine of emulated CUDA ranks over a d2d communicator generates the
 * same greedy tokens as a CPU engine, its ranks' collectives run on their models' streams while
 * it lives and on the communicator's own afterwards, and the pairings that cannot work (shm with
 * CUDA ranks, d2d with CPU ranks, a rank on another device, a model without a stream) are refused
 * with the reason. And the device backend of KV moves (kernels/kv_move_device.c), registered in
 * the host backend's place, copies the same bytes as the host backend.
 *
 * The arenas here are CPU ones: build.py compiles forward_cuda.c and kv_move_device.c with
 * gy_arena_backend and gy_arena_device renamed to emu_arena_backend and emu_arena_device below,
 * which call every arena a CUDA one on device 0.
 *
 * Exits non-zero on any failure; ASan checks that every emulated allocation is freed.
 * `make cudaemu` (tests/gpu_emu/run.py harness). */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "comm/comm.h"
#include "cpu/rope.h"
#include "engine/engine.h"
#include "engine/forward_cuda.h"
#include "core/dtype.h"
#include "kernels/kv_move_device.h"
#include "mem/arena.h"
#include "gpu_emu.h"

enum { V = 97, H = 64, I = 96, L = 3, NH = 8, NKV = 4, D = 16, MAX_TP = 4 };
gy_arena_backend_kind emu_arena_backend(const gy_arena *a) { (void)a; return GY_ARENA_BACKEND_CUDA; }
int32_t emu_arena_device(const gy_arena *a) { (void)a; return 0; }
static int failures;
#define EXPECT(c) do { if (!(c)) { printf("FAIL %s:%d %s (%s)\n", __FILE__, __LINE__, #c, gy_error_message()); failures++; } } while (0)

static uint32_t state = 7;
static float rnd01(void) { state = state * 1664525u + 1013904223u; return (float)(state >> 8) / 16777216.0f - 0.5f; }
static void *tensor(int64_t n, float scale, gy_dtype dt, float add) {
    void *t = malloc((size_t)n * 4);
    for (int64_t i = 0; i < n; i++) { float v = scale * rnd01() + add;
        if (dt == GY_DTYPE_F32) ((float *)t)[i] = v; else ((uint16_t *)t)[i] = gy_f32_to_bf16(v); }
    return t;
}
static void build(gy_model *m, gy_dtype dt, int bias) {
    state = 7;
    memset(m, 0, sizeof *m);
    m->vocab = V; m->hidden = H; m->intermediate = I; m->n_layers = L; m->n_heads = NH; m->n_kv_heads = NKV;
    m->head_dim = D; m->max_tp = MAX_TP; m->max_pos = 128; m->rms_eps = 1e-5f; m->weight_dtype = dt;
    double inv_freq[D / 2];
    if (gy_cpu_rope_inv_freq(inv_freq, D, 10000.0) != GY_OK || gy_model_init(m, inv_freq, 1.0, NULL) != GY_OK) abort();
    m->embed = tensor(V * H, 2.0f, dt, 0); m->lm_head = tensor(V * H, 1.0f, dt, 0);
    m->final_norm = tensor(H, 0.2f, GY_DTYPE_F32, 1.0f);
    for (int l = 0; l < L; l++) {
        gy_layer_weights *w = &m->layers[l];
        w->attn_norm = tensor(H, 0.1f, GY_DTYPE_F32, 1.0f); w->ffn_norm = tensor(H, 0.1f, GY_DTYPE_F32, 1.0f);
        w->wq = tensor(NH * D * H, 0.5f, dt, 0); w->wk = tensor(NKV * D * H, 0.5f, dt, 0);
        w->wv = tensor(NKV * D * H, 0.5f, dt, 0); w->wo_t = tensor(NH * D * H, 0.5f, dt, 0);
        if (bias) { w->bq = tensor(NH * D, 0.5f, GY_DTYPE_F32, 0); w->bk = tensor(NKV * D, 0.5f, GY_DTYPE_F32, 0); w->bv = tensor(NKV * D, 0.5f, GY_DTYPE_F32, 0); }
        for (int s = 0; s < MAX_TP; s++) { w->gate[s] = tensor(I / MAX_TP * H, 0.5f, dt, 0);
            w->up[s] = tensor(I / MAX_TP * H, 0.5f, dt, 0); w->down_t[s] = tensor(I / MAX_TP * H, 0.5f, dt, 0); }
    }
}
static void kv_make(gy_arena **a, gy_kv_cache **kv, int64_t heads, int64_t elem, gy_kv_layout_kind kind, int64_t bs) {
    gy_arena_config ac = {.backend = GY_ARENA_BACKEND_CPU, .page_size = 4096, .n_slots = 512, .budget_bytes = 256 * 4096};
    if (gy_arena_init(a, &ac) != GY_OK) abort();
    gy_kv_config kc = {.layout = kind, .n_layers = L, .n_heads = heads, .head_dim = D, .block_size = bs, .elem_size = elem, .first_slot = 0, .slots_per_layer = 160};
    if (gy_kv_init(kv, *a, &kc) != GY_OK) abort();
    if (gy_kv_grow(*kv, 8) != GY_OK) abort();
}

/* Two sequences: A (len 23) prefilled in chunks with B (len 9) mixed in, then decodes of both. */
typedef struct { int32_t tok[64], seq[64], pos[64]; int64_t n; int32_t rows[4]; int64_t nl; } step;
static const int32_t toksA[30] = {5,17,3,88,42,9,61,0,96,33,12,7,71,50,2,19,64,38,27,80,11,45,90,4,6,8,10,13,15,16};
static const int32_t toksB[20] = {1,2,93,60,44,21,30,70,77,14,25,36,47,58,69,79,81,85,91,95};
static int64_t plan(step *out) {
    int64_t ns = 0, a = 0, b = 0;
    const int chunksA[] = {11, 0, 12, 1, 1, 1, 1}, chunksB[] = {0, 9, 1, 1, 1, 1, 1};
    for (int k = 0; k < 7; k++) { step *s = &out[ns++]; s->n = 0; s->nl = 0;
        for (int j = 0; j < chunksA[k]; j++, a++) { s->tok[s->n] = toksA[a]; s->seq[s->n] = 0; s->pos[s->n] = (int32_t)a; s->n++; }
        if (chunksA[k]) s->rows[s->nl++] = (int32_t)(s->n - 1);
        for (int j = 0; j < chunksB[k]; j++, b++) { s->tok[s->n] = toksB[b]; s->seq[s->n] = 1; s->pos[s->n] = (int32_t)b; s->n++; }
        if (chunksB[k]) s->rows[s->nl++] = (int32_t)(s->n - 1);
    }
    return ns;
}
static void seqs_for(gy_kv_cache *kv, int64_t *sa, int64_t *sb) {
    gy_kv_seq_new(kv, sa); gy_kv_seq_new(kv, sb);
    /* interleave reservations so block tables are not contiguous */
    gy_kv_seq_reserve(kv, *sa, 5); gy_kv_seq_reserve(kv, *sb, 7); gy_kv_seq_reserve(kv, *sa, 30); gy_kv_seq_reserve(kv, *sb, 20);
}
typedef struct { const gy_model *m; gy_kv_cache *kv; gy_tp_group tp; gy_forward_ws ws; float *logits; int64_t nsteps; step *steps; gy_status st; } runner;
static void *run(void *p) {
    runner *r = p;
    int64_t sa, sb; seqs_for(r->kv, &sa, &sb);
    int32_t indptr[3]; int32_t idx[64];
    int64_t na = gy_kv_seq_n_blocks(r->kv, sa), nb = gy_kv_seq_n_blocks(r->kv, sb);
    indptr[0] = 0; indptr[1] = (int32_t)na; indptr[2] = (int32_t)(na + nb);
    memcpy(idx, gy_kv_seq_blocks(r->kv, sa), na * 4); memcpy(idx + na, gy_kv_seq_blocks(r->kv, sb), nb * 4);
    int64_t off = 0;
    for (int64_t k = 0; k < r->nsteps; k++) {
        step *s = &r->steps[k];
        gy_forward_batch b = {.tokens = s->tok, .paged = {.n_tokens = s->n, .token_seq = s->seq, .token_pos = s->pos, .n_seqs = 2, .bt_indptr = indptr, .bt_indices = idx},
                              .n_logits = r->tp.rank == 0 ? s->nl : 0, .logit_rows = s->rows};
        r->st = gy_forward(r->tp.rank == 0 ? r->logits + off * V : NULL, r->m, &r->tp, r->kv, &b, &r->ws, NULL);
        if (r->st != GY_OK) { printf("forward failed at step %lld: %s\n", (long long)k, gy_error_message()); return NULL; }
        off += s->nl;
    }
    return NULL;
}
static double compare(const float *a, const float *b, int64_t n) {
    double err = 0, mx = 0;
    for (int64_t i = 0; i < n; i++) { if (!isfinite(b[i])) return INFINITY; err = fmax(err, fabs((double)a[i] - b[i])); mx = fmax(mx, fabs((double)a[i])); }
    return err / mx;
}
static double kv_compare(gy_kv_cache *ref, gy_kv_cache *got, int64_t elem) {
    /* both caches reserved identically: same block tables; compare every written value */
    double err = 0, mx = 0;
    const gy_kv_layout *Lr = gy_kv_layout_of(ref), *Lg = gy_kv_layout_of(got);
    int64_t lens[2] = {27, 14}; /* the tokens plan() writes */
    for (int64_t l = 0; l < L; l++) { float *br = gy_kv_layer_ptr(ref, l); void *bg = gy_kv_layer_ptr(got, l);
        for (int64_t s = 0; s < 2; s++) for (int64_t p = 0; p < lens[s]; p++) {
            int64_t blr = gy_kv_seq_blocks(ref, s)[p / Lr->block_size], blg = gy_kv_seq_blocks(got, s)[p / Lg->block_size];
            for (int kv = 0; kv < 2; kv++) for (int64_t h = 0; h < Lr->n_heads; h++) for (int64_t d = 0; d < D; d++) {
                float x = br[gy_kv_layout_offset(Lr, kv, blr, p % Lr->block_size, h) + d];
                int64_t o = gy_kv_layout_offset(Lg, kv, blg, p % Lg->block_size, h) + d;
                float y = elem == 4 ? ((float *)bg)[o] : gy_bf16_to_f32(((uint16_t *)bg)[o]);
                err = fmax(err, fabs(x - y)); mx = fmax(mx, fabs(x)); } } }
    return err / mx;
}

static void free_weights(gy_model *m) {
    free((void *)m->embed); free((void *)m->lm_head); free((void *)m->final_norm);
    for (int l = 0; l < L; l++) { gy_layer_weights *w = &m->layers[l];
        free((void *)w->attn_norm); free((void *)w->ffn_norm); free((void *)w->wq); free((void *)w->wk); free((void *)w->wv); free((void *)w->wo_t);
        free((void *)w->bq); free((void *)w->bk); free((void *)w->bv);
        for (int s = 0; s < MAX_TP; s++) { free((void *)w->gate[s]); free((void *)w->up[s]); free((void *)w->down_t[s]); } }
    gy_model_free(m);
}

enum { COMM_SHM, COMM_D2D, COMM_D2D_OWN_STREAMS };

/* comm: COMM_SHM joins the ranks over host memory (the "device" buffers are host memory here);
 * COMM_D2D over the d2d communicator with each rank's collectives on its model's stream, as an
 * engine sets it up; COMM_D2D_OWN_STREAMS leaves them on the communicator's own streams, which a
 * GPU would not order after the kernels (the emulation counts it, and the case expects it). */
static void one_case(gy_dtype dt, int bias, gy_kv_layout_kind kind, int64_t bs, int tp_size, double tol,
                     int comm_kind) {
    step steps[16]; int64_t ns = plan(steps), nl = 0; for (int64_t k = 0; k < ns; k++) nl += steps[k].nl;
    gy_model cpu; build(&cpu, dt, bias);
    gy_model dev[MAX_TP];
    for (int r = 0; r < tp_size; r++) {
        dev[r] = cpu; dev[r].stream = NULL; dev[r].backend = GY_MODEL_BACKEND_CPU;
        EXPECT(gy_forward_cuda_attach(&dev[r], 0) == GY_OK);
    }
    float *ref = calloc(nl * V, 4), *got = calloc(nl * V, 4);
    gy_arena *ar; gy_kv_cache *kr; kv_make(&ar, &kr, NKV, 4, GY_KV_LAYOUT_PAGE, 4);
    runner rr = {.m = &cpu, .kv = kr, .tp = {.rank = 0, .size = 1}, .logits = ref, .nsteps = ns, .steps = steps};
    run(&rr); EXPECT(rr.st == GY_OK);
    int64_t elem = dt == GY_DTYPE_F32 ? 4 : 2;
    gy_arena *ag[MAX_TP]; gy_kv_cache *kg[MAX_TP]; runner rg[MAX_TP]; pthread_t th[MAX_TP];
    gy_comm *comm = NULL; gy_comm_rank cr[MAX_TP];
    if (tp_size > 1) {
        const gy_comm_config cc = {.backend = comm_kind == COMM_SHM ? GY_COMM_BACKEND_SHM : GY_COMM_BACKEND_D2D,
                                   .size = tp_size};
        EXPECT(gy_comm_init_config(&comm, &cc) == GY_OK);
        for (int r = 0; r < tp_size && comm_kind == COMM_D2D; r++)
            EXPECT(gy_comm_set_stream(comm, r, dev[r].stream) == GY_OK);
    }
    gy_emu_decode_calls = gy_emu_prefill_calls = 0;
    gy_emu_stream_mismatches = 0;
    for (int r = 0; r < tp_size; r++) {
        kv_make(&ag[r], &kg[r], NKV / tp_size, elem, kind, bs);
        cr[r] = (gy_comm_rank){.comm = comm, .rank = r};
        rg[r] = (runner){.m = &dev[r], .kv = kg[r], .tp = {.rank = r, .size = tp_size, .all_reduce = tp_size > 1 ? gy_comm_rank_all_reduce : NULL, .ctx = &cr[r], .device_buffers = 1}, .logits = got, .nsteps = ns, .steps = steps};
        pthread_create(&th[r], NULL, run, &rg[r]);
    }
    for (int r = 0; r < tp_size; r++) { pthread_join(th[r], NULL); EXPECT(rg[r].st == GY_OK); }
    double e = compare(ref, got, nl * V);
    /* TP ranks hold some of the heads each: their caches are compared through the logits only. */
    double ke = tp_size == 1 ? kv_compare(kr, kg[0], elem) : 0;
    static const char *const comm_names[] = {"shm", "d2d", "d2d on its own streams"};
    printf("dtype=%d bias=%d layout=%d bs=%lld tp=%d%s%s: logits rel err %.3g, kv rel err %s%.3g (decode calls %d, prefill %d, off-stream collectives %ld)\n",
           dt, bias, kind, (long long)bs, tp_size, tp_size > 1 ? " over " : "", tp_size > 1 ? comm_names[comm_kind] : "",
           e, tp_size == 1 ? "" : "(not compared) ", ke, gy_emu_decode_calls, gy_emu_prefill_calls, gy_emu_stream_mismatches);
    EXPECT(e < tol); EXPECT(ke < tol);
    EXPECT(gy_emu_decode_calls > 0 && gy_emu_prefill_calls > 0);
    if (comm_kind == COMM_D2D) EXPECT(gy_emu_stream_mismatches == 0);
    if (comm_kind == COMM_D2D_OWN_STREAMS) EXPECT(gy_emu_stream_mismatches > 0);
    for (int r = 0; r < tp_size; r++) { gy_forward_ws_free(&rg[r].ws); gy_kv_free(kg[r]); gy_arena_free(ag[r]); }
    gy_forward_ws_free(&rr.ws); gy_kv_free(kr); gy_arena_free(ar);
    if (comm) gy_comm_free(comm);
    for (int r = 0; r < tp_size; r++) gy_forward_cuda_detach(&dev[r]);
    free(ref); free(got); free_weights(&cpu);
}

/* ---- the serving loop on emulated CUDA ranks ---- */

typedef struct { gy_arena *arena[MAX_TP]; gy_kv_cache *kv[MAX_TP]; gy_engine_rank ranks[MAX_TP]; } engine_ranks;

static void ranks_make(engine_ranks *er, gy_model *models, int n, int64_t elem) {
    for (int r = 0; r < n; r++) {
        kv_make(&er->arena[r], &er->kv[r], NKV / n, elem, GY_KV_LAYOUT_HEAD, 4);
        er->ranks[r] = (gy_engine_rank){.model = &models[r], .kv = er->kv[r]};
    }
}

static void ranks_free(engine_ranks *er, int n) {
    for (int r = 0; r < n; r++) { gy_kv_free(er->kv[r]); gy_arena_free(er->arena[r]); }
}

/* Greedy tokens of three requests (prefill chunks mixed with decodes: max_batch_tokens 16). */
static void generate(gy_engine *e, int32_t out[3][6]) {
    const int32_t *prompts[3] = {toksA, toksB, toksA + 7};
    const int64_t lens[3] = {23, 9, 14};
    const gy_engine_params p = {.sampler = {.temperature = 0.0, .top_p = 1.0}, .max_new_tokens = 6};
    for (int i = 0; i < 3; i++) EXPECT(gy_engine_add(e, i, prompts[i], lens[i], &p, 0.0) == GY_OK);
    int64_t n[3] = {0, 0, 0};
    for (int k = 0; k < 64 && (n[0] < 6 || n[1] < 6 || n[2] < 6); k++) {
        gy_engine_step_out o;
        if (gy_engine_step(e, 0.0, &o) != GY_OK) { EXPECT(0); return; }
        for (int64_t t = 0; t < o.n_tokens; t++)
            if (n[o.token_ids[t]] < 6) out[o.token_ids[t]][n[o.token_ids[t]]++] = o.tokens[t];
    }
    EXPECT(n[0] == 6 && n[1] == 6 && n[2] == 6);
}

static void engine_cases(void) {
    gy_model cpu; build(&cpu, GY_DTYPE_F32, 1);
    const gy_engine_config cfg = {.max_batch_tokens = 16, .max_running = 8};
    int32_t want[3][6], got[3][6];
    engine_ranks one; ranks_make(&one, &cpu, 1, 4);
    gy_engine *e = NULL;
    EXPECT(gy_engine_init(&e, one.ranks, 1, NULL, &cfg) == GY_OK);
    generate(e, want);
    gy_engine_free(e);
    ranks_free(&one, 1);
    for (int tp = 2; tp <= MAX_TP; tp *= 2) {
        gy_model dev[MAX_TP];
        for (int r = 0; r < tp; r++) {
            dev[r] = cpu; dev[r].stream = NULL; dev[r].backend = GY_MODEL_BACKEND_CPU;
            EXPECT(gy_forward_cuda_attach(&dev[r], 0) == GY_OK);
        }
        gy_comm *d2d = NULL, *shm = NULL;
        const gy_comm_config cc = {.backend = GY_COMM_BACKEND_D2D, .size = tp};
        EXPECT(gy_comm_init_config(&d2d, &cc) == GY_OK);
        EXPECT(gy_comm_init(&shm, tp) == GY_OK);
        engine_ranks er; ranks_make(&er, dev, tp, 4);
        gy_emu_stream_mismatches = 0;
        EXPECT(gy_engine_init(&e, er.ranks, tp, d2d, &cfg) == GY_OK);
        for (int r = 0; r < tp; r++) EXPECT(gy_comm_stream(d2d, r) == (void *)dev[r].stream);
        generate(e, got);
        gy_engine_free(e);
        for (int r = 0; r < tp; r++) EXPECT(gy_comm_stream(d2d, r) == gy_comm_own_stream(d2d, r) && gy_comm_own_stream(d2d, r) != NULL);
        EXPECT(memcmp(want, got, sizeof want) == 0);
        EXPECT(gy_emu_stream_mismatches == 0);
        printf("engine: TP%d of emulated CUDA ranks over d2d: greedy tokens %s the CPU engine's, off-stream collectives %ld\n",
               tp, memcmp(want, got, sizeof want) == 0 ? "equal" : "DIFFER from", gy_emu_stream_mismatches);

        /* Pairings that cannot work are refused with the reason, and nothing is borrowed. */
        EXPECT(gy_engine_init(&e, er.ranks, tp, shm, &cfg) == GY_ERR_INVALID);
        EXPECT(strstr(gy_error_message(), "needs a device communicator") != NULL);
        gy_model cpus[MAX_TP];
        for (int r = 0; r < tp; r++) cpus[r] = cpu;
        engine_ranks host; ranks_make(&host, cpus, tp, 4);
        EXPECT(gy_engine_init(&e, host.ranks, tp, d2d, &cfg) == GY_ERR_INVALID);
        EXPECT(strstr(gy_error_message(), "CPU ranks need shm") != NULL);
        ranks_free(&host, tp);
        dev[tp - 1].device = 1;
        EXPECT(gy_engine_init(&e, er.ranks, tp, d2d, &cfg) == GY_ERR_INVALID);
        EXPECT(strstr(gy_error_message(), "on CUDA device 1 but the d2d communicator") != NULL);
        dev[tp - 1].device = 0;
        void *stream = dev[0].stream;
        dev[0].stream = NULL;
        EXPECT(gy_engine_init(&e, er.ranks, tp, d2d, &cfg) == GY_ERR_STATE);
        EXPECT(strstr(gy_error_message(), "not attached") != NULL);
        dev[0].stream = stream;
        for (int r = 0; r < tp; r++) EXPECT(gy_comm_stream(d2d, r) == gy_comm_own_stream(d2d, r));
        ranks_free(&er, tp);
        gy_comm_free(d2d);
        gy_comm_free(shm);
        for (int r = 0; r < tp; r++) gy_forward_cuda_detach(&dev[r]);
    }
    free_weights(&cpu);
}

/* A move on the host backend, or on the device backend registered in its place. */
static gy_status kv_move_on(int device, const gy_kv_move *move, gy_kv_move_stats *st) {
    if (device && gy_kv_move_set_backend(GY_KV_MOVE_BACKEND_HOST, &gy_kv_move_device_backend) != GY_OK) abort();
    const gy_status s = gy_kv_move_run(move, NULL, st);
    if (gy_kv_move_set_backend(GY_KV_MOVE_BACKEND_HOST, NULL) != GY_OK) abort();
    return s;
}

static int kv_layers_equal(gy_kv_cache *a, gy_kv_cache *b) {
    int same = 1;
    for (int l = 0; l < L; l++)
        same &= memcmp(gy_kv_layer_ptr(a, l), gy_kv_layer_ptr(b, l),
                       (size_t)gy_kv_layout_layer_elems(gy_kv_layout_of(a)) * 4) == 0;
    return same;
}

/* The device backend against the host backend: the same bytes, every layout; items between the
 * same caches and heads go in one launch, others in their own; with a bitmap each block holding a
 * dirty slot goes whole (the host's move of those blocks). */
static void kv_move_case(gy_kv_layout_kind kind) {
    gy_arena *a[3]; gy_kv_cache *src, *d1, *d2;
    kv_make(&a[0], &src, 4, 4, kind, 4);
    kv_make(&a[1], &d1, 2, 4, kind, 4);
    kv_make(&a[2], &d2, 2, 4, kind, 4);
    for (int l = 0; l < L; l++) {
        float *p = gy_kv_layer_ptr(src, l), *q = gy_kv_layer_ptr(d1, l);
        const int64_t ns = gy_kv_layout_layer_elems(gy_kv_layout_of(src)), nd = gy_kv_layout_layer_elems(gy_kv_layout_of(d1));
        for (int64_t i = 0; i < ns; i++) p[i] = rnd01();
        for (int64_t i = 0; i < nd; i++) q[i] = rnd01();
        memcpy(gy_kv_layer_ptr(d2, l), q, (size_t)nd * 4);
    }
    const int32_t sb[5] = {3, 0, 13, 9, 15}, db[5] = {1, 20, 4, 0, 12}; /* of 16 and 32 blocks */
    gy_kv_move_item items[3] = {
        {.src = src, .dst = d1, .src_blocks = sb, .dst_blocks = db, .n_blocks = 3, .src_head = 2, .dst_head = 1, .n_heads = 1, .n_tokens = -1},
        {.src = src, .dst = d1, .src_blocks = sb + 3, .dst_blocks = db + 3, .n_blocks = 2, .src_head = 2, .dst_head = 1, .n_heads = 1, .n_tokens = -1},
        {.src = src, .dst = d1, .src_blocks = sb, .dst_blocks = db + 2, .n_blocks = 1, .src_head = 0, .dst_head = 0, .n_heads = 1, .n_tokens = -1},
    };
    gy_kv_move move = {.items = items, .n_items = 3, .first_layer = 1, .end_layer = L};
    gy_kv_move_stats hs, ds;
    EXPECT(kv_move_on(0, &move, &hs) == GY_OK);
    for (int i = 0; i < 3; i++) items[i].dst = d2;
    items[1].n_tokens = 6; /* the device copies the partly used last block whole anyway */
    EXPECT(kv_move_on(1, &move, &ds) == GY_OK);
    const int same = kv_layers_equal(d1, d2);
    int changed = 0;
    for (int l = 1; l < L; l++)
        changed |= ((float *)gy_kv_layer_ptr(d1, l))[gy_kv_layout_offset(gy_kv_layout_of(d1), 1, 12, 3, 1)] ==
                   ((float *)gy_kv_layer_ptr(src, l))[gy_kv_layout_offset(gy_kv_layout_of(src), 1, 15, 3, 2)];
    EXPECT(same); EXPECT(changed);
    EXPECT(ds.backend == GY_KV_MOVE_BACKEND_HOST && ds.slots == hs.slots - 2);
    /* a bitmap: the device copies the blocks that hold a dirty slot, whole */
    uint64_t dirty[2] = {0, 0};
    dirty[(9 * 4 + 1) / 64] |= (uint64_t)1 << ((9 * 4 + 1) % 64); /* source block 9, token 1 */
    dirty[(0 * 4 + 3) / 64] |= (uint64_t)1 << 3;                  /* source block 0, token 3 */
    const gy_kv_move_item all = {.src = src, .dst = d2, .src_blocks = sb, .dst_blocks = db, .n_blocks = 5,
                                 .src_head = 0, .dst_head = 0, .n_heads = 2, .n_tokens = -1};
    const gy_kv_move patch = {.items = &all, .n_items = 1, .first_layer = 0, .end_layer = L, .dirty = dirty, .dirty_slots = 128};
    EXPECT(kv_move_on(1, &patch, &ds) == GY_OK && ds.slots == 2);
    const int32_t hb[2] = {0, 9}, hd[2] = {20, 0};
    const gy_kv_move_item whole = {.src = src, .dst = d1, .src_blocks = hb, .dst_blocks = hd, .n_blocks = 2,
                                   .src_head = 0, .dst_head = 0, .n_heads = 2, .n_tokens = -1};
    const gy_kv_move blocks = {.items = &whole, .n_items = 1, .first_layer = 0, .end_layer = L};
    EXPECT(kv_move_on(0, &blocks, NULL) == GY_OK);
    const int patched = kv_layers_equal(d1, d2);
    EXPECT(patched);
    const int32_t bad[5] = {3, 0, 13, 9, 999};
    items[0].src_blocks = bad;
    items[0].n_blocks = 5;
    items[0].dst_blocks = db;
    EXPECT(kv_move_on(1, &move, NULL) == GY_ERR_INVALID);
    EXPECT(kv_layers_equal(d1, d2));
    printf("kv_move layout=%d: the device backend %s the host backend\n", kind,
           same && patched ? "matches" : "DIFFERS from");
    for (int i = 0; i < 3; i++) gy_kv_free(i == 0 ? src : i == 1 ? d1 : d2), gy_arena_free(a[i]);
}

int main(void) {
    for (int kind = 0; kind < 3; kind++) one_case(GY_DTYPE_F32, 0, kind, kind == 1 ? 8 : 4, 1, 1e-5, COMM_SHM);
    one_case(GY_DTYPE_F32, 1, GY_KV_LAYOUT_HEAD, 4, 1, 1e-5, COMM_SHM);
    one_case(GY_DTYPE_F32, 0, GY_KV_LAYOUT_HEAD, 4, 2, 1e-5, COMM_SHM);
    one_case(GY_DTYPE_F32, 1, GY_KV_LAYOUT_RAW, 16, 2, 1e-5, COMM_SHM);
    one_case(GY_DTYPE_F32, 1, GY_KV_LAYOUT_HEAD, 4, 2, 1e-5, COMM_D2D);
    one_case(GY_DTYPE_F32, 0, GY_KV_LAYOUT_PAGE, 8, 4, 1e-5, COMM_D2D);
    one_case(GY_DTYPE_F32, 0, GY_KV_LAYOUT_HEAD, 4, 4, 1e-5, COMM_D2D_OWN_STREAMS);
    one_case(GY_DTYPE_BF16, 0, GY_KV_LAYOUT_HEAD, 4, 1, 5e-2, COMM_SHM);
    one_case(GY_DTYPE_BF16, 1, GY_KV_LAYOUT_PAGE, 4, 2, 5e-2, COMM_SHM);
    one_case(GY_DTYPE_BF16, 1, GY_KV_LAYOUT_HEAD, 4, 4, 5e-2, COMM_D2D);
    engine_cases();
    for (int kind = 0; kind < 3; kind++) kv_move_case(kind);
    printf("live emulated allocations at exit: %ld\n", gy_emu_live_allocations());
    EXPECT(gy_emu_live_allocations() == 0);
    printf("%s (%d failures)\n", failures ? "FAILED" : "OK", failures);
    return failures != 0;
}
