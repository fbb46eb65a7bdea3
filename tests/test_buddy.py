"""KunServe's buddy groups on a real host (gyges.reconfig.kunserve.form / restore through host.buddy and
host.restore): tokens bit-identical to one worker, memory to the page, restores byte-identical,
refusals that change nothing, and random sequences that lose nothing."""
import numpy as np
import pytest
from test_pipelive import finish, prompts, reference

import gyges


@pytest.fixture(scope="module")
def tiny():
    return gyges.Model.tiny()


def params(temperature, tokens=24):
    return gyges.SamplingParams(max_tokens=tokens, temperature=temperature, top_k=50, seed=5,
                                ignore_eos=True)


def in_use(host):
    return [host.worker(i).arena.stats()["bytes_in_use"] for i in range(host.n_workers)]


@pytest.mark.parametrize("g", [2, 4])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_victims_in_every_state_keep_their_tokens(tiny, g, temperature):
    """Requests in prefill (chunked), in decode and queued (more than max_running) when the
    group forms, through a restore: the tokens of one worker."""
    ps = prompts(16, seed=g, lo=30, hi=120)
    p = params(temperature)
    want = reference(tiny, ps, p)
    host = gyges.Host(tiny, workers=4, memory_per_worker="32MiB", layout="4xTP1",
                      max_batch_tokens=48, max_prefill_chunk=16, max_running=16)
    reqs = [host.submit(q, p, instance=i % 4) for i, q in enumerate(ps)]
    for _ in range(4):
        host.step()
    assert any(not q.output_tokens and q.metrics.scheduled != q.metrics.scheduled for q in reqs)
    b = host.buddy(host.instances[:g])
    assert host.layout() == ("PP2+2xTP1" if g == 2 else "PP4")
    assert b.stats["kv_bytes_exchanged"] > 0
    for _ in range(6):
        host.step()
    late = [host.submit(q, p) for q in prompts(2, 9)]  # new requests enter the pipeline too
    host.restore(b)
    assert host.layout() == "4xTP1"
    assert finish(host, reqs) == want
    assert finish(host, late) == reference(tiny, prompts(2, 9), p)


