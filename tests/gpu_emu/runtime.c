/* runtime.c: the CUDA runtime API emulated on host memory: the cuda* calls csrc/ makes
 * (kernels/device.cu, kernels/comm_d2d.cu, engine/forward_cuda.c, the launch checks), so that
 * all the code above them runs unchanged on a machine without a GPU. Every build of
 * tests/gpu_emu/ links it; gpu_emu.h declares what it offers beyond the real API.
 *
 * "Device memory" is host memory: cudaMalloc is 256-byte aligned and filled with 0xa5, so that
 * reading what nobody wrote shows. Streams run their work in order, one of two ways
 * (GYGES_EMU_STREAMS):
 *   - "sync" (the default): work runs on the calling thread as it is enqueued, so a stream is
 *     always finished. Deterministic and fast: the harness and the emulated extensions use it.
 *   - "threads": each stream is a thread that runs its queue in order, one operation in four
 *     after a random pause of up to 300 us, so that streams overtake each other and the host as
 *     they may on a GPU (test_comm.c runs the communicators so, under ThreadSanitizer).
 * Events follow CUDA either way: a record captures what was enqueued on the stream so far; a
 * wait holds the waiting stream until that much of the recorded one has run; a never-recorded
 * event is complete. The legacy default stream (NULL) is one more stream per device. Misuse the
 * real runtime refuses is refused here too, and left for cudaGetLastError as it does: work on a
 * stream of another device than the current one, recording an event of another device, a device
 * ordinal out of range.
 *
 * GYGES_EMU_DEVICES (default 1) is the number of devices; 0 answers as a machine without one.
 * Each device has memory of its own: every cudaMalloc remembers its device (cudaMemGetInfo
 * counts per device, cudaPointerGetAttributes answers it). Devices reach each other's memory by
 * cudaMemcpyPeer(Async), or by plain copies once cudaDeviceEnablePeerAccess opened the way; a
 * device-to-device copy between two devices without peer access is reported on stderr and
 * counted in gy_emu_peer_misuses (CUDA stages such a copy through the host, slowly, and a kernel
 * touching the other device's memory would fault: either way, not what the code meant). Kernels'
 * pointers are not checked (the naive model kernels receive them untyped). */
#include "gpu_emu.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define EMU_MAX_DEVICES 16
#define EMU_MAX_DELAY_US 300
#define EMU_LEAST_PRIORITY 0
#define EMU_GREATEST_PRIORITY (-5) /* as an H100 answers */
#define EMU_DEVICE_BYTES ((size_t)16 << 30)

typedef enum { EMU_OP_COPY, EMU_OP_SET, EMU_OP_WAIT, EMU_OP_FN } emu_op_kind;

typedef struct emu_op {
    emu_op_kind kind;
    void *dst;
    const void *src;
    size_t bytes;
    int value;
    struct CUstream_st *wait_stream;
    uint64_t wait_position;
    void (*fn)(void *);
    void *arg;
    struct emu_op *next;
} emu_op;

struct CUstream_st {
    int device;
    int priority;
    int threaded;
    emu_op *head, *tail; /* threads: the queue its thread runs */
    uint64_t enqueued, completed;
    int stop;
    unsigned seed;
    pthread_t worker;
    struct CUstream_st *next_live; /* every stream, for the device-wide wait of cudaFree */
};

struct CUevent_st {
    int device;
    int timing;
    struct CUstream_st *stream; /* of the last record; NULL: never recorded */
    uint64_t position;
    double ms; /* host time of the last record: the emulator's timings mean nothing */
};

/* One lock and one condition for the whole emulated machine: simple, and fast enough. */
static pthread_mutex_t emu_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t emu_cond = PTHREAD_COND_INITIALIZER;
static struct CUstream_st *emu_live;
static struct CUstream_st *emu_default[EMU_MAX_DEVICES];
static int emu_threads = -1; /* GYGES_EMU_STREAMS=threads, read once */
static long emu_allocations;
long gy_emu_stream_mismatches;
static _Thread_local int emu_current;
static _Thread_local cudaError_t emu_last_error;
static _Thread_local cudaStream_t emu_kernel_stream; /* of this thread's last model kernel */
long gy_emu_peer_misuses;

