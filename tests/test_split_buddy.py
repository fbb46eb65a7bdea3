"""KunServe buddy groups whose members sit on different hosts: a pipeline split between two
processes (engine/peer.h, reconfig/split_buddy.py, distributed/split_group.py).

What is checked, against a Host that never formed a group (exact): the leader's and the
follower's engines together give one engine's tokens and logprobs (greedy and seeded, chunked
prefill, preemptions in the follower's KV); the follower's KV mirrors the leader's and is all
freed when the pair is idle; a leader step that fails after the follower ran is taken back on
both sides; in one process, a group formed and restored with requests in flight gives every
request one Host's tokens, with the bytes that crossed counted; on a 2-node Ray cluster, the
same through gyges.Cluster.buddy / restore, and a lost follower host leaves the leader serving
alone with nothing lost (those two in tests/test_distributed.py, on its Ray nodes)."""

import numpy as np
import pytest

import gyges
from gyges import _C
from gyges.reconfig.split_buddy import Follow, Lead
from gyges.runtime.engine import InstanceLoop

GREEDY = gyges.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SEEDED = gyges.SamplingParams(max_tokens=24, temperature=0.9, top_k=40, seed=5, ignore_eos=True,
                              logprobs=2)


@pytest.fixture(scope="module")
def tiny():
    return gyges.Model.tiny()


def prompts(n, seed, lo=3, hi=40):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(1, 4000, rng.integers(lo, hi))] for _ in range(n)]


def reference(model, ps, params, memory="32MiB", **kw):
    host = gyges.Host(model, workers=1, memory_per_worker=memory, **kw)
    out = host.generate(ps, params)
    host.close()
    return [(r.output_tokens, r.logprobs) for r in out]


