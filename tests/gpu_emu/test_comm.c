/* test_comm.c: the d2d and nccl communicators (csrc/comm/) and their device side
 * (csrc/kernels/comm_d2d.cu), compiled with GY_WITH_CUDA against the emulated runtime
 * (runtime.c) and the pretend NCCL (nccl.c), run by real rank threads. tests/test_comm_cuda.py
 * builds it (build.py) and runs it under ThreadSanitizer and under ASan+UBSan:
 *
 *   FAKE_MODE=gpu   GYGES_EMU_DEVICES=4 GYGES_EMU_STREAMS=threads GYGES_NCCL_LIBRARY=<libnccl.so>
 *   FAKE_MODE=bare  GYGES_EMU_DEVICES=0 GYGES_EMU_STREAMS=threads GYGES_NCCL_LIBRARY=/nonexistent
 *
 * The emulated streams run their work on their own threads after random pauses, so a collective
 * whose events let one rank's stream overtake another's reads or writes a buffer too early:
 * the sums come out wrong, and ThreadSanitizer names the two accesses. What it checks beyond
 * tests/test_comm_cuda.py's GPU tests: many rounds back to back with the inputs written and the
 * results read by later work on the same stream (the visibility rule of comm.h), stream
 * switches between rounds, the current device being restored, and the nccl glue, its abort and
 * remake. And the emulated machine itself, so that what the other tests rely on is checked: the
 * pretend NCCL (ranks joining by unique id from their threads, one thread grouping every rank's
 * part of an all-to-all, a send holding its stream until the receiver posts, ncclCommAbort
 * waking a stuck receiver, the hang detector catching two communicators called in opposite
 * orders) and devices with their own memory and peer copies. */
#include <dlfcn.h>
#include <pthread.h>
#include <stddef.h>
#include <time.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../c/gytest.h"
#include "comm/comm.h"
#include "core/fault.h"
#include "kernels/comm_d2d.h"
#include "gpu_emu.h"

#define ROUNDS 12
#define MAX_N 4099

static int stream_device(gy_cuda_stream stream) {
    int device = -1;
    cudaStreamGetDevice(stream, &device);
    return device;
}

static int current_device(void) {
    int device = -1;
    cudaGetDevice(&device);
    return device;
}

static int mode_is(const char *mode) {
    const char *m = getenv("FAKE_MODE");
    return m != NULL && strcmp(m, mode) == 0;
}

/* Deterministic floats of mixed magnitudes and signs: the order of additions shows. */
static float value(uint32_t seed, int32_t rank, int64_t i) {
    uint32_t x = seed * 2654435761u ^ (uint32_t)rank * 40503u ^ (uint32_t)i * 2246822519u;
    x ^= x >> 15;
    x *= 2246822519u;
    x ^= x >> 13;
    const float scales[5] = {1e-3f, 0.1f, 1.0f, 10.0f, 1e3f};
    return ((float)(x % 20001) - 10000.0f) / 997.0f * scales[(x >> 20) % 5];
}

static float tree(const float *v, int32_t size) {
    float t[GY_COMM_MAX_RANKS];
    memcpy(t, v, sizeof(float) * (size_t)size);
    for (int32_t w = size; w > 1; w /= 2)
        for (int32_t j = 0; j < w / 2; j++) t[j] = t[2 * j] + t[2 * j + 1];
    return t[0];
}

typedef struct rank_job {
    gy_comm *comm;
    gy_comm *other; /* a second communicator whose streams the rank switches to */
    int32_t rank, size;
    int64_t n[ROUNDS];
    float *inputs;  /* [ROUNDS][MAX_N] host data "uploaded" by a copy on the rank's stream */
    float *results; /* [ROUNDS][MAX_N] "downloaded" by a copy after each all-reduce */
    float *device;  /* [MAX_N] the rank's buffer */
    int failures;
} rank_job;

/* fn(&jobs[r]) on a thread per rank; jobs is an array of `size` jobs of job_size bytes. */
static void run_jobs(void *jobs, size_t job_size, int32_t size, void *(*fn)(void *)) {
    pthread_t threads[GY_COMM_MAX_RANKS];
    for (int32_t r = 0; r < size; r++)
        pthread_create(&threads[r], NULL, fn, (char *)jobs + (size_t)r * job_size);
    for (int32_t r = 0; r < size; r++) pthread_join(threads[r], NULL);
}

static void run_ranks(rank_job *jobs, int32_t size, void *(*fn)(void *)) {
    run_jobs(jobs, sizeof *jobs, size, fn);
}

/* Every round: upload on the stream, all-reduce, download on the stream; never a host wait in
 * between, so only the stream order and the communicator's events keep it right. Round k of
 * the switching variant runs on the rank's own stream, the other comm's, or the default one. */
static void *all_reduce_rounds(void *p) {
    rank_job *j = p;
    /* A rank thread works with its device current, as engines' do (its own copies need it). */
    const int32_t device = gy_comm_device(j->comm, j->rank);
    j->failures += gy_cuda_comm_device_swap(device, NULL) != GY_OK;
    void *own = gy_comm_stream(j->comm, j->rank);
    for (int k = 0; k < ROUNDS; k++) {
        if (j->other != NULL) {
            void *streams[3] = {own, gy_comm_stream(j->other, j->rank), NULL};
            j->failures += gy_comm_set_stream(j->comm, j->rank, streams[k % 3]) != GY_OK;
        }
        void *stream = gy_comm_stream(j->comm, j->rank);
        const int64_t n = j->n[k];
        j->failures += gy_cuda_comm_copy(j->device, j->inputs + k * MAX_N, (uint64_t)n * 4,
                                         stream) != GY_OK;
        j->failures += gy_comm_all_reduce(j->comm, j->rank, j->device, n) != GY_OK;
        j->failures += gy_cuda_comm_copy(j->results + k * MAX_N, j->device, (uint64_t)n * 4,
                                         stream) != GY_OK;
        if (k % 5 == 4) j->failures += gy_comm_barrier(j->comm, j->rank) != GY_OK;
    }
    j->failures += gy_comm_synchronize(j->comm, j->rank) != GY_OK;
    if (j->other != NULL) j->failures += gy_comm_set_stream(j->comm, j->rank, own) != GY_OK;
    return NULL;
}

/* Runs ROUNDS all-reduces of varying sizes on `comm` and checks them against the tree; with
 * `other`, the ranks switch streams between rounds. */
