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
