"""Layer-staggered transformations (Gyges 4.3): a few layers move per host step, last layer
first, while serving goes on. During the move the instance runs a plan of two stages over the
same workers (engine/transition.h): layers below the boundary in one geometry, layers above it
in the other; the hidden states cross once, at the boundary.

StaggeredScaleUp: the merged instance serves from the start; below the boundary the old groups
still run (each on its own requests' rows, with the old KV and FFN shards). StaggeredScaleDown:
the TPk instance serves on; above the boundary each new group runs its own requests' rows with
the new KV geometry (a shadow over the same pages) and the FFN shards gathered back layer by
layer. Each layer's KV is one overlap KVMove (csrc/kv/kv_move.h): the new blocks lie over the
old ones.

A failure at any advance rolls the transformation back: the layers moved so far move back (the
same move, the other way: every run goes back where it came from, tokens written since
included), the transition stage goes, the requests go back to the old instances
and each worker to its checkpoint."""
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..core.errors import OutOfMemoryError
from ..runtime.kv_cache import KVMove, KVMoveStage
from .kv_move import migration_comm
from .plans import MergePlan, SplitPlan, balance
from .requests import MovedRequest, collect, hand_back, hand_over
from .plans import TransformError
from .transform import (Transform, merge_sources, refuse_pinned,
                        reserve_growing, shards_to_restore, split_source, trim_kv)


