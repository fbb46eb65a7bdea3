"""The KV bytes of an at-once transformation, all through the one KV move (KVMove,
csrc/kv/kv_move.h): heads of block lists between caches wherever they live (memmove on the
host, one kernel per layer on a GPU the arenas share, and between GPUs the group's migration
communicator: one all-to-all per layer, csrc/comm/kv_move_comm.h). The plans (plans.py) say
which blocks go where; these functions carry them out and count the bytes on the handle. One
round of the all-to-all is one move (one phase of Gyges 4.1.2: its staging is the extra memory).

    all_to_all   scale-up's phased all-to-all, round by round; reverse=True takes it back
                 (rounds newest first, every run copied back where it came from: nothing it
                 overwrote is lost, since a round only receives into blocks an earlier round sent)
    stage        scale-down: every moved request's blocks copied aside, into a staging cache
                 per old rank (outside the workers' budgets; stats["stage_bytes"])
    unstage      the staged blocks written into the new caches' wider blocks
    restage      the staged blocks written back where they came from (a rollback)
"""
import numpy as np

from ..runtime.arena import Arena
from ..runtime.kv_cache import KVCache, KVMove


def migration_comm(host, workers):
    """The migration communicator of the aligned group of `workers` when they sit on distinct
    GPUs (comm="nccl"), else None: one memory needs none."""
    if host.comm_backend != "nccl":
        return None
    workers = sorted(workers)
    return host.migration_comm(workers[0], len(workers))


def _staged(tr, workers, stats):
    """A move's device staging (the comm backend's), counted on each worker it involved."""
    for w in workers:
        tr.staging_peak[w] = max(tr.staging_peak.get(w, 0), stats.get("staging_bytes", 0))


def all_to_all(host, tr, rounds, m, sub_of, run_bytes, reverse=False):
    """Scale-up's phased all-to-all (plans.AllToAllPlan.rounds), in round order: destination dst
    receives sub-group sub_of[dst] of the source's old blocks (new block m*b + sub of old block
    b). A round is one move, every pair and layer of it (between GPUs: one all-to-all per layer
    over the group's migration communicator), the rounds in order. Returns the rounds' pairs
    done (a failure raises with `done` attached to the error, for the rollback)."""
    L = host.model.config.num_hidden_layers
    comm = migration_comm(host, tr.workers)
    done = []
    try:
        for rnd in sorted(rounds, reverse=reverse):
            move = KVMove(range(L), comm=comm)
            for (src, dst), (src_blocks, dst_blocks) in rounds[rnd].items():
                old = m * np.asarray(src_blocks, np.int64) + sub_of[dst]
                move.add(host.worker(src).kv, host.worker(dst).kv, old, dst_blocks)
            _staged(tr, tr.workers, move.run())
            for (src, dst), (src_blocks, dst_blocks) in rounds[rnd].items():
                tr._count(src, dst, len(dst_blocks) * run_bytes * L)
                done.append((rnd, (src, dst)))
    except BaseException as e:
        e.done = done
        raise
    return done


def undo_all_to_all(host, rounds, m, sub_of, done, comm=None):
    """Takes back the copies `done` lists (newest round first, one move a round): each run goes
    back to the old block it came from, which no later copy overwrote."""
    L = host.model.config.num_hidden_layers
    by_round = {}
    for rnd, pair in done:
        by_round.setdefault(rnd, []).append(pair)
    for rnd in sorted(by_round, reverse=True):
        move = KVMove(range(L), comm=comm)
        for src, dst in by_round[rnd]:
            src_blocks, dst_blocks = rounds[rnd][(src, dst)]
            move.add(host.worker(dst).kv, host.worker(src).kv, dst_blocks,
                     m * np.asarray(src_blocks, np.int64) + sub_of[dst])
        move.run()


def stage(host, tr, moved, rank_worker):
    """Scale-down, before the caches change: every moved request's KV blocks of each old rank,
    every layer, copied into a staging cache of its worker's backend. Returns {old rank:
    (staging cache, {request id: its first staging block})}."""
    L = host.model.config.num_hidden_layers
    stages = {}
    for rank, w in enumerate(rank_worker):
        worker = host.worker(w)
        kv = worker.kv
        items = [(req.id, req.tables[rank]) for req in moved
                 if req.tables[rank] is not None and len(req.tables[rank])]
        n = sum(len(tab) for _, tab in items)
        if not n:
            continue
        pages = -(-n * kv.block_bytes // worker.page_size)
        arena = Arena(budget=pages * L * worker.page_size, page_size=worker.page_size,
                      n_slots=pages * L, backend=worker.backend, device=worker.device)
        staging = KVCache(arena, n_layers=L, n_kv_heads=kv.n_kv_heads, head_dim=kv.head_dim,
                          block_size=kv.block_size, layout=kv.layout_name, first_slot=0,
                          slots_per_layer=pages, dtype=worker.kv_dtype)
        staging.grow(pages)
        first, at = {}, 0
        for rid, tab in items:
            first[rid] = at
            at += len(tab)
        KVMove(range(L)).add(kv, staging, np.concatenate([tab for _, tab in items]),
                             np.arange(n)).run()
        stages[rank] = (staging, first)
        tr.stats["peak_extra_bytes"][w] += n * kv.block_bytes * L
        tr.stats["stage_bytes"] += pages * L * worker.page_size
    return stages


def unstage(host, tr, moved, staged, plan, seq_of):
    """Writes the staged blocks into the new caches' wider blocks: new rank r of instance j
    takes sub-group g of its heads from old rank r*m + g (plans.SplitPlan)."""
    L = host.model.config.num_hidden_layers
    m = plan.m
    move, counts = KVMove(range(L), comm=migration_comm(host, plan.rank_worker)), []
    for (j, r), w in plan.new_ranks:
        kv = host.worker(w).kv
        for g in range(m):
            rank = r * m + g
            if rank not in staged:
                continue
            staging, first = staged[rank]
            dst, src = [], []
            for req in moved:
                if req.id not in seq_of[w] or req.id not in first:
                    continue
                table = kv.block_table(seq_of[w][req.id])
                dst.append(table)
                src.append(np.arange(first[req.id], first[req.id] + len(table)))
            if not dst:
                continue
            dst, src = np.concatenate(dst), np.concatenate(src)
            move.add(staging, kv, src, dst, dst_head=g * staging.n_kv_heads)
            counts.append((plan.rank_worker[rank], w, len(dst) * staging.block_bytes * L))
    if counts:  # one move: between GPUs, one all-to-all per layer
        _staged(tr, tr.workers, move.run())
    for src, dst, nbytes in counts:
        tr._count(src, dst, nbytes)


def restage(host, moved, staged, rank_worker, seq_of_old):
    """A rollback's write back: every staged block to its old block (the caches in their old
    geometry again, each request's old table in seq_of_old[rank][id])."""
    L = host.model.config.num_hidden_layers
    for rank, (staging, first) in staged.items():
        kv = host.worker(rank_worker[rank]).kv
        dst, src = [], []
        for req in moved:
            if req.id in first:
                table = kv.block_table(seq_of_old[rank][req.id])
                dst.append(table)
                src.append(np.arange(first[req.id], first[req.id] + len(table)))
        if dst:
            KVMove(range(L)).add(staging, kv, np.concatenate(src), np.concatenate(dst)).run()
