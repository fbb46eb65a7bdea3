"""Live in-place pipeline re-split (PipeLive, Algorithm 1).

    r = host.reconfigure(instance, layers=[1, 3], mode="live", tau=50)
    while not r.done:
        host.step()          # serving goes on; each step advances the re-split
    r.stats                  # B_cur, B_shrink, B_new, stop time, bytes, patch rounds, lags

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
   source workers in a dirty bitmap (kv_patch.h), and each advance drains it and patches those
   slots at the destinations (T_sched: tokens marked; T_applied: slots patched).
4. When the weights and the bulk copy are done and the tokens written since the last drain are
   fewer than tau for every source, the re-split commits; if that has not happened within
   `max_rounds` patch rounds it commits anyway (the residual is copied in the pause: a
   stop-and-copy fallback, reported in stats).
5. SyncAndCommit: the last patch and the switch to tgt (gy_engine_replan: same caches, so every
   request keeps its blocks): that pause is the stop time. At the next advance (between the next
   two steps: the paper deletes them asynchronously) the layers no longer owned are dropped
   (weights and KV pages) and the budget becomes B_new = min_i MaxBlocks(i, |tgt[i]|); then
   `done`.

mode="no_patch" loads the weights step by step but copies all KV in the pause at commit;
mode="stop_copy" does everything in that pause. A failure before the switch takes back every
change (added weights and KV layers, the cap, the dirty bitmaps): the instance serves on as
before, its tokens unchanged. On the CPU host the "asynchronous" work runs between steps in
bounded chunks, as a layer-staggered transformation's does; the stop time is the pause at commit.
"""
import time

import numpy as np

from . import _C, checks
from .errors import BusyError, InvalidArgumentError, OutOfMemoryError

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


