"""Layer-staggered transformations (Gyges 4.3): a few layers move per host step, last layer
first, while serving goes on. During the move the instance runs a plan of two stages over the
same workers (engine/stage.h): layers below the boundary in one geometry, layers above it in the
other; the hidden states cross once, at the boundary.

StaggeredScaleUp: the merged instance serves from the start; below the boundary the old groups
still run (each on its own requests' rows, with the old KV and FFN shards). StaggeredScaleDown:
the TPk instance serves on; above the boundary each new group runs its own requests' rows with
the new KV geometry (a shadow over the same pages) and the FFN shards gathered back layer by
layer. Each layer's KV moves with a C KVMover (csrc/kv/kv_mover.h), the same on both backends.
"""
import os
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .. import _C
from ..errors import OutOfMemoryError
from .plans import MergePlan, SplitPlan, balance
from .requests import collect, hand_over
from .transformation import (Transformation, TransformError, merge_sources, reserve_growing,
                             shards_to_restore, split_source, trim_kv, views_in)


def _lowest_priority():
    """The background transformation thread yields to serving (nice 19: on Linux a thread's own
    priority), as Gyges and PipeLive put migration on a low-priority stream."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


_EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gyges-transform",
                               initializer=_lowest_priority)


class _Staggered(Transformation):
    """What both layer-staggered directions share: the checks, the boundary, and advance(), which
    moves `layers_per_step` layers (last first) before each host step: a layer's KV, then the
    layer's weights (`_layer_weights`), then the boundary; `_finish` at layer 0. Subclasses set
    self.engine (the instance whose C engine runs the transition).

    overlap=True runs most of the work beside the steps, on a low-priority thread: the KV of the
    layers to move next is read while the step computes (a step never writes the positions it
    read), and advance() only reads the tokens added since and writes everything out (PipeLive's
    pre-copy and patch); scale-up also releases moved layers' FFN pages there. The first step
    only starts the reading, so the transformation takes one step more."""

    _background_weights = False  # can _layer_weights run after the boundary has passed?

    @staticmethod
    def _check(host, method):
        if method != "gyges":
            raise TransformError(f"layer-staggered execution is the gyges method; {method!r} "
                                 f"runs all layers at once (omit layers_per_step)")
        if not host.worker(0).weights.pad:
            raise TransformError("a layer-staggered transformation needs padded FFN weights")
        if host.kv_layout == "raw":
            raise TransformError("the raw layout moves V blocks when it grows, so two geometries "
                                 "cannot share its pages; use page or header")

    @property
    def boundary(self):
        return self.engine.boundary

    overlap = False
    _background = None
    _movers = None  # overlap: layer -> KVMover planned for it
    _mover_pool = None  # one KVMover per layer a step moves, reused: each keeps its stage

    def _pool(self):
        if self._mover_pool is None:
            self._mover_pool = [_C.KVMover() for _ in range(self.layers_per_step)]
        return self._mover_pool

    def wait_background(self):
        """Blocks until the work running beside the steps is done (benchmarks charge it to the
        step it ran beside)."""
        if self._background is not None:
            self._background.result()  # re-raises what the background work raised
            self._background = None

    def _next_layers(self):
        b = self.boundary
        return list(range(b - 1, max(b - self.layers_per_step, 0) - 1, -1))

    # overlap: steps in a row that may go on while the background work is still running before
    # advance() waits for it (the boundary moves only once a layer's early read is complete)
    max_steps_behind = 4
    _behind = 0

    def release_resources(self):
        try:
            self.wait_background()
        except Exception:  # the transformation failed anyway; what it read is dropped
            self._background = None
        self._movers = self._mover_pool = None
        for name in ("old_models", "old_kvs", "new_kv", "new_model"):
            if hasattr(self, name):
                setattr(self, name, {})

    def advance(self):
        """Moves the next layers (the engine is between steps). While a NumPy view pins a page
        of the group it waits instead (blocked_by says why; serving goes on)."""
        if self.done:
            return
        self.blocked_by = views_in(self.host, self.workers)
        if self.blocked_by:
            self.stats["steps_blocked"] = self.stats.get("steps_blocked", 0) + 1
            return
        if (self._background is not None and not self._background.done()
                and self._behind < self.max_steps_behind):
            self._behind += 1  # the reading is not done: serve on, move nothing this step
            self.stats["steps_waiting"] += 1
            return
        self._behind = 0
        self.wait_background()
        start = time.perf_counter()
        items, sent = self._move_plan()
        planned = self._movers or {}
        if self.overlap and not planned:
            self._start_background(items, [])  # the first step only starts reading
            self._time("layers", start)
            return
        released = []
        for layer, spare in zip(self._next_layers(), self._pool()):
            mover = planned.get(layer, spare)
            moved = mover.finish(items, layer)
            self.stats["bytes_read_beside_steps"] += moved["bytes_early"]
            self.stats["bytes_in_place"] += moved["bytes_in_place"]
            self.stats["stage_bytes"] = max(self.stats["stage_bytes"], moved["stage_bytes"])
            for (src_w, dst_w), nbytes in sent.items():
                self.stats["bytes_sent"][src_w] += nbytes
                self.stats["bytes_received"][dst_w] += nbytes
            if self.overlap and self._background_weights:
                released.append(layer)
            else:
                self._layer_weights(layer)
            self.engine.set_boundary(layer)
        if self.boundary == 0:
            for layer in released:
                self._layer_weights(layer)
            self._time("layers", start)
            self._finish()
            return
        if self.overlap:
            self._start_background(items, released)
        self._time("layers", start)

    def _start_background(self, items, released):
        """Plans the next layers' moves and reads them, and releases the weights of `released`,
        on the transformation thread while the next step runs."""
        self._movers = {}
        for layer, mover in zip(self._next_layers(), self._pool()):
            self._movers[layer] = mover
            mover.plan(items, layer)

        def work(movers=list(self._movers.values())):
            for mover in movers:
                mover.read()
            for layer in released:
                self._layer_weights(layer)
        self._background = _EXECUTOR.submit(work)


class StaggeredScaleUp(_Staggered):
    """Layer-staggered scale-up (Gyges 4.3): the merged instance serves from the start; each host
    step first moves `layers_per_step` more layers, last layer first. Layers below the boundary
    still run in the old instances (on their own requests' rows, with the old KV and FFN shards),
    layers above it in the merged instance; the hidden states cross once, at the boundary."""

    _background_weights = True  # a moved layer's other FFN shards are no longer read

    def __init__(self, host, first, k, method, layers_per_step, overlap=False):
        self._check(host, method)
        old = merge_sources(host, first, k)
        plan = MergePlan.of([inst.workers for inst in old], first, k)
        group = list(range(first, first + k))
        super().__init__("scale-up", group, plan.t, k, method)
        self.host, self.layers_per_step = weakref.proxy(host), layers_per_step
        self.overlap = bool(overlap)
        config = host.model.config
        self.L = config.num_hidden_layers
        m = plan.m
        H = config.num_key_value_heads
        self.h_old, self.h_new = H // plan.t, H // k
        self.new_rank, self.rank_order = plan.new_rank, plan.rank_order
        start = time.perf_counter()
        moved = [req for inst in old for req in collect(inst, host)]
        index_of = {id(inst): j for j, inst in enumerate(old)}
        # Room for the new geometry: every worker holds H/k heads of every request.
        for w in group:
            worker = host.worker(w)
            s = worker.arena.stats()
            new_block = worker.kv.block_bytes // self.h_old * self.h_new
            blocks = sum(-(-req.kv_tokens // host.block_size) for req in moved)
            need = -(-blocks * new_block // worker.page_size) * self.L * worker.page_size
            mapped = worker.kv.stats()["pages_per_layer"] * self.L * worker.page_size
            if need > mapped + s["budget_bytes"] - s["bytes_in_use"]:
                raise OutOfMemoryError(f"worker {w} cannot hold the new geometry's {need:,} bytes of KV")
        self.base = {w: host.worker(w).arena.stats()["bytes_in_use"] for w in group}
        for w in group:
            host.worker(w).arena.reset_peak()
        host.begin_change()
        # The old engines let go of their KV sequences, which stay for the old layers; they
        # live on until the merged instance has taken their requests.
        for inst in old:
            inst.detach_kv()
        self.old_models, self.old_kvs = {}, {}
        for w in group:
            worker = host.worker(w)
            self.old_models[w], self.old_kvs[w] = worker.c_model, worker.kv
            worker.install(kv=worker.kv.shadow(self.h_new),
                           c_model=worker.model_for_shards(worker.owned_shards(k, self.new_rank[w])))
        seq_of = {w: {} for w in group}
        if host.kv_layout == "header":
            # Worker (j, r) keeps heads run j of its old heads (plans.MergePlan). In the header
            # layout that run of old block X is the shadow's block m*X + j, so a sequence made
            # of those blocks finds its heads already in place: the layer moves skip them, and
            # only the other ranks' heads are copied (Gyges 4.1.2). These come first, while
            # every shadow block is free.
            for req in moved:
                j = index_of[id(req.source)]
                for r, w in enumerate(req.source.workers):
                    if req.tables[r] is not None and req.n_tokens[r]:
                        blocks = m * np.asarray(req.tables[r], np.int64) + j
                        seq_of[w][req.id] = host.worker(w).kv.adopt(blocks, req.n_tokens[r])
        for req in moved:
            if not req.kv_tokens:
                continue
            for w in group:
                kv = host.worker(w).kv
                seq = seq_of[w].get(req.id)
                if seq is None:
                    seq = seq_of[w][req.id] = kv.new_sequence()
                reserve_growing(kv, seq, req.kv_tokens, host.worker(w).page_size)
        merged = host.make_instance(self.rank_order, k)
        host.install(merged)  # first: a failing hand-over finds every request on the host
        hand_over(merged, moved, lambda rid: [seq_of[w].get(rid, -1) for w in self.rank_order])
        for inst in old:
            host.retire(inst)
        rank_of = {w: i for i, w in enumerate(self.rank_order)}
        groups = [([rank_of[w] for w in inst.workers], host.comm(min(inst.workers), inst.tp)
                   if inst.tp > 1 else None) for inst in old]
        merged.begin_transition([self.old_models[w] for w in self.rank_order],
                                [self.old_kvs[w] for w in self.rank_order], groups)
        self.group_ranks = [ranks for ranks, _ in groups]  # engine ranks of each old group
        for req in moved:
            merged.transition_adopt(req.id, index_of[id(req.source)], req.seqs)
        self.old_instances = old
        self.merged = self.engine = merged
        self.stats["requests_moved"] = len(moved)
        self._time("begin", start)

    def _layer_weights(self, layer):
        for w in self.workers:  # this layer's FFN shards of other ranks go back to the budget
            worker = self.host.worker(w)
            worker.weights.drop_layer_shards(layer, worker.owned_shards(self.to_tp, self.new_rank[w]))

    def _move_plan(self):
        """What moving one layer copies, the same for every layer until the next step: for every
        request and new rank, the heads it owns, from the old rank of the request's group that
        holds them. Returns the items for _C.KVMover and the bytes per (src, dst) worker."""
        items, sent = [], {}
        D = self.host.model.config.head_dim
        dst_kvs = [self.host.worker(w).kv for w in self.rank_order]
        for rid, new_seqs, olds in self.merged.transition_table():
            for i, w in enumerate(self.rank_order):
                group = olds[i][0]
                if new_seqs[i] < 0 or group < 0:
                    continue
                first = i * self.h_new
                src_rank = first // self.h_old
                src = self.group_ranks[group][src_rank]
                src_w = self.rank_order[src]
                item, n_tokens = self.old_kvs[src_w].mover_item(
                    olds[src][1], first - src_rank * self.h_old, self.h_new, dst_kvs[i], new_seqs[i])
                items.append(item)
                if src_w != w:
                    sent[(src_w, w)] = sent.get((src_w, w), 0) + 2 * n_tokens * self.h_new * D * 4
        return items, sent

    def _finish(self):
        host = self.host
        self.merged.end_transition()
        for w in self.workers:
            worker = host.worker(w)
            worker.kv.take_pages()
            worker.weights.finish_layer_drops(worker.owned_shards(self.to_tp, self.new_rank[w]))
            worker.install(tp=(self.to_tp, self.new_rank[w]))
            s = worker.arena.stats()
            self.stats["peak_extra_bytes"][w] = max(s["peak_bytes"] - self.base[w], 0)
        trim_kv(host, self.workers)
        self.old_models.clear()
        self.old_kvs.clear()
        self.done = True


class StaggeredScaleDown(_Staggered):
    """Layer-staggered scale-down: the TPk instance keeps serving while its layers move to the new
    TPt instances, last layer first. Layers below the boundary run in TPk on every row; above it,
    each new instance runs its own requests' rows with the new KV geometry (a shadow over the
    same pages) and FFN shards gathered back layer by layer (KV first, then the weights). When the
    last layer has moved, the new instances take over the requests."""

    def __init__(self, host, first, k, tp, method, layers_per_step, weights_from, overlap=False):
        self._check(host, method)
        if weights_from not in ("peers", "host"):
            raise TransformError(f"weights_from must be 'peers' or 'host', got {weights_from!r}")
        inst = split_source(host, first, k)
        plan = SplitPlan.of(inst.workers, first, k, tp)
        group = list(range(first, first + k))
        super().__init__("scale-down", group, k, tp, method)
        self.host, self.layers_per_step = weakref.proxy(host), layers_per_step
        self.weights_from, self.overlap = weights_from, bool(overlap)
        self.inst = self.engine = inst
        self.plan = plan
        config = host.model.config
        self.L = config.num_hidden_layers
        m = self.m = plan.m
        H = config.num_key_value_heads
        self.h_old, self.h_new = H // k, H // tp
        self.rank_worker = list(plan.rank_worker)
        start = time.perf_counter()
        moved = collect(inst, host)
        self.target, load = balance([(req.id, req.kv_tokens) for req in moved], m, host.block_size)
        # Room: every worker must hold the new geometry of its instance's requests and the FFN
        # shards its new rank needs, beside what it has now.
        for (j, r), w in plan.new_ranks:
            worker = host.worker(w)
            s = worker.arena.stats()
            new_block = worker.kv.block_bytes // self.h_old * self.h_new
            need = -(-load[j] * new_block // worker.page_size) * self.L * worker.page_size
            need += shards_to_restore(worker, tp, r) * worker.page_size
            mapped = worker.kv.stats()["pages_per_layer"] * self.L * worker.page_size
            if need > s["budget_bytes"] - s["bytes_in_use"] + mapped:
                raise TransformError(f"scale-down refused: worker {w} cannot hold the KV of its "
                                     f"new instance's requests ({load[j]} blocks) and its FFN shards")
        self.base = {w: host.worker(w).arena.stats()["bytes_in_use"] for w in group}
        for w in group:
            host.worker(w).arena.reset_peak()
        host.begin_change()
        # The new geometry and models, next to the old ones.
        self.new_kv, self.new_model = {}, {}
        for (j, r), w in plan.new_ranks:
            worker = host.worker(w)
            self.new_kv[w] = worker.kv.shadow(self.h_new)
            self.new_model[w] = worker.model_for_shards(worker.owned_shards(tp, r), pending=True)
        rank_of = {w: i for i, w in enumerate(self.rank_worker)}
        self.group_ranks = [[rank_of[w] for w in plan.instance_workers(j)] for j in range(m)]
        groups = [(ranks, host.comm(first + j * tp, tp) if tp > 1 else None)
                  for j, ranks in enumerate(self.group_ranks)]
        inst.begin_transition([self.new_model[w] for w in self.rank_worker],
                              [self.new_kv[w] for w in self.rank_worker], groups, groups_above=True)
        for req in moved:
            j = self.target[req.id]
            seqs = []
            for w in plan.instance_workers(j):
                if req.kv_tokens:
                    seq = self.new_kv[w].new_sequence()
                    reserve_growing(self.new_kv[w], seq, req.kv_tokens, host.worker(w).page_size)
                    seqs.append(seq)
                else:
                    seqs.append(-1)
            inst.transition_adopt(req.id, j, seqs)
        self.stats["requests_moved"] = len(moved)
        self._time("begin", start)

    def _layer_weights(self, layer):
        """KV first, then the FFN shards this layer's new ranks need, from a peer or the host."""
        holders = {}
        for w in self.workers:
            for shard in self.host.worker(w).weights.held:
                holders.setdefault(shard, w)
        source = ((lambda shard: self.host.worker(holders[shard]).weights)
                  if self.weights_from == "peers" else None)
        for (j, r), w in self.plan.new_ranks:
            worker = self.host.worker(w)
            self.stats["weight_bytes_copied"][w] += worker.weights.restore_layer_shards(
                layer, worker.owned_shards(self.to_tp, r), source)

    def _move_plan(self):
        items, sent = [], {}
        D = self.host.model.config.head_dim
        src_kvs = [self.host.worker(w).kv for w in self.rank_worker]
        for rid, old_seqs, news in self.inst.transition_table():
            group = news[0][0]
            if group < 0 or min(old_seqs) < 0:
                continue
            for r, rank in enumerate(self.group_ranks[group]):
                new_seq = news[rank][1]
                w = self.rank_worker[rank]
                for g in range(self.m):  # old rank r*m + g holds sub-group g of the new heads
                    src_rank = r * self.m + g
                    src_w = self.rank_worker[src_rank]
                    item, n_tokens = src_kvs[src_rank].mover_item(
                        old_seqs[src_rank], 0, self.h_old, self.new_kv[w], new_seq, g * self.h_old)
                    items.append(item)
                    if src_w != w:
                        sent[(src_w, w)] = sent.get((src_w, w), 0) + 2 * n_tokens * self.h_old * D * 4
        return items, sent

    def _finish(self):
        host, tp, inst = self.host, self.to_tp, self.inst
        ids = inst.request_ids()
        group_seqs = {rid: [inst.transition_seq(rid, rank)[1] for rank in range(len(self.rank_worker))]
                      for rid in ids}
        homes = {rid: inst.transition_seq(rid, 0)[0] for rid in ids}
        count = [sum(1 for h in homes.values() if h == j) for j in range(self.m)]
        for rid in ids:  # never scheduled yet, so no KV and no group: the least loaded one
            if homes[rid] < 0:
                homes[rid] = min(range(self.m), key=lambda j: count[j])
                count[homes[rid]] += 1
        inst.detach_transition()  # the new sequences stay with the new instances...
        inst.end_transition()     # ...and the TPk engine is one stage again, to hand over
        for (j, r), w in self.plan.new_ranks:
            worker = host.worker(w)
            self.new_kv[w].take_pages()
            worker.weights.finish_layer_restores(worker.owned_shards(tp, r))
            self.stats["weight_bytes_released"][w] = worker.weights.drop_shards(worker.owned_shards(tp, r))
            worker.install(kv=self.new_kv[w], c_model=self.new_model[w], tp=(tp, r))
        rank_of = {w: i for i, w in enumerate(self.rank_worker)}
        for j in range(self.m):
            ranks = self.plan.instance_workers(j)
            new = host.make_instance(ranks, tp)
            host.install(new)  # first: a failing hand-over finds every request on the host
            for rid in ids:
                if homes[rid] == j:
                    new.take(inst, rid, [group_seqs[rid][rank_of[w]] for w in ranks])
        host.retire(inst)  # the old sequences go with the old caches, whose pages the new took
        for w in self.workers:
            s = host.worker(w).arena.stats()
            self.stats["peak_extra_bytes"][w] = max(s["peak_bytes"] - self.base[w], 0)
        trim_kv(host, self.workers)
        self.done = True
