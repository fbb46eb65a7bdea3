"""Tests for gyges.traces: loaders against the csv/json modules, generators against their
statistical definitions, transforms against hand-computed examples."""

import csv
import datetime as dt
import gzip
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

from gyges import traces
from gyges.cluster.traces import TRACE_DTYPE, TraceError

TRACES_DIR = Path(os.environ.get("GYGES_TRACES",
                                 Path(__file__).resolve().parents[2] / "shared" / "traces"))


def real_trace(name: str) -> Path:
    path = TRACES_DIR / name
    if not path.exists():
        pytest.skip(f"real trace {path} is absent (the shared traces folder is not mounted)")
    return path


def write(tmp_path, name, text) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def assert_well_formed(t):
    assert t.dtype == TRACE_DTYPE
    assert np.all(np.diff(t["arrival"]) >= 0)
    assert np.all(t["input_tokens"] >= 1)
    assert np.all(t["output_tokens"] >= 0)


# ---------------------------------------------------------------------------------------------
# Real files: every row checked against an independent parse with the csv / json modules.


def azure_reference(path):
    """(seconds from the first row, context, generated) parsed with datetime, exactly: the 7th
    fractional digit (100 ns), which %f cannot read, is added as an integer."""
    ticks, ctx, gen = [], [], []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            ts = row["TIMESTAMP"]
            base = dt.datetime.strptime(ts[:26], "%Y-%m-%d %H:%M:%S.%f")
            us = (base - dt.datetime(1970, 1, 1)) // dt.timedelta(microseconds=1)
            ticks.append(us * 10 + int(ts[26:] or 0))    # in units of 100 ns
            ctx.append(int(row["ContextTokens"]))
            gen.append(int(row["GeneratedTokens"]))
    ticks = np.array(ticks, dtype=np.int64)
    return (ticks - ticks[0]) / 1e7, np.array(ctx), np.array(gen)


def test_azure_conv_real_file_matches_csv_module():
    path = real_trace("azure_llm_2023_conv.csv")
    t = traces.load_azure(path)
    assert_well_formed(t)
    assert t.size == 19_366
    ref_t, ref_in, ref_out = azure_reference(path)
    assert t["arrival"][0] == 0.0
    # 18:15:46.6805900 -> 19:14:08.4025270 (first and last rows of the file).
    assert t["arrival"][-1] == pytest.approx(3501.721937, abs=1e-9)
    # float64 seconds below 1e4 carry ~1e-12 s of rounding; the file's resolution is 1e-7 s.
    np.testing.assert_allclose(t["arrival"], ref_t, rtol=0, atol=1e-9)
    np.testing.assert_array_equal(t["input_tokens"], ref_in)
    np.testing.assert_array_equal(t["output_tokens"], ref_out)
    assert np.all(t["priority"] == 0)
    np.testing.assert_array_equal(traces.load(path), t)


def test_mooncake_real_file_matches_json_module():
    path = real_trace("mooncake_synthetic.jsonl")
    t, hashes = traces.load_mooncake(path, with_hash_ids=True)
    assert_well_formed(t)
    assert t.size == 3_993
    with open(path) as f:
        ref = [json.loads(line) for line in f if line.strip()]
    assert t["arrival"][0] == 0.0
    assert t["arrival"][-1] == pytest.approx(1022.025, abs=1e-9)
    np.testing.assert_allclose(t["arrival"], [r["timestamp"] / 1000 for r in ref], atol=1e-12)
    np.testing.assert_array_equal(t["input_tokens"], [r["input_length"] for r in ref])
    np.testing.assert_array_equal(t["output_tokens"], [r["output_length"] for r in ref])
    for k in (0, 1, 1234, len(ref) - 1):
        np.testing.assert_array_equal(hashes[k], ref[k]["hash_ids"])
    np.testing.assert_array_equal(traces.load(path), t)


# ---------------------------------------------------------------------------------------------
# Small generated files in every format


