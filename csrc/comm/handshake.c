/* handshake.c: the device lock and PipeLive's two-phase entry for migrations (handshake.h).
 *
 * One mutex (gy_hs.mu) guards every pair's side channel and transfer slots and the stats; each
 * device lock has its own. The only nesting is gy_hs.mu, then a device lock's mutex (a receiver's
 * try on an ACK, so that taking the ACK, trying the lock and answering are one step and a sender
 * never sees an ACK taken but unanswered); a wait for a device lock holds no other mutex. Every
 * timed wait runs on the monotonic clock, so a change of the wall clock cannot stretch or cut a
 * deadline. */
#include "handshake.h"

#include <errno.h>
#include <pthread.h>
#include <string.h>
#include <time.h>

#include "../core/alloc.h"

/* ---- time ---- */

static struct timespec gy_hs_after_ns(int64_t ns) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    t.tv_sec += (time_t)(ns / 1000000000);
    t.tv_nsec += (long)(ns % 1000000000);
    if (t.tv_nsec >= 1000000000L) {
        t.tv_sec++;
        t.tv_nsec -= 1000000000L;
    }
    return t;
}

static struct timespec gy_hs_after_ms(int64_t ms) { return gy_hs_after_ns(ms * 1000000); }

static int gy_hs_earlier(const struct timespec *a, const struct timespec *b) {
    return a->tv_sec < b->tv_sec || (a->tv_sec == b->tv_sec && a->tv_nsec < b->tv_nsec);
}

static int gy_hs_cond_init(pthread_cond_t *cond) {
    pthread_condattr_t attr;
    if (pthread_condattr_init(&attr) != 0) return -1;
    int rc = pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    if (rc == 0) rc = pthread_cond_init(cond, &attr);
    pthread_condattr_destroy(&attr);
    return rc;
}

/* 1 when the wait ended at the deadline. Any error counts as the deadline, so that a caller's
 * loop can never spin on a wait that keeps failing. */
static int gy_hs_wait(pthread_cond_t *cond, pthread_mutex_t *mu, const struct timespec *deadline) {
    return pthread_cond_timedwait(cond, mu, deadline) != 0;
}

/* ---- the device lock ---- */

struct gy_dev_lock {
    pthread_mutex_t mu;
    pthread_cond_t freed;
    const char *holder; /* NULL: free */
};

