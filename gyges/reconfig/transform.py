"""Gyges' live tensor-parallel transformation (Gyges section 4, AMOEBAs section 3): merge m
instances of TPt into one TPk, or split one TPk into m instances of TPt, with requests in
flight, moving no request's progress and recomputing nothing. host.transform builds one with
`transformation()` below:

    at once          at_once.ScaleUp / ScaleDown: every layer between two steps
    layer-staggered  staggered.StaggeredScaleUp / StaggeredScaleDown: a few layers per step
                     (Gyges 4.3), serving in between

What they share is here: the arguments' checks, the handle's statistics, and the small steps
(the instances a merge takes, the instance a split cuts, room in a cache)."""
import time

from ..core import checks
from ..core.errors import BusyError, InvalidArgumentError
from .baselines import METHODS
from .plans import TransformError
from .reconfiguration import Reconfiguration


class Transform(Reconfiguration):
    """What every Gyges transformation shares. Its stats, beside the protocol's: per worker
    bytes_sent, bytes_received, weight_bytes_released, weight_bytes_copied, kv_pages_mapped,
    kv_bytes_trimmed, peak_extra_bytes; requests_moved; phase_seconds; and, layer-staggered,
    bytes_read_beside_steps, bytes_in_place, stage_bytes, steps_waiting, steps_blocked."""

    def __init__(self, host, kind, workers, from_tp, to_tp, method):
        super().__init__(host, workers)
        self.kind, self.from_tp, self.to_tp, self.method = kind, from_tp, to_tp, method
        ws = self.workers
        self.stats.update(
            bytes_sent={w: 0 for w in ws}, bytes_received={w: 0 for w in ws},
            weight_bytes_released={w: 0 for w in ws}, weight_bytes_copied={w: 0 for w in ws},
            kv_pages_mapped={w: 0 for w in ws}, kv_bytes_trimmed={w: 0 for w in ws},
            peak_extra_bytes={w: 0 for w in ws}, phase_seconds={},
            bytes_read_beside_steps=0, bytes_in_place=0, stage_bytes=0, steps_waiting=0,
            steps_blocked=0)
        self.staging_peak = {}  # worker -> the most device staging a KV move held on it

    def __repr__(self):
        return (f"{type(self).__name__}({self.kind} TP{self.from_tp}->TP{self.to_tp} on workers "
                f"{list(self.workers)}, {self.state})")

    def _time(self, phase, start):
        self.stats["phase_seconds"][phase] = self.stats["phase_seconds"].get(phase, 0.0) + (
            time.perf_counter() - start)

    def _count(self, src, dst, nbytes):
        """KV bytes from worker src to worker dst (none counted within one worker)."""
        self.stats["kv_bytes_moved"] += nbytes
        self.stats["bytes_moved"] += nbytes
        if src != dst:
            self.stats["bytes_sent"][src] += nbytes
            self.stats["bytes_received"][dst] += nbytes

    def _release(self):
        # an ended change keeps its stats only: not the instances it replaced or made (a kept
        # handle would keep their engines and KV caches alive), nor the requests' tables
        self.old, self.moved = [], []
        self.inst = self.engine = self.merged = None

    def _recovery_layout(self):
        return self.source_layout

    # ---- journaled steps every transformation takes ----
    def _checkpoint_workers(self):
        """Each worker of the group as it is (weights, KV cache object, C model, TP position):
        the last thing a rollback restores."""
        host = self.host
        cps = {w: host.worker(w).checkpoint() for w in self.workers}
        self._mark_base()
        self.undo(lambda: [host.worker(w).restore(cps[w]) for w in self.workers], "workers")

    def _peer_source(self, w, held):
        """Where worker w's missing FFN shards (or experts) come from, as ModelWeights'
        restores take it: a peer of the group holding one on w's own device (arena copies;
        held(its ModelWeights) says which it holds), else None, the host copy of the weights
        (weights_from="host", or a peer on another GPU: arenas copy within one device only)."""
        host = self.host
        if self.weights_from != "peers":
            return None
        device = host.worker(w).arena.device
        holders = {}
        for v in self.workers:
            if host.worker(v).arena.device == device:
                for unit in held(host.worker(v).weights):
                    holders.setdefault(unit, v)
        return lambda unit: host.worker(holders[unit]).weights if unit in holders else None

    def _mark_base(self):
        """What peak_extra_bytes counts from: the bytes each worker holds now."""
        for w in self.workers:
            self.host.worker(w).arena.reset_peak()
        self.base = {w: self.host.worker(w).arena.stats()["bytes_in_use"] for w in self.workers}

    def _peaks(self):
        for w in self.workers:
            s = self.host.worker(w).arena.stats()
            # the arena's pages past the base, and the comm backend's staging on top (an upper
            # bound: the two need not peak at once)
            self.stats["peak_extra_bytes"][w] = max(self.stats["peak_extra_bytes"][w],
                                                    s["peak_bytes"] - self.base[w]
                                                    + self.staging_peak.get(w, 0))


