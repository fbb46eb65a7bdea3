/* fake_cuda.c: a pretend GPU behind csrc/kernels/comm_d2d.h, so that the d2d and nccl
 * communicators' host logic (the event protocol of comm_stream.c, scratch growth, stream
 * switches, the all-to-all size table) runs on machines without one, under sanitizers.
 *
 * "Device memory" is host memory. Each stream is a thread that runs its queue in order, now and
 * then after a random pause, so streams overtake each other as they may on a GPU.
 * Events follow CUDA: a record captures what was enqueued on the stream so far; a wait enqueues
 * a point that blocks the waiting stream until that much of the recorded stream has run (a
 * never-recorded event is complete). The legacy default stream (NULL) is one more such stream
 * per device. Misuse that the CUDA runtime refuses is refused here too: a launch or copy on a
 * stream of another device than the current one, recording an event of another device.
 *
 * FAKE_CUDA_DEVICES (default 1) sets how many devices there are; 0 answers as a machine without
 * any. fake_cuda_host_fn lets the fake NCCL (fake_nccl.c) enqueue its collectives. */
#include "fake_cuda.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define FAKE_MAX_DEVICES 16
#define FAKE_MAX_DELAY_US 300

typedef enum { FAKE_OP_COPY, FAKE_OP_SUM, FAKE_OP_WAIT, FAKE_OP_FN } fake_op_kind;

typedef struct fake_op {
    fake_op_kind kind;
    void *dst;
    const void *src;
    uint64_t bytes;
    const float *in[GY_CUDA_COMM_MAX_INPUTS];
    int32_t n_in;
    int64_t n;
    struct CUstream_st *wait_stream;
    uint64_t wait_position;
    void (*fn)(void *);
    void *arg;
    struct fake_op *next;
} fake_op;

struct CUstream_st {
    int device;
    int priority;
    fake_op *head, *tail;
    uint64_t enqueued, completed;
    int stop;
    unsigned seed;
    pthread_t worker;
    struct CUstream_st *next_live; /* every stream, for the device-wide waits of free */
};

struct CUevent_st {
    int device;
    struct CUstream_st *stream; /* of the last record; NULL: never recorded */
    uint64_t position;
};

/* One lock and one condition for the whole fake device: simple, and fast enough. */
static pthread_mutex_t fake_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t fake_cond = PTHREAD_COND_INITIALIZER;
static struct CUstream_st *fake_live;
static struct CUstream_st *fake_default[FAKE_MAX_DEVICES];
static _Thread_local int fake_current = 0;
static uint64_t fake_ops_run;
static int fake_devices = -1;

static int fake_device_count(void) {
    pthread_mutex_lock(&fake_lock);
    if (fake_devices < 0) {
        const char *env = getenv("FAKE_CUDA_DEVICES");
        fake_devices = env ? atoi(env) : 1;
        if (fake_devices > FAKE_MAX_DEVICES) fake_devices = FAKE_MAX_DEVICES;
    }
    const int n = fake_devices;
    pthread_mutex_unlock(&fake_lock);
    return n;
}

/* Most operations run at once; one in four waits up to FAKE_MAX_DELAY_US, long enough for
 * the other streams (and the host) to get well ahead of it. */
static void fake_pause(unsigned *seed) {
    const int r = rand_r(seed);
    if (r % 4 == 0) {
        struct timespec t = {0, (long)((r >> 2) % (FAKE_MAX_DELAY_US + 1)) * 1000};
        nanosleep(&t, NULL);
    }
}

static void fake_run(fake_op *op) {
    switch (op->kind) {
    case FAKE_OP_COPY: memmove(op->dst, op->src, (size_t)op->bytes); break;
    case FAKE_OP_SUM: {
        float *out = op->dst;
        for (int64_t i = 0; i < op->n; i++) {
            float v[GY_CUDA_COMM_MAX_INPUTS];
            for (int32_t r = 0; r < op->n_in; r++) v[r] = op->in[r][i];
            for (int32_t w = op->n_in; w > 1; w /= 2)
                for (int32_t j = 0; j < w / 2; j++) v[j] = v[2 * j] + v[2 * j + 1];
            out[i] = v[0];
        }
        break;
    }
    case FAKE_OP_FN: op->fn(op->arg); break;
    case FAKE_OP_WAIT: break;
    }
}

