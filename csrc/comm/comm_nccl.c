/* comm_nccl.c: the nccl backend: one GPU per rank, the ranks being threads of this process.
 *
 * NCCL is never linked: libnccl.so.2 (or the file GYGES_NCCL_LIBRARY names) is opened on first
 * use, so `import gyges` and every other backend work without it, and this one answers
 * GY_ERR_UNAVAILABLE with dlopen's words when it is missing. The few types and constants used
 * are declared below from nccl.h's ABI (stable since NCCL 2.0), so no NCCL header is needed to
 * build either.
 *
 * One NCCL communicator per rank, made from one unique id (ncclGetUniqueId) by an
 * ncclCommInitRank per rank, issued by the constructing thread inside one group with each rank's
 * device current, as NCCL documents for one thread managing several GPUs; a multi-process
 * deployment makes the same calls with the id sent to its ranks. (An NCCL without InitRank:
 * ncclCommInitAll.) Each rank then calls its collectives from its own thread, on its own stream:
 *   all-reduce   ncclAllReduce in place, float32 sum (NCCL's order of additions, not the tree)
 *   all-gather   ncclAllGather of bytes
 *   all-to-all   ncclSend/ncclRecv of bytes to and from every peer in one group; the rank's own
 *                block is a device-to-device copy. The ranks first meet on the host to compare
 *                the sizes: a mismatched pair would leave NCCL waiting forever, so it is refused
 *                on every rank before anything moves.
 *   send/recv    ncclSend / ncclRecv of bytes, after the pair compared sizes on the host.
 * All-reduce and all-gather sizes must agree on every rank: NCCL hangs otherwise, and checking
 * would cost a host barrier on the hot path.
 *
 * Several communicators used at once (a compute and a migration one on the same GPUs) must be
 * called in the same order on every rank, as NCCL requires of concurrent communicators.
 *
 * gy_comm_abort (a rank failed) calls ncclCommAbort on every rank's communicator, which wakes a
 * rank whose stream waits in NCCL for the failed one; its call then fails with GY_ERR_STATE.
 * gy_comm_reset makes new communicators. A rank that read its communicator just before an abort
 * and calls NCCL just after would use a freed one: ranks check the abort under a lock right
 * before each call, which leaves that window as narrow as NCCL's own API allows. */
#include <stdlib.h>
#include "../core/alloc.h"
#include <string.h>

#include "comm_backend.h"

#ifndef GY_WITH_CUDA

static gy_status gy_nccl_init_unavailable(gy_comm *c) {
    (void)c;
    return GY_FAIL(GY_ERR_UNAVAILABLE,
                   "the nccl communicator is not available: gyges was not built with CUDA (nvcc "
                   "was not found at build time, or GYGES_CUDA=0)");
}

static void gy_nccl_destroy_nothing(gy_comm *c) { (void)c; }

/* Only init and destroy are ever called: gy_comm_init_config stops when init fails. */
const gy_comm_ops gy_comm_nccl_ops = {
    .name = "nccl",
    .init = gy_nccl_init_unavailable,
    .destroy = gy_nccl_destroy_nothing,
};

#else /* GY_WITH_CUDA */

#include <dlfcn.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>

#include "../core/fault.h"
#include "../kernels/comm_d2d.h"

/* ---- the part of nccl.h's ABI we use ---- */

typedef struct gy_nccl_comm *gy_nccl_comm_t; /* ncclComm_t */
typedef struct { char internal[128]; } gy_nccl_unique_id; /* ncclUniqueId, passed by value */
typedef int gy_nccl_result;                   /* ncclResult_t: ncclSuccess = 0 */
enum { GY_NCCL_SUCCESS = 0 };
enum { GY_NCCL_INT8 = 0, GY_NCCL_FLOAT32 = 7 }; /* ncclDataType_t */
enum { GY_NCCL_SUM = 0 };                       /* ncclRedOp_t */
/* ncclSend/ncclRecv exist since 2.7; NCCL_VERSION codes are X*10000+Y*100+Z since 2.9. */
#define GY_NCCL_MIN_VERSION 20900

