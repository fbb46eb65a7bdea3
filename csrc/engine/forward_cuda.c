/* forward_cuda.c: the decoder forward pass on the CUDA kernels (csrc/kernels) and cuBLAS
 * (csrc/kernels/gemm.h), on the worker's stream. forward_cuda.h says what differs from the CPU
 * pass; this file follows forward.c's order of operations layer by layer.
 *
 * One layer, for TP rank r of size S (heads, KV heads and FFN shards are this rank's):
 *   h    = rmsnorm(x)                                    act dtype
 *   q,k,v = h @ wq/wk/wv (rows of rank r) (+ bias)       act dtype
 *   rope(q, k); kv_write(k, v) into the layer's pages; attn = paged attention(q)
 *   o    = x (rank 0) or 0 (other ranks), fp32;  o += attn @ wo_t (rows of rank r)
 *   o    = all_reduce(o) when S > 1;  x = o rounded to the act dtype
 *   h    = rmsnorm(x)
 *   o    = x or 0 as above; for each shard s: gu = [h @ gate_s | h @ up_s], g = silu(gate) * up,
 *          o += g @ down_t_s
 *   o    = all_reduce(o) when S > 1;  x = o rounded to the act dtype
 * The conversions x -> o and o -> x are the embedding kernel gathering rows 0..n-1 (an exact copy
 * or one rounding), so no kernel beyond kernels.h and gemm.h is needed. */
#include "forward_cuda.h"
#include "forward_backend.h"
#include "../core/alloc.h"
#include "../core/fault.h"
#include "../core/grow.h"

#if defined(GY_WITH_CUDA) && defined(GY_WITH_CUDA_FORWARD)

#include <cuda_runtime_api.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../cpu/moe.h"
#include "../kernels/gemm.h"
#include "../kernels/attention.h"
#include "../kernels/kv_ops.h"
#include "../kernels/model_ops.h"

/* ---- runtime errors ---- */

static gy_status gy_fwd_cuda_status(cudaError_t e, const char *what, const char *file, int line) {
    cudaGetLastError(); /* clear a non-sticky error so the next launch check is not confused */
    switch (e) {
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorStubLibrary:
    case cudaErrorCallRequiresNewerDriver:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorDevicesUnavailable:
        return gy_error_set(GY_ERR_UNAVAILABLE, file, line,
                            "CUDA is not available: %s (%s, from %s)", cudaGetErrorString(e),
                            cudaGetErrorName(e), what);
    default:
        return gy_error_set(GY_ERR_CUDA, file, line, "%s failed: %s (%s)", what,
                            cudaGetErrorString(e), cudaGetErrorName(e));
    }
}

#define GY_FWD_CUDA_CHECK(call)                                                                    \
    do {                                                                                           \
        cudaError_t gy_fwd_e_ = (call);                                                            \
        if (gy_fwd_e_ != cudaSuccess)                                                              \
            return gy_fwd_cuda_status(gy_fwd_e_, #call, __FILE__, __LINE__);                       \
    } while (0)

/* ---- the workspace ---- */

typedef struct gy_dev_buf {
    void *ptr;
    int64_t bytes;
} gy_dev_buf;

struct gy_forward_cuda_ws {
    int32_t device;
    cudaStream_t stream;  /* the model's; blas is bound to it */
    gy_cuda_blas *blas;
    /* Device buffers, each grown on demand to the largest step seen (n = tokens of the step):
     *   x, h (n, hidden)  q, attn (n, heads*D)  k, v (n, kv_heads*D)  gu (n, 2*shard_rows)
     *   g (n, shard_rows), all act dtype;  o (n, hidden) fp32;  sel (n_logits, hidden) act;
     *   logits (n_logits, vocab) fp32;  attn_ws: the attention kernels' scratch;
     *   idx: the step's packed int32 index arrays (layout in gy_fwd_cuda_upload) */
    gy_dev_buf x, h, q, k, v, attn, gu, g, o, sel, logits, attn_ws, idx;
    /* A mixture of experts (E experts, k a token; gu and g are as wide as the widest FFN):
     *   hf (n, hidden) fp32: h widened for the fp32 router;  rlog (n*E + n) fp32: router logits
     *   and the shared expert's gate logit;  xs (n*k, hidden) act: the tokens' rows grouped by
     *   expert;  ys (n*k, hidden) fp32: the experts' outputs;  sh (n, hidden) fp32: the shared
     *   expert's;  midx (2*n*k) int32: token_of | slot_of;  mw (n*k) fp32: the weights
     * and on the host (moe_cap tokens) the logits, the choice and the grouping, computed by
     * cpu/moe.h so that a token goes to the experts the CPU pass sends it to. */
    gy_dev_buf hf, rlog, xs, ys, sh, midx, mw;
    float *h_logits, *h_weight;
    int32_t *h_choice, *h_token_of, *h_slot_of;
    int64_t *h_offsets, moe_cap;
    int32_t *host_idx; /* (host_idx_cap) pinned staging of idx */
    int64_t host_idx_cap;
    /* The step, set by begin for layers and end. */
    int64_t n_tokens, n_seqs, n_logits, max_len;
    int decode; /* one query token per sequence: the decode attention kernel */
    const int32_t *d_tokens, *d_token_seq, *d_token_pos, *d_indptr, *d_indices, *d_logit_rows,
        *d_iota;
    /* KunServe's remote attention (gy_fwd_cuda_remote_upload), when the batch has parts:
     *   ridx: packed int32 zeros (n) | per part p: its block table {0, nb_p} (2), blocks (nb_p)
     *   rem_at: (cap_rem) host, part p's table at ridx + rem_at[p] */
    gy_dev_buf ridx;
    int32_t *host_ridx; /* (host_ridx_cap) pinned staging of ridx */
    int64_t host_ridx_cap, *rem_at, cap_rem;
    const int32_t *d_zeros;
    /* parts whose cache is on another device: a workspace there per device (rem_at[p] is then
     * an offset into that peer's idx) */
    struct gy_fwd_cuda_peer *peers;
    int32_t n_peers;
};

/* Remote attention on another device (gy_fwd_cuda_remote_peer): buffers there, for the rows of
 * one part at a time (r: the most rows of a part there this step), and a stream of its own
 * there, ordered after this worker's by events.
 *   q, attn (r, heads*D) act;  k, v (r, kv_heads*D) act;  attn_ws: the attention's scratch;
 *   idx: packed int32, per part p: zeros (rows_p) | positions (rows_p) | {0, nb_p} | blocks */
typedef struct gy_fwd_cuda_peer {
    int32_t device;
    cudaStream_t stream;
    cudaEvent_t ready; /* on this worker's device: its q, k, v are written */
    cudaEvent_t done;  /* on the peer: the output is back */
    gy_dev_buf q, k, v, attn, attn_ws, idx;
    int32_t *host_idx; /* (host_idx_cap) pinned staging of idx */
    int64_t host_idx_cap;
} gy_fwd_cuda_peer;

static void gy_fwd_cuda_peer_free(gy_fwd_cuda_peer *p, int32_t home) {
    cudaSetDevice(p->device);
    if (p->stream != NULL) cudaStreamSynchronize(p->stream);
    gy_dev_buf *bufs[] = {&p->q, &p->k, &p->v, &p->attn, &p->attn_ws, &p->idx};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]->ptr != NULL) cudaFree(bufs[i]->ptr);
    if (p->host_idx != NULL) cudaFreeHost(p->host_idx);
    if (p->done != NULL) cudaEventDestroy(p->done);
    if (p->stream != NULL) cudaStreamDestroy(p->stream);
    cudaSetDevice(home);
    if (p->ready != NULL) cudaEventDestroy(p->ready);
}