gy_status gy_dev_lock_init(gy_dev_lock **out) {
    if (out == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_dev_lock_init: out is NULL");
    *out = NULL;
    gy_dev_lock *lock = gy_calloc(1, sizeof *lock);
    if (lock == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for a device lock");
    if (pthread_mutex_init(&lock->mu, NULL) != 0) {
        free(lock);
        return GY_FAIL(GY_ERR_SYSTEM, "pthread_mutex_init failed for a device lock");
    }
    if (gy_hs_cond_init(&lock->freed) != 0) {
        pthread_mutex_destroy(&lock->mu);
        free(lock);
        return GY_FAIL(GY_ERR_SYSTEM, "pthread_cond_init failed for a device lock");
    }
    *out = lock;
    return GY_OK;
}

void gy_dev_lock_free(gy_dev_lock *lock) {
    if (lock == NULL) return;
    pthread_cond_destroy(&lock->freed);
    pthread_mutex_destroy(&lock->mu);
    free(lock);
}

/* GY_OK taken; GY_ERR_BUSY at the deadline, with the holder then in *blocker (no message: the
 * caller knows what it was doing). */
static gy_status gy_dev_lock_acquire_until(gy_dev_lock *lock, const char *who,
                                           const struct timespec *deadline, const char **blocker) {
    pthread_mutex_lock(&lock->mu);
    while (lock->holder != NULL) {
        if (gy_hs_wait(&lock->freed, &lock->mu, deadline) && lock->holder != NULL) {
            *blocker = lock->holder;
            pthread_mutex_unlock(&lock->mu);
            return GY_ERR_BUSY;
        }
    }
    lock->holder = who;
    pthread_mutex_unlock(&lock->mu);
    return GY_OK;
}

static int gy_dev_lock_try_(gy_dev_lock *lock, const char *who) {
    pthread_mutex_lock(&lock->mu);
    const int taken = lock->holder == NULL;
    if (taken) lock->holder = who;
    pthread_mutex_unlock(&lock->mu);
    return taken;
}

gy_status gy_dev_lock_acquire(gy_dev_lock *lock, const char *who, int64_t timeout_ms) {
    if (lock == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_dev_lock_acquire: lock is NULL");
    if (who == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_dev_lock_acquire: who is NULL");
    if (timeout_ms < 0 || timeout_ms > GY_HS_MAX_TIMEOUT_MS)
        return GY_FAIL(GY_ERR_INVALID, "gy_dev_lock_acquire: timeout_ms %lld outside [0, %lld]",
                       (long long)timeout_ms, (long long)GY_HS_MAX_TIMEOUT_MS);
    const struct timespec deadline = gy_hs_after_ms(timeout_ms);
    const char *blocker = NULL;
    if (gy_dev_lock_acquire_until(lock, who, &deadline, &blocker) != GY_OK)
        return GY_FAIL(GY_ERR_BUSY, "device lock wanted by %s still held by %s after %lld ms", who,
                       blocker, (long long)timeout_ms);
    return GY_OK;
}

gy_status gy_dev_lock_try(gy_dev_lock *lock, const char *who) {
    if (lock == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_dev_lock_try: lock is NULL");
    if (who == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_dev_lock_try: who is NULL");
    if (!gy_dev_lock_try_(lock, who)) {
        const char *holder = gy_dev_lock_holder(lock);
        return GY_FAIL(GY_ERR_BUSY, "device lock wanted by %s is held by %s", who,
                       holder ? holder : "someone who just let go");
    }
    return GY_OK;
}

void gy_dev_lock_release(gy_dev_lock *lock) {
    if (lock == NULL) return;
    pthread_mutex_lock(&lock->mu);
    lock->holder = NULL;
    pthread_cond_signal(&lock->freed); /* one waiter can take it; the others would wait again */
    pthread_mutex_unlock(&lock->mu);
}

const char *gy_dev_lock_holder(gy_dev_lock *lock) {
    if (lock == NULL) return NULL;
    pthread_mutex_lock(&lock->mu);
    const char *holder = lock->holder;
    pthread_mutex_unlock(&lock->mu);
    return holder;
}

/* ---- workers, side channels and transfer slots ---- */

enum { GY_HS_GROUP_ACTIVATION = 0, GY_HS_GROUP_MIGRATION = 1, GY_HS_GROUP_COUNT };
enum { GY_HS_ANSWER_NONE = 0, GY_HS_ANSWER_ACCEPT = 1, GY_HS_ANSWER_REJECT = 2 };

/* One direction of one communicator group between two workers: a rendezvous of one send and one
 * receive, each made while its side holds its own device lock. */
typedef struct gy_hs_slot {
    int32_t sending, receiving; /* a call of that side is in flight (one at a time) */
    int32_t posted;             /* the sender offers buf until the receiver takes it */
    const void *buf;
    int64_t bytes;
    int32_t taken;              /* the receiver answered the offer: result, and want on refusal */
    gy_status result;
    int64_t want;
} gy_hs_slot;

/* Everything from one worker to another. The side channel needs one message each way: a pair has
 * at most one migration send in flight, so at most one ACK and one answer. */
typedef struct gy_hs_pair {
    gy_hs_slot slot[GY_HS_GROUP_COUNT];
    int32_t ack;    /* sender -> receiver: the sender holds its lock and asks to enter */
    int32_t answer; /* receiver -> sender: GY_HS_ANSWER_* */
} gy_hs_pair;

struct gy_hs {
    gy_hs_config config;
    gy_dev_lock **locks; /* [n_workers] */
    gy_hs_pair *pairs;   /* [n_workers * n_workers], from * n_workers + to */
    pthread_mutex_t mu;
    pthread_cond_t changed; /* any slot or side channel changed */
    int32_t mu_ready, changed_ready;
    gy_hs_stats stats;
    uint64_t rng;           /* back-off jitter (xorshift64) */
};

static const char *const gy_hs_op_names[GY_HS_OP_COUNT] = {
    "activation send", "activation recv", "migration send", "migration recv"};
/* Who holds a device lock, as gy_dev_lock_holder and the messages of those waiting show it. */
static const char *const gy_hs_holders[GY_HS_OP_COUNT] = {
    "an activation send", "an activation recv", "a migration send", "a migration recv"};

void gy_hs_free(gy_hs *hs) {
    if (hs == NULL) return;
    if (hs->locks != NULL)
        for (int32_t w = 0; w < hs->config.n_workers; w++) gy_dev_lock_free(hs->locks[w]);
    free(hs->locks);
    free(hs->pairs);
    if (hs->changed_ready) pthread_cond_destroy(&hs->changed);
    if (hs->mu_ready) pthread_mutex_destroy(&hs->mu);
    free(hs);
}

gy_status gy_hs_init(gy_hs **out, const gy_hs_config *config) {
    if (out == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_hs_init: out is NULL");
    *out = NULL;
    if (config == NULL) return GY_FAIL(GY_ERR_INVALID, "gy_hs_init: config is NULL");
    const int32_t n = config->n_workers;
    if (n < 2 || n > GY_HS_MAX_WORKERS)
        return GY_FAIL(GY_ERR_INVALID, "gy_hs_init: n_workers %d outside [2, %d]", (int)n,
                       GY_HS_MAX_WORKERS);
    if (config->two_phase != 0 && config->two_phase != 1)
        return GY_FAIL(GY_ERR_INVALID, "gy_hs_init: two_phase %d is neither 0 nor 1",
                       (int)config->two_phase);
    if (config->timeout_ms < 1 || config->timeout_ms > GY_HS_MAX_TIMEOUT_MS)
        return GY_FAIL(GY_ERR_INVALID, "gy_hs_init: timeout_ms %lld outside [1, %lld]",
                       (long long)config->timeout_ms, (long long)GY_HS_MAX_TIMEOUT_MS);
    /* tau 0 would withdraw every ACK before the receiver could answer it */
    if (config->tau_ms < 1 || config->tau_ms > config->timeout_ms)
        return GY_FAIL(GY_ERR_INVALID, "gy_hs_init: tau_ms %lld outside [1, timeout_ms %lld]",
                       (long long)config->tau_ms, (long long)config->timeout_ms);
    gy_hs *hs = gy_calloc(1, sizeof *hs);
    if (hs == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for a handshake group");
    hs->config = *config;
    hs->rng = 0x9E3779B97F4A7C15ull;
    hs->locks = gy_calloc((size_t)n, sizeof *hs->locks);
    hs->pairs = gy_calloc((size_t)n * (size_t)n, sizeof *hs->pairs);
    if (hs->locks == NULL || hs->pairs == NULL) {
        gy_hs_free(hs);
        return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for a handshake group of %d workers", (int)n);
    }
    hs->mu_ready = pthread_mutex_init(&hs->mu, NULL) == 0;
    hs->changed_ready = hs->mu_ready && gy_hs_cond_init(&hs->changed) == 0;
    if (!hs->changed_ready) {
        gy_hs_free(hs);
        return GY_FAIL(GY_ERR_SYSTEM, "pthread_mutex_init or pthread_cond_init failed for a handshake group");
    }
    for (int32_t w = 0; w < n; w++) {
        gy_status st = gy_dev_lock_init(&hs->locks[w]);
        if (st != GY_OK) {
            gy_hs_free(hs);
            return st;
        }
    }
    *out = hs;
    return GY_OK;
}

int32_t gy_hs_size(const gy_hs *hs) { return hs ? hs->config.n_workers : 0; }

gy_dev_lock *gy_hs_dev_lock(gy_hs *hs, int32_t worker) {
    if (hs == NULL || worker < 0 || worker >= hs->config.n_workers) return NULL;
    return hs->locks[worker];
}

static gy_hs_pair *gy_hs_pair_of(gy_hs *hs, int32_t from, int32_t to) {
    return &hs->pairs[from * hs->config.n_workers + to];
}

static void gy_hs_count_timeout(gy_hs *hs) {
    pthread_mutex_lock(&hs->mu);
    hs->stats.timeouts++;
    pthread_mutex_unlock(&hs->mu);
}

static void gy_hs_held(gy_hs *hs, int32_t worker, gy_hs_op op) {
    if (hs->config.on_hold) hs->config.on_hold(hs->config.on_hold_ctx, worker, op);
}

/* Takes the worker's device lock directly, waiting as long as the deadline allows: activations
 * always, migrations in naive mode. */
static gy_status gy_hs_enter_direct(gy_hs *hs, gy_hs_op op, int32_t worker, int32_t peer,
                                    const struct timespec *deadline) {
    const char *blocker = NULL;
    if (gy_dev_lock_acquire_until(hs->locks[worker], gy_hs_holders[op], deadline, &blocker) != GY_OK) {
        gy_hs_count_timeout(hs);
        return GY_FAIL(GY_ERR_BUSY,
                       "%s of worker %d (peer %d) timed out after %lld ms waiting for its device "
                       "lock, held by %s (deadlock?)",
                       gy_hs_op_names[op], (int)worker, (int)peer,
                       (long long)hs->config.timeout_ms, blocker);
    }
    gy_hs_held(hs, worker, op);
    return GY_OK;
}

/* Phases one and two on the sender's side: holds its own lock and ACKs until an ACCEPT (then
 * returns holding it) or the deadline (then holds nothing). */
static gy_status gy_hs_enter_send(gy_hs *hs, int32_t worker, int32_t peer,
                                  const struct timespec *deadline) {
    gy_hs_pair *p = gy_hs_pair_of(hs, worker, peer);
    const int64_t tau_ns = hs->config.tau_ms * 1000000;
    for (int64_t attempt = 0;; attempt++) {
        GY_TRY(gy_hs_enter_direct(hs, GY_HS_MIGRATION_SEND, worker, peer, deadline));
        pthread_mutex_lock(&hs->mu);
        if (attempt > 0) hs->stats.retries++;
        hs->stats.acks++;
        p->ack = 1;
        p->answer = GY_HS_ANSWER_NONE;
        pthread_cond_broadcast(&hs->changed);
        struct timespec answer_by = gy_hs_after_ns(tau_ns);
        if (gy_hs_earlier(deadline, &answer_by)) answer_by = *deadline;
        while (p->answer == GY_HS_ANSWER_NONE) {
            if (gy_hs_wait(&hs->changed, &hs->mu, &answer_by) && p->answer == GY_HS_ANSWER_NONE) {
                p->ack = 0; /* withdrawn: the receiver has not called, and the lock is wanted */
                hs->stats.unanswered++;
                break;
            }
        }
        const int32_t answer = p->answer;
        p->answer = GY_HS_ANSWER_NONE;
        if (answer == GY_HS_ANSWER_ACCEPT) {
            pthread_mutex_unlock(&hs->mu);
            return GY_OK;
        }
        if (answer == GY_HS_ANSWER_REJECT) hs->stats.rejects++;
        hs->rng ^= hs->rng << 13;
        hs->rng ^= hs->rng >> 7;
        hs->rng ^= hs->rng << 17;
        const int64_t backoff_ns = tau_ns + (int64_t)(hs->rng % (uint64_t)tau_ns);
        pthread_mutex_unlock(&hs->mu);
        gy_dev_lock_release(hs->locks[worker]);
        struct timespec until = gy_hs_after_ns(backoff_ns);
        if (!gy_hs_earlier(&until, deadline)) {
            gy_hs_count_timeout(hs);
            return GY_FAIL(GY_ERR_BUSY,
                           "migration send from worker %d to %d not accepted within %lld ms "
                           "(%lld attempts, each rejected or unanswered)",
                           (int)worker, (int)peer, (long long)hs->config.timeout_ms,
                           (long long)attempt + 1);
        }
        while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &until, NULL) == EINTR) {
        }
    }
}

/* Phase two on the receiver's side: answers each ACK from the peer with a try of its own lock,
 * never waiting for it; returns holding it after an ACCEPT, or at the deadline holding nothing. */
static gy_status gy_hs_enter_recv(gy_hs *hs, int32_t worker, int32_t peer,
                                  const struct timespec *deadline) {
    gy_hs_pair *p = gy_hs_pair_of(hs, peer, worker);
    pthread_mutex_lock(&hs->mu);
    for (;;) {
        while (!p->ack) {
            if (gy_hs_wait(&hs->changed, &hs->mu, deadline) && !p->ack) {
                hs->stats.timeouts++;
                pthread_mutex_unlock(&hs->mu);
                return GY_FAIL(GY_ERR_BUSY,
                               "migration recv of worker %d from %d timed out after %lld ms "
                               "without an ACK it could accept",
                               (int)worker, (int)peer, (long long)hs->config.timeout_ms);
            }
        }
        p->ack = 0;
        const int taken = gy_dev_lock_try_(hs->locks[worker], gy_hs_holders[GY_HS_MIGRATION_RECV]);
        p->answer = taken ? GY_HS_ANSWER_ACCEPT : GY_HS_ANSWER_REJECT;
        pthread_cond_broadcast(&hs->changed);
        if (taken) break;
    }
    pthread_mutex_unlock(&hs->mu);
    gy_hs_held(hs, worker, GY_HS_MIGRATION_RECV);
    return GY_OK;
}

/* The sender's half of a transfer, its device lock held: offers buf until the receiver (its own
 * lock held) has copied or refused it, or the deadline, when the offer is withdrawn. */
static gy_status gy_hs_slot_send(gy_hs *hs, gy_hs_op op, int32_t worker, int32_t peer,
                                 gy_hs_slot *s, const void *buf, int64_t bytes,
                                 const struct timespec *deadline) {
    pthread_mutex_lock(&hs->mu);
    s->buf = buf;
    s->bytes = bytes;
    s->posted = 1;
    s->taken = 0;
    pthread_cond_broadcast(&hs->changed);
    while (!s->taken) {
        if (gy_hs_wait(&hs->changed, &hs->mu, deadline) && !s->taken) {
            s->posted = 0;
            s->buf = NULL;
            hs->stats.timeouts++;
            pthread_mutex_unlock(&hs->mu);
            return GY_FAIL(GY_ERR_BUSY,
                           "%s from worker %d to %d timed out after %lld ms: worker %d did not "
                           "receive (deadlock?)",
                           gy_hs_op_names[op], (int)worker, (int)peer,
                           (long long)hs->config.timeout_ms, (int)peer);
        }
    }
    s->taken = 0;
    const gy_status result = s->result;
    const int64_t want = s->want;
    pthread_mutex_unlock(&hs->mu);
    if (result != GY_OK)
        return GY_FAIL(result, "%s from worker %d to %d of %lld bytes refused: the receiver expects %lld",
                       gy_hs_op_names[op], (int)worker, (int)peer, (long long)bytes, (long long)want);
    return GY_OK;
}

/* The receiver's half, its device lock held: waits for the offer and copies it (both locks are
 * held, so this is the transfer; under the group's mutex, so a sender giving up at its deadline
 * cannot withdraw the buffer half-way). */
static gy_status gy_hs_slot_recv(gy_hs *hs, gy_hs_op op, int32_t worker, int32_t peer,
                                 gy_hs_slot *s, void *buf, int64_t bytes,
                                 const struct timespec *deadline) {
    pthread_mutex_lock(&hs->mu);
    while (!s->posted) {
        if (gy_hs_wait(&hs->changed, &hs->mu, deadline) && !s->posted) {
            hs->stats.timeouts++;
            pthread_mutex_unlock(&hs->mu);
            return GY_FAIL(GY_ERR_BUSY,
                           "%s of worker %d from %d timed out after %lld ms: worker %d did not "
                           "send (deadlock?)",
                           gy_hs_op_names[op], (int)worker, (int)peer,
                           (long long)hs->config.timeout_ms, (int)peer);
        }
    }
    const int64_t sent = s->bytes;
    if (sent == bytes) {
        if (bytes > 0) memcpy(buf, s->buf, (size_t)bytes);
        s->result = GY_OK;
        if (op == GY_HS_ACTIVATION_RECV)
            hs->stats.activations++;
        else
            hs->stats.migrations++;
        hs->stats.bytes += (uint64_t)bytes;
    } else {
        s->result = GY_ERR_INVALID;
        s->want = bytes;
    }
    s->posted = 0;
    s->buf = NULL;
    s->taken = 1;
    pthread_cond_broadcast(&hs->changed);
    pthread_mutex_unlock(&hs->mu);
    if (sent != bytes)
        return GY_FAIL(GY_ERR_INVALID, "%s of worker %d from %d expects %lld bytes, the sender has %lld",
                       gy_hs_op_names[op], (int)worker, (int)peer, (long long)bytes, (long long)sent);
    return GY_OK;
}

static gy_status gy_hs_call(gy_hs *hs, gy_hs_op op, int32_t worker, int32_t peer, void *buf,
                            int64_t bytes) {
    const char *name = gy_hs_op_names[op];
    if (hs == NULL) return GY_FAIL(GY_ERR_INVALID, "%s: hs is NULL", name);
    const int32_t n = hs->config.n_workers;
    if (worker < 0 || worker >= n)
        return GY_FAIL(GY_ERR_INVALID, "%s: worker %d outside [0, %d)", name, (int)worker, (int)n);
    if (peer < 0 || peer >= n)
        return GY_FAIL(GY_ERR_INVALID, "%s: peer %d outside [0, %d)", name, (int)peer, (int)n);
    if (peer == worker)
        return GY_FAIL(GY_ERR_INVALID, "%s: peer %d is the worker itself", name, (int)peer);
    if (bytes < 0) return GY_FAIL(GY_ERR_INVALID, "%s: bytes %lld < 0", name, (long long)bytes);
    if (buf == NULL && bytes > 0)
        return GY_FAIL(GY_ERR_INVALID, "%s: buf is NULL for %lld bytes", name, (long long)bytes);

    const int sending = op == GY_HS_ACTIVATION_SEND || op == GY_HS_MIGRATION_SEND;
    const int group = op == GY_HS_MIGRATION_SEND || op == GY_HS_MIGRATION_RECV;
    gy_hs_slot *s = &gy_hs_pair_of(hs, sending ? worker : peer, sending ? peer : worker)->slot[group];
    pthread_mutex_lock(&hs->mu);
    int32_t *inside = sending ? &s->sending : &s->receiving;
    const int busy = *inside;
    *inside = 1;
    pthread_mutex_unlock(&hs->mu);
    if (busy)
        return GY_FAIL(GY_ERR_STATE, "%s between workers %d and %d: another is already in flight",
                       name, (int)worker, (int)peer);

    struct timespec deadline = gy_hs_after_ms(hs->config.timeout_ms);
    gy_status st;
    if (group == GY_HS_GROUP_ACTIVATION || !hs->config.two_phase) {
        st = gy_hs_enter_direct(hs, op, worker, peer, &deadline);
    } else {
        st = sending ? gy_hs_enter_send(hs, worker, peer, &deadline)
                     : gy_hs_enter_recv(hs, worker, peer, &deadline);
        /* After an ACCEPT both sides hold their locks for this transfer and nothing else can
         * stop it, so neither gives up on it at a deadline that came during the handshake
         * (which would leave the other holding its lock until its own). */
        deadline = gy_hs_after_ms(hs->config.timeout_ms);
    }
    if (st == GY_OK) {
        st = sending ? gy_hs_slot_send(hs, op, worker, peer, s, buf, bytes, &deadline)
                     : gy_hs_slot_recv(hs, op, worker, peer, s, buf, bytes, &deadline);
        gy_dev_lock_release(hs->locks[worker]);
    }
    pthread_mutex_lock(&hs->mu);
    *inside = 0;
    pthread_mutex_unlock(&hs->mu);
    return st;
}

gy_status gy_hs_activation_send(gy_hs *hs, int32_t worker, int32_t peer, const void *buf,
                                int64_t bytes) {
    return gy_hs_call(hs, GY_HS_ACTIVATION_SEND, worker, peer, (void *)buf, bytes);
}

gy_status gy_hs_activation_recv(gy_hs *hs, int32_t worker, int32_t peer, void *buf, int64_t bytes) {
    return gy_hs_call(hs, GY_HS_ACTIVATION_RECV, worker, peer, buf, bytes);
}

gy_status gy_hs_migration_send(gy_hs *hs, int32_t worker, int32_t peer, const void *buf,
                               int64_t bytes) {
    return gy_hs_call(hs, GY_HS_MIGRATION_SEND, worker, peer, (void *)buf, bytes);
}

gy_status gy_hs_migration_recv(gy_hs *hs, int32_t worker, int32_t peer, void *buf, int64_t bytes) {
    return gy_hs_call(hs, GY_HS_MIGRATION_RECV, worker, peer, buf, bytes);
}

void gy_hs_stats_get(gy_hs *hs, gy_hs_stats *out) {
    if (out == NULL) return;
    memset(out, 0, sizeof *out);
    if (hs == NULL) return;
    pthread_mutex_lock(&hs->mu);
    *out = hs->stats;
    pthread_mutex_unlock(&hs->mu);
}

void gy_hs_stats_reset(gy_hs *hs) {
    if (hs == NULL) return;
    pthread_mutex_lock(&hs->mu);
    memset(&hs->stats, 0, sizeof hs->stats);
    pthread_mutex_unlock(&hs->mu);
}
