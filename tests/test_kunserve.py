"""KunServe's buddy-group plans (gyges.kunserve, csrc/policy/buddy.c): Algorithm 1's cases from the
issue, the memory-greedy variant, an independent reference on random inputs, and refusals."""
import random

import numpy as np

import pytest

import gyges
from gyges.cluster import buddy_plan

P = 10.0


def test_algorithm_1_cases():
    p = buddy_plan.plan(8, P, P)
    assert p.groups == ((0, 1), (2,), (3,), (4,), (5,), (6,), (7,)) and p.met and p.freed == P
    p = buddy_plan.plan(8, 5 * P, P)
    assert sorted(len(g) for g in p.groups) == [2, 2, 4] and p.met and p.freed == 5 * P
    assert p.groups == ((0, 1, 2, 3), (4, 5), (6, 7))
    p = buddy_plan.plan(8, 0, P)
    assert p.groups == tuple((j,) for j in range(8)) and p.met and p.freed == 0
    p = buddy_plan.plan(8, 8 * P, P)  # one group of all 8 frees 7 P: unmet, flagged
    assert p.groups == (tuple(range(8)),) and not p.met and p.freed == 7 * P
    assert buddy_plan.plan(1, P, P).met is False


def test_memory_greedy_grows_one_group_within_the_kv_region():
    p = buddy_plan.plan(8, 3 * P, P, strategy="memory")
    assert p.groups == ((0, 1, 2, 3), (4,), (5,), (6,), (7,)) and p.met
    p = buddy_plan.plan(8, 6 * P, P, strategy="memory", kv_bytes=4.5 * P)  # stops at 4 P freed
    assert p.groups[0] == (0, 1, 2, 3, 4) and not p.met and p.freed == 4 * P


def reference_throughput(n, required, param):
    """Algorithm 1 with groups kept as neighbouring ranges: merge the adjacent pair with the
    smallest larger member, then the smallest sum, leftmost first."""
    sizes = [1] * n
    freed = 0.0
    while len(sizes) > 1 and freed < required:
        k = min(range(len(sizes) - 1),
                key=lambda i: (max(sizes[i], sizes[i + 1]), sizes[i] + sizes[i + 1], i))
        sizes[k:k + 2] = [sizes[k] + sizes[k + 1]]
        freed += param
    return sizes, freed


def test_throughput_greedy_matches_a_reference_on_random_inputs():
    rng = random.Random(5)
    for _ in range(300):
        n = rng.randint(1, 40)
        required = rng.uniform(0, 45) * P
        p = buddy_plan.plan(n, required, P)
        sizes, freed = reference_throughput(n, required, P)
        assert [len(g) for g in p.groups] == sizes and p.freed == freed
        assert p.met == (freed >= required)
        assert [j for g in p.groups for j in g] == list(range(n))  # every instance once
        # the largest group is at most twice the smallest or the pairs it came from
        assert p.freed == sum(len(g) - 1 for g in p.groups) * P


@pytest.mark.parametrize("kwargs, match", [
    (dict(n_instances=0, required_bytes=1, param_bytes=1), "n_instances"),
    (dict(n_instances=4, required_bytes=-1, param_bytes=1), "required_bytes"),
    (dict(n_instances=4, required_bytes=1, param_bytes=0), "param_bytes"),
    (dict(n_instances=4, required_bytes=1, param_bytes=1, strategy="fast"), "strategy"),
    (dict(n_instances=4, required_bytes=1, param_bytes=1, kv_bytes=0), "kv_bytes"),
])
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(gyges.InvalidArgumentError, match=match):
        buddy_plan.plan(**kwargs)


def test_the_kunserve_policy_drops_under_a_burst_and_restores_after():
    """At paper scale in the simulator (8 A800, qwen2.5-14b, 200 Gbps RDMA): a burst of long
    outputs drives the KV demand past memory, the policy forms buddy groups (victims move in with
    their KV) and, the burst over, restores them; every request completes and the cluster ends as
    replicas. (Its P99 TTFT is not below replication's under our cost model yet: a g-stage group
    with one batch in flight has one GPU's throughput, so this asserts only the mechanism.)"""
    from gyges import costmodel, sim, traces
    cost = costmodel.PipelineCost.create("qwen2.5-14b", ["a800-80gb"] * 8,
                                         link_bw=costmodel.RDMA_200G)
    trace = traces.burst(8, 300, at=100, factor=14, length=10, seed=1,
                         output_tokens=traces.lognormal_lengths(1000, cap=4096))
    res = sim.run(trace, policy="kunserve", weights="buddy", cost=cost, sample_interval=0.5)
    assert res.summary()["completed"] == len(trace)
    assert res.stats["drops"] >= 1 and res.stats["restores"] == res.stats["drops"]
    assert res.stats["victims"] > 0 and res.stats["exchange_bytes"] > 0
    calm = sim.run(trace[trace["arrival"] < 90], policy="kunserve", weights="buddy", cost=cost,
                   sample_interval=0.5)
    assert calm.stats["drops"] == 0  # before the burst the replicas hold the demand


