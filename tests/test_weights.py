"""Padded FFN weight placement (Gyges section 4.2): shards on page boundaries, exact contents,
padding accounted to the byte."""
import dataclasses

import numpy as np
import pytest

import gyges
from gyges.models.checkpoint import random_weights
from gyges.models.config import ModelConfig
from gyges.runtime.weights import ModelWeights, replicated_names


@pytest.fixture(scope="module")
def tiny():
    config = ModelConfig.tiny()
    return config, random_weights(config, seed=3)


@pytest.mark.parametrize("page_size", [4096, 65536])
def test_shards_start_on_page_boundaries_and_hold_their_rows(tiny, page_size):
    config, tensors = tiny
    arena = gyges.Arena(budget="64MiB", page_size=page_size)
    w = ModelWeights(arena, config, tensors, dtype="f32", max_tp=4, first_slot=3)
    rows = config.intermediate_size // 4
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}.mlp."
        full = {"gate": tensors[p + "gate_proj.weight"], "up": tensors[p + "up_proj.weight"],
                "down": tensors[p + "down_proj.weight"].T}
        for kind in ("gate", "up", "down"):
            for s in range(4):
                offset, shard_rows = w.ffn[layer][kind][s]
                assert shard_rows == rows
                assert offset % page_size == 0
                slots = w.shard_slots_of(layer, kind, s)
                whole = arena.view(slots.start, len(slots), dtype=np.float32)
                got = whole[:rows * config.hidden_size]
                np.testing.assert_array_equal(got.reshape(rows, -1), full[kind][s * rows:(s + 1) * rows])
                # The padding after the shard is zeros (eq. 2's 0 blocks).
                assert not whole[rows * config.hidden_size:].any()
                del whole, got
            np.testing.assert_array_equal(w.read_ffn(layer, kind), full[kind])
    for name in replicated_names(config):
        want = tensors[name].T if name.endswith("o_proj.weight") else tensors[name]
        np.testing.assert_array_equal(w.read(name), want)


def test_unpadded_layout_packs_shards(tiny):
    config, tensors = tiny
    arena = gyges.Arena(budget="64MiB", page_size=65536)
    w = ModelWeights(arena, config, tensors, pad=False)
    shard_bytes = 172 * 256 * 4
    for s in range(4):
        assert w.shard_offset(0, "up", s) == w.shard_offset(0, "up", 0) + s * shard_bytes
    np.testing.assert_array_equal(w.read_ffn(2, "down"), tensors["model.layers.2.mlp.down_proj.weight"].T)
    with pytest.raises(ValueError, match="share pages"):
        w.shard_slots_of(0, "up", 1)


