"""Gyges across GPUs: merge and split of CUDA workers on distinct GPUs (comm="nccl"), the KV
moved by the phased all-to-all over the group's migration communicator (KVMove's comm backend,
csrc/comm/kv_move_comm.h), the FFN shards dropped in place and restored from the host copy; the
same layer-staggered (each layer an overlapping move into shadows of the same pages: every rank
reads and exchanges before any writes) and with basic's migration (basic, partial_swap with the
page layout).

Runs where a CUDA host of four workers on four GPUs with NCCL can be made: a machine with four
GPUs, or the emulated one (`python tests/gpu_emu/run.py ext`: four GPUs and the pretend NCCL).
Skipped with the reason elsewhere.

Tolerance policy: exact everywhere. KV bytes are copies (never recomputed); tokens are compared
with the same host that never transformed: a step at TP4 all-reduces over NCCL, whose order of sums is
NCCL's and not the TP1 worker's tree, so the exact round trip merges and splits between the
same two steps, and the variant that serves at TP4 allows test_cuda_host's near ties."""
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
from test_cuda_host import assert_same_greedy_tokens, prompts
from test_transform import assert_kv_unchanged, check_placement, kv_by_request

import gyges
from gyges import _C, testing
from gyges.runtime.comm import make_comm
from gyges.runtime.worker import cuda_unavailable

pytestmark = pytest.mark.filterwarnings("error::gyges.reconfig.recovery.RecoveryWarning")

EMULATED = os.environ.get("GYGES_CUDA_EMULATED") == "1"


def _why_not():
    why = cuda_unavailable()
    if why is not None:
        return f"needs CUDA: {why}"
    if _C.cuda_device_count() < 4:
        return f"needs 4 GPUs, this machine has {_C.cuda_device_count()}"
    try:
        make_comm(2, "nccl", [0, 1])
    except gyges.UnavailableError as e:
        return f"needs NCCL: {e}"
    return None


WHY_NOT = _why_not()
needs_nccl = pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))

