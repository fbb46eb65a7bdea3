"""Mechanism times derived from what the mechanisms move (gyges.cluster.mechanisms, issue 35):
each price equals its terms by hand, and lands where the seed paper's figure is under the paper's
setup, within the tolerance stated beside each check (the paper's figure is never an input)."""

import pytest

import gyges
from gyges import sim, traces
from gyges.cluster import links, mechanisms
from gyges.cluster.costmodel import RDMA_100G, RDMA_200G, CostModel, PipelineCost


def test_links_are_alpha_beta_by_hand():
    nv = links.NVLINK4
    assert nv.bw == 450e9 and nv.latency == pytest.approx(3.6e-6 + 0.47e-6)
    assert nv.transfer(1e9, 0.5) == pytest.approx(4.07e-6 + 1e9 / 225e9)
    # ring all-reduce over 4 ranks: 6 steps, each 1/4 of the message
    assert nv.allreduce(8e6, 4) == pytest.approx(3.6e-6 + 6 * 0.47e-6 + 1.5 * 8e6 / 450e9)
    assert nv.allreduce(8e6, 1) == 0.0 and nv.barrier(8) == pytest.approx(3.6e-6 + 14 * 0.47e-6)
    assert links.RDMA_100G.latency > links.PCIE4_X16.latency > nv.latency
    for bad in (dict(nbytes=-1.0), dict(nbytes=1.0, eff=0.0), dict(nbytes=1.0, eff=1.5)):
        with pytest.raises(gyges.InvalidArgumentError, match="nbytes|eff"):
            nv.transfer(**bad)
    with pytest.raises(gyges.InvalidArgumentError, match="ranks"):
        nv.allreduce(1.0, 0)
    with pytest.raises(gyges.InvalidArgumentError, match="kind"):
        links.Link("x", 1e9, "carrier-pigeon")


def test_flying_switch_is_its_terms_and_near_the_papers_15_ms():
    """Flying Serving Table 2 (Llama-3-70B on 8 H200, TP2 engines bound into TP8): 15 ms live.
    Ours: the switch (signal, barrier, view re-pointing) plus the wait for the step in flight,
    half a TP2 decode step of the cost model. Tolerance: a factor of two either way (the paper
    gives no breakdown and no load for its figure; the drain is only as good as the step
    model)."""
    cost = CostModel.create("llama3-70b", "h200")
    p = mechanisms.flying_switch(cost, 2, 8)
    assert p.terms["signal"] == pytest.approx(2 * 3 * links.HOST_MESSAGE)
    assert p.terms["barrier"] == pytest.approx(links.NVLINK4.barrier(8))
    assert p.terms["rebind"] == pytest.approx(80 * 5 * links.HOST_CALL)
    assert p.seconds == pytest.approx(sum(p.terms.values()))
    step = cost.step_time(2, **CostModel.batch_shape([(1024, 1, True)]))
    assert p.extra["drain"] == pytest.approx(step / 2)
    assert 0.015 / 2 <= p.as_measured <= 0.015 * 2
    assert p.seconds < 0.015 / 2      # the switch itself is a small part: nothing is copied
    # the simulator's default switch_time is the switch (its bind waits for the step itself)
    tr = traces.poisson(0.5, n=4, seed=1)
    res = sim.run(tr, policy="flying", weights="replicated", cost=cost, gpus_per_host=8)
    assert res.config["switch_time"] == pytest.approx(p.seconds)
    assert mechanisms.flying_switch(cost, 8, 2).seconds == pytest.approx(p.seconds)
    with pytest.raises(gyges.InvalidArgumentError, match="tp_to"):
        mechanisms.flying_switch(cost, 2, 3)


def test_loongserve_scale_is_a_flying_switch_without_the_rebind():
    """LoongServe's elastic instances keep whole replicas and a request's KV where it was made:
    a scale-up re-points nothing, so only the signal and the group's first collective."""
    cost = CostModel.create("qwen2.5-32b", "h20")
    p = mechanisms.loongserve_scale(cost, 2, 8)
    f = mechanisms.flying_switch(cost, 2, 8)
    assert p.terms == {"signal": f.terms["signal"], "barrier": f.terms["barrier"]}
    assert p.seconds == pytest.approx(f.seconds - f.terms["rebind"])
    assert p.extra["drain"] == pytest.approx(f.extra["drain"])


