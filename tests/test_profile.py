"""Profiled cost models (gyges.cluster.profile, issue 35 part 2): the C backend against its
float64 reference; a profile of the tiny model on a real 2-worker host, its fit on its own grid,
its file, and the simulator's prediction of a small real replay with it; refusals.

Tolerances: this machine is shared (two cores, other jobs), so one real run's mean TTFT moves by
up to 2x from the next under load (measured while writing these tests); the replay check is
therefore a factor of 2, not the benchmark's 5% (benchmarks/bench_fidelity.py measures that,
the mean of 3 runs). The fit check allows noisy points but not a wrong model: a missing term or a
coefficient off by 2x fails it."""
import math

import numpy as np
import pytest

import gyges
from gyges import _C, _C_test, experiment, sim, traces
from gyges.cluster.profile import ProfiledCost, ProfileError, TERMS

GRID = {"batch": (1, 4), "context": (32, 96), "prefill": (32, 128)}


def hand_cost(**changes):
    """A profiled model with made-up coefficients for two TP levels (no host)."""
    kw = dict(model=gyges.Model.tiny().config,
              levels=((1e-3, 2e-4, 3e-4, 1e-6, 5e-8), (2e-3, 1e-4, 1e-4, 5e-7, 2e-8)),
              capacity=(56, 120), block_size=16, kv_bytes_per_token=4096.0, ffn_bytes=8e6,
              xfer_bw=2e9, phase_latency_per_layer=1e-4, transform_slowdown=0.25)
    return ProfiledCost(**{**kw, **changes})


def test_the_c_backend_matches_its_reference():
    cost = hand_cost()
    p = cost.params()
    for tp in (1, 2, 4):   # TP4: beyond the levels, priced as the last one
        for transforming in (False, True):
            for n, samples, kv, pairs in ((1, 1, 40.0, 40.0), (512, 1, 700.0, 1e5),
                                          (37, 30, 3000.0, 9000.0), (0, 0, 0.0, 0.0)):
                got = _C_test.sim_step_time("profiled", p, tp, transforming, n, 1, samples, kv,
                                            pairs)
                want = cost.step_time(tp, n, 1, samples, kv, pairs, transforming)
                assert got == pytest.approx(want, rel=1e-12, abs=0)
    assert cost.step_time(4, 10) == cost.step_time(2, 10) != cost.step_time(1, 10)
    for kind, phase in enumerate(("weights_drop", "kv_scatter", "weights_gather")):
        for a, b in ((1, 2), (2, 1)):
            got = _C_test.sim_phase_time("profiled", p, kind, a, b, 5000.0)
            want = cost.phase_time(phase, a, b, 5000.0)
            assert got == pytest.approx(want, rel=1e-12)
    # the controller's prefill rates come from it too
    rates = _C.sim_prefill_rates("profiled", p, 2, 256)
    shape = dict(n_tokens=256, n_samples=1, kv_read_tokens=256.0, attn_pairs=256 * 257 / 2)
    assert rates == pytest.approx([256 / cost.step_time(1, **shape),
                                   256 / cost.step_time(2, **shape)], rel=1e-12)
    # with the alone coefficients a step goes from them (no other worker busy) to the busy ones
    alone = hand_cost(levels=((5e-4, 1e-4, 1e-4, 5e-7, 2e-8), (1e-3, 5e-5, 5e-5, 2e-7, 1e-8)))
    both = cost.with_alone(alone)
    pb = both.params()
    for tp, share in ((1, 0.0), (1, 1.0), (2, 0.25), (1, 0.6), (2, 7.0)):
        got = _C_test.sim_step_time("profiled", pb, tp, False, 300, 2, 2, 900.0, 5e4, share)
        want = both.step_time(tp, 300, 2, 2, 900.0, 5e4, busy_share=share)
        assert got == pytest.approx(want, rel=1e-12, abs=0)
    one, busy = alone.step_time(1, 300, 2, 2, 900.0, 5e4), cost.step_time(1, 300, 2, 2, 900.0, 5e4)
    assert both.step_time(1, 300, 2, 2, 900.0, 5e4, busy_share=0.0) == pytest.approx(one)
    assert both.step_time(1, 300, 2, 2, 900.0, 5e4, busy_share=1.0) == pytest.approx(busy)
    assert both.step_time(1, 300, 2, 2, 900.0, 5e4, busy_share=0.5) == \
        pytest.approx((one + busy) / 2)
    with pytest.raises(ProfileError, match="same model"):
        cost.with_alone(hand_cost(capacity=(56, 64)))
    with pytest.raises(ProfileError, match="alone coefficients of TP2"):
        cost.replace(alone=((1e-3,) * len(TERMS), (0.0,) * len(TERMS)))


