"""Layer-staggered and overlapped transformations, and the baselines' methods (basic,
partial_swap), on CUDA workers: four virtual workers sharing one GPU (comm="d2d"), every KV byte
moved by the device backend of the one KV move (csrc/kernels/kv_move_device.c), the boundary's
hidden states handed over by device copies (forward_cuda.c's x_in / x_out).

Each test compares a CUDA host that transformed with the same CUDA host that did not: the
tokens are equal, greedy and seeded (both sum in the same order: no tolerance), the KV of every
request is bit-exact across each transformation, and the pages come back to a fresh host's. The
fault sweeps fail each allocation, page creation, page map and copy event in turn, as
gyges.testing.sweep_transformation does on CPU hosts: refused or rolled back with the host as
before, or done; never rebuilt; no request lost, no token changed, no page left behind.

Run on a GPU, or on the emulated device (tests/gpu_emu/run.py ext, by hand until run.py lists
this file); skipped without either."""
import warnings

import numpy as np
import pytest
from test_cuda_host import EMULATED, GPU_SKIP_REASON, MEMORY, PAGE, needs_gpu, prompts
from test_transform import assert_kv_unchanged, check_placement, kv_by_request

import gyges
from gyges import testing
from gyges.core.errors import Error
from gyges.reconfig import RecoveryWarning, ReconfigurationWarning, TransformError

pytestmark = [pytest.mark.filterwarnings("error::gyges.reconfig.recovery.RecoveryWarning"),
              pytest.mark.skipif(GPU_SKIP_REASON is not None,
                                 reason=f"needs a GPU: {GPU_SKIP_REASON}")]

GREEDY = gyges.SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
SEEDED = gyges.SamplingParams(max_tokens=10, temperature=0.9, top_k=40, seed=3, ignore_eos=True)
N_PROMPTS = 6


@pytest.fixture(scope="module")
def tiny():
    return gyges.Model.tiny()


def cuda_host(tiny, layout="4xTP1", **kw):
    # Virtual workers of one GPU (on an emulated machine of four, the default would be one GPU
    # each, over NCCL). A small prefill chunk, so that layers move in the middle of prefills too.
    kw.setdefault("devices", 0)
    return gyges.Host(tiny, workers=4, memory_per_worker=MEMORY, page_size=PAGE, layout=layout,
                      max_prefill_chunk=16, max_batch_tokens=64, backend="cuda", **kw)


def workload(seed=11):
    """Half the requests greedy, half seeded; the first four arrive before the transformation,
    the rest while it runs."""
    ps = prompts(N_PROMPTS, seed=seed, lo=10, hi=50)
    return [(p, GREEDY if i % 2 == 0 else SEEDED) for i, p in enumerate(ps)]


@pytest.fixture(scope="module")
def untransformed(tiny):
    """The tokens of the same CUDA host that never transformed, per (kv_layout, pad_ffn), and
    each worker's bytes when fresh, per (layout, kv_layout, pad_ffn)."""
    tokens, fresh = {}, {}

    def get(kv_layout="header", pad=True):
        if (kv_layout, pad) not in tokens:
            with cuda_host(tiny, kv_layout=kv_layout, pad_ffn=pad) as host:
                reqs = [host.submit(p, q) for p, q in workload()]
                host.run()
                tokens[(kv_layout, pad)] = [r.output_tokens for r in reqs]
        return tokens[(kv_layout, pad)]

    def fresh_bytes(layout, kv_layout="header", pad=True):
        key = (layout, kv_layout, pad)
        if key not in fresh:
            with cuda_host(tiny, layout=layout, kv_layout=kv_layout, pad_ffn=pad) as host:
                fresh[key] = [host.worker(w).arena.stats()["bytes_in_use"] for w in range(4)]
        return fresh[key]
    get.fresh_bytes = fresh_bytes
    return get


def run_to_commit(host, t, most=200):
    for _ in range(most):
        if t.done:
            return t
        host.step()
    raise AssertionError(f"{t} did not end in {most} steps")


def assert_kv_both(before, after):
    """assert_kv_unchanged over the requests both hold (a staggered move serves meanwhile:
    some finish, some start)."""
    both = set(before) & set(after)
    assert both
    assert_kv_unchanged({rid: before[rid] for rid in both}, {rid: after[rid] for rid in both})