static int check_all_reduce_rounds(gy_comm *comm, gy_comm *other, uint32_t seed, int exact_tree) {
    const int32_t size = gy_comm_size(comm);
    rank_job jobs[GY_COMM_MAX_RANKS];
    const int64_t sizes[ROUNDS] = {1003, 1, 3, MAX_N, 7, 1003, MAX_N - 1, 64, 4, 2, 999, 5};
    for (int32_t r = 0; r < size; r++) {
        jobs[r] = (rank_job){.comm = comm, .other = other, .rank = r, .size = size};
        memcpy(jobs[r].n, sizes, sizeof sizes);
        jobs[r].inputs = malloc(sizeof(float) * ROUNDS * MAX_N);
        jobs[r].results = malloc(sizeof(float) * ROUNDS * MAX_N);
        jobs[r].device = malloc(sizeof(float) * MAX_N);
        for (int k = 0; k < ROUNDS; k++)
            for (int64_t i = 0; i < MAX_N; i++)
                jobs[r].inputs[k * MAX_N + i] = value(seed + (uint32_t)k, r, i);
    }
    run_ranks(jobs, size, all_reduce_rounds);
    int bad = 0;
    for (int32_t r = 0; r < size; r++) bad += jobs[r].failures;
    for (int k = 0; k < ROUNDS && size > 1; k++)
        for (int64_t i = 0; i < sizes[k]; i++) {
            float v[GY_COMM_MAX_RANKS];
            double exact = 0.0, magnitude = 0.0;
            for (int32_t r = 0; r < size; r++) {
                v[r] = jobs[r].inputs[k * MAX_N + i];
                exact += v[r];
                magnitude += v[r] < 0 ? -v[r] : v[r];
            }
            const float want = tree(v, size);
            for (int32_t r = 0; r < size; r++) {
                const float got = jobs[r].results[k * MAX_N + i];
                if (exact_tree) {
                    bad += memcmp(&got, &want, sizeof got) != 0;
                } else { /* another order of additions: within size roundings */
                    const double err = got > exact ? got - exact : exact - got;
                    bad += err > size * magnitude * 0x1p-24 + 1e-30;
                }
            }
        }
    for (int32_t r = 0; r < size; r++) {
        free(jobs[r].inputs);
        free(jobs[r].results);
        free(jobs[r].device);
    }
    if (bad) fprintf(stderr, "  %d wrong values or failed calls (%s)\n", bad, gy_error_message());
    return bad == 0;
}

static gy_comm *make(gy_comm_backend_kind backend, int32_t size, const int32_t *devices,
                     gy_comm_channel channel) {
    gy_comm *comm = NULL;
    const gy_comm_config config = {.backend = backend, .size = size, .devices = devices,
                                   .channel = channel};
    if (gy_comm_init_config(&comm, &config) != GY_OK) {
        fprintf(stderr, "  init failed: %s\n", gy_error_message());
        return NULL;
    }
    return comm;
}

GYTEST(fake_d2d_all_reduce_rounds_have_the_tree_bits) {
    if (!mode_is("gpu")) return;
    for (int32_t size = 1; size <= 8; size *= 2) {
        gy_comm *comm = make(GY_COMM_BACKEND_D2D, size, NULL, GY_COMM_CHANNEL_COMPUTE);
        CHECK(comm != NULL);
        if (comm == NULL) continue;
        CHECK(check_all_reduce_rounds(comm, NULL, 11u * (uint32_t)size, 1));
        gy_comm_stats st;
        gy_comm_stats_get(comm, &st);
        CHECK(st.calls == (size > 1 ? ROUNDS : 0u));
        gy_comm_free(comm);
    }
}

GYTEST(fake_d2d_on_another_device_restores_the_current_one) {
    if (!mode_is("gpu")) return;
    const int32_t devices[4] = {3, 3, 3, 3};
    gy_comm *comm = make(GY_COMM_BACKEND_D2D, 4, devices, GY_COMM_CHANNEL_COMPUTE);
    CHECK(comm != NULL);
    if (comm == NULL) return;
    CHECK(gy_comm_device(comm, 2) == 3);
    CHECK(stream_device(gy_comm_stream(comm, 1)) == 3);
    CHECK(check_all_reduce_rounds(comm, NULL, 5, 1));
    gy_comm_free(comm);
    /* Called from a thread whose current device is another: the work goes to the rank's device
     * and the thread's device is put back. */
    comm = make(GY_COMM_BACKEND_D2D, 1, devices, GY_COMM_CHANNEL_COMPUTE);
    CHECK(comm != NULL);
    if (comm == NULL) return;
    CHECK_OK(gy_cuda_comm_device_swap(1, NULL));
    unsigned char in[40], out[40];
    memset(in, 9, sizeof in);
    memset(out, 0, sizeof out);
    CHECK_OK(gy_comm_all_gather(comm, 0, out, in, sizeof in));
    CHECK(current_device() == 1);
    CHECK_OK(gy_comm_synchronize(comm, 0));
    CHECK(current_device() == 1);
    CHECK(memcmp(in, out, sizeof in) == 0);
    CHECK_OK(gy_cuda_comm_device_swap(0, NULL));
    gy_comm_free(comm);
    const int32_t absent[2] = {4, 4};
    gy_comm *none = NULL;
    const gy_comm_config config = {.backend = GY_COMM_BACKEND_D2D, .size = 2, .devices = absent};
    CHECK_STATUS(gy_comm_init_config(&none, &config), GY_ERR_UNAVAILABLE);
    CHECK(strstr(gy_error_message(), "wants CUDA device 4, this machine has 4") != NULL);
    gy_error_clear();
}

GYTEST(fake_d2d_stream_switches_and_priorities) {
    if (!mode_is("gpu")) return;
    gy_comm *compute = make(GY_COMM_BACKEND_D2D, 4, NULL, GY_COMM_CHANNEL_COMPUTE);
    gy_comm *migration = make(GY_COMM_BACKEND_D2D, 4, NULL, GY_COMM_CHANNEL_MIGRATION);
    CHECK(compute != NULL && migration != NULL);
    if (compute == NULL || migration == NULL) return;
    int32_t high = 1, low = -1;
    CHECK_OK(gy_comm_stream_priority(compute, 0, &high));
    CHECK_OK(gy_comm_stream_priority(migration, 0, &low));
    CHECK(high < low); /* the fake's range is [0, -5], like an H100's */
    CHECK(check_all_reduce_rounds(compute, migration, 77, 1));
    gy_comm_free(compute);
    gy_comm_free(migration);
}

#define MOVE_ROUNDS 6
#define REFUSED_ROUND 3
#define GATHER_BYTES 33
#define GATHER_ROUND(k) ((k) % 2 == 0)

typedef struct {
    gy_comm *comm;
    int32_t rank, size;
    int64_t sizes[8][8]; /* bytes rank s sends rank d */
    unsigned char *send[8], *recv[8], *gather_in, *gather_out; /* the rank's "device" buffers */
    /* Host copies: what each round uploads before its calls and downloads after them. */
    unsigned char *send_src[MOVE_ROUNDS][8], *recv_dst[MOVE_ROUNDS][8];
    unsigned char *gather_src[MOVE_ROUNDS], *gather_dst[MOVE_ROUNDS], *gather_dst2[MOVE_ROUNDS];
    int failures, refused;
} move_job;

static unsigned char pattern(int round, int32_t src, int32_t dst) {
    return (unsigned char)(16 * src + dst + 37 * round);
}