/* Device memory: [start, start + bytes) of `device`, sorted by start (binary search). */
typedef struct emu_block { uintptr_t start; size_t bytes; int device; } emu_block;
static emu_block *emu_blocks;
static size_t emu_n_blocks, emu_cap_blocks;
static size_t emu_used[EMU_MAX_DEVICES];
static unsigned char emu_peer[EMU_MAX_DEVICES][EMU_MAX_DEVICES]; /* [device][peer]: enabled */

int gy_emu_device_count(void) {
    const char *env = getenv("GYGES_EMU_DEVICES");
    const int n = env ? atoi(env) : 1;
    return n < 0 ? 0 : n > EMU_MAX_DEVICES ? EMU_MAX_DEVICES : n;
}

static int emu_streams_are_threads(void) {
    pthread_mutex_lock(&emu_lock);
    if (emu_threads < 0) {
        const char *env = getenv("GYGES_EMU_STREAMS");
        emu_threads = env != NULL && strcmp(env, "threads") == 0;
    }
    const int threads = emu_threads;
    pthread_mutex_unlock(&emu_lock);
    return threads;
}

static void emu_count(long delta) { __atomic_fetch_add(&emu_allocations, delta, __ATOMIC_RELAXED); }

long gy_emu_live_allocations(void) { return __atomic_load_n(&emu_allocations, __ATOMIC_RELAXED); }

/* Every failing call leaves its error for cudaGetLastError, as the runtime does. */
static cudaError_t emu_fail(cudaError_t e) {
    emu_last_error = e;
    return e;
}

/* ---- streams ---- */

/* Most operations run at once; one in four waits up to EMU_MAX_DELAY_US, long enough for the
 * other streams (and the host) to get well ahead of it. */
static void emu_pause(unsigned *seed) {
    const int r = rand_r(seed);
    if (r % 4 == 0) {
        struct timespec t = {0, (long)((r >> 2) % (EMU_MAX_DELAY_US + 1)) * 1000};
        nanosleep(&t, NULL);
    }
}

/* With emu_lock held: until `stream` has run its first `position` operations. */
static void emu_wait_locked(const struct CUstream_st *stream, uint64_t position) {
    while (stream->completed < position) pthread_cond_wait(&emu_cond, &emu_lock);
}

static void emu_run(emu_op *op) {
    switch (op->kind) {
    case EMU_OP_COPY: memmove(op->dst, op->src, op->bytes); break;
    case EMU_OP_SET: memset(op->dst, op->value, op->bytes); break;
    case EMU_OP_FN: op->fn(op->arg); break;
    case EMU_OP_WAIT:
        pthread_mutex_lock(&emu_lock);
        emu_wait_locked(op->wait_stream, op->wait_position);
        pthread_mutex_unlock(&emu_lock);
        break;
    }
}

static void *emu_worker(void *p) {
    struct CUstream_st *s = p;
    pthread_mutex_lock(&emu_lock);
    for (;;) {
        while (s->head == NULL && !s->stop) pthread_cond_wait(&emu_cond, &emu_lock);
        if (s->head == NULL) break;
        emu_op *op = s->head;
        pthread_mutex_unlock(&emu_lock);
        if (op->kind != EMU_OP_WAIT) emu_pause(&s->seed);
        emu_run(op);
        pthread_mutex_lock(&emu_lock);
        s->head = op->next;
        if (s->head == NULL) s->tail = NULL;
        s->completed++;
        pthread_cond_broadcast(&emu_cond);
        free(op);
    }
    pthread_mutex_unlock(&emu_lock);
    return NULL;
}

static struct CUstream_st *emu_stream_new(int device, int priority) {
    struct CUstream_st *s = calloc(1, sizeof *s);
    if (s == NULL) return NULL;
    static unsigned seeds = 1;
    s->device = device;
    s->priority = priority;
    s->threaded = emu_streams_are_threads();
    pthread_mutex_lock(&emu_lock);
    s->seed = seeds++ * 2654435761u;
    s->next_live = emu_live;
    emu_live = s;
    pthread_mutex_unlock(&emu_lock);
    if (s->threaded) pthread_create(&s->worker, NULL, emu_worker, s);
    return s;
}

/* Waits for what is queued, then frees the stream. */
static void emu_stream_free(struct CUstream_st *s) {
    pthread_mutex_lock(&emu_lock);
    s->stop = 1;
    pthread_cond_broadcast(&emu_cond);
    emu_wait_locked(s, s->enqueued); /* sync streams: another thread may still be running one */
    pthread_mutex_unlock(&emu_lock);
    if (s->threaded) pthread_join(s->worker, NULL);
    pthread_mutex_lock(&emu_lock);
    for (struct CUstream_st **p = &emu_live; *p; p = &(*p)->next_live)
        if (*p == s) {
            *p = s->next_live;
            break;
        }
    pthread_mutex_unlock(&emu_lock);
    free(s);
}

