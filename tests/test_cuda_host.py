"""gyges.Host(backend="cuda"): workers on GPUs, tensor parallelism over a device communicator, and
live transformations of virtual workers sharing one GPU, against the CPU host.

What runs where:
  - everywhere: the refusals (no GPU: UnavailableError naming the reason before anything is
    allocated; placements and communicator choices that cannot work), and the device path of a
    transformation's KV movement (KVMove of block lists and the staging of a scale-down) run on
    CPU hosts, where the same C copies are memmoves, against the host path's token streams;
  - with a GPU (skipped with the reason otherwise), and on the emulated device of `make cudaemu`
    (tests/gpu_emu/, `run.py ext`: everything but the kernels, cuBLAS and the driver is the code
    a GPU runs): a 4-virtual-worker CUDA host against the CPU host through 4xTP1 -> TP4 -> 4xTP1
    with requests in flight, the TP layouts, the pairings of engines and communicators, and the
    refusals of what CUDA transformations cannot do yet.

Tolerance policy (exact unless said):
  - KV values moved by a transformation: bit-exact (copies, never recomputed);
  - page and byte accounting: exact, and equal to the CPU host's when both use the same page size
    (the arenas run the same bookkeeping whatever holds the pages);
  - greedy fp32 tokens equal the CPU host's, except where, at a request's first divergence, the
    CPU logits' two largest are closer than NEAR_TIE of the largest logit: cuBLAS orders its fp32
    sums differently from the CPU kernels (ulp-level differences), which may pick the other
    token of a near tie; the rest of that request is then not comparable and is not compared.
    The emulated device sums in float64 and rounds once, so there too only near ties may differ.
"""
import os

import numpy as np
import pytest
from test_buddy import sweep_buddy
from test_pipelive import failed_resplit
from test_transform import assert_kv_unchanged, check_placement, kv_by_request

import gyges
import gyges.runtime.host as host_module
from gyges import _C
from gyges.runtime.host import cuda_placement
from gyges.testing import spread, sweep_most
from gyges.runtime.worker import Worker, cuda_unavailable

# A transformation that fails half-way is rebuilt and recomputes its requests (gyges.recovery),
# which keeps token streams right and would hide the failure: here none may happen.
pytestmark = pytest.mark.filterwarnings("error::gyges.reconfig.recovery.RecoveryWarning")

GPU_SKIP_REASON = cuda_unavailable()
EMULATED = os.environ.get("GYGES_CUDA_EMULATED") == "1"
needs_gpu = pytest.mark.skipif(GPU_SKIP_REASON is not None,
                               reason=f"needs a GPU: {GPU_SKIP_REASON}")
NEAR_TIE = 1e-4
GREEDY = gyges.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
PAGE = "2MiB"        # the CUDA page; the CPU host uses it too, so their accounting compares
MEMORY = "256MiB"


@pytest.fixture(scope="module")
def tiny():
    return gyges.Model.tiny()


def prompts(n, seed, lo=4, hi=60):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 4096, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def new_host(tiny, backend, layout="4xTP1", **kw):
    # A small prefill chunk, so that transformations land in the middle of prefills too. CUDA
    # workers are virtual workers on one GPU (d2d) whatever the machine has: the emulator's has
    # four, with NCCL (test_cuda_multi_gpu.py runs those).
    if backend == "cuda":
        kw.setdefault("devices", 0)
    return gyges.Host(tiny, workers=4, memory_per_worker=MEMORY, page_size=PAGE, layout=layout,
                      max_prefill_chunk=16, max_batch_tokens=64, backend=backend, **kw)


def cpu_logits(tiny, tokens):
    """The CPU backend's fp32 logits after `tokens` (a TP1 worker, one prefill)."""
    w = Worker(tiny, memory="256MiB", threads=1)
    seq = w.kv.new_sequence()
    while w.kv.free_blocks * w.block_size < len(tokens):
        w.kv.grow(1)
    w.kv.reserve(seq, len(tokens))
    return w.forward(tokens, [0] * len(tokens), range(len(tokens)), [w.kv.block_table(seq)],
                     [len(tokens) - 1])[0]


