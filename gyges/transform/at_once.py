"""Transformations that move every layer at once, between two steps of the host (Gyges 4.1-4.2).

Scale-up, m instances of TPt -> one TPk (k = m*t), with requests in flight:
  1. MLP first: every worker keeps the FFN shards of its new rank and unmaps the others. The
     shards are page-aligned (gyges/weights.py), so nothing is copied and the pages go back to
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

The all-reduce sums over ranks in a fixed tree, so the order of workers does not change a bit
of the result. Where the bytes move is the host's KV move (kv_move.py)."""
import time

from ..errors import OutOfMemoryError
from . import baselines
from .plans import MergePlan, SplitPlan, balance, plan_all_to_all
from .requests import collect, hand_over
from .transformation import (Transformation, TransformError, merge_sources, shards_to_restore,
                             split_source, trim_kv)


def scale_up(host, first, k, method="gyges", chunks=4):
    """Merges the instances on workers [first, first+k) into one TPk instance; each all-to-all
    phase of the KV migration runs in `chunks` rounds."""
    weights_mech, kv_mech = baselines.mechanisms(host, method)
    old = merge_sources(host, first, k)
    plan = MergePlan.of([inst.workers for inst in old], first, k)
    config = host.model.config
    L, H = config.num_hidden_layers, config.num_key_value_heads
    h_new = H // k
    tr = Transformation("scale-up", range(first, first + k), plan.t, k, method)

    start = time.perf_counter()
    moved = [req for inst in old for req in collect(inst, host)]
    tr._time("collect", start)
    if kv_mech == "basic":
        return _scale_up_copying(host, tr, plan, old, moved, weights_mech)

    # ---- plan (no state changes): destination blocks per worker, round by round ----
    start = time.perf_counter()
    block_bytes_new = host.worker(first).kv.block_bytes // (H // plan.t) * h_new
    tables, n_blocks, mapped = {}, {}, {}
    for j, inst in enumerate(old):
        for r, w in enumerate(inst.workers):
            kv = host.worker(w).kv
            n_blocks[w] = kv.n_blocks
            mapped[w] = kv.stats()["pages_per_layer"] * kv.arena.page_size // block_bytes_new
            tables[(j, r)] = [(req.id, req.tables[r]) for req in moved
                              if req.source is inst and req.tables[r] is not None]
    a2a = plan_all_to_all(plan, tables, n_blocks, mapped, chunks)
    grow_pages = {}  # pages per layer to map for the blocks past the mapped ones
    for w in plan.rank_order:
        page = host.worker(w).page_size
        short = a2a.end_block[w] * block_bytes_new - host.worker(w).kv.stats()["pages_per_layer"] * page
        grow_pages[w] = -(-max(short, 0) // page)
    tr._time("plan", start)

    # Memory check before changing anything: the weights the workers drop come back first.
    new_rank = plan.new_rank
    for w in plan.rank_order:
        worker = host.worker(w)
        freed = worker.weights.bytes_freed_keeping(worker.owned_shards(k, new_rank[w]))
        stats = worker.arena.stats()
        free_bytes = stats["budget_bytes"] - stats["bytes_in_use"] + freed
        need = grow_pages[w] * L * worker.page_size
        if need > free_bytes:
            raise OutOfMemoryError(f"scale-up needs {need:,} more bytes of KV on worker {w} but "
                                   f"only {free_bytes:,} would be free")

    # ---- 1. MLP first: drop the FFN shards the new rank does not own ----
    start = time.perf_counter()
    host.begin_change()
    for inst in old:  # their requests' KV is re-planned; the engines stay to hand them over
        inst.detach_kv()
    baselines.weights_up(host, tr, plan, weights_mech)
    tr._time("weights", start)

    # ---- 2. KV: reshape in place, map the planned pages, adopt the planned tables ----
    start = time.perf_counter()
    seq_of = {w: {} for w in plan.rank_order}
    kv_tokens = {req.id: req.kv_tokens for req in moved}
    for w in plan.rank_order:
        worker = host.worker(w)
        base_peak = worker.arena.stats()["bytes_in_use"]
        worker.arena.reset_peak()
        worker.kv.reshape(h_new)
        if grow_pages[w]:
            worker.kv.grow(grow_pages[w])
        tr.stats["kv_pages_mapped"][w] = grow_pages[w] * L
        for rid, blocks in a2a.dest[w].items():
            seq_of[w][rid] = worker.kv.adopt(blocks, kv_tokens[rid])
        tr.stats["peak_extra_bytes"][w] = worker.arena.stats()["peak_bytes"] - base_peak
    tr._time("reshape", start)

    # ---- 3. the phased all-to-all ----
    start = time.perf_counter()
    sub_of = {w: new_rank[w] % plan.m for w in plan.rank_order}  # = the old instance index j
    host.kv_move.all_to_all(host, tr, a2a.rounds, plan.m, sub_of, block_bytes_new)
    tr._time("kv_all_to_all", start)

    # ---- 4. the merged instance takes over every request ----
    return _install_merged(host, tr, plan, old, moved, seq_of)


def _install_merged(host, tr, plan, old, moved, seq_of):
    """The merged TPk instance takes over every moved request (its KV already in place)."""
    start = time.perf_counter()
    new_rank = plan.new_rank
    for w in plan.rank_order:
        host.worker(w).set_tp(plan.k, new_rank[w])
    merged = host.make_instance(plan.rank_order, plan.k)
    host.install(merged)  # first: a failing hand-over finds every request on the host
    hand_over(merged, moved, lambda rid: [seq_of[w].get(rid, -1) for w in plan.rank_order])
    for inst in old:
        host.retire(inst)
    trim_kv(host, plan.rank_order)
    tr.stats["requests_moved"] = len(moved)
    tr._time("adopt", start)
    tr.done = True
    return tr


def _scale_up_copying(host, tr, plan, old, moved, weights_mech):
    """Scale-up with Gyges' Basic KV migration (baselines.kv_basic)."""
    start = time.perf_counter()
    host.begin_change()
    baselines.weights_up(host, tr, plan, weights_mech)
    tr._time("weights", start)
    start = time.perf_counter()
    seq_of, new_kv = baselines.kv_basic(host, tr, plan, moved)
    for inst in old:
        inst.detach_kv()
    baselines.free_old_sequences(host, moved)
    baselines.switch_caches(host, tr, new_kv)
    tr._time("kv_migrate_and_trim", start)
    return _install_merged(host, tr, plan, old, moved, seq_of)


def scale_down(host, first, k, tp, method="gyges", weights_from="peers"):
    """Splits the TPk instance on workers [first, first+k) into k/tp instances of TPtp."""
    weights_mech, _ = baselines.mechanisms(host, method)
    if weights_mech != "drop":
        raise TransformError("scale-down needs padded FFN weights (shards are restored page by page)")
    if weights_from not in ("peers", "host"):
        raise TransformError(f"weights_from must be 'peers' or 'host', got {weights_from!r}")
    inst = split_source(host, first, k)
    plan = SplitPlan.of(inst.workers, first, k, tp)
    m = plan.m
    config = host.model.config
    L, H = config.num_hidden_layers, config.num_key_value_heads
    h_old, h_new = H // k, H // tp
    group = list(range(first, first + k))
    tr = Transformation("scale-down", group, k, tp, method)

    start = time.perf_counter()
    moved = collect(inst, host)
    tr._time("collect", start)

    target, load = balance([(req.id, req.kv_tokens) for req in moved], m, host.block_size)
    # Capacity check on every new worker: blocks of h_new heads its budget can hold.
    block_bytes_new = host.worker(first).kv.block_bytes // h_old * h_new
    for (j, r), w in plan.new_ranks:
        worker = host.worker(w)
        stats = worker.arena.stats()
        free = stats["budget_bytes"] - stats["bytes_in_use"] + stats["bytes_by_tag"]["kv"]
        free -= shards_to_restore(worker, tp, r) * worker.page_size
        capacity = free // L // worker.page_size * (worker.page_size // block_bytes_new)
        if load[j] > capacity:
            raise TransformError(
                f"scale-down refused: the requests for instance {j} need {load[j]} KV blocks on "
                f"worker {w} but it can hold {capacity} after taking back its FFN shards")

    # ---- 1. KV first: stage every layer, then write it in the wider blocks ----
    start = time.perf_counter()
    host.begin_change()
    inst.detach_kv()  # the engine stays to hand its requests over
    staged = host.kv_move.stage(host, tr, moved, plan.rank_worker)
    for w in group:
        kv = host.worker(w).kv
        pages = kv.stats()["pages_per_layer"]
        kv.reshape(h_new)
        if pages:
            kv.shrink(pages)  # every block is free after the reshape; pages come back below
    seq_of = {w: {} for w in group}
    for (j, r), w in plan.new_ranks:
        kv = host.worker(w).kv
        mine = [req for req in moved if target[req.id] == j and req.kv_tokens]
        need = sum(-(-req.kv_tokens // host.block_size) for req in mine)
        if need:
            pages = -(-need // (host.worker(w).page_size // kv.block_bytes))
            kv.grow(pages)
            tr.stats["kv_pages_mapped"][w] = pages * L
        for req in mine:
            seq = kv.new_sequence()
            kv.reserve(seq, req.kv_tokens)
            seq_of[w][req.id] = seq
    host.kv_move.unstage(host, tr, moved, staged, plan, seq_of)
    del staged  # the stage goes back (host memory, or the device path's staging arenas)
    tr._time("kv", start)

    # ---- 2. weights: each worker takes back the FFN shards of its new rank ----
    start = time.perf_counter()
    holders = {}
    for w in group:
        for s in host.worker(w).weights.held:
            holders.setdefault(s, w)
    source = (lambda s: host.worker(holders[s]).weights) if weights_from == "peers" else None
    for (j, r), w in plan.new_ranks:
        worker = host.worker(w)
        missing = worker.owned_shards(tp, r) - worker.weights.held
        tr.stats["weight_bytes_copied"][w] = worker.weights.restore_shards(missing, source)
    for (j, r), w in plan.new_ranks:  # a shard of the old rank that the new one does not own
        worker = host.worker(w)
        tr.stats["weight_bytes_released"][w] = worker.weights.drop_shards(worker.owned_shards(tp, r))
    tr._time("weights", start)

    # ---- 3. the new instances take over the requests ----
    start = time.perf_counter()
    for (j, r), w in plan.new_ranks:
        host.worker(w).set_tp(tp, r)
    for j in range(m):
        ranks = plan.instance_workers(j)
        new = host.make_instance(ranks, tp)
        host.install(new)  # first: a failing hand-over finds every request on the host
        hand_over(new, [req for req in moved if target[req.id] == j],
                  lambda rid: [seq_of[w].get(rid, -1) for w in ranks])
    host.retire(inst)
    trim_kv(host, group)
    tr.stats["requests_moved"] = len(moved)
    tr._time("adopt", start)
    tr.done = True
    return tr
