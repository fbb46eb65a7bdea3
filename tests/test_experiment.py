"""gyges.experiment: the simulator's C policies driving a real gyges.Host (issue 5, sections 3-6).

The policy wrapper is checked on hand-built views against the rules of csrc/policy/policy_*.c; the
replay on small traces (tiny model, 4 CPU workers of 24 MiB: a TP1 instance holds 60 blocks of
16 tokens, TP2 264, TP4 672) for request accounting, transformations and refusals."""
import math

import numpy as np
import pytest

import gyges
from gyges import experiment, sim, traces
from gyges.cluster.costmodel import ConstantCost
from gyges.cluster import POLICIES, Policy, PolicyError, View
from gyges.cluster.experiment import ExperimentError
from gyges.cluster.results import Results

CAP = [56, 256, 656]  # KV blocks of a fresh TP1, TP2, TP4 instance at 24 MiB per worker
# (weights in runs of their own per layer, embedding and head: 3 pages more than one packed run)


@pytest.fixture(scope="module")
def model():
    return gyges.Model.tiny()


def host_of(model, layout="4xTP1", memory="24MiB"):
    return gyges.Host(model, workers=4, memory_per_worker=memory, layout=layout)


def mixed(n_short=10, longs=(4,), long_prompt=1200, span=2.0, seed=0):
    """Short requests (24-120 prompt tokens, 4-12 output) spread over `span` seconds; the
    requests at the indices in `longs` get `long_prompt` tokens (more than a TP1 instance)."""
    rng = np.random.default_rng(seed)
    arrival = np.sort(rng.uniform(0, span, n_short))
    inp = rng.integers(24, 120, n_short)
    out = rng.integers(4, 12, n_short)
    for k in longs:
        inp[k] = long_prompt
    return traces.from_arrays(arrival, inp, out)


def check_accounting(res, trace):
    """Every request finished or was rejected exactly once, with exactly its output tokens."""
    r = res.requests
    assert r.size == trace.size
    assert set(np.unique(r["status"]).tolist()) <= {3, 4}
    done = r["status"] == 3
    assert np.all(np.isfinite(r["finish"][done])) and np.all(np.isnan(r["finish"][~done]))
    assert np.all(np.isnan(r["scheduled"][~done]))
    per_request = np.bincount(res.tokens["request"], minlength=r.size)
    assert np.array_equal(per_request[done], trace["output_tokens"][done])
    assert np.all(per_request[~done] == 0)
    assert np.all(r["first_token"][done] >= r["arrival"][done])
    assert np.all(r["finish"][done] >= r["first_token"][done])
    s = res.summary()
    assert s["completed"] + s["policy_rejected"] == trace.size
    assert res.stats["n_finished"] == s["completed"]


# ---- the policies on hand-built views ----------------------------------------------------------

def four_tp1(**extra):
    rows = [dict(gpu_first=g, tp=1, kv_total=CAP[0]) for g in range(4)]
    for g, fields in extra.items():
        rows[int(g[1:])].update(fields)
    return View.of(rows, CAP)


def test_static_places_on_least_loaded_and_rejects_what_fits_nowhere():
    p = Policy("static")
    v = four_tp1(g0=dict(pending_prefill=500), g1=dict(pending_prefill=10),
                 g2=dict(pending_prefill=300), g3=dict(pending_prefill=200))
    d = p.place(v, prompt=100, output=10)
    assert (d.action, d.target, d.ops) == ("place", 1, ())
    d = p.place(v, prompt=1200, output=10)  # 76 blocks > 60: no TP1 instance holds it
    assert d.action == "reject"
    assert not p.rebalances


