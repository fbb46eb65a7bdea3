"""Live in-place pipeline re-split (PipeLive, Algorithm 1).

    r = host.reconfigure(instance, layers=[1, 3], mode="live", tau=50)
    while not r.done:
        host.step()          # serving goes on; each step advances the re-split
    r.stats                  # B_cur, B_shrink, B_new, stop time, bytes, patch rounds, lags
                             # (also as attributes: r.stats.stop_s)

A pipeline instance runs worker i's layers cur[i] = [s_i, e_i); the target gives it tgt[i].
Between two steps:

1. Feasibility. Worker i holds the union int[i] = cur[i] | tgt[i] while the KV of the layers it
   gains is copied (a range: the two must overlap or touch, else refused). The block budget every
   worker can keep for int[] is B_shrink = min_i MaxBlocks(i, |int[i]|), where MaxBlocks is
   floor((M_i - W(layers)) / (|layers| * P)) in whole pages per layer (M_i the worker's budget,
   W the weights it would hold, P a page); refused, with nothing changed, when more blocks are
   in use than B_shrink.
2. CompactKV and ResizeKV: every cache moves its blocks in use below B_shrink (bytes copied,
   block tables rewritten: gy_kv_compact), gives back the pages past it and is capped there, then
   maps its added layers (gy_kv_set_layers).
3. Each step (host.step calls advance) loads `layers_per_step` added layers' weights on their
   new worker, from the worker that has them, and copies those layers' KV of every request from
   their current owner (mode "live"). Meanwhile every step marks the KV slots it writes on the
   source workers in a dirty bitmap (kv_dirty.h), and each advance drains it and patches those
   slots at the destinations (T_sched: tokens marked; T_applied: slots patched).
4. When the weights and the bulk copy are done and the tokens written since the last drain are
   fewer than tau for every source (or none are), the re-split commits; if that has not happened
   within `max_rounds` rounds after the bulk copy it commits anyway (the residual is copied in
   the pause: a stop-and-copy fallback, reported in stats), so it always ends.
5. SyncAndCommit: the last patch and the switch to tgt (gy_engine_replan: same caches, so every
   request keeps its blocks): that pause is the stop time. Right after it (the paper deletes
   them asynchronously) the layers no longer owned are dropped (weights and KV pages) and the
   budget becomes B_new = min_i MaxBlocks(i, |tgt[i]|).

mode="no_patch" loads the weights step by step but copies all KV in the pause at commit;
mode="stop_copy" does everything in that pause. A failure before the switch takes back every
change (added weights and KV layers, the pages and cap, the dirty bitmaps): the instance serves
on as before, its tokens unchanged; an advance that fails is first tried again (what it copied
is copied again). On the CPU host the "asynchronous" work runs between steps in
bounded chunks, as a layer-staggered transformation's does; the stop time is the pause at commit.
"""
import time

import numpy as np

from .. import _C
from ..core import checks
from ..core.errors import BusyError, InvalidArgumentError, OutOfMemoryError
from .kv_move import migration_comm
from .reconfiguration import Reconfiguration

MODES = ("live", "no_patch", "stop_copy")


def _ranges(layers):
    bounds = np.concatenate([[0], np.cumsum(layers)]).astype(int)
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def weight_bytes(worker, layers):
    """Bytes of weights the worker would hold with `layers`: what it holds now, with layers
    added and removed (each layer's attention run and FFN shards; the embedding and head stay)."""
    w = worker.weights
    kv = worker.kv.stats()
    now = worker.arena.stats()["bytes_in_use"] - kv["pages_per_layer"] * worker.kv.n_runs * worker.page_size
    layers = set(layers)
    return (now + sum(w.layer_bytes(l) for l in layers - w.held_layers)
            - sum(w.layer_bytes(l) for l in w.held_layers - layers))


