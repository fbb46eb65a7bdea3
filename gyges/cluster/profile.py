"""Profiled cost models (Vidur-style): a real engine's step times measured over a grid of batch
shapes, and the cost model the simulator takes built from them.

    cost = ProfiledCost.profile(host)                 # an idle gyges.Host of TP1 instances
    cost.fit_report()                                 # each grid point: measured, fitted, error
    cost.save("smollm2.json"); cost = ProfiledCost.load("smollm2.json")
    res = gyges.sim.run(trace, gpus_per_host=host.n_workers, cost=cost)

What is measured. On the host's TP1 instances, then on its workers merged into TP-tp instances
for every TP the host can form (host.transform, split back afterwards), each grid point is run
for real at every TP whose instance holds it (a long prompt that only a merged instance holds is
measured there, not extrapolated to): a decode point of `batch` requests at `context` tokens
times `repeats` decode steps (after `warmup`), a prefill point of `prefill` prompt tokens times
its chunk steps (a prompt longer than the host's max_batch_tokens is prefilled in several) over
`repeats` fresh requests.
Every instance of a level runs the grid at once, each on a thread, as a replay's instances step
(concurrent=True: CPU workers share cores and memory bandwidth, so one instance alone is faster
than under load). A timed step is what a replay's runner pays per step: Instance.step() and the
load it reads after it (experiment.instance_load); its shape comes from the requests' computed
tokens before and after (gyges.costmodel's batch shape: tokens, samples, KV tokens read, causal
pairs); a point's time is the mean of its steps (the simulator adds step times up, so it needs
their expectation: a shared machine's occasional slow step makes the median too low). The merges and splits between the levels are
timed too, with the KV of the last decode points in flight and without.

The model. Per TP level, step = base + per_token * n_tokens + per_sample * n_samples +
per_kv_read * kv_read_tokens + per_pair * attn_pairs (csrc/policy/cost.h's profiled backend; the
matmuls, the LM head and sampler, attention's reads and its causal FLOPs), every coefficient
>= 0, fitted by least squares on errors relative to the fit (so that 1 ms decode steps and
0.5 s prefills count alike) to that level's points. A transformation phase moves the roofline's
bytes (the KV heads that change owner, the FFN shards a split gathers) at `xfer_bw` plus a
latency per layer, both fitted to the timed merges and splits. The host's merges run every
layer at once between two steps, so `transform_slowdown` is 0. KV capacities are the host's own
(experiment.capacities); prompts are prefilled in chunks, so only the KV limits their length
(max_inputs is None).

Pipelines (PP) are not profiled: the simulator prices them with gyges.costmodel.PipelineCost."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..models.config import ModelConfig
from .costmodel import PHASES, CostModel, CostModelError

__all__ = ["ProfiledCost", "ProfileError", "DEFAULT_GRID", "TERMS"]

# The step model's terms, in the order of csrc/policy/cost.h's gy_sim_cost_profiled.
TERMS = ("base", "per_token", "per_sample", "per_kv_read", "per_pair")

# Small enough that the tiny model profiles in seconds; the benchmark passes its own.
DEFAULT_GRID = {"batch": (1, 4, 16), "context": (32, 160), "prefill": (32, 96, 256)}

POINT_KEYS = ("tp", "kind", "n_tokens", "n_seqs", "n_samples", "kv_read_tokens", "attn_pairs",
              "seconds", "spread")


class ProfileError(CostModelError):
    """A bad grid, host or profile file (the message names the value)."""


def _shape_of(entries):
    return CostModel.batch_shape(entries)


def nonneg_lstsq(X, y):
    """Least squares with every coefficient >= 0 (an active set: drop the most negative column
    and solve again)."""
    keep = list(range(X.shape[1]))
    while True:
        coef = np.zeros(X.shape[1])
        if keep:
            coef[keep], *_ = np.linalg.lstsq(X[:, keep], y, rcond=None)
        if not keep or coef[keep].min() >= 0:
            return coef
        keep.remove(keep[int(np.argmin(coef[keep]))])


def _relative_fit(X, y, iterations=8):
    """Non-negative coefficients c of X c ~ y with errors relative to the fit (Gamma regression
    by reweighted least squares: weights 1 / (X c) of the previous round, first 1 / y). Weighting
    by the measured 1 / y instead is biased low under noise: a point measured slow counts less."""
    w = 1.0 / y
    for _ in range(iterations):
        c = nonneg_lstsq(X * w[:, None], y * w)
        fitted = X @ c
        if np.any(fitted <= 0):
            break
        w = 1.0 / fitted
    return c


def _columns(p):
    """The step model's regressors of points (dicts or a structured array)."""
    get = (lambda k: np.asarray([q[k] for q in p], np.float64)) if isinstance(p, list) \
        else (lambda k: np.asarray(p[k], np.float64))
    n = get("n_tokens")
    return np.stack([np.ones_like(n), n, get("n_samples"), get("kv_read_tokens"),
                     get("attn_pairs")], axis=1)


