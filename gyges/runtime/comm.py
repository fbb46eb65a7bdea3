"""Communicators among the workers of a host, made once at start-up.

    pool = CommPool(aligned_groups(4), backend="shm")      # CPU workers (threads)
    pool = CommPool(aligned_groups(4), backend="d2d", devices=0)            # 4 virtual workers
    pool = CommPool(aligned_groups(8), backend="nccl", devices=range(8))    # one GPU per worker
    pool.comm(0, 2)        # the compute communicator of workers {0, 1}: the all-reduces
    pool.migration(0, 4)   # the migration communicator of workers {0..3}: KV/weight moves

A TPk instance is an aligned group of workers (Flying Serving 4.3): it starts at a worker whose
index is a multiple of k. The pool makes a communicator for every such group up front, so that
forming a group during a transformation never pays for set-up (NCCL's takes seconds), and a
second one on the migration channel: its streams have the device's least priority and it has its
own NCCL communicators, so migration traffic never sits in front of the compute all-reduces on a
stream or a communicator (Gyges, PipeLive).

Backends (csrc/comm/comm.h): "shm" joins CPU worker threads over host memory; "d2d" joins
virtual workers sharing one GPU (device-to-device copies, the same sum order as shm, hence the
same bits); "nccl" joins workers on distinct GPUs of this machine.
"""
import operator

from .. import _C
from ..core.errors import InvalidArgumentError

BACKENDS = ("shm", "d2d", "nccl")
CHANNELS = ("compute", "migration")


def aligned_groups(n_workers, max_size=None, sizes=None):
    """Every aligned group of two or more workers: [(first, size), ...], a group of size k
    starting at a multiple of k; sizes 2, 4, ... up to min(n_workers, max_size), or the given
    sizes (e.g. (3,) for a model with 3 KV heads)."""
    n_workers = operator.index(n_workers)
    if n_workers < 1:
        raise InvalidArgumentError(f"n_workers must be positive, got {n_workers}")
    limit = n_workers if max_size is None else min(n_workers, operator.index(max_size))
    if sizes is None:
        sizes = [1 << i for i in range(1, limit.bit_length())]
    groups = []
    for size in sorted(set(operator.index(s) for s in sizes)):
        if 2 <= size <= limit:
            groups.extend((first, size) for first in range(0, n_workers - size + 1, size))
    return groups


def _worker_devices(backend, devices, n_workers):
    """The CUDA device of every worker (None for shm)."""
    if backend == "shm":
        return None
    if devices is None:
        return [0] * n_workers if backend == "d2d" else list(range(n_workers))
    if isinstance(devices, int):
        return [devices] * n_workers
    devices = [operator.index(d) for d in devices]
    if len(devices) < n_workers:
        raise InvalidArgumentError(f"devices names {len(devices)} GPUs for {n_workers} workers")
    return devices


_made = 0


def communicators_made():
    """Communicators made in this process so far (a switch that makes none leaves it as is)."""
    return _made


def make_comm(size, backend="shm", devices=None, channel="compute"):
    """One communicator (gyges._C.Comm), with its arguments checked here. devices: the CUDA
    device of each rank (a list) or of all of them (an int)."""
    if backend not in BACKENDS:
        raise InvalidArgumentError(f"unknown communicator backend {backend!r}; expected one of "
                         f"{', '.join(BACKENDS)}")
    if channel not in CHANNELS:
        raise InvalidArgumentError(f"unknown channel {channel!r}; expected one of {', '.join(CHANNELS)}")
    size = operator.index(size)
    global _made
    made = _C.Comm(size, backend, None if backend == "shm" else devices, channel)
    _made += 1
    return made


class CommPool:
    """A compute and a migration communicator for every group in `groups` ((first, size) pairs
    of aligned worker groups), made now. devices: for d2d one GPU (an int, default 0) shared by
    every worker; for nccl the GPU of each worker (a list indexed by worker, default worker i on
    GPU i); unused for shm. migration=False skips the migration communicators."""

    def __init__(self, groups, backend="shm", devices=None, migration=True):
        groups = [(operator.index(first), operator.index(size)) for first, size in groups]
        for first, size in groups:
            if size < 1 or first < 0 or first % size:
                raise InvalidArgumentError(f"workers {first}..{first + size - 1} are not an aligned group")
        if backend not in BACKENDS:
            raise InvalidArgumentError(f"unknown communicator backend {backend!r}; expected one of "
                             f"{', '.join(BACKENDS)}")
        n_workers = max((first + size for first, size in groups), default=0)
        self.backend = backend
        self.devices = _worker_devices(backend, devices, n_workers)
        self._compute, self._migration = {}, {}
        for first, size in groups:
            ranks = None if self.devices is None else self.devices[first:first + size]
            self._compute[(first, size)] = make_comm(size, backend, ranks, "compute")
            if migration:
                self._migration[(first, size)] = make_comm(size, backend, ranks, "migration")

    def groups(self):
        return list(self._compute)

    def _lookup(self, table, first, size, what):
        try:
            return table[(first, size)]
        except KeyError:
            if (first, size) in self._compute:
                raise InvalidArgumentError("this pool was made without migration communicators") from None
            raise InvalidArgumentError(f"no {what} communicator for workers {first}..{first + size - 1}: "
                             f"groups must be aligned (pool: {self.groups()})") from None

    def comm(self, first, size):
        """The compute communicator of the aligned group starting at worker `first`."""
        return self._lookup(self._compute, first, size, "compute")

    def migration(self, first, size):
        """The migration communicator of the same group (least-priority streams)."""
        return self._lookup(self._migration, first, size, "migration")

    def stats(self):
        """{(first, size): {"compute": stats, "migration": stats}}."""
        return {key: {"compute": comm.stats(),
                      **({"migration": self._migration[key].stats()}
                         if key in self._migration else {})}
                for key, comm in self._compute.items()}

    def reset_stats(self):
        for comm in (*self._compute.values(), *self._migration.values()):
            comm.reset_stats()

    def close(self):
        """Frees the communicators (device backends wait for their streams)."""
        self._compute.clear()
        self._migration.clear()

    def __len__(self):
        return len(self._compute)

    def __repr__(self):
        return (f"CommPool(backend={self.backend!r}, groups={self.groups()}, "
                f"migration={bool(self._migration)})")
