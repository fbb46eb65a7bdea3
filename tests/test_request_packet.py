"""A running request out of one Host and into another with its KV (Host.export_request,
Host.import_request; gyges/runtime/request_packet.py): what gyges.Cluster's migrations between
hosts move. Checked in one process, host to host: tokens equal one Host's that never moved them
(greedy and seeded, mid prefill and mid decode, into a TP2 instance and a pipeline), the KV
arrives bit for bit, every page goes back, and every refusal changes nothing.
Tolerance policy: exact."""
import numpy as np
import pytest

import gyges
from gyges.runtime.request_packet import RequestPacket
from gyges.testing import count, inject

GREEDY = gyges.SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
SEEDED = gyges.SamplingParams(max_tokens=20, temperature=0.9, top_k=40, seed=11, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    return gyges.Model.tiny()


def prompts(n, seed, lo, hi):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(1, 4000, rng.integers(lo, hi))] for _ in range(n)]


def host(model, layout="2xTP1", memory="32MiB", **kw):
    kw.setdefault("max_batch_tokens", 64)
    kw.setdefault("max_prefill_chunk", 16)
    return gyges.Host(model, workers=2, memory_per_worker=memory, layout=layout, **kw)


def reference(model, ps, params):
    h = host(model)
    out = [r.output_tokens for r in h.generate(ps, params)]
    h.close()
    return out


def mapped(h):
    return [h.worker(w).arena.stats()["bytes_in_use"] for w in range(h.n_workers)]


def in_use(h):
    for w in range(h.n_workers):
        h.worker(w).kv.trim()
    return [h.worker(w).arena.stats()["bytes_in_use"] for w in range(h.n_workers)]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("when", ["prefill", "decode"])
@pytest.mark.parametrize("to", ["1xTP2", "PP[3,1]", "2xTP1"])
def test_a_moved_request_gives_the_tokens_it_would_have_given(tiny, params, when, to):
    """Half the requests of a 2xTP1 host move to another host (a TP2 instance, a pipeline, or
    TP1 ones) mid chunked prefill or mid decode: every request's tokens are one Host's, and both
    hosts give every page back."""
    long = when == "prefill"
    ps = prompts(6, seed=3, lo=60 if long else 10, hi=100 if long else 40)
    want = reference(tiny, ps, params)
    a, b = host(tiny), host(tiny, to)
    start = [in_use(a), in_use(b)]
    reqs = [a.submit(p, params) for p in ps]
    for _ in range(2 if long else 6):
        a.step()
    moved = {}
    for i in range(0, len(reqs), 2):
        packet = a.export_request(reqs[i])
        assert isinstance(packet, RequestPacket)
        assert (packet.computed < len(ps[i])) if long else (len(packet.output) > 0)
        moved[i] = b.import_request(packet)
        assert moved[i].output_tokens == packet.output and not reqs[i].finished
    a.run()
    b.run()
    got = [moved[i] if i in moved else r for i, r in enumerate(reqs)]
    assert [r.output_tokens for r in got] == want
    assert all(r.finish_reason == "length" for r in got)
    assert [in_use(a), in_use(b)] == start


def test_the_kv_arrives_bit_for_bit(tiny):
    """The packet holds the source ranks' KV in the model's shape (K and V of every layer and
    head, each TP rank's slice in its place); once imported into a TP2 instance each rank's
    sequence holds its slice of it, every byte, and the sequence's tokens are the computed
    ones."""
    ps = prompts(2, seed=5, lo=30, hi=40)
    a, b = host(tiny, "1xTP2"), host(tiny, "1xTP2")
    reqs = [a.submit(p, GREEDY) for p in ps]
    for _ in range(5):
        a.step()
    inst = a.instances[0]
    seqs = inst.request_seqs(reqs[0].id)
    computed = inst.info(reqs[0].id)["n_computed"]
    source = [[inst.kvs[r].gather(seqs[r], layer, 0, computed) for layer in range(4)]
              for r in range(2)]
    packet = a.export_request(reqs[0])
    assert packet.kv.shape == (4, 2, computed, 4, tiny.config.head_dim)
    assert packet.kv_bytes == packet.kv.nbytes
    for r in range(2):
        for layer in range(4):
            k, v = source[r][layer]
            np.testing.assert_array_equal(packet.kv[layer, 0, :, 2 * r:2 * r + 2], k)
            np.testing.assert_array_equal(packet.kv[layer, 1, :, 2 * r:2 * r + 2], v)
    got = b.import_request(packet)
    dst = b.instances[0]
    dseqs = dst.request_seqs(got.id)
    for r in range(2):
        assert dst.kvs[r].n_tokens(dseqs[r]) == computed
        for layer in range(4):
            k, v = dst.kvs[r].gather(dseqs[r], layer, 0, computed)
            np.testing.assert_array_equal(k, source[r][layer][0])
            np.testing.assert_array_equal(v, source[r][layer][1])


