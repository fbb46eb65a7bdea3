/* test_comm.c: the shared-memory collectives, run by real threads. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "comm/comm.h"
#include "gytest.h"

#define N 1003 /* odd, so the slices of the all-reduce are uneven */

typedef struct {
    gy_comm *comm;
    int32_t rank;
    float buf[N];
    int ok;
} rank_arg;

static float value(int32_t rank, int64_t i) { return (float)((rank + 1) * 0.1 + i * 1e-3 + rank * i * 1e-7); }

static void *all_reduce_rank(void *p) {
    rank_arg *a = p;
    for (int64_t i = 0; i < N; i++) a->buf[i] = value(a->rank, i);
    for (int round = 0; round < 3; round++) /* reuse of the scratch across calls */
        if (round == 0) a->ok = gy_comm_all_reduce(a->comm, a->rank, a->buf, N) == GY_OK;
    return NULL;
}

/* By gy_comm_init, or by gy_comm_init_config with the shm backend: the same communicator. */
static gy_status make_shm(gy_comm **comm, int32_t size, int by_config) {
    if (!by_config) return gy_comm_init(comm, size);
    const gy_comm_config config = {.backend = GY_COMM_BACKEND_SHM, .size = size,
                                   .channel = GY_COMM_CHANNEL_MIGRATION};
    return gy_comm_init_config(comm, &config);
}

GYTEST(comm_all_reduce_sums_in_tree_order) {
    for (int32_t k = 0; k < 8; k++) {
        const int32_t size = 1 << (k % 4);
        const int by_config = k >= 4;
        gy_comm *comm;
        CHECK_OK(make_shm(&comm, size, by_config));
        CHECK(gy_comm_backend(comm) == GY_COMM_BACKEND_SHM);
        rank_arg args[8];
        pthread_t threads[8];
        for (int32_t r = 0; r < size; r++) {
            args[r] = (rank_arg){.comm = comm, .rank = r};
            pthread_create(&threads[r], NULL, all_reduce_rank, &args[r]);
        }
        for (int32_t r = 0; r < size; r++) pthread_join(threads[r], NULL);
        int exact = 1;
        for (int64_t i = 0; i < N; i++) {
            float v[8];
            for (int32_t r = 0; r < size; r++) v[r] = value(r, i);
            /* ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7)), written out. */
            float want = v[0];
            if (size == 2) want = v[0] + v[1];
            if (size == 4) want = (v[0] + v[1]) + (v[2] + v[3]);
            if (size == 8) want = ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
            for (int32_t r = 0; r < size; r++) exact &= memcmp(&args[r].buf[i], &want, sizeof want) == 0;
        }
        for (int32_t r = 0; r < size; r++) CHECK(args[r].ok);
        CHECK(exact);
        gy_comm_stats st;
        gy_comm_stats_get(comm, &st);
        CHECK(st.calls == (size > 1 ? 1u : 0u));
        /* What a ring would move: 2 (size - 1) / size of the vector each way. */
        for (int32_t r = 0; r < size; r++)
            CHECK(st.bytes_sent[r] == (uint64_t)N * 4 * 2 * (size - 1) / size &&
                  st.bytes_received[r] == st.bytes_sent[r]);
        gy_comm_free(comm);
    }
}

typedef struct {
    gy_comm *comm;
    int32_t rank, size;
    int ok;
} a2a_arg;

/* Rank s sends (s + 1) * (d + 1) bytes of value 16 * s + d to rank d. */
static void *all_to_all_rank(void *p) {
    a2a_arg *a = p;
    unsigned char send_data[8][64], recv_data[8][64];
    const void *send[8];
    void *recv[8];
    int64_t send_bytes[8], recv_bytes[8];
    for (int32_t d = 0; d < a->size; d++) {
        send_bytes[d] = (a->rank + 1) * (d + 1);
        memset(send_data[d], 16 * a->rank + d, (size_t)send_bytes[d]);
        send[d] = send_data[d];
        recv_bytes[d] = (d + 1) * (a->rank + 1);
        recv[d] = recv_data[d];
    }
    a->ok = gy_comm_all_to_all(a->comm, a->rank, recv, recv_bytes, send, send_bytes) == GY_OK;
    for (int32_t s = 0; s < a->size; s++)
        for (int64_t i = 0; i < recv_bytes[s]; i++) a->ok &= recv_data[s][i] == 16 * s + a->rank;
    /* A mismatched size is refused on the receiving rank, not silently truncated. */
    recv_bytes[0] += 1;
    a->ok &= gy_comm_all_to_all(a->comm, a->rank, recv, recv_bytes, send, send_bytes) == GY_ERR_INVALID;
    gy_error_clear();
    return NULL;
}

