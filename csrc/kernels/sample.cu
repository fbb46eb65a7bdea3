/* sample.cu: the next token of each row of logits, on the device, with the algorithm, the order of
 * operations and the counter-based random stream of csrc/sched/sampler.c (read its header first):
 *
 *   greedy (temperature 0): the lowest index of the largest logit (argmax.cu's rule);
 *   otherwise, with m the largest logit and t the temperature, in double:
 *     w_i = exp(((double)x_i - m) / t);  min-p: w_i = 0 where w_i < min_p;
 *     top-k: keep the k smallest keys, key = (logit descending, index ascending) as 64 bits;
 *     top-p: among the kept tokens with w_i > 0.5 (1 - top_p) z / kept (z: their sum of w), the
 *            shortest prefix in key order whose sum reaches top_p * z;
 *     draw:  u = Philox4x32-10 uniform of (seed, token_index, GY_RNG_STREAM_SAMPLE), then the
 *            first token in index order whose running sum of kept w exceeds u * (sum of kept w),
 *            or the last kept token when rounding leaves u * sum above every running sum.
 * One thread block per row. Keys and counts are integers, so top-k is exact: a radix select on
 * the keys, 8 bits per pass (shared-memory histograms). top-p is a weighted radix select, 4 bits
 * per pass: every thread keeps 16 per-digit sums in registers, reduced in a fixed order.
 *
 * Where the GPU can differ from the CPU (fp32 logits; fp16/bf16 logits are widened exactly and
 * behave as the same values in fp32 would on the CPU):
 *   - the CPU sums w sequentially (the total and the draw's running sum in index order, the
 *     top-p sum in key order); here the same terms are summed in a fixed tree order. The sums
 *     differ by a few units in the last place of a double (~1e-16 relative), so a draw differs
 *     only when u * total falls within that distance of a token boundary, and a top-p set only
 *     when a prefix sum lies that close to top_p * z: probability ~1e-13 per row;
 *   - exp() of CUDA and of the host libm are both within 1 ulp, not always the same ulp: a w_i
 *     may differ in its last bit, with the same (tiny) consequences, and min-p differs only when
 *     w_i is within an ulp of min_p.
 * Everything else (greedy, the top-k set, the random number, the tie rules) is bit-identical.
 * Results never depend on timing: there are no floating-point atomics.
 *
 * The CPU sampler refuses a row with a NaN or +inf logit, with only -inf logits, or with
 * parameters out of range (gy_sampler_check); here such a row gets the token -1 (the parameters
 * live on the device: check them on the host before copying them, as the Python entry point
 * does). So does a sampled row when no workspace was given. */
#include <math.h>

#include "../core/rng.h"
#include "common.cuh"

#define GY_SAMPLE_THREADS 512
#define GY_SAMPLE_WARPS (GY_SAMPLE_THREADS / 32)
/* Rows in flight at once; each thread block keeps its row's w (vocab doubles) in the workspace. */
#define GY_SAMPLE_MAX_BLOCKS 128

extern "C" int64_t gy_cuda_sample_workspace_bytes(int64_t rows, int64_t vocab) {
    if (rows <= 0 || vocab <= 0) return 0;
    const int64_t blocks = rows < GY_SAMPLE_MAX_BLOCKS ? rows : GY_SAMPLE_MAX_BLOCKS;
    return blocks * vocab * (int64_t)sizeof(double);
}

/* ---- what sampler.c and rng.c compute, on the device ---- */

/* rng.c's gy_rng_uniform: Philox4x32-10 of counter (index, stream, 0), key seed. */
__device__ __forceinline__ double gy_sample_uniform(uint64_t seed, int64_t index,
                                                    uint32_t stream) {
    const uint64_t i = (uint64_t)index;
    uint32_t c0 = (uint32_t)i, c1 = (uint32_t)(i >> 32), c2 = stream, c3 = 0;
    uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
#pragma unroll
    for (int round = 0; round < 10; round++) {
        const uint32_t hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        const uint32_t hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    const uint64_t bits = ((uint64_t)c0 << 32 | c1) >> 11;
    return (double)bits * 0x1.0p-53;
}

/* sampler.c's gy_sampler_key: smaller = ranked first (logit descending, then index ascending). */
__device__ __forceinline__ uint64_t gy_sample_key(float v, int64_t i) {
    uint32_t u = v == 0.0f ? 0u : __float_as_uint(v); /* -0 ties with +0 */
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);   /* ascending with v */
    return (uint64_t)(~u) << 32 | (uint64_t)(uint32_t)i;
}

