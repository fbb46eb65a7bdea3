"""Flying Serving on a replicated host (gyges.flying): DP <-> TP switches move nothing, paused
requests keep their KV, soft preemption recomputes exactly what ran in DP mode, and every token is
the one a static 4xTP1 or TP4 host gives."""
import warnings

import numpy as np
import pytest

import gyges
from gyges.reconfig import ReconfigurationWarning, TransformError

MEM = "48MiB"


@pytest.fixture(scope="module")
def tiny():
    return gyges.Model.tiny()


def replicated(model, layout="4xTP1", memory=MEM):
    return gyges.Host(model, workers=4, memory_per_worker=memory, layout=layout,
                      weights="replicated")


def prompts(n, seed=0, lo=4, hi=60):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 4096, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def static_tokens(model, layout, ps, params):
    with gyges.Host(model, workers=4, memory_per_worker=MEM, layout=layout) as h:
        return [r.output_tokens for r in h.generate(ps, params)]


def weight_state(host):
    """Every worker's weight pages (slot -> physical page) and their bytes."""
    out = []
    for w in range(host.n_workers):
        worker = host.worker(w)
        table = worker.arena.page_table()
        weights = table[:worker.weights.end_slot]
        view = worker.arena.view(0, worker.weights.end_slot)
        out.append((weights["page"].tobytes(), view.tobytes()))
        del view
    return out


def paused_state(host, requests):
    """Per request: its tokens, and per worker of its instance its block table and K/V."""
    out = {}
    for r in requests:
        seqs = host.kv_sequences(r)
        kv = {}
        for w, seq in seqs.items():
            cache = host.worker(w).kv
            kv[w] = (cache.block_table(seq).tolist(),
                     [cache.gather(seq, layer) for layer in range(cache.n_layers)])
        out[r.id] = (list(r.output_tokens), kv)
    return out


def same_paused_state(a, b):
    if a.keys() != b.keys():
        return False
    for rid in a:
        (ta, kva), (tb, kvb) = a[rid], b[rid]
        if ta != tb or kva.keys() != kvb.keys():
            return False
        for w in kva:
            if kva[w][0] != kvb[w][0]:
                return False
            for (ka, va), (kb, vb) in zip(kva[w][1], kvb[w][1]):
                if not (np.array_equal(ka, kb) and np.array_equal(va, vb)):
                    return False
    return True


