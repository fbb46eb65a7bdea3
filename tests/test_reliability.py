"""The reliability contract (README "Guarantees"): every public call succeeds or raises a
gyges.Error and leaves the object exactly as before; a failed step fails only the requests it
must and the engine serves on; abort finishes the handle; a host never loses an instance or a
request to a refused or failed transformation; engines and hosts are safe to call from several
threads; nothing leaks. Each test below reproduces one way the contract used to break (issue 12,
"What was found", numbered as there) or sweeps injected faults over a whole operation."""
import gc
import os
import threading
import time
import warnings
import weakref

import numpy as np
import pytest

import gyges
from gyges import testing
from gyges.config import ModelConfig
from gyges.recovery import RecoveryWarning

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


def engine_loops(target):
    return [target._loop] if isinstance(target, gyges.Engine) else [i.loop for i in target.instances]


def snapshot(target):
    """Everything a caller can see: the layout, every worker's page table, every request's state
    and progress in C and in its handle, and every KV block table."""
    workers = ([target.worker] if isinstance(target, gyges.Engine) else
               [target.worker(w) for w in range(target.n_workers)])
    state = {"layout": None if isinstance(target, gyges.Engine) else target.layout(),
             "pages": [w.arena.page_table().tobytes() for w in workers], "requests": {}}
    for loop in engine_loops(target):
        for rid, r in loop.requests.items():
            ex = loop._c.export(rid)
            info = {k: ex["info"][k] for k in ("state", "n_generated", "n_computed", "prefill_end",
                                               "n_preemptions")}
            tables = []
            for rank, seq in enumerate(ex["seqs"]):
                kv = workers[rank].kv if isinstance(target, gyges.Engine) else None
                if kv is None:
                    inst = next(i for i in target.instances if i.loop is loop)
                    kv = target.worker(inst.workers[rank]).kv
                tables.append(kv.block_table(seq).tolist() if seq >= 0 else None)
            state["requests"][rid] = (info, tables, list(r.output_tokens), r.finished)
    return state


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

def test_two_threads_submit_abort_step_and_transform(tiny, reference):
    """Finding 7: two threads stepping one engine, or transforming while another steps,
    corrupted memory or lost instances. Now the calls take turns: every request ends, and those
    not aborted give the reference tokens."""
    host = gyges.Host(tiny, workers=4, memory_per_worker=MEMORY)
    stop, errors = threading.Event(), []
    handles, aborted = [], set()

    def stepper():
        while not stop.is_set():
            try:
                host.step()
            except gyges.Error as e:  # allowed (a refused call), but none is expected
                errors.append(e)

    thread = threading.Thread(target=stepper)
    thread.start()
    try:
        rng = np.random.default_rng(1)
        for k in range(60):
            i = k % len(PROMPTS)
            handles.append((i, host.submit(PROMPTS[i], PARAMS if i % 2 == 0 else SAMPLED)))
            if k % 7 == 3:  # a long request, aborted at once: surely not finished yet
                long = host.submit(PROMPTS[i], gyges.SamplingParams(max_tokens=200))
                assert host.abort(long) is True and long.finish_reason == "abort"
                _, h = handles[int(rng.integers(len(handles)))]  # and one that may be done
                if host.abort(h):
                    aborted.add(h.id)
            if k % 10 == 5:
                target = [((0, 1, 2, 3), 4), ((0, 1, 2, 3), 1), ((0, 1), 2), ((0, 1, 2, 3), 2)]
                workers, tp = target[int(rng.integers(len(target)))]
                try:
                    host.transform(workers=workers, tp=tp,
                                   layers_per_step=[None, 1][int(rng.integers(2))])
                except gyges.Error:
                    pass  # not a legal move from the current layout: refused, nothing changed
            time.sleep(0.002)
        deadline = time.time() + 120
        while host.has_unfinished() and time.time() < deadline:
            time.sleep(0.01)
    finally:
        stop.set()
        thread.join()
    assert not errors
    assert all(h.finished for _, h in handles)
    for i, h in handles:
        if h.id in aborted:
            assert h.finish_reason == "abort"
        else:
            assert h.finish_reason == "length" and h.output_tokens == reference[i]
    host.close()


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

def spread(count, most):
    """At most `most` event numbers in [1, count], spread evenly, the first and the last in."""
    if count <= most:
        return list(range(1, count + 1))
    return sorted({1 + round(i * (count - 1) / (most - 1)) for i in range(most)})


def new_host(tiny, layout):
    host = gyges.Host(tiny, workers=4, memory_per_worker=MEMORY, layout=layout)
    reqs = submit_all(host)
    host.step()
    host.step()
    return host, reqs


def finish_and_check(host, reqs, reference, layouts):
    host.run()
    assert host.layout() in layouts
    assert [r.finish_reason for r in reqs] == ["length"] * len(reqs)  # no request lost
    assert [r.output_tokens for r in reqs] == reference
    # Nothing leaks: once idle, every worker holds what a fresh host of this layout holds.
    assert [host.worker(w).arena.stats()["bytes_in_use"] for w in range(4)] == \
           fresh_bytes(host.model, host.layout())