static void *fake_worker(void *p) {
    struct CUstream_st *s = p;
    pthread_mutex_lock(&fake_lock);
    for (;;) {
        while (s->head == NULL && !s->stop) pthread_cond_wait(&fake_cond, &fake_lock);
        if (s->head == NULL) break;
        fake_op *op = s->head;
        if (op->kind == FAKE_OP_WAIT)
            while (op->wait_stream->completed < op->wait_position)
                pthread_cond_wait(&fake_cond, &fake_lock);
        pthread_mutex_unlock(&fake_lock);
        fake_pause(&s->seed);
        fake_run(op);
        pthread_mutex_lock(&fake_lock);
        s->head = op->next;
        if (s->head == NULL) s->tail = NULL;
        s->completed++;
        fake_ops_run++;
        pthread_cond_broadcast(&fake_cond);
        free(op);
    }
    pthread_mutex_unlock(&fake_lock);
    return NULL;
}

static struct CUstream_st *fake_stream_new(int device, int priority) {
    struct CUstream_st *s = calloc(1, sizeof *s);
    if (s == NULL) return NULL;
    static unsigned seeds = 1;
    s->device = device;
    s->priority = priority;
    pthread_mutex_lock(&fake_lock);
    s->seed = seeds++ * 2654435761u;
    s->next_live = fake_live;
    fake_live = s;
    pthread_mutex_unlock(&fake_lock);
    pthread_create(&s->worker, NULL, fake_worker, s);
    return s;
}

/* The stream a call means: NULL is the current device's legacy default stream. */
static struct CUstream_st *fake_stream(gy_cuda_stream stream) {
    if (stream != NULL) return stream;
    const int d = fake_current;
    pthread_mutex_lock(&fake_lock);
    struct CUstream_st *s = fake_default[d];
    pthread_mutex_unlock(&fake_lock);
    if (s == NULL) {
        s = fake_stream_new(d, 0);
        pthread_mutex_lock(&fake_lock);
        if (fake_default[d] == NULL) {
            fake_default[d] = s;
            s = NULL;
        }
        struct CUstream_st *winner = fake_default[d];
        pthread_mutex_unlock(&fake_lock);
        if (s != NULL) gy_cuda_comm_stream_destroy(s); /* another thread made it first */
        s = winner;
    }
    return s;
}

static gy_status fake_enqueue(struct CUstream_st *s, fake_op *op) {
    pthread_mutex_lock(&fake_lock);
    op->next = NULL;
    if (s->tail) s->tail->next = op;
    else s->head = op;
    s->tail = op;
    s->enqueued++;
    pthread_cond_broadcast(&fake_cond);
    pthread_mutex_unlock(&fake_lock);
    return GY_OK;
}

static gy_status fake_check_stream_device(struct CUstream_st *s, const char *what) {
    if (s->device != fake_current)
        return GY_FAIL(GY_ERR_CUDA,
                       "%s failed: stream of device %d used while device %d is current "
                       "(invalid resource handle)",
                       what, s->device, fake_current);
    return GY_OK;
}

/* ---- comm_d2d.h ---- */

gy_status gy_cuda_comm_device_count(int32_t *count) {
    *count = fake_device_count();
    if (*count == 0) return GY_FAIL(GY_ERR_UNAVAILABLE, "CUDA is not available: no CUDA device");
    return GY_OK;
}

gy_status gy_cuda_comm_device_swap(int32_t device, int32_t *previous) {
    if (previous) *previous = fake_current;
    if (device < 0 || device >= fake_device_count())
        return GY_FAIL(GY_ERR_CUDA, "cudaSetDevice(%d) failed: invalid device ordinal", (int)device);
    fake_current = device;
    return GY_OK;
}

