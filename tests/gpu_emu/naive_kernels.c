/* naive_kernels.c: the device ops of kernels.h and gemm.h, naive and plainly correct, on the
 * emulated runtime's host memory (runtime.c): float64 sums and the HF conventions the real
 * kernels document, run on the calling thread (gy_emu_kernel_on first waits for the stream's
 * earlier work). What they let the harness and the emulated extension check is the code that
 * calls them, forward_cuda.c above all: pointers, offsets, orientations, leading dimensions,
 * dtypes, the residual and TP plumbing. The real kernels are checked by the kernel emulator
 * (kernel_emu.cpp) and on a GPU; cuBLAS only on a GPU. The KV copies move bytes through
 * gy_kv_layout_offset, as the kernels do.
 *
 * Why naive twins at all: the forward pass launches a dozen kernels a layer; on fibers
 * (kernel_emu.cpp) the engine tests of the emulated extension would take hours. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_emu.h"
#include "core/dtype.h"
#include "kernels/gemm.h"
#include "kernels/kernels.h"

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

gy_status gy_cuda_embedding(void *out, const void *table, const int32_t *ids, int64_t n, int64_t vocab, int64_t dim, gy_dtype od, gy_dtype td, gy_cuda_stream s) {
    gy_emu_kernel_on(s);
    for (int64_t t = 0; t < n; t++) for (int64_t j = 0; j < dim; j++)
        st(out, od, t * dim + j, ids[t] >= 0 && ids[t] < vocab ? ld(table, td, (int64_t)ids[t] * dim + j) : 0.0f);
    return GY_OK;
}
gy_status gy_cuda_rmsnorm(void *out, const void *x, const void *w, int64_t rows, int64_t dim, float eps, gy_dtype a, gy_dtype wd, gy_cuda_stream s) {
    gy_emu_kernel_on(s);
    for (int64_t r = 0; r < rows; r++) {
        double ss = 0; for (int64_t j = 0; j < dim; j++) { float v = ld(x, a, r * dim + j); ss += (double)v * v; }
        float inv = 1.0f / sqrtf((float)(ss / dim) + eps);
        for (int64_t j = 0; j < dim; j++) st(out, a, r * dim + j, ld(w, wd, j) * rnd(a, ld(x, a, r * dim + j) * inv));
    }
    return GY_OK;
}
gy_status gy_cuda_rope(void *q, void *k, const int32_t *pos, int64_t n, int64_t nq, int64_t nk, int64_t D, const float *inv_freq, float mscale, gy_dtype t, gy_cuda_stream s) {
    gy_emu_kernel_on(s);
    void *xs[2] = {q, k}; int64_t hs[2] = {nq, nk};
    for (int w = 0; w < 2; w++) { if (!xs[w]) continue;
        for (int64_t tk = 0; tk < n; tk++) for (int64_t h = 0; h < hs[w]; h++) for (int64_t i = 0; i < D / 2; i++) {
            double ang = pos[tk] * (double)inv_freq[i], c = mscale * cos(ang), sn = mscale * sin(ang);
            int64_t b = (tk * hs[w] + h) * D;
            float a0 = ld(xs[w], t, b + i), b0 = ld(xs[w], t, b + i + D / 2);
            st(xs[w], t, b + i, a0 * c - b0 * sn); st(xs[w], t, b + i + D / 2, b0 * c + a0 * sn); } }
    return GY_OK;
}
gy_status gy_cuda_moe_combine(float *out, const float *ys, const float *w, const int32_t *slot, const float *shared,
                              const float *gate, int64_t n, int64_t k, int64_t dim, int accumulate, gy_cuda_stream s) {
    gy_emu_kernel_on(s);
    for (int64_t t = 0; t < n; t++) for (int64_t j = 0; j < dim; j++) {
        double acc = 0.0;
        for (int64_t r = 0; r < k; r++) acc += (double)w[t * k + r] * ys[(int64_t)slot[t * k + r] * dim + j];
        if (shared) acc += (gate ? 1.0 / (1.0 + exp(-(double)gate[t])) : 1.0) * shared[t * dim + j];
        out[t * dim + j] = (float)(accumulate ? out[t * dim + j] + acc : acc); }
    return GY_OK;
}
gy_status gy_cuda_silu_mul(void *out, const void *x, int64_t rows, int64_t dim, gy_dtype t, gy_cuda_stream s) {
    gy_emu_kernel_on(s);
    for (int64_t r = 0; r < rows; r++) for (int64_t j = 0; j < dim; j++) {
        float g = ld(x, t, r * 2 * dim + j), u = ld(x, t, r * 2 * dim + dim + j);
        st(out, t, r * dim + j, g / (1.0f + expf(-g)) * u); }
    return GY_OK;
}
gy_status gy_cuda_kv_write(void *storage, const gy_kv_layout *L, gy_dtype kvd, const void *k, const void *v, gy_dtype a,
                           const int32_t *seq, const int32_t *pos, int64_t n, const int32_t *ip, const int32_t *ix, int64_t ns, gy_cuda_stream s) {
    gy_emu_kernel_on(s);
    for (int64_t t = 0; t < n; t++) {
        int64_t blk = ix[ip[seq[t]] + pos[t] / L->block_size], slot = pos[t] % L->block_size;
        for (int64_t h = 0; h < L->n_heads; h++) for (int64_t d = 0; d < L->head_dim; d++) {
            st(storage, kvd, gy_kv_layout_offset(L, 0, blk, slot, h) + d, ld(k, a, (t * L->n_heads + h) * L->head_dim + d));
            st(storage, kvd, gy_kv_layout_offset(L, 1, blk, slot, h) + d, ld(v, a, (t * L->n_heads + h) * L->head_dim + d)); } }
    return GY_OK;
}
int gy_emu_decode_calls, gy_emu_prefill_calls;
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
        float scale, void *ws, int64_t wsb, gy_cuda_stream s) { gy_emu_kernel_on(s); gy_emu_decode_calls++; return attn(out, q, a, base, L, kvd, seq, pos, n, ip, ix, ns, nq, max_len, scale); }
gy_status gy_cuda_paged_attention_prefill(void *out, const void *q, gy_dtype a, const void *base, const gy_kv_layout *L, gy_dtype kvd,
        const int32_t *seq, const int32_t *pos, int64_t n, const int32_t *ip, const int32_t *ix, int64_t ns, int64_t nq, int64_t max_len,
        float scale, void *ws, int64_t wsb, gy_cuda_stream s) { gy_emu_kernel_on(s); gy_emu_prefill_calls++; return attn(out, q, a, base, L, kvd, seq, pos, n, ip, ix, ns, nq, max_len, scale); }
int64_t gy_cuda_paged_attention_workspace_bytes(int64_t n, int64_t nq, int64_t D, int64_t max_len) { return n * nq * 64; }

struct gy_cuda_blas { gy_cuda_stream s; };
gy_status gy_cuda_blas_available(void) { return GY_OK; }
gy_status gy_cuda_blas_init(gy_cuda_blas **out, gy_cuda_stream s) { *out = malloc(sizeof **out); if (*out == NULL) return GY_FAIL(GY_ERR_SYSTEM, "emu: out of memory"); (*out)->s = s; return GY_OK; }
void gy_cuda_blas_free(gy_cuda_blas *b) { free(b); }
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
    gy_emu_kernel_on(b->s);
    for (int64_t r = 0; r < m; r++) for (int64_t j = 0; j < n_out; j++) {
        float base = acc ? ld(y, yd, r * ldy + j) : 0.0f;
        if (bias) base = rnd(yd, base + bias[j]);
        double s = 0;
        for (int64_t k = 0; k < n_in; k++)
            s += (double)ld(x, xd, r * ldx + k) * ld(w, wd, o == GY_GEMM_W_OUT_IN ? j * n_in + k : k * n_out + j);
        st(y, yd, r * ldy + j, (float)(base + s)); }
    return GY_OK;
}

/* ---- kernels.h: KV movement (byte copies through gy_kv_layout_offset, as the kernels do) ---- */

