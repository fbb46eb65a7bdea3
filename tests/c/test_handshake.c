/* test_handshake.c: PipeLive's two-phase handshake (comm/handshake.h): the collision of an
 * inference send and a migration send that deadlocks without it (detected at the deadline, and
 * cleaned up), the same collision resolved with it, a soak of both groups in every direction,
 * and the refusals. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "comm/handshake.h"
#include "core/fault.h"
#include "gytest.h"

/* One call on its own thread, with its status and message kept (messages are per thread). */
typedef struct {
    gy_hs *hs;
    gy_hs_op op;
    int32_t worker, peer;
    void *buf;
    int64_t bytes;
    gy_status status;
    char message[512];
} hs_call;

static void *hs_call_run(void *p) {
    hs_call *c = p;
    switch (c->op) {
    case GY_HS_ACTIVATION_SEND: c->status = gy_hs_activation_send(c->hs, c->worker, c->peer, c->buf, c->bytes); break;
    case GY_HS_ACTIVATION_RECV: c->status = gy_hs_activation_recv(c->hs, c->worker, c->peer, c->buf, c->bytes); break;
    case GY_HS_MIGRATION_SEND: c->status = gy_hs_migration_send(c->hs, c->worker, c->peer, c->buf, c->bytes); break;
    default: c->status = gy_hs_migration_recv(c->hs, c->worker, c->peer, c->buf, c->bytes); break;
    }
    snprintf(c->message, sizeof c->message, "%s", c->status == GY_OK ? "" : gy_error_message());
    return NULL;
}

/* CHECK_STATUS for a call made on another thread, with its message. */
#define CHECK_CALL(c, expected)                                                                    \
    do {                                                                                           \
        if ((c).status != (expected)) {                                                            \
            char msg_[700];                                                                        \
            snprintf(msg_, sizeof msg_, "%s returned %d (%s), expected %d", #c, (int)(c).status,   \
                     (c).message, (int)(expected));                                                \
            gytest_fail(__FILE__, __LINE__, msg_);                                                 \
        }                                                                                          \
    } while (0)

/* The byte i of payload `key`: any two payloads of the tests differ. */
static uint8_t pattern(int64_t i, uint32_t key) {
    return (uint8_t)(((uint32_t)i * 131u + key * 2654435761u) >> 7);
}

static void fill(uint8_t *buf, int64_t n, uint32_t key) {
    for (int64_t i = 0; i < n; i++) buf[i] = pattern(i, key);
}

static int holds(const uint8_t *buf, int64_t n, uint32_t key) {
    for (int64_t i = 0; i < n; i++)
        if (buf[i] != pattern(i, key)) return 0;
    return 1;
}

/* The forced collision. A (worker 0) runs inference: an activation send to B (worker 1). B
 * migrates KV: a migration send to A. Each holds its own device lock (the hook meets at a
 * barrier) before the receivers start: A's migration receive, which needs A's lock, and B's
 * activation receive, which needs B's. */
typedef struct {
    pthread_barrier_t both_hold;
    int activation_met, migration_met;
} collision;

static void collision_hold(void *ctx, int32_t worker, gy_hs_op op) {
    collision *c = ctx;
    int *met = worker == 0 && op == GY_HS_ACTIVATION_SEND ? &c->activation_met
               : worker == 1 && op == GY_HS_MIGRATION_SEND ? &c->migration_met
                                                           : NULL;
    /* a two-phase sender holds again at each retry: only its first hold is part of the setup */
    if (met != NULL && !__atomic_exchange_n(met, 1, __ATOMIC_SEQ_CST)) pthread_barrier_wait(&c->both_hold);
}

enum { ACT = 200, MIG = 3000 }; /* payload bytes */

typedef struct {
    uint8_t act_out[ACT], act_in[ACT], mig_out[MIG], mig_in[MIG];
    hs_call call[4]; /* A's activation send, B's migration send, A's migration recv, B's activation recv */
    const char *holder[2]; /* of A's and B's device locks, 100 ms after the receivers started */
    uint64_t moved_by_then;  /* transfers completed by then */
} collision_run;

