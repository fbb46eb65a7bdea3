/* tree.h: the one order in which gyges adds n partial results (a rank's FFN shards and o_proj
 * chunks, the ranks of an all-reduce), so that tensor parallelism never changes a bit.
 *
 * Level by level, adjacent pairs, an odd last one carried up unchanged:
 *   n = 4: (p0 + p1) + (p2 + p3)      n = 3: (p0 + p1) + p2      n = 6: ((p0+p1) + (p2+p3)) + (p4+p5)
 * which equals sum(the first 2^k) + sum(the rest), 2^k the largest power of two below n. Hence a
 * rank that adds its s adjacent parts, followed by the tree over the ranks' sums, gives the bits of
 * the tree over all n = s * t parts whenever s is a power of two (or t = 1): the TP degrees t
 * that gy_tree_split_ok accepts for a model of max_tp parts. */
#ifndef GY_CORE_TREE_H
#define GY_CORE_TREE_H

#include <stdint.h>

/* One level on v[0 .. width): v[j] = v[2j] + v[2j+1], the odd last one moved down; returns the
 * new width. `while (w > 1) w = gy_tree_level(v, w);` from w = n leaves the sum in v[0]. */
static inline int32_t gy_tree_level(float *v, int32_t width) {
    for (int32_t j = 0; j < width / 2; j++) v[j] = v[2 * j] + v[2 * j + 1];
    if (width & 1) v[width / 2] = v[width - 1];
    return (width + 1) / 2;
}

static inline int gy_tree_is_power_of_two(int64_t x) { return x > 0 && (x & (x - 1)) == 0; }

/* Whether t ranks, each adding max_tp / t adjacent parts, reproduce the tree over max_tp parts. */
static inline int gy_tree_split_ok(int64_t max_tp, int64_t t) {
    return t >= 1 && max_tp % t == 0 && (t == 1 || gy_tree_is_power_of_two(max_tp / t));
}

#endif