static gy_status emu_check_layout(const gy_kv_layout *l, const char *what) {
    if (l == NULL || l->block_size <= 0 || l->n_heads <= 0 || l->head_dim <= 0 ||
        l->elem_size <= 0 || l->n_blocks < 0)
        return GY_FAIL(GY_ERR_INVALID, "%s: bad layout (emulated)", what);
    return GY_OK;
}

static void emu_row(void *dst, const void *src, const gy_kv_layout *l) {
    memmove(dst, src, (size_t)(l->head_dim * l->elem_size));
}

gy_status gy_cuda_kv_scatter(void *storage, const gy_kv_layout *layout, const void *k,
                             const void *v, const int32_t *block_table, int64_t start,
                             int64_t n_tokens, gy_cuda_stream stream) {
    GY_TRY(emu_check_layout(layout, "kv_scatter"));
    gy_emu_kernel_on(stream);
    const int64_t es = layout->elem_size, row = layout->head_dim * es;
    for (int64_t t = 0; t < n_tokens; t++) {
        const int64_t p = start + t, b = block_table[p / layout->block_size];
        if (b < 0 || b >= layout->n_blocks) continue;
        for (int64_t h = 0; h < layout->n_heads; h++) {
            const int64_t at = (t * layout->n_heads + h) * row;
            emu_row((char *)storage + gy_kv_layout_offset(layout, 0, b, p % layout->block_size, h) * es,
                    (const char *)k + at, layout);
            emu_row((char *)storage + gy_kv_layout_offset(layout, 1, b, p % layout->block_size, h) * es,
                    (const char *)v + at, layout);
        }
    }
    return GY_OK;
}

