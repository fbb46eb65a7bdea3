/* test_cpu_kernels.c: the CPU kernels against plain loops in double, and their determinism
 * promises (rows independent of batch and threads, the k-split tree, layouts and chunking), with
 * poisoned outputs and guard words after every output to catch missed or stray writes.
 *
 * Tolerance policy: fp32 results are compared with |got - ref| <= 1e-5 * sum|terms| + 1e-30 (the
 * forward error bound of a length-n fp32 sum is about n * 2^-24 * sum|terms|; 1e-5 allows n up to
 * ~160 with no cancellation luck needed, and our reductions are trees over 16 lanes, far better);
 * promised bit-exactness is checked with memcmp. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/activation.h"
#include "cpu/argmax.h"
#include "cpu/attention.h"
#include "cpu/dot.h"
#include "core/dtype.h"
#include "cpu/embedding.h"
#include "cpu/isa.h"
#include "cpu/kv_write.h"
#include "cpu/linear.h"
#include "cpu/norm.h"
#include "cpu/peak.h"
#include "cpu/rope.h"
#include "cpu/stream.h"
#include "cpu/threadpool.h"
#include "cpu/vexp.h"
#include "gytest.h"

/* ---- helpers --------------------------------------------------------------------------------- */

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static void rng_seed(uint64_t s) { rng_state = s * 0x9e3779b97f4a7c15ull + 1; }
static uint32_t rng_u32(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 16);
}
static float rng_uniform(void) { return (float)((rng_u32() & 0xffffff) / 16777216.0 * 2.0 - 1.0); }
static void fill_uniform(float *p, int64_t n) {
    for (int64_t i = 0; i < n; i++) p[i] = rng_uniform();
}

#define GUARD 16
static const uint32_t guard_word = 0xdeadbeefu;

/* n floats preceded by nothing and followed by GUARD guard words; filled with NaN (poison). */
static float *alloc_poisoned(int64_t n) {
    float *p = malloc((size_t)(n + GUARD) * sizeof(float));
    for (int64_t i = 0; i < n; i++) p[i] = NAN;
    for (int i = 0; i < GUARD; i++) memcpy(p + n + i, &guard_word, 4);
    return p;
}
static int guard_ok(const float *p, int64_t n) {
    for (int i = 0; i < GUARD; i++)
        if (memcmp(p + n + i, &guard_word, 4) != 0) return 0;
    return 1;
}
static int all_finite(const float *p, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(p[i])) return 0;
    return 1;
}

/* Weights stored as dtype, and their exact fp32 values (what the reference multiplies). */
static void *make_weights(gy_dtype dt, int64_t n, float *exact) {
    fill_uniform(exact, n);
    void *w = malloc((size_t)n * (size_t)gy_dtype_size(dt));
    gy_dtype_from_f32(w, dt, exact, n);
    gy_dtype_to_f32(exact, w, dt, n);
    return w;
}

static gy_threadpool *pools[5]; /* pools[t] has t threads; pools[1] is NULL (inline) */
static gy_threadpool *pool_of(int threads) {
    if (threads <= 1) return NULL;
    if (pools[threads] == NULL) gy_threadpool_init(&pools[threads], threads);
    return pools[threads];
}
__attribute__((destructor)) static void free_pools(void) {
    for (int i = 0; i < 5; i++) gy_threadpool_free(pools[i]);
}

/* ---- dtype ----------------------------------------------------------------------------------- */

GYTEST(cpu_dtype_f16_roundtrip_all_values) {
    int bad = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        const float f = gy_f16_to_f32((uint16_t)h);
        if (isnan(f)) continue;
        if (gy_f32_to_f16(f) != h) bad++;
    }
    CHECK(bad == 0);
    CHECK(gy_f16_to_f32(0x3c00) == 1.0f);
    CHECK(gy_f16_to_f32(0x0001) == ldexpf(1.0f, -24));
    CHECK(gy_f32_to_f16(65520.0f) == 0x7c00);         /* rounds to inf */
    CHECK(gy_f32_to_f16(65519.0f) == 0x7bff);
    CHECK(gy_f32_to_f16(ldexpf(1.0f, -25)) == 0);     /* tie to even: zero */
    CHECK(gy_f32_to_f16(ldexpf(1.5f, -25)) == 1);
    CHECK(isnan(gy_f16_to_f32(gy_f32_to_f16(NAN))));
}

GYTEST(cpu_dtype_bf16_rounding) {
    CHECK(gy_f32_to_bf16(1.0f) == 0x3f80);
    float f;
    uint32_t bits = 0x3f808000u; /* halfway between 0x3f80 and 0x3f81: ties to even */
    memcpy(&f, &bits, 4);
    CHECK(gy_f32_to_bf16(f) == 0x3f80);
    bits = 0x3f818000u;
    memcpy(&f, &bits, 4);
    CHECK(gy_f32_to_bf16(f) == 0x3f82);
    CHECK(isnan(gy_bf16_to_f32(gy_f32_to_bf16(NAN))));
    CHECK_STATUS(gy_dtype_to_f32(&f, &bits, (gy_dtype)7, 1), GY_ERR_INVALID);
}

/* ---- threadpool ------------------------------------------------------------------------------ */

typedef struct {
    int *hits;
    gy_threadpool *nested;
} count_ctx;
static void count_task(void *ctx, int64_t i, int64_t n) { __atomic_add_fetch(&((count_ctx *)ctx)->hits[i], 1, __ATOMIC_RELAXED); }
static void inner_task(void *ctx, int64_t i, int64_t n) { ((int *)ctx)[i] += 1; }
static void nesting_task(void *ctx, int64_t i, int64_t n) {
    count_ctx *c = (count_ctx *)ctx;
    int inner[3] = {0, 0, 0};
    gy_threadpool_run(c->nested, inner_task, inner, 3); /* runs inline */
    if (inner[0] == 1 && inner[1] == 1 && inner[2] == 1) __atomic_add_fetch(&c->hits[i], 1, __ATOMIC_RELAXED);
}

