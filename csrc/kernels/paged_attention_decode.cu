/* paged_attention_decode.cu: causal paged attention, one query token per work item, with the KV
 * length split into partitions whose partial results are reduced afterwards (flash-decoding), so
 * that one long sequence still spreads over the whole GPU. Correct for any batch (prefill chunks
 * too); the prefill kernel is the faster one when many query tokens of a sequence come together.
 *
 * Work item (one thread block of 4 warps): a query token t, a KV head g, a chunk of up to QH of
 * the query heads that share g (GQA: each K/V row is read once for all of them), and a partition
 * of positions [p * part_len, (p + 1) * part_len) of the token's 0..token_pos[t] (the last
 * partition also takes any rest, so a max_len that is too small costs speed, not correctness).
 *
 * Inside a work item the warps take turns over the positions, KW at a time, and never wait for
 * each other: each warp keeps its own online softmax (running maximum m, sum l, and the weighted
 * sum of V rows), and the four are merged once at the end. Within a warp, LPR lanes share one K/V
 * row (16-byte loads, one or two per lane), so a warp reads 32 / LPR rows at a time, U times per
 * step (GY_ATTN_ROWS rows) with all loads issued before any is used. Scores are dot products of the fp32 query with
 * the widened key in fp32, times `scale`; weights are expf(s - m).
 *
 * With one partition the work item writes the output itself; with more, it writes (m, l, sum) to
 * the workspace and gy_attn_combine_kernel merges the partitions of each (token, head) in
 * partition order: the result does not depend on timing (no atomics anywhere). */
#include "attention.cuh"

/* How the KV length is split: partitions of at least GY_ATTN_MIN_PART positions, enough of them
 * that (token, query head, partition) rows reach GY_ATTN_TARGET_ROWS (an H100 has 132 SMs; 4096
 * rows are >= 256 work items even with 8 query heads per KV head), at most GY_ATTN_MAX_PARTS. A
 * pure function of the arguments of gy_cuda_paged_attention_workspace_bytes, which uses it too. */
#define GY_ATTN_MIN_PART 128
#define GY_ATTN_TARGET_ROWS 4096
#define GY_ATTN_MAX_PARTS 256
#define GY_ATTN_WARPS 4
/* K/V rows a warp loads per step, all issued before any is used. Measured on an H200 (head_dim
 * 128, 32/8 heads, batch 64 x 4K context): f16/bf16 KV (two rows per load round) 43% of the copy
 * bandwidth at 4 rows, 41% at 8, 35% at 16; fp32 KV (one row per round) 48% at 2 rows, 58% at 4,
 * 52% at 8. GYGES_NVCC_FLAGS=-DGY_ATTN_ROWS=n tries another. */
#ifndef GY_ATTN_ROWS
#define GY_ATTN_ROWS 4
#endif

static int64_t gy_attn_parts(int64_t n_tokens, int64_t n_q_heads, int64_t max_len) {
    if (n_tokens <= 0 || n_q_heads <= 0 || max_len <= GY_ATTN_MIN_PART) return 1;
    const int64_t rows = n_tokens * n_q_heads;
    int64_t parts = (max_len + GY_ATTN_MIN_PART - 1) / GY_ATTN_MIN_PART;
    const int64_t wanted = (GY_ATTN_TARGET_ROWS + rows - 1) / rows;
    if (parts > wanted) parts = wanted;
    if (parts > GY_ATTN_MAX_PARTS) parts = GY_ATTN_MAX_PARTS;
    return parts < 1 ? 1 : parts;
}

