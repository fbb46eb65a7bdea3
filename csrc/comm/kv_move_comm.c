/* kv_move_comm.c: the comm backend of KV moves (kv_move_comm.h). */
#include "kv_move_comm.h"

#ifdef GY_WITH_CUDA

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/alloc.h"
#include "../core/fault.h"
#include "../kernels/device.h"
#include "../kernels/kv_move_device.h"
#include "../kernels/kv_ops.h"
#include "comm.h"

/* The rank of `comm` whose device is `device`, or -1. */
static int32_t gy_kmc_rank_of(const gy_comm *comm, int32_t device) {
    for (int32_t r = 0; r < gy_comm_size(comm); r++)
        if (gy_comm_device(comm, r) == device) return r;
    return -1;
}

static int32_t gy_kmc_device(const gy_kv_cache *kv) { return gy_arena_device(gy_kv_arena(kv)); }

static gy_status gy_kmc_check(const gy_kv_move *mv) {
    const gy_comm *comm = mv->comm;
    if (gy_comm_backend(comm) == GY_COMM_BACKEND_SHM)
        return GY_FAIL(GY_ERR_INVALID, "KV moves between CUDA devices need a device communicator "
                       "(nccl), not shm");
    for (int64_t i = 0; i < mv->n_items; i++) {
        const gy_kv_cache *kv[2] = {mv->items[i].src, mv->items[i].dst};
        for (int e = 0; e < 2; e++)
            if (gy_arena_backend(gy_kv_arena(kv[e])) != GY_ARENA_BACKEND_CUDA ||
                gy_kmc_rank_of(comm, gy_kmc_device(kv[e])) < 0)
                return GY_FAIL(GY_ERR_INVALID,
                               "move item %lld: its %s cache is on %s %d, which is no rank's "
                               "device in the move's communicator of %d ranks",
                               (long long)i, e ? "destination" : "source",
                               gy_arena_backend(gy_kv_arena(kv[e])) == GY_ARENA_BACKEND_CUDA
                                   ? "CUDA device" : "host memory (device)",
                               (int)gy_kmc_device(kv[e]), (int)gy_comm_size(comm));
    }
    return GY_OK;
}

/* ---- the plan every rank reads: who sends what to whom, and where it sits in staging ---- */

typedef struct gy_kmc_item {
    int32_t src_rank, dst_rank;
    int64_t pairs;        /* block pairs (OVERLAP, one device: those not already in place) */
    const int32_t *src_ids, *dst_ids; /* (pairs) each: its block lists, or `kept`'s */
    int32_t *kept;        /* NULL, or (2, pairs) src then dst ids of an OVERLAP item on one
                           * device, its pairs already in place left out */
    int64_t layer_bytes;  /* one layer of its pairs' heads, K and V, whole blocks */
    int64_t send_at;      /* its bytes' offset in its source rank's send buffer (one layer) */
    int64_t recv_at;      /* and in its destination rank's receive buffer */
    int64_t list_at;      /* its block ids' offset in its source and destination ranks' lists */
} gy_kmc_item;

typedef struct gy_kmc_plan {
    const gy_kv_move *mv;
    gy_comm *comm;
    int32_t size;
    int overlap;          /* GY_KV_MOVE_OVERLAP: read everything, exchange, then write */
    int cross;            /* some item crosses devices: every rank takes part in the exchanges */
    int64_t layers;
    uint64_t in_place;    /* bytes of pairs already where they go, every layer */
    /* OVERLAP: nothing is written until every rank has read and exchanged everything, so a
     * failure anywhere leaves every cache as it was (a staggered layer is moved whole or not) */
    pthread_mutex_t lock;
    pthread_cond_t arrived_cond;
    int32_t expected, arrived, failed;
    gy_kmc_item *items;                                     /* (n_items) */
    int64_t send[GY_COMM_MAX_RANKS][GY_COMM_MAX_RANKS];     /* [src][dst] bytes of one layer */
    int64_t send_total[GY_COMM_MAX_RANKS], recv_total[GY_COMM_MAX_RANKS];
    int64_t list_total[GY_COMM_MAX_RANKS];                  /* int32 ids a rank uploads */
    int64_t max_pairs;
    gy_status status[GY_COMM_MAX_RANKS];
    char message[GY_COMM_MAX_RANKS][512];                   /* a rank's failure (thread-local) */
    uint64_t staged[GY_COMM_MAX_RANKS];                     /* device bytes each rank staged */
} gy_kmc_plan;