static void run_collision(gy_hs *hs, collision *c, collision_run *r) {
    fill(r->act_out, ACT, 1);
    fill(r->mig_out, MIG, 2);
    memset(r->act_in, 0, ACT);
    memset(r->mig_in, 0, MIG);
    r->call[0] = (hs_call){hs, GY_HS_ACTIVATION_SEND, 0, 1, r->act_out, ACT, GY_OK, ""};
    r->call[1] = (hs_call){hs, GY_HS_MIGRATION_SEND, 1, 0, r->mig_out, MIG, GY_OK, ""};
    r->call[2] = (hs_call){hs, GY_HS_MIGRATION_RECV, 0, 1, r->mig_in, MIG, GY_OK, ""};
    r->call[3] = (hs_call){hs, GY_HS_ACTIVATION_RECV, 1, 0, r->act_in, ACT, GY_OK, ""};
    pthread_t t[4];
    pthread_barrier_init(&c->both_hold, NULL, 3);
    pthread_create(&t[0], NULL, hs_call_run, &r->call[0]);
    pthread_create(&t[1], NULL, hs_call_run, &r->call[1]);
    pthread_barrier_wait(&c->both_hold);
    pthread_create(&t[2], NULL, hs_call_run, &r->call[2]);
    pthread_create(&t[3], NULL, hs_call_run, &r->call[3]);
    const struct timespec pause = {0, 100 * 1000000};
    nanosleep(&pause, NULL);
    r->holder[0] = gy_dev_lock_holder(gy_hs_dev_lock(hs, 0));
    r->holder[1] = gy_dev_lock_holder(gy_hs_dev_lock(hs, 1));
    gy_hs_stats s;
    gy_hs_stats_get(hs, &s);
    r->moved_by_then = s.activations + s.migrations;
    for (int i = 0; i < 4; i++) pthread_join(t[i], NULL);
    pthread_barrier_destroy(&c->both_hold);
}

/* Without the handshake the four calls wait on one another in a cycle, until the first deadline
 * (a sender's: they started first). The call that gives up releases its lock and withdraws its
 * offer, which breaks the cycle: the other pair may then complete (or give up too, when its
 * deadline is as near), so each pair either moved its bytes or failed on both sides, and at
 * least one failed. The group works again afterwards. */
