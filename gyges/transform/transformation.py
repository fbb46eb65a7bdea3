"""What every transformation shares: its handle (done, stats), its error, and the checks and
small steps both the at-once and the layer-staggered executors take."""
import time

from ..errors import InvalidArgumentError


class TransformError(InvalidArgumentError):
    """A transformation that cannot be carried out; nothing was changed."""


class Transformation:
    """The handle Host.transform returns: done, and stats (bytes per worker, pages, peak extra
    memory, time per phase)."""

    rolls_back = False  # a failure half-way is rebuilt (gyges.recovery), not taken back

    def __init__(self, kind, workers, from_tp, to_tp, method):
        self.kind, self.workers, self.from_tp, self.to_tp = kind, tuple(workers), from_tp, to_tp
        self.method = method
        self.done = False
        self.recovered = False  # failed half-way and rebuilt (gyges.recovery)
        self.error = None       # what failed, then
        self.blocked_by = None  # why a layer-staggered one is waiting (a live view), or None
        self.source_instances = ()
        self.stats = {"bytes_sent": {w: 0 for w in workers}, "bytes_received": {w: 0 for w in workers},
                      "weight_bytes_released": {w: 0 for w in workers},
                      "weight_bytes_copied": {w: 0 for w in workers},
                      "kv_pages_mapped": {w: 0 for w in workers},
                      "kv_bytes_trimmed": {w: 0 for w in workers},
                      "peak_extra_bytes": {w: 0 for w in workers},
                      "requests_moved": 0, "phase_seconds": {},
                      # layer-staggered: KV bytes read beside steps (overlap), KV bytes already
                      # in place (a rank's own heads), and the host memory the largest layer
                      # move staged
                      "bytes_read_beside_steps": 0, "bytes_in_place": 0, "stage_bytes": 0,
                      "steps_waiting": 0}

    def release_resources(self):
        """Lets go of everything it holds of the workers (a failed one is rebuilt without it)."""

    def _time(self, phase, start):
        self.stats["phase_seconds"][phase] = self.stats["phase_seconds"].get(phase, 0.0) + (
            time.perf_counter() - start)

    def __repr__(self):
        state = "recovered" if self.recovered else "done" if self.done else "pending"
        return (f"Transformation({self.kind} TP{self.from_tp}->TP{self.to_tp} on workers "
                f"{list(self.workers)}, {state})")


def views_in(host, workers):
    """Why the workers' pages cannot change now (a live NumPy view pins a slot), or None."""
    for w in workers:
        pinned = host.worker(w).arena.pinned_slots()
        if pinned.size:
            return (f"worker {w} has {pinned.size} slot(s) under a live NumPy view (slot "
                    f"{int(pinned[0])} first)")
    return None


def trim_kv(host, workers):
    """A transformation that ends gives back the KV pages its new caches do not use: the
    requests that held them may have finished while it ran, and an idle instance holds none."""
    for w in workers:
        host.worker(w).kv.trim()


def merge_sources(host, first, k):
    """The instances a scale-up merges: those inside the aligned group [first, first+k), in
    order of first worker (gyges.transform.plans.MergePlan checks them)."""
    host.check_group(first, k)
    group = set(range(first, first + k))
    return sorted((inst for inst in host.instances if set(inst.workers) & group),
                  key=lambda inst: min(inst.workers))


def split_source(host, first, k):
    """The TPk instance a scale-down splits, checked."""
    group = set(range(first, first + k))
    matches = [inst for inst in host.instances if set(inst.workers) == group]
    if not matches or matches[0].tp != k or matches[0].stages:
        raise TransformError(f"workers {sorted(group)} are not one TP{k} instance (layout "
                             f"{host.layout()})")
    return matches[0]


def reserve_growing(kv, seq, n_tokens, page_size):
    """reserve, mapping pages first when the free blocks are too few."""
    want = -(-n_tokens // kv.block_size) - len(kv.block_table(seq))
    short = want - kv.free_blocks
    if short > 0:
        kv.grow(-(-short * kv.block_bytes // page_size))
    kv.reserve(seq, n_tokens)


def shards_to_restore(worker, tp, rank):
    """Slots the worker must map to hold its new rank's FFN shards."""
    missing = worker.owned_shards(tp, rank) - worker.weights.held
    return len(missing) * worker.weights.shard_slots * 3 * worker.config.num_hidden_layers
