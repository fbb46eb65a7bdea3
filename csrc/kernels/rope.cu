/* rope.cu: rotary position embedding in place, HF Llama convention (rotate_half: element i of a
 * head pairs with element i + head_dim/2, not with i + 1):
 *   angle = position * inv_freq[i]   (fp32, like HF; inv_freq is data: gyges/models/rope.py)
 *   cos, sin = mscale * cos(angle), mscale * sin(angle)   (YaRN's attention factor; 1 otherwise)
 *   x[i]        <- x[i] cos - x[i + half] sin
 *   x[i + half] <- x[i + half] cos + x[i] sin
 * HF rounds cos and sin to the activation dtype and rounds after each product; here the rotation
 * is computed in fp32 and rounded once, which is at least as accurate. One thread per pair. */
#include "common.cuh"

/* x: (n_tokens, n_heads, head_dim) T   positions: (n_tokens) int32 */
template <typename T>
__global__ void gy_rope_kernel(T *x, const int32_t *__restrict__ positions, int64_t n_tokens,
                               int64_t n_heads, int64_t head_dim,
                               const float *__restrict__ inv_freq, float mscale) {
    const int64_t half = head_dim / 2;
    const int64_t total = n_tokens * n_heads * half;
    for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int64_t i = idx % half;
        const int64_t row = idx / half; /* t * n_heads + h */
        const int64_t t = row / n_heads;
        const float angle = (float)positions[t] * inv_freq[i];
        float s, c;
        sincosf(angle, &s, &c);
        s *= mscale; /* exact when mscale is 1 */
        c *= mscale;
        T *head = x + row * head_dim;
        const float a = gy_to_float(head[i]), b = gy_to_float(head[i + half]);
        head[i] = gy_from_float<T>(a * c - b * s);
        head[i + half] = gy_from_float<T>(b * c + a * s);
    }
}

template <typename T>
static gy_status gy_rope_launch(void *x, const int32_t *positions, int64_t n_tokens,
                                int64_t n_heads, int64_t head_dim, const float *inv_freq,
                                float mscale, cudaStream_t stream) {
    const int64_t total = n_tokens * n_heads * (head_dim / 2);
    gy_rope_kernel<T><<<gy_cuda_blocks(total, GY_CUDA_THREADS), GY_CUDA_THREADS, 0, stream>>>(
        (T *)x, positions, n_tokens, n_heads, head_dim, inv_freq, mscale);
    GY_CUDA_CHECK_LAUNCH("gy_rope_kernel");
    return GY_OK;
}

extern "C" gy_status gy_cuda_rope(void *q, void *k, const int32_t *positions, int64_t n_tokens,
                                  int64_t n_q_heads, int64_t n_kv_heads, int64_t head_dim,
                                  const float *inv_freq, float mscale, gy_dtype dtype,
                                  gy_cuda_stream stream) {
    GY_TRY(gy_cuda_check_dtype(dtype, "rope"));
    if (n_tokens < 0 || n_q_heads < 0 || n_kv_heads < 0 || head_dim <= 0 || head_dim % 2 != 0 ||
        !(mscale > 0.0f) || mscale - mscale != 0.0f) /* finite: inf - inf is NaN */
        return GY_FAIL(GY_ERR_INVALID,
                       "rope: needs n_tokens, n_q_heads, n_kv_heads >= 0, an even head_dim > 0 and "
                       "a finite mscale > 0 (got %lld, %lld, %lld, %lld, %g)",
                       (long long)n_tokens, (long long)n_q_heads, (long long)n_kv_heads,
                       (long long)head_dim, (double)mscale);
    if (n_tokens == 0) return GY_OK;
    if (positions == NULL || inv_freq == NULL || (q == NULL && n_q_heads > 0))
        return GY_FAIL(GY_ERR_INVALID, "rope: NULL positions, inv_freq or q");
    GY_CUDA_DISPATCH_DTYPE(dtype, T, {
        if (n_q_heads > 0)
            GY_TRY(gy_rope_launch<T>(q, positions, n_tokens, n_q_heads, head_dim, inv_freq, mscale,
                                     stream));
        if (k != NULL && n_kv_heads > 0)
            GY_TRY(gy_rope_launch<T>(k, positions, n_tokens, n_kv_heads, head_dim, inv_freq, mscale,
                                     stream));
    });
    return GY_OK;
}