/* A copy ordered on the rank's stream (shm has none: its calls are synchronous). */
static int move(move_job *j, void *dst, const void *src, int64_t bytes) {
    if (gy_comm_backend(j->comm) == GY_COMM_BACKEND_SHM) {
        memcpy(dst, src, (size_t)bytes);
        return 0;
    }
    return gy_cuda_comm_copy(dst, src, (uint64_t)bytes, gy_comm_stream(j->comm, j->rank)) != GY_OK;
}

/* Each round rewrites the inputs and reads the outputs with work on the rank's stream, right
 * before and after the calls: a rank whose stream ran ahead of a peer's reads, or one that read
 * a peer's input before it was written, leaves another round's bytes behind. */
static void *move_rounds(void *p) {
    move_job *j = p;
    if (gy_comm_backend(j->comm) != GY_COMM_BACKEND_SHM)
        j->failures += gy_cuda_comm_device_swap(gy_comm_device(j->comm, j->rank), NULL) != GY_OK;
    for (int k = 0; k < MOVE_ROUNDS; k++) {
        int64_t send_bytes[8], recv_bytes[8];
        const void *send[8];
        void *recv[8];
        for (int32_t d = 0; d < j->size; d++) {
            send_bytes[d] = j->sizes[j->rank][d];
            recv_bytes[d] = j->sizes[d][j->rank];
            send[d] = j->send[d];
            recv[d] = j->recv[d];
            j->failures += move(j, j->send[d], j->send_src[k][d], send_bytes[d]);
        }
        if (k == REFUSED_ROUND && j->rank == 1) recv_bytes[0] += 1; /* refused */
        const gy_status s = gy_comm_all_to_all(j->comm, j->rank, recv, recv_bytes, send, send_bytes);
        if (k == REFUSED_ROUND) j->refused += s == GY_ERR_INVALID;
        else j->failures += s != GY_OK;
        gy_error_clear();
        for (int32_t src = 0; src < j->size; src++)
            j->failures += move(j, j->recv_dst[k][src], j->recv[src], j->sizes[src][j->rank]);
        if (!GATHER_ROUND(k)) continue; /* back-to-back all-to-alls in between */
        j->failures += move(j, j->gather_in, j->gather_src[k], GATHER_BYTES);
        j->failures += gy_comm_all_gather(j->comm, j->rank, j->gather_out, j->gather_in,
                                          GATHER_BYTES) != GY_OK;
        j->failures += move(j, j->gather_dst[k], j->gather_out, GATHER_BYTES * j->size);
    }
    for (int k = 0; k < MOVE_ROUNDS; k++) { /* and back-to-back all-gathers */
        j->failures += move(j, j->gather_in, j->gather_src[k], GATHER_BYTES);
        j->failures += gy_comm_all_gather(j->comm, j->rank, j->gather_out, j->gather_in,
                                          GATHER_BYTES) != GY_OK;
        j->failures += move(j, j->gather_dst2[k], j->gather_out, GATHER_BYTES * j->size);
    }
    j->failures += gy_comm_synchronize(j->comm, j->rank) != GY_OK;
    return NULL;
}

static int check_moves(gy_comm *comm, int nccl) {
    const int32_t size = gy_comm_size(comm);
    move_job jobs[8];
    for (int32_t r = 0; r < size; r++) {
        jobs[r] = (move_job){.comm = comm, .rank = r, .size = size};
        for (int32_t s = 0; s < size; s++)
            for (int32_t d = 0; d < size; d++)
                jobs[r].sizes[s][d] = ((s * 7 + d * 3) % 5) * 101 + (s != d) * ((s + d) % 3);
        for (int32_t d = 0; d < size; d++) {
            jobs[r].send[d] = malloc(1024);
            jobs[r].recv[d] = malloc(1024);
            memset(jobs[r].recv[d], 0xee, 1024);
            for (int k = 0; k < MOVE_ROUNDS; k++) {
                jobs[r].send_src[k][d] = malloc(1024);
                jobs[r].recv_dst[k][d] = calloc(1, 1024);
                memset(jobs[r].send_src[k][d], pattern(k, r, d), 1024);
            }
        }
        jobs[r].gather_in = malloc(GATHER_BYTES);
        jobs[r].gather_out = malloc(GATHER_BYTES * (size_t)size);
        for (int k = 0; k < MOVE_ROUNDS; k++) {
            jobs[r].gather_src[k] = malloc(GATHER_BYTES);
            jobs[r].gather_dst[k] = calloc(1, GATHER_BYTES * (size_t)size);
            jobs[r].gather_dst2[k] = calloc(1, GATHER_BYTES * (size_t)size);
            memset(jobs[r].gather_src[k], pattern(k, r, 99), GATHER_BYTES);
        }
    }
    pthread_t threads[8];
    for (int32_t r = 0; r < size; r++) pthread_create(&threads[r], NULL, move_rounds, &jobs[r]);
    for (int32_t r = 0; r < size; r++) pthread_join(threads[r], NULL);
    int bad = 0;
    for (int32_t r = 0; r < size; r++) {
        bad += jobs[r].failures;
        /* shm and d2d refuse on the receiver only; nccl on every rank, before anything moves */
        bad += jobs[r].refused != (nccl || r == 1 ? 1 : 0);
        for (int k = 0; k < MOVE_ROUNDS; k++)
            for (int32_t s = 0; s < size; s++) {
                /* A refused pair keeps the previous round's bytes. */
                const int refused = k == REFUSED_ROUND && (nccl || (s == 0 && r == 1));
                const unsigned char want = pattern(refused ? k - 1 : k, s, r);
                for (int64_t i = 0; i < jobs[r].sizes[s][r]; i++)
                    bad += jobs[r].recv_dst[k][s][i] != want;
                for (int i = 0; i < GATHER_BYTES; i++) {
                    if (GATHER_ROUND(k))
                        bad += jobs[r].gather_dst[k][s * GATHER_BYTES + i] != pattern(k, s, 99);
                    bad += jobs[r].gather_dst2[k][s * GATHER_BYTES + i] != pattern(k, s, 99);
                }
            }
        for (int32_t s = 0; s < size; s++)
            bad += jobs[r].recv[s][jobs[r].sizes[s][r]] != 0xee; /* nothing past the end */
    }
    gy_comm_stats st;
    gy_comm_stats_get(comm, &st);
    const uint64_t gathers = (MOVE_ROUNDS + 1) / 2 + MOVE_ROUNDS;
    bad += st.calls != MOVE_ROUNDS + gathers; /* the refused all-to-all counts too */
    for (int32_t r = 0; r < size; r++) {
        uint64_t sent = 0, received = 0;
        for (int32_t d = 0; d < size; d++)
            if (d != r) {
                sent += (uint64_t)jobs[r].sizes[r][d];
                received += (uint64_t)jobs[r].sizes[d][r];
            }
        /* The refused all-to-all moved all but the refused pair (shm, d2d) or nothing (nccl). */
        const uint64_t refused_received = nccl ? received : r == 1 ? (uint64_t)jobs[r].sizes[0][1] : 0;
        const uint64_t refused_sent = nccl ? sent : r == 0 ? (uint64_t)jobs[r].sizes[0][1] : 0;
        const uint64_t gathered = gathers * GATHER_BYTES * (uint64_t)(size - 1);
        bad += st.bytes_received[r] != MOVE_ROUNDS * received - refused_received + gathered;
        bad += st.bytes_sent[r] != MOVE_ROUNDS * sent - refused_sent + gathered;
    }
    for (int32_t r = 0; r < size; r++) {
        for (int32_t d = 0; d < size; d++) {
            free(jobs[r].send[d]);
            free(jobs[r].recv[d]);
            for (int k = 0; k < MOVE_ROUNDS; k++) {
                free(jobs[r].send_src[k][d]);
                free(jobs[r].recv_dst[k][d]);
            }
        }
        free(jobs[r].gather_in);
        free(jobs[r].gather_out);
        for (int k = 0; k < MOVE_ROUNDS; k++) {
            free(jobs[r].gather_src[k]);
            free(jobs[r].gather_dst[k]);
            free(jobs[r].gather_dst2[k]);
        }
    }
    if (bad) fprintf(stderr, "  %d wrong bytes, stats or calls\n", bad);
    return bad == 0;
}