GYTEST(handshake_threads_naive_migration_deadlocks) {
    collision c = {0};
    gy_hs_config config = {.n_workers = 2, .two_phase = 0, .timeout_ms = 1000, .tau_ms = 5,
                           .on_hold = collision_hold, .on_hold_ctx = &c};
    gy_hs *hs = NULL;
    CHECK_OK(gy_hs_init(&hs, &config));
    collision_run *r = calloc(1, sizeof *r);
    run_collision(hs, &c, r);
    /* the cycle, as it stood 100 ms into the wait: each lock held by the other group's sender,
     * nothing moved */
    CHECK(r->holder[0] != NULL && strcmp(r->holder[0], "an activation send") == 0);
    CHECK(r->holder[1] != NULL && strcmp(r->holder[1], "a migration send") == 0);
    CHECK(r->moved_by_then == 0);
    /* detected: calls [0] and [3] are the activation pair, [1] and [2] the migration pair */
    int failed_pairs = 0;
    uint64_t timeouts = 0;
    for (int pair = 0; pair < 2; pair++) {
        const hs_call *send = &r->call[pair], *recv = &r->call[3 - pair];
        CHECK(send->status == recv->status);
        if (send->status == GY_OK) continue;
        failed_pairs++;
        timeouts += 2;
        CHECK_CALL(*send, GY_ERR_BUSY);
        CHECK_CALL(*recv, GY_ERR_BUSY);
        CHECK(strstr(send->message, "timed out after 1000 ms") != NULL);
        CHECK(strstr(recv->message, "timed out after 1000 ms") != NULL);
    }
    CHECK(failed_pairs >= 1);
    CHECK(strstr(r->call[0].message, "worker 1 did not receive") != NULL || r->call[0].status == GY_OK);
    CHECK(strstr(r->call[1].message, "worker 0 did not receive") != NULL || r->call[1].status == GY_OK);
    gy_hs_stats s;
    gy_hs_stats_get(hs, &s);
    CHECK(s.timeouts == timeouts && s.acks == 0);
    CHECK(s.activations == (r->call[0].status == GY_OK) && s.migrations == (r->call[1].status == GY_OK));
    uint8_t zero[MIG] = {0};
    CHECK(r->call[0].status == GY_OK ? holds(r->act_in, ACT, 1) : memcmp(r->act_in, zero, ACT) == 0);
    CHECK(r->call[1].status == GY_OK ? holds(r->mig_in, MIG, 2) : memcmp(r->mig_in, zero, MIG) == 0);
    CHECK(gy_dev_lock_holder(gy_hs_dev_lock(hs, 0)) == NULL);
    CHECK(gy_dev_lock_holder(gy_hs_dev_lock(hs, 1)) == NULL);

    /* Nothing stale is left: each transfer alone, its receiver first, moves its bytes. */
    gy_hs_stats_reset(hs);
    r->call[3].status = r->call[2].status = GY_ERR_STATE;
    pthread_t t;
    pthread_create(&t, NULL, hs_call_run, &r->call[3]);
    CHECK_OK(gy_hs_activation_send(hs, 0, 1, r->act_out, ACT));
    pthread_join(t, NULL);
    pthread_create(&t, NULL, hs_call_run, &r->call[2]);
    CHECK_OK(gy_hs_migration_send(hs, 1, 0, r->mig_out, MIG));
    pthread_join(t, NULL);
    CHECK_CALL(r->call[3], GY_OK);
    CHECK_CALL(r->call[2], GY_OK);
    CHECK(holds(r->act_in, ACT, 1) && holds(r->mig_in, MIG, 2));
    gy_hs_stats_get(hs, &s);
    CHECK(s.activations == 1 && s.migrations == 1 && s.bytes == ACT + MIG && s.timeouts == 0);
    free(r);
    gy_hs_free(hs);
}

/* With the handshake, A's migration receive answers B's ACK with REJECT (A's lock is held by
 * the activation send), B lets its lock go, B's activation receive takes it and the activation
 * completes; B's retry is then accepted. tau (300 ms) leaves the receiver ample time to answer
 * the first ACK, so that attempt ends in a REJECT rather than a withdrawal. */
GYTEST(handshake_threads_two_phase_completes) {
    collision c = {0};
    gy_hs_config config = {.n_workers = 2, .two_phase = 1, .timeout_ms = 4000, .tau_ms = 300,
                           .on_hold = collision_hold, .on_hold_ctx = &c};
    gy_hs *hs = NULL;
    CHECK_OK(gy_hs_init(&hs, &config));
    collision_run *r = calloc(1, sizeof *r);
    run_collision(hs, &c, r);
    for (int i = 0; i < 4; i++) CHECK_CALL(r->call[i], GY_OK);
    CHECK(holds(r->act_in, ACT, 1) && holds(r->mig_in, MIG, 2));
    gy_hs_stats s;
    gy_hs_stats_get(hs, &s);
    CHECK(s.activations == 1 && s.migrations == 1 && s.bytes == ACT + MIG && s.timeouts == 0);
    /* the first attempt cannot be accepted: A's lock is held until B's lock is let go */
    CHECK(s.retries >= 1 && s.acks == s.retries + 1);
    CHECK(s.rejects >= 1);
    CHECK(gy_dev_lock_holder(gy_hs_dev_lock(hs, 0)) == NULL);
    CHECK(gy_dev_lock_holder(gy_hs_dev_lock(hs, 1)) == NULL);
    free(r);
    gy_hs_free(hs);
}

/* ---- soak: inference around a ring and migrations in every direction, interleaved ---- */

typedef struct {
    gy_hs *hs;
    int32_t n, worker, peer, rounds;
    uint32_t seed;
    int ok;
} soak_thread;