gy_status gy_cuda_comm_stream_create(gy_cuda_stream *out, int32_t lowest) {
    *out = fake_stream_new(fake_current, lowest ? 0 : -5);
    return *out ? GY_OK : GY_FAIL(GY_ERR_SYSTEM, "fake stream: out of memory");
}

void gy_cuda_comm_stream_destroy(gy_cuda_stream stream) {
    if (stream == NULL) return;
    struct CUstream_st *s = stream;
    pthread_mutex_lock(&fake_lock);
    s->stop = 1;
    pthread_cond_broadcast(&fake_cond);
    pthread_mutex_unlock(&fake_lock);
    pthread_join(s->worker, NULL); /* runs what is queued first, as cudaStreamDestroy lets it */
    pthread_mutex_lock(&fake_lock);
    for (struct CUstream_st **p = &fake_live; *p; p = &(*p)->next_live)
        if (*p == s) {
            *p = s->next_live;
            break;
        }
    pthread_mutex_unlock(&fake_lock);
    free(s);
}

gy_status gy_cuda_comm_stream_priority(gy_cuda_stream stream, int32_t *priority) {
    *priority = fake_stream(stream)->priority;
    return GY_OK;
}

gy_status gy_cuda_comm_stream_synchronize(gy_cuda_stream stream) {
    struct CUstream_st *s = fake_stream(stream);
    pthread_mutex_lock(&fake_lock);
    while (s->completed < s->enqueued) pthread_cond_wait(&fake_cond, &fake_lock);
    pthread_mutex_unlock(&fake_lock);
    return GY_OK;
}

gy_status gy_cuda_comm_event_create(gy_cuda_event *out) {
    *out = calloc(1, sizeof **out);
    if (*out == NULL) return GY_FAIL(GY_ERR_SYSTEM, "fake event: out of memory");
    (*out)->device = fake_current;
    return GY_OK;
}

void gy_cuda_comm_event_destroy(gy_cuda_event event) { free(event); }

gy_status gy_cuda_comm_event_record(gy_cuda_event event, gy_cuda_stream stream) {
    struct CUstream_st *s = fake_stream(stream);
    if (event->device != s->device)
        return GY_FAIL(GY_ERR_CUDA, "cudaEventRecord failed: event of device %d, stream of %d",
                       event->device, s->device);
    pthread_mutex_lock(&fake_lock);
    event->stream = s;
    event->position = s->enqueued;
    pthread_mutex_unlock(&fake_lock);
    return GY_OK;
}

gy_status gy_cuda_comm_stream_wait(gy_cuda_stream stream, gy_cuda_event event) {
    struct CUstream_st *s = fake_stream(stream);
    pthread_mutex_lock(&fake_lock);
    struct CUstream_st *recorded = event->stream;
    const uint64_t position = event->position;
    pthread_mutex_unlock(&fake_lock);
    if (recorded == NULL) return GY_OK;
    fake_op *op = calloc(1, sizeof *op);
    if (op == NULL) return GY_FAIL(GY_ERR_SYSTEM, "fake wait: out of memory");
    op->kind = FAKE_OP_WAIT;
    op->wait_stream = recorded;
    op->wait_position = position;
    return fake_enqueue(s, op);
}

gy_status gy_cuda_comm_malloc(void **out, uint64_t bytes) {
    *out = malloc(bytes ? (size_t)bytes : 1);
    if (*out == NULL) return GY_FAIL(GY_ERR_CUDA, "cudaMalloc failed: out of memory");
    memset(*out, 0xab, bytes); /* not zeroed, like device memory */
    return GY_OK;
}

