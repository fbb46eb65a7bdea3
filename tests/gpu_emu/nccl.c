/* nccl.c: a pretend libnccl.so.2 on the emulated runtime (runtime.c), built as a shared library
 * and loaded by csrc/comm/comm_nccl.c through GYGES_NCCL_LIBRARY, so that the nccl backend's
 * glue (loading, ncclCommInitAll, grouped send/recv, the size table, stats) runs without GPUs.
 *
 * Like NCCL, a collective is enqueued on the caller's stream (cudaLaunchHostFunc); when every
 * rank's stream reaches it, the ranks meet (on their stream threads, with
 * GYGES_EMU_STREAMS=threads), read what they need into temporaries, meet again, and write their
 * outputs; a send and its receive meet pairwise. The all-reduce adds in rank order (not the
 * tree: NCCL does not promise it either). Whatever NCCL would hang on or refuse (ranks calling
 * different collectives or sizes, a send without its receive, a stream of another device) is
 * counted in fake_nccl_errors() and described by fake_nccl_last_problem(), so the tests can
 * assert that nothing of the kind happened. The cuda* calls resolve against the test executable
 * (linked with -rdynamic). */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

typedef int ncclResult_t;
enum { ncclSuccess = 0, ncclInvalidArgument = 4, ncclInvalidUsage = 5 };
enum { ncclInt8 = 0, ncclFloat32 = 7 };
enum { ncclSum = 0 };

#define FAKE_NCCL_MAX 16

typedef struct fake_mail {
    const void *buf;
    size_t bytes;
    int posted;
    uint64_t sent, taken; /* messages posted and copied out so far */
} fake_mail;

typedef struct fake_clique {
    int size;
    int refs;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    int waiting;
    uint64_t generation;
    struct fake_call *posted[FAKE_NCCL_MAX];
    fake_mail mail[FAKE_NCCL_MAX][FAKE_NCCL_MAX]; /* [src][dst] */
} fake_clique;

typedef struct ncclComm {
    fake_clique *clique;
    int rank, device;
    uint64_t calls;
    char last_error[256];
} *ncclComm_t;

enum { FAKE_ALL_REDUCE, FAKE_ALL_GATHER, FAKE_P2P };

typedef struct fake_p2p {
    int send; /* 1 send, 0 recv */
    int peer;
    void *buf;
    size_t bytes;
} fake_p2p;

typedef struct fake_call {
    int kind;
    uint64_t seq;
    ncclComm_t comm;
    const void *in;
    void *out;
    size_t count; /* elements */
    int n_p2p;
    fake_p2p p2p[2 * FAKE_NCCL_MAX];
} fake_call;

static pthread_mutex_t fake_problem_lock = PTHREAD_MUTEX_INITIALIZER;
static int fake_problems;
static char fake_problem[512];

static void fake_nccl_problem(const char *message, int a, int b) {
    pthread_mutex_lock(&fake_problem_lock);
    fake_problems++;
    snprintf(fake_problem, sizeof fake_problem, "%s (%d, %d)", message, a, b);
    pthread_mutex_unlock(&fake_problem_lock);
}

int fake_nccl_errors(void) {
    pthread_mutex_lock(&fake_problem_lock);
    const int n = fake_problems;
    pthread_mutex_unlock(&fake_problem_lock);
    return n;
}

const char *fake_nccl_last_problem(void) { return fake_problem; }

static void fake_clique_barrier(fake_clique *q) {
    pthread_mutex_lock(&q->lock);
    const uint64_t generation = q->generation;
    if (++q->waiting == q->size) {
        q->waiting = 0;
        q->generation++;
        pthread_cond_broadcast(&q->cond);
    } else {
        while (generation == q->generation) pthread_cond_wait(&q->cond, &q->lock);
    }
    pthread_mutex_unlock(&q->lock);
}

/* Point-to-point on the rank's stream thread: like NCCL, only the two ends of a pair meet.
 * One message at a time per ordered pair: a send waits for an empty mailbox, posts, and does
 * not complete before its receiver has copied it out. */
