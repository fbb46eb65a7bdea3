"""Request traces: what arrives at the server, when, and how long it is.

A trace is a NumPy structured array of dtype TRACE_DTYPE, sorted by `arrival` (seconds; the
first request is at 0.0 unless the caller asks otherwise). Three groups of functions:

- loaders for public trace files (Azure LLM inference 2023/2024, BurstGPT, Mooncake), which
  raise TraceError naming the file, the row and the bad value for every malformed row;
- seeded generators (Poisson, gamma-bursty, class mixtures, piecewise-constant rates) and the
  named workloads of the papers we reproduce (Gyges 6.2.4, Flying Serving);
- transforms that fit a trace to an experiment (scale lengths or rate, clip, fit to a model).
"""

from __future__ import annotations

import contextlib
import csv
import gzip
import json
import math
import warnings
import zlib
from typing import Sequence

import numpy as np

from ..core.errors import ArgumentTypeError, FormatError, InvalidArgumentError

TRACE_DTYPE = np.dtype(
    [("arrival", "f8"), ("input_tokens", "i8"), ("output_tokens", "i8"), ("priority", "i4")]
)

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
BURSTGPT_COLUMNS = ("Timestamp", "Model", "Request tokens", "Response tokens")
MOONCAKE_KEYS = ("timestamp", "input_length", "output_length")

# Generators take lengths ("length specs") as: an int (every request the same), an inclusive
# (low, high) tuple of ints (uniform), or a callable(rng, n) -> n whole numbers >= 1.


class TraceError(FormatError):
    """A trace file or trace array is malformed (the message names the file, row and value).
    A gyges.FormatError, and so a ValueError."""


# ----------------------------------------------------------------------------------------------
# Building and checking trace arrays


def empty(n: int = 0) -> np.ndarray:
    """A zero-filled trace of n requests."""
    return np.zeros(n, dtype=TRACE_DTYPE)


def from_arrays(arrival, input_tokens, output_tokens, priority=0, sort: bool = False,
                allow_zero_output: bool = False) -> np.ndarray:
    """Build a trace from columns (scalars broadcast), checked with validate().

    Arrivals are kept as given (no shift to 0); sort=True sorts them (stable) instead of raising.
    """
    arrival = np.asarray(arrival, dtype=np.float64)
    if arrival.ndim != 1:
        raise InvalidArgumentError(f"arrival must be 1-D, got shape {arrival.shape}")
    n = arrival.shape[0]
    out = empty(n)
    out["arrival"] = arrival
    for name, col in (("input_tokens", input_tokens), ("output_tokens", output_tokens),
                      ("priority", priority)):
        col = np.asarray(col)
        if col.dtype.kind == "f":
            if not np.all(np.isfinite(col)) or np.any(col != np.round(col)):
                raise TraceError(f"{name} must hold whole numbers, got {col!r}")
        elif col.dtype.kind not in "iub":
            raise TraceError(f"{name} must be integers, got dtype {col.dtype}")
        out[name] = np.broadcast_to(col, (n,))
    if sort:
        out = out[np.argsort(out["arrival"], kind="stable")]
    validate(out, allow_zero_output=allow_zero_output)
    return out


def validate(trace: np.ndarray, allow_zero_output: bool = False) -> None:
    """Raise TraceError unless `trace` is a well-formed trace (fields, finite sorted arrivals,
    input >= 1, output >= 1 or >= 0 when allowed)."""
    _check_fields(trace)
    arrival = trace["arrival"]
    bad = np.flatnonzero(~np.isfinite(arrival))
    if bad.size:
        raise TraceError(f"request {bad[0]}: arrival {arrival[bad[0]]} is not finite")
    bad = np.flatnonzero(np.diff(arrival) < 0)
    if bad.size:
        i = bad[0] + 1
        raise TraceError(f"request {i}: arrival {arrival[i]} is before the previous "
                         f"request's {arrival[i - 1]}; traces are sorted by arrival")
    bad = np.flatnonzero(trace["input_tokens"] < 1)
    if bad.size:
        raise TraceError(f"request {bad[0]}: input_tokens {trace['input_tokens'][bad[0]]} < 1")
    low = 0 if allow_zero_output else 1
    bad = np.flatnonzero(trace["output_tokens"] < low)
    if bad.size:
        raise TraceError(f"request {bad[0]}: output_tokens {trace['output_tokens'][bad[0]]} "
                         f"< {low}")


def merge(traces: Sequence[np.ndarray]) -> np.ndarray:
    """Merge traces by arrival; ties keep the order of `traces` (stable)."""
    for t in traces:
        _check_fields(t)
    if not traces:
        return empty()
    cat = np.concatenate([np.asarray(t, dtype=TRACE_DTYPE) for t in traces])
    return cat[np.argsort(cat["arrival"], kind="stable")]


def _check_fields(trace) -> None:
    names = getattr(getattr(trace, "dtype", None), "names", None)
    if names is None:
        raise ArgumentTypeError(f"a trace must be a NumPy structured array with fields "
                        f"{TRACE_DTYPE.names}, got {type(trace).__name__}")
    missing = [f for f in TRACE_DTYPE.names if f not in names]
    if missing:
        raise TraceError(f"trace lacks field(s) {missing}; it has {list(names)}")


# ----------------------------------------------------------------------------------------------
# Loaders


