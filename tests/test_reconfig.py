"""The one reconfiguration protocol (gyges/reconfig/reconfiguration.py), across every kind: the
handles share their fields, combinations compose or are refused at the call, every kind ends in
bounded steps, close() works at any point, finished ones keep nothing, and no sequence of
public calls makes host.step() raise or stall. The mixed soak runs every kind together with
arrivals and aborts (benchmarks/soak_mixed.py runs it by the thousand)."""
import gc
import os
import warnings

import numpy as np
import pytest

import gyges
from gyges import testing
from gyges.models.config import ModelConfig
from gyges.reconfig import STATS, ReconfigurationWarning

MEMORY = "32MiB"


@pytest.fixture(scope="module")
def small():
    """Model.tiny()'s shapes at a quarter of its width: what is checked does not depend on it."""
    config = ModelConfig.tiny().replace(hidden_size=64, intermediate_size=128,
                                        num_attention_heads=4, num_key_value_heads=4,
                                        vocab_size=512)
    return gyges.Model.random(config, seed=12)


def prompts(n, seed=0, lo=3, hi=40):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 512, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


GREEDY = gyges.SamplingParams(max_tokens=10, ignore_eos=True)
SAMPLED = gyges.SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)


def alone(model, ps, params):
    """Each request served alone by a plain engine: what every host must give."""
    with gyges.Engine(model, memory="128MiB") as e:
        return [e.generate([p], params)[0].output_tokens for p in ps]


# ---- one protocol ----

def every_kind(host, replicated):
    """One handle of every kind, each driven to its end on a host serving requests."""
    out = {}

    def drive(r, on=host):
        while not r.done:
            on.step()
        return r
    out["transform"] = drive(host.transform((2, 3), 2))
    out["transform, staggered"] = drive(host.transform((2, 3), 1, layers_per_step=1))
    out["reconfigure"] = drive(host.reconfigure(host.instances[0], [2, 2]))
    b = out["buddy"] = drive(host.buddy([i for i in host.instances if not i.stages], live=True))
    out["restore"] = drive(host.restore(b, live=True))
    out["switch"] = drive(replicated.switch((0, 1), 2, preempt="soft"), replicated)
    out["release"] = replicated.switch((0, 1), 1)
    return out


def test_every_kind_has_the_protocols_handle(small):
    with gyges.Host(small, workers=4, memory_per_worker=MEMORY, layout="PP[3,1]+2xTP1") as host, \
            gyges.Host(small, workers=4, memory_per_worker=MEMORY, weights="replicated") as rep:
        reqs = [host.submit(p, GREEDY) for p in prompts(6)]
        reqs += [rep.submit(p, GREEDY) for p in prompts(6, seed=1)]
        host.step()
        rep.step()
        for kind, r in every_kind(host, rep).items():
            assert r.state == "committed" and r.done and r.committed, kind
            assert r.error is None and r.blocked_by is None, kind
            assert set(STATS) <= set(r.stats), kind
            assert r.stats["seconds"] >= 0 and r.stats["stall_seconds"] >= 0, kind
            assert isinstance(r.workers, tuple) and r.workers, kind
        assert host.reconfigurations == [] and rep.reconfigurations == []
        host.run()
        rep.run()
        assert all(r.finish_reason == "length" for r in reqs)


# ---- the states that used to stop serving (issue 30) ----

@pytest.mark.parametrize("preempt", ["wait", "soft"])
def test_plain_requests_around_a_bind_of_every_worker_are_served(small, preempt):
    """A replicated 4xTP1 host binds all four workers while plain requests keep arriving: they
    used to queue on a pair that could not bind and host.step() raised BusyError at every step
    from then on. Now they go where something will serve them."""
    ps = prompts(24, seed=2)
    want = alone(small, ps, GREEDY)
    with gyges.Host(small, workers=4, memory_per_worker=MEMORY, weights="replicated") as host:
        reqs = [host.submit(p, GREEDY) for p in ps[:4]]
        host.step()
        host.switch(workers=(0, 1, 2, 3), tp=4, preempt=preempt)
        for p in ps[4:]:
            reqs.append(host.submit(p, GREEDY))
            host.step()   # never raises
        host.run()        # never stuck
        assert [r.output_tokens for r in reqs] == want