GYTEST(fake_d2d_all_to_all_and_all_gather_match_shm) {
    if (!mode_is("gpu")) return;
    for (int32_t size = 2; size <= 8; size *= 2) {
        gy_comm *shm = make(GY_COMM_BACKEND_SHM, size, NULL, GY_COMM_CHANNEL_COMPUTE);
        gy_comm *d2d = make(GY_COMM_BACKEND_D2D, size, NULL, GY_COMM_CHANNEL_MIGRATION);
        CHECK(shm != NULL && d2d != NULL);
        if (shm == NULL || d2d == NULL) return;
        CHECK(check_moves(shm, 0));
        CHECK(check_moves(d2d, 0));
        gy_comm_stats a, b;
        gy_comm_stats_get(shm, &a);
        gy_comm_stats_get(d2d, &b);
        CHECK(memcmp(&a, &b, sizeof a) == 0);
        gy_comm_free(shm);
        gy_comm_free(d2d);
    }
}

/* ---- point to point: a pipeline of ranks ---- */

#define CHAIN_ROUNDS 16

typedef struct chain_job {
    gy_comm *comm;
    int32_t rank, size;
    float *inputs;  /* rank 0: [CHAIN_ROUNDS][MAX_N] uploaded by copies on its stream */
    float *results; /* the last rank: [CHAIN_ROUNDS][MAX_N] downloaded by copies on its stream */
    float *device;  /* [MAX_N] the rank's buffer, reused every round */
    int failures;
} chain_job;

static int64_t chain_count(int k) { return (k * 1009 + 3) % MAX_N; }

/* Round k moves chain_count(k) floats from rank 0 through every rank to the last, each hop
 * received into the rank's one buffer and sent on from it at once, with no host wait: only the
 * events of send/recv keep a hop from reading a buffer the next round has overwritten. */
static void *chain_rounds(void *p) {
    chain_job *j = p;
    j->failures += gy_cuda_comm_device_swap(gy_comm_device(j->comm, j->rank), NULL) != GY_OK;
    void *stream = gy_comm_stream(j->comm, j->rank);
    for (int k = 0; k < CHAIN_ROUNDS; k++) {
        const int64_t n = chain_count(k), bytes = n * 4;
        if (j->rank == 0)
            j->failures += gy_cuda_comm_copy(j->device, j->inputs + k * MAX_N, (uint64_t)bytes,
                                             stream) != GY_OK;
        else
            j->failures += gy_comm_recv(j->comm, j->rank, j->rank - 1, j->device, bytes) != GY_OK;
        if (j->rank + 1 < j->size)
            j->failures += gy_comm_send(j->comm, j->rank, j->rank + 1, j->device, bytes) != GY_OK;
        else
            j->failures += gy_cuda_comm_copy(j->results + k * MAX_N, j->device, (uint64_t)bytes,
                                             stream) != GY_OK;
    }
    j->failures += gy_comm_synchronize(j->comm, j->rank) != GY_OK;
    return NULL;
}

static int check_chain(gy_comm *comm, uint32_t seed) {
    const int32_t size = gy_comm_size(comm);
    chain_job jobs[GY_COMM_MAX_RANKS];
    for (int32_t r = 0; r < size; r++) {
        jobs[r] = (chain_job){.comm = comm, .rank = r, .size = size};
        jobs[r].device = malloc(sizeof(float) * MAX_N);
    }
    jobs[0].inputs = malloc(sizeof(float) * CHAIN_ROUNDS * MAX_N);
    jobs[size - 1].results = calloc(CHAIN_ROUNDS * MAX_N, sizeof(float));
    for (int k = 0; k < CHAIN_ROUNDS; k++)
        for (int64_t i = 0; i < MAX_N; i++) jobs[0].inputs[k * MAX_N + i] = value(seed, k, i);
    gy_comm_stats_reset(comm);
    run_jobs(jobs, sizeof *jobs, size, chain_rounds);
    int bad = 0;
    for (int32_t r = 0; r < size; r++) bad += jobs[r].failures;
    uint64_t bytes = 0;
    for (int k = 0; k < CHAIN_ROUNDS; k++) {
        bytes += (uint64_t)chain_count(k) * 4;
        bad += memcmp(jobs[size - 1].results + k * MAX_N, jobs[0].inputs + k * MAX_N,
                      sizeof(float) * (size_t)chain_count(k)) != 0;
    }
    gy_comm_stats st;
    gy_comm_stats_get(comm, &st);
    bad += st.calls != (uint64_t)CHAIN_ROUNDS * (uint64_t)(size - 1);
    for (int32_t r = 0; r < size; r++) {
        bad += st.bytes_sent[r] != (r + 1 < size ? bytes : 0);
        bad += st.bytes_received[r] != (r > 0 ? bytes : 0);
    }
    for (int32_t r = 0; r < size; r++) free(jobs[r].device);
    free(jobs[0].inputs);
    free(jobs[size - 1].results);
    if (bad) fprintf(stderr, "  chain of %d ranks: %d wrong rounds, stats or calls\n", (int)size, bad);
    return bad == 0;
}

GYTEST(fake_d2d_send_recv_chain_keeps_every_round) {
    if (!mode_is("gpu")) return;
    for (int32_t size = 2; size <= 8; size *= 2) {
        gy_comm *comm = make(GY_COMM_BACKEND_D2D, size, NULL, GY_COMM_CHANNEL_COMPUTE);
        CHECK(comm != NULL);
        if (comm == NULL) return;
        CHECK(check_chain(comm, 21));
        gy_comm_free(comm);
    }
}

/* ---- nccl over nccl.c ---- */

static int (*fake_nccl_errors_fn)(void);
static const char *(*fake_nccl_problem_fn)(void);
static int fake_nccl_expected; /* problems the hang detector's test caused on purpose */

