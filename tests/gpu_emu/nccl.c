/* nccl.c: a pretend libnccl.so.2 on the emulated runtime (runtime.c), built as a shared library
 * and loaded by csrc/comm/comm_nccl.c through GYGES_NCCL_LIBRARY, so that the nccl backend runs
 * without GPUs, and behaves as NCCL does where our code could get it wrong:
 *
 *   - communicators from a unique id: ncclGetUniqueId, then ncclCommInitRank by every rank (from
 *     its own thread, or from one thread inside a group); outside a group InitRank blocks until
 *     every rank has joined. ncclCommInitAll is that, for a list of devices. The communicator
 *     lives on the device current at InitRank; two ranks on one device are refused.
 *   - every operation is asynchronous: the call enqueues it on the caller's stream and returns.
 *     When its stream reaches it the operation is posted; it completes when its peers have
 *     posted theirs (every rank for a collective, the other end for a send or a receive), and
 *     the stream does not go past it before then. A send therefore blocks its stream until the
 *     receiver posts, as NCCL's rendezvous does. Collectives match by their order on the
 *     communicator, sends and receives by their order between the pair.
 *   - groups (ncclGroupStart/End, nested): the operations of a group, for any communicators and
 *     streams, are posted together when the outermost group ends and each stream waits for its
 *     own. So one thread driving several GPUs (a grouped all-to-all over four ranks issued by one
 *     thread) completes, and a rank's grouped send and receive to the same peer cannot deadlock.
 *   - ncclCommAbort: the communicator's operations stop with an error, and so do its peers'
 *     (ncclRemoteError), so a rank stuck waiting for a peer that will never come wakes up;
 *     ncclCommGetAsyncError reports it. Later calls on the communicator fail.
 *   - a hang detector: an operation still waiting after GYGES_EMU_NCCL_TIMEOUT_S seconds
 *     (default 60; fake_nccl_set_timeout changes it) is a would-be deadlock on a GPU (two ranks
 *     posting on two communicators in opposite orders, a send without its receive): it is
 *     reported as a problem and the communicator fails with ncclSystemError instead of hanging.
 *
 * The all-reduce adds in rank order (not NCCL's ring or tree: NCCL does not promise an order
 * either). Whatever NCCL would hang on or refuse (ranks calling different collectives or sizes, a
 * receive of another size than its send, a stream of another device, a would-be deadlock) is
 * counted in fake_nccl_errors() and described by fake_nccl_last_problem(), so the tests can
 * assert that nothing of the kind happened (and fake_nccl_operations() that NCCL did run). The
 * cuda* calls resolve against the emulated runtime: the test program's (linked -rdynamic), or
 * libgy_emu_cudart.so, which this library links in the ext build. One lock serialises the whole
 * pretend network: simple, and fast enough. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdarg.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime_api.h>

typedef int ncclResult_t;
enum {
    ncclSuccess = 0,
    ncclUnhandledCudaError = 1,
    ncclSystemError = 2,
    ncclInternalError = 3,
    ncclInvalidArgument = 4,
    ncclInvalidUsage = 5,
    ncclRemoteError = 6,
};
enum { ncclInt8 = 0, ncclFloat32 = 7 };
enum { ncclSum = 0 };

#define FAKE_NCCL_MAX 16
#define FAKE_ID_MAGIC "gyges fake NCCL id"

typedef struct { char internal[128]; } ncclUniqueId; /* NCCL_UNIQUE_ID_BYTES */

typedef enum { FAKE_ALL_REDUCE, FAKE_ALL_GATHER, FAKE_SEND, FAKE_RECV } fake_kind;
static const char *const fake_kind_name[] = {"all-reduce", "all-gather", "send", "receive"};

typedef enum { FAKE_ISSUED, FAKE_POSTED, FAKE_DONE, FAKE_FAILED } fake_state;

typedef struct fake_clique fake_clique;

typedef struct ncclComm {
    fake_clique *clique;
    int rank, device;
    uint64_t collectives;              /* issued so far: the next one's sequence number */
    uint64_t sends[FAKE_NCCL_MAX];     /* to each peer, issued so far */
    uint64_t recvs[FAKE_NCCL_MAX];     /* from each peer */
    int inflight;                      /* issued, not yet finished on the stream */
    int aborted;
    char last_error[256];
} *ncclComm_t;