static void fake_nccl_p2p(fake_call *c) {
    fake_clique *q = c->comm->clique;
    const int rank = c->comm->rank;
    uint64_t ids[2 * FAKE_NCCL_MAX];
    pthread_mutex_lock(&q->lock);
    for (int i = 0; i < c->n_p2p; i++) {
        const fake_p2p *p = &c->p2p[i];
        if (!p->send) continue;
        fake_mail *m = &q->mail[rank][p->peer];
        while (m->posted) pthread_cond_wait(&q->cond, &q->lock);
        m->buf = p->buf;
        m->bytes = p->bytes;
        m->posted = 1;
        ids[i] = ++m->sent;
    }
    pthread_cond_broadcast(&q->cond);
    for (int i = 0; i < c->n_p2p; i++) {
        const fake_p2p *p = &c->p2p[i];
        if (p->send) continue;
        fake_mail *m = &q->mail[p->peer][rank];
        while (!m->posted) pthread_cond_wait(&q->cond, &q->lock);
        if (m->bytes != p->bytes)
            fake_nccl_problem("a receive of another size than its send", rank, p->peer);
        else
            memcpy(p->buf, m->buf, p->bytes);
        m->posted = 0;
        m->taken = m->sent;
        pthread_cond_broadcast(&q->cond);
    }
    for (int i = 0; i < c->n_p2p; i++) {
        const fake_p2p *p = &c->p2p[i];
        if (!p->send) continue;
        while (q->mail[rank][p->peer].taken < ids[i]) pthread_cond_wait(&q->cond, &q->lock);
    }
    pthread_mutex_unlock(&q->lock);
}

/* Collectives on the rank's stream thread: every rank meets, reads, meets, writes. */
static void fake_nccl_run(void *arg) {
    fake_call *c = arg;
    if (c->kind == FAKE_P2P) {
        fake_nccl_p2p(c);
        free(c);
        return;
    }
    fake_clique *q = c->comm->clique;
    const int rank = c->comm->rank, size = q->size;
    q->posted[rank] = c;
    fake_clique_barrier(q);
    for (int r = 0; r < size; r++)
        if (q->posted[r]->seq != c->seq || q->posted[r]->kind != c->kind ||
            q->posted[r]->count != c->count)
            fake_nccl_problem("ranks called different collectives or sizes", rank, r);
    void *temp = NULL;
    if (c->kind == FAKE_ALL_REDUCE) {
        float *sum = malloc(c->count * sizeof(float) + 1);
        for (size_t i = 0; i < c->count; i++) {
            float v = 0.0f;
            for (int r = 0; r < size; r++) v += ((const float *)q->posted[r]->in)[i];
            sum[i] = v;
        }
        temp = sum;
    } else {
        char *all = malloc(c->count * (size_t)size + 1);
        for (int r = 0; r < size; r++) memcpy(all + (size_t)r * c->count, q->posted[r]->in, c->count);
        temp = all;
    }
    fake_clique_barrier(q); /* every input has been read */
    memcpy(c->out, temp, c->kind == FAKE_ALL_REDUCE ? c->count * sizeof(float)
                                                    : c->count * (size_t)size);
    free(temp);
    free(c);
}

static ncclResult_t fake_nccl_enqueue(fake_call *c, void *stream) {
    ncclComm_t comm = c->comm;
    int device = -1;
    cudaStreamGetDevice(stream, &device);
    if (device != comm->device) {
        snprintf(comm->last_error, sizeof comm->last_error,
                 "stream of device %d for a communicator on device %d", device, comm->device);
        fake_nccl_problem("stream on the wrong device", comm->rank, comm->device);
        free(c);
        return ncclInvalidArgument;
    }
    if (c->kind != FAKE_P2P) c->seq = comm->calls++; /* pairs meet without the clique */
    if (cudaLaunchHostFunc(stream, fake_nccl_run, c) != cudaSuccess) {
        snprintf(comm->last_error, sizeof comm->last_error, "enqueue failed");
        free(c);
        return ncclInvalidUsage;
    }
    return ncclSuccess;
}

/* ---- the API comm_nccl.c resolves ---- */

ncclResult_t ncclGetVersion(int *version) {
    *version = 22800;
    return ncclSuccess;
}

const char *ncclGetErrorString(ncclResult_t r) {
    return r == ncclSuccess ? "no error" : "fake NCCL error";
}

const char *ncclGetLastError(ncclComm_t comm) { return comm ? comm->last_error : ""; }