def _phase_bytes(phase, tp_from, tp_to, kv_tokens, kv_bytes_per_token, ffn_bytes):
    """What each GPU receives in one phase (csrc/policy/cost.c's gy_sim_phase_bytes)."""
    lo, hi = min(tp_from, tp_to), max(tp_from, tp_to)
    if phase == "kv_scatter":
        return (1 - lo / hi) * kv_tokens * kv_bytes_per_token / hi
    if phase == "weights_gather":
        return ffn_bytes * (1 / lo - 1 / hi)
    return 0.0


# A merge drops weights, then scatters KV; a split scatters KV, then gathers the FFN.
_PHASES_OF = {"merge": ("weights_drop", "kv_scatter"), "split": ("kv_scatter", "weights_gather")}


@dataclass(frozen=True)
class ProfiledCost:
    """A cost model measured on a real engine (module docstring): per TP level 1, 2, 4, ...
    the coefficients of TERMS (`levels`, seconds per unit), the host's KV blocks per level
    (`capacity`, of `block_size` tokens), the phase terms, and the grid points it was fitted to
    (`points`, dicts of POINT_KEYS) with the timed transformations (`transforms`)."""
    model: ModelConfig
    levels: tuple                  # per TP level: TERMS' coefficients
    capacity: tuple                # KV blocks of a TP-1, 2, 4, ... instance
    block_size: int
    kv_bytes_per_token: float      # K and V of one token, every layer, every head
    ffn_bytes: float
    xfer_bw: float                 # bytes/s a worker receives in a phase
    phase_latency_per_layer: float
    transform_slowdown: float = 0.0
    points: tuple = ()
    transforms: tuple = ()
    # per TP level: TERMS' coefficients measured with the host's other workers idle (a profile
    # with concurrent=False, with_alone); a step then interpolates from them to `levels` by the
    # share of the host's other workers stepping when it starts. None: `levels` for every step
    alone: tuple | None = None
    note: str = field(default="", compare=False)

    kind = "profiled"

    def __post_init__(self):
        if not isinstance(self.model, ModelConfig):
            raise ProfileError(f"model must be a ModelConfig, got {type(self.model).__name__}")
        if not 1 <= len(self.levels) <= 8 or any(len(c) != len(TERMS) for c in self.levels):
            raise ProfileError(f"levels must be 1 to 8 tuples of {len(TERMS)} coefficients, got "
                               f"{self.levels!r}")
        for l, coefs in enumerate(self.levels):
            for name, v in zip(TERMS, coefs):
                if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                    raise ProfileError(f"{name} of TP{1 << l} must be a finite number >= 0, "
                                       f"got {v!r}")
        if self.alone is not None:
            if len(self.alone) != len(self.levels) or \
                    any(len(c) != len(TERMS) for c in self.alone):
                raise ProfileError(f"alone must give {len(TERMS)} coefficients for each of the "
                                   f"{len(self.levels)} TP levels, got {self.alone!r}")
            for l, coefs in enumerate(self.alone):
                if not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0
                           for v in coefs) or not coefs[0] + coefs[1] > 0:
                    raise ProfileError(f"alone coefficients of TP{1 << l} must be finite, >= 0 "
                                       f"and not all 0, got {coefs!r}")
        if len(self.capacity) != len(self.levels) or min(self.capacity) < 1:
            raise ProfileError(f"capacity must give >= 1 block for each of the "
                               f"{len(self.levels)} TP levels, got {self.capacity!r}")
        for name in ("kv_bytes_per_token", "xfer_bw"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ProfileError(f"{name} must be a finite number > 0, got {v!r}")
        for name in ("ffn_bytes", "phase_latency_per_layer", "transform_slowdown"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ProfileError(f"{name} must be a finite number >= 0, got {v!r}")

    def replace(self, **changes) -> "ProfiledCost":
        return dataclasses.replace(self, **changes)

    @property
    def max_tp(self) -> int:
        return 1 << (len(self.levels) - 1)

    # ---- what the simulator and the controller take ----

    def with_alone(self, alone: "ProfiledCost") -> "ProfiledCost":
        """This profile (measured with every instance busy) with `alone`'s coefficients (the
        same host profiled with concurrent=False) as its idle-neighbours end."""
        if not isinstance(alone, ProfiledCost) or len(alone.levels) != len(self.levels) or \
                alone.model != self.model or alone.capacity != self.capacity:
            raise ProfileError("alone must be a ProfiledCost of the same model, TP levels and "
                               "capacities")
        return self.replace(alone=alone.levels,
                            note=f"{self.note}; alone: {alone.note}" if self.note else alone.note)

    def params(self) -> dict:
        m = self.model
        alone = {} if self.alone is None else {
            f"alone_{name}": [float(c[k]) for c in self.alone] for k, name in enumerate(TERMS)}
        return {**{name: [float(c[k]) for c in self.levels] for k, name in enumerate(TERMS)},
                **alone,
                "transform_slowdown": float(self.transform_slowdown),
                "kv_bytes_per_token": float(self.kv_bytes_per_token),
                "ffn_bytes": float(self.ffn_bytes), "n_layers": int(m.num_hidden_layers),
                "xfer_bw": float(self.xfer_bw),
                "phase_latency_per_layer": float(self.phase_latency_per_layer)}

    def capacities(self, max_tp: int, block_size: int = 16):
        """(capacity, capacity_mid) per TP level up to max_tp, in blocks of block_size tokens
        (the host's; mid = capacity: its merges free no room before they end)."""
        levels = int(math.log2(max_tp)) + 1
        if levels > len(self.levels):
            raise ProfileError(f"max_tp {max_tp}: the profile measured TP up to {self.max_tp}")
        cap = [int(c * self.block_size // block_size) for c in self.capacity[:levels]]
        return cap, list(cap)

    def max_inputs(self, max_tp: int):
        return None   # chunked prefill: only the KV limits a prompt

    def describe(self) -> dict:
        return {"kind": self.kind, "model": f"{self.model.hidden_size}x"
                f"{self.model.num_hidden_layers}",
                "levels": {f"TP{1 << l}": dict(zip(TERMS, c)) for l, c in enumerate(self.levels)},
                "capacity": list(self.capacity), "block_size": self.block_size,
                "xfer_bw": self.xfer_bw, "phase_latency_per_layer": self.phase_latency_per_layer,
                "transform_slowdown": self.transform_slowdown,
                "alone": None if self.alone is None else
                {f"TP{1 << l}": dict(zip(TERMS, c)) for l, c in enumerate(self.alone)},
                "note": self.note}

    # ---- the float64 reference of csrc/policy/cost.c's profiled backend ----

    def step_time(self, tp: int, n_tokens: int, n_seqs: int = 1, n_samples: int = 1,
                  kv_read_tokens: float = 0.0, attn_pairs: float = 0.0,
                  transforming: bool = False, busy_share: float = 0.0) -> float:
        """busy_share: the share of the host's other workers stepping (0..1; read only with
        `alone` coefficients)."""
        if n_tokens <= 0:
            return 0.0
        level = min(max(int(tp), 1).bit_length() - 1, len(self.levels) - 1)

        def of(c):
            return c[0] + c[1] * n_tokens + c[2] * n_samples + c[3] * kv_read_tokens \
                + c[4] * attn_pairs
        t = of(self.levels[level])
        if self.alone is not None:
            alone = of(self.alone[level])
            t = alone + min(max(busy_share, 0.0), 1.0) * (t - alone)
        return t * (1 + self.transform_slowdown) if transforming else t

    def phase_time(self, phase: str, tp_from: int, tp_to: int, kv_tokens: float = 0.0):
        """(seconds, bytes each GPU receives) of one transformation phase."""
        if phase not in PHASES:
            raise ProfileError(f"unknown phase {phase!r}; known: {', '.join(PHASES)}")
        nbytes = _phase_bytes(phase, tp_from, tp_to, kv_tokens, self.kv_bytes_per_token,
                              self.ffn_bytes)
        return (nbytes / self.xfer_bw
                + self.model.num_hidden_layers * self.phase_latency_per_layer), nbytes

    # ---- the fit ----

    def fit_report(self) -> list[dict]:
        """Every grid point: its shape, the measured and the fitted seconds, and the error of
        the fit (fitted / measured - 1)."""
        out = []
        for p in self.points:
            pred = self.step_time(p["tp"], p["n_tokens"], p["n_seqs"], p["n_samples"],
                                  p["kv_read_tokens"], p["attn_pairs"], busy_share=1.0)
            out.append({**p, "fitted": pred, "error": pred / p["seconds"] - 1})
        return out

    @classmethod
    def fit(cls, points, transforms, model, capacity, block_size, kv_bytes_per_token,
            ffn_bytes, note="") -> "ProfiledCost":
        """The model from measured `points` (dicts of POINT_KEYS, every TP level 1, 2, 4, ...
        up to the largest present) and `transforms` (dicts: kind "merge" or "split", tp_from,
        tp_to, kv_tokens, seconds; none: phases cost nothing but the fit's floor)."""
        points = [dict(p) for p in points]
        tps = sorted({int(p["tp"]) for p in points})
        want = [1 << l for l in range(len(tps))]
        if tps != want:
            raise ProfileError(f"the points' TP degrees must be 1, 2, 4, ... without gaps, "
                               f"got {tps}")
        levels = []
        for tp in tps:
            mine = [p for p in points if p["tp"] == tp]
            if len(mine) < len(TERMS):
                raise ProfileError(f"TP{tp} has {len(mine)} grid points; fitting "
                                   f"{len(TERMS)} terms needs at least {len(TERMS)}")
            X = _columns(mine)
            y = np.asarray([p["seconds"] for p in mine], np.float64)
            if not np.all(np.isfinite(y)) or np.any(y <= 0):
                raise ProfileError(f"TP{tp}: measured times must be finite and > 0")
            levels.append(tuple(float(c) for c in _relative_fit(X, y)))
        lat, bw = _fit_phases(transforms, model.num_hidden_layers, kv_bytes_per_token, ffn_bytes)
        return cls(model=model, levels=tuple(levels), capacity=tuple(int(c) for c in capacity),
                   block_size=int(block_size), kv_bytes_per_token=float(kv_bytes_per_token),
                   ffn_bytes=float(ffn_bytes), xfer_bw=bw, phase_latency_per_layer=lat,
                   points=tuple(points), transforms=tuple(dict(t) for t in transforms),
                   note=note or f"profiled from {len(points)} grid points")

    # ---- measuring a host ----

    @classmethod
    def profile(cls, host, grid=None, *, warmup: int = 2, repeats: int = 5,
                max_tp: int | None = None, concurrent: bool = True,
                progress=None) -> "ProfiledCost":
        """Measures `host` (an idle gyges.Host whose instances are all TP1) over `grid`
        ({"batch": decode batch sizes, "context": their context lengths, "prefill": prompt
        lengths}; default DEFAULT_GRID) at TP 1, 2, ... up to max_tp (default the largest the
        host forms), and fits the model (module docstring). The host ends as it began.
        concurrent: every aligned group of the host is a TP-tp instance and runs the grid at
        the same time, each on a thread of its own, as a replay's instances step (on a CPU host
        they share cores and memory bandwidth); False: workers 0..tp-1 only, the rest idle.
        progress: a callable given a line per grid point (or None)."""
        grid = _check_grid(grid, warmup, repeats)
        tps = _check_host(host, max_tp)
        if not isinstance(concurrent, bool):
            raise ProfileError(f"concurrent must be True or False, got {concurrent!r}")
        from .experiment import capacities
        caps = capacities(host, tps[-1])
        levels = {tp: _level_grid(host, grid, cap, warmup, repeats, tp)
                  for tp, cap in zip(tps, caps)}
        cfg = host.model.config
        kv_token = float(host.worker(0).kv.block_bytes * cfg.num_hidden_layers / host.block_size)
        from ..runtime.weights import DTYPES
        ffn = float(3 * cfg.hidden_size * cfg.intermediate_size * cfg.num_hidden_layers
                    * DTYPES[host.worker(0).weights.dtype][1])
        say = progress or (lambda line: None)
        points, transforms = [], []
        alive = {}   # first worker -> requests of its last decode point, still in flight
        n = host.n_workers
        with ThreadPoolExecutor(max_workers=n, thread_name_prefix="gyges-profile") as pool:
            for tp in tps:
                firsts = list(range(0, n - tp + 1, tp)) if concurrent else [0]
                if tp > 1:   # merge each group with the last points' KV in flight
                    for g in firsts:
                        moving = [h for f, hs in alive.items() if g <= f < g + tp for h in hs]
                        transforms.append(_timed_transform(host, g, tp, moving, "merge"))
                    alive = {}
                # the decode point whose KV the next merge or split moves: the last one a
                # TP1 instance holds too (a split brings it back to one)
                keep = [bc for bc in levels[tp]["decode"] if bc in levels[tps[0]]["decode"]][-1] \
                    if len(tps) > 1 else None
                jobs = [pool.submit(_measure_level, host, _instance_at(host, g, tp), tp,
                                    levels[tp], warmup, repeats, keep) for g in firsts]
                done = len(points)
                for g, job in zip(firsts, jobs):
                    mine, alive[g] = job.result()
                    points += mine
                for p in points[done:]:
                    say(f"TP{tp} {p['kind']}: {p['n_tokens']} tokens, "
                        f"{p['seconds'] * 1e3:.2f} ms")
                if tp > 1:   # split back, with the KV in flight, then an idle merge and split
                    for g in firsts:
                        transforms.append(_timed_transform(host, g, 1, alive.pop(g), "split",
                                                           tp_from=tp))
                    transforms.append(_timed_transform(host, 0, tp, [], "merge"))
                    transforms.append(_timed_transform(host, 0, 1, [], "split", tp_from=tp))
        for hs in alive.values():
            for h in hs:
                host.abort(h)
        return cls.fit(points, transforms, cfg, caps, host.block_size, kv_token, ffn,
                       note=f"profiled on {n} CPU workers ({'all' if concurrent else 'one'} "
                            f"busy), {len(points)} grid points, mean of {repeats}")

    # ---- files ----

    def to_dict(self) -> dict:
        return {"kind": self.kind, "model": dataclasses.asdict(self.model),
                **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                   if f.name != "model"}}

    def save(self, path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=1))
        return path

    @classmethod
    def load(cls, path) -> "ProfiledCost":
        try:
            d = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise ProfileError(f"cannot read a profile from {str(path)!r}: {e}") from None
        if not isinstance(d, dict) or d.pop("kind", None) != cls.kind:
            raise ProfileError(f"{str(path)!r} is not a profiled cost model")
        try:
            model = ModelConfig(**d.pop("model"))
            alone = d.pop("alone", None)
            return cls(model=model, levels=tuple(tuple(c) for c in d.pop("levels")),
                       alone=None if alone is None else tuple(tuple(c) for c in alone),
                       capacity=tuple(d.pop("capacity")),
                       points=tuple(d.pop("points", ())),
                       transforms=tuple(d.pop("transforms", ())), **d)
        except (TypeError, KeyError, AttributeError) as e:
            raise ProfileError(f"{str(path)!r}: a bad profile ({e})") from None


def _fit_phases(transforms, n_layers, kv_token, ffn):
    """(latency per layer per phase, bytes/s) by non-negative least squares over the timed
    transformations; with none or no bytes moved, latency only and a nominal rate."""
    rows, y = [], []
    for t in transforms:
        nbytes = sum(_phase_bytes(ph, t["tp_from"], t["tp_to"], t["kv_tokens"], kv_token, ffn)
                     for ph in _PHASES_OF[t["kind"]])
        rows.append([2.0 * n_layers, nbytes])
        y.append(t["seconds"])
    if not rows:
        return 0.0, 1e12
    X, y = np.asarray(rows), np.asarray(y)
    coef = nonneg_lstsq(X, y)
    bw = 1.0 / coef[1] if coef[1] > 0 else 1e12   # no byte cost seen: as good as free
    return float(coef[0]), float(bw)


def _check_grid(grid, warmup, repeats):
    for name, v, low in (("warmup", warmup, 0), ("repeats", repeats, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= 1000:
            raise ProfileError(f"{name} must be an int in [{low}, 1000], got {v!r}")
    grid = dict(DEFAULT_GRID if grid is None else grid)
    if not isinstance(grid, dict) or set(grid) - set(DEFAULT_GRID):
        raise ProfileError(f"grid must be a dict of {', '.join(DEFAULT_GRID)}, got {grid!r}")
    out = {}
    for key in DEFAULT_GRID:
        vals = grid.get(key, ())
        if isinstance(vals, (str, bytes)) or not hasattr(vals, "__iter__"):
            raise ProfileError(f"grid[{key!r}] must be a sequence of ints >= 1, got {vals!r}")
        vals = tuple(vals)
        if any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1
               for v in vals):
            raise ProfileError(f"grid[{key!r}] must be a sequence of ints >= 1, got {vals!r}")
        out[key] = tuple(sorted({int(v) for v in vals}))
    if not out["batch"] or not out["context"] or not out["prefill"]:
        raise ProfileError(f"grid needs decode batch sizes, contexts and prefill lengths, got "
                           f"{grid!r}")
    if len(out["batch"]) * len(out["context"]) + len(out["prefill"]) < len(TERMS):
        raise ProfileError(f"grid {grid!r} has fewer than {len(TERMS)} points per TP: too few to "
                           f"fit {len(TERMS)} terms")
    return out


def _check_host(host, max_tp):
    from ..runtime.host import Host
    if not isinstance(host, Host):
        raise ProfileError(f"host must be a gyges.Host, got {type(host).__name__}")
    if host.closed:
        raise ProfileError("host is closed")
    if host.has_unfinished():
        raise ProfileError("the host serves requests or transforms: profile an idle host")
    if host.replicas is not None or any(inst.stages or inst.tp != 1 for inst in host.instances):
        raise ProfileError(f"profile a host of TP1 instances with sharded weights (it merges "
                           f"them itself), not {host.layout()!r}")
    cfg = host.model.config
    largest = 1   # the largest power of two the host forms and the model's heads divide by
    while largest * 2 <= min(host.max_tp, host.n_workers) and \
            cfg.num_key_value_heads % (largest * 2) == 0 and \
            cfg.num_attention_heads % (largest * 2) == 0:
        largest *= 2
    if max_tp is None:
        max_tp = largest
    elif isinstance(max_tp, bool) or not isinstance(max_tp, int) or max_tp < 1 or \
            max_tp & (max_tp - 1) or max_tp > largest:
        raise ProfileError(f"max_tp must be a power of two <= {largest} on this host, got "
                           f"{max_tp!r}")
    return [1 << l for l in range(max_tp.bit_length())]


def _blocks(tokens, block_size):
    return -(-tokens // block_size)


def _decode_tokens(host, b, c, warmup, repeats):
    """Output tokens each request of a decode point asks for: enough that none finishes in a
    timed step, though the first ones decode while the last ones are still prefilled."""
    return warmup + repeats + 3 + _blocks(b * c, host.max_batch_tokens)


def _level_grid(host, grid, cap, warmup, repeats, tp):
    """The grid points a TP-tp instance holds (a larger point would measure preemptions): the
    prompt lengths, and the (batch, context) decode points. A prompt only a larger TP holds is
    measured there, so that the profile covers the shapes each level serves. Too few points
    left to fit the terms at this level: a ProfileError."""
    bs = host.block_size
    decodes = [(b, c) for b in grid["batch"] for c in grid["context"]
               if b <= host.max_running and
               b * _blocks(c + _decode_tokens(host, b, c, warmup, repeats), bs) <= cap]
    prefills = [p for p in grid["prefill"]
                if _blocks(p + 2, bs) <= cap and p + 2 <= host.worker(0).max_pos]
    if not decodes or not prefills or len(decodes) + len(prefills) < len(TERMS):
        raise ProfileError(f"a TP{tp} instance of this host ({cap} blocks of {bs} tokens, "
                           f"{host.max_running} running requests) holds {len(decodes)} decode "
                           f"and {len(prefills)} prefill points of grid {grid!r}: too few to fit "
                           f"{len(TERMS)} terms")
    return {"decode": decodes, "prefill": prefills}


def _instance_at(host, first, tp):
    for inst in host.instances:
        if min(inst.workers) == first and inst.tp == tp:
            return inst
    raise ProfileError(f"no TP{tp} instance at worker {first} (host layout {host.layout()!r})")


def _submit(host, inst, prompt_len, max_tokens, seed):
    from ..runtime.engine import SamplingParams
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, host.model.config.vocab_size, size=prompt_len).tolist()
    return host.submit(tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                       instance=host.instances.index(inst))


def _timed_step(inst, after):
    """(seconds, batch shape) of one step of inst and `after()`; None as shape when a request
    left in it."""
    before = {rid: (inst.info(rid)["n_computed"], len(h.output_tokens))
              for rid, h in inst.requests.items()}
    start = time.perf_counter()
    inst.step()
    after()
    seconds = time.perf_counter() - start
    entries = []
    for rid, (computed, n_out) in before.items():
        h = inst.requests.get(rid)
        if h is None:
            return seconds, None
        entries.append((computed, inst.info(rid)["n_computed"] - computed,
                        len(h.output_tokens) - n_out))
    return seconds, _shape_of(entries)


def _point(tp, kind, shapes, times):
    """A grid point: the median step's shape and the mean of the times (what a sum of such steps
    costs on average; spread: half the interquartile range, relative to the mean)."""
    if not times:   # pragma: no cover - the grid checks keep requests in every timed step
        raise ProfileError(f"TP{tp} {kind}: no step of a clean shape was measured")
    order = np.argsort(times)
    mid = order[len(order) // 2]
    q1, q3 = np.percentile(times, [25, 75])
    mean = float(np.mean(times))
    return {"tp": tp, "kind": kind, **shapes[mid], "seconds": mean,
            "spread": float((q3 - q1) / 2 / mean)}


def _measure_level(host, inst, tp, level, warmup, repeats, keep):
    """(the points of `level` (_level_grid) on one instance, the requests of its decode point
    `keep` (batch, context), left in flight; None: every point's are aborted). Each timed step
    is what a replay's runner does per step: Instance.step() and the load it reads after it
    (experiment.instance_load)."""
    from .experiment import instance_load
    points, alive = [], []
    seed = 1000 * tp + 100_000 * min(inst.workers)

    def timed():
        return _timed_step(inst, lambda: instance_load(host, inst))
    for p in level["prefill"]:
        chunks = {}
        for r in range(warmup + repeats):
            seed += 1
            h = _submit(host, inst, p, 2, seed)
            k = 0
            while not h.output_tokens:
                seconds, shape = timed()
                if shape is not None and r >= warmup:
                    chunks.setdefault(k, ([], []))
                    chunks[k][0].append(shape)
                    chunks[k][1].append(seconds)
                k += 1
            host.abort(h)
        points += [_point(tp, "prefill", *chunks[k]) for k in sorted(chunks)]
    for b, c in level["decode"]:
        seed += 1
        n_out = _decode_tokens(host, b, c, warmup, repeats)
        hs = [_submit(host, inst, c, n_out, seed * 100 + j) for j in range(b)]
        while any(not h.output_tokens for h in hs):   # prefill (untimed)
            inst.step()
        shapes, times = [], []
        for s in range(warmup + repeats):
            seconds, shape = timed()
            if shape is not None and s >= warmup:
                shapes.append(shape)
                times.append(seconds)
        points.append(_point(tp, "decode", shapes, times))
        if (b, c) == keep:
            alive = hs
        else:
            for h in hs:
                host.abort(h)
    return points, alive


def _timed_transform(host, first, tp, alive, kind, tp_from=1):
    """Merges TP1 workers first..first+tp-1 (tp > 1) or splits the TP-tp_from instance at
    `first` (tp 1) with the `alive` requests' KV in flight, then aborts them; a row of the
    transformation and its wall seconds."""
    size = max(tp, tp_from)
    kv = float(sum(len(h.prompt) + len(h.output_tokens) for h in alive if not h.finished))
    start = time.perf_counter()
    t = host.transform(workers=tuple(range(first, first + size)), tp=tp)
    while not t.done:
        host.step()
    seconds = time.perf_counter() - start
    for h in alive:
        host.abort(h)
    return {"kind": kind, "tp_from": tp_from, "tp_to": tp, "kv_tokens": kv, "seconds": seconds}
