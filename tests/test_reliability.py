"""The reliability contract (README "Guarantees"): every public call succeeds or raises a
gyges.Error and leaves the object exactly as before; a failed step fails only the requests it
must and the engine serves on; abort finishes the handle; a host never loses an instance or a
request to a refused or failed transformation; engines and hosts are safe to call from several
threads; nothing leaks. Each test below reproduces one way the contract used to break (issue 12,
"What was found", numbered as there) or sweeps injected faults over a whole operation."""
import gc
import os
import time
import warnings
import weakref

import numpy as np
import pytest

import gyges
from gyges import testing
from gyges.models.config import ModelConfig
from gyges.reconfig.recovery import RecoveryWarning

MEMORY = "48MiB"
PARAMS = gyges.SamplingParams(max_tokens=6, ignore_eos=True)
SAMPLED = gyges.SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)


VOCAB = 512


@pytest.fixture(scope="module")
def tiny():
    """A smaller cousin of Model.tiny() (the same 4 layers and shapes of TP groups, a quarter of
    the width): these tests serve thousands of steps; what they check does not depend on size."""
    config = ModelConfig.tiny().replace(hidden_size=64, intermediate_size=128,
                                        num_attention_heads=4, num_key_value_heads=4,
                                        vocab_size=VOCAB)
    return gyges.Model.random(config, seed=12)


def prompts(n, seed=0, lo=3, hi=40):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


PROMPTS = prompts(8)


@pytest.fixture(scope="module")
def reference(tiny):
    """Tokens of PROMPTS under PARAMS (even) and SAMPLED (odd), from a plain engine."""
    with gyges.Engine(tiny) as e:
        out = [e.submit(p, PARAMS if i % 2 == 0 else SAMPLED) for i, p in enumerate(PROMPTS)]
        e.run()
        return [r.output_tokens for r in out]


def submit_all(target, **kw):
    return [target.submit(p, PARAMS if i % 2 == 0 else SAMPLED, **kw) for i, p in enumerate(PROMPTS)]


snapshot = testing.snapshot


# ---- 1. a staggered move with no KV to move ----

def test_a_staggered_merge_of_idle_workers_completes(tiny, reference):
    """Finding 1: a layer move with no items (workers 2 and 3 hold no KV) made the run order's
    grid 0 ("gy_run_order_copy: bad sizes") and wedged the host."""
    with gyges.Host(tiny, workers=4, memory_per_worker=MEMORY) as host:
        reqs = [host.submit(p, PARAMS if i % 2 == 0 else SAMPLED, instance=i % 2)
                for i, p in enumerate(PROMPTS)]
        host.step()
        t = host.transform(workers=(2, 3), tp=2, layers_per_step=1, overlap=False)
        while not t.done:
            host.step()
        host.run()
        assert host.layout() == "2xTP1+TP2" and not t.recovered
        assert [r.output_tokens for r in reqs] == reference


# ---- 2. abort ----

@pytest.mark.parametrize("steps", [0, 2])
def test_abort_finishes_the_handle(tiny, steps):
    """Finding 2: abort left the handle unfinished and run() spun forever."""
    with gyges.Engine(tiny) as e:
        reqs = submit_all(e)
        for _ in range(steps):
            e.step()
        assert e.abort(reqs[1]) is True and e.abort(reqs[1]) is False
        e.run()
        assert reqs[1].finished and reqs[1].finish_reason == "abort"
        assert all(r.finish_reason == "length" for i, r in enumerate(reqs) if i != 1)
        assert e.memory()["kv"] == 0
        with pytest.raises(gyges.InvalidArgumentError, match="not submitted to this engine"):
            e.abort(gyges.Request(99, [1], PARAMS, 0.0))
    with gyges.Host(tiny, workers=2, memory_per_worker=MEMORY) as host:
        reqs = submit_all(host)
        host.step()
        assert host.abort(reqs[0]) is True
        host.run()
        assert reqs[0].finish_reason == "abort" and reqs[2].finish_reason == "length"


# ---- 3. a failed step ----