def test_gyges_defers_a_long_request_on_a_pair_and_merges_it():
    p = Policy("gyges", merge_wait=0.0, light_load=0, idle_load=0)  # the paper's rules
    d = p.place(four_tp1(), prompt=1200, output=10)
    assert d.action == "defer" and d.group[1] == 2 and d.group[0] % 2 == 0
    assert d.ops == (("merge", d.group[0], 2),)
    # the group merged: the deferred request is placed there
    rows = [dict(gpu_first=0, tp=2, kv_total=CAP[1]), dict(gpu_first=2, tp=1, kv_total=CAP[0]),
            dict(gpu_first=3, tp=1, kv_total=CAP[0])]
    d2 = p.place(View.of(rows, CAP, pending=[(0, 2)]), prompt=1200, output=10, deferred=True,
                 group=(0, 2))
    assert (d2.action, d2.target) == ("place", 0)
    # a TP2 instance that no request needs is held, then split once its KV is free
    d3 = p.rebalance(View.of(rows, CAP))
    assert d3.ops == (("hold", 0, 2), ("split", 0, 2))


def test_gyges_waits_for_the_group_to_drain_before_merging():
    p = Policy("gyges", merge_wait=5.0)
    v = four_tp1(g0=dict(n_requests=2), g1=dict(n_requests=1), g2=dict(n_requests=3),
                 g3=dict(n_requests=1))
    v.now = 1.0
    d = p.place(v, prompt=1200, output=10, arrival=0.5)
    assert d.action == "defer" and d.group[1] == 2 and d.ops == ()  # not drained, not late
    v.now = 6.0
    d = p.place(v, prompt=1200, output=10, arrival=0.5, deferred=True, group=d.group)
    assert d.ops == (("merge", d.group[0], 2),)  # merge_wait passed: merge anyway


def test_gyges_latency_mode_merges_idle_pairs_and_keeps_them_under_load():
    p = Policy("gyges", idle_load=100, light_load=1000)
    assert p.config["idle_load"] == 100 and p.config["light_load"] == 1000 and p.monitors
    assert not Policy("static").monitors and not Policy("least_load").monitors
    # idle: the pairs merge; 2 x 200 prompt tokens per GPU: base TP2, pairs still merge
    assert p.rebalance(four_tp1()).ops == (("merge", 0, 2), ("merge", 2, 2))
    busy = four_tp1(g0=dict(pending_prefill=800))
    assert p.rebalance(busy).ops == (("merge", 0, 2), ("merge", 2, 2))
    # past light_load (4 GPUs x 1000 tokens) TP1 stays
    assert p.rebalance(four_tp1(g0=dict(pending_prefill=4001))).ops == ()
    # a TP2 at 300 tokens per GPU stays a TP2 (< 4 x idle_load keeps even a TP4)...
    rows = [dict(gpu_first=0, tp=2, kv_total=CAP[1], pending_prefill=1200),
            dict(gpu_first=2, tp=2, kv_total=CAP[1])]
    assert p.rebalance(View.of(rows, CAP)).ops == ()
    # ... and is held and split past 4 x light_load
    rows[0]["pending_prefill"] = 16004
    assert p.rebalance(View.of(rows, CAP)).ops == (("hold", 0, 2), ("split", 0, 2),
                                                   ("hold", 2, 2), ("split", 2, 2))


def test_round_robin_keeps_its_cursor():
    p = Policy("round_robin")
    v = four_tp1()
    assert [p.place(v, prompt=10, output=5).target for _ in range(6)] == [0, 1, 2, 3, 0, 1]


def test_requests_no_tp_holds_are_rejected_by_every_policy():
    for name in POLICIES:
        d = Policy(name).place(four_tp1(), prompt=20000, output=10)
        assert d.action == "reject", name


@pytest.mark.parametrize("bad, match", [
    (dict(capacity=[60, 264]), "capacity levels"),
    (dict(max_tp=8), "max_tp"),
    (dict(overlap=True), "aligned group"),
    (dict(pending=[(1, 2)]), "pending group"),
])
def test_bad_views_are_refused_with_the_reason(bad, match):
    rows = [dict(gpu_first=g, tp=1, kv_total=CAP[0]) for g in range(4)]
    if bad.get("overlap"):
        rows[1] = dict(gpu_first=0, tp=2, kv_total=CAP[1])
    v = View.of(rows, bad.get("capacity", CAP), pending=bad.get("pending"))
    if "max_tp" in bad:
        v.max_tp = bad["max_tp"]
    with pytest.raises(ValueError, match=match):
        Policy("gyges").place(v, prompt=10, output=5)


