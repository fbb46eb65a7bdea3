/* paged_attention_prefill.cu: causal paged attention for tiles of query tokens that share their
 * sequence's K/V: a prefill chunk, or any batch (a tile whose tokens belong to several sequences
 * is done one sequence at a time, so a decode batch is correct here too, only slower than with
 * paged_attention_decode.cu).
 *
 * Work item (one thread block of 4 warps): BQ = 32 consecutive tokens of the batch and one query
 * head h (KV head g = h / (n_q_heads / n_kv_heads)). The tile's queries, widened to fp32, stay in
 * shared memory; for each sequence among the tile's tokens (a "round"), its K/V rows 0..(largest
 * position of those tokens) are brought into shared memory BK = 32 positions at a time (widened to
 * fp32, through gy_kv_layout_offset) and every query of the round is scored against the tile:
 *   scores   warp w owns rows w, w + 4, ..., w + 28 and lane c position c of the tile, so a row's 32
 *            scores lie across one warp: its maximum and sum are warp shuffles, no barrier;
 *   softmax  online, per row: m, l and the output accumulator are rescaled by expf(m - m_new);
 *   P @ V    lane c accumulates columns c, c + 32, ... of its warp's 8 rows, reading the weights
 *            from shared memory (broadcast) and V rows (consecutive words, no bank conflicts).
 * The key rows are padded to head_dim + 4 floats, so the float4 reads of 8 lanes fall in
 * distinct banks. Arithmetic is fp32 on CUDA cores (no tensor cores): exact enough to be checked
 * at fp32 tolerance against the CPU backend, and simple; the decode kernel is the tuned one. */
#include "attention.cuh"

#define GY_PREFILL_BQ 32 /* query tokens per tile; one lane per key position needs BK = 32 too */
#define GY_PREFILL_BK 32
#define GY_PREFILL_WARPS 4
#define GY_PREFILL_ROWS (GY_PREFILL_BQ / GY_PREFILL_WARPS) /* rows per warp */

/* Dynamic shared memory of a tile: Q (BQ x D), K (BK x (D + 4)), V (BK x D), P (BQ x BK) floats,
 * then the tile's sequence ids and positions and the key positions' validity. */
static size_t gy_prefill_smem(int64_t D) {
    return sizeof(float) * (size_t)(GY_PREFILL_BQ * D + GY_PREFILL_BK * (D + 4) +
                                    GY_PREFILL_BK * D + GY_PREFILL_BQ * GY_PREFILL_BK) +
           sizeof(int32_t) * (2 * GY_PREFILL_BQ + GY_PREFILL_BK);
}

/* out, q: (n_tokens, n_q_heads, D) act   layer: (layout) KV
 * Items: tile * n_q_heads + h, grid-stride. */
