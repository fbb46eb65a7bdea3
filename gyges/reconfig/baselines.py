"""The methods a transformation can use, Gyges' own and the baselines it is measured against
(Gyges 6.2): how the FFN weights and the KV move.

    gyges, stop_world: release padded FFN shards page by page; KV in place (header-centric
        layout). Without layers_per_step both run every layer at once between two steps, which
        is what stop_world means; gyges is layer-staggered with it.
    basic: Gyges' Basic for the KV, any layout: build the new blocks in fresh pages, migrate
        the other heads into them, then trim by copying the kept heads and freeing the old
        pages; weights as the host is padded or not.
    partial_swap: weights by partial swap (unpadded FFN: copy the kept shard to the front, then
        release); KV in place when the layout allows it."""

from ..core.errors import OutOfMemoryError
from ..runtime.kv_cache import KVMove
from .kv_move import migration_comm
from .plans import TransformError

METHODS = ("gyges", "stop_world", "basic", "partial_swap")


def mechanisms(host, method):
    """(weights, kv) mechanisms of a method: weights "drop" or "swap", KV "inplace" or
    "basic"."""
    if method not in METHODS:
        raise TransformError(f"unknown method {method!r}; expected one of {', '.join(METHODS)}")
    padded = host.worker(0).weights.pad
    if method == "partial_swap":
        if padded:
            raise TransformError("partial_swap needs unpadded FFN weights (Host(..., pad_ffn=False))")
        return "swap", ("inplace" if host.kv_layout == "header" else "basic")
    if method == "basic":
        return ("drop" if padded else "swap"), "basic"
    if not padded:
        raise TransformError(f"method {method!r} needs padded FFN weights; use partial_swap")
    if host.kv_layout != "header":
        raise TransformError("in-place KV migration needs the header-centric layout "
                             f"(this host uses {host.kv_layout!r}); use method='basic'")
    return "drop", "inplace"


def weights_up(host, tr, plan, mechanism):
    """Scale-up's weights: every worker keeps the FFN shards of its new rank, dropping the
    others' pages (padded) or copying its shard to the front first (partial swap)."""
    new_rank = plan.new_rank
    for w in plan.rank_order:
        worker = host.worker(w)
        before = worker.arena.stats()["bytes_in_use"]
        keep = worker.owned_shards(plan.k, new_rank[w])
        if mechanism == "drop":
            worker.weights.drop_shards(keep)
            if worker.expert_parallel:   # and the experts of the other ranks, whole
                worker.weights.drop_experts(worker.owned_experts(plan.k, new_rank[w]))
        else:
            copied, _ = worker.weights.partial_swap(keep)
            tr.stats["weight_bytes_copied"][w] = copied
        tr.stats["weight_bytes_released"][w] = before - worker.arena.stats()["bytes_in_use"]


class BasicMigration:
    """Gyges' Basic for a scale-up's KV: every worker builds a new cache (H/k heads) in fresh
    pages of its other slot region, receives the heads it now owns of every request (migrate)
    and copies in its own (trim); the old caches stay whole until the commit, so a rollback only
    drops the new ones."""

    def __init__(self, host, tr, plan, moved):
        self.host, self.tr, self.plan, self.moved = host, tr, plan, moved
        config = host.model.config
        L, H, k = config.num_hidden_layers, config.num_key_value_heads, plan.k
        self.held = [req for req in moved if req.kv_tokens]
        for w in plan.rank_order:  # all-or-nothing memory check before anything changes
            worker = host.worker(w)
            probe_bytes = worker.kv.block_bytes // worker.kv.n_kv_heads * (H // k)
            per_page = worker.page_size // probe_bytes
            blocks = sum(-(-req.kv_tokens // host.block_size) for req in self.held)
            pages = -(-blocks // per_page) if blocks else 0
            s = worker.arena.stats()
            # (checked before the weights go, which come back first: MLP first)
            free = s["budget_bytes"] - s["bytes_in_use"] + worker.weights.bytes_freed_keeping(
                worker.owned_shards(k, plan.new_rank[w]))
            if pages * L * worker.page_size > free:
                raise OutOfMemoryError(f"the basic migration needs {pages * L * worker.page_size:,} "
                                       f"bytes of new KV pages on worker {w} while the old ones are "
                                       f"still in use; only {free:,} are free once the FFN shards "
                                       f"it drops are")
        self.new_kv = {}

    def migrate(self):
        """Builds the new caches and copies every request's heads into them; returns
        {worker: {request id: its new sequence}}."""
        host, tr, plan = self.host, self.tr, self.plan
        config = host.model.config
        L, H, k = config.num_hidden_layers, config.num_key_value_heads, plan.k
        new_rank = plan.new_rank
        seq_of = self.seq_of = {w: {} for w in plan.rank_order}
        tr.undo(self._drop_new, "new caches")
        for w in plan.rank_order:
            worker = host.worker(w)
            new = self.new_kv[w] = worker.new_kv(k, region=1 - worker.kv_region)
            for req in self.held:
                free = new.stats()["free_blocks"]
                want = -(-req.kv_tokens // host.block_size)
                if want > free:
                    per_page = worker.page_size // new.block_bytes
                    new.grow(-(-(want - free) // per_page))
                seq = new.new_sequence()
                new.reserve(seq, req.kv_tokens)
                seq_of[w][req.id] = seq
            tr.stats["kv_pages_mapped"][w] = new.stats()["pages_per_layer"] * L
            tr.stats["pages_mapped"] += tr.stats["kv_pages_mapped"][w]
        # Every request's heads each new rank owns, from the old rank of its group that holds
        # them (h_old = H/t is a multiple of h_new = H/k, so one old rank holds all of them),
        # every layer at once: one KV move (a memmove on the host, the head-copy kernel on a
        # device), the same bytes the gather and write of Basic copy.
        h_old, h_new = H // plan.t, H // k
        move = KVMove(range(L), comm=migration_comm(host, plan.rank_order))  # between GPUs
        for req in self.held:
            for w in plan.rank_order:
                first = new_rank[w] * h_new
                r = first // h_old
                w_old, seq = req.source.workers[r], req.seqs[r]
                old = host.worker(w_old).kv
                move.add(old, self.new_kv[w], src_seq=seq, dst_seq=seq_of[w][req.id],
                         src_head=first - r * h_old, n_heads=h_new, n_tokens=req.kv_tokens)
                nbytes = 2 * req.kv_tokens * config.head_dim * old.storage_dtype.itemsize * h_new * L
                if w_old != w:
                    tr._count(w_old, w, nbytes)
                else:
                    tr.stats["kv_bytes_trimmed"][w] += nbytes
        move.run()
        return seq_of

    def _drop_new(self):
        for w, new in self.new_kv.items():
            for seq in self.seq_of[w].values():
                new.free(seq)
            pages = new.stats()["pages_per_layer"]
            if pages:
                new.shrink(pages)
        self.new_kv = {}

    def switch_caches(self):
        """The commit: the new caches become the workers' (the worker checkpoint takes it
        back)."""
        for w, new in self.new_kv.items():
            self.host.worker(w).install(kv=new)

    def free_old(self, old_kvs):
        """After the commit: the moved requests' old sequences and the old caches' pages go
        (old_kvs: {worker: its cache before})."""
        for req in self.moved:
            for w, seq in zip(req.source.workers, req.seqs):
                if seq >= 0:
                    old_kvs[w].free(seq)
        for kv in old_kvs.values():
            pages = kv.stats()["pages_per_layer"]
            if pages:
                kv.shrink(pages)
