"""A CUDA host whose workers are on four GPUs, joined by NCCL (Host(backend="cuda", comm="nccl")),
against the same host as four virtual workers on one GPU joined by d2d: the tokens of TP1, TP2
and TP4 layouts, greedy and seeded.

Runs on a machine with four GPUs and NCCL, and on the emulated one of `make cudaemu`
(tests/gpu_emu/run.py ext: four emulated GPUs with memory of their own and the pretend NCCL,
whose counters the emulated run also checks); skipped elsewhere with the reason.

Tolerance policy: the d2d all-reduce adds the ranks' partial sums as the tree
((r0 + r1) + (r2 + r3)); NCCL adds in an order of its own (the pretend one in rank order, a GPU's
along its ring). Two ranks' sums are the same either way (a + b == b + a), so TP1 and TP2
layouts give the d2d host's tokens exactly, greedy and seeded. Four ranks' sums may differ in
the last bit: TP4's greedy tokens are the d2d host's but for a divergence at a near tie of the
logits (test_cuda_host.py's policy), and its seeded tokens are compared with a second NCCL host,
exactly (the same order of additions every time).
"""
import ctypes
import os

import pytest

import gyges
from gyges import _C
from gyges.runtime.worker import cuda_unavailable

from test_cuda_host import assert_same_greedy_tokens, prompts

GPUS = 4
MEMORY = "256MiB"
PAGE = "2MiB"
EMULATED = os.environ.get("GYGES_CUDA_EMULATED") == "1"
GREEDY = gyges.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SEEDED = gyges.SamplingParams(max_tokens=8, temperature=0.9, top_k=40, seed=7, ignore_eos=True)


def _why_not():
    why = cuda_unavailable()
    if why is not None:
        return f"needs {GPUS} GPUs: {why}"
    if _C.cuda_device_count() < GPUS:
        return f"needs {GPUS} GPUs, this machine has {_C.cuda_device_count()}"
    try:
        _C.Comm(2, "nccl", [0, 1])
    except gyges.UnavailableError as error:
        return f"needs NCCL: {error}"
    return None


WHY_NOT = _why_not()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))


@pytest.fixture(scope="module")
def tiny():
    return gyges.Model.tiny()


def fake_nccl():
    """The pretend NCCL's counters (tests/gpu_emu/nccl.c), or None on a real one."""
    path = os.environ.get("GYGES_NCCL_LIBRARY")
    if not EMULATED or not path:
        return None
    lib = ctypes.CDLL(path)  # the library comm_nccl.c opened: dlopen hands back the same one
    lib.fake_nccl_operations.restype = ctypes.c_long
    lib.fake_nccl_last_problem.restype = ctypes.c_char_p
    return lib


def host_on(tiny, comm, layout):
    kwargs = {"comm": "nccl"} if comm == "nccl" else {"devices": 0}
    host = gyges.Host(tiny, workers=GPUS, memory_per_worker=MEMORY, page_size=PAGE, layout=layout,
                      max_prefill_chunk=16, max_batch_tokens=64, backend="cuda", **kwargs)
    assert host.comm_backend == comm
    assert host.devices == ([0, 1, 2, 3] if comm == "nccl" else [0] * GPUS)
    assert [host.worker(w).device for w in range(GPUS)] == host.devices
    assert host.layout() == layout.replace("1xTP4", "TP4")
    return host


def tokens(tiny, comm, layout, ps, params):
    host = host_on(tiny, comm, layout)
    try:
        return [r.output_tokens for r in host.generate(ps, params)]
    finally:
        host.close()