static int fake_nccl_clean(void) {
    if (fake_nccl_errors_fn == NULL) {
        void *lib = dlopen(getenv("GYGES_NCCL_LIBRARY"), RTLD_NOW | RTLD_NOLOAD);
        if (lib == NULL) return 0;
        *(void **)&fake_nccl_errors_fn = dlsym(lib, "fake_nccl_errors");
        *(void **)&fake_nccl_problem_fn = dlsym(lib, "fake_nccl_last_problem");
        if (fake_nccl_errors_fn == NULL || fake_nccl_problem_fn == NULL) return 0;
    }
    const int errors = fake_nccl_errors_fn();
    if (errors != fake_nccl_expected) fprintf(stderr, "  fake NCCL: %s\n", fake_nccl_problem_fn());
    return errors == fake_nccl_expected;
}

GYTEST(fake_nccl_collectives_and_all_to_all) {
    if (!mode_is("gpu")) return;
    const int32_t devices[4] = {2, 0, 3, 1};
    for (int32_t size = 1; size <= 4; size *= 2) {
        gy_comm *comm = make(GY_COMM_BACKEND_NCCL, size, devices, GY_COMM_CHANNEL_COMPUTE);
        CHECK(comm != NULL);
        if (comm == NULL) return;
        CHECK(gy_comm_device(comm, 0) == 2);
        CHECK(stream_device(gy_comm_stream(comm, 0)) == 2);
        CHECK(check_all_reduce_rounds(comm, NULL, 3, 0));
        gy_comm_stats_reset(comm);
        if (size > 1) CHECK(check_moves(comm, 1));
        if (size > 1) CHECK(check_chain(comm, 22));
        CHECK(fake_nccl_clean());
        gy_comm_free(comm);
    }
}

GYTEST(fake_nccl_migration_comm_switches_streams) {
    if (!mode_is("gpu")) return;
    gy_comm *compute = make(GY_COMM_BACKEND_NCCL, 4, NULL, GY_COMM_CHANNEL_COMPUTE);
    gy_comm *migration = make(GY_COMM_BACKEND_NCCL, 4, NULL, GY_COMM_CHANNEL_MIGRATION);
    CHECK(compute != NULL && migration != NULL);
    if (compute == NULL || migration == NULL) return;
    int32_t high = 1, low = -1;
    CHECK_OK(gy_comm_stream_priority(compute, 3, &high));
    CHECK_OK(gy_comm_stream_priority(migration, 3, &low));
    CHECK(high < low);
    CHECK(check_all_reduce_rounds(migration, compute, 8, 0));
    CHECK(fake_nccl_clean());
    gy_comm_free(compute);
    gy_comm_free(migration);
}

GYTEST(fake_nccl_refuses_more_gpus_than_there_are) {
    if (!mode_is("gpu")) return;
    gy_comm *comm = NULL;
    const gy_comm_config config = {.backend = GY_COMM_BACKEND_NCCL, .size = 8};
    CHECK_STATUS(gy_comm_init_config(&comm, &config), GY_ERR_UNAVAILABLE);
    CHECK(strstr(gy_error_message(), "wants CUDA device 4, this machine has 4") != NULL);
    gy_error_clear();
}

/* ---- the pretend NCCL's own behaviour, through its API (as a GPU's NCCL would be driven) ---- */

typedef struct { char internal[128]; } nccl_id;
typedef struct nccl_comm *nccl_comm;
enum { NCCL_OK = 0, NCCL_SYSTEM_ERROR = 2, NCCL_REMOTE_ERROR = 6, NCCL_INT8 = 0, NCCL_FLOAT32 = 7 };

static struct {
    int (*get_unique_id)(nccl_id *);
    int (*init_rank)(nccl_comm *, int, nccl_id, int);
    int (*init_all)(nccl_comm *, int, const int *);
    int (*destroy)(nccl_comm);
    int (*abort)(nccl_comm);
    int (*async_error)(nccl_comm, int *);
    int (*all_reduce)(const void *, void *, size_t, int, int, nccl_comm, void *);
    int (*send)(const void *, size_t, int, int, nccl_comm, void *);
    int (*recv)(void *, size_t, int, int, nccl_comm, void *);
    int (*group_start)(void);
    int (*group_end)(void);
    void (*set_timeout)(double);
} nccl;

static int nccl_load(void) {
    if (nccl.group_end != NULL) return 1;
    void *lib = dlopen(getenv("GYGES_NCCL_LIBRARY"), RTLD_NOW);
    if (lib == NULL) return 0;
    static const struct { const char *name; size_t offset; } symbols[] = {
        {"ncclGetUniqueId", offsetof(__typeof__(nccl), get_unique_id)},
        {"ncclCommInitRank", offsetof(__typeof__(nccl), init_rank)},
        {"ncclCommInitAll", offsetof(__typeof__(nccl), init_all)},
        {"ncclCommDestroy", offsetof(__typeof__(nccl), destroy)},
        {"ncclCommAbort", offsetof(__typeof__(nccl), abort)},
        {"ncclCommGetAsyncError", offsetof(__typeof__(nccl), async_error)},
        {"ncclAllReduce", offsetof(__typeof__(nccl), all_reduce)},
        {"ncclSend", offsetof(__typeof__(nccl), send)},
        {"ncclRecv", offsetof(__typeof__(nccl), recv)},
        {"ncclGroupStart", offsetof(__typeof__(nccl), group_start)},
        {"fake_nccl_set_timeout", offsetof(__typeof__(nccl), set_timeout)},
        {"ncclGroupEnd", offsetof(__typeof__(nccl), group_end)}, /* last: marks it loaded */
    };
    for (size_t i = 0; i < sizeof symbols / sizeof symbols[0]; i++) {
        void *fn = dlsym(lib, symbols[i].name);
        if (fn == NULL) return 0;
        memcpy((char *)&nccl + symbols[i].offset, &fn, sizeof fn);
    }
    return 1;
}

/* The fake NCCL loaded and `n` communicators on devices 0..n-1 in comms (one set per array);
 * 0, the test failed, if either cannot be. */
static int open_comms(int n, nccl_comm *comms, nccl_comm *more) {
    CHECK(nccl_load());
    if (!nccl_load()) return 0;
    int devices[8];
    for (int d = 0; d < n; d++) devices[d] = d;
    CHECK(nccl.init_all(comms, n, devices) == NCCL_OK);
    if (more != NULL) CHECK(nccl.init_all(more, n, devices) == NCCL_OK);
    return 1;
}

static void *new_stream(int device) {
    cudaSetDevice(device);
    cudaStream_t stream = NULL;
    cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    return stream;
}

static void set_flag(void *flag) { __atomic_store_n((int *)flag, 1, __ATOMIC_SEQ_CST); }
static int flag_of(int *flag) { return __atomic_load_n(flag, __ATOMIC_SEQ_CST); }

static void sleep_ms(long ms) {
    struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&t, NULL);
}