typedef struct fake_op {
    fake_kind kind;
    ncclComm_t comm;
    int peer;     /* sends and receives */
    uint64_t seq; /* the comm's nth collective, or nth message of its pair and direction */
    const void *in;
    void *out;
    size_t count; /* floats for the all-reduce, bytes otherwise (per rank for the all-gather) */
    fake_state state;
    struct fake_op *next_posted;
} fake_op;

/* One stream's part of a group: its stream posts the ops, then waits for them. */
typedef struct fake_batch {
    void *stream;
    int device;
    int n, cap;
    fake_op **ops;
    struct fake_batch *next;
} fake_batch;

struct fake_clique {
    uint64_t id;
    int size, joined, refs;
    ncclComm_t ranks[FAKE_NCCL_MAX];
    int error;      /* abort or the hang detector: every op of the clique fails from then on */
    fake_op *posted; /* posted and not yet matched */
    struct fake_clique *next_joining;
};

static pthread_mutex_t fake_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t fake_cond;
static pthread_once_t fake_once = PTHREAD_ONCE_INIT;
static fake_clique *fake_joining; /* cliques some rank has not joined yet */
static uint64_t fake_ids;
static double fake_timeout_s;
static int fake_problems;
static long fake_completed; /* operations that moved their bytes */
static char fake_problem[512];
static char fake_last_error[256]; /* for ncclGetLastError(NULL) */

/* The condition waits on CLOCK_MONOTONIC, so that the hang detector ignores clock changes. */
static void fake_init(void) {
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&fake_cond, &attr);
    pthread_condattr_destroy(&attr);
    const char *env = getenv("GYGES_EMU_NCCL_TIMEOUT_S");
    fake_timeout_s = env != NULL && atof(env) > 0 ? atof(env) : 60.0;
}

static void fake_lock_all(void) {
    pthread_once(&fake_once, fake_init);
    pthread_mutex_lock(&fake_lock);
}