def assert_pages_of_a_fresh_host(host, fresh):
    """No KV left and every worker's bytes those of a fresh host of its layout; every byte in
    use is a mapped physical page."""
    assert all(m["kv"] == 0 for m in host.memory())
    assert [host.worker(w).arena.stats()["bytes_in_use"] for w in range(4)] == fresh
    for w in range(4):
        arena = host.worker(w).arena
        assert len(arena.physical_pages()) * arena.page_size == arena.stats()["bytes_in_use"]


# ---- layer-staggered and overlapped: 4xTP1 -> TP4 -> 4xTP1 with requests in flight ----

@needs_gpu
@pytest.mark.parametrize("layers_per_step, overlap", [(1, False), (2, False), (2, True)])
def test_a_staggered_round_trip_on_cuda_keeps_every_token_and_kv_byte(tiny, untransformed,
                                                                     layers_per_step, overlap):
    """The old groups run the layers below the boundary, the merged group (or, splitting, the
    new groups) those above it, on the same GPU; each step moves layers_per_step layers' KV
    (an overlapping move into a shadow of the same pages: read into a device stage, then
    written) and weights. Tokens are the untransformed host's, KV is bit-exact across each
    transformation, and the pages are a fresh 4xTP1 host's at the end; a CPU host doing the
    same moves the same bytes between the same workers."""
    host = cuda_host(tiny)
    load = workload()
    reqs = [host.submit(p, q) for p, q in load[:4]]
    for _ in range(3):
        host.step()
    L = tiny.config.num_hidden_layers
    before = kv_by_request(host)
    up = host.transform(workers=(0, 1, 2, 3), tp=4, layers_per_step=layers_per_step,
                        overlap=overlap)
    assert not up.done and up.boundary == L
    reqs += [host.submit(p, q) for p, q in load[4:]]  # admitted while the layers move
    boundaries = []
    while not up.done:
        host.step()
        boundaries.append(up.boundary if not up.done else 0)
    assert host.layout() == "TP4" and up.committed
    # every layer moved in its own step (no early read on a device: no step only reads)
    assert len(boundaries) == -(-L // layers_per_step) + up.stats["steps_waiting"]
    assert up.stats["bytes_read_beside_steps"] == 0
    assert sum(up.stats["bytes_received"].values()) > 0
    # a merged rank's own heads stay where they are (header layout), as on the CPU
    assert up.stats["bytes_in_place"] > 0
    check_placement(host)
    assert_kv_both(before, kv_by_request(host))
    host.step()
    before = kv_by_request(host)
    down = host.transform(workers=(0, 1, 2, 3), tp=1, layers_per_step=layers_per_step,
                          overlap=overlap)
    run_to_commit(host, down)
    assert host.layout() == "4xTP1"
    check_placement(host)
    assert_kv_both(before, kv_by_request(host))
    assert down.stats["bytes_in_place"] == 0 and sum(down.stats["weight_bytes_copied"].values())
    host.run()
    assert [r.output_tokens for r in reqs] == untransformed()
    assert_pages_of_a_fresh_host(host, untransformed.fresh_bytes("4xTP1"))
    host.close()
    if not overlap:  # (with overlap the CPU host's first step only reads: other tokens move)
        # ignore_eos: the CPU host schedules the same tokens, so it moves the same bytes,
        # worker to worker, and leaves the same in place
        cpu_up, cpu_down = cpu_round_trip(tiny, layers_per_step)
        assert moved_bytes(up.stats) == moved_bytes(cpu_up)
        assert moved_bytes(down.stats) == moved_bytes(cpu_down)


def moved_bytes(stats):
    return {k: stats[k] for k in ("bytes_sent", "bytes_received", "bytes_in_place",
                                  "kv_bytes_moved", "requests_moved")}


def cpu_round_trip(tiny, layers_per_step):
    """The staggered merge and split of the test above on a CPU host; their stats."""
    host = gyges.Host(tiny, workers=4, memory_per_worker=MEMORY, page_size=PAGE,
                      layout="4xTP1", max_prefill_chunk=16, max_batch_tokens=64)
    load = workload()
    for p, q in load[:4]:
        host.submit(p, q)
    for _ in range(3):
        host.step()
    up = host.transform(workers=(0, 1, 2, 3), tp=4, layers_per_step=layers_per_step)
    for p, q in load[4:]:
        host.submit(p, q)
    run_to_commit(host, up)
    host.step()
    down = run_to_commit(host, host.transform(workers=(0, 1, 2, 3), tp=1,
                                              layers_per_step=layers_per_step))
    host.close()
    return up.stats, down.stats


@needs_gpu
def test_an_overlapping_device_move_reads_every_source_before_writing(tiny):
    """A shadow's blocks over its owner's pages: each destination lies over another item's
    source. Moved by the device backend (a stage on the device), the result is what the host
    backend gives on host caches of the same contents, bit for bit; without the read-first
    (a plain move) the same items give another result on the device, so the order matters.
    Each allocation (the block lists, the device stage) and copy event of the move fails in
    turn: refused, nothing written."""
    def caches(backend):
        arena = gyges.Arena(budget="8MiB", page_size=PAGE, backend=backend)
        kv = gyges.KVCache(arena, n_layers=2, n_kv_heads=4, head_dim=32, block_size=16)
        kv.grow(1)
        rng = np.random.default_rng(5)
        for layer in range(2):
            kv.arena.write(kv.layer_offset(layer), rng.standard_normal(
                kv.n_blocks * kv.block_bytes // 4).astype(np.float32))
        seqs = [kv.adopt([2 * i, 2 * i + 1], 32) for i in range(3)]
        shadow = kv.shadow(2)
        # item i reads heads [2j, 2j + 2) of sequence i's blocks (j = i % 2: consecutive items
        # differ in heads, so each is a group of its own, a launch apart). Shadow block 2b + j
        # is heads [2j, 2j + 2) of block b, so writing item i into the heads item (i + 1) % 3
        # reads of its sequence's blocks lands on a source still to be read.
        def blocks(c):
            return [4 * c + c % 2, 4 * c + 2 + c % 2]
        news = [shadow.adopt(blocks((i + 1) % 3), 32) for i in range(3)]
        items = [gyges.KVMove.item(kv, shadow, src_seq=seqs[i], dst_seq=news[i],
                                   src_head=2 * (i % 2), n_heads=2, n_tokens=32)
                 for i in range(3)]
        return kv, shadow, news, items

    def result(backend, overlap):
        kv, shadow, news, items = caches(backend)
        stats = gyges.KVMove(range(2), items, overlap=overlap).run()
        return [shadow.gather(s, layer) for s in news for layer in range(2)], stats

    for site in ("alloc", "copy"):  # every allocation and copy event of a device move
        kv, shadow, news, items = caches("cuda")
        events, _ = testing.count(site, gyges.KVMove(range(2), items, overlap=True).run)
        assert events == {"alloc": 2, "copy": 1}[site]  # the lists and the stage; the move
        for n in range(1, events + 1):
            kv, shadow, news, items = caches("cuda")
            before = [kv.gather(s, layer) for s in range(3) for layer in range(2)]
            with testing.inject(site, n), pytest.raises(Error):
                gyges.KVMove(range(2), items, overlap=True).run()
            after = [kv.gather(s, layer) for s in range(3) for layer in range(2)]
            for (k0, v0), (k1, v1) in zip(before, after):  # refused: nothing written
                np.testing.assert_array_equal(k0, k1)
                np.testing.assert_array_equal(v0, v1)
    want, _ = result("cpu", True)
    got, stats = result("cuda", True)
    assert stats["backend"] == "cuda" and stats["stage_bytes"] > 0
    for (k0, v0), (k1, v1) in zip(got, want):
        np.testing.assert_array_equal(k0, k1)
        np.testing.assert_array_equal(v0, v1)
    if EMULATED:  # (on a GPU the plain move's blocks race: any result may come out)
        plain, _ = result("cuda", False)
        assert any(not np.array_equal(a[0], b[0]) for a, b in zip(plain, want))


# ---- the baselines' methods, every KV layout ----

@needs_gpu
@pytest.mark.parametrize("kv_layout", ["raw", "page", "header"])
@pytest.mark.parametrize("method", ["basic", "partial_swap"])
def test_basic_and_partial_swap_on_cuda_keep_every_token(tiny, untransformed, kv_layout, method):
    """Basic builds the merged caches in fresh pages and copies every request's heads into them
    (one KV move of every layer: the head-copy kernel on the device); partial_swap packs the
    kept FFN shards (device copies) and moves the KV as basic does, or in place with the header
    layout. Tokens are the untransformed host's, the KV bit-exact; with padded weights the
    group splits back (at once with the header layout, its KV staged on the device; staggered
    with the page layout; the raw layout has neither) to a fresh host's pages."""
    pad = method == "basic"
    host = cuda_host(tiny, kv_layout=kv_layout, pad_ffn=pad)
    load = workload()
    reqs = [host.submit(p, q) for p, q in load[:4]]
    for _ in range(3):
        host.step()
    before = kv_by_request(host)
    up = host.transform(workers=(0, 1, 2, 3), tp=4, method=method)
    assert host.layout() == "TP4" and up.committed
    if method == "basic" or kv_layout != "header":  # new caches beside the old ones
        assert min(up.stats["kv_pages_mapped"].values()) > 0
        assert sum(up.stats["kv_bytes_trimmed"].values()) > 0
    check_placement(host)
    assert_kv_unchanged(before, kv_by_request(host))
    reqs += [host.submit(p, q) for p, q in load[4:]]
    host.step()
    split = dict(header=dict(method=method), page=dict(layers_per_step=2)).get(kv_layout)
    if kv_layout != "header" or not pad:  # an at-once split reshapes blocks in place (header
        state = testing.snapshot(host)     # only) and restores padded shards page by page
        with pytest.raises(TransformError, match="header-centric" if pad else "padded FFN"):
            host.transform(workers=(0, 1, 2, 3), tp=1, method=method)
        assert testing.snapshot(host) == state
    if pad and split:
        before = kv_by_request(host)
        run_to_commit(host, host.transform(workers=(0, 1, 2, 3), tp=1, **split))
        assert host.layout() == "4xTP1"
        assert_kv_both(before, kv_by_request(host))
    host.run()
    assert [r.output_tokens for r in reqs] == untransformed(kv_layout, pad)
    if pad and split:
        assert_pages_of_a_fresh_host(host, untransformed.fresh_bytes("4xTP1", kv_layout, pad))
    else:
        assert all(m["kv"] == 0 for m in host.memory())
        check_placement(host)
    host.close()


# ---- fault sweeps of every device path ----

SWEEPS = {  # kind -> (layout, host arguments, transform arguments, layout after)
    "merge_staggered": ("4xTP1", {}, dict(workers=(0, 1, 2, 3), tp=4, layers_per_step=2), "TP4"),
    "split_staggered_overlap": ("1xTP4", {}, dict(workers=(0, 1, 2, 3), tp=1, layers_per_step=2,
                                                    overlap=True), "4xTP1"),
    "merge_basic_page": ("4xTP1", dict(kv_layout="page"),
                                  dict(workers=(0, 1, 2, 3), tp=4, method="basic"), "TP4"),
    "merge_partial_swap_raw": ("4xTP1", dict(kv_layout="raw", pad_ffn=False),
                                        dict(workers=(0, 1, 2, 3), tp=4, method="partial_swap"),
                                        "TP4"),
}


SWEEP_LOAD = [(p, gyges.SamplingParams(max_tokens=6, ignore_eos=True) if i % 2 == 0 else
               gyges.SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=3,
                                    ignore_eos=True))
              for i, p in enumerate(prompts(4, seed=4, lo=10, hi=40))]


@pytest.fixture(scope="module")
def sweep_baseline(tiny):
    """Per kind: the tokens of its host that never transformed, and the bytes a fresh host
    holds in the start and the target layout."""
    cache = {}

    def get(kind):
        if kind not in cache:
            start, host_kw, _, target = SWEEPS[kind]
            with cuda_host(tiny, layout=start, **host_kw) as host:
                reqs = [host.submit(p, q) for p, q in SWEEP_LOAD]
                host.run()
                want = [r.output_tokens for r in reqs]
            fresh = {}  # (keyed by the layouts' names as Host.layout() gives them)
            for layout in (start, target):
                with cuda_host(tiny, layout=layout, **host_kw) as h:
                    fresh[h.layout()] = sum(h.worker(w).arena.stats()["bytes_in_use"]
                                            for w in range(4))
            cache[kind] = want, fresh
        return cache[kind]
    return get


def sweep_cuda_transformation(tiny, baseline, kind, site, most):
    """gyges.testing.sweep_transformation on a CUDA host: the n-th `site` event fails, for n
    spread over every event of the transformation (`most` of them), each on a fresh host
    serving SWEEP_LOAD; returns the same counts."""
    start, host_kw, kwargs, target = SWEEPS[kind]
    want, fresh = baseline(kind)

    def new_host():
        host = cuda_host(tiny, layout=start, **host_kw)
        reqs = [host.submit(p, q) for p, q in SWEEP_LOAD]
        host.step()
        host.step()
        return host, reqs

    host, _ = new_host()
    events, _ = testing.count(site, lambda: testing._transform_to_the_end(host, kwargs))
    host.close()
    out = dict(events=events, runs=0, refused=0, rolled_back=0, done=0, recovered=0, changed=0,
               wrong_layout=0, lost=0, mismatches=0, leaked_pages=0)
    for n in testing.spread(events, most):
        host, reqs = new_host()
        start_layout = host.layout()
        before = testing.snapshot(host, physical=False)
        t = None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RecoveryWarning)
            warnings.simplefilter("ignore", ReconfigurationWarning)
            with testing.inject(site, n):
                try:
                    t = testing._transform_to_the_end(host, kwargs)
                except Error as e:
                    t = getattr(e, "reconfiguration", None)
                    if t is None:
                        out["refused"] += 1
                    out["changed"] += testing.snapshot(host, physical=False) != before
        out["runs"] += 1
        if t is not None:
            out[{"committed": "done"}.get(t.state, t.state)] += 1
            out["wrong_layout"] += host.layout() != (
                target.replace("1xTP4", "TP4") if t.committed else start_layout)
        host.run()
        out["lost"] += sum(r.finish_reason != "length" for r in reqs)
        out["mismatches"] += sum(r.output_tokens != w for r, w in zip(reqs, want))
        held = sum(host.worker(w).arena.stats()["bytes_in_use"] for w in range(4))
        out["leaked_pages"] += held != fresh[host.layout()]
        host.close()
    return out


# The sites each kind has events of (a staggered merge maps no page: its shadows read the old
# caches' pages, and the memory is ample), page_create and page_map taken in turn (a page is
# created and then mapped, by the same calls).
SWEEP_SITES = [("merge_staggered", "alloc"), ("merge_staggered", "copy"),
               ("split_staggered_overlap", "alloc"), ("split_staggered_overlap", "page_map"),
               ("split_staggered_overlap", "copy"),
               ("merge_basic_page", "alloc"), ("merge_basic_page", "page_create"),
               ("merge_basic_page", "copy"),
               ("merge_partial_swap_raw", "alloc"), ("merge_partial_swap_raw", "page_map"),
               ("merge_partial_swap_raw", "copy")]


@needs_gpu
@pytest.mark.parametrize("kind, site", SWEEP_SITES)
def test_a_fault_anywhere_in_a_cuda_transformation_loses_nothing(tiny, sweep_baseline, kind,
                                                                 site):
    """Every device path fails at each kind of event in turn (a sample of the events: MOST):
    refused with nothing changed, or rolled back (the host as before, by slot, record, block
    table and token), or done; never rebuilt; every request's tokens those of the host that did
    not fail, and no page left behind."""
    r = sweep_cuda_transformation(tiny, sweep_baseline, kind, site, most=MOST)
    assert r["events"] > 0
    assert r["runs"] == r["refused"] + r["rolled_back"] + r["done"] + r["recovered"] > 0
    assert r["recovered"] == 0, r
    assert (r["changed"], r["wrong_layout"], r["lost"], r["mismatches"], r["leaked_pages"]) == \
           (0, 0, 0, 0, 0), r


MOST = testing.sweep_most(2)  # events failed per (kind, site), spread over all of them: on the emulated device a
#          run is several seconds, and a staggered merge has ~220 allocation events