template <typename KV, int D_MAX>
__global__ void __launch_bounds__(32 * GY_PREFILL_WARPS)
    gy_attn_prefill_kernel(void *__restrict__ out, const void *__restrict__ q, int act_dtype,
                           const void *__restrict__ layer, const gy_kv_layout L,
                           const int32_t *__restrict__ token_seq,
                           const int32_t *__restrict__ token_pos, int64_t n_tokens,
                           const int32_t *__restrict__ bt_indptr,
                           const int32_t *__restrict__ bt_indices, int64_t n_seqs,
                           int64_t n_q_heads, float scale) {
    constexpr int BQ = GY_PREFILL_BQ, BK = GY_PREFILL_BK, NW = GY_PREFILL_WARPS;
    constexpr int RW = GY_PREFILL_ROWS, NCOL = D_MAX / 32, VEC = gy_attn_vec<KV>::n;
    static_assert(BK == 32, "one lane per key position of a tile");

    extern __shared__ float4 gy_prefill_smem_f4[]; /* float4: 16-byte alignment for the rows */
    const int D = (int)L.head_dim, DK = D + 4, NCH = D / VEC;
    float *sQ = (float *)gy_prefill_smem_f4; /* [BQ][D] */
    float *sK = sQ + BQ * D;                 /* [BK][DK] */
    float *sV = sK + BK * DK;                /* [BK][D] */
    float *sP = sV + BK * D;                 /* [BQ][BK] */
    int32_t *sSeq = (int32_t *)(sP + BQ * BK); /* [BQ]: sequence, -1 stale, -2 past the batch */
    int32_t *sPos = sSeq + BQ;                 /* [BQ] */
    int32_t *sKeyOk = sPos + BQ;               /* [BK] */

    const int lane = threadIdx.x % 32, w = threadIdx.x / 32;
    const int64_t n_kv = L.n_heads, G = n_q_heads / n_kv;
    const int64_t n_tiles = (n_tokens + BQ - 1) / BQ;
    const int64_t items = n_tiles * n_q_heads;

    for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
        const int64_t h = item % n_q_heads, t0 = (item / n_q_heads) * BQ;
        const int64_t g = h / G;
        for (int r = threadIdx.x; r < BQ; r += blockDim.x) {
            const int64_t t = t0 + r;
            int32_t seq = -2, pos = 0;
            if (t < n_tokens) {
                seq = token_seq[t];
                pos = token_pos[t];
                if (seq < 0 || seq >= n_seqs || pos < 0 || pos == INT32_MAX) seq = -1;
            }
            sSeq[r] = seq;
            sPos[r] = pos;
        }
        for (int idx = threadIdx.x; idx < BQ * D; idx += blockDim.x) {
            const int r = idx / D, d = idx % D;
            const int64_t t = t0 + r;
            sQ[idx] = t < n_tokens ? gy_attn_load_act(q, act_dtype, (t * n_q_heads + h) * D + d)
                                   : 0.0f;
        }
        __syncthreads();

        /* rows done: past the batch, or stale (their output is zeros) */
        uint32_t done = 0;
        for (int r = 0; r < BQ; r++)
            if (sSeq[r] < 0) done |= 1u << r;
#pragma unroll
        for (int i = 0; i < RW; i++) {
            const int r = w + NW * i;
            if (sSeq[r] == -1)
                for (int d = lane; d < D; d += 32)
                    gy_attn_store_act(out, act_dtype, ((t0 + r) * n_q_heads + h) * D + d, 0.0f);
        }

        while (done != 0xffffffffu) { /* one round per sequence among the tile's tokens */
            const int r0 = __ffs(~done) - 1;
            const int32_t seq = sSeq[r0];
            uint32_t active = 0;
            int32_t kmax = 0;
            for (int r = 0; r < BQ; r++)
                if (!(done >> r & 1) && sSeq[r] == seq) {
                    active |= 1u << r;
                    kmax = max(kmax, sPos[r] + 1);
                }
            gy_attn_seq s;
            s.blocks = bt_indices + bt_indptr[seq];
            s.owned = bt_indptr[seq + 1] - bt_indptr[seq];
            s.len = kmax;

            float m[RW], l[RW], acc[RW][NCOL];
            int32_t mypos[RW];
            bool myrow[RW];
#pragma unroll
            for (int i = 0; i < RW; i++) {
                const int r = w + NW * i;
                myrow[i] = active >> r & 1;
                mypos[i] = sPos[r];
                m[i] = -INFINITY;
                l[i] = 0.0f;
#pragma unroll
                for (int k = 0; k < NCOL; k++) acc[i][k] = 0.0f;
            }

            for (int32_t kb = 0; kb < kmax; kb += BK) {
                __syncthreads(); /* the previous tile's K, V and P are no longer read */
                for (int idx = threadIdx.x; idx < BK * NCH; idx += blockDim.x) {
                    const int c = idx / NCH, ch = idx % NCH;
                    const int32_t j = kb + c;
                    int32_t slot = 0;
                    const int64_t block = j < kmax ? gy_attn_block(s, L, j, &slot) : -1;
                    float kf[VEC], vf[VEC];
                    if (block >= 0) {
                        gy_attn_unpack(gy_attn_load16<KV>(
                                           layer, gy_kv_layout_offset(&L, 0, block, slot, g) +
                                                      ch * VEC),
                                       kf, KV());
                        gy_attn_unpack(gy_attn_load16<KV>(
                                           layer, gy_kv_layout_offset(&L, 1, block, slot, g) +
                                                      ch * VEC),
                                       vf, KV());
                    } else {
#pragma unroll
                        for (int e = 0; e < VEC; e++) kf[e] = vf[e] = 0.0f;
                    }
#pragma unroll
                    for (int e = 0; e < VEC; e += 4) {
                        *(float4 *)&sK[c * DK + ch * VEC + e] =
                            make_float4(kf[e], kf[e + 1], kf[e + 2], kf[e + 3]);
                        *(float4 *)&sV[c * D + ch * VEC + e] =
                            make_float4(vf[e], vf[e + 1], vf[e + 2], vf[e + 3]);
                    }
                    if (ch == 0) sKeyOk[c] = block >= 0;
                }
                __syncthreads();

                /* scores of the warp's rows against key position kb + lane */
                float sc[RW];
#pragma unroll
                for (int i = 0; i < RW; i++) sc[i] = 0.0f;
                const float *krow = sK + lane * DK;
                for (int d = 0; d < D; d += 4) {
                    const float4 k4 = *(const float4 *)&krow[d];
#pragma unroll
                    for (int i = 0; i < RW; i++) {
                        const float4 q4 = *(const float4 *)&sQ[(w + NW * i) * D + d];
                        sc[i] = fmaf(q4.x, k4.x, sc[i]);
                        sc[i] = fmaf(q4.y, k4.y, sc[i]);
                        sc[i] = fmaf(q4.z, k4.z, sc[i]);
                        sc[i] = fmaf(q4.w, k4.w, sc[i]);
                    }
                }
                const int32_t j = kb + lane;
                const bool key_ok = sKeyOk[lane] != 0;
#pragma unroll
                for (int i = 0; i < RW; i++) {
                    const float s_ij =
                        myrow[i] && key_ok && j <= mypos[i] ? sc[i] * scale : -INFINITY;
                    float mt = s_ij;
#pragma unroll
                    for (int off = 16; off > 0; off /= 2)
                        mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, off));
                    const float m_new = fmaxf(m[i], mt);
                    const float alpha = gy_attn_weight(m[i], m_new);
                    const float p = gy_attn_weight(s_ij, m_new);
                    float psum = p;
#pragma unroll
                    for (int off = 16; off > 0; off /= 2)
                        psum += __shfl_xor_sync(0xffffffffu, psum, off);
                    l[i] = l[i] * alpha + psum;
                    m[i] = m_new;
#pragma unroll
                    for (int k = 0; k < NCOL; k++) acc[i][k] *= alpha;
                    sP[(w + NW * i) * BK + lane] = p;
                }
                __syncwarp(); /* the warp's rows of P are read by the whole warp */

                for (int c = 0; c < BK; c += 4) {
                    float4 p4[RW];
#pragma unroll
                    for (int i = 0; i < RW; i++) p4[i] = *(const float4 *)&sP[(w + NW * i) * BK + c];
#pragma unroll
                    for (int k = 0; k < NCOL; k++) {
                        const int d = lane + 32 * k;
                        if (d < D) {
                            const float v0 = sV[(c + 0) * D + d], v1 = sV[(c + 1) * D + d];
                            const float v2 = sV[(c + 2) * D + d], v3 = sV[(c + 3) * D + d];
#pragma unroll
                            for (int i = 0; i < RW; i++) {
                                acc[i][k] = fmaf(p4[i].x, v0, acc[i][k]);
                                acc[i][k] = fmaf(p4[i].y, v1, acc[i][k]);
                                acc[i][k] = fmaf(p4[i].z, v2, acc[i][k]);
                                acc[i][k] = fmaf(p4[i].w, v3, acc[i][k]);
                            }
                        }
                    }
                }
            }