def test_a_request_with_nan_logits_fails_alone(tiny, reference):
    """Finding 3: a NaN logit failed the step and every later one ("a step is under way"). Now
    the requests whose logits are not numbers finish with reason "error" and the engine serves
    the others: an infinite embedding row poisons only prompts holding that token."""
    tensors = dict(tiny.tensors)
    embed = np.array(tensors["model.embed_tokens.weight"])
    bad_token = 7
    embed[bad_token] = np.inf
    tensors["model.embed_tokens.weight"] = embed
    poisoned = gyges.Model(tiny.config, tensors)
    with gyges.Engine(poisoned) as e:
        good = submit_all(e)
        bad = [e.submit([1, bad_token, 2], PARAMS), e.submit([bad_token] * 30, SAMPLED)]
        e.run()
        assert [r.output_tokens for r in good] == reference
        for r in bad:
            assert r.finish_reason == "error" and "NaN" in r.error and r.output_tokens == []
        late = e.submit(PROMPTS[0], PARAMS)  # the engine still serves
        e.run()
        assert late.output_tokens == reference[0]


def test_a_step_refused_by_a_raw_layer_view_changes_nothing(tiny, reference):
    """Finding 4: growing a raw-layout cache under a live view raised BusyError and every later
    step "the scheduler is unusable". Now the step is taken back and retried after the view."""
    with gyges.Engine(tiny, memory="64MiB", kv_layout="raw") as e:
        reqs = submit_all(e)
        e.step()
        view = e.kv.layer(0)
        raised = 0
        for p in prompts(12, seed=5, lo=60, hi=120):  # enough to need more pages
            e.submit(p, PARAMS)
        for _ in range(10):
            before = snapshot(e)
            try:
                e.step()
            except gyges.BusyError as err:
                raised += 1
                assert "view" in str(err)
                assert snapshot(e) == before
                break
        assert raised == 1
        del view
        e.run()
        assert [r.output_tokens for r in reqs] == reference


# ---- 5, 6. transformations and live views ----

@pytest.mark.parametrize("layers_per_step", [None, 1])
def test_a_transformation_is_refused_while_a_view_pins_a_page(tiny, reference, layers_per_step):
    """Findings 5 and 6: a view pinning a weight slot made a transformation fail half-way and
    lose every instance (or, staggered, give wrong tokens). Now it is refused before anything
    changes."""
    with gyges.Host(tiny, workers=4, memory_per_worker=MEMORY) as host:
        reqs = submit_all(host)
        host.step()
        worker = host.worker(1)
        view = worker.arena.view(worker.weights.shard_slots_of(3, "gate", 0).start)
        before = snapshot(host)
        with pytest.raises(gyges.BusyError, match="worker 1 .*live NumPy view"):
            host.transform(workers=(0, 1, 2, 3), tp=4, layers_per_step=layers_per_step)
        assert snapshot(host) == before
        del view
        t = host.transform(workers=(0, 1, 2, 3), tp=4, layers_per_step=layers_per_step)
        host.run()
        assert t.done and not t.recovered and host.layout() == "TP4"
        assert [r.output_tokens for r in reqs] == reference


def test_a_staggered_transformation_waits_for_a_view_made_meanwhile(tiny, reference):
    with gyges.Host(tiny, workers=4, memory_per_worker=MEMORY) as host:
        reqs = submit_all(host)
        host.step()
        t = host.transform(workers=(0, 1, 2, 3), tp=4, layers_per_step=1)
        host.step()
        boundary = t.boundary
        view = host.worker(2).arena.view(host.worker(2).weights.shard_slots_of(0, "up", 1).start)
        host.step()
        host.step()
        assert t.boundary == boundary and "worker 2" in t.blocked_by and not t.done
        assert t.stats["steps_blocked"] == 2
        del view
        host.run()
        assert t.done and not t.recovered and t.blocked_by is None
        assert [r.output_tokens for r in reqs] == reference


# ---- 7. threads ----

