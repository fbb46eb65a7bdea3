"""Transformations that move every layer at once, between two steps of the host (Gyges 4.1-4.2).

Scale-up, m instances of TPt -> one TPk (k = m*t), with requests in flight:
  1. MLP first: every worker keeps the FFN shards of its new rank and unmaps the others. The
     shards are page-aligned (runtime/weights.py), so nothing is copied and the pages go back to
     the budget at once.
  2. KV, header-centric layout: every worker re-reads its pages as blocks of H/k heads (block
     reshaping) and receives the other instances' requests' heads it now owns in the phased
     all-to-all of plans.AllToAllPlan, so the extra memory a worker maps is at most about one
     round's worth (Gyges 4.1.2, Figure 5d).
  3. The merged instance takes over every request with its progress (requests.hand_over):
     no recomputation.

Scale-down, TPk -> m instances of TPt: requests are spread over the new instances to balance
their KV (refused with the reason when they cannot fit), the KV is staged and written back in
the wider blocks (all layers at once: the staging is reported as peak extra bytes), then each
worker gathers the FFN shards its new rank needs from the peers that hold them (or from the host
copy of the weights).

Every change is journaled (Reconfiguration.undo), so a failure anywhere is taken back exactly:
the old instances stay (detached) until the commit and take their requests back; the caches go
back to their geometry, pages and tables; the all-to-all's copies go back where they came from
(kv_move.undo_all_to_all) and a scale-down's staged blocks are written back (kv_move.restage);
each worker's weights, C model and TP position come back from its checkpoint.

The all-reduce sums over ranks in a fixed tree, so the order of workers does not change a bit
of the result."""
import time

from ..core.errors import OutOfMemoryError
from . import baselines, kv_move
from .plans import MergePlan, SplitPlan, balance, plan_all_to_all
from .requests import collect, hand_back, hand_over
from .plans import TransformError
from .transform import (Transform, merge_sources, refuse_pinned,
                        shards_to_restore, split_source, trim_kv)


class _AtOnce(Transform):
    """What both directions share: the old instances live on (detached from their KV) until the
    commit retires them, and a rollback gives them back their requests and KV."""

    moves_experts = True   # an expert-parallel worker drops or restores its experts whole

    def _detach_old(self, old, moved):
        """The old engines forget their requests' KV sequences (the new instances take the
        requests at the commit); journaled: they get the sequences back, as they then are."""
        for inst in old:
            inst.detach_kv()
        self._old_seqs = {req.id: list(req.seqs) for req in moved}

        def reattach():
            for req in moved:
                if req.id in req.source.requests and any(s >= 0 for s in req.seqs):
                    req.source.attach_kv(req.id, self._old_seqs[req.id])
        self.undo(reattach, "old engines' KV")

    def _install(self, new, moved, seqs_of):
        """A new instance serves and takes its requests; journaled: they go back to their old
        instances (with the sequences they have now: the KV's undo sets the old ones)."""
        host = self.host
        host.install(new)
        self.undo(lambda: host.retire(new), "new instance")
        taken = []
        self.undo(lambda: hand_back(new, taken, self._back_seqs), "requests")
        hand_over(new, moved, seqs_of, taken)

    def _back_seqs(self, req):
        """The sequences a request taken back to its old instance holds meanwhile: the new
        geometry's on the old instance's workers (the KV's undo then re-points them)."""
        return [self._new_seq_of.get(w, {}).get(req.id, -1) for w in req.source.workers]

    def _retire_old(self, old):
        for inst in old:
            self.host.retire(inst)

    def _release(self):
        super()._release()
        self._old_seqs = None