def pair(model, memory="32MiB", **kw):
    """A leader engine over layers [0, L/2) of one host's worker and a follower over the rest
    of another's, joined by a direct outlet that counts its calls."""
    L = model.config.num_hidden_layers
    a = gyges.Host(model, workers=1, memory_per_worker=memory, **kw)
    b = gyges.Host(model, workers=1, memory_per_worker=memory, **kw)
    wa, wb = a.worker(0), b.worker(0)
    lead = _C.Engine([[wa.model_for_layers(0, L // 2)]], [[wa.kv.handle]], [None],
                     a.max_batch_tokens, a.max_running, a.max_prefill_chunk,
                     layers=[(0, L // 2)], span=(0, L // 2))
    follow = _C.Engine([[wb.model_for_layers(L // 2, L)]], [[wb.kv.handle]], [None],
                       b.max_batch_tokens, b.max_running, b.max_prefill_chunk,
                       layers=[(L // 2, L)], span=(L // 2, L))
    return a, b, lead, follow


def assert_mirrored(a, b, lead, follow, ids):
    """Between steps, once told of every release, the follower holds a sequence exactly for the
    requests the leader holds one for, each as many tokens long."""
    lead.peer_flush()
    ka, kb = a.worker(0).kv, b.worker(0).kv
    for rid in ids:
        mine = lead.export(rid)["seqs"][0] if rid in lead.request_ids() else -1
        theirs = follow.follow_seqs(rid)[0]
        assert (mine >= 0) == (theirs >= 0), (rid, mine, theirs)
        if mine >= 0:
            assert ka.n_tokens(mine) == kb.n_tokens(theirs), rid
    assert ka.stats()["n_sequences"] == kb.stats()["n_sequences"]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_split_pipeline_gives_one_engines_tokens(tiny, params):
    ps = prompts(6, seed=1)
    want = reference(tiny, ps, params, max_prefill_chunk=16)
    a, b, lead, follow = pair(tiny, max_prefill_chunk=16)
    calls = []

    def outlet(step):
        calls.append(step)
        return follow.follow(step)
    with pytest.raises(gyges.StateError, match="follower is attached"):
        lead.step(0.0)
    lead.set_outlet(outlet, follow.stats()["capacity_blocks"])
    loop = InstanceLoop(lead, tiny.config, a.clock, seed=0)
    handles = [loop.add(i, p, params) for i, p in enumerate(ps)]
    used = []
    while loop.unfinished():
        loop.step()
        used.append((a.worker(0).kv.stats()["n_sequences"], b.worker(0).kv.stats()["n_sequences"]))
    assert [(h.output_tokens, h.logprobs) for h in handles] == want
    # the follower holds a sequence for each the leader holds, a step behind on releases
    assert all(f >= l for l, f in used)
    lead.peer_flush()
    assert b.worker(0).kv.stats()["n_sequences"] == 0 == a.worker(0).kv.stats()["n_sequences"]
    # every row the leader ran crossed, with its hidden state
    rows = sum(len(c["tokens"]) // 4 for c in calls if c is not None)
    assert rows == sum(len(p) + params.max_tokens - 1 for p in ps)
    with pytest.raises(gyges.StateError, match="follows another engine"):
        follow.step(0.0)


def test_the_followers_kv_mirrors_the_leaders_under_preemption(tiny):
    """A KV budget that preempts: the follower frees what the leader's schedule released before
    reserving, so it never runs out where the leader did not, and the tokens stay exact."""
    ps = prompts(12, seed=2, lo=60, hi=100)
    params = gyges.SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    want = reference(tiny, ps, params, memory="24MiB")
    a, b, lead, follow = pair(tiny, memory="24MiB")
    lead.set_outlet(follow.follow, follow.stats()["capacity_blocks"])
    loop = InstanceLoop(lead, tiny.config, a.clock, seed=0)
    handles = [loop.add(i, p, params) for i, p in enumerate(ps)]
    while loop.unfinished():
        loop.step()
    assert lead.stats()["preemptions"] > 0
    assert [(h.output_tokens, h.logprobs) for h in handles] == want


def test_a_leader_step_whose_reply_is_lost_is_taken_back_on_both_sides(tiny):
    """The outlet fails after the follower ran the step (a lost reply: once on every step that
    preempted a request, whose KV the follower freed, and on some others), or before it reached
    the follower (a lost request): the leader's step is undone and the follower is told to take
    that step back, which it does only if it ran it; the retried steps give the same tokens."""
    ps = prompts(12, seed=2, lo=60, hi=100)
    params = gyges.SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    want = reference(tiny, ps, params, memory="24MiB")
    a, b, lead, follow = pair(tiny, memory="24MiB")
    seen = {"n": 0, "cancels": 0, "preempting": 0}

    def outlet(step):
        if step["cancel"]:
            seen["cancels"] += 1
            return follow.follow(step)
        seen["n"] += 1
        if seen["n"] in (3, 12, 20):
            raise RuntimeError("the request was lost")
        out = follow.follow(step)
        if step["n_released_now"] and seen.get("last") != "lost":
            seen["preempting"] += 1
            seen["last"] = "lost"
            raise RuntimeError("the reply was lost")
        seen["last"] = None
        if seen["n"] in (2, 5, 9):
            raise RuntimeError("the reply was lost")
        return out
    lead.set_outlet(outlet, follow.stats()["capacity_blocks"])
    loop = InstanceLoop(lead, tiny.config, a.clock, seed=0)
    handles = [loop.add(i, p, params) for i, p in enumerate(ps)]
    failures = 0
    while loop.unfinished():
        try:
            loop.step()
        except gyges.StateError as e:
            assert "was lost" in str(e)
            failures += 1
        assert_mirrored(a, b, lead, follow, range(len(ps)))
    assert seen["preempting"] > 0 and failures == 6 + seen["preempting"] == seen["cancels"]
    assert [(h.output_tokens, h.logprobs) for h in handles] == want
    lead.peer_flush()
    assert b.worker(0).kv.stats()["n_sequences"] == 0


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_group_across_two_hosts_forms_and_restores_in_flight(tiny, params):
    """Two one-worker hosts in this process: requests running on both, the group formed (the
    follower's requests move to the leader with their KV below the split, the leader's send
    theirs above it), served, restored (each request to the less loaded member with its KV of
    every layer): every request's tokens are one Host's, and the bytes that crossed are the
    KV of the layers each side gave up, to the byte."""
    cfg = tiny.config
    L, split = cfg.num_hidden_layers, cfg.num_hidden_layers // 2
    ps = prompts(6, seed=4)
    want = reference(tiny, ps, params)
    a = gyges.Host(tiny, workers=1, memory_per_worker="32MiB")
    b = gyges.Host(tiny, workers=1, memory_per_worker="32MiB")
    ra = [a.submit(p, params) for p in ps[:3]]
    rb = [b.submit(p, params) for p in ps[3:]]
    for _ in range(4):
        a.step()
        b.step()
    computed = {r.id: a.instances[0].info(r.id)["n_computed"] for r in ra}
    lead, follow = Lead(a, 0, split), Follow(b, 0, split)
    upper = lead.upper_kv()
    token_bytes = 2 * cfg.num_key_value_heads * cfg.head_dim * 4   # K and V of one token-layer
    assert sum(u.nbytes for u in upper.values()) == \
        sum(computed.values()) * (L - split) * token_bytes
    packets = follow.form(upper)
    moved, handles = lead.form(packets, follow.follow, follow.capacity_blocks)
    follow.adopt(moved)
    assert lead.stats["kv_bytes_received"] == sum(p.kv_bytes for _, p in packets) > 0
    assert lead.stats["weight_bytes_released"] > 0 and follow.stats["weight_bytes_released"] > 0
    assert b.instances == [] and a.layout() == "PP1"
    rb = [handles[moved[r.id]] for r in rb]
    # its KV is on two hosts: no request of the group leaves while it is formed
    with pytest.raises(gyges.BusyError, match=r"Lead\(worker 0, split 2, formed\)"):
        a.export_request(rb[0])
    for _ in range(6):
        a.step()
    assert follow.stats["steps"] >= 6
    go, stay = lead.split_homes()
    assert go and stay
    upper, back = follow.restore(go, stay)
    lead.restore(upper)
    assert a.layout() == b.layout() == "TP1"
    out = [back.get(r.id, r) if r.id in go else r for r in ra + rb]
    a.run()
    b.run()
    assert [(r.output_tokens, r.logprobs) for r in out] == want
    for h in (a, b):
        assert h.worker(0).kv.stats()["n_sequences"] == 0
        h.close()