static gy_status gy_dev_reserve(gy_dev_buf *b, int64_t bytes) {
    if (bytes <= b->bytes) return GY_OK;
    /* A quarter of headroom, so a batch that grows a little does not reallocate every step. */
    int64_t want = bytes + bytes / 4;
    want = (want + 255) & ~(int64_t)255;
    if (b->ptr != NULL) cudaFree(b->ptr); /* waits for the device: nothing of ours is in flight */
    b->ptr = NULL;
    b->bytes = 0;
    GY_FWD_CUDA_CHECK(cudaMalloc(&b->ptr, (size_t)want));
    b->bytes = want;
    return GY_OK;
}

void gy_forward_cuda_ws_free(struct gy_forward_cuda_ws *c) {
    if (c == NULL) return;
    cudaSetDevice(c->device);
    if (c->stream != NULL) cudaStreamSynchronize(c->stream);
    gy_cuda_blas_free(c->blas);
    gy_dev_buf *bufs[] = {&c->x, &c->h, &c->q, &c->k, &c->v, &c->attn, &c->gu, &c->g,
                          &c->o, &c->sel, &c->logits, &c->attn_ws, &c->idx, &c->ridx,
                          &c->hf, &c->rlog, &c->xs, &c->ys, &c->sh, &c->midx, &c->mw};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]->ptr != NULL) cudaFree(bufs[i]->ptr);
    if (c->host_idx != NULL) cudaFreeHost(c->host_idx);
    if (c->host_ridx != NULL) cudaFreeHost(c->host_ridx);
    free(c->rem_at);
    free(c->h_logits);
    free(c->h_weight);
    free(c->h_choice);
    free(c->h_token_of);
    free(c->h_slot_of);
    free(c->h_offsets);
    for (int32_t i = 0; i < c->n_peers; i++) gy_fwd_cuda_peer_free(&c->peers[i], c->device);
    free(c->peers);
    cudaGetLastError(); /* a cleanup: the first error's message is what matters */
    free(c);
}

const char *gy_forward_cuda_unavailable(void) { return NULL; }

/* ---- the model's stream ---- */

