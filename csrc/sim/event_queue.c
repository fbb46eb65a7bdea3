/* event_queue.c: an array heap ordered by (time, rank, seq); seq makes every key unique, so the
 * pop order is a total order fixed by the pushes alone. */
#include "event_queue.h"
#include "../core/alloc.h"

#include <math.h>
#include <stdlib.h>

static int gy_sim_event_before(const gy_sim_event *x, const gy_sim_event *y) {
    if (x->time != y->time) return x->time < y->time;
    if (x->rank != y->rank) return x->rank < y->rank;
    return x->seq < y->seq;
}

void gy_sim_eventq_free(gy_sim_eventq *q) {
    if (q == NULL) return;
    free(q->heap);
    q->heap = NULL;
    q->n = q->capacity = 0;
}

gy_status gy_sim_eventq_push(gy_sim_eventq *q, double time, int32_t rank, int32_t kind, int64_t a,
                             int64_t b) {
    if (!isfinite(time)) return GY_FAIL(GY_ERR_INVALID, "event time must be finite, got %g", time);
    if (q->n == q->capacity) {
        const int64_t capacity = q->capacity ? 2 * q->capacity : 64;
        gy_sim_event *heap = gy_realloc(q->heap, (size_t)capacity * sizeof *heap);
        if (heap == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for the event queue");
        q->heap = heap;
        q->capacity = capacity;
    }
    gy_sim_event e = {.time = time, .rank = rank, .kind = kind, .a = a, .b = b,
                      .seq = q->next_seq++};
    int64_t i = q->n++;
    while (i > 0) {
        const int64_t parent = (i - 1) / 2;
        if (!gy_sim_event_before(&e, &q->heap[parent])) break;
        q->heap[i] = q->heap[parent];
        i = parent;
    }
    q->heap[i] = e;
    return GY_OK;
}

int gy_sim_eventq_pop(gy_sim_eventq *q, gy_sim_event *out) {
    if (q->n == 0) return 0;
    *out = q->heap[0];
    const gy_sim_event last = q->heap[--q->n];
    int64_t i = 0;
    for (;;) {
        int64_t child = 2 * i + 1;
        if (child >= q->n) break;
        if (child + 1 < q->n && gy_sim_event_before(&q->heap[child + 1], &q->heap[child])) child++;
        if (!gy_sim_event_before(&q->heap[child], &last)) break;
        q->heap[i] = q->heap[child];
        i = child;
    }
    if (q->n > 0) q->heap[i] = last;
    return 1;
}

const gy_sim_event *gy_sim_eventq_peek(const gy_sim_eventq *q) {
    return q->n ? &q->heap[0] : NULL;
}