def test_a_request_no_replica_holds_is_served_by_a_group_dropped_for_it():
    """Gyges 6.2.4's 50K prompts on 8 H20 serving Qwen2.5-32B: no replica holds one (its KV
    room is 27K tokens), a buddy group of two does. KunServe drops the least-loaded pair for
    each that no group holds yet and serves it there; replication (least load over the same
    replicas) can only reject them. Asked once the group stands, a request already waiting for
    it is not dropped a second group."""
    from gyges import sim, traces
    from gyges.cluster.costmodel import RDMA_200G, PipelineCost
    cost = PipelineCost.create("qwen2.5-32b", ["h20"] * 8, link_bw=RDMA_200G, micro_batches=None)
    tr = traces.gyges_mixed(300, seed=0)
    long = tr["input_tokens"] == 50_000
    res = sim.run(tr, policy="kunserve", weights="buddy", cost=cost, check=True)
    q = res.requests
    assert res.summary()["rejected"] == 0 and (q["status"] == 3).all()
    assert (q["min_tp"][long] == 0).all()   # (no replica holds them)
    assert res.stats["drops"] >= 1 and res.stats["ops_refused"] == 0
    replicas = sim.run(tr, policy="least_load", weights="buddy", cost=cost)
    assert (replicas.requests["status"][long] == 4).all()   # rejected
    assert (replicas.requests["status"][~long] == 3).all()


def burst_of_long_outputs(seconds=200):
    from gyges import traces
    return traces.burst(4, seconds, at=60, factor=3, length=40, seed=1,
                        input_tokens=traces.lognormal_lengths(1000),
                        output_tokens=traces.lognormal_lengths(3000, cap=8192))


def test_swapping_preempted_kv_prices_both_ways_and_beats_recomputing():
    """KunServe's KV-swap baseline (sim.run swap_bw): replicas that preempt under a burst move
    the victims' KV to host memory and back. Every byte that goes out comes back, the steps pay
    exactly those bytes over the GPUs' PCIe, the scheduler's preemptions are the same kind of
    event, and tail latency beats recomputing (the KV of long outputs is cheaper to move than
    to compute again); without preemptions it changes nothing."""
    from gyges import costmodel, sim
    cost = costmodel.PipelineCost.create("qwen2.5-14b", ["a800-80gb"] * 8,
                                         link_bw=costmodel.RDMA_200G)
    tr = burst_of_long_outputs()
    recompute = sim.run(tr, policy="least_load", weights="buddy", cost=cost, check=True)
    swap = sim.run(tr, policy="least_load", weights="buddy", cost=cost, swap_bw=25e9, check=True)
    assert recompute.stats["preemptions"] > 0 and swap.stats["preemptions"] > 0
    assert recompute.stats["swap_out_bytes"] == recompute.stats["swap_s"] == 0
    out, back = swap.stats["swap_out_bytes"], swap.stats["swap_in_bytes"]
    token = cost.kv_layer * cost.n_layers
    assert out > 0 and back == out and (out / token) == round(out / token)
    assert swap.stats["swap_s"] == pytest.approx((out + back) / 25e9)  # replicas: one GPU each
    assert swap.summary()["completed"] == recompute.summary()["completed"] == len(tr)
    assert swap.summary()["ttft_p99"] < recompute.summary()["ttft_p99"]
    calm = tr[tr["arrival"] < 50]
    a = sim.run(calm, policy="least_load", weights="buddy", cost=cost)
    b = sim.run(calm, policy="least_load", weights="buddy", cost=cost, swap_bw=25e9)
    assert a.stats["preemptions"] == 0 and b.stats["swap_s"] == 0
    np.testing.assert_array_equal(a.requests, b.requests)