extern "C" gy_status gy_cuda_paged_attention_check(gy_dtype act_dtype, const gy_kv_layout *layout,
                                                   gy_dtype kv_dtype, int64_t n_tokens,
                                                   int64_t n_seqs, int64_t n_q_heads,
                                                   int64_t max_len, float scale) {
    const char *what = "paged_attention";
    GY_TRY(gy_cuda_check_dtype(act_dtype, what));
    GY_TRY(gy_cuda_check_dtype(kv_dtype, what));
    GY_TRY(gy_cuda_check_layout(layout, what));
    if (layout->elem_size != gy_dtype_size(kv_dtype))
        return GY_FAIL(GY_ERR_INVALID,
                       "%s: the layout's elem_size=%lld does not match kv_dtype %s (%lld bytes)",
                       what, (long long)layout->elem_size, gy_dtype_name(kv_dtype),
                       (long long)gy_dtype_size(kv_dtype));
    if (layout->head_dim % 8 != 0 || layout->head_dim > GY_ATTN_MAX_HEAD_DIM)
        return GY_FAIL(GY_ERR_INVALID,
                       "%s: head_dim=%lld is not supported (a multiple of 8, at most %d)", what,
                       (long long)layout->head_dim, GY_ATTN_MAX_HEAD_DIM);
    if (n_tokens < 0 || n_seqs < 0 || n_tokens > INT32_MAX || n_seqs > INT32_MAX)
        return GY_FAIL(GY_ERR_INVALID, "%s: n_tokens=%lld and n_seqs=%lld must be in [0, 2^31)",
                       what, (long long)n_tokens, (long long)n_seqs);
    if (n_q_heads <= 0 || n_q_heads > 65536 || n_q_heads % layout->n_heads != 0)
        return GY_FAIL(GY_ERR_INVALID,
                       "%s: n_q_heads=%lld must be a positive multiple of the layout's %lld KV "
                       "heads (at most 65536)",
                       what, (long long)n_q_heads, (long long)layout->n_heads);
    if (!isfinite(scale))
        return GY_FAIL(GY_ERR_INVALID, "%s: scale=%g is not finite", what, (double)scale);
    if (n_tokens > 0 && (max_len < 1 || max_len > INT32_MAX))
        return GY_FAIL(GY_ERR_INVALID,
                       "%s: max_len=%lld must be in [1, 2^31) (an upper bound on token_pos + 1)",
                       what, (long long)max_len);
    return GY_OK;
}

extern "C" int64_t gy_cuda_paged_attention_workspace_bytes(int64_t n_tokens, int64_t n_q_heads,
                                                           int64_t head_dim, int64_t max_len) {
    if (n_tokens <= 0 || n_q_heads <= 0 || head_dim <= 0 || max_len <= 0) return 0;
    const int64_t parts = gy_attn_parts(n_tokens, n_q_heads, max_len);
    if (parts == 1) return 0; /* the work items write the output directly */
    /* per (token, head, partition): the unnormalised sum (head_dim floats), m and l */
    return n_tokens * n_q_heads * parts * (head_dim + 2) * (int64_t)sizeof(float);
}

/* out: (n_tokens, n_q_heads, D) act   q: same   layer: (layout) KV
 * ws_o: (n_tokens, n_q_heads, P, D) fp32   ws_ml: (n_tokens, n_q_heads, P, 2) fp32 (m, l)
 * Items: ((t * n_kv + g) * n_chunks + chunk) * P + p, grid-stride. */
