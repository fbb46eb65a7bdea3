"""The batch scheduler (csrc/sched/batch.h) through gyges._C_test.Scheduler: long random runs
checked step by step against a pure-Python model of the same policy written here (same batches,
same preemptions, same finishes, same block accounting), plus invariants that do not trust the
model, submit-time refusals, the call protocol and a leak check."""
import bisect
import gc
import random

import pytest

from gyges import _C, _C_test


def cdiv(a, b):
    return -(-a // b)


class Req:
    def __init__(self, rid, prompt, max_new, arrival, priority, order):
        self.id, self.P, self.M = rid, prompt, max_new
        self.arrival, self.priority, self.order = arrival, priority, order
        self.G = self.C = self.E = 0
        self.state = "waiting"
        self.preemptions = 0

    def key(self):
        return (self.priority, self.arrival, self.order)


class Model:
    """The policy of batch.h, written from its comment, with lists instead of linked lists."""

    def __init__(self, total_blocks, block_size, max_batch_tokens, max_running,
                 max_prefill_chunk=0, watermark_blocks=0):
        self.total, self.bs = total_blocks, block_size
        self.budget_max, self.max_running = max_batch_tokens, max_running
        self.chunk_cap, self.watermark = max_prefill_chunk, watermark_blocks
        self.free = total_blocks
        self.held = {}            # id -> blocks
        self.reqs = {}
        self.running = []         # admission order
        self.preempted_q = []     # front first
        self.waiting_q = []       # sorted by key
        self.order = 0
        self.batch = None

    # the block counter
    def needed(self, r, n):
        return max(0, cdiv(n, self.bs) - self.held.get(r.id, 0))

    def reserve(self, r, n):
        need = self.needed(r, n)
        self.held[r.id] = self.held.get(r.id, 0) + need
        self.free -= need

    def release(self, r):
        self.free += self.held.pop(r.id, 0)

    def add(self, rid, prompt, max_new, arrival, priority):
        r = Req(rid, prompt, max_new, arrival, priority, self.order)
        self.order += 1
        self.reqs[rid] = r
        keys = [q.key() for q in self.waiting_q]
        self.waiting_q.insert(bisect.bisect_right(keys, r.key()), r)

    def chunk(self, remaining, budget):
        n = min(remaining, budget)
        return min(n, self.chunk_cap) if self.chunk_cap else n

    def schedule(self, now):
        budget = self.budget_max
        entries, preempted = [], []

        def preempt_newest():
            nonlocal budget
            v = self.running.pop()
            for e in entries:
                if e[0] == v.id:
                    entries.remove(e)
                    budget += e[2]
                    break
            self.release(v)
            v.C = v.E = 0
            v.preemptions += 1
            v.state = "preempted"
            self.preempted_q.insert(0, v)
            preempted.append(v.id)
            return v

        for decode in (True, False):
            i = 0
            while i < len(self.running) and budget > 0:
                r = self.running[i]
                i += 1
                if (r.C >= r.E) != decode:
                    continue
                n = 1 if decode else self.chunk(r.E - r.C, budget)
                while True:
                    if self.needed(r, r.C + n) <= self.free:
                        self.reserve(r, r.C + n)
                        samples = decode or r.C + n == r.E
                        entries.append((r.id, r.C, n, samples, r.G, not decode))
                        budget -= n
                        break
                    if preempt_newest() is r:
                        break
        if not preempted:
            self.admit(now, entries, budget)
        self.batch = entries
        return entries, preempted

    def admit(self, now, entries, budget):
        for q in (self.preempted_q, self.waiting_q):
            for r in list(q):
                if budget <= 0 or len(self.running) >= self.max_running:
                    return
                if r.arrival > now:
                    continue
                total = r.P + r.G
                n = self.chunk(total, budget)
                watermark = self.watermark if self.running else 0
                if self.needed(r, n) + watermark > self.free:
                    return
                self.reserve(r, n)
                q.remove(r)
                r.state, r.C, r.E = "running", 0, total
                self.running.append(r)
                entries.append((r.id, 0, n, n == total, r.G, True))
                budget -= n

    def finish(self, r):
        if r.state == "running":
            self.release(r)
            self.running.remove(r)
        elif r.state == "waiting":
            self.waiting_q.remove(r)
        elif r.state == "preempted":
            self.preempted_q.remove(r)
        r.state = "finished"

    def commit(self, stopped):
        done = []
        for rid, _, n, samples, _, _ in self.batch:
            r = self.reqs[rid]
            if r.state != "running":
                continue  # aborted meanwhile
            r.C += n
            if samples:
                r.G += 1
                if rid in stopped or r.G >= r.M:
                    self.finish(r)
                    done.append(rid)
        self.batch = None
        return done

    def abort(self, rid):
        self.finish(self.reqs[rid])

    def counts(self):
        c = {"waiting": 0, "preempted": 0, "running": 0, "finished": 0}
        for r in self.reqs.values():
            c[r.state] += 1
        return c


CONFIGS = [
    # total_blocks, block_size, max_batch_tokens, max_running, max_prefill_chunk, watermark
    dict(total_blocks=12, block_size=4, max_batch_tokens=16, max_running=6),
    dict(total_blocks=9, block_size=1, max_batch_tokens=5, max_running=4, max_prefill_chunk=2),
    dict(total_blocks=40, block_size=3, max_batch_tokens=64, max_running=16, max_prefill_chunk=7,
         watermark_blocks=2),
    dict(total_blocks=20, block_size=2, max_batch_tokens=48, max_running=5, watermark_blocks=12),
    dict(total_blocks=7, block_size=5, max_batch_tokens=2, max_running=3),
    dict(total_blocks=64, block_size=16, max_batch_tokens=256, max_running=8,
         max_prefill_chunk=64),
]


@pytest.mark.parametrize("ci", range(len(CONFIGS)))
def test_random_run_matches_model_and_invariants(ci):
    cfg = CONFIGS[ci]
    rng = random.Random(1000 + ci)
    sched = _C_test.Scheduler(**cfg)
    model = Model(**cfg)
    cap = cfg["total_blocks"] * cfg["block_size"]
    n_requests = 1000
    computed, sampled, decoding, ends = {}, {}, {}, {}
    prompts, max_news = {}, {}
    next_id, now, steps, preemptions = 0, 0.0, 0, 0
    while (next_id < n_requests or len(ends) < next_id) and steps < 20000:
        # arrivals, some announced ahead of their time and with priorities
        while next_id < n_requests and rng.random() < 0.3:
            rid = next_id * 7 - 50  # arbitrary, negative too
            prompt = rng.randint(1, max(1, cap // 2))
            max_new = rng.randint(1, max(1, cap - prompt))
            arrival = now + (rng.choice([0.0, 0.0, 0.0, 2.5]))
            priority = rng.choice([0, 0, 0, 1, -1])
            sched.add(rid, prompt, max_new, arrival, priority)
            model.add(rid, prompt, max_new, arrival, priority)
            prompts[rid], max_news[rid] = prompt, max_new
            computed[rid], sampled[rid], decoding[rid] = 0, 0, False
            next_id += 1
        entries, preempted = sched.schedule(now)
        expected = model.schedule(now)
        assert (entries, preempted) == expected, f"step {steps}"
        steps += 1
        preemptions += len(preempted)
        # invariants that do not trust the model
        assert sum(e[2] for e in entries) <= cfg["max_batch_tokens"]
        assert len({e[0] for e in entries}) == len(entries) <= cfg["max_running"]
        st = sched.stats()
        assert 0 <= st["free_blocks"] <= cfg["total_blocks"]
        assert st["running"] <= cfg["max_running"]
        assert st["free_blocks"] == model.free and st["holders"] == len(model.held)
        for rid in preempted:
            computed[rid] = 0  # recompute from scratch, as a prefill
            decoding[rid] = False
        for rid, pos, n, samples, index, is_prefill in entries:
            assert pos == computed[rid] and n >= 1
            assert index == sampled[rid]
            assert samples == (pos + n == prompts[rid] + sampled[rid])
            assert is_prefill == (not decoding[rid])
            if not is_prefill:
                assert n == 1 and pos == prompts[rid] + sampled[rid] - 1
        # the engine runs the step; some tokens are EOS; sometimes a request is aborted meanwhile
        stopped = {e[0] for e in entries if e[3] and rng.random() < 0.05}
        if rng.random() < 0.03:
            live = [rid for rid in computed if rid not in ends]
            if live:
                victim = rng.choice(live)
                sched.abort(victim)
                model.abort(victim)
                ends[victim] = "abort"
                stopped.discard(victim)
        now += rng.choice([0.5, 1.0, 1.5])
        finished = sched.commit(now, sorted(stopped))
        assert finished == model.commit(stopped)
        for rid, pos, n, samples, _, _ in entries:
            if ends.get(rid) == "abort":
                continue
            computed[rid] += n
            sampled[rid] += samples
            decoding[rid] = decoding[rid] or samples
        for rid in finished:
            assert rid not in ends, "finished twice"
            ends[rid] = "stop" if rid in stopped else "length"
        counts = model.counts()
        st = sched.stats()
        assert {k: st[k] for k in counts} == counts
        if steps % 97 == 0:  # blocks held add up, per request
            held = sum(sched.info(rid)["blocks_held"] for rid in computed)
            assert held == cfg["total_blocks"] - st["free_blocks"]
    assert len(ends) == n_requests, f"{n_requests - len(ends)} requests never finished"
    for rid in computed:
        info = sched.info(rid)
        assert info["state"] == "finished" and info["finish"] == ends[rid]
        assert info["n_generated"] == sampled[rid] <= max_news[rid]
        if ends[rid] == "length":
            assert sampled[rid] == max_news[rid]
        assert info["n_preemptions"] == model.reqs[rid].preemptions
        sched.forget(rid)
    st = sched.stats()
    assert st["free_blocks"] == cfg["total_blocks"] and st["holders"] == 0
    assert st["finished"] == 0 and st["preemptions"] == preemptions
    print(f"config {ci}: {steps} steps, {preemptions} preemptions")
    if ci in (0, 1, 4):
        assert preemptions > 0, "this configuration is meant to exercise preemption"


def test_same_inputs_same_batches():
    def run():
        s = _C_test.Scheduler(10, 2, 6, 3, 3)
        for i in range(12):
            s.add(i, 1 + (i * 5) % 9, 1 + (i * 3) % 7)
        out = []
        for t in range(200):
            b = s.schedule(float(t))
            out.append(b)
            s.commit(t + 0.5, [e[0] for e in b[0] if e[3] and e[0] % 5 == 0 and t % 4 == 0])
        return out, s.stats()
    assert run() == run()


def test_submit_time_refusals_are_value_errors_with_reasons():
    s = _C_test.Scheduler(10, 4, 8, 4)
    cases = [((1, 0, 5), "prompt length"), ((1, 5, 0), "max_new_tokens"),
             ((1, 30, 11), "can never fit"), ((1, -3, 5), "prompt length")]
    for args, words in cases:
        with pytest.raises(_C.InvalidArgumentError, match=words):
            s.add(*args)
    s.add(1, 30, 10)  # exactly 10 blocks
    with pytest.raises(ValueError, match="already in use"):
        s.add(1, 1, 1)
    with pytest.raises(ValueError, match="finite"):
        s.add(2, 1, 1, float("nan"))
    assert s.stats()["waiting"] == 1
    for bad in [(0, 4, 8, 4), (10, 0, 8, 4), (10, 4, 0, 4), (10, 4, 8, 0), (10, 4, 8, 4, -1),
                (10, 4, 8, 4, 0, 10)]:
        with pytest.raises(ValueError):
            _C_test.Scheduler(*bad)


def test_protocol_errors():
    s = _C_test.Scheduler(10, 4, 8, 4)
    with pytest.raises(_C.StateError, match="no step"):
        s.commit(0.0)
    s.add(1, 3, 2)
    s.add(2, 20, 2)
    entries, _ = s.schedule(1.0)
    assert entries == [(1, 0, 3, True, 0, True), (2, 0, 5, False, 0, True)]
    with pytest.raises(_C.StateError, match="commit"):
        s.schedule(1.0)
    with pytest.raises(ValueError, match="does not sample"):
        s.commit(2.0, [2])  # a prefill chunk that does not end the prompt
    with pytest.raises(ValueError, match="backwards"):
        s.commit(0.5)
    assert s.commit(2.0, [1]) == [1]
    info = s.info(1)
    assert info["finish"] == "stop" and info["first_token"] == 2.0 and info["finished_at"] == 2.0
    with pytest.raises(_C.StateError, match="already finished"):
        s.abort(1)
    with pytest.raises(ValueError, match="no request"):
        s.info(99)
    with pytest.raises(_C.StateError, match="only finished"):
        s.forget(2)
    s.forget(1)
    s.add(1, 2, 2)  # ids can be reused once forgotten


def test_abort_in_flight_is_ignored_at_commit():
    s = _C_test.Scheduler(20, 2, 8, 4)
    s.add(1, 4, 3)
    s.add(2, 4, 3)
    entries, _ = s.schedule(0.0)
    assert [e[0] for e in entries] == [1, 2]
    s.abort(2)
    assert s.info(2)["blocks_held"] == 0
    assert s.commit(1.0, [2]) == []  # its stop flag and tokens are dropped
    assert s.info(2)["finish"] == "abort" and s.info(2)["n_generated"] == 0
    assert s.info(1)["n_generated"] == 1


def test_no_leak_over_many_schedulers_and_steps():
    def rss_pages():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1])

    def churn():
        for _ in range(300):
            s = _C_test.Scheduler(32, 4, 32, 8, 8)
            for i in range(20):
                s.add(i, 1 + i % 13, 1 + i % 5)
            for t in range(30):
                entries, _ = s.schedule(float(t))
                s.commit(float(t), [])
            s.stats()
    churn()
    gc.collect()
    before = rss_pages()
    churn()
    gc.collect()
    grown = (rss_pages() - before) * 4096
    assert grown < 2 << 20, f"RSS grew by {grown} bytes over 300 schedulers"