/* With fake_lock held. */
static void fake_problem_locked(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void fake_problem_locked(const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    vsnprintf(fake_problem, sizeof fake_problem, fmt, args);
    va_end(args);
    fake_problems++;
}

/* ---- what the tests read (test_comm.c, tests/test_gpu_emu*.py) ---- */

int fake_nccl_errors(void) {
    fake_lock_all();
    const int n = fake_problems;
    pthread_mutex_unlock(&fake_lock);
    return n;
}

const char *fake_nccl_last_problem(void) { return fake_problem; }

/* Operations (one rank's part of a collective, a send, a receive) completed so far. */
long fake_nccl_operations(void) {
    fake_lock_all();
    const long n = fake_completed;
    pthread_mutex_unlock(&fake_lock);
    return n;
}

/* The hang detector's patience, in seconds, for operations that start waiting from now on. */
void fake_nccl_set_timeout(double seconds) {
    fake_lock_all();
    fake_timeout_s = seconds;
    pthread_mutex_unlock(&fake_lock);
}

/* ---- matching ---- */

static void fake_unpost(fake_clique *q, fake_op *op) {
    for (fake_op **p = &q->posted; *p != NULL; p = &(*p)->next_posted)
        if (*p == op) {
            *p = op->next_posted;
            return;
        }
}

static void fake_finish(fake_clique *q, fake_op *op, fake_state state) {
    fake_unpost(q, op);
    op->state = state;
    fake_completed += state == FAKE_DONE;
}

/* A posted send or receive meets its other end, if that has been posted. */
static void fake_match_p2p(fake_clique *q, fake_op *op) {
    const fake_kind other = op->kind == FAKE_SEND ? FAKE_RECV : FAKE_SEND;
    for (fake_op *p = q->posted; p != NULL; p = p->next_posted) {
        if (p->kind != other || p->comm->rank != op->peer || p->peer != op->comm->rank ||
            p->seq != op->seq)
            continue;
        fake_op *send = op->kind == FAKE_SEND ? op : p, *recv = op->kind == FAKE_SEND ? p : op;
        fake_state state = FAKE_DONE;
        if (send->count != recv->count) {
            fake_problem_locked("rank %d receives %zu bytes from rank %d, which sends %zu "
                                "(NCCL would hang or corrupt)", recv->comm->rank, recv->count,
                                send->comm->rank, send->count);
            state = FAKE_FAILED;
        } else {
            memcpy(recv->out, send->in, send->count);
        }
        fake_finish(q, p, state);
        fake_finish(q, op, state);
        return;
    }
}

/* The collective of sequence number op->seq runs when every rank has posted it: computed into
 * temporaries first, since outputs may be inputs (in place). */
static void fake_match_collective(fake_clique *q, fake_op *op) {
    fake_op *all[FAKE_NCCL_MAX] = {0};
    int found = 0;
    for (fake_op *p = q->posted; p != NULL; p = p->next_posted)
        if ((p->kind == FAKE_ALL_REDUCE || p->kind == FAKE_ALL_GATHER) && p->seq == op->seq &&
            all[p->comm->rank] == NULL) {
            all[p->comm->rank] = p;
            found++;
        }
    if (found < q->size) return;
    fake_state state = FAKE_DONE;
    for (int r = 0; r < q->size; r++)
        if (all[r]->kind != op->kind || all[r]->count != op->count) {
            fake_problem_locked("ranks called different collectives or sizes: rank %d a %s of "
                                "%zu, rank %d a %s of %zu", op->comm->rank,
                                fake_kind_name[op->kind], op->count, r,
                                fake_kind_name[all[r]->kind], all[r]->count);
            state = FAKE_FAILED;
        }
    if (state == FAKE_DONE && op->kind == FAKE_ALL_REDUCE) {
        float *sum = malloc(op->count * sizeof(float) + 1);
        for (size_t i = 0; i < op->count; i++) {
            float v = 0.0f;
            for (int r = 0; r < q->size; r++) v += ((const float *)all[r]->in)[i];
            sum[i] = v;
        }
        for (int r = 0; r < q->size; r++) memcpy(all[r]->out, sum, op->count * sizeof(float));
        free(sum);
    } else if (state == FAKE_DONE) {
        const size_t n = op->count;
        char *gathered = malloc(n * (size_t)q->size + 1);
        for (int r = 0; r < q->size; r++) memcpy(gathered + (size_t)r * n, all[r]->in, n);
        for (int r = 0; r < q->size; r++) memcpy(all[r]->out, gathered, n * (size_t)q->size);
        free(gathered);
    }
    for (int r = 0; r < q->size; r++) fake_finish(q, all[r], state);
}

/* The clique fails: every op waiting in it fails, and so does every later one. */
static void fake_fail_clique(fake_clique *q, int error) {
    if (q->error == ncclSuccess) q->error = error;
    while (q->posted != NULL) fake_finish(q, q->posted, FAKE_FAILED);
    pthread_cond_broadcast(&fake_cond);
}

/* ---- on the streams ---- */

/* The stream reached the batch: its ops are posted and matched with their peers'. */
static void fake_post(void *arg) {
    fake_batch *b = arg;
    fake_lock_all();
    for (int i = 0; i < b->n; i++) {
        fake_op *op = b->ops[i];
        fake_clique *q = op->comm->clique;
        if (q->error != ncclSuccess || op->comm->aborted) {
            op->state = FAKE_FAILED;
            continue;
        }
        op->state = FAKE_POSTED;
        op->next_posted = q->posted;
        q->posted = op;
        if (op->kind == FAKE_SEND || op->kind == FAKE_RECV) fake_match_p2p(q, op);
        else fake_match_collective(q, op);
    }
    pthread_cond_broadcast(&fake_cond);
    pthread_mutex_unlock(&fake_lock);
}

static const fake_op *fake_unfinished(const fake_batch *b) {
    for (int i = 0; i < b->n; i++)
        if (b->ops[i]->state == FAKE_POSTED) return b->ops[i];
    return NULL;
}

/* The stream waits until every op of its batch has completed or failed; past the timeout, the
 * wait is a would-be deadlock: reported, and its communicator fails. */
static void fake_wait(void *arg) {
    fake_batch *b = arg;
    fake_lock_all();
    struct timespec deadline;
    clock_gettime(CLOCK_MONOTONIC, &deadline);
    const double timeout = fake_timeout_s;
    deadline.tv_sec += (time_t)timeout;
    deadline.tv_nsec += (long)((timeout - (double)(time_t)timeout) * 1e9);
    if (deadline.tv_nsec >= 1000000000L) {
        deadline.tv_sec++;
        deadline.tv_nsec -= 1000000000L;
    }
    const fake_op *op;
    while ((op = fake_unfinished(b)) != NULL) {
        if (pthread_cond_timedwait(&fake_cond, &fake_lock, &deadline) == ETIMEDOUT &&
            (op = fake_unfinished(b)) != NULL) {
            fake_problem_locked("would-be deadlock: rank %d (device %d) waited %g s for its %s "
                                "(number %llu%s%d) and its peers never posted theirs",
                                op->comm->rank, op->comm->device, timeout, fake_kind_name[op->kind],
                                (unsigned long long)op->seq,
                                op->kind == FAKE_SEND ? " to rank " : op->kind == FAKE_RECV
                                    ? " from rank " : " on a communicator of ",
                                op->kind == FAKE_SEND || op->kind == FAKE_RECV
                                    ? op->peer : op->comm->clique->size);
            fprintf(stderr, "fake NCCL: %s\n", fake_problem);
            fake_fail_clique(op->comm->clique, ncclSystemError);
        }
    }
    for (int i = 0; i < b->n; i++) {
        ncclComm_t comm = b->ops[i]->comm;
        if (b->ops[i]->state == FAKE_FAILED && comm->last_error[0] == '\0')
            snprintf(comm->last_error, sizeof comm->last_error, "%s",
                     comm->aborted ? "the communicator was aborted"
                                   : "a peer aborted, or the hang detector failed the communicator");
        comm->inflight--;
        free(b->ops[i]);
    }
    pthread_cond_broadcast(&fake_cond);
    pthread_mutex_unlock(&fake_lock);
    free(b->ops);
    free(b);
}

/* ---- groups ---- */

typedef struct fake_join {
    fake_clique *clique;
    struct fake_join *next;
} fake_join;

/* This thread's open group: its batches (one per stream) and the InitRanks it must wait for. */
static _Thread_local int fake_depth;
static _Thread_local fake_batch *fake_batches;
static _Thread_local fake_join *fake_joins;
static _Thread_local ncclResult_t fake_group_error;

static ncclResult_t fake_error(ncclComm_t comm, ncclResult_t r, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static ncclResult_t fake_error(ncclComm_t comm, ncclResult_t r, const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    char *to = comm != NULL ? comm->last_error : fake_last_error;
    vsnprintf(to, sizeof fake_last_error, fmt, args);
    va_end(args);
    return r;
}

ncclResult_t ncclGroupStart(void) {
    if (fake_depth++ == 0) fake_group_error = ncclSuccess;
    return ncclSuccess;
}

/* With fake_lock held: until every rank of q joined, or the hang detector gives up. */
static ncclResult_t fake_wait_joined(fake_clique *q) {
    struct timespec deadline;
    clock_gettime(CLOCK_MONOTONIC, &deadline);
    deadline.tv_sec += (time_t)fake_timeout_s + 1;
    while (q->joined < q->size && q->error == ncclSuccess)
        if (pthread_cond_timedwait(&fake_cond, &fake_lock, &deadline) == ETIMEDOUT &&
            q->joined < q->size) {
            fake_problem_locked("would-be deadlock: ncclCommInitRank waited for %d of %d ranks "
                                "that never joined", q->size - q->joined, q->size);
            fake_fail_clique(q, ncclSystemError);
        }
    return q->error;
}

static void fake_batches_free(fake_batch *b) {
    while (b != NULL) {
        fake_batch *next = b->next;
        for (int i = 0; i < b->n; i++) free(b->ops[i]);
        free(b->ops);
        free(b);
        b = next;
    }
}

ncclResult_t ncclGroupEnd(void) {
    if (fake_depth == 0) return fake_error(NULL, ncclInvalidUsage, "ncclGroupEnd without a start");
    if (--fake_depth > 0) return ncclSuccess;
    fake_batch *batches = fake_batches;
    fake_join *joins = fake_joins;
    fake_batches = NULL;
    fake_joins = NULL;
    ncclResult_t r = fake_group_error;
    fake_lock_all(); /* after a refused call, the group's InitRanks are not waited for */
    for (fake_join *j = joins; j != NULL && r == ncclSuccess; j = j->next) r = fake_wait_joined(j->clique);
    pthread_mutex_unlock(&fake_lock);
    while (joins != NULL) {
        fake_join *next = joins->next;
        free(joins);
        joins = next;
    }
    if (r != ncclSuccess) {
        if (batches != NULL) {
            fake_lock_all();
            for (fake_batch *b = batches; b != NULL; b = b->next)
                for (int i = 0; i < b->n; i++) b->ops[i]->comm->inflight--;
            pthread_cond_broadcast(&fake_cond);
            pthread_mutex_unlock(&fake_lock);
        }
        fake_batches_free(batches);
        return r;
    }
    /* Every stream posts before any waits: in the emulator's synchronous mode the host thread is
     * every stream, and a wait before the other streams' posts would never end. NCCL launches
     * on each communicator's device itself. */
    int previous = 0;
    cudaGetDevice(&previous);
    for (int pass = 0; pass < 2; pass++)
        for (fake_batch *b = batches, *next; b != NULL; b = next) {
            next = b->next; /* the wait frees b, perhaps before this loop reads it again */
            cudaSetDevice(b->device);
            cudaLaunchHostFunc(b->stream, pass == 0 ? fake_post : fake_wait, b);
        }
    cudaSetDevice(previous);
    return ncclSuccess;
}

/* ---- issuing an operation ---- */

static ncclResult_t fake_issue(fake_kind kind, ncclComm_t comm, int peer, const void *in, void *out,
                               size_t count, void *stream) {
    if (comm == NULL) return fake_error(NULL, ncclInvalidArgument, "NULL communicator");
    int device = -1;
    cudaStreamGetDevice(stream, &device);
    fake_lock_all();
    ncclResult_t r = ncclSuccess;
    if (comm->aborted) {
        r = fake_error(comm, ncclInvalidUsage, "the communicator was aborted");
    } else if (comm->clique->error != ncclSuccess) {
        r = comm->clique->error; /* NCCL answers the communicator's asynchronous error */
    } else if (device != comm->device) {
        fake_problem_locked("stream of device %d for rank %d's communicator on device %d",
                            device, comm->rank, comm->device);
        r = fake_error(comm, ncclInvalidArgument, "stream of device %d for a communicator on "
                       "device %d", device, comm->device);
    } else if ((kind == FAKE_SEND || kind == FAKE_RECV) &&
               (peer < 0 || peer >= comm->clique->size || peer == comm->rank)) {
        r = fake_error(comm, ncclInvalidArgument, "peer %d of rank %d in a communicator of %d",
                       peer, comm->rank, comm->clique->size);
    }
    fake_op *op = r == ncclSuccess ? calloc(1, sizeof *op) : NULL;
    if (op != NULL) {
        *op = (fake_op){.kind = kind, .comm = comm, .peer = peer, .in = in, .out = out,
                        .count = count, .state = FAKE_ISSUED};
        op->seq = kind == FAKE_SEND ? comm->sends[peer]++
                  : kind == FAKE_RECV ? comm->recvs[peer]++ : comm->collectives++;
        comm->inflight++;
    } else if (r == ncclSuccess) {
        r = fake_error(comm, ncclSystemError, "out of host memory");
    }
    pthread_mutex_unlock(&fake_lock);
    if (r != ncclSuccess) {
        if (fake_depth > 0 && fake_group_error == ncclSuccess) fake_group_error = r;
        return r;
    }
    const int grouped = fake_depth > 0;
    if (!grouped) ncclGroupStart();
    fake_batch *b = fake_batches;
    while (b != NULL && b->stream != stream) b = b->next;
    if (b == NULL) {
        b = calloc(1, sizeof *b);
        b->stream = stream;
        b->device = device;
        b->next = fake_batches;
        fake_batches = b;
    }
    if (b->n == b->cap) {
        b->cap = b->cap ? 2 * b->cap : 4;
        b->ops = realloc(b->ops, sizeof *b->ops * (size_t)b->cap);
    }
    b->ops[b->n++] = op;
    return grouped ? ncclSuccess : ncclGroupEnd();
}

/* ---- the API ---- */

ncclResult_t ncclGetVersion(int *version) {
    *version = 22800;
    return ncclSuccess;
}

const char *ncclGetErrorString(ncclResult_t r) {
    switch (r) {
    case ncclSuccess: return "no error";
    case ncclSystemError: return "unhandled system error (fake NCCL)";
    case ncclInvalidArgument: return "invalid argument (fake NCCL)";
    case ncclInvalidUsage: return "invalid usage (fake NCCL)";
    case ncclRemoteError: return "remote process exited or there was a network error (fake NCCL)";
    default: return "fake NCCL error";
    }
}

const char *ncclGetLastError(ncclComm_t comm) { return comm ? comm->last_error : fake_last_error; }

ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
    if (id == NULL) return fake_error(NULL, ncclInvalidArgument, "NULL unique id");
    memset(id, 0, sizeof *id);
    fake_lock_all();
    const uint64_t serial = ++fake_ids;
    pthread_mutex_unlock(&fake_lock);
    memcpy(id->internal, FAKE_ID_MAGIC, sizeof FAKE_ID_MAGIC);
    memcpy(id->internal + 64, &serial, sizeof serial);
    return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t *out, int nranks, ncclUniqueId id, int rank) {
    uint64_t serial = 0;
    memcpy(&serial, id.internal + 64, sizeof serial);
    if (out == NULL || memcmp(id.internal, FAKE_ID_MAGIC, sizeof FAKE_ID_MAGIC) != 0 || serial == 0)
        return fake_error(NULL, ncclInvalidArgument, "not a unique id of ncclGetUniqueId");
    if (nranks < 1 || nranks > FAKE_NCCL_MAX || rank < 0 || rank >= nranks)
        return fake_error(NULL, ncclInvalidArgument, "rank %d of %d", rank, nranks);
    int device = 0, count = 0;
    cudaGetDevice(&device);
    if (cudaGetDeviceCount(&count) != cudaSuccess || device >= count)
        return fake_error(NULL, ncclUnhandledCudaError, "no CUDA device");
    ncclComm_t comm = calloc(1, sizeof *comm);
    if (comm == NULL) return fake_error(NULL, ncclSystemError, "out of host memory");
    fake_lock_all();
    fake_clique *q = fake_joining;
    while (q != NULL && q->id != serial) q = q->next_joining;
    ncclResult_t r = ncclSuccess;
    if (q == NULL) {
        q = calloc(1, sizeof *q);
        q->id = serial;
        q->size = nranks;
        q->next_joining = fake_joining;
        fake_joining = q;
    }
    if (q->size != nranks) {
        r = fake_error(NULL, ncclInvalidArgument, "rank %d joins with %d ranks, rank 0..%d "
                       "with %d", rank, nranks, q->size - 1, q->size);
    } else if (q->ranks[rank] != NULL) {
        r = fake_error(NULL, ncclInvalidUsage, "rank %d joined twice", rank);
    } else {
        for (int i = 0; i < q->size; i++)
            if (q->ranks[i] != NULL && q->ranks[i]->device == device)
                r = fake_error(NULL, ncclInvalidUsage, "Duplicate GPU detected: rank %d and "
                               "rank %d both on CUDA device %d", i, rank, device);
    }
    if (r != ncclSuccess) {
        pthread_mutex_unlock(&fake_lock);
        free(comm);
        if (fake_depth > 0 && fake_group_error == ncclSuccess) fake_group_error = r;
        return r;
    }
    comm->clique = q;
    comm->rank = rank;
    comm->device = device;
    q->ranks[rank] = comm;
    q->refs++;
    if (++q->joined == q->size) { /* complete: the id is spent */
        for (fake_clique **p = &fake_joining; *p != NULL; p = &(*p)->next_joining)
            if (*p == q) {
                *p = q->next_joining;
                break;
            }
        pthread_cond_broadcast(&fake_cond);
    }
    *out = comm;
    if (fake_depth == 0) {
        r = fake_wait_joined(q);
        pthread_mutex_unlock(&fake_lock);
        return r;
    }
    pthread_mutex_unlock(&fake_lock);
    fake_join *j = calloc(1, sizeof *j);
    j->clique = q;
    j->next = fake_joins;
    fake_joins = j;
    return ncclSuccess;
}

ncclResult_t ncclCommInitAll(ncclComm_t *comms, int ndev, const int *devlist) {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || ndev < 1 || ndev > FAKE_NCCL_MAX)
        return fake_error(NULL, ncclInvalidArgument, "%d devices", ndev);
    for (int i = 0; i < ndev; i++)
        if (devlist != NULL && (devlist[i] < 0 || devlist[i] >= count))
            return fake_error(NULL, ncclInvalidArgument, "CUDA device %d of %d", devlist[i], count);
    ncclUniqueId id;
    ncclGetUniqueId(&id);
    int previous = 0;
    cudaGetDevice(&previous);
    ncclGroupStart();
    ncclResult_t r = ncclSuccess;
    for (int i = 0; i < ndev && r == ncclSuccess; i++) {
        cudaSetDevice(devlist != NULL ? devlist[i] : i);
        r = ncclCommInitRank(&comms[i], ndev, id, i);
    }
    if (r != ncclSuccess) { /* fail the clique, so that the group's wait ends at once */
        fake_lock_all();
        fake_clique *q = fake_joining;
        while (q != NULL && memcmp(&q->id, id.internal + 64, sizeof q->id) != 0)
            q = q->next_joining;
        if (q != NULL) fake_fail_clique(q, r);
        pthread_mutex_unlock(&fake_lock);
    }
    const ncclResult_t end = ncclGroupEnd();
    cudaSetDevice(previous);
    return r != ncclSuccess ? r : end;
}

