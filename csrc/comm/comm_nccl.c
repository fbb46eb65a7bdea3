/* comm_nccl.c: the nccl backend: one GPU per rank, the ranks being threads of this process.
 *
 * NCCL is never linked: libnccl.so.2 (or the file GYGES_NCCL_LIBRARY names) is opened on first
 * use, so `import gyges` and every other backend work without it, and this one answers
 * GY_ERR_UNAVAILABLE with dlopen's words when it is missing. The few types and constants used
 * are declared below from nccl.h's ABI (stable since NCCL 2.0), so no NCCL header is needed to
 * build either.
 *
 * One NCCL communicator per rank, made together by ncclCommInitAll on the constructing thread;
 * each rank then calls its collectives from its own thread, on its own stream:
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
 * called in the same order on every rank, as NCCL requires of concurrent communicators. */
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

#include "../kernels/comm_d2d.h"

/* ---- the part of nccl.h's ABI we use ---- */

typedef struct gy_nccl_comm *gy_nccl_comm_t; /* ncclComm_t */
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
    gy_nccl_result (*comm_destroy)(gy_nccl_comm_t);
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
        GY_NCCL_SYMBOL("ncclCommDestroy", comm_destroy, 0),
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
    gy_nccl_comm_t comms[GY_COMM_MAX_RANKS];
    /* All-to-all sizes, [call parity][rank][0 = send, 1 = recv][peer]: each rank writes its row
     * before the host barrier and every rank reads the whole table after it. Two copies, so a
     * rank already in the next all-to-all does not overwrite what a slower rank still reads
     * (it cannot get two calls ahead: it would have to pass the next call's barrier). */
    int64_t sizes[2][GY_COMM_MAX_RANKS][2][GY_COMM_MAX_RANKS];
    uint64_t a2a_calls[GY_COMM_MAX_RANKS]; /* per rank; every rank makes the same calls */
} gy_comm_nccl;

static void gy_nccl_destroy(gy_comm *c) {
    gy_comm_nccl *m = c->state;
    if (m == NULL) return;
    for (int32_t r = 0; r < c->size; r++)
        if (m->comms[r] != NULL) {
            gy_nccl.comm_destroy(m->comms[r]);
            m->comms[r] = NULL;
        }
    gy_comm_streams_free(&m->streams, c);
    free(m);
    c->state = NULL;
}