GYTEST(cpu_threadpool_runs_every_task_once) {
    for (int threads = 1; threads <= 4; threads++) {
        gy_threadpool *pool = NULL;
        CHECK_OK(gy_threadpool_init(&pool, threads));
        CHECK(gy_threadpool_size(pool) == threads);
        if (threads == 3) gy_threadpool_set_spin_us(pool, 0); /* exercise the sleeping path */
        for (int64_t n = 0; n <= 37; n += (n < 5 ? 1 : 8)) {
            for (int rep = 0; rep < 50; rep++) {
                int hits[64] = {0};
                count_ctx c = {hits, NULL};
                CHECK_OK(gy_threadpool_run(pool, count_task, &c, n));
                int ok = 1;
                for (int64_t i = 0; i < n; i++) ok &= hits[i] == 1;
                CHECK(ok);
            }
        }
        int hits[8] = {0};
        count_ctx c = {hits, pool};
        CHECK_OK(gy_threadpool_run(pool, nesting_task, &c, 8));
        for (int i = 0; i < 8; i++) CHECK(hits[i] == 1);
        CHECK_STATUS(gy_threadpool_run(pool, NULL, NULL, 3), GY_ERR_INVALID);
        gy_threadpool_free(pool);
    }
    gy_threadpool *pool = NULL;
    CHECK_STATUS(gy_threadpool_init(&pool, GY_THREADPOOL_MAX_THREADS + 1), GY_ERR_INVALID);
    CHECK(pool == NULL);
    CHECK_OK(gy_threadpool_init(&pool, 0));
    CHECK(gy_threadpool_size(pool) == GY_THREADPOOL_DEFAULT_THREADS);
    gy_threadpool_free(pool);
    gy_threadpool_free(NULL);
}

GYTEST(cpu_stream_read_sums_everything) {
    float x[1000], sum = 0.0f;
    for (int i = 0; i < 1000; i++) x[i] = (float)(i % 7);
    for (int threads = 1; threads <= 3; threads++) {
        CHECK_OK(gy_cpu_stream_read(&sum, x, 1000, pool_of(threads)));
        CHECK(sum == 2997.0f); /* small integers: exact in any order */
    }
    CHECK_STATUS(gy_cpu_stream_read(NULL, x, 10, NULL), GY_ERR_INVALID);
}

/* ---- dot and exp ----------------------------------------------------------------------------- */

GYTEST(cpu_dot_tile_matches_reference_pairs) {
    rng_seed(1);
    const int64_t lens[] = {1, 7, 16, 17, 48, 100};
    for (int li = 0; li < 6; li++)
        for (int dt = 0; dt < GY_DTYPE_COUNT; dt++)
            for (int R = 4; R <= 16; R *= 2) {
                const int64_t len = lens[li];
                float *wf = malloc(16 * len * sizeof(float)), *x = malloc(16 * len * sizeof(float));
                void *w = make_weights((gy_dtype)dt, 16 * len, wf);
                fill_uniform(x, 16 * len);
                const void *wp[16];
                const float *xp[16];
                for (int r = 0; r < 16; r++) {
                    wp[r] = (const char *)w + r * len * gy_dtype_size((gy_dtype)dt);
                    xp[r] = x + r * len;
                }
                float out[16];
                gy_dot_tile16(out, wp, (gy_dtype)dt, R, xp, len);
                int same = 1;
                for (int r = 0; r < R; r++)
                    for (int b = 0; b < 16 / R; b++) {
                        const float ref = gy_dot_ref(wp[r], (gy_dtype)dt, xp[b], len);
                        same &= memcmp(&ref, &out[r * (16 / R) + b], 4) == 0;
                    }
                CHECK(same);
                free(w);
                free(wf);
                free(x);
            }
}

GYTEST(cpu_exp_accuracy_and_specials) {
    double worst = 0;
    for (float x = -103.0f; x < 88.7f; x += 0.01234f) {
        const double ref = exp((double)x);
        const double got = gy_exp_ref(x);
        if (ref > 1.2e-38) { /* normal range: relative error in ulps */
            const double err = fabs(got - ref) / ref;
            if (err > worst) worst = err;
        } else {
            CHECK(fabs(got - ref) <= ldexp(1.0, -149));
        }
    }
    CHECK(worst < 4e-7); /* a few ulps */
    CHECK(gy_exp_ref(0.0f) == 1.0f);
    CHECK(isinf(gy_exp_ref(89.0f)) && isinf(gy_exp_ref(INFINITY)));
    CHECK(gy_exp_ref(-105.0f) == 0.0f && gy_exp_ref(-INFINITY) == 0.0f);
    CHECK(isnan(gy_exp_ref(NAN)));
    float in[37], out[37];
    for (int i = 0; i < 37; i++) in[i] = (float)(i - 18) * 3.7f;
    CHECK_OK(gy_cpu_exp(out, in, 37));
    for (int i = 0; i < 37; i++) CHECK(out[i] == gy_exp_ref(in[i]));
}

GYTEST(cpu_isa_switch) {
    const gy_cpu_isa best = gy_cpu_isa_best();
    CHECK(gy_cpu_isa_get() == best);
    CHECK_OK(gy_cpu_isa_set(GY_CPU_ISA_PORTABLE));
    CHECK(gy_cpu_isa_get() == GY_CPU_ISA_PORTABLE);
    CHECK_STATUS(gy_cpu_isa_set(GY_CPU_ISA_AVX512),
                 GY_CPU_HAVE_AVX512 ? GY_OK : GY_ERR_UNAVAILABLE);
    CHECK_STATUS(gy_cpu_isa_set((gy_cpu_isa)9), GY_ERR_INVALID);
    CHECK_OK(gy_cpu_isa_set(best));
}

/* ---- linear ---------------------------------------------------------------------------------- */

typedef gy_status (*linear_fn)(float *, const float *, const void *, gy_dtype, const float *,
                               int64_t, int64_t, int64_t, int32_t, gy_threadpool *);

/* Reference in double; transposed: w is [in, out]. Returns max violation of the tolerance. */
static int linear_close(const float *y, const float *x, const float *wf, const float *bias,
                        int64_t n, int64_t in, int64_t out, int transposed) {
    for (int64_t r = 0; r < n; r++)
        for (int64_t o = 0; o < out; o++) {
            double acc = bias ? bias[o] : 0.0, mag = bias ? fabs(bias[o]) : 0.0;
            for (int64_t i = 0; i < in; i++) {
                const double w = transposed ? wf[i * out + o] : wf[o * in + i];
                acc += (double)x[r * in + i] * w;
                mag += fabs((double)x[r * in + i] * w);
            }
            if (!(fabs(y[r * out + o] - acc) <= 1e-5 * mag + 1e-30)) return 0;
        }
    return 1;
}

