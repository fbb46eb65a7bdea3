"""PipeLive: live in-place pipeline re-splits (gyges.pipelive). Tokens are compared with one
TP1 engine of the same model (bit-identical), KV with an identical host that never re-split,
and pages with the host before the re-split."""
import dataclasses

import numpy as np
import pytest

import gyges
from gyges.testing import count, inject

MODES = ("live", "no_patch", "stop_copy")


@pytest.fixture(scope="module")
def tiny():
    return gyges.Model.tiny()


@pytest.fixture(scope="module")
def deep():
    """The tiny model at 8 layers, for PP4 splits."""
    config = dataclasses.replace(gyges.Model.tiny().config, num_hidden_layers=8)
    return gyges.Model.random(config, seed=3)


def prompts(n, seed, lo=20, hi=90):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 4000, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def params(temperature, tokens=24):
    return gyges.SamplingParams(max_tokens=tokens, temperature=temperature, top_k=50, seed=9,
                                ignore_eos=True)


def reference(model, ps, p):
    return [r.output_tokens for r in gyges.Engine(model, memory="64MiB").generate(ps, p)]


def run_resplit(host, target, mode, steps_before, tau=50, **kw):
    """Steps, re-splits the only instance to `target`, and steps until the re-split is done;
    returns it."""
    for _ in range(steps_before):
        host.step()
    r = host.reconfigure(host.instances[0], target, mode=mode, tau=tau, **kw)
    for _ in range(500):
        if r.done:
            return r
        host.step()
    raise AssertionError("the re-split never committed")


def finish(host, reqs):
    while not all(q.finished for q in reqs):
        host.step()
    return [q.output_tokens for q in reqs]


def tight_host(model, ps, p):
    """PP[3,1] on two workers with little KV room (28 and 22 MiB: B_shrink for PP[1,3] is 188
    blocks, B_cur 316), the requests submitted and one step run."""
    host = gyges.Host(model, workers=2, memory_per_worker=["28MiB", "22MiB"], layout="PP[3,1]",
                      max_batch_tokens=4096)
    reqs = [host.submit(q, p) for q in ps]
    host.step()
    return host, reqs


def held(host, i):
    w = host.worker(i)
    return sorted(w.weights.held_layers), (w.kv.first_layer, w.kv.first_layer + w.kv.n_layers)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("when", ["prefill", "decode"])
def test_pp2_resplits_keep_every_token(tiny, mode, temperature, when):
    """PP[3,1] -> PP[1,3] -> PP[2,2] while requests run, mid chunked prefill (chunk 16, long
    prompts) or mid decode: the tokens are those of one worker."""
    ps = prompts(5, seed=1, lo=60 if when == "prefill" else 10, hi=120 if when == "prefill" else 40)
    p = params(temperature)
    want = reference(tiny, ps, p)
    host = gyges.Host(tiny, workers=2, memory_per_worker="32MiB", layout="PP[3,1]",
                      max_batch_tokens=48, max_prefill_chunk=16)
    reqs = [host.submit(q, p) for q in ps]
    r = run_resplit(host, [1, 3], mode, steps_before=2 if when == "prefill" else 12)
    assert host.layout() == "PP[1,3]" and r.stats.stop_s > 0
    assert held(host, 0) == ([0], (0, 1)) and held(host, 1) == ([1, 2, 3], (1, 4))
    run_resplit(host, [2, 2], mode, steps_before=1)
    assert host.layout() == "PP2"
    assert finish(host, reqs) == want
    assert all(q.finish_reason == "length" for q in reqs)


@pytest.mark.parametrize("mode", MODES)
def test_pp4_resplit_keeps_tokens_with_arrivals_during_the_migration(deep, mode):
    ps = prompts(8, seed=2)
    p = params(0.9, tokens=20)
    want = reference(deep, ps, p)
    host = gyges.Host(deep, workers=4, memory_per_worker="48MiB", layout="PP4", max_batch_tokens=64)
    reqs = [host.submit(q, p) for q in ps[:4]]
    for _ in range(6):
        host.step()
    r = host.reconfigure(host.instances[0], [1, 3, 3, 1], mode=mode, tau=8)
    late = iter(ps[4:])
    while not r.done:
        q = next(late, None)
        if q is not None:  # arrivals (and, as requests end, finishes) during the migration
            reqs.append(host.submit(q, p))
        host.step()
    reqs += [host.submit(q, p) for q in late]
    assert host.layout() == "PP[1,3,3,1]"
    assert [held(host, i)[0] for i in range(4)] == [[0], [1, 2, 3], [4, 5, 6], [7]]
    assert finish(host, reqs) == want
    if mode == "live":
        assert r.stats.kv_patch_bytes > 0 and r.stats.patch_rounds > 0
        assert r.stats.t_applied <= r.stats.t_sched