PAGE = "2MiB"
MEMORY = "256MiB"
GREEDY = gyges.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SEEDED = gyges.SamplingParams(max_tokens=12, temperature=0.9, top_k=40, seed=3, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    return gyges.Model.tiny()


def nccl_host(tiny, layout="4xTP1", backend="cuda", memory=MEMORY, **extra):
    kw = dict(comm="nccl") if backend == "cuda" else {}
    return gyges.Host(tiny, workers=4, memory_per_worker=memory, page_size=PAGE, layout=layout,
                      max_prefill_chunk=16, max_batch_tokens=64, backend=backend, **kw, **extra)


def raw_kv(host):
    """Every worker's KV storage, layer by layer, as bytes (the mapped blocks)."""
    out = []
    for w in range(host.n_workers):
        kv = host.worker(w).kv
        out.append([kv.arena.read(kv.layer_offset(l), kv.n_blocks * kv.block_bytes)
                    for l in range(kv.n_layers)])
    return out


def accounting(host):
    keys = ("bytes_in_use", "pages_mapped")
    return [{k: host.worker(w).arena.stats()[k] for k in keys} for w in range(host.n_workers)]


# ---- the comm backend on its own ----

def _cache(backend, device=0, layout="header", heads=4):
    arena = gyges.Arena(budget="16MiB", page_size=PAGE, backend=backend, device=device)
    kv = gyges.KVCache(arena, n_layers=3, n_kv_heads=heads, head_dim=32, block_size=16,
                       layout=layout)
    kv.grow(1)
    return kv


def _fill(caches, seed):
    rng = np.random.default_rng(seed)
    for layer in range(3):
        datas = [rng.standard_normal(kv.n_blocks * kv.block_bytes // 4).astype(np.float32)
                 for kv in caches[0]]
        for group in caches:
            for kv, data in zip(group, datas):
                kv.arena.write(kv.layer_offset(layer), data)


def _items(n, seed):
    """Random items among n caches: disjoint destination blocks, never a source of another."""
    rng = np.random.default_rng(seed)
    items, taken = [], [set() for _ in range(n)]
    for _ in range(7):
        a, b = (int(x) for x in rng.integers(0, n, 2))
        pairs = int(rng.integers(1, 5))
        src = rng.choice(np.arange(0, 16), pairs, replace=False)  # sources: blocks 0..15
        free = [x for x in range(16, 32) if x not in taken[b]]    # destinations: 16..31
        dst = rng.choice(free, pairs, replace=False)
        taken[b].update(int(x) for x in dst)
        h = int(rng.integers(1, 4))
        items.append((a, b, src, dst, int(rng.integers(0, 4 - h + 1)), int(rng.integers(0, 4 - h + 1)), h))
    return items


@needs_nccl
@pytest.mark.parametrize("layout", ["header", "page", "raw"])
@pytest.mark.parametrize("size", [2, 4])
def test_kv_move_between_gpus_has_the_host_backends_bytes(layout, size):
    """A move among caches on `size` GPUs over a migration communicator (items in both
    directions, within one GPU, and ranks with nothing to send) writes what the host's memmove
    writes on CPU caches holding the same bytes, to the bit, every layer of every cache."""
    comm = make_comm(size, "nccl", list(range(size)), "migration")
    gpu = [_cache("cuda", d, layout) for d in range(size)]
    cpu = [_cache("cpu", 0, layout) for _ in range(size)]
    _fill([gpu, cpu], seed=size)
    items = _items(size, seed=7 * size)
    stats = {}
    for name, caches, c in (("gpu", gpu, comm), ("cpu", cpu, None)):
        move = gyges.KVMove(range(1, 3), comm=c)
        for a, b, src, dst, sh, dh, h in items:
            move.add(caches[a], caches[b], src, dst, src_head=sh, dst_head=dh, n_heads=h)
        stats[name] = move.run()
    assert stats["gpu"]["backend"] == "comm" and stats["cpu"]["backend"] == "host"
    assert stats["gpu"]["bytes"] == stats["cpu"]["bytes"] and stats["gpu"]["staging_bytes"] > 0
    cross = sum(len(src) * h for a, b, src, _, _, _, h in items if a != b)
    assert stats["gpu"]["comm_bytes"] == cross * 2 * 16 * 32 * 4 * 2  # K and V, 2 layers
    for g, c in zip(gpu, cpu):
        for layer in range(3):
            assert (g.arena.read(g.layer_offset(layer), g.n_blocks * g.block_bytes).tobytes()
                    == c.arena.read(c.layer_offset(layer), c.n_blocks * c.block_bytes).tobytes())
    assert comm.stats()["calls"] == 2  # one all-to-all a layer


@needs_nccl
def test_a_patch_between_gpus_moves_the_blocks_holding_dirty_slots_whole():
    """A move with a dirty bitmap across two GPUs (PipeLive's live patches, KunServe's restore
    patching) copies every block pair whose source block holds a dirty slot, whole, over the
    communicator, as the device backend does on one GPU; clean blocks are not touched; its
    stats count the dirty slots."""
    comm = make_comm(2, "nccl", [0, 1], "migration")
    a, b = _cache("cuda", 0), _cache("cuda", 1)
    _fill([[a, b]], seed=4)
    bb = a.block_bytes
    block = lambda kv, l, i: kv.arena.read(kv.layer_offset(l) + i * bb, bb).tobytes()  # [bb]
    before = [[block(b, l, i) for i in range(8)] for l in range(3)]
    words = np.zeros(2, np.uint64)      # 128 slots: blocks 0..7 of 16 tokens
    words[0] = np.uint64(1 << 21) | np.uint64(1 << 50)   # a slot of block 1 and one of block 3
    stats = gyges.KVMove(range(1, 3), comm=comm, dirty=words, dirty_slots=128).add(
        a, b, [0, 1, 2, 3], [4, 5, 6, 7]).run()
    assert stats["backend"] == "comm" and stats["slots"] == 2
    for l in range(3):
        for s, d in zip(range(4), range(4, 8)):
            moved = l > 0 and s in (1, 3)
            assert block(b, l, d) == (block(a, l, s) if moved else before[l][d]), (l, s)
        assert [block(b, l, i) for i in range(4)] == before[l][:4]


@needs_nccl
def test_kv_moves_between_gpus_refuse_what_they_cannot_do_and_copy_nothing():
    comm = make_comm(2, "nccl", [0, 1], "migration")
    a, b, c, h = _cache("cuda", 0), _cache("cuda", 1), _cache("cuda", 2), _cache("cpu")
    _fill([[a, b, c, h]], seed=1)
    before = [kv.arena.read(kv.layer_offset(0), kv.block_bytes * kv.n_blocks).tobytes()
              for kv in (a, b, c, h)]
    for move, error, match in (
        (gyges.KVMove(range(3)).add(a, b, [0], [1]), gyges.InvalidArgumentError,
         "this move was given none"),
        (gyges.KVMove(range(3), comm=comm).add(a, c, [0], [1]), gyges.InvalidArgumentError,
         "no rank's device"),
        (gyges.KVMove(range(3), comm=comm).add(a, h, [0], [1]), gyges.UnavailableError,
         "host memory is not a rank"),
    ):
        with pytest.raises(error, match=match):
            move.run()
    with pytest.raises(gyges.ArgumentTypeError, match="communicator"):
        gyges.KVMove(range(3), comm="nccl")
    assert [kv.arena.read(kv.layer_offset(0), kv.block_bytes * kv.n_blocks).tobytes()
            for kv in (a, b, c, h)] == before


@needs_nccl
@pytest.mark.parametrize("site", ["copy", "comm", "alloc"])
def test_a_failed_move_between_gpus_fails_every_rank_and_the_communicator_recovers(site):
    """The n-th event of a move across 4 GPUs fails, for every n: the move raises (no rank
    waits forever for one that failed), sources are untouched, the communicator is usable
    again, and the same move then runs whole."""
    comm = make_comm(4, "nccl", list(range(4)), "migration")
    gpu = [_cache("cuda", d) for d in range(4)]
    cpu = [_cache("cpu") for _ in range(4)]
    _fill([gpu, cpu], seed=3)
    items = _items(4, seed=5)

    def move(caches, c):
        m = gyges.KVMove(range(3), comm=c)
        for a, b, src, dst, sh, dh, h in items:
            m.add(caches[a], caches[b], src, dst, src_head=sh, dst_head=dh, n_heads=h)
        return m

    sources = [[kv.arena.read(kv.layer_offset(l), 16 * kv.block_bytes).tobytes()
                for l in range(3)] for kv in gpu]
    events, _ = testing.count(site, lambda: move(gpu, comm).run())
    assert events >= 1
    for n in range(1, events + 1):
        with testing.inject(site, n) as fired:
            with pytest.raises(gyges.Error):
                move(gpu, comm).run()
            assert fired() == 1
        assert [[kv.arena.read(kv.layer_offset(l), 16 * kv.block_bytes).tobytes()
                 for l in range(3)] for kv in gpu] == sources
    move(gpu, comm).run()
    move(cpu, None).run()
    for g, c in zip(gpu, cpu):
        for layer in range(3):
            assert (g.arena.read(g.layer_offset(layer), g.n_blocks * g.block_bytes).tobytes()
                    == c.arena.read(c.layer_offset(layer), c.n_blocks * c.block_bytes).tobytes())


def _overlapping_items(caches, shadows):
    """A staggered merge's pattern on n caches: each shadow (blocks of 2 of the 4 heads over its
    owner's pages: shadow block 2b + j is heads [2j, 2j + 2) of block b) receives, over sources
    other items still read, heads from the next GPU's cache (A, B) and from its own (C); D is
    a rank's own heads staying where they are (in place)."""
    n = len(caches)
    items = []
    for d in range(n):
        to = shadows[(d + 1) % n]
        items += [
            gyges.KVMove.item(caches[d], to, list(range(4)), [2 * b + 1 for b in range(4)],
                              n_heads=2),                                        # A
            gyges.KVMove.item(caches[d], to, list(range(4)), [2 * b for b in range(4, 8)],
                              src_head=2, n_heads=2),                            # B
            gyges.KVMove.item(caches[d], shadows[d], list(range(4, 8)),
                              [2 * b for b in range(4)], src_head=2, n_heads=2),  # C: over A's
            gyges.KVMove.item(caches[d], shadows[d], list(range(4, 8)),
                              [2 * b + 1 for b in range(4, 8)], src_head=2, n_heads=2)]  # D
    return items


@needs_nccl
def test_an_overlapping_move_between_gpus_reads_and_exchanges_everything_before_writing():
    """OVERLAP between GPUs (a staggered layer's move into shadows of the same pages): every
    layer of every cache ends as the host backend's read-first move leaves CPU caches of the
    same bytes, to the bit, with the same bytes in place (neither read nor written); a plain
    move of the same items gives another result, so the order matters. Each allocation,
    exchange and copy event of a two-layer move fails in turn: the move raises and no cache
    changed (nothing is written until every rank has read and exchanged every layer), and the
    communicator works again."""
    comm = make_comm(4, "nccl", list(range(4)), "migration")

    def caches(backend):
        kvs = [_cache(backend, d if backend == "cuda" else 0) for d in range(4)]
        _fill([kvs], seed=4)
        return kvs, _overlapping_items(kvs, [kv.shadow(2) for kv in kvs])

    def contents(kvs):
        return [[kv.arena.read(kv.layer_offset(l), 16 * kv.block_bytes).tobytes()
                 for l in range(3)] for kv in kvs]

    def run(backend, overlap=True):
        kvs, items = caches(backend)
        stats = gyges.KVMove(range(1, 3), items, overlap=overlap,
                             comm=comm if backend == "cuda" else None).run()
        return contents(kvs), stats

    want, host = run("cpu")
    got, stats = run("cuda")
    assert stats["backend"] == "comm" and host["backend"] == "host"
    assert got == want
    assert stats["bytes_in_place"] == host["bytes_in_place"] > 0
    assert stats["bytes"] == host["bytes"] and stats["comm_bytes"] > 0
    assert run("cuda", overlap=False)[0] != want
    for site in ("alloc", "comm", "copy"):
        kvs, items = caches("cuda")
        events, _ = testing.count(
            site, gyges.KVMove(range(1, 3), items, overlap=True, comm=comm).run)
        assert events >= 1
        for n in range(1, events + 1):
            kvs, items = caches("cuda")
            before = contents(kvs)
            with testing.inject(site, n) as fired, pytest.raises(gyges.Error):
                gyges.KVMove(range(1, 3), items, overlap=True, comm=comm).run()
            assert fired() == 1 and contents(kvs) == before, (site, n)
    got, _ = run("cuda")
    assert got == want


# ---- hosts of workers on four GPUs ----

@needs_nccl
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_round_trip_on_four_gpus_keeps_every_token_and_kv_byte(tiny, params):
    """4xTP1 -> TP4 -> 4xTP1 on four GPUs over NCCL with requests in flight (some mid-prefill):
    every request's tokens are those of the same host that never transformed, every head of
    every token is where the new geometry says (bit for bit), and the workers hold the pages of
    a fresh host at the end. The KV crossed GPUs (bytes_sent) through staging only (no page was
    mapped past the planned ones)."""
    ps = prompts(8, seed=11)
    fresh = nccl_host(tiny)
    start = accounting(fresh)
    want = [r.output_tokens for r in fresh.generate(ps, params)]
    fresh.close()
    host = nccl_host(tiny)
    assert host.comm_backend == "nccl" and host.devices == [0, 1, 2, 3]
    requests = [host.submit(p, params) for p in ps]
    for _ in range(3):
        host.step()
    before = kv_by_request(host)
    up = host.transform(workers=(0, 1, 2, 3), tp=4)
    assert host.layout() == "TP4" and up.stats["requests_moved"] == len(ps)
    assert_kv_unchanged(before, kv_by_request(host))
    check_placement(host)
    assert sum(up.stats["bytes_sent"].values()) == up.stats["kv_bytes_moved"] > 0
    before = kv_by_request(host)
    down = host.transform(workers=(0, 1, 2, 3), tp=1)
    assert host.layout() == "4xTP1"
    assert_kv_unchanged(before, kv_by_request(host))
    check_placement(host)
    assert sum(down.stats["weight_bytes_copied"].values()) > 0  # from the host copy
    host.run()
    assert [r.output_tokens for r in requests] == want
    assert accounting(host) == start
    assert all(host.worker(w).kv.stats()["pages_per_layer"] == 0 for w in range(4))


@needs_nccl
def test_serving_at_tp4_between_gpus_keeps_the_greedy_tokens(tiny):
    """A merge, three steps served at TP4 over NCCL, a split: the greedy tokens of the host that
    never transformed, but where NCCL's order of sums (not the TP1 worker's tree) flips a near
    tie of the CPU logits (test_cuda_host's policy: at most one request)."""

    ps = prompts(6, seed=2)
    ref = nccl_host(tiny)
    want = [r.output_tokens for r in ref.generate(ps, GREEDY)]
    ref.close()
    host = nccl_host(tiny)
    reqs = [host.submit(p, GREEDY) for p in ps]
    host.step()
    host.step()
    host.transform(workers=(0, 1, 2, 3), tp=4)
    for _ in range(3):
        host.step()
    host.transform(workers=(0, 1, 2, 3), tp=1)
    host.run()
    assert assert_same_greedy_tokens(tiny, ps, [r.output_tokens for r in reqs], want) <= 1


def used_kv(host):
    """(worker, request id) -> its sequence's block table and, every layer, the K and V bytes
    of its tokens (the slots a step reads)."""
    out = {}
    for inst in host.instances:
        for rid in inst.request_ids():
            for w, seq in zip(inst.workers, inst.export(rid)["seqs"]):
                if seq < 0:
                    continue
                kv = host.worker(w).kv
                out[(w, rid)] = (kv.block_table(seq).tolist(),
                                 [b"".join(x.tobytes() for x in kv.gather(seq, layer))
                                  for layer in range(kv.n_layers)])
    return out


@needs_nccl
def test_moved_kv_has_the_cpu_hosts_layout_to_the_bit(tiny):
    """The same requests on a CPU host and on four GPUs, the CPU host's KV storage made the
    GPUs' byte for byte: after the merge (the all-to-all over NCCL against the CPU's memmoves)
    every mapped byte of every worker's KV equals the CPU host's; after the split, every
    request's block tables and the bytes of its tokens do (the split writes into pages mapped
    anew, whose slots past the tokens hold what those pages held before)."""
    ps = prompts(8, seed=5)
    hosts = {b: nccl_host(tiny, backend=b) for b in ("cpu", "cuda")}
    for h in hosts.values():
        for p in ps:
            h.submit(p, GREEDY)
        for _ in range(3):
            h.step()
    cpu, gpu = hosts["cpu"], hosts["cuda"]
    assert accounting(cpu) == accounting(gpu)
    for w, layers in enumerate(raw_kv(gpu)):
        kv = cpu.worker(w).kv
        for layer, data in enumerate(layers):
            kv.arena.write(kv.layer_offset(layer), data)
    for h in hosts.values():
        h.transform(workers=(0, 1, 2, 3), tp=4)
    assert accounting(cpu) == accounting(gpu)
    for a, b in zip(raw_kv(cpu), raw_kv(gpu)):
        assert [x.tobytes() for x in a] == [y.tobytes() for y in b]
    for h in hosts.values():
        h.transform(workers=(0, 1, 2, 3), tp=1)
    assert accounting(cpu) == accounting(gpu)
    want, got = used_kv(cpu), used_kv(gpu)
    assert len(want) == len(ps) and want == got


def _transform(host, target, kw):
    """host.transform(...) driven to its end between the same two steps: a layer-staggered one
    advanced (Host.step's first half) until done, without a step. Returns the handle."""
    t = host.transform(workers=(0, 1, 2, 3), tp=target, **kw)
    while not t.done:
        t.advance()
    return t


def _sweep(tiny, site, start, target, most, **kw):
    """The n-th `site` event of a transformation on four GPUs fails (every n, or `most`
    spread): refused or rolled back leaves the host as it was; nothing is lost, every token is
    the untouched host's, and no page is left behind. `kw`: more transform arguments (a
    staggered one is advanced to its end before the next step; a failed advance is retried or
    rolled back on the handle, counted as rolled_back when it was, retried when it was tried
    again)."""
    from gyges.reconfig import ReconfigurationWarning
    import warnings

    ps = prompts(8, seed=9, hi=40)
    params = [GREEDY if i % 2 else SEEDED for i in range(8)]
    ref = nccl_host(tiny, layout=start)
    fresh = accounting(ref)
    reqs = [ref.submit(p, q) for p, q in zip(ps, params)]
    ref.run()
    want = [r.output_tokens for r in reqs]
    ref.close()

    def setup():
        host = nccl_host(tiny, layout=start)
        reqs = [host.submit(p, q) for p, q in zip(ps, params)]
        host.step()
        host.step()
        return host, reqs

    host, _ = setup()
    events, _ = testing.count(site, lambda: _transform(host, target, kw))
    host.close()
    out = dict(events=events, refused=0, rolled_back=0, retried=0, done=0, changed=0, lost=0,
               mismatches=0, leaked=0)
    for n in testing.spread(events, most):
        host, reqs = setup()
        layout, before = host.layout(), testing.snapshot(host, physical=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ReconfigurationWarning)
            with testing.inject(site, n):
                try:
                    t = _transform(host, target, kw)
                    if not t.committed:
                        out["rolled_back"] += 1
                        out["changed"] += (host.layout() != layout
                                           or testing.snapshot(host, physical=False) != before)
                    else:
                        out["done"] += 1
                        out["retried"] += t.stats.get("retries", 0) > 0
                except gyges.Error as e:
                    r = getattr(e, "reconfiguration", None)
                    out["refused" if r is None else "rolled_back"] += 1
                    out["changed"] += (host.layout() != layout
                                       or testing.snapshot(host, physical=False) != before)
        host.run()
        out["lost"] += sum(r.finish_reason != "length" for r in reqs)
        out["mismatches"] += sum(r.output_tokens != w for r, w in zip(reqs, want))
        if host.layout() == start:
            out["leaked"] += accounting(host) != fresh
        host.close()
    return out


SWEEP_MOST = testing.sweep_most(2)


@needs_nccl
@pytest.mark.parametrize("kind, site", [
    # (a merge maps no page here: what it receives fits in the blocks it frees)
    *(("merge", s) for s in ("copy", "comm", "alloc")),
    *(("split", s) for s in ("copy", "comm", "alloc", "page_create", "page_map"))])
def test_fault_sweep_of_transformations_between_gpus(tiny, kind, site):
    """The n-th event of a site fails, n spread over SWEEP_MOST of them (every one with
    GYGES_SWEEP_MOST=0: minutes on the emulator): refused or rolled back as on the CPU,
    0 lost, 0 changed, 0 mismatched, 0 leaked."""
    start, target = ("4xTP1", 4) if kind == "merge" else ("1xTP4", 1)
    out = _sweep(tiny, site, start, target, SWEEP_MOST)
    assert out["events"] > 0, out
    assert out["refused"] + out["rolled_back"] > 0, out
    assert out["changed"] == out["lost"] == out["mismatches"] == out["leaked"] == 0, out


# ---- the order of the two communicators ----

_OPPOSITE_ORDERS = r"""
import os, sys, threading
from gyges.runtime.comm import CommPool
sys.path.insert(0, os.getcwd())
from test_comm_cuda import RankMemory
pool = CommPool([(0, 2)], backend="nccl", devices=[0, 1])
compute, migration = pool.comm(0, 2), pool.migration(0, 2)
cm, mm = RankMemory(compute, 1 << 16), RankMemory(migration, 1 << 16)
bufs = [cm.alloc(r, 4096) for r in range(2)]
send = [mm.alloc(r, 64) for r in range(2)]
recv = [[mm.alloc(r, 64) for _ in range(2)] for r in range(2)]
opposite = sys.argv[1] == "opposite"

def reduce(r):
    compute.all_reduce(r, bufs[r], 1024)

def migrate(r):
    migration.all_to_all(r, recv[r], [64, 64], [send[r]] * 2, [64, 64])

def rank(r):
    # gyges' order: a step's compute collectives, then (between steps) the migration's
    order = (migrate, reduce) if opposite and r == 0 else (reduce, migrate)
    for f in order:
        f(r)
    compute.synchronize(r)
    migration.synchronize(r)

threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(2)]
for t in threads:
    t.start()
for t in threads:
    t.join(10)
print("hung" if any(t.is_alive() for t in threads) else "done", flush=True)
os._exit(0)
"""


@needs_nccl
def test_the_migration_and_compute_communicators_cannot_deadlock_in_gyges_order():
    """NCCL serializes each GPU's operations, so two ranks posting a compute all-reduce and a
    migration all-to-all in opposite orders wait for each other forever (the pretend NCCL
    too: shown in a process of its own). gyges' order, every rank alike: a step's compute
    collectives complete (sampling reads the logits) before the host thread issues any
    migration collective between two steps, and a move waits for its streams before the next
    step: that completes."""
    def run(order):
        return subprocess.run([sys.executable, "-c", _OPPOSITE_ORDERS, order], cwd=os.path.dirname(__file__),
                              capture_output=True, text=True, timeout=120).stdout.strip()
    assert run("gyges") == "done"
    assert run("opposite") == "hung"


@needs_nccl
def test_host_migrations_run_only_between_steps(tiny, monkeypatch):
    """The order in a host: every KV move of a transformation on four GPUs runs on the thread
    that holds the host's lock (no step runs), after every compute collective it issued has
    finished (the compute communicators' streams are idle), and none of them runs a
    collective meanwhile."""
    import gyges.reconfig.kv_move as kv_move_module

    host = nccl_host(tiny)
    for p in prompts(6, seed=4):
        host.submit(p, GREEDY)
    host.step()
    host.step()
    compute = [host.comms.comm(first, size) for first, size in host.comms.groups()]
    seen = []
    real = kv_move_module.KVMove

    class Watched(real):
        def run(self, stage=None):
            calls = [c.stats()["calls"] for c in compute]
            locked = host._lock._owner == threading.get_ident()  # a peek: no step can run
            stats = super().run(stage)
            seen.append((stats["backend"], locked, calls == [c.stats()["calls"] for c in compute]))
            return stats

    monkeypatch.setattr(kv_move_module, "KVMove", Watched)
    host.transform(workers=(0, 1, 2, 3), tp=4)
    host.step()
    host.transform(workers=(0, 1, 2, 3), tp=1)
    assert any(b == "comm" for b, _, _ in seen)
    assert all(locked and quiet for _, locked, quiet in seen), seen
    host.run()


# ---- peak extra memory of a merge (Gyges 4.1.2: 91.6% below the basic solution's) ----

def merge_peak(model, backend="cuda", method="gyges", occupancy=0.88, phase_chunks=4,
               page_pages=1, block_size=64):
    """A 4xTP1 -> TP4 merge whose workers' KV is `occupancy` full (blocks in use over the
    blocks their budget leaves after the weights: `page_pages` pages a layer, blocks of
    `block_size` tokens, one block a request, every request in flight). Returns the KV bytes
    in use, the KV occupancy reached, and the merge's peak extra bytes over the four workers
    (pages mapped past what the weights left, plus the comm backend's staging), summed and
    per worker. backend="cuda": four GPUs over NCCL; "cpu": CPU workers (method="basic" runs
    there: it builds KV through host copies)."""
    probe = gyges.Host(model, workers=1, memory_per_worker="1GiB", page_size=PAGE,
                       block_size=block_size)
    worker = probe.worker(0)
    weights = worker.arena.stats()["bytes_in_use"]
    layer_blocks = worker.page_size // worker.kv.block_bytes  # (block_bytes: one layer's)
    probe.close()
    L = model.config.num_hidden_layers
    memory = weights + page_pages * L * worker.page_size
    capacity = page_pages * layer_blocks                    # blocks a worker's KV can hold
    per_worker = -int(-occupancy * capacity // 1)               # at least `occupancy`
    kw = dict(comm="nccl") if backend == "cuda" else {}
    host = gyges.Host(model, workers=4, memory_per_worker=memory, page_size=PAGE,
                      layout="4xTP1", block_size=block_size, max_batch_tokens=4096,
                      max_running=4 * per_worker, backend=backend, **kw)
    rng = np.random.default_rng(0)
    params = gyges.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    requests = [host.submit(rng.integers(0, 4096, size=8).tolist(), params, instance=i % 4)
                for i in range(4 * per_worker)]
    for _ in range(8):  # every prompt prefilled (one block each), all in flight
        host.step()
        if all(len(r.output_tokens) for r in requests):
            break
    used = [host.worker(w).kv.stats() for w in range(4)]
    kv_bytes = sum((s["n_blocks"] - s["free_blocks"]) * host.worker(w).kv.block_bytes * L
                   for w, s in enumerate(used))
    reached = min((s["n_blocks"] - s["free_blocks"]) / capacity for s in used)
    t = host.transform(workers=(0, 1, 2, 3), tp=4, method=method, phase_chunks=phase_chunks)
    peaks = dict(t.stats["peak_extra_bytes"])
    staging = dict(t.staging_peak) if hasattr(t, "staging_peak") else {}
    host.run()
    host.close()
    return dict(backend=backend, method=method, occupancy=reached, kv_bytes=kv_bytes,
                peak_extra=sum(peaks.values()), per_worker=peaks,
                staging=max(staging.values(), default=0), phase_chunks=phase_chunks)


@needs_nccl
def test_a_merge_between_gpus_needs_a_tenth_of_basics_extra_memory(tiny):
    """At 88% KV occupancy, the peak extra memory of a merge on four GPUs (the all-to-all's
    staging of one layer of one round, and any page mapped past the planned ones) is at most
    0.1x the basic solution's (a whole new KV before the old goes: about the KV in use),
    measured in bytes; benchmarks/bench_xgpu_merge.py prints the table."""
    ours = merge_peak(tiny, "cuda", "gyges")
    basic = merge_peak(tiny, "cpu", "basic")
    assert ours["occupancy"] >= 0.88 and basic["occupancy"] == ours["occupancy"]
    assert basic["peak_extra"] >= 0.9 * basic["kv_bytes"], basic
    assert 0 < ours["peak_extra"] <= 0.1 * basic["peak_extra"], (ours, basic)


# ---- layer-staggered and the baselines' methods between GPUs ----

def d2d_host(tiny, **kw):
    """nccl_host's twin of virtual workers on one GPU (comm="d2d"): the device backend of KV
    moves instead of the migration communicator."""
    return gyges.Host(tiny, workers=4, memory_per_worker=MEMORY, page_size=PAGE, layout="4xTP1",
                      max_prefill_chunk=16, max_batch_tokens=64, backend="cuda", comm="d2d", **kw)


def moved_bytes(stats):
    return {k: stats[k] for k in ("bytes_sent", "bytes_received", "bytes_in_place",
                                  "kv_bytes_moved", "requests_moved")}


def staggered_round_trip(host, ps, params, **kw):
    """4xTP1 -> TP4 -> 4xTP1 of `host` between the same two steps (three steps in), each change
    advanced layer by layer to its end; every request's KV unchanged and placed as the new
    geometry says after each. Returns (requests, merge handle, split handle, the raw KV after
    the merge, used_kv after the split)."""
    reqs = [host.submit(p, q) for p, q in zip(ps, params)]
    for _ in range(3):
        host.step()
    L = host.model.config.num_hidden_layers
    before = kv_by_request(host)
    up = host.transform(workers=(0, 1, 2, 3), tp=4, **kw)
    assert not up.done and up.boundary == L
    while not up.done:
        up.advance()
    assert host.layout() == "TP4" and up.committed, up
    check_placement(host)
    assert_kv_unchanged(before, kv_by_request(host))
    merged = raw_kv(host)
    before = kv_by_request(host)
    down = _transform(host, 1, kw)
    assert host.layout() == "4xTP1" and down.committed, down
    check_placement(host)
    assert_kv_unchanged(before, kv_by_request(host))
    return reqs, up, down, merged, used_kv(host)


@needs_nccl
@pytest.mark.parametrize("layers_per_step, overlap", [(1, False), (2, True)])
def test_a_staggered_round_trip_between_gpus_keeps_every_token_and_kv_byte(tiny, layers_per_step,
                                                                           overlap):
    """Layer-staggered 4xTP1 -> TP4 -> 4xTP1 on four GPUs over NCCL, requests in flight (greedy
    and seeded, some mid-prefill): each layer's KV is one overlapping move over the migration
    communicator (the new caches are shadows over the old pages: every rank reads and exchanges
    before any writes). Tokens are the same host's that never transformed; the KV after the
    merge is a d2d host's byte for byte (every mapped byte of every worker), and after the split
    every request's blocks and tokens are; the two move the same bytes between the same workers
    and leave the same in place; the pages end as a fresh host's."""
    ps = prompts(8, seed=11)
    params = [GREEDY if i % 2 else SEEDED for i in range(8)]
    fresh = nccl_host(tiny)
    start = accounting(fresh)
    reqs = [fresh.submit(p, q) for p, q in zip(ps, params)]
    fresh.run()
    want = [r.output_tokens for r in reqs]
    fresh.close()
    kw = dict(layers_per_step=layers_per_step, overlap=overlap)
    with d2d_host(tiny) as host:
        _, d2d_up, d2d_down, d2d_merged, d2d_used = staggered_round_trip(host, ps, params, **kw)
    host = nccl_host(tiny)
    reqs, up, down, merged, used = staggered_round_trip(host, ps, params, **kw)
    assert up.stats["bytes_in_place"] > 0  # a merged rank's own heads stay put (header layout)
    # each rank staged its layer (one layer of its heads out and in, whole blocks)
    assert 0 < up.stats["stage_bytes"] and 0 < down.stats["stage_bytes"]
    assert sum(up.stats["bytes_sent"].values()) > 0 and sum(down.stats["bytes_sent"].values()) > 0
    assert moved_bytes(up.stats) == moved_bytes(d2d_up.stats)
    assert moved_bytes(down.stats) == moved_bytes(d2d_down.stats)
    for a, b in zip(merged, d2d_merged):
        assert [x.tobytes() for x in a] == [y.tobytes() for y in b]
    assert used == d2d_used
    host.run()
    assert [r.output_tokens for r in reqs] == want
    assert accounting(host) == start
    assert all(host.worker(w).kv.stats()["pages_per_layer"] == 0 for w in range(4))
    host.close()


@needs_nccl
@pytest.mark.parametrize("method, kv_layout", [("basic", "header"), ("partial_swap", "page")])
def test_basic_and_partial_swap_merges_between_gpus_keep_every_token(tiny, method, kv_layout):
    """Basic's migration (new caches in fresh pages, every request's heads moved into them in
    one KV move of every layer) over the migration communicator: basic itself, and
    partial_swap with the page layout (its KV moves as basic's). Requests in flight; every
    request's KV unchanged, placed as TP4 says, its blocks and token bytes a d2d host's, the
    same bytes moved between the same workers; padded (basic), the group splits back at once
    between the same two steps, to a fresh host's pages. Tokens are the same host's that never
    transformed (unpadded, served on at TP4: this workload has no near tie NCCL's order of sums
    flips, as in the merges' fault sweep)."""
    ps = prompts(8, seed=9, hi=40)
    params = [GREEDY if i % 2 else SEEDED for i in range(8)]
    extra = dict(kv_layout=kv_layout, pad_ffn=method == "basic")
    ref = nccl_host(tiny, **extra)
    fresh = accounting(ref)
    reqs = [ref.submit(p, q) for p, q in zip(ps, params)]
    ref.run()
    want = [r.output_tokens for r in reqs]
    ref.close()
    keys = ("bytes_sent", "bytes_received", "kv_bytes_moved", "kv_bytes_trimmed",
            "kv_pages_mapped", "requests_moved")
    out = {}
    for comm in ("d2d", "nccl"):
        host = d2d_host(tiny, **extra) if comm == "d2d" else nccl_host(tiny, **extra)
        reqs = [host.submit(p, q) for p, q in zip(ps, params)]
        for _ in range(3):
            host.step()
        before = kv_by_request(host)
        up = host.transform(workers=(0, 1, 2, 3), tp=4, method=method)
        assert host.layout() == "TP4" and up.committed
        assert min(up.stats["kv_pages_mapped"].values()) > 0  # new caches beside the old
        check_placement(host)
        assert_kv_unchanged(before, kv_by_request(host))
        out[comm] = (used_kv(host), {k: up.stats[k] for k in keys})
        if comm == "d2d":
            host.close()
    assert sum(out["nccl"][1]["bytes_sent"].values()) > 0
    assert out["nccl"] == out["d2d"]
    if method == "basic":
        before = kv_by_request(host)
        host.transform(workers=(0, 1, 2, 3), tp=1, method=method)
        assert host.layout() == "4xTP1"
        check_placement(host)
        assert_kv_unchanged(before, kv_by_request(host))
    host.run()
    assert [r.output_tokens for r in reqs] == want
    if method == "basic":
        assert accounting(host) == fresh
    host.close()


@needs_nccl
@pytest.mark.parametrize("site", ["copy", "comm", "alloc"])
def test_fault_sweep_of_a_staggered_merge_between_gpus(tiny, site):
    """The n-th event of a site (SWEEP_MOST of them, spread) fails during a layer-staggered
    merge on four GPUs (overlapping moves over the migration communicator, two layers a step):
    the failed advance changed nothing (every rank reads and exchanges before any writes), so
    it is tried again or rolled back; 0 lost, 0 changed, 0 mismatched, 0 leaked."""
    most = None if SWEEP_MOST == 0 else SWEEP_MOST
    out = _sweep(tiny, site, "4xTP1", 4, most, layers_per_step=2)
    assert out["events"] > 0, out
    assert out["retried"] + out["refused"] + out["rolled_back"] > 0, out
    assert out["changed"] == out["lost"] == out["mismatches"] == out["leaked"] == 0, out


@needs_nccl
def test_serving_through_a_staggered_merge_between_gpus_keeps_the_greedy_tokens(tiny):
    """A layer-staggered merge driven by the steps themselves: while it runs, each step computes
    the layers below the boundary in the old TP1 instances and those above it in the merged
    group over NCCL, then the group splits back (staggered too, overlapping); requests arrive
    meanwhile. Nothing is lost, the KV of the requests both sides hold is unchanged, and the
    greedy tokens are the untransformed host's but where NCCL's order of sums flips a near tie
    (test_cuda_host's policy: at most one request; none on the emulator)."""

    ps = prompts(8, seed=2)
    ref = nccl_host(tiny)
    want = [r.output_tokens for r in ref.generate(ps, GREEDY)]
    ref.close()
    host = nccl_host(tiny)
    reqs = [host.submit(p, GREEDY) for p in ps[:4]]
    host.step()
    host.step()
    up = host.transform(workers=(0, 1, 2, 3), tp=4, layers_per_step=1)
    reqs += [host.submit(p, GREEDY) for p in ps[4:]]
    steps = 0
    while not up.done:
        host.step()
        steps += 1
    assert up.committed and host.layout() == "TP4" and steps >= tiny.config.num_hidden_layers
    before = kv_by_request(host)
    down = host.transform(workers=(0, 1, 2, 3), tp=1, layers_per_step=2, overlap=True)
    while not down.done:
        host.step()
    assert down.committed and host.layout() == "4xTP1"
    check_placement(host)
    after = kv_by_request(host)
    both = set(before) & set(after)
    assert both
    assert_kv_unchanged({r: before[r] for r in both}, {r: after[r] for r in both})
    host.run()
    assert all(r.finish_reason == "length" for r in reqs)
    assert assert_same_greedy_tokens(tiny, ps, [r.output_tokens for r in reqs], want) <= 1
    host.close()