typedef struct gy_nccl_api {
    gy_nccl_result (*get_version)(int *);
    const char *(*get_error_string)(gy_nccl_result);
    const char *(*get_last_error)(gy_nccl_comm_t); /* optional (2.13+) */
    gy_nccl_result (*comm_init_all)(gy_nccl_comm_t *, int, const int *);
    gy_nccl_result (*get_unique_id)(gy_nccl_unique_id *);                        /* optional */
    gy_nccl_result (*comm_init_rank)(gy_nccl_comm_t *, int, gy_nccl_unique_id, int); /* optional */
    gy_nccl_result (*comm_destroy)(gy_nccl_comm_t);
    gy_nccl_result (*comm_abort)(gy_nccl_comm_t);                         /* optional (2.4+) */
    gy_nccl_result (*comm_get_async_error)(gy_nccl_comm_t, gy_nccl_result *); /* optional */
    gy_nccl_result (*all_reduce)(const void *, void *, size_t, int, int, gy_nccl_comm_t, void *);
    gy_nccl_result (*all_gather)(const void *, void *, size_t, int, gy_nccl_comm_t, void *);
    gy_nccl_result (*send)(const void *, size_t, int, int, gy_nccl_comm_t, void *);
    gy_nccl_result (*recv)(void *, size_t, int, int, gy_nccl_comm_t, void *);
    gy_nccl_result (*group_start)(void);
    gy_nccl_result (*group_end)(void);
} gy_nccl_api;

static gy_nccl_api gy_nccl;
static pthread_once_t gy_nccl_once = PTHREAD_ONCE_INIT;
static int gy_nccl_loaded;
static char gy_nccl_load_message[768];

static void gy_nccl_load(void) {
    const char *path = getenv("GYGES_NCCL_LIBRARY");
    const char *name = path && path[0] ? path : "libnccl.so.2";
    /* Never dlclose'd: NCCL keeps threads and CUDA state that outlive any communicator. */
    void *lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        snprintf(gy_nccl_load_message, sizeof gy_nccl_load_message,
                 "the nccl communicator is not available: NCCL could not be loaded (dlopen %s: "
                 "%s; install NCCL or point GYGES_NCCL_LIBRARY at libnccl.so.2)",
                 name, dlerror());
        return;
    }
    static const struct { const char *name; size_t offset; int optional; } symbols[] = {
#define GY_NCCL_SYMBOL(name, field, optional) {name, offsetof(gy_nccl_api, field), optional}
        GY_NCCL_SYMBOL("ncclGetVersion", get_version, 0),
        GY_NCCL_SYMBOL("ncclGetErrorString", get_error_string, 0),
        GY_NCCL_SYMBOL("ncclGetLastError", get_last_error, 1),
        GY_NCCL_SYMBOL("ncclCommInitAll", comm_init_all, 0),
        GY_NCCL_SYMBOL("ncclGetUniqueId", get_unique_id, 1),
        GY_NCCL_SYMBOL("ncclCommInitRank", comm_init_rank, 1),
        GY_NCCL_SYMBOL("ncclCommDestroy", comm_destroy, 0),
        GY_NCCL_SYMBOL("ncclCommAbort", comm_abort, 1),
        GY_NCCL_SYMBOL("ncclCommGetAsyncError", comm_get_async_error, 1),
        GY_NCCL_SYMBOL("ncclAllReduce", all_reduce, 0),
        GY_NCCL_SYMBOL("ncclAllGather", all_gather, 0),
        GY_NCCL_SYMBOL("ncclSend", send, 0),
        GY_NCCL_SYMBOL("ncclRecv", recv, 0),
        GY_NCCL_SYMBOL("ncclGroupStart", group_start, 0),
        GY_NCCL_SYMBOL("ncclGroupEnd", group_end, 0),
#undef GY_NCCL_SYMBOL
    };
    gy_nccl_api api;
    memset(&api, 0, sizeof api);
    for (size_t i = 0; i < sizeof symbols / sizeof symbols[0]; i++) {
        void *fn = dlsym(lib, symbols[i].name);
        if (fn == NULL && !symbols[i].optional) {
            snprintf(gy_nccl_load_message, sizeof gy_nccl_load_message,
                     "the nccl communicator is not available: %s has no %s (NCCL too old?)", name,
                     symbols[i].name);
            return;
        }
        memcpy((char *)&api + symbols[i].offset, &fn, sizeof fn);
    }
    int version = 0;
    if (api.get_version(&version) != GY_NCCL_SUCCESS || version < GY_NCCL_MIN_VERSION) {
        snprintf(gy_nccl_load_message, sizeof gy_nccl_load_message,
                 "the nccl communicator is not available: %s is NCCL version code %d; gyges "
                 "needs 2.9 or newer",
                 name, version);
        return;
    }
    gy_nccl = api;
    gy_nccl_loaded = 1;
}

