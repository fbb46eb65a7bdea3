"""The one KV move (gyges.KVMove over csrc/kv/kv_move.h). Its overlap mode (a layer-staggered
transformation's): a layer read early beside a step, then patched and written, must land exactly
as a one-shot move of the caches as they are at the end; planned items that changed in between
(more tokens, a freed and remade sequence) must be noticed. And the plain moves of the other
callers against a NumPy reference: head ranges of block lists, sequences with a token limit,
dirty bitmaps, refusals that change nothing."""
import numpy as np
import pytest

import gyges
from gyges import KVMove, KVMoveStage

H_OLD, H_NEW, D, L, B = 4, 2, 8, 3, 4


def caches(layout="header"):
    """An old cache of 4 heads and a shadow of 2 heads over the same pages (scale-down's
    geometry change) and a second, separate 2-head cache."""
    arena = gyges.Arena(budget="8MiB", page_size="64KiB", n_slots=128)
    old = gyges.KVCache(arena, n_layers=L, n_kv_heads=H_OLD, head_dim=D, block_size=B,
                        layout=layout, slots_per_layer=20)
    old.grow(4)
    new = old.shadow(H_NEW)
    other = gyges.KVCache(gyges.Arena(budget="4MiB", page_size="64KiB", n_slots=64), n_layers=L,
                          n_kv_heads=H_NEW, head_dim=D, block_size=B, layout=layout)
    other.grow(2)
    return arena, old, new, other


def fill(kv, seq, n, seed, start=0):
    rng = np.random.default_rng(seed)
    kv.reserve(seq, start + n)
    for layer in range(L):
        kv.write(seq, layer, start, rng.standard_normal((n, kv.n_kv_heads, D)),
                 rng.standard_normal((n, kv.n_kv_heads, D)))


def item(src, seq, head, n_heads, n_tokens, dst, dst_seq, dst_head=0):
    return KVMove.item(src, dst, src_seq=seq, dst_seq=dst_seq, src_head=head, dst_head=dst_head,
                       n_heads=n_heads, n_tokens=n_tokens)


def layer_move(items, layer):
    """A layer-staggered transformation's move of one layer."""
    return KVMove(range(layer, layer + 1), items, overlap=True, threads=2)


def items_for(old, new, other, src_seqs, dst_seqs, other_seqs):
    """Heads [0, 2) of each old sequence to `new`, heads [2, 4) to `other`."""
    items = []
    for s, d, o in zip(src_seqs, dst_seqs, other_seqs):
        n = old.n_tokens(s)
        for kv, seq, h in ((new, d, 0), (other, o, 2)):
            kv.reserve(seq, n)
            items.append(item(old, s, h, H_NEW, n, kv, seq))
    return items


def check_moved(old, new, other, src, dst, oth, layer, expect):
    """Heads [0, 2) of every old sequence are in `new`, heads [2, 4) in `other`, as `expect`."""
    for s, d, o in zip(src, dst, oth):
        k, v = expect[s]
        k_new, v_new = new.gather(d, layer, 0, old.n_tokens(s))
        k_oth, v_oth = other.gather(o, layer, 0, old.n_tokens(s))
        np.testing.assert_array_equal(k_new, k[:, :2])
        np.testing.assert_array_equal(v_new, v[:, :2])
        np.testing.assert_array_equal(k_oth, k[:, 2:])
        np.testing.assert_array_equal(v_oth, v[:, 2:])


@pytest.mark.parametrize("layout", ["header", "page"])
def test_early_read_then_patch_equals_a_one_shot_move(layout):
    arena, old, new, other = caches(layout)
    src = [old.new_sequence() for _ in range(3)]
    for i, s in enumerate(src):
        fill(old, s, 5 + 7 * i, seed=i)
    # The shadow's blocks 0..31 overlap the old blocks these sequences use (0..15 at most): a
    # spacer takes them, so that no destination block is by chance the source's own head run
    # (that run would stay in place; test_own_heads_stay_in_place covers it).
    new.reserve(new.new_sequence(), 32 * B)
    dst = [new.new_sequence() for _ in src]
    oth = [other.new_sequence() for _ in src]
    stage = KVMoveStage()
    layer = 1
    layer_move(items_for(old, new, other, src, dst, oth), layer).plan(stage)
    stage.read()
    # A step happens: sequence 0 gets 6 more tokens, sequence 1 is freed and remade (same id,
    # new data, longer than planned), sequence 2 is unchanged, and a new sequence 3 appears.
    fill(old, src[0], 6, seed=10, start=old.n_tokens(src[0]))
    old.free(src[1])
    remade = old.new_sequence()
    assert remade == src[1]
    fill(old, remade, 20, seed=11)  # more tokens than planned: only its generation tells
    src.append(old.new_sequence())
    fill(old, src[3], 3, seed=12)
    dst.append(new.new_sequence())
    oth.append(other.new_sequence())
    expect = {s: old.gather(s, layer) for s in src}
    stats = layer_move(items_for(old, new, other, src, dst, oth), layer).run(stage)
    assert stats["items_reused"] == 4       # sequences 0 and 2, two items each
    assert stats["items_stale"] == 2        # the remade sequence's two items
    per_token = 2 * H_NEW * D * 4
    planned = (5 + 19) * 2 * per_token      # tokens read early and still valid
    assert stats["bytes_early"] == planned
    assert stats["bytes"] == sum(old.n_tokens(s) for s in src) * 2 * per_token
    assert stats["bytes_late"] == stats["bytes"] - planned
    assert stats["bytes_in_place"] == 0
    check_moved(old, new, other, src, dst, oth, layer, expect)