def max_pages(worker, layers):
    """MaxBlocks(i, L) of Algorithm 1 in whole KV pages per run of layers (per layer without
    stacking): the budget left after the weights of `layers`, shared by their caches."""
    free = worker.arena.stats()["budget_bytes"] - weight_bytes(worker, layers)
    return max(free // worker.page_size // max(len(set(layers)) // worker.kv_stack, 1), 0)


class Stats(dict):
    """What a re-split did, as a dict with attribute access."""
    __getattr__ = dict.__getitem__


class Resplit(Reconfiguration):
    kind = "resplit"
    live = True
    max_retries = 0   # a failed advance rolls the re-split back (taken back exactly)

    def __init__(self, host, instance, layers, mode="live", tau=50, layers_per_step=1,
                 max_rounds=64):
        if mode not in MODES:
            raise InvalidArgumentError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        checks.integer("tau", tau, lo=0)
        L = host.model.config.num_hidden_layers
        # more than the layers is every layer in one step: bounded before anything is sized
        layers_per_step = min(checks.integer("layers_per_step", layers_per_step, lo=1), L)
        checks.integer("max_rounds", max_rounds, lo=1, hi=1 << 20)
        if not hasattr(instance, "stages") or instance not in host.instances:
            raise InvalidArgumentError(f"instance must be one of this host's instances, got "
                                       f"{instance!r}")
        if not instance.stages:
            raise InvalidArgumentError(f"instance {instance.layout} is not a pipeline")
        n = len(instance.stages)
        if (not isinstance(layers, (list, tuple)) or len(layers) != n
                or not all(isinstance(x, int) and x >= 1 for x in layers) or sum(layers) != L):
            raise InvalidArgumentError(f"layers must list {n} positive layer counts summing to "
                                       f"{L}, got {layers!r}")
        k = host.worker(instance.workers[0]).kv_stack
        if any(x % k for x in layers):
            raise InvalidArgumentError(f"layers {list(layers)}: with kv_stack={k} every stage "
                                       f"holds whole runs of {k} layers")
        super().__init__(host, instance.workers)
        self.instance, self.mode, self.tau = instance, mode, tau
        self.layers_per_step, self.max_rounds = layers_per_step, max_rounds
        self.tgt = _ranges(layers)
        self.stats = Stats(self.stats)

    def __repr__(self):
        return (f"Resplit({self.instance.layout} -> {[b - a for a, b in self.tgt]}, "
                f"{self.mode}, {self.state})")

    def _plan(self):
        host, instance = self.host, self.instance
        if instance not in host.instances:
            raise InvalidArgumentError(f"{instance!r} no longer serves on this host")
        viewed = host.pinned(self.workers)
        if viewed:
            raise BusyError(f"{viewed}: a re-split changes the workers' pages; delete the "
                            f"views first")
        self._w = [host.worker(i) for i in self.workers]
        # stages on different GPUs move KV over their aligned group's migration communicator
        self._comm = migration_comm(host, self.workers)
        self.cur = list(instance.stages)
        if self.tgt == self.cur:
            raise InvalidArgumentError(f"the pipeline already runs {[b - a for a, b in self.tgt]}")
        self.int = []
        for i, ((a, b), (c, d)) in enumerate(zip(self.cur, self.tgt)):
            if max(a, c) > min(b, d):
                raise InvalidArgumentError(
                    f"worker {self.workers[i]} would go from layers [{a}, {b}) to [{c}, {d}), "
                    f"which do not touch: it holds a range of layers, so re-split in two moves")
            self.int.append((min(a, c), max(b, d)))
        # Phase 1: the intermediate budget, and whether the blocks in use fit it.
        pages = [max_pages(w, range(*r)) for w, r in zip(self._w, self.int)]
        self.cap = min(pages)
        bpp = self._w[0].kv.blocks_per_page()
        self.b_shrink = int(self.cap * bpp)
        used = max(w.kv.n_blocks - w.kv.free_blocks for w in self._w)
        b_cur = int(min(max_pages(w, range(*r)) for w, r in zip(self._w, self.cur)) * bpp)
        if self.cap < 1:
            raise OutOfMemoryError(f"the intermediate pipeline {self.int} leaves no KV page per "
                                   f"layer on some worker (pages per layer: {pages})")
        if used > self.b_shrink:
            raise BusyError(f"{used} KV blocks are in use but the intermediate pipeline {self.int} "
                            f"keeps {self.b_shrink} (B_shrink); wait for requests to finish")
        # (src stage, dst stage, layer) for every layer a worker gains
        self.moves = [(self._owner(l), i, l) for i, (lo, hi) in enumerate(self.int)
                      for l in range(lo, hi) if not self.cur[i][0] <= l < self.cur[i][1]]
        self.pending = list(self.moves)   # weights (and KV in live mode) still to move
        self.copied = set()               # (dst, layer) whose KV was copied in bulk
        self.dirty = {}                   # src stage -> KVDirty
        self._rounds = 0                  # advances since the bulk copy ended
        self._slot_bytes = self._w[0].kv.block_bytes // self._w[0].kv.block_size  # a token, a layer
        self.stats.update(mode=self.mode, tau=self.tau, B_cur=b_cur, B_shrink=self.b_shrink,
                          B_new=None, blocks_in_use=used, layers_moved=len(self.moves),
                          compact_s=0.0, blocks_compacted=0, weight_bytes=0, kv_bulk_bytes=0,
                          kv_patch_bytes=0, patch_rounds=0, lags=[], t_sched=0, t_applied=0,
                          stop_s=None, release_s=None, total_s=None, fallback=False)

    def _owner(self, layer):
        return next(i for i, (a, b) in enumerate(self.cur) if a <= layer < b)

    # ---- phase 2 ----
    def _begin(self):
        cps = {i: w.checkpoint() for i, w in enumerate(self._w)}
        self.undo(lambda: [w.restore(cps[i]) for i, w in enumerate(self._w)], "weights")
        t = time.perf_counter()
        for w, (lo, hi), (a, b) in zip(self._w, self.int, self.cur):
            kv = w.kv
            # compaction moves blocks in use below B_shrink with their bytes and tables: the
            # same values, so nothing to take back
            self.stats["blocks_compacted"] += kv.compact(self.b_shrink)
            pages = kv.stats()["pages_per_layer"]
            self.undo(lambda kv=kv, pages=pages: self._pages_back(kv, pages), "pages")
            over = pages - self.cap
            if over > 0:
                kv.shrink(over)
                self.stats["pages_freed"] += over * kv.n_runs
            kv.set_page_cap(self.cap)
            self.undo(lambda kv=kv: kv.set_page_cap(None), "page cap")
            if (lo, hi) != (kv.first_layer, kv.first_layer + kv.n_layers):
                kv.set_layers(lo, hi)
                self.undo(lambda kv=kv, a=a, b=b: kv.set_layers(a, b), "KV layers")
        self.stats["compact_s"] = time.perf_counter() - t
        if self.mode == "live":
            n_slots = self.b_shrink * self._w[0].kv.block_size
            self.undo(self._stop_marking, "dirty bitmaps")
            for src in sorted({s for s, _, _ in self.moves}):
                self.dirty[src] = _C.KVDirty(n_slots)
                self.instance.set_dirty(src, self.dirty[src])
            self._words = np.zeros(next(iter(self.dirty.values())).words(), np.uint64)

    @staticmethod
    def _pages_back(kv, pages):
        now = kv.stats()["pages_per_layer"]
        if now < pages:
            kv.grow(pages - now)

    def _stop_marking(self):
        for src in list(self.dirty):
            self.instance.set_dirty(src, None)
        self.dirty = {}

    # ---- phase 3 and 4 ----
    def _advance(self):
        """One round between two steps: a patch round and the next layers' weights and KV; True
        once it may commit (the commit is the switch, in this same pause)."""
        if self.mode == "stop_copy":
            return True
        if self.mode == "live":
            lag = sum(d.count() for d in self.dirty.values())
            self.stats["lags"].append(lag)
            if not self.pending:
                self._rounds += 1
                if lag < self.tau or lag == 0 or self._rounds >= self.max_rounds:
                    self.stats["fallback"] = lag >= max(self.tau, 1)
                    return True
            self._patch()
        elif not self.pending:
            return True
        self._move(self.pending[:self.layers_per_step], kv=self.mode == "live")
        del self.pending[:self.layers_per_step]
        return False

    def _move(self, moves, kv):
        for src, dst, layer in moves:
            w = self._w[dst]
            if layer not in w.weights.held_layers:
                nbytes = w.weights.restore_layers({layer}, self._w[src].weights)
                self.stats["weight_bytes"] += nbytes
                self.stats["weight_bytes_moved"] += nbytes
                self.stats["bytes_moved"] += nbytes
            if kv:
                self._copy(src, dst, layer, "kv_bulk_bytes")
                self.copied.add((dst, layer))

    def _copy(self, src, dst, layer, key, words=None, slots=0):
        nbytes = self.instance.copy_layers(src, dst, layer, layer + 1, words, slots,
                                           comm=self._comm) * self._slot_bytes
        self.stats[key] += nbytes
        self.stats["kv_bytes_moved"] += nbytes
        self.stats["bytes_moved"] += nbytes

    def _patch(self):
        """Drains each source's bitmap and copies those slots of the layers copied so far. A
        failed copy loses the drained marks: those layers are copied again whole."""
        for src, d in self.dirty.items():
            taken = d.take(self._words)
            if not taken:
                continue
            self.stats["patch_rounds"] += 1
            done = [(s, dst, layer) for s, dst, layer in self.moves
                    if s == src and (dst, layer) in self.copied]
            try:
                for s, dst, layer in done:
                    self._copy(src, dst, layer, "kv_patch_bytes", self._words, d.slots())
            except BaseException:
                for s, dst, layer in done:
                    self.copied.discard((dst, layer))
                self.pending = [m for m in done if m not in self.pending] + self.pending
                raise
            self.stats["t_applied"] += taken

    # ---- phase 5 ----
    def _commit(self):
        t = time.perf_counter()
        if self.mode == "live":
            self._patch()
        else:
            self._move(self.moves, kv=True)
            self.pending = []
        models = [w.model_for_layers(*r) for w, r in zip(self._w, self.tgt)]
        self.instance.replan(self.tgt, models)
        # The switch is made: from here on nothing is taken back.
        marked = sum(d.marked() for d in self.dirty.values())
        self._stop_marking()
        for w, r, m in zip(self._w, self.tgt, models):
            w.set_layers(*r, m)
        self.stats.update(stop_s=time.perf_counter() - t, t_sched=marked)

    def _finish(self):
        """After the switch (the paper deletes them asynchronously): the layers no longer owned
        go, weights and KV pages, and the budget becomes B_new."""
        t = time.perf_counter()
        for w, (lo, hi) in zip(self._w, self.tgt):
            before = w.arena.stats()["bytes_in_use"]
            w.weights.drop_layers(w.weights.held_layers - set(range(lo, hi)))
            w.kv.set_layers(lo, hi)
            self.stats["pages_freed"] += (before - w.arena.stats()["bytes_in_use"]) // w.page_size
        cap = min(max_pages(w, range(*r)) for w, r in zip(self._w, self.tgt))
        for w in self._w:
            w.kv.set_page_cap(max(cap, w.kv.stats()["pages_per_layer"]))
        end = time.perf_counter()
        self.stats.update(B_new=int(cap * self._w[0].kv.blocks_per_page()), release_s=end - t,
                          total_s=end - self._t0)

    def _release(self):
        self.dirty = {}