GYTEST(comm_all_to_all_with_variable_sizes) {
    const int32_t size = 4;
    gy_comm *comm;
    CHECK_OK(gy_comm_init(&comm, size));
    a2a_arg args[4];
    pthread_t threads[4];
    for (int32_t r = 0; r < size; r++) {
        args[r] = (a2a_arg){.comm = comm, .rank = r, .size = size};
        pthread_create(&threads[r], NULL, all_to_all_rank, &args[r]);
    }
    for (int32_t r = 0; r < size; r++) pthread_join(threads[r], NULL);
    for (int32_t r = 0; r < size; r++) CHECK(args[r].ok);
    gy_comm_stats st;
    gy_comm_stats_get(comm, &st);
    /* Rank 1 sends 2 * (d + 1) bytes to each d != 1 (twice: the refused call moves data too). */
    CHECK(st.bytes_sent[1] == 2u * (2 * 1 + 2 * 3 + 2 * 4));
    gy_comm_free(comm);
}

typedef struct {
    gy_comm *comm;
    int32_t rank, size;
    int ok;
} gather_arg;

/* Rank r contributes 7 bytes of value r + 1, twice, around a barrier. */
static void *all_gather_rank(void *p) {
    gather_arg *a = p;
    unsigned char in[7], out[8 * 7];
    memset(in, a->rank + 1, sizeof in);
    a->ok = 1;
    for (int round = 0; round < 2; round++) {
        memset(out, 0xee, sizeof out);
        a->ok &= gy_comm_all_gather(a->comm, a->rank, out, in, 7) == GY_OK;
        for (int32_t r = 0; r < a->size; r++)
            for (int i = 0; i < 7; i++) a->ok &= out[r * 7 + i] == r + 1;
        a->ok &= gy_comm_barrier(a->comm, a->rank) == GY_OK;
    }
    return NULL;
}

GYTEST(comm_all_gather_in_rank_order_with_exact_stats) {
    const int32_t size = 4;
    gy_comm *comm;
    CHECK_OK(make_shm(&comm, size, 1));
    gather_arg args[4];
    pthread_t threads[4];
    for (int32_t r = 0; r < size; r++) {
        args[r] = (gather_arg){.comm = comm, .rank = r, .size = size};
        pthread_create(&threads[r], NULL, all_gather_rank, &args[r]);
    }
    for (int32_t r = 0; r < size; r++) pthread_join(threads[r], NULL);
    for (int32_t r = 0; r < size; r++) CHECK(args[r].ok);
    gy_comm_stats st;
    gy_comm_stats_get(comm, &st);
    CHECK(st.calls == 2); /* barriers are not counted */
    for (int32_t r = 0; r < size; r++)
        CHECK(st.bytes_sent[r] == 2u * 7 * 3 && st.bytes_received[r] == 2u * 7 * 3);
    gy_comm_stats_reset(comm);
    gy_comm_stats_get(comm, &st);
    CHECK(st.calls == 0 && st.bytes_sent[0] == 0);
    gy_comm_free(comm);
}

GYTEST(comm_shm_takes_streams_and_names_itself) {
    gy_comm *comm;
    CHECK_OK(gy_comm_init(&comm, 2));
    CHECK(gy_comm_size(comm) == 2);
    CHECK(gy_comm_channel_of(comm) == GY_COMM_CHANNEL_COMPUTE);
    CHECK(strcmp(gy_comm_backend_name(gy_comm_backend(comm)), "shm") == 0);
    CHECK(strcmp(gy_comm_backend_name(GY_COMM_BACKEND_D2D), "d2d") == 0);
    CHECK(strcmp(gy_comm_backend_name(GY_COMM_BACKEND_NCCL), "nccl") == 0);
    CHECK(strcmp(gy_comm_backend_name((gy_comm_backend_kind)9), "?") == 0);
    CHECK(gy_comm_device(comm, 0) == -1 && gy_comm_device(comm, 5) == -1);
    CHECK(gy_comm_stream(comm, 1) == NULL);
    int marker;
    CHECK_OK(gy_comm_set_stream(comm, 1, &marker)); /* stored, never used */
    CHECK(gy_comm_stream(comm, 1) == &marker);
    int32_t priority = 7;
    CHECK_OK(gy_comm_stream_priority(comm, 1, &priority));
    CHECK(priority == 0);
    CHECK_OK(gy_comm_synchronize(comm, 0));
    CHECK_STATUS(gy_comm_set_stream(comm, 2, NULL), GY_ERR_INVALID);
    CHECK_STATUS(gy_comm_synchronize(comm, -1), GY_ERR_INVALID);
    CHECK_STATUS(gy_comm_barrier(comm, 2), GY_ERR_INVALID);
    gy_comm_free(comm);
}