#define INIT_RANKS 4
#define INIT_N 1001

typedef struct init_job {
    nccl_id id;
    int rank, late, failures;
    int *late_joined; /* set by the late rank just before it joins */
} init_job;

/* Rank r on its own thread and device: joins by the id (the last rank late: the others wait in
 * InitRank for it), then all-reduces rank-valued floats on its own stream. */
static void *init_rank_job(void *p) {
    init_job *j = p;
    if (j->late) {
        sleep_ms(100);
        set_flag(j->late_joined);
    }
    cudaSetDevice(j->rank);
    nccl_comm comm = NULL;
    j->failures += nccl.init_rank(&comm, INIT_RANKS, j->id, j->rank) != NCCL_OK;
    j->failures += !flag_of(j->late_joined); /* nobody got through before every rank joined */
    if (comm == NULL) return NULL;
    void *stream = new_stream(j->rank);
    float *buf = NULL;
    cudaMalloc((void **)&buf, INIT_N * sizeof(float));
    float host[INIT_N];
    for (int i = 0; i < INIT_N; i++) host[i] = (float)(j->rank + 1) * (float)i;
    cudaMemcpyAsync(buf, host, sizeof host, cudaMemcpyHostToDevice, stream);
    j->failures += nccl.all_reduce(buf, buf, INIT_N, NCCL_FLOAT32, 0, comm, stream) != NCCL_OK;
    cudaMemcpyAsync(host, buf, sizeof host, cudaMemcpyDeviceToHost, stream);
    cudaStreamSynchronize(stream);
    for (int i = 0; i < INIT_N; i++) j->failures += host[i] != 10.0f * (float)i; /* 1+2+3+4 */
    cudaFree(buf);
    cudaStreamDestroy(stream);
    j->failures += nccl.destroy(comm) != NCCL_OK;
    return NULL;
}

GYTEST(fake_nccl_ranks_join_by_unique_id_from_their_threads) {
    if (!mode_is("gpu")) return;
    CHECK(nccl_load());
    if (!nccl_load()) return;
    nccl_id id;
    CHECK(nccl.get_unique_id(&id) == NCCL_OK);
    int late_joined = 0;
    init_job jobs[INIT_RANKS];
    for (int r = 0; r < INIT_RANKS; r++)
        jobs[r] = (init_job){.id = id, .rank = r, .late = r == INIT_RANKS - 1,
                             .late_joined = &late_joined};
    run_jobs(jobs, sizeof *jobs, INIT_RANKS, init_rank_job);
    for (int r = 0; r < INIT_RANKS; r++) CHECK(jobs[r].failures == 0);
    /* Two ranks on one device: NCCL's "Duplicate GPU detected", refused on the second. */
    nccl_comm a = NULL, b = NULL;
    CHECK(nccl.get_unique_id(&id) == NCCL_OK);
    cudaSetDevice(1);
    CHECK(nccl.group_start() == NCCL_OK);
    CHECK(nccl.init_rank(&a, 2, id, 0) == NCCL_OK);
    CHECK(nccl.init_rank(&b, 2, id, 1) != NCCL_OK);
    CHECK(nccl.group_end() != NCCL_OK);
    CHECK(nccl.destroy(a) == NCCL_OK);
    CHECK(fake_nccl_clean());
}

/* One thread drives four GPUs: every rank's sends and receives of an all-to-all in one group,
 * each on its rank's stream. Without the group the first send would wait for a receive this
 * thread has not issued yet. */
GYTEST(fake_nccl_one_thread_groups_an_all_to_all_over_four_ranks) {
    if (!mode_is("gpu")) return;
    enum { R = 4 };
    nccl_comm comms[R];
    if (!open_comms(R, comms, NULL)) return;
    void *streams[R];
    unsigned char *send[R][R], *recv[R][R];
    size_t bytes[R][R]; /* [src][dst] */
    for (int s = 0; s < R; s++) {
        streams[s] = new_stream(s);
        for (int d = 0; d < R; d++) {
            bytes[s][d] = (size_t)(97 * s + 31 * d + 5) * (s != d);
            unsigned char host[512];
            for (size_t i = 0; i < bytes[s][d]; i++) host[i] = (unsigned char)(s * 16 + d + i);
            cudaSetDevice(s);
            cudaMalloc((void **)&send[s][d], 512);
            cudaMemcpy(send[s][d], host, bytes[s][d], cudaMemcpyHostToDevice);
            cudaSetDevice(d);
            cudaMalloc((void **)&recv[d][s], 512);
            cudaMemset(recv[d][s], 0xee, 512);
        }
    }
    CHECK(nccl.group_start() == NCCL_OK);
    for (int r = 0; r < R; r++)
        for (int p = 0; p < R; p++) {
            if (p == r) continue;
            CHECK(nccl.send(send[r][p], bytes[r][p], NCCL_INT8, p, comms[r], streams[r]) == NCCL_OK);
            CHECK(nccl.recv(recv[r][p], bytes[p][r], NCCL_INT8, p, comms[r], streams[r]) == NCCL_OK);
        }
    CHECK(nccl.group_end() == NCCL_OK);
    for (int r = 0; r < R; r++) CHECK(cudaStreamSynchronize(streams[r]) == cudaSuccess);
    for (int s = 0; s < R; s++)
        for (int d = 0; d < R; d++) {
            unsigned char got[512], want[512];
            cudaSetDevice(d);
            cudaMemcpy(got, recv[d][s], 512, cudaMemcpyDeviceToHost);
            for (size_t i = 0; i < 512; i++)
                want[i] = i < bytes[s][d] ? (unsigned char)(s * 16 + d + i) : 0xee;
            CHECK(memcmp(got, want, 512) == 0);
        }
    for (int s = 0; s < R; s++) {
        for (int d = 0; d < R; d++) {
            cudaFree(send[s][d]);
            cudaFree(recv[s][d]);
        }
        cudaStreamDestroy(streams[s]);
        CHECK(nccl.destroy(comms[s]) == NCCL_OK);
    }
    cudaSetDevice(0);
    CHECK(fake_nccl_clean());
}