/* Item `x`'s pairs that the move copies between devices (gy_kv_move_pair_moves), into x->kept:
 * an OVERLAP item on one device leaves out those already in place (a rank's own heads of a
 * header-centric block stay put, neither read nor written, as on the host and one device), their
 * bytes counted in p->in_place; a patch keeps those whose source block holds a dirty slot. */
static gy_status gy_kmc_filter(gy_kmc_plan *p, gy_kmc_item *x, const gy_kv_move_item *it) {
    x->kept = gy_malloc((size_t)(2 * x->pairs) * sizeof *x->kept);
    if (x->kept == NULL)
        return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for the block lists of a KV move "
                       "between devices");
    const int same = p->overlap && x->src_rank == x->dst_rank && gy_kv_move_same_place(p->mv, it);
    int64_t n = 0;
    for (int64_t j = 0; j < x->pairs; j++) {
        if (!gy_kv_move_pair_moves(p->mv, it, j, x->src_ids, x->dst_ids, same, &p->in_place))
            continue;
        x->kept[n] = x->src_ids[j];
        x->kept[x->pairs + n++] = x->dst_ids[j];
    }
    memmove(x->kept + n, x->kept + x->pairs, (size_t)n * sizeof *x->kept);
    x->src_ids = x->kept;
    x->dst_ids = x->kept + n;
    x->pairs = n;
    return GY_OK;
}

static void gy_kmc_plan_free(gy_kmc_plan *p) {
    if (p->items != NULL)
        for (int64_t i = 0; i < p->mv->n_items; i++) free(p->items[i].kept);
    free(p->items);
}

static gy_status gy_kmc_plan_init(gy_kmc_plan *p, const gy_kv_move *mv) {
    memset(p, 0, sizeof *p);
    p->mv = mv;
    p->comm = mv->comm;
    p->size = gy_comm_size(mv->comm);
    p->overlap = (mv->flags & GY_KV_MOVE_OVERLAP) != 0;
    p->layers = mv->end_layer - mv->first_layer;
    p->expected = p->size;
    p->items = gy_calloc((size_t)(mv->n_items > 0 ? mv->n_items : 1), sizeof *p->items);
    if (p->items == NULL)
        return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for the plan of a KV move between "
                       "devices");
    for (int64_t i = 0; i < mv->n_items; i++) {
        const gy_kv_move_item *it = &mv->items[i];
        gy_kmc_item *x = &p->items[i];
        const int32_t *sb = NULL, *db = NULL;
        x->src_rank = gy_kmc_rank_of(p->comm, gy_kmc_device(it->src));
        x->dst_rank = gy_kmc_rank_of(p->comm, gy_kmc_device(it->dst));
        x->pairs = it->n_heads > 0 && gy_kv_move_item_tokens(it) > 0
                       ? gy_kv_move_item_pairs(it, &sb, &db) : 0;
        x->src_ids = sb;
        x->dst_ids = db;
        if (x->pairs == 0) continue;
        if (x->src_rank == x->dst_rank && !p->overlap) continue; /* local: the device backend */
        /* an OVERLAP item on one device, or a patch between devices (never both kinds of move:
         * gy_kv_move_check_dirty) */
        if (x->src_rank == x->dst_rank || p->mv->dirty != NULL) {
            GY_TRY(gy_kmc_filter(p, x, it));
            if (x->pairs == 0) continue;
        }
        p->cross |= x->src_rank != x->dst_rank;
        const gy_kv_config *c = gy_kv_config_of(it->src);
        x->layer_bytes = x->pairs * 2 * c->block_size * it->n_heads * c->head_dim * c->elem_size;
        p->send[x->src_rank][x->dst_rank] += x->layer_bytes;
        if (x->pairs > p->max_pairs) p->max_pairs = x->pairs;
    }
    /* Offsets: a send buffer is grouped by destination, a receive buffer by source, items in
     * their order inside a group, so both ends of a pair agree on every item's place. */
    int64_t send_at[GY_COMM_MAX_RANKS][GY_COMM_MAX_RANKS], recv_at[GY_COMM_MAX_RANKS][GY_COMM_MAX_RANKS];
    for (int32_t s = 0; s < p->size; s++)
        for (int32_t d = 0; d < p->size; d++) {
            send_at[s][d] = p->send_total[s];
            p->send_total[s] += p->send[s][d];
            if (s == d) continue; /* an OVERLAP move's own items are written from the send side */
            recv_at[d][s] = p->recv_total[d];
            p->recv_total[d] += p->send[s][d];
        }
    for (int64_t i = 0; i < mv->n_items; i++) {
        gy_kmc_item *x = &p->items[i];
        if (x->layer_bytes == 0) continue;
        x->send_at = send_at[x->src_rank][x->dst_rank];
        send_at[x->src_rank][x->dst_rank] += x->layer_bytes;
        if (x->src_rank == x->dst_rank) { /* both lists on its one rank: src, then dst ids */
            x->list_at = p->list_total[x->src_rank];
            p->list_total[x->src_rank] += 2 * x->pairs;
            continue;
        }
        x->recv_at = recv_at[x->dst_rank][x->src_rank];
        recv_at[x->dst_rank][x->src_rank] += x->layer_bytes;
        /* the same offset in both ranks' lists: each uploads its own end's ids there */
        x->list_at = p->list_total[x->src_rank] > p->list_total[x->dst_rank]
                         ? p->list_total[x->src_rank] : p->list_total[x->dst_rank];
        p->list_total[x->src_rank] = p->list_total[x->dst_rank] = x->list_at + x->pairs;
    }
    return GY_OK;
}