def test_padding_accounting_is_exact(tiny):
    config, tensors = tiny
    page = 65536
    arena = gyges.Arena(budget="64MiB", page_size=page)
    w = ModelWeights(arena, config, tensors, dtype="f32")
    shard_bytes = 172 * 256 * 4                       # 688/4 rows of 256 fp32
    shard_pages = -(-shard_bytes // page)             # 3 pages
    expected_padding = (shard_pages * page - shard_bytes) * 4 * 3 * 4  # shards, kinds, layers
    assert w.padding_bytes == expected_padding
    assert arena.stats()["bytes_by_tag"]["weights"] == w.bytes_total
    assert w.bytes_total == (w.replicated_slots + 4 * 3 * 4 * shard_pages) * page
    assert 0 < w.padding_overhead() < 0.1


def test_bf16_storage_rounds_to_nearest_even(tiny):
    config, tensors = tiny
    arena = gyges.Arena(budget="64MiB", page_size=65536)
    w = ModelWeights(arena, config, tensors, dtype="bf16")
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    bits = q.astype(np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16).view(np.float32)
    np.testing.assert_array_equal(w.read("model.layers.0.self_attn.q_proj.weight"), rounded)
    # Norms stay fp32.
    np.testing.assert_array_equal(w.read("model.norm.weight"), tensors["model.norm.weight"])


def test_bad_arguments(tiny):
    config, tensors = tiny
    arena = gyges.Arena(budget="64MiB", page_size=65536)
    with pytest.raises(ValueError, match="dtype"):
        ModelWeights(arena, config, tensors, dtype="int4")
    with pytest.raises(ValueError, match=r"max_tp must be in \[1, 8\], got 9"):
        ModelWeights(arena, config, tensors, max_tp=9)
    with pytest.raises(ValueError, match="688 is not divisible by max_tp=3"):
        ModelWeights(arena, config, tensors, max_tp=3)
    with pytest.raises(ValueError, match="divisible"):
        ModelWeights(arena, config.replace(intermediate_size=690), tensors, max_tp=4)
    small = gyges.Arena(budget="1MiB", page_size=65536)
    with pytest.raises(gyges.OutOfMemoryError):
        ModelWeights(small, config, tensors)


def _run_pages(config, page, names_bytes):
    """Pages of one run: its tensors packed at 64-byte boundaries, rounded up to whole pages."""
    cursor = 0
    for nbytes in names_bytes:
        cursor = -(-(cursor + nbytes) // 64) * 64
    return max(-(-cursor // page), 1)


@pytest.mark.parametrize("tied", [False, True])
def test_replicated_runs_are_accounted_from_the_config(tied):
    """Embedding, every layer's attention and the head each own their pages; the sizes come from
    the config alone."""
    config = dataclasses.replace(ModelConfig.tiny(), tie_word_embeddings=tied)
    tensors = random_weights(config, seed=4)
    page = 4096
    arena = gyges.Arena(budget="64MiB", page_size=page)
    w = ModelWeights(arena, config, tensors, dtype="f32")
    H, V, D = config.hidden_size, config.vocab_size, config.head_dim
    q, kv = config.num_attention_heads * D, config.num_key_value_heads * D
    layer = _run_pages(config, page, [H * 4, H * 4, q * H * 4, kv * H * 4, kv * H * 4, q * H * 4])
    want = {"embed": _run_pages(config, page, [V * H * 4]),
            "head": _run_pages(config, page, [H * 4] + ([] if tied else [V * H * 4]))}
    want.update({i: layer for i in range(config.num_hidden_layers)})
    assert {k: n for k, (_, n) in w.runs.items()} == want
    starts = sorted(first for first, _ in w.runs.values())
    assert starts[0] == 0 and w.replicated_slots == sum(want.values())
    assert arena.stats()["bytes_by_tag"]["weights"] == w.bytes_total


def test_whole_layers_drop_and_come_back_exactly(tiny):
    config, tensors = tiny
    page = 65536
    arena = gyges.Arena(budget="64MiB", page_size=page)
    w = ModelWeights(arena, config, tensors, dtype="f32")
    peer_arena = gyges.Arena(budget="64MiB", page_size=page)
    peer = ModelWeights(peer_arena, config, tensors, dtype="f32")
    w.drop_shards({0, 1})  # a TP2 rank: the layer holds two shards of each FFN tensor
    before = arena.stats()["bytes_in_use"]
    one_layer = (w.runs[2][1] + 2 * 3 * w.shard_slots) * page
    assert w.layer_bytes(2) == one_layer
    assert w.drop_layers({2, 3}) == 2 * one_layer
    assert arena.stats()["bytes_in_use"] == before - 2 * one_layer
    assert w.held_layers == {0, 1} and w.c_offsets()[3 + 2 * (13 + 12)] == -1
    with pytest.raises(gyges.InvalidArgumentError, match="not held"):
        w.drop_layers({3})
    assert arena.stats()["bytes_in_use"] == before - 2 * one_layer  # refused: nothing changed
    copied = w.restore_layers({2}) + w.restore_layers({3}, source=peer)
    assert arena.stats()["bytes_in_use"] == before and w.held_layers == {0, 1, 2, 3}
    n_attn = sum(int(np.prod(tensors[n].shape)) * 4 for n in w.run_names[2])
    assert copied == 2 * (n_attn + 2 * 3 * w.shard_rows * config.hidden_size * 4)
    for layer in (2, 3):
        for name in w.run_names[layer]:
            want = tensors[name].T if name.endswith("o_proj.weight") else tensors[name]
            assert np.array_equal(w.read(name), want), name
        gate = tensors[f"model.layers.{layer}.mlp.gate_proj.weight"]
        for shard in (0, 1):  # the shards held; each on its own pages
            got = arena.read(w.shard_offset(layer, "gate", shard),
                             w.shard_rows * config.hidden_size * 4, dtype=np.float32)
            rows = gate[shard * w.shard_rows:(shard + 1) * w.shard_rows]
            assert np.array_equal(got.reshape(rows.shape), rows)
    assert w.set_ends(embed=False, head=False) == 0
    assert arena.stats()["bytes_in_use"] == before - (w.runs["embed"][1] + w.runs["head"][1]) * page
    w.set_ends(embed=True, head=True, source=peer)
    assert arena.stats()["bytes_in_use"] == before
    assert np.array_equal(w.read("model.embed_tokens.weight"), tensors["model.embed_tokens.weight"])


# (writes from the host copy are not copies between arenas: no "copy" event without a peer)
@pytest.mark.parametrize("site, from_peer", [("page_create", False), ("page_map", False),
                                             ("page_create", True), ("page_map", True),
                                             ("copy", True)])
def test_a_failed_restore_of_layers_or_ends_changes_nothing(tiny, site, from_peer):
    """Every event of `site` in a restore of two whole layers and of the embedding and head fails
    in turn: the call raises a gyges.Error and the weights are as before it (pages, bytes, what
    is held); the same restore then succeeds with the right contents."""
    from gyges import testing
    config, tensors = tiny
    page = 65536
    peer = ModelWeights(gyges.Arena(budget="64MiB", page_size=page), config, tensors, dtype="f32")
    source = peer if from_peer else None
    arena = gyges.Arena(budget="64MiB", page_size=page)
    w = ModelWeights(arena, config, tensors, dtype="f32")
    w.drop_shards({0, 1})
    w.drop_layers({1, 3})
    w.set_ends(embed=False, head=False)

    def state():
        return (arena.stats()["bytes_in_use"], arena.page_table().tolist(), set(w.held_layers),
                w.has_embed, w.has_head, w.c_offsets().tolist())

    steps = [(lambda: w.restore_layers({1, 3}, source=source), lambda: w.drop_layers({1, 3})),
             (lambda: w.set_ends(embed=True, head=True, source=source),
              lambda: w.set_ends(embed=False, head=False))]
    for restore, undo in steps:
        before = state()
        count = testing.count(site, restore)[0]
        undo()
        assert state() == before and count > 0
        for n in range(1, count + 1):
            with testing.inject(site, n) as fired:
                with pytest.raises(gyges.Error):
                    restore()
            assert fired() == 1 and state() == before, (site, n)
        restore()
    assert w.held_layers == {0, 1, 2, 3} and w.has_embed and w.has_head
    for name in tensors:
        if ".mlp." not in name:
            want = tensors[name].T if name.endswith("o_proj.weight") else tensors[name]
            assert np.array_equal(w.read(name), want), name