/* gy_sampler_bad_params, for one row. */
__device__ __forceinline__ bool gy_sample_bad_params(const gy_sampler_params &p, int64_t V) {
    return !(isfinite(p.temperature) && p.temperature >= 0) || p.top_k < 0 || p.top_k > V ||
           !(p.top_p > 0 && p.top_p <= 1) || !(p.min_p >= 0 && p.min_p <= 1);
}

/* ---- block-wide reductions in a fixed order (every thread gets the result) ---- */

struct gy_sample_smem {
    double d[GY_SAMPLE_WARPS][16];
    int c[GY_SAMPLE_WARPS][16];
    double dsum[16];
    int csum[16];
    unsigned long long u64[GY_SAMPLE_WARPS];
    float best_v[GY_SAMPLE_WARPS];
    long long best_i[GY_SAMPLE_WARPS];
    int hist[256];
    int bin, before, count;
    long long found[GY_SAMPLE_WARPS];
    long long last[GY_SAMPLE_WARPS];
    double seg[GY_SAMPLE_WARPS];
};

__device__ __forceinline__ double gy_sample_warp_sum(double x) {
    for (int off = 16; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
    return x;
}

__device__ __forceinline__ int gy_sample_warp_sum(int x) {
    for (int off = 16; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
    return x;
}

/* The sum over the block of one double per thread: warps by xor butterfly, then the warps' sums
 * in warp order. */
__device__ double gy_sample_block_sum(double x, gy_sample_smem &sm) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    x = gy_sample_warp_sum(x);
    __syncthreads(); /* sm.d may still be read by the previous reduction */
    if (lane == 0) sm.d[warp][0] = x;
    __syncthreads();
    double s = 0.0;
    for (int v = 0; v < GY_SAMPLE_WARPS; v++) s += sm.d[v][0];
    return s;
}

/* 16 sums and 16 counts at once (the digits of a weighted radix-select pass). */
__device__ void gy_sample_block_sum16(double (&x)[16], int (&c)[16], gy_sample_smem &sm) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
    for (int b = 0; b < 16; b++) {
        x[b] = gy_sample_warp_sum(x[b]);
        c[b] = gy_sample_warp_sum(c[b]);
    }
    __syncthreads();
    if (lane == 0)
#pragma unroll
        for (int b = 0; b < 16; b++) {
            sm.d[warp][b] = x[b];
            sm.c[warp][b] = c[b];
        }
    __syncthreads();
    if (threadIdx.x < 16) {
        double s = 0.0;
        int n = 0;
        for (int v = 0; v < GY_SAMPLE_WARPS; v++) {
            s += sm.d[v][threadIdx.x];
            n += sm.c[v][threadIdx.x];
        }
        sm.dsum[threadIdx.x] = s;
        sm.csum[threadIdx.x] = n;
    }
    __syncthreads();
#pragma unroll
    for (int b = 0; b < 16; b++) {
        x[b] = sm.dsum[b];
        c[b] = sm.csum[b];
    }
}

__device__ unsigned long long gy_sample_block_max(unsigned long long x, gy_sample_smem &sm) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    for (int off = 16; off > 0; off /= 2) {
        const unsigned long long o = __shfl_xor_sync(0xffffffffu, x, off);
        x = o > x ? o : x;
    }
    __syncthreads();
    if (lane == 0) sm.u64[warp] = x;
    __syncthreads();
    unsigned long long r = 0;
    for (int v = 0; v < GY_SAMPLE_WARPS; v++) r = sm.u64[v] > r ? sm.u64[v] : r;
    return r;
}

/* ---- the steps of one row ---- */

/* The k smallest keys (0 < k < V) are those <= the returned threshold: a radix select on the
 * 64-bit keys, 8 bits per pass from the top, stopping as soon as the bin holding the k-th key is
 * kept whole (usually within the logit's 32 bits; the index bits only break exact ties). */