/* The stream a call means: NULL is the current device's legacy default stream. */
static struct CUstream_st *emu_stream(cudaStream_t stream) {
    if (stream != NULL) {
        /* A destroyed stream is freed memory to a real runtime, which may crash on it: here the
         * use stops the program with its name, so the emulated tests see it. */
        pthread_mutex_lock(&emu_lock);
        struct CUstream_st *live = emu_live;
        while (live != NULL && live != stream) live = live->next_live;
        pthread_mutex_unlock(&emu_lock);
        if (live == NULL) {
            fprintf(stderr, "gpu_emu: stream %p was used after cudaStreamDestroy (or was never "
                    "created)\n", (void *)stream);
            abort();
        }
        return stream;
    }
    const int d = emu_current;
    pthread_mutex_lock(&emu_lock);
    struct CUstream_st *s = emu_default[d];
    pthread_mutex_unlock(&emu_lock);
    if (s == NULL) {
        s = emu_stream_new(d, EMU_LEAST_PRIORITY);
        if (s == NULL) return NULL;
        pthread_mutex_lock(&emu_lock);
        if (emu_default[d] == NULL) {
            emu_default[d] = s;
            s = NULL;
        }
        struct CUstream_st *winner = emu_default[d];
        pthread_mutex_unlock(&emu_lock);
        if (s != NULL) emu_stream_free(s); /* another thread made it first */
        s = winner;
    }
    return s;
}

/* Work for `stream`: queued for its thread, or run here and now. `op` is a template, copied when
 * it is queued. Launches and copies need the stream's device to be the current one (waits do
 * not). */
static cudaError_t emu_enqueue(cudaStream_t stream, const emu_op *op) {
    struct CUstream_st *s = emu_stream(stream);
    if (s == NULL) return emu_fail(cudaErrorMemoryAllocation);
    if (op->kind != EMU_OP_WAIT && s->device != emu_current) {
        fprintf(stderr, "gpu_emu: work on a stream of device %d while device %d is current\n",
                s->device, emu_current);
        return emu_fail(cudaErrorInvalidResourceHandle);
    }
    if (s->threaded) {
        emu_op *queued = malloc(sizeof *queued);
        if (queued == NULL) return emu_fail(cudaErrorMemoryAllocation);
        *queued = *op;
        queued->next = NULL;
        pthread_mutex_lock(&emu_lock);
        if (s->tail) s->tail->next = queued;
        else s->head = queued;
        s->tail = queued;
        s->enqueued++;
        pthread_cond_broadcast(&emu_cond);
        pthread_mutex_unlock(&emu_lock);
        return cudaSuccess;
    }
    pthread_mutex_lock(&emu_lock);
    s->enqueued++;
    pthread_mutex_unlock(&emu_lock);
    emu_op now = *op;
    emu_run(&now);
    pthread_mutex_lock(&emu_lock);
    s->completed++;
    pthread_cond_broadcast(&emu_cond);
    pthread_mutex_unlock(&emu_lock);
    return cudaSuccess;
}

static cudaError_t emu_synchronize(struct CUstream_st *s) {
    if (s == NULL) return emu_fail(cudaErrorMemoryAllocation);
    pthread_mutex_lock(&emu_lock);
    emu_wait_locked(s, s->enqueued);
    pthread_mutex_unlock(&emu_lock);
    return cudaSuccess;
}

/* Work that is not a model kernel on a stream other than this thread's last model kernel's: on a
 * GPU nothing would order it after that kernel. */
static void emu_check_order(cudaStream_t stream) {
    if (emu_kernel_stream != NULL && stream != emu_kernel_stream)
        __atomic_fetch_add(&gy_emu_stream_mismatches, 1, __ATOMIC_RELAXED);
}

/* ---- gpu_emu.h ---- */

void gy_emu_kernel_on(cudaStream_t stream) {
    emu_kernel_stream = stream;
    emu_synchronize(emu_stream(stream)); /* threads: what came before on the stream has run */
}