#pragma unroll
            for (int i = 0; i < RW; i++) {
                if (!myrow[i]) continue;
                const int64_t row = (t0 + w + NW * i) * n_q_heads + h;
#pragma unroll
                for (int k = 0; k < NCOL; k++) {
                    const int d = lane + 32 * k;
                    if (d < D)
                        gy_attn_store_act(out, act_dtype, row * D + d,
                                          l[i] > 0.0f ? acc[i][k] / l[i] : 0.0f);
                }
            }
            done |= active;
        }
        __syncthreads(); /* the shared arrays are rewritten by the next item */
    }
}

template <typename KV, int D_MAX>
static gy_status gy_attn_prefill_launch(void *out, const void *q, gy_dtype act_dtype,
                                        const void *layer, const gy_kv_layout &L,
                                        const int32_t *token_seq, const int32_t *token_pos,
                                        int64_t n_tokens, const int32_t *bt_indptr,
                                        const int32_t *bt_indices, int64_t n_seqs,
                                        int64_t n_q_heads, float scale, cudaStream_t stream) {
    const size_t smem = gy_prefill_smem(L.head_dim);
    GY_CUDA_CHECK(cudaFuncSetAttribute(gy_attn_prefill_kernel<KV, D_MAX>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    const int64_t items = (n_tokens + GY_PREFILL_BQ - 1) / GY_PREFILL_BQ * n_q_heads;
    gy_attn_prefill_kernel<KV, D_MAX>
        <<<gy_cuda_blocks(items, 1), 32 * GY_PREFILL_WARPS, smem, stream>>>(
            out, q, (int)act_dtype, layer, L, token_seq, token_pos, n_tokens, bt_indptr,
            bt_indices, n_seqs, n_q_heads, scale);
    GY_CUDA_CHECK_LAUNCH("gy_attn_prefill_kernel");
    return GY_OK;
}

extern "C" gy_status gy_cuda_paged_attention_prefill(
    void *out, const void *q, gy_dtype act_dtype, const void *layer_base,
    const gy_kv_layout *layout, gy_dtype kv_dtype, const int32_t *token_seq,
    const int32_t *token_pos, int64_t n_tokens, const int32_t *bt_indptr,
    const int32_t *bt_indices, int64_t n_seqs, int64_t n_q_heads, int64_t max_len, float scale,
    void *workspace, int64_t workspace_bytes, gy_cuda_stream stream) {
    (void)workspace; /* the same signature as the decode kernel; a tile needs no scratch */
    (void)workspace_bytes;
    GY_TRY(gy_cuda_paged_attention_check(act_dtype, layout, kv_dtype, n_tokens, n_seqs, n_q_heads,
                                         max_len, scale));
    if (n_tokens == 0) return GY_OK;
    GY_TRY(gy_attn_check_pointers("paged_attention_prefill", out, q, layer_base, token_seq,
                                  token_pos, bt_indptr, bt_indices, n_seqs));
    const int64_t d = layout->head_dim;
#define GY_ATTN_PREFILL_D(D_MAX)                                                                   \
    return gy_attn_prefill_launch<KV, D_MAX>(out, q, act_dtype, layer_base, *layout, token_seq,    \
                                             token_pos, n_tokens, bt_indptr, bt_indices, n_seqs,   \
                                             n_q_heads, scale, stream)
    GY_CUDA_DISPATCH_DTYPE(kv_dtype, KV, {
        if (d <= 64) GY_ATTN_PREFILL_D(64);
        if (d <= 128) GY_ATTN_PREFILL_D(128);
        GY_ATTN_PREFILL_D(256);
    });
#undef GY_ATTN_PREFILL_D
    return GY_OK; /* not reached */
}