def test_tp_and_plain_requests_around_every_switch_never_stop_serving(small):
    """Random plain and TP requests, and random binds and releases of every aligned group with
    every preemption, on a replicated host: every step serves or waits for a switch under way,
    none raises, and run() ends with every request right."""
    rng = np.random.default_rng(3)
    ps = prompts(60, seed=3)
    want = alone(small, ps, GREEDY)
    with gyges.Host(small, workers=4, memory_per_worker=MEMORY, weights="replicated") as host:
        reqs = []
        for i, p in enumerate(ps):
            reqs.append(host.submit(p, GREEDY, tp=[None, None, 1, 2, 4][int(rng.integers(5))]))
            if rng.random() < 0.3:
                first, size = list(host.replicas.groups)[int(rng.integers(3))]
                try:
                    host.switch(range(first, first + size), [size, 1][int(rng.integers(2))],
                                preempt=["wait", "soft", "hard"][int(rng.integers(3))])
                except gyges.BusyError:
                    pass   # overlaps a group engaged now: refused at the call
            host.step()
        host.run()
        assert [r.output_tokens for r in reqs] == want


def test_a_resplit_of_a_buddy_group_composes_with_its_restore(small):
    """host.buddy, then a re-split of the group's pipeline (blocking or live): the handle's
    ranges follow the instance, the restore brings every layer home, and the tokens are one
    worker's. (A restore used to read the ranges the group was formed with: "worker holds
    layers [0, 1, 3], not a range", and every later step failed.)"""
    ps = prompts(6, seed=4, lo=20, hi=40)
    want = alone(small, ps, SAMPLED)
    for live in (False, True):
        with gyges.Host(small, workers=2, memory_per_worker=MEMORY, layout="2xTP1") as host:
            reqs = [host.submit(p, SAMPLED, instance=i % 2) for i, p in enumerate(ps)]
            host.step()
            b = host.buddy((0, 1), live=live)
            if live:   # a live exchange holds the workers: refused at the call
                with pytest.raises(gyges.BusyError, match="under way"):
                    host.reconfigure(b.instance, [3, 1])
            while not b.done:
                host.step()
            r = host.reconfigure(b.instance, [3, 1], mode="live")
            while not r.done:
                host.step()
            assert b.ranges == ((0, 3), (3, 4)) and host.layout() == "PP[3,1]"
            host.step()
            back = host.restore(b, live=live)
            while not back.done:
                host.step()
            assert host.layout() == "2xTP1" and b.restored
            host.run()
            assert [x.output_tokens for x in reqs] == want


def test_a_live_resplit_with_tau_0_on_an_idle_pipeline_ends(small):
    """mode="live", tau=0 on a pipeline with nothing to serve used to wait for fewer than 0
    tokens lagging forever (675k steps); it commits once nothing lags."""
    with gyges.Host(small, workers=2, memory_per_worker=MEMORY, layout="PP[3,1]") as host:
        r = host.reconfigure(host.instances[0], [1, 3], mode="live", tau=0)
        for _ in range(20):
            host.step()
            if r.done:
                break
        assert r.committed and host.layout() == "PP[1,3]"


def test_every_size_parameter_is_bounded_before_anything_is_allocated(small):
    """layers_per_step=10**9 used to make one KV mover per layer-step (the server was
    OOM-killed at 22.6 GB): it is every layer in one step now."""
    with gyges.Host(small, workers=4, memory_per_worker=MEMORY) as host:
        reqs = [host.submit(p, GREEDY) for p in prompts(6)]
        host.step()
        t = host.transform((0, 1, 2, 3), 4, layers_per_step=10**9)
        assert t.layers_per_step == small.config.num_hidden_layers
        host.step()
        assert t.done and host.layout() == "TP4"
        host.run()
        assert all(x.finish_reason == "length" for x in reqs)
        for bad in (dict(phase_chunks=10**9), dict(tp=10**9)):
            with pytest.raises(gyges.InvalidArgumentError):
                host.transform((0, 1, 2, 3), **{"tp": 1, **bad})


