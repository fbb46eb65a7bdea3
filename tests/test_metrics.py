"""Tests for gyges.metrics: a hand-computed example, percentiles against the statistics module
(an independent implementation of the same linear interpolation), and SLO edge cases."""

import math
import statistics

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyges import metrics
from gyges.cluster.metrics import REQUEST_DTYPE, MetricsError

NAN = float("nan")


def hand_example():
    """Five requests whose metrics are worked out by hand in the tests below.

    0: completed; ttft 1.0, tpot (3.0-1.0)/4 = 0.5, e2e 3.0, queue 0.5
    1: completed; ttft 0.5, tpot (3.5-1.5)/2 = 1.0, e2e 2.5, queue 0.0
    2: completed with 1 output token; ttft 2.0, no tpot, e2e 2.0, queue 1.0
    3: rejected (never scheduled)
    4: unfinished (scheduled, first token, never finished)
    """
    rows = [
        # arrival scheduled first_token finish input output
        (0.0, 0.5, 1.0, 3.0, 100, 5),
        (1.0, 1.0, 1.5, 3.5, 200, 3),
        (2.0, 3.0, 4.0, 4.0, 50, 1),
        (2.5, NAN, NAN, NAN, 80, 0),
        (3.0, 3.5, 4.0, NAN, 70, 10),
    ]
    return np.array(rows, dtype=REQUEST_DTYPE)


HAND_TOKEN_TIMES = [
    np.array([1.0, 1.5, 2.0, 2.5, 3.0]),   # gaps .5 .5 .5 .5
    np.array([1.5, 2.0, 3.5]),             # gaps .5 1.5
    np.array([4.0]),                       # no gap
    np.array([]),                          # rejected
    np.array([4.0, 4.2]),                  # unfinished: not in ITL
]


def test_summarize_hand_example():
    s = metrics.summarize(hand_example(), token_times=HAND_TOKEN_TIMES)
    assert (s["completed"], s["rejected"], s["unfinished"]) == (3, 1, 1)
    assert s["requests"] == 5 and s["latency_requests"] == 3  # latencies: completed ones only
    assert s["total_input"] == 350 and s["total_output"] == 9
    assert s["duration"] == 4.0                      # last finish 4.0 - first arrival 0.0
    assert s["request_throughput"] == 0.75
    assert s["output_throughput"] == 2.25
    assert s["total_token_throughput"] == 89.75      # (350 + 9) / 4
    approx = pytest.approx
    # TTFT [1.0, 0.5, 2.0]
    assert s["ttft_mean"] == approx(3.5 / 3)
    assert s["ttft_median"] == 1.0
    assert s["ttft_std"] == approx(math.sqrt(7 / 18))  # deviations -1/6, -2/3, 5/6
    assert s["ttft_p90"] == approx(1.8)              # sorted .5 1 2: rank 1.8
    assert s["ttft_p99"] == approx(1.98)
    # TPOT [0.5, 1.0]
    assert s["tpot_mean"] == 0.75 and s["tpot_median"] == 0.75
    assert s["tpot_p90"] == approx(0.95) and s["tpot_std"] == approx(0.25)
    # E2E [3.0, 2.5, 2.0], queue [0.5, 0.0, 1.0]
    assert s["e2e_mean"] == 2.5 and s["e2e_median"] == 2.5 and s["e2e_p99"] == approx(2.99)
    assert s["queue_mean"] == 0.5 and s["queue_p90"] == approx(0.9)
    # ITL pooled [.5 .5 .5 .5 .5 1.5]
    assert s["itl_mean"] == approx(4 / 6) and s["itl_median"] == 0.5
    assert s["itl_p90"] == approx(1.0) and s["itl_p99"] == approx(1.45)
    assert "goodput" not in s


def test_itl_keys_only_with_token_times():
    s = metrics.summarize(hand_example())
    assert not any(k.startswith("itl_") for k in s)