def kv_of(host, rid):
    """{layer: (k, v)} of request rid over the pipeline, each layer read where it lives."""
    inst = host.instances[0]
    out = {}
    for stage, (lo, hi) in enumerate(inst.stages):
        kv = host.worker(inst.workers[stage]).kv
        seq = inst.stage_seq(stage, rid)
        n = kv.n_tokens(seq)
        for layer in range(lo, hi):
            out[layer] = kv.gather(seq, layer - kv.first_layer, 0, n)
    return out


@pytest.mark.parametrize("mode", MODES)
def test_kv_per_layer_equals_an_undisturbed_host(tiny, mode):
    """After the commit each request's K/V in every layer, read on its new owner, equals what
    an identical host that never re-split holds after the same steps."""
    ps = prompts(4, seed=5, lo=30, hi=60)
    p = params(0.0, tokens=40)
    hosts = [gyges.Host(tiny, workers=2, memory_per_worker="32MiB", layout="PP[3,1]",
                        max_batch_tokens=64) for _ in range(2)]
    reqs = [[h.submit(q, p) for q in ps] for h in hosts]
    for _ in range(5):
        hosts[0].step(), hosts[1].step()
    r = hosts[0].reconfigure(hosts[0].instances[0], [1, 3], mode=mode, tau=50)
    while not r.done:
        hosts[0].step(), hosts[1].step()
    for a, b in zip(*reqs):
        ka, kb = kv_of(hosts[0], a.id), kv_of(hosts[1], b.id)
        assert sorted(ka) == sorted(kb) == [0, 1, 2, 3]
        for layer in ka:
            for x, y in zip(ka[layer], kb[layer]):
                np.testing.assert_array_equal(x, y)


def pages(host):
    return [host.worker(i).arena.stats()["bytes_in_use"] for i in range(host.n_workers)]


def test_twenty_round_trips_return_every_page(tiny):
    host = gyges.Host(tiny, workers=2, memory_per_worker="32MiB", layout="PP[3,1]")
    start = pages(host)
    start_weights = [host.worker(i).weights.held_layers.copy() for i in range(2)]
    for trip in range(20):
        for target, mode in (([1, 3], MODES[trip % 3]), ([3, 1], "live")):
            r = host.reconfigure(host.instances[0], target, mode=mode)
            while not r.done:
                host.step()
        assert pages(host) == start, trip
    assert [host.worker(i).weights.held_layers for i in range(2)] == start_weights
    p = params(0.0)
    assert [q.output_tokens for q in host.generate(prompts(3, 7), p)] == reference(tiny, prompts(3, 7), p)


def test_weight_pages_are_exactly_the_owned_layers(tiny):
    host = gyges.Host(tiny, workers=2, memory_per_worker="32MiB", layout="PP[3,1]")
    w0 = host.worker(0)
    before = pages(host)
    r = host.reconfigure(host.instances[0], [1, 3], mode="live")
    while not r.done:
        host.step()
    layer = w0.weights.layer_bytes(1)
    # worker 0 gave layers 1 and 2 away, worker 1 got them: each by exactly their bytes
    assert w0.weights.layer_bytes(2) == layer
    assert pages(host) == [before[0] - 2 * layer, before[1] + 2 * layer]
    assert r.stats.weight_bytes > 0


def test_tight_memory_compacts_resizes_and_keeps_tokens(tiny):
    """Heterogeneous workers with little KV room: B_shrink below B_cur forces a compaction of
    live blocks (the blocks of requests that came late sit high up once the early ones end) and
    the tokens stay exact."""
    ps = prompts(12, seed=11, lo=250, hi=270)
    p = params(0.0, tokens=30)
    want = reference(tiny, ps, p)
    host, reqs = tight_host(tiny, ps, p)
    for q in reqs[:10]:
        host.abort(q)
    r = host.reconfigure(host.instances[0], [1, 3], mode="live")
    assert r.stats.B_shrink < r.stats.B_cur
    assert r.stats.blocks_compacted > 0
    while not r.done:
        host.step()
    assert r.stats.B_new >= r.stats.B_shrink
    assert finish(host, reqs[10:]) == want[10:]


def test_refusals_change_nothing(tiny):
    host, reqs = tight_host(tiny, prompts(14, 3, lo=250, hi=270), params(0.0, tokens=8))
    before = pages(host), host.layout(), [held(host, i) for i in range(2)]
    for target, error in (([1, 3], gyges.BusyError), ([4], gyges.InvalidArgumentError),
                          ([2, 1], gyges.InvalidArgumentError), ([3, 1], gyges.InvalidArgumentError)):
        with pytest.raises(error):
            host.reconfigure(host.instances[0], target)
        assert (pages(host), host.layout(), [held(host, i) for i in range(2)]) == before
    with pytest.raises(gyges.InvalidArgumentError, match="mode"):
        host.reconfigure(host.instances[0], [1, 3], mode="fast")
    finish(host, reqs)