GYTEST(comm_configs_are_checked_before_any_device) {
    gy_comm *comm = NULL;
    gy_comm_config config = {.backend = (gy_comm_backend_kind)7, .size = 2};
    CHECK_STATUS(gy_comm_init_config(&comm, &config), GY_ERR_INVALID);
    CHECK(strstr(gy_error_message(), "unknown communicator backend") != NULL);
    config = (gy_comm_config){.backend = GY_COMM_BACKEND_SHM, .size = 2,
                              .channel = (gy_comm_channel)5};
    CHECK_STATUS(gy_comm_init_config(&comm, &config), GY_ERR_INVALID);
    const int32_t mixed[2] = {0, 1}, same[2] = {1, 1}, negative[2] = {0, -1};
    config = (gy_comm_config){.backend = GY_COMM_BACKEND_D2D, .size = 2, .devices = mixed};
    CHECK_STATUS(gy_comm_init_config(&comm, &config), GY_ERR_INVALID);
    CHECK(strstr(gy_error_message(), "one GPU") != NULL);
    config = (gy_comm_config){.backend = GY_COMM_BACKEND_NCCL, .size = 2, .devices = same};
    CHECK_STATUS(gy_comm_init_config(&comm, &config), GY_ERR_INVALID);
    CHECK(strstr(gy_error_message(), "one GPU per rank") != NULL);
    config = (gy_comm_config){.backend = GY_COMM_BACKEND_NCCL, .size = 2, .devices = negative};
    CHECK_STATUS(gy_comm_init_config(&comm, &config), GY_ERR_INVALID);
    for (int b = GY_COMM_BACKEND_SHM; b < GY_COMM_BACKEND_COUNT; b++) {
        config = (gy_comm_config){.backend = (gy_comm_backend_kind)b, .size = GY_COMM_MAX_RANKS + 1};
        CHECK_STATUS(gy_comm_init_config(&comm, &config), GY_ERR_INVALID);
    }
    CHECK_STATUS(gy_comm_init_config(&comm, NULL), GY_ERR_INVALID);
    CHECK(comm == NULL);
    gy_error_clear();
}

#ifndef GY_WITH_CUDA
GYTEST(comm_device_backends_are_unavailable_without_cuda) {
    for (int b = GY_COMM_BACKEND_D2D; b <= GY_COMM_BACKEND_NCCL; b++) {
        gy_comm *comm = NULL;
        const gy_comm_config config = {.backend = (gy_comm_backend_kind)b, .size = 2};
        CHECK_STATUS(gy_comm_init_config(&comm, &config), GY_ERR_UNAVAILABLE);
        CHECK(strstr(gy_error_message(), "not built with CUDA") != NULL);
        CHECK(strstr(gy_error_message(), gy_comm_backend_name((gy_comm_backend_kind)b)) != NULL);
        CHECK(comm == NULL);
    }
    gy_error_clear();
}
#endif

GYTEST(comm_rejects_bad_sizes) {
    gy_comm *comm = NULL;
    CHECK_STATUS(gy_comm_init(&comm, 0), GY_ERR_INVALID);
    CHECK_STATUS(gy_comm_init(&comm, -1), GY_ERR_INVALID);
    CHECK_STATUS(gy_comm_init(&comm, 32), GY_ERR_INVALID);
    CHECK(comm == NULL);
    CHECK_OK(gy_comm_init(&comm, 2));
    float x = 1.0f;
    CHECK_STATUS(gy_comm_all_reduce(comm, 2, &x, 1), GY_ERR_INVALID);
    CHECK_STATUS(gy_comm_all_reduce(comm, 0, &x, -1), GY_ERR_INVALID);
    CHECK_STATUS(gy_comm_all_gather(comm, 0, &x, &x, -4), GY_ERR_INVALID);
    CHECK_STATUS(gy_comm_all_to_all(comm, 0, NULL, NULL, NULL, NULL), GY_ERR_INVALID);
    gy_error_clear();
    gy_comm_free(comm);
}