ncclResult_t ncclCommInitAll(ncclComm_t *comms, int ndev, const int *devlist) {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || ndev < 1 || ndev > FAKE_NCCL_MAX)
        return ncclInvalidArgument;
    for (int i = 0; i < ndev; i++) {
        if (devlist[i] < 0 || devlist[i] >= count) return ncclInvalidArgument;
        for (int j = 0; j < i; j++)
            if (devlist[j] == devlist[i]) return ncclInvalidUsage; /* "Duplicate GPU detected" */
    }
    fake_clique *q = calloc(1, sizeof *q);
    q->size = ndev;
    q->refs = ndev;
    pthread_mutex_init(&q->lock, NULL);
    pthread_cond_init(&q->cond, NULL);
    for (int i = 0; i < ndev; i++) {
        comms[i] = calloc(1, sizeof *comms[i]);
        comms[i]->clique = q;
        comms[i]->rank = i;
        comms[i]->device = devlist[i];
    }
    return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
    fake_clique *q = comm->clique;
    pthread_mutex_lock(&q->lock);
    const int left = --q->refs;
    pthread_mutex_unlock(&q->lock);
    if (left == 0) {
        pthread_mutex_destroy(&q->lock);
        pthread_cond_destroy(&q->cond);
        free(q);
    }
    free(comm);
    return ncclSuccess;
}

ncclResult_t ncclAllReduce(const void *in, void *out, size_t count, int dtype, int op,
                           ncclComm_t comm, void *stream) {
    if (dtype != ncclFloat32 || op != ncclSum) return ncclInvalidArgument;
    fake_call *c = calloc(1, sizeof *c);
    *c = (fake_call){.kind = FAKE_ALL_REDUCE, .comm = comm, .in = in, .out = out, .count = count};
    return fake_nccl_enqueue(c, stream);
}

ncclResult_t ncclAllGather(const void *in, void *out, size_t count, int dtype, ncclComm_t comm,
                           void *stream) {
    if (dtype != ncclInt8) return ncclInvalidArgument;
    fake_call *c = calloc(1, sizeof *c);
    *c = (fake_call){.kind = FAKE_ALL_GATHER, .comm = comm, .in = in, .out = out, .count = count};
    return fake_nccl_enqueue(c, stream);
}

/* The open group of this thread: one communicator and stream (all comm_nccl.c needs). */
static _Thread_local int fake_group_depth;
static _Thread_local fake_call *fake_group;
static _Thread_local void *fake_group_stream;

ncclResult_t ncclGroupStart(void) {
    fake_group_depth++;
    return ncclSuccess;
}

ncclResult_t ncclGroupEnd(void) {
    if (fake_group_depth == 0) return ncclInvalidUsage;
    if (--fake_group_depth > 0 || fake_group == NULL) return ncclSuccess;
    fake_call *c = fake_group;
    fake_group = NULL;
    return fake_nccl_enqueue(c, fake_group_stream);
}

static ncclResult_t fake_p2p_add(int send, void *buf, size_t count, int dtype, int peer,
                                 ncclComm_t comm, void *stream) {
    if (dtype != ncclInt8 || peer < 0 || peer >= comm->clique->size || peer == comm->rank)
        return ncclInvalidArgument;
    const int grouped = fake_group_depth > 0;
    if (!grouped) ncclGroupStart();
    if (fake_group == NULL) {
        fake_group = calloc(1, sizeof *fake_group);
        fake_group->kind = FAKE_P2P;
        fake_group->comm = comm;
        fake_group_stream = stream;
    }
    if (fake_group->comm != comm || fake_group_stream != stream ||
        fake_group->n_p2p == 2 * FAKE_NCCL_MAX) {
        fake_nccl_problem("a group over several communicators or streams", comm->rank, peer);
        return ncclInvalidUsage;
    }
    fake_group->p2p[fake_group->n_p2p++] = (fake_p2p){send, peer, buf, count};
    return grouped ? ncclSuccess : ncclGroupEnd();
}

ncclResult_t ncclSend(const void *buf, size_t count, int dtype, int peer, ncclComm_t comm,
                      void *stream) {
    return fake_p2p_add(1, (void *)buf, count, dtype, peer, comm, stream);
}

ncclResult_t ncclRecv(void *buf, size_t count, int dtype, int peer, ncclComm_t comm, void *stream) {
    return fake_p2p_add(0, buf, count, dtype, peer, comm, stream);
}
