"""KunServe and multi-stage plans on CUDA workers: a buddy group's live exchange (remote attention
on the other worker's cache, forward_cuda.c) and live restore (weights and KV streamed back with
dirty-bitmap patching) on virtual workers of one GPU, and pipelines whose stages are on different
GPUs. Run with a GPU, or on the emulated device (tests/gpu_emu, `run.py ext`); the tests across
devices need two devices and NCCL (GYGES_EMU_DEVICES=2 and the pretend NCCL on the emulator) and
are skipped with the reason otherwise.

Tolerance policy: exact. A token's attention depends only on its own sequence, so attending some
rows on another cache changes no bit: tokens (greedy and seeded) equal those of a CUDA host that
never reconfigured, and the KV a live exchange leaves equals, byte for byte, the KV of the same
group formed blocking at the same step; pages are a fresh host's once the group is restored."""
import warnings

import numpy as np
import pytest
from test_buddy import sweep_live, weights_of
from test_pipelive import failed_resplit
from test_cuda_host import GPU_SKIP_REASON, MEMORY, PAGE, prompts

import gyges
from gyges import _C
from gyges.testing import spread, sweep_most
from gyges.reconfig import ReconfigurationWarning

pytestmark = [pytest.mark.filterwarnings("error::gyges.reconfig.recovery.RecoveryWarning"),
              pytest.mark.skipif(GPU_SKIP_REASON is not None,
                                 reason=f"needs a GPU: {GPU_SKIP_REASON}")]

