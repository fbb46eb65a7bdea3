/* moe.c: the router and the grouped dispatch of moe.h. */
#include "moe.h"

#include <math.h>
#include <stddef.h>

gy_status gy_cpu_moe_route(int32_t *choice, float *weight, const float *logits, int64_t n,
                           int64_t n_experts, int64_t k, int norm_topk) {
    if (n < 0 || n_experts < 1 || k < 1 || k > n_experts)
        return GY_FAIL(GY_ERR_INVALID, "gy_cpu_moe_route: %lld tokens, top %lld of %lld experts",
                       (long long)n, (long long)k, (long long)n_experts);
    if (n > 0 && (choice == NULL || weight == NULL || logits == NULL))
        return GY_FAIL(GY_ERR_INVALID, "gy_cpu_moe_route: NULL buffer");
    for (int64_t t = 0; t < n; t++) {
        const float *l = logits + t * n_experts;
        int32_t *c = choice + t * k;
        for (int64_t r = 0; r < k; r++) {
            int64_t best = -1;
            for (int64_t e = 0; e < n_experts; e++) {
                int taken = 0;
                for (int64_t q = 0; q < r; q++) taken |= c[q] == e;
                if (!taken && (best < 0 || l[e] > l[best])) best = e; /* strict: lower index wins */
            }
            c[r] = (int32_t)best;
        }
        double top = l[c[0]], sum = 0.0, chosen = 0.0;
        for (int64_t e = 0; e < n_experts; e++) sum += exp((double)l[e] - top);
        for (int64_t r = 0; r < k; r++) chosen += exp((double)l[c[r]] - top);
        for (int64_t r = 0; r < k; r++)
            weight[t * k + r] = (float)(exp((double)l[c[r]] - top) / (norm_topk ? chosen : sum));
    }
    return GY_OK;
}

gy_status gy_cpu_moe_group(int64_t *offsets, int32_t *token_of, int32_t *slot_of,
                           const int32_t *choice, int64_t n, int64_t n_experts, int64_t k) {
    if (n < 0 || n_experts < 1 || k < 1 || offsets == NULL || (n > 0 && (token_of == NULL ||
        slot_of == NULL || choice == NULL)))
        return GY_FAIL(GY_ERR_INVALID, "gy_cpu_moe_group: bad arguments");
    for (int64_t e = 0; e <= n_experts; e++) offsets[e] = 0;
    for (int64_t i = 0; i < n * k; i++) {
        if (choice[i] < 0 || choice[i] >= n_experts)
            return GY_FAIL(GY_ERR_INVALID, "gy_cpu_moe_group: expert %d of %lld", (int)choice[i],
                           (long long)n_experts);
        offsets[choice[i] + 1]++;
    }
    for (int64_t e = 0; e < n_experts; e++) offsets[e + 1] += offsets[e];
    /* Tokens in increasing order within an expert: the fill goes through them in order. */
    for (int64_t t = 0; t < n; t++)
        for (int64_t r = 0; r < k; r++) {
            const int32_t e = choice[t * k + r];
            int64_t fill = offsets[e]; /* offsets[e] is advanced as a cursor, then put back */
            offsets[e] = fill + 1;
            token_of[fill] = (int32_t)t;
            slot_of[t * k + r] = (int32_t)fill;
        }
    for (int64_t e = n_experts; e > 0; e--) offsets[e] = offsets[e - 1];
    offsets[0] = 0;
    return GY_OK;
}

gy_status gy_cpu_moe_gather(float *xs, const float *x, const int32_t *token_of, int64_t rows,
                            int64_t dim) {
    if (rows < 0 || dim < 0 || (rows > 0 && (xs == NULL || x == NULL || token_of == NULL)))
        return GY_FAIL(GY_ERR_INVALID, "gy_cpu_moe_gather: bad arguments");
    for (int64_t j = 0; j < rows; j++) {
        const float *src = x + (int64_t)token_of[j] * dim;
        float *dst = xs + j * dim;
        for (int64_t i = 0; i < dim; i++) dst[i] = src[i];
    }
    return GY_OK;
}

gy_status gy_cpu_moe_combine(float *out, const float *ys, const float *weight,
                             const int32_t *slot_of, int64_t n, int64_t k, int64_t dim) {
    if (n < 0 || k < 1 || dim < 0 ||
        (n > 0 && (out == NULL || ys == NULL || weight == NULL || slot_of == NULL)))
        return GY_FAIL(GY_ERR_INVALID, "gy_cpu_moe_combine: bad arguments");
    for (int64_t t = 0; t < n; t++) {
        float *o = out + t * dim;
        for (int64_t i = 0; i < dim; i++) o[i] = 0.0f;
        for (int64_t r = 0; r < k; r++) {
            const float w = weight[t * k + r];
            const float *y = ys + (int64_t)slot_of[t * k + r] * dim;
            for (int64_t i = 0; i < dim; i++) o[i] += w * y[i];
        }
    }
    return GY_OK;
}

gy_status gy_cpu_moe_add_gated(float *out, const float *y, const float *gate, int64_t n,
                               int64_t dim) {
    if (n < 0 || dim < 0 || (n > 0 && (out == NULL || y == NULL)))
        return GY_FAIL(GY_ERR_INVALID, "gy_cpu_moe_add_gated: bad arguments");
    for (int64_t t = 0; t < n; t++) {
        const float g = gate == NULL ? 1.0f : (float)(1.0 / (1.0 + exp(-(double)gate[t])));
        for (int64_t i = 0; i < dim; i++) out[t * dim + i] += g * y[t * dim + i];
    }
    return GY_OK;
}
