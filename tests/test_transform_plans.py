"""The pure plans of a transformation (gyges/transform/plans.py), without a host: rank maps keep
a subset of each worker's heads, the balance spreads KV, and the phased all-to-all plan,
replayed block by block against a model of every worker's blocks, never writes into a block
that still holds KV nobody has read, gives every request a complete table of distinct blocks,
and maps no more than one round's extra."""
import random

import pytest

from gyges.reconfig import TransformError
from gyges.reconfig.plans import MergePlan, SplitPlan, balance, chunk, plan_all_to_all


def test_merge_ranks_keep_a_subset_of_each_workers_heads():
    for t, k in ((1, 2), (1, 4), (2, 4), (1, 8), (2, 8), (4, 8)):
        m = k // t
        old = [tuple(range(j * t, (j + 1) * t)) for j in range(m)]
        plan = MergePlan.of(old, 0, k)
        assert plan.m == m and sorted(plan.rank_order) == list(range(k))
        H = 8  # KV heads: old rank r of TPt holds [r*H/t, (r+1)*H/t), new rank q of TPk [q*H/k, ...)
        for j, workers in enumerate(old):
            for r, w in enumerate(workers):
                q = plan.new_rank[w]
                new_heads = set(range(q * H // k, (q + 1) * H // k))
                assert new_heads <= set(range(r * H // t, (r + 1) * H // t))
                assert q % m == j  # its sub-group of the old heads is its instance's index


def test_merge_and_split_plans_refuse_what_cannot_be_done():
    with pytest.raises(TransformError, match="one TP degree"):
        MergePlan.of([(0,), (1, 2), (3,)], 0, 4)
    with pytest.raises(TransformError, match="not exactly covered"):
        MergePlan.of([(0,), (1,), (2,)], 0, 4)
    with pytest.raises(TransformError, match="not exactly covered"):
        MergePlan.of([(0,), (1,), (2,), (5,)], 0, 4)
    with pytest.raises(TransformError, match="smaller divisor"):
        SplitPlan.of((0, 1, 2, 3), 0, 4, 3)
    with pytest.raises(TransformError, match="smaller divisor"):
        SplitPlan.of((0, 1), 0, 2, 2)


def test_split_plan_gathers_each_new_rank_from_m_old_ranks():
    plan = SplitPlan.of((0, 1, 2, 3), 0, 4, 2)
    assert plan.m == 2 and plan.instance_workers(1) == [2, 3]
    assert plan.new_ranks == [((0, 0), 0), ((0, 1), 1), ((1, 0), 2), ((1, 1), 3)]


def test_balance_spreads_blocks_largest_first():
    target, load = balance([(0, 100), (1, 10), (2, 60), (3, 50), (4, 0)], 2, 16)
    assert load == [8, 8] and sorted(target) == [0, 1, 2, 3, 4]
    assert target[0] != target[2] and target[2] == target[3]


def test_chunk_covers_a_list_in_order():
    items = list(range(10))
    for chunks in (1, 3, 4, 10, 12):
        assert sum((chunk(items, c, chunks) for c in range(chunks)), []) == items


def _replay(plan, tables, n_blocks, mapped, a2a):
    """Replays the rounds on a model of each worker's blocks (in the new geometry): which
    (request, index, sub-group) each holds. Asserts that a round writes only into blocks whose
    content has been read or was never needed, and returns the final contents."""
    m = plan.m
    holds = {}  # (worker, block) -> (rid, i, g) still to be read or kept
    for (j, r), reqs in tables.items():
        w = plan.worker_of(j, r)
        for rid, tab in reqs:
            for i, b in enumerate(tab):
                for g in range(m):
                    holds[(w, m * b + g)] = (rid, i, g)
    for rnd in sorted(a2a.rounds):
        writes = []
        for (src, dst), (src_blocks, dst_blocks) in a2a.rounds[rnd].items():
            j_dst = plan.new_rank[dst] % m
            for b, d in zip(src_blocks, dst_blocks):
                got = holds.get((src, m * b + j_dst))
                assert got is not None and got[2] == j_dst, (rnd, src, dst, b)
                writes.append(((dst, d), (got[0], got[1], "moved")))
                holds.pop((src, m * b + j_dst))  # read: that sub-block is free after the round
        for key, value in writes:
            assert key not in holds, f"round {rnd} overwrites {holds.get(key)} at {key}"
        for key, value in writes:
            holds[key] = value
    return holds


@pytest.mark.parametrize("t,k", [(1, 2), (1, 4), (2, 4), (1, 8)])
@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_all_to_all_plan_is_safe_and_complete(t, k, chunks):
    rng = random.Random(t * 100 + k * 10 + chunks)
    m = k // t
    old = [tuple(range(j * t, (j + 1) * t)) for j in range(m)]
    plan = MergePlan.of(old, 0, k)
    for trial in range(20):
        n_old = rng.randint(1, 12)
        tables, n_blocks, mapped, rid = {}, {}, {}, 0
        for j in range(m):
            free = list(range(n_old))
            rng.shuffle(free)
            reqs = []
            while free and rng.random() < 0.8:
                take = rng.randint(1, min(3, len(free)))
                reqs.append((rid, [free.pop() for _ in range(take)]))
                rid += 1
            for r in range(t):  # every rank of an instance holds the same tables
                tables[(j, r)] = reqs
                n_blocks[old[j][r]] = n_old
                mapped[old[j][r]] = m * n_old + rng.randint(0, 2)
        a2a = plan_all_to_all(plan, tables, n_blocks, mapped, chunks)
        holds = _replay(plan, tables, n_blocks, mapped, a2a)
        for w in plan.rank_order:
            j_w = plan.new_rank[w] % m
            r_w = plan.new_rank[w] // m
            blocks = [b for tab in a2a.dest[w].values() for b in tab]
            assert None not in blocks and len(blocks) == len(set(blocks))
            assert a2a.end_block[w] >= mapped[w] and max(blocks, default=0) < a2a.end_block[w]
            for j in range(m):  # every request of the group, with its sub-group j_w
                for rid, tab in tables[(j, r_w)]:
                    dest = a2a.dest[w][rid]
                    assert len(dest) == len(tab)
                    for i, d in enumerate(dest):
                        got = holds[(w, d)]
                        assert got[:2] == (rid, i) and (got[2] == j_w if j == j_w else got[2] == "moved")
            # Extra blocks: at most what one round receives (the first rounds).
            biggest = max((len(dst) for rnd in a2a.rounds.values()
                           for (s, d), (_, dst) in rnd.items() if d == w), default=0)
            assert a2a.end_block[w] - mapped[w] <= biggest