static int64_t soak_bytes(uint32_t seed, uint32_t a, uint32_t b, uint32_t c) {
    uint32_t h = seed * 2654435761u ^ a * 40503u ^ b * 9973u ^ c * 31u;
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    return (int64_t)((h ^ h >> 15) % 700); /* 0 included */
}

static void soak_pause(unsigned *rng) {
    const long ns = (long)(rand_r(rng) % 200) * 1000;
    if (ns > 0) {
        struct timespec t = {0, ns};
        nanosleep(&t, NULL);
    }
}

/* A pipeline stage: receives the round's activations from the previous worker (not worker 0),
 * runs a "forward pass" (the device lock, as a compute collective would take it), and sends to
 * the next (worker 0 first, then receives from the last: the ring back to the first stage). */
static void *soak_inference(void *p) {
    soak_thread *t = p;
    const int32_t prev = (t->worker + t->n - 1) % t->n, next = (t->worker + 1) % t->n;
    uint8_t buf[700];
    unsigned rng = t->seed ^ (unsigned)t->worker;
    t->ok = 1;
    for (int32_t r = 0; r < t->rounds; r++) {
        const int64_t in = soak_bytes(t->seed, 0, (uint32_t)r, (uint32_t)prev);
        const int64_t out = soak_bytes(t->seed, 0, (uint32_t)r, (uint32_t)t->worker);
        const uint32_t in_key = 7u * (uint32_t)r + (uint32_t)prev, out_key = 7u * (uint32_t)r + (uint32_t)t->worker;
        if (t->worker != 0) {
            t->ok &= gy_hs_activation_recv(t->hs, t->worker, prev, buf, in) == GY_OK && holds(buf, in, in_key);
        }
        t->ok &= gy_dev_lock_acquire(gy_hs_dev_lock(t->hs, t->worker), "a forward pass", 5000) == GY_OK;
        soak_pause(&rng);
        gy_dev_lock_release(gy_hs_dev_lock(t->hs, t->worker));
        fill(buf, out, out_key);
        t->ok &= gy_hs_activation_send(t->hs, t->worker, next, buf, out) == GY_OK;
        if (t->worker == 0) {
            t->ok &= gy_hs_activation_recv(t->hs, 0, prev, buf, in) == GY_OK && holds(buf, in, in_key);
        }
        soak_pause(&rng);
    }
    return NULL;
}

static uint32_t soak_mig_key(int32_t from, int32_t to, int32_t k) {
    return 100000u + 1000u * (uint32_t)from + 100u * (uint32_t)to + (uint32_t)k;
}

static void *soak_migration_send(void *p) {
    soak_thread *t = p;
    uint8_t buf[700];
    unsigned rng = t->seed ^ 0x1234u ^ (unsigned)(t->worker * 16 + t->peer);
    t->ok = 1;
    for (int32_t k = 0; k < t->rounds; k++) {
        const int64_t n = soak_bytes(t->seed, 1 + (uint32_t)t->worker, (uint32_t)t->peer, (uint32_t)k);
        fill(buf, n, soak_mig_key(t->worker, t->peer, k));
        t->ok &= gy_hs_migration_send(t->hs, t->worker, t->peer, buf, n) == GY_OK;
        soak_pause(&rng);
    }
    return NULL;
}

static void *soak_migration_recv(void *p) {
    soak_thread *t = p;
    uint8_t buf[700];
    unsigned rng = t->seed ^ 0x5678u ^ (unsigned)(t->worker * 16 + t->peer);
    t->ok = 1;
    for (int32_t k = 0; k < t->rounds; k++) {
        const int64_t n = soak_bytes(t->seed, 1 + (uint32_t)t->peer, (uint32_t)t->worker, (uint32_t)k);
        t->ok &= gy_hs_migration_recv(t->hs, t->worker, t->peer, buf, n) == GY_OK &&
                 holds(buf, n, soak_mig_key(t->peer, t->worker, k));
        soak_pause(&rng);
    }
    return NULL;
}