class Reconfiguration:
    rolls_back = True  # a failure before the switch takes its changes back (Host._advance)

    def __init__(self, host, instance, layers, mode="live", tau=50, layers_per_step=1,
                 max_rounds=64):
        if mode not in MODES:
            raise InvalidArgumentError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        checks.integer("tau", tau, lo=0)
        checks.integer("layers_per_step", layers_per_step, lo=1)
        checks.integer("max_rounds", max_rounds, lo=1)
        if not instance.stages:
            raise InvalidArgumentError(f"instance {instance.layout} is not a pipeline")
        n = len(instance.stages)
        L = host.model.config.num_hidden_layers
        if (not isinstance(layers, (list, tuple)) or len(layers) != n
                or not all(isinstance(x, int) and x >= 1 for x in layers) or sum(layers) != L):
            raise InvalidArgumentError(f"layers must list {n} positive layer counts summing to "
                                       f"{L}, got {layers!r}")
        k = host.worker(instance.workers[0]).kv_stack
        if any(x % k for x in layers):
            raise InvalidArgumentError(f"layers {list(layers)}: with kv_stack={k} every stage "
                                       f"holds whole runs of {k} layers")
        self.host, self.instance, self.mode, self.tau = host, instance, mode, tau
        self.layers_per_step, self.max_rounds = layers_per_step, max_rounds
        self.workers = tuple(instance.workers)
        self._w = [host.worker(i) for i in self.workers]
        self.cur = list(instance.stages)
        self.tgt = _ranges(layers)
        if self.tgt == self.cur:
            raise InvalidArgumentError(f"the pipeline already runs {list(layers)}")
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
        self.done = False
        self.switched = False   # committed to tgt; the old layers go at the next advance
        self.error = None
        self.blocked_by = None  # (Host.step asks every transformation; a re-split never waits)
        self._slot_bytes = self._w[0].kv.block_bytes // self._w[0].kv.block_size  # a token, a layer
        self.stats = Stats(mode=mode, tau=tau, B_cur=b_cur, B_shrink=self.b_shrink, B_new=None,
                           blocks_in_use=used, layers_moved=len(self.moves), compact_s=0.0,
                           blocks_compacted=0, weight_bytes=0, kv_bulk_bytes=0,
                           kv_patch_bytes=0, patch_rounds=0, lags=[], t_sched=0, t_applied=0,
                           stop_s=None, release_s=None, total_s=None, fallback=False)
        self._t0 = time.perf_counter()
        try:
            self._resize()
            if mode == "live":
                n_slots = self.b_shrink * self._w[0].kv.block_size
                for src in sorted({s for s, _, _ in self.moves}):
                    self.dirty[src] = _C.KVDirty(n_slots)
                    self.instance._c.set_dirty(src, 0, self.dirty[src])
                self._words = np.zeros(next(iter(self.dirty.values())).words(), np.uint64)
        except BaseException:
            self._undo()
            raise

    def __repr__(self):
        return (f"Reconfiguration({self.instance.layout} -> {[b - a for a, b in self.tgt]}, "
                f"{self.mode}{', done' if self.done else ''})")

    def _owner(self, layer):
        return next(i for i, (a, b) in enumerate(self.cur) if a <= layer < b)

    # ---- phase 2 ----
    def _resize(self):
        t = time.perf_counter()
        for w, (lo, hi) in zip(self._w, self.int):
            kv = w.kv
            self.stats["blocks_compacted"] += kv.compact(self.b_shrink)
            over = kv.stats()["pages_per_layer"] - self.cap
            if over > 0:
                kv.shrink(over)
            kv.set_page_cap(self.cap)
            if (lo, hi) != (kv.first_layer, kv.first_layer + kv.n_layers):
                kv.set_layers(lo, hi)
        self.stats["compact_s"] = time.perf_counter() - t

    # ---- phase 3 and 4 ----
    def advance(self):
        """One round between two steps: a patch round and the next layers' weights and KV, or
        the commit. A failure before the switch takes everything back and is raised."""
        if self.done:
            return
        if self.switched:
            return self._release()
        try:
            if self.mode == "stop_copy":
                return self._commit()
            if self.mode == "live":
                lag = sum(d.count() for d in self.dirty.values())
                self.stats["lags"].append(lag)
                if not self.pending and (lag < self.tau or self.stats["patch_rounds"] >= self.max_rounds):
                    self.stats["fallback"] = lag >= self.tau
                    return self._commit()
                self._patch()
            elif not self.pending:
                return self._commit()
            self._move(self.pending[:self.layers_per_step], kv=self.mode == "live")
            del self.pending[:self.layers_per_step]
        except BaseException as e:
            self.error = e
            self._undo()
            raise

    def _move(self, moves, kv):
        for src, dst, layer in moves:
            w = self._w[dst]
            if layer not in w.weights.held_layers:
                self.stats["weight_bytes"] += w.weights.restore_layers({layer}, self._w[src].weights)
            if kv:
                n = self.instance._c.copy_layers(src, dst, 0, layer, layer + 1, None, 0)
                self.stats["kv_bulk_bytes"] += n * self._slot_bytes
                self.copied.add((dst, layer))

    def _patch(self):
        """Drains each source's bitmap and copies those slots of the layers copied so far."""
        for src, d in self.dirty.items():
            taken = d.take(self._words)
            if not taken:
                continue
            self.stats["patch_rounds"] += 1
            for s, dst, layer in self.moves:
                if s == src and (dst, layer) in self.copied:
                    n = self.instance._c.copy_layers(src, dst, 0, layer, layer + 1, self._words,
                                                     d.slots())
                    self.stats["kv_patch_bytes"] += n * self._slot_bytes
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
        self.instance._c.replan(self.tgt, [[m] for m in models])
        # The switch is made: from here on nothing is taken back.
        for i, (w, r, m) in enumerate(zip(self._w, self.tgt, models)):
            if i in self.dirty:
                self.instance._c.set_dirty(i, 0, None)
            w.set_layers(*r, m)
        self.instance.stages = tuple(self.tgt)
        end = time.perf_counter()
        self.stats.update(stop_s=end - t, t_sched=sum(d.marked() for d in self.dirty.values()))
        self.dirty = {}
        self.switched = True

    def _release(self):
        """After the switch, between the next two steps (the paper deletes them asynchronously):
        the layers no longer owned go, weights and KV pages, and the budget becomes B_new."""
        t = time.perf_counter()
        for w, (lo, hi) in zip(self._w, self.tgt):
            w.weights.drop_layers(w.weights.held_layers - set(range(lo, hi)))
            w.kv.set_layers(lo, hi)
        cap = min(max_pages(w, range(*r)) for w, r in zip(self._w, self.tgt))
        for w in self._w:
            w.kv.set_page_cap(max(cap, w.kv.stats()["pages_per_layer"]))
        end = time.perf_counter()
        self.stats.update(B_new=int(cap * self._w[0].kv.blocks_per_page()), release_s=end - t,
                          total_s=end - self._t0)
        self.done = True

    def _undo(self):
        """Takes back everything done before the switch: the dirty bitmaps, the weights and KV
        layers added, the cap. Compacted blocks stay where they went (same values)."""
        for src in list(self.dirty):
            self.instance._c.set_dirty(src, 0, None)
        self.dirty = {}
        for w, (lo, hi) in zip(self._w, self.cur):
            extra = w.weights.held_layers - set(range(lo, hi))
            if extra:
                w.weights.drop_layers(extra)
            if (w.kv.first_layer, w.kv.first_layer + w.kv.n_layers) != (lo, hi):
                w.kv.set_layers(lo, hi)
            w.kv.set_page_cap(None)
        self.done = True
