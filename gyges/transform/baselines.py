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

import numpy as np

from ..errors import OutOfMemoryError
from .transformation import TransformError

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
        else:
            copied, _ = worker.weights.partial_swap(keep)
            tr.stats["weight_bytes_copied"][w] = copied
        tr.stats["weight_bytes_released"][w] = before - worker.arena.stats()["bytes_in_use"]


def kv_basic(host, tr, plan, moved):
    """Gyges' Basic: every worker builds a new cache (H/k heads) in fresh pages of its other
    slot region, receives the heads it now owns of every request (migrate) and copies in its own
    (trim). Returns (worker -> request id -> sequence, worker -> (new cache, bytes in use
    before)); the old pages go in switch_caches."""
    config = host.model.config
    L, H, k = config.num_hidden_layers, config.num_key_value_heads, plan.k
    new_rank = plan.new_rank
    heads_of = {w: list(range(new_rank[w] * H // k, (new_rank[w] + 1) * H // k)) for w in plan.rank_order}
    held = [req for req in moved if req.kv_tokens]
    for w in plan.rank_order:  # all-or-nothing memory check before anything changes
        worker = host.worker(w)
        probe_bytes = worker.kv.block_bytes // worker.kv.n_kv_heads * (H // k)
        per_page = worker.page_size // probe_bytes
        blocks = sum(-(-req.kv_tokens // host.block_size) for req in held)
        pages = -(-blocks // per_page) if blocks else 0
        s = worker.arena.stats()
        if pages * L * worker.page_size > s["budget_bytes"] - s["bytes_in_use"]:
            raise OutOfMemoryError(f"the basic migration needs {pages * L * worker.page_size:,} "
                                   f"bytes of new KV pages on worker {w} while the old ones are "
                                   f"still in use; only {s['budget_bytes'] - s['bytes_in_use']:,} "
                                   f"are free")
    new_kv, seq_of = {}, {w: {} for w in plan.rank_order}
    for w in plan.rank_order:
        worker = host.worker(w)
        base = worker.arena.stats()["bytes_in_use"]
        worker.arena.reset_peak()
        new = worker._new_kv(k, region=1 - worker.kv_region)
        for req in held:
            free = new.stats()["free_blocks"]
            want = -(-req.kv_tokens // host.block_size)
            if want > free:
                per_page = worker.page_size // new.block_bytes
                new.grow(-(-(want - free) // per_page))
            seq = new.new_sequence()
            new.reserve(seq, req.kv_tokens)
            seq_of[w][req.id] = seq
        new_kv[w] = (new, base)
        tr.stats["kv_pages_mapped"][w] = new.stats()["pages_per_layer"] * L
    for layer in range(L):
        for req in held:
            # The whole request's K/V from the ranks that held it, then each new owner's heads.
            home = req.source.workers
            parts = [(w_old, host.worker(w_old).kv.gather(seq, layer, 0, req.kv_tokens))
                     for w_old, seq in zip(home, req.seqs) if seq >= 0]
            k_all = np.concatenate([p[1][0] for p in parts], axis=1)
            v_all = np.concatenate([p[1][1] for p in parts], axis=1)
            held_by = [w_old for w_old, (kk, _) in parts for _ in range(kk.shape[1])]
            for w in plan.rank_order:
                heads = heads_of[w]
                new_kv[w][0].write(seq_of[w][req.id], layer, 0, k_all[:, heads], v_all[:, heads])
                for h in heads:
                    nbytes = 2 * req.kv_tokens * config.head_dim * 4
                    if held_by[h] != w:
                        tr.stats["bytes_sent"][held_by[h]] += nbytes
                        tr.stats["bytes_received"][w] += nbytes
                    else:
                        tr.stats["kv_bytes_trimmed"][w] += nbytes
    return seq_of, new_kv


def switch_caches(host, tr, new_kv):
    """After the old sequences are freed: unmap the old caches' pages and make the new ones the
    workers' caches."""
    for w, (new, base) in new_kv.items():
        worker = host.worker(w)
        pages = worker.kv.stats()["pages_per_layer"]
        if pages:
            worker.kv.shrink(pages)
        worker.install(kv=new)
        tr.stats["peak_extra_bytes"][w] = worker.arena.stats()["peak_bytes"] - base


def free_old_sequences(host, moved):
    """The moved requests' sequences in the old caches (their engines have detached them)."""
    for req in moved:
        for w, seq in zip(req.source.workers, req.seqs):
            if seq >= 0:
                host.worker(w).kv.free(seq)
