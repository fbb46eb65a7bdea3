"""Live tensor-parallel transformation of a group of workers (Gyges section 4, AMOEBAs section 3).

Scale-up, m instances of TPt -> one TPk (k = m*t), with requests in flight:
  1. MLP first: every worker keeps the FFN shards of its new rank and unmaps the others. The
     shards are page-aligned (gyges/weights.py), so nothing is copied and the pages go back to
     the budget at once.
  2. KV, header-centric layout: every worker re-reads its pages as blocks of H/k heads (block
     reshaping): old block b is now blocks m*b .. m*b+m-1, one per sub-group of heads. A worker
     keeps, in place, the sub-group its new rank owns for its own requests, and sends the other
     sub-groups to their owners in m-1 phases of an all-to-all. A phase receives only into blocks
     that were free from the start or that an earlier phase sent away (Gyges 4.1.2, Figure 5d),
     so the extra memory a worker maps is at most about one phase's worth.
  3. The requests of all merged instances continue in the merged instance with their progress:
     no recomputation.

Which worker gets which rank: worker (instance j, old rank r) becomes rank r*m + j of TPk, so
that the heads and FFN shards it keeps are a subset of those it has. The all-reduce sums over
ranks in a fixed tree, so the order of workers does not change a bit of the result.

Scale-down, TPk -> m instances of TPt: requests are spread over the new instances to balance
their KV (refused with the reason when they cannot fit), the KV is staged in host memory and
written back in the wider blocks (all layers at once in this version: the staging is reported as
peak extra bytes), then each worker gathers the FFN shards its new rank
needs from the peers that hold them (or from the host copy of the weights).

This version carries a transformation out at once, between two steps of the host. The issue's
layer-staggered execution (a few layers per step, serving in between) is not written yet.
"""
import time

import numpy as np

from .errors import OutOfMemoryError


class TransformError(ValueError):
    """A transformation that cannot be carried out; nothing was changed."""


class Transformation:
    """The handle Host.transform returns: done, and stats (bytes per worker, pages, peak extra
    memory, time per phase)."""

    def __init__(self, kind, workers, from_tp, to_tp, method):
        self.kind, self.workers, self.from_tp, self.to_tp = kind, tuple(workers), from_tp, to_tp
        self.method = method
        self.done = False
        self.stats = {"bytes_sent": {w: 0 for w in workers}, "bytes_received": {w: 0 for w in workers},
                      "weight_bytes_released": {w: 0 for w in workers},
                      "weight_bytes_copied": {w: 0 for w in workers},
                      "kv_pages_mapped": {w: 0 for w in workers},
                      "peak_extra_bytes": {w: 0 for w in workers},
                      "requests_moved": 0, "phase_seconds": {}}

    def _time(self, phase, start):
        self.stats["phase_seconds"][phase] = self.stats["phase_seconds"].get(phase, 0.0) + (
            time.perf_counter() - start)

    def __repr__(self):
        state = "done" if self.done else "pending"
        return (f"Transformation({self.kind} TP{self.from_tp}->TP{self.to_tp} on workers "
                f"{list(self.workers)}, {state})")


def _collect(instance):
    """Every unfinished request of an instance: (handle, export, per-rank block tables, tokens
    of KV per rank)."""
    out = []
    for rid in instance._c.request_ids():
        ex = instance._c.export(rid)
        tables, ntok = [], []
        for rank, seq in enumerate(ex["seqs"]):
            kv = instance.host.worker(instance.workers[rank]).kv
            tables.append(kv.block_table(seq) if seq >= 0 else None)
            ntok.append(kv.n_tokens(seq) if seq >= 0 else 0)
        out.append((instance.requests.get(rid), ex, tables, ntok))
    return out