# PipeLive's testbed: Llama-3-70B (one-byte weights and KV) on an A100-80GB and an L40S on two
# servers over 100 Gb/s InfiniBand, tau = 50 tokens.
PIPE_IB = PipelineCost.create("llama3-70b", ["a100-80gb", "l40s"], dtype_bytes=1, eff_flops=0.6,
                              link_bw=RDMA_100G)


def test_pipelive_stop_is_its_terms_and_under_the_papers_10_ms():
    """PipeLive Fig. 13 / abstract: with KV patching the stop stays around and under 10 ms
    whatever the number of migrated layers; without it (stop-and-copy) it grows with them, to
    seconds. Ours: the lagging KV, the commit handshake, the table swaps. Check: under 10 ms, and
    the stop-and-copy of a full pipeline's live KV at least 10x longer and growing with the
    layers moved. Our stop is far below 10 ms (0.4 ms): the bytes and messages do not explain
    the paper's figure, which includes host coordination we do not price."""
    cur, tgt = (44, 36), (60, 20)
    p = mechanisms.pipelive_stop(PIPE_IB, cur, tgt)
    ib = mechanisms.stage_link(PIPE_IB)
    assert ib.bw == RDMA_100G and ib.kind == "net"
    assert p.terms["patch"] == pytest.approx(ib.transfer(50 * PIPE_IB.kv_layer * 16,
                                                         PIPE_IB.eff_xfer))
    assert p.terms["commit"] == pytest.approx(4 * ib.latency)
    assert p.terms["rebind"] == pytest.approx(16 * 2 * links.HOST_CALL)
    assert 0 < p.seconds < 0.010
    live = 0.9 * PIPE_IB.capacity(cur) * 16
    copy16 = mechanisms.pipelive_stop(PIPE_IB, cur, tgt, kv_tokens=live, stop_and_copy=True)
    copy30 = mechanisms.pipelive_stop(PIPE_IB, (30, 50), (60, 20), kv_tokens=live,
                                      stop_and_copy=True)
    assert copy16.seconds >= 10 * p.seconds and copy30.seconds > 1.5 * copy16.seconds
    # the simulator's stop is the derivation for a move of a quarter of the layers
    assert PIPE_IB.stop_seconds() == pytest.approx(
        mechanisms.pipelive_stop_layers(PIPE_IB, 20).seconds)
    assert PIPE_IB.params()["stop_time"] == PIPE_IB.stop_seconds()
    assert PIPE_IB.replace(stop_time=0.02).params()["stop_time"] == 0.02


def test_gyges_transformation_slowdown_is_its_terms_and_under_1_percent():
    """Gyges 6.2.3 / Fig. 11: with overlap a transformation costs a step less than 1%. Setup:
    Qwen2.5-32B on H20, 4xTP1 -> TP4 with 90% of the KV in use (6.2.1), one layer per step
    (the layer-by-layer transformation of 4.3). Ours: the migration's reads and writes taken
    from the memory-bound step's HBM bandwidth. Check: above 0 and below 1%; without overlap
    (the copy between the steps) several times more. Moving every layer in one step gives
    about 5.6%: above the paper's < 1%, which does not state the KV in use for that point."""
    cost = CostModel.create("qwen2.5-32b", "h20")
    p = mechanisms.transform_slowdown(cost, 1, 4, layers_per_step=1)
    kv = 0.9 * cost.max_tokens(1) * 4
    per_gpu = cost.phase_time("kv_scatter", 1, 4, kv)[1] / 64
    step = cost.step_time(1, **CostModel.batch_shape([(1024, 1, True)] * 32))
    assert p.terms["hbm"] == pytest.approx(2 * per_gpu / (cost.gpu.hbm_bw * cost.eff_bw) / step)
    assert p.terms["link"] == 0.0           # TP1 instances have no all-reduce to slow
    assert 0.0001 < p.seconds < 0.01
    assert p.extra["serial"] > 3 * p.seconds
    # a TP4 instance splitting: its all-reduce shares the link with the migration
    down = mechanisms.transform_slowdown(cost, 4, 1, layers_per_step=1)
    assert down.terms["link"] > 0
    # the simulator's default: the KV phase of the first merge (TP1 -> TP2), spread over it
    avg = mechanisms.transform_slowdown(cost, 1, 2)
    phase, nbytes = cost.phase_time("kv_scatter", 1, 2, 0.9 * cost.max_tokens(1) * 2)
    assert avg.terms["hbm"] == pytest.approx(2 * nbytes / phase / (cost.gpu.hbm_bw * cost.eff_bw))
    assert cost.slowdown() == pytest.approx(avg.seconds)
    assert cost.params()["transform_slowdown"] == cost.slowdown()
    assert 0 < cost.slowdown() < 0.05
    assert cost.replace(transform_slowdown=0.1).params()["transform_slowdown"] == 0.1