@pytest.mark.parametrize("layout", ["4xTP1", "2xTP2", "TP2+2xTP1"])
def test_nccl_host_gives_the_d2d_hosts_tokens_exactly(tiny, layout):
    ps = prompts(4, seed=21)
    fake = fake_nccl()
    before = fake.fake_nccl_operations() if fake else 0
    for params in (GREEDY, SEEDED):
        want = tokens(tiny, "d2d", layout, ps, params)
        got = tokens(tiny, "nccl", layout, ps, params)
        assert got == want, params
        assert all(len(t) == params.max_tokens for t in got)
    if fake:
        assert fake.fake_nccl_errors() == 0, fake.fake_nccl_last_problem()
        # TP1 workers need no collective; a TP2 instance all-reduces over NCCL every layer.
        assert (fake.fake_nccl_operations() > before) == (layout != "4xTP1")


def test_nccl_tp4_gives_the_d2d_tokens_but_at_near_ties_and_repeats_itself(tiny):
    ps = prompts(4, seed=22)
    fake = fake_nccl()
    want = tokens(tiny, "d2d", "1xTP4", ps, GREEDY)
    got = tokens(tiny, "nccl", "1xTP4", ps, GREEDY)
    assert assert_same_greedy_tokens(tiny, ps, got, want) <= 1
    seeded = tokens(tiny, "nccl", "1xTP4", ps, SEEDED)
    assert tokens(tiny, "nccl", "1xTP4", ps, SEEDED) == seeded
    assert all(len(t) == SEEDED.max_tokens for t in seeded)
    if fake:
        assert fake.fake_nccl_errors() == 0, fake.fake_nccl_last_problem()


def device_bytes():
    """Bytes of each emulated GPU's memory the pretend driver holds (tests/gpu_emu/libcuda.c),
    or None on a real driver."""
    if not EMULATED:
        return None
    driver = ctypes.CDLL("libcuda.so.1")  # the one csrc/mem/arena_cuda.c opened
    driver.fake_cuda_device_bytes.restype = ctypes.c_size_t
    return [driver.fake_cuda_device_bytes(d) for d in range(GPUS)]


@pytest.mark.parametrize("comm", ["nccl", "d2d"])
def test_each_workers_memory_is_on_its_own_gpu(tiny, comm):
    """Each worker's arena is on its device (on the emulator: its pages are that device's
    memory, no other's), and serving gives every KV page back."""
    before = device_bytes()
    host = host_on(tiny, comm, "2xTP2")
    host.generate(prompts(4, seed=23), GREEDY)
    assert [host.worker(w).arena.device for w in range(GPUS)] == host.devices
    assert all(m["kv"] == 0 for m in host.memory())
    if before is not None:
        grew = [after > b for after, b in zip(device_bytes(), before)]
        assert grew == [d in host.devices for d in range(GPUS)], grew
    host.close()


def test_a_rank_failing_in_a_collective_wakes_its_nccl_peer_and_serving_goes_on(tiny):
    """Faults injected into one rank's collective, step after step: the rank aborts the
    communicator, whose ncclCommAbort wakes the peer if it already waits in the NCCL all-reduce
    (it does in some of the steps: the ranks are threads racing; without the abort the peer
    would wait forever, and the pretend NCCL's hang detector would say so after a minute). Each
    step fails, new communicators are made, and serving ends with the tokens of a run without
    the faults."""
    from gyges import testing

    ps = prompts(4, seed=24)
    params = gyges.SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    want = tokens(tiny, "nccl", "2xTP2", ps, params)
    fake = fake_nccl()
    host = host_on(tiny, "nccl", "2xTP2")
    requests = [host.submit(p, params) for p in ps]
    host.step()
    events, _ = testing.count("comm", host.step)
    assert events > 0
    for n in testing.spread(max(1, events // 2), 8):  # early in the step: both instances run
        with testing.inject("comm", n) as fired:
            with pytest.raises(gyges.Error):
                host.step()
            assert fired() == 1
    host.run()
    assert [r.output_tokens for r in requests] == want
    assert all(len(r.output_tokens) == params.max_tokens for r in requests)
    if fake:
        assert fake.fake_nccl_errors() == 0, fake.fake_nccl_last_problem()
    host.close()