@pytest.mark.parametrize("kind", ["staggered", "resplit", "exchange", "restore", "bind",
                                  "release"])
def test_close_works_while_any_kind_is_under_way(small, kind):
    """Host.close() in the middle of every live kind: it is rolled back, the memory goes, and
    the requests end with "abort" (close() used to raise AttributeError ... 'release_resources'
    and keep the memory)."""
    layout = {"resplit": "PP[3,1]", "exchange": "2xTP1", "restore": "2xTP1"}.get(kind, "4xTP1")
    weights = "replicated" if kind in ("bind", "release") else "sharded"
    host = gyges.Host(small, workers=4 if layout == "4xTP1" else 2, memory_per_worker=MEMORY,
                      layout=layout if weights == "sharded" else "4xTP1", weights=weights)
    reqs = [host.submit(p, GREEDY) for p in prompts(8, seed=5)]
    host.step()
    if kind == "staggered":
        r = host.transform((0, 1, 2, 3), 4, layers_per_step=1)
    elif kind == "resplit":
        r = host.reconfigure(host.instances[0], [1, 3], tau=0)
    elif kind == "exchange":
        r = host.buddy((0, 1), live=True)
    elif kind == "restore":
        b = host.buddy((0, 1))
        host.step()
        r = host.restore(b, live=True)
    elif kind == "bind":
        r = host.switch((0, 1, 2, 3), 4, preempt="wait")
    else:
        host.switch((0, 1, 2, 3), 4, preempt="hard")
        t = [host.submit(p, GREEDY, tp=4) for p in prompts(2, seed=6)]
        host.step()
        r = host.switch((0, 1, 2, 3), 1, preempt="wait")
        reqs += t
    host.step()
    assert not r.done, r
    host.close()
    assert r.rolled_back and host.closed
    assert all(x.finished for x in reqs)


def test_a_finished_reconfiguration_keeps_no_buffers(small):
    """The host keeps only live reconfigurations, and a handle the caller keeps holds no KV
    buffers: 60 staggered round trips with their handles kept do not grow the process
    (host.transformations used to keep every executor and its KV stages: +457 MiB after 400)."""
    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    with gyges.Host(small, workers=4, memory_per_worker=MEMORY) as host:
        reqs = [host.submit(p, GREEDY) for p in prompts(8)]
        kept = []
        for i in range(80):
            if i == 20:
                gc.collect()
                start = rss()
            for tp in (4, 1):
                t = host.transform((0, 1, 2, 3), tp, layers_per_step=1, overlap=True)
                while not t.done:
                    host.step()
                kept.append(t)
            assert host.reconfigurations == []
        gc.collect()
        grown = rss() - start
        host.run()
        assert all(x.finish_reason == "length" for x in reqs)
        assert all(t._stage_pool is None and not t._undo for t in kept)
        assert grown < 16 << 20, grown


def test_a_live_reconfiguration_can_be_cancelled_exactly(small):
    """host.cancel(r) takes a live one back exactly: after a staggered merge moved some layers,
    the host is as before it (pages by slot, records, tables, tokens) and serves on."""
    ps = prompts(8, seed=7)
    want = alone(small, ps, SAMPLED)
    with gyges.Host(small, workers=4, memory_per_worker=MEMORY) as host:
        reqs = [host.submit(p, SAMPLED) for p in ps]
        host.step()
        before = testing.snapshot(host, physical=False)
        t = host.transform((0, 1, 2, 3), 4, layers_per_step=1)
        assert host.layout() == "TP4" and not t.done
        assert host.cancel(t) and t.rolled_back and t.error == "cancelled"
        assert testing.snapshot(host, physical=False) == before
        assert not host.cancel(t)
        host.run()
        assert [r.output_tokens for r in reqs] == want