/* ncclResult_t -> GY_ERR_CUDA with NCCL's words (and its last error for this comm). */
static gy_status gy_nccl_fail(gy_nccl_result r, const char *what, gy_nccl_comm_t comm,
                              const char *file, int line) {
    const char *last = comm && gy_nccl.get_last_error ? gy_nccl.get_last_error(comm) : NULL;
    return gy_error_set(GY_ERR_CUDA, file, line, "%s failed: %s (ncclResult_t %d)%s%s", what,
                        gy_nccl.get_error_string ? gy_nccl.get_error_string(r) : "?", (int)r,
                        last && last[0] ? ": " : "", last ? last : "");
}

#define GY_NCCL_CHECK(what, comm, call)                                                            \
    do {                                                                                           \
        gy_nccl_result gy_nccl_r_ = (call);                                                        \
        if (gy_nccl_r_ != GY_NCCL_SUCCESS)                                                         \
            return gy_nccl_fail(gy_nccl_r_, (what), (comm), __FILE__, __LINE__);                  \
    } while (0)

/* ---- the backend ---- */

typedef struct gy_comm_nccl {
    gy_comm_streams streams;
    /* comms and aborted under lock: gy_comm_abort takes the communicators away while ranks
     * may be about to use them. */
    pthread_mutex_t lock;
    gy_nccl_comm_t comms[GY_COMM_MAX_RANKS];
    int aborted;           /* ncclCommAbort'ed: every call fails until gy_comm_reset */
    char remade[512];      /* why gy_comm_reset could not make new communicators ("" if it did) */
    /* All-to-all sizes, [call parity][rank][0 = send, 1 = recv][peer]: each rank writes its row
     * before the host barrier and every rank reads the whole table after it. Two copies, so a
     * rank already in the next all-to-all does not overwrite what a slower rank still reads
     * (it cannot get two calls ahead: it would have to pass the next call's barrier). */
    int64_t sizes[2][GY_COMM_MAX_RANKS][2][GY_COMM_MAX_RANKS];
    uint64_t a2a_calls[GY_COMM_MAX_RANKS]; /* per rank; every rank makes the same calls */
} gy_comm_nccl;

static void gy_nccl_destroy_comms(gy_comm *c, gy_comm_nccl *m) {
    for (int32_t r = 0; r < c->size; r++)
        if (m->comms[r] != NULL) {
            gy_nccl.comm_destroy(m->comms[r]);
            m->comms[r] = NULL;
        }
}

static void gy_nccl_destroy(gy_comm *c) {
    gy_comm_nccl *m = c->state;
    if (m == NULL) return;
    gy_nccl_destroy_comms(c, m);
    gy_comm_streams_free(&m->streams, c);
    pthread_mutex_destroy(&m->lock);
    free(m);
    c->state = NULL;
}

/* One communicator per rank, each made with its rank's device current: InitRank from one id
 * inside a group (one thread joining every rank needs the group: alone, each InitRank waits for
 * the others), or InitAll. On failure none is left. */
