"""gyges.Cluster: hosts as Ray actors on a 2-node Ray cluster started here
(ray.cluster_utils.Cluster: two raylets on this machine, as two machines would be).

What is checked: every request gets the tokens of one in-process Host (greedy and seeded) while
the hosts transform underneath it; tokens stream to the driver while the hosts step on their own;
a killed host actor, and a whole node lost, lose no request (the orphans recomputed elsewhere,
the tokens already streamed given again exactly); bad input is a gyges.Error that queues
nothing. Tolerance policy: exact."""
import functools
import os
import threading
import time

import numpy as np
import pytest

import gyges
from gyges import experiment, sim, traces
from gyges.cluster.costmodel import ConstantCost

ray = pytest.importorskip("ray", reason="gyges.Cluster needs Ray (requirements.txt pins it)")
from ray.cluster_utils import Cluster as RayNodes  # noqa: E402

GREEDY = gyges.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SEEDED = gyges.SamplingParams(max_tokens=24, temperature=0.9, top_k=40, seed=5, ignore_eos=True)
HOST = dict(workers_per_host=2, layout="2xTP1", memory_per_worker="32MiB")


@pytest.fixture(scope="module")
def nodes():
    """Two Ray nodes on this machine (a head and a worker), connected for the module."""
    c = RayNodes(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    c.add_node(num_cpus=1)
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False, configure_logging=False)
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def tiny():
    return gyges.Model.tiny()


def prompts(n, seed, lo=8, hi=40):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(1, 4000, rng.integers(lo, hi))] for _ in range(n)]


def reference(model, ps, params):
    """The tokens of one in-process Host of the cluster hosts' shape."""
    host = gyges.Host(model, workers=2, memory_per_worker="32MiB", layout="2xTP1")
    out = [r.output_tokens for r in host.generate(ps, params)]
    host.close()
    return out


@pytest.mark.parametrize("n_hosts, params", [(2, GREEDY), (3, SEEDED)],
                         ids=["2-greedy", "3-seeded"])
def test_hosts_give_one_hosts_tokens_while_they_transform_and_migrate(nodes, tiny, n_hosts,
                                                                       params):
    """Requests spread over 2 hosts on the 2 nodes (or 3 hosts: two share a node) while each
    host merges 2xTP1 -> TP2 and back (even hosts at once, odd ones layer by layer) and
    requests migrate from each host to the next with their KV: every request's tokens are one
    Host's, and every host ends as it began."""
    params = gyges.SamplingParams(max_tokens=40, temperature=params.temperature,
                                  top_k=params.top_k, seed=params.seed, ignore_eos=True)
    ps = prompts(12, seed=1)
    want = reference(tiny, ps, params)
    with gyges.Cluster(tiny, hosts=n_hosts, **HOST) as cluster:
        pids = {cluster.host(i).info()["pid"] for i in range(n_hosts)}
        assert len(pids) == n_hosts
        assert len(set(cluster._nodes)) == 2   # one host per node while nodes last
        handles = [cluster.submit(p, params) for p in ps]
        assert {h.host for h in handles} == set(range(n_hosts))
        ups = [cluster.host(i).transform(workers=(0, 1), tp=2,
                                         layers_per_step=1 if i % 2 else None)
               for i in range(n_hosts)]
        def to_next(h):
            """Moves h to the next host: 1 when it moved; 0 when a merge holds it, or when it
            finished before its host was asked (checked)."""
            if h.finished:
                return 0
            try:
                return int(cluster.migrate(h, (h.host + 1) % n_hosts) > 0)
            except gyges.BusyError:
                return 0
            except gyges.InvalidArgumentError as e:
                assert "not an unfinished request" in str(e) and cluster.wait([h], timeout=5)
                return 0
        # while the merges run: refused where one holds it
        migrated = sum(to_next(h) for h in handles[:2 * n_hosts])
        for r in ups:
            assert r.wait(60) and r.committed, r.error
        assert [cluster.host(i).layout() for i in range(n_hosts)] == ["TP2"] * n_hosts
        more = [cluster.submit(p, params) for p in ps[:4]]
        migrated += sum(to_next(h) for h in more[:2])
        downs = [cluster.host(i).transform(workers=(0, 1), tp=1) for i in range(n_hosts)]
        assert all(r.wait(60) and r.committed for r in downs)
        assert cluster.wait(handles + more, timeout=120)
        assert migrated > 0
        assert [h.output_tokens for h in handles] == want
        assert [h.output_tokens for h in more] == want[:4]
        assert all(h.finish_reason == "length" and h.recompute_mismatches == 0
                   for h in handles + more)
        assert [cluster.host(i).layout() for i in range(n_hosts)] == ["2xTP1"] * n_hosts


def test_tokens_stream_while_the_hosts_step_on_their_own(nodes, tiny):
    """A long request's tokens reach its handle while it runs: the driver sees it unfinished
    with some tokens (the host steps without being asked)."""
    params = gyges.SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    with gyges.Cluster(tiny, hosts=1, **HOST) as cluster:
        h = cluster.submit(prompts(1, seed=2)[0], params)
        seen = []
        while not h.finished:
            seen.append(len(h.output_tokens))
            time.sleep(0.002)
        assert any(0 < n < 200 for n in seen), seen[-5:]
        assert len(h.output_tokens) == 200