def test_disjoint_ranges_are_refused(deep):
    host = gyges.Host(deep, workers=3, memory_per_worker="48MiB", layout="PP[1,1,6]")
    with pytest.raises(gyges.InvalidArgumentError, match="do not touch"):
        host.reconfigure(host.instances[0], [6, 1, 1])
    assert host.layout() == "PP[1,1,6]"


def failed_resplit(make_host, ps, p, want, site, n=None, after=None):
    """A live PP[3,1] -> PP[1,3] re-split of make_host()'s only instance, three steps into
    serving `ps`, with event n of `site` failing (n=None: counts the events instead and returns
    their number). A failure of the re-split takes it back (layout, weights and KV layers as
    before, r.error set); a failed step leaves it going. Either way the requests finish with
    `want`; after(host, undone), when given, then checks the host. Returns whether the re-split
    was undone."""
    host = make_host()
    reqs = [host.submit(q, p) for q in ps]
    for _ in range(3):
        host.step()
    before = [held(host, i) for i in range(2)]
    r = None

    def go():
        nonlocal r
        try:
            r = host.reconfigure(host.instances[0], [1, 3], mode="live", tau=2)
        except gyges.Error:
            return
        while not r.done:
            try:
                host.step()
            except gyges.Error:
                pass
    if n is None:
        events = count(site, go)[0]
    else:
        with inject(site, n) as fired:
            go()
        assert fired() == 1
    undone = r is None or r.error is not None
    if undone:
        assert host.layout() == "PP[3,1]"
        assert [held(host, i) for i in range(2)] == before
    else:
        assert host.layout() == "PP[1,3]"
    assert finish(host, reqs) == want
    if after is not None:
        after(host, undone)
    host.close()
    return events if n is None else undone


@pytest.mark.parametrize("site", ["copy", "page_map", "alloc"])
def test_a_failed_resplit_takes_itself_back(tiny, site):
    """Every copy / page map / allocation during a live re-split fails in turn (failed_resplit)."""
    ps = prompts(3, seed=4, lo=20, hi=40)
    p = params(0.0, tokens=24)
    want = reference(tiny, ps, p)

    def make_host():
        return gyges.Host(tiny, workers=2, memory_per_worker="32MiB", layout="PP[3,1]",
                          max_batch_tokens=64)
    events = failed_resplit(make_host, ps, p, want, site)
    assert events > 0
    outcomes = [failed_resplit(make_host, ps, p, want, site, n)
                for n in range(1, min(events, 12) + 1)]
    if site != "alloc":  # (the first allocations are the steps')
        assert any(outcomes)


@pytest.mark.parametrize("stack", [1, 2, 4])
def test_layer_stacking_is_bit_identical_and_resplits_in_whole_runs(deep, stack):
    """kv_stack = k: a page holds block b of k layers; tokens equal one worker's, pages per KV
    growth step cover k layers, and re-splits move whole runs (others refused)."""
    ps = prompts(4, seed=6)
    p = params(0.9, tokens=16)
    want = reference(deep, ps, p)
    host = gyges.Host(deep, workers=2, memory_per_worker="48MiB", layout="PP[4,4]",
                      kv_stack=stack, max_batch_tokens=64)
    kv = host.worker(0).kv
    assert kv.stack == stack and kv.n_runs == 4 // stack
    reqs = [host.submit(q, p) for q in ps]
    for _ in range(3):
        host.step()
    assert kv.layout()["stride_block"] == stack * kv.layout()["block_elems"]
    if stack == 2:
        with pytest.raises(gyges.InvalidArgumentError, match="whole runs"):
            host.reconfigure(host.instances[0], [3, 5])
    if stack < 4:  # PP[4,4] -> PP[2,6] -> PP[6,2]; with k = 4 no other split exists
        run_resplit(host, [2, 6], "live", steps_before=1, tau=8)
        run_resplit(host, [6, 2], "no_patch", steps_before=1)
        assert host.layout() == "PP[6,2]"
        assert held(host, 1) == ([6, 7], (6, 8))
    assert finish(host, reqs) == want
    with pytest.raises(gyges.InvalidArgumentError, match="whole runs"):
        gyges.Host(deep, workers=2, memory_per_worker="48MiB", layout="PP[3,5]", kv_stack=2)


def test_preemptions_during_the_migration_keep_tokens(tiny):
    """Requests that outgrow the intermediate budget (B_shrink caps the caches) are preempted
    while the layers move (a live re-split whose lag stays above tau for 60 rounds) and
    recomputed later; every request still gets one worker's tokens."""
    ps = prompts(8, seed=12, lo=330, hi=350)
    p = params(0.0, tokens=120)
    want = reference(tiny, ps, p)
    host, reqs = tight_host(tiny, ps, p)
    r = host.reconfigure(host.instances[0], [1, 3], mode="live", tau=4, max_rounds=60)
    assert r.stats.B_shrink < r.stats.B_cur
    before = host.instances[0].stats()["preemptions"]
    while not r.done:
        host.step()
    assert host.instances[0].stats()["preemptions"] > before
    assert finish(host, reqs) == want