class ScaleUp(_AtOnce):
    """Merges the instances on workers [first, first+k) into one TPk instance; each all-to-all
    phase of the KV migration runs in `chunks` rounds."""

    def __init__(self, host, first, k, method="gyges", chunks=4):
        super().__init__(host, "scale-up", range(first, first + k), None, k, method)
        self.first, self.k, self.chunks = first, k, chunks

    def _plan(self):
        host, first, k = self.host, self.first, self.k
        self.weights_mech, self.kv_mech = baselines.mechanisms(host, self.method)
        self.old = merge_sources(host, first, k)
        refuse_pinned(host, self.workers, f"a transformation of workers {list(self.workers)}")
        self.plan = plan = MergePlan.of([inst.workers for inst in self.old], first, k)
        self.from_tp = plan.t
        self.source_layout = [(min(inst.workers), inst.tp) for inst in self.old]
        config = host.model.config
        L, H = config.num_hidden_layers, config.num_key_value_heads
        self.h_old, self.h_new = H // plan.t, H // k
        start = time.perf_counter()
        self.moved = [req for inst in self.old for req in collect(inst, host)]
        self.old_kvs = {w: host.worker(w).kv for w in self.workers}
        self._time("collect", start)
        if self.kv_mech == "basic":
            self.basic = baselines.BasicMigration(host, self, plan, self.moved)
            return
        start = time.perf_counter()
        self.block_bytes_new = host.worker(first).kv.block_bytes // self.h_old * self.h_new
        tables, n_blocks, mapped = {}, {}, {}
        for j, inst in enumerate(self.old):
            for r, w in enumerate(inst.workers):
                kv = host.worker(w).kv
                n_blocks[w] = kv.n_blocks
                mapped[w] = kv.stats()["pages_per_layer"] * kv.arena.page_size // self.block_bytes_new
                tables[(j, r)] = [(req.id, req.tables[r]) for req in self.moved
                                  if req.source is inst and req.tables[r] is not None]
        self.a2a = plan_all_to_all(plan, tables, n_blocks, mapped, self.chunks)
        self.grow_pages = {}  # pages per layer to map for the blocks past the mapped ones
        for w in plan.rank_order:
            page = host.worker(w).page_size
            short = (self.a2a.end_block[w] * self.block_bytes_new
                     - host.worker(w).kv.stats()["pages_per_layer"] * page)
            self.grow_pages[w] = -(-max(short, 0) // page)
        self._time("plan", start)
        # Memory: the weights the workers drop come back first.
        for w in plan.rank_order:
            worker = host.worker(w)
            freed = worker.weights.bytes_freed_keeping(worker.owned_shards(k, plan.new_rank[w]))
            stats = worker.arena.stats()
            free_bytes = stats["budget_bytes"] - stats["bytes_in_use"] + freed
            need = self.grow_pages[w] * L * worker.page_size
            if need > free_bytes:
                raise OutOfMemoryError(f"scale-up needs {need:,} more bytes of KV on worker {w} "
                                       f"but only {free_bytes:,} would be free")

    def _begin(self):
        host, plan = self.host, self.plan
        self._checkpoint_workers()
        self._new_seq_of = {}
        self._detach_old(self.old, self.moved)
        # ---- 1. MLP first: drop the FFN shards the new rank does not own ----
        start = time.perf_counter()
        baselines.weights_up(host, self, plan, self.weights_mech)
        self._mark_base()  # the extra memory is counted from what the weights left
        self._time("weights", start)
        if self.kv_mech == "basic":
            start = time.perf_counter()
            self._new_seq_of = self.basic.migrate()
            self._time("kv_migrate_and_trim", start)
            return
        # ---- 2. KV: reshape in place, map the planned pages, adopt the planned tables ----
        start = time.perf_counter()
        kv_tokens = {req.id: req.kv_tokens for req in self.moved}
        for w in plan.rank_order:
            self._reshape(w)
            kv = host.worker(w).kv
            for rid, blocks in self.a2a.dest[w].items():
                self._new_seq_of[w][rid] = kv.adopt(blocks, kv_tokens[rid])
        self._time("reshape", start)
        # ---- 3. the phased all-to-all ----
        start = time.perf_counter()
        self.sub_of = {w: plan.new_rank[w] % plan.m for w in plan.rank_order}  # old instance j
        done = []
        comm = kv_move.migration_comm(host, self.workers)
        self.undo(lambda: kv_move.undo_all_to_all(host, self.a2a.rounds, plan.m, self.sub_of,
                                                  done, comm), "all-to-all")
        try:
            done.extend(kv_move.all_to_all(host, self, self.a2a.rounds, plan.m, self.sub_of,
                                           self.block_bytes_new))
        except BaseException as e:
            done.extend(getattr(e, "done", ()))
            raise
        self._time("kv_all_to_all", start)

    def _back_seqs(self, req):
        # Basic leaves the old caches whole until _finish: a request taken back goes home to its
        # old sequences (the new caches' are dropped by their own undo)
        if self.kv_mech == "basic":
            return list(self._old_seqs[req.id])
        return super()._back_seqs(req)

    def _reshape(self, w):
        """Worker w's cache re-read as blocks of H/k heads, with the planned pages mapped;
        journaled: back to H/t heads, its pages and every old sequence's table (their new ids
        recorded for the old engines' reattach)."""
        host = self.host
        kv = host.worker(w).kv
        pages = kv.stats()["pages_per_layer"]
        old = [(req, r) for req in self.moved for r, ww in enumerate(req.source.workers)
               if ww == w and req.seqs[r] >= 0]

        def back():
            kv.reshape(self.h_old)  # drops every sequence of the new geometry
            over = kv.stats()["pages_per_layer"] - pages
            if over > 0:
                kv.shrink(over)
            for req, r in old:
                self._old_seqs[req.id][r] = kv.adopt(req.tables[r], req.n_tokens[r])
        self.undo(back, f"worker {w}'s KV geometry")
        kv.reshape(self.h_new)
        self._new_seq_of[w] = {}
        if self.grow_pages[w]:
            kv.grow(self.grow_pages[w])
        self.stats["kv_pages_mapped"][w] = self.grow_pages[w] * kv.n_layers
        self.stats["pages_mapped"] += self.grow_pages[w] * kv.n_layers

    def _commit(self):
        host, plan = self.host, self.plan
        start = time.perf_counter()
        if self.kv_mech == "basic":
            self.basic.switch_caches()
        for w in plan.rank_order:
            host.worker(w).set_tp(plan.k, plan.new_rank[w])
        merged = host.make_instance(plan.rank_order, plan.k)
        self._install(merged, self.moved,
                      lambda rid: [self._new_seq_of[w].get(rid, -1) for w in plan.rank_order])
        self._time("adopt", start)

    def _finish(self):
        self._retire_old(self.old)
        if self.kv_mech == "basic":
            self.basic.free_old(self.old_kvs)
        trim_kv(self.host, self.plan.rank_order)
        self._peaks()
        self.stats["requests_moved"] = len(self.moved)

    def _release(self):
        super()._release()
        self.a2a = self.basic = None


class ScaleDown(_AtOnce):
    """Splits the TPk instance on workers [first, first+k) into k/tp instances of TPtp."""

    def __init__(self, host, first, k, tp, method="gyges", weights_from="peers"):
        super().__init__(host, "scale-down", range(first, first + k), k, tp, method)
        self.first, self.k, self.weights_from = first, k, weights_from

    def _plan(self):
        host, first, k, tp = self.host, self.first, self.k, self.to_tp
        weights_mech, _ = baselines.mechanisms(host, self.method)
        if weights_mech != "drop":
            raise TransformError("scale-down needs padded FFN weights (shards are restored page "
                                 "by page)")
        if host.kv_layout != "header":  # (refused here: _regeometry's reshape would fail late)
            raise TransformError(f"an at-once scale-down re-reads each cache's pages as wider "
                                 f"blocks (block reshaping), which needs the header-centric "
                                 f"layout, not {host.kv_layout!r}; split the page layout "
                                 f"layer-staggered (layers_per_step)")
        self.inst = split_source(host, first, k)
        refuse_pinned(host, self.workers, f"a transformation of workers {list(self.workers)}")
        self.plan = plan = SplitPlan.of(self.inst.workers, first, k, tp)
        self.source_layout = [(first, k)]
        config = host.model.config
        L, H = config.num_hidden_layers, config.num_key_value_heads
        self.h_old, self.h_new = H // k, H // tp
        start = time.perf_counter()
        self.moved = collect(self.inst, host)
        self._time("collect", start)
        self.target, load = balance([(req.id, req.kv_tokens) for req in self.moved], plan.m,
                                    host.block_size)
        # Capacity check on every new worker: blocks of h_new heads its budget can hold.
        block_bytes_new = host.worker(first).kv.block_bytes // self.h_old * self.h_new
        for (j, r), w in plan.new_ranks:
            worker = host.worker(w)
            stats = worker.arena.stats()
            free = stats["budget_bytes"] - stats["bytes_in_use"] + stats["bytes_by_tag"]["kv"]
            free -= shards_to_restore(worker, tp, r) * worker.page_size
            capacity = free // L // worker.page_size * (worker.page_size // block_bytes_new)
            if load[j] > capacity:
                raise TransformError(
                    f"scale-down refused: the requests for instance {j} need {load[j]} KV blocks "
                    f"on worker {w} but it can hold {capacity} after taking back its FFN shards")

    def _begin(self):
        host, plan, tp = self.host, self.plan, self.to_tp
        group = list(self.workers)
        self._checkpoint_workers()
        self._new_seq_of = {}
        self._detach_old([self.inst], self.moved)
        # ---- 1. KV first: stage every layer, then write it in the wider blocks ----
        start = time.perf_counter()
        self.staged = {}
        self.undo(self._restage, "staged KV")
        self.staged = kv_move.stage(host, self, self.moved, plan.rank_worker)
        for w in group:
            self._regeometry(w)
        self._new_seq_of = {w: {} for w in group}
        for (j, r), w in plan.new_ranks:
            kv = host.worker(w).kv
            mine = [req for req in self.moved if self.target[req.id] == j and req.kv_tokens]
            need = sum(-(-req.kv_tokens // host.block_size) for req in mine)
            if need:
                pages = -(-need // (host.worker(w).page_size // kv.block_bytes))
                kv.grow(pages)
                self.stats["kv_pages_mapped"][w] = pages * kv.n_layers
                self.stats["pages_mapped"] += pages * kv.n_layers
            for req in mine:
                seq = kv.new_sequence()
                kv.reserve(seq, req.kv_tokens)
                self._new_seq_of[w][req.id] = seq
        kv_move.unstage(host, self, self.moved, self.staged, plan, self._new_seq_of)
        self._time("kv", start)
        # ---- 2. weights: each worker takes back the FFN shards of its new rank ----
        start = time.perf_counter()
        for (j, r), w in plan.new_ranks:
            worker = host.worker(w)
            missing = worker.owned_shards(tp, r) - worker.weights.held
            copied = worker.weights.restore_shards(missing, self._peer_source(
                w, lambda weights: weights.held))
            if worker.expert_parallel:   # the experts of its new rank, whole
                copied += worker.weights.restore_experts(
                    worker.owned_experts(tp, r), self._peer_source(
                        w, lambda weights: weights.held_experts))
            self.stats["weight_bytes_copied"][w] = copied
            self.stats["weight_bytes_moved"] += copied
            self.stats["bytes_moved"] += copied
        for (j, r), w in plan.new_ranks:  # a shard of the old rank the new one does not own
            worker = host.worker(w)
            self.stats["weight_bytes_released"][w] = worker.weights.drop_shards(
                worker.owned_shards(tp, r))
            if worker.expert_parallel:
                self.stats["weight_bytes_released"][w] += worker.weights.drop_experts(
                    worker.owned_experts(tp, r))
        self._time("weights", start)

    def _regeometry(self, w):
        """Worker w's cache as blocks of H/tp heads, every page given back (they come back
        below for the new sequences); journaled: its old geometry, pages and tables."""
        kv = self.host.worker(w).kv
        pages = kv.stats()["pages_per_layer"]
        rank = self.plan.rank_worker.index(w)
        old = [req for req in self.moved if req.seqs[rank] >= 0]

        def back():
            kv.reshape(self.h_old)
            now = kv.stats()["pages_per_layer"]
            if now > pages:
                kv.shrink(now - pages)
            elif now < pages:
                kv.grow(pages - now)
            for req in old:
                self._old_seqs[req.id][rank] = kv.adopt(req.tables[rank], req.n_tokens[rank])
        self.undo(back, f"worker {w}'s KV geometry")
        kv.reshape(self.h_new)
        if pages:
            kv.shrink(pages)  # every block is free after the reshape; pages come back below

    def _restage(self):
        """The staged blocks back to where they were (the caches are in their old geometry:
        this entry is older than theirs, so it runs after them)."""
        if self.staged:
            ranks = range(len(self.plan.rank_worker))
            seqs = {r: {rid: s[r] for rid, s in self._old_seqs.items()} for r in ranks}
            kv_move.restage(self.host, self.moved, self.staged, self.plan.rank_worker, seqs)

    def _commit(self):
        host, plan, tp = self.host, self.plan, self.to_tp
        start = time.perf_counter()
        for (j, r), w in plan.new_ranks:
            host.worker(w).set_tp(tp, r)
        for j in range(plan.m):
            ranks = plan.instance_workers(j)
            new = host.make_instance(ranks, tp)
            self._install(new, [req for req in self.moved if self.target[req.id] == j],
                          lambda rid, ranks=ranks: [self._new_seq_of[w].get(rid, -1)
                                                    for w in ranks])
        self._time("adopt", start)

    def _finish(self):
        self._retire_old([self.inst])
        trim_kv(self.host, list(self.workers))
        self._peaks()
        self.stats["requests_moved"] = len(self.moved)

    def _release(self):
        super()._release()
        self.staged = None