def test_a_merge_beyond_max_running_keeps_every_request_running(small):
    """An instance admits requests up to max_running, but the instance a merge (at once or
    layer-staggered) or a buddy group makes takes every request its parts run, with its KV:
    the running set grows past max_running, nothing is preempted or recomputed, and no new
    request is admitted until fewer than max_running run. Before, the hand-over refused the
    request past the limit and the whole change was rolled back. Tokens are those of each
    request alone."""
    ps = prompts(7, seed=3)
    params = gyges.SamplingParams(max_tokens=16, ignore_eos=True)
    want = alone(small, ps, params)
    changes = {"merge": lambda host: host.transform((0, 1), 2),
               "staggered merge": lambda host: host.transform((0, 1), 2, layers_per_step=1),
               "buddy group": lambda host: host.buddy(host.instances)}
    for what, change in changes.items():
        with gyges.Host(small, workers=2, memory_per_worker=MEMORY, layout="2xTP1",
                        max_running=3) as host:
            reqs = [host.submit(p, params, instance=i % 2) for i, p in enumerate(ps[:6])]
            host.step()
            assert [inst.stats()["running"] for inst in host.instances] == [3, 3], what
            r = change(host)
            (merged,) = host.instances
            assert merged.stats()["running"] == 6, what  # taken whole: the set grew
            late = host.submit(ps[6], params)
            while not r.done:
                host.step()
            assert r.committed, (what, r.error)
            while merged.stats()["running"] >= 3:  # nothing new runs while 3 or more do
                assert not late.output_tokens and merged.info(late.id)["state"] == "waiting", what
                host.step()
            host.run()
            assert merged.stats()["preemptions"] == 0, what
            assert [q.output_tokens for q in reqs + [late]] == want, what


# ---- the mixed soak ----

@pytest.mark.parametrize("seed, faults", [(0, False), (1, True)])
def test_mixed_soak_loses_nothing(small, seed, faults):
    """Every kind at random with arrivals and aborts on one host of sharded workers (a pipeline,
    a TP group, replicas for buddy groups) and replicated ones (gyges.testing.soak_mixed), all
    changing side by side in one step loop: nothing lost,
    every token a plain engine's, every page back; without faults no step raised; with them
    every failure past a first change rolled back, none rebuilt."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReconfigurationWarning)
        r = testing.soak_mixed(small, seed=seed, operations=80, faults=faults, memory=MEMORY)
    assert r["operations"] >= 80 and r["requests"] > 200, r
    assert (r["lost"], r["mismatches"]) == (0, 0), r
    assert r["page_delta"] == [0] * 12, r
    kinds = ("transform", "reconfigure", "buddy", "restore", "switch")
    assert all(r[k]["committed"] > 0 for k in kinds), r
    assert all(r[k]["recovered"] == 0 for k in kinds), r
    if not faults:
        assert r["failed_steps"] == 0, r
    else:
        assert sum(r[k]["rolled_back"] for k in kinds) > 0, r


# ---- every kind under faults ----

@pytest.mark.parametrize("site", ["alloc", "page_create", "page_map", "copy"])
@pytest.mark.parametrize("kind", testing.RECONFIGURATIONS)
def test_a_fault_anywhere_in_any_kind_is_refused_rolled_back_or_done(small, kind, site):
    """The n-th event of a site fails while a kind starts and runs to its end (spread over
    every event it has; benchmarks/soak_mixed.py sweeps them all): refused, or rolled back (past
    its first change: the host as before it, by slot, record, block table and token, in its
    layout), or done; never rebuilt; nothing lost, mismatched or leaked."""
    r = testing.sweep_reconfiguration(small, kind, site, most=6, memory=MEMORY)
    if r["events"] == 0:
        pytest.skip(f"{kind} has no {site} event")
    assert r["runs"] == r["refused"] + r["rolled_back"] + r["done"] + r["recovered"] > 0
    assert r["recovered"] == 0, r
    assert (r["changed"], r["wrong_layout"], r["lost"], r["mismatches"], r["leaked_pages"]) == \
           (0, 0, 0, 0, 0), r