def test_per_request_hand_example():
    pr = metrics.per_request(hand_example())
    np.testing.assert_allclose(pr["ttft"][:3], [1.0, 0.5, 2.0])
    np.testing.assert_allclose(pr["tpot"][:2], [0.5, 1.0])
    assert math.isnan(pr["tpot"][2])                 # one output token: TPOT undefined
    np.testing.assert_allclose(pr["e2e"][:3], [3.0, 2.5, 2.0])
    np.testing.assert_allclose(pr["queue"], [0.5, 0.0, 1.0, NAN, 0.5])
    assert math.isnan(pr["ttft"][3]) and math.isnan(pr["e2e"][4])


@pytest.mark.parametrize("slo, good", [
    ({"ttft": 1.0, "tpot": 0.5}, 1),     # request 0 sits exactly on both limits: passes
    ({"ttft": 0.999, "tpot": 0.5}, 0),   # just under its TTFT: fails
    ({"tpot": 0.1}, 1),                  # request 2 (one token) counts as TPOT 0
    ({"e2e": 2.0}, 1),
    ({"queue": 0.0}, 1),
    ({"ttft": 1e9}, 3),                  # rejected and unfinished requests are never good
    ({}, 3),                             # no constraint
])
def test_goodput_slo_edges(slo, good):
    s = metrics.summarize(hand_example(), slo=slo)
    assert s["good_completed"] == good
    assert s["goodput"] == good / 4.0
    assert s["slo_attainment"] == good / 5  # over all 5 requests: the rejected one is a miss


def test_slo_argument_errors():
    with pytest.raises(ValueError, match="unknown SLO 'itl'"):
        metrics.summarize(hand_example(), slo={"itl": 0.1})
    with pytest.raises(ValueError, match="SLO 'ttft'.*-1"):
        metrics.summarize(hand_example(), slo={"ttft": -1})
    with pytest.raises(TypeError, match="slo must be a dict"):
        metrics.summarize(hand_example(), slo=[("ttft", 1)])


def test_nothing_completed():
    r = hand_example()[3:4]
    s = metrics.summarize(r, slo={"ttft": 1.0})
    assert s["completed"] == 0 and s["rejected"] == 1
    assert s["request_throughput"] == 0.0 and s["goodput"] == 0.0
    assert math.isnan(s["duration"]) and math.isnan(s["ttft_mean"]) and math.isnan(s["tpot_p99"])


def pct_reference(data, q):
    """Linear-interpolation percentile from the statistics module (method='inclusive' is the
    same rule as NumPy's default, implemented independently)."""
    if len(data) == 1:
        return data[0]
    return statistics.quantiles(data, n=1000, method="inclusive")[int(q * 10) - 1]


def random_requests(n, seed):
    rng = np.random.default_rng(seed)
    r = np.zeros(n, dtype=REQUEST_DTYPE)
    r["arrival"] = np.sort(rng.uniform(0, 100, n))
    r["scheduled"] = r["arrival"] + rng.exponential(0.3, n)
    r["first_token"] = r["scheduled"] + rng.exponential(0.2, n)
    r["output_tokens"] = rng.integers(1, 400, n)
    r["finish"] = r["first_token"] + r["output_tokens"] * rng.uniform(0.01, 0.05, n)
    r["input_tokens"] = rng.integers(1, 4000, n)
    return r


@pytest.mark.parametrize("n", [1, 2, 7, 101, 1000])
def test_percentiles_match_statistics_module(n):
    r = random_requests(n, seed=n)
    s = metrics.summarize(r, percentiles=(50, 90, 99, 99.9))
    for name, values in (("ttft", r["first_token"] - r["arrival"]),
                         ("e2e", r["finish"] - r["arrival"]),
                         ("queue", r["scheduled"] - r["arrival"])):
        data = [float(v) for v in values]
        # Tolerance: a few ulps of the values (< 100 s), from differing summation order.
        tol = dict(rel=1e-12, abs=1e-12)
        assert s[f"{name}_mean"] == pytest.approx(statistics.fmean(data), **tol)
        assert s[f"{name}_median"] == pytest.approx(statistics.median(data), **tol)
        assert s[f"{name}_std"] == pytest.approx(statistics.pstdev(data), **tol)
        for q in (50, 90, 99, 99.9):
            assert s[f"{name}_p{q:g}"] == pytest.approx(pct_reference(data, q), **tol), (name, q)
    assert s["request_throughput"] == pytest.approx(n / (r["finish"].max() - r["arrival"].min()))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0, 1e3, allow_nan=False), min_size=2, max_size=40))