static gy_status gy_nccl_make_comms(gy_comm *c, gy_comm_nccl *m) {
    if (gy_fault_hit(GY_FAULT_COMM)) /* a device operation that can fail: sweeps reach it */
        return GY_FAIL(GY_ERR_SYSTEM, "injected fault making the nccl communicators");
    int32_t previous = -1;
    GY_TRY(gy_comm_device_enter(c, 0, &previous));
    gy_status s = GY_OK;
    if (gy_nccl.get_unique_id != NULL && gy_nccl.comm_init_rank != NULL) {
        gy_nccl_unique_id id;
        gy_nccl_result r = gy_nccl.get_unique_id(&id);
        if (r != GY_NCCL_SUCCESS) s = gy_nccl_fail(r, "ncclGetUniqueId", NULL, __FILE__, __LINE__);
        if (s == GY_OK && (r = gy_nccl.group_start()) != GY_NCCL_SUCCESS)
            s = gy_nccl_fail(r, "ncclGroupStart", NULL, __FILE__, __LINE__);
        if (s == GY_OK) {
            for (int32_t rank = 0; rank < c->size && s == GY_OK; rank++) {
                int32_t ignored;
                s = gy_comm_device_enter(c, rank, &ignored);
                if (s == GY_OK &&
                    (r = gy_nccl.comm_init_rank(&m->comms[rank], c->size, id, rank)) != GY_NCCL_SUCCESS) {
                    m->comms[rank] = NULL;
                    s = gy_nccl_fail(r, "ncclCommInitRank", NULL, __FILE__, __LINE__);
                }
            }
            /* Closed whatever happened: an open group would swallow this thread's next calls. */
            r = gy_nccl.group_end();
            if (s == GY_OK && r != GY_NCCL_SUCCESS)
                s = gy_nccl_fail(r, "ncclGroupEnd (ncclCommInitRank)", NULL, __FILE__, __LINE__);
        }
    } else {
        int devices[GY_COMM_MAX_RANKS];
        for (int32_t r = 0; r < c->size; r++) devices[r] = c->devices[r];
        const gy_nccl_result r = gy_nccl.comm_init_all(m->comms, c->size, devices);
        if (r != GY_NCCL_SUCCESS) {
            memset(m->comms, 0, sizeof m->comms);
            s = gy_nccl_fail(r, "ncclCommInitAll", NULL, __FILE__, __LINE__);
        }
    }
    gy_comm_device_leave(previous);
    if (s != GY_OK) gy_nccl_destroy_comms(c, m);
    return s;
}