gy_status gy_cuda_kv_gather(void *k, void *v, const void *storage, const gy_kv_layout *layout,
                            const int32_t *block_table, int64_t start, int64_t n_tokens,
                            gy_cuda_stream stream) {
    GY_TRY(emu_check_layout(layout, "kv_gather"));
    gy_emu_kernel_on(stream);
    const int64_t es = layout->elem_size, row = layout->head_dim * es;
    for (int64_t t = 0; t < n_tokens; t++) {
        const int64_t p = start + t, b = block_table[p / layout->block_size];
        for (int64_t h = 0; h < layout->n_heads; h++) {
            const int64_t at = (t * layout->n_heads + h) * row;
            if (b < 0 || b >= layout->n_blocks) {
                memset((char *)k + at, 0, (size_t)row);
                memset((char *)v + at, 0, (size_t)row);
                continue;
            }
            emu_row((char *)k + at,
                    (const char *)storage + gy_kv_layout_offset(layout, 0, b, p % layout->block_size, h) * es,
                    layout);
            emu_row((char *)v + at,
                    (const char *)storage + gy_kv_layout_offset(layout, 1, b, p % layout->block_size, h) * es,
                    layout);
        }
    }
    return GY_OK;
}

gy_status gy_cuda_kv_copy_heads(void *dst, const gy_kv_layout *dst_layout,
                                const int32_t *dst_blocks, int64_t dst_head0, const void *src,
                                const gy_kv_layout *src_layout, const int32_t *src_blocks,
                                int64_t src_head0, int64_t n_heads, int64_t n_blocks,
                                gy_cuda_stream stream) {
    GY_TRY(emu_check_layout(dst_layout, "kv_copy_heads (destination)"));
    GY_TRY(emu_check_layout(src_layout, "kv_copy_heads (source)"));
    if (dst_layout->block_size != src_layout->block_size ||
        dst_layout->head_dim != src_layout->head_dim ||
        dst_layout->elem_size != src_layout->elem_size || n_heads < 0 || n_blocks < 0 ||
        src_head0 < 0 || src_head0 + n_heads > src_layout->n_heads || dst_head0 < 0 ||
        dst_head0 + n_heads > dst_layout->n_heads)
        return GY_FAIL(GY_ERR_INVALID, "kv_copy_heads: bad arguments (emulated)");
    gy_emu_kernel_on(stream);
    const int64_t es = src_layout->elem_size;
    for (int64_t i = 0; i < n_blocks; i++) {
        const int64_t sb = src_blocks[i], db = dst_blocks[i];
        if (sb < 0 || sb >= src_layout->n_blocks || db < 0 || db >= dst_layout->n_blocks) continue;
        for (int64_t kv = 0; kv < 2; kv++)
            for (int64_t t = 0; t < src_layout->block_size; t++)
                for (int64_t h = 0; h < n_heads; h++)
                    emu_row((char *)dst + gy_kv_layout_offset(dst_layout, kv, db, t, dst_head0 + h) * es,
                            (const char *)src + gy_kv_layout_offset(src_layout, kv, sb, t, src_head0 + h) * es,
                            src_layout);
    }
    return GY_OK;
}