@pytest.mark.parametrize("params", [SEEDED], ids=["seeded"])   # (greedy: test_request_packet)
def test_requests_migrate_between_hosts_with_their_kv(nodes, tiny, params):
    """Requests decoding on host 0 move to host 1 on the other node with their KV (stop and
    copy, through Ray's object store): each goes on there from where it was, its tokens one
    Host's, none recomputed; one whose instance is transforming is refused and stays."""
    params = gyges.SamplingParams(max_tokens=96, temperature=params.temperature,
                                  top_k=params.top_k, seed=params.seed, ignore_eos=True)
    ps = prompts(6, seed=8)
    want = reference(tiny, ps, params)
    with gyges.Cluster(tiny, hosts=2, **HOST) as cluster:
        handles = [cluster.submit(p, params, host=0, instance=i % 2) for i, p in enumerate(ps)]
        while not all(len(h.output_tokens) > 2 for h in handles):
            time.sleep(0.002)
        moved = [cluster.migrate(h, 1) for h in handles[:3]]
        assert all(m > 0 for m in moved)
        assert [h.host for h in handles] == [1, 1, 1, 0, 0, 0]
        r = cluster.host(0).transform(workers=(0, 1), tp=2, layers_per_step=1)
        if not r.refresh().done:
            with pytest.raises(gyges.BusyError, match="being reconfigured"):
                cluster.migrate(handles[3], 1)
            assert handles[3].host == 0
        assert cluster.wait(handles, timeout=120)
        assert [h.output_tokens for h in handles] == want
        assert [h.migrations for h in handles] == [1, 1, 1, 0, 0, 0]
        assert all(h.recompute_mismatches == 0 and h.resubmitted == 0 for h in handles)
        with pytest.raises(gyges.InvalidArgumentError, match="finished"):
            cluster.migrate(handles[0], 0)


def on_call(cluster, k, action):
    """Runs action() before the driver's k-th wait on a host from now on (Cluster._get: a live
    migration's calls in order are round 1 at the source, the reservation at the destination,
    round 2, its fill, ..., the stop, the import, the source's settle)."""
    calls, real = [0], cluster._get

    def get(index, ref):
        calls[0] += 1
        if calls[0] == k:
            action()
        return real(index, ref)
    cluster._get = get
    return calls


def kv_in_use(cluster, host):
    return sum(w["kv_blocks_used"] for w in cluster.host(host).stats()["workers"])


def test_a_live_migration_stops_the_request_only_for_its_last_round(nodes, tiny):
    """Requests decoding on host 0 move to host 1 live (Llumnix: KV in rounds while they decode,
    then a last round of a block or two) or stopped and copied, side by side: each goes on
    from where it was with one Host's tokens, none recomputed, and a live one's last round
    carries a fraction of the KV a stop and copy does. Midway: a request that finishes on its
    source during the rounds stays there (the reservation freed), a destination that is
    killed after round 1 leaves the request on its source, and a source killed after round 1
    has its request recomputed on the destination, whose reservation is freed."""
    params = gyges.SamplingParams(max_tokens=160, temperature=0.9, top_k=40, seed=5,
                                  ignore_eos=True)
    ps = prompts(6, seed=14, lo=60, hi=90)
    want = reference(tiny, ps, params)
    with gyges.Cluster(tiny, hosts=3, **HOST) as cluster:
        handles = [cluster.submit(p, params, host=0, instance=i % 2) for i, p in enumerate(ps)]
        while not all(len(h.output_tokens) > 2 for h in handles):
            time.sleep(0.002)
        live, stop = handles[0], handles[1]
        assert cluster.migrate(live, 1, live=True) > 0
        assert cluster.migrate(stop, 1) > 0
        m, s = live.last_migration, stop.last_migration
        assert (m.mode, m.outcome, s.mode, s.outcome) == ("live", "moved", "stop", "moved")
        assert len(m.rounds) >= 2 and m.rounds[0] > 20 * m.final_bytes > 0
        assert s.final_bytes > 20 * m.final_bytes and s.rounds == []
        assert live.host == stop.host == 1
        # finished on its source between round 1 and round 2
        short = cluster.submit(ps[2], gyges.SamplingParams(max_tokens=6, ignore_eos=True),
                               host=0)
        on_call(cluster, 3, lambda: cluster.wait([short], timeout=30))
        assert cluster.migrate(short, 2, live=True) == 0
        assert short.last_migration.outcome == "finished" and short.host == 0
        assert kv_in_use(cluster, 2) == 0
        # the destination (host 2) killed after round 1: the request stays on host 0
        on_call(cluster, 3, lambda: ray.kill(cluster.host(2).actor, no_restart=True))
        with pytest.raises(gyges.StateError, match="host 2 is lost"):
            cluster.migrate(handles[2], 2, live=True)
        assert handles[2].host == 0 and handles[2].last_migration.outcome == "refused"
        # the source (host 0) killed after round 1: recomputed on host 1, reservation freed
        on_call(cluster, 3, lambda: ray.kill(cluster.host(0).actor, no_restart=True))
        with pytest.raises(gyges.StateError, match="host 0 is lost"):
            cluster.migrate(handles[3], 1, live=True)
        cluster._get = type(cluster)._get.__get__(cluster)
        assert cluster.wait(handles, timeout=120)
        assert [h.output_tokens for h in handles] == want
        assert [h.migrations for h in handles] == [1, 1, 0, 0, 0, 0]
        assert handles[3].resubmitted == 1 and handles[3].host == 1
        assert all(h.recompute_mismatches == 0 for h in handles)
        assert kv_in_use(cluster, 1) == 0   # (every request done: its reservation went too)


