"""Communicator backends (csrc/comm/): shm on host memory, d2d for virtual workers sharing one
GPU, nccl for one GPU per worker; and the pool of communicators a host makes at start-up.

Every collective is driven the way engines drive it: one thread per rank, each calling with its
own buffers (NumPy arrays for shm, device addresses for d2d and nccl).

What runs everywhere: the refusals (unknown backend, bad sizes, device lists, d2d/nccl without a
GPU raise gyges.UnavailableError naming the reason), the shm collectives against NumPy, the pool,
and the d2d and nccl backends' host logic compiled against a pretend GPU and NCCL
(tests/gpu_emu/) under ThreadSanitizer and ASan+UBSan. What needs a GPU (skipped with the
reason otherwise): d2d against shm on the device, nccl (two GPUs or more).

Tolerance policy: exact everywhere except the nccl all-reduce of random floats. The shm and d2d
all-reduces promise the same bits as a float32 pairwise tree ((r0 + r1) + (r2 + r3)) computed by
NumPy, and each other's; gathers and all-to-alls are copies. NCCL adds in its own order, so its
random-float sums are checked to within size * u * sum|x| (u = 2^-24, one rounding per add), and
its sums of small integers, which every order gives exactly, bit for bit.
"""
import gc
import importlib.util
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import gyges
from gyges import _C
from gyges.runtime.comm import CommPool, aligned_groups, make_comm
from gyges.core.errors import InvalidArgumentError, UnavailableError

MiB = 1 << 20
PAGE = 2 * MiB


def _gpu_count():
    if not _C.WITH_CUDA:
        return 0
    return _C.cuda_device_count()


from gpu import GPU_SKIP_REASON, needs_gpu  # noqa: E402  (tests/gpu.py)
GPUS = _gpu_count()


def needs_gpus(n):
    return pytest.mark.skipif(GPUS < n, reason=f"needs {n} GPUs, this machine has {GPUS}"
                              + (f" ({GPU_SKIP_REASON})" if GPU_SKIP_REASON else ""))


def run_ranks(size, fn, timeout=120):
    """fn(rank) on `size` threads at once, as engines call collectives; returns the results in
    rank order and re-raises the first rank's exception. A rank that never returns fails the
    test instead of hanging it (its thread is a daemon)."""
    results, errors = [None] * size, [None] * size

    def body(rank):
        try:
            results[rank] = fn(rank)
        except BaseException as error:  # noqa: BLE001 - handed to the main thread
            errors[rank] = error

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    stuck = [r for r, t in enumerate(threads) if t.is_alive()]
    assert not stuck, f"ranks {stuck} never returned from the collective"
    for error in errors:
        if error is not None:
            raise error
    return results


def tree_sum(parts):
    """The float32 tree of core/tree.h, in NumPy, by its recursive definition: the sum of the
    first 2^k parts plus the sum of the rest, 2^k the largest power of two below their number
    (((p0 + p1) + (p2 + p3)) for 4, (p0 + p1) + p2 for 3)."""
    parts = [np.asarray(p, np.float32) for p in parts]
    if len(parts) == 1:
        return parts[0]
    half = 1 << ((len(parts) - 1).bit_length() - 1)
    return tree_sum(parts[:half]) + tree_sum(parts[half:])


def rank_inputs(size, n, seed):
    """Floats of mixed magnitudes and signs, so that the order of the additions shows in the
    low bits of the sums."""
    rng = np.random.default_rng(seed)
    scale = np.float32(10.0) ** rng.integers(-3, 4, size=(size, n)).astype(np.float32)
    return (rng.standard_normal((size, n)).astype(np.float32) * scale).astype(np.float32)