gy_status gy_forward_cuda_attach(gy_model *m, int32_t device) {
    if (m == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_forward_cuda_attach: NULL model");
    if (m->stream != NULL) return GY_FAIL(GY_ERR_STATE, "the model already has a CUDA stream");
    GY_FWD_CUDA_CHECK(cudaSetDevice(device));
    GY_TRY(gy_cuda_blas_available());
    if (m->rope_inv_freq == NULL)
        return GY_FAIL(GY_ERR_STATE, "gy_forward_cuda_attach: the model has no rotary frequencies");
    /* The rope kernel's frequencies, fp32 like the angles it computes (as HF's inv_freq buffer). */
    const int64_t half = m->head_dim / 2;
    float *host = gy_malloc((size_t)half * sizeof(float));
    if (host == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for the rotary frequencies");
    for (int64_t i = 0; i < half; i++) host[i] = (float)m->rope_inv_freq[i];
    float *dev = NULL;
    cudaError_t e = cudaMalloc((void **)&dev, (size_t)half * sizeof(float));
    if (e == cudaSuccess)
        e = cudaMemcpy(dev, host, (size_t)half * sizeof(float), cudaMemcpyHostToDevice);
    free(host);
    if (e != cudaSuccess) {
        if (dev != NULL) cudaFree(dev);
        return gy_fwd_cuda_status(e, "cudaMalloc/cudaMemcpy of the rotary frequencies", __FILE__,
                                  __LINE__);
    }
    cudaStream_t stream = NULL;
    e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
        cudaFree(dev);
        return gy_fwd_cuda_status(e, "cudaStreamCreateWithFlags", __FILE__, __LINE__);
    }
    m->backend = GY_MODEL_BACKEND_CUDA;
    m->device = device;
    m->stream = stream;
    m->rope_inv_freq_dev = dev;
    return GY_OK;
}

void gy_forward_cuda_detach(gy_model *m) {
    if (m == NULL || m->backend != GY_MODEL_BACKEND_CUDA || m->stream == NULL) return;
    cudaSetDevice(m->device);
    cudaStreamSynchronize(m->stream);
    cudaStreamDestroy(m->stream);
    if (m->rope_inv_freq_dev != NULL) cudaFree(m->rope_inv_freq_dev);
    cudaGetLastError();
    m->stream = NULL;
    m->rope_inv_freq_dev = NULL;
}

/* ---- checks ---- */

/* The dtype of the KV values: fp32 for 4-byte elements, the activation dtype for 2-byte ones. */
static gy_status gy_fwd_cuda_kv_dtype(const gy_model *m, const gy_kv_cache *kv, gy_dtype *out) {
    const int64_t elem = gy_kv_layout_of(kv)->elem_size;
    if (elem == 4) {
        *out = GY_DTYPE_F32;
        return GY_OK;
    }
    if (elem == 2 && m->weight_dtype != GY_DTYPE_F32) {
        *out = m->weight_dtype;
        return GY_OK;
    }
    return GY_FAIL(GY_ERR_INVALID,
                   "a KV cache of %lld-byte values does not fit a model computing in %s (use 4 "
                   "bytes, or 2 with f16/bf16 weights)",
                   (long long)elem, gy_dtype_name(m->weight_dtype));
}

static gy_status gy_fwd_cuda_check(const gy_model *m, const gy_tp_group *tp,
                                   const gy_kv_cache *kv) {
    if (m->backend != GY_MODEL_BACKEND_CUDA || m->stream == NULL)
        return GY_FAIL(GY_ERR_STATE, "the model is not attached to a CUDA device");
    const gy_arena *arena = gy_kv_arena(kv);
    if (gy_arena_backend(arena) != GY_ARENA_BACKEND_CUDA || gy_arena_device(arena) != m->device)
        return GY_FAIL(GY_ERR_INVALID,
                       "the KV cache must live in a CUDA arena on the model's device %d (it is in "
                       "a %s arena%s)",
                       (int)m->device,
                       gy_arena_backend(arena) == GY_ARENA_BACKEND_CUDA ? "cuda" : "cpu",
                       gy_arena_backend(arena) == GY_ARENA_BACKEND_CUDA ? " on another device" : "");
    if (tp->size > 1 && !tp->device_buffers)
        return GY_FAIL(GY_ERR_UNAVAILABLE,
                       "tensor parallelism on CUDA needs an all-reduce over device buffers on the "
                       "worker's stream (a device communicator); this TP group's all-reduce works "
                       "on host memory");
    gy_dtype kv_dtype;
    return gy_fwd_cuda_kv_dtype(m, kv, &kv_dtype);
}

/* ---- per step ---- */

static gy_status gy_fwd_cuda_ws_get(gy_forward_ws *ws, const gy_model *m,
                                    struct gy_forward_cuda_ws **out) {
    GY_FWD_CUDA_CHECK(cudaSetDevice(m->device));
    struct gy_forward_cuda_ws *c = ws->cuda;
    if (c != NULL && c->device != m->device) { /* a workspace moves with its model's device */
        gy_forward_cuda_ws_free(c);
        ws->cuda = c = NULL;
        GY_FWD_CUDA_CHECK(cudaSetDevice(m->device));
    }
    if (c == NULL) {
        c = gy_calloc(1, sizeof *c);
        if (c == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for a CUDA workspace");
        c->device = m->device;
        c->stream = (cudaStream_t)m->stream;
        gy_status s = gy_cuda_blas_init(&c->blas, m->stream);
        if (s != GY_OK) {
            free(c);
            return s;
        }
        ws->cuda = c;
    }
    if (c->stream != (cudaStream_t)m->stream) {
        /* Another model on the same device: finish the old stream's work before switching. */
        GY_FWD_CUDA_CHECK(cudaStreamSynchronize(c->stream));
        GY_TRY(gy_cuda_blas_set_stream(c->blas, m->stream));
        c->stream = (cudaStream_t)m->stream;
    }
    *out = c;
    return GY_OK;
}

/* One host-to-device copy of the step's index arrays, packed as int32:
 *   tokens (n) | token_seq (n) | token_pos (n) | bt_indptr (S+1) | bt_indices (bt_indptr[S])
 *   | logit_rows (n_logits) | iota 0..n-1 (n) */
static gy_status gy_fwd_cuda_upload(struct gy_forward_cuda_ws *c, const gy_forward_batch *b) {
    const gy_cpu_paged_batch *p = &b->paged;
    const int64_t n = p->n_tokens, S = p->n_seqs, nb = p->bt_indptr[S], nl = b->n_logits;
    const int64_t total = 4 * n + (S + 1) + nb + nl;
    if (total > c->host_idx_cap) {
        if (c->host_idx != NULL) cudaFreeHost(c->host_idx);
        c->host_idx = NULL;
        c->host_idx_cap = 0;
        const int64_t want = total + total / 4;
        GY_FWD_CUDA_CHECK(cudaMallocHost((void **)&c->host_idx, (size_t)want * sizeof(int32_t)));
        c->host_idx_cap = want;
    }
    GY_TRY(gy_dev_reserve(&c->idx, total * (int64_t)sizeof(int32_t)));
    int32_t *h = c->host_idx;
    const int32_t *d = c->idx.ptr;
    int64_t at = 0;
#define GY_FWD_PACK(src, count, dev)                                                               \
    do {                                                                                           \
        if ((count) > 0 && (src) != NULL)                                                          \
            memcpy(h + at, (src), (size_t)(count) * sizeof(int32_t));                              \
        else if ((count) > 0)                                                                      \
            memset(h + at, 0, (size_t)(count) * sizeof(int32_t));                                 \
        (dev) = d + at;                                                                            \
        at += (count);                                                                             \
    } while (0)
    GY_FWD_PACK(b->tokens, n, c->d_tokens);
    GY_FWD_PACK(p->token_seq, n, c->d_token_seq);
    GY_FWD_PACK(p->token_pos, n, c->d_token_pos);
    GY_FWD_PACK(p->bt_indptr, S + 1, c->d_indptr);
    GY_FWD_PACK(p->bt_indices, nb, c->d_indices);
    GY_FWD_PACK(b->logit_rows, nl, c->d_logit_rows);
#undef GY_FWD_PACK
    for (int64_t t = 0; t < n; t++) h[at + t] = (int32_t)t;
    c->d_iota = d + at;
    at += n;
    GY_FWD_CUDA_CHECK(cudaMemcpyAsync(c->idx.ptr, h, (size_t)at * sizeof(int32_t),
                                      cudaMemcpyHostToDevice, c->stream));
    return GY_OK;
}

/* ---- KunServe's remote attention (forward.h: gy_forward_remote) ----
 *
 * A remote part's rows attend, for its layers, on another worker's cache: their K/V are written
 * there and the same kernels run over it, the part being one sequence (token_seq zeros, its block
 * table in that cache). The projections and the FFN stay here. A cache on this worker's device
 * (virtual workers of one GPU) is read and written from this worker's stream, in order with the
 * rest of the layer. A cache on another device is attended there: q, k and v of the part's rows
 * are copied over (a peer copy), the kernels run on a stream of that device, and the output
 * comes back, the two streams ordered by events. A token's attention depends only on its own
 * sequence, so the rows attended here and there are the bits of one pass over the whole batch. */

/* The attention scratch for any run of at most n rows (a run of k rows may need more than the
 * whole batch: the decode kernel splits the KV length further for fewer rows). */
static int64_t gy_fwd_cuda_runs_workspace(int64_t n, int64_t heads, int64_t D, int64_t max_len) {
    int64_t need = 0;
    for (int64_t k = 1; k <= n; k++) {
        const int64_t w = gy_cuda_paged_attention_workspace_bytes(k, heads, D, max_len);
        if (w > need) need = w;
    }
    return need;
}

/* Pinned staging of at least `count` int32, kept between steps. */
static gy_status gy_fwd_cuda_staging(int32_t **host, int64_t *cap, int64_t count) {
    if (count <= *cap) return GY_OK;
    if (*host != NULL) cudaFreeHost(*host);
    *host = NULL;
    *cap = 0;
    const int64_t want = count + count / 4;
    GY_FWD_CUDA_CHECK(cudaMallocHost((void **)host, (size_t)want * sizeof(int32_t)));
    *cap = want;
    return GY_OK;
}

/* The workspace on device d (made on first use: a stream and two events). */
static gy_status gy_fwd_cuda_peer_of(struct gy_forward_cuda_ws *c, int32_t d,
                                     gy_fwd_cuda_peer **out) {
    for (int32_t i = 0; i < c->n_peers; i++)
        if (c->peers[i].device == d) {
            *out = &c->peers[i];
            return GY_OK;
        }
    gy_fwd_cuda_peer *grown = gy_realloc(c->peers, (size_t)(c->n_peers + 1) * sizeof *grown);
    if (grown == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for a peer workspace");
    c->peers = grown;
    gy_fwd_cuda_peer *p = &c->peers[c->n_peers];
    memset(p, 0, sizeof *p);
    p->device = d;
    cudaError_t e = cudaEventCreateWithFlags(&p->ready, cudaEventDisableTiming); /* here */
    if (e == cudaSuccess) e = cudaSetDevice(d);
    if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&p->stream, cudaStreamNonBlocking);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&p->done, cudaEventDisableTiming);
    if (e != cudaSuccess) {
        gy_fwd_cuda_peer_free(p, c->device);
        return gy_fwd_cuda_status(e, "a stream and events on the peer device", __FILE__, __LINE__);
    }
    c->n_peers++;
    *out = p;
    GY_FWD_CUDA_CHECK(cudaSetDevice(c->device));
    return GY_OK;
}

/* The parts' checks a CUDA pass adds to forward.c's, and their index arrays: one copy for the
 * parts on this device, one per other device (with its buffers there); the attention scratch
 * grown for the largest run of rows a layer may cut the batch into. Leaves this device current. */
static gy_status gy_fwd_cuda_remote_upload(struct gy_forward_cuda_ws *c, const gy_model *m,
                                           const gy_forward_batch *b, int64_t heads,
                                           int64_t max_len) {
    if (b->n_remote == 0) return GY_OK;
    const int64_t n = b->paged.n_tokens, D = m->head_dim, esz = gy_dtype_size(m->weight_dtype);
    int64_t total = n;
    for (int64_t i = 0; i < b->n_remote; i++) {
        const gy_arena *a = gy_kv_arena(b->remote[i].kv);
        if (gy_arena_backend(a) != GY_ARENA_BACKEND_CUDA)
            return GY_FAIL(GY_ERR_INVALID, "remote attention part %lld: its cache is not in a "
                           "CUDA arena", (long long)i);
        if (gy_arena_device(a) == m->device) total += 2 + b->remote[i].indptr[1];
    }
    GY_TRY(gy_grow((void **)&c->rem_at, &c->cap_rem, b->n_remote, sizeof *c->rem_at,
                   "remote attention offsets"));
    const int64_t need = gy_fwd_cuda_runs_workspace(n, heads, D, max_len);
    GY_TRY(gy_dev_reserve(&c->attn_ws, need));
    GY_TRY(gy_fwd_cuda_staging(&c->host_ridx, &c->host_ridx_cap, total));
    GY_TRY(gy_dev_reserve(&c->ridx, total * (int64_t)sizeof(int32_t)));
    int32_t *h = c->host_ridx;
    memset(h, 0, (size_t)n * sizeof(int32_t));
    int64_t at = n;
    for (int64_t i = 0; i < b->n_remote; i++) {
        const gy_forward_remote *p = &b->remote[i];
        if (gy_arena_device(gy_kv_arena(p->kv)) != m->device) continue;
        c->rem_at[i] = at;
        h[at] = 0;
        h[at + 1] = p->indptr[1];
        if (p->indptr[1] > 0)
            memcpy(h + at + 2, p->blocks, (size_t)p->indptr[1] * sizeof(int32_t));
        at += 2 + p->indptr[1];
    }
    c->d_zeros = c->ridx.ptr;
    GY_FWD_CUDA_CHECK(cudaMemcpyAsync(c->ridx.ptr, h, (size_t)at * sizeof(int32_t),
                                      cudaMemcpyHostToDevice, c->stream));

    /* the other devices': each part's zeros, positions and block table, packed per device */
    for (int64_t i = 0; i < b->n_remote; i++) {
        const int32_t d = gy_arena_device(gy_kv_arena(b->remote[i].kv));
        int first = d != m->device; /* the first part on d packs every part there */
        for (int64_t j = 0; first && j < i; j++)
            first = gy_arena_device(gy_kv_arena(b->remote[j].kv)) != d;
        if (!first) continue;
        gy_fwd_cuda_peer *peer = NULL;
        GY_TRY(gy_fwd_cuda_peer_of(c, d, &peer));
        /* normally idle (this stream waited for it); after a failed step, the staging and the
         * buffers below may still be in use there */
        GY_FWD_CUDA_CHECK(cudaStreamSynchronize(peer->stream));
        int64_t count = 0, rows = 0; /* the packed indices, the most rows of one part */
        for (int64_t j = i; j < b->n_remote; j++)
            if (gy_arena_device(gy_kv_arena(b->remote[j].kv)) == d) {
                count += 2 * b->remote[j].n_rows + 2 + b->remote[j].indptr[1];
                if (b->remote[j].n_rows > rows) rows = b->remote[j].n_rows;
            }
        GY_TRY(gy_fwd_cuda_staging(&peer->host_idx, &peer->host_idx_cap, count));
        h = peer->host_idx;
        at = 0;
        for (int64_t j = i; j < b->n_remote; j++) {
            const gy_forward_remote *p = &b->remote[j];
            if (gy_arena_device(gy_kv_arena(p->kv)) != d) continue;
            c->rem_at[j] = at;
            memset(h + at, 0, (size_t)p->n_rows * sizeof(int32_t));
            memcpy(h + at + p->n_rows, b->paged.token_pos + p->row0,
                   (size_t)p->n_rows * sizeof(int32_t));
            at += 2 * p->n_rows;
            h[at] = 0;
            h[at + 1] = p->indptr[1];
            if (p->indptr[1] > 0)
                memcpy(h + at + 2, p->blocks, (size_t)p->indptr[1] * sizeof(int32_t));
            at += 2 + p->indptr[1];
        }
        const int64_t qd = heads * D, kvd = gy_kv_layout_of(b->remote[i].kv)->n_heads * D;
        GY_FWD_CUDA_CHECK(cudaSetDevice(d));
        const struct { gy_dev_buf *buf; int64_t bytes; } plan[] = {
            {&peer->q, rows * qd * esz}, {&peer->attn, rows * qd * esz},
            {&peer->k, rows * kvd * esz}, {&peer->v, rows * kvd * esz},
            {&peer->attn_ws, gy_fwd_cuda_runs_workspace(rows, heads, D, max_len)},
            {&peer->idx, count * (int64_t)sizeof(int32_t)},
        };
        for (size_t k = 0; k < sizeof plan / sizeof plan[0]; k++)
            GY_TRY(gy_dev_reserve(plan[k].buf, plan[k].bytes));
        GY_FWD_CUDA_CHECK(cudaMemcpyAsync(peer->idx.ptr, h, (size_t)at * sizeof(int32_t),
                                          cudaMemcpyHostToDevice, peer->stream));
        GY_FWD_CUDA_CHECK(cudaSetDevice(m->device));
    }
    return GY_OK;
}

/* n rows: their K/V (k, v) into the layer at layer_base, then their attention (q -> attn) over
 * it (sequences token_seq[..] of the block tables indptr/indices, n_seqs of them), on `st` with
 * the scratch `ws`. */
static gy_status gy_fwd_cuda_attend(const struct gy_forward_cuda_ws *c, const gy_model *m,
                                    void *attn, const void *q, const void *k, const void *v,
                                    int64_t n, void *layer_base, const gy_kv_layout *layout,
                                    gy_dtype kv_dtype, const int32_t *token_seq,
                                    const int32_t *token_pos, const int32_t *indptr,
                                    const int32_t *indices, int64_t n_seqs, int64_t heads,
                                    float scale, const gy_dev_buf *ws, cudaStream_t st) {
    const gy_dtype act = m->weight_dtype;
    GY_TRY(gy_cuda_kv_write(layer_base, layout, kv_dtype, k, v, act, token_seq, token_pos, n,
                            indptr, indices, n_seqs, st));
    if (c->decode)
        return gy_cuda_paged_attention_decode(attn, q, act, layer_base, layout, kv_dtype, token_seq,
                                              token_pos, n, indptr, indices, n_seqs, heads,
                                              c->max_len, scale, ws->ptr, ws->bytes, st);
    return gy_cuda_paged_attention_prefill(attn, q, act, layer_base, layout, kv_dtype, token_seq,
                                           token_pos, n, indptr, indices, n_seqs, heads,
                                           c->max_len, scale, ws->ptr, ws->bytes, st);
}

/* Part i's rows on the device of its cache: q, k, v over, the kernels there, the output back,
 * this worker's stream waiting for it. */
static gy_status gy_fwd_cuda_remote_peer(struct gy_forward_cuda_ws *c, const gy_model *m,
                                         const gy_forward_batch *b, int64_t i, void *there,
                                         gy_dtype kv_dtype, int64_t heads, float scale) {
    const gy_forward_remote *p = &b->remote[i];
    const gy_kv_layout *R = gy_kv_layout_of(p->kv);
    const int32_t d = gy_arena_device(gy_kv_arena(p->kv));
    gy_fwd_cuda_peer *peer = NULL;
    GY_TRY(gy_fwd_cuda_peer_of(c, d, &peer)); /* made by the upload */
    /* activations between workers: a copy that fault sweeps reach */
    if (gy_fault_hit(GY_FAULT_COPY))
        return GY_FAIL(GY_ERR_SYSTEM, "injected fault: remote attention's copies to device %d "
                       "failed", (int)d);
    const int64_t esz = gy_dtype_size(m->weight_dtype), D = m->head_dim, rows = p->n_rows;
    const size_t q_bytes = (size_t)(rows * heads * D * esz);
    const size_t kv_bytes = (size_t)(rows * R->n_heads * D * esz);
    const int64_t q_off = p->row0 * heads * D * esz, kv_off = p->row0 * R->n_heads * D * esz;
    const int32_t *idx = (const int32_t *)peer->idx.ptr + c->rem_at[i]; /* zeros | positions */
    const int32_t *table = idx + 2 * rows;                                /* {0, nb} | blocks */
    GY_FWD_CUDA_CHECK(cudaEventRecord(peer->ready, c->stream));
    GY_FWD_CUDA_CHECK(cudaSetDevice(d));
    gy_status s = GY_OK;
    cudaError_t e = cudaStreamWaitEvent(peer->stream, peer->ready, 0);
    if (e == cudaSuccess)
        e = cudaMemcpyAsync(peer->q.ptr, (const char *)c->q.ptr + q_off, q_bytes,
                            cudaMemcpyDeviceToDevice, peer->stream);
    if (e == cudaSuccess)
        e = cudaMemcpyAsync(peer->k.ptr, (const char *)c->k.ptr + kv_off, kv_bytes,
                            cudaMemcpyDeviceToDevice, peer->stream);
    if (e == cudaSuccess)
        e = cudaMemcpyAsync(peer->v.ptr, (const char *)c->v.ptr + kv_off, kv_bytes,
                            cudaMemcpyDeviceToDevice, peer->stream);
    if (e == cudaSuccess)
        s = gy_fwd_cuda_attend(c, m, peer->attn.ptr, peer->q.ptr, peer->k.ptr, peer->v.ptr, rows,
                               there, R, kv_dtype, idx, idx + rows, table, table + 2, 1, heads,
                               scale, &peer->attn_ws, peer->stream);
    if (e == cudaSuccess && s == GY_OK)
        e = cudaMemcpyAsync((char *)c->attn.ptr + q_off, peer->attn.ptr, q_bytes,
                            cudaMemcpyDeviceToDevice, peer->stream);
    if (e == cudaSuccess && s == GY_OK) e = cudaEventRecord(peer->done, peer->stream);
    const cudaError_t back = cudaSetDevice(m->device); /* this device again, whatever happened */
    if (s != GY_OK) return s;
    if (e != cudaSuccess)
        return gy_fwd_cuda_status(e, "remote attention on the peer device", __FILE__, __LINE__);
    if (back != cudaSuccess) return gy_fwd_cuda_status(back, "cudaSetDevice", __FILE__, __LINE__);
    GY_FWD_CUDA_CHECK(cudaStreamWaitEvent(c->stream, peer->done, 0));
    return GY_OK;
}

/* Layer l's attention for the whole batch: here, except the remote parts whose KV for l is on
 * another worker (forward_cpu.c's gy_forward_cpu_attention, on the device). */
static gy_status gy_fwd_cuda_attention(struct gy_forward_cuda_ws *c, const gy_model *m,
                                       const gy_forward_batch *b, void *layer_base,
                                       const gy_kv_layout *layout, gy_dtype kv_dtype, int64_t l,
                                       int64_t heads, float scale) {
    const int64_t esz = gy_dtype_size(m->weight_dtype);
    const int64_t q_row = heads * m->head_dim * esz, kv_row = layout->n_heads * m->head_dim * esz;
    /* rows [row, ...) of q or attn, and of k or v */
#define GY_Q_ROWS(ptr, row) ((void *)((char *)(ptr) + (row) * q_row))
#define GY_KV_ROWS(ptr, row) ((const void *)((const char *)(ptr) + (row) * kv_row))
    int64_t row = 0; /* rows before it are done */
    for (int64_t i = 0; i <= b->n_remote; i++) {
        const gy_forward_remote *p = i < b->n_remote ? &b->remote[i] : NULL;
        if (p != NULL && (l < p->first_layer || l >= p->end_layer)) continue; /* attends here */
        const int64_t stop = p != NULL ? p->row0 : c->n_tokens;
        if (stop > row)
            GY_TRY(gy_fwd_cuda_attend(c, m, GY_Q_ROWS(c->attn.ptr, row), GY_Q_ROWS(c->q.ptr, row),
                                      GY_KV_ROWS(c->k.ptr, row), GY_KV_ROWS(c->v.ptr, row),
                                      stop - row, layer_base, layout, kv_dtype,
                                      c->d_token_seq + row, c->d_token_pos + row, c->d_indptr,
                                      c->d_indices, c->n_seqs, heads, scale, &c->attn_ws,
                                      c->stream));
        if (p == NULL) break;
        void *there = (void *)gy_kv_layer_address(p->kv, l - gy_kv_config_of(p->kv)->first_layer);
        if (gy_arena_device(gy_kv_arena(p->kv)) != m->device) {
            GY_TRY(gy_fwd_cuda_remote_peer(c, m, b, i, there, kv_dtype, heads, scale));
        } else {
            /* its block table: {0, nb}, then the blocks */
            const int32_t *table = (const int32_t *)c->ridx.ptr + c->rem_at[i];
            GY_TRY(gy_fwd_cuda_attend(c, m, GY_Q_ROWS(c->attn.ptr, p->row0),
                                      GY_Q_ROWS(c->q.ptr, p->row0), GY_KV_ROWS(c->k.ptr, p->row0),
                                      GY_KV_ROWS(c->v.ptr, p->row0), p->n_rows, there,
                                      gy_kv_layout_of(p->kv), kv_dtype, c->d_zeros,
                                      c->d_token_pos + p->row0, table, table + 2, 1, heads, scale,
                                      &c->attn_ws, c->stream));
        }
        row = p->row0 + p->n_rows;
    }
#undef GY_Q_ROWS
#undef GY_KV_ROWS
    return GY_OK;
}

/* The host arrays of a mixture of experts' routing, for n tokens (all or nothing). */
static gy_status gy_fwd_cuda_moe_host(struct gy_forward_cuda_ws *c, const gy_model *m, int64_t n) {
    const int64_t E = m->n_experts, nk = n * m->n_experts_used;
    float *logits = gy_malloc((size_t)(n * E) * sizeof(float));
    float *weight = gy_malloc((size_t)nk * sizeof(float));
    int32_t *choice = gy_malloc((size_t)nk * sizeof(int32_t));
    int32_t *token_of = gy_malloc((size_t)nk * sizeof(int32_t));
    int32_t *slot_of = gy_malloc((size_t)nk * sizeof(int32_t));
    int64_t *offsets = gy_malloc((size_t)(E + 1) * sizeof(int64_t));
    if (!logits || !weight || !choice || !token_of || !slot_of || !offsets) {
        free(logits), free(weight), free(choice), free(token_of), free(slot_of), free(offsets);
        return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for the routing of %lld tokens",
                       (long long)n);
    }
    free(c->h_logits), free(c->h_weight), free(c->h_choice), free(c->h_token_of);
    free(c->h_slot_of), free(c->h_offsets);
    c->h_logits = logits, c->h_weight = weight, c->h_choice = choice, c->h_token_of = token_of;
    c->h_slot_of = slot_of, c->h_offsets = offsets;
    c->moe_cap = n;
    return GY_OK;
}