/* ---- point to point ---- */

#define RING_ROUNDS 40
#define RING_MAX 700

typedef struct {
    gy_comm *comm;
    int32_t rank, size;
    float buf[RING_MAX];
    float got[RING_ROUNDS][RING_MAX]; /* rank 0: what came back around the ring */
    int failures;
} ring_arg;

static int64_t ring_count(int round) { return (round * 37) % RING_MAX; } /* 0 included */

/* Round k: rank 0 sends ring_count(k) floats to rank 1; each rank adds its rank + 1 and passes
 * them on; the last sends them back to rank 0. Every hop reuses its buffer at once, so a
 * receiver still reading a sender's buffer after the sender moved on shows as wrong values. */
static void *ring_rank(void *p) {
    ring_arg *a = p;
    const int32_t next = (a->rank + 1) % a->size, prev = (a->rank + a->size - 1) % a->size;
    for (int k = 0; k < RING_ROUNDS; k++) {
        const int64_t n = ring_count(k);
        if (a->rank == 0) {
            for (int64_t i = 0; i < n; i++) a->buf[i] = value(k, i);
            a->failures += gy_comm_send(a->comm, 0, next, a->buf, n * 4) != GY_OK;
            for (int64_t i = 0; i < n; i++) a->buf[i] = -1.0f; /* the send is over: reusable */
            a->failures += gy_comm_recv(a->comm, 0, prev, a->got[k], n * 4) != GY_OK;
        } else {
            a->failures += gy_comm_recv(a->comm, a->rank, prev, a->buf, n * 4) != GY_OK;
            for (int64_t i = 0; i < n; i++) a->buf[i] += (float)(a->rank + 1);
            a->failures += gy_comm_send(a->comm, a->rank, next, a->buf, n * 4) != GY_OK;
        }
    }
    return NULL;
}

GYTEST(comm_send_recv_threads_around_a_ring) {
    for (int32_t size = 2; size <= 8; size *= 2) {
        gy_comm *comm;
        CHECK_OK(gy_comm_init(&comm, size));
        ring_arg *args = calloc((size_t)size, sizeof *args);
        pthread_t threads[8];
        for (int32_t r = 0; r < size; r++) {
            args[r].comm = comm, args[r].rank = r, args[r].size = size;
            pthread_create(&threads[r], NULL, ring_rank, &args[r]);
        }
        for (int32_t r = 0; r < size; r++) pthread_join(threads[r], NULL);
        int exact = 1;
        uint64_t bytes = 0;
        for (int k = 0; k < RING_ROUNDS; k++) {
            bytes += (uint64_t)ring_count(k) * 4;
            for (int64_t i = 0; i < ring_count(k); i++) {
                float want = value(k, i); /* the same adds in the same order */
                for (int32_t r = 1; r < size; r++) want += (float)(r + 1);
                exact &= memcmp(&args[0].got[k][i], &want, sizeof want) == 0;
            }
        }
        for (int32_t r = 0; r < size; r++) CHECK(args[r].failures == 0);
        CHECK(exact);
        gy_comm_stats st;
        gy_comm_stats_get(comm, &st);
        CHECK(st.calls == (uint64_t)RING_ROUNDS * (uint64_t)size);
        for (int32_t r = 0; r < size; r++) CHECK(st.bytes_sent[r] == bytes && st.bytes_received[r] == bytes);
        free(args);
        gy_comm_free(comm);
    }
}

typedef struct {
    gy_comm *comm;
    int64_t send_bytes, recv_bytes;
    const float *send_buf;
    gy_status sent, received;
    float out[8];
} pair_arg;

static void *pair_sender(void *p) {
    pair_arg *a = p;
    a->sent = gy_comm_send(a->comm, 0, 1, a->send_buf, a->send_bytes);
    return NULL;
}

/* One message from rank 0 to rank 1, each side on its own thread; the statuses land in *a. */
static void pair_exchange(pair_arg *a) {
    pthread_t t;
    pthread_create(&t, NULL, pair_sender, a);
    a->received = gy_comm_recv(a->comm, 1, 0, a->out, a->recv_bytes);
    pthread_join(t, NULL);
}

