"""What a simulation returns (gyges.sim.run): per-request records, per-instance time series, the
layout over time, the transformations, throughput bins, and the run's configuration.

    res.summary()            gyges.metrics.summarize(...) plus policy_rejected, transformations,
                             scale_ups, scale_downs, preemptions, migrations
    res.requests             REQUEST_DTYPE: gyges.metrics' fields first, then the simulator's
    res.timeline             TIMELINE_DTYPE: one row per instance per sample
    res.layout               LAYOUT_DTYPE: instances appearing (+1) and disappearing (-1)
    res.transformations      TRANSFORM_DTYPE
    res.throughput()         (bin starts, output tokens/s, prompt+output tokens/s)
    res.window_throughput()  tokens/s while the requests arrive (Gyges' Figure 12 throughput)
    res.save(path) / Results.load(path)   path.json (config, stats) + path.npz (arrays)
    res.to_pandas("requests") / res.to_csv(path, "timeline")   a table, codes as names
    res.plot(path=None)      matplotlib (imported only here)

The dtypes mirror the C structs of csrc/sim/sim.h byte for byte.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np

from . import metrics
from ..core.errors import InvalidArgumentError, require

__all__ = ["Results", "REQUEST_DTYPE", "TIMELINE_DTYPE", "LAYOUT_DTYPE", "TRANSFORM_DTYPE",
           "TABLES", "STATUS"]

# gy_sim_request_out
REQUEST_DTYPE = np.dtype([
    ("arrival", "f8"), ("scheduled", "f8"), ("first_token", "f8"), ("finish", "f8"),
    ("input_tokens", "i8"), ("output_tokens", "i8"),
    ("status", "i4"), ("min_tp", "i4"), ("gpu", "i4"), ("tp", "i4"),
    ("preemptions", "i4"), ("migrations", "i4")])
# gy_sim_sample
TIMELINE_DTYPE = np.dtype([
    ("time", "f8"), ("gpu", "i4"), ("tp", "i4"), ("xform", "i4"), ("held", "i4"),
    ("kv_used", "i8"), ("kv_total", "i8"), ("running", "i8"), ("waiting", "i8")])
# gy_sim_layout_event
LAYOUT_DTYPE = np.dtype([("time", "f8"), ("gpu", "i4"), ("tp", "i4"), ("change", "i4"),
                         ("pad", "i4")])
# gy_sim_transform_out (kind 0 = merge / scale-up, 1 = split / scale-down)
TRANSFORM_DTYPE = np.dtype([
    ("kind", "i4"), ("gpu", "i4"), ("tp_from", "i4"), ("tp_to", "i4"),
    ("start", "f8"), ("phase_end", "f8"), ("end", "f8"),
    ("kv_bytes", "f8"), ("weight_bytes", "f8"), ("migrated", "i8"),
    ("layers_from", "i4", (8,)), ("layers_to", "i4", (8,))])  # resplit (kind 6); 8 stages max
TOKEN_DTYPE = np.dtype([("request", "i8"), ("time", "f8")])

STATUS = {0: "pending", 1: "deferred", 2: "queued", 3: "finished", 4: "rejected"}
# codes of the other tables, as names in Results.table / to_pandas / to_csv
KIND = {0: "merge", 1: "split", 4: "bind", 5: "release", 6: "resplit", 7: "drop",
        8: "restore"}                                                    # transformations
XFORM = {0: "none", 1: "merging", 2: "splitting", 3: "split_tail", 4: "binding",
         5: "releasing", 6: "resplitting", 7: "dropping", 8: "exchanging",
         9: "restoring"}                                            # timeline (gy_sim_xform)
CHANGE = {1: "created", -1: "gone"}                                # layout
TABLES = ("requests", "timeline", "layout", "transformations", "tokens")


class Results:
    """The outcome of one simulation (see the module docstring)."""

    def __init__(self, requests, timeline, layout, transformations, bins_output, bins_prompt,
                 bin_seconds, config, stats, slo=None, wall_seconds=math.nan, tokens=None):
        self.requests = requests
        self.timeline = timeline
        self.layout = layout
        self.transformations = transformations
        self.bins_output = bins_output
        self.bins_prompt = bins_prompt
        self.bin_seconds = float(bin_seconds)
        self.config = config
        self.stats = stats
        self.slo = slo
        self.wall_seconds = float(wall_seconds)
        self.tokens = tokens

    @classmethod
    def from_simulator(cls, sim, config, slo=None, wall_seconds=math.nan) -> "Results":
        out, prompt = sim.bins()
        tokens = np.frombuffer(sim.tokens(), dtype=TOKEN_DTYPE).copy()
        return cls(
            requests=np.frombuffer(sim.requests(), dtype=REQUEST_DTYPE).copy(),
            timeline=np.frombuffer(sim.samples(), dtype=TIMELINE_DTYPE).copy(),
            layout=np.frombuffer(sim.layout(), dtype=LAYOUT_DTYPE).copy(),
            transformations=np.frombuffer(sim.transforms(), dtype=TRANSFORM_DTYPE).copy(),
            bins_output=np.frombuffer(out, dtype=np.float64).copy(),
            bins_prompt=np.frombuffer(prompt, dtype=np.float64).copy(),
            bin_seconds=config["sample_interval"], config=config, stats=sim.stats(), slo=slo,
            wall_seconds=wall_seconds, tokens=tokens if config.get("record_tokens", True)
            and tokens.size else None)

    # ---- views ----

    def token_times(self) -> list | None:
        """Each request's output-token times (only with record_tokens=True), for
        gyges.metrics' ITL and throughput_timeseries."""
        if self.tokens is None:
            return None
        order = np.argsort(self.tokens["request"], kind="stable")
        req, t = self.tokens["request"][order], self.tokens["time"][order]
        cuts = np.searchsorted(req, np.arange(self.requests.size + 1))
        return [t[cuts[i]:cuts[i + 1]] for i in range(self.requests.size)]

    def summary(self, slo: dict | None = None, percentiles=(90, 99)) -> dict:
        """gyges.metrics.summarize over the requests (its `rejected` counts every request never
        scheduled) plus: policy_rejected (requests no instance could ever hold), unserved
        (deferred and never placed), transformations (completed), scale_ups, scale_downs,
        preemptions, migrations, and the policy."""
        slo = self.slo if slo is None else slo
        res = metrics.summarize(self.requests, self.token_times(), slo=slo,
                                percentiles=percentiles)
        status = self.requests["status"]
        done = ~np.isnan(self.transformations["end"]) if self.transformations.size else \
            np.zeros(0, bool)
        res.update(
            policy=self.config.get("policy"),
            policy_rejected=int((status == 4).sum()),
            unserved=int((status == 1).sum()),
            transformations=int(done.sum()),
            scale_ups=int((done & (self.transformations["kind"] == 0)).sum()),
            scale_downs=int((done & (self.transformations["kind"] == 1)).sum()),
            resplits=int((done & (self.transformations["kind"] == 6)).sum()),
            preemptions=int(self.requests["preemptions"].sum()),
            migrations=int(self.requests["migrations"].sum()),
            wall_seconds=self.wall_seconds,
        )
        return res

    def throughput(self):
        """(bin starts in seconds from the first arrival, output tokens/s, prompt + output
        tokens/s), bins of `bin_seconds`."""
        starts = np.arange(self.bins_output.size) * self.bin_seconds
        return (starts, self.bins_output / self.bin_seconds,
                (self.bins_output + self.bins_prompt) / self.bin_seconds)

    def window_throughput(self, end: float | None = None) -> tuple[float, float]:
        """(prompt + output tokens/s, output tokens/s) processed in [0, end) from the first
        arrival, default end: the last arrival, in whole bins. The throughput of Gyges'
        Figure 12/13 (TPS while the workload runs): a policy that falls behind shows it here,
        while the throughput of summary() waits for every request to finish."""
        if end is None:
            end = float(np.nanmax(self.requests["arrival"])) if self.requests.size else 0.0
        n = min(int(end // self.bin_seconds), self.bins_output.size)
        if n < 1:
            return math.nan, math.nan
        span = n * self.bin_seconds
        return (float((self.bins_output[:n] + self.bins_prompt[:n]).sum()) / span,
                float(self.bins_output[:n].sum()) / span)

    def layout_at(self, t: float) -> list[tuple[int, int]]:
        """[(first GPU, TP), ...] of the instances alive at time t (seconds, absolute)."""
        alive = {}
        for ev in self.layout[np.argsort(self.layout["time"], kind="stable")]:
            if ev["time"] > t:
                break
            key = (int(ev["gpu"]), int(ev["tp"]))
            alive[key] = alive.get(key, 0) + int(ev["change"])
        return sorted(k for k, v in alive.items() if v > 0)

    # ---- tables ----

    def table(self, name: str = "requests") -> dict:
        """One of TABLES as {column: array}, codes as names: a request's status ('finished',
        'rejected', ...), a transformation's kind ('merge', 'split'), a sample's xform ('none',
        'merging', ...), a layout event's change ('created', 'gone'). Requests and
        transformations get their index (`request`, `transformation`) as the first column."""
        if name not in TABLES:
            raise InvalidArgumentError(f"unknown table {name!r}; known: {', '.join(TABLES)}")
        array = getattr(self, name)
        if array is None:
            raise InvalidArgumentError(f"this run kept no {name} (record_tokens=True keeps them)")
        names = {"requests": {"status": STATUS}, "transformations": {"kind": KIND},
                 "timeline": {"xform": XFORM}, "layout": {"change": CHANGE}}.get(name, {})
        out = {}
        if name in ("requests", "transformations"):
            out[name[:-1]] = np.arange(array.size)
        for field in array.dtype.names:
            if field == "pad":
                continue
            col = array[field]
            if col.ndim > 1:  # a re-split's layers per stage: "60,20" (unused stages are 0)
                col = np.array([",".join(str(int(x)) for x in row if x) for row in col],
                               dtype=object)
            if field in names:
                col = np.array([names[field].get(int(v), str(int(v))) for v in col], dtype=object)
            out[field] = col
        return out

    def to_pandas(self, name: str = "requests"):
        """table(name) as a pandas.DataFrame (pandas is optional: pip install pandas)."""
        pd = require("pandas", "Results.to_pandas")
        return pd.DataFrame(self.table(name))

    def to_csv(self, path, name: str = "requests") -> Path:
        """Writes table(name) as CSV (a header row, then one row per record; NaN as 'nan')."""
        cols = self.table(name)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(cols)
            for row in zip(*(c.tolist() for c in cols.values())):
                w.writerow(row)
        return path

    # ---- files ----

    def save(self, path) -> tuple[Path, Path]:
        """Writes path.json (config, stats, summary) and path.npz (the arrays)."""
        base = _base(path)
        base.parent.mkdir(parents=True, exist_ok=True)
        arrays = {"requests": self.requests, "timeline": self.timeline, "layout": self.layout,
                  "transformations": self.transformations, "bins_output": self.bins_output,
                  "bins_prompt": self.bins_prompt}
        if self.tokens is not None:
            arrays["tokens"] = self.tokens
        npz = base.with_suffix(".npz")
        np.savez_compressed(npz, **arrays)
        meta = {"format": "gyges.sim.results/1", "config": self.config, "stats": self.stats,
                "slo": self.slo, "bin_seconds": self.bin_seconds,
                "wall_seconds": self.wall_seconds, "summary": _jsonable(self.summary())}
        js = base.with_suffix(".json")
        js.write_text(json.dumps(_jsonable(meta), indent=2))
        return js, npz

    @classmethod
    def load(cls, path) -> "Results":
        base = _base(path)
        meta = json.loads(base.with_suffix(".json").read_text())
        if meta.get("format") != "gyges.sim.results/1":
            raise InvalidArgumentError(f"{base.with_suffix('.json')}: not a gyges simulation result "
                             f"(format {meta.get('format')!r})")
        with np.load(base.with_suffix(".npz")) as z:
            arrays = {k: z[k] for k in z.files}
        return cls(requests=arrays["requests"], timeline=arrays["timeline"],
                   layout=arrays["layout"], transformations=arrays["transformations"],
                   bins_output=arrays["bins_output"], bins_prompt=arrays["bins_prompt"],
                   bin_seconds=meta["bin_seconds"], config=meta["config"], stats=meta["stats"],
                   slo=meta.get("slo"), wall_seconds=meta.get("wall_seconds", math.nan),
                   tokens=arrays.get("tokens"))

    # ---- pictures ----

    def plot(self, path=None, title: str | None = None):
        """Three panels: throughput over time with transformation markers, the layout over time
        (each GPU coloured by the TP of its instance), and CDFs of TTFT, TPOT and E2E. Saves to
        `path` when given; returns the matplotlib Figure."""
        matplotlib = require("matplotlib", "Results.plot")
        if path is not None:
            matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(3, 1, figsize=(10, 10), constrained_layout=True)
        t0 = float(self.requests["arrival"].min()) if self.requests.size else 0.0
        starts, out_tps, total_tps = self.throughput()
        group = max(1, starts.size // 400)  # about 400 points: readable, not per-bin noise
        if group > 1:
            n = starts.size // group * group
            starts = starts[:n:group]
            out_tps = out_tps[:n].reshape(-1, group).mean(axis=1)
            total_tps = total_tps[:n].reshape(-1, group).mean(axis=1)
        ax = axes[0]
        ax.plot(starts, total_tps, lw=0.8, label="prompt + output tokens/s")
        ax.plot(starts, out_tps, lw=0.8, label="output tokens/s")
        for tr in self.transformations:
            ax.axvline(tr["start"] - t0, color="tab:red" if tr["kind"] == 0 else "tab:green",
                       lw=0.5, alpha=0.6)
        ax.set_xlabel("time (s)")
        ax.set_ylabel("tokens/s")
        ax.set_title(title or f"{self.config.get('policy')}: throughput (red: scale-up, green: "
                              f"scale-down)")
        ax.legend(loc="upper right", fontsize=8)
        ax = axes[1]
        end = max(float(np.nanmax(self.requests["finish"])) if np.isfinite(
            self.requests["finish"]).any() else t0, t0) - t0
        colours = {1: "tab:blue", 2: "tab:orange", 4: "tab:red", 8: "tab:purple"}
        open_at = {}
        for ev in self.layout[np.argsort(self.layout["time"], kind="stable")]:
            key = (int(ev["gpu"]), int(ev["tp"]))
            if ev["change"] > 0:
                open_at[key] = float(ev["time"]) - t0
            elif key in open_at:
                _bar(ax, key, open_at.pop(key), float(ev["time"]) - t0, colours)
        for key, s in open_at.items():
            _bar(ax, key, s, end, colours)
        ax.set_xlabel("time (s)")
        ax.set_ylabel("GPU")
        ax.set_title("layout (colour = TP of the instance: blue 1, orange 2, red 4, purple 8)")
        ax.invert_yaxis()
        ax = axes[2]
        pr = metrics.per_request(self.requests)
        for name in ("ttft", "tpot", "e2e"):
            x = np.sort(pr[name][np.isfinite(pr[name])])
            if x.size:
                ax.plot(x, np.arange(1, x.size + 1) / x.size, label=name)
        ax.set_xscale("log")
        ax.set_xlabel("seconds")
        ax.set_ylabel("CDF")
        ax.legend()
        if path is not None:
            fig.savefig(path, dpi=120)
        return fig


def _bar(ax, key, start, end, colours):
    gpu, tp = key
    ax.broken_barh([(start, max(end - start, 1e-9))], (gpu, tp), facecolors=colours.get(tp, "k"),
                   edgecolor="white", linewidth=0.3)


def _base(path) -> Path:
    p = Path(path)
    return p.with_suffix("") if p.suffix in (".json", ".npz") else p


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating, float)):
        x = float(x)
        return x if math.isfinite(x) else None
    if isinstance(x, np.bool_):
        return bool(x)
    return x