static gy_status gy_forward_cuda_begin(const gy_model *m, const gy_tp_group *tp, gy_kv_cache *kv,
                                       const gy_forward_batch *b, gy_forward_ws *ws, int embed,
                                       int64_t max_len) {
    GY_TRY(gy_fwd_cuda_check(m, tp, kv));
    const gy_cpu_paged_batch *p = &b->paged;
    const int64_t n = p->n_tokens, hid = m->hidden, D = m->head_dim;
    if (embed) {
        if (b->tokens == NULL) return GY_FAIL(GY_ERR_INVALID, "forward batch: NULL tokens");
        for (int64_t t = 0; t < n; t++)
            if (b->tokens[t] < 0 || b->tokens[t] >= m->vocab)
                return GY_FAIL(GY_ERR_INVALID, "token %lld is %d, outside the vocabulary [0, %lld)",
                               (long long)t, (int)b->tokens[t], (long long)m->vocab);
    }
    struct gy_forward_cuda_ws *c = NULL;
    GY_TRY(gy_fwd_cuda_ws_get(ws, m, &c));
    /* Normally idle already (end waits); after a failed step this keeps the pinned staging and
     * the buffers below from being reused under work still in flight. */
    GY_FWD_CUDA_CHECK(cudaStreamSynchronize(c->stream));

    const int64_t esz = gy_dtype_size(m->weight_dtype);
    const int64_t heads = m->n_heads / tp->size, kv_heads = m->n_kv_heads / tp->size;
    const int64_t qd = heads * D, kvd = kv_heads * D;
    int64_t R = m->shard_rows; /* gu and g hold the widest FFN: dense, an expert or shared */
    if (m->expert_rows > R) R = m->expert_rows;
    if (m->shared_rows > R) R = m->shared_rows;
    const int64_t nl = b->n_logits, E = m->n_experts, nk = n * m->n_experts_used;
    /* expert parallelism: ys holds every shard's outputs, exchanged by the all-reduce */
    const int64_t ys_parts = m->expert_end - m->expert_begin < E ? m->max_tp : 1;
    const struct { gy_dev_buf *buf; int64_t bytes; } plan[] = {
        {&c->x, n * hid * esz},      {&c->h, n * hid * esz},     {&c->q, n * qd * esz},
        {&c->k, n * kvd * esz},      {&c->v, n * kvd * esz},     {&c->attn, n * qd * esz},
        {&c->gu, n * 2 * R * esz},   {&c->g, n * R * esz},       {&c->o, n * hid * 4},
        {&c->sel, nl * hid * esz},   {&c->logits, nl * m->vocab * 4},
        {&c->attn_ws, gy_cuda_paged_attention_workspace_bytes(n, heads, D, max_len)},
        {&c->hf, E > 0 ? n * hid * 4 : 0},  {&c->rlog, (n * E + n) * 4},
        {&c->xs, nk * hid * esz},    {&c->ys, ys_parts * nk * hid * 4},
        {&c->sh, E > 0 ? n * hid * 4 : 0},
        {&c->midx, 2 * nk * 4},      {&c->mw, nk * 4},
    };
    for (size_t i = 0; i < sizeof plan / sizeof plan[0]; i++)
        GY_TRY(gy_dev_reserve(plan[i].buf, plan[i].bytes));
    if (E > 0 && n > c->moe_cap) GY_TRY(gy_fwd_cuda_moe_host(c, m, n));
    GY_TRY(gy_fwd_cuda_upload(c, b));
    GY_TRY(gy_fwd_cuda_remote_upload(c, m, b, heads, max_len));

    c->n_tokens = n;
    c->n_seqs = p->n_seqs;
    c->n_logits = nl;
    c->max_len = max_len;
    /* The decode kernel when every sequence brings exactly one query token, in order (the
     * engine's pure decode steps); the prefill kernel otherwise. Both are correct for any batch. */
    c->decode = n == p->n_seqs;
    for (int64_t t = 0; c->decode && t < n; t++) c->decode = p->token_seq[t] == (int32_t)t;

    if (!embed) return GY_OK;
    return gy_cuda_embedding(c->x.ptr, m->embed, c->d_tokens, n, m->vocab, hid, m->weight_dtype,
                             m->weight_dtype, c->stream);
}