static void check_linear_form(linear_fn fn, int transposed) {
    rng_seed(2 + transposed);
    /* {in, out}; out = 2100 gives batch-1 linear_t column ranges wider than one register tile
     * (accumulated in memory) and wider than one such strip. */
    const int64_t shapes[][2] = {{1, 1}, {17, 5}, {33, 47}, {64, 288}, {5, 300}, {130, 96}, {37, 2100}};
    const int64_t ns[] = {1, 2, 3, 4, 5, 9, 33};
    for (int si = 0; si < 7; si++)
        for (int dt = 0; dt < GY_DTYPE_COUNT; dt++) {
            const int64_t in = shapes[si][0], out = shapes[si][1], nmax = 33;
            float *wf = malloc((size_t)(in * out) * sizeof(float));
            void *w = make_weights((gy_dtype)dt, in * out, wf);
            float *x = malloc((size_t)(nmax * in) * sizeof(float)), *bias = malloc((size_t)out * sizeof(float));
            fill_uniform(x, nmax * in);
            fill_uniform(bias, out);
            /* The full batch, single-threaded, is the baseline every other run must reproduce. */
            float *base = alloc_poisoned(nmax * out);
            CHECK_OK(fn(base, x, w, (gy_dtype)dt, bias, nmax, in, out, 1, NULL));
            CHECK(guard_ok(base, nmax * out) && all_finite(base, nmax * out));
            CHECK(linear_close(base, x, wf, bias, nmax, in, out, transposed));
            for (int ni = 0; ni < 7; ni++)
                for (int threads = 1; threads <= 3; threads++) {
                    const int64_t n = ns[ni];
                    const int64_t first = (ni * 5) % (nmax - n + 1); /* a window of other rows */
                    float *y = alloc_poisoned(n * out);
                    CHECK_OK(fn(y, x + first * in, w, (gy_dtype)dt, bias, n, in, out, 1, pool_of(threads)));
                    CHECK(guard_ok(y, n * out));
                    CHECK(memcmp(y, base + first * out, (size_t)(n * out) * sizeof(float)) == 0);
                    free(y);
                }
            free(base);
            free(w);
            free(wf);
            free(x);
            free(bias);
        }
}

GYTEST(cpu_linear_matches_reference_and_rows_are_independent) {
    check_linear_form(gy_cpu_linear, 0);
}

GYTEST(cpu_linear_t_matches_reference_and_rows_are_independent) {
    check_linear_form(gy_cpu_linear_t, 1);
}

/* TP-1 with k_splits = K equals t workers each computing their shard with k_splits = K / t,
 * combined by gy_cpu_add_tree and gy_cpu_add_bias. */
static void check_k_split_tree(linear_fn fn, int transposed) {
    rng_seed(4 + transposed);
    const int64_t in = 8 * 37, out = 29, n = 6;
    for (int dt = 0; dt < GY_DTYPE_COUNT; dt++) {
        float *wf = malloc((size_t)(in * out) * sizeof(float));
        void *w = make_weights((gy_dtype)dt, in * out, wf);
        const int64_t es = gy_dtype_size((gy_dtype)dt);
        float x[6 * 8 * 37], bias[29];
        fill_uniform(x, n * in);
        fill_uniform(bias, out);
        for (int K = 1; K <= 8; K *= 2) {
            float *tp1 = alloc_poisoned(n * out);
            CHECK_OK(fn(tp1, x, w, (gy_dtype)dt, bias, n, in, out, K, pool_of(2)));
            CHECK(guard_ok(tp1, n * out));
            CHECK(linear_close(tp1, x, wf, bias, n, in, out, transposed));
            for (int t = 2; t <= K; t *= 2) {
                const int64_t shard = in / t;
                float *parts[8];
                for (int s = 0; s < t; s++) {
                    /* The worker's own copies of its shard of x and W, contiguous. */
                    float *xs = malloc((size_t)(n * shard) * sizeof(float));
                    char *ws = malloc((size_t)(out * shard * es));
                    for (int64_t r = 0; r < n; r++) memcpy(xs + r * shard, x + r * in + s * shard, (size_t)shard * 4);
                    if (transposed)
                        memcpy(ws, (const char *)w + s * shard * out * es, (size_t)(shard * out * es));
                    else
                        for (int64_t o = 0; o < out; o++)
                            memcpy(ws + o * shard * es, (const char *)w + (o * in + s * shard) * es, (size_t)(shard * es));
                    parts[s] = alloc_poisoned(n * out);
                    CHECK_OK(fn(parts[s], xs, ws, (gy_dtype)dt, NULL, n, shard, out, K / t, pool_of(1 + s % 2)));
                    free(xs);
                    free(ws);
                }
                float *sum = alloc_poisoned(n * out);
                CHECK_OK(gy_cpu_add_tree(sum, (const float *const *)parts, t, n * out));
                CHECK_OK(gy_cpu_add_bias(sum, bias, n, out));
                CHECK(guard_ok(sum, n * out));
                CHECK(memcmp(sum, tp1, (size_t)(n * out) * sizeof(float)) == 0);
                /* In place into part 0 gives the same. */
                CHECK_OK(gy_cpu_add_tree(parts[0], (const float *const *)parts, t, n * out));
                CHECK_OK(gy_cpu_add_bias(parts[0], bias, n, out));
                CHECK(memcmp(parts[0], tp1, (size_t)(n * out) * sizeof(float)) == 0);
                for (int s = 0; s < t; s++) free(parts[s]);
                free(sum);
            }
            free(tp1);
        }
        free(w);
        free(wf);
    }
}

GYTEST(cpu_linear_k_split_tree_is_tensor_parallel_exact) { check_k_split_tree(gy_cpu_linear, 0); }
GYTEST(cpu_linear_t_k_split_tree_is_tensor_parallel_exact) { check_k_split_tree(gy_cpu_linear_t, 1); }

GYTEST(cpu_add_tree_order) {
    /* ((a + b) + (c + d)) differs from ((a + b) + c) + d here: 1e8 + 1 - 1e8 ... */
    const float a[1] = {1e8f}, b[1] = {1.0f}, c[1] = {-1e8f}, d[1] = {1.0f};
    const float *parts[4] = {a, b, c, d};
    float out[1];
    CHECK_OK(gy_cpu_add_tree(out, parts, 4, 1));
    CHECK(out[0] == (1e8f + 1.0f) + (-1e8f + 1.0f));
    /* three parts (core/tree.h): (a + b) + c, the odd last one carried up: 0, not 1 */
    CHECK_OK(gy_cpu_add_tree(out, parts, 3, 1));
    CHECK(out[0] == (1e8f + 1.0f) + -1e8f);
    CHECK_STATUS(gy_cpu_add_tree(out, parts, 0, 1), GY_ERR_INVALID);
}

