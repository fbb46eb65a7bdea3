"""The KV mover (csrc/kv/kv_mover.h): a layer read early beside a step, then patched and written,
must land exactly as a one-shot move of the caches as they are at the end; planned items that
changed in between (more tokens, a freed and remade sequence) must be noticed."""
import numpy as np
import pytest

import gyges
from gyges import _C

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


def items_for(old, new, other, src_seqs, dst_seqs, other_seqs):
    """Heads [0, 2) of each old sequence to `new`, heads [2, 4) to `other`."""
    items = []
    for s, d, o in zip(src_seqs, dst_seqs, other_seqs):
        n = old.n_tokens(s)
        for kv, seq, h in ((new, d, 0), (other, o, 2)):
            kv.reserve(seq, n)
            items.append((old._c, s, h, H_NEW, n, kv._c, seq, 0))
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
    mover = _C.KVMover()
    layer = 1
    mover.plan(items_for(old, new, other, src, dst, oth), layer)
    mover.read()
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
    stats = mover.finish(items_for(old, new, other, src, dst, oth), layer)
    assert stats["items_reused"] == 4       # sequences 0 and 2, two items each
    assert stats["items_stale"] == 2        # the remade sequence's two items
    per_token = 2 * H_NEW * D * 4
    planned = (5 + 19) * 2 * per_token      # tokens read early and still valid
    assert stats["bytes_early"] == planned
    assert stats["bytes_moved"] == sum(old.n_tokens(s) for s in src) * 2 * per_token
    assert stats["bytes_late"] == stats["bytes_moved"] - planned
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
    mover = _C.KVMover()
    if early:
        mover.plan(items_for(old, new, other, src, dst, oth), layer)
        mover.read()
    # The first sequence grows from 9 to 14 tokens: tokens 9..11 fill its third block (in place),
    # tokens 12 and 13 go to a fourth block, which the shadow takes from its free list.
    fill(old, src[0], 5, seed=30, start=old.n_tokens(src[0]))
    new.reserve(dst[0], old.n_tokens(src[0]))
    grown = old.n_tokens(src[0]) - 3 * B        # tokens in the fourth block: they move
    in_place += 3 * B - 9
    expect = {s: old.gather(s, layer) for s in src}
    stats = mover.finish(items_for(old, new, other, src, dst, oth), layer)
    per_token = 2 * H_NEW * D * 4
    total = sum(old.n_tokens(s) for s in src) * 2 * per_token
    assert stats["bytes_in_place"] == in_place * per_token
    assert stats["bytes_moved"] == total - in_place * per_token
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
    items = [(old._c, s, h, H_NEW, n, new._c, d, 0) for (s, h), d in dest.items()]
    stats = _C.KVMover().finish(items, layer)
    runs = len(items) * H_NEW * 2 * 2  # heads x K/V x blocks
    if layout == "header":
        assert stats["runs_direct"] == runs
        assert stats["runs_parked"] == H_NEW * 2 * 2  # every run of the a/b swap is a cycle of 2
    else:
        assert stats["runs_direct"] == 0
    assert stats["bytes_moved"] == len(items) * n * 2 * H_NEW * D * 4
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
    mover = _C.KVMover()
    mover.plan(items, 0)
    mover.read()
    stats = mover.finish(items, 2)  # planned layer 0, moving layer 2
    assert stats["bytes_early"] == 0 and stats["items_reused"] == 0
    mover.plan(items, 2)            # planned, never read
    stats = mover.finish(items, 2)
    assert stats["bytes_early"] == 0
    np.testing.assert_array_equal(new.gather(d, 2)[0][:10], old.gather(s, 2)[0][:, :2])


def test_bad_items_are_refused_and_change_nothing():
    arena, old, new, other = caches()
    s = old.new_sequence()
    fill(old, s, 6, seed=4)
    d = new.new_sequence()
    new.reserve(d, 6)
    before = new.gather(d, 0)
    mover = _C.KVMover()
    bad = [
        ((old._c, s, 3, 2, 6, new._c, d, 0), "heads"),      # source heads [3, 5) of 4
        ((old._c, s, 0, 2, 6, new._c, d, 1), "heads"),      # destination heads [1, 3) of 2
        ((old._c, s, 0, 2, 99, new._c, d, 0), "room"),      # more tokens than reserved
        ((old._c, 42, 0, 2, 6, new._c, d, 0), "does not exist"),
    ]
    for item, match in bad:
        with pytest.raises(gyges.Error, match=match):
            mover.plan([item], 0)
        with pytest.raises(gyges.Error, match=match):
            mover.finish([item], 0)
    with pytest.raises(gyges.Error, match="layer"):
        mover.finish([(old._c, s, 0, 2, 6, new._c, d, 0)], L)
    with pytest.raises(TypeError):
        mover.finish([("x", s, 0, 2, 6, new._c, d, 0)], 0)
    np.testing.assert_array_equal(new.gather(d, 0)[0], before[0])
    raw_arena = gyges.Arena(budget="4MiB", page_size="64KiB", n_slots=64)
    raw = gyges.KVCache(raw_arena, n_layers=1, n_kv_heads=2, head_dim=D, block_size=B, layout="raw")
    raw.grow(1)
    r = raw.new_sequence()
    raw.reserve(r, 4)
    with pytest.raises(gyges.Error, match="raw layout"):
        mover.plan([(raw._c, r, 0, 2, 4, raw._c, r, 0)], 0)