/* ---- one rank ---- */

typedef struct gy_kmc_rank {
    gy_kmc_plan *plan;
    int32_t rank;
} gy_kmc_rank;

/* The staging "cache" of an item: its pairs as blocks of its heads, header layout. */
static gy_status gy_kmc_staging_layout(gy_kv_layout *out, const gy_kv_move_item *it, int64_t pairs) {
    const gy_kv_config *c = gy_kv_config_of(it->src);
    return gy_kv_layout_init(out, GY_KV_LAYOUT_HEAD, c->block_size, it->n_heads, c->head_dim,
                             c->elem_size, pairs);
}

/* Items whose two caches are on this rank's device, through the device backend. */
static gy_status gy_kmc_local(gy_kmc_plan *p, int32_t rank) {
    const gy_kv_move *mv = p->mv;
    int64_t n = 0;
    for (int64_t i = 0; i < mv->n_items; i++)
        n += p->items[i].src_rank == rank && p->items[i].dst_rank == rank && p->items[i].pairs;
    if (n == 0) return GY_OK;
    gy_kv_move_item *local = gy_malloc((size_t)n * sizeof *local);
    if (local == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for a KV move's items");
    n = 0;
    for (int64_t i = 0; i < mv->n_items; i++)
        if (p->items[i].src_rank == rank && p->items[i].dst_rank == rank && p->items[i].pairs)
            local[n++] = mv->items[i];
    gy_kv_move sub = *mv;
    sub.items = local;
    sub.n_items = n;
    sub.comm = NULL;
    gy_kv_move_stats ignored = {0};
    const gy_status s = gy_kv_move_device_backend.copy(&sub, &ignored);
    free(local);
    return s;
}

/* Where layer `l`'s groups sit in rank `rank`'s staging `base`: send [send_total] then receive
 * [recv_total] buffers, one layer's (an OVERLAP move keeps every layer: (layers, ...) each),
 * then the ids. */
static void gy_kmc_places(const gy_kmc_plan *p, int32_t rank, char *base, int64_t l, char **send,
                          char **recv, const int32_t **ids) {
    const int64_t slots = p->overlap ? p->layers : 1, at = p->overlap ? l - p->mv->first_layer : 0;
    if (base == NULL) {
        *send = *recv = NULL;
        *ids = NULL;
        return;
    }
    *send = base + at * p->send_total[rank];
    *recv = base + slots * p->send_total[rank] + at * p->recv_total[rank];
    *ids = (const int32_t *)(base + slots * (p->send_total[rank] + p->recv_total[rank]));
}

/* Layer `l` of the items rank `rank` receives (or, OVERLAP, keeps on its device) written from
 * staging into their destinations. */
static gy_status gy_kmc_unpack(gy_kmc_plan *p, int32_t rank, char *base, int64_t l,
                               gy_cuda_stream stream) {
    const gy_kv_move *mv = p->mv;
    char *send, *recv;
    const int32_t *dev_ids;
    gy_kmc_places(p, rank, base, l, &send, &recv, &dev_ids);
    const int32_t *iota = dev_ids ? dev_ids + p->list_total[rank] : NULL;
    for (int64_t i = 0; i < mv->n_items; i++) {
        const gy_kmc_item *x = &p->items[i];
        if (x->dst_rank != rank || x->layer_bytes == 0) continue;
        const gy_kv_move_item *it = &mv->items[i];
        const int local = x->src_rank == rank;
        gy_kv_layout staging;
        GY_TRY(gy_kmc_staging_layout(&staging, it, x->pairs));
        GY_TRY(gy_cuda_kv_copy_heads((void *)gy_kv_layer_address(it->dst, gy_kv_move_layer(it->dst, l)),
                                     gy_kv_layout_of(it->dst),
                                     dev_ids + x->list_at + (local ? x->pairs : 0), it->dst_head,
                                     local ? send + x->send_at : recv + x->recv_at, &staging,
                                     iota, 0, it->n_heads, x->pairs, stream));
    }
    return GY_OK;
}

/* Rank `rank`'s part: stages, reads and exchanges every layer (and, without OVERLAP, writes each
 * as it arrives). bufs[0] gets its staging. */
static gy_status gy_kmc_rank_run(gy_kmc_plan *p, int32_t rank, void **bufs) {
    const gy_kv_move *mv = p->mv;
    const int32_t size = p->size;
    const int64_t slots = p->overlap ? p->layers : 1;
    gy_cuda_stream stream = (gy_cuda_stream)gy_comm_stream(p->comm, rank);
    GY_TRY(gy_cuda_set_device(gy_comm_device(p->comm, rank)));
    if (!p->overlap) GY_TRY(gy_kmc_local(p, rank));
    /* Staging: send (slots, send_total), recv (slots, recv_total), ids (list_total) int32,
     * iota (max_pairs). */
    const int64_t ids = p->list_total[rank] + p->max_pairs;
    const int64_t span = slots * (p->send_total[rank] + p->recv_total[rank]);
    const uint64_t bytes = (uint64_t)span + (uint64_t)ids * sizeof(int32_t);
    if (span == 0) {
        /* nothing of its own to move: it still takes part in every layer's exchange */
    } else {
        if (gy_fault_hit(GY_FAULT_ALLOC))
            return GY_FAIL(GY_ERR_OUT_OF_MEMORY, "injected fault: rank %d's %llu bytes of KV "
                           "staging on CUDA device %d", (int)rank, (unsigned long long)bytes,
                           (int)gy_comm_device(p->comm, rank));
        GY_TRY(gy_cuda_malloc(&bufs[0], bytes));
        p->staged[rank] = bytes;
        int32_t *host = gy_malloc((size_t)ids * sizeof *host);
        if (host == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for block lists");
        for (int64_t i = 0; i < mv->n_items; i++) {
            const gy_kmc_item *x = &p->items[i];
            if (x->layer_bytes == 0 || (x->src_rank != rank && x->dst_rank != rank)) continue;
            if (x->src_rank == x->dst_rank) { /* OVERLAP on one device: both ends here */
                memcpy(host + x->list_at, x->src_ids, (size_t)x->pairs * sizeof *host);
                memcpy(host + x->list_at + x->pairs, x->dst_ids, (size_t)x->pairs * sizeof *host);
            } else {
                memcpy(host + x->list_at, x->src_rank == rank ? x->src_ids : x->dst_ids,
                       (size_t)x->pairs * sizeof *host);
            }
        }
        for (int64_t j = 0; j < p->max_pairs; j++) host[p->list_total[rank] + j] = (int32_t)j;
        const gy_status s = gy_cuda_memcpy_htod((char *)bufs[0] + span, host,
                                                (uint64_t)ids * sizeof *host);
        free(host);
        GY_TRY(s);
    }
    void *recv_at[GY_COMM_MAX_RANKS];
    const void *send_from[GY_COMM_MAX_RANKS];
    int64_t recv_bytes[GY_COMM_MAX_RANKS], send_bytes[GY_COMM_MAX_RANKS];
    for (int64_t l = mv->first_layer; l < mv->end_layer && p->max_pairs > 0; l++) {
        char *send, *recv;
        const int32_t *dev_ids;
        gy_kmc_places(p, rank, bufs[0], l, &send, &recv, &dev_ids);
        const int32_t *iota = dev_ids ? dev_ids + p->list_total[rank] : NULL;
        for (int64_t i = 0; i < mv->n_items; i++) {
            const gy_kmc_item *x = &p->items[i];
            if (x->src_rank != rank || x->layer_bytes == 0) continue;
            const gy_kv_move_item *it = &mv->items[i];
            gy_kv_layout staging;
            GY_TRY(gy_kmc_staging_layout(&staging, it, x->pairs));
            GY_TRY(gy_cuda_kv_copy_heads(send + x->send_at, &staging, iota, 0,
                                         (const void *)gy_kv_layer_address(it->src, gy_kv_move_layer(it->src, l)),
                                         gy_kv_layout_of(it->src), dev_ids + x->list_at,
                                         it->src_head, it->n_heads, x->pairs, stream));
        }
        if (p->cross) {
            /* each peer's group (the plan's order: by peer, then item); its own group, OVERLAP
             * items on one device, stays in the send buffer */
            int64_t s_at = 0, r_at = 0;
            for (int32_t q = 0; q < size; q++) {
                send_from[q] = send ? send + s_at : NULL;
                recv_at[q] = recv ? recv + r_at : NULL;
                send_bytes[q] = q == rank ? 0 : p->send[rank][q];
                recv_bytes[q] = q == rank ? 0 : p->send[q][rank];
                s_at += p->send[rank][q];
                r_at += recv_bytes[q];
            }
            GY_TRY(gy_comm_all_to_all(p->comm, rank, recv_at, recv_bytes, send_from, send_bytes));
        }
        if (!p->overlap) GY_TRY(gy_kmc_unpack(p, rank, bufs[0], l, stream));
    }
    return gy_comm_synchronize(p->comm, rank);
}

/* OVERLAP: every rank waits here until all have read and exchanged; returns whether none
 * failed (then, and only then, anything is written). */
static int gy_kmc_barrier(gy_kmc_plan *p, int failed) {
    pthread_mutex_lock(&p->lock);
    p->failed += failed;
    p->arrived++;
    pthread_cond_broadcast(&p->arrived_cond);
    while (p->arrived < p->expected) pthread_cond_wait(&p->arrived_cond, &p->lock);
    const int go = p->failed == 0;
    pthread_mutex_unlock(&p->lock);
    return go;
}

static gy_status gy_kmc_write(gy_kmc_plan *p, int32_t rank, void *base) {
    gy_cuda_stream stream = (gy_cuda_stream)gy_comm_stream(p->comm, rank);
    for (int64_t l = p->mv->first_layer; l < p->mv->end_layer && p->max_pairs > 0; l++)
        GY_TRY(gy_kmc_unpack(p, rank, base, l, stream));
    return gy_comm_synchronize(p->comm, rank);
}

static void *gy_kmc_thread(void *arg) {
    gy_kmc_rank *r = arg;
    gy_kmc_plan *p = r->plan;
    void *bufs[1] = {NULL};
    gy_status s = gy_kmc_rank_run(p, r->rank, bufs);
    if (s != GY_OK) {
        snprintf(p->message[r->rank], sizeof p->message[r->rank], "%s", gy_error_message());
        /* the others must not wait for this rank's exchanges */
        gy_comm_abort(p->comm, r->rank, p->message[r->rank]);
        gy_comm_synchronize(p->comm, r->rank); /* its staging is idle before it is freed */
    }
    if (p->overlap && !gy_kmc_barrier(p, s != GY_OK)) {
        if (s == GY_OK) {
            s = GY_FAIL(GY_ERR_SYSTEM, "rank %d's part of an overlapping KV move was aborted: "
                        "another rank failed before anything was written", (int)r->rank);
            snprintf(p->message[r->rank], sizeof p->message[r->rank], "%s", gy_error_message());
        }
    } else if (p->overlap) {
        /* no collective, no allocation, no fault site: launches of copies read from staging */
        s = gy_kmc_write(p, r->rank, bufs[0]);
        if (s != GY_OK) {
            snprintf(p->message[r->rank], sizeof p->message[r->rank], "%s", gy_error_message());
            gy_comm_synchronize(p->comm, r->rank);
        }
    }
    gy_cuda_free(bufs[0]);
    p->status[r->rank] = s;
    return NULL;
}

static gy_status gy_kmc_copy(const gy_kv_move *mv, gy_kv_move_stats *st) {
    gy_kmc_plan p;
    gy_status s = gy_kmc_plan_init(&p, mv);
    if (s != GY_OK) {
        gy_kmc_plan_free(&p);
        return s;
    }
    pthread_mutex_init(&p.lock, NULL);
    pthread_cond_init(&p.arrived_cond, NULL);
    gy_kmc_rank ranks[GY_COMM_MAX_RANKS];
    pthread_t threads[GY_COMM_MAX_RANKS];
    int32_t started = 0;
    for (; started < p.size; started++) {
        ranks[started] = (gy_kmc_rank){.plan = &p, .rank = started};
        if (pthread_create(&threads[started], NULL, gy_kmc_thread, &ranks[started]) != 0) {
            gy_comm_abort(p.comm, started, "its thread could not start");
            pthread_mutex_lock(&p.lock); /* the ones started write nothing, nor wait for it */
            p.expected = started;
            p.failed++;
            pthread_cond_broadcast(&p.arrived_cond);
            pthread_mutex_unlock(&p.lock);
            s = GY_FAIL(GY_ERR_SYSTEM, "could not start the thread of rank %d of a KV move",
                        (int)started);
            break;
        }
    }
    for (int32_t r = 0; r < started; r++) pthread_join(threads[r], NULL);
    pthread_cond_destroy(&p.arrived_cond);
    pthread_mutex_destroy(&p.lock);
    /* The failure that started it: a rank's own, not a peer's echo of the abort. */
    int32_t first = -1;
    for (int32_t r = 0; r < started; r++)
        if (p.status[r] != GY_OK && (first < 0 || (strstr(p.message[first], "was aborted") &&
                                                   !strstr(p.message[r], "was aborted"))))
            first = r;
    if (s == GY_OK && first >= 0)
        s = GY_FAIL(p.status[first], "a KV move between devices failed on rank %d (CUDA device "
                    "%d): %s", (int)first, (int)gy_comm_device(p.comm, first), p.message[first]);
    if (gy_comm_aborted(p.comm)) gy_comm_reset(p.comm); /* every rank is out of it */
    if (s == GY_OK) {
        for (int32_t a = 0; a < p.size; a++)
            for (int32_t b = 0; b < p.size; b++)
                if (a != b)
                    st->comm_bytes += (uint64_t)p.send[a][b] * (uint64_t)p.layers;
        for (int32_t r = 0; r < p.size; r++)
            if (p.staged[r] > st->staging_bytes) st->staging_bytes = p.staged[r];
        if (p.overlap) { /* as the host and one device count it */
            st->bytes -= p.in_place;
            st->bytes_in_place = p.in_place;
            st->bytes_late = st->bytes;
        }
    }
    gy_kmc_plan_free(&p);
    return s;
}

/* A staggered layer's KV over the pages it is read from (shadow caches): every source, on every
 * rank, is read into staging and exchanged before the barrier, and written only after it.
 * `stage` is the host's early read, which a move between devices does not use. */
static gy_status gy_kmc_copy_overlapping(const gy_kv_move *mv, gy_kv_move_stage *stage,
                                         gy_kv_move_stats *st) {
    (void)stage;
    return gy_kmc_copy(mv, st);
}

const gy_kv_move_backend gy_kv_move_comm_backend = {
    .name = "comm",
    .copy = gy_kmc_copy,
    .copy_overlapping = gy_kmc_copy_overlapping,
    .check = gy_kmc_check,
};

gy_status gy_kv_move_comm_register(void) {
    return gy_kv_move_set_backend(GY_KV_MOVE_BACKEND_COMM, &gy_kv_move_comm_backend);
}

#else

gy_status gy_kv_move_comm_register(void) { return GY_OK; }

#endif
