"""The cluster policies (csrc/policy/policy_*.c) and their controller (csrc/cluster/controller.h),
seen from Python: one set of policy names for the simulator and the real host, and the policies
callable on a hand-built view.

    p = Policy("gyges", merge_wait=1.0)
    p.place(View.of([{"gpu_first": 0, "tp": 1, "kv_total": 60}, ...], capacity=[60, 264]),
            prompt=2000, output=32)           # -> Decision("defer", ...)

Both executors run the very same code: gyges.sim drives the controller from C (csrc/sim/sim.c),
gyges.experiment through gyges._C.Controller with the host as its executor.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .. import _C
from ..core.errors import DependencyError, InvalidArgumentError
from .buddy_plan import STRATEGIES

__all__ = ["POLICIES", "Policy", "View", "Decision", "PolicyError", "INST_VIEW_DTYPE",
           "GROUP_DTYPE", "DEFAULTS", "check_policy", "check_number", "smallest_tp"]

# The policies compiled into gyges._C, in their order there, and the knobs' defaults
# (gy_sim_policy_config_default: one place for both executors).
POLICIES = tuple(name.strip() for name in _C.sim_policy_names().split(","))
DEFAULTS = _C.Policy(POLICIES[0]).config


class PolicyError(InvalidArgumentError):
    """A bad policy name, knob or view (the message names the value)."""


def check_policy(name, error=PolicyError) -> str:
    if name not in POLICIES:
        raise error(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
    return name


# gy_sim_inst_view and gy_sim_group (csrc/policy/policy.h), field for field.
INST_VIEW_DTYPE = np.dtype([
    ("gpu_first", "i4"), ("tp", "i4"), ("host", "i4"), ("xform", "i4"), ("placeable", "i4"),
    ("held", "i4"), ("reserved", "i4"), ("max_min_tp", "i4"),
    ("kv_total", "i8"), ("kv_used", "i8"), ("footprint", "i8"), ("max_footprint", "i8"),
    ("n_requests", "i8"), ("n_running", "i8"), ("n_waiting", "i8"),
    ("pending_prefill", "i8"), ("pending_output", "i8"), ("bound", "i4"), ("prefill_only", "i4"),
    ("n_paused", "i8"), ("n_tp_work", "i8"), ("n_priority", "i8"),
    ("n_stages", "i4"), ("layers", "i4", (8,)), ("pad2_", "i4")])  # 8: GY_SIM_MAX_STAGES
GROUP_DTYPE = np.dtype([("gpu_first", "i4"), ("size", "i4"), ("footprint", "i8")])
if INST_VIEW_DTYPE.itemsize != _C.POLICY_INST_VIEW_SIZE or \
        GROUP_DTYPE.itemsize != _C.POLICY_GROUP_SIZE:  # pragma: no cover - a build mismatch
    raise DependencyError("gyges._C's policy view structs do not match gyges/cluster.py's dtypes; "
                      "rebuild the extension (make build)")

# gy_sim_xform, gy_sim_action, gy_sim_op_kind
XFORM_NONE, XFORM_MERGING, XFORM_RESPLITTING, XFORM_EXCHANGING, XFORM_LOST = 0, 1, 6, 8, 10
ACTIONS = {0: "none", 1: "place", 2: "defer", 3: "reject"}
OPS = {0: "merge", 1: "split", 2: "hold", 3: "unhold", 4: "bind", 5: "release", 6: "resplit",
       7: "drop", 8: "restore", 9: "migrate", 10: "park", 11: "unpark"}
PLACE, DEFER = 1, 2  # gy_sim_action
BIND, RELEASE = 4, 5  # gy_sim_op_kind of a replicated cluster
RESPLIT = 6  # gy_sim_op_kind of a pipeline cluster
DROP, RESTORE = 7, 8  # buddy clusters (KunServe)
MIGRATE = 9  # a running request moves with its KV (Llumnix; a cluster's executor)
PARK, UNPARK = 10, 11  # an instance serves prompts only, its prefilled KV in host memory (Seesaw)


@dataclass
class View:
    """What a policy sees of a cluster (gy_sim_view): instances in GPU order (INST_VIEW_DTYPE),
    KV blocks of a fresh instance per TP level (TP 1, 2, 4, ... up to max_tp), and the groups
    deferred requests wait for (GROUP_DTYPE). gpu_inst is derived."""
    inst: np.ndarray
    capacity: np.ndarray
    n_gpus: int
    gpus_per_host: int | None = None
    max_tp: int | None = None
    block_size: int = 16
    watermark: float = 0.0
    now: float = 0.0
    pending: np.ndarray = field(default_factory=lambda: np.zeros(0, GROUP_DTYPE))
    replicated: bool = False  # Flying Serving's cluster: bind / release (csrc/policy/policy.h)
    base_tp: int = 1          # replicated: the TP of an unbound instance

    @classmethod
    def of(cls, instances, capacity, n_gpus=None, **kwargs) -> "View":
        """A view from dicts: [{"gpu_first": 0, "tp": 1, "kv_total": 60, ...}, ...] (missing
        fields are 0; placeable defaults to 1), e.g. for trying a policy by hand."""
        inst = np.zeros(len(instances), INST_VIEW_DTYPE)
        for row, spec in zip(inst, instances):
            unknown = set(spec) - set(INST_VIEW_DTYPE.names)
            if unknown:
                raise PolicyError(f"unknown instance field(s) {sorted(unknown)}; known: "
                                      f"{', '.join(INST_VIEW_DTYPE.names)}")
            row["placeable"] = 1
            for k, v in spec.items():
                row[k] = v
        inst = inst[np.argsort(inst["gpu_first"], kind="stable")]
        if n_gpus is None:
            n_gpus = int((inst["gpu_first"] + inst["tp"]).max()) if inst.size else 0
        pending = kwargs.pop("pending", None)
        pend = np.zeros(len(pending or ()), GROUP_DTYPE)
        for row, g in zip(pend, pending or ()):
            row["gpu_first"], row["size"] = g[0], g[1]
            row["footprint"] = g[2] if len(g) > 2 else 0
        return cls(inst=inst, capacity=np.asarray(capacity, np.int64), n_gpus=n_gpus,
                   pending=pend, **kwargs)

    def gpu_inst(self) -> np.ndarray:
        out = np.full(self.n_gpus, -1, np.int32)
        for k, row in enumerate(self.inst):
            out[row["gpu_first"]:row["gpu_first"] + row["tp"]] = k
        return out

    def as_tuple(self):
        gph = self.gpus_per_host or self.n_gpus
        max_tp = self.max_tp or gph
        return (float(self.now), int(self.n_gpus), int(gph), int(max_tp), int(self.block_size),
                float(self.watermark), np.ascontiguousarray(self.inst, INST_VIEW_DTYPE),
                self.gpu_inst(), np.ascontiguousarray(self.capacity, np.int64),
                np.ascontiguousarray(self.pending, GROUP_DTYPE), int(bool(self.replicated)),
                int(self.base_tp))


@dataclass(frozen=True)
class Decision:
    """action: 'place', 'defer', 'reject' (or 'none' from rebalance); target: the index into
    view.inst (place); group: (first GPU, size) the request waits for (defer; size 0: none);
    ops: [('merge' | 'split' | 'hold' | 'unhold' | 'bind' | 'release', first GPU, size), ...]
    in order; tp_work: a placement as TP work (flying: recomputed at its group's bind)."""
    action: str
    target: int
    group: tuple
    ops: tuple
    tp_work: bool = False


class Policy:
    """A cluster policy of the simulator with its per-run state (round_robin keeps a cursor):

        p = Policy("gyges", merge_wait=1.0)
        p.place(view, prompt=2000, output=32)     # -> Decision
        p.rebalance(view)

    The configuration is gy_sim_policy_config (see gyges.sim.run for each knob); a knob left
    None takes the C default (DEFAULTS)."""

    def __init__(self, name="gyges", decode_weight=None, scale_down_free=None, scale_up_cap=None,
                 merge_wait=None, scale_up_load=None, eager_scale_up=None, flying_tp=None,
                 light_load=None, buddy_strategy=None, restore_wait=None, idle_load=None,
                 sp_min_prompt=None, decode_tp=None, prefill_tp=None):
        check_policy(name)
        knobs = dict(DEFAULTS)
        for key, v, high in (("decode_weight", decode_weight, None),
                             ("scale_down_free", scale_down_free, 1.0),
                             ("scale_up_cap", scale_up_cap, None),
                             ("merge_wait", merge_wait, None),
                             ("scale_up_load", scale_up_load, None),
                             ("light_load", light_load, None),
                             ("idle_load", idle_load, None),
                             ("restore_wait", restore_wait, None),
                             ("sp_min_prompt", sp_min_prompt, None)):
            if v is not None:
                knobs[key] = check_number(key, v, 0.0, high)
        if eager_scale_up is not None:
            knobs["eager_scale_up"] = bool(eager_scale_up)
        if buddy_strategy is not None:
            if buddy_strategy not in STRATEGIES:
                raise InvalidArgumentError(f"buddy_strategy must be one of "
                                           f"{', '.join(STRATEGIES)}, got {buddy_strategy!r}")
            knobs["buddy_strategy"] = STRATEGIES[buddy_strategy]
        if flying_tp is not None:
            knobs["flying_tp"] = int(check_number("flying_tp", flying_tp, 0.0, 1 << 20))
        for key, tp in (("decode_tp", decode_tp), ("prefill_tp", prefill_tp)):
            if tp is None:
                continue
            if isinstance(tp, bool) or not isinstance(tp, (int, np.integer)) or \
                    not 0 <= tp <= 1 << 20 or tp & (tp - 1):
                raise PolicyError(f"{key} must be 0 or a power of two, got {tp!r}")
            knobs[key] = int(tp)
        self.name = name
        self._c = _C.Policy(name, **knobs)

    @property
    def handle(self):
        """The C policy (gyges._C.Policy) a controller runs."""
        return self._c

    @property
    def config(self) -> dict:
        return self._c.config

    @property
    def rebalances(self) -> bool:
        """Whether the policy transforms on its own (static: no)."""
        return self._c.rebalances

    @property
    def monitors(self) -> bool:
        """Whether it also rebalances at every tick, watching the load (gyges' latency mode,
        kunserve): an executor ticks it even when no request waits."""
        return self._c.monitors

    def place(self, view: View, prompt: int, output: int, footprint: int | None = None,
              min_tp: int | None = None, deferred: bool = False, group=(0, 0),
              arrival: float = 0.0, request_id: int = 0, priority: int = 0) -> Decision:
        """Where a request of `prompt` + `output` tokens goes. footprint (KV blocks at its end)
        and min_tp (the smallest TP whose fresh instance holds it, 0: none) are derived from the
        view when not given."""
        for key, v, low in (("prompt", prompt, 1), ("output", output, 0)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < low:
                raise PolicyError(f"{key} must be an int >= {low}, got {v!r}")
        if footprint is None:
            footprint = -(-(int(prompt) + int(output)) // view.block_size)
        if min_tp is None:
            min_tp = smallest_tp(footprint, view.capacity)
        req = (int(request_id), int(prompt), int(output), int(footprint), int(min_tp),
               int(bool(deferred)), int(group[0]), int(group[1]), float(arrival), int(priority))
        return _decision(self._c.place(view.as_tuple(), req))

    def rebalance(self, view: View) -> Decision:
        return _decision(self._c.rebalance(view.as_tuple()))

    def __repr__(self):
        return f"Policy({self.name!r}, {self.config})"


def _decision(raw) -> Decision:
    action, target, group, ops, tp_work = raw
    return Decision(ACTIONS[action], target, (group[0], group[1]),
                    tuple((OPS[op[0]], *op[1:]) for op in ops), bool(tp_work))


def smallest_tp(footprint, capacity, tokens=None, max_pos=None):
    if max_pos is not None and tokens is not None and tokens > max_pos:
        return 0
    for level, blocks in enumerate(capacity):
        if footprint <= blocks:
            return 1 << level
    return 0


def check_number(name, v, low, high=None, low_open=False, error=PolicyError):
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) \
            or not math.isfinite(v) or v < low or (low_open and v == low) \
            or (high is not None and v >= high):
        raise error(f"{name} must be a finite number {'>' if low_open else '>='} {low}"
                    f"{'' if high is None else f' and < {high}'}, got {v!r}")
    return float(v)
