/* emu.c: an emulated CUDA device for tests/cuda_emu/harness.c: the runtime calls of
 * cuda_runtime_api.h, the kernels forward_cuda.c launches (kernels.h) and
 * the cuBLAS wrapper (gemm.h), on host memory, naive and plainly correct (float64 sums, the HF
 * conventions the real kernels document). What it checks is forward_cuda.c itself: pointers,
 * offsets, orientations, leading dimensions, dtypes, the residual and TP plumbing. The real
 * kernels and cuBLAS are checked on a GPU by tests/test_cuda.py and tests/test_cuda_engine.py
 * (and without one by tests/kernel_emu/, which runs the real kernels' code on the host).
 * emu_device.c adds the rest of kernels.h and the communicators' device side; build_ext.py links
 * both into a whole extension for the Python tests that otherwise need a GPU. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cuda_runtime_api.h>
#include "kernels/kernels.h"
#include "kernels/gemm.h"
#include "cpu/dtype.h"
#include "mem/arena.h"

const char *cudaGetErrorString(cudaError_t e) { return e ? "emu error" : "no error"; }
const char *cudaGetErrorName(cudaError_t e) { return e ? "cudaErrorEmu" : "cudaSuccess"; }
cudaError_t cudaGetLastError(void) { return cudaSuccess; }
long emu_live_allocs; /* counted atomically: TP ranks allocate from their own threads */
#define EMU_COUNT(d) __atomic_fetch_add(&emu_live_allocs, (d), __ATOMIC_RELAXED)
cudaError_t cudaMalloc(void **p, size_t n) { *p = malloc(n); EMU_COUNT(1); return *p ? cudaSuccess : cudaErrorMemoryAllocation; }
cudaError_t cudaFree(void *p) { free(p); if (p) EMU_COUNT(-1); return cudaSuccess; }
cudaError_t cudaMallocHost(void **p, size_t n) { return cudaMalloc(p, n); }
cudaError_t cudaFreeHost(void *p) { return cudaFree(p); }
cudaError_t cudaMemcpyAsync(void *d, const void *s, size_t n, enum cudaMemcpyKind k, cudaStream_t st) { (void)k; (void)st; memcpy(d, s, n); return cudaSuccess; }
cudaError_t cudaSetDevice(int d) { (void)d; return cudaSuccess; }
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned f) { (void)f; *s = (cudaStream_t)malloc(8); EMU_COUNT(1); return cudaSuccess; }
cudaError_t cudaStreamDestroy(cudaStream_t s) { free(s); EMU_COUNT(-1); return cudaSuccess; }
cudaError_t cudaStreamSynchronize(cudaStream_t s) { (void)s; return cudaSuccess; }

/* the arena is a cpu one in the harness; the forward asks whether it is a cuda one */
gy_arena_backend_kind emu_arena_backend(const gy_arena *a) { (void)a; return GY_ARENA_BACKEND_CUDA; }
int32_t emu_arena_device(const gy_arena *a) { (void)a; return 0; }

static float ld(const void *p, gy_dtype t, int64_t i) {
    if (t == GY_DTYPE_F32) return ((const float *)p)[i];
    if (t == GY_DTYPE_BF16) return gy_bf16_to_f32(((const uint16_t *)p)[i]);
    return gy_f16_to_f32(((const uint16_t *)p)[i]);
}
static void st(void *p, gy_dtype t, int64_t i, float v) {
    if (t == GY_DTYPE_F32) ((float *)p)[i] = v;
    else if (t == GY_DTYPE_BF16) ((uint16_t *)p)[i] = gy_f32_to_bf16(v);
    else ((uint16_t *)p)[i] = gy_f32_to_f16(v);
}
static float rnd(gy_dtype t, float v) { uint32_t b[1]; st(b, t, 0, v); return ld(b, t, 0); }
void emu_kernel_on(gy_cuda_stream stream); /* emu_device.c: the stream this thread's kernels run on */

