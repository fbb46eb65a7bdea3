"""The paged KV cache: the three Gyges layouts against hand-computed offsets, zero-copy views in
both directions, growth cost per layout, block tables, refusals and a random alloc/free run."""
import gc

import numpy as np
import pytest

import gyges
from gyges.runtime.kv_cache import LAYOUTS

LAYOUT_NAMES = list(LAYOUTS)


def make(layout, layers=3, heads=3, head_dim=5, block_size=7, page=4096, budget_pages=64,
         slots_per_layer=16):
    arena = gyges.Arena(budget=budget_pages * page, page_size=page, n_slots=1 + layers * slots_per_layer)
    kv = gyges.KVCache(arena, n_layers=layers, n_kv_heads=heads, head_dim=head_dim,
                       block_size=block_size, layout=layout, first_slot=1,
                       slots_per_layer=slots_per_layer)
    return arena, kv


def hand_offset(layout, kv, block, token, head, d, n_blocks, B, H, D):
    """Element offset of one value, written out from Gyges Table 2."""
    if layout == "raw":      # [K/V, Block, Token, Head, d]
        return (((kv * n_blocks + block) * B + token) * H + head) * D + d
    if layout == "page":     # [Block, K/V, Token, Head, d]
        return (((block * 2 + kv) * B + token) * H + head) * D + d
    return (((block * H + head) * 2 + kv) * B + token) * D + d  # [Block, Head, K/V, Token, d]


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_layout_offsets_match_the_paper(layout):
    B, H, D = 7, 3, 5
    arena, kv = make(layout, heads=H, head_dim=D, block_size=B)
    kv.grow(2)
    n_blocks = kv.n_blocks
    assert n_blocks == 2 * 4096 // (2 * B * H * D * 4)
    seq = kv.new_sequence()
    kv.reserve(seq, n_blocks * B)
    rng = np.random.default_rng(0)
    k = rng.standard_normal((n_blocks * B, H, D)).astype(np.float32)
    v = rng.standard_normal((n_blocks * B, H, D)).astype(np.float32)
    kv.write(seq, 1, 0, k, v)
    raw = kv.layer_raw(1)
    table = kv.block_table(seq)
    for pos in range(0, n_blocks * B, 5):
        block, token = table[pos // B], pos % B
        for head in range(H):
            for d in (0, D - 1):
                assert raw[hand_offset(layout, 0, block, token, head, d, n_blocks, B, H, D)] == k[pos, head, d]
                assert raw[hand_offset(layout, 1, block, token, head, d, n_blocks, B, H, D)] == v[pos, head, d]
    order = {"raw": (0, 1, 2, 3), "page": (1, 0, 2, 3), "header": (1, 3, 0, 2)}[layout]
    assert kv.layout()["stride_order"] == order


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_logical_view_and_gather_agree_both_ways(layout):
    arena, kv = make(layout)
    kv.grow(2)
    a, b = kv.new_sequence(), kv.new_sequence()
    kv.reserve(a, 9)
    kv.reserve(b, 20)
    view = kv.layer(2)  # axes (kv, block, token, head, dim)
    assert view.shape == (2, kv.n_blocks, 7, 3, 5)
    # Write through NumPy, read through C.
    table = kv.block_table(b)
    for pos in range(20):
        view[0, table[pos // 7], pos % 7] = pos
        view[1, table[pos // 7], pos % 7] = -pos
    k, v = kv.gather(b, 2)
    np.testing.assert_array_equal(k[:, 0, 0], np.arange(20))
    np.testing.assert_array_equal(v[:, 2, 4], -np.arange(20))
    # Write through C, read through NumPy.
    rng = np.random.default_rng(1)
    k = rng.standard_normal((9, 3, 5)).astype(np.float32)
    kv.write(a, 2, 0, k, -k)
    table = kv.block_table(a)
    for pos in range(9):
        np.testing.assert_array_equal(view[0, table[pos // 7], pos % 7], k[pos])
        np.testing.assert_array_equal(view[1, table[pos // 7], pos % 7], -k[pos])


def test_every_layout_holds_the_same_values():
    rng = np.random.default_rng(2)
    data = [rng.standard_normal((30, 3, 5)).astype(np.float32) for _ in range(2)]
    gathered = []
    for layout in LAYOUT_NAMES:
        arena, kv = make(layout)
        kv.grow(2)
        s = kv.new_sequence()
        kv.reserve(s, 30)
        kv.write(s, 0, 0, *data)
        gathered.append(kv.gather(s, 0))
    for k, v in gathered:
        np.testing.assert_array_equal(k, data[0])
        np.testing.assert_array_equal(v, data[1])


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_growth_moves_bytes_only_with_the_raw_layout(layout):
    layers = 3
    arena, kv = make(layout, layers=layers)
    kv.grow(1)
    s = kv.new_sequence()
    kv.reserve(s, 21)
    rng = np.random.default_rng(3)
    k = rng.standard_normal((21, 3, 5)).astype(np.float32)
    for layer in range(layers):
        kv.write(s, layer, 0, k + layer, k - layer)
    n1 = kv.n_blocks
    kv.grow(3)
    moved = kv.stats()["bytes_moved"]
    half_block = kv.block_bytes // 2
    assert moved == (layers * n1 * half_block if layout == "raw" else 0)
    assert arena.stats()["bytes_copied_total"] == moved
    for layer in range(layers):
        got_k, got_v = kv.gather(s, layer)
        np.testing.assert_array_equal(got_k, k + layer)
        np.testing.assert_array_equal(got_v, k - layer)


def test_raw_growth_is_refused_under_a_live_view_but_others_are_not():
    for layout in LAYOUT_NAMES:
        arena, kv = make(layout)
        kv.grow(1)
        view = kv.layer(0)
        if layout == "raw":
            with pytest.raises(gyges.BusyError, match="move"):
                kv.grow(1)
        else:
            kv.grow(1)
        del view
        gc.collect()
        kv.grow(1)


def test_block_tables_in_csr_form():
    arena, kv = make("header", block_size=4)
    kv.grow(1)
    seqs = [kv.new_sequence() for _ in range(3)]
    for s, n in zip(seqs, (5, 8, 1)):
        kv.reserve(s, n)
    indptr, indices, last = kv.block_tables(seqs)
    assert indptr.tolist() == [0, 2, 4, 5]
    assert sorted(indices.tolist()) == list(range(5))  # distinct blocks
    assert last.tolist() == [1, 4, 1]
    kv.free(seqs[1])
    with pytest.raises(gyges.StateError):
        kv.free(seqs[1])
    with pytest.raises(gyges.StateError):
        kv.block_table(seqs[1])


def test_memory_returns_to_baseline():
    arena, kv = make("header")
    baseline = arena.stats()["bytes_in_use"]
    kv.grow(4)
    assert arena.stats()["bytes_in_use"] == baseline + 3 * 4 * 4096
    assert arena.stats()["bytes_by_tag"]["kv"] == 3 * 4 * 4096
    s = kv.new_sequence()
    kv.reserve(s, 50)
    kv.free(s)
    kv.shrink(4)
    assert arena.stats()["bytes_in_use"] == baseline
    assert kv.n_blocks == 0


def test_bad_input():
    arena, kv = make("page")
    kv.grow(1)
    s = kv.new_sequence()
    kv.reserve(s, 10)
    good = np.zeros((3, 3, 5), np.float32)
    with pytest.raises(ValueError, match="shape"):
        kv.write(s, 0, 0, np.zeros((3, 5, 3), np.float32), good)
    with pytest.raises(gyges.InvalidArgumentError, match="layer"):
        kv.write(s, 3, 0, good, good)
    with pytest.raises(gyges.InvalidArgumentError, match="outside"):
        kv.write(s, 0, 13, good, good)  # two blocks: room for 14 tokens
    with pytest.raises(gyges.StateError):
        kv.write(99, 0, 0, good, good)
    with pytest.raises(gyges.OutOfMemoryError, match="blocks"):
        kv.reserve(s, 10_000)
    assert kv.block_table(s).size == 2  # unchanged by the refused reserve
    with pytest.raises(gyges.LimitError):
        kv.grow(100)
    with pytest.raises(gyges.BusyError, match="in use"):
        kv.shrink(1)
    with pytest.raises(ValueError, match="layout"):
        gyges.KVCache(arena, 1, 1, 1, layout="diagonal")
    with pytest.raises(gyges.InvalidArgumentError, match="do not fit"):
        gyges.KVCache(arena, n_layers=100, n_kv_heads=1, head_dim=1, slots_per_layer=2)
    with pytest.raises(gyges.InvalidArgumentError):
        gyges.KVCache(arena, n_layers=1, n_kv_heads=0, head_dim=4)


def test_random_alloc_free_matches_a_model():
    rng = np.random.default_rng(7)
    arena, kv = make("header", block_size=4)
    kv.grow(2)
    total = kv.n_blocks
    model = {}  # seq -> reserved tokens
    for step in range(3000):
        if model and rng.random() < 0.4:
            seq = list(model)[rng.integers(len(model))]
            kv.free(seq)
            del model[seq]
        elif rng.random() < 0.5 or not model:
            seq = kv.new_sequence()
            model[seq] = 0
        else:
            seq = list(model)[rng.integers(len(model))]
            want = model[seq] + int(rng.integers(1, 12))
            need = -(-want // 4) - -(-model[seq] // 4)
            free = total - sum(-(-n // 4) for n in model.values())
            if need > free:
                with pytest.raises(gyges.OutOfMemoryError):
                    kv.reserve(seq, want)
            else:
                kv.reserve(seq, want)
                model[seq] = want
        used = sum(-(-n // 4) for n in model.values())
        assert kv.free_blocks == total - used
        if step % 100 == 0:
            tables = [kv.block_table(s) for s in model]
            flat = np.concatenate(tables) if tables else np.zeros(0)
            assert len(set(flat.tolist())) == flat.size == used  # no block owned twice