@pytest.mark.parametrize("early", [False, True])
def test_own_heads_stay_in_place(early):
    """A destination block that is the source block's own head run (old block X's heads [0, 2)
    are the shadow's block 2X) is neither read nor written; tokens that grow into other blocks
    move as usual, and the result equals the old cache's contents either way."""
    arena, old, new, other = caches()
    src = [old.new_sequence() for _ in range(2)]
    for i, s in enumerate(src):
        fill(old, s, 9 + 4 * i, seed=20 + i)
    dst = [new.adopt(2 * np.asarray(old.block_table(s)), old.n_tokens(s)) for s in src]
    oth = [other.new_sequence() for _ in src]
    layer = 2
    in_place = sum(old.n_tokens(s) for s in src)  # tokens: every token of the adopted blocks
    stage = KVMoveStage()
    if early:
        layer_move(items_for(old, new, other, src, dst, oth), layer).plan(stage)
        stage.read()
    # The first sequence grows from 9 to 14 tokens: tokens 9..11 fill its third block (in place),
    # tokens 12 and 13 go to a fourth block, which the shadow takes from its free list.
    fill(old, src[0], 5, seed=30, start=old.n_tokens(src[0]))
    new.reserve(dst[0], old.n_tokens(src[0]))
    grown = old.n_tokens(src[0]) - 3 * B        # tokens in the fourth block: they move
    in_place += 3 * B - 9
    expect = {s: old.gather(s, layer) for s in src}
    stats = layer_move(items_for(old, new, other, src, dst, oth), layer).run(stage)
    per_token = 2 * H_NEW * D * 4
    total = sum(old.n_tokens(s) for s in src) * 2 * per_token
    assert stats["bytes_in_place"] == in_place * per_token
    assert stats["bytes"] == total - in_place * per_token
    assert new.block_table(dst[0])[3] != 2 * old.block_table(src[0])[3]
    assert grown > 0
    check_moved(old, new, other, src, dst, oth, layer, expect)


@pytest.mark.parametrize("layout", ["header", "page"])
def test_a_move_without_early_read_copies_over_its_own_sources(layout):
    """New blocks laid over head runs that other items still have to read: a's heads [0, 2) go
    where b's heads [2, 4) are and b's go where a's were (a cycle), a's heads [2, 4) go where c's
    heads [0, 2) are, and c's to free blocks (a chain). The header layout copies each run once, in
    an order that reads every source first (parking one run per cycle); the page layout goes
    through the stage. Both must land exactly the old contents."""
    arena, old, new, other = caches(layout)
    a, b, c = (old.new_sequence() for _ in range(3))
    for i, s in enumerate((a, b, c)):
        fill(old, s, 2 * B, seed=40 + i)
    blocks = {s: np.asarray(old.block_table(s)) for s in (a, b, c)}
    n = 2 * B
    dest = {(a, 0): new.adopt(2 * blocks[b] + 1, n),   # over b's heads [2, 4)
            (b, 2): new.adopt(2 * blocks[a], n),       # over a's heads [0, 2)
            (a, 2): new.adopt(2 * blocks[c], n),       # over c's heads [0, 2)
            (c, 0): new.adopt(np.array([400, 401]), n)}  # free
    layer = 1
    expect = {s: old.gather(s, layer) for s in (a, b, c)}
    items = [item(old, s, h, H_NEW, n, new, d) for (s, h), d in dest.items()]
    stats = layer_move(items, layer).run()
    runs = len(items) * H_NEW * 2 * 2  # heads x K/V x blocks
    if layout == "header":
        assert stats["runs_direct"] == runs
        assert stats["runs_parked"] == H_NEW * 2 * 2  # every run of the a/b swap is a cycle of 2
    else:
        assert stats["runs_direct"] == 0
    assert stats["bytes"] == len(items) * n * 2 * H_NEW * D * 4
    for (s, h), d in dest.items():
        k, v = new.gather(d, layer, 0, n)
        np.testing.assert_array_equal(k, expect[s][0][:, h:h + H_NEW])
        np.testing.assert_array_equal(v, expect[s][1][:, h:h + H_NEW])