cudaError_t gy_emu_launch(cudaStream_t stream, void (*run)(void *), void *launch) {
    emu_check_order(stream);
    const emu_op op = {.kind = EMU_OP_FN, .fn = run, .arg = launch};
    return emu_enqueue(stream, &op);
}

void gy_emu_shutdown(void) {
    for (int d = 0; d < EMU_MAX_DEVICES; d++) {
        pthread_mutex_lock(&emu_lock);
        struct CUstream_st *s = emu_default[d];
        emu_default[d] = NULL;
        pthread_mutex_unlock(&emu_lock);
        if (s != NULL) emu_stream_free(s);
    }
}

/* ---- errors ---- */

const char *cudaGetErrorName(cudaError_t e) {
    switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorPeerAccessAlreadyEnabled: return "cudaErrorPeerAccessAlreadyEnabled";
    case cudaErrorPeerAccessNotEnabled: return "cudaErrorPeerAccessNotEnabled";
    default: return "cudaErrorUnknown";
    }
}

const char *cudaGetErrorString(cudaError_t e) {
    switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument (emulated)";
    case cudaErrorMemoryAllocation: return "out of memory (emulated)";
    case cudaErrorInvalidDevice: return "invalid device ordinal (emulated)";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected (emulated)";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle (emulated)";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument (emulated)";
    case cudaErrorPeerAccessAlreadyEnabled: return "peer access is already enabled (emulated)";
    case cudaErrorPeerAccessNotEnabled: return "peer access has not been enabled (emulated)";
    default: return "unknown error (emulated)";
    }
}

cudaError_t cudaGetLastError(void) {
    const cudaError_t e = emu_last_error;
    emu_last_error = cudaSuccess;
    return e;
}

/* ---- devices ---- */

cudaError_t cudaGetDeviceCount(int *count) {
    *count = gy_emu_device_count();
    return *count > 0 ? cudaSuccess : emu_fail(cudaErrorNoDevice);
}

static cudaError_t emu_check_device(int device) {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) return cudaErrorNoDevice;
    return device >= 0 && device < count ? cudaSuccess : emu_fail(cudaErrorInvalidDevice);
}

cudaError_t cudaGetDevice(int *device) {
    *device = emu_current;
    return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
    const cudaError_t e = emu_check_device(device);
    if (e == cudaSuccess) emu_current = device;
    return e;
}

cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *prop, int device) {
    const cudaError_t e = emu_check_device(device);
    if (e != cudaSuccess) return e;
    memset(prop, 0, sizeof *prop);
    snprintf(prop->name, sizeof prop->name, "gpu_emu device %d", device);
    prop->major = 9;
    prop->multiProcessorCount = 1;
    prop->totalGlobalMem = EMU_DEVICE_BYTES;
    return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes) {
    pthread_mutex_lock(&emu_lock);
    const size_t used = emu_used[emu_current];
    pthread_mutex_unlock(&emu_lock);
    *total_bytes = EMU_DEVICE_BYTES;
    *free_bytes = used < EMU_DEVICE_BYTES ? EMU_DEVICE_BYTES - used : 0;
    return cudaSuccess;
}

cudaError_t cudaDeviceGetStreamPriorityRange(int *least, int *greatest) {
    *least = EMU_LEAST_PRIORITY;
    *greatest = EMU_GREATEST_PRIORITY;
    return cudaSuccess;
}

/* ---- memory ---- */