GREEDY = gyges.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
SEEDED = gyges.SamplingParams(max_tokens=16, temperature=0.9, top_k=40, seed=7, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    return gyges.Model.tiny()


def cuda_host(tiny, workers=2, layout="2xTP1", **kw):
    # a small prefill chunk, so that the group forms with requests in the middle of prefills;
    # virtual workers of device 0 unless told (with more devices, Host would give one each)
    kw.setdefault("devices", 0)
    return gyges.Host(tiny, workers=workers, memory_per_worker=MEMORY, page_size=PAGE,
                      layout=layout, max_prefill_chunk=16, max_batch_tokens=64, backend="cuda",
                      **kw)


def unreconfigured(tiny, ps, params, instances=2):
    """The tokens of a CUDA host of `instances` TP1 workers that never reconfigures, the
    requests placed as the tests place them."""
    host = cuda_host(tiny, instances, f"{instances}xTP1")
    reqs = [host.submit(q, params, instance=i % instances) for i, q in enumerate(ps)]
    host.run()
    host.close()
    return [r.output_tokens for r in reqs]


def in_use(host):
    for w in range(host.n_workers):
        host.worker(w).kv.trim()
    return [host.worker(w).arena.stats()["bytes_in_use"] for w in range(host.n_workers)]


def pipeline_kv(host, pipe):
    """rid -> per model layer (K, V) of every token, read from the stage whose cache holds it."""
    out = {}
    for rid in pipe.request_ids():
        layers = []
        for k, (lo, hi) in enumerate(pipe.stages):
            kv = host.worker(pipe.workers[k]).kv
            seq = pipe.stage_seq(k, rid)
            layers += [kv.gather(seq, layer - kv.first_layer) if seq >= 0 else None
                       for layer in range(lo, hi)]
        out[rid] = layers
    return out


def devices_or_skip(n):
    count = _C.cuda_device_count()
    if count < n:
        pytest.skip(f"needs {n} CUDA devices, this machine has {count} (GYGES_EMU_DEVICES on "
                    f"the emulator)")


def nccl_host_or_skip(tiny, **kw):
    try:
        return cuda_host(tiny, comm="nccl", **kw)
    except gyges.UnavailableError as e:
        if "NCCL" not in str(e):
            raise
        pytest.skip(f"NCCL cannot be loaded here: {e}")


# ---- remote attention alone ----

@pytest.mark.parametrize("devices", [[0, 0], [0, 1]], ids=["one_gpu", "two_gpus"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_remote_attention_gives_the_tokens_of_local_attention(tiny, devices, params):
    """The mechanism under a live exchange, alone: PP2 whose first worker's cache holds layers
    2 and 3 too; every other request attends in those layers on that cache from its first token
    (on one GPU from the second worker's stream; across two GPUs its q, k and v go over by peer
    copies, the kernels run there and the output comes back), the rest on the second worker.
    Every request gets one CUDA worker's tokens, and the pages come back."""
    if devices[1]:
        devices_or_skip(2)
    ps = prompts(6, seed=17, lo=10, hi=50)
    want = unreconfigured(tiny, ps, params, instances=1)
    host = (nccl_host_or_skip if devices[1] else cuda_host)(tiny, layout="PP2", devices=devices)
    pipe, kv0 = host.instances[0], host.worker(0).kv
    start = in_use(host)
    kv0.set_layers(0, 4)
    reqs = [host.submit(q, params) for q in ps]
    assert sorted(r.id for r in reqs) == sorted(pipe.request_ids())
    for r in reqs[::2]:
        pipe.set_remote(r.id, 1, 0, 2, 4)
    host.run()
    assert [r.output_tokens for r in reqs] == want
    stats = pipe.remote_stats()   # a call per request and layer of every step it ran in
    assert stats["calls"] >= 3 * 2 * params.max_tokens and stats["token_layers"] > stats["calls"]
    kv0.set_layers(0, 2)
    assert in_use(host) == start


@pytest.mark.parametrize("devices", [[0, 0], [0, 1]], ids=["one_gpu", "two_gpus"])
@pytest.mark.parametrize("site", ["alloc", "copy"])
def test_a_failed_remote_attention_fails_its_step_only(tiny, devices, site):
    """Every host allocation of the steps (the remote parts' lists among them) and, across
    GPUs, every round trip of remote attention's activations (the `copy` site) fails in turn:
    that step raises and is taken back, the next ones serve on, and every request gets one CUDA
    worker's tokens with every page back."""
    from gyges.testing import count, inject
    if devices[1]:
        devices_or_skip(2)
    ps = prompts(3, seed=19, lo=10, hi=40)
    want = unreconfigured(tiny, ps, GREEDY, instances=1)

    def setup():
        host = (nccl_host_or_skip if devices[1] else cuda_host)(tiny, layout="PP2",
                                                                devices=devices)
        start = in_use(host)
        host.worker(0).kv.set_layers(0, 4)
        reqs = [host.submit(q, GREEDY) for q in ps]
        for r in reqs[::2]:
            host.instances[0].set_remote(r.id, 1, 0, 2, 4)
        return host, reqs, start

    def run(host, reqs):
        while not all(r.finished for r in reqs):
            host.step()
    host, reqs, _ = setup()
    events, _ = count(site, lambda: run(host, reqs))
    host.close()
    if site == "copy" and not devices[1]:
        assert events == 0   # one device: no copies, the kernels read the other cache
        return
    assert events > 0
    for n in spread(events, sweep_most(2)):
        host, reqs, start = setup()
        with inject(site, n) as fired:
            with pytest.raises(gyges.Error):
                run(host, reqs)
            assert fired() == 1
        run(host, reqs)
        assert [r.output_tokens for r in reqs] == want
        host.worker(0).kv.set_layers(0, 2)
        assert in_use(host) == start
        host.close()


# ---- one GPU: virtual workers ----

@pytest.mark.parametrize("g, params", [(2, GREEDY), (2, SEEDED), (4, GREEDY)],
                         ids=["2-greedy", "2-seeded", "4-greedy"])
def test_a_live_exchange_and_restore_on_cuda_keep_every_token(tiny, g, params):
    """KunServe 4.2 and 4.3 on g virtual workers: the group serves at once, the requests whose
    KV has not moved attending remotely on the other workers' caches, a layer moving per step;
    a live restore streams the weights and KV back while it serves. Every request, in prefill or
    decode when it forms and arriving meanwhile, gets the tokens of a host that never
    reconfigured; weights come back byte-identical and pages back to a fresh host's."""
    ps = prompts(6, seed=13, lo=20, hi=70)
    late_ps = prompts(2, seed=9, lo=10, hi=30)
    want = unreconfigured(tiny, ps + late_ps, params, instances=g)
    host = cuda_host(tiny, g, f"{g}xTP1")
    start = in_use(host)
    weights = [weights_of(host.worker(i)) for i in range(g)]
    reqs = [host.submit(q, params, instance=i % g) for i, q in enumerate(ps)]
    host.step()
    host.step()
    b = host.buddy(host.instances, live=True)
    assert host.layout() == f"PP{g}" and not b.exchange.done
    late = [host.submit(q, params, instance=0) for i, q in enumerate(late_ps)]
    steps = 0
    while not b.exchange.done:
        host.step()
        steps += 1
    assert steps >= 2 and b.stats["remote_attention_calls"] > 0
    assert b.stats["kv_bytes_exchanged"] > 0
    assert b.stats["remote_attention_bytes"] == \
        b.instance.remote_stats()["token_layers"] * b.exchange.row_bytes
    r = host.restore(b, live=True)
    served, steps = sum(len(q.output_tokens) for q in reqs), 0
    while not r.done:
        host.step()
        steps += 1
    assert steps >= 2 and sum(len(q.output_tokens) for q in reqs) > served   # served meanwhile
    assert host.layout() == f"{g}xTP1" and b.restored and host.has_unfinished()
    assert b.stats["weight_bytes_restored"] > 0 and b.stats["kv_bytes_returned"] > 0
    host.run()
    assert [q.output_tokens for q in reqs + late] == want
    for i in range(g):
        got = weights_of(host.worker(i))
        assert got.keys() == weights[i].keys()
        assert all(np.array_equal(got[k], weights[i][k]) for k in got)
    assert in_use(host) == start


def test_a_live_exchange_leaves_the_kv_of_a_blocking_one(tiny):
    """The same requests, the same steps: a group formed live (remote attention until each
    layer has moved) and one formed blocking hold the same KV, byte for byte, once the live
    exchange is done: what remote attention wrote on the other cache, and every layer after it,
    is what local attention writes."""
    ps = prompts(6, seed=21, lo=20, hi=70)
    kv = {}
    for live in (False, True):
        host = cuda_host(tiny)
        for i, q in enumerate(ps):
            host.submit(q, GREEDY, instance=i % 2)
        host.step()
        host.step()
        b = host.buddy(host.instances, live=live)
        for _ in range(4):
            host.step()
        assert b.done and (not live or b.stats["remote_attention_calls"] > 0)
        kv[live] = pipeline_kv(host, b.instance)
        host.close()
    assert kv[True].keys() == kv[False].keys() and kv[True]
    for rid, layers in kv[True].items():
        for got, want in zip(layers, kv[False][rid]):
            assert (got is None) == (want is None)
            if got is not None:
                np.testing.assert_array_equal(got[0], want[0])
                np.testing.assert_array_equal(got[1], want[1])


def test_a_failed_live_exchange_step_on_cuda_is_tried_again(tiny):
    """Every device copy of the exchange's layers and every host allocation of its steps (the
    remote attention's lists among them) fails in turn: the step is cancelled or the layer
    waits, later steps finish it, the tokens are one CUDA host's that never reconfigured, and
    once restored every page is a fresh host's (test_buddy.sweep_live)."""
    fresh = in_use(cuda_host(tiny))
    groups = {}   # host -> its group

    def begin(host):
        groups[host] = host.buddy(host.instances, live=True)
        return groups[host].exchange

    def restored(host):
        host.restore(groups.pop(host))
        assert host.layout() == "2xTP1"
        assert in_use(host) == fresh
    t = sweep_live(tiny, begin, ["copy", "alloc"], sweep_most(2),
                   make_host=lambda: cuda_host(tiny),
                   want=lambda ps, p: unreconfigured(tiny, ps, p), after=restored)
    assert t.stats["remote_attention_calls"] > 0


def test_a_failed_live_restore_on_cuda_waits_or_is_rolled_back(tiny):
    """A live restore's weights and KV (allocations, page maps, device copies, the patches of
    the dirty bitmaps) fail in turn: the layer waits or is copied again and a later step brings
    it, or a failure in its switch rolls it back with the group serving on and a new restore
    completes; the tokens are one CUDA host's that never reconfigured, every page a fresh
    host's at the end."""
    fresh = in_use(cuda_host(tiny))

    def begin(host):
        b = host.buddy(host.instances, live=True)
        while not b.done:
            host.step()
        return host.restore(b, live=True)

    def after(host):
        assert host.layout() == "2xTP1"
        assert in_use(host) == fresh
    t = sweep_live(tiny, begin, ["alloc", "page_map", "copy"], sweep_most(2),
                   again=lambda host, t: host.restore(t.buddy, live=True),
                   make_host=lambda: cuda_host(tiny),
                   want=lambda ps, p: unreconfigured(tiny, ps, p), after=after)
    assert t.buddy.restored


# ---- across GPUs ----

@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_pipeline_across_two_gpus_gives_one_cuda_workers_tokens(tiny, params):
    """PP[3,1] with its stages on two GPUs: the hidden states pass through the engine's host
    buffer in the activations' own bytes (x_out on one device, x_in on the other), so the
    pipeline computes what one CUDA worker computes, to the bit, and gives its pages back."""
    devices_or_skip(2)
    ps = prompts(5, seed=8)
    want = unreconfigured(tiny, ps, params, instances=1)
    host = nccl_host_or_skip(tiny, layout="PP[3,1]", devices=[0, 1])
    assert host.devices == [0, 1] and host.layout() == "PP[3,1]"
    start = in_use(host)
    reqs = [host.submit(q, params) for q in ps]
    host.run()
    assert [r.output_tokens for r in reqs] == want
    assert in_use(host) == start


@pytest.mark.parametrize("live", [True, False])
@pytest.mark.parametrize("weights_from", ["host", "peers"])
def test_an_exchange_and_restore_across_gpus_keep_every_token(tiny, live, weights_from):
    """Two TP1 workers on two GPUs group and come back: remote attention runs across them (the
    test above), the exchange's KV and the restore's KV (live: its dirty patches too) move over
    their migration communicator, and the layers a member gave up come back from the host copy
    or the peer's arena (peer copies between the devices). The tokens of a host that never
    reconfigured; the pages come back."""
    devices_or_skip(2)
    ps = prompts(4, seed=5, lo=20, hi=40)
    want = unreconfigured(tiny, ps, GREEDY)
    host = nccl_host_or_skip(tiny, devices=[0, 1])
    start = in_use(host)
    reqs = [host.submit(q, GREEDY, instance=i % 2) for i, q in enumerate(ps)]
    host.step()
    b = host.buddy(host.instances, live=live)
    while not b.done:
        host.step()
    assert b.committed and host.layout() == "PP2", b.error
    for _ in range(2):
        host.step()
    assert b.stats["remote_attention_calls"] > 0 or not live
    r = host.restore(b, live=live, weights_from=weights_from)
    while not r.done:
        host.step()
    assert r.committed and host.layout() == "2xTP1", r.error
    host.run()
    assert [r.output_tokens for r in reqs] == want
    assert in_use(host) == start


@pytest.mark.parametrize("mode", ["live", "stop_copy", "no_patch"])
def test_a_resplit_across_two_gpus_commits_and_keeps_every_token(tiny, mode):
    """PipeLive re-splitting PP[3,1] -> PP[1,3] with its stages on two GPUs copies weights
    between the devices' arenas (peer copies) and KV over the stages' migration communicator,
    live mode's patches too (the blocks holding dirty slots, whole): it commits with requests
    in flight, no request lost or changed, and no page left behind."""
    devices_or_skip(2)
    ps = prompts(5, seed=6)
    want = unreconfigured(tiny, ps, GREEDY, instances=1)
    host = nccl_host_or_skip(tiny, layout="PP[3,1]", devices=[0, 1])
    start = in_use(host)
    reqs = [host.submit(q, GREEDY) for q in ps]
    host.step()
    host.step()
    r = host.reconfigure(host.instances[0], [1, 3], mode=mode)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always", ReconfigurationWarning)
        for _ in range(200):
            if r.done:
                break
            host.step()
    assert r.done and r.committed and host.layout() == "PP[1,3]", r.error
    assert not warned
    if mode == "live":   # requests kept decoding between the rounds: patches crossed GPUs
        assert r.stats["kv_bulk_bytes"] > 0 and r.stats["patch_rounds"] > 0, r.stats
    host.run()
    assert [q.output_tokens for q in reqs] == want
    # worker 0 freed the layers it gave up (weights and KV), worker 1 holds them: the same
    # bytes in all (KV pages per layer may differ by one between the two)
    now = in_use(host)
    assert now[0] < now[1] and sum(now) == sum(start) and now[2:] == start[2:], (now, start)


@pytest.mark.parametrize("site", ["copy", "comm", "page_map", "alloc"])
def test_a_failed_resplit_across_two_gpus_takes_itself_back(tiny, site):
    """Events of a live re-split across two GPUs fail in turn (spread over sweep_most(2); every
    one under `make sweep-cuda`): peer copies of the weights, the migration communicator's KV
    and patches, page maps, allocations. A failed re-split is taken back, a failed step leaves
    it going (test_pipelive.failed_resplit); the tokens are one CUDA worker's, and no page is
    lost: as at the start once taken back, the same total once committed."""
    devices_or_skip(2)
    ps = prompts(3, seed=4, lo=20, hi=40)
    want = unreconfigured(tiny, ps, GREEDY, instances=1)
    starts = {}

    def make_host():
        host = nccl_host_or_skip(tiny, layout="PP[3,1]", devices=[0, 1])
        starts[host] = in_use(host)
        return host

    def pages_back(host, undone):
        start, now = starts.pop(host), in_use(host)
        assert now == start if undone else sum(now) == sum(start), (now, start)
    events = failed_resplit(make_host, ps, GREEDY, want, site, after=pages_back)
    assert events > 0
    undone = [failed_resplit(make_host, ps, GREEDY, want, site, n, after=pages_back)
              for n in spread(events, sweep_most(2))]
    if site in ("copy", "comm"):   # (the first allocations and maps may be the steps')
        assert any(undone)


@pytest.mark.parametrize("op", ["exchange", "restore"])
def test_a_fault_in_a_live_buddy_group_across_two_gpus_loses_nothing(tiny, op):
    """A live exchange, or a live restore, of two TP1 workers on two GPUs with events failing in
    turn (spread over sweep_most(2) a site): the migration communicator's KV and patches,
    device and peer copies, allocations. The layer waits and a later step brings it, or the
    restore's switch is rolled back and a new one completes; the tokens are one CUDA host's
    that never reconfigured, and every page is back once restored (test_buddy.sweep_live)."""
    devices_or_skip(2)
    fresh = in_use(nccl_host_or_skip(tiny, devices=[0, 1]))
    groups = {}

    def begin(host):
        b = host.buddy(host.instances, live=True)
        if op == "exchange":
            groups[host] = b
            return b.exchange
        while not b.done:
            host.step()
        return host.restore(b, live=True, weights_from="peers")

    def after(host):
        if host in groups:
            host.restore(groups.pop(host))
        assert host.layout() == "2xTP1" and in_use(host) == fresh
    t = sweep_live(tiny, begin, ["comm", "copy", "alloc"], sweep_most(2),
                   again=lambda host, t: host.restore(t.buddy, live=True, weights_from="peers"),
                   make_host=lambda: nccl_host_or_skip(tiny, devices=[0, 1]),
                   want=lambda ps, p: unreconfigured(tiny, ps, p), after=after)
    assert t.committed


def test_arena_copies_between_two_gpus_are_peer_copies_counted_as_copy_events():
    """Runs from a CUDA arena on device 1 into one on device 0 (how a re-split moves a stage's
    weights between GPUs): the bytes arrive exactly; each call is one copy fault event, and an
    injected fault leaves the destination as it was."""
    devices_or_skip(2)
    from gyges.testing import count, inject
    a = gyges.Arena(budget="8MiB", page_size=PAGE, backend="cuda", device=0)
    b = gyges.Arena(budget="8MiB", page_size=PAGE, backend="cuda", device=1)
    a.grow(0, 2)
    b.grow(0, 2)
    page = a.page_size
    src = np.random.default_rng(3).integers(0, 256, 2 * page, dtype=np.uint8)  # [2 pages]
    b.write(0, src)
    a.write(0, np.zeros(2 * page, np.uint8))
    runs = (np.array([page, 0]), np.array([0, page + 64]), np.array([page, 100]))  # dst, src, bytes
    with inject("copy", 1) as fired:
        with pytest.raises(gyges.Error, match="injected fault"):
            a.copy_runs(b, *runs)
        assert fired() == 1
    assert not a.read(0, 2 * page).any()
    n, _ = count("copy", lambda: a.copy_runs(b, *runs))
    assert n == 1
    got = a.read(0, 2 * page)
    np.testing.assert_array_equal(got[page:], src[:page])
    np.testing.assert_array_equal(got[:100], src[page + 64:page + 164])
    assert not got[100:page].any()