def test_ttft_percentiles_property(ttfts):
    n = len(ttfts)
    r = np.zeros(n, dtype=REQUEST_DTYPE)
    r["first_token"] = ttfts
    r["scheduled"] = 0.0
    r["finish"] = r["first_token"] + 1.0
    r["output_tokens"] = 2
    s = metrics.summarize(r)
    for q in (90, 99):
        ref = statistics.quantiles(ttfts, n=100, method="inclusive")[q - 1]
        assert s[f"ttft_p{q}"] == pytest.approx(ref, rel=1e-9, abs=1e-9)


def test_throughput_timeseries_hand_example():
    starts, tps = metrics.throughput_timeseries(hand_example(), HAND_TOKEN_TIMES, bin_seconds=1.0)
    # Token times bucketed by hand into [0,1) [1,2) [2,3) [3,4) [4,5).
    np.testing.assert_array_equal(starts, [0, 1, 2, 3, 4])
    np.testing.assert_array_equal(tps, [0, 3, 3, 2, 3])
    starts, tps = metrics.throughput_timeseries(hand_example(), HAND_TOKEN_TIMES, bin_seconds=2.0)
    np.testing.assert_array_equal(starts, [0, 2, 4])
    np.testing.assert_array_equal(tps, [1.5, 2.5, 1.5])
    # Every token is counted once.
    assert tps.sum() * 2.0 == sum(len(t) for t in HAND_TOKEN_TIMES)


def test_inter_token_latencies_pooled():
    itl = metrics.inter_token_latencies(hand_example(), HAND_TOKEN_TIMES)
    np.testing.assert_allclose(np.sort(itl), [0.5] * 5 + [1.5])


def test_request_validation_names_the_request():
    r = hand_example()
    r["finish"][1] = 1.2                              # before its first token at 1.5
    with pytest.raises(MetricsError, match=r"request 1: finish is before first_token"):
        metrics.summarize(r)
    r = hand_example()
    r["first_token"][0] = NAN
    with pytest.raises(MetricsError, match=r"request 0: finished but first_token is missing"):
        metrics.summarize(r)
    r = hand_example()
    r["output_tokens"][2] = 0
    with pytest.raises(MetricsError, match=r"request 2: finished with fewer than 1"):
        metrics.summarize(r)
    with pytest.raises(MetricsError, match=r"lack field\(s\) \['scheduled'"):
        metrics.summarize(np.zeros(2, dtype=[("arrival", "f8"), ("first_token", "f8"),
                                              ("finish", "f8"), ("input_tokens", "i8"),
                                              ("output_tokens", "i8")]))
    with pytest.raises(TypeError, match="structured array"):
        metrics.summarize([1, 2, 3])


def test_token_times_validation():
    with pytest.raises(MetricsError, match="4 entries for 5 requests"):
        metrics.summarize(hand_example(), token_times=HAND_TOKEN_TIMES[:4])
    bad = list(HAND_TOKEN_TIMES)
    bad[1] = np.array([1.5, 3.5, 2.0])
    with pytest.raises(MetricsError, match=r"request 1: token time 2 \(2.0\) is before token 1"):
        metrics.summarize(hand_example(), token_times=bad)
    with pytest.raises(ValueError, match="bin_seconds"):
        metrics.throughput_timeseries(hand_example(), HAND_TOKEN_TIMES, bin_seconds=0)


def test_extra_fields_and_other_dtypes_are_accepted():
    r = hand_example()
    wide = np.zeros(r.size, dtype=REQUEST_DTYPE.descr + [("id", "i4")])
    for f in REQUEST_DTYPE.names:
        wide[f] = r[f]
    a, b = metrics.summarize(wide), metrics.summarize(r)
    assert a.keys() == b.keys()
    assert all(a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in a)