/* With emu_lock held: the index of the first block starting above `at`. */
static size_t emu_block_after(uintptr_t at) {
    size_t lo = 0, hi = emu_n_blocks;
    while (lo < hi) {
        const size_t mid = (lo + hi) / 2;
        if (emu_blocks[mid].start <= at) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* The device whose memory holds `ptr`, or -1 (host memory, or the driver's mappings). */
static int emu_device_of(const void *ptr) {
    const uintptr_t at = (uintptr_t)ptr;
    pthread_mutex_lock(&emu_lock);
    const size_t i = emu_block_after(at);
    int device = -1;
    if (i > 0 && at < emu_blocks[i - 1].start + emu_blocks[i - 1].bytes) device = emu_blocks[i - 1].device;
    pthread_mutex_unlock(&emu_lock);
    return device;
}

cudaError_t cudaMalloc(void **ptr, size_t bytes) {
    const size_t rounded = (bytes + 255) / 256 * 256;
    *ptr = aligned_alloc(256, rounded ? rounded : 256);
    if (*ptr == NULL) return emu_fail(cudaErrorMemoryAllocation);
    memset(*ptr, 0xa5, rounded); /* not zeroed, like device memory */
    pthread_mutex_lock(&emu_lock);
    if (emu_n_blocks == emu_cap_blocks) {
        const size_t cap = emu_cap_blocks ? 2 * emu_cap_blocks : 256;
        emu_block *grown = realloc(emu_blocks, cap * sizeof *grown);
        if (grown == NULL) {
            pthread_mutex_unlock(&emu_lock);
            free(*ptr);
            *ptr = NULL;
            return emu_fail(cudaErrorMemoryAllocation);
        }
        emu_blocks = grown;
        emu_cap_blocks = cap;
    }
    const size_t i = emu_block_after((uintptr_t)*ptr);
    memmove(emu_blocks + i + 1, emu_blocks + i, (emu_n_blocks - i) * sizeof *emu_blocks);
    emu_blocks[i] = (emu_block){(uintptr_t)*ptr, rounded ? rounded : 256, emu_current};
    emu_n_blocks++;
    emu_used[emu_current] += emu_blocks[i].bytes;
    pthread_mutex_unlock(&emu_lock);
    emu_count(1);
    return cudaSuccess;
}

cudaError_t cudaFree(void *ptr) {
    if (ptr == NULL) return cudaSuccess;
    /* cudaFree synchronises the memory's device: nothing queued there may still use it. Only
     * that device: a rank freeing memory while a peer's stream on another GPU waits in NCCL for
     * this very rank must not wait for that stream (a real GPU does not). */
    pthread_mutex_lock(&emu_lock);
    size_t i = emu_block_after((uintptr_t)ptr);
    int known = i > 0 && emu_blocks[i - 1].start == (uintptr_t)ptr;
    const int device = known ? emu_blocks[i - 1].device : -1;
    for (struct CUstream_st *s = emu_live; s; s = s->next_live)
        if (s->device == device) emu_wait_locked(s, s->enqueued);
    i = emu_block_after((uintptr_t)ptr); /* the waits let other threads change the table */
    known = i > 0 && emu_blocks[i - 1].start == (uintptr_t)ptr;
    if (known) {
        emu_used[emu_blocks[i - 1].device] -= emu_blocks[i - 1].bytes;
        memmove(emu_blocks + i - 1, emu_blocks + i, (emu_n_blocks - i) * sizeof *emu_blocks);
        emu_n_blocks--;
    }
    pthread_mutex_unlock(&emu_lock);
    if (!known) {
        fprintf(stderr, "gpu_emu: cudaFree(%p) of memory cudaMalloc did not return\n", ptr);
        return emu_fail(cudaErrorInvalidValue);
    }
    free(ptr);
    emu_count(-1);
    return cudaSuccess;
}

cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *attributes, const void *ptr) {
    memset(attributes, 0, sizeof *attributes);
    const int device = emu_device_of(ptr);
    attributes->type = device >= 0 ? cudaMemoryTypeDevice : cudaMemoryTypeUnregistered;
    attributes->device = device >= 0 ? device : -2;
    attributes->devicePointer = device >= 0 ? (void *)ptr : NULL;
    attributes->hostPointer = device >= 0 ? NULL : (void *)ptr;
    return cudaSuccess;
}

/* ---- peers ---- */

cudaError_t cudaDeviceCanAccessPeer(int *can, int device, int peer) {
    if (emu_check_device(device) != cudaSuccess || emu_check_device(peer) != cudaSuccess)
        return emu_fail(cudaErrorInvalidDevice);
    *can = device != peer; /* every pair of emulated devices is linked */
    return cudaSuccess;
}

cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned int flags) {
    if (flags != 0) return emu_fail(cudaErrorInvalidValue);
    if (emu_check_device(peer) != cudaSuccess || peer == emu_current)
        return emu_fail(cudaErrorInvalidDevice);
    pthread_mutex_lock(&emu_lock);
    const int already = emu_peer[emu_current][peer];
    emu_peer[emu_current][peer] = 1;
    pthread_mutex_unlock(&emu_lock);
    return already ? emu_fail(cudaErrorPeerAccessAlreadyEnabled) : cudaSuccess;
}

cudaError_t cudaDeviceDisablePeerAccess(int peer) {
    if (emu_check_device(peer) != cudaSuccess) return emu_fail(cudaErrorInvalidDevice);
    pthread_mutex_lock(&emu_lock);
    const int was = emu_peer[emu_current][peer];
    emu_peer[emu_current][peer] = 0;
    pthread_mutex_unlock(&emu_lock);
    return was ? cudaSuccess : emu_fail(cudaErrorPeerAccessNotEnabled);
}

/* A copy between two devices' memory without peer access either way. */
static void emu_check_peer(void *dst, const void *src) {
    const int to = emu_device_of(dst), from = emu_device_of(src);
    if (to < 0 || from < 0 || to == from) return;
    pthread_mutex_lock(&emu_lock);
    const int open = emu_peer[to][from] || emu_peer[from][to];
    pthread_mutex_unlock(&emu_lock);
    if (open) return;
    __atomic_fetch_add(&gy_emu_peer_misuses, 1, __ATOMIC_RELAXED);
    fprintf(stderr, "gpu_emu: a copy from device %d's memory to device %d's without peer access "
            "(cudaMemcpyPeer, or cudaDeviceEnablePeerAccess first)\n", from, to);
}

cudaError_t cudaMallocHost(void **ptr, size_t bytes) {
    *ptr = malloc(bytes ? bytes : 1);
    if (*ptr == NULL) return emu_fail(cudaErrorMemoryAllocation);
    emu_count(1);
    return cudaSuccess;
}

cudaError_t cudaFreeHost(void *ptr) {
    if (ptr == NULL) return cudaSuccess;
    free(ptr);
    emu_count(-1);
    return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind kind,
                            cudaStream_t stream) {
    /* one address space: every kind is a memmove */
    if (bytes == 0 || dst == src) return cudaSuccess;
    if (dst == NULL || src == NULL) return emu_fail(cudaErrorInvalidValue);
    if (kind == cudaMemcpyDeviceToDevice || kind == cudaMemcpyDefault) emu_check_peer(dst, src);
    emu_check_order(stream);
    const emu_op op = {.kind = EMU_OP_COPY, .dst = dst, .src = src, .bytes = bytes};
    return emu_enqueue(stream, &op);
}

/* Between devices, whether or not peer access is enabled. Each pointer must be in its device's
 * memory when the emulator knows it (cudaMalloc's; the driver's mappings are not known). */
cudaError_t cudaMemcpyPeerAsync(void *dst, int dst_device, const void *src, int src_device,
                                size_t bytes, cudaStream_t stream) {
    if (emu_check_device(dst_device) != cudaSuccess || emu_check_device(src_device) != cudaSuccess)
        return emu_fail(cudaErrorInvalidDevice);
    if (bytes == 0) return cudaSuccess;
    if (dst == NULL || src == NULL) return emu_fail(cudaErrorInvalidValue);
    const int to = emu_device_of(dst), from = emu_device_of(src);
    if ((to >= 0 && to != dst_device) || (from >= 0 && from != src_device)) {
        fprintf(stderr, "gpu_emu: cudaMemcpyPeer names devices %d <- %d for memory of devices "
                "%d <- %d\n", dst_device, src_device, to, from);
        return emu_fail(cudaErrorInvalidValue);
    }
    emu_check_order(stream);
    const emu_op op = {.kind = EMU_OP_COPY, .dst = dst, .src = src, .bytes = bytes};
    return emu_enqueue(stream, &op);
}

cudaError_t cudaMemcpyPeer(void *dst, int dst_device, const void *src, int src_device,
                           size_t bytes) {
    const cudaError_t e = cudaMemcpyPeerAsync(dst, dst_device, src, src_device, bytes, NULL);
    return e != cudaSuccess ? e : emu_synchronize(emu_stream(NULL));
}

/* The synchronous calls: on the legacy default stream, and waited for. */
cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind kind) {
    const cudaError_t e = cudaMemcpyAsync(dst, src, bytes, kind, NULL);
    return e != cudaSuccess ? e : emu_synchronize(emu_stream(NULL));
}