def test_bad_policy_arguments():
    with pytest.raises(PolicyError, match="unknown policy 'fifo'"):
        Policy("fifo")
    with pytest.raises(PolicyError, match="scale_down_free"):
        Policy("gyges", scale_down_free=1.5)
    with pytest.raises(PolicyError, match="prompt"):
        Policy("gyges").place(four_tp1(), prompt=0, output=5)


# ---- replays on the real host ------------------------------------------------------------------

def test_capacities_match_the_instances(model):
    for layout, level in (("4xTP1", 0), ("2xTP2", 1), ("1xTP4", 2)):
        host = host_of(model, layout)
        caps = experiment.capacities(host)
        assert caps == CAP
        assert host.instances[0].capacity_blocks() == caps[level]


def test_gyges_serves_everything_with_transformations(model):
    trace = mixed(n_short=10, longs=(3, 7))
    res = experiment.run(trace, "gyges", host=host_of(model), record_steps=True)
    check_accounting(res, trace)
    s = res.summary()
    assert s["completed"] == trace.size and s["policy_rejected"] == 0
    assert s["scale_ups"] >= 1 and s["transformations"] == res.transformations.size
    x = res.transformations
    assert np.all(x["end"] >= x["start"]) and set(x["kind"].tolist()) <= {0, 1}
    assert np.all(x[x["kind"] == 0]["tp_to"] == 2)
    r = res.requests
    assert np.all(r["min_tp"][[3, 7]] == 2) and np.all(r["tp"][[3, 7]] == 2)
    assert np.all(r["min_tp"][r["input_tokens"] < 200] == 1)
    # the layout events replay to the final layout
    alive = res.layout_at(math.inf)
    assert sum(tp for _, tp in alive) == 4
    assert res.stats["final_layout"] == gyges.runtime.host.layout_string([f"TP{tp}" for _, tp in alive])
    # every step was measured with a batch shape
    st = res.steps
    assert st.size > 0 and np.all(st["seconds"] > 0) and np.all(st["n_tokens"] >= st["n_seqs"])
    assert set(np.unique(st["tp"]).tolist()) <= {1, 2}


def test_static_layouts_never_transform(model):
    trace = mixed(n_short=8, longs=(2,))
    res = experiment.run(trace, "static", host=host_of(model, "4xTP1"))
    check_accounting(res, trace)
    s = res.summary()
    assert s["transformations"] == 0 and res.stats["n_ops_refused"] == 0
    assert s["policy_rejected"] == 1 and res.requests["status"][2] == 4
    # one scheduler, two executors: the simulator with the host's capacities decides alike
    twin = sim.run(trace, "static", gpus_per_host=4, layout="4xTP1",
                   cost=ConstantCost(step=0.01, capacity=tuple(CAP)))
    assert np.array_equal(twin.requests["status"], res.requests["status"])
    assert np.array_equal(twin.requests["min_tp"], res.requests["min_tp"])
    res = experiment.run(trace, "static", host=host_of(model, "2xTP2"))
    check_accounting(res, trace)
    assert res.summary()["transformations"] == 0 and res.summary()["policy_rejected"] == 0
    assert res.stats["final_layout"] == "2xTP2"
    assert set(res.requests["tp"].tolist()) == {2}


@pytest.mark.parametrize("policy", ["round_robin", "least_load"])
def test_baselines_serve_everything(model, policy):
    trace = mixed(n_short=8, longs=(5,), seed=2)
    res = experiment.run(trace, policy, host=host_of(model))
    check_accounting(res, trace)
    assert res.summary()["completed"] == trace.size
    assert res.summary()["scale_ups"] >= 1