def test_the_simulator_prices_a_step_by_how_many_of_the_hosts_workers_are_busy():
    """With alone coefficients the simulator passes each step the share of the host's other
    workers stepping when it starts: one request alone runs at the alone speed; two at once on
    the two workers run slower than alone and no slower than all busy."""
    busy = hand_cost()
    alone = hand_cost(levels=tuple(tuple(c / 3 for c in lv) for lv in busy.levels))
    both = busy.with_alone(alone)
    kw = dict(policy="round_robin", gpus_per_host=2, block_size=16, watermark=0.0, check=True)
    one = traces.from_arrays([0.0], [64], [30])
    finish = {name: sim.run(one, cost=c, **kw).requests["finish"][0]
              for name, c in (("alone", alone), ("both", both))}
    assert finish["both"] == pytest.approx(finish["alone"], rel=1e-12)
    two = traces.from_arrays([0.0, 0.0], [64, 64], [30, 30])
    f = {name: sim.run(two, cost=c, **kw).requests["finish"].max()
         for name, c in (("alone", alone), ("busy", busy), ("both", both))}
    assert f["alone"] < f["both"] <= f["busy"] * (1 + 1e-12)


def fit_is_close(cost):
    """Whether the fit reproduces its own grid: single points are noisy (a step here is 1-100
    ms of a shared CPU, two instances at once; under a load of 6 on 2 cores a 1-token decode
    point measured 18 ms against 2 ms unloaded), so the median point within 25% and each TP's
    prefill and decode points on the whole (their fitted time summed) within 20%."""
    report = cost.fit_report()
    err = np.array([abs(r["error"]) for r in report])
    if np.median(err) >= 0.25:
        return False
    for tp in (1, 2):
        for kind in ("prefill", "decode"):
            mine = [r for r in report if r["tp"] == tp and r["kind"] == kind]
            fitted, measured = (sum(r[k] for r in mine) for k in ("fitted", "seconds"))
            if abs(fitted / measured - 1) >= 0.20:
                return False
    return True


@pytest.fixture(scope="module")
def profiled():
    """The tiny model's profile on 2 workers; measured once more when a burst of the machine's
    load spoilt the first (a wrong model fails both)."""
    host = gyges.Host(gyges.Model.tiny(), workers=2, memory_per_worker="24MiB", layout="2xTP1")
    cost = ProfiledCost.profile(host, GRID, warmup=1, repeats=5)
    if not fit_is_close(cost):
        cost = ProfiledCost.profile(host, GRID, warmup=1, repeats=5)
    assert host.layout() == "2xTP1" and not host.has_unfinished()   # as it began
    host.close()
    return cost


def test_the_fit_recovers_known_coefficients_on_the_measured_shapes(profiled):
    """Times made from known coefficients on the grid's real shapes: the fit gives them back."""
    truth = hand_cost()
    points = [{**p, "seconds": truth.step_time(p["tp"], p["n_tokens"], p["n_seqs"],
                                               p["n_samples"], p["kv_read_tokens"],
                                               p["attn_pairs"])} for p in profiled.points]
    fit = ProfiledCost.fit(points, profiled.transforms, profiled.model, profiled.capacity, 16,
                           profiled.kv_bytes_per_token, profiled.ffn_bytes)
    for r in fit.fit_report():
        assert r["error"] == pytest.approx(0, abs=1e-9)
    with pytest.raises(ProfileError, match="at least 5"):
        ProfiledCost.fit(points[:4], (), profiled.model, (56,), 16, 4096.0, 1e6)
    with pytest.raises(ProfileError, match="without gaps"):
        ProfiledCost.fit([p for p in points if p["tp"] == 2], (), profiled.model, (56,), 16,
                         4096.0, 1e6)