def test_a_killed_host_loses_no_request(nodes, tiny):
    """Host 1's actor is killed with requests half decoded and a merge under way: the driver
    notices within seconds, its requests are recomputed on host 0, each gives the tokens it had
    streamed again and then the rest (one Host's tokens), the merge's handle says its host is
    lost, and the cluster serves on with host 0 alone."""
    params = gyges.SamplingParams(max_tokens=128, temperature=0.9, top_k=40, seed=3,
                                  ignore_eos=True)
    ps = prompts(6, seed=4)
    want = reference(tiny, ps, params)
    with gyges.Cluster(tiny, hosts=2, **HOST) as cluster:
        handles = [cluster.submit(p, params) for p in ps]
        victims = [h for h in handles if h.host == 1]
        while not any(len(h.output_tokens) > 4 for h in victims):
            time.sleep(0.005)
        streamed = {h.id: len(h.output_tokens) for h in victims}
        orphans = [h for h in victims if not h.finished]
        merging = cluster.host(1).transform(workers=(0, 1), tp=2, layers_per_step=1)
        ray.kill(cluster.host(1).actor, no_restart=True)   # (mid merge, most likely)
        killed = time.monotonic()
        while 1 in cluster.live_hosts:
            time.sleep(0.01)
            assert time.monotonic() - killed < 10, "the lost host was not noticed"
        assert cluster.wait(handles, timeout=120)
        assert [h.output_tokens for h in handles] == want
        assert orphans and all(h.resubmitted == 1 and h.host == 0 for h in orphans)
        assert sum(streamed[h.id] for h in orphans) > 0
        assert all(h.recompute_mismatches == 0 for h in handles)
        assert list(cluster.lost_hosts) == [1] and cluster.live_hosts == [0]
        if not merging._fields["done"]:   # its handle says where it went
            with pytest.raises(gyges.StateError, match="host 1 is lost"):
                merging.refresh()
        later = cluster.submit(ps[0], params)
        assert later.host == 0 and cluster.wait([later], timeout=60)
        assert later.output_tokens == want[0]
        with pytest.raises(gyges.StateError, match="host 1 is lost"):
            cluster.submit(ps[0], params, host=1)


def test_a_lost_node_loses_no_request(nodes, tiny):
    """Three hosts on three nodes; the third node is removed (its raylet and every process on
    it gone) in the middle of serving: its host's requests finish on the others with one
    Host's tokens."""
    extra = nodes.add_node(num_cpus=1)
    nodes.wait_for_nodes()
    ps = prompts(9, seed=6)
    params = gyges.SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    want = reference(tiny, ps, params)
    with gyges.Cluster(tiny, hosts=3, **HOST) as cluster:
        assert len(set(cluster._nodes)) == 3
        handles = [cluster.submit(p, params) for p in ps]
        on_extra = [i for i, n in enumerate(cluster._nodes) if n == extra.node_id]
        assert len(on_extra) == 1
        lost = on_extra[0]
        while not any(h.output_tokens for h in handles if h.host == lost):
            time.sleep(0.005)
        nodes.remove_node(extra)
        assert cluster.wait(handles, timeout=120)
        assert [h.output_tokens for h in handles] == want
        assert lost in cluster.lost_hosts and lost not in cluster.live_hosts
        assert any(h.resubmitted for h in handles)
        assert all(h.recompute_mismatches == 0 for h in handles)


# ---- a trace replayed over the cluster by the one controller (distributed/replay.py) ----

REPLAY_HOST = dict(workers_per_host=2, layout="2xTP1", memory_per_worker="24MiB")


def replay_capacities(tiny):
    host = gyges.Host(tiny, workers=2, memory_per_worker="24MiB", layout="2xTP1")
    caps = experiment.capacities(host)
    host.close()
    return caps


def decisions(res):
    """Each request's (status, first GPU, TP) and the reconfigurations in order."""
    r, x = res.requests, res.transformations
    return ([(int(st), int(g), int(tp)) for st, g, tp in zip(r["status"], r["gpu"], r["tp"])],
            [(int(k), int(g), int(a), int(b))
             for k, g, a, b in zip(x["kind"], x["gpu"], x["tp_from"], x["tp_to"])])


def replay_tokens(tiny, trace, seed=0):
    """What one in-process Host gives each request of a replay (the prompts and sampling the
    replay uses: random tokens seeded by seed and the request's index, greedy)."""
    prompts_, params = [], []
    for i in range(trace.shape[0]):
        rng = np.random.default_rng([seed, i])
        prompts_.append(rng.integers(3, tiny.config.vocab_size,
                                     size=int(trace["input_tokens"][i])).tolist())
        params.append(gyges.SamplingParams(max_tokens=int(trace["output_tokens"][i]),
                                           temperature=0.0, ignore_eos=True))
    host = gyges.Host(tiny, workers=2, memory_per_worker="64MiB", layout="TP2")
    want = {tuple(p): r.output_tokens for p, r in
            zip(prompts_, [host.submit(p, q) for p, q in zip(prompts_, params)])}
    while host.has_unfinished():
        host.step()
    host.close()
    return {k: list(v) for k, v in want.items()}


def assert_one_hosts_tokens(seen, want):
    """Every request of a replay (its handle by prompt) has one Host's tokens."""
    bad = [(len(want.get(p, ())), len(h.output_tokens), h.finish_reason, h.error, h.host,
            h.resubmitted, h.recompute_mismatches)
           for p, h in seen.items() if h.output_tokens != want.get(p)]
    assert not bad and len(seen) == len(want), (bad, len(seen), len(want))