def assert_same_greedy_tokens(tiny, prompt_list, got, want):
    """got == want, but for a divergence at a near tie of the CPU logits (the policy above);
    returns how many requests diverged there."""
    ties = 0
    for prompt, g, w in zip(prompt_list, got, want):
        if g == w:
            continue
        i = next(i for i, (a, b) in enumerate(zip(g, w)) if a != b) if len(g) == len(w) else None
        assert i is not None, f"lengths differ: {len(g)} vs {len(w)}"
        logits = cpu_logits(tiny, prompt + w[:i])
        top2 = np.sort(logits)[-2:]
        gap = (top2[1] - top2[0]) / np.abs(logits).max()
        assert gap < NEAR_TIE and g[i] in np.argsort(logits)[-2:], (
            f"token {i} differs ({g[i]} vs {w[i]}) where the CPU's top two are {gap:.2e} apart")
        ties += 1
    return ties


def arena_accounting(host):
    keys = ("bytes_in_use", "peak_bytes", "bytes_by_tag", "pages_mapped", "pages_created_total",
            "pages_released_total", "maps_total", "unmaps_total")
    return [{k: host.worker(w).arena.stats()[k] for k in keys} for w in range(4)]


def comparable(stats):
    """A transformation's stats without its timings and the host path's own staging."""
    return {k: v for k, v in stats.items()
            if k not in ("phase_seconds", "stage_bytes") and not k.endswith("seconds")}


# ---- everywhere ----

@pytest.mark.skipif(GPU_SKIP_REASON is None, reason="this machine runs CUDA workers")
def test_cuda_host_without_a_gpu_raises_unavailable_before_allocating(tiny, monkeypatch):
    def must_not_run(*args, **kwargs):
        raise AssertionError("allocated before refusing")
    monkeypatch.setattr(host_module, "Worker", must_not_run)
    monkeypatch.setattr(host_module, "CommPool", must_not_run)
    for kwargs in ({}, {"devices": 0}, {"comm": "nccl"}, {"comm": "d2d", "layout": "1xTP4"}):
        with pytest.raises(gyges.UnavailableError, match="backend='cuda' cannot run here: ") as e:
            gyges.Host(tiny, workers=4, backend="cuda", **kwargs)
        assert GPU_SKIP_REASON in str(e.value)
    monkeypatch.undo()
    host = gyges.Host(tiny, workers=2, memory_per_worker="48MiB")  # the CPU backend still works
    assert host.generate([[1, 2, 3]], gyges.SamplingParams(max_tokens=2))[0].finished


def test_placement_of_cuda_workers(monkeypatch):
    monkeypatch.setattr(host_module, "cuda_unavailable", lambda: None)
    for count, kwargs, want in (
        (4, {}, ([0, 1, 2, 3], "nccl")),             # one GPU each when there are enough
        (2, {}, ([0, 0, 0, 0], "d2d")),              # else virtual workers on device 0
        (1, {}, ([0, 0, 0, 0], "d2d")),
        (4, {"comm": "d2d"}, ([0, 0, 0, 0], "d2d")),
        (4, {"devices": 2}, ([2, 2, 2, 2], "d2d")),
        (4, {"devices": [3, 2, 1, 0]}, ([3, 2, 1, 0], "nccl")),
        (4, {"devices": (1, 1, 1, 1), "comm": "d2d"}, ([1, 1, 1, 1], "d2d")),
    ):
        monkeypatch.setattr(_C, "cuda_device_count", lambda count=count: count)
        assert cuda_placement(4, **kwargs) == want, (count, kwargs)
    monkeypatch.setattr(_C, "cuda_device_count", lambda: 2)
    assert cuda_placement(1) == ([0], "d2d")
    for kwargs, match in (
        ({"comm": "nccl"}, r"device\(s\) \[2, 3\] do not exist: this machine has 2"),
        ({"devices": [0, 0, 1, 1]}, "one GPU per worker"),
        ({"devices": [0, 1, 0, 1], "comm": "d2d"}, "sharing one GPU"),
        ({"devices": [0, 1]}, "names 2 GPUs for 4 workers"),
        ({"devices": 5}, "do not exist"),
        ({"comm": "shm"}, "unknown communicator"),
    ):
        with pytest.raises(ValueError, match=match):
            cuda_placement(4, **kwargs)