def test_the_profile_fits_its_own_grid(profiled, tmp_path):
    cost = profiled
    assert len(cost.levels) == 2   # TP1 and TP2 (merged from the two workers)
    kinds = {(p["tp"], p["kind"]) for p in cost.points}
    assert kinds == {(1, "prefill"), (1, "decode"), (2, "prefill"), (2, "decode")}
    # two instances at TP1 (both busy at once), one at TP2
    assert sum(p["tp"] == 1 for p in cost.points) == 2 * 6
    assert sum(p["tp"] == 2 for p in cost.points) == 6
    report = cost.fit_report()
    assert fit_is_close(cost), [(r["tp"], r["kind"], r["n_tokens"], round(r["error"], 2))
                                for r in report]
    # a 256-token prefill costs more than a decode step: the model orders the shapes as measured
    assert cost.step_time(1, 256, 1, 1, 256.0, 256 * 257 / 2) > 5 * cost.step_time(1, 1, 1, 1,
                                                                                    96.0, 96.0)
    # merges and splits were timed, with KV in flight and without, and priced from them
    assert {t["kind"] for t in cost.transforms} == {"merge", "split"}
    assert any(t["kv_tokens"] > 0 for t in cost.transforms)
    assert cost.phase_latency_per_layer > 0 or cost.xfer_bw < 1e12
    # the file gives the same model back
    again = ProfiledCost.load(cost.save(tmp_path / "tiny.json"))
    assert again == cost and again.fit_report() == report


def test_the_simulator_predicts_a_real_replay_with_the_profile(profiled):
    """A held-out trace (not the grid: mixed prompt lengths, decodes beside prefills) on the real
    host under round robin and in the simulator with the profile: mean TTFT and TPOT within a
    factor of 2 (a profile taken in a burst of the machine's load is slow throughout: a TPOT
    came out 2.05x once in 4 runs, 1.0-1.3x otherwise), output throughput within 15%. The
    arrivals keep both instances busy, as the profile measured them (on a light trace an
    instance often steps alone, faster: the benchmark's light trace is off by up to 1.5x for
    that)."""
    trace = traces.poisson(8.0, duration=3.0, input_tokens=(32, 160), output_tokens=(8, 32),
                           seed=5)
    host = gyges.Host(gyges.Model.tiny(), workers=2, memory_per_worker="24MiB", layout="2xTP1")
    real = experiment.run(trace, "round_robin", host=host, cost=profiled).summary()
    simulated = sim.run(trace, "round_robin", gpus_per_host=2, cost=profiled,
                        block_size=host.block_size, max_batch_tokens=host.max_batch_tokens,
                        max_running=host.max_running, watermark=0.0).summary()
    host.close()
    assert real["completed"] == simulated["completed"] == len(trace)
    assert simulated["output_throughput"] == pytest.approx(real["output_throughput"], rel=0.15)
    for key in ("ttft_mean", "tpot_mean"):
        ratio = simulated[key] / real[key]
        assert 1 / 2 < ratio < 2, (key, simulated[key], real[key])