template <typename T>
__device__ uint64_t gy_sample_top_k(const T *x, int64_t V, int64_t k, gy_sample_smem &sm) {
    const int lane = threadIdx.x % 32;
    uint64_t prefix = 0, mask = 0;
    int64_t rank = k; /* the rank wanted among the keys that match `prefix` */
    for (int shift = 56; shift >= 0; shift -= 8) {
        __syncthreads(); /* the previous pass's histogram has been read */
        for (int b = threadIdx.x; b < 256; b += blockDim.x) sm.hist[b] = 0;
        __syncthreads();
        for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
            const uint64_t key = gy_sample_key(gy_to_float(x[i]), i);
            if ((key & mask) == prefix) atomicAdd(&sm.hist[(key >> shift) & 255], 1);
        }
        __syncthreads();
        if (threadIdx.x < 32) { /* lane l owns bins [8l, 8l + 8) */
            int own = 0;
            for (int b = 0; b < 8; b++) own += sm.hist[8 * lane + b];
            int incl = own;
            for (int off = 1; off < 32; off *= 2) {
                const int o = __shfl_up_sync(0xffffffffu, incl, off);
                if (lane >= off) incl += o;
            }
            const int excl = incl - own;
            if (excl < rank && rank <= incl) { /* exactly one lane */
                int before = excl, b = 8 * lane;
                while (before + sm.hist[b] < rank) before += sm.hist[b++];
                sm.bin = b;
                sm.before = before;
                sm.count = sm.hist[b];
            }
        }
        __syncthreads();
        rank -= sm.before;
        prefix |= (uint64_t)sm.bin << shift;
        mask |= (uint64_t)255 << shift;
        if (sm.count == rank) break; /* the whole bin is kept (always true at shift 0) */
    }
    return prefix | ~mask;
}

/* The top-p threshold: the smallest candidate key K with (sum of candidate w with key <= K) >=
 * target, or the largest candidate key if none; candidates are keys <= kept with w > floor_w.
 * A weighted radix select, 4 bits per pass; `before` is the sum of the candidates ranked before
 * the bin chosen so far. Finally the exact key of the one candidate left in the chosen bin. */
template <typename T>
__device__ uint64_t gy_sample_top_p(const T *x, const double *w, int64_t V, uint64_t kept,
                                    double floor_w, double target, gy_sample_smem &sm) {
    uint64_t prefix = 0, mask = 0;
    double before = 0.0;
    for (int shift = 60; shift >= 0; shift -= 4) {
        double sum[16];
        int cnt[16];
#pragma unroll
        for (int b = 0; b < 16; b++) {
            sum[b] = 0.0;
            cnt[b] = 0;
        }
        for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
            const uint64_t key = gy_sample_key(gy_to_float(x[i]), i);
            const double wi = w[i];
            if (key > kept || !(wi > floor_w) || (key & mask) != prefix) continue;
            const int digit = (int)(key >> shift) & 15;
#pragma unroll
            for (int b = 0; b < 16; b++) {
                sum[b] += digit == b ? wi : 0.0;
                cnt[b] += digit == b;
            }
        }
        gy_sample_block_sum16(sum, cnt, sm); /* the same values in every thread */
        /* the first bin whose running sum reaches the target; if none does (rounding), the
         * last bin holding a candidate. Unrolled, so the arrays stay in registers. */
        int chosen = -1, chosen_cnt = 0;
        double acc = before, chosen_before = before;
        bool reached = false;
#pragma unroll
        for (int b = 0; b < 16; b++) {
            if (!reached && cnt[b] > 0) {
                chosen = b;
                chosen_cnt = cnt[b];
                chosen_before = acc;
                acc += sum[b];
                reached = acc >= target;
            }
        }
        before = chosen_before;
        prefix |= (uint64_t)chosen << shift;
        mask |= (uint64_t)15 << shift;
        if (chosen_cnt == 1) break;
    }
    /* the one candidate whose key starts with `prefix` */
    unsigned long long found = 0;
    for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
        const uint64_t key = gy_sample_key(gy_to_float(x[i]), i);
        if (key <= kept && w[i] > floor_w && (key & mask) == prefix && key > found) found = key;
    }
    return gy_sample_block_max(found, sm);
}

/* The draw: the first index whose running sum of kept w exceeds u * total, else the last kept
 * index. Warp v owns the indices [v * seg, (v + 1) * seg): pass 1 sums each segment, pass 2 scans
 * each segment 32 indices at a time from its start (the sum of the segments before it). */