/* o = x widened to fp32 on rank 0, nothing elsewhere (the rank's first product overwrites o). */
static gy_status gy_fwd_cuda_residual_open(struct gy_forward_cuda_ws *c, const gy_model *m,
                                           const gy_tp_group *tp) {
    if (tp->rank != 0) return GY_OK;
    return gy_cuda_embedding(c->o.ptr, c->x.ptr, c->d_iota, c->n_tokens, c->n_tokens, m->hidden,
                             GY_DTYPE_F32, m->weight_dtype, c->stream);
}

/* Sums o over the ranks, then x = o in the activation dtype. */
static gy_status gy_fwd_cuda_residual_close(struct gy_forward_cuda_ws *c, const gy_model *m,
                                            const gy_tp_group *tp) {
    if (tp->size > 1) GY_TRY(tp->all_reduce(tp->ctx, c->o.ptr, c->n_tokens * m->hidden));
    return gy_cuda_embedding(c->x.ptr, c->o.ptr, c->d_iota, c->n_tokens, c->n_tokens, m->hidden,
                             m->weight_dtype, GY_DTYPE_F32, c->stream);
}

/* Shard s of experts [first_e, end_e) on the grouped rows xs into ys (fp32, (n*k, hidden)). */
static gy_status gy_fwd_cuda_experts(struct gy_forward_cuda_ws *c, const gy_model *m,
                                     const gy_layer_weights *w, float *ys, int64_t s,
                                     int64_t first_e, int64_t end_e, int64_t l) {
    const gy_dtype act = m->weight_dtype, F32 = GY_DTYPE_F32;
    const int64_t hid = m->hidden, esz = gy_dtype_size(act), R = m->expert_rows;
    for (int64_t e = first_e; e < end_e; e++) {
        const int64_t first = c->h_offsets[e], rows = c->h_offsets[e + 1] - first;
        const gy_expert_weights *x = &w->experts[e];
        if (rows == 0) continue;
        if (x->gate[s] == NULL || x->up[s] == NULL || x->down_t[s] == NULL)
            return GY_FAIL(GY_ERR_STATE, "layer %lld: expert %lld's shard %lld is not held here",
                           (long long)l, (long long)e, (long long)s);
        const void *xe = (const char *)c->xs.ptr + first * hid * esz;
        GY_TRY(gy_cuda_gemm(c->gu.ptr, act, 2 * R, xe, act, hid, x->gate[s], act,
                            GY_GEMM_W_OUT_IN, NULL, rows, hid, R, 0, c->blas));
        GY_TRY(gy_cuda_gemm((char *)c->gu.ptr + R * esz, act, 2 * R, xe, act, hid, x->up[s],
                            act, GY_GEMM_W_OUT_IN, NULL, rows, hid, R, 0, c->blas));
        GY_TRY(gy_cuda_silu_mul(c->g.ptr, c->gu.ptr, rows, R, act, c->stream));
        GY_TRY(gy_cuda_gemm(ys + first * hid, F32, hid, c->g.ptr, act, R, x->down_t[s], act,
                            GY_GEMM_W_IN_OUT, NULL, rows, R, hid, 0, c->blas));
    }
    return GY_OK;
}