/* A send holds its stream until the receiver posts: work enqueued after it does not run. */
GYTEST(fake_nccl_send_blocks_its_stream_until_the_peer_posts) {
    if (!mode_is("gpu")) return;
    nccl_comm comms[2];
    if (!open_comms(2, comms, NULL)) return;
    void *s0 = new_stream(0), *s1 = new_stream(1);
    char *src = NULL, *dst = NULL;
    cudaSetDevice(0);
    cudaMalloc((void **)&src, 4096);
    cudaMemset(src, 0x5a, 4096);
    cudaSetDevice(1);
    cudaMalloc((void **)&dst, 4096);
    cudaMemset(dst, 0, 4096);
    int passed = 0;
    cudaSetDevice(0);
    CHECK(nccl.send(src, 4096, NCCL_INT8, 1, comms[0], s0) == NCCL_OK); /* returns at once */
    CHECK(cudaLaunchHostFunc(s0, set_flag, &passed) == cudaSuccess);
    sleep_ms(200);
    CHECK(!flag_of(&passed));
    cudaSetDevice(1);
    CHECK(nccl.recv(dst, 4096, NCCL_INT8, 0, comms[1], s1) == NCCL_OK);
    CHECK(cudaStreamSynchronize(s0) == cudaSuccess && cudaStreamSynchronize(s1) == cudaSuccess);
    CHECK(flag_of(&passed));
    char host[4096];
    cudaMemcpy(host, dst, 4096, cudaMemcpyDeviceToHost);
    CHECK(host[0] == 0x5a && host[4095] == 0x5a);
    cudaFree(dst);
    cudaSetDevice(0);
    cudaFree(src);
    cudaStreamDestroy(s0);
    cudaStreamDestroy(s1);
    CHECK(nccl.destroy(comms[0]) == NCCL_OK && nccl.destroy(comms[1]) == NCCL_OK);
    CHECK(fake_nccl_clean());
}

/* A receive whose sender never comes holds its stream; ncclCommAbort (from another thread, as
 * NCCL documents) wakes it, leaves the buffer as it was, and the peer learns of it. */
GYTEST(fake_nccl_abort_wakes_a_stuck_receiver) {
    if (!mode_is("gpu")) return;
    nccl_comm comms[2];
    if (!open_comms(2, comms, NULL)) return;
    void *s1 = new_stream(1);
    char *dst = NULL;
    cudaMalloc((void **)&dst, 256);
    cudaMemset(dst, 0x11, 256);
    int woke = 0;
    CHECK(nccl.recv(dst, 256, NCCL_INT8, 0, comms[1], s1) == NCCL_OK);
    CHECK(cudaLaunchHostFunc(s1, set_flag, &woke) == cudaSuccess);
    sleep_ms(100);
    CHECK(!flag_of(&woke));
    CHECK(nccl.abort(comms[1]) == NCCL_OK);
    CHECK(cudaStreamSynchronize(s1) == cudaSuccess);
    CHECK(flag_of(&woke));
    char host[256];
    cudaMemcpy(host, dst, 256, cudaMemcpyDeviceToHost);
    CHECK(host[0] == 0x11 && host[255] == 0x11);
    int error = NCCL_OK;
    CHECK(nccl.async_error(comms[0], &error) == NCCL_OK && error == NCCL_REMOTE_ERROR);
    cudaFree(dst);
    cudaStreamDestroy(s1);
    CHECK(nccl.destroy(comms[0]) == NCCL_OK);
    cudaSetDevice(0);
    CHECK(fake_nccl_clean());
}

typedef struct stuck_job {
    gy_comm *comm;
    int32_t rank;
    float *buf;
    gy_status first, after_abort, after_reset;
    int *entered;
} stuck_job;

/* Rank 1 all-reduces and waits for its stream: stuck, since rank 0 fails instead of coming.
 * After gy_comm_reset both all-reduce again. */
static void *stuck_rank(void *p) {
    stuck_job *j = p;
    gy_cuda_comm_device_swap(gy_comm_device(j->comm, j->rank), NULL);
    if (j->rank == 1) {
        j->first = gy_comm_all_reduce(j->comm, 1, j->buf, 64);
        set_flag(j->entered);
        gy_comm_synchronize(j->comm, 1); /* returns once the abort woke the stream */
        j->after_abort = gy_comm_all_reduce(j->comm, 1, j->buf, 64);
        gy_error_clear();
    } else {
        while (!flag_of(j->entered)) sleep_ms(5);
        sleep_ms(100); /* rank 1's stream is waiting in NCCL by now */
        gy_comm_abort(j->comm, 0, "a test's rank 0 gave up");
    }
    return NULL;
}

GYTEST(fake_nccl_gy_comm_abort_wakes_a_rank_stuck_in_nccl_and_reset_remakes_it) {
    if (!mode_is("gpu")) return;
    gy_comm *comm = make(GY_COMM_BACKEND_NCCL, 2, NULL, GY_COMM_CHANNEL_COMPUTE);
    CHECK(comm != NULL);
    if (comm == NULL) return;
    int entered = 0;
    stuck_job jobs[2];
    for (int32_t r = 0; r < 2; r++) {
        jobs[r] = (stuck_job){.comm = comm, .rank = r, .entered = &entered};
        cudaSetDevice(r);
        cudaMalloc((void **)&jobs[r].buf, 64 * sizeof(float));
        float ones[64];
        for (int i = 0; i < 64; i++) ones[i] = (float)(r + 1);
        cudaMemcpy(jobs[r].buf, ones, sizeof ones, cudaMemcpyHostToDevice);
    }
    run_jobs(jobs, sizeof *jobs, 2, stuck_rank);
    CHECK(jobs[1].first == GY_OK); /* enqueued: NCCL reports later */
    CHECK(jobs[1].after_abort == GY_ERR_STATE);
    CHECK(gy_comm_aborted(comm));
    /* Making the communicators again can fail (an injected fault here): every call then says
     * so, and the next reset tries again. */
    gy_fault_arm(GY_FAULT_COMM, 1);
    gy_comm_reset(comm);
    gy_fault_disarm_all();
    CHECK_STATUS(gy_comm_all_reduce(comm, 0, jobs[0].buf, 64), GY_ERR_STATE);
    CHECK(strstr(gy_error_message(), "could not be made again: injected fault") != NULL);
    gy_error_clear();
    gy_comm_reset(comm);
    CHECK(!gy_comm_aborted(comm));
    rank_job again[2];
    for (int32_t r = 0; r < 2; r++) {
        again[r] = (rank_job){.comm = comm, .rank = r, .size = 2};
        for (int k = 0; k < ROUNDS; k++) again[r].n[k] = 64;
        again[r].inputs = calloc(ROUNDS * MAX_N, sizeof(float));
        again[r].results = calloc(ROUNDS * MAX_N, sizeof(float));
        again[r].device = jobs[r].buf;
        for (int k = 0; k < ROUNDS; k++)
            for (int i = 0; i < 64; i++) again[r].inputs[k * MAX_N + i] = (float)(r + 1) * (float)i;
    }
    run_ranks(again, 2, all_reduce_rounds);
    for (int32_t r = 0; r < 2; r++) {
        CHECK(again[r].failures == 0);
        for (int i = 0; i < 64; i++) CHECK(again[r].results[(ROUNDS - 1) * MAX_N + i] == 3.0f * (float)i);
        free(again[r].inputs);
        free(again[r].results);
        cudaSetDevice(r);
        cudaFree(jobs[r].buf);
    }
    cudaSetDevice(0);
    gy_comm_free(comm);
    CHECK(fake_nccl_clean());
}

/* Two communicators over the same two GPUs, called in opposite orders on one stream per rank:
 * on a GPU each stream waits forever for the other. The hang detector says so instead. */
