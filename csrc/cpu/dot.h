/* dot.h: the one fixed-order fp32 dot product every reduction over a contiguous vector uses
 * (linear layers, attention scores).
 *
 * The order, for a vector of `len` products w[k] * x[k] (w widened exactly to fp32): 16 lanes,
 * each a chain acc[l] = fma(w[k], x[k], acc[l]) from +0 over its elements in increasing k, then
 * the lanes added as a halving tree: s8[i] = acc[i] + acc[i + 8], s4[i] = s8[i] + s8[i + 4],
 * s2[i] = s4[i] + s4[i + 2], result = s2[0] + s2[1]. Which elements a lane takes:
 *   f32, f16: lane l takes k = l, l + 16, l + 32, ... (blocks of 16);
 *   bf16:     lane l takes k = 2l, 2l + 1, 32 + 2l, 32 + 2l + 1, ... (blocks of 32: a 64-byte load
 *             of bf16 splits into even and odd elements with one instruction each, where the
 *             block-of-16 order would need a widening shuffle per 16 weights).
 * The vector is padded with zeros to a whole block; the padding's fma(0, 0, acc) is part of the
 * definition. The AVX-512 path (one zmm accumulator per dot) and the portable path compute
 * exactly these operations, so they agree bit for bit; the result depends only on w[0..len) and
 * x[0..len). bf16 weights therefore do not give the bits of the same values stored as f32. */
#ifndef GY_CPU_DOT_H
#define GY_CPU_DOT_H

#include <stdint.h>

#include "../core/dtype.h"

#ifdef __cplusplus
extern "C" {
#endif

#define GY_DOT_LANES 16

/* The halving tree over 16 lanes, as defined above. */
static inline float gy_dot_lane_tree(const float acc[GY_DOT_LANES]) {
    float s8[8], s4[4], s2[2];
    for (int i = 0; i < 8; i++) s8[i] = acc[i] + acc[i + 8];
    for (int i = 0; i < 4; i++) s4[i] = s8[i] + s8[i + 4];
    for (int i = 0; i < 2; i++) s2[i] = s4[i] + s4[i + 2];
    return s2[0] + s2[1];
}

/* The plain definition: one dot product of w[0..len) (of `w_dtype`) with x[0..len). */
float gy_dot_ref(const void *w, gy_dtype w_dtype, const float *x, int64_t len);

/* A tile of 16 dot products: rows w[r] (r < n_w) against rows x[b] (b < 16 / n_w), each of length
 * len, written to out[r * (16 / n_w) + b]. n_w is 16, 8 or 4. Each result equals gy_dot_ref of its
 * pair. Uses the kernel path chosen in isa.h. */
void gy_dot_tile16(float out[16], const void *const *w, gy_dtype w_dtype, int32_t n_w,
                   const float *const *x, int64_t len);

/* A linear layer's inner loop over one tile of up to 16 weight rows (valid_rows of them; rows past
 * them are read as copies of the last valid row and not written): for weight row r and activation
 * row i < n_rows (n_rows a multiple of 16 / n_w),
 *   y[i * ldy + r] = tree over the k_splits chunks of gy_dot_ref(w_r + chunk, x_i + chunk, L)
 *                    (+ bias[r] when bias is not NULL),  L = len / k_splits,
 * the tree pairing chunks as ((c0 + c1) + (c2 + c3)); w_r = w + r * w_row_bytes,
 * x_i = x + i * ldx. The work runs as slices of n_w (16, 8 or 4) weight rows against groups of
 * 16 / n_w activation rows, 16 dot products per slice; the bits do not depend on n_w. k_splits is
 * a power of two <= 64 dividing len. */
void gy_dot_rows16(float *y, int64_t ldy, const float *bias, const void *w, int64_t w_row_bytes,
                   gy_dtype w_dtype, int32_t n_w, int32_t valid_rows, const float *x, int64_t ldx,
                   int64_t n_rows, int64_t len, int32_t k_splits);

/* ---- batched kernels over packed activations ----
 *
 * The batched path of gy_cpu_linear first copies the activation rows once into a packed buffer
 * (64-byte aligned rows, each k-split chunk zero-padded to whole lane blocks, bf16's blocks of 32
 * stored as their 16 even then their 16 odd elements), so that the inner loop reads x with plain
 * aligned loads. Then 8 weight rows at a time run against groups of up to 3 packed rows: 24
 * accumulators, each exactly the 16-lane chain of one (weight row, activation row) pair, so every
 * result has the bits of gy_dot_ref (and of gy_dot_rows16) whatever the batch. gy_cpu_linear takes
 * this path on AVX-512 only (the portable gy_dot_rows8_packed is the plain definition, for tests). */

/* Floats per packed row: k_splits chunks of len / k_splits, each rounded up to a whole lane block
 * (16 elements, 32 for bf16). A multiple of 16. */
int64_t gy_dot_packed_stride(gy_dtype w_dtype, int64_t len, int32_t k_splits);

/* xp [n_rows, ldp] (64-byte aligned, ldp = gy_dot_packed_stride) = x [n_rows, ldx] packed. */
void gy_dot_pack(float *xp, const float *x, int64_t ldx, int64_t n_rows, gy_dtype w_dtype,
                 int64_t len, int32_t k_splits);

/* gy_dot_rows16's result for one tile of up to 8 weight rows (valid_rows of them) against the
 * packed rows xp [n_rows, ldp]: y[i * ldy + r] = chunk tree of the dot products (+ bias[r]). */
void gy_dot_rows8_packed(float *y, int64_t ldy, const float *bias, const void *w,
                         int64_t w_row_bytes, gy_dtype w_dtype, int32_t valid_rows, const float *xp,
                         int64_t n_rows, int64_t len, int32_t k_splits);

#ifdef __cplusplus
}
#endif
#endif
