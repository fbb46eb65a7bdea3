"""Flying Serving on CUDA workers (Host(..., weights="replicated", backend="cuda")): every worker
keeps the whole model on its device and one KV cache of all its KV heads; a TPk engine's rank r
runs on worker r's model and on a view of its cache (KVCache.view: blocks of k*B tokens of H/k
heads over the same device bytes), so the CUDA attention kernels and kv_write read and write the
views' longer blocks (their kernel tests: tests/test_cuda.py, `run.py kernels`).

What runs where: like tests/test_cuda_host.py's GPU tests, these skip without a GPU and run on the
emulated device of `make cudaemu` (tests/gpu_emu/, `run.py ext`, GYGES_CUDA_EMULATED=1): on
virtual workers of one device (d2d), and over NCCL when the emulator has 4 devices and its
pretend libnccl (GYGES_EMU_DEVICES=4, GYGES_NCCL_LIBRARY).

Tolerance policy (test_cuda_host.py's): tokens are exact against a CUDA host that runs the same
batches on the same geometry (a replicated TP2 engine against a sharded one: the kernels read a
view's longer blocks in the order they read a shard's cache). Against a host that never switched
and against the CPU host the batches or the sums differ (a request recomputed in the other
geometry: TP partial sums added by the all-reduce where one worker adds them in its GEMM; on a
GPU, cuBLAS's order and the decode kernel's partitions follow the batch): greedy tokens may then
differ only at a near tie of the CPU logits, and seeded ones are compared exactly (an ulp moves a
draw across a boundary of the sampler's CDF with a probability of about 1e-7 a token). KV a
paused request keeps, weights, and page and byte accounting: exact.
"""
import warnings

import pytest
from test_cuda_host import GPU_SKIP_REASON, arena_accounting, assert_same_greedy_tokens, needs_gpu
from test_flying import paused_state, prompts, same_paused_state

import gyges
from gyges.reconfig import ReconfigurationWarning
from gyges.testing import count, inject, snapshot, spread, sweep_most

# A failed switch is taken back exactly; a rebuild (recovery) would hide that: none may happen.
pytestmark = pytest.mark.filterwarnings("error::gyges.reconfig.recovery.RecoveryWarning")

PAGE = "2MiB"        # the CUDA page; the CPU host uses it too, so their accounting compares
MEMORY = "256MiB"


@pytest.fixture(scope="module")
def tiny():
    return gyges.Model.tiny()


def params(temperature, tokens=10):
    return gyges.SamplingParams(max_tokens=tokens, temperature=temperature, top_k=40, seed=5,
                                ignore_eos=True)


def new_host(tiny, backend="cuda", layout="4xTP1", weights="replicated", **kw):
    # A small prefill chunk, so that switches land in the middle of prefills too.
    return gyges.Host(tiny, workers=4, memory_per_worker=MEMORY, page_size=PAGE, layout=layout,
                      max_prefill_chunk=16, max_batch_tokens=64, backend=backend,
                      weights=weights, **kw)


def weight_bytes(host):
    """Every worker's weights as read back from its arena."""
    return [[host.worker(w).weights.read(n).tobytes()
             for n in sorted(host.worker(w).weights.offsets)] for w in range(host.n_workers)]


def same_tokens(tiny, ps, got, want, temperature):
    """The policy above: exact, but for greedy divergences at near ties (at most one)."""
    if temperature:
        assert got == want
    else:
        assert assert_same_greedy_tokens(tiny, ps, got, want) <= 1