def test_a_plan_of_another_layer_or_without_read_is_ignored():
    arena, old, new, other = caches()
    s = old.new_sequence()
    fill(old, s, 10, seed=3)
    d, o = new.new_sequence(), other.new_sequence()
    items = items_for(old, new, other, [s], [d], [o])
    stage = KVMoveStage()
    layer_move(items, 0).plan(stage)
    stage.read()
    stats = layer_move(items, 2).run(stage)  # planned layer 0, moving layer 2
    assert stats["bytes_early"] == 0 and stats["items_reused"] == 0
    layer_move(items, 2).plan(stage)         # planned, never read
    stats = layer_move(items, 2).run(stage)
    assert stats["bytes_early"] == 0
    np.testing.assert_array_equal(new.gather(d, 2)[0][:10], old.gather(s, 2)[0][:, :2])


def test_bad_items_are_refused_and_change_nothing():
    arena, old, new, other = caches()
    s = old.new_sequence()
    fill(old, s, 6, seed=4)
    d = new.new_sequence()
    new.reserve(d, 6)
    before = new.gather(d, 0)
    stage = KVMoveStage()
    bad = [
        (item(old, s, 3, 2, 6, new, d), "heads"),      # source heads [3, 5) of 4
        (item(old, s, 0, 2, 6, new, d, 1), "heads"),   # destination heads [1, 3) of 2
        (item(old, s, 0, 2, 99, new, d), "room"),      # more tokens than reserved
        (item(old, 42, 0, 2, 6, new, d), "does not exist"),
    ]
    for it, match in bad:
        with pytest.raises(gyges.Error, match=match):
            layer_move([it], 0).plan(stage)
        with pytest.raises(gyges.Error, match=match):
            layer_move([it], 0).run()
    with pytest.raises(gyges.Error, match="layer"):
        layer_move([item(old, s, 0, 2, 6, new, d)], L).run()
    with pytest.raises(TypeError):
        KVMove.item("x", new, src_seq=s, dst_seq=d)
    np.testing.assert_array_equal(new.gather(d, 0)[0], before[0])
    raw_arena = gyges.Arena(budget="4MiB", page_size="64KiB", n_slots=64)
    raw = gyges.KVCache(raw_arena, n_layers=1, n_kv_heads=2, head_dim=D, block_size=B, layout="raw")
    raw.grow(1)
    r = raw.new_sequence()
    raw.reserve(r, 4)
    with pytest.raises(gyges.Error, match="raw layout"):
        layer_move([item(raw, r, 0, 2, 4, raw, r)], 0).plan(stage)


# ---- plain moves (at-once transformations, PipeLive, KunServe) against a NumPy reference ----

def odd_cache(layout, heads, dtype="f32", stack=1, layers=4):
    """Blocks of 3 tokens of 5-value heads: sizes that line up with nothing."""
    arena = gyges.Arena(budget="4MiB", page_size="16KiB", n_slots=64)
    kv = gyges.KVCache(arena, n_layers=layers, n_kv_heads=heads, head_dim=5, block_size=3,
                       layout=layout, dtype=dtype, stack=stack, slots_per_layer=8)
    kv.grow(2 if stack == 1 else 1)
    rng = np.random.default_rng(heads + 7 * stack)
    for layer in range(layers):
        raw = kv.layer_raw(layer)
        raw[:] = rng.integers(0, 2**15, raw.size).astype(raw.dtype)
    return kv