def test_a_kv_view_reads_the_same_bytes_in_longer_blocks_of_fewer_heads(tiny):
    arena = gyges.Arena(budget="4MiB", page_size="64KiB")
    base = gyges.KVCache(arena, n_layers=2, n_kv_heads=4, head_dim=8, block_size=4)
    view = base.view(2)
    assert (view.n_kv_heads, view.block_size, view.block_bytes) == (2, 8, base.block_bytes)
    view.grow(1)
    assert base.n_blocks == view.n_blocks > 0
    dp, tp = base.new_sequence(), view.new_sequence()
    base.reserve(dp, 6)
    view.reserve(tp, 11)
    assert len(base.block_table(dp)) == 2 and len(view.block_table(tp)) == 2
    assert not set(base.block_table(dp)) & set(view.block_table(tp))
    assert base.free_blocks == view.free_blocks == base.n_blocks - 4
    rng = np.random.default_rng(0)
    k, v = rng.standard_normal((2, 11, 2, 8)).astype(np.float32)
    view.write(tp, 1, 0, k, v)
    logical = view.layer(1)  # (kv, block, token, head, dim) in the view's geometry
    table = view.block_table(tp)
    for t in range(11):
        assert np.array_equal(logical[0, table[t // 8], t % 8], k[t])
        assert np.array_equal(logical[1, table[t // 8], t % 8], v[t])
    del logical
    with pytest.raises(gyges.InvalidArgumentError, match="factor 3 must divide"):
        base.view(3)
    with pytest.raises(gyges.BusyError, match="view"):
        base.reshape(2)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("preempt", ["wait", "soft", "hard"])
def test_switches_at_random_steps_keep_every_token(tiny, temperature, preempt):
    params = gyges.SamplingParams(max_tokens=20, temperature=temperature, top_k=40, seed=11,
                                  ignore_eos=True)
    ps = prompts(14, seed=3)
    want = static_tokens(tiny, "4xTP1", ps, params)
    assert want == static_tokens(tiny, "TP4", ps, params)
    rng = np.random.default_rng({"wait": 1, "soft": 2, "hard": 3}[preempt] + int(temperature))
    host = replicated(tiny)
    requests, modes_seen, switches = {}, set(), []
    for i in range(6):
        requests[i] = host.submit(ps[i], params)
    groups = [((0, 1, 2, 3), 4), ((0, 1), 2), ((2, 3), 2)]
    # a TP4 episode and a TP2 one for sure, and random switches around them
    planned = {2: ((0, 1, 2, 3), 4), 20: ((0, 1, 2, 3), 1), 21: ((2, 3), 2)}
    step = 0
    while host.has_unfinished() or len(requests) < len(ps):
        if len(requests) < len(ps) and rng.random() < 0.4:
            i = len(requests)
            tp = [None, None, 2, 4][rng.integers(4)]
            requests[i] = host.submit(ps[i], params, tp=tp)
        step += 1
        if step in planned or (step > 45 and rng.random() < 0.3):
            workers, tp = planned.get(step) or groups[rng.integers(len(groups))]
            if step not in planned and rng.random() < 0.4:
                tp = 1
            try:
                switches.append(host.switch(workers, tp, preempt))
            except gyges.BusyError:
                pass  # overlaps an engaged group
        host.step()  # never stuck: a group with no TP work and DP work waiting is released
        modes_seen.update(host.modes())
    assert {"TP4", "TP2"} <= modes_seen
    assert [requests[i].output_tokens for i in range(len(ps))] == want
    assert all(r.finish_reason == "length" for r in requests.values())
    for s in switches:
        assert s.stats["weight_bytes_copied"] == s.stats["pages_mapped"] == 0
        assert s.stats["communicators_created"] == 0


def test_hard_preemption_pauses_dp_requests_with_their_kv_untouched(tiny):
    params = gyges.SamplingParams(max_tokens=30, ignore_eos=True)
    ps = prompts(5, seed=5, lo=20, hi=40)
    host = replicated(tiny)
    dp = [host.submit(p, params) for p in ps[:4]]
    for _ in range(3):
        host.step()
    assert host.modes() == ["DP"] * 4
    before = paused_state(host, dp)
    weights = weight_state(host)
    urgent = host.submit(ps[4], params, tp=4, priority=1)  # binds at once (hard)
    assert host.modes() == ["TP4"] * 4
    steps = 0
    while not urgent.finished:
        host.step()
        steps += 1
        if not urgent.finished:
            assert same_paused_state(paused_state(host, dp), before)
    assert steps == 30 and host.modes() == ["DP"] * 4  # released by itself
    assert weight_state(host) == weights
    host.run()
    want = static_tokens(tiny, "4xTP1", ps, params)
    assert [r.output_tokens for r in dp + [urgent]] == want


def test_soft_preemption_recomputes_prompt_and_generated_tokens(tiny):
    params = gyges.SamplingParams(max_tokens=24, ignore_eos=True)
    host = replicated(tiny)
    # worker 0 stays busy for a while; workers 1-3 are idle
    long_dp = host.submit(prompts(1, seed=7)[0], gyges.SamplingParams(max_tokens=12,
                                                                      ignore_eos=True), tp=1)
    host.step()
    t = host.submit(prompts(1, seed=8)[0], params, tp=4)  # soft: starts on an idle member
    s = host.replicas.groups[(0, 4)].switch
    assert s.preempt == "soft" and s.stats["requests_soft_started"] == 1
    assert host.modes() == ["paused"] * 4
    generated_at_bind = None
    while not s.done:
        n = len(t.output_tokens)
        host.step()
        if s.done:
            generated_at_bind = n
    assert long_dp.finished and generated_at_bind > 0  # it made progress in DP mode
    assert s.stats["requests_recomputed"] == 1
    assert s.stats["tokens_recomputed"] == len(t.prompt) + generated_at_bind
    host.run()
    assert t.output_tokens == static_tokens(tiny, "TP4", [t.prompt], params)[0]


def test_wait_binds_only_when_every_member_is_idle(tiny):
    params = gyges.SamplingParams(max_tokens=8, ignore_eos=True)
    host = replicated(tiny)
    dp = [host.submit(p, gyges.SamplingParams(max_tokens=4 + 5 * i, ignore_eos=True))
          for i, p in enumerate(prompts(4, seed=9))]
    host.step()
    late = host.submit(prompts(1, seed=11)[0], params, instance=0)  # queued on worker 0's DP
    s = host.switch((0, 1, 2, 3), 4, preempt="wait")
    t = host.submit(prompts(1, seed=10)[0], params, tp=4)
    while not s.done:
        assert not t.output_tokens and host.modes() == ["paused"] * 4
        host.step()
    running = [host.replicas.dp[w].stats()["running"] for w in range(4)]
    assert running == [0, 0, 0, 0] and all(r.finished for r in dp)
    assert s.stats["wait_seconds"] > 0 and s.stats["requests_paused"] == 0
    while not t.finished:
        host.step()
    assert t.metrics.first_token >= max(r.metrics.finish for r in dp)
    assert not late.output_tokens  # held on a member until the release
    host.switch((0, 1, 2, 3), 1)
    host.run()
    assert late.finished and host.modes() == ["DP"] * 4


def test_a_request_too_long_for_one_worker_binds_four(tiny):
    params = gyges.SamplingParams(max_tokens=16, ignore_eos=True)
    host = replicated(tiny, memory="22MiB")
    dp_tokens = host.replicas.dp[0].capacity_blocks() * host.block_size
    tp4 = host.replicas.groups[(0, 4)].instance
    assert tp4.block_tokens == 4 * host.block_size
    assert tp4.capacity_blocks() * tp4.block_tokens == 4 * dp_tokens  # the pooled KV
    pair = host.submit(prompts(1, seed=11, lo=dp_tokens, hi=dp_tokens + 1)[0], params)
    assert host.modes() == ["TP2", "TP2", "DP", "DP"]  # the smallest group that holds it
    host.run()
    prompt = prompts(1, seed=12, lo=2 * dp_tokens, hi=2 * dp_tokens + 1)[0]
    r = host.submit(prompt, params)
    assert host.modes() == ["TP4"] * 4  # nobody was busy: bound at once
    host.run()
    with gyges.Host(tiny, workers=4, memory_per_worker="22MiB", layout="TP4") as ref:
        want = ref.generate([pair.prompt, prompt], params)
        assert [pair.output_tokens, r.output_tokens] == [w.output_tokens for w in want]
    assert host.modes() == ["DP"] * 4
    with pytest.raises(gyges.InvalidArgumentError, match="no instance holds"):
        host.submit(prompts(1, seed=13, lo=4 * dp_tokens, hi=4 * dp_tokens + 1)[0], params)


def test_twenty_round_trips_return_arenas_and_blocks_to_the_start(tiny):
    params = gyges.SamplingParams(max_tokens=60, ignore_eos=True)
    host = replicated(tiny)
    reqs = [host.submit(p, params) for p in prompts(4, seed=14)]
    host.step()
    start = [(host.worker(w).arena.stats()["bytes_in_use"], host.worker(w).kv.free_blocks,
              host.worker(w).kv.n_blocks) for w in range(4)]
    weights = weight_state(host)
    latencies = []
    for i in range(20):
        s = host.switch((0, 1, 2, 3), 4, preempt="hard")
        latencies.append(s.stats["switch_seconds"])
        assert host.modes() == ["TP4"] * 4
        r = host.switch((0, 1, 2, 3), 1)
        assert r.done and host.modes() == ["DP"] * 4
        assert [(host.worker(w).arena.stats()["bytes_in_use"], host.worker(w).kv.free_blocks,
                 host.worker(w).kv.n_blocks) for w in range(4)] == start
    assert weight_state(host) == weights
    assert max(latencies) < 0.05
    host.run()
    assert [r.output_tokens for r in reqs] == static_tokens(tiny, "4xTP1",
                                                            [r.prompt for r in reqs], params)


def test_refusals_change_nothing(tiny):
    host = replicated(tiny, layout="TP2+2xTP1")
    assert host.modes() == ["TP2", "TP2", "DP", "DP"] and host.layout() == "TP2+2xTP1"
    r = host.submit(prompts(1)[0], gyges.SamplingParams(max_tokens=40))
    host.step()
    for call, error, match in (
            (lambda: host.switch((1, 2), 2), gyges.InvalidArgumentError, "not an aligned group"),
            (lambda: host.switch((0, 1, 2), 3), gyges.InvalidArgumentError, "aligned group"),
            (lambda: host.switch((0, 1, 2, 3), 2), gyges.InvalidArgumentError, "binds 2 workers"),
            (lambda: host.switch((0, 1, 2, 3), 4), gyges.BusyError, "overlap the TP2 group"),
            (lambda: host.switch((2, 3), 2, preempt="now"), gyges.InvalidArgumentError,
             "preempt must be one of"),
            (lambda: host.transform((2, 3), 2), TransformError, "weights='replicated'"),
            (lambda: host.submit([1, 2], tp=3), gyges.InvalidArgumentError, "tp=3")):
        with pytest.raises(error, match=match):
            call()
        assert host.modes() == ["TP2", "TP2", "DP", "DP"] and host.layout() == "TP2+2xTP1"
    sharded = gyges.Host(tiny, workers=2, memory_per_worker=MEM)
    with pytest.raises(gyges.InvalidArgumentError, match="weights='replicated'"):
        sharded.switch((0, 1), 2)
    with pytest.raises(gyges.InvalidArgumentError, match="replicated host"):
        sharded.submit([1, 2], tp=2)
    with pytest.raises(gyges.InvalidArgumentError, match="weights must be"):
        gyges.Host(tiny, workers=2, memory_per_worker=MEM, weights="mirrored")
    with pytest.raises(gyges.InvalidArgumentError, match="pipelines need sharded"):
        gyges.Host(tiny, workers=2, memory_per_worker=MEM, layout="PP2", weights="replicated")
    host.run()
    assert r.finished and host.modes() == ["TP2", "TP2", "DP", "DP"]


def test_a_release_under_load_recomputes_tp_requests_in_dp(tiny):
    params = gyges.SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8, seed=5)
    ps = prompts(6, seed=15)
    host = replicated(tiny, layout="TP4")
    reqs = [host.submit(p, params) for p in ps]
    for _ in range(5):
        host.step()
    assert all(r.output_tokens for r in reqs[:4])
    done = sum(len(r.prompt) + len(r.output_tokens) for r in reqs)
    s = host.switch((0, 1, 2, 3), 1, preempt="soft")
    assert s.done and host.modes() == ["DP"] * 4
    assert s.stats["requests_recomputed"] == 6 and s.stats["tokens_recomputed"] == done
    for w in range(4):  # the TP blocks are free again: the requests wait to be recomputed
        assert host.worker(w).kv.free_blocks == host.worker(w).kv.n_blocks
    host.run()
    assert [r.output_tokens for r in reqs] == static_tokens(tiny, "4xTP1", ps, params)
    # a request that fits no single worker keeps its group: refused, nothing changed
    host = replicated(tiny, layout="TP4", memory="22MiB")
    cap = host.replicas.dp[0].capacity_blocks() * host.block_size
    long = host.submit(prompts(1, seed=16, lo=cap + 8, hi=cap + 9)[0], params)
    host.step()
    with pytest.raises(gyges.BusyError, match="fits no worker"):
        host.switch((0, 1, 2, 3), 1, preempt="hard")
    assert host.modes() == ["TP4"] * 4
    host.run()
    assert long.finished and len(long.output_tokens) == 24


@pytest.mark.parametrize("operation", ["release", "bind"])
def test_an_allocation_failing_in_a_switch_loses_no_request(tiny, operation):
    """Every host allocation a release under load makes, and every 25th of a soft bind's steps,
    fails in turn: the release raises, rolled back with nothing changed; a bind's failure is
    rolled back and reported on its handle (or, in an instance's step, raised by the step);
    either way serving goes on to the same tokens."""
    params = gyges.SamplingParams(max_tokens=12, ignore_eos=True)
    ps = [[1 + i, 2, 3, 4 + i] * 5 for i in range(6)]
    want = static_tokens(tiny, "4xTP1", ps, params)

    def setup():
        if operation == "release":
            host = replicated(tiny, layout="TP4")
            reqs = [host.submit(p, params) for p in ps]
            host.step()
            host.step()
            return host, reqs, lambda: host.switch((0, 1, 2, 3), 1, preempt="soft")
        host = replicated(tiny)
        reqs = [host.submit(p, params, instance=0) for p in ps[:2]]
        host.step()
        reqs += [host.submit(p, params, tp=4) for p in ps[2:]]  # soft: start on idle members
        return host, reqs, lambda: [host.step() for _ in range(30)]

    host, reqs, op = setup()
    n, _ = gyges.testing.count("alloc", op)
    assert n > 0
    stride = 1 if operation == "release" else 25
    rolled_back = 0
    for k in range(1, n + 1, stride):
        host, reqs, op = setup()
        before = gyges.testing.snapshot(host)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ReconfigurationWarning)
            with gyges.testing.inject("alloc", k) as fired:
                try:
                    op()
                    raised = None
                except gyges.Error as e:
                    raised = e
        assert fired() == 1
        if operation == "release":
            assert raised is not None and raised.reconfiguration.rolled_back
            assert gyges.testing.snapshot(host) == before  # the same requests, KV and pages
            rolled_back += 1
        host.run()
        assert [r.output_tokens for r in reqs] == want, k
        host.close()
    assert operation == "bind" or rolled_back > 0


def test_a_mixed_host_switches_its_replicas_and_transforms_its_shards_side_by_side(tiny):
    """weights=[...] per worker: the sharded part merges (Gyges) while the replicated part binds
    (Flying Serving), in one step loop; each refuses the other's call by the workers named;
    every token is a static host's; and bad weights lists are refused."""
    weights = ["sharded"] * 4 + ["replicated"] * 4
    host = gyges.Host(tiny, workers=8, memory_per_worker=MEM, layout="PP[3,1]+2xTP1+4xTP1",
                      weights=weights)
    assert host.weights == "mixed" and host.weights_of(range(4)) == {"sharded"}
    assert host.layout() == "PP[3,1]+6xTP1"   # (a layout names instances, not weights)
    assert host.modes() == ["TP1"] * 4 + ["DP"] * 4
    ps = prompts(12, seed=3)
    params = gyges.SamplingParams(max_tokens=10, ignore_eos=True)
    rs = [host.submit(p, params) for p in ps[:8]]
    host.step()
    dp = [i for i in host.instances if list(i.workers) in ([4], [5])]
    for call, match in ((lambda: host.switch((2, 3), 2), "keep their shards"),
                        (lambda: host.transform((4, 5), 2), "weights='replicated'"),
                        (lambda: host.buddy(dp), "sharded workers")):
        with pytest.raises(gyges.Error, match=match):
            call()
        assert host.layout() == "PP[3,1]+6xTP1" and not host.reconfigurations
    merge = host.transform((2, 3), 2, layers_per_step=1)
    bind = host.switch(range(4, 8), 4, preempt="soft")
    rs += [host.submit(p, params, tp=4) for p in ps[8:]]
    host.run()
    assert merge.committed and bind.committed
    assert host.layout() == "PP[3,1]+TP2+TP4"
    assert host.modes() == ["TP1", "TP1", "TP2", "TP2"] + ["TP4"] * 4
    want = static_tokens(tiny, "4xTP1", ps, params)
    assert [r.output_tokens for r in rs] == want
    host.close()
    for bad, match in ((["replicated"] * 2 + ["sharded"] * 2, None),  # (aligned: allowed)
                       (["sharded", "replicated", "replicated", "sharded"], "aligned group"),
                       (["sharded"] * 3, "for each of the 4 workers"),
                       (["sharded"] * 3 + ["mirrored"], "for each of the 4 workers")):
        if match is None:
            gyges.Host(tiny, workers=4, memory_per_worker=MEM, weights=bad).close()
            continue
        with pytest.raises(gyges.InvalidArgumentError, match=match):
            gyges.Host(tiny, workers=4, memory_per_worker=MEM, weights=bad)
    with pytest.raises(gyges.InvalidArgumentError, match="sharded and replicated workers"):
        gyges.Host(tiny, workers=4, memory_per_worker=MEM, layout="TP4",
                   weights=["sharded"] * 2 + ["replicated"] * 2)