@pytest.mark.parametrize("seed", [1, 2])
def test_two_threads_submit_abort_step_and_transform(tiny, seed):
    """Finding 7: two threads stepping one engine, or transforming while another steps,
    corrupted memory or lost instances. Now the calls take turns: every request ends, and those
    not aborted give the tokens they have when served alone. (The C core's side of this runs
    under ThreadSanitizer: `make tsan`.)"""
    r = testing.stress_threads(tiny, seed=seed, memory=MEMORY)
    assert r["aborted"] > 0 and r["transformations"] > 0
    assert (r["errors"], r["lost"], r["mismatches"], r["bad_aborts"]) == (0, 0, 0, 0), r


def test_two_threads_stepping_one_engine(tiny, reference):
    """Finding 7's first form: two threads both calling e.step() (and a third submitting) used
    to corrupt memory; the engine's lock makes the steps take turns."""
    import threading

    with gyges.Engine(tiny) as e:
        reqs = []
        errors = []

        def stepper():
            for _ in range(400):
                try:
                    e.step()
                except gyges.Error as err:
                    errors.append(err)

        threads = [threading.Thread(target=stepper) for _ in range(2)]
        for t in threads:
            t.start()
        for i, p in enumerate(PROMPTS * 3):
            reqs.append((i % len(PROMPTS), e.submit(p, PARAMS if i % 2 == 0 else SAMPLED)))
        for t in threads:
            t.join()
        e.run()
        assert not errors
        assert all(r.output_tokens == reference[i] for i, r in reqs)


def test_the_lock_is_reentrant_and_granted_in_turn():
    """A thread stepping without pause must not starve one that waits to submit or abort: the
    lock goes to its waiters in the order they asked."""
    import threading

    from gyges.core.fairlock import FairLock

    lock, order = FairLock(), []
    with lock:
        with lock:  # reentrant
            pass
        waiters = []
        for k in range(5):
            t = threading.Thread(target=lambda k=k: (lock.acquire(), order.append(k),
                                                     lock.release()))
            t.start()
            waiters.append(t)
            while lock._next_ticket < k + 2:  # wait until thread k holds its ticket
                time.sleep(0.001)
    for t in waiters:
        t.join()
    assert order == [0, 1, 2, 3, 4]
    with pytest.raises(gyges.StateError):
        lock.release()



class _Interrupted(Exception):
    pass


def _interrupt_main_while_it_waits(lock, waiting_for, then):
    """Holds `lock` on a thread, sends SIGINT to the main thread once it waits for the lock
    (its ticket taken: `waiting_for` tickets handed out), then runs `then()` on that thread and
    lets go. Returns the thread (started)."""
    import signal
    import threading

    main = threading.main_thread().ident
    held = threading.Event()

    def hold():
        with lock:
            held.set()
            while lock._next_ticket < waiting_for:
                time.sleep(0.001)
            time.sleep(0.05)  # the main thread is inside its wait now
            signal.pthread_kill(main, signal.SIGINT)
            then()

    t = threading.Thread(target=hold, daemon=True)
    t.start()
    held.wait()
    return t


def _raising_sigint():
    import signal

    def handler(signum, frame):
        raise _Interrupted()
    return signal.signal(signal.SIGINT, handler)


def test_a_waiter_interrupted_by_a_signal_gives_its_turn_back():
    """Finding (issue 33): Ctrl-C while a thread waits for an Engine's or a Host's lock left its
    ticket taken and nobody to serve it: every later call hung forever (serving=1,
    next_ticket=3, no owner). The interrupted waiter's ticket is skipped; the one queued behind
    it gets the lock, and so does the interrupted thread when it asks again."""
    import signal
    import threading

    from gyges.core.fairlock import FairLock

    lock, order = FairLock(), []
    behind = threading.Thread(target=lambda: (lock.acquire(), order.append("behind"),
                                              lock.release()), daemon=True)
    # the holder starts the thread queued behind the main one once main holds ticket 1
    holder = _interrupt_main_while_it_waits(
        lock, 2, then=lambda: (behind.start(), [time.sleep(0.001) for _ in range(1000)
                                                if lock._next_ticket < 3]))
    previous = _raising_sigint()
    try:
        with pytest.raises(_Interrupted):
            lock.acquire()  # ticket 1: interrupted mid-wait
    finally:
        signal.signal(signal.SIGINT, previous)
    holder.join(5)
    behind.join(5)
    assert not holder.is_alive() and not behind.is_alive(), "the lock was never granted again"
    assert order == ["behind"]
    assert lock.acquire() and lock._owner == threading.get_ident()  # and main gets it again
    lock.release()
    assert lock._abandoned == set() and lock._owner is None