template <typename T>
__device__ int32_t gy_sample_draw(const T *x, const double *w, int64_t V, uint64_t keep,
                                  double u, gy_sample_smem &sm) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int64_t seg = (V + GY_SAMPLE_WARPS - 1) / GY_SAMPLE_WARPS;
    const int64_t lo = warp * seg, hi = lo + seg < V ? lo + seg : V;
    double own = 0.0;
    int64_t last = -1;
    for (int64_t i = lo + lane; i < hi; i += 32) {
        const double wi = gy_sample_key(gy_to_float(x[i]), i) <= keep ? w[i] : 0.0;
        own += wi;
        if (wi > 0) last = i;
    }
    own = gy_sample_warp_sum(own);
    for (int off = 16; off > 0; off /= 2) {
        const int64_t o = __shfl_xor_sync(0xffffffffu, last, off);
        last = o > last ? o : last;
    }
    __syncthreads();
    if (lane == 0) {
        sm.seg[warp] = own;
        sm.last[warp] = last;
    }
    __syncthreads();
    double total = 0.0, carry = 0.0;
    int64_t last_kept = -1;
    for (int v = 0; v < GY_SAMPLE_WARPS; v++) {
        if (v == warp) carry = total;
        total += sm.seg[v];
        last_kept = sm.last[v] > last_kept ? sm.last[v] : last_kept;
    }
    const double target = u * total;
    int64_t found = INT64_MAX;
    for (int64_t base = lo; base < hi; base += 32) { /* warp-uniform bounds */
        const int64_t i = base + lane;
        const double wi =
            i < hi && gy_sample_key(gy_to_float(x[i]), i) <= keep ? w[i] : 0.0;
        double incl = wi;
        for (int off = 1; off < 32; off *= 2) {
            const double o = __shfl_up_sync(0xffffffffu, incl, off);
            if (lane >= off) incl += o;
        }
        const unsigned hit = __ballot_sync(0xffffffffu, wi > 0 && carry + incl > target);
        if (hit) {
            found = base + __ffs(hit) - 1;
            break;
        }
        carry += __shfl_sync(0xffffffffu, incl, 31);
    }
    if (lane == 0) sm.found[warp] = found;
    __syncthreads();
    int64_t first = INT64_MAX;
    for (int v = 0; v < GY_SAMPLE_WARPS; v++) first = sm.found[v] < first ? sm.found[v] : first;
    return (int32_t)(first != INT64_MAX ? first : last_kept);
}

/* tokens: (rows) int32   logits: (rows, V) T   params, token_index: (rows)
 * workspace: (gridDim.x, V) doubles, or NULL. Rows grid-stride over the blocks. */
template <typename T>
__global__ void __launch_bounds__(GY_SAMPLE_THREADS)
    gy_sample_kernel(int32_t *__restrict__ tokens, const T *__restrict__ logits, int64_t rows,
                     int64_t V, const gy_sampler_params *__restrict__ params,
                     const int64_t *__restrict__ token_index, double *__restrict__ workspace) {
    __shared__ gy_sample_smem sm;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
        const T *x = logits + row * V;
        const gy_sampler_params p = params[row];

        /* the greedy scan: the first maximum, and whether the row is refused */
        float best = -INFINITY;
        int64_t best_i = V;
        int bad = 0;
        for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
            const float v = gy_to_float(x[i]);
            if (isnan(v) || v == INFINITY) bad = 1;
            else if (v > best) { /* strict: a thread's later tie never moves it */
                best = v;
                best_i = i;
            }
        }
        for (int off = 16; off > 0; off /= 2) {
            const float ov = __shfl_xor_sync(0xffffffffu, best, off);
            const int64_t oi = __shfl_xor_sync(0xffffffffu, best_i, off);
            if (ov > best || (ov == best && oi < best_i)) {
                best = ov;
                best_i = oi;
            }
        }
        bad = __any_sync(0xffffffffu, bad);
        __syncthreads(); /* sm is free: the previous row is done with it */
        if (lane == 0) {
            sm.best_v[warp] = best;
            sm.best_i[warp] = bad ? -1 : best_i;
        }
        __syncthreads();
        best = -INFINITY;
        best_i = V;
        bad = gy_sample_bad_params(p, V);
        for (int v = 0; v < GY_SAMPLE_WARPS; v++) {
            if (sm.best_i[v] < 0) bad = 1;
            else if (sm.best_v[v] > best || (sm.best_v[v] == best && sm.best_i[v] < best_i)) {
                best = sm.best_v[v];
                best_i = sm.best_i[v];
            }
        }
        if (bad || best_i == V || (p.temperature > 0 && workspace == NULL)) {
            if (threadIdx.x == 0) tokens[row] = -1;
            continue; /* uniform: every thread saw the same */
        }
        if (p.temperature == 0) {
            if (threadIdx.x == 0) tokens[row] = (int32_t)best_i;
            continue;
        }

        /* w, min-p */
        double *w = workspace + (int64_t)blockIdx.x * V;
        const double m = (double)best, t = p.temperature;
        for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
            double wi = exp(((double)gy_to_float(x[i]) - m) / t);
            if (p.min_p > 0 && wi < p.min_p) wi = 0;
            w[i] = wi;
        }
        __syncthreads(); /* w is read across threads below */

        uint64_t keep = ~(uint64_t)0;
        const bool top_k = p.top_k > 0 && p.top_k < V, top_p = p.top_p < 1.0;
        if (top_k) keep = gy_sample_top_k(x, V, p.top_k, sm);
        if (top_p) {
            double z = 0.0;
            for (int64_t i = threadIdx.x; i < V; i += blockDim.x)
                if (!top_k || gy_sample_key(gy_to_float(x[i]), i) <= keep) z += w[i];
            z = gy_sample_block_sum(z, sm);
            const double kept = top_k ? (double)p.top_k : (double)V;
            const double floor_w = 0.5 * (1.0 - p.top_p) * z / kept;
            keep = gy_sample_top_p(x, w, V, keep, floor_w, p.top_p * z, sm);
        }
        const double u = gy_sample_uniform(p.seed, token_index[row], GY_RNG_STREAM_SAMPLE);
        const int32_t token = gy_sample_draw(x, w, V, keep, u, sm);
        if (threadIdx.x == 0) tokens[row] = token;
    }
}

