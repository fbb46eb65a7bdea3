/* event_queue.h: the simulator's agenda: a binary min-heap of timed events. Events come out by
 * (time, rank, seq): earliest first; at equal times the lower rank first (the simulator ranks
 * arrivals before transformation phases before step ends, so a request arriving at t is seen by
 * a step starting at t); at equal time and rank, in push order. The order therefore never
 * depends on addresses or on how the heap happens to be laid out. */
#ifndef GY_SIM_EVENT_QUEUE_H
#define GY_SIM_EVENT_QUEUE_H

#include <stdint.h>

#include "../core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct gy_sim_event {
    double time;   /* seconds of simulated time */
    int32_t rank;  /* tie-breaker at equal times: lower first */
    int32_t kind;  /* the owner's event type */
    int64_t a, b;  /* the owner's payload (an instance and its generation, a request...) */
    uint64_t seq;  /* set by push: the push counter */
} gy_sim_event;

typedef struct gy_sim_eventq {
    gy_sim_event *heap; /* (capacity) heap[0] is the next event */
    int64_t n, capacity;
    uint64_t next_seq;
} gy_sim_eventq;

/* An empty queue needs no allocation: `gy_sim_eventq q = {0};` is ready. */
void gy_sim_eventq_free(gy_sim_eventq *q);
/* Refuses a non-finite time (GY_ERR_INVALID); fails only otherwise when host memory runs out. */
gy_status gy_sim_eventq_push(gy_sim_eventq *q, double time, int32_t rank, int32_t kind, int64_t a,
                             int64_t b);
/* 1 and the next event removed into *out, or 0 when empty. */
int gy_sim_eventq_pop(gy_sim_eventq *q, gy_sim_event *out);
/* The next event without removing it, or NULL when empty. */
const gy_sim_event *gy_sim_eventq_peek(const gy_sim_eventq *q);

#ifdef __cplusplus
}
#endif
#endif