def test_a_point_only_a_larger_tp_holds_is_measured_there():
    """A prompt of 1280 tokens and a decode at context 1024 exceed a TP1 instance of this host
    (56 blocks of 16 tokens) but not its TP2 (256): they are measured at TP2 only, so that the
    profile covers the long prompts a merged instance serves instead of extrapolating to them;
    the KV a split brings back to TP1 is a point TP1 holds."""
    host = gyges.Host(gyges.Model.tiny(), workers=2, memory_per_worker="24MiB", layout="2xTP1")
    grid = {"batch": (1, 2), "context": (32, 96, 1024), "prefill": (32, 128, 1280)}
    cost = ProfiledCost.profile(host, grid, warmup=1, repeats=2)
    assert host.layout() == "2xTP1"
    host.close()
    longest = {tp: max(p["kv_read_tokens"] for p in cost.points if p["tp"] == tp)
               for tp in (1, 2)}
    assert longest[1] <= 56 * 16 < 1280 <= longest[2]
    decodes = {(p["tp"], p["n_seqs"], p["kv_read_tokens"] > 1000) for p in cost.points
               if p["kind"] == "decode"}
    assert (2, 1, True) in decodes and (1, 1, True) not in decodes
    assert fit_is_close(cost)


def test_bad_grids_hosts_and_profiles_are_refused(tmp_path):
    host = gyges.Host(gyges.Model.tiny(), workers=2, memory_per_worker="24MiB", layout="2xTP1")
    for grid, match in (({"batch": (1, 0), "context": (32,), "prefill": (32,)}, "ints >= 1"),
                        ({"batch": (1,), "context": (), "prefill": (32,)}, "needs decode"),
                        ({"batch": (1,), "context": (32,), "prefill": (32,)}, "fewer than"),
                        ({"batch": (1, 2), "context": (32,), "prefill": (32,), "tp": (1,)},
                         "must be a dict of"),
                        ({"batch": "12", "context": (32,), "prefill": (32,)}, "sequence"),
                        ({"batch": (64,), "context": (4000,), "prefill": (32, 64, 96, 128)},
                         "holds 0 decode and 4 prefill points")):
        with pytest.raises(ProfileError, match=match):
            ProfiledCost.profile(host, grid)
    with pytest.raises(ProfileError, match="repeats"):
        ProfiledCost.profile(host, GRID, repeats=0)
    with pytest.raises(ProfileError, match="max_tp"):
        ProfiledCost.profile(host, GRID, max_tp=4)
    with pytest.raises(ProfileError, match="gyges.Host"):
        ProfiledCost.profile("localhost", GRID)
    h = host.submit([5, 6, 7], gyges.SamplingParams(max_tokens=2))
    with pytest.raises(ProfileError, match="idle host"):
        ProfiledCost.profile(host, GRID)
    host.abort(h)
    host.close()
    merged = gyges.Host(gyges.Model.tiny(), workers=2, memory_per_worker="24MiB", layout="1xTP2")
    with pytest.raises(ProfileError, match="TP1 instances"):
        ProfiledCost.profile(merged, GRID)
    merged.close()
    # a profile that makes no sense, a file that is not one, a TP it did not measure
    with pytest.raises(ProfileError, match="per_token of TP2"):
        hand_cost(levels=((1e-3,) * len(TERMS), (1e-3, -1e-4, 0.0, 0.0, 0.0)))
    with pytest.raises(ProfileError, match="capacity"):
        hand_cost(capacity=(56,))
    bad = tmp_path / "bad.json"
    bad.write_text('{"kind": "roofline"}')
    with pytest.raises(ProfileError, match="not a profiled cost model"):
        ProfiledCost.load(bad)
    with pytest.raises(ProfileError, match="cannot read"):
        ProfiledCost.load(tmp_path / "missing.json")
    trace = traces.poisson(1.0, duration=2.0, seed=1)
    with pytest.raises(ProfileError, match="measured TP up to 2"):
        sim.run(trace, "round_robin", gpus_per_host=4, cost=hand_cost())
    # the C check behind the Python one
    p = hand_cost().params()
    p["per_pair"] = [1e-8, -1.0]
    with pytest.raises(gyges.InvalidArgumentError, match="per_pair of TP2"):
        _C.sim_prefill_rates("profiled", p, 2, 128)
    assert math.isfinite(_C.sim_prefill_rates("profiled", hand_cost().params(), 2, 128)[1])