cudaError_t cudaMemset(void *dst, int value, size_t bytes) {
    if (bytes == 0) return cudaSuccess;
    if (dst == NULL) return emu_fail(cudaErrorInvalidValue);
    const emu_op op = {.kind = EMU_OP_SET, .dst = dst, .value = value, .bytes = bytes};
    const cudaError_t e = emu_enqueue(NULL, &op);
    return e != cudaSuccess ? e : emu_synchronize(emu_stream(NULL));
}

cudaError_t cudaMemsetAsync(void *dst, int value, size_t bytes, cudaStream_t stream) {
    if (bytes == 0) return cudaSuccess;
    if (dst == NULL) return emu_fail(cudaErrorInvalidValue);
    emu_check_order(stream);
    const emu_op op = {.kind = EMU_OP_SET, .dst = dst, .value = value, .bytes = bytes};
    return emu_enqueue(stream, &op);
}

/* ---- streams ---- */

cudaError_t cudaStreamCreateWithPriority(cudaStream_t *stream, unsigned int flags, int priority) {
    (void)flags; /* every emulated stream is non-blocking */
    if (priority > EMU_LEAST_PRIORITY) priority = EMU_LEAST_PRIORITY;
    if (priority < EMU_GREATEST_PRIORITY) priority = EMU_GREATEST_PRIORITY;
    *stream = emu_stream_new(emu_current, priority);
    if (*stream == NULL) return emu_fail(cudaErrorMemoryAllocation);
    emu_count(1);
    return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *stream, unsigned int flags) {
    return cudaStreamCreateWithPriority(stream, flags, EMU_LEAST_PRIORITY);
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
    if (stream == NULL) return emu_fail(cudaErrorInvalidResourceHandle);
    if (emu_kernel_stream == stream) emu_kernel_stream = NULL; /* its address may come back */
    emu_stream_free(stream); /* runs what is queued first, as cudaStreamDestroy lets it */
    emu_count(-1);
    return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) { return emu_synchronize(emu_stream(stream)); }

