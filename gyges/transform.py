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
their KV (refused with the reason when they cannot fit), the KV is staged and written back in the
wider blocks (all layers at once in this version: the staging is reported as peak extra bytes),
then each worker gathers the FFN shards its new rank
needs from the peers that hold them (or from the host copy of the weights).

Where the bytes move (KV_COPY_PATH): CPU workers copy host memory (NumPy views, arena copy_runs,
staging in host memory). CUDA workers, virtual workers sharing one GPU, never move KV through the
host: the all-to-all is KVCache.copy_heads_from (a kernel per layer and pair of workers), a
scale-down stages in a device arena of its own (outside the workers' budgets, like the host
staging; stats["stage_bytes"]), and FFN shards come back from peers by device-to-device copies.
The plan, the order of the rounds and every count are the same on both paths.

Both directions run either at once, between two steps of the host (scale_up, scale_down), or
layer-staggered (Gyges 4.3: StaggeredScaleUp/StaggeredScaleDown move a few layers per step, last
layer first, serving in between; with overlap=True most of the copying runs beside the steps).
"""
import os
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from . import _C

from .arena import Arena
from .errors import InvalidArgumentError, OutOfMemoryError
from .kv_cache import KVCache


class TransformError(InvalidArgumentError):
    """A transformation that cannot be carried out; nothing was changed."""


def views_in(host, workers):
    """Why the workers' pages cannot change now (a live NumPy view pins a slot), or None."""
    for w in workers:
        pinned = host.worker(w).arena.pinned_slots()
        if pinned.size:
            return (f"worker {w} has {pinned.size} slot(s) under a live NumPy view (slot "
                    f"{int(pinned[0])} first)")
    return None


def _trim_kv(host, workers):
    """A transformation that ends gives back the KV pages its new caches do not use: the
    requests that held them may have finished while it ran, and an idle instance holds none."""
    for w in workers:
        host.worker(w).kv.trim()


def _changes_begin(host):
    """Marks the point past which a failure rebuilds the group (gyges.recovery) instead of
    leaving it as it was: before it, a transformation has only looked."""
    host._changing = True


# How a transformation moves KV between workers: "host" copies host memory (NumPy views and
# arena copy_runs: the CPU backend's way), "device" uses KVCache.copy_heads_from, which copies on
# the GPU the workers' arenas share (and with memmove on CPU arenas). None: by the host's backend.
# Tests set "device" to run the GPU's path on CPU hosts.
KV_COPY_PATH = None


def _device_path(host):
    if KV_COPY_PATH is not None:
        return KV_COPY_PATH == "device"
    return host.backend == "cuda"


class Transformation:
    """The handle Host.transform returns: done, and stats (bytes per worker, pages, peak extra
    memory, time per phase)."""

    def __init__(self, kind, workers, from_tp, to_tp, method):
        self.kind, self.workers, self.from_tp, self.to_tp = kind, tuple(workers), from_tp, to_tp
        self.method = method
        self.done = False
        self.recovered = False  # failed half-way and rebuilt (gyges.recovery)
        self.error = None       # what failed, then
        self.blocked_by = None  # why a layer-staggered one is waiting (a live view), or None
        self.source_instances = ()
        self.stats = {"bytes_sent": {w: 0 for w in workers}, "bytes_received": {w: 0 for w in workers},
                      "weight_bytes_released": {w: 0 for w in workers},
                      "weight_bytes_copied": {w: 0 for w in workers},
                      "kv_pages_mapped": {w: 0 for w in workers},
                      "kv_bytes_trimmed": {w: 0 for w in workers},
                      "peak_extra_bytes": {w: 0 for w in workers},
                      "requests_moved": 0, "phase_seconds": {},
                      # layer-staggered: KV bytes read beside steps (overlap), KV bytes already
                      # in place (a rank's own heads), and the host memory the largest layer
                      # move staged
                      "bytes_read_beside_steps": 0, "bytes_in_place": 0, "stage_bytes": 0,
                      "steps_waiting": 0}

    def release_resources(self):
        """Lets go of everything it holds of the workers (a failed one is rebuilt without it)."""

    def _time(self, phase, start):
        self.stats["phase_seconds"][phase] = self.stats["phase_seconds"].get(phase, 0.0) + (
            time.perf_counter() - start)

    def __repr__(self):
        state = "recovered" if self.recovered else "done" if self.done else "pending"
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


METHODS = ("gyges", "stop_world", "basic", "partial_swap")