/* ---- kernels.h: residual add and greedy sampling ---- */

gy_status gy_cuda_residual_add(void *out, const void *a, const void *b, int64_t n, gy_dtype dtype,
                               gy_cuda_stream stream) {
    gy_emu_kernel_on(stream);
    for (int64_t i = 0; i < n; i++) st(out, dtype, i, ld(a, dtype, i) + ld(b, dtype, i));
    return GY_OK;
}

gy_status gy_cuda_argmax(int32_t *out, const void *logits, int64_t rows, int64_t vocab,
                         gy_dtype dtype, gy_cuda_stream stream) {
    gy_emu_kernel_on(stream);
    for (int64_t r = 0; r < rows; r++) {
        int64_t best = 0;
        for (int64_t j = 1; j < vocab; j++)
            if (ld(logits, dtype, r * vocab + j) > ld(logits, dtype, r * vocab + best)) best = j;
        out[r] = (int32_t)best;
    }
    return GY_OK;
}

/* ---- kernels.h entry points that only py_cuda.c's kernel tests and benchmarks bind: those tests
 * run the real kernels (kernel_emu.cpp), so here they are refused, never emulated. ---- */
#define EMU_NOT_HERE(what)                                                                          \
    GY_FAIL(GY_ERR_UNAVAILABLE, "%s is not part of the naive emulated device (the kernel " \
            "emulator, tests/gpu_emu/run.py kernels, runs the real kernel on the host)", what)
gy_status gy_cuda_kv_write_check(const gy_kv_layout *layout, gy_dtype kv_dtype, gy_dtype act_dtype,
                                 int64_t n_tokens, int64_t n_seqs) {
    (void)layout, (void)kv_dtype, (void)act_dtype, (void)n_tokens, (void)n_seqs;
    return EMU_NOT_HERE("gy_cuda_kv_write_check");
}
gy_status gy_cuda_paged_attention_check(gy_dtype act_dtype, const gy_kv_layout *layout,
                                        gy_dtype kv_dtype, int64_t n_tokens, int64_t n_seqs,
                                        int64_t n_q_heads, int64_t max_len, float scale) {
    (void)act_dtype, (void)layout, (void)kv_dtype, (void)n_tokens, (void)n_seqs, (void)n_q_heads;
    (void)max_len, (void)scale;
    return EMU_NOT_HERE("gy_cuda_paged_attention_check");
}
gy_status gy_cuda_sample_check(gy_dtype dtype, int64_t rows, int64_t vocab) {
    (void)dtype, (void)rows, (void)vocab;
    return EMU_NOT_HERE("gy_cuda_sample_check");
}
int64_t gy_cuda_sample_workspace_bytes(int64_t rows, int64_t vocab) { return rows * vocab * 8; }
gy_status gy_cuda_sample(int32_t *tokens, const void *logits, gy_dtype dtype, int64_t rows,
                         int64_t vocab, const gy_sampler_params *params, const int64_t *token_index,
                         void *workspace, int64_t workspace_bytes, gy_cuda_stream stream) {
    (void)tokens, (void)logits, (void)dtype, (void)rows, (void)vocab, (void)params;
    (void)token_index, (void)workspace, (void)workspace_bytes, (void)stream;
    return EMU_NOT_HERE("gy_cuda_sample");
}