template <typename KV, int D_MAX, int QH>
__global__ void __launch_bounds__(32 * GY_ATTN_WARPS)
    gy_attn_decode_kernel(void *__restrict__ out, float *__restrict__ ws_o,
                          float *__restrict__ ws_ml, const void *__restrict__ q, int act_dtype,
                          const void *__restrict__ layer, const gy_kv_layout L,
                          const int32_t *__restrict__ token_seq,
                          const int32_t *__restrict__ token_pos, int64_t n_tokens,
                          const int32_t *__restrict__ bt_indptr,
                          const int32_t *__restrict__ bt_indices, int64_t n_seqs,
                          int64_t n_q_heads, int64_t n_chunks, int64_t P, int64_t part_len,
                          float scale) {
    constexpr int NW = GY_ATTN_WARPS;
    constexpr int VEC = gy_attn_vec<KV>::n;            /* values per 16-byte load */
    constexpr int NCH_MAX = D_MAX / VEC;               /* 16-byte chunks of a row, at most */
    constexpr int LPR = NCH_MAX < 32 ? NCH_MAX : 32;   /* lanes sharing a row */
    constexpr int CPL = NCH_MAX / LPR;                 /* chunks per lane */
    constexpr int KPI = 32 / LPR;                      /* rows a warp reads at a time */
    constexpr int U = KPI < GY_ATTN_ROWS ? GY_ATTN_ROWS / KPI : 1; /* load rounds per step */
    constexpr int KW = KPI * U;                        /* rows a warp takes per step */
    static_assert(NCH_MAX % LPR == 0 && 32 % LPR == 0, "D_MAX must be a power of two >= VEC");

    __shared__ float sh_acc[NW][QH][D_MAX];
    __shared__ float sh_m[NW][QH], sh_l[NW][QH];

    const int D = (int)L.head_dim, NCH = D / VEC;
    const int lane = threadIdx.x % 32, w = threadIdx.x / 32;
    const int sl = lane % LPR, kk = lane / LPR; /* lane within its row, row within the warp */
    const int64_t n_kv = L.n_heads, G = n_q_heads / n_kv;
    const int64_t items = n_tokens * n_kv * n_chunks * P;

    for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
        const int64_t p = item % P;
        int64_t r = item / P;
        const int64_t chunk = r % n_chunks;
        r /= n_chunks;
        const int64_t g = r % n_kv;
        const int64_t t = r / n_kv;
        const int64_t h0 = g * G + chunk * QH;
        const int nh = (int)(G - chunk * QH < QH ? G - chunk * QH : QH);

        const gy_attn_seq s =
            gy_attn_seq_of(t, token_seq, token_pos, bt_indptr, bt_indices, n_seqs);
        const int64_t kbeg = p * part_len;
        int64_t kend = p == P - 1 ? s.len : kbeg + part_len;
        if (kend > s.len) kend = s.len;

        /* this lane's chunks of the query rows */
        float qv[QH][CPL][VEC], acc[QH][CPL][VEC], m[QH], l[QH];
#pragma unroll
        for (int i = 0; i < QH; i++) {
            m[i] = -INFINITY;
            l[i] = 0.0f;
#pragma unroll
            for (int ci = 0; ci < CPL; ci++) {
                const int c = sl + LPR * ci;
#pragma unroll
                for (int e = 0; e < VEC; e++) {
                    acc[i][ci][e] = 0.0f;
                    qv[i][ci][e] = i < nh && c < NCH
                                       ? gy_attn_load_act(q, act_dtype,
                                                          ((t * n_q_heads + h0 + i) * D) +
                                                              c * VEC + e)
                                       : 0.0f;
                }
            }
        }

        for (int64_t base = kbeg + (int64_t)w * KW; base < kend; base += (int64_t)NW * KW) {
            /* issue every load of the step first */
            uint4 kraw[U][CPL], vraw[U][CPL];
            bool ok[U];
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int64_t j = base + u * KPI + kk;
                int32_t slot = 0;
                const int64_t block = j < kend ? gy_attn_block(s, L, (int32_t)j, &slot) : -1;
                ok[u] = block >= 0;
                const int64_t koff = ok[u] ? gy_kv_layout_offset(&L, 0, block, slot, g) : 0;
                const int64_t voff = ok[u] ? gy_kv_layout_offset(&L, 1, block, slot, g) : 0;
#pragma unroll
                for (int ci = 0; ci < CPL; ci++) {
                    const int c = sl + LPR * ci;
                    const bool load = ok[u] && c < NCH;
                    kraw[u][ci] = load ? gy_attn_load16<KV>(layer, koff + c * VEC)
                                       : make_uint4(0, 0, 0, 0);
                    vraw[u][ci] = load ? gy_attn_load16<KV>(layer, voff + c * VEC)
                                       : make_uint4(0, 0, 0, 0);
                }
            }
            /* scores: partial dot products, then a sum over the LPR lanes of the row */
            float sc[U][QH];
#pragma unroll
            for (int u = 0; u < U; u++) {
                float kf[CPL][VEC];
#pragma unroll
                for (int ci = 0; ci < CPL; ci++) gy_attn_unpack(kraw[u][ci], kf[ci], KV());
#pragma unroll
                for (int i = 0; i < QH; i++) {
                    float d = 0.0f;
#pragma unroll
                    for (int ci = 0; ci < CPL; ci++)
#pragma unroll
                        for (int e = 0; e < VEC; e++) d = fmaf(qv[i][ci][e], kf[ci][e], d);
#pragma unroll
                    for (int off = LPR / 2; off > 0; off /= 2)
                        d += __shfl_xor_sync(0xffffffffu, d, off);
                    sc[u][i] = ok[u] ? d * scale : -INFINITY;
                }
            }
            /* online softmax over the warp's KW rows of this step: the maximum and the sum of
             * the weights over the whole warp (every lane of a row holds its scores) */
            float pw[U][QH];
#pragma unroll
            for (int i = 0; i < QH; i++) {
                float mt = sc[0][i];
#pragma unroll
                for (int u = 1; u < U; u++) mt = fmaxf(mt, sc[u][i]);
#pragma unroll
                for (int off = 16; off >= LPR; off /= 2)
                    mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, off));
                const float m_new = fmaxf(m[i], mt);
                const float alpha = gy_attn_weight(m[i], m_new);
                float psum = 0.0f;