def test_a_replay_over_two_hosts_decides_as_the_simulator_does(nodes, tiny):
    """gyges.experiment.run(trace, cluster=...) and gyges.sim.run(hosts=2) on one trace: the
    controller places every request on the same GPU of the same host and merges and splits
    the same groups in the same order (round-robin over 4 GPUs of 2 hosts, two requests that
    only a TP2 holds: a merge and a split on each host). Arrivals are far enough apart that
    timing cannot change a decision (test_cluster.py's rule). Every request's tokens are one
    Host's."""
    caps = replay_capacities(tiny)
    cost = ConstantCost(step=0.001, phase=0.0, capacity=tuple(caps))
    long2 = (caps[0] + 8) * 16   # more than a TP1 instance holds, less than a TP2
    trace = traces.from_arrays(np.arange(8) * 1.5, np.array([40, 60, long2, 30, 50,
                                                             long2 + 100, 20, 70]),
                               np.array([5, 6, 4, 7, 5, 3, 6, 4]))
    simulated = sim.run(trace, policy="round_robin", hosts=2, gpus_per_host=2, cost=cost,
                        watermark=0.0, check=True)
    with gyges.Cluster(tiny, hosts=2, **REPLAY_HOST) as cluster:
        for bad, match in (({"idle": "skip"}, "idle='skip'"), ({"policy": "flying"}, "flying"),
                           ({"layout": "TP2"}, "layout=")):
            with pytest.raises(experiment.ExperimentError, match=match):
                experiment.run(trace, cluster=cluster, **{"policy": "round_robin", **bad})
        seen = {}
        cluster.add_listener(lambda hs: seen.update({tuple(h.prompt): h for h in hs}))
        real = experiment.run(trace, policy="round_robin", cluster=cluster, cost=cost)
    assert decisions(real) == decisions(simulated)
    placed, xforms = decisions(real)
    assert {g for _, g, _ in placed} == {0, 1, 2, 3}                 # both hosts serve
    assert [(k, g) for k, g, _, _ in xforms] == [(0, 2), (1, 2), (0, 0), (1, 0)]  # both merge
    assert real.config["hosts"] == 2 and real.config["executor"] == "gyges.Cluster"
    assert real.stats["final_layout"] == "2xTP1 | 2xTP1"
    assert np.isfinite(real.requests["scheduled"]).all()
    assert_one_hosts_tokens(seen, replay_tokens(tiny, trace))


def test_a_replay_loses_nothing_to_a_killed_host_and_a_lost_node(nodes, tiny):
    """Three hosts (the third on a node of its own) replay a busy trace under gyges' policy;
    host 1's actor is killed and then the third node removed while they serve. The
    controller's view loses their GPUs, their requests are recomputed on host 0, and every
    request finishes with one Host's tokens; nothing is placed on a lost host afterwards."""
    extra = nodes.add_node(num_cpus=1)
    nodes.wait_for_nodes()
    rng = np.random.default_rng(11)
    n = 24
    # (outputs long enough that each host still streams when the losses look for one: with
    # 30-60 tokens a fast machine once finished the replay before the first loss)
    trace = traces.from_arrays(np.sort(rng.uniform(0, 3.0, n)), rng.integers(20, 200, n),
                               rng.integers(80, 160, n))
    with gyges.Cluster(tiny, hosts=3, **REPLAY_HOST) as cluster:
        lost = [i for i, node in enumerate(cluster._nodes) if node == extra.node_id]
        assert len(lost) == 1 and lost[0] != 0
        killed = ({1, 2} - set(lost)).pop()
        seen, when = {}, {}

        def losses():
            for victim, lose in ((killed, lambda: ray.kill(cluster.host(killed).actor,
                                                           no_restart=True)),
                                 (lost[0], lambda: nodes.remove_node(extra))):
                while not any(h.host == victim and h.output_tokens and not h.finished
                              for h in list(seen.values())):
                    time.sleep(0.005)
                lose()
                when[victim] = time.monotonic()

        cluster.add_listener(lambda hs: seen.update({tuple(h.prompt): h for h in hs}))
        t = threading.Thread(target=losses, daemon=True)
        t.start()
        start = time.monotonic()
        res = experiment.run(trace, policy="gyges", cluster=cluster)
        t.join(timeout=30)
        assert sorted(cluster.lost_hosts) == sorted([killed, lost[0]])
    assert (res.requests["status"] == 3).all()          # every request finished
    assert res.stats["n_hosts_lost"] == 2
    assert res.stats["n_resubmitted"] >= 1 and res.stats["recompute_mismatches"] == 0
    assert res.stats["final_layout"].count("lost") == 2
    after = res.requests["arrival"] > max(when.values()) - start + 0.5
    assert (res.requests["gpu"][after] < 2).all()      # placed on host 0 only
    assert_one_hosts_tokens(seen, replay_tokens(tiny, trace))


def test_llumnix_moves_running_requests_between_hosts_with_their_kv(nodes, tiny):
    """policy 'llumnix' on two hosts of one TP1 replica each (decode work weighs most in its
    placement): a long request goes to host 0, then two short ones and a long one to host 1,
    whose requests' KV demand then exceeds its memory while host 0's does not; the controller's
    MIGRATE op moves a short one, running, with its KV, to host 0 (Cluster.migrate), and every
    request's tokens are one Host's."""
    trace = traces.from_arrays(np.array([0.0, 0.01, 0.02, 0.03]), np.array([150, 300, 300, 150]),
                               np.array([600, 80, 80, 600]))
    with gyges.Cluster(tiny, hosts=2, workers_per_host=1, layout="TP1",
                       memory_per_worker="24MiB") as cluster:
        seen = {}
        cluster.add_listener(lambda hs: seen.update({tuple(h.prompt): h for h in hs}))
        res = experiment.run(trace, policy="llumnix", cluster=cluster, decode_weight=10.0,
                             sample_interval=0.05)
        with pytest.raises(experiment.ExperimentError, match="max_tp 1"):
            experiment.run(trace, policy="llumnix", cluster=cluster, max_tp=2)
    assert (res.requests["status"] == 3).all()
    assert res.stats["n_live_migrations"] >= 1, (res.stats, res.requests["gpu"])
    assert res.stats["n_migrations_between_hosts"] == res.stats["n_live_migrations"]
    assert res.stats["migrate_bytes"] > 0 and res.stats["recompute_mismatches"] == 0
    assert res.requests["migrations"].sum() == res.stats["n_live_migrations"]
    assert sum(h.migrations for h in seen.values()) == res.stats["n_live_migrations"]
    assert_one_hosts_tokens(seen, replay_tokens(tiny, trace))