def load(path, **kwargs) -> np.ndarray:
    """Load a trace file of any supported format, chosen from its first line:
    JSON objects -> load_mooncake, an Azure header -> load_azure, a BurstGPT header ->
    load_burstgpt. Keyword arguments go to that loader."""
    path = str(path)
    with contextlib.closing(_lines(path)) as f:
        first = ""
        for line in f:
            if line.strip():
                first = line.strip()
                break
    if not first:
        raise TraceError(f"{path}: file is empty; cannot tell its format")
    if first.startswith("{"):
        return load_mooncake(path, **kwargs)
    try:
        header = [h.strip() for h in next(csv.reader([first]))]
    except csv.Error:                         # not CSV (e.g. a huge field): an unknown format
        header = []
    if all(c in header for c in AZURE_COLUMNS):
        return load_azure(path, **kwargs)
    if all(c in header for c in BURSTGPT_COLUMNS):
        return load_burstgpt(path, **kwargs)
    raise TraceError(f"{path}: unknown trace format; first line is {first[:120]!r} (expected an "
                     f"Azure header {','.join(AZURE_COLUMNS)}, a BurstGPT header "
                     f"{','.join(BURSTGPT_COLUMNS)},... or Mooncake JSON lines)")


def load_azure(path, sort: bool = False, allow_zero_output: bool = False,
               start: float | None = 0.0) -> np.ndarray:
    """Azure LLM inference trace (2023 or 2024 release): `TIMESTAMP,ContextTokens,GeneratedTokens`.

    TIMESTAMP is a date-time like `2023-11-16 18:15:46.6805900` (up to 9 fractional digits; an
    optional `+HH:MM`/`Z` offset is applied). Arrivals are shifted so the first is at `start`;
    start=None keeps seconds since the Unix epoch (float64: sub-microsecond digits are lost).
    """
    path = str(path)
    cols, lines = _read_csv(path, AZURE_COLUMNS)
    ts = np.char.strip(np.asarray(cols["TIMESTAMP"], dtype=str)) if lines.size else \
        np.empty(0, dtype=str)
    ns = _parse_datetimes(path, ts, lines)
    inp = _parse_ints(path, "ContextTokens", cols["ContextTokens"], lines)
    out = _parse_ints(path, "GeneratedTokens", cols["GeneratedTokens"], lines)
    # Sort on the exact integer nanoseconds, then convert relative times to seconds.
    order = _check_order(path, "TIMESTAMP", ns, ts, lines, sort)
    _check_lengths(path, inp, out, lines, allow_zero_output)
    ns, inp, out = ns[order], inp[order], out[order]
    if start is None or not ns.size:
        arrival = ns.astype(np.float64) / 1e9
    else:
        arrival = (ns - ns[0]).astype(np.float64) / 1e9 + start
    return _assemble(arrival, inp, out)


def load_burstgpt(path, include_failed: bool = False, model: str | None = None,
                  sort: bool = False, allow_zero_output: bool = False,
                  start: float | None = 0.0) -> np.ndarray:
    """BurstGPT trace: `Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type`.

    Timestamp is seconds. Failed requests (Response tokens = 0) are dropped unless
    include_failed=True (which keeps them with 0 output tokens). `model` keeps only rows whose
    Model equals it. Arrivals are shifted so the first kept request is at `start` (None: as in
    the file). File-level checks (numbers, signs, order) cover every row, kept or not.
    """
    path = str(path)
    cols, lines = _read_csv(path, BURSTGPT_COLUMNS)
    raw_ts = cols["Timestamp"]
    t = _parse_floats(path, "Timestamp", raw_ts, lines)
    inp = _parse_ints(path, "Request tokens", cols["Request tokens"], lines)
    out = _parse_ints(path, "Response tokens", cols["Response tokens"], lines)
    _check_timestamps(path, "Timestamp", t, raw_ts, lines)
    order = _check_order(path, "Timestamp", t, raw_ts, lines, sort)
    _check_nonnegative(path, inp, out, lines)
    keep = np.ones(t.shape[0], dtype=bool)
    if model is not None:
        models = np.asarray(cols["Model"], dtype=str)
        keep &= models == model
        if lines.size and not keep.any():
            present = sorted(set(models.tolist()))
            raise TraceError(f"{path}: no rows with Model {model!r}; models present: {present}")
    if not include_failed:
        keep &= out > 0
    order = order[keep[order]]
    _check_lengths(path, inp[order], out[order], lines[order],
                   allow_zero_output or include_failed)
    return _assemble(_rebase(t[order], start), inp[order], out[order])


def load_mooncake(path, sort: bool = False, allow_zero_output: bool = False,
                  start: float | None = 0.0, with_hash_ids: bool = False):
    """Mooncake trace (JSON lines): `timestamp` (ms from start), `input_length`,
    `output_length`, and `hash_ids` (one id per 512-token prefix block; not part of the trace).

    Arrivals become seconds, shifted so the first is at `start` (None: as in the file).
    with_hash_ids=True returns (trace, hash_ids) where hash_ids[i] is an int64 array for trace[i].
    """
    path = str(path)
    ts, inp, out, lines, hashes = [], [], [], [], []
    with contextlib.closing(_lines(path)) as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}: data row {len(lines) + 1} (line {lineno})"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"{where}: not valid JSON ({e.msg}): {line.strip()[:80]!r}") \
                    from None
            if not isinstance(rec, dict):
                raise TraceError(f"{where}: expected a JSON object, got {line.strip()[:80]!r}")
            missing = [k for k in MOONCAKE_KEYS if k not in rec]
            if with_hash_ids and "hash_ids" not in rec:
                missing.append("hash_ids")
            if missing:
                raise TraceError(f"{where}: missing key(s) {missing}; has {sorted(rec)}")
            ts.append(_json_number(where, "timestamp", rec["timestamp"], integer=False))
            inp.append(_json_number(where, "input_length", rec["input_length"], integer=True))
            out.append(_json_number(where, "output_length", rec["output_length"], integer=True))
            lines.append(lineno)
            if with_hash_ids:
                hashes.append(rec["hash_ids"])
    lines = np.asarray(lines, dtype=np.int64)
    t = np.asarray(ts, dtype=np.float64)
    inp = np.asarray(inp, dtype=np.int64)
    out = np.asarray(out, dtype=np.int64)
    raw = [repr(v) for v in ts]
    _check_timestamps(path, "timestamp", t, raw, lines)
    order = _check_order(path, "timestamp", t, raw, lines, sort)
    _check_lengths(path, inp, out, lines, allow_zero_output)
    trace = _assemble(_rebase(t[order] / 1000.0, start), inp[order], out[order])
    if with_hash_ids:
        return trace, [np.asarray(hashes[i], dtype=np.int64) for i in order]
    return trace