def test_cpu_hosts_refuse_cuda_arguments(tiny):
    with pytest.raises(ValueError, match="unknown backend"):
        gyges.Host(tiny, workers=2, backend="gpu")
    for kwargs in ({"devices": 0}, {"comm": "d2d"}):
        with pytest.raises(ValueError, match="for backend='cuda'"):
            gyges.Host(tiny, workers=2, memory_per_worker="48MiB", **kwargs)
    assert gyges.Host(tiny, workers=2, memory_per_worker="48MiB").comm_backend == "shm"


def test_kv_move_checks_its_arguments(tiny):
    host = gyges.Host(tiny, workers=2, memory_per_worker="48MiB")
    a, b = host.worker(0).kv, host.worker(1).kv
    a.grow(1)
    b.grow(1)
    layers = range(a.n_layers)
    with pytest.raises(TypeError, match="gyges.KVCache"):
        gyges.KVMove(layers).add(b._c, a, [0], [0])
    with pytest.raises(ValueError, match="2 destination blocks for 1 sources"):
        gyges.KVMove(layers).add(b, a, [0], [0, 1])
    with pytest.raises(ValueError, match="range with step 1"):
        gyges.KVMove([0, 1])
    with pytest.raises(gyges.InvalidArgumentError, match="not one of the cache's"):
        gyges.KVMove(layers).add(b, a, [a.n_blocks], [0]).run()
    with pytest.raises(gyges.InvalidArgumentError, match="out of range"):
        gyges.KVMove(layers).add(b, a, [0], [0], dst_head=1).run()
    k = np.arange(16 * 4 * 32, dtype=np.float32).reshape(16, 4, 32)
    seq = b.new_sequence()
    b.reserve(seq, 16)
    b.write(seq, 2, 0, k, -k)
    gyges.KVMove(range(1, 3)).add(b, a, b.block_table(seq), [3], dst_head=1, src_head=2,
                                  n_heads=2).run()
    s2 = a.adopt([3], 16)
    got_k, got_v = a.gather(s2, 2)
    np.testing.assert_array_equal(got_k[:, 1:3], k[:, 2:4])
    np.testing.assert_array_equal(got_v[:, 1:3], -k[:, 2:4])


@pytest.mark.parametrize("start, workers, target, steps", [
    ("4xTP1", (0, 1, 2, 3), 4, 3), ("1xTP4", (0, 1, 2, 3), 1, 4), ("2xTP2", (0, 1, 2, 3), 4, 5),
    ("1xTP4", (0, 1, 2, 3), 2, 6), ("4xTP1", (2, 3), 2, 2),
])
def test_the_one_kv_route_of_cuda_transformations_runs_on_cpu_hosts(tiny, start, workers,
                                                                     target, steps):
    """The KV movement CUDA transformations use (KVMove of block lists: one kernel per layer
    on a device, memmove on the host; a staging cache of the worker's own backend for a
    scale-down) is the one every backend runs: on CPU hosts every byte of every request's KV is
    where the new geometry says, the placement and accounting hold, and the tokens are the
    plain engine's; only a scale-down stages."""
    host = new_host(tiny, "cpu", layout=start)
    ps = prompts(10, seed=1)
    requests = [host.submit(p, GREEDY) for p in ps]
    for _ in range(steps):
        host.step()
    before = kv_by_request(host)
    t = host.transform(workers=workers, tp=target)
    assert_kv_unchanged(before, kv_by_request(host))
    check_placement(host)
    host.run()
    with gyges.Engine(tiny, memory="128MiB") as e:
        assert [r.output_tokens for r in requests] == [r.output_tokens for r in e.generate(ps, GREEDY)]
    assert (t.stats["stage_bytes"] > 0) == (target < len(workers))


# ---- with a GPU (or the emulated device of `make cudaemu`) ----

@pytest.mark.skipif(not EMULATED, reason="only under `make cudaemu`")
def test_the_emulated_build_is_the_one_under_test():
    assert GPU_SKIP_REASON is None, GPU_SKIP_REASON
    assert os.path.join("ext", "gyges") in gyges.__file__  # tests/gpu_emu/build.py's OUT/ext


