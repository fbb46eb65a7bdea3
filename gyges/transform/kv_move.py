"""How a transformation's KV bytes move between workers: one interface, two implementations.

HOST copies host memory (NumPy views of the arenas, arena copy_runs, staging in host memory):
the CPU backend's way. DEVICE never moves KV through the host: the all-to-all is
KVCache.copy_heads_from (one kernel per layer and pair of workers on the GPU the workers'
arenas share; memmove on CPU arenas), and a scale-down stages in a device arena of its own
(outside the workers' budgets, like the host staging; stats["stage_bytes"]). The plan, the
order of the rounds and every count are the same on both. A host picks by its backend
(Host.kv_move); tests set DEVICE on CPU hosts to run the GPU's path.

Both account what they move in the transformation's stats: bytes_sent / bytes_received per
worker, peak_extra_bytes for what staging holds."""
import abc

import numpy as np

from ..arena import Arena
from ..kv_cache import KVCache
from .transformation import TransformError


class KVMove(abc.ABC):
    name = None

    @abc.abstractmethod
    def all_to_all(self, host, tr, rounds, m, sub_of, run_bytes):
        """Scale-up's phased all-to-all (plans.AllToAllPlan.rounds), in round order: the
        destination dst receives sub-group sub_of[dst] of the source's old blocks (new block
        m*b + sub of old block b, run_bytes each). Within every
        layer a round receives only into blocks earlier rounds have sent away."""

    @abc.abstractmethod
    def stage(self, host, tr, moved, rank_worker):
        """Scale-down, before the caches change: every moved request's KV blocks of each old
        rank, every layer, copied aside. Returns what unstage() takes."""

    @abc.abstractmethod
    def unstage(self, host, tr, moved, staged, plan, seq_of):
        """Writes the staged blocks into the new caches' wider blocks: new rank r of instance j
        takes sub-group g of its heads from old rank r*m + g (plans.SplitPlan)."""

    def __repr__(self):
        return f"<KV move {self.name}>"


def _count(tr, src, dst, nbytes):
    if src != dst:
        tr.stats["bytes_sent"][src] += nbytes
        tr.stats["bytes_received"][dst] += nbytes


class HostKVMove(KVMove):
    name = "host"

    def all_to_all(self, host, tr, rounds, m, sub_of, run_bytes):
        for layer in range(host.model.config.num_hidden_layers):
            for rnd in sorted(rounds):
                for (src, dst), (src_blocks, dst_blocks) in rounds[rnd].items():
                    src_kv, dst_kv = host.worker(src).kv, host.worker(dst).kv
                    src_off = (src_kv.layer_offset(layer)
                               + (m * np.asarray(src_blocks, np.uint64) + sub_of[dst]) * run_bytes)
                    dst_off = dst_kv.layer_offset(layer) + np.asarray(dst_blocks, np.uint64) * run_bytes
                    sizes = np.full(dst_off.size, run_bytes, dtype=np.uint64)
                    host.worker(dst).arena.copy_runs(host.worker(src).arena, dst_off, src_off, sizes)
                    _count(tr, src, dst, int(sizes.sum()))

    def stage(self, host, tr, moved, rank_worker):
        """Returns {(layer, request id, old rank): bytes}."""
        staged = {}
        for layer in range(host.model.config.num_hidden_layers):
            for req in moved:
                for rank, tab in enumerate(req.tables):
                    if tab is None:
                        continue
                    w = rank_worker[rank]
                    kv = host.worker(w).kv
                    raw = host.worker(w).arena.view_bytes(kv.layer_offset(layer), kv.n_blocks * kv.block_bytes,
                                                          dtype=np.uint8).reshape(kv.n_blocks, kv.block_bytes)
                    staged[(layer, req.id, rank)] = raw[tab].copy()
                    # Staged in host memory, not in the arena: this version stages every layer.
                    tr.stats["peak_extra_bytes"][w] += staged[(layer, req.id, rank)].nbytes
                    del raw
        return staged

    def unstage(self, host, tr, moved, staged, plan, seq_of):
        m = plan.m
        for layer in range(host.model.config.num_hidden_layers):
            for (j, r), w in plan.new_ranks:
                kv = host.worker(w).kv
                if not kv.n_blocks:
                    continue
                run_bytes = kv.block_bytes // m
                dst = host.worker(w).arena.view_bytes(kv.layer_offset(layer), kv.n_blocks * kv.block_bytes,
                                                      dtype=np.uint8).reshape(kv.n_blocks, m, run_bytes)
                for req in moved:
                    if req.id not in seq_of[w]:
                        continue
                    table = kv.block_table(seq_of[w][req.id])
                    for g in range(m):
                        data = staged[(layer, req.id, r * m + g)]
                        dst[table, g] = data
                        _count(tr, plan.rank_worker[r * m + g], w, data.nbytes)
                del dst
            for key in [key for key in staged if key[0] == layer]:
                del staged[key]


class DeviceKVMove(KVMove):
    name = "device"

    def all_to_all(self, host, tr, rounds, m, sub_of, run_bytes):
        # Every layer of a round at once (one kernel per layer and pair), the rounds in order.
        L = host.model.config.num_hidden_layers
        for rnd in sorted(rounds):
            for (src, dst), (src_blocks, dst_blocks) in rounds[rnd].items():
                src_kv, dst_kv = host.worker(src).kv, host.worker(dst).kv
                dst_kv.copy_heads_from(src_kv, dst_blocks, m * np.asarray(src_blocks, np.int64) + sub_of[dst])
                _count(tr, src, dst, len(dst_blocks) * run_bytes * L)

    def stage(self, host, tr, moved, rank_worker):
        """Returns {old rank: (staging cache, {request id: its first staging block})}."""
        config = host.model.config
        L = config.num_hidden_layers
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
            staging = KVCache(arena, n_layers=L, n_kv_heads=kv.n_kv_heads, head_dim=config.head_dim,
                              block_size=host.block_size, layout=host.kv_layout, first_slot=0,
                              slots_per_layer=pages, dtype=worker.kv_dtype)
            staging.grow(pages)
            first, at = {}, 0
            for rid, tab in items:
                first[rid] = at
                at += len(tab)
            staging.copy_heads_from(kv, np.arange(n), np.concatenate([tab for _, tab in items]))
            stages[rank] = (staging, first)
            tr.stats["peak_extra_bytes"][w] += n * kv.block_bytes * L
            tr.stats["stage_bytes"] += pages * L * worker.page_size
        return stages

    def unstage(self, host, tr, moved, staged, plan, seq_of):
        # One device copy per (worker, g) for every request and layer.
        L = host.model.config.num_hidden_layers
        m = plan.m
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
                    if len(table) != len(req.tables[rank]):
                        raise TransformError(f"request {req.id}: {len(table)} new blocks for "
                                             f"{len(req.tables[rank])} staged ones")
                    dst.append(table)
                    src.append(np.arange(first[req.id], first[req.id] + len(table)))
                if not dst:
                    continue
                dst, src = np.concatenate(dst), np.concatenate(src)
                kv.copy_heads_from(staging, dst, src, dst_head0=g * staging.n_kv_heads,
                                   n_heads=staging.n_kv_heads)
                _count(tr, plan.rank_worker[rank], w, len(dst) * staging.block_bytes * L)


HOST, DEVICE = HostKVMove(), DeviceKVMove()


def for_backend(backend):
    return DEVICE if backend == "cuda" else HOST