def _open(path: str):
    # The public traces are often shipped gzipped; read them without unpacking. utf-8-sig: files
    # saved by Excel and some Windows tools start with a byte-order mark, which is not data.
    if path.endswith(".gz"):
        return gzip.open(path, "rt", newline="", encoding="utf-8-sig")
    return open(path, "r", newline="", encoding="utf-8-sig")


def _lines(path: str):
    """The lines of a trace file (gzipped or not). A file that cannot be decoded raises
    TraceError naming it and the line, not a bare UnicodeDecodeError or EOFError."""
    done = 0                                  # lines decoded in full so far
    try:
        with _open(path) as f:
            for line in f:
                done += 1
                yield line
    except UnicodeDecodeError as e:
        raise _not_utf8(path, e) from e
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        # EOFError: the stream ends early (an interrupted download); zlib.error: corrupt data;
        # BadGzipFile: not gzip at all, or a bad CRC or length at the end.
        if not done and isinstance(e, gzip.BadGzipFile):
            raise TraceError(f"{path}: not a gzip file, though its name ends in .gz: "
                             f"{e}") from e
        where = f"after line {done}" if done else "before its first line"
        raise TraceError(f"{path}: the gzip stream is truncated or corrupt {where}: "
                         f"{e}") from e


def _not_utf8(path: str, e: UnicodeDecodeError) -> TraceError:
    """The TraceError for a file that is not UTF-8, naming its first bad line. The text layer
    decodes in blocks, so its error gives an offset in a block; re-read the bytes to find the
    line (a newline byte never occurs inside a UTF-8 character, so lines decode alone)."""
    try:
        with (gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")) as f:
            for lineno, raw in enumerate(f, start=1):
                try:
                    raw.decode("utf-8")
                except UnicodeDecodeError as bad:
                    hint = " (it looks gzipped: name it .gz)" \
                        if lineno == 1 and raw.startswith(b"\x1f\x8b") else ""
                    return TraceError(f"{path}: line {lineno} is not valid UTF-8 (byte "
                                      f"0x{raw[bad.start]:02x} at position {bad.start}: "
                                      f"{bad.reason}); trace files must be UTF-8 text{hint}")
    except (OSError, EOFError, zlib.error):
        pass                                  # the re-read failed too: report what we know
    return TraceError(f"{path}: not valid UTF-8 (byte 0x{e.object[e.start]:02x}: {e.reason}); "
                      f"trace files must be UTF-8 text")


def _where(path: str, lines: np.ndarray, i: int) -> str:
    return f"{path}: data row {i + 1} (line {int(lines[i])})"


def _read_csv(path: str, required: Sequence[str]):
    """Columns (lists of strings, by header name) and each data row's physical line number."""
    with contextlib.closing(_lines(path)) as f:
        reader = csv.reader(f)
        try:
            header = next(reader, None)
            while header is not None and not any(h.strip() for h in header):
                header = next(reader, None)
            if header is None:
                raise TraceError(f"{path}: file is empty; expected header {','.join(required)}")
            header = [h.strip() for h in header]
            missing = [c for c in required if c not in header]
            if missing:
                raise TraceError(f"{path}: header lacks column(s) {missing}; header is {header}")
            rows, lines = [], []
            for row in reader:
                if not row or (len(row) == 1 and not row[0].strip()):
                    continue
                if len(row) != len(header):
                    i = len(rows)
                    raise TraceError(f"{path}: data row {i + 1} (line {reader.line_num}) has "
                                     f"{len(row)} fields, header has {len(header)}: {row}")
                rows.append(row)
                lines.append(reader.line_num)
        except csv.Error as e:                # e.g. a field over the csv module's size limit
            raise TraceError(f"{path}: line {reader.line_num} is not valid CSV: {e}") from e
    idx = {c: header.index(c) for c in required}
    cols = {c: [r[j] for r in rows] for c, j in idx.items()}
    return cols, np.asarray(lines, dtype=np.int64)


def _first_bad(values, convert) -> int:
    for i, v in enumerate(values):
        try:
            convert(v)
        except (ValueError, OverflowError):
            return i
    return -1


def _parse_ints(path, column, values, lines) -> np.ndarray:
    if not len(values):
        return np.empty(0, dtype=np.int64)
    try:
        # Vectorised parse; the per-row loop below only runs to name the bad row.
        return np.asarray(values, dtype=str).astype(np.int64)
    except (ValueError, OverflowError):
        i = _first_bad(values, lambda v: np.int64(int(v.strip())))
        if i < 0:                             # a form NumPy rejects but Python accepts
            return np.array([int(v) for v in values], dtype=np.int64)
        raise TraceError(f"{_where(path, lines, i)}: column {column!r} has non-integer value "
                         f"{values[i]!r}") from None


def _parse_floats(path, column, values, lines) -> np.ndarray:
    if not len(values):
        return np.empty(0, dtype=np.float64)
    try:
        return np.asarray(values, dtype=str).astype(np.float64)
    except ValueError:
        i = _first_bad(values, float)
        if i < 0:
            return np.array([float(v) for v in values], dtype=np.float64)
        raise TraceError(f"{_where(path, lines, i)}: column {column!r} has non-numeric value "
                         f"{values[i]!r}") from None


def _parse_datetimes(path, ts: np.ndarray, lines) -> np.ndarray:
    """Date-time strings -> int64 nanoseconds since the epoch (UTC when an offset is given)."""
    if not ts.size:
        return np.empty(0, dtype=np.int64)

    def parse(a):
        with warnings.catch_warnings():
            # NumPy warns that it converts `+HH:MM` offsets to UTC: that is what we want.
            warnings.simplefilter("ignore", UserWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            return np.asarray(a, dtype="datetime64[ns]")

    # NumPy also reads '2023' or '2023-11' as dates; a trace row that short is a broken row.
    short = np.flatnonzero(np.char.str_len(ts) < len("2023-11-16 18:15:46"))
    if short.size:
        i = short[0]
        raise TraceError(f"{_where(path, lines, i)}: TIMESTAMP {str(ts[i])!r} is not a "
                         f"date-time like '2023-11-16 18:15:46.6805900'")
    try:
        dt = parse(ts)
    except ValueError:
        i = 0
        for i, v in enumerate(ts):
            try:
                parse([v])
            except ValueError:
                break
        raise TraceError(f"{_where(path, lines, i)}: TIMESTAMP {str(ts[i])!r} is not a "
                         f"date-time like '2023-11-16 18:15:46.6805900'") from None
    bad = np.flatnonzero(np.isnat(dt))
    if bad.size:
        i = bad[0]
        raise TraceError(f"{_where(path, lines, i)}: TIMESTAMP {str(ts[i])!r} is missing")
    return dt.astype(np.int64)


def _json_number(where, key, v, integer: bool):
    # bool is an int in Python; a `true` length is a bug in the file, not a 1.
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TraceError(f"{where}: {key} must be a number, got {v!r}")
    if integer:
        if isinstance(v, float):
            if not math.isfinite(v) or v != int(v):
                raise TraceError(f"{where}: {key} must be a whole number, got {v!r}")
            v = int(v)
        if not -2**63 <= v < 2**63:
            raise TraceError(f"{where}: {key} {v!r} is out of range")
    return v


def _check_timestamps(path, column, t, raw, lines) -> None:
    bad = np.flatnonzero(~np.isfinite(t))
    if bad.size:
        i = bad[0]
        raise TraceError(f"{_where(path, lines, i)}: {column} {raw[i]!s} is not finite")
    bad = np.flatnonzero(t < 0)
    if bad.size:
        i = bad[0]
        raise TraceError(f"{_where(path, lines, i)}: {column} {raw[i]!s} is negative")


def _check_order(path, column, t, raw, lines, sort: bool) -> np.ndarray:
    """The permutation that sorts `t`; raises on the first out-of-order row unless sort=True."""
    down = np.flatnonzero(np.diff(t) < 0)
    if not down.size:
        return np.arange(t.shape[0])
    if sort:
        return np.argsort(t, kind="stable")
    i = down[0] + 1
    raise TraceError(f"{_where(path, lines, i)}: {column} {str(raw[i])!s} is earlier than the "
                     f"previous row's {str(raw[i - 1])!s}; timestamps must not decrease "
                     f"(pass sort=True to sort them)")


def _check_nonnegative(path, inp, out, lines) -> None:
    for name, col in (("input", inp), ("output", out)):
        bad = np.flatnonzero(col < 0)
        if bad.size:
            i = bad[0]
            raise TraceError(f"{_where(path, lines, i)}: negative {name} token count {col[i]}")


def _check_lengths(path, inp, out, lines, allow_zero_output: bool) -> None:
    _check_nonnegative(path, inp, out, lines)
    bad = np.flatnonzero(inp == 0)
    if bad.size:
        raise TraceError(f"{_where(path, lines, bad[0])}: zero-length input (0 input tokens)")
    if not allow_zero_output:
        bad = np.flatnonzero(out == 0)
        if bad.size:
            raise TraceError(f"{_where(path, lines, bad[0])}: zero output tokens (pass "
                             f"allow_zero_output=True to keep such requests)")


def _rebase(t: np.ndarray, start: float | None) -> np.ndarray:
    if start is None or not t.size:
        return t.astype(np.float64)
    return t - t[0] + start


def _assemble(arrival, inp, out, priority=0) -> np.ndarray:
    trace = empty(len(arrival))
    trace["arrival"] = arrival
    trace["input_tokens"] = inp
    trace["output_tokens"] = out
    trace["priority"] = priority
    return trace


# ----------------------------------------------------------------------------------------------
# Generators


def poisson(rate: float, duration: float | None = None, n: int | None = None,
            input_tokens=1024, output_tokens=256, priority: int = 0, seed=0,
            start: float = 0.0) -> np.ndarray:
    """Poisson arrivals at `rate` requests/s (gamma() with burstiness 1, as in vLLM)."""
    return gamma(rate, 1.0, duration=duration, n=n, input_tokens=input_tokens,
                 output_tokens=output_tokens, priority=priority, seed=seed, start=start)


def gamma(rate: float, burstiness: float, duration: float | None = None, n: int | None = None,
          input_tokens=1024, output_tokens=256, priority: int = 0, seed=0,
          start: float = 0.0) -> np.ndarray:
    """Arrivals whose gaps are gamma-distributed with shape = burstiness and scale =
    1/(rate*burstiness) (vLLM's benchmark_serving): mean rate `rate`, gap CV 1/sqrt(burstiness);
    burstiness 1 is Poisson, < 1 burstier, > 1 smoother.

    The first request arrives at `start`; generation stops after `n` requests or at
    start + duration (exclusive), whichever comes first. Lengths: see the length specs above.
    Arrivals and each length column use their own stream derived from `seed`, so changing the
    lengths leaves the arrivals unchanged.
    """
    _check_positive("rate", rate)
    _check_positive("burstiness", burstiness)
    duration, n = _check_stop(duration, n)
    ss_arr, ss_in, ss_out = _seedseq(seed).spawn(3)
    arrival = start + _renewal(np.random.default_rng(ss_arr), rate, burstiness, duration, n,
                               first_at_zero=True)
    return _with_lengths(arrival, input_tokens, output_tokens, priority, ss_in, ss_out)


def time_varying(rates: Sequence[float], period: float, duration: float | None = None,
                 n: int | None = None, input_tokens=1024, output_tokens=256,
                 priority: int = 0, seed=0, start: float = 0.0) -> np.ndarray:
    """Poisson arrivals with a piecewise-constant rate: phase k covers
    [k*period, (k+1)*period) at rates[k % len(rates)] requests/s (the list cycles).

    Exact (time-rescaling of a unit-rate Poisson process, no thinning). As in poisson(), a
    request arrives at `start` when the first phase's rate is positive. Rates may be 0 (idle
    phases) but not all of them.
    """
    rates = np.asarray(rates, dtype=np.float64)
    if rates.ndim != 1 or rates.size == 0:
        raise InvalidArgumentError(f"rates must be a non-empty list of requests/s, got {rates!r}")
    if not np.all(np.isfinite(rates)) or np.any(rates < 0) or not np.any(rates > 0):
        raise InvalidArgumentError(f"rates must be finite, >= 0 and not all 0, got {rates.tolist()}")
    _check_positive("period", period)
    duration, n = _check_stop(duration, n)
    ss_arr, ss_in, ss_out = _seedseq(seed).spawn(3)
    rng = np.random.default_rng(ss_arr)
    cum = period * np.cumsum(rates)          # integrated rate at the end of each phase
    per_cycle = cum[-1]
    cycle_len = period * rates.size

    def inverse(lam):                         # integrated rate -> time
        cycle = np.floor(lam / per_cycle)
        r = np.minimum(lam - cycle * per_cycle, np.nextafter(per_cycle, 0.0))
        j = np.searchsorted(cum, r, side="right")
        prev = cum[j] - period * rates[j]
        return cycle * cycle_len + j * period + (r - prev) / rates[j]

    lam_end = None if duration is None else (
        math.floor(duration / cycle_len) * per_cycle
        + np.interp(duration % cycle_len, period * np.arange(rates.size + 1),
                    np.concatenate([[0.0], cum])))
    lam = _renewal(rng, 1.0, 1.0, None if duration is None else lam_end, n, first_at_zero=True)
    arrival = inverse(lam)
    if duration is not None:
        arrival = arrival[arrival < duration]
    return _with_lengths(start + arrival, input_tokens, output_tokens, priority, ss_in, ss_out)


def lognormal_lengths(mean: float, sigma: float = 1.0, cap: int = 8192):
    """A length spec (callable) drawing lognormal lengths of the given mean, rounded, in
    [1, cap]: BurstGPT's chat lengths are heavy-tailed like this (KunServe Table 3: mean input
    603, mean output 289)."""
    _check_positive("mean", mean)
    _check_positive("sigma", sigma)
    mu = math.log(mean) - sigma * sigma / 2

    def draw(rng, n):
        return np.clip(np.round(rng.lognormal(mu, sigma, size=n)), 1, cap).astype(np.int64)
    return draw


def burst(rate: float, duration: float, at: float = 150.0, factor: float = 14.0,
          length: float = 20.0, every: float | None = None, input_tokens=None,
          output_tokens=None, priority: int = 0, seed=0, start: float = 0.0) -> np.ndarray:
    """A BurstGPT-like load spike (KunServe Fig. 1: the rate rises 14x at 150 s): Poisson
    arrivals at `rate` requests/s, at rate * factor during [at, at + length) and, with `every`,
    again every `every` seconds after (a second spike: KunServe Fig. 15). Lengths default to
    lognormal_lengths(603) and lognormal_lengths(289, cap=4096). Exact: a unit-rate Poisson
    process mapped through the integrated rate."""
    _check_positive("rate", rate)
    _check_positive("duration", duration)
    _check_positive("factor", factor)
    _check_positive("length", length)
    if not (isinstance(at, (int, float)) and math.isfinite(at) and at >= 0):
        raise InvalidArgumentError(f"at must be a number >= 0, got {at!r}")
    if every is not None:
        _check_positive("every", every)
        if every < length:
            raise InvalidArgumentError(f"every {every} must be at least length {length}")
    input_tokens = lognormal_lengths(603) if input_tokens is None else input_tokens
    output_tokens = lognormal_lengths(289, cap=4096) if output_tokens is None else output_tokens
    edges, rates, t = [0.0], [], 0.0
    spike = at
    while t < duration:
        if spike is not None and spike < duration:
            if spike > t:
                edges.append(spike)
                rates.append(rate)
            edges.append(min(spike + length, duration))
            rates.append(rate * factor)
            t = edges[-1]
            spike = spike + every if every is not None else None
        else:
            edges.append(duration)
            rates.append(rate)
            t = duration
    edges, rates = np.asarray(edges), np.asarray(rates)
    cum = np.concatenate([[0.0], np.cumsum(rates * np.diff(edges))])  # integrated rate
    ss_arr, ss_in, ss_out = _seedseq(seed).spawn(3)
    lam = _renewal(np.random.default_rng(ss_arr), 1.0, 1.0, float(cum[-1]), None,
                   first_at_zero=True)
    arrival = np.interp(lam, cum, edges)
    arrival = arrival[arrival < duration]
    return _with_lengths(start + arrival, input_tokens, output_tokens, priority, ss_in, ss_out)


def mixture(classes: Sequence[dict], duration: float, seed=0, start: float = 0.0) -> np.ndarray:
    """Independent request classes merged by arrival. Each class is a dict with
    `rate_per_min` or `rate` (per s), optional `burstiness` (default 1: Poisson),
    `input_tokens`, `output_tokens` (length specs, defaults 1024/256) and `priority` (default 0).

    Each class is a stationary renewal process over [0, duration) (its first gap is drawn like
    the others, so slow classes do not all fire at t=0); the merged trace is then shifted so its
    first request is at `start`. Class k uses the k-th stream spawned from `seed`.
    """
    if isinstance(classes, dict) or not len(classes):
        raise InvalidArgumentError("classes must be a non-empty list of dicts")
    _check_positive("duration", duration)
    allowed = {"rate_per_min", "rate", "burstiness", "input_tokens", "output_tokens",
               "priority"}
    parts = []
    for k, (cls, ss) in enumerate(zip(classes, _seedseq(seed).spawn(len(classes)))):
        if not isinstance(cls, dict):
            raise InvalidArgumentError(f"class {k} must be a dict, got {cls!r}")
        unknown = set(cls) - allowed
        if unknown:
            raise InvalidArgumentError(f"class {k}: unknown key(s) {sorted(unknown)}; "
                             f"allowed: {sorted(allowed)}")
        if ("rate" in cls) == ("rate_per_min" in cls):
            raise InvalidArgumentError(f"class {k}: give exactly one of 'rate' (per s) or 'rate_per_min'")
        rate = cls["rate"] if "rate" in cls else cls["rate_per_min"] / 60.0
        _check_positive(f"class {k} rate", rate)
        burstiness = cls.get("burstiness", 1.0)
        _check_positive(f"class {k} burstiness", burstiness)
        ss_arr, ss_in, ss_out = ss.spawn(3)
        arrival = _renewal(np.random.default_rng(ss_arr), rate, burstiness, duration, None,
                           first_at_zero=False)
        parts.append(_with_lengths(arrival, cls.get("input_tokens", 1024),
                                   cls.get("output_tokens", 256), cls.get("priority", 0),
                                   ss_in, ss_out))
    trace = merge(parts)
    if trace.size:
        trace["arrival"] += start - trace["arrival"][0]
    return trace


def gyges_mixed(duration: float, seed=0, short_input=1024, long_input=50_000,
                short_rate_per_min: float = 60.0, long_rate_per_min: float = 1.0,
                output_tokens=256, start: float = 0.0) -> np.ndarray:
    """Gyges (section 6.2.4) mixed workload: short ~1K-token prompts at 60/min plus long
    ~50K-token prompts at 1/min, both Poisson. The paper does not fix output lengths; 256 is
    our default."""
    return mixture([
        {"rate_per_min": short_rate_per_min, "input_tokens": short_input,
         "output_tokens": output_tokens, "priority": 0},
        {"rate_per_min": long_rate_per_min, "input_tokens": long_input,
         "output_tokens": output_tokens, "priority": 0},
    ], duration=duration, seed=seed, start=start)


def flying_alternating(duration: float, seed=0, low=(2.0, 5.0), high=(10.0, 30.0),
                       period: float = 30.0, input_tokens=1024, output_tokens=256,
                       start: float = 0.0) -> np.ndarray:
    """Flying Serving's alternating load: phases of `period` seconds alternate low and high,
    starting low; each phase's rate (req/s) is drawn uniformly from its (min, max) range.
    The phase length is our choice (the paper alternates but we fix 30 s by default)."""
    _check_positive("duration", duration)
    _check_positive("period", period)
    for name, rng_ in (("low", low), ("high", high)):
        if len(rng_) != 2 or not 0 < rng_[0] <= rng_[1]:
            raise InvalidArgumentError(f"{name} must be a (min, max) rate range with 0 < min <= max, "
                             f"got {rng_!r}")
    ss_rates, ss_trace = _seedseq(seed).spawn(2)
    rng = np.random.default_rng(ss_rates)
    phases = max(1, math.ceil(duration / period))
    rates = [rng.uniform(*(low if k % 2 == 0 else high)) for k in range(phases)]
    return time_varying(rates, period, duration=duration, input_tokens=input_tokens,
                        output_tokens=output_tokens, seed=ss_trace, start=start)


PREFILL_HEAVY = (512, 16)   # PipeLive 7.2: mean input / output tokens of a prefill-heavy phase
DECODE_HEAVY = (128, 512)   # and of a decode-heavy phase


def pattern_shifting(rate: float, phase: float, duration: float | None = None,
                     n: int | None = None, patterns=(PREFILL_HEAVY, DECODE_HEAVY),
                     seed=0, start: float = 0.0, first: int = 0) -> np.ndarray:
    """PipeLive's pattern-shifting workload (its section 7.2): Poisson arrivals at `rate`
    requests/s whose lengths alternate every `phase` seconds between the patterns, by default
    prefill-heavy (512 in / 16 out) and decode-heavy (128 in / 512 out), starting with
    patterns[first]. Phase k covers [k*phase, (k+1)*phase) from `start` and uses
    patterns[(first + k) % len(patterns)]. The paper gives mean lengths; we use them exactly
    (every request of a phase has its pattern's lengths). Stops after n requests or at
    start + duration (the paper: 200 requests)."""
    _check_positive("phase", phase)
    pats = [tuple(int(x) for x in p) for p in patterns]
    if not pats or any(len(p) != 2 or min(p) < 1 for p in pats):
        raise InvalidArgumentError(f"patterns must be (input, output) pairs of tokens >= 1, got "
                                   f"{patterns!r}")
    if isinstance(first, bool) or not isinstance(first, (int, np.integer)) or first < 0:
        raise InvalidArgumentError(f"first must be an int >= 0, got {first!r}")
    trace = poisson(rate, duration=duration, n=n, seed=seed, start=start)
    k = np.floor((trace["arrival"] - start) / phase).astype(np.int64)
    which = (int(first) + k) % len(pats)
    trace["input_tokens"] = np.array([p[0] for p in pats], np.int64)[which]
    trace["output_tokens"] = np.array([p[1] for p in pats], np.int64)[which]
    return trace


def phase_of(trace: np.ndarray, phase: float, start: float = 0.0) -> np.ndarray:
    """The phase index of each request of a pattern_shifting trace."""
    _check_positive("phase", phase)
    return np.floor((trace["arrival"] - start) / phase).astype(np.int64)


def _seedseq(seed) -> np.random.SeedSequence:
    if isinstance(seed, np.random.SeedSequence):
        return seed
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise InvalidArgumentError(f"seed must be a non-negative int, got {seed!r}")
    return np.random.SeedSequence(int(seed))


def _check_positive(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) \
            or not math.isfinite(v) or v <= 0:
        raise InvalidArgumentError(f"{name} must be a finite number > 0, got {v!r}")


def _check_stop(duration, n):
    if duration is None and n is None:
        raise InvalidArgumentError("give duration (seconds), n (requests) or both")
    if duration is not None:
        _check_positive("duration", duration)
        duration = float(duration)
    if n is not None:
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise InvalidArgumentError(f"n must be an int >= 0, got {n!r}")
        n = int(n)
    return duration, n


def _renewal(rng, rate, burstiness, duration, n, first_at_zero: bool) -> np.ndarray:
    """Arrival times (from 0) of a renewal process with gamma gaps; stops at n events or at
    `duration` (exclusive). first_at_zero puts an event at 0; otherwise the first gap is drawn
    like the rest."""
    scale = 1.0 / (rate * burstiness)
    if duration is None:
        need = n - 1 if first_at_zero else n
        gaps = rng.gamma(burstiness, scale, size=max(need, 0))
    elif duration <= 0:
        gaps = np.empty(0)
    else:
        # Draw in chunks until past `duration`; the chunk sizes depend only on the arguments,
        # so the result is a deterministic function of the seed.
        mean = rate * duration
        chunk = int(mean + 6 * math.sqrt(mean / burstiness + 1) + 16)
        if n is not None:
            chunk = min(chunk, n + 1)
        chunks, total = [], 0.0
        while total < duration and (n is None or sum(c.size for c in chunks) < n):
            g = rng.gamma(burstiness, scale, size=chunk)
            chunks.append(g)
            total += g.sum()
        gaps = np.concatenate(chunks)
    t = np.cumsum(gaps)
    if first_at_zero:
        t = np.concatenate([[0.0], t])
    if duration is not None:
        t = t[t < duration]
    if n is not None:
        t = t[:n]
    return t


def _draw_lengths(spec, rng, n: int, name: str) -> np.ndarray:
    if isinstance(spec, (bool, np.bool_)):
        raise InvalidArgumentError(f"{name} must be an int, a (low, high) tuple or a callable, got {spec!r}")
    if isinstance(spec, (int, np.integer)):
        if spec < 1:
            raise InvalidArgumentError(f"{name} must be >= 1, got {spec}")
        return np.full(n, int(spec), dtype=np.int64)
    if isinstance(spec, tuple) and len(spec) == 2:
        low, high = spec
        if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in spec) \
                or not 1 <= low <= high:
            raise InvalidArgumentError(f"{name} range must be two ints with 1 <= low <= high, got {spec!r}")
        return rng.integers(low, high, size=n, endpoint=True, dtype=np.int64)
    if callable(spec):
        v = np.asarray(spec(rng, n))
        if v.shape != (n,):
            raise InvalidArgumentError(f"{name} callable returned shape {v.shape}, expected ({n},)")
        if v.dtype.kind == "f" and (not np.all(np.isfinite(v)) or np.any(v != np.round(v))):
            raise InvalidArgumentError(f"{name} callable returned non-integer lengths, e.g. "
                             f"{v[v != np.round(v)][:3]}")
        if v.dtype.kind not in "iuf":
            raise InvalidArgumentError(f"{name} callable returned dtype {v.dtype}, expected integers")
        if n and v.min() < 1:
            raise InvalidArgumentError(f"{name} callable returned a length < 1: {v.min()}")
        return v.astype(np.int64)
    raise InvalidArgumentError(f"{name} must be an int, a (low, high) tuple or a callable(rng, n), "
                     f"got {spec!r}")


def _with_lengths(arrival, input_tokens, output_tokens, priority, ss_in, ss_out) -> np.ndarray:
    n = arrival.shape[0]
    inp = _draw_lengths(input_tokens, np.random.default_rng(ss_in), n, "input_tokens")
    out = _draw_lengths(output_tokens, np.random.default_rng(ss_out), n, "output_tokens")
    return _assemble(arrival, inp, out, priority)


# ----------------------------------------------------------------------------------------------
# Transforms (each returns a new trace; the input is not modified)


def scale_lengths(trace: np.ndarray, factor=None, max_input: int | None = None,
                  max_output: int | None = None) -> np.ndarray:
    """Multiply lengths by `factor` (one number, or (input_factor, output_factor)); results are
    rounded and kept >= 1; then cap them at max_input / max_output."""
    _check_fields(trace)
    out = trace.copy()
    if factor is not None:
        fi, fo = factor if isinstance(factor, tuple) else (factor, factor)
        _check_positive("input factor", fi)
        _check_positive("output factor", fo)
        out["input_tokens"] = np.maximum(1, np.rint(trace["input_tokens"] * fi))
        # Zero outputs (failed requests kept on purpose) stay zero.
        scaled = np.maximum(1, np.rint(trace["output_tokens"] * fo))
        out["output_tokens"] = np.where(trace["output_tokens"] == 0, 0, scaled)
    if max_input is not None:
        _check_min("max_input", max_input, 1)
        out["input_tokens"] = np.minimum(out["input_tokens"], max_input)
    if max_output is not None:
        _check_min("max_output", max_output, 1)
        out["output_tokens"] = np.minimum(out["output_tokens"], max_output)
    return out


def scale_rate(trace: np.ndarray, factor: float) -> np.ndarray:
    """Speed arrivals up by `factor` (2 = twice the request rate), keeping the first arrival."""
    _check_fields(trace)
    _check_positive("factor", factor)
    out = trace.copy()
    if out.size:
        a0 = trace["arrival"][0]
        out["arrival"] = a0 + (trace["arrival"] - a0) / factor
    return out


def clip(trace: np.ndarray, duration: float | None = None, n: int | None = None) -> np.ndarray:
    """Keep requests arriving within `duration` seconds of the first (exclusive) and/or the
    first `n` requests."""
    _check_fields(trace)
    out = trace
    if duration is not None:
        _check_positive("duration", duration)
        if out.size:
            out = out[out["arrival"] < out["arrival"][0] + duration]
    if n is not None:
        _check_min("n", n, 0)
        out = out[:n]
    return out.copy()


def fit(trace: np.ndarray, max_model_len: int, max_input: int | None = None,
        max_output: int | None = None, mode: str = "clip") -> tuple[np.ndarray, int]:
    """Fit a trace to a model/cluster: each request must have input <= max_input,
    output <= max_output and input + output <= max_model_len (vLLM's admission rule).

    mode="clip" shortens requests: output is capped at max_output and at max_model_len - 1
    (so one prompt token fits), then input at max_input and at max_model_len - output.
    mode="drop" removes the requests that do not fit.
    Returns (new trace, number of requests clipped or dropped).
    """
    _check_fields(trace)
    _check_min("max_model_len", max_model_len, 2)
    if max_input is not None:
        _check_min("max_input", max_input, 1)
    if max_output is not None:
        _check_min("max_output", max_output, 1)
    if mode not in ("clip", "drop"):
        raise InvalidArgumentError(f"mode must be 'clip' or 'drop', got {mode!r}")
    inp, out = trace["input_tokens"], trace["output_tokens"]
    if mode == "drop":
        ok = inp + out <= max_model_len
        if max_input is not None:
            ok &= inp <= max_input
        if max_output is not None:
            ok &= out <= max_output
        return trace[ok].copy(), int((~ok).sum())
    new_out = np.minimum(out, max_model_len - 1)
    if max_output is not None:
        new_out = np.minimum(new_out, max_output)
    new_in = np.minimum(inp, max_model_len - new_out)
    if max_input is not None:
        new_in = np.minimum(new_in, max_input)
    result = trace.copy()
    result["input_tokens"] = new_in
    result["output_tokens"] = new_out
    return result, int(((new_in != inp) | (new_out != out)).sum())


def _check_min(name, v, low) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < low:
        raise InvalidArgumentError(f"{name} must be an int >= {low}, got {v!r}")


def summary(trace: np.ndarray) -> dict:
    """count, duration (last - first arrival, s), rate (req/s = (count-1)/duration, i.e. one
    over the mean gap; NaN when duration is 0), and mean/p50/p99/max of input and output
    lengths plus their totals. Percentiles interpolate linearly (NumPy's default)."""
    _check_fields(trace)
    n = int(trace.size)
    res: dict = {"count": n}
    if n == 0:
        res.update(duration=0.0, rate=math.nan)
    else:
        dur = float(trace["arrival"][-1] - trace["arrival"][0])
        res.update(duration=dur, rate=(n - 1) / dur if dur > 0 else math.nan)
    for key, field in (("input", "input_tokens"), ("output", "output_tokens")):
        col = trace[field].astype(np.float64)
        res[f"{key}_total"] = int(trace[field].sum())
        if n:
            res[f"{key}_mean"] = float(col.mean())
            res[f"{key}_p50"] = float(np.percentile(col, 50))
            res[f"{key}_p99"] = float(np.percentile(col, 99))
            res[f"{key}_max"] = int(trace[field].max())
        else:
            res.update({f"{key}_{s}": math.nan for s in ("mean", "p50", "p99", "max")})
    return res