static gy_status gy_nccl_init(gy_comm *c) {
    pthread_once(&gy_nccl_once, gy_nccl_load);
    if (!gy_nccl_loaded) return GY_FAIL(GY_ERR_UNAVAILABLE, "%s", gy_nccl_load_message);
    gy_comm_nccl *m = gy_calloc(1, sizeof *m);
    if (m == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory");
    c->state = m;
    GY_TRY(gy_comm_streams_init(&m->streams, c, "nccl"));
    int devices[GY_COMM_MAX_RANKS];
    for (int32_t r = 0; r < c->size; r++) devices[r] = c->devices[r];
    int32_t previous = -1;
    GY_TRY(gy_comm_device_enter(c, 0, &previous));
    const gy_nccl_result r = gy_nccl.comm_init_all(m->comms, c->size, devices);
    gy_comm_device_leave(previous);
    if (r != GY_NCCL_SUCCESS) {
        memset(m->comms, 0, sizeof m->comms);
        return gy_nccl_fail(r, "ncclCommInitAll", NULL, __FILE__, __LINE__);
    }
    return GY_OK;
}

/* An all-to-all aborted on some ranks before they counted it: start the parities again. */
static void gy_nccl_reset(gy_comm *c) {
    gy_comm_nccl *m = c->state;
    if (m != NULL) memset(m->a2a_calls, 0, sizeof m->a2a_calls);
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
    int32_t previous = -1;
    GY_TRY(gy_comm_device_enter(c, rank, &previous));
    const gy_nccl_result r = gy_nccl.all_reduce(buf, buf, (size_t)n, GY_NCCL_FLOAT32, GY_NCCL_SUM,
                                                m->comms[rank], c->streams[rank]);
    gy_comm_device_leave(previous);
    if (r != GY_NCCL_SUCCESS)
        return gy_nccl_fail(r, "ncclAllReduce", m->comms[rank], __FILE__, __LINE__);
    gy_comm_count_all_reduce(c, rank, n);
    gy_comm_count_call(c, rank);
    return GY_OK;
}

static gy_status gy_nccl_all_gather(gy_comm *c, int32_t rank, void *out, const void *in,
                                    int64_t bytes) {
    gy_comm_nccl *m = c->state;
    if (bytes > 0) {
        int32_t previous = -1;
        GY_TRY(gy_comm_device_enter(c, rank, &previous));
        const gy_nccl_result r = gy_nccl.all_gather(in, out, (size_t)bytes, GY_NCCL_INT8,
                                                    m->comms[rank], c->streams[rank]);
        gy_comm_device_leave(previous);
        if (r != GY_NCCL_SUCCESS)
            return gy_nccl_fail(r, "ncclAllGather", m->comms[rank], __FILE__, __LINE__);
    }
    gy_comm_count_all_gather(c, rank, bytes);
    gy_comm_count_call(c, rank);
    return GY_OK;
}

/* Send/recv of every pair in one group (the rank's own block copied), on the rank's stream. */
static gy_status gy_nccl_exchange(gy_comm *c, gy_comm_nccl *m, int32_t rank, void *const *recv,
                                  const int64_t *recv_bytes, const void *const *send,
                                  const int64_t *send_bytes) {
    void *stream = c->streams[rank];
    GY_TRY(gy_cuda_comm_copy(recv[rank], send[rank], (uint64_t)recv_bytes[rank], stream));
    GY_NCCL_CHECK("ncclGroupStart", m->comms[rank], gy_nccl.group_start());
    gy_status s = GY_OK;
    for (int32_t peer = 0; peer < c->size && s == GY_OK; peer++) {
        if (peer == rank) continue;
        gy_nccl_result r = GY_NCCL_SUCCESS;
        if (send_bytes[peer] > 0)
            r = gy_nccl.send(send[peer], (size_t)send_bytes[peer], GY_NCCL_INT8, peer,
                             m->comms[rank], stream);
        if (r == GY_NCCL_SUCCESS && recv_bytes[peer] > 0)
            r = gy_nccl.recv(recv[peer], (size_t)recv_bytes[peer], GY_NCCL_INT8, peer,
                             m->comms[rank], stream);
        if (r != GY_NCCL_SUCCESS)
            s = gy_nccl_fail(r, "ncclSend/ncclRecv", m->comms[rank], __FILE__, __LINE__);
    }
    /* Closed whatever happened: an open group would swallow this thread's next NCCL calls. */
    const gy_nccl_result r = gy_nccl.group_end();
    if (s == GY_OK && r != GY_NCCL_SUCCESS)
        s = gy_nccl_fail(r, "ncclGroupEnd", m->comms[rank], __FILE__, __LINE__);
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
    int32_t previous = -1;
    GY_TRY(gy_comm_device_enter(c, rank, &previous));
    const gy_status s = gy_nccl_exchange(c, m, rank, recv, recv_bytes, send, send_bytes);
    gy_comm_device_leave(previous);
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
    int32_t previous = -1;
    GY_TRY(gy_comm_device_enter(c, rank, &previous));
    const gy_nccl_result r =
        send ? gy_nccl.send(buf, (size_t)bytes, GY_NCCL_INT8, peer, m->comms[rank], c->streams[rank])
             : gy_nccl.recv(buf, (size_t)bytes, GY_NCCL_INT8, peer, m->comms[rank], c->streams[rank]);
    gy_comm_device_leave(previous);
    if (r != GY_NCCL_SUCCESS)
        return gy_nccl_fail(r, send ? "ncclSend" : "ncclRecv", m->comms[rank], __FILE__, __LINE__);
    return GY_OK;
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
    .reset = gy_nccl_reset,
};

#endif /* GY_WITH_CUDA */