/* Layer l's mixture of experts on h, onto o (rank 0's residual, or overwritten first on other
 * ranks) for this rank's shards, as the dense FFN's shards go: the router in fp32 on the device,
 * the top k and the grouping on the host by cpu/moe.h (one wait for the stream a layer), each
 * expert's tokens gathered and run as one GEMM a shard, combined per token in rank order with
 * the shared expert's shard behind its gate (moe_combine.cu). Expert-parallel (the model holds
 * experts [expert_begin, expert_end) whole): this rank's experts for every shard into
 * ys [max_tp, n*k, hidden], zeros in the others' slots, and the group's all-reduce gives every
 * rank every slot (one contributor a value: exact), as the CPU pass does. */
static gy_status gy_fwd_cuda_moe(struct gy_forward_cuda_ws *c, const gy_model *m,
                                 const gy_layer_weights *w, const gy_tp_group *tp, int64_t l,
                                 int64_t first_shard, int64_t shards_here) {
    const gy_dtype act = m->weight_dtype, F32 = GY_DTYPE_F32;
    const int64_t n = c->n_tokens, hid = m->hidden, E = m->n_experts, k = m->n_experts_used;
    const int64_t nk = n * k, esz = gy_dtype_size(act), S = m->shared_rows;
    const cudaStream_t st = c->stream;
    gy_cuda_blas *blas = c->blas;
    float *logits = c->rlog.ptr, *gate = logits + n * E, *ys = c->ys.ptr, *sh = c->sh.ptr;
    int32_t *d_token_of = c->midx.ptr, *d_slot_of = d_token_of + nk;
    GY_TRY(gy_cuda_embedding(c->hf.ptr, c->h.ptr, c->d_iota, n, n, hid, F32, act, st));
    GY_TRY(gy_cuda_gemm(logits, F32, E, c->hf.ptr, F32, hid, w->router, F32, GY_GEMM_W_OUT_IN,
                        NULL, n, hid, E, 0, blas));
    const int gated = S > 0 && w->shared_gate != NULL;
    if (gated)
        GY_TRY(gy_cuda_gemm(gate, F32, 1, c->hf.ptr, F32, hid, w->shared_gate, F32,
                            GY_GEMM_W_OUT_IN, NULL, n, hid, 1, 0, blas));
    GY_FWD_CUDA_CHECK(cudaMemcpyAsync(c->h_logits, logits, (size_t)(n * E) * sizeof(float),
                                      cudaMemcpyDeviceToHost, st));
    GY_FWD_CUDA_CHECK(cudaStreamSynchronize(st));
    GY_TRY(gy_cpu_moe_route(c->h_choice, c->h_weight, c->h_logits, n, E, k, m->norm_topk_prob));
    GY_TRY(gy_cpu_moe_group(c->h_offsets, c->h_token_of, c->h_slot_of, c->h_choice, n, E, k));
    /* pageable sources: each copy has read them when it returns */
    GY_FWD_CUDA_CHECK(cudaMemcpyAsync(d_token_of, c->h_token_of, (size_t)nk * sizeof(int32_t),
                                      cudaMemcpyHostToDevice, st));
    GY_FWD_CUDA_CHECK(cudaMemcpyAsync(d_slot_of, c->h_slot_of, (size_t)nk * sizeof(int32_t),
                                      cudaMemcpyHostToDevice, st));
    GY_FWD_CUDA_CHECK(cudaMemcpyAsync(c->mw.ptr, c->h_weight, (size_t)nk * sizeof(float),
                                      cudaMemcpyHostToDevice, st));
    GY_TRY(gy_cuda_embedding(c->xs.ptr, c->h.ptr, d_token_of, nk, n, hid, act, act, st));
    const int partitioned = m->expert_end - m->expert_begin < E;
    if (partitioned) {
        GY_FWD_CUDA_CHECK(cudaMemsetAsync(ys, 0, (size_t)(m->max_tp * nk * hid) * sizeof(float),
                                          st));
        for (int64_t s = 0; s < m->max_tp; s++)
            GY_TRY(gy_fwd_cuda_experts(c, m, w, ys + s * nk * hid, s, m->expert_begin,
                                       m->expert_end, l));
        GY_TRY(tp->all_reduce(tp->ctx, ys, m->max_tp * nk * hid));
    }
    for (int64_t j = 0; j < shards_here; j++) {
        const int64_t s = first_shard + j;
        const float *ys_s = partitioned ? ys + s * nk * hid : ys;
        if (!partitioned) GY_TRY(gy_fwd_cuda_experts(c, m, w, ys, s, 0, E, l));
        if (S > 0) {
            if (w->gate[s] == NULL || w->up[s] == NULL || w->down_t[s] == NULL)
                return GY_FAIL(GY_ERR_STATE, "layer %lld: the shared expert's shard %lld is not "
                               "held here", (long long)l, (long long)s);
            GY_TRY(gy_cuda_gemm(c->gu.ptr, act, 2 * S, c->h.ptr, act, hid, w->gate[s], act,
                                GY_GEMM_W_OUT_IN, NULL, n, hid, S, 0, blas));
            GY_TRY(gy_cuda_gemm((char *)c->gu.ptr + S * esz, act, 2 * S, c->h.ptr, act, hid,
                                w->up[s], act, GY_GEMM_W_OUT_IN, NULL, n, hid, S, 0, blas));
            GY_TRY(gy_cuda_silu_mul(c->g.ptr, c->gu.ptr, n, S, act, st));
            GY_TRY(gy_cuda_gemm(sh, F32, hid, c->g.ptr, act, S, w->down_t[s], act,
                                GY_GEMM_W_IN_OUT, NULL, n, S, hid, 0, blas));
        }
        GY_TRY(gy_cuda_moe_combine(c->o.ptr, ys_s, c->mw.ptr, d_slot_of, S > 0 ? sh : NULL,
                                   gated ? gate : NULL, n, k, hid, tp->rank == 0 || j > 0, st));
    }
    return GY_OK;
}