#pragma unroll
                for (int u = 0; u < U; u++) {
                    pw[u][i] = gy_attn_weight(sc[u][i], m_new);
                    psum += pw[u][i];
                }
#pragma unroll
                for (int off = 16; off >= LPR; off /= 2)
                    psum += __shfl_xor_sync(0xffffffffu, psum, off);
                l[i] = l[i] * alpha + psum;
                m[i] = m_new;
#pragma unroll
                for (int ci = 0; ci < CPL; ci++)
#pragma unroll
                    for (int e = 0; e < VEC; e++) acc[i][ci][e] *= alpha;
            }
            /* each lane adds its chunks of its own rows' V, weighted */
#pragma unroll
            for (int u = 0; u < U; u++) {
                float vf[CPL][VEC];
#pragma unroll
                for (int ci = 0; ci < CPL; ci++) gy_attn_unpack(vraw[u][ci], vf[ci], KV());
#pragma unroll
                for (int i = 0; i < QH; i++)
#pragma unroll
                    for (int ci = 0; ci < CPL; ci++)
#pragma unroll
                        for (int e = 0; e < VEC; e++)
                            acc[i][ci][e] = fmaf(pw[u][i], vf[ci][e], acc[i][ci][e]);
            }
        }

        /* the warp's rows were spread over its KPI row groups: add them up (same m) */
#pragma unroll
        for (int i = 0; i < QH; i++)
#pragma unroll
            for (int ci = 0; ci < CPL; ci++)
#pragma unroll
                for (int e = 0; e < VEC; e++)
#pragma unroll
                    for (int off = 16; off >= LPR; off /= 2)
                        acc[i][ci][e] += __shfl_xor_sync(0xffffffffu, acc[i][ci][e], off);
        if (kk == 0) {
#pragma unroll
            for (int i = 0; i < QH; i++)
#pragma unroll
                for (int ci = 0; ci < CPL; ci++) {
                    const int c = sl + LPR * ci;
                    if (c < NCH)
#pragma unroll
                        for (int e = 0; e < VEC; e++) sh_acc[w][i][c * VEC + e] = acc[i][ci][e];
                }
        }
        if (lane == 0)