GYTEST(comm_send_recv_refusals_fail_both_sides_and_move_nothing) {
    gy_comm *comm;
    CHECK_OK(gy_comm_init(&comm, 2));
    const float data[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    /* Sizes that differ: refused on both ranks, nothing written. */
    pair_arg a = {.comm = comm, .send_bytes = 16, .recv_bytes = 32, .send_buf = data};
    for (int i = 0; i < 8; i++) a.out[i] = -7.0f;
    pair_exchange(&a);
    CHECK(a.sent == GY_ERR_INVALID && a.received == GY_ERR_INVALID);
    int untouched = 1;
    for (int i = 0; i < 8; i++) untouched &= a.out[i] == -7.0f;
    CHECK(untouched);
    /* A bad sender argument (a NULL buffer) fails the receiver too. */
    a = (pair_arg){.comm = comm, .send_bytes = 16, .recv_bytes = 16, .send_buf = NULL};
    pair_exchange(&a);
    CHECK(a.sent == GY_ERR_INVALID && a.received == GY_ERR_INVALID);
    /* A negative size on the receiver fails the sender. */
    a = (pair_arg){.comm = comm, .send_bytes = 16, .recv_bytes = -16, .send_buf = data};
    pair_exchange(&a);
    CHECK(a.sent == GY_ERR_INVALID && a.received == GY_ERR_INVALID);
    gy_comm_stats st;
    gy_comm_stats_get(comm, &st);
    CHECK(st.calls == 0 && st.bytes_sent[0] == 0 && st.bytes_received[1] == 0);
    /* The pair is still in step: the next message goes through whole. */
    a = (pair_arg){.comm = comm, .send_bytes = 32, .recv_bytes = 32, .send_buf = data};
    pair_exchange(&a);
    CHECK(a.sent == GY_OK && a.received == GY_OK);
    CHECK(memcmp(a.out, data, sizeof data) == 0);
    gy_comm_stats_get(comm, &st);
    CHECK(st.calls == 1 && st.bytes_sent[0] == 32 && st.bytes_received[1] == 32 &&
          st.bytes_sent[1] == 0 && st.bytes_received[0] == 0);
    /* Peers that cannot be: refused on the caller at once (nobody waits). */
    CHECK_STATUS(gy_comm_send(comm, 0, 0, data, 4), GY_ERR_INVALID);
    CHECK_STATUS(gy_comm_recv(comm, 1, 2, a.out, 4), GY_ERR_INVALID);
    CHECK_STATUS(gy_comm_send(comm, 0, -1, data, 4), GY_ERR_INVALID);
    CHECK_STATUS(gy_comm_send(comm, 2, 0, data, 4), GY_ERR_INVALID);
    gy_error_clear();
    gy_comm_free(comm);
}

static void *abort_after_a_while(void *p) {
    struct timespec ts = {0, 20 * 1000 * 1000};
    nanosleep(&ts, NULL);
    gy_comm_abort(p, 0, "test abort");
    return NULL;
}

GYTEST(comm_send_recv_threads_an_abort_wakes_a_waiting_rank) {
    gy_comm *comm;
    CHECK_OK(gy_comm_init(&comm, 4));
    float buf[4] = {0};
    for (int receive = 0; receive < 2; receive++) {
        pthread_t t;
        pthread_create(&t, NULL, abort_after_a_while, comm);
        /* Nobody will answer: only the abort ends the wait. */
        const gy_status s = receive ? gy_comm_recv(comm, 3, 1, buf, 16)
                                    : gy_comm_send(comm, 2, 1, buf, 16);
        pthread_join(t, NULL);
        CHECK(s == GY_ERR_STATE);
        CHECK(strstr(gy_error_message(), "test abort") != NULL);
        gy_error_clear();
        CHECK(gy_comm_aborted(comm));
        gy_comm_reset(comm);
    }
    /* After the reset the half-posted message is gone: a fresh exchange works. */
    pair_arg a = {.comm = comm, .send_bytes = 8, .recv_bytes = 8, .send_buf = (float[]){3, 4}};
    pair_exchange(&a);
    CHECK(a.sent == GY_OK && a.received == GY_OK && a.out[0] == 3 && a.out[1] == 4);
    gy_comm_free(comm);
}