def _lowest_priority():
    """The background transformation thread yields to serving (nice 19: on Linux a thread's own
    priority), as Gyges and PipeLive put migration on a low-priority stream."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


def _item(src, seq, head, n_heads, dst, dst_seq, dst_head=0):
    """The KVMove item of heads [head, head + n_heads) of every token of `seq` in `src`, into
    heads [dst_head, ...) of dst_seq in `dst`; returns (item, tokens)."""
    n_tokens = src.n_tokens(seq)
    return KVMove.item(src, dst, src_seq=seq, dst_seq=dst_seq, src_head=head, dst_head=dst_head,
                       n_heads=n_heads, n_tokens=n_tokens), n_tokens


_EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gyges-transform",
                               initializer=_lowest_priority)


class _Staggered(Transform):
    """What both directions share: the checks, the boundary, and _advance(), which moves
    `layers_per_step` layers (last first) before each host step: a layer's weights where they
    come back (scale-down), its KV, the weights that go (scale-up), then the boundary. Subclasses
    set self.engine (the instance whose C engine runs the transition).

    overlap=True runs most of the work beside the steps, on a low-priority thread: the KV of the
    layers to move next is read while the step computes (a step never writes the positions it
    read), and advance() only reads the tokens added since and writes everything out (PipeLive's
    pre-copy and patch); scale-up also releases moved layers' FFN pages there. The first step
    only starts the reading, so the transformation takes one step more."""

    live = True
    moves_experts = True
    _background_weights = False  # can _layer_weights run after the boundary has passed?
    overlap = False
    _background = None
    engine = None        # the instance whose C engine runs the transition
    _stages = None       # overlap: layer -> the KVMoveStage its move was planned in
    _stage_pool = None   # one KVMoveStage per layer a step moves, reused: each keeps its memory
    # overlap: steps in a row that may go on while the background work is still running before
    # advance() waits for it (the boundary moves only once a layer's early read is complete)
    max_steps_behind = 4
    _behind = 0

    def _check(self):
        host = self.host
        if self.method != "gyges":
            raise TransformError(f"layer-staggered execution is the gyges method; {self.method!r} "
                                 f"runs all layers at once (omit layers_per_step)")
        if not host.worker(0).weights.pad:
            raise TransformError("a layer-staggered transformation needs padded FFN weights")
        if host.kv_layout == "raw":
            raise TransformError("the raw layout moves V blocks when it grows, so two geometries "
                                 "cannot share its pages; use page or header")
        refuse_pinned(host, self.workers, f"a transformation of workers {list(self.workers)}")

    @property
    def boundary(self):
        """The first layer the new geometry runs (0 once every layer moved); -1 once ended."""
        return -1 if self.engine is None else self.engine.boundary

    def _pool(self):
        if self._stage_pool is None:
            self._stage_pool = [KVMoveStage() for _ in range(self.layers_per_step)]
        return self._stage_pool

    def wait_background(self):
        """Blocks until the work running beside the steps is done (benchmarks charge it to the
        step it ran beside)."""
        if self._background is not None:
            try:
                self._background.result()  # re-raises what the background work raised
            finally:
                self._background = None

    def _next_layers(self):
        b = self.boundary
        return list(range(b - 1, max(b - self.layers_per_step, 0) - 1, -1))

    def _checkpoint_workers(self):
        # the last undo: pages the old caches grew meanwhile and no longer use go back
        self.undo(lambda: trim_kv(self.host, self.workers), "trim")
        super()._checkpoint_workers()
        self._grown = {w: 0 for w in self.workers}

    def _quiesce(self):
        try:
            self.wait_background()
        except Exception:  # it failed or is rolled back anyway; what it read is dropped
            pass

    def _release(self):
        self._quiesce()
        self._stages = self._stage_pool = None
        super()._release()

    def _advance(self):
        """Moves the next layers (the engine is between steps); True once layer 0 has moved.
        While a NumPy view pins a page of the group it waits instead (blocked_by says why;
        serving goes on)."""
        self.blocked_by = self.host.pinned(self.workers)
        if self.blocked_by:
            self.stats["steps_blocked"] += 1
            return False
        if (self._background is not None and not self._background.done()
                and self._behind < self.max_steps_behind):
            self._behind += 1  # the reading is not done: serve on, move nothing this step
            self.stats["steps_waiting"] += 1
            return False
        self._behind = 0
        self.wait_background()
        start = time.perf_counter()
        items, sent = self._move_plan(self._table())
        planned = self._stages or {}
        if self.overlap and self._early_read() and not planned:
            self._start_background(items, [])  # the first step only starts reading
            self._time("layers", start)
            return False
        self._stages = None
        released = []
        for layer, spare in zip(self._next_layers(), self._pool()):
            self._weights_in(layer)
            moved = self._layer_move(items, layer).run(planned.get(layer, spare))
            self.undo(lambda layer=layer: self._move_back(layer), f"layer {layer}'s KV")
            self.stats["bytes_read_beside_steps"] += moved["bytes_early"]
            self.stats["bytes_in_place"] += moved["bytes_in_place"]
            # the stage of one layer: host or one device's, or between GPUs each rank's staging
            self.stats["stage_bytes"] = max(self.stats["stage_bytes"], moved["stage_bytes"],
                                            moved.get("staging_bytes", 0))
            for (src_w, dst_w), nbytes in sent.items():
                self._count(src_w, dst_w, nbytes)
            if self.overlap and self._background_weights:
                released.append(layer)
            else:
                self._weights_out(layer)
            self.engine.set_boundary(layer)
        if self.boundary == 0:
            for layer in released:
                self._weights_out(layer)
            self._time("layers", start)
            return True
        if self.overlap:
            self._start_background(items, released)
        self._time("layers", start)
        return False

    def _early_read(self):
        """Whether the next layers' KV is read beside the step (host caches: PipeLive's
        pre-copy). CUDA workers read it in advance() instead, through the device backend's
        stage: a layer's KV is copied at device bandwidth, a small part of a step, and an early
        read would have to race the step's kernels on a second stream for it."""
        return self.host.backend != "cuda"

    def _start_background(self, items, released):
        """Plans the next layers' moves and reads them (host caches), and releases the weights
        of `released`, on the transformation thread while the next step runs."""
        self._stages = {}
        for layer, stage in zip(self._next_layers(), self._pool()):
            if not self._early_read():
                break
            self._stages[layer] = stage
            self._layer_move(items, layer).plan(stage)

        def work(stages=list(self._stages.values())):
            for stage in stages:
                stage.read()
            for layer in released:
                self._weights_out(layer)
        self._background = _EXECUTOR.submit(work)

    def _move_back(self, layer):
        """The rollback of one moved layer: its KV back into the old geometry (the reverse
        items; tokens written since come along). The boundary stays: the transition is dropped
        next (abort_transition), before anything steps."""
        self.wait_background()
        items, _ = self._move_plan(self._saved_table or self._table(), reverse=True)
        self._layer_move(items, layer).run()

    def _layer_move(self, items, layer):
        """One layer's KV: the new blocks lie over the old ones, so every source is read first
        (on two threads; between GPUs, over the group's migration communicator, which reads
        and exchanges everything before it writes)."""
        return KVMove(range(layer, layer + 1), items, overlap=True, threads=2,
                      comm=migration_comm(self.host, self.workers))

    _saved_table = None

    def _weights_in(self, layer):
        """A layer's weights that come back before its KV moves (scale-down)."""

    def _weights_out(self, layer):
        """A layer's weights that go once its KV has moved (scale-up)."""