def test_an_engine_interrupted_while_waiting_for_its_lock_still_serves(tiny):
    """Ctrl-C in a notebook cell that waits on an Engine stepped by another thread: the engine
    goes on serving every later call."""
    import signal

    e = gyges.Engine(tiny)
    expected = e.generate([[1, 2, 3]], gyges.SamplingParams(max_tokens=4))[0].output_tokens
    holder = _interrupt_main_while_it_waits(e._lock, 2, then=lambda: None)
    previous = _raising_sigint()
    try:
        with pytest.raises(_Interrupted):
            e.submit([4, 5, 6], gyges.SamplingParams(max_tokens=4))
    finally:
        signal.signal(signal.SIGINT, previous)
    holder.join(5)
    assert not holder.is_alive()
    done = []
    t = __import__("threading").Thread(target=lambda: done.append(
        e.generate([[1, 2, 3]], gyges.SamplingParams(max_tokens=4))[0].output_tokens), daemon=True)
    t.start()
    t.join(30)
    assert done == [expected], "the engine hung after an interrupted wait for its lock"
    e.close()


# ---- 8. weight dtypes ----

def test_integer_weights_are_refused_by_name(tiny):
    """Finding 8 (the safetensors side is in test_safetensors.py): integer weights handed to a
    Model were converted by value."""
    tensors = dict(tiny.tensors)
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name] = np.asarray(tensors[name]).view(np.int32)
    with pytest.raises(gyges.FormatError, match=f"{name}.*int32.*floating point"):
        gyges.Model(tiny.config, tensors)


# ---- 9. arrival times ----

def test_an_absolute_arrival_time_is_refused(tiny):
    """Finding 9: arrival=time.time() made run() spin forever waiting for it."""
    with gyges.Engine(tiny) as e:
        with pytest.raises(gyges.InvalidArgumentError, match="arrival.*seconds since the engine"):
            e.submit([1, 2, 3], arrival=time.time())
        with pytest.raises(gyges.InvalidArgumentError, match="arrival must be finite"):
            e.submit([1, 2, 3], arrival=float("nan"))
        r = e.submit([1, 2, 3], PARAMS, arrival=e.now() + 0.05)  # a little ahead is fine
        e.run()
        assert r.finished and not e.has_unfinished()


# ---- 10. resources ----

def _process():
    rss = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return rss, len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))


def test_engines_and_hosts_free_everything_without_the_cycle_collector(tiny):
    """Finding 10: reference cycles kept arenas, threads and fds alive until gc ran (+1.4 GB
    after 200 cycles). Now the last reference frees them: 200 create/serve/destroy cycles with
    the collector off leave RSS, fds and threads flat."""
    gc.collect()
    gc.disable()
    try:
        def cycle(k):
            e = gyges.Engine(tiny, memory="32MiB")
            e.generate([PROMPTS[k % 8]], PARAMS)
            ref = weakref.ref(e)
            del e
            assert ref() is None
            h = gyges.Host(tiny, workers=2, memory_per_worker="32MiB", layout="TP2")
            h.submit(PROMPTS[k % 8], PARAMS)
            h.step()
            ref = weakref.ref(h)
            del h
            assert ref() is None

        for k in range(20):
            cycle(k)
        time.sleep(0.2)  # executor threads end when their host is collected
        rss0, fds0, threads0 = _process()
        for k in range(180):
            cycle(k)
        time.sleep(0.2)
        rss1, fds1, threads1 = _process()
    finally:
        gc.enable()
    assert fds1 == fds0 and threads1 == threads0
    assert rss1 - rss0 < 24 << 20, f"RSS grew by {(rss1 - rss0) >> 20} MiB over 180 cycles"