#pragma unroll
            for (int i = 0; i < QH; i++) {
                sh_m[w][i] = m[i];
                sh_l[w][i] = l[i];
            }
        __syncthreads();

        /* merge the warps, in warp order */
        for (int idx = threadIdx.x; idx < nh * D; idx += blockDim.x) {
            const int i = idx / D, d = idx % D;
            float M = -INFINITY;
#pragma unroll
            for (int v = 0; v < NW; v++) M = fmaxf(M, sh_m[v][i]);
            float o = 0.0f, lsum = 0.0f;
#pragma unroll
            for (int v = 0; v < NW; v++) {
                const float f = gy_attn_weight(sh_m[v][i], M);
                o = fmaf(f, sh_acc[v][i][d], o);
                lsum = fmaf(f, sh_l[v][i], lsum);
            }
            const int64_t row = t * n_q_heads + h0 + i;
            if (P == 1) {
                gy_attn_store_act(out, act_dtype, row * D + d, lsum > 0.0f ? o / lsum : 0.0f);
            } else {
                ws_o[(row * P + p) * D + d] = o;
                if (d == 0) {
                    ws_ml[(row * P + p) * 2] = M;
                    ws_ml[(row * P + p) * 2 + 1] = lsum;
                }
            }
        }
        __syncthreads(); /* the shared arrays are rewritten by the next item */
    }
}

/* out (rows = n_tokens * n_q_heads, D) act <- the P partitions of each row, in order. */
__global__ void __launch_bounds__(128)
    gy_attn_combine_kernel(void *__restrict__ out, int act_dtype, const float *__restrict__ ws_o,
                           const float *__restrict__ ws_ml, int64_t rows, int64_t P, int D) {
    __shared__ float weight[GY_ATTN_MAX_PARTS];
    __shared__ float total;
    for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
        const float *ml = ws_ml + row * P * 2;
        float M = -INFINITY;
        for (int64_t p = 0; p < P; p++) M = fmaxf(M, ml[2 * p]);
        for (int64_t p = threadIdx.x; p < P; p += blockDim.x) weight[p] = gy_attn_weight(ml[2 * p], M);
        __syncthreads();
        if (threadIdx.x == 0) {
            float lsum = 0.0f;
            for (int64_t p = 0; p < P; p++) lsum = fmaf(weight[p], ml[2 * p + 1], lsum);
            total = lsum;
        }
        __syncthreads();
        const float lsum = total;
        for (int d = threadIdx.x; d < D; d += blockDim.x) {
            float o = 0.0f;
            for (int64_t p = 0; p < P; p++) o = fmaf(weight[p], ws_o[(row * P + p) * D + d], o);
            gy_attn_store_act(out, act_dtype, row * D + d, lsum > 0.0f ? o / lsum : 0.0f);
        }
        __syncthreads(); /* weight and total are rewritten by the next row */
    }
}

template <typename KV, int D_MAX, int QH>
static gy_status gy_attn_decode_launch(void *out, const void *q, gy_dtype act_dtype,
                                       const void *layer, const gy_kv_layout &L,
                                       const int32_t *token_seq, const int32_t *token_pos,
                                       int64_t n_tokens, const int32_t *bt_indptr,
                                       const int32_t *bt_indices, int64_t n_seqs,
                                       int64_t n_q_heads, int64_t max_len, float scale,
                                       void *workspace, cudaStream_t stream) {
    const int64_t G = n_q_heads / L.n_heads;
    const int64_t n_chunks = (G + QH - 1) / QH;
    const int64_t P = gy_attn_parts(n_tokens, n_q_heads, max_len);
    const int64_t part_len = (max_len + P - 1) / P;
    const int64_t rows = n_tokens * n_q_heads;
    float *ws_o = P > 1 ? (float *)workspace : NULL;
    float *ws_ml = P > 1 ? ws_o + rows * P * L.head_dim : NULL;
    const int64_t items = n_tokens * L.n_heads * n_chunks * P;
    gy_attn_decode_kernel<KV, D_MAX, QH>
        <<<gy_cuda_blocks(items, 1), 32 * GY_ATTN_WARPS, 0, stream>>>(
            out, ws_o, ws_ml, q, (int)act_dtype, layer, L, token_seq, token_pos, n_tokens,
            bt_indptr, bt_indices, n_seqs, n_q_heads, n_chunks, P, part_len, scale);
    GY_CUDA_CHECK_LAUNCH("gy_attn_decode_kernel");
    if (P > 1) {
        gy_attn_combine_kernel<<<gy_cuda_blocks(rows, 1), 128, 0, stream>>>(
            out, (int)act_dtype, ws_o, ws_ml, rows, P, (int)L.head_dim);
        GY_CUDA_CHECK_LAUNCH("gy_attn_combine_kernel");
    }
    return GY_OK;
}