def _mechanisms(host, method):
    """(weights, kv) mechanisms of a method:
    gyges, stop_world: release padded shards page by page; KV in place (header-centric layout).
        Both run every layer at once between two steps in this version, which is what
        stop_world means; gyges will differ once layer-staggered execution exists.
    basic: Gyges' Basic for the KV (any layout: build the new blocks in fresh pages, migrate the
        other heads into them, then trim by copying the kept heads and freeing the old pages);
        weights as the host is padded or not.
    partial_swap: weights by partial swap (unpadded FFN: copy the kept shard to the front, then
        release); KV in place when the layout allows it."""
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


def _kv_basic(host, tr, moved, group, heads_of, home_ranks, k_new):
    """Gyges' Basic: every worker builds a new cache (H/k_new heads) in fresh pages of its other
    slot region, receives the heads it now owns of every request (migrate) and copies in its own
    (trim), then frees the old pages. Returns worker -> request id -> sequence."""
    config = host.model.config
    L = config.num_hidden_layers
    ntok = {h.id: max(n) for h, _, _, n in moved}
    new_kv, seq_of = {}, {w: {} for w in group}
    for w in group:  # all-or-nothing memory check before anything changes
        worker = host.worker(w)
        probe_bytes = worker.kv.block_bytes // worker.kv.n_kv_heads * (config.num_key_value_heads // k_new)
        per_page = worker.page_size // probe_bytes
        blocks = sum(-(-ntok[h.id] // host.block_size) for h, _, _, n in moved if max(n))
        pages = -(-blocks // per_page) if blocks else 0
        s = worker.arena.stats()
        if pages * L * worker.page_size > s["budget_bytes"] - s["bytes_in_use"]:
            raise OutOfMemoryError(f"the basic migration needs {pages * L * worker.page_size:,} "
                                   f"bytes of new KV pages on worker {w} while the old ones are "
                                   f"still in use; only {s['budget_bytes'] - s['bytes_in_use']:,} "
                                   f"are free")
    for w in group:
        worker = host.worker(w)
        base = worker.arena.stats()["bytes_in_use"]
        worker.arena.reset_peak()
        new = worker._new_kv(k_new, region=1 - worker.kv_region)
        for handle, ex, tabs, n in moved:
            if not max(n):
                continue
            need = new.stats()["free_blocks"]
            want = -(-ntok[handle.id] // host.block_size)
            if want > need:
                per_page = worker.page_size // new.block_bytes
                new.grow(-(-(want - need) // per_page))
            seq = new.new_sequence()
            new.reserve(seq, ntok[handle.id])
            seq_of[w][handle.id] = seq
        new_kv[w] = (new, base)
        tr.stats["kv_pages_mapped"][w] = new.stats()["pages_per_layer"] * L
    for layer in range(L):
        for handle, ex, tabs, n in moved:
            if not max(n):
                continue
            # The whole request's K/V from the ranks that held it, then each new owner's heads.
            parts = [(w_old, host.worker(w_old).kv.gather(seq, layer, 0, ntok[handle.id]))
                     for w_old, seq in zip(home_ranks[handle.id], ex["seqs"]) if seq >= 0]
            k_all = np.concatenate([p[1][0] for p in parts], axis=1)
            v_all = np.concatenate([p[1][1] for p in parts], axis=1)
            held_by = [w_old for w_old, (kk, _) in parts for _ in range(kk.shape[1])]
            for w in group:
                heads = heads_of[w]
                new_kv[w][0].write(seq_of[w][handle.id], layer, 0, k_all[:, heads], v_all[:, heads])
                for h in heads:
                    nbytes = 2 * ntok[handle.id] * config.head_dim * 4
                    if held_by[h] != w:
                        tr.stats["bytes_sent"][held_by[h]] += nbytes
                        tr.stats["bytes_received"][w] += nbytes
                    else:
                        tr.stats["kv_bytes_trimmed"][w] += nbytes
    return seq_of, new_kv


def _switch_caches(host, tr, new_kv):
    """After the old engines are gone (their sequences freed): unmap the old caches' pages and
    make the new ones the workers' caches."""
    for w, (new, base) in new_kv.items():
        worker = host.worker(w)
        pages = worker.kv.stats()["pages_per_layer"]
        if pages:
            worker.kv.shrink(pages)
        worker.kv = new
        tr.stats["peak_extra_bytes"][w] = worker.arena.stats()["peak_bytes"] - base


def _chunk(items, c, chunks):
    """The c-th of `chunks` nearly equal consecutive parts of a list."""
    n = len(items)
    return items[c * n // chunks:(c + 1) * n // chunks]


def _merge_sources(host, first, k):
    """The instances a scale-up merges, checked: inside the aligned group and all of one TP
    degree below k. Returns (group, old instances by first worker, their TP degree)."""
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
    return group, old, t


def _merge_ranks(old, group, m, t):
    """Worker (instance j, old rank r) becomes rank r*m + j of the merged instance, so that it
    keeps a subset of its heads and FFN shards. Returns (worker_of, new_rank, rank_order)."""
    worker_of = {(j, r): old[j].workers[r] for j in range(m) for r in range(t)}
    new_rank = {worker_of[(j, r)]: r * m + j for (j, r) in worker_of}
    return worker_of, new_rank, sorted(group, key=lambda w: new_rank[w])


def _split_source(host, first, k, tp, weights_from):
    """The TPk instance a scale-down splits, checked. Returns (group, instance)."""
    if weights_from not in ("peers", "host"):
        raise TransformError(f"weights_from must be 'peers' or 'host', got {weights_from!r}")
    group = list(range(first, first + k))
    matches = [inst for inst in host.instances if set(inst.workers) == set(group)]
    if not matches or matches[0].tp != k:
        raise TransformError(f"workers {group} are not one TP{k} instance (layout {host.layout()})")
    if tp >= k or k % tp:
        raise TransformError(f"scale-down goes from TP{k} to a smaller divisor, not TP{tp}")
    return group, matches[0]


def _balance(moved, m, block_size):
    """Spreads requests over m new instances by the KV blocks they hold, largest first.
    Returns (request id -> instance, blocks per instance)."""
    load = [0] * m
    target = {}
    for handle, ex, tabs, ntok in sorted(moved, key=lambda x: -max(x[3])):
        j = min(range(m), key=lambda i: load[i])
        target[handle.id] = j
        load[j] += -(-max(ntok) // block_size)
    return target, load


def scale_up(host, first, k, method="gyges", chunks=4):
    """Merges the instances on workers [first, first+k) into one TPk instance; each all-to-all
    phase of the KV migration runs in `chunks` rounds."""
    weights_mech, kv_mech = _mechanisms(host, method)
    group, old, t = _merge_sources(host, first, k)
    m = k // t
    config = host.model.config
    H = config.num_key_value_heads
    h_new = H // k
    worker_of, new_rank, rank_order = _merge_ranks(old, group, m, t)
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
    if kv_mech == "basic":
        return _scale_up_copying(host, tr, old, moved, owner, group, worker_of, new_rank,
                                 rank_order, m, t, k, weights_mech, start)
    sample = host.worker(first)
    block_bytes_new = sample.kv.block_bytes // (H // t) * h_new
    plan_dest = {w: {} for w in group}      # worker -> rid -> its new block list there
    grow_pages = {w: 0 for w in group}
    sends = []                               # ((phase, chunk), src worker, dst worker, src block, dst block)
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
        # Each phase is cut into `chunks` rounds; a round receives only into blocks free from
        # the start or sent away in an earlier round, so only the first round maps new pages.
        outgoing = {j: [b for _, tab in local[j] for b in tab.tolist()] for j in range(m)}
        n_blocks_of = {rid: len(tab) for j in range(m) for rid, tab in local[j]}
        for s in range(1, m):
            incoming = {j: [(rid, i, b) for rid, tab in local[(j - s) % m]
                            for i, b in enumerate(tab.tolist())] for j in range(m)}
            for c in range(chunks):
                for j in range(m):
                    w = col[j]
                    part = _chunk(incoming[j], c, chunks)
                    for rid, i, b in part:
                        if pool[w]:
                            dest = pool[w].pop()
                        else:  # no freed block left: map a new one (the extra memory)
                            dest = next_block[w]
                            next_block[w] += 1
                        plan_dest[w].setdefault(rid, [None] * n_blocks_of[rid])[i] = dest
                        sends.append(((s, c), col[(j - s) % m], w, b, dest))
                for j in range(m):  # what this round sent away is free for the next rounds
                    w = col[j]
                    freed = [m * b + (j + s) % m for b in _chunk(outgoing[j], c, chunks)]
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
        freed = worker.weights.bytes_freed_keeping(worker.owned_shards(k, new_rank[w]))
        stats = worker.arena.stats()
        free_bytes = stats["budget_bytes"] - stats["bytes_in_use"] + freed
        need = grow_pages[w] * config.num_hidden_layers * worker.page_size
        if need > free_bytes:
            raise OutOfMemoryError(f"scale-up needs {need:,} more bytes of KV on worker {w} but "
                                   f"only {free_bytes:,} would be free")

    # ---- 1. MLP first: drop the FFN shards the new rank does not own ----
    start = time.perf_counter()
    _changes_begin(host)
    for inst in old:
        host.instances.remove(inst)
        inst.close()
    _weights_up(host, tr, group, new_rank, k, weights_mech)
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
    rounds = {}  # (phase, chunk) -> (src, dst) -> (src blocks, dst blocks)
    for rnd, src, dst, b, dest in sends:
        pair = rounds.setdefault(rnd, {}).setdefault((src, dst), ([], []))
        pair[0].append(b)
        pair[1].append(dest)
    if _device_path(host):
        _all_to_all_device(host, tr, rounds, new_rank, m, run_bytes)
        tr._time("kv_all_to_all", start)
        return _install_merged(host, tr, group, new_rank, rank_order, k, moved, seq_of)
    for layer in range(config.num_hidden_layers):
        for rnd in sorted(rounds):
            for (src, dst), (src_blocks, dst_blocks) in rounds[rnd].items():
                sub = new_rank[dst] % m  # the sub-group of heads the destination's rank owns
                src_off = (host.worker(src).kv.layer_offset(layer)
                           + (m * np.asarray(src_blocks, np.uint64) + sub) * run_bytes)
                dst_off = host.worker(dst).kv.layer_offset(layer) + np.asarray(dst_blocks, np.uint64) * run_bytes
                sizes = np.full(dst_off.size, run_bytes, dtype=np.uint64)
                host.worker(dst).arena._c.copy_runs(host.worker(src).arena._c, dst_off.astype(np.uint64),
                                                    src_off.astype(np.uint64), sizes)
                tr.stats["bytes_sent"][src] += int(sizes.sum())
                tr.stats["bytes_received"][dst] += int(sizes.sum())
    tr._time("kv_all_to_all", start)

    # ---- 4. the merged instance takes over every request ----
    return _install_merged(host, tr, group, new_rank, rank_order, k, moved, seq_of)


def _all_to_all_device(host, tr, rounds, new_rank, m, run_bytes):
    """The phased all-to-all with device copies (KVCache.copy_heads_from: one kernel per layer
    and pair on a GPU): every layer of a round at once, the rounds in order, so that in each
    layer a round still receives only into blocks that earlier rounds have already sent away."""
    L = host.model.config.num_hidden_layers
    for rnd in sorted(rounds):
        for (src, dst), (src_blocks, dst_blocks) in rounds[rnd].items():
            sub = new_rank[dst] % m  # the sub-group of heads the destination's rank owns
            src_kv, dst_kv = host.worker(src).kv, host.worker(dst).kv
            dst_kv.copy_heads_from(src_kv, dst_blocks, m * np.asarray(src_blocks, np.int64) + sub)
            nbytes = len(dst_blocks) * run_bytes * L
            tr.stats["bytes_sent"][src] += nbytes
            tr.stats["bytes_received"][dst] += nbytes


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
        return self.engine._c.transition_boundary()

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
            self.engine._c.transition_set_boundary(layer)
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
        group, old, t = _merge_sources(host, first, k)
        super().__init__("scale-up", group, t, k, method)
        self.host, self.layers_per_step = weakref.proxy(host), layers_per_step
        self.overlap = bool(overlap)
        config = host.model.config
        self.L = config.num_hidden_layers
        m = k // t
        H = config.num_key_value_heads
        self.h_old, self.h_new = H // t, H // k
        worker_of, self.new_rank, self.rank_order = _merge_ranks(old, group, m, t)
        start = time.perf_counter()
        moved = []
        for j, inst in enumerate(old):
            moved += [(j, item) for item in _collect(inst)]
        # Room for the new geometry: every worker holds H/k heads of every request.
        for w in group:
            worker = host.worker(w)
            s = worker.arena.stats()
            new_block = worker.kv.block_bytes // self.h_old * self.h_new
            blocks = sum(-(-max(n) // host.block_size) for _, (h, _, _, n) in moved if max(n))
            need = -(-blocks * new_block // worker.page_size) * self.L * worker.page_size
            mapped = worker.kv.stats()["pages_per_layer"] * self.L * worker.page_size
            if need > mapped + s["budget_bytes"] - s["bytes_in_use"]:
                raise OutOfMemoryError(f"worker {w} cannot hold the new geometry's {need:,} bytes of KV")
        self.base = {w: host.worker(w).arena.stats()["bytes_in_use"] for w in group}
        for w in group:
            host.worker(w).arena.reset_peak()
        _changes_begin(host)
        # The old engines go; their KV sequences stay for the old layers.
        for inst in old:
            inst._c.detach_kv()
            host.instances.remove(inst)
            inst.close()
        self.old_models, self.old_kvs = {}, {}
        for w in group:
            worker = host.worker(w)
            self.old_models[w], self.old_kvs[w] = worker.c_model, worker.kv
            worker.kv = worker.kv.shadow(self.h_new)
            worker.c_model = worker.model_for_shards(worker.owned_shards(k, self.new_rank[w]))
        seq_of = {w: {} for w in group}
        if host.kv_layout == "header":
            # Worker (j, r) keeps heads run j of its old heads (_merge_ranks). In the header
            # layout that run of old block X is the shadow's block m*X + j, so a sequence made
            # of those blocks finds its heads already in place: the layer moves skip them, and
            # only the other ranks' heads are copied (Gyges 4.1.2). These come first, while
            # every shadow block is free.
            for j, (handle, ex, tabs, n) in moved:
                for r, w in enumerate(old[j].workers):
                    if tabs[r] is not None and n[r]:
                        blocks = m * np.asarray(tabs[r], np.int64) + j
                        seq_of[w][handle.id] = host.worker(w).kv.adopt(blocks, n[r])
        for _, (handle, ex, tabs, n) in moved:
            if not max(n):
                continue
            for w in group:
                kv = host.worker(w).kv
                seq = seq_of[w].get(handle.id)
                if seq is None:
                    seq = seq_of[w][handle.id] = kv.new_sequence()
                _reserve_growing(kv, seq, max(n), host.worker(w).page_size)
        merged = host.make_instance(self.rank_order, k)
        _adopt_all(merged, [item for _, item in moved],
                   lambda rid: [seq_of[w].get(rid, -1) for w in self.rank_order])
        rank_of = {w: i for i, w in enumerate(self.rank_order)}
        groups = [([rank_of[w] for w in inst.workers], host.comm(min(inst.workers), inst.tp)
                   if inst.tp > 1 else None) for inst in old]
        merged._c.transition_begin([self.old_models[w] for w in self.rank_order],
                                   [self.old_kvs[w]._c for w in self.rank_order], groups)
        self.group_ranks = [ranks for ranks, _ in groups]  # engine ranks of each old group
        for j, (handle, ex, tabs, n) in moved:
            merged._c.transition_adopt(handle.id, j, ex["seqs"])
        self.old_instances = old
        self.merged = self.engine = merged
        host.instances.append(merged)
        host.instances.sort(key=lambda inst: min(inst.workers))
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
        c = self.merged._c
        items, sent = [], {}
        D = self.host.model.config.head_dim
        dst_kvs = [self.host.worker(w).kv._c for w in self.rank_order]
        for rid, new_seqs, olds in c.transition_table():
            for i, w in enumerate(self.rank_order):
                group = olds[i][0]
                if new_seqs[i] < 0 or group < 0:
                    continue
                first = i * self.h_new
                src_rank = first // self.h_old
                src = self.group_ranks[group][src_rank]
                old_seq = olds[src][1]
                src_w = self.rank_order[src]
                src_kv = self.old_kvs[src_w]._c
                n_tokens = src_kv.seq_n_tokens(old_seq)
                items.append((src_kv, old_seq, first - src_rank * self.h_old, self.h_new,
                              n_tokens, dst_kvs[i], new_seqs[i]))
                if src_w != w:
                    sent[(src_w, w)] = sent.get((src_w, w), 0) + 2 * n_tokens * self.h_new * D * 4
        return items, sent

    def _finish(self):
        host = self.host
        self.merged._c.transition_end()
        for w in self.workers:
            worker = host.worker(w)
            worker.kv.take_pages()
            worker.weights.finish_layer_drops(worker.owned_shards(self.to_tp, self.new_rank[w]))
            worker.tp_size, worker.tp_rank = self.to_tp, self.new_rank[w]
            s = worker.arena.stats()
            self.stats["peak_extra_bytes"][w] = max(s["peak_bytes"] - self.base[w], 0)
        _trim_kv(host, self.workers)
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
        group, inst = _split_source(host, first, k, tp, weights_from)
        super().__init__("scale-down", group, k, tp, method)
        self.host, self.layers_per_step = weakref.proxy(host), layers_per_step
        self.weights_from, self.overlap = weights_from, bool(overlap)
        self.inst = self.engine = inst
        config = host.model.config
        self.L = config.num_hidden_layers
        m = self.m = k // tp
        H = config.num_key_value_heads
        self.h_old, self.h_new = H // k, H // tp
        self.rank_worker = list(inst.workers)
        self.worker_of = {(j, r): first + j * tp + r for j in range(m) for r in range(tp)}
        start = time.perf_counter()
        moved = _collect(inst)
        self.target, load = _balance(moved, m, host.block_size)
        # Room: every worker must hold the new geometry of its instance's requests and the FFN
        # shards its new rank needs, beside what it has now.
        for (j, r), w in self.worker_of.items():
            worker = host.worker(w)
            s = worker.arena.stats()
            new_block = worker.kv.block_bytes // self.h_old * self.h_new
            need = -(-load[j] * new_block // worker.page_size) * self.L * worker.page_size
            need += _shards_to_restore(worker, tp, r) * worker.page_size
            if need > s["budget_bytes"] - s["bytes_in_use"] + worker.kv.stats()["pages_per_layer"] * self.L * worker.page_size:
                raise TransformError(f"scale-down refused: worker {w} cannot hold the KV of its "
                                     f"new instance's requests ({load[j]} blocks) and its FFN shards")
        self.base = {w: host.worker(w).arena.stats()["bytes_in_use"] for w in group}
        for w in group:
            host.worker(w).arena.reset_peak()
        _changes_begin(host)
        # The new geometry and models, next to the old ones.
        self.new_kv, self.new_model = {}, {}
        for (j, r), w in self.worker_of.items():
            worker = host.worker(w)
            self.new_kv[w] = worker.kv.shadow(self.h_new)
            self.new_model[w] = worker.model_for_shards(worker.owned_shards(tp, r), pending=True)
        rank_of = {w: i for i, w in enumerate(self.rank_worker)}
        self.group_ranks = [[rank_of[self.worker_of[(j, r)]] for r in range(tp)] for j in range(m)]
        groups = [(ranks, host.comm(first + j * tp, tp) if tp > 1 else None)
                  for j, ranks in enumerate(self.group_ranks)]
        inst._c.transition_begin([self.new_model[w] for w in self.rank_worker],
                                 [self.new_kv[w]._c for w in self.rank_worker], groups, True)
        for handle, ex, tabs, ntok in moved:
            j = self.target[handle.id]
            seqs = []
            for r in range(tp):
                w = self.worker_of[(j, r)]
                if max(ntok):
                    seq = self.new_kv[w].new_sequence()
                    _reserve_growing(self.new_kv[w], seq, max(ntok), host.worker(w).page_size)
                    seqs.append(seq)
                else:
                    seqs.append(-1)
            inst._c.transition_adopt(handle.id, j, seqs)
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
        for (j, r), w in self.worker_of.items():
            worker = self.host.worker(w)
            self.stats["weight_bytes_copied"][w] += worker.weights.restore_layer_shards(
                layer, worker.owned_shards(self.to_tp, r), source)

    def _move_plan(self):
        c = self.inst._c
        items, sent = [], {}
        D = self.host.model.config.head_dim
        src_kvs = [self.host.worker(w).kv._c for w in self.rank_worker]
        for rid, old_seqs, news in c.transition_table():
            group = news[0][0]
            if group < 0 or min(old_seqs) < 0:
                continue
            for r, rank in enumerate(self.group_ranks[group]):
                new_seq = news[rank][1]
                w = self.rank_worker[rank]
                for g in range(self.m):  # old rank r*m + g holds sub-group g of the new heads
                    src_rank = r * self.m + g
                    src_w = self.rank_worker[src_rank]
                    src_kv = src_kvs[src_rank]
                    n_tokens = src_kv.seq_n_tokens(old_seqs[src_rank])
                    items.append((src_kv, old_seqs[src_rank], 0, self.h_old, n_tokens,
                                  self.new_kv[w]._c, new_seq, g * self.h_old))
                    if src_w != w:
                        sent[(src_w, w)] = sent.get((src_w, w), 0) + 2 * n_tokens * self.h_old * D * 4
        return items, sent

    def _finish(self):
        host, tp = self.host, self.to_tp
        c = self.inst._c
        ids = c.request_ids()
        exports = {rid: c.export(rid) for rid in ids}
        group_seqs = {rid: [c.transition_seq(rid, rank)[1] for rank in range(len(self.rank_worker))]
                      for rid in ids}
        homes = {rid: c.transition_seq(rid, 0)[0] for rid in ids}
        count = [sum(1 for h in homes.values() if h == j) for j in range(self.m)]
        for rid in ids:  # never scheduled yet, so no KV and no group: the least loaded one
            if homes[rid] < 0:
                homes[rid] = min(range(self.m), key=lambda j: count[j])
                count[homes[rid]] += 1
        c.transition_detach()           # the new sequences stay...
        handles = dict(self.inst.requests)
        host.instances.remove(self.inst)
        self.inst.close()               # ...the old ones go with the TPk engine
        for (j, r), w in self.worker_of.items():
            worker = host.worker(w)
            self.new_kv[w].take_pages()
            worker.kv = self.new_kv[w]
            worker.weights.finish_layer_restores(worker.owned_shards(tp, r))
            self.stats["weight_bytes_released"][w] = worker.weights.drop_shards(worker.owned_shards(tp, r))
            worker.tp_size, worker.tp_rank = tp, r
            worker.c_model = self.new_model[w]
        for j in range(self.m):
            ranks = [self.worker_of[(j, r)] for r in range(tp)]
            new = host.make_instance(ranks, tp)
            rank_of = {w: i for i, w in enumerate(self.rank_worker)}
            mine = [(handles[rid], exports[rid], None, None) for rid in ids if homes[rid] == j]
            _adopt_all(new, mine, lambda rid: [group_seqs[rid][rank_of[w]] for w in ranks])
            host.instances.append(new)
        host.instances.sort(key=lambda inst: min(inst.workers))
        for w in self.workers:
            s = host.worker(w).arena.stats()
            self.stats["peak_extra_bytes"][w] = max(s["peak_bytes"] - self.base[w], 0)
        _trim_kv(host, self.workers)
        self.done = True


def _reserve_growing(kv, seq, n_tokens, page_size):
    """reserve, mapping pages first when the free blocks are too few."""
    want = -(-n_tokens // kv.block_size) - len(kv.block_table(seq))
    short = want - kv.free_blocks
    if short > 0:
        kv.grow(-(-short * kv.block_bytes // page_size))
    kv.reserve(seq, n_tokens)


def _install_merged(host, tr, group, new_rank, rank_order, k, moved, seq_of):
    """The merged TPk instance takes over every moved request (its KV already in place)."""
    start = time.perf_counter()
    for w in group:
        host.worker(w).set_tp(k, new_rank[w])
    merged = host.make_instance(rank_order, k)
    _adopt_all(merged, moved, lambda rid: [seq_of[w].get(rid, -1) for w in rank_order])
    host.instances.append(merged)
    host.instances.sort(key=lambda inst: min(inst.workers))
    _trim_kv(host, group)
    tr.stats["requests_moved"] = len(moved)
    tr._time("adopt", start)
    tr.done = True
    return tr


def _weights_up(host, tr, group, new_rank, k, mechanism):
    for w in group:
        worker = host.worker(w)
        before = worker.arena.stats()["bytes_in_use"]
        keep = worker.owned_shards(k, new_rank[w])
        if mechanism == "drop":
            worker.weights.drop_shards(keep)
        else:
            copied, _ = worker.weights.partial_swap(keep)
            tr.stats["weight_bytes_copied"][w] = copied
        tr.stats["weight_bytes_released"][w] = before - worker.arena.stats()["bytes_in_use"]


def _scale_up_copying(host, tr, old, moved, owner, group, worker_of, new_rank, rank_order, m, t,
                      k, weights_mech, start):
    """Scale-up with Gyges' Basic KV migration (see _kv_basic)."""
    config = host.model.config
    H = config.num_key_value_heads
    heads_of = {w: list(range(new_rank[w] * H // k, (new_rank[w] + 1) * H // k)) for w in group}
    home_ranks = {h.id: list(old[owner[h.id]].workers) for h, _, _, _ in moved}
    tr._time("plan", start)
    start = time.perf_counter()
    _changes_begin(host)
    _weights_up(host, tr, group, new_rank, k, weights_mech)
    tr._time("weights", start)
    start = time.perf_counter()
    seq_of, new_kv = _kv_basic(host, tr, moved, group, heads_of, home_ranks, k)
    for inst in old:
        host.instances.remove(inst)
        inst.close()
    _switch_caches(host, tr, new_kv)
    tr._time("kv_migrate_and_trim", start)
    return _install_merged(host, tr, group, new_rank, rank_order, k, moved, seq_of)


def scale_down(host, first, k, tp, method="gyges", weights_from="peers"):
    """Splits the TPk instance on workers [first, first+k) into k/tp instances of TPtp."""
    weights_mech, kv_mech = _mechanisms(host, method)
    if weights_mech != "drop":
        raise TransformError("scale-down needs padded FFN weights (shards are restored page by page)")
    group, inst = _split_source(host, first, k, tp, weights_from)
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
    sample = host.worker(first)
    block_size = host.block_size
    target, load = _balance(moved, m, block_size)
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
    _changes_begin(host)
    host.instances.remove(inst)
    inst.close()
    device = _device_path(host)
    stage, unstage = (_stage_device, _unstage_device) if device else (_stage_host, _unstage_host)
    staged = stage(host, tr, moved, rank_worker)
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
    unstage(host, tr, moved, staged, worker_of, rank_worker, seq_of, m, h_old)
    del staged  # the stage goes back (host memory, or the device path's staging arenas)
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
    _trim_kv(host, group)
    tr.stats["requests_moved"] = len(moved)
    tr._time("adopt", start)
    tr.done = True
    return tr


def _stage_host(host, tr, moved, rank_worker):
    """Scale-down's staging on the host path: each moved request's old blocks of every rank and
    layer, copied out of the arena's host memory. Returns {(layer, request id, rank): bytes}."""
    staged = {}
    for layer in range(host.model.config.num_hidden_layers):
        for handle, ex, tabs, ntok in moved:
            for rank, tab in enumerate(tabs):
                if tab is None:
                    continue
                w = rank_worker[rank]
                kv = host.worker(w).kv
                run_bytes = kv.block_bytes  # one old block = h_old heads
                raw = host.worker(w).arena.view_bytes(kv.layer_offset(layer), kv.n_blocks * run_bytes,
                                                      dtype=np.uint8).reshape(kv.n_blocks, run_bytes)
                staged[(layer, handle.id, rank)] = raw[tab].copy()
                # Staged in host memory, not in the arena: this version stages every layer.
                tr.stats["peak_extra_bytes"][w] += staged[(layer, handle.id, rank)].nbytes
                del raw
    return staged


def _unstage_host(host, tr, moved, staged, worker_of, rank_worker, seq_of, m, h_old):
    """Writes the staged blocks into the new workers' wider blocks through host views: new rank
    r of instance j takes from old rank r*m + g the sub-group g of its heads."""
    for layer in range(host.model.config.num_hidden_layers):
        for (j, r), w in worker_of.items():
            kv = host.worker(w).kv
            if not kv.n_blocks:
                continue
            run_bytes = kv.block_bytes // m
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


def _stage_device(host, tr, moved, rank_worker):
    """Scale-down's staging on the device path: every moved request's KV blocks of each old
    rank, all layers, copied into a staging cache in an arena of its own on the rank's device
    (outside the workers' budgets, like the host path's staging in host memory; counted in
    peak_extra_bytes and stage_bytes). Returns {rank: (staging cache, {request id: its first
    staging block})}."""
    config = host.model.config
    L = config.num_hidden_layers
    stages = {}
    for rank, w in enumerate(rank_worker):
        worker = host.worker(w)
        kv = worker.kv
        items = [(handle.id, tabs[rank]) for handle, _, tabs, _ in moved
                 if tabs[rank] is not None and len(tabs[rank])]
        n = sum(len(tab) for _, tab in items)
        if not n:
            continue
        pages = -(-n * kv.block_bytes // worker.page_size)
        arena = Arena(budget=pages * L * worker.page_size, page_size=worker.page_size,
                      n_slots=pages * L, backend=worker.backend, device=worker.device)
        stage = KVCache(arena, n_layers=L, n_kv_heads=kv.n_kv_heads, head_dim=config.head_dim,
                        block_size=host.block_size, layout=host.kv_layout, first_slot=0,
                        slots_per_layer=pages, dtype=worker.kv_dtype)
        stage.grow(pages)
        first, at = {}, 0
        for rid, tab in items:
            first[rid] = at
            at += len(tab)
        stage.copy_heads_from(kv, np.arange(n), np.concatenate([tab for _, tab in items]))
        stages[rank] = (stage, first)
        tr.stats["peak_extra_bytes"][w] += n * kv.block_bytes * L
        tr.stats["stage_bytes"] += pages * L * worker.page_size
    return stages


def _unstage_device(host, tr, moved, stages, worker_of, rank_worker, seq_of, m, h_old):
    """Writes the staged blocks into the new workers' wider blocks: new rank r of instance j
    takes from old rank r*m + g the sub-group g of its heads (heads g*h_old ...), one device copy
    per (worker, g) for every request and layer."""
    L = host.model.config.num_hidden_layers
    for (j, r), w in worker_of.items():
        kv = host.worker(w).kv
        for g in range(m):
            rank = r * m + g
            if rank not in stages:
                continue
            stage, first = stages[rank]
            dst, src = [], []
            for handle, _, tabs, _ in moved:
                rid = handle.id
                if rid not in seq_of[w] or rid not in first:
                    continue
                table = kv.block_table(seq_of[w][rid])
                if len(table) != len(tabs[rank]):
                    raise TransformError(f"request {rid}: {len(table)} new blocks for "
                                         f"{len(tabs[rank])} staged ones")
                dst.append(table)
                src.append(np.arange(first[rid], first[rid] + len(table)))
            if not dst:
                continue
            dst, src = np.concatenate(dst), np.concatenate(src)
            kv.copy_heads_from(stage, dst, src, dst_head0=g * h_old, n_heads=h_old)
            src_w = rank_worker[rank]
            if src_w != w:
                tr.stats["bytes_sent"][src_w] += len(dst) * stage.block_bytes * L
                tr.stats["bytes_received"][w] += len(dst) * stage.block_bytes * L


def _shards_to_restore(worker, tp, rank):
    """Slots the worker must map to hold its new rank's FFN shards."""
    missing = worker.owned_shards(tp, rank) - worker.weights.held
    return len(missing) * worker.weights.shard_slots * 3 * worker.config.num_hidden_layers