GYTEST(cpu_linear_rejects_bad_arguments) {
    float x[8] = {0}, y[8], w[64] = {0};
    CHECK_STATUS(gy_cpu_linear(y, x, w, GY_DTYPE_F32, NULL, 1, 6, 2, 4, NULL), GY_ERR_INVALID); /* 6 % 4 */
    CHECK_STATUS(gy_cpu_linear(y, x, w, GY_DTYPE_F32, NULL, 1, 6, 2, 3, NULL), GY_ERR_INVALID); /* not 2^k */
    CHECK_STATUS(gy_cpu_linear(y, x, w, GY_DTYPE_F32, NULL, 1, 128, 2, 128, NULL), GY_ERR_INVALID);
    CHECK_STATUS(gy_cpu_linear(y, x, w, (gy_dtype)5, NULL, 1, 4, 2, 1, NULL), GY_ERR_INVALID);
    CHECK_STATUS(gy_cpu_linear(y, x, w, GY_DTYPE_F32, NULL, -1, 4, 2, 1, NULL), GY_ERR_INVALID);
    CHECK_STATUS(gy_cpu_linear_t(y, x, w, GY_DTYPE_F32, NULL, 1, 0, 2, 1, NULL), GY_ERR_INVALID);
    CHECK_STATUS(gy_cpu_linear_t(NULL, x, w, GY_DTYPE_F32, NULL, 1, 4, 2, 1, NULL), GY_ERR_INVALID);
    CHECK_OK(gy_cpu_linear(NULL, NULL, NULL, GY_DTYPE_F32, NULL, 0, 4, 2, 1, NULL)); /* n = 0 */
}

#if GY_CPU_HAVE_AVX512
GYTEST(cpu_linear_avx512_and_portable_paths_agree) {
    rng_seed(6);
    const int64_t n = 7, in = 77, out = 45;
    for (int dt = 0; dt < GY_DTYPE_COUNT; dt++)
        for (int tr = 0; tr < 2; tr++) {
            linear_fn fn = tr ? gy_cpu_linear_t : gy_cpu_linear;
            float wf[77 * 45], x[7 * 77], y0[7 * 45], y1[7 * 45];
            void *w = make_weights((gy_dtype)dt, in * out, wf);
            fill_uniform(x, n * in);
            CHECK_OK(fn(y0, x, w, (gy_dtype)dt, NULL, n, in, out, 1, NULL));
            CHECK_OK(gy_cpu_isa_set(GY_CPU_ISA_PORTABLE));
            CHECK_OK(fn(y1, x, w, (gy_dtype)dt, NULL, n, in, out, 1, NULL));
            CHECK_OK(gy_cpu_isa_set(GY_CPU_ISA_AVX512));
            CHECK(memcmp(y0, y1, sizeof y0) == 0);
            free(w);
        }
}
#endif

/* The definitions, written here from the headers: linear.h's chunk tree over dot.h's dot product
 * (gy_dot_ref) for W [out, in], and the sequential chain per chunk for W [in, out]. */
static float def_linear(const void *w, gy_dtype dt, const float *x, int64_t in, int64_t out,
                        int64_t o, int k_splits, const float *bias, int transposed) {
    const int64_t L = in / k_splits, es = gy_dtype_size(dt);
    float parts[64];
    for (int c = 0; c < k_splits; c++) {
        if (!transposed) {
            parts[c] = gy_dot_ref((const char *)w + (o * in + c * L) * es, dt, x + c * L, L);
            continue;
        }
        float acc = 0.0f, wf;
        for (int64_t i = c * L; i < (c + 1) * L; i++) {
            gy_dtype_to_f32(&wf, (const char *)w + (i * out + o) * es, dt, 1);
            acc = fmaf(x[i], wf, acc);
        }
        parts[c] = acc;
    }
    for (int width = k_splits; width > 1; width /= 2)
        for (int p = 0; p < width / 2; p++) parts[p] = parts[2 * p] + parts[2 * p + 1];
    return bias ? parts[0] + bias[o] : parts[0];
}

/* Every batch size 1..40 (the batched paths: packed groups of 3 rows against 8-row tiles of W,
 * register tiles of 4 rows over strips of W [in, out]), 1-3 threads, odd sizes that leave partial
 * lane blocks, tiles and groups: each output has the bits of the definition. */
static void check_batches_match_definition(linear_fn fn, int transposed) {
    rng_seed(40 + transposed);
    const int64_t shapes[][2] = {{1, 3}, {17, 9}, {33, 17}, {64, 8}, {77, 45}, {290, 13}}; /* in, out */
    enum { NMAX = 40 };
    for (int si = 0; si < 6; si++)
        for (int dt = 0; dt < GY_DTYPE_COUNT; dt++)
            for (int ks = 1; ks <= 2; ks++) {
                const int64_t in = shapes[si][0], out = shapes[si][1];
                if (in % ks != 0) continue;
                float *wf = malloc((size_t)(in * out) * sizeof(float));
                void *w = make_weights((gy_dtype)dt, in * out, wf);
                float *x = malloc((size_t)(NMAX * in) * sizeof(float)), *bias = malloc((size_t)out * sizeof(float));
                fill_uniform(x, NMAX * in);
                fill_uniform(bias, out);
                float *want = malloc((size_t)(NMAX * out) * sizeof(float));
                for (int64_t r = 0; r < NMAX; r++)
                    for (int64_t o = 0; o < out; o++)
                        want[r * out + o] = def_linear(w, (gy_dtype)dt, x + r * in, in, out, o, ks, bias, transposed);
                for (int isa = 0; isa <= (int)gy_cpu_isa_best(); isa++) {
                    CHECK_OK(gy_cpu_isa_set((gy_cpu_isa)isa));
                    int same = 1;
                    for (int64_t n = 1; n <= NMAX; n++) {
                        const int64_t first = (n * 3) % (NMAX - n + 1);
                        float *y = alloc_poisoned(n * out);
                        CHECK_OK(fn(y, x + first * in, w, (gy_dtype)dt, bias, n, in, out, ks,
                                    pool_of(1 + (int)(n % 3))));
                        CHECK(guard_ok(y, n * out));
                        same &= memcmp(y, want + first * out, (size_t)(n * out) * sizeof(float)) == 0;
                        free(y);
                    }
                    CHECK(same);
                }
                CHECK_OK(gy_cpu_isa_set(gy_cpu_isa_best()));
                free(want);
                free(w);
                free(wf);
                free(x);
                free(bias);
            }
}

GYTEST(cpu_linear_batches_have_the_bits_of_dot_ref) { check_batches_match_definition(gy_cpu_linear, 0); }
GYTEST(cpu_linear_t_batches_have_the_bits_of_the_chain) { check_batches_match_definition(gy_cpu_linear_t, 1); }

/* The packed rows of the batched gy_cpu_linear: each chunk zero-padded to whole lane blocks, bf16's
 * blocks of 32 as their even then their odd elements. */