@pytest.mark.parametrize("kwargs, match", [
    (dict(swap_bw=0), "swap_bw"), (dict(swap_bw=float("nan")), "swap_bw"),
    (dict(swap_bw=1e9, cost="constant"), "CostModel or PipelineCost")])
def test_swap_arguments_are_named(kwargs, match):
    from gyges import costmodel, sim
    if kwargs.get("cost") == "constant":
        kwargs["cost"] = costmodel.ConstantCost()
    with pytest.raises(sim.SimError, match=match):
        sim.run(burst_of_long_outputs(20), policy="least_load", **kwargs)


def test_llumnix_migrates_from_the_replica_whose_demand_is_highest():
    """The migration baseline's rule on hand-built views: the running replica whose requests'
    KV demand (footprint / kv_total) is furthest beyond its memory sends one request to the
    replica with the lowest demand; nothing moves while no replica is over-committed or the
    gap is small."""
    from gyges.cluster import Policy, View
    p = Policy("llumnix")

    def view(*footprints):
        return View.of([dict(gpu_first=g, tp=1, kv_total=100, footprint=f, n_running=3)
                        for g, f in enumerate(footprints)], [100], max_tp=1)
    assert p.rebalance(view(150, 30, 60, 90)).ops == (("migrate", 0, 1, 1),)
    assert p.rebalance(view(60, 90, 130, 20)).ops == (("migrate", 2, 1, 3),)
    assert p.rebalance(view(95, 30, 60, 90)).ops == ()     # nobody over-committed
    assert p.rebalance(view(120, 110, 105, 101)).ops == ()  # nowhere with room


def test_llumnix_migrates_live_and_loses_nothing_but_kunserve_beats_it_on_a_memory_burst():
    """KunServe's migration baseline in the simulator: under a burst of long outputs requests
    move live between replicas with their KV (priced over the link), every request completes,
    the invariants hold, and buddy groups still give the lower tail TTFT (KunServe Fig. 10:
    migration cannot create memory when every replica is full)."""
    from gyges import costmodel, sim
    cost = costmodel.PipelineCost.create("qwen2.5-14b", ["a800-80gb"] * 8,
                                         link_bw=costmodel.RDMA_200G, micro_batches=None)
    tr = burst_of_long_outputs(300)
    res = sim.run(tr, policy="llumnix", weights="buddy", cost=cost, check=True)
    moved = res.stats["live_migrations"]
    assert moved > 0 and res.summary()["completed"] == len(tr)
    assert res.requests["migrations"].sum() >= moved
    token = cost.kv_layer * cost.n_layers
    assert res.stats["migrate_bytes"] > 0 and \
        res.stats["migrate_bytes"] / token == round(res.stats["migrate_bytes"] / token)
    kun = sim.run(tr, policy="kunserve", weights="buddy", cost=cost)
    assert kun.summary()["ttft_p99"] < res.summary()["ttft_p99"]
    with pytest.raises(sim.SimError, match="weights='buddy'"):
        sim.run(tr, policy="llumnix")
    from gyges import experiment
    with pytest.raises(experiment.ExperimentError, match="simulate it"):
        experiment.run(tr[:4], policy="llumnix")


def test_without_live_restore_a_group_finishes_its_requests_before_it_dissolves():
    """KunServe Fig. 15's baseline (live_restore=False): a restore brings the weights back but
    gathers no KV; the group serves its requests as a pipeline until the last has finished, so
    its restores last longer and move only weights."""
    from gyges import costmodel, sim
    cost = costmodel.PipelineCost.create("qwen2.5-14b", ["a800-80gb"] * 8,
                                         link_bw=costmodel.RDMA_200G)
    tr = burst_of_long_outputs(300)
    live = sim.run(tr, policy="kunserve", weights="buddy", cost=cost, check=True)
    drain = sim.run(tr, policy="kunserve", weights="buddy", cost=cost, live_restore=False,
                    check=True)
    for res in (live, drain):
        assert res.summary()["completed"] == len(tr)
        assert res.stats["restores"] == res.stats["drops"] >= 1
    restores = [r.transformations[r.transformations["kind"] == 8] for r in (live, drain)]
    took = [float(np.mean(x["end"] - x["start"])) for x in restores]
    assert took[1] > took[0]
    assert drain.stats["restore_bytes"] < live.stats["restore_bytes"]  # no KV gathered