def _adopt_all(instance, moved, seqs_of):
    """Adopts every moved request into the new instance; seqs_of(rid) -> per-rank sequences."""
    for handle, ex, _, _ in moved:
        info = ex["info"]
        info_tuple = (info["state_id"], info["n_generated"], info["n_computed"],
                      info["prefill_end"], info["n_preemptions"], info["arrival"],
                      info["first_scheduled"], info["first_token"])
        rid = handle.id
        instance._c.adopt(rid, np.frombuffer(ex["tokens"], dtype=np.int32), ex["prompt_len"],
                          ex["max_new_tokens"], ex["temperature"], ex["top_k"], ex["top_p"],
                          ex["seed"], np.frombuffer(ex["stop_tokens"] or b"", dtype=np.int32),
                          info_tuple, seqs_of(rid))
        instance.loop.requests[rid] = handle


def scale_up(host, first, k, method="gyges"):
    """Merges the instances on workers [first, first+k) into one TPk instance."""
    if method != "gyges":
        raise TransformError(f"method {method!r} is not implemented yet; only 'gyges' is")
    group = list(range(first, first + k))
    old = sorted((inst for inst in host.instances if inst.workers[0] in group),
                 key=lambda inst: min(inst.workers))
    host.check_group(first, k)
    if sum(inst.tp for inst in old) != k or any(w not in group for inst in old for w in inst.workers):
        raise TransformError(f"workers {group} are not exactly covered by instances inside the group "
                             f"(layout {host.layout()}); busy in another group")
    t = old[0].tp
    if any(inst.tp != t for inst in old) or t >= k:
        raise TransformError(f"scale-up merges instances of one TP degree below TP{k}; found "
                             f"{[inst.tp for inst in old]}")
    if host.kv_layout != "header":
        raise TransformError("in-place KV migration needs the header-centric layout "
                             f"(this host uses {host.kv_layout!r})")
    m = k // t
    config = host.model.config
    H = config.num_key_value_heads
    h_new = H // k
    worker_of = {(j, r): old[j].workers[r] for j in range(m) for r in range(t)}
    new_rank = {worker_of[(j, r)]: r * m + j for (j, r) in worker_of}
    rank_order = sorted(group, key=lambda w: new_rank[w])
    tr = Transformation("scale-up", group, t, k, method)

    start = time.perf_counter()
    moved, owner = [], {}  # owner: request id -> index of its old instance
    for j, inst in enumerate(old):
        for item in _collect(inst):
            moved.append(item)
            owner[item[0].id] = j
    tr._time("collect", start)

    # ---- plan (no state changes): destination blocks per worker, phase by phase ----
    start = time.perf_counter()
    sample = host.worker(first)
    block_bytes_new = sample.kv.block_bytes // (H // t) * h_new
    plan_dest = {w: {} for w in group}      # worker -> rid -> its new block list there
    grow_pages = {w: 0 for w in group}
    sends = []                               # (phase, src worker, dst worker, src blocks, dst blocks)
    for r in range(t):
        col = [worker_of[(j, r)] for j in range(m)]
        local = {j: [(h.id, tabs[r]) for h, ex, tabs, _ in moved if owner[h.id] == j and tabs[r] is not None]
                 for j in range(m)}
        pool, next_block, mapped = {}, {}, {}
        for j in range(m):
            w = col[j]
            kv = host.worker(w).kv
            pages = kv.stats()["pages_per_layer"]
            mapped[w] = pages * kv.arena.page_size // block_bytes_new  # blocks after the reshape
            used = set(b for _, tab in local[j] for b in tab.tolist())
            # Free from the start: every sub-block of an unused old block, and any tail the
            # smaller blocks add. Kept in place: the sub-group this worker's new rank owns.
            free = [m * b + g for b in range(kv.n_blocks) if b not in used for g in range(m)]
            free += list(range(m * kv.n_blocks, mapped[w]))
            pool[w] = sorted(free, reverse=True)  # pop() hands out the lowest block first
            next_block[w] = mapped[w]
            for rid, tab in local[j]:
                plan_dest[w][rid] = [m * b + j for b in tab.tolist()]
        for s in range(1, m):
            for j in range(m):
                w = col[j]
                for rid, tab in local[(j - s) % m]:
                    dest = []
                    for _ in range(len(tab)):
                        if pool[w]:
                            dest.append(pool[w].pop())
                        else:  # no freed block left: map a new one (a phase's extra memory)
                            dest.append(next_block[w])
                            next_block[w] += 1
                    plan_dest[w][rid] = dest
                    sends.append((s, col[(j - s) % m], w, tab, dest))
            for j in range(m):  # what phase s sent away is free for phase s + 1
                w = col[j]
                freed = [m * b + (j + s) % m for _, tab in local[j] for b in tab.tolist()]
                pool[w] = sorted(freed + pool[w], reverse=True)
        for w in col:
            extra_blocks = next_block[w] - mapped[w]
            if extra_blocks:
                kv = host.worker(w).kv
                total = kv.stats()["pages_per_layer"] * kv.arena.page_size
                needed = -(-(next_block[w] * block_bytes_new - total) // kv.arena.page_size)
                grow_pages[w] = needed
    tr._time("plan", start)

    # Memory check before changing anything: the weights the workers drop come back first.
    for w in group:
        worker = host.worker(w)
        owned = worker.owned_shards(k, new_rank[w])
        freed = sum(len(worker.weights.shard_slots_of(0, "gate", s)) for s in worker.weights.held - owned)
        freed *= 3 * config.num_hidden_layers * worker.page_size
        stats = worker.arena.stats()
        free_bytes = stats["budget_bytes"] - stats["bytes_in_use"] + freed
        need = grow_pages[w] * config.num_hidden_layers * worker.page_size
        if need > free_bytes:
            raise OutOfMemoryError(f"scale-up needs {need:,} more bytes of KV on worker {w} but "
                                   f"only {free_bytes:,} would be free")

    # ---- 1. MLP first: drop the FFN shards the new rank does not own ----
    start = time.perf_counter()
    for inst in old:
        host.instances.remove(inst)
        inst.close()
    for w in group:
        worker = host.worker(w)
        before = worker.arena.stats()["bytes_in_use"]
        worker.weights.drop_shards(worker.owned_shards(k, new_rank[w]))
        tr.stats["weight_bytes_released"][w] = before - worker.arena.stats()["bytes_in_use"]
    tr._time("weights", start)

    # ---- 2. KV: reshape in place, map the planned pages, adopt the planned tables ----
    start = time.perf_counter()
    seq_of = {w: {} for w in group}
    ntok_of = {h.id: max(ntok) for h, _, _, ntok in moved}
    for w in group:
        worker = host.worker(w)
        base_peak = worker.arena.stats()["bytes_in_use"]
        worker.arena.reset_peak()
        worker.kv.reshape(h_new)
        if grow_pages[w]:
            worker.kv.grow(grow_pages[w])
        tr.stats["kv_pages_mapped"][w] = grow_pages[w] * config.num_hidden_layers
        for rid, blocks in plan_dest[w].items():
            seq_of[w][rid] = worker.kv.adopt(blocks, ntok_of[rid])
        tr.stats["peak_extra_bytes"][w] = worker.arena.stats()["peak_bytes"] - base_peak
    tr._time("reshape", start)

    # ---- 3. the phased all-to-all, layer by layer ----
    start = time.perf_counter()
    run_bytes = block_bytes_new
    for layer in range(config.num_hidden_layers):
        for s in range(1, m):
            batches = {}
            for phase, src, dst, src_tab, dst_blocks in sends:
                if phase != s:
                    continue
                sub = new_rank[dst] % m  # the sub-group of heads the destination's rank owns
                src_off = host.worker(src).kv.layer_offset(layer) + (m * src_tab.astype(np.uint64) + sub) * run_bytes
                dst_off = host.worker(dst).kv.layer_offset(layer) + np.asarray(dst_blocks, np.uint64) * run_bytes
                batches.setdefault((src, dst), []).append((dst_off, src_off))
            for (src, dst), parts in batches.items():
                dst_off = np.concatenate([p[0] for p in parts]).astype(np.uint64)
                src_off = np.concatenate([p[1] for p in parts]).astype(np.uint64)
                sizes = np.full(dst_off.size, run_bytes, dtype=np.uint64)
                host.worker(dst).arena._c.copy_runs(host.worker(src).arena._c, dst_off, src_off, sizes)
                tr.stats["bytes_sent"][src] += int(sizes.sum())
                tr.stats["bytes_received"][dst] += int(sizes.sum())
    tr._time("kv_all_to_all", start)

    # ---- 4. the merged instance takes over every request ----
    start = time.perf_counter()
    for w in group:
        host.worker(w).set_tp(k, new_rank[w])
    merged = host.make_instance(rank_order, k)
    _adopt_all(merged, moved, lambda rid: [seq_of[w].get(rid, -1) for w in rank_order])
    host.instances.append(merged)
    host.instances.sort(key=lambda inst: min(inst.workers))
    tr.stats["requests_moved"] = len(moved)
    tr._time("adopt", start)
    tr.done = True
    return tr


def scale_down(host, first, k, tp, method="gyges", weights_from="peers"):
    """Splits the TPk instance on workers [first, first+k) into k/tp instances of TPtp."""
    if method != "gyges":
        raise TransformError(f"method {method!r} is not implemented yet; only 'gyges' is")
    if weights_from not in ("peers", "host"):
        raise TransformError(f"weights_from must be 'peers' or 'host', got {weights_from!r}")
    group = list(range(first, first + k))
    matches = [inst for inst in host.instances if set(inst.workers) == set(group)]
    if not matches or matches[0].tp != k:
        raise TransformError(f"workers {group} are not one TP{k} instance (layout {host.layout()})")
    if tp >= k or k % tp:
        raise TransformError(f"scale-down goes from TP{k} to a smaller divisor, not TP{tp}")
    inst = matches[0]
    m = k // tp
    config = host.model.config
    H = config.num_key_value_heads
    h_old, h_new = H // k, H // tp
    rank_worker = list(inst.workers)          # old rank -> worker
    tr = Transformation("scale-down", group, k, tp, method)

    start = time.perf_counter()
    moved = _collect(inst)
    tr._time("collect", start)

    # New instance j is the aligned group [first + j*tp, ...); its rank r collects the heads of
    # old ranks r*m .. r*m + m-1 (the KV is staged, so any worker can take any rank).
    worker_of = {(j, r): first + j * tp + r for j in range(m) for r in range(tp)}
    # Balance requests over the new instances by the KV blocks they hold (largest first).
    sample = host.worker(first)
    block_size = host.block_size
    load = [0] * m
    target = {}
    for handle, ex, tabs, ntok in sorted(moved, key=lambda x: -max(x[3])):
        j = min(range(m), key=lambda i: load[i])
        target[handle.id] = j
        load[j] += -(-max(ntok) // block_size)
    # Capacity check on every new worker: blocks of h_new heads its budget can hold.
    block_bytes_new = sample.kv.block_bytes // h_old * h_new
    for (j, r), w in worker_of.items():
        worker = host.worker(w)
        stats = worker.arena.stats()
        kv_bytes = stats["bytes_by_tag"]["kv"]
        free = stats["budget_bytes"] - stats["bytes_in_use"] + kv_bytes
        free -= _shards_to_restore(worker, tp, r) * worker.page_size
        capacity = free // config.num_hidden_layers // worker.page_size * (worker.page_size // block_bytes_new)
        if load[j] > capacity:
            raise TransformError(
                f"scale-down refused: the requests for instance {j} need {load[j]} KV blocks on "
                f"worker {w} but it can hold {capacity} after taking back its FFN shards")

    # ---- 1. KV first: stage each layer in host memory, then write it in the wider blocks ----
    start = time.perf_counter()
    host.instances.remove(inst)
    inst.close()
    run_bytes = sample.kv.block_bytes  # one old block = h_old heads
    staged = {}
    for layer in range(config.num_hidden_layers):
        for handle, ex, tabs, ntok in moved:
            for rank, tab in enumerate(tabs):
                if tab is None:
                    continue
                w = rank_worker[rank]
                kv = host.worker(w).kv
                raw = host.worker(w).arena.view_bytes(kv.layer_offset(layer), kv.n_blocks * run_bytes,
                                                      dtype=np.uint8).reshape(kv.n_blocks, run_bytes)
                staged[(layer, handle.id, rank)] = raw[tab].copy()
                # Staged in host memory, not in the arena: this version stages every layer.
                tr.stats["peak_extra_bytes"][w] += staged[(layer, handle.id, rank)].nbytes
                del raw
    for w in group:
        kv = host.worker(w).kv
        pages = kv.stats()["pages_per_layer"]
        kv.reshape(h_new)
        if pages:
            kv.shrink(pages)  # every block is free after the reshape; pages come back below
    seq_of = {w: {} for w in group}
    for (j, r), w in worker_of.items():
        kv = host.worker(w).kv
        need = sum(-(-max(ntok) // block_size) for h, _, _, ntok in moved if target[h.id] == j and max(ntok))
        if need:
            pages = -(-need // (host.worker(w).page_size // kv.block_bytes))
            kv.grow(pages)
            tr.stats["kv_pages_mapped"][w] = pages * config.num_hidden_layers
        for handle, ex, tabs, ntok in moved:
            if target[handle.id] != j or not max(ntok):
                continue
            seq = kv.new_sequence()
            kv.reserve(seq, max(ntok))
            seq_of[w][handle.id] = seq
    for layer in range(config.num_hidden_layers):
        for (j, r), w in worker_of.items():
            kv = host.worker(w).kv
            if not kv.n_blocks:
                continue
            dst = host.worker(w).arena.view_bytes(kv.layer_offset(layer), kv.n_blocks * kv.block_bytes,
                                                  dtype=np.uint8).reshape(kv.n_blocks, m, run_bytes)
            for handle, ex, tabs, ntok in moved:
                if handle.id not in seq_of[w]:
                    continue
                table = kv.block_table(seq_of[w][handle.id])
                for g in range(m):  # old rank r*m + g held sub-group g of the new rank's heads
                    data = staged[(layer, handle.id, r * m + g)]
                    dst[table, g] = data
                    src_w = rank_worker[r * m + g]
                    if src_w != w:
                        tr.stats["bytes_sent"][src_w] += data.nbytes
                        tr.stats["bytes_received"][w] += data.nbytes
            del dst
        for key in [key for key in staged if key[0] == layer]:
            del staged[key]
    tr._time("kv", start)

    # ---- 2. weights: each worker takes back the FFN shards of its new rank ----
    start = time.perf_counter()
    holders = {}
    for w in group:
        for s in host.worker(w).weights.held:
            holders.setdefault(s, w)
    for (j, r), w in worker_of.items():
        worker = host.worker(w)
        missing = worker.owned_shards(tp, r) - worker.weights.held
        source = (lambda s: host.worker(holders[s]).weights) if weights_from == "peers" else None
        tr.stats["weight_bytes_copied"][w] = worker.weights.restore_shards(missing, source)
    for (j, r), w in worker_of.items():  # a shard of the old rank that the new one does not own
        worker = host.worker(w)
        tr.stats["weight_bytes_released"][w] = worker.weights.drop_shards(worker.owned_shards(tp, r))
    tr._time("weights", start)

    # ---- 3. the new instances take over the requests ----
    start = time.perf_counter()
    for (j, r), w in worker_of.items():
        host.worker(w).set_tp(tp, r)
    for j in range(m):
        ranks = [worker_of[(j, r)] for r in range(tp)]
        new = host.make_instance(ranks, tp)
        mine = [item for item in moved if target[item[0].id] == j]
        _adopt_all(new, mine, lambda rid: [seq_of[w].get(rid, -1) for w in ranks])
        host.instances.append(new)
    host.instances.sort(key=lambda inst: min(inst.workers))
    tr.stats["requests_moved"] = len(moved)
    tr._time("adopt", start)
    tr.done = True
    return tr


def _shards_to_restore(worker, tp, rank):
    """Slots the worker must map to hold its new rank's FFN shards."""
    missing = worker.owned_shards(tp, rank) - worker.weights.held
    return len(missing) * worker.weights.shard_slots * 3 * worker.config.num_hidden_layers
