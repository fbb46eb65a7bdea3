/* test_comm.c: the shared-memory collectives, run by real threads. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

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

GYTEST(comm_all_reduce_sums_in_tree_order) {
    for (int32_t size = 1; size <= 8; size *= 2) {
        gy_comm *comm;
        CHECK_OK(gy_comm_init(&comm, size));
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

GYTEST(comm_rejects_bad_sizes) {
    gy_comm *comm = NULL;
    CHECK_STATUS(gy_comm_init(&comm, 3), GY_ERR_INVALID);
    CHECK_STATUS(gy_comm_init(&comm, 0), GY_ERR_INVALID);
    CHECK_STATUS(gy_comm_init(&comm, 32), GY_ERR_INVALID);
    CHECK(comm == NULL);
    CHECK_OK(gy_comm_init(&comm, 2));
    float x = 1.0f;
    CHECK_STATUS(gy_comm_all_reduce(comm, 2, &x, 1), GY_ERR_INVALID);
    gy_comm_free(comm);
}