def round_trips(host, p):
    """DP -> TP4 -> DP three ways on a replicated host serving DP requests: a hard bind for a
    request asked for at TP4 (the members' DP requests paused with their KV, released by itself
    once it is done), a bind with TP work then a soft release under load (the TP requests
    recomputed in DP), and a soft bind while DP requests run (a TP request started in DP on an
    idle member, recomputed under TP at the bind). Returns the requests in submission order
    and the arenas' accounting at each point."""
    ps = prompts(9, seed=3, lo=4, hi=40)
    acct = {"start": arena_accounting(host)}
    dp = [host.submit(q, p) for q in ps[:5]]
    host.step()
    host.step()
    before = paused_state(host, dp)
    urgent = host.submit(ps[5], p, tp=4, priority=1)       # binds at once (hard)
    assert host.modes() == ["TP4"] * 4
    acct["bound"] = arena_accounting(host)
    while not urgent.finished:
        host.step()
        if not urgent.finished:    # the paused DP requests' KV on the device, bit for bit
            assert same_paused_state(paused_state(host, dp), before)
    assert host.modes() == ["DP"] * 4   # released by itself
    host.switch((0, 1, 2, 3), 4, "hard")
    tp = [host.submit(q, p, tp=4) for q in ps[6:8]]
    for _ in range(3):
        host.step()
    acct["tp"] = arena_accounting(host)
    release = host.switch((0, 1, 2, 3), 1, "soft")
    assert release.committed and release.stats["requests_recomputed"] == 2
    assert host.modes() == ["DP"] * 4
    bind = host.switch((0, 1, 2, 3), 4, "soft")
    late = host.submit(ps[8], p, tp=4)
    while not bind.done:
        host.step()
    assert bind.committed and bind.stats["requests_soft_started"] == 1
    assert host.modes() == ["TP4"] * 4
    host.run()
    acct["end"] = arena_accounting(host)
    for s in (release, bind):
        assert s.stats["weight_bytes_copied"] == s.stats["pages_mapped"] == 0
        assert s.stats["kv_bytes_moved"] == s.stats["communicators_created"] == 0
    return ps, dp + [urgent] + tp + [late], acct


@needs_gpu
@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "seeded"])
def test_dp_tp4_dp_on_cuda_keeps_every_token(tiny, temperature):
    """round_trips on 4 replicated CUDA workers: the tokens of the same CUDA host that never
    switched and of the CPU host that made the same switches; the weights on the devices
    untouched; the KV of paused requests untouched; the CPU host's pages and bytes at every
    point, and back where they started."""
    runs = {}
    for backend in ("cpu", "cuda"):
        host = new_host(tiny, backend)
        if backend == "cuda":
            assert host.comm_backend in ("d2d", "nccl")
            for (first, size), g in host.replicas.groups.items():  # the TP engines' views
                assert g.instance.block_tokens == size * host.block_size
                assert all(v.block_size == size * host.block_size and
                           v.n_kv_heads * size == host.worker(first).kv.n_kv_heads
                           for v in g.views)
        weights = weight_bytes(host)
        ps, reqs, acct = round_trips(host, params(temperature))
        assert weight_bytes(host) == weights
        assert all(r.finish_reason == "length" for r in reqs)
        runs[backend] = [r.output_tokens for r in reqs], acct
        host.close()
    cuda, cpu = runs["cuda"], runs["cpu"]
    with new_host(tiny) as never:   # the requests in the order they came, all served in DP
        want = [r.output_tokens for r in never.generate(ps, params(temperature))]
    same_tokens(tiny, ps, cuda[0], want, temperature)
    same_tokens(tiny, ps, cuda[0], cpu[0], temperature)
    # ignore_eos: the schedule depends on lengths only, so both hosts map the same pages at the
    # same steps: the same memory, to the byte and the page
    for key in cpu[1]:
        assert cuda[1][key] == cpu[1][key], key
    assert [a["bytes_in_use"] for a in cuda[1]["end"]] == \
        [a["bytes_in_use"] for a in cuda[1]["start"]]
    assert all(a["bytes_by_tag"]["kv"] == 0 for a in cuda[1]["end"])