def a2a_sizes(size, seed, unit=1):
    """sizes[s][d]: bytes rank s sends rank d; some pairs (the diagonal included) send nothing."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, 40, size=(size, size)) * unit + rng.integers(0, 2, size=(size, size))
    sizes[rng.random((size, size)) < 0.2] = 0
    return sizes.astype(np.int64)


# ---- shm from Python: the reference the device backends are compared with ----

def shm_all_reduce(parts):
    size = len(parts)
    comm = _C.Comm(size)
    bufs = [np.array(p, np.float32) for p in parts]
    run_ranks(size, lambda r: comm.all_reduce(r, bufs[r]))
    return bufs, comm.stats()


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("n", [1, 3, 1003, 3 * 65536 + 5])
def test_shm_all_reduce_is_the_numpy_tree(size, n):
    parts = rank_inputs(size, n, seed=size * 7 + n)
    bufs, stats = shm_all_reduce(parts)
    want = tree_sum(parts)
    for r in range(size):
        assert bufs[r].tobytes() == want.tobytes(), f"rank {r}"
    moved = n * 4 * 2 * (size - 1) // size
    assert stats == {"calls": int(size > 1), "bytes_sent": [moved] * size,
                     "bytes_received": [moved] * size}


def test_shm_all_gather_and_all_to_all_from_python_threads():
    size, nbytes = 4, 1001
    rng = np.random.default_rng(3)
    ins = [rng.integers(0, 256, nbytes, dtype=np.uint8) for _ in range(size)]
    outs = [np.zeros(size * nbytes, np.uint8) for _ in range(size)]
    comm = _C.Comm(size)
    run_ranks(size, lambda r: comm.all_gather(r, outs[r], ins[r]))
    for r in range(size):
        assert outs[r].tobytes() == b"".join(x.tobytes() for x in ins)
    sizes = a2a_sizes(size, seed=4)
    send = [[rng.integers(0, 256, sizes[s][d], dtype=np.uint8) for d in range(size)]
            for s in range(size)]
    recv = [[np.zeros(sizes[s][d], np.uint8) for s in range(size)] for d in range(size)]
    comm.reset_stats()
    run_ranks(size, lambda r: comm.all_to_all(r, recv[r], sizes[:, r].tolist(), send[r],
                                              sizes[r].tolist()))
    for d in range(size):
        for s in range(size):
            assert recv[d][s].tobytes() == send[s][d].tobytes()
    off = sizes * (1 - np.eye(size, dtype=np.int64))
    assert comm.stats() == {"calls": 1, "bytes_sent": off.sum(1).tolist(),
                            "bytes_received": off.sum(0).tolist()}
    run_ranks(size, comm.barrier)
    assert comm.stats()["calls"] == 1


def test_shm_refuses_a_mismatched_all_to_all_on_the_receiver():
    comm = _C.Comm(2)
    data = [np.full(4, r + 1, np.uint8) for r in range(2)]
    recv = [[np.zeros(4, np.uint8) for _ in range(2)] for _ in range(2)]

    def rank(r):
        expect = [4, 4] if r == 0 else [3, 4]  # rank 1 expects 3 bytes from rank 0, gets 4
        try:
            comm.all_to_all(r, recv[r], expect, [data[r], data[r]], [4, 4])
        except InvalidArgumentError as error:
            return str(error)
        return None

    messages = run_ranks(2, rank)
    assert messages[0] is None and "rank 1 expects 3 bytes from rank 0" in messages[1]
    assert (recv[0][1] == 2).all() and (recv[1][1] == 2).all()  # the other pairs moved


def test_shm_send_recv_passes_a_pipeline_of_stages_in_order():
    """Hidden states through a pipeline: rank r receives from r - 1, adds, sends to r + 1; two
    messages of different sizes per step, so order within a pair matters."""
    size, steps = 4, 6
    rng = np.random.default_rng(5)
    inputs = [rng.standard_normal(17 * (k + 1)).astype(np.float32) for k in range(steps)]
    got = []
    comm = _C.Comm(size)

    def rank(r):
        for k, x in enumerate(inputs):
            buf = x.copy() if r == 0 else np.empty_like(x)
            tag = np.empty(1, np.int64) if r else np.array([k], np.int64)
            if r > 0:
                comm.recv(r, r - 1, tag)
                comm.recv(r, r - 1, buf)
                buf += np.float32(r)
            if r + 1 < size:
                comm.send(r, r + 1, tag)
                comm.send(r, r + 1, buf)
            else:
                got.append((int(tag[0]), buf))

    run_ranks(size, rank)
    assert [k for k, _ in got] == list(range(steps))
    for (_, y), x in zip(got, inputs):
        want = x.copy()
        for r in range(1, size):
            want += np.float32(r)  # the same float32 adds in the same order
        assert y.tobytes() == want.tobytes()
    stats = comm.stats()
    moved = sum(8 + x.nbytes for x in inputs)
    assert stats["calls"] == 2 * steps * (size - 1)
    assert stats["bytes_sent"] == [moved] * (size - 1) + [0]
    assert stats["bytes_received"] == [0] + [moved] * (size - 1)


def test_shm_send_recv_of_another_size_fails_both_ranks():
    comm = _C.Comm(2)
    out = np.full(8, 7, np.uint8)

    def rank(r):
        try:
            if r == 0:
                comm.send(0, 1, np.arange(4, dtype=np.uint8))
            else:
                comm.recv(1, 0, out)
        except InvalidArgumentError as error:
            return str(error)

    messages = run_ranks(2, rank)
    assert "rank 0 sends 4 bytes to rank 1, which expects 8" in messages[0]
    assert "rank 1 expects 8 bytes from rank 0, which sends 4" in messages[1]
    assert (out == 7).all()
    assert comm.stats()["calls"] == 0
    with pytest.raises(InvalidArgumentError, match="cannot exchange with rank 0"):
        comm.send(0, 0, out)
    with pytest.raises(InvalidArgumentError, match="needs 9"):
        comm.recv(1, 0, out, 9)
    with pytest.raises(TypeError, match="writable"):
        comm.recv(1, 0, out.tobytes())


def test_shm_python_arguments_are_checked_before_the_ranks_meet():
    comm = _C.Comm(2)
    x = np.zeros(4, np.float32)
    with pytest.raises(InvalidArgumentError, match="rank 2"):
        comm.all_reduce(2, x)
    with pytest.raises(TypeError, match="host memory"):
        comm.all_reduce(0, 12345, 4)  # an address: shm works on buffers
    with pytest.raises(ValueError, match="needs 32"):
        comm.all_reduce(0, x, 8)
    with pytest.raises(ValueError, match="float32"):
        comm.all_reduce(0, np.zeros(3, np.uint8))
    with pytest.raises(ValueError, match="needs 32"):
        comm.all_gather(0, np.zeros(31, np.uint8), np.zeros(16, np.uint8))
    with pytest.raises(ValueError, match="2 ranks"):
        comm.all_to_all(0, [x], [0], [x], [0])
    with pytest.raises(ValueError, match="needs 17"):
        comm.all_to_all(0, [x, x], [17, 0], [x, x], [0, 0])
    with pytest.raises(TypeError, match="host memory already"):
        comm.upload(0, 12345, x)
    with pytest.raises(TypeError, match="host memory already"):
        comm.download(0, x, 12345)
    before = sys.getrefcount(x)
    for _ in range(1000):
        with pytest.raises(ValueError):
            comm.all_to_all(0, [x, x], [0, 0], [x, x], [0, 99])
    gc.collect()
    assert sys.getrefcount(x) == before
    x.resize(5, refcheck=False)  # raises if a buffer export were still held


# ---- refusals that run on every machine ----

def test_unknown_backend_and_channel_are_refused():
    with pytest.raises(InvalidArgumentError, match="unknown communicator backend 'mpi'"):
        _C.Comm(2, "mpi")
    with pytest.raises(ValueError, match="expected one of shm, d2d, nccl"):
        make_comm(2, "gloo")
    with pytest.raises(InvalidArgumentError, match="channel"):
        _C.Comm(2, "shm", None, "bulk")
    with pytest.raises(ValueError, match="channel"):
        make_comm(2, "shm", channel="bulk")
    with pytest.raises(ValueError, match="backend"):
        CommPool([(0, 2)], backend="mpi")


@pytest.mark.parametrize("backend", ["shm", "d2d", "nccl"])
@pytest.mark.parametrize("size", [0, 17, 32, -2])
def test_bad_sizes_are_refused_before_any_device(backend, size):
    with pytest.raises(InvalidArgumentError, match="1 to 16 ranks"):
        _C.Comm(size, backend)


def test_device_lists_are_checked_before_any_device():
    with pytest.raises(InvalidArgumentError, match="one GPU"):
        _C.Comm(2, "d2d", [0, 1])
    with pytest.raises(InvalidArgumentError, match="one GPU per rank"):
        _C.Comm(2, "nccl", [3, 3])
    with pytest.raises(InvalidArgumentError, match="one GPU per rank"):
        _C.Comm(2, "nccl", 0)  # an int puts every rank on that device
    with pytest.raises(InvalidArgumentError, match="negative"):
        _C.Comm(2, "d2d", [-1, -1])
    with pytest.raises(ValueError, match="3 devices for 2 ranks"):
        _C.Comm(2, "d2d", [0, 0, 0])
    with pytest.raises(TypeError):
        _C.Comm(2, "d2d", 2.5)


@pytest.mark.parametrize("backend", ["d2d", "nccl"])
def test_device_backends_without_a_gpu_are_unavailable_with_the_reason(backend):
    if GPU_SKIP_REASON is None:
        pytest.skip("a CUDA device is present: the GPU tests below cover this backend")
    with pytest.raises(UnavailableError) as info:
        _C.Comm(2, backend, [0, 0] if backend == "d2d" else [0, 1])
    message = str(info.value)
    assert isinstance(info.value, gyges.Error)
    assert f"the {backend} communicator is not available" in message, message
    if not _C.WITH_CUDA:
        assert "not built with CUDA" in message
    else:
        # No driver, an old driver, no device, or (nccl) no libnccl.so.2: named either way.
        assert any(word in message for word in ("CUDA", "driver", "device", "NCCL")), message
    with pytest.raises(UnavailableError):
        CommPool(aligned_groups(4), backend=backend)
    # The refusal leaves shm working.
    comm = _C.Comm(2)
    bufs = [np.ones(3, np.float32), np.full(3, 2.0, np.float32)]
    run_ranks(2, lambda r: comm.all_reduce(r, bufs[r]))
    assert (bufs[0] == 3.0).all()


def test_nccl_refuses_more_gpus_than_the_machine_has():
    with pytest.raises(UnavailableError, match="not available"):
        _C.Comm(16, "nccl")  # 16 GPUs in one process: no machine here has them


# ---- the pool ----

def test_aligned_groups():
    assert aligned_groups(4) == [(0, 2), (2, 2), (0, 4)]
    assert aligned_groups(8, max_size=4) == [(0, 2), (2, 2), (4, 2), (6, 2), (0, 4), (4, 4)]
    assert aligned_groups(1) == []
    assert aligned_groups(6) == [(0, 2), (2, 2), (4, 2), (0, 4)]
    with pytest.raises(ValueError):
        aligned_groups(0)


def test_pool_makes_a_compute_and_a_migration_comm_per_group():
    pool = CommPool(aligned_groups(4), backend="shm")
    assert pool.groups() == [(0, 2), (2, 2), (0, 4)] and len(pool) == 3
    for first, size in pool.groups():
        c, m = pool.comm(first, size), pool.migration(first, size)
        assert c is not m and c.size == m.size == size
        assert (c.channel, m.channel) == ("compute", "migration")
        assert c.backend == m.backend == "shm" and c.devices is None
    with pytest.raises(ValueError, match="aligned"):
        pool.comm(1, 2)
    with pytest.raises(ValueError, match="aligned"):
        CommPool([(1, 2)])
    without = CommPool([(0, 2)], migration=False)
    with pytest.raises(ValueError, match="without migration"):
        without.migration(0, 2)
    bufs = [np.full(5, r, np.float32) for r in range(4)]
    run_ranks(4, lambda r: pool.migration(0, 4).all_reduce(r, bufs[r]))
    stats = pool.stats()
    assert stats[(0, 4)]["migration"]["calls"] == 1 and stats[(0, 4)]["compute"]["calls"] == 0
    pool.reset_stats()
    assert pool.stats()[(0, 4)]["migration"]["calls"] == 0
    pool.close()
    assert len(pool) == 0


def test_host_uses_the_pool():
    host = gyges.Host(gyges.Model.tiny(), workers=4, memory_per_worker="48MiB", layout="2xTP2")
    assert host.comm(0, 2).channel == "compute" and host.migration_comm(0, 2).channel == "migration"
    assert host.comm(0, 4) is host.comms.comm(0, 4)
    with pytest.raises(ValueError, match="aligned"):
        host.comm(1, 2)
    host.generate([[1, 2, 3]], gyges.SamplingParams(max_tokens=4))
    assert host.comm(0, 2).stats()["calls"] > 0  # the engines all-reduce through it


# ---- device buffers for the GPU tests: one CUDA arena per rank, like virtual workers ----

class RankMemory:
    """A CUDA arena per rank of `comm` (on the rank's device) with a bump allocator over it.
    Data goes in and out with comm.upload/download, in the order of the rank's stream: a write
    is seen by the rank's next collective, a read sees its last one (no host synchronisation,
    and no legacy-stream copy that a non-blocking stream would not wait for)."""

    def __init__(self, comm, nbytes):
        pages = max(1, -(-nbytes // PAGE))
        self.comm = comm
        self.arenas = [gyges.Arena(budget=pages * PAGE, page_size=PAGE, n_slots=pages,
                                   backend="cuda", device=d) for d in comm.devices]
        for a in self.arenas:
            a.grow(0, pages, "other")
        self.used = [0] * comm.size
        self.capacity = pages * PAGE

    def alloc(self, rank, nbytes):
        offset = self.used[rank]
        self.used[rank] = offset + -(-max(nbytes, 1) // 256) * 256  # keep addresses aligned
        assert self.used[rank] <= self.capacity, "test arena too small"
        return self.arenas[rank].base_address + offset

    def write(self, rank, address, array):
        self.comm.upload(rank, address, np.ascontiguousarray(array))

    def read(self, rank, address, nbytes, dtype=np.uint8):
        out = np.empty(nbytes, np.uint8)
        self.comm.download(rank, out, address)
        return out.view(dtype)


def sync_all(comm):
    for r in range(comm.size):
        comm.synchronize(r)


# ---- d2d (one GPU, virtual workers) ----

@needs_gpu
@pytest.mark.parametrize("size", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [1, 3, 1003, 3 * 65536 + 5])
def test_d2d_all_reduce_has_the_bits_of_shm(size, n):
    parts = rank_inputs(size, n, seed=size * 7 + n)
    shm_bufs, shm_stats = shm_all_reduce(parts)
    comm = _C.Comm(size, "d2d", 0)
    mem = RankMemory(comm, n * 4)
    bufs = [mem.alloc(r, n * 4) for r in range(size)]
    for r in range(size):
        mem.write(r, bufs[r], parts[r])
    run_ranks(size, lambda r: comm.all_reduce(r, bufs[r], n))
    want = tree_sum(parts)
    for r in range(size):
        got = mem.read(r, bufs[r], n * 4, np.float32)  # ordered after it on the rank's stream
        assert got.tobytes() == shm_bufs[r].tobytes() == want.tobytes(), (
            f"rank {r}: {np.count_nonzero(got != want)} of {n} differ from the tree sum")
    assert comm.stats() == shm_stats


@needs_gpu
def test_d2d_all_reduce_reuses_and_grows_its_scratch():
    size, largest = 4, 40000
    comm = _C.Comm(size, "d2d", 0)
    mem = RankMemory(comm, largest * 4)
    bufs = [mem.alloc(r, largest * 4) for r in range(size)]
    sizes = [1000, largest, 7, largest, largest - 1]  # grows twice, then reuses
    for k, n in enumerate(sizes):
        parts = rank_inputs(size, n, seed=100 + k)
        for r in range(size):
            mem.write(r, bufs[r], parts[r])
        run_ranks(size, lambda r: comm.all_reduce(r, bufs[r], n))
        want = tree_sum(parts).tobytes()
        assert all(mem.read(r, bufs[r], n * 4).tobytes() == want for r in range(size)), n
    assert comm.stats()["calls"] == len(sizes)


def check_all_to_all(comm, mem, size, sizes, rng):
    """An all-to-all of random bytes, sizes[s][d] from rank s to rank d, between fresh buffers:
    every byte lands where it should, and the stats count each pair once (a rank's own part
    moves no bytes between ranks)."""
    send = [[rng.integers(0, 256, sizes[s][d], dtype=np.uint8) for d in range(size)]
            for s in range(size)]
    send_addr = [[mem.alloc(s, sizes[s][d]) for d in range(size)] for s in range(size)]
    recv_addr = [[mem.alloc(d, sizes[s][d]) for s in range(size)] for d in range(size)]
    for s in range(size):
        for d in range(size):
            mem.write(s, send_addr[s][d], send[s][d])
    comm.reset_stats()
    run_ranks(size, lambda r: comm.all_to_all(r, recv_addr[r], sizes[:, r].tolist(),
                                              send_addr[r], sizes[r].tolist()))
    sync_all(comm)
    for d in range(size):
        for s in range(size):
            got = mem.read(d, recv_addr[d][s], int(sizes[s][d]))
            assert got.tobytes() == send[s][d].tobytes(), (s, d)
    off = sizes * (1 - np.eye(size, dtype=np.int64))
    assert comm.stats() == {"calls": 1, "bytes_sent": off.sum(1).tolist(),
                            "bytes_received": off.sum(0).tolist()}


@needs_gpu
@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_d2d_all_gather_and_all_to_all_are_exact(size):
    rng = np.random.default_rng(size)
    nbytes = 1001
    comm = _C.Comm(size, "d2d", 0)
    sizes = a2a_sizes(size, seed=size + 1, unit=97)
    mem = RankMemory(comm, size * nbytes + 2 * int(sizes.max()) * size + 64 * 1024)
    ins = [rng.integers(0, 256, nbytes, dtype=np.uint8) for _ in range(size)]
    in_addr = [mem.alloc(r, nbytes) for r in range(size)]
    out_addr = [mem.alloc(r, size * nbytes) for r in range(size)]
    for r in range(size):
        mem.write(r, in_addr[r], ins[r])
        mem.write(r, out_addr[r], np.full(size * nbytes, 0xEE, np.uint8))
    run_ranks(size, lambda r: comm.all_gather(r, out_addr[r], in_addr[r], nbytes))
    sync_all(comm)
    for r in range(size):
        assert mem.read(r, out_addr[r], size * nbytes).tobytes() == b"".join(x.tobytes() for x in ins)
    gather_stats = comm.stats()
    assert gather_stats == {"calls": 1, "bytes_sent": [nbytes * (size - 1)] * size,
                            "bytes_received": [nbytes * (size - 1)] * size}

    check_all_to_all(comm, mem, size, sizes, rng)


@needs_gpu
def test_d2d_refuses_a_mismatched_all_to_all_on_the_receiver():
    comm = _C.Comm(2, "d2d", 0)
    mem = RankMemory(comm, 4096)
    send = [mem.alloc(r, 64) for r in range(2)]
    recv = [[mem.alloc(r, 64) for _ in range(2)] for r in range(2)]
    for r in range(2):
        mem.write(r, send[r], np.full(64, r + 1, np.uint8))

    def rank(r):
        expect = [16, 16] if r == 0 else [15, 16]
        try:
            comm.all_to_all(r, recv[r], expect, [send[r], send[r]], [16, 16])
        except InvalidArgumentError as error:
            return str(error)
        return None

    messages = run_ranks(2, rank)
    sync_all(comm)
    assert messages[0] is None and "rank 1 expects 15 bytes from rank 0" in messages[1]
    assert (mem.read(1, recv[1][1], 16) == 2).all()  # the other pairs still moved


@needs_gpu
def test_d2d_streams_priorities_and_set_stream_are_honoured():
    size = 4
    compute = _C.Comm(size, "d2d", 0)
    migration = _C.Comm(size, "d2d", 0, "migration")
    assert compute.devices == migration.devices == (0,) * size
    for r in range(size):
        assert compute.stream(r) != 0 and migration.stream(r) != 0
        assert compute.stream(r) != migration.stream(r)
        # Greatest priority (lowest number) for compute, least for migration.
        assert compute.stream_priority(r) < migration.stream_priority(r)
    # A rank's collectives go on whatever stream it is given: here the migration comm's, so
    # synchronising that stream alone is enough to see the result.
    n = 1 << 20
    parts = rank_inputs(size, n, seed=9)
    mem = RankMemory(compute, n * 4)
    bufs = [mem.alloc(r, n * 4) for r in range(size)]
    for r in range(size):
        mem.write(r, bufs[r], parts[r])  # on compute's own stream, before the switch
        compute.set_stream(r, migration.stream(r))
        assert compute.stream(r) == migration.stream(r)
        assert compute.stream_priority(r) == migration.stream_priority(r)
    run_ranks(size, lambda r: compute.all_reduce(r, bufs[r], n))
    sync_all(migration)
    want = tree_sum(parts).tobytes()
    assert all(mem.read(r, bufs[r], n * 4).tobytes() == want for r in range(size))
    # The legacy default stream is a stream too.
    for r in range(size):
        compute.set_stream(r, 0)
    run_ranks(size, lambda r: compute.barrier(r))
    sync_all(compute)


@needs_gpu
def test_d2d_collectives_in_a_loop_with_barriers():
    """Many back-to-back calls on the ranks' own streams: the event protocol must keep each
    call's reads before the next call's writes (a race shows as wrong sums)."""
    size, n, rounds = 4, 4099, 50
    comm = _C.Comm(size, "d2d", 0)
    mem = RankMemory(comm, n * 4)
    bufs = [mem.alloc(r, n * 4) for r in range(size)]
    ones = np.ones(n, np.float32)
    for r in range(size):
        mem.write(r, bufs[r], ones)

    def rank(r):
        for k in range(rounds):
            comm.all_reduce(r, bufs[r], n)  # x -> 4x each round (exact in float32 until 2^126)
            if k % 10 == 0:
                comm.barrier(r)

    run_ranks(size, rank)
    sync_all(comm)
    want = np.full(n, 4.0 ** rounds, np.float32).tobytes()
    assert all(mem.read(r, bufs[r], n * 4).tobytes() == want for r in range(size))
    assert comm.stats()["calls"] == rounds


def check_send_recv_chain(comm, mem, rounds=8, seed=9):
    """Round k moves a block of bytes from rank 0 through every rank to the last, each hop
    receiving into its one device buffer and sending from it at once, with no host wait."""
    size = comm.size
    rng = np.random.default_rng(seed)
    cap = 1 << 16
    bufs = [mem.alloc(r, cap) for r in range(size)]
    data = [rng.integers(0, 256, int(rng.integers(1, cap)), dtype=np.uint8) for _ in range(rounds)]

    def rank(r):
        for k, x in enumerate(data):
            if r == 0:
                mem.write(0, bufs[0], x)
            else:
                comm.recv(r, r - 1, bufs[r], x.nbytes)
            if r + 1 < size:
                comm.send(r, r + 1, bufs[r], x.nbytes)
            else:
                got[k] = mem.read(r, bufs[r], x.nbytes)  # in the order of the rank's stream
        comm.synchronize(r)

    got = [None] * rounds
    run_ranks(size, rank)
    for k, x in enumerate(data):
        assert got[k].tobytes() == x.tobytes()


@needs_gpu
@pytest.mark.parametrize("size", [2, 4])
def test_d2d_send_recv_chain(size):
    comm = make_comm(size, "d2d")
    check_send_recv_chain(comm, RankMemory(comm, 1 << 20))


@needs_gpus(2)
def test_nccl_send_recv_chain():
    size = min(GPUS, 4) if GPUS != 3 else 2
    comm = _C.Comm(size, "nccl", list(range(size)))
    check_send_recv_chain(comm, RankMemory(comm, 1 << 20))


@needs_gpu
def test_d2d_pool_for_four_virtual_workers():
    pool = CommPool(aligned_groups(4), backend="d2d", devices=0)
    assert pool.devices == [0, 0, 0, 0]
    for first, size in pool.groups():
        c, m = pool.comm(first, size), pool.migration(first, size)
        assert c.backend == "d2d" and c.devices == (0,) * size
        assert c.stream_priority(0) < m.stream_priority(0)
    pool.close()


# ---- nccl (one GPU per rank) ----

@needs_gpus(2)
@pytest.mark.parametrize("size", [2, 4, 8])
def test_nccl_collectives(size):
    if GPUS < size:
        pytest.skip(f"needs {size} GPUs, this machine has {GPUS}")
    devices = list(range(size))
    comm = _C.Comm(size, "nccl", devices)
    assert comm.devices == tuple(devices)
    n = 100003
    rng = np.random.default_rng(size)
    mem = RankMemory(comm, 8 * n * 4)
    # Small integers: every order of additions gives them exactly.
    ints = rng.integers(-1000, 1000, size=(size, n)).astype(np.float32)
    floats = rank_inputs(size, n, seed=5)
    for parts in (ints, floats):
        bufs = [mem.alloc(r, n * 4) for r in range(size)]
        for r in range(size):
            mem.write(r, bufs[r], parts[r])
        run_ranks(size, lambda r: comm.all_reduce(r, bufs[r], n))
        sync_all(comm)
        want = parts.astype(np.float64).sum(0)
        bound = size * 2.0**-24 * np.abs(parts.astype(np.float64)).sum(0)
        for r in range(size):
            got = mem.read(r, bufs[r], n * 4, np.float32)
            if parts is ints:
                assert got.tobytes() == want.astype(np.float32).tobytes()
            else:
                err = np.abs(got - want)
                assert (err <= bound).all(), f"largest error {err.max()} (bound {bound.max()})"
    nbytes = 4097
    ins = [rng.integers(0, 256, nbytes, dtype=np.uint8) for _ in range(size)]
    in_addr = [mem.alloc(r, nbytes) for r in range(size)]
    out_addr = [mem.alloc(r, size * nbytes) for r in range(size)]
    for r in range(size):
        mem.write(r, in_addr[r], ins[r])
    comm.reset_stats()
    run_ranks(size, lambda r: comm.all_gather(r, out_addr[r], in_addr[r], nbytes))
    sync_all(comm)
    for r in range(size):
        assert mem.read(r, out_addr[r], size * nbytes).tobytes() == b"".join(x.tobytes() for x in ins)
    assert comm.stats()["bytes_received"] == [nbytes * (size - 1)] * size

    sizes = a2a_sizes(size, seed=size + 2, unit=1001)
    check_all_to_all(comm, mem, size, sizes, rng)
    run_ranks(size, comm.barrier)
    sync_all(comm)


@needs_gpus(2)
def test_nccl_refuses_a_mismatched_all_to_all_on_every_rank():
    comm = _C.Comm(2, "nccl", [0, 1])
    mem = RankMemory(comm, 4096)
    send = [mem.alloc(r, 64) for r in range(2)]
    recv = [[mem.alloc(r, 64) for _ in range(2)] for r in range(2)]

    def rank(r):
        with pytest.raises(InvalidArgumentError, match="rank 1 expects 15 bytes from rank 0"):
            comm.all_to_all(r, recv[r], [16, 16] if r == 0 else [15, 16], [send[r]] * 2, [16, 16])
        comm.all_to_all(r, recv[r], [16, 16], [send[r]] * 2, [16, 16])  # still usable

    run_ranks(2, rank)
    sync_all(comm)


@needs_gpus(2)
def test_nccl_pool_has_migration_comms_on_least_priority_streams():
    pool = CommPool([(0, 2)], backend="nccl")
    c, m = pool.comm(0, 2), pool.migration(0, 2)
    assert c.devices == m.devices == (0, 1)
    assert all(c.stream_priority(r) < m.stream_priority(r) for r in range(2))
    pool.close()


# ---- the device backends' host logic on the emulated GPU (tests/gpu_emu/), on every machine ----

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("gpu_emu_build", ROOT / "tests/gpu_emu/build.py")
gpu_emu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_emu)

SANITIZERS = ("thread", "address")


@pytest.fixture(scope="module")
def fake_build(tmp_path_factory):
    why_not = gpu_emu.check()
    if why_not is not None:
        pytest.skip(why_not)
    return gpu_emu.build_comm(tmp_path_factory.mktemp("gpu_emu"))


@pytest.mark.parametrize("sanitizer", SANITIZERS)
@pytest.mark.parametrize("machine", ["gpu", "bare"])
def test_device_backends_on_a_pretend_gpu(fake_build, sanitizer, machine):
    """The d2d and nccl backends and comm_d2d.cu compiled with GY_WITH_CUDA against the emulated
    runtime: four emulated GPUs and a pretend NCCL ("gpu"), or none of either ("bare"). Their
    streams are threads that overtake each other at random, so a missing wait shows as wrong
    bytes or a sanitizer report. test_comm.c also checks the pretend NCCL's own behaviour
    (InitRank, groups from one thread, blocking sends, abort, the hang detector) and the
    devices' separate memory and peer copies."""
    env = {**os.environ, "FAKE_MODE": machine, "GYGES_EMU_STREAMS": "threads",
           "GYGES_EMU_DEVICES": "4" if machine == "gpu" else "0",
           "GYGES_NCCL_LIBRARY": str(fake_build["nccl"]) if machine == "gpu" else "/nonexistent",
           "TSAN_OPTIONS": "halt_on_error=1", "ASAN_OPTIONS": "detect_leaks=1"}
    # A sanitizer runtime that cannot start here (ThreadSanitizer on kernels with high mmap
    # randomisation) is the machine's limit, not a failure of the code: run no test first.
    probe = subprocess.run([str(fake_build[sanitizer]), "no test has this name"], env=env,
                           capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"the {sanitizer} sanitizer runtime does not start on this machine: "
                    f"{probe.stderr.strip()[:200]}")
    result = subprocess.run([str(fake_build[sanitizer])], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert " passed, 0 failed" in result.stdout and "Sanitizer" not in result.stderr, (
        result.stdout + result.stderr)


def test_comm_benchmark_skips_cleanly_without_a_gpu():
    if GPU_SKIP_REASON is None:
        pytest.skip("a GPU is present: `make bench` runs benchmarks/bench_cuda_comm.py for real")
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_cuda_comm.py")],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"skipped: {GPU_SKIP_REASON}"