def test_a_request_imported_without_kv_is_recomputed_to_the_same_tokens(tiny):
    ps = prompts(3, seed=7, lo=10, hi=30)
    want = reference(tiny, ps, SEEDED)
    a, b = host(tiny), host(tiny)
    reqs = [a.submit(p, SEEDED) for p in ps]
    for _ in range(8):
        a.step()
    packet = a.export_request(reqs[1])
    moved = b.import_request(packet, with_kv=False)
    assert b.instances[0].info(moved.id)["state"] in ("preempted", "waiting", "running")
    a.run()
    b.run()
    assert [reqs[0].output_tokens, moved.output_tokens, reqs[2].output_tokens] == want


def test_refusals_change_nothing(tiny):
    """A finished request, another host's, one whose instance is being reconfigured, a packet
    whose KV does not fit (the pages mapped for it go back) and a wrong packet are refused; the
    requests then finish with one Host's tokens."""
    ps = prompts(3, seed=9, lo=20, hi=30)
    want = reference(tiny, ps, GREEDY)
    a, b = host(tiny), host(tiny)
    reqs = [a.submit(p, GREEDY, instance=0) for p in ps]
    other = b.submit(ps[0], GREEDY)
    for _ in range(4):
        a.step()
    with pytest.raises(gyges.InvalidArgumentError, match="not an unfinished request"):
        a.export_request(other)
    with pytest.raises(gyges.ArgumentTypeError):
        a.export_request("request 0")
    with pytest.raises(gyges.ArgumentTypeError):
        b.import_request({"prompt": [1]})
    r = a.transform(workers=(0, 1), tp=2, layers_per_step=1)
    assert not r.done
    with pytest.raises(gyges.BusyError, match="being reconfigured"):
        a.export_request(reqs[0])
    while not r.done:
        a.step()
    packet = a.export_request(reqs[0])
    # a TP2 destination whose last page map fails (rank 1's): rank 0's pages go back too
    probe = host(tiny, "1xTP2")
    events, _ = count("page_map", lambda: probe.import_request(packet))
    assert events >= 2
    full = host(tiny, "1xTP2")
    before = mapped(full)
    with inject("page_map", events):
        with pytest.raises(gyges.Error, match="injected"):
            full.import_request(packet)
    assert mapped(full) == before   # (no trim: what the failed import mapped is unmapped)
    assert full.instances[0].request_ids() == []
    moved = b.import_request(packet)
    a.run()
    b.run()
    assert [moved.output_tokens, reqs[1].output_tokens, reqs[2].output_tokens] == want
    with pytest.raises(gyges.InvalidArgumentError, match="not an unfinished request"):
        a.export_request(reqs[1])


def test_a_reconfiguring_instance_takes_a_request_only_without_its_kv(tiny):
    """While a live merge holds the destination's workers, a request cannot come in with its
    KV (the merge's plan would not move it: BusyError, nothing changed); it can without, queued
    to be recomputed as a new request would be, and its tokens are one Host's."""
    ps = prompts(4, seed=12, lo=20, hi=30)
    want = reference(tiny, ps, SEEDED)
    a, b = host(tiny), host(tiny)
    reqs = [a.submit(p, SEEDED) for p in ps[:2]]
    theirs = [b.submit(p, SEEDED) for p in ps[2:]]
    for _ in range(4):
        a.step()
        b.step()
    packet = a.export_request(reqs[0])
    r = b.transform(workers=(0, 1), tp=2, layers_per_step=1)
    assert not r.done
    before = mapped(b)
    with pytest.raises(gyges.BusyError, match="being reconfigured"):
        b.import_request(packet)
    assert mapped(b) == before
    moved = b.import_request(packet, with_kv=False)
    a.run()
    b.run()
    assert r.committed
    assert [moved.output_tokens, reqs[1].output_tokens] + [t.output_tokens for t in theirs] == want


# ---- a live migration's rounds (gyges.Cluster.migrate(live=True)), host to host ----

