"""Live TP transformations with requests in flight (Gyges 4.1-4.2): token streams bit-identical
to serving with no transformation, KV heads on the right workers with unchanged values, FFN
pages exactly the owned shards, no leaked pages, and refusals that change nothing."""
import numpy as np
import pytest

import gyges
from gyges.reconfig import TransformError

# A transformation that fails half-way is rebuilt and recomputes its requests (gyges.recovery),
# which keeps token streams right and would hide the failure: here none may happen.
pytestmark = pytest.mark.filterwarnings("error::gyges.reconfig.recovery.RecoveryWarning")

MEMORY = "48MiB"


@pytest.fixture(scope="module")
def tiny():
    return gyges.Model.tiny()


def prompts(n, seed, lo=4, hi=70):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 4096, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


PARAMS = gyges.SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=21, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny):
    """Token streams served by one engine, no transformation."""
    cache = {}

    def get(seed, n=10):
        if (seed, n) not in cache:
            cache[(seed, n)] = [r.output_tokens for r in
                                gyges.Engine(tiny, memory="96MiB").generate(prompts(n, seed), PARAMS)]
        return cache[(seed, n)]
    return get


def new_host(tiny, layout):
    # A small prefill chunk so that transformations land in the middle of prefills too.
    return gyges.Host(tiny, workers=4, memory_per_worker=MEMORY, layout=layout,
                      max_prefill_chunk=16, max_batch_tokens=64)


def kv_by_request(host):
    """request id -> per layer (K, V) with every KV head, assembled from the ranks that hold them."""
    out = {}
    L = host.model.config.num_hidden_layers
    for inst in host.instances:
        for rid in inst.request_ids():
            seqs = inst.export(rid)["seqs"]
            if min(seqs) < 0:
                continue
            layers = []
            for layer in range(L):
                parts = [host.worker(w).kv.gather(seq, layer) for w, seq in zip(inst.workers, seqs)]
                n = min(p[0].shape[0] for p in parts)
                layers.append((np.concatenate([p[0][:n] for p in parts], axis=1),
                               np.concatenate([p[1][:n] for p in parts], axis=1)))
            out[rid] = layers
    return out


def assert_kv_unchanged(before, after):
    """Every head of every token of every request (kv_by_request) has its values unchanged."""
    assert set(before) == set(after)
    for rid in before:
        for (k0, v0), (k1, v1) in zip(before[rid], after[rid]):
            n = min(k0.shape[0], k1.shape[0])
            np.testing.assert_array_equal(k0[:n], k1[:n])
            np.testing.assert_array_equal(v0[:n], v1[:n])