GYTEST(cpu_dot_pack_layout) {
    rng_seed(41);
    const int64_t lens[] = {1, 16, 31, 45, 64, 96};
    for (int li = 0; li < 6; li++)
        for (int dt = 0; dt < GY_DTYPE_COUNT; dt++)
            for (int ks = 1; ks <= 4; ks *= 2) {
                const int64_t len = lens[li], n = 3, ldx = len + 5, L = len / ks;
                if (len % ks != 0) continue;
                const int64_t blk = dt == GY_DTYPE_BF16 ? 32 : 16, Lp = (L + blk - 1) / blk * blk;
                const int64_t ldp = gy_dot_packed_stride((gy_dtype)dt, len, ks);
                CHECK(ldp == Lp * ks && ldp % 16 == 0);
                float x[3 * 101];
                fill_uniform(x, n * ldx);
                float *xp = aligned_alloc(64, (size_t)(n * ldp + 16) * sizeof(float));
                gy_dot_pack(xp, x, ldx, n, (gy_dtype)dt, len, ks);
                int ok = 1;
                for (int64_t i = 0; i < n; i++)
                    for (int64_t c = 0; c < ks; c++)
                        for (int64_t j = 0; j < Lp; j++) {
                            /* element of the chunk stored at position j */
                            int64_t e = j;
                            if (dt == GY_DTYPE_BF16) e = j / 32 * 32 + (j % 32 < 16 ? 2 * (j % 32) : 2 * (j % 32 - 16) + 1);
                            const float want = e < L ? x[i * ldx + c * L + e] : 0.0f;
                            ok &= memcmp(&xp[i * ldp + c * Lp + j], &want, 4) == 0;
                        }
                CHECK(ok);
                free(xp);
            }
}

/* One 8-row tile on packed rows gives gy_dot_rows16's bits (the definition) on every path, for
 * partial tiles (valid rows < 8), every group size (n 1..10) and k-splits. */
GYTEST(cpu_dot_rows8_packed_matches_rows16) {
    rng_seed(43);
    const int64_t lens[] = {5, 32, 47, 96};
    for (int li = 0; li < 4; li++)
        for (int dt = 0; dt < GY_DTYPE_COUNT; dt++)
            for (int ks = 1; ks <= 2; ks++) {
                const int64_t len = lens[li];
                if (len % ks != 0) continue;
                const int64_t wrb = len * gy_dtype_size((gy_dtype)dt), ldp = gy_dot_packed_stride((gy_dtype)dt, len, ks);
                float wf[8 * 96], x[10 * 96], bias[8];
                void *w = make_weights((gy_dtype)dt, 8 * len, wf);
                fill_uniform(x, 10 * len);
                fill_uniform(bias, 8);
                float *xp = aligned_alloc(64, (size_t)(10 * ldp) * sizeof(float));
                gy_dot_pack(xp, x, len, 10, (gy_dtype)dt, len, ks);
                for (int isa = 0; isa <= (int)gy_cpu_isa_best(); isa++) {
                    CHECK_OK(gy_cpu_isa_set((gy_cpu_isa)isa));
                    for (int32_t valid = 1; valid <= 8; valid += 3)
                        for (int64_t n = 1; n <= 10; n++) {
                            float want[10 * 8], got[10 * 8 + GUARD];
                            for (int i = 0; i < 10 * 8 + GUARD; i++) got[i] = NAN;
                            for (int64_t i = 0; i < n; i++)
                                gy_dot_rows16(want + i * 8, 8, bias, w, wrb, (gy_dtype)dt, 16, valid,
                                              x + i * len, len, 1, len, ks);
                            gy_dot_rows8_packed(got, 8, bias, w, wrb, (gy_dtype)dt, valid, xp, n, len, ks);
                            int same = 1;
                            for (int64_t i = 0; i < n; i++) {
                                same &= memcmp(got + i * 8, want + i * 8, (size_t)valid * sizeof(float)) == 0;
                                for (int r = valid; r < 8; r++) same &= isnan(got[i * 8 + r]); /* not written */
                            }
                            CHECK(same);
                        }
                }
                CHECK_OK(gy_cpu_isa_set(gy_cpu_isa_best()));
                free(xp);
                free(w);
            }
}

GYTEST(cpu_fma_peak_runs) {
    double flops = 0;
    CHECK_OK(gy_cpu_fma_peak(&flops, 0.005, pool_of(2)));
    CHECK(flops > 1e6);
    CHECK_STATUS(gy_cpu_fma_peak(&flops, 0, NULL), GY_ERR_INVALID);
    CHECK_STATUS(gy_cpu_fma_peak(NULL, 0.01, NULL), GY_ERR_INVALID);
}

/* ---- norm, rope, activation, embedding, argmax ----------------------------------------------- */

GYTEST(cpu_rmsnorm_matches_reference) {
    rng_seed(7);
    const int64_t n = 5, dim = 77;
    float x[5 * 77], w[77];
    fill_uniform(x, n * dim);
    fill_uniform(w, dim);
    float *y = alloc_poisoned(n * dim);
    CHECK_OK(gy_cpu_rmsnorm(y, x, w, n, dim, 1e-5f));
    CHECK(guard_ok(y, n * dim));
    for (int64_t r = 0; r < n; r++) {
        double ss = 0;
        for (int64_t i = 0; i < dim; i++) ss += (double)x[r * dim + i] * x[r * dim + i];
        const double inv = 1.0 / sqrt(ss / dim + 1e-5);
        for (int64_t i = 0; i < dim; i++) {
            const double ref = x[r * dim + i] * inv * w[i];
            CHECK(fabs(y[r * dim + i] - ref) <= 1e-5 * fabs(ref) + 1e-7);
        }
    }
    /* Row independence: row 3 alone gives the same bits. */
    float y3[77];
    CHECK_OK(gy_cpu_rmsnorm(y3, x + 3 * dim, w, 1, dim, 1e-5f));
    CHECK(memcmp(y3, y + 3 * dim, sizeof y3) == 0);
    CHECK_OK(gy_cpu_rmsnorm(x, x, w, n, dim, 1e-5f)); /* in place */
    CHECK(memcmp(x, y, sizeof x) == 0);
    CHECK_STATUS(gy_cpu_rmsnorm(y, x, w, 1, 0, 1e-5f), GY_ERR_INVALID);
    CHECK_STATUS(gy_cpu_rmsnorm(y, x, w, 1, 4, -1.0f), GY_ERR_INVALID);
    free(y);
}