def expected(src, dst, layers, pairs, heads, tokens, words=None):
    """dst's logical layers as they must be after the move: per pair (src block, dst block),
    heads (src_head, dst_head, n) of token slots [0, t) (with words: only the dirty ones)."""
    sh, dh, n = heads
    out = {}
    for layer in layers:
        want, have = dst.layer(layer).copy(), src.layer(layer)
        for j, (sb, db) in enumerate(pairs):
            for t in range(tokens[j]):
                slot = sb * src.block_size + t
                if words is None or words[slot // 64] >> np.uint64(slot % 64) & np.uint64(1):
                    want[:, db, t, dh:dh + n] = have[:, sb, t, sh:sh + n]
        out[layer] = want
    return out


@pytest.mark.parametrize("src_layout", ["raw", "page", "header"])
@pytest.mark.parametrize("dst_layout", ["raw", "page", "header"])
@pytest.mark.parametrize("kind", ["lists", "sequences", "dirty"])
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_plain_moves_match_the_reference(src_layout, dst_layout, kind, dtype):
    stack = 1 if dst_layout == "raw" else 2  # a stacked destination: k blocks apart
    src, dst = odd_cache(src_layout, 3, dtype), odd_cache(dst_layout, 4, dtype, stack=stack)
    src.reserve(src.new_sequence(), 5)       # block ids that differ between the caches
    s, d = src.new_sequence(), dst.new_sequence()
    src.reserve(s, 9)
    dst.reserve(d, 9)
    layers = range(1, 3)
    words = None
    if kind == "lists":
        sb, db = [7, 0, 4], [2, 5, 0]
        move = KVMove(layers).add(src, dst, sb, db, src_head=1, dst_head=2, n_heads=2)
        heads, tokens = (1, 2, 2), [3, 3, 3]
    else:
        sb, db = src.block_table(s), dst.block_table(d)
        words = np.zeros(2, np.uint64)
        for slot in (0, 4, 5, 8, 3 * sb[1] + 2, 3 * sb[2]):
            words[slot // 64] |= np.uint64(1) << np.uint64(slot % 64)
        n_tokens = 7 if kind == "sequences" else None
        move = KVMove(layers, dirty=words if kind == "dirty" else None).add(
            src, dst, src_seq=s, dst_seq=d, dst_head=1, n_tokens=n_tokens)
        heads, tokens = (0, 1, 3), [3, 3, 1] if kind == "sequences" else [3, 3, 3]
        words = words if kind == "dirty" else None
    want = expected(src, dst, layers, list(zip(sb, db)), heads, tokens, words)
    before = {layer: dst.layer(layer).copy() for layer in (0, 3)}
    stats = move.run()
    for layer in layers:
        np.testing.assert_array_equal(dst.layer(layer), want[layer])
    for layer in (0, 3):
        np.testing.assert_array_equal(dst.layer(layer), before[layer])
    assert stats["backend"] == "host" and stats["bytes_in_place"] == 0
    per_slot = 2 * heads[2] * 5 * src.storage_dtype.itemsize
    assert stats["bytes"] == stats["slots"] * per_slot * len(layers)


def test_moves_refuse_bad_arguments_and_change_nothing():
    src, dst = odd_cache("header", 3), odd_cache("header", 4)
    before = [dst.layer(layer).copy() for layer in range(4)]
    with pytest.raises(TypeError, match="gyges.KVCache"):
        KVMove(range(4)).add(src._c, dst, [0], [0])
    with pytest.raises(ValueError, match="2 destination blocks for 1 sources"):
        KVMove(range(4)).add(src, dst, [0], [0, 1])
    with pytest.raises(ValueError, match="range with step 1"):
        KVMove([0, 1])
    with pytest.raises(ValueError, match="two block lists or two sequences"):
        KVMove(range(4)).add(src, dst, [0], [0], src_seq=0, dst_seq=0)
    for move, match in [
        (KVMove(range(4)).add(src, dst, [0], [dst.n_blocks]), "not one of the cache's"),
        (KVMove(range(4)).add(src, dst, [0], [0], dst_head=2), "out of range"),
        (KVMove(range(2, 5)).add(src, dst, [0], [0]), "not held by both"),
        (KVMove(range(4)).add(src, dst, src_seq=9, dst_seq=0), "does not exist"),
        (KVMove(range(4)).add(src, odd_cache("header", 3, "f16"), [0], [0]), "value size"),
        (KVMove(range(4), dirty=np.zeros(1, np.uint64), dirty_slots=3).add(src, dst, [1], [1]),
         "past the bitmap"),
    ]:
        with pytest.raises(gyges.InvalidArgumentError if match != "does not exist"
                           else gyges.StateError, match=match):
            move.run()
    for layer in range(4):
        np.testing.assert_array_equal(dst.layer(layer), before[layer])
    with pytest.raises(TypeError, match="KVMoveStage"):
        KVMove(range(4)).run(stage=object())
    s, d = src.new_sequence(), dst.new_sequence()
    with pytest.raises(ValueError, match="first phase of an OVERLAP move"):
        KVMove(range(4)).add(src, dst, src_seq=s, dst_seq=d, n_tokens=0).plan(KVMoveStage())