cudaError_t cudaStreamGetPriority(cudaStream_t stream, int *priority) {
    struct CUstream_st *s = emu_stream(stream);
    if (s == NULL) return emu_fail(cudaErrorMemoryAllocation);
    *priority = s->priority;
    return cudaSuccess;
}

cudaError_t cudaStreamGetDevice(cudaStream_t stream, int *device) {
    struct CUstream_st *s = emu_stream(stream);
    if (s == NULL) return emu_fail(cudaErrorMemoryAllocation);
    *device = s->device;
    return cudaSuccess;
}

cudaError_t cudaLaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void *arg) {
    const emu_op op = {.kind = EMU_OP_FN, .fn = fn, .arg = arg};
    return emu_enqueue(stream, &op);
}

/* ---- events ---- */

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int flags) {
    *event = calloc(1, sizeof **event);
    if (*event == NULL) return emu_fail(cudaErrorMemoryAllocation);
    (*event)->device = emu_current;
    (*event)->timing = !(flags & cudaEventDisableTiming);
    emu_count(1);
    return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t *event) { return cudaEventCreateWithFlags(event, 0); }

cudaError_t cudaEventDestroy(cudaEvent_t event) {
    if (event == NULL) return emu_fail(cudaErrorInvalidResourceHandle);
    free(event);
    emu_count(-1);
    return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
    struct CUstream_st *s = emu_stream(stream);
    if (s == NULL) return emu_fail(cudaErrorMemoryAllocation);
    if (event->device != s->device) {
        fprintf(stderr, "gpu_emu: an event of device %d recorded on a stream of device %d\n",
                event->device, s->device);
        return emu_fail(cudaErrorInvalidResourceHandle);
    }
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    pthread_mutex_lock(&emu_lock);
    event->stream = s;
    event->position = s->enqueued;
    event->ms = (double)now.tv_sec * 1e3 + (double)now.tv_nsec * 1e-6;
    pthread_mutex_unlock(&emu_lock);
    return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
    pthread_mutex_lock(&emu_lock);
    if (event->stream != NULL) emu_wait_locked(event->stream, event->position);
    pthread_mutex_unlock(&emu_lock);
    return cudaSuccess;
}

cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end) {
    if (!start->timing || !end->timing || start->stream == NULL || end->stream == NULL)
        return emu_fail(cudaErrorInvalidResourceHandle);
    *ms = (float)(end->ms - start->ms);
    return cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags) {
    (void)flags;
    pthread_mutex_lock(&emu_lock);
    struct CUstream_st *recorded = event->stream;
    const uint64_t position = event->position;
    pthread_mutex_unlock(&emu_lock);
    if (recorded == NULL) return cudaSuccess;
    const emu_op op = {.kind = EMU_OP_WAIT, .wait_stream = recorded, .wait_position = position};
    return emu_enqueue(stream, &op);
}