GYTEST(cpu_rope_matches_reference) {
    rng_seed(8);
    const int64_t n = 3, H = 2, d = 10, max_pos = 50;
    float cosb[50 * 5], sinb[50 * 5], x[3 * 2 * 10], x0[3 * 2 * 10];
    double inv_freq[5];
    CHECK_OK(gy_cpu_rope_inv_freq(inv_freq, d, 10000.0));
    CHECK_OK(gy_cpu_rope_table(cosb, sinb, max_pos, d, inv_freq, 1.0));
    fill_uniform(x, n * H * d);
    memcpy(x0, x, sizeof x);
    const int32_t pos[3] = {0, 7, 49};
    CHECK_OK(gy_cpu_rope(x, pos, cosb, sinb, n, H, d, max_pos));
    for (int64_t t = 0; t < n; t++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t i = 0; i < d / 2; i++) {
                const double ang = pos[t] * pow(10000.0, -2.0 * i / d);
                const double a = x0[(t * H + h) * d + i], b = x0[(t * H + h) * d + i + d / 2];
                CHECK(fabs(x[(t * H + h) * d + i] - (a * cos(ang) - b * sin(ang))) < 1e-6);
                CHECK(fabs(x[(t * H + h) * d + i + d / 2] - (b * cos(ang) + a * sin(ang))) < 1e-6);
            }
    const int32_t bad[1] = {50};
    CHECK_STATUS(gy_cpu_rope(x, bad, cosb, sinb, 1, H, d, max_pos), GY_ERR_INVALID);
    CHECK_STATUS(gy_cpu_rope_table(cosb, sinb, max_pos, 9, inv_freq, 1.0), GY_ERR_INVALID);
    CHECK_STATUS(gy_cpu_rope_table(cosb, sinb, max_pos, d, inv_freq, 0.0), GY_ERR_INVALID);
    CHECK_STATUS(gy_cpu_rope_inv_freq(inv_freq, d, 0.0), GY_ERR_INVALID);
    /* Scaled frequencies and an mscale are data like any others. */
    for (int i = 0; i < 5; i++) inv_freq[i] /= 4.0;
    CHECK_OK(gy_cpu_rope_table(cosb, sinb, max_pos, d, inv_freq, 1.25));
    for (int64_t p = 0; p < max_pos; p++)
        for (int64_t i = 0; i < d / 2; i++) {
            const double ang = p * (pow(10000.0, -2.0 * i / d) / 4.0);
            CHECK(fabs(cosb[p * 5 + i] - 1.25 * cos(ang)) < 1e-6);
            CHECK(fabs(sinb[p * 5 + i] - 1.25 * sin(ang)) < 1e-6);
        }
}

GYTEST(cpu_swiglu_and_add) {
    rng_seed(9);
    float g[37], u[37], out[37];
    for (int i = 0; i < 37; i++) g[i] = rng_uniform() * 30.0f;
    g[0] = -200.0f;
    g[1] = 0.0f;
    fill_uniform(u, 37);
    CHECK_OK(gy_cpu_swiglu(out, g, u, 37));
    for (int i = 0; i < 37; i++) {
        const double ref = g[i] / (1.0 + exp(-(double)g[i])) * u[i];
        CHECK(fabs(out[i] - ref) <= 1e-6 * fabs(ref) + 1e-30);
    }
    CHECK_OK(gy_cpu_add(out, g, u, 37));
    for (int i = 0; i < 37; i++) CHECK(out[i] == g[i] + u[i]);
    CHECK_STATUS(gy_cpu_swiglu(out, g, u, -1), GY_ERR_INVALID);
}

GYTEST(cpu_embedding_all_dtypes) {
    rng_seed(10);
    const int64_t vocab = 11, dim = 19;
    for (int dt = 0; dt < GY_DTYPE_COUNT; dt++) {
        float exact[11 * 19];
        void *table = make_weights((gy_dtype)dt, vocab * dim, exact);
        const int32_t tokens[4] = {3, 0, 10, 3};
        float *out = alloc_poisoned(4 * dim);
        CHECK_OK(gy_cpu_embedding(out, table, (gy_dtype)dt, tokens, 4, vocab, dim));
        CHECK(guard_ok(out, 4 * dim));
        for (int t = 0; t < 4; t++) CHECK(memcmp(out + t * dim, exact + tokens[t] * dim, (size_t)dim * 4) == 0);
        const int32_t bad[1] = {11};
        CHECK_STATUS(gy_cpu_embedding(out, table, (gy_dtype)dt, bad, 1, vocab, dim), GY_ERR_INVALID);
        free(out);
        free(table);
    }
}

GYTEST(cpu_argmax_ties_and_nans) {
    const float logits[3 * 5] = {1, 3, 3, 2, 0, NAN, -1, 5, 5, NAN, NAN, NAN, NAN, NAN, NAN};
    int32_t out[3];
    CHECK_OK(gy_cpu_argmax(out, logits, 3, 5));
    CHECK(out[0] == 1 && out[1] == 2 && out[2] == 0);
    CHECK_STATUS(gy_cpu_argmax(out, logits, 1, 0), GY_ERR_INVALID);
}

/* The sampler's greedy scan: the first maximum over finite logits, -inf skipped; a NaN, a +inf or
 * a row of only -inf is refused (and *argmax left alone). Lengths around the 16-lane blocks. */
GYTEST(cpu_argmax_checked_first_maximum_and_refusals) {
    rng_seed(42);
    float v[1000];
    for (int64_t len = 1; len <= 1000; len += len < 40 ? 1 : 137) {
        for (int trial = 0; trial < 4; trial++) {
            for (int64_t i = 0; i < len; i++) v[i] = trial == 1 ? (float)(rng_u32() % 3) : rng_uniform();
            if (trial == 2) v[rng_u32() % len] = -INFINITY;
            if (trial == 3 && len > 1) v[0] = v[len - 1] = 5.0f;
            int64_t want = -1;
            for (int64_t i = 0; i < len; i++)
                if (v[i] != -INFINITY && (want < 0 || v[i] > v[want])) want = i;
            int64_t got = -7;
            if (want < 0) {
                CHECK(gy_cpu_argmax_checked(v, len, &got) == 1 && got == -7);
                continue;
            }
            CHECK(gy_cpu_argmax_checked(v, len, &got) == 0 && got == want);
        }
        const int64_t at = (int64_t)(rng_u32() % len);
        const float saved = v[at];
        const float bad[3] = {NAN, INFINITY, -NAN};
        for (int b = 0; b < 3; b++) {
            int64_t got = -7;
            v[at] = bad[b];
            CHECK(gy_cpu_argmax_checked(v, len, &got) == 1 && got == -7);
        }
        v[at] = saved;
        for (int64_t i = 0; i < len; i++) v[i] = -INFINITY;
        int64_t got = -7;
        CHECK(gy_cpu_argmax_checked(v, len, &got) == 1 && got == -7);
    }
    const float zeros[3] = {-0.0f, 0.0f, -0.0f};
    int64_t got = -1;
    CHECK(gy_cpu_argmax_checked(zeros, 3, &got) == 0 && got == 0); /* -0 == +0: the first */
}

/* ---- attention ------------------------------------------------------------------------------- */