/* With fake_lock held; takes the lock's release into account. */
static void fake_release(ncclComm_t comm) {
    fake_clique *q = comm->clique;
    q->ranks[comm->rank] = NULL;
    if (--q->refs == 0) {
        for (fake_clique **p = &fake_joining; *p != NULL; p = &(*p)->next_joining)
            if (*p == q) {
                *p = q->next_joining;
                break;
            }
        free(q);
    }
    free(comm);
}

/* Waits for the communicator's operations to finish (as ncclCommDestroy does), then frees it. */
ncclResult_t ncclCommDestroy(ncclComm_t comm) {
    if (comm == NULL) return ncclSuccess;
    fake_lock_all();
    while (comm->inflight > 0) pthread_cond_wait(&fake_cond, &fake_lock);
    fake_release(comm);
    pthread_mutex_unlock(&fake_lock);
    return ncclSuccess;
}

/* Stops the communicator: its waiting operations fail, its peers' fail with ncclRemoteError,
 * and it is freed once its stream work has let go of it. Safe while another thread (or stream)
 * is stuck in one of its operations: that is what it is for. */
ncclResult_t ncclCommAbort(ncclComm_t comm) {
    if (comm == NULL) return ncclSuccess;
    fake_lock_all();
    comm->aborted = 1;
    fake_clique *q = comm->clique;
    for (fake_op *p = q->posted, *next; p != NULL; p = next) {
        next = p->next_posted;
        if (p->comm == comm) fake_finish(q, p, FAKE_FAILED);
    }
    fake_fail_clique(q, ncclRemoteError);
    while (comm->inflight > 0) pthread_cond_wait(&fake_cond, &fake_lock);
    fake_release(comm);
    pthread_mutex_unlock(&fake_lock);
    return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *error) {
    if (comm == NULL || error == NULL) return ncclInvalidArgument;
    fake_lock_all();
    *error = comm->clique->error;
    pthread_mutex_unlock(&fake_lock);
    return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int *count) {
    *count = comm->clique->size;
    return ncclSuccess;
}

ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int *device) {
    *device = comm->device;
    return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *rank) {
    *rank = comm->rank;
    return ncclSuccess;
}