static gy_status gy_forward_cuda_layers(const gy_model *m, const gy_tp_group *tp, gy_kv_cache *kv,
                                        const gy_forward_batch *b, gy_forward_ws *ws,
                                        gy_threadpool *pool, int64_t first_layer,
                                        int64_t end_layer) {
    (void)pool; /* the work is on the worker's stream */
    const int64_t kv_first = gy_kv_config_of(kv)->first_layer;
    struct gy_forward_cuda_ws *c = ws->cuda;
    if (c == NULL || c->n_tokens != b->paged.n_tokens || c->stream != (cudaStream_t)m->stream)
        return GY_FAIL(GY_ERR_STATE, "gy_forward_layers before gy_forward_begin of this batch");
    GY_FWD_CUDA_CHECK(cudaSetDevice(m->device));
    gy_dtype kv_dtype = GY_DTYPE_F32; /* set by the call below; gcc cannot see it */
    GY_TRY(gy_fwd_cuda_kv_dtype(m, kv, &kv_dtype));
    const gy_dtype act = m->weight_dtype, F32 = GY_DTYPE_F32;
    const int64_t n = c->n_tokens, hid = m->hidden, D = m->head_dim, R = m->shard_rows;
    const int64_t esz = gy_dtype_size(act);
    const int64_t heads = m->n_heads / tp->size, kv_heads = m->n_kv_heads / tp->size;
    const int64_t q_rows = heads * D, kv_rows = kv_heads * D;
    const int64_t shards_here = m->max_tp / tp->size, first_shard = tp->rank * shards_here;
    const gy_kv_layout *layout = gy_kv_layout_of(kv);
    const float scale = 1.0f / sqrtf((float)D);
    const cudaStream_t st = c->stream;
    gy_cuda_blas *blas = c->blas;
    /* Rows [row, ...) of a row-major matrix whose rows hold `hidden` values. */
#define GY_ROWS(ptr, row) ((const void *)((const char *)(ptr) + (row) * hid * esz))
    for (int64_t l = first_layer; l < end_layer; l++) {
        const gy_layer_weights *w = &m->layers[l];
        void *layer_base = (void *)gy_kv_layer_address(kv, l - kv_first);

        /* Attention: this rank's heads only. */
        GY_TRY(gy_cuda_rmsnorm(c->h.ptr, c->x.ptr, w->attn_norm, n, hid, m->rms_eps, act, F32, st));
        GY_TRY(gy_cuda_gemm(c->q.ptr, act, q_rows, c->h.ptr, act, hid,
                            GY_ROWS(w->wq, tp->rank * q_rows), act, GY_GEMM_W_OUT_IN,
                            w->bq ? w->bq + tp->rank * q_rows : NULL, n, hid, q_rows, 0, blas));
        GY_TRY(gy_cuda_gemm(c->k.ptr, act, kv_rows, c->h.ptr, act, hid,
                            GY_ROWS(w->wk, tp->rank * kv_rows), act, GY_GEMM_W_OUT_IN,
                            w->bk ? w->bk + tp->rank * kv_rows : NULL, n, hid, kv_rows, 0, blas));
        GY_TRY(gy_cuda_gemm(c->v.ptr, act, kv_rows, c->h.ptr, act, hid,
                            GY_ROWS(w->wv, tp->rank * kv_rows), act, GY_GEMM_W_OUT_IN,
                            w->bv ? w->bv + tp->rank * kv_rows : NULL, n, hid, kv_rows, 0, blas));
        if (w->q_norm != NULL) { /* Qwen3: each head RMS-normed before the rotation */
            GY_TRY(gy_cuda_rmsnorm(c->q.ptr, c->q.ptr, w->q_norm, n * heads, D, m->rms_eps, act,
                                   F32, st));
            GY_TRY(gy_cuda_rmsnorm(c->k.ptr, c->k.ptr, w->k_norm, n * kv_heads, D, m->rms_eps, act,
                                   F32, st));
        }
        GY_TRY(gy_cuda_rope(c->q.ptr, c->k.ptr, c->d_token_pos, n, heads, kv_heads, D,
                            m->rope_inv_freq_dev, (float)m->rope_mscale, act, st));
        GY_TRY(gy_fwd_cuda_attention(c, m, b, layer_base, layout, kv_dtype, l, heads, scale));
        /* o_proj is row-parallel: this rank's heads' partial sum, onto the residual on rank 0. */
        GY_TRY(gy_fwd_cuda_residual_open(c, m, tp));
        GY_TRY(gy_cuda_gemm(c->o.ptr, F32, hid, c->attn.ptr, act, q_rows,
                            GY_ROWS(w->wo_t, tp->rank * q_rows), act, GY_GEMM_W_IN_OUT, NULL, n,
                            q_rows, hid, tp->rank == 0, blas));
        GY_TRY(gy_fwd_cuda_residual_close(c, m, tp));

        /* FFN: each shard's product accumulates onto o in fp32. */
        GY_TRY(gy_cuda_rmsnorm(c->h.ptr, c->x.ptr, w->ffn_norm, n, hid, m->rms_eps, act, F32, st));
        GY_TRY(gy_fwd_cuda_residual_open(c, m, tp));
        if (w->router != NULL)
            GY_TRY(gy_fwd_cuda_moe(c, m, w, tp, l, first_shard, shards_here));
        for (int64_t j = 0; j < shards_here && w->router == NULL; j++) {
            const int64_t s = first_shard + j;
            if (w->gate[s] == NULL || w->up[s] == NULL || w->down_t[s] == NULL)
                return GY_FAIL(GY_ERR_STATE, "layer %lld: FFN shard %lld is not held here",
                               (long long)l, (long long)s);
            /* gate and up side by side in one (n, 2R) buffer: silu_mul's fused layout. */
            GY_TRY(gy_cuda_gemm(c->gu.ptr, act, 2 * R, c->h.ptr, act, hid, w->gate[s], act,
                                GY_GEMM_W_OUT_IN, NULL, n, hid, R, 0, blas));
            GY_TRY(gy_cuda_gemm((char *)c->gu.ptr + R * esz, act, 2 * R, c->h.ptr, act, hid,
                                w->up[s], act, GY_GEMM_W_OUT_IN, NULL, n, hid, R, 0, blas));
            GY_TRY(gy_cuda_silu_mul(c->g.ptr, c->gu.ptr, n, R, act, st));
            GY_TRY(gy_cuda_gemm(c->o.ptr, F32, hid, c->g.ptr, act, R, w->down_t[s], act,
                                GY_GEMM_W_IN_OUT, NULL, n, R, hid, tp->rank == 0 || j > 0, blas));
        }
        GY_TRY(gy_fwd_cuda_residual_close(c, m, tp));
    }
#undef GY_ROWS
    return GY_OK;
}