def test_dropping_frees_exactly_the_layers_and_kv_grows_by_it(tiny):
    host = gyges.Host(tiny, workers=2, memory_per_worker="32MiB", layout="2xTP1")
    ws = [host.worker(i) for i in range(2)]
    page = ws[0].page_size
    before = in_use(host)
    runs = ws[0].weights.runs
    b = host.buddy(host.instances)
    # worker 0 gave away layers 2, 3 and the head; worker 1 layers 0, 1 and the embedding
    layer = ws[0].weights.layer_bytes(0)
    head, embed = runs["head"][1] * page, runs["embed"][1] * page
    assert in_use(host) == [before[0] - 2 * layer - head, before[1] - 2 * layer - embed]
    assert b.stats["weight_bytes_released"] == 4 * layer + head + embed
    # KV: each stage's budget left after its weights, over its 2 layers, the least of the two
    bpp = ws[0].kv.blocks_per_page()
    want = min(int((w.arena.stats()["budget_bytes"] - w.arena.stats()["bytes_in_use"])
                   // page // 2 * bpp) for w in ws)
    assert b.instance.capacity_blocks() == want
    full = int((ws[0].arena.stats()["budget_bytes"] - before[0]) // page // 4 * bpp)
    assert want > 2 * full  # half the layers per worker, and their weights gone too


def weights_of(worker):
    w = worker.weights
    return {name: w.read(name) for name in w.offsets} | \
           {(l, k): w.read_ffn(l, k) for l in w.held_layers for k in ("gate", "up", "down")}


@pytest.mark.parametrize("source", ["peers", "host"])
def test_restore_is_byte_identical(tiny, source):
    host = gyges.Host(tiny, workers=2, memory_per_worker="32MiB", layout="2xTP1")
    want = [weights_of(host.worker(i)) for i in range(2)]
    before = in_use(host)
    b = host.buddy(host.instances)
    host.restore(b, weights_from=source)
    for i in range(2):
        got = weights_of(host.worker(i))
        assert got.keys() == want[i].keys()
        for key in got:
            np.testing.assert_array_equal(got[key], want[i][key])
    for i in range(2):
        host.worker(i).kv.trim()
    assert in_use(host) == before


@pytest.mark.parametrize("source", ["peers", "host"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_live_restore_streams_the_weights_back_while_serving(tiny, source, temperature):
    """KunServe 4.3: after a live exchange, host.restore(live=True) brings each member's layers
    back one a step while the group serves as a pipeline, then sends the requests home: tokens
    of one worker, weights byte-identical, every page back once idle; nothing else may change
    the group meanwhile."""
    ps = prompts(8, seed=3, lo=30, hi=80)
    p = params(temperature, tokens=40)
    host = gyges.Host(tiny, workers=2, memory_per_worker="32MiB", layout="2xTP1")
    want_weights = [weights_of(host.worker(i)) for i in range(2)]
    start = in_use(host)
    reqs = [host.submit(q, p, instance=i % 2) for i, q in enumerate(ps)]
    host.step()
    b = host.buddy(host.instances, live=True)
    while not b.exchange.done:
        host.step()
    host.restore(b, weights_from=source, live=True)
    assert host.layout() == "PP2" and not b.restoring.done
    with pytest.raises(gyges.BusyError, match="under way"):
        host.restore(b)
    with pytest.raises(gyges.Error, match="under way"):
        host.reconfigure(host.instances[0], [1, 3])   # a re-split of the group meanwhile
    served, steps = sum(len(r.output_tokens) for r in reqs), 0
    while not b.restoring.done:
        host.step()
        steps += 1
    assert steps >= 2 and sum(len(r.output_tokens) for r in reqs) > served  # it served meanwhile
    assert host.layout() == "2xTP1" and b.restored and host.has_unfinished()
    assert b.stats["weight_bytes_restored"] > 0 and b.stats["kv_bytes_returned"] > 0
    assert b.stats["restore_stall_seconds"] < b.stats["restore_seconds"]
    assert finish(host, reqs) == reference(tiny, ps, p)
    for i in range(2):
        got = weights_of(host.worker(i))
        assert got.keys() == want_weights[i].keys()
        assert all(np.array_equal(got[k], want_weights[i][k]) for k in got)
        host.worker(i).kv.trim()
    assert in_use(host) == start


def test_refusals_change_nothing(tiny):
    host = gyges.Host(tiny, workers=4, memory_per_worker="32MiB", layout="4xTP1")
    reqs = [host.submit(q, params(0.0), instance=i % 4) for i, q in enumerate(prompts(4, 1))]
    host.step()
    state = in_use(host), host.layout()
    a, b, c, _ = host.instances
    for instances in ([a, b, c],   # 3 does not divide 4 layers
                      [a, c],      # not neighbours
                      [a],         # not a group
                      (0, 7),      # no instance 7
                      a):          # not a list
        with pytest.raises(gyges.InvalidArgumentError):
            host.buddy(instances)
        assert (in_use(host), host.layout()) == state
    for bad in ({"link": 25e9}, {"layers_per_step": 0}):
        with pytest.raises(gyges.InvalidArgumentError, match=next(iter(bad))):
            host.buddy(host.instances[:2], live=True, **bad)
        assert (in_use(host), host.layout()) == state
    b = host.buddy((0, 1), live=True)   # indices into host.instances, as the issue writes it
    assert host.layout() == "PP2+2xTP1"
    state = in_use(host), host.layout()
    with pytest.raises(gyges.BusyError, match="Buddy.*under way"):
        host.restore(b)   # the victims' KV has not moved yet
    assert (in_use(host), host.layout()) == state
    finish(host, reqs)
    assert b.exchange.done
    for bad, cls in (({"weights_from": "disk"}, gyges.InvalidArgumentError),
                     ({"live": True, "layers_per_step": 0}, gyges.InvalidArgumentError),
                     ({"live": True, "link": 1e9}, gyges.InvalidArgumentError)):
        with pytest.raises(cls):
            host.restore(b, **bad)
        assert b.restoring is None and host.layout() == "PP2+2xTP1"
    host.restore(b)


def victims_in_every_state(host, p):
    """Requests on every instance, two of them long (a chunked prefill of some 19 steps), until
    the small caches preempted some on the first two instances; then two more, queued. Returns
    them in VICTIM_PROMPTS' order."""
    reqs = [host.submit(q, p, instance=i % 4) for i, q in enumerate(VICTIM_PROMPTS[:18])]
    for _ in range(30):
        host.step()
        if any(i.stats()["preempted_queued"] for i in host.instances[:2]):
            break
    reqs += [host.submit(q, p, instance=i) for i, q in enumerate(VICTIM_PROMPTS[18:])]
    st = [i.stats() for i in host.instances[:2]]
    assert sum(x["preempted_queued"] for x in st) and sum(x["waiting"] for x in st)
    assert any(r.output_tokens for r in reqs[:16])
    assert not reqs[16].output_tokens and not reqs[17].output_tokens   # mid-prefill
    return reqs


VICTIM_PROMPTS = prompts(16, seed=2, lo=30, hi=120) + prompts(2, 7, 300, 310) + \
    prompts(2, 8, 30, 40)


@pytest.mark.parametrize("g", [2, 4])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_live_exchange_attends_remotely_and_keeps_every_token(tiny, g, temperature):
    """KunServe 4.2: the group serves at once; the victims (decoding, preempted, in prefill,
    queued) attend remotely on the worker holding each layer's KV until it has moved, a layer
    per step. Their tokens, and those of requests that came during it, are one worker's, and
    through a restore."""
    p = params(temperature, tokens=48)
    host = gyges.Host(tiny, workers=4, memory_per_worker="22MiB", layout="4xTP1",
                      max_batch_tokens=48, max_prefill_chunk=16, max_running=24)
    reqs = victims_in_every_state(host, p)
    b = host.buddy(host.instances[:g], live=True)
    assert not b.exchange.done and b.stats["kv_bytes_exchanged"] == 0
    late = [host.submit(q, p) for q in prompts(2, 9)]
    steps = 0
    while not b.exchange.done:
        host.step()
        steps += 1
    assert steps >= 2
    assert b.stats["remote_attention_calls"] > 0 and b.stats["kv_bytes_exchanged"] > 0
    assert b.stats["remote_attention_bytes"] == \
        b.instance.remote_stats()["token_layers"] * b.exchange.row_bytes
    # the caches keep their own layers once all has moved
    assert [(host.worker(w).kv.first_layer, host.worker(w).kv.first_layer +
             host.worker(w).kv.n_layers) for w in b.workers] == list(b.ranges)
    while True:   # the weights come back once the requests leave room for them (in caches
        try:      # this small, when they are gone: free blocks between used ones stay mapped)
            host.restore(b)
            break
        except gyges.OutOfMemoryError:
            host.step()
    assert finish(host, reqs) == reference(tiny, VICTIM_PROMPTS, p)
    assert finish(host, late) == reference(tiny, prompts(2, 9), p)


def test_a_link_stalls_a_blocking_exchange_but_not_a_live_one(tiny):
    """With a paced link, a blocking exchange stops serving for at least the KV's time on the
    link; a live one stops for none of it, moves the KV with what the link leaves over across
    several steps, and pays the link for its remote attention's round trips."""
    link = gyges.reconfig.Link(bandwidth=16e6, latency=20e-6)   # scaled: 128 Mbps
    out = {}
    for live in (False, True):
        p = params(0.0, tokens=96)
        host = gyges.Host(tiny, workers=2, memory_per_worker="32MiB", layout="2xTP1",
                          max_batch_tokens=64)
        ps = prompts(6, seed=4, lo=60, hi=120)
        reqs = [host.submit(q, p, instance=i % 2) for i, q in enumerate(ps)]
        for _ in range(8):
            host.step()
        b = host.buddy(host.instances, live=live, link=link)
        steps = 0
        while b.exchange is not None and not b.exchange.done:
            host.step()
            steps += 1
        host.restore(b)   # in flight
        assert host.has_unfinished()
        assert finish(host, reqs) == reference(tiny, ps, p)
        out[live] = b.stats, steps
    (blocking, _), (live, steps) = out[False], out[True]
    assert blocking["stall_seconds"] >= link.seconds(blocking["kv_bytes_exchanged"])
    assert live["stall_seconds"] < link.seconds(blocking["kv_bytes_exchanged"]) / 4
    assert steps >= 3 and live["remote_attention_calls"] > 0
    assert live["activation_seconds"] == pytest.approx(
        2 * live["remote_attention_calls"] * link.latency +
        live["remote_attention_bytes"] / link.bandwidth)


def test_an_exchange_that_does_not_fit_is_taken_back(tiny):
    """Long requests on both members fill their caches: the copies of each other's half do not
    fit even with the weights dropped; the buddy is refused and every page and layer is back."""
    host = gyges.Host(tiny, workers=2, memory_per_worker="36MiB", layout="2xTP1",
                      max_batch_tokens=16384)
    p = params(0.0, tokens=4)
    reqs = [host.submit(q, p, instance=i % 2) for i, q in enumerate(prompts(8, 2, 900, 1000))]
    host.step()
    state = in_use(host), host.layout(), [sorted(host.worker(i).weights.held_layers) for i in range(2)]
    with pytest.raises(gyges.OutOfMemoryError):
        host.buddy(host.instances)
    for i in range(2):
        host.worker(i).kv.trim()
    assert (in_use(host), host.layout(),
            [sorted(host.worker(i).weights.held_layers) for i in range(2)]) == state
    assert finish(host, reqs) == reference(tiny, prompts(8, 2, 900, 1000), p)


@pytest.mark.parametrize("seed, faults", [(0, False), (1, True)])
def test_random_drop_exchange_restore_sequences_lose_nothing(tiny, seed, faults):
    """gyges.testing.soak_buddy: random formations and restores (blocking and live, g = 2 and 4,
    from peers and host) while requests arrive at every step, with and without faults inside
    them: every request finishes with a plain engine's tokens, every group formed is restored,
    and every worker holds exactly a fresh host's pages. (benchmarks/soak_kunserve.py runs a
    thousand of them.)"""
    from gyges.testing import soak_buddy
    r = soak_buddy(tiny, seed=seed, operations=40, faults=faults)
    assert r["formed"] >= 5 and r["restored"] == r["formed"]
    assert r["lost"] == r["mismatches"] == 0 and r["requests"] > 50
    assert r["page_delta"] == [0, 0, 0, 0] and r["layout"] == "4xTP1"


def sweep_live(tiny, begin, sites, most, again=None, make_host=None, want=None, after=None):
    """Every event of each fault site (spread, at most `most` a site) in driving a live
    operation to its end fails in turn: host.step raises, or the layer waits and later steps
    finish it, or (a failure of its switch) it is rolled back and again(host, t) starts it anew;
    the tokens are one worker's (`want(ps, p)`, by default a CPU engine's). begin(host) starts
    the operation on two TP1 instances (of make_host(), by default CPU ones) that have run a
    step, and returns what its `done` ends; after(host), when given, checks each host once its
    requests have finished; returns the last one."""
    from gyges.testing import count, inject, spread
    ps = prompts(4, seed=3, lo=30, hi=50)
    p = params(0.0, tokens=16)
    want = want(ps, p) if want is not None else reference(tiny, ps, p)
    make_host = make_host or (lambda: gyges.Host(tiny, workers=2, memory_per_worker="32MiB",
                                                 layout="2xTP1"))

    def setup():
        host = make_host()
        reqs = [host.submit(q, p, instance=i % 2) for i, q in enumerate(ps)]
        host.step()
        return host, reqs, begin(host)

    def drive(host, t):
        while not t.done:
            host.step()
    for site in sites:
        host, _, t = setup()
        events, _ = count(site, lambda: drive(host, t))
        assert events > 0
        for n in spread(events, most):
            host, reqs, t = setup()
            with inject(site, n) as fired:
                try:
                    drive(host, t)
                except gyges.Error:
                    pass
                assert fired() == 1
            drive(host, t)
            if t.rolled_back:
                assert again is not None, t.error
                t = again(host, t)
                drive(host, t)
            assert t.committed
            assert finish(host, reqs) == want
            if after is not None:
                after(host)
            host.close()
    return t


def test_a_failed_exchange_step_is_tried_again(tiny):
    """A layer's copy failing in a live exchange's advance: the layer still attends remotely
    and a later step moves it (sweep_live)."""
    t = sweep_live(tiny, lambda host: host.buddy(host.instances, live=True).exchange, ["copy"], 6)
    assert t.stats["remote_attention_calls"] > 0


def test_a_failed_layer_of_a_live_restore_is_tried_again(tiny):
    """A live restore's weights or KV failing (allocations, page maps, copies) in an advance:
    the layer waits or is copied again, and a later step brings it; a failure in its switch
    rolls it back, the group serving on, and a new restore completes (sweep_live)."""
    def begin(host):
        b = host.buddy(host.instances)
        host.step()
        return host.restore(b, live=True)
    t = sweep_live(tiny, begin, ["alloc", "page_map", "copy"], 4,
                   again=lambda host, t: host.restore(t.buddy, live=True))
    assert t.buddy.restored


def sweep_buddy(make_host, ps, p, want, site, op, most=10):
    """Every event of `site` in forming a group of make_host()'s two TP1 instances (or in
    restoring one), up to `most` spread over them, fails in turn: the call either works or raises
    with the layout, every worker's pages (idle pages trimmed) and layers as before, and the
    requests finish with `want`. Returns the calls refused."""
    from gyges.testing import count, inject, spread

    def setup():
        host = make_host()
        reqs = [host.submit(q, p, instance=i % 2) for i, q in enumerate(ps)]
        host.step()
        b = host.buddy(host.instances) if op == "restore" else None
        host.step()
        call = (lambda: host.restore(b)) if op == "restore" else (lambda: host.buddy(host.instances))
        return host, reqs, call

    def state(host):
        for i in range(2):
            host.worker(i).kv.trim()
        return in_use(host), host.layout(), [sorted(host.worker(i).weights.held_layers)
                                             for i in range(2)]
    host, _, call = setup()
    events, _ = count(site, call)
    assert events > 0
    refused = 0
    for n in spread(events, most):
        host, reqs, call = setup()
        before = state(host)
        try:
            with inject(site, n) as fired:
                call()
        except gyges.Error:
            assert fired() == 1
            assert state(host) == before
            refused += 1
        assert finish(host, reqs) == want
        host.close()
    return refused


@pytest.mark.parametrize("site", ["alloc", "page_map", "page_create", "copy"])
@pytest.mark.parametrize("op", ["buddy", "restore"])
def test_a_failed_buddy_or_restore_changes_nothing(tiny, site, op):
    """sweep_buddy on CPU workers: some of the failures refuse the call."""
    ps = prompts(4, seed=3, lo=30, hi=50)
    p = params(0.0, tokens=12)
    assert sweep_buddy(lambda: gyges.Host(tiny, workers=2, memory_per_worker="32MiB",
                                          layout="2xTP1"),
                       ps, p, reference(tiny, ps, p), site, op) > 0