ncclResult_t ncclAllReduce(const void *in, void *out, size_t count, int dtype, int op,
                           ncclComm_t comm, void *stream) {
    if (dtype != ncclFloat32 || op != ncclSum)
        return fake_error(comm, ncclInvalidArgument, "only float32 sums are pretended");
    return fake_issue(FAKE_ALL_REDUCE, comm, -1, in, out, count, stream);
}

ncclResult_t ncclAllGather(const void *in, void *out, size_t count, int dtype, ncclComm_t comm,
                           void *stream) {
    if (dtype != ncclInt8) return fake_error(comm, ncclInvalidArgument, "only bytes are pretended");
    return fake_issue(FAKE_ALL_GATHER, comm, -1, in, out, count, stream);
}

ncclResult_t ncclSend(const void *buf, size_t count, int dtype, int peer, ncclComm_t comm,
                      void *stream) {
    if (dtype != ncclInt8) return fake_error(comm, ncclInvalidArgument, "only bytes are pretended");
    return fake_issue(FAKE_SEND, comm, peer, buf, NULL, count, stream);
}

ncclResult_t ncclRecv(void *buf, size_t count, int dtype, int peer, ncclComm_t comm, void *stream) {
    if (dtype != ncclInt8) return fake_error(comm, ncclInvalidArgument, "only bytes are pretended");
    return fake_issue(FAKE_RECV, comm, peer, NULL, buf, count, stream);
}