/* 2 and 3 workers, several seeds: every transfer arrives with its bytes, no call times out. */
GYTEST(handshake_threads_soak_both_groups_every_direction) {
    const int32_t rounds = 40, migrations = 15;
    for (int32_t n = 2; n <= 3; n++) {
        for (uint32_t seed = 1; seed <= 3; seed++) {
            gy_hs_config config = {.n_workers = n, .two_phase = 1, .timeout_ms = 10000, .tau_ms = 1};
            gy_hs *hs = NULL;
            CHECK_OK(gy_hs_init(&hs, &config));
            soak_thread t[3 + 2 * 6];
            pthread_t th[3 + 2 * 6];
            int m = 0;
            for (int32_t w = 0; w < n; w++) {
                t[m] = (soak_thread){hs, n, w, -1, rounds, seed, 0};
                pthread_create(&th[m], NULL, soak_inference, &t[m]);
                m++;
            }
            for (int32_t from = 0; from < n; from++)
                for (int32_t to = 0; to < n; to++) {
                    if (from == to) continue;
                    t[m] = (soak_thread){hs, n, from, to, migrations, seed, 0};
                    pthread_create(&th[m], NULL, soak_migration_send, &t[m]);
                    m++;
                    t[m] = (soak_thread){hs, n, to, from, migrations, seed, 0};
                    pthread_create(&th[m], NULL, soak_migration_recv, &t[m]);
                    m++;
                }
            int ok = 1;
            for (int i = 0; i < m; i++) {
                pthread_join(th[i], NULL);
                ok &= t[i].ok;
            }
            CHECK(ok);
            gy_hs_stats s;
            gy_hs_stats_get(hs, &s);
            CHECK(s.timeouts == 0);
            CHECK(s.activations == (uint64_t)(n * rounds));
            CHECK(s.migrations == (uint64_t)(n * (n - 1) * migrations));
            CHECK(s.acks == s.migrations + s.rejects + s.unanswered);
            for (int32_t w = 0; w < n; w++) CHECK(gy_dev_lock_holder(gy_hs_dev_lock(hs, w)) == NULL);
            gy_hs_free(hs);
        }
    }
}

/* ---- refusals ---- */

static int message_has(const char *what) { return strstr(gy_error_message(), what) != NULL; }