template <typename T>
static gy_status gy_sample_launch(int32_t *tokens, const void *logits, int64_t rows,
                                  int64_t vocab, const gy_sampler_params *params,
                                  const int64_t *token_index, void *workspace,
                                  cudaStream_t stream) {
    const unsigned blocks =
        (unsigned)(rows < GY_SAMPLE_MAX_BLOCKS ? rows : GY_SAMPLE_MAX_BLOCKS);
    gy_sample_kernel<T><<<blocks, GY_SAMPLE_THREADS, 0, stream>>>(
        tokens, (const T *)logits, rows, vocab, params, token_index, (double *)workspace);
    GY_CUDA_CHECK_LAUNCH("gy_sample_kernel");
    return GY_OK;
}

extern "C" gy_status gy_cuda_sample_check(gy_dtype dtype, int64_t rows, int64_t vocab) {
    GY_TRY(gy_cuda_check_dtype(dtype, "sample"));
    if (rows < 0 || vocab <= 0 || vocab > INT32_MAX)
        return GY_FAIL(GY_ERR_INVALID, "sample: rows=%lld >= 0 and 0 < vocab=%lld < 2^31 needed",
                       (long long)rows, (long long)vocab);
    return GY_OK;
}

extern "C" gy_status gy_cuda_sample(int32_t *tokens, const void *logits, gy_dtype dtype,
                                    int64_t rows, int64_t vocab, const gy_sampler_params *params,
                                    const int64_t *token_index, void *workspace,
                                    int64_t workspace_bytes, gy_cuda_stream stream) {
    GY_TRY(gy_cuda_sample_check(dtype, rows, vocab));
    if (rows == 0) return GY_OK;
    if (tokens == NULL || logits == NULL || params == NULL || token_index == NULL)
        return GY_FAIL(GY_ERR_INVALID, "sample: NULL tokens, logits, params or token_index");
    const int64_t need = gy_cuda_sample_workspace_bytes(rows, vocab);
    if (workspace != NULL && (workspace_bytes < need || (uintptr_t)workspace % 8 != 0))
        return GY_FAIL(GY_ERR_INVALID,
                       "sample: the workspace has %lld bytes at %p, %lld 8-byte aligned ones "
                       "needed (gy_cuda_sample_workspace_bytes), or pass NULL for greedy rows only",
                       (long long)workspace_bytes, workspace, (long long)need);
    GY_CUDA_DISPATCH_DTYPE(dtype, T,
                           return gy_sample_launch<T>(tokens, logits, rows, vocab, params,
                                                      token_index, workspace, stream));
    return GY_OK; /* not reached */
}