void gy_cuda_comm_free(void *ptr) {
    if (ptr == NULL) return;
    /* cudaFree waits for the device: nothing queued anywhere may still use it. */
    pthread_mutex_lock(&fake_lock);
    for (;;) {
        int busy = 0;
        for (struct CUstream_st *s = fake_live; s; s = s->next_live)
            busy |= s->completed < s->enqueued;
        if (!busy) break;
        pthread_cond_wait(&fake_cond, &fake_lock);
    }
    pthread_mutex_unlock(&fake_lock);
    free(ptr);
}

gy_status gy_cuda_comm_copy(void *dst, const void *src, uint64_t bytes, gy_cuda_stream stream) {
    if (bytes == 0 || dst == src) return GY_OK;
    if (dst == NULL || src == NULL) return GY_FAIL(GY_ERR_INVALID, "comm_copy: NULL dst or src");
    struct CUstream_st *s = fake_stream(stream);
    GY_TRY(fake_check_stream_device(s, "cudaMemcpyAsync"));
    fake_op *op = calloc(1, sizeof *op);
    if (op == NULL) return GY_FAIL(GY_ERR_SYSTEM, "fake copy: out of memory");
    op->kind = FAKE_OP_COPY;
    op->dst = dst;
    op->src = src;
    op->bytes = bytes;
    return fake_enqueue(s, op);
}

gy_status gy_cuda_comm_copy_h2d(void *dst, const void *src_host, uint64_t bytes,
                                gy_cuda_stream stream) {
    return gy_cuda_comm_copy(dst, src_host, bytes, stream);
}

gy_status gy_cuda_comm_copy_d2h(void *dst_host, const void *src, uint64_t bytes,
                                gy_cuda_stream stream) {
    return gy_cuda_comm_copy(dst_host, src, bytes, stream);
}

gy_status gy_cuda_comm_sum_tree(float *out, const float *const *in, int32_t n_in, int64_t n,
                                gy_cuda_stream stream) {
    if (n < 0 || n_in < 1 || n_in > GY_CUDA_COMM_MAX_INPUTS || (n_in & (n_in - 1)))
        return GY_FAIL(GY_ERR_INVALID, "comm_sum_tree: bad n=%lld or n_in=%d", (long long)n,
                       (int)n_in);
    if (n == 0) return GY_OK;
    struct CUstream_st *s = fake_stream(stream);
    GY_TRY(fake_check_stream_device(s, "launch of gy_comm_sum_tree_kernel"));
    fake_op *op = calloc(1, sizeof *op);
    if (op == NULL) return GY_FAIL(GY_ERR_SYSTEM, "fake sum: out of memory");
    op->kind = FAKE_OP_SUM;
    op->dst = out;
    op->n_in = n_in;
    op->n = n;
    for (int32_t r = 0; r < n_in; r++) op->in[r] = in[r];
    return fake_enqueue(s, op);
}

/* ---- for the fake NCCL and the tests ---- */

gy_status fake_cuda_host_fn(gy_cuda_stream stream, void (*fn)(void *), void *arg) {
    struct CUstream_st *s = fake_stream(stream);
    GY_TRY(fake_check_stream_device(s, "fake NCCL launch"));
    fake_op *op = calloc(1, sizeof *op);
    if (op == NULL) return GY_FAIL(GY_ERR_SYSTEM, "fake fn: out of memory");
    op->kind = FAKE_OP_FN;
    op->fn = fn;
    op->arg = arg;
    return fake_enqueue(s, op);
}

int fake_cuda_current_device(void) { return fake_current; }

int fake_cuda_stream_device(gy_cuda_stream stream) { return fake_stream(stream)->device; }

uint64_t fake_cuda_ops_run(void) {
    pthread_mutex_lock(&fake_lock);
    const uint64_t n = fake_ops_run;
    pthread_mutex_unlock(&fake_lock);
    return n;
}

void fake_cuda_shutdown(void) {
    for (int d = 0; d < FAKE_MAX_DEVICES; d++) {
        gy_cuda_comm_stream_destroy(fake_default[d]);
        fake_default[d] = NULL;
    }
}