gy_status gy_cuda_embedding(void *out, const void *table, const int32_t *ids, int64_t n, int64_t vocab, int64_t dim, gy_dtype od, gy_dtype td, gy_cuda_stream s) {
    emu_kernel_on(s);
    for (int64_t t = 0; t < n; t++) for (int64_t j = 0; j < dim; j++)
        st(out, od, t * dim + j, ids[t] >= 0 && ids[t] < vocab ? ld(table, td, (int64_t)ids[t] * dim + j) : 0.0f);
    return GY_OK;
}
gy_status gy_cuda_rmsnorm(void *out, const void *x, const void *w, int64_t rows, int64_t dim, float eps, gy_dtype a, gy_dtype wd, gy_cuda_stream s) {
    emu_kernel_on(s);
    for (int64_t r = 0; r < rows; r++) {
        double ss = 0; for (int64_t j = 0; j < dim; j++) { float v = ld(x, a, r * dim + j); ss += (double)v * v; }
        float inv = 1.0f / sqrtf((float)(ss / dim) + eps);
        for (int64_t j = 0; j < dim; j++) st(out, a, r * dim + j, ld(w, wd, j) * rnd(a, ld(x, a, r * dim + j) * inv));
    }
    return GY_OK;
}
gy_status gy_cuda_rope(void *q, void *k, const int32_t *pos, int64_t n, int64_t nq, int64_t nk, int64_t D, float theta, gy_dtype t, gy_cuda_stream s) {
    emu_kernel_on(s);
    void *xs[2] = {q, k}; int64_t hs[2] = {nq, nk};
    for (int w = 0; w < 2; w++) { if (!xs[w]) continue;
        for (int64_t tk = 0; tk < n; tk++) for (int64_t h = 0; h < hs[w]; h++) for (int64_t i = 0; i < D / 2; i++) {
            double ang = pos[tk] * pow(theta, -(double)(2 * i) / D);
            int64_t b = (tk * hs[w] + h) * D;
            float a0 = ld(xs[w], t, b + i), b0 = ld(xs[w], t, b + i + D / 2);
            st(xs[w], t, b + i, a0 * cos(ang) - b0 * sin(ang)); st(xs[w], t, b + i + D / 2, b0 * cos(ang) + a0 * sin(ang)); } }
    return GY_OK;
}
gy_status gy_cuda_silu_mul(void *out, const void *x, int64_t rows, int64_t dim, gy_dtype t, gy_cuda_stream s) {
    emu_kernel_on(s);
    for (int64_t r = 0; r < rows; r++) for (int64_t j = 0; j < dim; j++) {
        float g = ld(x, t, r * 2 * dim + j), u = ld(x, t, r * 2 * dim + dim + j);
        st(out, t, r * dim + j, g / (1.0f + expf(-g)) * u); }
    return GY_OK;
}
gy_status gy_cuda_kv_write(void *storage, const gy_kv_layout *L, gy_dtype kvd, const void *k, const void *v, gy_dtype a,
                           const int32_t *seq, const int32_t *pos, int64_t n, const int32_t *ip, const int32_t *ix, int64_t ns, gy_cuda_stream s) {
    emu_kernel_on(s);
    for (int64_t t = 0; t < n; t++) {
        int64_t blk = ix[ip[seq[t]] + pos[t] / L->block_size], slot = pos[t] % L->block_size;
        for (int64_t h = 0; h < L->n_heads; h++) for (int64_t d = 0; d < L->head_dim; d++) {
            st(storage, kvd, gy_kv_layout_offset(L, 0, blk, slot, h) + d, ld(k, a, (t * L->n_heads + h) * L->head_dim + d));
            st(storage, kvd, gy_kv_layout_offset(L, 1, blk, slot, h) + d, ld(v, a, (t * L->n_heads + h) * L->head_dim + d)); } }
    return GY_OK;
}
int emu_decode_calls, emu_prefill_calls;
static gy_status attn(void *out, const void *q, gy_dtype a, const void *base, const gy_kv_layout *L, gy_dtype kvd,
                      const int32_t *seq, const int32_t *pos, int64_t n, const int32_t *ip, const int32_t *ix, int64_t ns,
                      int64_t nq, int64_t max_len, float scale) {
    const int64_t D = L->head_dim, grp = nq / L->n_heads;
    float *sc = malloc(sizeof(float) * (size_t)max_len);
    for (int64_t t = 0; t < n; t++) {
        if (pos[t] + 1 > max_len) { free(sc); return GY_FAIL(GY_ERR_INVALID, "emu: max_len too small"); }
        for (int64_t h = 0; h < nq; h++) {
            int64_t kh = h / grp; float m = -INFINITY;
            for (int64_t j = 0; j <= pos[t]; j++) {
                int64_t blk = ix[ip[seq[t]] + j / L->block_size];
                double dot = 0; for (int64_t d = 0; d < D; d++) dot += (double)ld(q, a, (t * nq + h) * D + d) * ld(base, kvd, gy_kv_layout_offset(L, 0, blk, j % L->block_size, kh) + d);
                sc[j] = (float)dot * scale; if (sc[j] > m) m = sc[j]; }
            double sum = 0; for (int64_t j = 0; j <= pos[t]; j++) { sc[j] = expf(sc[j] - m); sum += sc[j]; }
            for (int64_t d = 0; d < D; d++) { double acc = 0;
                for (int64_t j = 0; j <= pos[t]; j++) { int64_t blk = ix[ip[seq[t]] + j / L->block_size];
                    acc += sc[j] * ld(base, kvd, gy_kv_layout_offset(L, 1, blk, j % L->block_size, kh) + d); }
                st(out, a, (t * nq + h) * D + d, (float)(acc / sum)); } } }
    free(sc);
    return GY_OK;
}
gy_status gy_cuda_paged_attention_decode(void *out, const void *q, gy_dtype a, const void *base, const gy_kv_layout *L, gy_dtype kvd,
        const int32_t *seq, const int32_t *pos, int64_t n, const int32_t *ip, const int32_t *ix, int64_t ns, int64_t nq, int64_t max_len,
        float scale, void *ws, int64_t wsb, gy_cuda_stream s) { emu_kernel_on(s); emu_decode_calls++; return attn(out, q, a, base, L, kvd, seq, pos, n, ip, ix, ns, nq, max_len, scale); }