AZURE_2023 = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:16:46.6805901,12,1
"""

# The 2024 week-long release: same columns; written here with 6 fractional digits, a UTC
# offset, and one timestamp without a fraction, to cover the forms such exports take.
AZURE_2024 = """TIMESTAMP,ContextTokens,GeneratedTokens
2024-05-10 00:00:00.009875+00:00,2048,28
2024-05-10 02:00:01+02:00,1,7
2024-05-10 00:00:02.5+00:00,4096,1
"""

BURSTGPT = """Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
5,ChatGPT,472,18,490,Conversation log
5.5,GPT-4,1021,0,1021,Conversation log
7.25,ChatGPT,30,200,230,API log
9,GPT-4,64,32,96,API log
"""

MOONCAKE = """{"timestamp": 1000, "input_length": 40160, "output_length": 6, "hash_ids": [0, 1]}
{"timestamp": 1000, "input_length": 512, "output_length": 4, "hash_ids": [2]}

{"timestamp": 3500, "input_length": 1, "output_length": 83, "hash_ids": []}
"""


def test_azure_2023_small(tmp_path):
    t = traces.load_azure(write(tmp_path, "a.csv", AZURE_2023))
    np.testing.assert_allclose(t["arrival"], [0.0, 4.314579, 60.0000001], atol=1e-12)
    np.testing.assert_array_equal(t["input_tokens"], [374, 396, 12])
    np.testing.assert_array_equal(t["output_tokens"], [44, 109, 1])


def test_azure_2024_variant_offsets_are_applied(tmp_path):
    t = traces.load(write(tmp_path, "a.csv", AZURE_2024))
    # 02:00:01+02:00 is 00:00:01 UTC.
    np.testing.assert_allclose(t["arrival"], [0.0, 1.0 - 0.009875, 2.5 - 0.009875], atol=1e-12)
    np.testing.assert_array_equal(t["input_tokens"], [2048, 1, 4096])


def test_azure_start_none_keeps_epoch_seconds(tmp_path):
    t = traces.load_azure(write(tmp_path, "a.csv", AZURE_2023), start=None)
    epoch = dt.datetime(2023, 11, 16, 18, 15, 46, 680590, tzinfo=dt.timezone.utc).timestamp()
    assert t["arrival"][0] == pytest.approx(epoch, abs=1e-6)
    t5 = traces.load_azure(write(tmp_path, "b.csv", AZURE_2023), start=5.0)
    assert t5["arrival"][0] == 5.0


def test_azure_gzip(tmp_path):
    path = tmp_path / "a.csv.gz"
    with gzip.open(path, "wt") as f:
        f.write(AZURE_2023)
    np.testing.assert_array_equal(traces.load(path),
                                  traces.load_azure(write(tmp_path, "a.csv", AZURE_2023)))


def test_burstgpt_drops_failed_by_default(tmp_path):
    path = write(tmp_path, "b.csv", BURSTGPT)
    t = traces.load_burstgpt(path)
    np.testing.assert_allclose(t["arrival"], [0.0, 2.25, 4.0])
    np.testing.assert_array_equal(t["input_tokens"], [472, 30, 64])
    np.testing.assert_array_equal(t["output_tokens"], [18, 200, 32])
    np.testing.assert_array_equal(traces.load(path), t)


def test_burstgpt_include_failed_and_model_filter(tmp_path):
    path = write(tmp_path, "b.csv", BURSTGPT)
    t = traces.load_burstgpt(path, include_failed=True)
    np.testing.assert_array_equal(t["output_tokens"], [18, 0, 200, 32])
    g = traces.load_burstgpt(path, model="GPT-4", include_failed=True)
    np.testing.assert_allclose(g["arrival"], [0.0, 3.5])      # 5.5 and 9, rebased
    np.testing.assert_array_equal(g["input_tokens"], [1021, 64])
    with pytest.raises(TraceError, match=r"no rows with Model 'Claude'.*ChatGPT"):
        traces.load_burstgpt(path, model="Claude")


def test_mooncake_small(tmp_path):
    t = traces.load_mooncake(write(tmp_path, "m.jsonl", MOONCAKE))
    np.testing.assert_allclose(t["arrival"], [0.0, 0.0, 2.5])
    np.testing.assert_array_equal(t["input_tokens"], [40160, 512, 1])
    np.testing.assert_array_equal(t["output_tokens"], [6, 4, 83])


def test_sort_true_sorts_stably(tmp_path):
    text = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n" \
           "3,m,1,1,2,x\n1,m,2,1,3,x\n3,m,3,1,4,x\n2,m,4,1,5,x\n"
    t = traces.load_burstgpt(write(tmp_path, "b.csv", text), sort=True)
    np.testing.assert_allclose(t["arrival"], [0, 1, 2, 2])
    np.testing.assert_array_equal(t["input_tokens"], [2, 4, 1, 3])


def test_empty_and_unknown_files(tmp_path):
    with pytest.raises(TraceError, match="empty"):
        traces.load(write(tmp_path, "e.csv", "\n\n"))
    with pytest.raises(TraceError, match="unknown trace format.*'a,b,c'"):
        traces.load(write(tmp_path, "u.csv", "a,b,c\n1,2,3\n"))
    header_only = traces.load_azure(write(tmp_path, "h.csv", "TIMESTAMP,ContextTokens,"
                                                             "GeneratedTokens\n"))
    assert header_only.size == 0 and header_only.dtype == TRACE_DTYPE


AZ = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
BG = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n1,m,10,5,15,x\n"
MC = '{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": []}\n'

# (loader, file text, fragments the message must contain). The bad row is data row 2 = line 3
# for CSV files (after the header) and data row 2 = line 2 for JSON lines.
MALFORMED = {
    "missing column": ("azure", "TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.6,374\n",
                       ["GeneratedTokens", "header lacks"]),
    "short row": ("azure", AZ + "2023-11-16 18:15:47.0,374\n", ["data row 2 (line 3)", "2 fields"]),
    "non-numeric tokens": ("azure", AZ + "2023-11-16 18:15:47.0,abc,4\n",
                           ["data row 2 (line 3)", "'abc'", "ContextTokens"]),
    "fractional tokens": ("burstgpt", BG + "2,m,1.5,5,6,x\n",
                          ["data row 2 (line 3)", "'1.5'", "Request tokens"]),
    "bad timestamp": ("azure", AZ + "2023-13-45 99:15:47.0,3,4\n",
                      ["data row 2 (line 3)", "'2023-13-45 99:15:47.0'"]),
    "truncated timestamp": ("azure", AZ + "2023,3,4\n", ["data row 2 (line 3)", "'2023'"]),
    "empty timestamp": ("azure", AZ + ",3,4\n", ["data row 2 (line 3)", "TIMESTAMP"]),
    "negative input": ("azure", AZ + "2023-11-16 18:15:47.0,-5,4\n",
                       ["data row 2 (line 3)", "negative input", "-5"]),
    "negative output": ("burstgpt", BG + "2,m,10,-3,7,x\n",
                        ["data row 2 (line 3)", "negative output", "-3"]),
    "zero input": ("azure", AZ + "2023-11-16 18:15:47.0,0,4\n",
                   ["data row 2 (line 3)", "zero-length input"]),
    "zero output": ("mooncake", MC + '{"timestamp": 5, "input_length": 3, "output_length": 0}\n',
                    ["data row 2 (line 2)", "zero output", "allow_zero_output"]),
    "negative timestamp": ("burstgpt", BG + "-2,m,10,5,15,x\n",
                           ["data row 2 (line 3)", "-2", "negative"]),
    "nan timestamp": ("burstgpt", BG + "nan,m,10,5,15,x\n", ["data row 2 (line 3)", "finite"]),
    "negative ms": ("mooncake", MC + '{"timestamp": -7, "input_length": 3, "output_length": 1}\n',
                    ["data row 2 (line 2)", "-7", "negative"]),
    "unsorted": ("azure", AZ + "2023-11-16 18:15:40.0,3,4\n",
                 ["data row 2 (line 3)", "2023-11-16 18:15:40.0", "sort=True"]),
    "unsorted ms": ("mooncake", MC.replace('": 0', '": 9') + MC,
                    ["data row 2 (line 2)", "earlier", "sort=True"]),
    "invalid json": ("mooncake", MC + '{"timestamp": 1, "input_length": \n',
                     ["data row 2 (line 2)", "not valid JSON"]),
    "missing key": ("mooncake", MC + '{"timestamp": 1, "input_length": 3}\n',
                    ["data row 2 (line 2)", "output_length"]),
    "string length": ("mooncake",
                      MC + '{"timestamp": 1, "input_length": "3", "output_length": 1}\n',
                      ["data row 2 (line 2)", "input_length", "'3'"]),
    "fractional length": ("mooncake",
                          MC + '{"timestamp": 1, "input_length": 3.5, "output_length": 1}\n',
                          ["data row 2 (line 2)", "input_length", "3.5"]),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_rows_raise_naming_row_and_value(tmp_path, case):
    fmt, text, fragments = MALFORMED[case]
    path = write(tmp_path, "bad.jsonl" if fmt == "mooncake" else "bad.csv", text)
    loader = {"azure": traces.load_azure, "burstgpt": traces.load_burstgpt,
              "mooncake": traces.load_mooncake}[fmt]
    with pytest.raises(TraceError) as err:
        loader(path)
    msg = str(err.value)
    assert str(path) in msg
    for fragment in fragments:
        assert fragment in msg, f"{fragment!r} missing from: {msg}"
    # load() sniffs the same format and so raises the same error.
    with pytest.raises(TraceError, match="bad"):
        traces.load(path)


def test_zero_output_allowed_when_asked(tmp_path):
    path = write(tmp_path, "z.csv", AZ + "2023-11-16 18:15:47.0,3,0\n")
    t = traces.load_azure(path, allow_zero_output=True)
    np.testing.assert_array_equal(t["output_tokens"], [44, 0])


def test_trace_error_is_value_error():
    assert issubclass(TraceError, ValueError)


# ---------------------------------------------------------------------------------------------
# Generators


def gaps(t):
    return np.diff(t["arrival"])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_poisson_rate_and_exponential_gaps(seed):
    rate, n = 4.0, 20_000
    t = traces.poisson(rate, n=n, seed=seed)
    assert_well_formed(t)
    assert t.size == n and t["arrival"][0] == 0.0
    g = gaps(t)
    # Mean gap 1/rate with standard error (1/rate)/sqrt(n) ~ 0.7%: 5 standard errors.
    assert abs(g.mean() * rate - 1) < 5 / math.sqrt(n)
    # Kolmogorov-Smirnov distance to Exp(rate); 1.63/sqrt(n) is the 1% critical value.
    s = np.sort(g)
    cdf = 1 - np.exp(-rate * s)
    ecdf_hi = np.arange(1, s.size + 1) / s.size
    d = max(np.max(ecdf_hi - cdf), np.max(cdf - (ecdf_hi - 1 / s.size)))
    assert d < 1.63 / math.sqrt(s.size)


def test_poisson_duration_counts():
    rate, duration = 10.0, 1000.0
    counts = [traces.poisson(rate, duration=duration, seed=s).size for s in range(5)]
    for c in counts:        # Poisson count: sd sqrt(rate * duration) = 100
        assert abs(c - rate * duration) < 5 * math.sqrt(rate * duration)
    t = traces.poisson(rate, duration=duration, seed=0, start=3.0)
    assert t["arrival"][0] == 3.0 and t["arrival"][-1] < 3.0 + duration
    # n and duration together: whichever comes first.
    assert traces.poisson(rate, duration=duration, n=50).size == 50
    assert traces.poisson(rate, duration=1.0, n=10_000).size < 100


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_rate_and_coefficient_of_variation(burstiness):
    rate, n = 2.0, 40_000
    g = gaps(traces.gamma(rate, burstiness, n=n, seed=7))
    assert g.mean() * rate == pytest.approx(1.0, rel=0.03)
    # Gamma(shape k) gaps have CV 1/sqrt(k); sample-std error is ~2% at k=0.25, n=40k.
    assert g.std() / g.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.08)


def test_gamma_one_equals_poisson():
    np.testing.assert_array_equal(traces.gamma(3.0, 1.0, n=100, seed=5),
                                  traces.poisson(3.0, n=100, seed=5))


def test_determinism_per_seed():
    a = traces.gamma(5.0, 0.5, duration=60, input_tokens=(10, 500), output_tokens=(1, 50), seed=3)
    b = traces.gamma(5.0, 0.5, duration=60, input_tokens=(10, 500), output_tokens=(1, 50), seed=3)
    c = traces.gamma(5.0, 0.5, duration=60, input_tokens=(10, 500), output_tokens=(1, 50), seed=4)
    np.testing.assert_array_equal(a, b)
    assert a.size != c.size or not np.array_equal(a, c)
    # Arrivals have their own stream: changing lengths leaves them unchanged.
    d = traces.gamma(5.0, 0.5, duration=60, input_tokens=7, seed=3)
    np.testing.assert_array_equal(a["arrival"], d["arrival"])
    m1 = traces.gyges_mixed(600, seed=9)
    np.testing.assert_array_equal(m1, traces.gyges_mixed(600, seed=9))
    np.testing.assert_array_equal(traces.flying_alternating(120, seed=2),
                                  traces.flying_alternating(120, seed=2))


def test_length_specs():
    t = traces.poisson(1.0, n=3000, input_tokens=(3, 5), output_tokens=17, seed=0)
    assert set(np.unique(t["input_tokens"])) == {3, 4, 5}        # inclusive range
    assert np.all(t["output_tokens"] == 17)
    seen = []

    def lognormal(rng, n):
        seen.append(n)
        return np.maximum(1, np.rint(rng.lognormal(6, 1, size=n)))

    t = traces.poisson(1.0, n=40, input_tokens=lognormal, seed=0)
    assert seen == [40] and t["input_tokens"].dtype == np.int64 and t["input_tokens"].min() >= 1


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(rate=0, n=5), "rate"),
    (dict(rate=-1, n=5), "rate"),
    (dict(rate=float("nan"), n=5), "rate"),
    (dict(rate=1, burstiness=0, n=5), "burstiness"),
    (dict(rate=1), "duration"),
    (dict(rate=1, n=-1), "n must"),
    (dict(rate=1, duration=-3), "duration"),
    (dict(rate=1, n=5, input_tokens=0), "input_tokens"),
    (dict(rate=1, n=5, output_tokens=(5, 2)), "output_tokens"),
    (dict(rate=1, n=5, input_tokens=(0, 2)), "input_tokens"),
    (dict(rate=1, n=5, input_tokens="long"), "input_tokens"),
    (dict(rate=1, n=5, input_tokens=lambda rng, n: np.zeros(n)), "input_tokens"),
    (dict(rate=1, n=5, input_tokens=lambda rng, n: np.ones(n + 1)), "shape"),
    (dict(rate=1, n=5, input_tokens=lambda rng, n: np.full(n, 2.5)), "non-integer"),
    (dict(rate=1, n=5, seed=-1), "seed"),
])
def test_generator_argument_errors(kwargs, fragment):
    kwargs = dict(kwargs)
    kwargs.setdefault("burstiness", 1.0)
    with pytest.raises(ValueError, match=fragment):
        traces.gamma(**kwargs)


def test_mixture_class_proportions():
    classes = [{"rate_per_min": 60, "input_tokens": 100, "output_tokens": 10, "priority": 0},
               {"rate": 1 / 3, "input_tokens": 999, "output_tokens": 20, "priority": 2}]
    t = traces.mixture(classes, duration=3600, seed=1)
    assert_well_formed(t)
    assert t["arrival"][0] == 0.0 and t["arrival"][-1] < 3600
    slow = t["input_tokens"] == 999
    assert np.all(t["priority"][slow] == 2) and np.all(t["output_tokens"][slow] == 20)
    assert np.all(t["priority"][~slow] == 0)
    # Expected share of the slow class: (1/3) / (1 + 1/3) = 0.25; binomial sd ~0.006.
    assert slow.mean() == pytest.approx(0.25, abs=0.03)
    assert t.size == pytest.approx(4800, abs=5 * math.sqrt(4800))


def test_mixture_errors():
    with pytest.raises(ValueError, match="unknown key"):
        traces.mixture([{"rate": 1, "inputs": 5}], duration=10)
    with pytest.raises(ValueError, match="exactly one"):
        traces.mixture([{"input_tokens": 5}], duration=10)
    with pytest.raises(ValueError, match="class 1 rate"):
        traces.mixture([{"rate": 1}, {"rate_per_min": 0}], duration=10)


def test_gyges_mixed_preset():
    t = traces.gyges_mixed(7200, seed=0)
    assert set(np.unique(t["input_tokens"])) == {1024, 50_000}
    n_long = int((t["input_tokens"] == 50_000).sum())
    n_short = int((t["input_tokens"] == 1024).sum())
    assert abs(n_long - 120) < 5 * math.sqrt(120)        # 1/min for 2 h
    assert abs(n_short - 7200) < 5 * math.sqrt(7200)     # 60/min for 2 h


def test_time_varying_rates_per_phase():
    rates, period = [2.0, 20.0, 0.0], 50.0
    t = traces.time_varying(rates, period, duration=15_000, seed=4)
    assert_well_formed(t)
    phase = (t["arrival"] // period).astype(int) % 3
    cycles = 15_000 / (3 * period)
    for k, r in enumerate(rates):
        expected = r * period * cycles
        assert abs((phase == k).sum() - expected) <= 5 * math.sqrt(expected) + 1e-9
    # n without duration cycles the phases until n requests exist.
    assert traces.time_varying([1.0, 3.0], 10.0, n=500, seed=0).size == 500


def test_flying_alternating_alternates_low_and_high():
    period = 60.0
    t = traces.flying_alternating(600, seed=3, period=period)
    counts = np.bincount((t["arrival"] // period).astype(int), minlength=10)
    lo, hi = counts[0::2] / period, counts[1::2] / period
    # Rates drawn from [2, 5] and [10, 30] req/s; 5 Poisson sd of a 60 s count as slack.
    def slack(r):
        return 5 * math.sqrt(r / period)
    assert np.all(lo >= 2 - slack(2)) and np.all(lo <= 5 + slack(5))
    assert np.all(hi >= 10 - slack(10)) and np.all(hi <= 30 + slack(30))


def test_time_varying_errors():
    with pytest.raises(ValueError, match="not all 0"):
        traces.time_varying([0, 0], 10, duration=10)
    with pytest.raises(ValueError, match="period"):
        traces.time_varying([1], 0, duration=10)
    with pytest.raises(ValueError, match="low"):
        traces.flying_alternating(10, low=(5, 2))


# ---------------------------------------------------------------------------------------------
# Transforms and summary


def small():
    return traces.from_arrays([0.0, 1.0, 3.0, 6.0], [10, 20, 30, 40], [5, 1, 7, 100],
                              priority=[0, 1, 0, 1])


def test_from_arrays_and_validate_errors():
    with pytest.raises(TraceError, match="request 1: arrival 0.5 is before"):
        traces.from_arrays([1.0, 0.5], 1, 1)
    with pytest.raises(TraceError, match="request 0: input_tokens 0"):
        traces.from_arrays([0.0], 0, 1)
    with pytest.raises(TraceError, match="lacks field"):
        traces.validate(np.zeros(3, dtype=[("arrival", "f8")]))
    np.testing.assert_array_equal(traces.from_arrays([1.0, 0.5], 1, 1, sort=True)["arrival"],
                                  [0.5, 1.0])


def test_scale_rate_and_clip():
    t = traces.scale_rate(small(), 2.0)
    np.testing.assert_allclose(t["arrival"], [0.0, 0.5, 1.5, 3.0])
    np.testing.assert_array_equal(small()["arrival"], [0.0, 1.0, 3.0, 6.0])   # input untouched
    assert traces.clip(small(), duration=3.0).size == 2          # arrivals < 3.0
    assert traces.clip(small(), n=3).size == 3
    assert traces.clip(small(), duration=100, n=1).size == 1


def test_scale_lengths():
    t = traces.scale_lengths(small(), factor=0.25, max_output=20)
    # 10*0.25=2.5 -> 2 (round half to even), 20->5, 30->7.5->8, 40->10; outputs >= 1, <= 20.
    np.testing.assert_array_equal(t["input_tokens"], [2, 5, 8, 10])
    np.testing.assert_array_equal(t["output_tokens"], [1, 1, 2, 20])
    t = traces.scale_lengths(small(), factor=(2, 1), max_input=50)
    np.testing.assert_array_equal(t["input_tokens"], [20, 40, 50, 50])
    np.testing.assert_array_equal(t["output_tokens"], [5, 1, 7, 100])


def test_fit_clip_and_drop():
    t = traces.from_arrays([0, 1, 2, 3], [50, 90, 10, 100], [40, 20, 150, 1])
    clipped, changed = traces.fit(t, max_model_len=100)
    # (50,40) fits; (90,20) -> input 80; (10,150) -> output 99, input 1; (100,1) -> input 99.
    np.testing.assert_array_equal(clipped["input_tokens"], [50, 80, 1, 99])
    np.testing.assert_array_equal(clipped["output_tokens"], [40, 20, 99, 1])
    assert changed == 3
    assert np.all(clipped["input_tokens"] + clipped["output_tokens"] <= 100)
    dropped, n_dropped = traces.fit(t, max_model_len=100, mode="drop")
    assert n_dropped == 3 and dropped["input_tokens"].tolist() == [50]
    capped, changed = traces.fit(t, max_model_len=1000, max_input=60, max_output=30)
    np.testing.assert_array_equal(capped["input_tokens"], [50, 60, 10, 60])
    np.testing.assert_array_equal(capped["output_tokens"], [30, 20, 30, 1])
    assert changed == 4
    with pytest.raises(ValueError, match="mode"):
        traces.fit(t, 100, mode="truncate")


def test_summary_hand_computed():
    s = traces.summary(small())
    assert s["count"] == 4 and s["duration"] == 6.0 and s["rate"] == 0.5   # 3 gaps in 6 s
    assert s["input_mean"] == 25.0 and s["input_p50"] == 25.0
    assert s["input_p99"] == pytest.approx(39.7)      # 30 + 0.97 * 10 (linear interpolation)
    assert s["output_max"] == 100 and s["output_total"] == 113
    e = traces.summary(traces.empty())
    assert e["count"] == 0 and math.isnan(e["rate"]) and math.isnan(e["input_mean"])


# ---------------------------------------------------------------------------------------------
# Files that cannot be decoded: a TraceError (a gyges.FormatError) naming the file, never a bare
# decoder error; a UTF-8 byte-order mark is not an error at all.

# Per format: (file suffix, valid text, an extra row whose text holds a non-ASCII character, the
# line that row lands on). Extra columns and keys are ignored by the loaders.
DECODING = {
    "azure": (".csv", "TIMESTAMP,ContextTokens,GeneratedTokens,Note\n"
                      + "".join(f"2023-11-16 18:15:{i // 10:02d}.{i % 10},{i + 1},{i % 7 + 1},"
                                f"r{i}\n" for i in range(400)),
              "2023-11-16 18:16:00.0,5,6,caf\u00e9\n", 402),
    "burstgpt": (".csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                         + "".join(f"{i},m{i % 3},{i + 1},{i % 7 + 1},{i + i % 7 + 2},x\n"
                                   for i in range(400)),
                 "500,Caf\u00e9GPT,5,6,11,x\n", 402),
    "mooncake": (".jsonl", "".join(f'{{"timestamp": {i}, "input_length": {i + 1}, '
                                   f'"output_length": {i % 7 + 1}, "hash_ids": [{i}]}}\n'
                                   for i in range(400)),
                 '{"timestamp": 500, "input_length": 5, "output_length": 6, "note": "caf\u00e9"}\n',
                 401),
}
LOADERS = {"azure": traces.load_azure, "burstgpt": traces.load_burstgpt,
           "mooncake": traces.load_mooncake, "any": traces.load}


def bad_file(tmp_path, fmt, case) -> tuple[Path, list[str]]:
    """Writes a file the loaders must refuse; returns it and fragments its error must hold."""
    suffix, text, extra, line = DECODING[fmt]
    if case == "binary":                  # e.g. a model file or an image passed by mistake
        path = tmp_path / f"bin{suffix}"
        path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe\x00\x80" * 8)
        return path, ["line 1", "not valid UTF-8", "0x89"]
    if case == "latin1":                  # exported by a tool that does not write UTF-8
        path = tmp_path / f"latin1{suffix}"
        path.write_bytes((text + extra).encode("latin-1"))
        return path, [f"line {line}", "not valid UTF-8", "0xe9"]
    if case == "truncated_gzip":          # an interrupted download
        path = tmp_path / f"cut{suffix}.gz"
        whole = gzip.compress(text.encode("utf-8"))
        path.write_bytes(whole[:len(whole) // 2])
        return path, ["gzip", "truncated or corrupt"]
    if case == "not_gzip":                # plain text named .gz
        path = tmp_path / f"plain{suffix}.gz"
        path.write_text(text)
        return path, ["not a gzip file"]
    raise AssertionError(case)


# Each format's own loader, and load(), which reads the first line to choose one.
@pytest.mark.parametrize("fmt, loader", [(f, ld) for f in sorted(DECODING) for ld in (f, "any")])
@pytest.mark.parametrize("case", ["binary", "latin1", "truncated_gzip", "not_gzip"])
def test_undecodable_files_raise_trace_error_naming_file(tmp_path, case, fmt, loader):
    import gyges
    path, fragments = bad_file(tmp_path, fmt, case)
    with pytest.raises(gyges.FormatError) as err:
        LOADERS[loader](path)
    assert isinstance(err.value, TraceError)
    assert err.value.__cause__ is not None          # chained to the decoder's error
    msg = str(err.value)
    assert str(path) in msg
    for fragment in fragments:
        assert fragment in msg, f"{fragment!r} missing from: {msg}"


@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gzip"])
@pytest.mark.parametrize("fmt", sorted(DECODING))
def test_utf8_byte_order_mark_is_accepted(tmp_path, fmt, gz):
    suffix, text, _, _ = DECODING[fmt]
    data = {"plain": text.encode("utf-8"), "bom": b"\xef\xbb\xbf" + text.encode("utf-8")}
    paths = {}
    for name, raw in data.items():
        paths[name] = tmp_path / f"{name}{suffix}{'.gz' if gz else ''}"
        paths[name].write_bytes(gzip.compress(raw) if gz else raw)
    expect = LOADERS[fmt](paths["plain"])
    assert expect.size == 400
    np.testing.assert_array_equal(LOADERS[fmt](paths["bom"]), expect)
    np.testing.assert_array_equal(traces.load(paths["bom"]), expect)


def test_trace_error_is_a_gyges_format_error():
    import gyges
    assert issubclass(TraceError, gyges.FormatError) and issubclass(TraceError, gyges.Error)