@needs_gpu
@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "seeded"])
def test_a_replicated_cuda_host_computes_a_sharded_ones_tokens_to_the_bit(tiny, temperature):
    """TP2+2xTP1 of replicated CUDA workers (the TP2 engine on views of blocks twice as long) and
    of sharded ones serve the same requests to the same tokens, exactly: the kernels read the
    views' longer blocks in the order they read a shard's cache."""
    ps = prompts(6, seed=21, lo=10, hi=50)
    p = params(temperature, tokens=12)
    got = {}
    for weights in ("replicated", "sharded"):
        with new_host(tiny, layout="TP2+2xTP1", weights=weights) as host:
            assert host.layout() == "TP2+2xTP1"
            # the TP2 instance and the two TP1 ones (a replicated host's: the TP2 group's
            # engine and workers 2 and 3's DP engines)
            targets = list(range(3)) if weights == "sharded" else [
                host.instances.index(i) for i in (host.replicas.groups[(0, 2)].instance,
                                                  host.replicas.dp[2], host.replicas.dp[3])]
            reqs = [host.submit(q, p, instance=targets[i % 3]) for i, q in enumerate(ps)]
            host.run()
            got[weights] = [r.output_tokens for r in reqs]
            if weights == "replicated":
                assert host.modes() == ["TP2", "TP2", "DP", "DP"]
    assert got["replicated"] == got["sharded"]


@needs_gpu
def test_a_mixed_cuda_host_transforms_its_shards_and_binds_its_replicas(tiny):
    """weights=[...] per worker on CUDA: the sharded pair merges (a transformation at once, its
    KV by the device's all-to-all) while the replicated pair binds (soft) for TP work, in one
    step loop; every token is a CUDA host's that never changed (the policy above)."""
    ps = prompts(8, seed=5, lo=4, hi=40)
    p = params(0.0)
    host = new_host(tiny, weights=["sharded"] * 2 + ["replicated"] * 2)
    assert host.weights == "mixed" and host.modes() == ["TP1", "TP1", "DP", "DP"]
    reqs = [host.submit(q, p) for q in ps[:6]]
    host.step()
    host.step()
    try:
        merge = host.transform(workers=(0, 1), tp=2)
    except gyges.UnavailableError as e:   # (transformations between GPUs: not on every build)
        backend = host.comm_backend
        host.close()
        pytest.skip(f"{backend}: {e}")
    bind = host.switch((2, 3), 2, preempt="soft")
    reqs += [host.submit(q, p, tp=2) for q in ps[6:]]
    host.run()
    assert merge.committed and bind.committed and merge.stats["requests_moved"] > 0
    assert host.layout() == "2xTP2" and host.modes() == ["TP2"] * 4
    host.close()
    with new_host(tiny, weights="sharded") as never:
        want = [r.output_tokens for r in never.generate(ps, p)]
    same_tokens(tiny, ps, [r.output_tokens for r in reqs], want, 0.0)


def switch_case(tiny, op):
    """(host, requests, operation) for a fault sweep of `op`, the operation returning the
    switch's handle (or raising):
      release  TP4 serving five requests, released under load (soft: all recomputed in DP),
               then the steps that recompute them on the members' DP engines;
      bind     DP requests on worker 0 and TP4 work started soft on the idle members, then the
               steps until the group binds, recomputes them under TP and serves."""
    ps = [[1 + i, 2, 3, 4 + i] * 4 for i in range(5)]
    p = params(0.0, tokens=6)
    if op == "release":
        host = new_host(tiny, layout="TP4")
        reqs = [host.submit(q, p) for q in ps]
        host.step()
        host.step()

        def release():
            r = host.switch((0, 1, 2, 3), 1, preempt="soft")
            for _ in range(4):
                host.step()
            return r
        return host, reqs, release
    host = new_host(tiny)
    reqs = [host.submit(q, p, instance=0) for q in ps[:2]]
    host.step()
    reqs += [host.submit(q, p, tp=4) for q in ps[2:]]   # soft: started on idle members
    bind = host.replicas.groups[(0, 4)].switch

    def drive():
        for _ in range(12):
            host.step()
        return bind
    return host, reqs, drive