_FRESH = {}


def fresh_bytes(model, layout):
    """Bytes each worker of a fresh idle host of `layout` holds (its weights)."""
    if layout not in _FRESH:
        with gyges.Host(model, workers=4, memory_per_worker=MEMORY, layout=layout) as fresh:
            _FRESH[layout] = [fresh.worker(w).arena.stats()["bytes_in_use"] for w in range(4)]
    return _FRESH[layout]


TRANSFORMS = {
    "merge": ("4xTP1", dict(workers=(0, 1, 2, 3), tp=4), "TP4"),
    "split": ("1xTP4", dict(workers=(0, 1, 2, 3), tp=1), "4xTP1"),
    "merge, staggered": ("4xTP1", dict(workers=(0, 1, 2, 3), tp=4, layers_per_step=1), "TP4"),
    "split, staggered": ("2xTP2", dict(workers=(0, 1), tp=1, layers_per_step=2, overlap=True),
                         "2xTP1+TP2"),
}


@pytest.mark.parametrize("site", list(testing.SITES))
@pytest.mark.parametrize("kind", list(TRANSFORMS))
def test_a_fault_anywhere_in_a_transformation_loses_nothing(tiny, reference, kind, site):
    """The n-th event of a site fails, for n spread over every event the transformation has:
    it is refused with nothing changed, or it completes (moved or rebuilt); either way every
    request ends with the reference tokens and no page is left behind."""
    start, kwargs, target = TRANSFORMS[kind]

    def transform(host):
        t = host.transform(**kwargs)  # raises when refused
        while not t.done:
            try:
                host.step()
            except gyges.Error:
                pass  # a failed step changes nothing: the next one tries again
        return t

    host, _ = new_host(tiny, start)
    count, _ = testing.count(site, lambda: transform(host))
    host.close()
    if count == 0:
        pytest.skip(f"{kind} has no {site} event")
    outcomes = {"refused": 0, "done": 0, "recovered": 0}
    for n in spread(count, 12):
        host, reqs = new_host(tiny, start)
        before = snapshot(host)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RecoveryWarning)  # the outcomes are counted here
            with testing.inject(site, n) as fired:
                try:
                    t = transform(host)
                except gyges.Error:
                    t = None
                assert fired() <= 1
        if t is None:  # refused: exactly as before
            assert snapshot(host) == before
            outcomes["refused"] += 1
        else:
            outcomes["recovered" if t.recovered else "done"] += 1
            assert host.layout() == target
        finish_and_check(host, reqs, reference, {target, start})
        host.close()
    assert sum(outcomes.values()) == len(spread(count, 12))


@pytest.mark.parametrize("site", ["alloc", "page_create", "page_map", "comm"])
def test_a_fault_anywhere_in_a_host_step_changes_nothing(tiny, reference, site):
    """A TP2 instance and two TP1 ones; the step also grows their KV (new long prompts)."""
    def setup():
        host = gyges.Host(tiny, workers=4, memory_per_worker=MEMORY, layout="TP2+2xTP1")
        reqs = submit_all(host)
        host.step()
        extra = [host.submit(p, PARAMS, instance=i % 3) for i, p in enumerate(prompts(6, 9, 60, 90))]
        return host, reqs, extra

    host, _, _ = setup()
    count, _ = testing.count(site, host.step)
    host.close()
    assert count > 0
    for n in spread(count, 16):
        host, reqs, extra = setup()
        before = snapshot(host)
        with testing.inject(site, n) as fired:
            try:
                host.step()
                failed = False
            except gyges.Error:
                failed = True
        assert fired() == 1
        if failed:  # the failed instance's requests are as before (the others' steps stand)
            after = snapshot(host)
            assert any(all(before["requests"][rid] == after["requests"][rid]
                           for rid in inst.loop.requests) for inst in host.instances)
            assert before["layout"] == after["layout"]
        finish_and_check(host, reqs, reference, {"TP2+2xTP1"})
        assert all(r.finish_reason == "length" for r in extra)
        host.close()


@pytest.mark.parametrize("site", ["alloc", "page_create", "page_map"])
def test_a_fault_while_loading_leaves_nothing_behind(tiny, site):
    """Making an engine (its arena, the weights placed page by page, the KV cache, the C model
    and serving loop) fails at each resource in turn: a gyges.Error, and no fd, thread or page
    is left behind; the next engine works."""
    count, _ = testing.count(site, lambda: gyges.Engine(tiny, memory="32MiB").close())
    assert count > 0
    gc.collect()
    _, fds0, threads0 = _process()
    for n in spread(count, 24):
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
    them: no request lost, every token equal to the request served alone, no page left over."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RecoveryWarning)
        r = testing.soak(tiny, seed=11 + faults, transformations=100,
                         faults=faults)
    assert r["lost"] == 0 and r["mismatches"] == 0 and r["page_delta"] == [0, 0, 0, 0], r
    assert r["transformations"] >= 100
    if faults:
        assert r["recovered"] > 0