def test_seesaw_moves_the_kv_through_host_memory_and_gyges_saves_97_percent_of_it():
    """Gyges 6.2.3 / Figure 11: moving every layer in one step, Gyges' extra cost is 97.2% below
    Seesaw's, which migrates the KV through CPU shared memory (up to 41x). Ours: each GPU's KV
    out to host memory and its new share back over PCIe 5 (H20), as a fraction of the decode
    step; Gyges' every-layer slowdown with overlap is 95% to 99.5% below it, and without overlap
    (Gyges-) still over 10x below."""
    cost = CostModel.create("qwen2.5-32b", "h20")
    p = mechanisms.seesaw_reshard(cost, 1, 4)
    kv = 0.9 * cost.max_tokens(1) * 4 * cost.model.kv_bytes_per_token(2, 1) / 4
    step = cost.step_time(1, **CostModel.batch_shape([(1024, 1, True)] * 32))
    one_way = kv / (links.PCIE5_X16.bw * cost.eff_xfer) / step
    assert p.terms == pytest.approx({"offload": one_way, "reload": one_way})
    assert links.host_link(cost.gpu) is links.PCIE5_X16
    ours = mechanisms.transform_slowdown(cost, 1, 4, layers_per_step=64)
    assert 0.95 < 1 - ours.seconds / p.seconds < 0.995
    assert p.seconds > 10 * ours.extra["serial"]
    half = mechanisms.seesaw_reshard(cost, 1, 4, layers=32)
    assert half.seconds == pytest.approx(p.seconds / 2)
    with pytest.raises(gyges.InvalidArgumentError, match="layers"):
        mechanisms.seesaw_reshard(cost, 1, 4, layers=65)


def test_kunserve_exchange_is_its_bytes_and_near_the_papers_1_3_s():
    """KunServe 4.2: a drop on Qwen-2.5-14B over 200 Gb/s GPU-direct RDMA exchanges 33 GB of KV
    between two GPUs in 1.3 s. Ours: each member sends the half of its KV whose layers it
    dropped, both directions at once, at eff_xfer of the link. Tolerance 35%: the paper's
    figure is the total over one direction's line rate (33 GB / 25 GB/s); ours sends the halves
    at once at 70% of it (0.94 s)."""
    pc = PipelineCost.create("qwen2.5-14b", ["a800-80gb"] * 2, link_bw=RDMA_200G)
    tokens = 33e9 / (2 * pc.kv_layer * 24)        # each member's live tokens
    p = mechanisms.kunserve_exchange(pc, [tokens, tokens])
    half = tokens * pc.kv_layer * 24
    assert 2 * half == pytest.approx(33e9)
    assert p.terms["bytes"] == pytest.approx(half / (RDMA_200G * pc.eff_xfer))
    assert p.seconds == pytest.approx(1.3, rel=0.35)
    with pytest.raises(gyges.InvalidArgumentError, match="buddy group"):
        mechanisms.kunserve_exchange(pc, [tokens])
    with pytest.raises(gyges.InvalidArgumentError, match="PipelineCost"):
        mechanisms.kunserve_exchange(CostModel.create("qwen2.5-14b", "h20"), [1, 1])