def test_closed_engines_and_hosts_refuse_calls(tiny):
    e = gyges.Engine(tiny)
    r = e.submit([1, 2, 3], PARAMS)
    e.close()
    e.close()
    assert r.finished and r.finish_reason == "abort" and "closed" in r.error
    for call in (lambda: e.submit([1, 2]), e.step, lambda: e.arena):
        with pytest.raises(gyges.StateError, match="closed"):
            call()
    h = gyges.Host(tiny, workers=2, memory_per_worker="32MiB")
    h.close()
    with pytest.raises(gyges.StateError, match="closed"):
        h.submit([1, 2])


# ---- 11. bad arguments ----

BAD_ENGINE_CALLS = [
    ("prompt", lambda e: e.submit(True)),
    ("prompt", lambda e: e.submit({1: 2, 3: 4})),
    ("prompt", lambda e: e.submit([1, True, 3])),
    ("prompt", lambda e: e.submit([1.0, 2.0])),
    ("prompt", lambda e: e.submit("hello")),
    ("prompt", lambda e: e.submit([])),
    ("vocabulary", lambda e: e.submit([1, VOCAB])),
    ("params", lambda e: e.submit([1], params={"max_tokens": 3})),
    ("stop_token_ids", lambda e: e.submit([1], gyges.SamplingParams(stop_token_ids=(3677.9,)))),
    ("stop_token_ids", lambda e: e.submit([1], gyges.SamplingParams(stop_token_ids=(VOCAB,)))),
    ("ignore_eos", lambda e: e.submit([1], gyges.SamplingParams(ignore_eos="no"))),
    ("max_tokens", lambda e: e.submit([1], gyges.SamplingParams(max_tokens=0))),
    ("temperature", lambda e: e.submit([1], gyges.SamplingParams(temperature=True))),
    ("top_p", lambda e: e.submit([1], gyges.SamplingParams(top_p=1.5))),
    ("request", lambda e: e.abort(3)),
]


@pytest.mark.parametrize("name, call", BAD_ENGINE_CALLS, ids=[f"{n}-{i}" for i, (n, _) in
                                                               enumerate(BAD_ENGINE_CALLS)])
def test_bad_engine_arguments_raise_a_gyges_error_and_change_nothing(tiny, name, call):
    with gyges.Engine(tiny, memory="32MiB") as e:
        e.submit([1, 2, 3], PARAMS)
        e.step()
        before = snapshot(e)
        with pytest.raises(gyges.Error, match=name):
            call(e)
        assert snapshot(e) == before


BAD_HOST_CALLS = [
    ("tp", lambda h: h.transform(workers=(0, 1), tp=0)),
    ("tp", lambda h: h.transform(workers=(0, 1), tp=2.0)),
    ("workers", lambda h: h.transform(workers=(), tp=2)),
    ("workers", lambda h: h.transform(workers=(0, 9), tp=2)),
    ("workers", lambda h: h.transform(workers="01", tp=2)),
    ("overlap", lambda h: h.transform(workers=(0, 1), tp=2, layers_per_step=1, overlap="yes")),
    ("weights_from", lambda h: h.transform(workers=(0, 1, 2, 3), tp=4, weights_from="disk")),
    ("instance", lambda h: h.submit([1, 2], instance=-1)),
    ("instance", lambda h: h.submit([1, 2], instance=1.0)),
    ("prompt", lambda h: h.submit({1: 2})),
    ("index", lambda h: h.worker(-1)),
    ("seconds", lambda h: h.advance_clock(-1)),
]


@pytest.mark.parametrize("name, call", BAD_HOST_CALLS, ids=[f"{n}-{i}" for i, (n, _) in
                                                             enumerate(BAD_HOST_CALLS)])
def test_bad_host_arguments_raise_a_gyges_error_and_change_nothing(tiny, name, call):
    with gyges.Host(tiny, workers=4, memory_per_worker="32MiB") as h:
        submit_all(h)
        h.step()
        before = snapshot(h)
        with pytest.raises(gyges.Error, match=name):
            call(h)
        assert snapshot(h) == before