GYTEST(fake_nccl_hang_detector_reports_communicators_in_opposite_orders) {
    if (!mode_is("gpu")) return;
    nccl_comm a[2], b[2];
    if (!open_comms(2, a, b)) return;
    void *streams[2] = {new_stream(0), new_stream(1)};
    float *buf[2];
    for (int r = 0; r < 2; r++) {
        cudaSetDevice(r);
        cudaMalloc((void **)&buf[r], 16 * sizeof(float));
        cudaMemset(buf[r], 0, 16 * sizeof(float));
    }
    (void)fake_nccl_clean(); /* loads the counters */
    const int before = fake_nccl_errors_fn != NULL ? fake_nccl_errors_fn() : 0;
    nccl.set_timeout(0.5);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    cudaSetDevice(0);
    CHECK(nccl.all_reduce(buf[0], buf[0], 16, NCCL_FLOAT32, 0, a[0], streams[0]) == NCCL_OK);
    CHECK(nccl.all_reduce(buf[0], buf[0], 16, NCCL_FLOAT32, 0, b[0], streams[0]) == NCCL_OK);
    cudaSetDevice(1);
    CHECK(nccl.all_reduce(buf[1], buf[1], 16, NCCL_FLOAT32, 0, b[1], streams[1]) == NCCL_OK);
    CHECK(nccl.all_reduce(buf[1], buf[1], 16, NCCL_FLOAT32, 0, a[1], streams[1]) == NCCL_OK);
    CHECK(cudaStreamSynchronize(streams[0]) == cudaSuccess);
    CHECK(cudaStreamSynchronize(streams[1]) == cudaSuccess);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    nccl.set_timeout(60.0);
    const double waited = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    CHECK(waited >= 0.5 && waited < 30.0);
    CHECK(fake_nccl_errors_fn != NULL && fake_nccl_errors_fn() > before);
    CHECK(fake_nccl_problem_fn != NULL && strstr(fake_nccl_problem_fn(), "would-be deadlock"));
    int error = NCCL_OK, other = NCCL_OK;
    CHECK(nccl.async_error(a[0], &error) == NCCL_OK && nccl.async_error(b[0], &other) == NCCL_OK);
    CHECK(error == NCCL_SYSTEM_ERROR || other == NCCL_SYSTEM_ERROR);
    if (fake_nccl_errors_fn != NULL) fake_nccl_expected = fake_nccl_errors_fn();
    for (int r = 0; r < 2; r++) {
        cudaSetDevice(r);
        cudaFree(buf[r]);
        cudaStreamDestroy(streams[r]);
        CHECK(nccl.destroy(a[r]) == NCCL_OK && nccl.destroy(b[r]) == NCCL_OK);
    }
    cudaSetDevice(0);
}

/* ---- peers ---- */

GYTEST(fake_devices_have_their_own_memory_and_peer_copies) {
    if (!mode_is("gpu")) return;
    char *on0 = NULL, *on1 = NULL;
    cudaSetDevice(0);
    size_t free0 = 0, total = 0;
    cudaMemGetInfo(&free0, &total);
    CHECK(cudaMalloc((void **)&on0, 1 << 20) == cudaSuccess);
    size_t free0_after = 0;
    cudaMemGetInfo(&free0_after, &total);
    CHECK(free0 - free0_after == 1 << 20);
    cudaSetDevice(1);
    size_t free1 = 0;
    cudaMemGetInfo(&free1, &total);
    CHECK(free1 == free0); /* device 1 did not pay for device 0's memory */
    CHECK(cudaMalloc((void **)&on1, 1 << 20) == cudaSuccess);
    struct cudaPointerAttributes attributes;
    CHECK(cudaPointerGetAttributes(&attributes, on0 + 100) == cudaSuccess);
    CHECK(attributes.type == cudaMemoryTypeDevice && attributes.device == 0);
    int can = 0;
    CHECK(cudaDeviceCanAccessPeer(&can, 1, 0) == cudaSuccess && can);
    cudaMemset(on1, 0, 1 << 20);
    cudaSetDevice(0);
    cudaMemset(on0, 0x77, 1 << 20);
    /* A plain copy between them without peer access: reported, and counted. */
    const long misuses = __atomic_load_n(&gy_emu_peer_misuses, __ATOMIC_RELAXED);
    CHECK(cudaMemcpy(on1, on0, 64, cudaMemcpyDeviceToDevice) == cudaSuccess);
    CHECK(__atomic_load_n(&gy_emu_peer_misuses, __ATOMIC_RELAXED) == misuses + 1);
    /* cudaMemcpyPeer is the way, and names the devices right. */
    CHECK(cudaMemcpyPeer(on1 + 64, 1, on0, 0, 64) == cudaSuccess);
    CHECK(cudaMemcpyPeer(on1, 0, on0, 0, 64) == cudaErrorInvalidValue);
    gy_error_clear();
    cudaGetLastError();
    /* Once peer access is on, plain copies are fine. */
    CHECK(cudaDeviceEnablePeerAccess(1, 0) == cudaSuccess);
    CHECK(cudaDeviceEnablePeerAccess(1, 0) == cudaErrorPeerAccessAlreadyEnabled);
    cudaGetLastError();
    CHECK(cudaMemcpy(on1 + 128, on0, 64, cudaMemcpyDeviceToDevice) == cudaSuccess);
    CHECK(__atomic_load_n(&gy_emu_peer_misuses, __ATOMIC_RELAXED) == misuses + 1);
    CHECK(cudaDeviceDisablePeerAccess(1) == cudaSuccess);
    char host[192];
    cudaMemcpy(host, on1, sizeof host, cudaMemcpyDeviceToHost);
    for (int i = 0; i < 192; i++) CHECK(host[i] == 0x77);
    cudaFree(on0);
    cudaSetDevice(1);
    cudaFree(on1);
    cudaSetDevice(0);
}

/* ---- a machine with neither ---- */

GYTEST(fake_bare_machine_refuses_with_reasons) {
    if (!mode_is("bare")) return;
    gy_comm *comm = NULL;
    gy_comm_config config = {.backend = GY_COMM_BACKEND_D2D, .size = 2};
    CHECK_STATUS(gy_comm_init_config(&comm, &config), GY_ERR_UNAVAILABLE);
    /* The runtime answers cudaErrorNoDevice when it sees no device, as a real one does. */
    CHECK(strstr(gy_error_message(), "the d2d communicator is not available: CUDA is not "
                                     "available: ") != NULL);
    CHECK(strstr(gy_error_message(), "cudaErrorNoDevice") != NULL);
    config.backend = GY_COMM_BACKEND_NCCL;
    CHECK_STATUS(gy_comm_init_config(&comm, &config), GY_ERR_UNAVAILABLE);
    CHECK(strstr(gy_error_message(), "NCCL could not be loaded") != NULL);
    CHECK(strstr(gy_error_message(), "GYGES_NCCL_LIBRARY") != NULL);
    CHECK(comm == NULL);
    gy_error_clear();
}

__attribute__((destructor)) static void emu_shutdown(void) { gy_emu_shutdown(); }