static gy_status gy_nccl_init(gy_comm *c) {
    pthread_once(&gy_nccl_once, gy_nccl_load);
    if (!gy_nccl_loaded) return GY_FAIL(GY_ERR_UNAVAILABLE, "%s", gy_nccl_load_message);
    gy_comm_nccl *m = gy_calloc(1, sizeof *m);
    if (m == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory");
    pthread_mutex_init(&m->lock, NULL);
    c->state = m;
    GY_TRY(gy_comm_streams_init(&m->streams, c, "nccl"));
    return gy_nccl_make_comms(c, m);
}

/* Takes every rank's communicator away and aborts it: a rank whose stream waits in NCCL for a
 * peer that failed wakes with an error. Without ncclCommAbort (NCCL < 2.4), only the host side
 * is aborted, as before. */
static void gy_nccl_abort(gy_comm *c) {
    gy_comm_nccl *m = c->state;
    if (gy_nccl.comm_abort == NULL) return;
    gy_nccl_comm_t comms[GY_COMM_MAX_RANKS];
    pthread_mutex_lock(&m->lock);
    m->aborted = 1;
    memcpy(comms, m->comms, sizeof comms);
    memset(m->comms, 0, sizeof m->comms);
    pthread_mutex_unlock(&m->lock);
    for (int32_t r = 0; r < c->size; r++)
        if (comms[r] != NULL) gy_nccl.comm_abort(comms[r]);
}

/* After an abort (no rank is inside a call): the all-to-all parities start again (an all-to-all
 * aborted on some ranks before they counted it leaves them a call apart), and new
 * communicators. When making them fails the communicator stays aborted and every call says
 * why. */
static void gy_nccl_reset(gy_comm *c) {
    gy_comm_nccl *m = c->state;
    if (m == NULL) return;
    memset(m->a2a_calls, 0, sizeof m->a2a_calls);
    if (!m->aborted) return;
    if (gy_nccl_make_comms(c, m) != GY_OK) {
        snprintf(m->remade, sizeof m->remade, "%s", gy_error_message());
        gy_error_clear();
        return;
    }
    pthread_mutex_lock(&m->lock);
    m->aborted = 0;
    m->remade[0] = '\0';
    pthread_mutex_unlock(&m->lock);
}

/* rank's communicator for one call, or GY_ERR_STATE when it was aborted. */
static gy_status gy_nccl_comm_of(gy_comm_nccl *m, int32_t rank, gy_nccl_comm_t *comm) {
    pthread_mutex_lock(&m->lock);
    *comm = m->aborted ? NULL : m->comms[rank];
    pthread_mutex_unlock(&m->lock);
    if (*comm != NULL) return GY_OK;
    return m->remade[0] ? GY_FAIL(GY_ERR_STATE, "the nccl communicator was aborted and could not "
                                  "be made again: %s", m->remade)
                        : GY_FAIL(GY_ERR_STATE, "the nccl communicator was aborted (a rank "
                                  "failed): ncclCommAbort");
}

/* After a call was enqueued: an abort that woke it, or an error NCCL reports asynchronously
 * (a peer that aborted, a network failure), fails it; checked under the lock, so the abort
 * cannot free the communicator meanwhile. */
static gy_status gy_nccl_after(gy_comm_nccl *m, int32_t rank, const char *what) {
    pthread_mutex_lock(&m->lock);
    gy_nccl_result async = GY_NCCL_SUCCESS;
    const int aborted = m->aborted;
    if (!aborted && gy_nccl.comm_get_async_error != NULL &&
        gy_nccl.comm_get_async_error(m->comms[rank], &async) != GY_NCCL_SUCCESS)
        async = GY_NCCL_SUCCESS;
    pthread_mutex_unlock(&m->lock);
    if (aborted)
        return GY_FAIL(GY_ERR_STATE, "the nccl communicator was aborted during %s (a rank "
                       "failed): ncclCommAbort", what);
    if (async != GY_NCCL_SUCCESS)
        return gy_nccl_fail(async, what, NULL, __FILE__, __LINE__);
    return GY_OK;
}

static gy_status gy_nccl_set_stream(gy_comm *c, int32_t rank, void *stream) {
    gy_comm_nccl *m = c->state;
    return gy_comm_streams_switch(c, &m->streams, rank, stream);
}

static gy_status gy_nccl_barrier(gy_comm *c, int32_t rank) {
    gy_comm_nccl *m = c->state;
    return gy_comm_stream_barrier(c, &m->streams, rank);
}

static gy_status gy_nccl_all_reduce(gy_comm *c, int32_t rank, float *buf, int64_t n) {
    gy_comm_nccl *m = c->state;
    if (c->size == 1 || n == 0) return GY_OK;
    gy_nccl_comm_t comm;
    GY_TRY(gy_nccl_comm_of(m, rank, &comm));
    int32_t previous = -1;
    GY_TRY(gy_comm_device_enter(c, rank, &previous));
    const gy_nccl_result r = gy_nccl.all_reduce(buf, buf, (size_t)n, GY_NCCL_FLOAT32, GY_NCCL_SUM,
                                                comm, c->streams[rank]);
    gy_comm_device_leave(previous);
    if (r != GY_NCCL_SUCCESS) return gy_nccl_fail(r, "ncclAllReduce", comm, __FILE__, __LINE__);
    GY_TRY(gy_nccl_after(m, rank, "ncclAllReduce"));
    gy_comm_count_all_reduce(c, rank, n);
    gy_comm_count_call(c, rank);
    return GY_OK;
}

static gy_status gy_nccl_all_gather(gy_comm *c, int32_t rank, void *out, const void *in,
                                    int64_t bytes) {
    gy_comm_nccl *m = c->state;
    if (bytes > 0) {
        gy_nccl_comm_t comm;
        GY_TRY(gy_nccl_comm_of(m, rank, &comm));
        int32_t previous = -1;
        GY_TRY(gy_comm_device_enter(c, rank, &previous));
        const gy_nccl_result r = gy_nccl.all_gather(in, out, (size_t)bytes, GY_NCCL_INT8, comm,
                                                    c->streams[rank]);
        gy_comm_device_leave(previous);
        if (r != GY_NCCL_SUCCESS) return gy_nccl_fail(r, "ncclAllGather", comm, __FILE__, __LINE__);
        GY_TRY(gy_nccl_after(m, rank, "ncclAllGather"));
    }
    gy_comm_count_all_gather(c, rank, bytes);
    gy_comm_count_call(c, rank);
    return GY_OK;
}

/* Send/recv of every pair in one group (the rank's own block copied), on the rank's stream. */
static gy_status gy_nccl_exchange(gy_comm *c, gy_nccl_comm_t comm, int32_t rank,
                                  void *const *recv, const int64_t *recv_bytes,
                                  const void *const *send, const int64_t *send_bytes) {
    void *stream = c->streams[rank];
    GY_TRY(gy_cuda_comm_copy(recv[rank], send[rank], (uint64_t)recv_bytes[rank], stream));
    GY_NCCL_CHECK("ncclGroupStart", comm, gy_nccl.group_start());
    gy_status s = GY_OK;
    for (int32_t peer = 0; peer < c->size && s == GY_OK; peer++) {
        if (peer == rank) continue;
        gy_nccl_result r = GY_NCCL_SUCCESS;
        if (send_bytes[peer] > 0)
            r = gy_nccl.send(send[peer], (size_t)send_bytes[peer], GY_NCCL_INT8, peer, comm,
                             stream);
        if (r == GY_NCCL_SUCCESS && recv_bytes[peer] > 0)
            r = gy_nccl.recv(recv[peer], (size_t)recv_bytes[peer], GY_NCCL_INT8, peer, comm,
                             stream);
        if (r != GY_NCCL_SUCCESS) s = gy_nccl_fail(r, "ncclSend/ncclRecv", comm, __FILE__, __LINE__);
    }
    /* Closed whatever happened: an open group would swallow this thread's next NCCL calls. */
    const gy_nccl_result r = gy_nccl.group_end();
    if (s == GY_OK && r != GY_NCCL_SUCCESS) s = gy_nccl_fail(r, "ncclGroupEnd", comm, __FILE__, __LINE__);
    return s;
}

static gy_status gy_nccl_all_to_all(gy_comm *c, int32_t rank, void *const *recv,
                                    const int64_t *recv_bytes, const void *const *send,
                                    const int64_t *send_bytes) {
    gy_comm_nccl *m = c->state;
    const int parity = (int)(m->a2a_calls[rank]++ & 1);
    memcpy(m->sizes[parity][rank][0], send_bytes, sizeof(int64_t) * (size_t)c->size);
    memcpy(m->sizes[parity][rank][1], recv_bytes, sizeof(int64_t) * (size_t)c->size);
    GY_TRY(gy_comm_host_barrier(c));
    /* Every rank checks the whole table, so all of them agree on going ahead. */
    for (int32_t src = 0; src < c->size; src++)
        for (int32_t dst = 0; dst < c->size; dst++) {
            const int64_t sent = m->sizes[parity][src][0][dst];
            const int64_t expected = m->sizes[parity][dst][1][src];
            if (sent != expected || sent < 0) {
                gy_comm_count_call(c, rank);
                return GY_FAIL(GY_ERR_INVALID,
                               "rank %d expects %lld bytes from rank %d, which sends %lld "
                               "(nothing was moved: NCCL would wait forever on it)",
                               (int)dst, (long long)expected, (int)src, (long long)sent);
            }
        }
    gy_nccl_comm_t comm;
    gy_status s = gy_nccl_comm_of(m, rank, &comm);
    int32_t previous = -1;
    if (s == GY_OK) s = gy_comm_device_enter(c, rank, &previous);
    if (s == GY_OK) {
        s = gy_nccl_exchange(c, comm, rank, recv, recv_bytes, send, send_bytes);
        gy_comm_device_leave(previous);
    }
    if (s == GY_OK) s = gy_nccl_after(m, rank, "the all-to-all's ncclSend/ncclRecv");
    if (s == GY_OK)
        for (int32_t src = 0; src < c->size; src++)
            gy_comm_count_received(c, rank, src, recv_bytes[src]);
    gy_comm_count_call(c, rank);
    return s;
}

/* The ranks compare sizes on the host first (a mismatch would leave NCCL waiting forever), then
 * each enqueues its half: ncclSend after the receiver's verdict, ncclRecv after the sender's
 * acknowledgement. NCCL orders the two on the device. */
static gy_status gy_nccl_p2p(gy_comm *c, int32_t rank, int32_t peer, void *buf, int64_t bytes,
                             int send) {
    gy_comm_nccl *m = c->state;
    gy_nccl_comm_t comm;
    GY_TRY(gy_nccl_comm_of(m, rank, &comm));
    int32_t previous = -1;
    GY_TRY(gy_comm_device_enter(c, rank, &previous));
    const gy_nccl_result r =
        send ? gy_nccl.send(buf, (size_t)bytes, GY_NCCL_INT8, peer, comm, c->streams[rank])
             : gy_nccl.recv(buf, (size_t)bytes, GY_NCCL_INT8, peer, comm, c->streams[rank]);
    gy_comm_device_leave(previous);
    if (r != GY_NCCL_SUCCESS)
        return gy_nccl_fail(r, send ? "ncclSend" : "ncclRecv", comm, __FILE__, __LINE__);
    return gy_nccl_after(m, rank, send ? "ncclSend" : "ncclRecv");
}

static gy_status gy_nccl_send(gy_comm *c, int32_t rank, int32_t peer, const void *buf,
                              int64_t bytes, gy_status status) {
    gy_status s = gy_comm_post_send(c, rank, peer, buf, bytes, NULL, status, NULL);
    if (s == GY_OK && bytes > 0) s = gy_nccl_p2p(c, rank, peer, (void *)buf, bytes, 1);
    gy_comm_post_ack(c, rank, peer);
    return s;
}

static gy_status gy_nccl_recv(gy_comm *c, int32_t rank, int32_t peer, void *buf, int64_t bytes,
                              gy_status status) {
    gy_comm_post post;
    gy_status s = gy_comm_post_take(c, rank, peer, bytes, status, &post);
    s = gy_comm_post_finish(c, rank, peer, s, NULL);
    if (s == GY_OK && bytes > 0) s = gy_nccl_p2p(c, rank, peer, buf, bytes, 0);
    if (s == GY_OK) gy_comm_count_message(c, rank, peer, bytes);
    return s;
}

const gy_comm_ops gy_comm_nccl_ops = {
    .name = "nccl",
    .init = gy_nccl_init,
    .destroy = gy_nccl_destroy,
    .barrier = gy_nccl_barrier,
    .all_reduce = gy_nccl_all_reduce,
    .all_gather = gy_nccl_all_gather,
    .all_to_all = gy_nccl_all_to_all,
    .send = gy_nccl_send,
    .recv = gy_nccl_recv,
    .set_stream = gy_nccl_set_stream,
    .stream_priority = gy_comm_streams_priority,
    .synchronize = gy_comm_streams_synchronize,
    .abort = gy_nccl_abort,
    .reset = gy_nccl_reset,
};

#endif /* GY_WITH_CUDA */