def test_seesaw_alternates_its_phases_on_a_real_host(model):
    """Seesaw's policy on the CPU engine: the prompts are prefilled by TP1 instances, the four
    workers merge into one TP4 that decodes them, and split back once it is empty; every
    request gets exactly its tokens."""
    rng = np.random.default_rng(4)
    trace = traces.from_arrays(np.sort(rng.uniform(0, 0.05, 12)), rng.integers(24, 100, 12),
                               np.full(12, 80))
    res = experiment.run(trace, "seesaw", host=host_of(model), record_steps=True)
    check_accounting(res, trace)
    assert res.summary()["completed"] == trace.size
    assert res.stats["n_merges"] >= 3 and res.stats["n_splits"] >= 1
    # its TP1s were asked to park their KV in host memory, which a CPU worker has not
    assert any("host-memory tier" in why for why in res.stats["refusals"])
    assert res.config["decode_tp"] == 0   # (no profile of this host: max_tp)
    st = res.steps
    prefill = st["n_tokens"] > st["n_seqs"]
    assert (st["tp"][prefill] == 1).all()
    decoded = st["n_tokens"][~prefill]
    assert decoded[st["tp"][~prefill] == 4].sum() > 0.5 * decoded.sum()   # most decoded at TP4


def test_seesaw_searches_its_decode_tp_from_the_hosts_profile(model):
    """Given this host's profile, experiment.run searches Seesaw's decode TP as gyges.sim.run
    does (gyges.cluster.seesaw_search over the profile's capacities and step times)."""
    from gyges.cluster import seesaw_search
    from test_profile import hand_cost
    trace = traces.from_arrays(np.linspace(0, 0.05, 6), np.full(6, 40), np.full(6, 8))
    cost = hand_cost()   # TP1 and TP2 measured
    want, rows = seesaw_search.decode_tp(cost, trace, 2)
    assert want in (1, 2) and len(rows) == 2
    host = gyges.Host(model, workers=2, memory_per_worker="24MiB")
    try:
        res = experiment.run(trace, "seesaw", host=host, cost=cost)
    finally:
        host.close()
    assert res.config["decode_tp"] == want
    assert res.summary()["completed"] == trace.size
    host = gyges.Host(model, workers=2, memory_per_worker="24MiB")
    try:
        with pytest.raises(gyges.Error, match="max_tp"):
            experiment.run(trace, "seesaw", host=host, cost=cost, max_tp=3)
    finally:
        host.close()


def test_results_save_load_and_summary_like_the_simulator(model, tmp_path):
    trace = mixed(n_short=6, longs=())
    res = experiment.run(trace, "gyges", host=host_of(model), time_scale=0.5, slo={"ttft": 1.0})
    assert isinstance(res, Results)
    simres = sim.run(trace, "gyges", gpus_per_host=4)
    assert set(simres.summary()) <= set(res.summary())
    assert res.summary()["good_completed"] <= res.summary()["completed"]
    # arrivals are the trace's, scaled, from the first
    assert np.allclose(res.requests["arrival"], (trace["arrival"] - trace["arrival"][0]) * 0.5)
    res.save(tmp_path / "run")
    back = Results.load(tmp_path / "run.json")
    assert back.requests.tobytes() == res.requests.tobytes()
    assert back.config["executor"] == "gyges.Host" and back.config["policy"] == "gyges"
    assert back.summary()["completed"] == res.summary()["completed"]
    fig = res.plot(tmp_path / "run.png")
    assert (tmp_path / "run.png").stat().st_size > 0
    import matplotlib.pyplot as plt
    plt.close(fig)


def test_time_limit_stops_and_leaves_the_rest_unserved(model):
    trace = traces.from_arrays([0.0, 0.0, 50.0], [40, 40, 40], [3000, 3000, 4])
    res = experiment.run(trace, "static", host=host_of(model, "1xTP4"), time_limit=0.3,
                         idle="sleep")
    assert res.stats["stopped_by_time_limit"]
    status = res.requests["status"].tolist()
    assert status[:2] == [2, 2] and status[2] == 0   # queued unfinished, never arrived
    assert res.summary()["completed"] == 0 and res.summary()["unfinished"] == 2