gy_status gy_cuda_paged_attention_prefill(void *out, const void *q, gy_dtype a, const void *base, const gy_kv_layout *L, gy_dtype kvd,
        const int32_t *seq, const int32_t *pos, int64_t n, const int32_t *ip, const int32_t *ix, int64_t ns, int64_t nq, int64_t max_len,
        float scale, void *ws, int64_t wsb, gy_cuda_stream s) { emu_kernel_on(s); emu_prefill_calls++; return attn(out, q, a, base, L, kvd, seq, pos, n, ip, ix, ns, nq, max_len, scale); }
int64_t gy_cuda_paged_attention_workspace_bytes(int64_t n, int64_t nq, int64_t D, int64_t max_len) { return n * nq * 64; }

struct gy_cuda_blas { gy_cuda_stream s; };
gy_status gy_cuda_blas_available(void) { return GY_OK; }
gy_status gy_cuda_blas_init(gy_cuda_blas **out, gy_cuda_stream s) { *out = malloc(sizeof **out); (*out)->s = s; EMU_COUNT(1); return GY_OK; }
void gy_cuda_blas_free(gy_cuda_blas *b) { if (b) { free(b); EMU_COUNT(-1); } }
gy_status gy_cuda_blas_set_stream(gy_cuda_blas *b, gy_cuda_stream s) { b->s = s; return GY_OK; }
gy_cuda_stream gy_cuda_blas_stream(const gy_cuda_blas *b) { return b->s; }
gy_status gy_cuda_gemm_check(gy_dtype yd, int64_t ldy, gy_dtype xd, int64_t ldx, gy_dtype wd, gy_gemm_weight o, int64_t m, int64_t n_in, int64_t n_out) {
    if (xd != wd || (yd != xd && yd != GY_DTYPE_F32) || ldx < n_in || ldy < n_out || m < 0 || n_in <= 0 || n_out <= 0)
        return GY_FAIL(GY_ERR_INVALID, "emu gemm: bad args yd=%d xd=%d wd=%d ldx=%lld ldy=%lld m=%lld n_in=%lld n_out=%lld", yd, xd, wd, (long long)ldx, (long long)ldy, (long long)m, (long long)n_in, (long long)n_out);
    return GY_OK;
}
gy_status gy_cuda_gemm(void *y, gy_dtype yd, int64_t ldy, const void *x, gy_dtype xd, int64_t ldx, const void *w, gy_dtype wd,
                       gy_gemm_weight o, const float *bias, int64_t m, int64_t n_in, int64_t n_out, int acc, gy_cuda_blas *b) {
    GY_TRY(gy_cuda_gemm_check(yd, ldy, xd, ldx, wd, o, m, n_in, n_out));
    if (b == NULL) return GY_FAIL(GY_ERR_INVALID, "emu: no handle");
    emu_kernel_on(b->s);
    for (int64_t r = 0; r < m; r++) for (int64_t j = 0; j < n_out; j++) {
        float base = acc ? ld(y, yd, r * ldy + j) : 0.0f;
        if (bias) base = rnd(yd, base + bias[j]);
        double s = 0;
        for (int64_t k = 0; k < n_in; k++)
            s += (double)ld(x, xd, r * ldx + k) * ld(w, wd, o == GY_GEMM_W_OUT_IN ? j * n_in + k : k * n_out + j);
        st(y, yd, r * ldy + j, (float)(base + s)); }
    return GY_OK;
}