static gy_status gy_forward_cuda_end(float *logits, const gy_model *m, const gy_forward_batch *b,
                                     gy_forward_ws *ws, gy_threadpool *pool) {
    (void)pool;
    struct gy_forward_cuda_ws *c = ws->cuda;
    if (c == NULL || c->n_tokens != b->paged.n_tokens || c->n_logits != b->n_logits)
        return GY_FAIL(GY_ERR_STATE, "gy_forward_end before gy_forward_begin of this batch");
    GY_FWD_CUDA_CHECK(cudaSetDevice(m->device));
    const int64_t nl = b->n_logits, hid = m->hidden, V = m->vocab;
    if (nl > 0) {
        const gy_dtype act = m->weight_dtype;
        /* The sampled rows, gathered (the embedding kernel with the rows as ids). */
        GY_TRY(gy_cuda_embedding(c->sel.ptr, c->x.ptr, c->d_logit_rows, nl, c->n_tokens, hid, act,
                                 act, c->stream));
        GY_TRY(gy_cuda_rmsnorm(c->sel.ptr, c->sel.ptr, m->final_norm, nl, hid, m->rms_eps, act,
                               GY_DTYPE_F32, c->stream));
        GY_TRY(gy_cuda_gemm(c->logits.ptr, GY_DTYPE_F32, V, c->sel.ptr, act, hid, m->lm_head, act,
                            GY_GEMM_W_OUT_IN, NULL, nl, hid, V, 0, c->blas));
        GY_FWD_CUDA_CHECK(cudaMemcpyAsync(logits, c->logits.ptr, (size_t)(nl * V) * sizeof(float),
                                          cudaMemcpyDeviceToHost, c->stream));
    }
    /* Also where an error a kernel hit while running surfaces. */
    GY_FWD_CUDA_CHECK(cudaStreamSynchronize(c->stream));
    return GY_OK;
}

/* x is in the activation dtype on the device: the hand-off copies its bytes, one copy when the
 * rows are contiguous and in order on both sides, a copy per row otherwise. */
static gy_status gy_forward_cuda_x_copy(const gy_model *m, gy_forward_ws *ws, void *host,
                                        size_t row_bytes, const int32_t *map, int64_t n, int in) {
    struct gy_forward_cuda_ws *c = ws->cuda;
    const size_t bytes = (size_t)(m->hidden * gy_dtype_size(m->weight_dtype));
    if (c == NULL || n > c->n_tokens || row_bytes < bytes)
        return GY_FAIL(GY_ERR_INVALID, "x_%s: %lld rows of %zu bytes for a step of %lld tokens "
                       "(rows of %zu)", in ? "in" : "out", (long long)n, row_bytes,
                       (long long)(c ? c->n_tokens : 0), bytes);
    GY_FWD_CUDA_CHECK(cudaSetDevice(m->device));
    const enum cudaMemcpyKind kind = in ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost;
    if (map == NULL && row_bytes == bytes) {
        void *dst = in ? c->x.ptr : host;
        const void *src = in ? (const void *)host : c->x.ptr;
        GY_FWD_CUDA_CHECK(cudaMemcpyAsync(dst, src, (size_t)n * bytes, kind, c->stream));
    } else {
        for (int64_t i = 0; i < n; i++) {
            char *h = (char *)host + (map ? map[i] : i) * row_bytes;
            char *d = (char *)c->x.ptr + i * bytes;
            GY_FWD_CUDA_CHECK(cudaMemcpyAsync(in ? (void *)d : (void *)h, in ? (const void *)h : d,
                                              bytes, kind, c->stream));
        }
    }
    /* The host buffer is the next stage's input (out) or may be rewritten by this step's other
     * groups once we return (in): the copies must be over. */
    GY_FWD_CUDA_CHECK(cudaStreamSynchronize(c->stream));
    return GY_OK;
}

static gy_status gy_forward_cuda_x_in(const gy_model *m, gy_forward_ws *ws, const void *host,
                                      size_t row_bytes, const int32_t *map, int64_t n) {
    return gy_forward_cuda_x_copy(m, ws, (void *)host, row_bytes, map, n, 1);
}

static gy_status gy_forward_cuda_x_out(const gy_model *m, gy_forward_ws *ws, void *host,
                                       size_t row_bytes, const int32_t *map, int64_t n) {
    return gy_forward_cuda_x_copy(m, ws, host, row_bytes, map, n, 0);
}

static void gy_forward_cuda_ws_release(gy_forward_ws *ws) {
    gy_forward_cuda_ws_free(ws->cuda);
    ws->cuda = NULL;
}

const gy_forward_backend gy_forward_cuda_backend = {
    .name = "cuda",
    .begin = gy_forward_cuda_begin,
    .layers = gy_forward_cuda_layers,
    .end = gy_forward_cuda_end,
    .x_in = gy_forward_cuda_x_in,
    .x_out = gy_forward_cuda_x_out,
    .ws_free = gy_forward_cuda_ws_release,
    .unavailable = gy_forward_cuda_unavailable,
};

#else /* the CUDA forward pass is not in this build */

#ifdef GY_WITH_CUDA
#define GY_FWD_CUDA_WHY                                                                            \
    "the CUDA forward pass is not in this build of gyges: csrc/kernels/kernels.h does not "       \
    "declare the paged-attention kernels it needs (gy_cuda_kv_write, "                             \
    "gy_cuda_paged_attention_decode/prefill)"
#else
#define GY_FWD_CUDA_WHY                                                                            \
    "the CUDA forward pass is not available: gyges was not built with CUDA (nvcc was not found "   \
    "at build time, or GYGES_CUDA=0)"
#endif

const char *gy_forward_cuda_unavailable(void) { return GY_FWD_CUDA_WHY; }

gy_status gy_forward_cuda_attach(gy_model *model, int32_t device) {
    (void)model;
    (void)device;
    return GY_FAIL(GY_ERR_UNAVAILABLE, "%s", GY_FWD_CUDA_WHY);
}

void gy_forward_cuda_detach(gy_model *model) { (void)model; }

void gy_forward_cuda_ws_free(struct gy_forward_cuda_ws *cws) { (void)cws; }

/* No parts: forward.c answers GY_ERR_UNAVAILABLE with the reason. */
const gy_forward_backend gy_forward_cuda_backend = {
    .name = "cuda",
    .unavailable = gy_forward_cuda_unavailable,
};

#endif