def check_placement(host):
    """Each worker holds the KV heads and FFN shards of its rank, and nothing else."""
    H = host.model.config.num_key_value_heads
    for inst in host.instances:
        for rank, w in enumerate(inst.workers):
            worker = host.worker(w)
            assert worker.tp_size == inst.tp and worker.tp_rank == rank
            assert worker.kv.n_kv_heads == H // inst.tp
            assert worker.weights.held == worker.owned_shards(inst.tp, rank)
            weights = worker.arena.stats()["bytes_by_tag"]["weights"]
            w_ = worker.weights
            if w_.pad:
                ffn_pages = len(w_.held) * w_.shard_slots * 3 * host.model.config.num_hidden_layers
            else:  # kept shards packed at the front of each tensor's pages
                shard_bytes = w_.shard_rows * host.model.config.hidden_size * 4
                ffn_pages = -(-len(w_.held) * shard_bytes // w_.page_size) * 3 * host.model.config.num_hidden_layers
            expected = (w_.replicated_slots + ffn_pages) * w_.page_size
            assert weights == expected


@pytest.mark.parametrize("start, target, workers, steps", [
    ("4xTP1", 2, (0, 1), 3), ("2xTP2", 4, (0, 1, 2, 3), 5), ("4xTP1", 4, (0, 1, 2, 3), 2),
    ("1xTP4", 1, (0, 1, 2, 3), 4), ("1xTP4", 2, (0, 1, 2, 3), 6), ("2xTP2", 1, (2, 3), 3),
])
def test_transformations_keep_every_token_stream(tiny, reference, start, target, workers, steps):
    host = new_host(tiny, start)
    requests = [host.submit(p, PARAMS) for p in prompts(10, seed=1)]
    for _ in range(steps):
        host.step()
    before = kv_by_request(host)
    t = host.transform(workers=workers, tp=target)
    assert t.done and t.stats["requests_moved"] > 0
    assert_kv_unchanged(before, kv_by_request(host))
    check_placement(host)
    host.run()
    assert [r.output_tokens for r in requests] == reference(1)


def test_twenty_round_trips_leak_nothing(tiny, reference):
    host = new_host(tiny, "4xTP1")
    start = [m["in_use"] for m in host.memory()]
    requests = [host.submit(p, PARAMS) for p in prompts(10, seed=1)]
    for trip in range(20):
        host.step()
        host.transform(workers=(0, 1, 2, 3), tp=4)
        assert host.layout() == "TP4"
        host.step()
        host.transform(workers=(0, 1, 2, 3), tp=1, weights_from="host" if trip % 2 else "peers")
        assert host.layout() == "4xTP1"
    check_placement(host)
    host.run()
    assert [r.output_tokens for r in requests] == reference(1)
    assert [m["in_use"] for m in host.memory()] == start


def test_scale_up_moves_only_other_heads_and_reuses_freed_space(tiny):
    host = new_host(tiny, "4xTP1")
    for p in prompts(12, seed=3, lo=40, hi=90):
        host.submit(p, PARAMS)
    for _ in range(8):
        host.step()
    kv_before = [host.worker(w).arena.stats()["bytes_by_tag"]["kv"] for w in range(4)]
    t = host.transform(workers=(0, 1, 2, 3), tp=4)
    s = t.stats
    # A worker keeps one of four heads in place and sends the other three quarters.
    for w in range(4):
        assert s["weight_bytes_released"][w] > 0 and s["weight_bytes_copied"][w] == 0
        assert s["peak_extra_bytes"][w] <= 0.5 * kv_before[w] + host.worker(w).page_size * 4
    assert sum(s["bytes_sent"].values()) == sum(s["bytes_received"].values()) > 0


def test_a_request_too_long_for_tp1_is_served_after_the_merge(tiny):
    host = gyges.Host(tiny, workers=4, memory_per_worker="24MiB", layout="4xTP1")
    params = gyges.SamplingParams(max_tokens=8, ignore_eos=True)
    short = [host.submit(p, params) for p in prompts(4, seed=4)]
    host.step()
    long_prompt = list(range(1, 1500))
    with pytest.raises(ValueError, match="merge instances"):
        host.submit(long_prompt, params)
    host.transform(workers=(0, 1, 2, 3), tp=4)
    long = host.submit(long_prompt, params)
    host.run()
    assert len(long.output_tokens) == 8 and all(len(r.output_tokens) == 8 for r in short)


def state_of(host):
    tables = {}
    for inst in host.instances:
        for rid in inst.request_ids():
            ex = inst.export(rid)
            tables[rid] = [host.worker(w).kv.block_table(seq).tolist() if seq >= 0 else None
                           for w, seq in zip(inst.workers, ex["seqs"])]
    return (host.layout(), [host.worker(w).arena.page_table().tolist() for w in range(4)], tables)


def test_refusals_change_nothing(tiny):
    host = new_host(tiny, "TP2+2xTP1")
    for p in prompts(6, seed=5):
        host.submit(p, PARAMS)
    host.step()
    before = state_of(host)
    refusals = [
        (dict(workers=(1, 2), tp=2), "aligned"),                 # unaligned group
        (dict(workers=(0, 1, 2), tp=2), "aligned"),
        (dict(workers=(2, 3), tp=4), "TP"),                      # tp must match the group
        (dict(workers=(0, 1), tp=4), "TP"),
        (dict(workers=(0, 1, 2, 3), tp=4, layers_per_step=1), "one TP degree"),
        (dict(workers=(0, 1, 2, 3), tp=4, method="magic"), "unknown method"),
        (dict(workers=(0, 1, 2, 3), tp=4, method="partial_swap"), "unpadded"),
        (dict(workers=(0, 1, 2, 3), tp=4, phase_chunks=0), "phase_chunks"),
    ]
    for kwargs, match in refusals:
        with pytest.raises((TransformError, ValueError), match=match):
            host.transform(**kwargs)
        assert state_of(host) == before
    # Mixed degrees in one group cannot merge in one go.
    with pytest.raises(TransformError, match="one TP degree"):
        host.transform(workers=(0, 1, 2, 3), tp=4)
    assert state_of(host) == before
    # Scale-down refused when the requests cannot fit: memory for the TP1 instances is short.
    # TP2 weights leave ~8 MB of KV a worker; back at TP1 the full FFN leaves ~3 MB.
    tight = gyges.Host(tiny, workers=2, memory_per_worker="24MiB", layout="TP2")
    for p in prompts(10, seed=6, lo=150, hi=200):
        tight.submit(p, gyges.SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(12):
        tight.step()
    snapshot = (tight.layout(), [tight.worker(w).arena.page_table().tolist() for w in range(2)])
    with pytest.raises(TransformError, match="scale-down refused"):
        tight.transform(workers=(0, 1), tp=1)
    assert (tight.layout(), [tight.worker(w).arena.page_table().tolist() for w in range(2)]) == snapshot
    tight.run()


@pytest.mark.parametrize("kv_layout, method, pad", [
    ("page", "basic", True), ("raw", "basic", True), ("header", "basic", True),
    ("header", "partial_swap", False), ("page", "partial_swap", False), ("header", "stop_world", True),
])
def test_baselines_keep_every_token_stream(tiny, reference, kv_layout, method, pad):
    host = gyges.Host(tiny, workers=4, memory_per_worker=MEMORY, layout="4xTP1",
                      kv_layout=kv_layout, pad_ffn=pad, max_prefill_chunk=16, max_batch_tokens=64)
    requests = [host.submit(p, PARAMS) for p in prompts(10, seed=1)]
    for _ in range(4):
        host.step()
    t = host.transform(workers=(0, 1, 2, 3), tp=4, method=method)
    copied = t.stats["weight_bytes_copied"]
    if method == "partial_swap":
        assert sum(copied.values()) > 0 and copied[0] == 0  # worker 0's shard is already first
    else:
        assert sum(copied.values()) == 0  # padded shards are released without a copy
    check_placement(host)
    host.run()
    assert [r.output_tokens for r in requests] == reference(1)


def test_gyges_needs_a_fraction_of_the_extra_memory_of_basic(tiny):
    peaks = {}
    for method, chunks in (("basic", 1), ("gyges", 1), ("gyges", 4)):
        host = new_host(tiny, "4xTP1")
        for p in prompts(16, seed=7, lo=60, hi=120):
            host.submit(p, gyges.SamplingParams(max_tokens=64, ignore_eos=True))
        for _ in range(10):
            host.step()
        t = host.transform(workers=(0, 1, 2, 3), tp=4, method=method, phase_chunks=chunks)
        peaks[(method, chunks)] = max(t.stats["peak_extra_bytes"].values())
    # Basic holds a second copy of the KV; gyges maps at most one round's worth of new pages.
    assert peaks[("gyges", 1)] < peaks[("basic", 1)] / 2
    assert peaks[("gyges", 4)] <= peaks[("gyges", 1)]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("start, workers, target, layers_per_step", [
    ("4xTP1", (0, 1, 2, 3), 4, 1), ("4xTP1", (0, 1, 2, 3), 4, 3), ("2xTP2", (0, 1, 2, 3), 4, 2),
    ("4xTP1", (2, 3), 2, 1),
])
def test_layer_staggered_scale_up_serves_while_it_moves(tiny, reference, start, workers, target,
                                                        layers_per_step, overlap):
    host = new_host(tiny, start)
    ps = prompts(10, seed=1)
    early = [host.submit(p, PARAMS) for p in ps[:7]]
    for _ in range(3):
        host.step()
    t = host.transform(workers=workers, tp=target, layers_per_step=layers_per_step,
                       overlap=overlap)
    assert not t.done and t.boundary == tiny.config.num_hidden_layers
    late = [host.submit(p, PARAMS) for p in ps[7:]]  # admitted while layers move
    boundaries = []
    while not t.done:
        host.step()
        boundaries.append(t.boundary if not t.done else 0)
    L = tiny.config.num_hidden_layers
    # With overlap the first step only starts reading the KV beside it, and a step moves nothing
    # while that reading is still running.
    assert len(boundaries) == -(-L // layers_per_step) + overlap + t.stats["steps_waiting"]
    if overlap:  # all but the first step's layers were read beside a step, the rest patched
        assert 0 < t.stats["bytes_read_beside_steps"] < sum(t.stats["bytes_received"].values()) * 2
        assert t.stats["stage_bytes"] > 0
    else:
        assert t.stats["bytes_read_beside_steps"] == 0
    check_placement(host)
    host.run()
    assert [r.output_tokens for r in early + late] == reference(1)


@pytest.mark.parametrize("start, target", [("4xTP1", 4), ("2xTP2", 4), ("4xTP1", 2)])
def test_staggered_scale_up_leaves_each_ranks_own_heads_in_place(tiny, reference, start, target):
    """In the header layout a merged rank's new blocks for its own requests are its old blocks'
    runs of the heads it keeps, so the first layer's move copies only the other ranks' heads:
    in place exactly the kept heads of every token, moved exactly the rest."""
    host = new_host(tiny, start)
    requests = [host.submit(p, PARAMS) for p in prompts(10, seed=1)]
    for _ in range(3):
        host.step()
    config = tiny.config
    per_head_token = 2 * config.head_dim * 4  # K and V, fp32
    group = range(target)
    tokens = sum(host.worker(w).kv.n_tokens(seq) for inst in host.instances
                 if inst.workers[0] in group for rid in inst.request_ids()
                 for w, seq in zip(inst.workers, inst.export(rid)["seqs"]) if seq >= 0)
    h_new = config.num_key_value_heads // target
    t = host.transform(workers=tuple(group), tp=target, layers_per_step=1)
    host.step()  # moves the last layer before the step adds tokens
    # Every old rank's tokens: h_new of its heads stay, the rest (h_old - h_new) move.
    h_old = config.num_key_value_heads // host_tp(start)
    assert t.stats["bytes_in_place"] == tokens * h_new * per_head_token
    assert sum(t.stats["bytes_received"].values()) == tokens * (h_old - h_new) * per_head_token
    while not t.done:
        host.step()
    check_placement(host)
    host.run()
    assert [r.output_tokens for r in requests] == reference(1)


def host_tp(layout):
    return int(layout.split("TP")[1])


def test_staggered_refusals_and_round_trip(tiny, reference):
    host = new_host(tiny, "4xTP1")
    requests = [host.submit(p, PARAMS) for p in prompts(10, seed=1)]
    host.step()
    for bad, match in ((dict(layers_per_step=0), "positive"), (dict(layers_per_step="2"), "integer")):
        with pytest.raises(gyges.InvalidArgumentError, match=match):
            host.transform(workers=(0, 1, 2, 3), tp=4, **bad)
    t = host.transform(workers=(0, 1, 2, 3), tp=4, layers_per_step=1)
    with pytest.raises(gyges.BusyError, match="under way"):
        host.transform(workers=(0, 1, 2, 3), tp=1)
    while not t.done:
        host.step()
    down = host.transform(workers=(0, 1, 2, 3), tp=1, layers_per_step=2, weights_from="host")
    while not down.done:
        host.step()
    assert host.layout() == "4xTP1"
    host.step()
    host.transform(workers=(0, 1, 2, 3), tp=4, layers_per_step=2)
    host.run()
    check_placement(host)
    assert [r.output_tokens for r in requests] == reference(1)
    raw = gyges.Host(tiny, workers=2, memory_per_worker=MEMORY, layout="2xTP1", kv_layout="raw")
    with pytest.raises(TransformError, match="raw layout"):
        raw.transform(workers=(0, 1), tp=2, layers_per_step=1)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("start, workers, target, layers_per_step, weights_from", [
    ("1xTP4", (0, 1, 2, 3), 1, 1, "peers"), ("1xTP4", (0, 1, 2, 3), 2, 3, "host"),
    ("2xTP2", (0, 1), 1, 2, "peers"), ("1xTP4", (0, 1, 2, 3), 1, 4, "peers"),
])
def test_layer_staggered_scale_down_serves_while_it_moves(tiny, reference, start, workers, target,
                                                          layers_per_step, weights_from, overlap):
    host = new_host(tiny, start)
    ps = prompts(10, seed=1)
    early = [host.submit(p, PARAMS) for p in ps[:7]]
    for _ in range(3):
        host.step()
    before = kv_by_request(host)
    t = host.transform(workers=workers, tp=target, layers_per_step=layers_per_step,
                       weights_from=weights_from, overlap=overlap)
    late = [host.submit(p, PARAMS) for p in ps[7:]]  # arrive while layers move
    while not t.done:
        host.step()
    check_placement(host)
    after = kv_by_request(host)
    for rid in set(before) & set(after):  # KV written before the split survived it
        for (k0, v0), (k1, v1) in zip(before[rid], after[rid]):
            n = min(k0.shape[0], k1.shape[0])
            np.testing.assert_array_equal(k0[:n], k1[:n])
            np.testing.assert_array_equal(v0[:n], v1[:n])
    host.run()
    assert [r.output_tokens for r in early + late] == reference(1)
    assert all(m["kv"] == 0 for m in host.memory())


# ---- groups of three: a model with 3 KV heads (SmolLM2's shape, small) ----

THREE_HEADS = gyges.models.config.ModelConfig(vocab_size=1024, hidden_size=192, intermediate_size=384,
                                      num_hidden_layers=3, num_attention_heads=6,
                                      num_key_value_heads=3, max_position_embeddings=512)


@pytest.fixture(scope="module")
def three():
    return gyges.Model.random(THREE_HEADS, seed=5)


@pytest.mark.parametrize("layers_per_step", [None, 1])
@pytest.mark.parametrize("params", [gyges.SamplingParams(max_tokens=20, ignore_eos=True), PARAMS],
                         ids=["greedy", "seeded"])
def test_three_workers_merge_into_tp3_and_split_back_bit_identically(three, params,
                                                                     layers_per_step):
    """3 KV heads allow TP1 and TP3 only; 3xTP1 -> TP3 -> 3xTP1 live (at once or layer by
    layer) with requests in flight gives the tokens of one engine, KV values moved unchanged,
    each worker holding exactly its rank's heads and FFN shard, and every page back."""
    ps = [p[:40] for p in prompts(9, seed=3)]
    ps = [[t % 1024 for t in p] for p in ps]
    want = [r.output_tokens for r in gyges.Engine(three, memory="64MiB").generate(ps, params)]
    host = gyges.Host(three, workers=3, memory_per_worker="32MiB", layout="3xTP1",
                      max_prefill_chunk=16, max_batch_tokens=64)
    assert host.max_tp == 3 and host.tp_degrees == [1, 3]
    start = [m["in_use"] for m in host.memory()]
    requests = [host.submit(p, params) for p in ps]
    for target in (3, 1):
        for _ in range(3):
            host.step()
        before = kv_by_request(host)
        t = host.transform(workers=(0, 1, 2), tp=target, layers_per_step=layers_per_step)
        while not t.done:
            host.step()
        assert host.layout() == ("TP3" if target == 3 else "3xTP1")
        if layers_per_step is None:
            assert_kv_unchanged(before, kv_by_request(host))
        check_placement(host)
    host.run()
    assert [r.output_tokens for r in requests] == want
    assert [m["in_use"] for m in host.memory()] == start
    host.close()


def test_group_sizes_the_heads_do_not_allow_are_refused_by_the_rule(three):
    with pytest.raises(gyges.InvalidArgumentError, match="divides its 3 KV heads.*runs at TP 1, 3"):
        gyges.Host(three, workers=2, memory_per_worker="32MiB", layout="TP2")
    host = gyges.Host(three, workers=4, memory_per_worker="32MiB", layout="TP3+TP1")
    assert host.layout() == "TP3+TP1"
    with pytest.raises(gyges.InvalidArgumentError, match="TP2 does not fit the model"):
        host.transform(workers=(0, 1, 2), tp=2)
    with pytest.raises(TransformError, match="aligned group"):
        host.transform(workers=(1, 2, 3), tp=3)
    assert host.layout() == "TP3+TP1"
    host.close()