@pytest.mark.filterwarnings("ignore::gyges.reconfig.recovery.RecoveryWarning")  # a recovered half-way
def test_an_allocation_failing_in_latency_merges_leaves_the_host_serving(model):
    """The latency mode on a real host (idle: 4xTP1 -> 2xTP2 -> TP4 while requests run): every
    failing allocation spread over the replay either raises a gyges.Error or the replay still
    completes every request (a transformation that failed half-way is recovered); either way
    the host then serves a request with the tokens of a fresh one."""
    trace = traces.from_arrays(np.arange(4) * 0.3, np.array([40, 60, 30, 50]),
                               np.array([5, 6, 7, 5]))
    probe, params = [7, 8, 9, 10], gyges.SamplingParams(max_tokens=6)

    def replay(host):
        return experiment.run(trace, "gyges", host=host, idle_load=1e4, light_load=1e6)

    def serve(host):
        r = host.submit(probe, params)
        while host.has_unfinished():
            host.step()
        return list(r.output_tokens)

    host = host_of(model)
    n, res = gyges.testing.count("alloc", lambda: replay(host))
    assert res.summary()["transformations"] == 3
    expected = serve(host)
    host.close()
    outcomes = set()
    for k in gyges.testing.spread(n, 25):
        host = host_of(model)
        with gyges.testing.inject("alloc", k):
            try:
                assert replay(host).summary()["completed"] == len(trace)
                outcomes.add("done")
            except gyges.Error:
                outcomes.add("raised")
        assert serve(host) == expected, k
        host.close()
    assert outcomes == {"done", "raised"}


def test_bad_input_is_refused(model):
    trace = mixed(n_short=3, longs=())
    host = host_of(model)
    with pytest.raises(ExperimentError, match="unknown policy 'fifo'; known: gyges"):
        experiment.run(trace, "fifo", host=host)
    with pytest.raises(ExperimentError, match="no requests"):
        experiment.run(traces.empty(), "gyges", host=host)
    bad = trace.copy()
    bad["arrival"] = bad["arrival"][::-1] + [0, 0, 0]
    bad["arrival"][0] += 10
    with pytest.raises(traces.TraceError, match="sorted"):
        experiment.run(bad, "gyges", host=host)
    with pytest.raises(TypeError, match="structured array"):
        experiment.run([1, 2, 3], "gyges", host=host)
    with pytest.raises(ExperimentError, match="time_scale"):
        experiment.run(trace, "gyges", host=host, time_scale=0)
    with pytest.raises(ExperimentError, match="layout"):
        experiment.run(trace, "static", host=host, layout="1xTP4")
    with pytest.raises(ExperimentError, match="gyges.Host"):
        experiment.run(trace, "gyges", host="localhost")
    with pytest.raises(ExperimentError, match="idle"):
        experiment.run(trace, "gyges", host=host, idle="spin")
    with pytest.raises(ExperimentError, match="max_tp"):
        experiment.run(trace, "gyges", host=host, max_tp=3)
    with pytest.raises(ExperimentError, match="cost must be a gyges.costmodel.CostModel"):
        experiment.run(trace, "gyges", host=host, cost="h20")
    with pytest.raises(PolicyError, match="idle_load"):
        experiment.run(trace, "gyges", host=host, idle_load=-1)
    with gyges.Host(model, workers=4, memory_per_worker="24MiB", layout="2xTP1+2xTP1",
                    weights=["sharded"] * 2 + ["replicated"] * 2) as both:
        with pytest.raises(ExperimentError, match="mixes them"):
            experiment.run(trace, "gyges", host=both)
    host.submit([1, 2, 3], gyges.SamplingParams(max_tokens=2))
    with pytest.raises(ExperimentError, match="idle host"):
        experiment.run(trace, "gyges", host=host)
    # nothing above touched the trace or left work behind on a fresh host
    fresh = host_of(model)
    res = experiment.run(trace, "gyges", host=fresh)
    check_accounting(res, trace)
    assert not fresh.has_unfinished()