def test_a_request_placed_twice_on_one_host_is_served_once(tiny):
    """Two losses in a row, or a loss and a migration's way back, can place one request on a
    host twice, in either order (the newer placement may arrive first); the host keeps the
    newest placement, aborts the other, and its updates name the placement (epoch), so the
    driver takes one stream. (The HostActor class in this process, no Ray.)"""
    from gyges.distributed.host_actor import HostActor
    params = gyges.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    p = prompts(1, seed=9)[0]
    actor = HostActor(tiny.source, dict(workers=2, layout="2xTP1", memory_per_worker="32MiB"))
    try:
        for rid, order in ((7, (1, 2)), (8, (4, 3))):
            for epoch in order:
                actor.submit(rid, p, params, None, epoch)
            assert actor.host.between_steps(lambda: sum(len(i.requests)
                                                        for i in actor.host.instances)) == 1
            got, epochs, done = [], set(), False
            while not done:
                for r, epoch, tokens, finished, reason, error, _, _ in actor.updates(1.0):
                    assert r == rid
                    epochs.add(epoch)
                    got += tokens
                    done = finished
            assert epochs == {max(order)} and got == reference(tiny, [p], params)[0]
    finally:
        actor.close()


@pytest.mark.parametrize("order", ["placed_then_settled", "settled_back_then_placed",
                                   "settled_then_placed"])
def test_a_stopped_live_migration_placed_anew_is_served_once(tiny, order):
    """A live migration's last round stopped a request on its source, and its destination was
    lost then: the driver's loss handling places the request on the source anew (submit, a
    newer epoch) while the migration settles it there (arrived, or back), in either order.
    The host serves the newest placement once, with one Host's tokens from the first, and the
    stopped copy's KV is freed: no block is left in use once it finishes. (The HostActor class
    in this process, no Ray.)"""
    from gyges.distributed.host_actor import HostActor
    params = gyges.SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    p = prompts(1, seed=4)[0]
    actor = HostActor(tiny.source, dict(workers=1, layout="TP1", memory_per_worker="32MiB"))
    try:
        actor.submit(3, p, params, None, 0)
        while not any(tokens for _, _, tokens, *_ in actor.updates(1.0)):
            pass
        packet, info = actor.migrate_round(3, 0)
        packet, info = actor.migrate_stop(3, info["end"])
        assert not info["finished"] and actor.host.stats()["workers"][0]["kv_blocks_used"] > 0
        calls = {"placed": lambda: actor.submit(3, p, params, None, 2),
                 "settled": lambda: actor.migrate_settle(3, True, 1),
                 "settled_back": lambda: actor.migrate_settle(3, False, 1)}
        for call in order.split("_then_"):
            calls[call]()
        got, done = {}, False
        while not done:
            for rid, epoch, tokens, finished, reason, error, _, _ in actor.updates(1.0):
                assert rid == 3 and error is None
                got.setdefault(epoch, []).extend(tokens)
                done = finished and epoch == 2
        assert got[2] == reference(tiny, [p], params)[0]
        assert actor.host.between_steps(lambda: sum(len(i.requests)
                                                    for i in actor.host.instances)) == 0
        assert actor.host.stats()["workers"][0]["kv_blocks_used"] == 0
        assert not actor._held and not actor.host._held
    finally:
        actor.close()


def test_bad_input_is_a_gyges_error_that_queues_nothing(nodes, tiny):
    with gyges.Cluster(tiny, hosts=1, **HOST) as cluster:
        with pytest.raises(gyges.InvalidArgumentError, match="token"):
            cluster.submit([1, 2, 99999], GREEDY)
        with pytest.raises(gyges.InvalidArgumentError):
            cluster.submit([1, 2, 3], GREEDY, host=5)
        with pytest.raises(gyges.InvalidArgumentError):
            cluster.host(0).transform(workers=(0, 1), tp=3)
        with pytest.raises(gyges.InvalidArgumentError, match="buddy"):
            cluster.host(0).restore("not a group")
        assert cluster.host(0).layout() == "2xTP1"
        h = cluster.submit([1, 2, 3], GREEDY)
        assert cluster.wait([h], timeout=60) and len(h.output_tokens) == 24
        long = cluster.submit([1, 2, 3], gyges.SamplingParams(max_tokens=1000,
                                                              ignore_eos=True))
        assert cluster.abort(long) and cluster.wait([long], timeout=30)
        assert long.finish_reason == "abort"
        with pytest.raises(gyges.ArgumentTypeError):
            cluster.migrate("request 0", 0)
        with pytest.raises(gyges.InvalidArgumentError):
            cluster.migrate(long, 7)
        with pytest.raises(gyges.InvalidArgumentError, match="finished"):
            cluster.migrate(long, 0)
    with pytest.raises(gyges.StateError, match="closed"):
        cluster.submit([1, 2, 3], GREEDY)
    with pytest.raises(gyges.InvalidArgumentError, match="cannot travel"):
        gyges.Cluster(gyges.Model(tiny.config, tiny.tensors), hosts=1)
    with pytest.raises(gyges.InvalidArgumentError, match="hosts"):
        gyges.Cluster(tiny, hosts=0)
    with pytest.raises(gyges.Error, match="could not start"):
        gyges.Cluster(tiny, hosts=1, workers_per_host=2, layout="3xTP1")