def copy_in_rounds(a, b, request, rounds, instance=None):
    """Round 1 copies the request's KV so far into a reservation of b, each later round (one
    step of a later) the tokens computed since; returns (reservation, tokens b holds, the
    rounds' packets)."""
    packets = [a.export_request(request, then="stay")]
    key = b.reserve_request(packets[0], instance=instance)
    held = packets[0].computed
    for _ in range(rounds - 1):
        a.step()
        packets.append(a.export_request(request, start=held, then="stay"))
        assert packets[-1].kv_start == held
        held = b.fill_reservation(key, packets[-1])
        assert held == packets[-1].computed
    return key, held, packets


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("to", ["1xTP2", "2xTP1"])
def test_a_request_copied_in_rounds_while_it_decodes_gives_its_tokens(tiny, params, to):
    """Llumnix's live migration in one process: while a request decodes on host a, its KV goes
    to host b in rounds (the first all of it, each later one only the tokens computed since,
    into sequences b reserved); the last round stops it, carries a token or two of KV and b
    adopts it with the reservation. Its tokens, and its neighbours', are one Host's that never
    moved it, nothing was recomputed, and both hosts give every page back."""
    ps = prompts(4, seed=21, lo=40, hi=60)
    params = gyges.SamplingParams(max_tokens=30, temperature=params.temperature,
                                  top_k=params.top_k, seed=params.seed, ignore_eos=True)
    want = reference(tiny, ps, params)
    a, b = host(tiny), host(tiny, to)
    start = [in_use(a), in_use(b)]
    reqs = [a.submit(p, params) for p in ps]
    while len(reqs[0].output_tokens) < 3:
        a.step()
    key, held, packets = copy_in_rounds(a, b, reqs[0], rounds=3)
    assert packets[0].kv.shape[2] == packets[0].computed > 40
    assert all(0 < p.kv.shape[2] <= 2 for p in packets[1:])   # a step's tokens each
    assert len(reqs[0].output_tokens) > len(packets[0].output)   # it decoded meanwhile
    a.step()
    last = a.export_request(reqs[0], start=held, then="hold")
    assert a.kv_sequences(reqs[0]) == {} and not reqs[0].finished
    assert last.kv_start == held and last.kv.shape[2] == last.computed - held <= 2
    moved = b.import_request(last, reservation=key)
    assert b.instances[0].info(moved.id)["n_computed"] == last.computed   # not recomputed
    assert a.settle_export(reqs[0], arrived=True)
    assert not a.settle_export(reqs[0], arrived=True)   # once
    a.run()
    b.run()
    assert [moved.output_tokens] + [r.output_tokens for r in reqs[1:]] == want
    assert [in_use(a), in_use(b)] == start


def test_an_abandoned_live_migration_leaves_the_request_where_it_was(tiny):
    """A reservation blocks reconfigurations of its workers and frees every page it mapped when
    the migration is abandoned; a destination that is gone at the last round puts the request
    back on its source as it was (its KV kept, nothing recomputed); a first round whose pages
    cannot be mapped is refused, changing nothing. Every request's tokens are one Host's."""
    ps = prompts(3, seed=22, lo=40, hi=60)
    want = reference(tiny, ps, SEEDED)
    a, b = host(tiny), host(tiny)
    reqs = [a.submit(p, SEEDED, instance=i % 2) for i, p in enumerate(ps)]
    while len(reqs[0].output_tokens) < 3:
        a.step()
    before = in_use(b)
    key, held, _ = copy_in_rounds(a, b, reqs[0], rounds=2, instance=0)
    with pytest.raises(gyges.BusyError, match="live migration"):
        b.transform(workers=(0, 1), tp=2)
    assert b.layout() == "2xTP1"
    assert b.free_reservation(key) and not b.free_reservation(key)
    assert in_use(b) == before
    r = b.transform(workers=(0, 1), tp=2)   # (allowed again) and back
    assert r.committed and b.transform(workers=(0, 1), tp=1).committed
    # the destination closes before the last round arrives: back on a, with its KV
    key, held, _ = copy_in_rounds(a, b, reqs[1], rounds=2)
    last = a.export_request(reqs[1], start=held, then="hold")
    with pytest.raises(gyges.BusyError, match="live migration"):
        a.transform(workers=(0, 1), tp=2)
    b.close()
    with pytest.raises(gyges.StateError, match="closed"):
        b.import_request(last, reservation=key)
    assert a.settle_export(reqs[1], arrived=False)
    info = a.instances[1].info(reqs[1].id)
    assert info["n_computed"] == last.computed and info["n_preemptions"] == 0
    # a first round whose last page cannot be mapped (rank 1's of a TP2): refused, nothing
    # mapped
    first = a.export_request(reqs[2], then="stay")
    probe = host(tiny, "1xTP2")
    events, _ = count("page_map", lambda: probe.reserve_request(first))
    assert events >= 2
    c = host(tiny, "1xTP2")
    room = mapped(c)
    with inject("page_map", events):
        with pytest.raises(gyges.Error, match="injected"):
            c.reserve_request(first)
    assert mapped(c) == room and c._reservations == {}
    a.run()
    assert [r.output_tokens for r in reqs] == want