GYTEST(handshake_refuses_bad_configs_and_calls) {
    gy_hs_config good = {.n_workers = 2, .two_phase = 1, .timeout_ms = 100, .tau_ms = 1};
    gy_hs *hs = (gy_hs *)&good; /* must come back NULL */
    CHECK_STATUS(gy_hs_init(NULL, &good), GY_ERR_INVALID);
    CHECK(message_has("out"));
    CHECK_STATUS(gy_hs_init(&hs, NULL), GY_ERR_INVALID);
    CHECK(hs == NULL && message_has("config"));
    struct { gy_hs_config c; const char *names; } bad[] = {
        {{.n_workers = 1, .timeout_ms = 100, .tau_ms = 1}, "n_workers"},
        {{.n_workers = GY_HS_MAX_WORKERS + 1, .timeout_ms = 100, .tau_ms = 1}, "n_workers"},
        {{.n_workers = 2, .two_phase = 2, .timeout_ms = 100, .tau_ms = 1}, "two_phase"},
        {{.n_workers = 2, .timeout_ms = 0, .tau_ms = 1}, "timeout_ms 0"},
        {{.n_workers = 2, .timeout_ms = GY_HS_MAX_TIMEOUT_MS + 1, .tau_ms = 1}, "timeout_ms"},
        {{.n_workers = 2, .timeout_ms = 100, .tau_ms = 0}, "tau_ms"},
        {{.n_workers = 2, .timeout_ms = 100, .tau_ms = 101}, "tau_ms"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        hs = (gy_hs *)&good;
        CHECK_STATUS(gy_hs_init(&hs, &bad[i].c), GY_ERR_INVALID);
        CHECK(hs == NULL && message_has(bad[i].names));
    }

    CHECK_OK(gy_hs_init(&hs, &good));
    CHECK(gy_hs_size(hs) == 2 && gy_hs_size(NULL) == 0);
    CHECK(gy_hs_dev_lock(hs, 2) == NULL && gy_hs_dev_lock(hs, -1) == NULL && gy_hs_dev_lock(NULL, 0) == NULL);
    uint8_t buf[4] = {0};
    CHECK_STATUS(gy_hs_activation_send(NULL, 0, 1, buf, 4), GY_ERR_INVALID);
    CHECK(message_has("hs"));
    CHECK_STATUS(gy_hs_activation_recv(hs, -1, 1, buf, 4), GY_ERR_INVALID);
    CHECK(message_has("worker -1"));
    CHECK_STATUS(gy_hs_migration_send(hs, 0, 2, buf, 4), GY_ERR_INVALID);
    CHECK(message_has("peer 2"));
    CHECK_STATUS(gy_hs_migration_recv(hs, 1, 1, buf, 4), GY_ERR_INVALID);
    CHECK(message_has("peer 1 is the worker"));
    CHECK_STATUS(gy_hs_migration_send(hs, 0, 1, buf, -1), GY_ERR_INVALID);
    CHECK(message_has("bytes -1"));
    CHECK_STATUS(gy_hs_activation_send(hs, 0, 1, NULL, 4), GY_ERR_INVALID);
    CHECK(message_has("buf is NULL"));
    gy_hs_stats s;
    gy_hs_stats_get(hs, &s);
    CHECK(s.acks == 0 && s.timeouts == 0);
    gy_hs_stats_get(hs, NULL);
    gy_hs_stats_get(NULL, &s);
    CHECK(s.activations == 0);
    gy_hs_stats_reset(NULL);
    /* Alone, a call gives up at its deadline (100 ms) and leaves nothing held. */
    CHECK_STATUS(gy_hs_migration_send(hs, 0, 1, NULL, 0), GY_ERR_BUSY);
    CHECK(message_has("not accepted within 100 ms"));
    CHECK_STATUS(gy_hs_activation_recv(hs, 1, 0, buf, 4), GY_ERR_BUSY);
    CHECK(message_has("did not send"));
    CHECK(gy_dev_lock_holder(gy_hs_dev_lock(hs, 0)) == NULL && gy_dev_lock_holder(gy_hs_dev_lock(hs, 1)) == NULL);
    gy_hs_stats_get(hs, &s);
    CHECK(s.timeouts == 2 && s.unanswered >= 1 && s.rejects == 0);
    gy_hs_free(hs);
    gy_hs_free(NULL);

    /* Every allocation of init fails once in turn: refused, nothing left (ASan's leak check). */
    gy_fault_arm(GY_FAULT_ALLOC, 0);
    CHECK_OK(gy_hs_init(&hs, &good));
    const int64_t events = gy_fault_count(GY_FAULT_ALLOC);
    gy_fault_disarm_all();
    gy_hs_free(hs);
    CHECK(events == 3 + 2); /* the group, its locks and pairs, a device lock each */
    for (int64_t e = 1; e <= events + 1; e++) {
        gy_fault_arm(GY_FAULT_ALLOC, e);
        const gy_status st = gy_hs_init(&hs, &good);
        gy_fault_disarm_all();
        CHECK(e <= events ? st == GY_ERR_SYSTEM && hs == NULL : st == GY_OK);
        gy_hs_free(hs);
    }
}

GYTEST(handshake_dev_lock_refusals_and_holder) {
    gy_dev_lock *lock = NULL;
    CHECK_STATUS(gy_dev_lock_init(NULL), GY_ERR_INVALID);
    CHECK_OK(gy_dev_lock_init(&lock));
    CHECK_STATUS(gy_dev_lock_acquire(NULL, "x", 0), GY_ERR_INVALID);
    CHECK(message_has("lock is NULL"));
    CHECK_STATUS(gy_dev_lock_acquire(lock, NULL, 0), GY_ERR_INVALID);
    CHECK(message_has("who is NULL"));
    CHECK_STATUS(gy_dev_lock_acquire(lock, "x", -1), GY_ERR_INVALID);
    CHECK(message_has("timeout_ms -1"));
    CHECK_STATUS(gy_dev_lock_acquire(lock, "x", GY_HS_MAX_TIMEOUT_MS + 1), GY_ERR_INVALID);
    CHECK_STATUS(gy_dev_lock_try(NULL, "x"), GY_ERR_INVALID);
    CHECK_STATUS(gy_dev_lock_try(lock, NULL), GY_ERR_INVALID);
    CHECK(gy_dev_lock_holder(lock) == NULL && gy_dev_lock_holder(NULL) == NULL);
    CHECK_OK(gy_dev_lock_acquire(lock, "an all-reduce", 0));
    CHECK(strcmp(gy_dev_lock_holder(lock), "an all-reduce") == 0);
    CHECK_STATUS(gy_dev_lock_try(lock, "a recv"), GY_ERR_BUSY);
    CHECK(message_has("held by an all-reduce"));
    CHECK_STATUS(gy_dev_lock_acquire(lock, "a send", 20), GY_ERR_BUSY);
    CHECK(message_has("wanted by a send still held by an all-reduce after 20 ms"));
    gy_dev_lock_release(lock);
    gy_dev_lock_release(lock); /* free already: nothing */
    gy_dev_lock_release(NULL);
    CHECK_OK(gy_dev_lock_try(lock, "a recv"));
    gy_dev_lock_release(lock);
    CHECK(gy_dev_lock_holder(lock) == NULL);
    gy_dev_lock_free(lock);
    gy_dev_lock_free(NULL);
}

/* Refusals that need a peer: sizes that differ refuse both sides and move nothing; a second send
 * on a pair and group while one is in flight is refused; a refused call leaves the first one
 * going. */
GYTEST(handshake_threads_size_mismatch_and_second_call_refused) {
    for (int32_t two_phase = 0; two_phase <= 1; two_phase++) {
        gy_hs_config config = {.n_workers = 3, .two_phase = two_phase, .timeout_ms = 2000, .tau_ms = 2};
        gy_hs *hs = NULL;
        CHECK_OK(gy_hs_init(&hs, &config));
        uint8_t out[16], in[16];
        fill(out, 16, 9);
        memset(in, 0xAB, sizeof in);
        hs_call send = {hs, two_phase ? GY_HS_MIGRATION_SEND : GY_HS_ACTIVATION_SEND, 2, 0, out, 16, GY_OK, ""};
        pthread_t t;
        pthread_create(&t, NULL, hs_call_run, &send);
        const gy_status st = two_phase ? gy_hs_migration_recv(hs, 0, 2, in, 8)
                                       : gy_hs_activation_recv(hs, 0, 2, in, 8);
        CHECK(st == GY_ERR_INVALID && message_has("expects 8 bytes, the sender has 16"));
        pthread_join(t, NULL);
        CHECK(send.status == GY_ERR_INVALID && strstr(send.message, "receiver expects 8") != NULL);
        for (int i = 0; i < 16; i++) CHECK(in[i] == 0xAB);

        /* The first send waits for its receiver; a second on the same pair and group is refused. */
        send.status = GY_ERR_STATE;
        pthread_create(&t, NULL, hs_call_run, &send);
        const struct timespec ms = {0, 1000000};
        for (int i = 0; i < 2000 && gy_dev_lock_holder(gy_hs_dev_lock(hs, 2)) == NULL; i++) nanosleep(&ms, NULL);
        /* in flight from the first hold until its receiver comes, holding the lock or not */
        CHECK_STATUS(two_phase ? gy_hs_migration_send(hs, 2, 0, out, 16) : gy_hs_activation_send(hs, 2, 0, out, 16),
                     GY_ERR_STATE);
        CHECK(message_has("already in flight"));
        CHECK_OK(two_phase ? gy_hs_migration_recv(hs, 0, 2, in, 16) : gy_hs_activation_recv(hs, 0, 2, in, 16));
        pthread_join(t, NULL);
        CHECK_CALL(send, GY_OK);
        CHECK(holds(in, 16, 9));
        gy_hs_free(hs);
    }
}