def test_the_server_fronts_a_cluster(nodes):
    """`gyges serve --hosts 2`'s server (Server over a Cluster of the packaged SmolLM2, one
    worker per host): the official openai client's completions, streamed or not, give one
    Host's text; /metrics has each host's instances and workers labelled and the cluster's
    sums; an admin transformation names its host."""
    from packaged import NAME, WHY_NOT
    if WHY_NOT is not None:
        pytest.skip(WHY_NOT)
    openai = pytest.importorskip("openai")
    from gyges.serve import Server
    import http.client
    import json
    model = gyges.Model.load(NAME)
    prompts = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,"]
    params = gyges.SamplingParams(max_tokens=12, temperature=0.0)
    one = gyges.Host(model, workers=1, memory_per_worker="768MiB", layout="1xTP1",
                     page_size="256KiB")
    want = [r.text for r in one.generate(prompts, params)]
    (scored,) = one.generate(prompts[:1], gyges.SamplingParams(max_tokens=4, logprobs=2))
    one.close()
    cluster = gyges.Cluster(model, hosts=2, workers_per_host=1, layout="1xTP1",
                            memory_per_worker="768MiB", page_size="256KiB")
    server = Server(cluster, NAME, port=0, api_key="k", enable_admin=True).start()
    try:
        c = openai.OpenAI(base_url=server.url, api_key="k", max_retries=0)
        got = [c.completions.create(model=NAME, prompt=p, max_tokens=12, temperature=0.0)
               .choices[0].text for p in prompts]
        assert got == want
        stream = c.completions.create(model=NAME, prompt=prompts[1], max_tokens=12,
                                      temperature=0.0, stream=True)
        assert "".join(e.choices[0].text for e in stream) == want[1]
        # log-probabilities come back from the hosts' processes: a single Host's, to the bit
        lp = c.completions.create(model=NAME, prompt=prompts[0], max_tokens=4, temperature=0.0,
                                  logprobs=2).choices[0].logprobs
        assert lp.token_logprobs == [e[t].logprob for t, e in zip(scored.output_tokens,
                                                                  scored.logprobs)]
        best = c.completions.create(model=NAME, prompt=prompts[1], max_tokens=3, n=2,
                                    temperature=1.0, extra_body={"best_of": 3})
        assert len(best.choices) == 2 and best.usage.completion_tokens == 9
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        assert 'host="0",instance="0"' in text and 'host="1",instance="1"' in text
        assert "gyges:cluster_hosts{" in text and 'host="1",worker="0"' in text
        conn.request("POST", "/admin/transform", json.dumps({"workers": [0], "tp": 1,
                                                             "host": 5}),
                     {"Authorization": "Bearer k", "Content-Type": "application/json"})
        reply = conn.getresponse()
        assert reply.status == 400 and b"host" in reply.read()
    finally:
        server.stop()
        cluster.close()


# ---- a fault-injection sweep of the replay: a host killed at a spread of points ----

# (point, policy): make test runs FAST; GYGES_FAULT_SWEEP=1 runs every point. (The live
# destination killed after round 1 is also in test_a_live_migration_stops_the_request_only_...)
FAULT_POINTS = ("queued", "before_merge", "while_merging", "after_merge",
                "migrating_live_destination", "migrating_live_last_round",
                "migrating_live_source", "migrating_stop_destination")
FAST_POINTS = ("while_merging", "migrating_live_last_round")