def check_args(host, workers, tp, method, layers_per_step, weights_from, phase_chunks, overlap):
    workers = checks.int_sequence("workers", workers, 0, host.n_workers - 1)
    if not workers:
        raise InvalidArgumentError("workers must name at least one worker, got none")
    if len(set(workers)) != len(workers):
        raise InvalidArgumentError(f"workers {workers} name a worker twice")
    tp = checks.integer("tp", tp, lo=1, hi=host.n_workers)
    if layers_per_step is not None:
        # more than the model's layers is every layer in one step: bounded here, before any
        # per-layer buffer is sized by it
        layers_per_step = min(checks.integer("layers_per_step", layers_per_step, lo=1),
                              host.model.config.num_hidden_layers)
    checks.integer("phase_chunks", phase_chunks, lo=1, hi=1 << 16)
    checks.boolean("overlap", overlap)
    if weights_from not in ("peers", "host"):
        raise InvalidArgumentError(f"weights_from must be 'peers' or 'host', got {weights_from!r}")
    if method not in METHODS:
        raise TransformError(f"unknown method {method!r}; expected one of {', '.join(METHODS)}")
    return sorted(workers), tp, layers_per_step


def check_cuda(host, method, layers_per_step):
    """What a transformation of CUDA workers cannot do, refused before anything changes: nothing
    now. Virtual workers on one GPU (comm="d2d") move KV with the device backend of KVMove;
    workers on distinct GPUs (comm="nccl") over the group's migration communicator (KVMove's
    comm backend): every method, at once or layer-staggered (a staggered layer's overlapping
    move reads and exchanges every source before it writes), FFN shards restored from a peer on
    the same GPU or the host copy. Kept as the one place such a refusal would go."""
    del host, method, layers_per_step


# ---- what the executors look at ----

def group_instances(host, workers):
    """The instances on any of these workers, in order of first worker, checked: they must lie
    inside the group and be TP groups (a pipeline is re-split, not transformed)."""
    group = set(workers)
    current = sorted((inst for inst in host.instances if set(inst.workers) & group),
                     key=lambda inst: min(inst.workers))
    piped = [inst for inst in current if inst.stages]
    if piped:
        raise TransformError(f"workers {sorted(group)} serve a pipeline ({piped[0].layout} on "
                             f"workers {list(piped[0].workers)}): Gyges transformations change "
                             f"TP groups over every layer; re-splitting a pipeline is "
                             f"PipeLive's reconfiguration")
    if any(not set(inst.workers) <= group for inst in current):
        raise TransformError(f"workers {sorted(group)} are busy in a group that reaches outside "
                             f"them (layout {host.layout()})")
    return current


def split_source(host, first, k):
    """The TPk instance a scale-down splits, checked."""
    group = set(range(first, first + k))
    current = group_instances(host, group)
    if len(current) != 1 or set(current[0].workers) != group or current[0].tp != k:
        raise TransformError(f"cannot take workers {sorted(group)} (layout {host.layout()}) to a "
                             f"smaller TP: split one TP{k} instance, or merge them first")
    return current[0]


def merge_sources(host, first, k):
    """The instances a scale-up merges (plans.MergePlan checks them)."""
    host.check_group(first, k)
    current = group_instances(host, range(first, first + k))
    if len(current) == 1 and current[0].tp == k:
        raise TransformError(f"workers {list(range(first, first + k))} are one TP{k} instance "
                             f"already (layout {host.layout()})")
    return current


def refuse_pinned(host, workers, what):
    viewed = host.pinned(workers)
    if viewed:
        raise BusyError(f"{viewed}: {what} changes their pages; delete the views first")


def reserve_growing(kv, seq, n_tokens, page_size):
    """reserve, mapping pages first when the free blocks are too few; returns the pages mapped
    per layer."""
    want = -(-n_tokens // kv.block_size) - len(kv.block_table(seq))
    short = want - kv.free_blocks
    pages = 0
    if short > 0:
        pages = -(-short * kv.block_bytes // page_size)
        kv.grow(pages)
    kv.reserve(seq, n_tokens)
    return pages


def shards_to_restore(worker, tp, rank):
    """Slots the worker must map to hold its new rank's FFN shards (and experts)."""
    missing = worker.owned_shards(tp, rank) - worker.weights.held
    return (worker.weights.ffn_slots(len(missing))
            + worker.weights.expert_slots_to_restore(worker.owned_experts(tp, rank) or ()))


def trim_kv(host, workers):
    """A transformation that ends gives back the KV pages its new caches do not use: the
    requests that held them may have finished while it ran, and an idle instance holds none."""
    for w in workers:
        host.worker(w).kv.trim()