class StaggeredScaleUp(_Staggered):
    """Layer-staggered scale-up (Gyges 4.3): the merged instance serves from the start; each host
    step first moves `layers_per_step` more layers, last layer first. Layers below the boundary
    still run in the old instances (on their own requests' rows, with the old KV and FFN shards),
    layers above it in the merged instance; the hidden states cross once, at the boundary."""

    _background_weights = True  # a moved layer's other FFN shards are no longer read

    def __init__(self, host, first, k, method, layers_per_step, overlap=False):
        super().__init__(host, "scale-up", range(first, first + k), None, k, method)
        self.first, self.k = first, k
        self.layers_per_step, self.overlap = layers_per_step, bool(overlap)

    def _plan(self):
        self._check()
        host, first, k = self.host, self.first, self.k
        self.old = merge_sources(host, first, k)
        plan = MergePlan.of([inst.workers for inst in self.old], first, k)
        self.plan, self.from_tp = plan, plan.t
        self.source_layout = [(min(inst.workers), inst.tp) for inst in self.old]
        config = host.model.config
        self.L = config.num_hidden_layers
        H = config.num_key_value_heads
        self.h_old, self.h_new = H // plan.t, H // k
        self.new_rank, self.rank_order = plan.new_rank, plan.rank_order
        self.moved = [req for inst in self.old for req in collect(inst, host)]
        # Room for the new geometry: every worker holds H/k heads of every request.
        for w in self.workers:
            worker = host.worker(w)
            s = worker.arena.stats()
            new_block = worker.kv.block_bytes // self.h_old * self.h_new
            blocks = sum(-(-req.kv_tokens // host.block_size) for req in self.moved)
            need = -(-blocks * new_block // worker.page_size) * self.L * worker.page_size
            mapped = worker.kv.stats()["pages_per_layer"] * self.L * worker.page_size
            if need > mapped + s["budget_bytes"] - s["bytes_in_use"]:
                raise OutOfMemoryError(f"worker {w} cannot hold the new geometry's {need:,} bytes "
                                       f"of KV")

    def _begin(self):
        host, k, m = self.host, self.k, self.plan.m
        start = time.perf_counter()
        self._checkpoint_workers()
        index_of = {id(inst): j for j, inst in enumerate(self.old)}
        # The old engines let go of their KV sequences, which stay for the old layers; they
        # live on, out of the host's pool, until the commit.
        for inst in self.old:
            inst.detach_kv()
        self.undo(lambda: [req.source.attach_kv(req.id, req.seqs) for req in self.moved
                           if req.id in req.source.requests and max(req.seqs) >= 0],
                  "old engines' KV")
        self.old_models, self.old_kvs, self.new_kvs = {}, {}, {}
        seq_of = self.seq_of = {w: {} for w in self.workers}
        self.undo(self._drop_shadows, "new geometry")   # (before the first shadow is made)
        for w in self.workers:
            worker = host.worker(w)
            self.old_models[w], self.old_kvs[w] = worker.c_model, worker.kv
            self.new_kvs[w] = worker.kv.shadow(self.h_new)
            worker.install(kv=self.new_kvs[w],
                           c_model=worker.model_for_rank(k, self.new_rank[w]))
        if host.kv_layout == "header":
            # Worker (j, r) keeps heads run j of its old heads (plans.MergePlan). In the header
            # layout that run of old block X is the shadow's block m*X + j, so a sequence made
            # of those blocks finds its heads already in place: the layer moves skip them, and
            # only the other ranks' heads are copied (Gyges 4.1.2). These come first, while
            # every shadow block is free.
            for req in self.moved:
                j = index_of[id(req.source)]
                for r, w in enumerate(req.source.workers):
                    if req.tables[r] is not None and req.n_tokens[r]:
                        blocks = m * np.asarray(req.tables[r], np.int64) + j
                        seq_of[w][req.id] = self.new_kvs[w].adopt(blocks, req.n_tokens[r])
        for req in self.moved:
            if not req.kv_tokens:
                continue
            for w in self.workers:
                kv = self.new_kvs[w]
                seq = seq_of[w].get(req.id)
                if seq is None:
                    seq = seq_of[w][req.id] = kv.new_sequence()
                self._grown[w] += reserve_growing(kv, seq, req.kv_tokens, host.worker(w).page_size)
        merged = self.merged = self.engine = host.make_instance(self.rank_order, k)
        host.install(merged)
        self.undo(lambda: host.retire(merged), "merged instance")
        taken = []
        self.undo(lambda: self._return_all(taken), "requests")
        hand_over(merged, self.moved,
                  lambda rid: [seq_of[w].get(rid, -1) for w in self.rank_order], taken)
        for inst in self.old:  # out of the pool, alive until the commit
            host.pool.remove(inst)
        self.undo(lambda: [host.pool.install(inst) for inst in self.old], "old instances")
        self.rank_of = rank_of = {w: i for i, w in enumerate(self.rank_order)}
        groups = [([rank_of[w] for w in inst.workers], host.comm(min(inst.workers), inst.tp)
                   if inst.tp > 1 else None) for inst in self.old]
        merged.begin_transition([self.old_models[w] for w in self.rank_order],
                                [self.old_kvs[w] for w in self.rank_order], groups)
        self.undo(self._abort_transition, "transition")
        self.group_ranks = [ranks for ranks, _ in groups]  # engine ranks of each old group
        for req in self.moved:
            merged.transition_adopt(req.id, index_of[id(req.source)], req.seqs)
        self.stats["requests_moved"] = len(self.moved)
        self._time("begin", start)

    _grown = None

    def _abort_transition(self):
        """The merged engine drops the old groups' stage (their sequences stay, for the
        requests going back), after the table of who holds what is saved."""
        if self.merged.boundary >= 0:
            self._saved_table = self._saved_table or self._table()
        self.merged.abort_transition()

    def _return_all(self, taken):
        """Every request of the merged instance (those it took, and those that arrived since)
        goes back to the old instance of its group, with its sequences there."""
        # rid -> ((old group, sequence) a rank); group -1: the request was never adopted
        table = {rid: olds for rid, _, olds in (self._saved_table or ())}
        if not table:  # the transition never began: only what was taken goes back
            return hand_back(self.merged, taken, lambda req: req.seqs)
        moved = {req.id: req for req in self.moved}
        for rid in reversed(self.merged.request_ids()):
            olds = table.get(rid)
            if olds and olds[0][0] >= 0:  # in the transition: its old group and sequences
                inst = self.old[olds[0][0]]
                self_seqs = [olds[self.rank_of[w]][1] for w in inst.workers]
            elif rid in moved:  # taken, not yet adopted (an adoption failed): as it came
                inst, self_seqs = moved[rid].source, list(moved[rid].seqs)
            else:  # arrived since: no KV yet
                inst = min(self.old, key=lambda i: i.load())
                self_seqs = [-1] * len(inst.workers)
            inst.take(self.merged, rid, self_seqs)
        taken.clear()

    def _drop_shadows(self):
        """Every sequence of the new geometry goes and the shadows let their owners keep the
        pages (those grown meanwhile are trimmed at the end)."""
        for kv in self.new_kvs.values():
            kv.unshare()

    def _weights_out(self, layer):
        for w in self.workers:  # this layer's FFN shards (and experts) of other ranks go back
            worker = self.host.worker(w)
            rank = self.new_rank[w]
            self.stats["weight_bytes_released"][w] += (
                worker.weights.drop_layer_shards(layer, worker.owned_shards(self.to_tp, rank))
                + worker.weights.drop_layer_experts(layer, worker.owned_experts(self.to_tp, rank)))

    def _table(self):
        return self.merged.transition_table()

    def _move_plan(self, table, reverse=False):
        """What moving one layer copies, the same for every layer until the next step: for every
        request and new rank, the heads it owns, from the old rank of the request's group that
        holds them (reverse: the other way). Returns the KVMove items and the bytes per
        (src, dst) worker."""
        items, sent = [], {}
        D = self.host.model.config.head_dim
        elem = self.new_kvs[self.rank_order[0]].storage_dtype.itemsize
        for rid, new_seqs, olds in table:
            for i, w in enumerate(self.rank_order):
                group = olds[i][0]
                if new_seqs[i] < 0 or group < 0:
                    continue
                first = i * self.h_new
                src_rank = first // self.h_old
                src = self.group_ranks[group][src_rank]
                src_w = self.rank_order[src]
                head = first - src_rank * self.h_old
                if reverse:
                    item, n_tokens = _item(self.new_kvs[w], new_seqs[i], 0, self.h_new,
                                           self.old_kvs[src_w], olds[src][1], head)
                else:
                    item, n_tokens = _item(self.old_kvs[src_w], olds[src][1], head, self.h_new,
                                           self.new_kvs[w], new_seqs[i])
                items.append(item)
                if src_w != w:
                    sent[(src_w, w)] = sent.get((src_w, w), 0) + 2 * n_tokens * self.h_new * D * elem
        return items, sent

    def _commit(self):
        host = self.host
        self._saved_table = self._table()
        self.merged.detach_transition()  # the old sequences stay until _finish (a rollback
        self.merged.end_transition()     # of this commit moves the layers back into them)
        for w in self.workers:
            worker = host.worker(w)
            worker.weights.finish_layer_drops(worker.owned_shards(self.to_tp, self.new_rank[w]))
            worker.weights.finish_layer_experts(worker.owned_experts(self.to_tp, self.new_rank[w]))
            worker.install(tp=(self.to_tp, self.new_rank[w]))

    def _finish(self):
        for rid, _, olds in self._saved_table:
            for i, w in enumerate(self.rank_order):
                seq = olds[i][1]
                if seq >= 0:
                    self.old_kvs[w].free(seq)
        for w in self.workers:
            self.new_kvs[w].take_pages()
        for inst in self.old:
            inst.close()
        trim_kv(self.host, self.workers)
        self._peaks()

    def _release(self):
        super()._release()
        self.old_models = self.old_kvs = self.new_kvs = self.seq_of = {}
        self._saved_table = None


class StaggeredScaleDown(_Staggered):
    """Layer-staggered scale-down: the TPk instance keeps serving while its layers move to the new
    TPt instances, last layer first. Layers below the boundary run in TPk on every row; above it,
    each new instance runs its own requests' rows with the new KV geometry (a shadow over the
    same pages) and FFN shards gathered back layer by layer (weights first, then KV). When the
    last layer has moved, the new instances take over the requests."""

    def __init__(self, host, first, k, tp, method, layers_per_step, weights_from, overlap=False):
        super().__init__(host, "scale-down", range(first, first + k), k, tp, method)
        self.first, self.k = first, k
        self.layers_per_step, self.weights_from = layers_per_step, weights_from
        self.overlap = bool(overlap)

    def _plan(self):
        self._check()
        host, first, k, tp = self.host, self.first, self.k, self.to_tp
        self.inst = self.engine = split_source(host, first, k)
        self.plan = plan = SplitPlan.of(self.inst.workers, first, k, tp)
        self.source_layout = [(first, k)]
        config = host.model.config
        self.L = config.num_hidden_layers
        self.m = plan.m
        H = config.num_key_value_heads
        self.h_old, self.h_new = H // k, H // tp
        self.rank_worker = list(plan.rank_worker)
        self.moved = collect(self.inst, host)
        self.target, load = balance([(req.id, req.kv_tokens) for req in self.moved], plan.m,
                                    host.block_size)
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
                                     f"new instance's requests ({load[j]} blocks) and its FFN "
                                     f"shards")

    def _begin(self):
        host, plan, tp = self.host, self.plan, self.to_tp
        start = time.perf_counter()
        self._checkpoint_workers()
        # The new geometry and models, next to the old ones.
        self.old_kvs = {w: host.worker(w).kv for w in self.workers}
        self.new_kvs, self.new_model = {}, {}
        self.seq_of = {w: {} for w in self.workers}
        self.undo(self._drop_shadows, "new geometry")   # (before the first shadow is made)
        for (j, r), w in plan.new_ranks:
            worker = host.worker(w)
            self.new_kvs[w] = worker.kv.shadow(self.h_new)
            self.new_model[w] = worker.model_for_rank(tp, r, pending=True)
        rank_of = {w: i for i, w in enumerate(self.rank_worker)}
        self.group_ranks = [[rank_of[w] for w in plan.instance_workers(j)] for j in range(self.m)]
        groups = [(ranks, host.comm(self.first + j * tp, tp) if tp > 1 else None)
                  for j, ranks in enumerate(self.group_ranks)]
        for req in self.moved:
            if not req.kv_tokens:
                continue
            for w in plan.instance_workers(self.target[req.id]):
                seq = self.seq_of[w][req.id] = self.new_kvs[w].new_sequence()
                self._grown[w] += reserve_growing(self.new_kvs[w], seq, req.kv_tokens,
                                                  host.worker(w).page_size)
        self.inst.begin_transition([self.new_model[w] for w in self.rank_worker],
                                   [self.new_kvs[w] for w in self.rank_worker], groups,
                                   groups_above=True)
        self.undo(self._abort_transition, "transition")  # (its sequences: _drop_shadows)
        for req in self.moved:
            j = self.target[req.id]
            self.inst.transition_adopt(req.id, j, [self.seq_of[w].get(req.id, -1)
                                                  for w in plan.instance_workers(j)])
        self.stats["requests_moved"] = len(self.moved)
        self._time("begin", start)

    def _drop_shadows(self):
        """Every sequence of the new geometry goes and the shadows let their owners keep the
        pages."""
        for kv in self.new_kvs.values():
            kv.unshare()

    def _abort_transition(self):
        if self.inst.boundary >= 0:
            self._saved_table = self._saved_table or self._table()
        self.inst.abort_transition()

    def _weights_in(self, layer):
        """The FFN shards (and, expert-parallel, the experts) this layer's new ranks need, from
        a peer on the same device or the host copy (all or nothing per shard or expert), before
        its KV moves (arenas copy within one device only: workers on separate GPUs restore
        from the host copy)."""
        for (j, r), w in self.plan.new_ranks:
            worker = self.host.worker(w)
            copied = worker.weights.restore_layer_shards(
                layer, worker.owned_shards(self.to_tp, r),
                self._peer_source(w, lambda weights: weights.held))
            copied += worker.weights.restore_layer_experts(
                layer, worker.owned_experts(self.to_tp, r) or (),
                self._peer_source(w, lambda weights: weights.held_experts or ()))
            self.stats["weight_bytes_copied"][w] += copied
            self.stats["weight_bytes_moved"] += copied
            self.stats["bytes_moved"] += copied

    def _table(self):
        return self.inst.transition_table()

    def _move_plan(self, table, reverse=False):
        items, sent = [], {}
        D = self.host.model.config.head_dim
        src_kvs = [self.old_kvs[w] for w in self.rank_worker]
        elem = src_kvs[0].storage_dtype.itemsize
        for rid, old_seqs, news in table:
            group = news[0][0]
            if group < 0 or min(old_seqs) < 0:
                continue
            for r, rank in enumerate(self.group_ranks[group]):
                new_seq = news[rank][1]
                w = self.rank_worker[rank]
                for g in range(self.m):  # old rank r*m + g holds sub-group g of the new heads
                    src_rank = r * self.m + g
                    src_w = self.rank_worker[src_rank]
                    if reverse:
                        item, n_tokens = _item(self.new_kvs[w], new_seq, g * self.h_old,
                                               self.h_old, src_kvs[src_rank], old_seqs[src_rank])
                    else:
                        item, n_tokens = _item(src_kvs[src_rank], old_seqs[src_rank], 0,
                                               self.h_old, self.new_kvs[w], new_seq,
                                               g * self.h_old)
                    items.append(item)
                    if src_w != w:
                        sent[(src_w, w)] = sent.get((src_w, w), 0) + 2 * n_tokens * self.h_old * D * elem
        return items, sent

    def _commit(self):
        host, tp, inst = self.host, self.to_tp, self.inst
        table = self._saved_table = self._table()
        old_seqs = {rid: list(olds) for rid, olds, _ in table}
        ids = [rid for rid, _, _ in table]
        group_seqs = {rid: [news[rank][1] for rank in range(len(self.rank_worker))]
                      for rid, _, news in table}
        homes = {rid: news[0][0] for rid, _, news in table}
        count = [sum(1 for h in homes.values() if h == j) for j in range(self.m)]
        for rid in ids:  # never scheduled yet, so no KV and no group: the least loaded one
            if homes[rid] < 0:
                homes[rid] = min(range(self.m), key=lambda j: count[j])
                count[homes[rid]] += 1
        inst.detach_transition()  # the new sequences stay with the new instances...
        inst.end_transition()     # ...and the TPk engine is one stage again, to hand over
        for (j, r), w in self.plan.new_ranks:
            worker = host.worker(w)
            worker.weights.finish_layer_restores(worker.owned_shards(tp, r))
            worker.weights.finish_layer_expert_restores(worker.owned_experts(tp, r))
            worker.install(kv=self.new_kvs[w], c_model=self.new_model[w], tp=(tp, r))
        rank_of = {w: i for i, w in enumerate(self.rank_worker)}
        by_id = {req.id: req for req in self.moved}
        for rid in ids:  # requests that arrived during the transformation move too
            by_id.setdefault(rid, MovedRequest(rid, inst, tuple(old_seqs[rid]), (), ()))
        for j in range(self.m):
            ranks = self.plan.instance_workers(j)
            new = host.make_instance(ranks, tp)
            host.install(new)
            self.undo(lambda new=new: host.retire(new), "new instance")
            taken = []
            self.undo(lambda new=new, taken=taken: hand_back(
                new, taken, lambda req: old_seqs[req.id]), "requests")
            mine = [by_id[rid] for rid in ids if homes[rid] == j]
            hand_over(new, mine, lambda rid, ranks=ranks: [group_seqs[rid][rank_of[w]]
                                                           for w in ranks], taken)

    def _finish(self):
        host, tp = self.host, self.to_tp
        for w in self.workers:
            self.new_kvs[w].take_pages()  # the old sequences go with the old caches
        for (j, r), w in self.plan.new_ranks:
            worker = host.worker(w)
            self.stats["weight_bytes_released"][w] = worker.weights.drop_shards(
                worker.owned_shards(tp, r))
            if worker.expert_parallel:   # the old rank's experts the new one does not own
                self.stats["weight_bytes_released"][w] += worker.weights.drop_experts(
                    worker.owned_experts(tp, r))
        host.retire(self.inst)
        self._peaks()
        trim_kv(host, self.workers)

    def _release(self):
        super()._release()
        self.new_kvs = self.new_model = self.seq_of = self.old_kvs = {}
        self._saved_table = None