def faulty_replay(point, killed):
    """ClusterReplay that kills a host once, at `point` (appending its index to `killed`)."""
    from gyges.distributed.replay import ClusterReplay

    class Faulty(ClusterReplay):
        def kill(self, h):
            if not killed:
                killed.append(h)
                ray.kill(self.cluster.host(h).actor, no_restart=True)

        def start_transform(self, workers, tp, layers_per_step):
            h = workers[0] // self.gpus_per_host
            if point == "before_merge":
                self.kill(h)
            t = super().start_transform(workers, tp, layers_per_step)
            if point == "while_merging":
                self.kill(h)
            return t

        def finish_transform(self, row, t):
            super().finish_transform(row, t)
            if point == "after_merge":
                self.kill(row["gpu"] // self.gpus_per_host)

        def migrate(self, g, target):
            if point.startswith("migrating") and not killed:
                # after round 1 (live), at the last of one round (its stop sent), or before
                # the import (stop and copy)
                victim = (g if point.endswith("source") else target) // self.gpus_per_host
                on_call(self.cluster, 2 if "stop" in point else 3, lambda: self.kill(victim))
                if point.endswith("last_round"):
                    self.cluster.migrate = functools.partial(type(self.cluster).migrate,
                                                             self.cluster, max_rounds=1)
            try:
                return super().migrate(g, target)
            finally:
                self.cluster._get = type(self.cluster)._get.__get__(self.cluster)
                self.cluster.__dict__.pop("migrate", None)
    return Faulty


@pytest.mark.parametrize("point", FAULT_POINTS)
def test_a_replay_survives_a_host_killed_at_any_point(nodes, tiny, point, monkeypatch):
    """A host's actor is killed at one point of a replay: before a merge starts on it, while
    it merges, after its merge, while requests queue on it, or in the middle of a Llumnix
    migration (live, the destination or the source killed after round 1, or the destination
    at the last round, once the source has stopped the request; stop and copy, the
    destination killed before the import). Every time the replay finishes, every request
    finishes with one Host's tokens (none lost, none recomputed differently), and the
    controller drops the dead host's GPUs."""
    if point not in FAST_POINTS and not os.environ.get("GYGES_FAULT_SWEEP"):
        pytest.skip("GYGES_FAULT_SWEEP=1 runs every point")
    killed = []
    monkeypatch.setattr(gyges.Cluster, "replay_executor",
                        property(lambda self: faulty_replay(point, killed)))
    if point.startswith("migrating"):   # llumnix on one TP1 replica a host
        trace = traces.from_arrays(np.array([0.0, 0.01, 0.02, 0.03]),
                                   np.array([150, 300, 300, 150]), np.array([600, 80, 80, 600]))
        shape = dict(workers_per_host=1, layout="TP1", memory_per_worker="24MiB")
        run = dict(policy="llumnix", decode_weight=10.0, sample_interval=0.05,
                   migrate="stop" if "stop" in point else "live")
    elif point == "queued":   # one running request an instance: the others queue (each
        # instance's second arrives while its first still decodes, however fast this CPU)
        trace = traces.from_arrays(np.arange(8) * 0.01, np.array([40, 90, 60, 80, 30, 50, 20,
                                                                  70]), np.full(8, 120))
        shape = dict(REPLAY_HOST, max_running=1)
        run = dict(policy="round_robin")
    else:   # round robin over 2xTP1 hosts; requests only a TP2 holds make them merge
        caps = replay_capacities(tiny)
        long2 = (caps[0] + 8) * 16
        trace = traces.from_arrays(np.arange(8) * 0.3, np.array([40, long2, 60, long2 + 100,
                                                                 30, 50, 20, 70]),
                                   np.array([30, 8, 30, 8, 30, 30, 30, 30]))
        shape = REPLAY_HOST
        run = dict(policy="round_robin", layers_per_step=1)
    with gyges.Cluster(tiny, hosts=2, **shape) as cluster:
        seen = {}
        cluster.add_listener(lambda hs: seen.update({tuple(h.prompt): h for h in hs}))
        if point == "queued":   # host 1 with a request waiting behind a running one
            def waiting():
                while not killed:
                    rows = cluster.host(1).stats()["instances"]
                    if any(r["waiting"] and r["running"] for r in rows):
                        killed.append(1)
                        ray.kill(cluster.host(1).actor, no_restart=True)
                    time.sleep(0.002)
            threading.Thread(target=waiting, daemon=True).start()
        res = experiment.run(trace, cluster=cluster, time_limit=90, **run)
        assert killed and list(cluster.lost_hosts) == killed
    assert (res.requests["status"] == 3).all()
    assert res.stats["n_hosts_lost"] == 1 and "lost" in res.stats["final_layout"]
    assert res.stats["recompute_mismatches"] == 0
    if point.startswith("migrating"):
        assert res.stats["migrate_mode"] == run["migrate"]
    if point == "while_merging":
        assert res.stats["n_transformations_abandoned"] == 1
    assert_one_hosts_tokens(seen, replay_tokens(tiny, trace))


# ---- KunServe buddy groups whose members sit on different hosts (reconfig/split_buddy.py) ----

ONE = dict(workers_per_host=1, memory_per_worker="32MiB")


def one_host(model, ps, params):
    """Tokens and logprobs of one in-process one-worker Host."""
    host = gyges.Host(model, workers=1, memory_per_worker="32MiB")
    out = [(r.output_tokens, r.logprobs) for r in host.generate(ps, params)]
    host.close()
    return out


def started(handles, n=2):
    while not all(len(h.output_tokens) >= n or h.finished for h in handles):
        time.sleep(0.002)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_cluster_groups_two_hosts_instances_and_restores_them(nodes, tiny, params):
    """Host 0's and host 1's instances (on two Ray nodes) form a buddy group with requests in
    flight on both, serve as one pipeline split between the two processes, and are restored:
    every request's tokens are one Host's, the follower's requests moved to the leader and
    some back, and each host is a TP1 instance again."""
    params = gyges.SamplingParams(max_tokens=64, temperature=params.temperature,
                                  top_k=params.top_k, seed=params.seed, ignore_eos=True,
                                  logprobs=2)
    ps = prompts(6, seed=5)
    want = one_host(tiny, ps, params)
    with gyges.Cluster(tiny, hosts=2, **ONE) as cluster:
        handles = [cluster.submit(p, params, host=i % 2) for i, p in enumerate(ps)]
        started(handles)
        with pytest.raises(gyges.InvalidArgumentError, match="both members are on host 0"):
            cluster.buddy([(0, 0), (0, 0)])
        group = cluster.buddy([(0, 0), (1, 0)])
        assert group.stats["leader"]["weight_bytes_released"] > 0
        assert group.stats["follower"]["weight_bytes_released"] > 0
        unfinished = [h for h in handles if not h.finished]
        assert all(h.host == 0 for h in unfinished)
        assert cluster.host(0).layout() == "PP1" and cluster.host(1).layout() == ""
        started(handles, 12)
        cluster.restore(group)
        assert group.restored and cluster.groups == []
        assert cluster.host(0).layout() == cluster.host(1).layout() == "TP1"
        assert cluster.wait(handles, timeout=120)
        assert [(h.output_tokens, h.logprobs) for h in handles] == want
        assert all(h.recompute_mismatches == 0 and h.resubmitted == 0 for h in handles)
        assert group.stats["leader"]["kv_bytes_received"] > 0
        assert group.stats["follower"]["steps"] > 0


@pytest.mark.parametrize("lost", [1, 0], ids=["follower", "leader"])
def test_a_lost_member_host_leaves_the_other_serving_alone(nodes, tiny, lost):
    """A member's host actor is killed while the group serves. The follower lost: the leader's
    host gets its parameters back and its requests (every request of the group) recompute what
    the follower held. The leader lost: its requests are placed on the follower's host, which
    gets its parameters back. Either way every request finishes with one Host's tokens and the
    cluster serves on."""
    params = gyges.SamplingParams(max_tokens=96, temperature=0.9, top_k=40, seed=3,
                                  ignore_eos=True)
    ps = prompts(4, seed=6)
    want = one_host(tiny, ps, params)
    with gyges.Cluster(tiny, hosts=2, **ONE) as cluster:
        handles = [cluster.submit(p, params, host=i % 2) for i, p in enumerate(ps)]
        started(handles)
        cluster.buddy([(0, 0), (1, 0)])
        started(handles, 8)
        ray.kill(cluster.host(lost).actor, no_restart=True)
        killed = time.monotonic()
        while lost in cluster.live_hosts:
            time.sleep(0.01)
            assert time.monotonic() - killed < 10, "the lost host was not noticed"
        assert cluster.wait(handles, timeout=120)
        assert [h.output_tokens for h in handles] == [tokens for tokens, _ in want]
        assert all(h.recompute_mismatches == 0 for h in handles)
        assert cluster.groups == [] and cluster.host(1 - lost).layout() == "TP1"
        assert all(h.host == 1 - lost for h in handles if h.resubmitted)


# driver calls of a formation: info, pause, pause, lead_begin, follow_form, lead_form,
# follow_adopt, resume, resume, stats, stats; of a restore: stats, stats, pause, pause,
# lead_leave, follow_restore, lead_restore, resume, resume (make test kills at two of each;
# GYGES_FAULT_SWEEP=1 at all)
FORMATION_CALLS, RESTORE_CALLS = range(1, 12), range(1, 10)
FAST_FORMATION = {("leader", 6), ("follower", 7)}
# (the leader killed at the restore's pause (3) or before the follower's restore is waited for
# (6) stranded a request about 1 run in 5 to 10 until a restore's calls and a loss's dissolve
# were ordered on the follower and every notice of a loss dissolved before sending on)
FAST_RESTORE = {("leader", 2), ("leader", 6), ("follower", 6)}


def split_group_killed_at(tiny, victim, call, fast, operate):
    """Four requests on two one-worker hosts; `operate(cluster)` (forming or restoring a buddy
    group split between them) with the leader's or the follower's host killed before the
    driver's `call`-th wait of the operation that ends it. It completes or is refused with a
    gyges.Error; either way no group is left, the surviving host serves a TP1 instance and
    every request finishes with one Host's tokens."""
    if (victim, call) not in fast and not os.environ.get("GYGES_FAULT_SWEEP"):
        pytest.skip("GYGES_FAULT_SWEEP=1 runs every point")
    params = gyges.SamplingParams(max_tokens=48, temperature=0.9, top_k=40, seed=3,
                                  ignore_eos=True)
    ps = prompts(4, seed=8)
    want = one_host(tiny, ps, params)
    host = 0 if victim == "leader" else 1
    with gyges.Cluster(tiny, hosts=2, **ONE) as cluster:
        handles = [cluster.submit(p, params, host=i % 2) for i, p in enumerate(ps)]
        started(handles)
        operate(cluster, lambda: on_call(cluster, call, lambda: ray.kill(
            cluster.host(host).actor, no_restart=True)), handles)
        cluster._get = type(cluster)._get.__get__(cluster)
        if host in cluster.live_hosts:   # killed after the operation's last wait
            ray.kill(cluster.host(host).actor, no_restart=True)
        killed = time.monotonic()
        while host in cluster.live_hosts:
            time.sleep(0.01)
            assert time.monotonic() - killed < 10, "the lost host was not noticed"
        assert cluster.wait(handles, timeout=60), [
            (h.host, h.finished, h._epoch, h.resubmitted, len(h.output_tokens)) for h in handles]
        assert [(h.finish_reason, h.error) for h in handles] == [("length", None)] * len(ps)
        assert [h.output_tokens for h in handles] == [tokens for tokens, _ in want]
        assert all(h.recompute_mismatches == 0 for h in handles)
        assert cluster.groups == [] and cluster.host(1 - host).layout() == "TP1"


@pytest.mark.parametrize("victim", ["leader", "follower"])
@pytest.mark.parametrize("call", FORMATION_CALLS)
def test_a_member_host_killed_while_a_split_group_forms_loses_nothing(nodes, tiny, victim, call):
    """split_group_killed_at for Cluster.buddy: every step of the formation in turn."""
    def operate(cluster, arm, handles):
        arm()
        try:
            cluster.buddy([(0, 0), (1, 0)])
        except gyges.Error:
            pass
    split_group_killed_at(tiny, victim, call, FAST_FORMATION, operate)


@pytest.mark.parametrize("victim", ["leader", "follower"])
@pytest.mark.parametrize("call", RESTORE_CALLS)
def test_a_member_host_killed_while_a_split_group_restores_loses_nothing(nodes, tiny, victim,
                                                                         call):
    """split_group_killed_at for Cluster.restore of a formed group (some requests on their way
    to the follower's host when it strikes)."""
    def operate(cluster, arm, handles):
        group = cluster.buddy([(0, 0), (1, 0)])
        started(handles, 6)
        arm()
        try:
            cluster.restore(group)
        except gyges.Error:
            pass
    split_group_killed_at(tiny, victim, call, FAST_RESTORE, operate)