@pytest.mark.parametrize("kwargs, name", [(dict(workers=0), "workers"),
                                           (dict(workers=2.0), "workers"),
                                           (dict(layout=4), "layout"),
                                           (dict(max_running=True), "max_running")])
def test_bad_host_construction_is_refused(tiny, kwargs, name):
    with pytest.raises(gyges.Error, match=name):
        gyges.Host(tiny, **{"workers": 2, **kwargs})


# ---- fault injection over whole operations ----

@pytest.mark.parametrize("site", list(testing.SITES))
@pytest.mark.parametrize("kind", list(testing.TRANSFORMS))
def test_a_fault_anywhere_in_a_transformation_loses_nothing(tiny, kind, site):
    """The n-th event of a site fails, for n spread over every event the transformation has:
    it is refused with nothing changed, or rolled back (past its first change: the host is as
    before, by slot, record, block table and token), or it completes; never rebuilt (that is
    for a rollback that fails too). Either way every request ends with the tokens it has when
    served alone, and no page is left behind. (benchmarks/soak_transform.py sweeps every
    event.)"""
    r = testing.sweep_transformation(tiny, kind, site, most=12, memory=MEMORY)
    if r["events"] == 0:
        pytest.skip(f"{kind} has no {site} event")
    assert r["runs"] == r["refused"] + r["rolled_back"] + r["done"] + r["recovered"] > 0
    assert r["recovered"] == 0, r
    assert (r["changed"], r["wrong_layout"], r["lost"], r["mismatches"], r["leaked_pages"]) == \
           (0, 0, 0, 0, 0), r


@pytest.mark.parametrize("site", ["alloc", "copy"])
@pytest.mark.parametrize("kind", ["merge", "merge, staggered", "merge, basic"])
def test_a_fault_in_a_merge_past_max_running_loses_nothing(tiny, kind, site):
    """The same sweep where each instance runs one request (max_running=1), so that the merged
    instance's running set grows past it as it takes them (gy_sched_adopt): a failure anywhere,
    the growth's allocations among them, is refused, rolled back or completed, and every request
    ends with its own tokens and no page left behind."""
    start, kwargs, _ = testing.TRANSFORMS[kind]
    with gyges.Host(tiny, workers=4, memory_per_worker=MEMORY, layout=start,
                    max_running=1) as host:  # without a fault: the running set grows
        for p in testing._Workload(tiny, MEMORY).prompts:
            host.submit(p, gyges.SamplingParams(max_tokens=6, ignore_eos=True))
        host.step()
        t = host.transform(**kwargs)
        assert host.instances[0].stats()["running"] == 4
        host.run()
        assert t.committed and host.instances[0].stats()["preemptions"] == 0
    r = testing.sweep_transformation(tiny, kind, site, most=10, memory=MEMORY, max_running=1)
    assert r["runs"] == r["refused"] + r["rolled_back"] + r["done"] + r["recovered"] > 0
    assert r["recovered"] == 0, r
    assert (r["changed"], r["wrong_layout"], r["lost"], r["mismatches"], r["leaked_pages"]) == \
           (0, 0, 0, 0, 0), r


@pytest.mark.parametrize("fail_at", [0, 3, 7])
def test_a_staggered_merge_that_fails_adopting_a_request_gives_every_request_back(tiny, fail_at,
                                                                                 monkeypatch):
    """The merged engine adopts the moved requests' old sequences one by one; when the adoption
    of one fails (out of memory growing a map, as a sweep of every event found), the requests it
    had not reached yet were given to the wrong old instance, without their KV: recomputed, and
    their pages left behind. Now each goes back to where it came from, as it was."""
    from gyges.core.errors import OutOfMemoryError
    from gyges.runtime.instance import Instance

    load = testing._Workload(tiny, MEMORY)
    host, reqs = load.host("4xTP1")
    before = testing.snapshot(host, physical=False)
    adopt, calls = Instance.transition_adopt, []

    def failing(self, *args):
        calls.append(args)
        if len(calls) == fail_at + 1:
            raise OutOfMemoryError("injected: adopting a request")
        return adopt(self, *args)
    monkeypatch.setattr(Instance, "transition_adopt", failing)
    with pytest.raises(OutOfMemoryError, match="injected") as e:
        host.transform(workers=(0, 1, 2, 3), tp=4, layers_per_step=1)
    monkeypatch.undo()
    assert e.value.reconfiguration.rolled_back
    assert testing.snapshot(host, physical=False) == before
    out = dict(lost=0, mismatches=0, leaked_pages=0)
    load.finish(host, reqs, out)
    assert out == dict(lost=0, mismatches=0, leaked_pages=0)
    host.close()