# What a switch never does: copy KV or weights (a bind or a release moves bookkeeping only);
# nor does a release map a page or reduce (its requests are recomputed in DP on the pages of the
# pool they already held).
NO_EVENTS = {("bind", "copy"), ("release", "copy"), ("release", "page_create"),
             ("release", "page_map"), ("release", "comm")}


@needs_gpu
@pytest.mark.parametrize("site", ["alloc", "page_create", "page_map", "copy", "comm"])
@pytest.mark.parametrize("op", ["release", "bind"])
def test_a_fault_in_a_switch_on_cuda_loses_nothing(tiny, op, site):
    """Events of `site` in a release under load or a soft bind and the steps that serve through
    it (host and device allocations, page creation and mapping, the TP engine's collectives;
    never a copy: NO_EVENTS), a few spread over all of them (every one with GYGES_SWEEP_MOST=0),
    fail in turn: a release that fails is refused with the host as it was (the same requests, KV
    and slots); a bind's failure is taken back and reported on its handle; a step that fails
    changes nothing and the next one serves. Every request then finishes with the tokens of a run without the fault, and no page
    is left behind: as on the CPU
    (test_flying.test_an_allocation_failing_in_a_switch_loses_no_request)."""
    host, reqs, call = switch_case(tiny, op)
    if site == "comm" and op == "bind" and host.comm_backend == "nccl":
        host.close()
        pytest.skip("the nccl communicator has no abort yet: a rank whose collective fails "
                    "leaves its peers inside ncclAllReduce for good (comm_nccl.c)")
    events, _ = count(site, call)
    host.run()
    want = [r.output_tokens for r in reqs]
    host.close()
    if (op, site) in NO_EVENTS:
        assert events == 0, f"{op}: {events} {site} events"
        return
    assert events > 0, f"{op} has no {site} event"
    with new_host(tiny) as idle:
        fresh = [idle.worker(w).arena.stats()["bytes_in_use"] for w in range(4)]
    outcomes = {"refused": 0, "rolled_back": 0, "failed_step": 0, "done": 0}
    for n in spread(events, sweep_most(2)):
        host, reqs, call = switch_case(tiny, op)
        before = snapshot(host, physical=False)
        raised = r = None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ReconfigurationWarning)
            with inject(site, n) as fired:
                try:
                    r = call()
                except gyges.Error as e:
                    raised = e
                    r = getattr(e, "reconfiguration", None)
        assert fired() == 1, (n, events)
        if raised is not None and r is not None:   # the release itself failed
            assert op == "release" and r.rolled_back
            assert snapshot(host, physical=False) == before   # the same requests, KV and slots
            outcomes["refused"] += 1
        elif raised is not None:
            outcomes["failed_step"] += 1
        else:
            outcomes["rolled_back" if r.rolled_back else "done"] += 1
        host.run()
        assert all(q.finish_reason == "length" for q in reqs), n       # none lost
        # (exact on the emulator; a bind taken back serves in the other geometry: the policy)
        same_tokens(tiny, [q.prompt for q in reqs], [q.output_tokens for q in reqs], want, 0.0)
        for w in range(4):
            host.worker(w).kv.trim()
        assert [host.worker(w).arena.stats()["bytes_in_use"] for w in range(4)] == fresh, n
        host.close()
    if op == "release" and site == "alloc":
        assert outcomes["refused"] > 0     # the release's own allocations are among them


def test_replicated_cuda_hosts_are_refused_only_without_a_gpu(tiny):
    """weights='replicated' is no reason to refuse a CUDA host any more; without a GPU the
    refusal is the backend's, naming why, as for any CUDA host."""
    if GPU_SKIP_REASON is None:
        with new_host(tiny, layout="TP2+2xTP1") as host:
            assert host.weights == "replicated" and host.modes() == ["TP2", "TP2", "DP", "DP"]
        return
    with pytest.raises(gyges.UnavailableError, match="backend='cuda' cannot run here: "):
        gyges.Host(tiny, workers=2, backend="cuda", weights="replicated")