/* A random paged cache holding `n_seqs` sequences of `lens[s]` positions each, written with
 * gy_cpu_kv_write from the logical K/V arrays klog/vlog [s][pos][head][d]. */
typedef struct {
    gy_kv_layout layout;
    float *kv;
    int32_t indptr[9];
    int32_t indices[256];
} paged_cache;

static void build_cache(paged_cache *pc, int kind, int64_t bs, int64_t H, int64_t d, int n_seqs,
                        const int64_t *lens, int64_t maxlen, const float *klog, const float *vlog,
                        uint64_t seed) {
    int64_t need = 0;
    for (int s = 0; s < n_seqs; s++) need += (lens[s] + bs - 1) / bs;
    const int64_t n_blocks = need + 3; /* some unused blocks */
    CHECK_OK(gy_kv_layout_init(&pc->layout, (gy_kv_layout_kind)kind, bs, H, d, 4, n_blocks));
    const int64_t elems = gy_kv_layout_layer_elems(&pc->layout);
    pc->kv = malloc((size_t)elems * sizeof(float));
    for (int64_t i = 0; i < elems; i++) pc->kv[i] = NAN; /* unwritten slots must never be read */
    /* A random permutation of the blocks. */
    int32_t perm[256];
    for (int64_t i = 0; i < n_blocks; i++) perm[i] = (int32_t)i;
    rng_seed(seed);
    for (int64_t i = n_blocks - 1; i > 0; i--) {
        const int64_t j = rng_u32() % (uint32_t)(i + 1);
        const int32_t t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    int64_t next = 0;
    pc->indptr[0] = 0;
    for (int s = 0; s < n_seqs; s++) {
        const int64_t nb = (lens[s] + bs - 1) / bs;
        for (int64_t b = 0; b < nb; b++) pc->indices[next++] = perm[pc->indptr[s] + b];
        pc->indptr[s + 1] = (int32_t)next;
    }
    for (int s = 0; s < n_seqs; s++) {
        int32_t seqs[512], pos[512];
        for (int64_t p = 0; p < lens[s]; p++) {
            seqs[p] = s;
            pos[p] = (int32_t)p;
        }
        gy_cpu_paged_batch b = {lens[s], seqs, pos, n_seqs, pc->indptr, pc->indices};
        CHECK_OK(gy_cpu_kv_write(pc->kv, &pc->layout, klog + s * maxlen * H * d, vlog + s * maxlen * H * d, &b));
    }
}

GYTEST(cpu_attention_matches_reference_and_is_layout_independent) {
    rng_seed(11);
    enum { NS = 3, MAXLEN = 45, H = 2, QH = 6, D = 20 };
    const int64_t lens[NS] = {45, 1, 30};
    float *klog = malloc(sizeof(float) * NS * MAXLEN * H * D), *vlog = malloc(sizeof(float) * NS * MAXLEN * H * D);
    fill_uniform(klog, NS * MAXLEN * H * D);
    fill_uniform(vlog, NS * MAXLEN * H * D);
    /* Queries: every position of every sequence (a full prefill), in one batch. */
    int64_t nt = 0;
    int32_t tseq[128], tpos[128];
    for (int s = 0; s < NS; s++)
        for (int64_t p = 0; p < lens[s]; p++) {
            tseq[nt] = s;
            tpos[nt] = (int32_t)p;
            nt++;
        }
    float *q = malloc(sizeof(float) * nt * QH * D);
    fill_uniform(q, nt * QH * D);
    float *base = NULL;
    const int64_t block_sizes[] = {1, 4, 16, 64};
    for (int kind = 0; kind < GY_KV_LAYOUT_COUNT; kind++)
        for (int bi = 0; bi < 4; bi++) {
            paged_cache pc;
            build_cache(&pc, kind, block_sizes[bi], H, D, NS, lens, MAXLEN, klog, vlog, 100 + kind * 7 + bi);
            gy_cpu_paged_batch batch = {nt, tseq, tpos, NS, pc.indptr, pc.indices};
            float *out = alloc_poisoned(nt * QH * D);
            CHECK_OK(gy_cpu_attention(out, q, pc.kv, &pc.layout, &batch, QH, pool_of(1 + bi % 3)));
            CHECK(guard_ok(out, nt * QH * D) && all_finite(out, nt * QH * D));
            if (base == NULL) {
                base = out;
                /* Reference in double. */
                int ok = 1;
                for (int64_t t = 0; t < nt; t++)
                    for (int64_t h = 0; h < QH; h++) {
                        const int64_t s = tseq[t], P = tpos[t] + 1, kh = h / (QH / H);
                        double sc[64], m = -1e300, sum = 0;
                        for (int64_t j = 0; j < P; j++) {
                            double dd = 0;
                            for (int64_t i = 0; i < D; i++)
                                dd += (double)q[(t * QH + h) * D + i] * klog[((s * MAXLEN + j) * H + kh) * D + i];
                            sc[j] = dd / sqrt((double)D);
                            if (sc[j] > m) m = sc[j];
                        }
                        for (int64_t j = 0; j < P; j++) sum += (sc[j] = exp(sc[j] - m));
                        for (int64_t i = 0; i < D; i++) {
                            double o = 0;
                            for (int64_t j = 0; j < P; j++) o += sc[j] / sum * vlog[((s * MAXLEN + j) * H + kh) * D + i];
                            ok &= fabs(out[(t * QH + h) * D + i] - o) <= 2e-6;
                        }
                    }
                CHECK(ok);
            } else {
                CHECK(memcmp(out, base, sizeof(float) * nt * QH * D) == 0);
                free(out);
            }
            /* Decode-style: the last token of each sequence alone gives the same bits. */
            for (int s = 0; s < NS; s++) {
                int64_t t = 0;
                for (int u = 0; u < s; u++) t += lens[u];
                t += lens[s] - 1;
                gy_cpu_paged_batch one = {1, &tseq[t], &tpos[t], NS, pc.indptr, pc.indices};
                float o1[QH * D];
                CHECK_OK(gy_cpu_attention(o1, q + t * QH * D, pc.kv, &pc.layout, &one, QH, NULL));
                CHECK(memcmp(o1, base + t * QH * D, sizeof o1) == 0);
            }
            free(pc.kv);
        }
    free(base);
    free(q);
    free(klog);
    free(vlog);
}

GYTEST(cpu_attention_rejects_bad_arguments) {
    gy_kv_layout layout;
    CHECK_OK(gy_kv_layout_init(&layout, GY_KV_LAYOUT_PAGE, 4, 2, 8, 4, 3));
    float kv[2 * 4 * 2 * 8 * 3] = {0}, q[4 * 8], out[4 * 8];
    int32_t indptr[2] = {0, 2}, indices[2] = {0, 2}, seq[1] = {0}, pos[1] = {7};
    gy_cpu_paged_batch b = {1, seq, pos, 1, indptr, indices};
    CHECK_OK(gy_cpu_attention(out, q, kv, &layout, &b, 4, NULL));
    CHECK_STATUS(gy_cpu_attention(out, q, kv, &layout, &b, 3, NULL), GY_ERR_INVALID); /* 3 % 2 */
    pos[0] = 8; /* needs a third block */
    CHECK_STATUS(gy_cpu_attention(out, q, kv, &layout, &b, 4, NULL), GY_ERR_INVALID);
    pos[0] = -1;
    CHECK_STATUS(gy_cpu_attention(out, q, kv, &layout, &b, 4, NULL), GY_ERR_INVALID);
    pos[0] = 0;
    seq[0] = 1;
    CHECK_STATUS(gy_cpu_attention(out, q, kv, &layout, &b, 4, NULL), GY_ERR_INVALID);
    seq[0] = 0;
    indices[1] = 3; /* outside the 3 blocks */
    CHECK_STATUS(gy_cpu_attention(out, q, kv, &layout, &b, 4, NULL), GY_ERR_INVALID);
    CHECK_STATUS(gy_cpu_kv_write(kv, &layout, q, q, &b), GY_ERR_INVALID);
    indices[1] = 2;
    indptr[1] = -1;
    CHECK_STATUS(gy_cpu_attention(out, q, kv, &layout, &b, 4, NULL), GY_ERR_INVALID);
    indptr[1] = 2;
    layout.elem_size = 2;
    CHECK_STATUS(gy_cpu_attention(out, q, kv, &layout, &b, 4, NULL), GY_ERR_INVALID);
}

/* ---- the same bits on every build ------------------------------------------------------------ */

static uint64_t golden_hash;
static void golden_mix(const void *p, size_t n) {
    const unsigned char *c = (const unsigned char *)p;
    for (size_t i = 0; i < n; i++) {
        golden_hash ^= c[i];
        golden_hash *= 1099511628211ull;
    }
}

/* A fixed workload through every kernel whose arithmetic the headers define (no libm), hashed.
 * `make ctest` builds the portable path without -march, the extension builds AVX-512 with
 * -march=native; GCC and Clang, -O0 to -O3, -ffp-contract=off/on/fast all gave this value when
 * it was recorded. A deliberate change of a defined order must update it. */
GYTEST(cpu_golden_bits_are_build_independent) {
    rng_seed(1234);
    golden_hash = 1469598103934665603ull;
    enum { IN = 200, OUT = 70, N = 5 };
    float *w = malloc(sizeof(float) * IN * OUT), *x = malloc(sizeof(float) * N * IN);
    float *y = malloc(sizeof(float) * N * IN);
    uint16_t *wb = malloc(sizeof(uint16_t) * IN * OUT);
    fill_uniform(w, IN * OUT);
    fill_uniform(x, N * IN);
    gy_dtype_from_f32(wb, GY_DTYPE_BF16, w, IN * OUT);
    for (int ks = 1; ks <= 8; ks *= 2) {
        CHECK_OK(gy_cpu_linear(y, x, w, GY_DTYPE_F32, NULL, N, IN, OUT, ks, pool_of(2)));
        golden_mix(y, sizeof(float) * N * OUT);
        CHECK_OK(gy_cpu_linear(y, x, wb, GY_DTYPE_BF16, NULL, N, IN, OUT, ks, NULL));
        golden_mix(y, sizeof(float) * N * OUT);
        CHECK_OK(gy_cpu_linear_t(y, x, w, GY_DTYPE_F32, NULL, N, IN, OUT, ks, pool_of(3)));
        golden_mix(y, sizeof(float) * N * OUT);
        CHECK_OK(gy_cpu_linear_t(y, x, wb, GY_DTYPE_BF16, NULL, 1, IN, OUT, ks, NULL));
        golden_mix(y, sizeof(float) * OUT);
    }
    CHECK_OK(gy_cpu_rmsnorm(y, x, w, N, IN, 1e-5f));
    golden_mix(y, sizeof(float) * N * IN);
    CHECK_OK(gy_cpu_swiglu(y, x, w, N * IN));
    golden_mix(y, sizeof(float) * N * IN);
    float cosb[64 * 8], sinb[64 * 8];
    for (int i = 0; i < 64 * 8; i++) {
        cosb[i] = rng_uniform();
        sinb[i] = rng_uniform();
    }
    const int32_t pos[N] = {1, 5, 9, 33, 63};
    CHECK_OK(gy_cpu_rope(x, pos, cosb, sinb, N, 2, 16, 64));
    golden_mix(x, sizeof(float) * N * 32);
    gy_kv_layout layout;
    CHECK_OK(gy_kv_layout_init(&layout, GY_KV_LAYOUT_HEAD, 4, 2, 20, 4, 40));
    float *kv = calloc(40 * 2 * 4 * 2 * 20, sizeof(float));
    int32_t indptr[2] = {0, 33}, indices[33], tseq[130], tpos[130];
    for (int i = 0; i < 33; i++) indices[i] = (i * 5) % 40;
    for (int i = 0; i < 130; i++) {
        tseq[i] = 0;
        tpos[i] = i;
    }
    float *k = malloc(sizeof(float) * 130 * 40), *v = malloc(sizeof(float) * 130 * 40);
    float *q = malloc(sizeof(float) * 130 * 80), *o = malloc(sizeof(float) * 130 * 80);
    fill_uniform(k, 130 * 40);
    fill_uniform(v, 130 * 40);
    fill_uniform(q, 130 * 80);
    gy_cpu_paged_batch batch = {130, tseq, tpos, 1, indptr, indices};
    CHECK_OK(gy_cpu_kv_write(kv, &layout, k, v, &batch));
    CHECK_OK(gy_cpu_attention(o, q, kv, &layout, &batch, 4, pool_of(2)));
    golden_mix(o, sizeof(float) * 130 * 80);
    int32_t am[N];
    CHECK_OK(gy_cpu_argmax(am, x, N, IN));
    golden_mix(am, sizeof am);
    float e[37];
    CHECK_OK(gy_cpu_exp(e, q, 37));
    golden_mix(e, sizeof e);
    if (golden_hash != 0xa920d6e9d787736full)
        fprintf(stderr, "  golden hash %016llx, recorded a920d6e9d787736f\n",
                (unsigned long long)golden_hash);
    CHECK(golden_hash == 0xa920d6e9d787736full);
    free(w);
    free(x);
    free(y);
    free(wb);
    free(kv);
    free(k);
    free(v);
    free(q);
    free(o);
}