@pytest.mark.parametrize("layout,site", [("TP2+2xTP1", "alloc"), ("TP2+2xTP1", "page_create"),
                                         ("TP2+2xTP1", "page_map"), ("TP2+2xTP1", "comm"),
                                         ("PP[3,1]+2xTP1", "alloc"), ("PP[3,1]+2xTP1", "page_create"),
                                         ("PP[3,1]+2xTP1", "page_map")])
def test_a_fault_anywhere_in_a_host_step_changes_nothing(tiny, layout, site):
    """A TP2 instance (or a two-stage pipeline) and two TP1 ones; the step also grows their KV
    (long prompts arrive)."""
    r = testing.sweep_step(tiny, site, most=16, memory=MEMORY, layout=layout)
    assert r["events"] > 0 and r["failed"] > 0
    assert (r["changed"], r["lost"], r["mismatches"], r["leaked_pages"]) == (0, 0, 0, 0), r


@pytest.mark.parametrize("site", ["alloc", "page_create", "page_map"])
def test_a_fault_while_loading_leaves_nothing_behind(tiny, site):
    """Making an engine (its arena, the weights placed page by page, the KV cache, the C model
    and serving loop) fails at each resource in turn: a gyges.Error, and no fd, thread or page
    is left behind; the next engine works."""
    count, _ = testing.count(site, lambda: gyges.Engine(tiny, memory="32MiB").close())
    assert count > 0
    gc.collect()
    _, fds0, threads0 = _process()
    for n in testing.spread(count, 24):
        with testing.inject(site, n) as fired:
            try:
                gyges.Engine(tiny, memory="32MiB").close()
            except gyges.Error:
                pass
        assert fired() == 1
    gc.collect()
    _, fds1, threads1 = _process()
    assert (fds1, threads1) == (fds0, threads0)
    with gyges.Engine(tiny, memory="32MiB") as e:
        assert e.generate([PROMPTS[0]], PARAMS)[0].finish_reason == "length"


# ---- the soak ----

@pytest.mark.parametrize("faults", [False, True])
def test_soak_of_random_live_transformations(tiny, faults):
    """100 random merges and splits (at once and layer-staggered, with and without overlap)
    while requests arrive at every step, the second run with a random fault inside about half of
    them: no request lost, every token equal to the request served alone, no page left over;
    a fault rolls its transformation back, never to a rebuild."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RecoveryWarning)
        r = testing.soak(tiny, seed=11 + faults, transformations=100,
                         faults=faults)
    assert r["lost"] == 0 and r["mismatches"] == 0 and r["page_delta"] == [0, 0, 0, 0], r
    assert r["transformations"] >= 100 and r["recovered"] == 0, r
    if faults:
        assert r["rolled_back"] > 0


def test_soak_beside_a_pipeline(tiny):
    """A PP[3,1] pipeline serving on workers 0 and 1 while workers 2 and 3 merge and split under
    random faults: the pipeline's requests and the others' all come out right, no page left."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RecoveryWarning)
        r = testing.soak(tiny, seed=21, transformations=30, faults=True, layout="PP[3,1]+2xTP1")
    assert r["lost"] == 0 and r["mismatches"] == 0 and r["page_delta"] == [0, 0, 0, 0], r
    assert r["transformations"] >= 30 and r["layout"].startswith("PP[3,1]+"), r
