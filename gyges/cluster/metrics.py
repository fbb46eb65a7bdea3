"""Serving metrics with vLLM's definitions (benchmarks/benchmark_serving.py, calculate_metrics).

Input: one row per request in a NumPy structured array with at least the fields of
REQUEST_FIELDS (times in seconds, float64; NaN where an event never happened), and optionally
each request's output-token times as a separate list of 1-D arrays.

A request is *completed* when `finish` is finite, *rejected* when it was never scheduled
(`scheduled` and `finish` NaN) and *unfinished* when it was scheduled but did not finish.
Only completed requests enter latency statistics, throughputs and goodput, as in vLLM, where
failed requests contribute nothing.

Per completed request:
    TTFT  = first_token - arrival
    TPOT  = (finish - first_token) / (output_tokens - 1), only when output_tokens > 1
    E2E   = finish - arrival
    queue = scheduled - arrival
    ITL   = the gaps between consecutive token times (pooled over all completed requests)

Where we differ from vLLM, on purpose:
- duration = last finish - first arrival (of any request), not the client's wall clock;
- SLO thresholds are in seconds (vLLM's --goodput takes ms);
- statistics of an empty set are NaN (vLLM reports 0).
Percentiles interpolate linearly and std is the population std (ddof=0), both as np.percentile
and np.std do by default, which is what vLLM calls.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from ..core.errors import ArgumentTypeError, InvalidArgumentError

REQUEST_FIELDS = ("arrival", "scheduled", "first_token", "finish", "input_tokens",
                  "output_tokens")

# A ready-made dtype for per-request records (callers may add fields of their own).
REQUEST_DTYPE = np.dtype([("arrival", "f8"), ("scheduled", "f8"), ("first_token", "f8"),
                          ("finish", "f8"), ("input_tokens", "i8"), ("output_tokens", "i8")])

PER_REQUEST_DTYPE = np.dtype([("ttft", "f8"), ("tpot", "f8"), ("e2e", "f8"), ("queue", "f8")])

# SLO keys accepted by summarize(slo=...), each a per-request latency in seconds.
SLO_KEYS = ("ttft", "tpot", "e2e", "queue")

LATENCIES = ("ttft", "tpot", "itl", "e2e", "queue")


class MetricsError(InvalidArgumentError):
    """Per-request records or token times are inconsistent (the message names the request)."""


def records(handles) -> tuple[np.ndarray, list]:
    """(REQUEST_DTYPE rows, token times) of request handles: what Engine.generate, Host.submit
    or LLM.generate returned (gyges.Request, or anything with a `.request` that is one)."""
    rows = np.empty(len(handles), dtype=REQUEST_DTYPE)
    times = []
    for i, h in enumerate(handles):
        r = getattr(h, "request", h)
        m = getattr(r, "metrics", None)
        if m is None or not hasattr(r, "prompt"):
            raise ArgumentTypeError(f"requests must be a NumPy structured array with fields "
                                    f"{REQUEST_FIELDS} or request handles; item {i} is a "
                                    f"{type(h).__name__}")
        rows[i] = (m.arrival, m.scheduled, m.first_token, m.finish, len(r.prompt),
                   len(r.output_tokens))
        times.append(np.asarray(m.token_times, dtype=np.float64))
    return rows, times


def _as_records(requests, token_times):
    """A structured array as it is; a sequence of request handles through records()."""
    if getattr(getattr(requests, "dtype", None), "names", None) is None and \
            isinstance(requests, (list, tuple)):
        rows, times = records(requests)
        return rows, times if token_times is None else token_times
    return requests, token_times


def per_request(requests: np.ndarray) -> np.ndarray:
    """TTFT, TPOT, E2E and queue time of each request (PER_REQUEST_DTYPE), NaN where undefined:
    queue needs `scheduled`, TTFT `first_token`, E2E `finish`, TPOT a completed request with more
    than one output token."""
    r = _check_requests(requests)
    out = np.empty(r["arrival"].shape[0], dtype=PER_REQUEST_DTYPE)
    out["queue"] = r["scheduled"] - r["arrival"]
    out["ttft"] = r["first_token"] - r["arrival"]
    out["e2e"] = r["finish"] - r["arrival"]
    with np.errstate(divide="ignore", invalid="ignore"):
        tpot = (r["finish"] - r["first_token"]) / (r["output_tokens"] - 1)
    out["tpot"] = np.where(r["output_tokens"] > 1, tpot, np.nan)
    return out


def summarize(requests: np.ndarray, token_times: Sequence[np.ndarray] | None = None,
              slo: dict | None = None, percentiles: Sequence[float] = (90, 99)) -> dict:
    """vLLM's benchmark metrics as a flat dict. `requests`: a structured array, or the request
    handles an Engine, a Host or an LLM returned (their token times then give the ITL).

    Counts: requests, completed, rejected (never scheduled), unfinished, total_input,
    total_output (completed requests). Rates (per second of `duration`): request_throughput,
    output_throughput, total_token_throughput; with `slo`, good_completed, goodput and
    slo_attainment (good_completed over every request: a rejected or unfinished request is a
    miss, so a layout cannot look better by turning requests away).
    For each of ttft, tpot, e2e, queue (and itl when token_times is given):
    <name>_mean, _median, _std and _p<q> for q in `percentiles` (e.g. ttft_p99), taken over
    the completed requests only: latency_requests says how many.

    slo: {"ttft": s, "tpot": s, "e2e": s, "queue": s}, any subset. A completed request is good
    when every given latency is <= its threshold (equal passes, as in vLLM); a request with one
    output token has TPOT 0 for this test (vLLM's rule). An empty dict sets no constraint.
    """
    requests, token_times = _as_records(requests, token_times)
    r = _check_requests(requests)
    done = np.isfinite(r["finish"])
    scheduled = np.isfinite(r["scheduled"])
    pr = per_request(requests)[done]
    res: dict = {
        "requests": int(done.size),
        "completed": int(done.sum()),
        "rejected": int((~done & ~scheduled).sum()),
        "unfinished": int((~done & scheduled).sum()),
        "total_input": int(r["input_tokens"][done].sum()),
        "total_output": int(r["output_tokens"][done].sum()),
    }
    duration = (float(r["finish"][done].max() - r["arrival"].min()) if done.any() else math.nan)
    res["duration"] = duration

    def rate(x):
        if res["completed"] == 0:
            return 0.0
        return x / duration if duration > 0 else math.nan

    res["request_throughput"] = rate(res["completed"])
    res["output_throughput"] = rate(res["total_output"])
    res["total_token_throughput"] = rate(res["total_input"] + res["total_output"])

    if slo is not None:
        good = _meets_slo(pr, r["output_tokens"][done], slo)
        res["good_completed"] = int(good.sum())
        res["goodput"] = rate(res["good_completed"])
        res["slo_attainment"] = res["good_completed"] / done.size if done.size else math.nan
    res["latency_requests"] = res["completed"]

    samples = {"ttft": pr["ttft"], "tpot": pr["tpot"][~np.isnan(pr["tpot"])],
               "e2e": pr["e2e"], "queue": pr["queue"]}
    if token_times is not None:
        samples["itl"] = inter_token_latencies(requests, token_times)
    for name in LATENCIES:
        if name in samples:
            res.update(_stats(name, samples[name], percentiles))
    return res


def inter_token_latencies(requests: np.ndarray, token_times: Sequence[np.ndarray]) -> np.ndarray:
    """All gaps between consecutive token times of the completed requests, pooled (vLLM's ITL).
    A request streamed in chunks may list fewer times than output tokens; only gaps count."""
    r = _check_requests(requests)
    times = _check_token_times(r, token_times)
    done = np.flatnonzero(np.isfinite(r["finish"]))
    gaps = [np.diff(times[i]) for i in done]
    return np.concatenate(gaps) if gaps else np.empty(0)


def throughput_timeseries(requests: np.ndarray, token_times: Sequence[np.ndarray],
                          bin_seconds: float = 1.0, start: float | None = None):
    """Output tokens per second over time: returns (bin_starts, tokens_per_second).

    Bins are [start + k*bin_seconds, start + (k+1)*bin_seconds), from `start` (default: the first
    arrival) through the bin holding the last token. Tokens of every request count, finished or
    not, since the server produced them.
    """
    r = _check_requests(requests)
    times = _check_token_times(r, token_times)
    if isinstance(bin_seconds, bool) or not isinstance(bin_seconds, (int, float)) \
            or not math.isfinite(bin_seconds) or bin_seconds <= 0:
        raise InvalidArgumentError(f"bin_seconds must be a finite number > 0, got {bin_seconds!r}")
    if start is None:
        start = float(r["arrival"].min()) if r["arrival"].size else 0.0
    flat = np.concatenate(times) if times else np.empty(0)
    if not flat.size:
        return np.empty(0), np.empty(0)
    if flat.min() < start:
        raise MetricsError(f"a token time {flat.min()} is before start {start}")
    idx = np.floor((flat - start) / bin_seconds).astype(np.int64)
    counts = np.bincount(idx)
    starts = start + bin_seconds * np.arange(counts.size)
    return starts, counts / bin_seconds


def _stats(name: str, x: np.ndarray, percentiles) -> dict:
    empty = x.size == 0
    res = {
        f"{name}_mean": math.nan if empty else float(np.mean(x)),
        f"{name}_median": math.nan if empty else float(np.median(x)),
        f"{name}_std": math.nan if empty else float(np.std(x)),
    }
    for q in percentiles:
        res[f"{name}_p{q:g}"] = math.nan if empty else float(np.percentile(x, q))
    return res


def _meets_slo(pr: np.ndarray, output_tokens: np.ndarray, slo: dict) -> np.ndarray:
    if not isinstance(slo, dict):
        raise ArgumentTypeError(f"slo must be a dict like {{'ttft': 2.0, 'tpot': 0.1}}, got {slo!r}")
    good = np.ones(pr.shape[0], dtype=bool)
    for key, limit in slo.items():
        if key not in SLO_KEYS:
            raise InvalidArgumentError(f"unknown SLO {key!r}; known SLOs: {list(SLO_KEYS)} (seconds)")
        if isinstance(limit, bool) or not isinstance(limit, (int, float)) \
                or math.isnan(limit) or limit < 0:
            raise InvalidArgumentError(f"SLO {key!r} must be a number of seconds >= 0, got {limit!r}")
        value = pr[key]
        if key == "tpot":
            value = np.where(output_tokens > 1, value, 0.0)
        good &= value <= limit
    return good


def _check_requests(requests) -> dict:
    names = getattr(getattr(requests, "dtype", None), "names", None)
    if names is None:
        raise ArgumentTypeError(f"requests must be a NumPy structured array with fields "
                        f"{REQUEST_FIELDS}, got {type(requests).__name__}")
    missing = [f for f in REQUEST_FIELDS if f not in names]
    if missing:
        raise MetricsError(f"requests lack field(s) {missing}; they have {list(names)}")
    if requests.ndim != 1:
        raise MetricsError(f"requests must be 1-D, got shape {requests.shape}")
    r = {f: np.asarray(requests[f], dtype=np.float64) for f in REQUEST_FIELDS[:4]}
    for f in REQUEST_FIELDS[4:]:
        col = np.asarray(requests[f])
        if col.dtype.kind not in "iu":
            raise MetricsError(f"field {f!r} must be integers, got dtype {col.dtype}")
        r[f] = col.astype(np.int64)

    def fail(mask, what):
        i = int(np.flatnonzero(mask)[0])
        vals = ", ".join(f"{f}={requests[f][i]}" for f in REQUEST_FIELDS)
        raise MetricsError(f"request {i}: {what} ({vals})")

    bad = ~np.isfinite(r["arrival"])
    if bad.any():
        fail(bad, "arrival is not finite")
    done = np.isfinite(r["finish"])
    for f in ("scheduled", "first_token"):
        bad = done & ~np.isfinite(r[f])
        if bad.any():
            fail(bad, f"finished but {f} is missing")
    # Events happen in order; checked wherever both times are known.
    order = ("arrival", "scheduled", "first_token", "finish")
    for a, b in zip(order, order[1:]):
        with np.errstate(invalid="ignore"):
            bad = r[b] < r[a]
        if bad.any():
            fail(bad, f"{b} is before {a}")
    bad = r["input_tokens"] < 0
    if bad.any():
        fail(bad, "negative input_tokens")
    bad = done & (r["output_tokens"] < 1)
    if bad.any():
        fail(bad, "finished with fewer than 1 output token")
    return r


def _check_token_times(r: dict, token_times) -> list:
    n = r["arrival"].shape[0]
    if isinstance(token_times, np.ndarray) and token_times.dtype != object:
        raise ArgumentTypeError("token_times must be a list with one 1-D array per request")
    if len(token_times) != n:
        raise MetricsError(f"token_times has {len(token_times)} entries for {n} requests")
    out = []
    for i, t in enumerate(token_times):
        t = np.asarray(t, dtype=np.float64)
        if t.ndim != 1:
            raise MetricsError(f"request {i}: token times must be 1-D, got shape {t.shape}")
        if t.size and not np.all(np.isfinite(t)):
            raise MetricsError(f"request {i}: token times hold a non-finite value")
        down = np.flatnonzero(np.diff(t) < 0)
        if down.size:
            k = down[0] + 1
            raise MetricsError(f"request {i}: token time {k} ({t[k]}) is before token "
                               f"{k - 1} ({t[k - 1]})")
        out.append(t)
    return out


def score(systems: dict, keys=("ttft", "tpot", "throughput")) -> dict:
    """PipeLive's composite score (its section 7.2) of systems compared with one another:
    `systems` maps a name to {"ttft": s, "tpot": s, "throughput": tokens/s} (e.g. the means of
    summarize: ttft_mean, tpot_mean, total_token_throughput). Each metric is min-max normalised
    over the systems, latencies inverted so that higher is better (s = (max - x) / (max - min)
    for TTFT and TPOT, (x - min) / (max - min) for throughput), and the score is their mean, in
    [0, 1]. A metric on which every system is equal gives each 1 (none is worse). Returns
    {name: score}."""
    if not isinstance(systems, dict) or len(systems) < 1:
        raise InvalidArgumentError("score needs a dict of at least one system")
    names = list(systems)
    out = {n: 0.0 for n in names}
    for key in keys:
        try:
            x = np.array([float(systems[n][key]) for n in names])
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidArgumentError(f"score: every system needs a number {key!r} ({e})") \
                from None
        if not np.all(np.isfinite(x)):
            raise InvalidArgumentError(f"score: {key} must be finite for every system, got "
                                       f"{dict(zip(names, x.tolist()))}")
        lo, hi = float(x.min()), float(x.max())
        if hi == lo:
            s = np.ones_like(x)
        elif key == "throughput":
            s = (x - lo) / (hi - lo)
        else:
            s = (hi - x) / (hi - lo)
        for n, v in zip(names, s):
            out[n] += float(v) / len(keys)
    return out