/* The query heads one work item serves: all of a KV head's group when it is small (each K/V row
 * is then read once), at most 8 (registers: 2 * QH * 8 floats per lane). */
template <typename KV, int D_MAX>
static gy_status gy_attn_decode_dispatch_qh(int64_t group, void *out, const void *q,
                                            gy_dtype act_dtype, const void *layer,
                                            const gy_kv_layout &L, const int32_t *token_seq,
                                            const int32_t *token_pos, int64_t n_tokens,
                                            const int32_t *bt_indptr, const int32_t *bt_indices,
                                            int64_t n_seqs, int64_t n_q_heads, int64_t max_len,
                                            float scale, void *workspace, cudaStream_t stream) {
#define GY_ATTN_DECODE_QH(QH)                                                                      \
    return gy_attn_decode_launch<KV, D_MAX, QH>(out, q, act_dtype, layer, L, token_seq,            \
                                                 token_pos, n_tokens, bt_indptr, bt_indices,       \
                                                 n_seqs, n_q_heads, max_len, scale, workspace,     \
                                                 stream)
    if (group == 1) GY_ATTN_DECODE_QH(1);
    if (group == 2) GY_ATTN_DECODE_QH(2);
    if (group <= 4) GY_ATTN_DECODE_QH(4);
    GY_ATTN_DECODE_QH(8);
#undef GY_ATTN_DECODE_QH
}

extern "C" gy_status gy_cuda_paged_attention_decode(
    void *out, const void *q, gy_dtype act_dtype, const void *layer_base,
    const gy_kv_layout *layout, gy_dtype kv_dtype, const int32_t *token_seq,
    const int32_t *token_pos, int64_t n_tokens, const int32_t *bt_indptr,
    const int32_t *bt_indices, int64_t n_seqs, int64_t n_q_heads, int64_t max_len, float scale,
    void *workspace, int64_t workspace_bytes, gy_cuda_stream stream) {
    GY_TRY(gy_cuda_paged_attention_check(act_dtype, layout, kv_dtype, n_tokens, n_seqs, n_q_heads,
                                         max_len, scale));
    if (n_tokens == 0) return GY_OK;
    GY_TRY(gy_attn_check_pointers("paged_attention_decode", out, q, layer_base, token_seq,
                                  token_pos, bt_indptr, bt_indices, n_seqs));
    const int64_t need =
        gy_cuda_paged_attention_workspace_bytes(n_tokens, n_q_heads, layout->head_dim, max_len);
    if (need > 0 && (workspace == NULL || workspace_bytes < need))
        return GY_FAIL(GY_ERR_INVALID,
                       "paged_attention_decode: the workspace has %lld bytes at %p, %lld needed "
                       "(gy_cuda_paged_attention_workspace_bytes)",
                       (long long)workspace_bytes, workspace, (long long)need);
    if (need > 0 && (uintptr_t)workspace % sizeof(float) != 0)
        return GY_FAIL(GY_ERR_INVALID, "paged_attention_decode: workspace %p is not 4-byte aligned",
                       workspace);
    const int64_t group = n_q_heads / layout->n_heads;
    const int64_t d = layout->head_dim;
#define GY_ATTN_DECODE_D(D_MAX)                                                                    \
    return gy_attn_decode_dispatch_qh<KV, D_MAX>(group, out, q, act_dtype, layer_base, *layout,    \
                                                 token_seq, token_pos, n_tokens, bt_indptr,        \
                                                 bt_indices, n_seqs, n_q_heads, max_len, scale,    \
                                                 workspace, stream)
    GY_CUDA_DISPATCH_DTYPE(kv_dtype, KV, {
        if (d <= 64) GY_ATTN_DECODE_D(64);
        if (d <= 128) GY_ATTN_DECODE_D(128);
        GY_ATTN_DECODE_D(256);
    });
#undef GY_ATTN_DECODE_D
    return GY_OK; /* not reached */
}