@needs_gpu
def test_kv_moves_run_on_one_device_and_refuse_what_needs_a_communicator():
    """Caches on the GPU move by the device backend; a move between host and device memory
    needs the NCCL migration backend (not built yet): refused, naming why, with nothing
    copied."""
    def cache(backend):
        arena = gyges.Arena(budget="8MiB", page_size=PAGE, backend=backend)
        kv = gyges.KVCache(arena, n_layers=2, n_kv_heads=2, head_dim=32, block_size=16)
        kv.grow(1)
        seq = kv.new_sequence()
        kv.reserve(seq, 20)
        return kv, seq
    (a, sa), (b, sb), (h, sh) = cache("cuda"), cache("cuda"), cache("cpu")
    rng = np.random.default_rng(5)
    for layer in range(2):
        a.arena.write(a.layer_offset(layer),
                      rng.standard_normal(a.n_blocks * a.block_bytes // 4).astype(np.float32))
    stats = gyges.KVMove(range(2)).add(a, b, src_seq=sa, dst_seq=sb).run()
    assert stats["backend"] == "cuda" and stats["slots"] == 32
    for layer in range(2):
        for got, want in zip(b.gather(sb, layer, 0, 32), a.gather(sa, layer, 0, 32)):
            np.testing.assert_array_equal(got, want)
    with pytest.raises(gyges.UnavailableError, match="NCCL migration backend"):
        gyges.KVMove(range(2)).add(a, h, src_seq=sa, dst_seq=sh).run()
    assert not h.gather(sh, 0)[0].any()
    # an overlapping move (a shadow's) goes through a device stage (tests/test_cuda_stagger.py)
    assert gyges.KVMove(range(2), overlap=True).add(a, b, src_seq=sa, dst_seq=sb).run()[
        "backend"] == "cuda"


@needs_gpu
def test_cuda_host_round_trip_matches_the_cpu_host(tiny):
    """4 virtual workers on one GPU, 4xTP1 -> TP4 -> 4xTP1 with requests in flight: the CPU
    host's greedy tokens, the same KV values before and after each move, and the CPU host's
    page and byte accounting at every point."""
    ps = prompts(8, seed=11)
    runs = {}
    for backend in ("cpu", "cuda"):
        host = new_host(tiny, backend)
        if backend == "cuda":
            assert host.comm_backend == "d2d" and host.devices == [0] * 4
        start = arena_accounting(host)
        requests = [host.submit(p, GREEDY) for p in ps]
        for _ in range(3):
            host.step()
        before = kv_by_request(host)
        up = host.transform(workers=(0, 1, 2, 3), tp=4)
        assert host.layout() == "TP4" and up.stats["requests_moved"] == len(ps)
        after = kv_by_request(host)
        check_placement(host)
        mid = arena_accounting(host)
        for _ in range(4):
            host.step()
        before_down = kv_by_request(host)
        down = host.transform(workers=(0, 1, 2, 3), tp=1)
        assert host.layout() == "4xTP1"
        after_down = kv_by_request(host)
        check_placement(host)
        host.run()
        end = arena_accounting(host)
        for a, b in ((before, after), (before_down, after_down)):
            assert set(a) == set(b)
            for rid in a:  # every head of every token moved, bit for bit
                for (k0, v0), (k1, v1) in zip(a[rid], b[rid]):
                    n = min(k0.shape[0], k1.shape[0])
                    np.testing.assert_array_equal(k0[:n], k1[:n])
                    np.testing.assert_array_equal(v0[:n], v1[:n])
        # Back where it started: the weights of TP1 and no KV, page for page.
        assert [a["bytes_in_use"] for a in end] == [a["bytes_in_use"] for a in start]
        assert all(a["bytes_by_tag"]["kv"] == 0 for a in end)
        for w in range(4):
            arena = host.worker(w).arena
            assert len(arena.physical_pages()) * arena.page_size == arena.stats()["bytes_in_use"]
        runs[backend] = dict(tokens=[r.output_tokens for r in requests], start=start, mid=mid,
                             end=end, up=comparable(up.stats), down=comparable(down.stats))
    cpu, cuda = runs["cpu"], runs["cuda"]
    ties = assert_same_greedy_tokens(tiny, ps, cuda["tokens"], cpu["tokens"])
    assert ties <= 1, f"{ties} requests diverged at near ties"
    # ignore_eos: the schedule depends on lengths only, so both hosts map the same blocks at the
    # same steps and move the same ones: the same memory, to the byte and the page.
    for key in ("start", "mid", "end", "up", "down"):
        assert cuda[key] == cpu[key], key


@needs_gpu
@pytest.mark.parametrize("layout", ["2xTP2", "1xTP4", "TP2+2xTP1"])
def test_tensor_parallel_layouts_on_cuda_give_the_cpu_tokens(tiny, layout):
    ps = prompts(6, seed=2)
    cpu = gyges.Engine(tiny, memory="256MiB").generate(ps, GREEDY)
    host = new_host(tiny, "cuda", layout=layout)
    assert host.layout() == layout.replace("1xTP4", "TP4")
    got = host.generate(ps, GREEDY)
    assert_same_greedy_tokens(tiny, ps, [r.output_tokens for r in got],
                              [r.output_tokens for r in cpu]) <= 1
    assert all(m["kv"] == 0 for m in host.memory())


@needs_gpu
@pytest.mark.parametrize("layout", ["PP4", "PP[3,1]+2xTP1", "TP2+PP[1,3]"])
def test_pipelines_on_cuda_give_the_tokens_of_one_cuda_worker(tiny, layout):
    """Stages on different virtual workers hand their hidden states on through host memory in
    the activations' own bytes, so a pipeline computes what one CUDA worker computes, to the
    bit (greedy and seeded sampling), and gives its KV pages back."""
    ps = prompts(6, seed=8)
    for params in (GREEDY, gyges.SamplingParams(max_tokens=12, temperature=0.9, top_k=40, seed=3,
                                                ignore_eos=True)):
        want = one_cuda_worker(tiny, ps, params)
        host = new_host(tiny, "cuda", layout=layout)
        assert host.layout() == layout
        pipe = [inst for inst in host.instances if inst.stages][0]
        requests = [host.submit(p, params, instance=host.instances.index(pipe)) for p in ps]
        host.run()
        assert [r.output_tokens for r in requests] == want
        assert all(m["kv"] == 0 for m in host.memory())
        host.close()


@needs_gpu
def test_split_and_merge_pairs_and_weights_from_the_host(tiny):
    ps = prompts(8, seed=4)
    cpu = [r.output_tokens for r in gyges.Engine(tiny, memory="256MiB").generate(ps, GREEDY)]
    host = new_host(tiny, "cuda", layout="2xTP2")
    requests = [host.submit(p, GREEDY) for p in ps]
    host.step()
    host.step()
    host.transform(workers=(0, 1, 2, 3), tp=4)
    host.step()
    host.transform(workers=(0, 1, 2, 3), tp=2, weights_from="host")
    assert host.layout() == "2xTP2"
    host.step()
    host.transform(workers=(2, 3), tp=1)
    assert host.layout() == "TP2+2xTP1"
    check_placement(host)
    host.run()
    assert_same_greedy_tokens(tiny, ps, [r.output_tokens for r in requests], cpu) <= 1


@needs_gpu
@pytest.mark.parametrize("method, pad", [("stop_world", True), ("partial_swap", False)])
def test_the_other_all_at_once_methods_run_on_cuda(tiny, method, pad):
    ps = prompts(6, seed=3)
    cpu = [r.output_tokens for r in gyges.Engine(tiny, memory="256MiB").generate(ps, GREEDY)]
    host = new_host(tiny, "cuda", pad_ffn=pad)
    requests = [host.submit(p, GREEDY) for p in ps]
    host.step()
    host.step()
    t = host.transform(workers=(0, 1, 2, 3), tp=4, method=method)
    copied = t.stats["weight_bytes_copied"]
    # partial_swap copies the kept shards to the front of their pages (arena copies on the
    # device); worker 0's is already there. Padded shards are released without a copy.
    assert (sum(copied.values()) > 0 and copied[0] == 0) if method == "partial_swap" else (
        sum(copied.values()) == 0)
    check_placement(host)
    host.run()
    assert_same_greedy_tokens(tiny, ps, [r.output_tokens for r in requests], cpu) <= 1


@needs_gpu
def test_engines_pair_cuda_ranks_with_device_communicators_only(tiny):
    from gyges.runtime.comm import make_comm
    cuda = [Worker(tiny, memory="256MiB", backend="cuda", tp_size=2, tp_rank=r) for r in range(2)]
    cpu = [Worker(tiny, memory="64MiB", tp_size=2, tp_rank=r) for r in range(2)]
    d2d, shm = make_comm(2, "d2d", devices=0), make_comm(2, "shm")
    args = (512, 64)
    with pytest.raises(gyges.InvalidArgumentError, match="needs a device communicator"):
        _C.Engine([w.c_model for w in cuda], [w.kv._c for w in cuda], shm, *args)
    with pytest.raises(gyges.InvalidArgumentError, match="CPU ranks need shm"):
        _C.Engine([w.c_model for w in cpu], [w.kv._c for w in cpu], d2d, *args)
    own = [d2d.stream(r) for r in range(2)]
    engine = _C.Engine([w.c_model for w in cuda], [w.kv._c for w in cuda], d2d, *args)
    assert all(d2d.stream(r) != own[r] for r in range(2))  # the workers' streams, borrowed
    del engine  # gives them back while the models live
    assert [d2d.stream(r) for r in range(2)] == own


@needs_gpu
def test_automatic_communicator_choice(tiny, monkeypatch):
    if EMULATED:  # four emulated GPUs and the pretend NCCL (run.py ext): one worker on each
        monkeypatch.setenv("GYGES_EMU_DEVICES", "4")
    host = gyges.Host(tiny, workers=4, memory_per_worker=MEMORY, backend="cuda")
    count = _C.cuda_device_count()
    if EMULATED and os.environ.get("GYGES_NCCL_LIBRARY", "/nonexistent") != "/nonexistent":
        assert host.comm_backend == "nccl"
    if host.comm_backend == "nccl":
        assert count >= 4 and host.devices == [0, 1, 2, 3] and host.comm_note is None
    else:
        assert host.devices == [0] * 4 and host.comm_backend == "d2d"
        assert (host.comm_note is not None) == (count >= 4)
        if count >= 4:
            assert "nccl communicator is not available" in host.comm_note
    assert "comm=" in repr(host)


# ---- PipeLive and KunServe on virtual workers (their KV copies: KV moves on the device) ----

def one_cuda_worker(tiny, ps, params):
    one = gyges.Host(tiny, workers=1, memory_per_worker=MEMORY, page_size=PAGE,
                     max_prefill_chunk=16, max_batch_tokens=64, backend="cuda")
    want = [r.output_tokens for r in one.generate(ps, params)]
    one.close()
    return want


def step_until_done(host, r):
    for _ in range(500):
        if r.done:
            return r
        host.step()
    raise AssertionError("the re-split never committed")


SEEDED = gyges.SamplingParams(max_tokens=16, temperature=0.9, top_k=40, seed=3, ignore_eos=True)


@needs_gpu
@pytest.mark.parametrize("mode", ["live", "no_patch", "stop_copy"])
def test_pipelive_resplits_on_cuda_keep_every_token(tiny, mode):
    """PP[3,1] -> PP[1,3] -> PP[2,2] of two virtual workers while requests prefill and decode:
    the weights and the KV of the moved layers go by device copies (the live mode's patches
    too), and the tokens are one CUDA worker's, to the bit (greedy and seeded)."""
    ps = prompts(6, seed=11, lo=20, hi=70)
    for params in (GREEDY, SEEDED):
        want = one_cuda_worker(tiny, ps, params)
        host = gyges.Host(tiny, workers=2, memory_per_worker=MEMORY, page_size=PAGE,
                          layout="PP[3,1]", max_prefill_chunk=16, max_batch_tokens=64,
                          backend="cuda", devices=0)
        requests = [host.submit(p, params) for p in ps]
        host.step()
        host.step()
        r = step_until_done(host, host.reconfigure(host.instances[0], [1, 3], mode=mode))
        assert host.layout() == "PP[1,3]" and r.stats["kv_bulk_bytes"] > 0
        assert (r.stats["patch_rounds"] > 0) == (mode == "live")
        step_until_done(host, host.reconfigure(host.instances[0], [2, 2], mode=mode))
        host.run()
        assert [q.output_tokens for q in requests] == want
        assert all(m["kv"] == 0 for m in host.memory())
        host.close()


@needs_gpu
@pytest.mark.parametrize("site", ["copy", "alloc"])
def test_a_failed_resplit_on_cuda_takes_itself_back(tiny, site):
    """Device copies (the patch's twin included) and allocations of a live re-split on virtual
    workers fail in turn, as on the CPU (test_pipelive.failed_resplit): the re-split is taken
    back or goes on, and the tokens are one CUDA worker's."""
    ps = prompts(3, seed=4, lo=20, hi=40)
    want = one_cuda_worker(tiny, ps, GREEDY)

    def make_host():
        return gyges.Host(tiny, workers=2, memory_per_worker=MEMORY, page_size=PAGE,
                          layout="PP[3,1]", max_batch_tokens=64, backend="cuda", devices=0)
    events = failed_resplit(make_host, ps, GREEDY, want, site)
    assert events > 0
    outcomes = [failed_resplit(make_host, ps, GREEDY, want, site, n)
                for n in spread(events, sweep_most(3))]
    if site == "copy":
        assert any(outcomes)


@needs_gpu
def test_buddy_groups_on_cuda_drop_exchange_and_restore(tiny):
    """KunServe on two virtual workers: a buddy group releases (g-1) P of parameters, the KV
    exchange and the restore's return go by device copies, the restored weights are byte
    identical, and the requests keep one CUDA worker's tokens."""
    ps = prompts(6, seed=13, lo=20, hi=70)
    want = one_cuda_worker(tiny, ps, GREEDY)
    host = gyges.Host(tiny, workers=2, memory_per_worker=MEMORY, page_size=PAGE,
                      layout="2xTP1", max_prefill_chunk=16, max_batch_tokens=64, backend="cuda",
                      devices=0)
    weights = [[host.worker(i).weights.read(n) for n in sorted(host.worker(i).weights.offsets)]
               for i in range(2)]
    requests = [host.submit(p, GREEDY, instance=i % 2) for i, p in enumerate(ps)]
    host.step()
    host.step()
    before = [host.worker(i).arena.stats()["bytes_in_use"] for i in range(2)]
    b = host.buddy(host.instances)   # (live ones: test_cuda_kunserve.py)
    assert host.layout() == "PP2" and b.stats["kv_bytes_exchanged"] > 0
    released = sum(before) - sum(host.worker(i).arena.stats()["bytes_in_use"] for i in range(2))
    assert released >= b.stats["weight_bytes_released"] > 0
    host.step()
    host.step()
    host.restore(b)
    assert host.layout() == "2xTP1"
    for i in range(2):
        got = [host.worker(i).weights.read(n) for n in sorted(host.worker(i).weights.offsets)]
        assert all(np.array_equal(g, w) for g, w in zip(got, weights[i]))
    host.run()
    assert [q.output_tokens for q in requests] == want


@needs_gpu
@pytest.mark.parametrize("op", ["buddy", "restore"])
def test_a_failed_buddy_or_restore_on_cuda_changes_nothing(tiny, op):
    """Device copies of the exchange and of the restore's return fail in turn, as on the CPU
    (test_buddy.sweep_buddy): refused with pages, layout and layers as before, or done; the
    tokens are one CUDA worker's."""
    ps = prompts(4, seed=3, lo=30, hi=50)
    want = one_cuda_worker(tiny, ps, GREEDY)
    assert sweep_buddy(lambda: gyges.Host(tiny, workers=2, memory_per_worker=MEMORY,
                                          page_size=PAGE, layout="2xTP1", backend="cuda",
                                          devices=0),
                       ps, GREEDY, want, "copy", op, most=6) > 0
