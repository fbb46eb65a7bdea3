"""The paper-scale simulator: a cluster of hosts x GPUs whose instances change tensor parallelism
while they serve (Gyges), driven by a request trace.

    res = gyges.sim.run(trace, policy="gyges", hosts=1, gpus_per_host=8,
                        model="qwen2.5-32b", gpu="h20")
    res.summary()                     # gyges.metrics.summarize + rejected, transformations
    res = gyges.sim.run(trace, policy="static", layout="4xTP1+1xTP4")

Every instance runs the real C batch scheduler (csrc/sched/batch.h) with a block counter as its
KV cache; a cost model (gyges.costmodel) prices each step and each transformation phase; a
cluster policy (csrc/policy/policy_*.c) places requests and starts scale-ups and scale-downs. The
event loop is C (csrc/sim/sim.c); this module checks arguments, builds the parameters, runs the
loop in chunks (a progress line for long runs) and wraps the results (gyges.results).

Policies: "gyges" (Gyges Algorithms 1-2 with AMOEBAs 3.3), "round_robin" and "least_load" (the
baselines of Gyges 6.2.4; eager_scale_up=False makes them scale up only when no instance can
hold a request), "static" (a fixed `layout`, never transforms; requests that fit no instance
are rejected), "flying" (Flying Serving, weights="replicated"), "loongserve" (LoongServe's
elastic sequence parallelism, weights="replicated": the layout's instances are its elastic
instances, and groups of them serve as sequence-parallel instances), "pipelive" (pipelines
re-split as the prefill/decode mix shifts, csrc/policy/policy_pipelive.c), "seesaw" (Seesaw's
re-sharding: each unit of decode_tp GPUs, searched, prefills as TP1 instances that park the KV
in host memory, then merges to decode as one instance, then splits back; with reshard="seesaw"
its transitions go through host memory, csrc/policy/policy_seesaw.c). Layouts: "8xTP1", "2xTP4",
"4xTP1+1xTP4", ... for ONE host, in GPU order; every host starts with it (the dynamic policies
default to all TP1).

Pipelines (PipeLive): a layout that is one pipeline, "PP2" or "PP[60,20]" (layers per stage),
with `gpus` naming each stage's GPU, makes every host that pipeline, one GPU a stage:

    res = gyges.sim.run(trace, policy="pipelive", layout="PP[60,20]",
                        gpus=["a100-80gb", "l40s"], model="llama3-70b")
    res = gyges.sim.run(trace, policy="static", layout="PP[44,36]", cost=PipelineCost(...))

Its cost model is gyges.costmodel.PipelineCost (cost=, or built from model and gpus); "static"
keeps the split, "pipelive" re-splits it; kv_resize=False keeps kv_blocks blocks at every split
(PipeLive without KV resizing). Mixing pipelines and TP groups in one layout is not simulated.

Buddy clusters (KunServe): weights="buddy" makes every GPU a whole replica of the model that
can drop parameters into a buddy group (a pipeline of g of its host's GPUs over one copy of the
layers) and restore them, priced by a PipelineCost of gpus_per_host identical stages (its link
is the link between the instances: RDMA_200G for KunServe's testbed):

    cost = PipelineCost.create("qwen2.5-14b", ["a800-80gb"] * 8, link_bw=RDMA_200G)
    res = gyges.sim.run(trace, policy="kunserve", weights="buddy", cost=cost)
    res = gyges.sim.run(trace, policy="least_load", weights="buddy", cost=cost)  # replication
    res = gyges.sim.run(trace, policy="least_load", weights="buddy", cost=cost,
                        buddy_group=2)                          # static pipelines of 2 GPUs

policy="llumnix" on a buddy cluster is KunServe's migration baseline: least-load placement and
live migrations (over the link) from the replica whose KV demand is highest to the lowest.
live_restore=False: a restoring group, its weights back, finishes its requests as a pipeline
(taking no new ones) before it dissolves (KunServe Fig. 15's baseline); buddy_strategy "throughput"
(Algorithm 1) or "memory"; restore_wait: seconds of fitting demand before a restore.
"""

from __future__ import annotations

import math
import time

import numpy as np

from . import traces
from .. import _C
from ..runtime import layout as layout_mod
from .policy import POLICIES, Policy, check_number, check_policy  # one set for both executors
from .costmodel import RESHARDS, ConstantCost, CostModel, CostModelError, PipelineCost
from .profile import ProfiledCost
from . import links, mechanisms, seesaw_search
from .costmodel import gpu_spec as costmodel_gpu
from ..core.errors import InvalidArgumentError
from ..core.logs import progress as progress_bar
from .results import Results

__all__ = ["run", "parse_layout", "POLICIES", "SimError"]


class SimError(InvalidArgumentError):
    """A bad simulator argument (the message names the value)."""


def parse_layout(layout: str, gpus_per_host: int) -> list[int]:
    """"4xTP1+1xTP4" -> [1, 1, 1, 1, 4]: the TP of each instance of one host, in GPU order
    (gyges.layout's grammar; the simulator runs aligned TP groups of power-of-two sizes)."""
    tps = layout_mod.tp_sizes(layout, gpus_per_host, error=SimError)
    if len(tps) > 64:
        raise SimError(f"bad layout {layout!r}: more than 64 instances per host")
    return tps


def _check_int(name, v, low, high=None):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < low \
            or (high is not None and v > high):
        rng = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise SimError(f"{name} must be an int {rng}, got {v!r}")
    return int(v)


def _check_float(name, v, low, high=None, low_open=False):
    return check_number(name, v, low, high, low_open, SimError)


def _scheduler_args(block_size, max_batch_tokens, max_running, max_prefill_chunk, watermark):
    """The scheduler's settings, checked: keyword arguments of _C.Simulator and of the config."""
    return {"block_size": _check_int("block_size", block_size, 1, 1 << 20),
            "max_batch_tokens": _check_int("max_batch_tokens", max_batch_tokens, 1),
            "max_running": _check_int("max_running", max_running, 1, 1 << 20),
            "max_prefill_chunk": _check_int("max_prefill_chunk", max_prefill_chunk, 0),
            "watermark": _check_float("watermark", watermark, 0.0, 1.0)}


def _trace_args(trace):
    """(requests, span in seconds, the trace's arrays as _C.Simulator takes them)."""
    n = trace.shape[0]
    arrival = np.ascontiguousarray(trace["arrival"], dtype=np.float64)
    return n, float(arrival[-1] - arrival[0]) if n else 0.0, {
        "arrival": arrival,
        "input_tokens": np.ascontiguousarray(trace["input_tokens"], dtype=np.int64),
        "output_tokens": np.ascontiguousarray(trace["output_tokens"], dtype=np.int64),
        "priority": np.ascontiguousarray(trace["priority"], dtype=np.int32)}


def _sample_interval(span, sample_interval):
    """Seconds between samples: as given, or about 1/10,000 of the trace's span (at least 1 s)."""
    if sample_interval is None:
        sample_interval = max(1.0, span / 10_000)
    return _check_float("sample_interval", sample_interval, 0.0, low_open=True)


def run(trace, policy: str = "gyges", hosts: int = 1, gpus_per_host: int | None = None,
        model="qwen2.5-32b", gpu="h20", layout: str | None = None, slo: dict | None = None,
        progress: bool = False, *, cost=None, max_tp: int | None = None, block_size: int = 16,
        max_batch_tokens: int = 2048, max_running: int = 256, max_prefill_chunk: int = 0,
        watermark: float = 0.01, decode_weight: float | None = None,
        scale_down_free: float | None = None, scale_up_load: float | None = None,
        scale_up_cap: float | None = None, merge_wait: float | None = None,
        eager_scale_up: bool | None = None, weights: str = "sharded",
        switch_time: float | None = None, flying_tp: int | None = None,
        light_load: float | None = None, idle_load: float | None = None,
        sample_interval: float | None = None,
        record_tokens: bool = False, check: bool = False, gpus=None, kv_resize: bool = True,
        kv_blocks: int | None = None, buddy_group: int = 1, live_restore: bool = True,
        buddy_strategy: str | None = None, restore_wait: float | None = None,
        swap_bw: float | None = None, sp_min_prompt: float | None = None,
        reshard: str = "gyges", decode_tp: int | None = None,
        prefill_tp: int | None = None, prefill_pp: bool | None = None) -> Results:
    """Simulate `trace` (a gyges.traces array) on `hosts` x `gpus_per_host` GPUs.

    cost: a gyges.costmodel.CostModel or ConstantCost, or a gyges.cluster.profile.ProfiledCost
    (measured on a real host); default CostModel.create(model, gpu) (the calibrated roofline).
    max_tp: the largest TP (default gpus_per_host). The scheduler of every
    instance gets block_size, max_batch_tokens, max_running, max_prefill_chunk and watermark (a
    fraction of its blocks). decode_weight: the policies' load is (pending prompt tokens +
    decode_weight * pending output tokens) / TP. scale_down_free: gyges splits a held instance
    once this fraction of its KV is free; scale_up_load: gyges starts another scale-up for a long
    request rather than queue it on a capable instance whose load exceeds the new group's by
    more than this (tokens per GPU) and the cluster keeps at most scale_up_cap of its GPUs at
    TP > 1; merge_wait: seconds gyges lets a reserved group drain before merging it anyway (0:
    at once). eager_scale_up: the baselines scale up the instance their rule picks when it
    cannot hold the request (False: only when no instance can). weights="replicated" is Flying
    Serving's cluster: every GPU keeps the model (or the smallest TP that fits keeps one copy
    per group), a TP-k group binds the replicas (policy "flying", or "static" for a fixed
    layout) in switch_time seconds moving nothing (default: gyges.cluster.mechanisms.flying_switch
    of the cost model, the smallest TP it fits to max_tp; 0 for a ConstantCost), then the
    members' steps in flight, and its KV is the members' pooled KV. Policy "loongserve" on it is
    LoongServe's elastic sequence parallelism: a bound group is sequence parallel (the cost
    model priced with sequence_parallel = the elastic instances' TP; every request keeps its KV
    through a scale-up and a scale-down; switch_time default mechanisms.loongserve_scale), and a
    prompt of sp_min_prompt tokens or more may take a larger group than its KV needs, for speed
    (policy_loongserve.c). flying_tp: the group size priority and light-load requests bind (0:
    gpus_per_host / 2); light_load: outstanding work per GPU (tokens, as the policies count
    load) under which arrivals go to TP groups (flying), or under which gyges keeps a base TP
    of 2, and idle_load the same for a base TP of 4 (gyges' latency mode, policy_gyges.c; 0
    turns either off). The policy knobs left None take
    gyges.cluster.DEFAULTS. sample_interval: seconds between time-series samples
    (default: about 10,000 over the trace). record_tokens: keep every token's time (ITL, exact
    throughput series; memory grows with the output). check: verify the simulator's invariants
    after every chunk (tests). slo: kept for Results.summary (goodput). swap_bw: bytes/s per
    GPU (PCIe) at which a preempted request's KV goes to host memory and comes back instead of
    being computed again (vLLM's swap preemption, KunServe's KV-swap baseline); None recomputes.
    reshard: how a sharded cluster's merges and splits move their bytes: "gyges" (GPU to GPU,
    the instances serving throughout) or "seesaw" (Seesaw's re-sharding, the baseline of Gyges
    Figure 11: the KV through host memory over PCIe and the FFN shards from the host copy,
    priced by the cost model (CostModel.reshard), the instances serving nothing until it is
    over); the same policy decides either way. decode_tp: the TP of Seesaw's decode phase
    (policy "seesaw"; 0: max_tp); None searches it as Seesaw does, from the cost model and the
    trace (gyges.cluster.seesaw_search); its prefill phases park each prefilled request's KV in
    host memory (Seesaw's tiered KV buffer, GY_SIM_OP_PARK) over swap_bw, which defaults to the
    GPU's host link (PCIe) for this policy (and then prices its preemptions' swaps too).
    prefill_tp: the TP of Seesaw's prefill instances, at least the smallest that holds the
    weights (0: that one); None searches it (seesaw_search.prefill_tp: so that few requests need
    more). prefill_pp: whether those instances, where they have more than one GPU (base), are
    base-stage pipelines (Seesaw's PP prefill: CostModel.pipeline_degree = base, re-sharded to
    and from the TP decode instances' layout); None searches it (seesaw_search.prefill_pp).
    Policy "seesaw" with a CostModel only.

    Pipelines: layout "PPn" or "PP[a,b,...]" (one pipeline per host, gpus_per_host its stages),
    gpus the stage GPUs (preset names, in stage order; taken from cost when it is a
    PipelineCost), cost a PipelineCost (default PipelineCost.create(model, gpus)); kv_resize
    False keeps kv_blocks KV blocks (default: the first split's) at every split, and a re-split
    whose intermediate budget falls below them is refused.
    """
    t_wall = time.perf_counter()
    traces.validate(trace)
    check_policy(policy, SimError)
    hosts = _check_int("hosts", hosts, 1, 4096)
    if reshard not in RESHARDS:
        raise SimError(f"reshard must be one of {', '.join(RESHARDS)}, got {reshard!r}")
    if reshard != "gyges" and (weights == "buddy" or (isinstance(layout, str) and
                                                      "pp" in layout.lower())):
        raise SimError(f"reshard={reshard!r} re-shards the TP groups of a sharded cluster, not "
                       f"pipelines or buddy groups")
    if prefill_pp is not None and (policy != "seesaw" or not isinstance(prefill_pp, bool)):
        raise SimError(f"prefill_pp (Seesaw's pipelined prefill, True or False) is for policy "
                       f"'seesaw', got {prefill_pp!r} with policy {policy!r}")
    if weights == "buddy":
        return _run_buddy(**{k: v for k, v in locals().items()
                             if k not in ("t_wall", "reshard", "decode_tp", "prefill_tp",
                                       "prefill_pp")},
                          t_wall=t_wall)
    if policy in ("kunserve", "llumnix"):
        what = "drops replicated parameters" if policy == "kunserve" else \
            "migrates requests between replicas"
        raise SimError(f"policy {policy!r} {what}: use weights='buddy'")
    if isinstance(layout, str) and "pp" in layout.lower():
        if (buddy_group, live_restore, buddy_strategy, restore_wait) != (1, True, None, None):
            raise SimError("buddy_group, live_restore, buddy_strategy and restore_wait are for "
                           "weights='buddy'")
        return _run_pipeline(**{k: v for k, v in locals().items()
                                if k not in ("t_wall", "buddy_group", "live_restore",
                                             "buddy_strategy", "restore_wait", "sp_min_prompt",
                                             "reshard", "decode_tp", "prefill_tp",
                                             "prefill_pp")},
                             t_wall=t_wall)
    if gpus is not None or isinstance(cost, PipelineCost):
        raise SimError("gpus and a PipelineCost are for pipeline layouts ('PP2', 'PP[60,20]')")
    gpus_per_host = _check_int("gpus_per_host", 8 if gpus_per_host is None else gpus_per_host,
                               1, 128)
    if gpus_per_host & (gpus_per_host - 1):
        raise SimError(f"gpus_per_host must be a power of two (aligned TP groups), got "
                       f"{gpus_per_host}")
    max_tp = gpus_per_host if max_tp is None else _check_int("max_tp", max_tp, 1, gpus_per_host)
    if max_tp & (max_tp - 1):
        raise SimError(f"max_tp must be a power of two, got {max_tp}")
    sched = _scheduler_args(block_size, max_batch_tokens, max_running, max_prefill_chunk,
                            watermark)
    block_size = sched["block_size"]
    knobs = Policy(policy, decode_weight=decode_weight, scale_down_free=scale_down_free,
                   scale_up_load=scale_up_load, scale_up_cap=scale_up_cap, merge_wait=merge_wait,
                   eager_scale_up=eager_scale_up, flying_tp=flying_tp,
                   light_load=light_load, idle_load=idle_load,
                   sp_min_prompt=sp_min_prompt, decode_tp=decode_tp,
                   prefill_tp=prefill_tp).config  # checked
    if weights not in ("sharded", "replicated"):
        raise SimError(f"weights must be 'sharded' or 'replicated', got {weights!r}")
    replicated = weights == "replicated"
    if switch_time is not None:
        switch_time = _check_float("switch_time", switch_time, 0.0)
    if replicated and policy not in ("flying", "loongserve", "static"):
        raise SimError(f"policy {policy!r} transforms by moving shards; a replicated cluster "
                       f"switches with policy 'flying' or 'loongserve' (or stays put with "
                       f"'static')")
    if policy in ("flying", "loongserve") and not replicated:
        raise SimError(f"policy {policy!r} binds replicas: use weights='replicated'")
    sequence_parallel = policy == "loongserve"

    if layout is None and policy == "static":
        raise SimError("policy 'static' needs a layout, e.g. layout='8xTP1' or '4xTP1+1xTP4'")

    if cost is None:
        try:
            cost = CostModel.create(model, gpu)
        except CostModelError as e:
            raise SimError(str(e)) from None
    elif not isinstance(cost, (CostModel, ProfiledCost, ConstantCost)):
        raise SimError(f"cost must be a CostModel, ProfiledCost or ConstantCost, got "
                       f"{type(cost).__name__}")
    if reshard == "seesaw":
        if replicated:
            raise SimError("reshard='seesaw' moves shards: a replicated cluster binds instead")
        if not isinstance(cost, CostModel):
            raise SimError("reshard='seesaw' prices its host-memory round trip with the roofline "
                           "cost model: give a CostModel")
        cost = cost.replace(reshard="seesaw")
    if sequence_parallel:
        if not isinstance(cost, CostModel):
            raise SimError("policy 'loongserve' prices sequence-parallel groups with the roofline "
                           "cost model: give a CostModel")
    if policy == "seesaw" and decode_tp is None:   # Seesaw's offline search
        knobs["decode_tp"] = seesaw_search.decode_tp(cost, trace, max_tp, block_size,
                                                     sched["max_running"])[0]
    if policy == "seesaw" and prefill_tp is None:
        knobs["prefill_tp"] = seesaw_search.prefill_tp(cost, trace, max_tp, block_size)[0]
    if prefill_pp is not None and not isinstance(cost, CostModel):
        raise SimError(f"prefill_pp prices pipelines with the roofline cost model: give a "
                       f"CostModel, not a {type(cost).__name__}")
    if policy == "seesaw" and swap_bw is None and isinstance(cost, CostModel):
        swap_bw = links.host_link(cost.gpu).bw   # its tiered KV buffer, over PCIe
    capacity, capacity_mid = cost.capacities(max_tp, block_size)
    max_input = cost.max_inputs(max_tp)
    # A large model may fit only from some TP on (Qwen2.5-32B on an H100: TP2): smaller
    # instances cannot exist (capacity 0), and the layout and every split stay at or above it.
    capacity = [max(int(b), 0) for b in capacity]
    fits = [level for level, blocks in enumerate(capacity) if blocks >= 1]
    name = getattr(getattr(cost, "gpu", None), "name", "this GPU")
    if not fits:
        raise SimError(f"the model fits no instance up to TP{max_tp} on {name} (no KV room left "
                       f"after its weights); raise max_tp or gpus_per_host")
    min_tp = 1 << fits[0]
    capacity_mid = [max(int(m), c) if c >= 1 else 0 for m, c in zip(capacity_mid, capacity)]
    # the default layout's instances: Seesaw's prefill instances (prefill_tp), else the smallest
    start_tp = max(min_tp, min(knobs["prefill_tp"], max_tp)) if policy == "seesaw" else min_tp
    if policy == "seesaw":
        knobs["prefill_tp"] = start_tp
    if policy == "seesaw" and isinstance(cost, CostModel):
        if prefill_pp is None:   # Seesaw's search of its prefill parallelism
            unit = knobs["decode_tp"] or max_tp
            prefill_pp = seesaw_search.prefill_pp(cost, trace, start_tp, unit,
                                                  sched["max_batch_tokens"],
                                                  sched["max_running"])[0]
        prefill_pp = bool(prefill_pp) and start_tp > 1   # (a TP1 instance is a 1-stage one)
        if prefill_pp:
            cost = cost.replace(pipeline_degree=start_tp)
    if replicated:
        # a bound TP-2^l group pools its members' KV: each keeps the smallest TP's copy (for
        # LoongServe, the copy of the layout's smallest instances: its elastic instances)
        base = fits[0]
        if sequence_parallel and layout is not None:
            base = max(base, min(parse_layout(layout, gpus_per_host)).bit_length() - 1)
        min_tp = start_tp = 1 << base
        if sequence_parallel:   # groups of them are priced as sequence parallel
            cost = cost.replace(sequence_parallel=min_tp)
        capacity = [capacity[base] << (level - base) if level >= base else 0
                    for level in range(len(capacity))]
        capacity_mid = list(capacity)
        if max_input is not None:
            max_input = [max_input[base] << (level - base) if level >= base else max_input[level]
                         for level in range(len(max_input))]
    if switch_time is None:
        scale = mechanisms.loongserve_scale if sequence_parallel else mechanisms.flying_switch
        switch_time = scale(cost, min_tp, max_tp).seconds \
            if isinstance(cost, CostModel) and max_tp > min_tp else 0.0
    if layout is None:
        layout = f"{gpus_per_host // start_tp}xTP{start_tp}"
    tps = parse_layout(layout, gpus_per_host)
    if max(tps) > max_tp:
        raise SimError(f"layout {layout!r} has a TP{max(tps)} instance but max_tp is {max_tp}")
    if min(tps) < min_tp:
        raise SimError(f"layout {layout!r} has a TP{min(tps)} instance, but the model fits no "
                       f"instance below TP{min_tp} on {name}")

    n, span, arrays = _trace_args(trace)
    sample_interval = _sample_interval(span, sample_interval)

    sim = _C.Simulator(
        hosts=hosts, gpus_per_host=gpus_per_host, max_tp=max_tp, layout=tps,
        capacity=capacity, capacity_mid=capacity_mid, **sched, cost_kind=cost.kind,
        cost_params=cost.params(), policy=policy, **knobs,
        sample_interval=sample_interval, record_tokens=bool(record_tokens), **arrays,
        max_input=max_input, replicated=replicated, switch_time=switch_time,
        sequence_parallel=sequence_parallel, stop_transforming=reshard == "seesaw",
        **_kv_args(cost, swap_bw))

    start = float(arrays["arrival"][0]) if n else 0.0
    return _drive(sim, policy, n, start, span, check, progress, t_wall, slo, {
              "policy": policy, "hosts": hosts, "gpus_per_host": gpus_per_host,
              "max_tp": max_tp, "layout": layout, "cost": cost.describe(),
              "capacity_blocks": capacity, "capacity_mid_blocks": capacity_mid,
              "max_input_tokens": max_input,
              **sched, **knobs, "weights": weights,
              "switch_time": switch_time, "reshard": reshard, "prefill_pp": prefill_pp,
              "sample_interval": sample_interval, "record_tokens": bool(record_tokens),
              "swap_bw": swap_bw})


def _drive(sim, policy, n, start, span, check, progress, t_wall, slo, config) -> Results:
    """Runs the simulator in chunks (a progress bar of requests done when `progress`) and
    wraps the results."""
    chunk = max(span / 100, 1.0)
    until = start
    with progress_bar(enabled=bool(progress), total=n, unit="req", desc=f"sim {policy}") as bar:
        while True:
            until += chunk
            done = sim.run(until if until < start + span else math.inf)
            if check:
                sim.check()
            if progress:
                st = sim.stats()
                bar.update(st["finished"] + st["rejected"] - bar.n)
                bar.set_postfix_str(f"{min(st['now'] - start, span):.0f}/{span:.0f} s simulated")
            if done:
                break
    return Results.from_simulator(sim, config, slo=slo,
                                  wall_seconds=time.perf_counter() - t_wall)


def _kv_args(cost, swap_bw=None, migrate_bw=0.0) -> dict:
    """_C.Simulator's swap_bw, migrate_bw and kv_token_bytes (a token's KV over every layer, from
    the cost model; a ConstantCost has no KV size, so it cannot price a swap)."""
    if swap_bw is None and not migrate_bw:
        return {}
    if swap_bw is not None:
        swap_bw = check_number("swap_bw", swap_bw, 0.0, low_open=True, error=SimError)
    if isinstance(cost, PipelineCost):
        token = cost.kv_layer * cost.n_layers
    elif isinstance(cost, CostModel):
        token = float(cost.model.kv_bytes_per_token(cost.dtype_bytes, 1))
    elif isinstance(cost, ProfiledCost):
        token = cost.kv_bytes_per_token
    else:
        raise SimError("swap_bw prices KV bytes: give a CostModel or PipelineCost, not "
                       f"{type(cost).__name__}")
    return {"swap_bw": float(swap_bw or 0.0), "kv_token_bytes": float(token),
            "migrate_bw": float(migrate_bw)}


def _run_pipeline(trace, policy, hosts, gpus_per_host, model, gpu, layout, slo, progress, cost,
                  max_tp, block_size, max_batch_tokens, max_running, max_prefill_chunk,
                  watermark, decode_weight, scale_down_free, scale_up_load, scale_up_cap,
                  merge_wait, eager_scale_up, weights, switch_time, flying_tp, light_load,
                  idle_load, sample_interval, record_tokens, check, gpus, kv_resize, kv_blocks,
                  swap_bw, t_wall) -> Results:
    """run() for a pipeline layout (the module docstring): one pipeline per host."""
    if policy not in ("static", "pipelive"):
        raise SimError(f"a pipeline layout runs with policy 'static' or 'pipelive', not "
                       f"{policy!r}")
    if weights != "sharded" or (max_tp not in (None, 1)):
        raise SimError("pipelines keep their layers' weights (weights='sharded') and no TP "
                       "(max_tp 1)")
    if cost is None:
        if gpus is None:
            raise SimError(f"layout {layout!r} is a pipeline: name each stage's GPU, e.g. "
                           f"gpus=['a100-80gb', 'l40s']")
        try:
            cost = PipelineCost.create(model, gpus)
        except CostModelError as e:
            raise SimError(str(e)) from None
    elif not isinstance(cost, PipelineCost):
        raise SimError(f"a pipeline layout needs a PipelineCost, got {type(cost).__name__}")
    elif gpus is not None:
        try:
            named = tuple(costmodel_gpu(g) for g in gpus)
        except CostModelError as e:
            raise SimError(str(e)) from None
        if named != cost.gpus:
            raise SimError(f"gpus {list(gpus)} are not the PipelineCost's "
                           f"{[g.name for g in cost.gpus]}")
    groups = layout_mod.parse(layout, cost.n_stages, cost.n_layers, error=SimError, unit="GPUs")
    if len(groups) != 1 or groups[0].stages is None:
        raise SimError(f"layout {layout!r}: a pipeline cluster has one pipeline per host over "
                       f"its {cost.n_stages} stage GPUs, nothing else")
    split = tuple(groups[0].stages)
    if gpus_per_host not in (None, cost.n_stages):
        raise SimError(f"gpus_per_host {gpus_per_host}: a pipeline host has its "
                       f"{cost.n_stages} stages")
    sched = _scheduler_args(block_size, max_batch_tokens, max_running, max_prefill_chunk,
                            watermark)
    block_size = sched["block_size"]
    knobs = Policy(policy, decode_weight=decode_weight).config
    first = cost.capacity(split, block_size)
    if first < 1:
        raise SimError(f"layout {layout!r} leaves no KV room on some stage of "
                       f"{[g.name for g in cost.gpus]}")
    fixed = 0
    if not kv_resize:
        fixed = first if kv_blocks is None else _check_int("kv_blocks", kv_blocks, 1, first)
    elif kv_blocks is not None:
        raise SimError("kv_blocks is for kv_resize=False")
    n, span, arrays = _trace_args(trace)
    sample_interval = _sample_interval(span, sample_interval)
    capacity = [fixed or first]
    unused = ConstantCost()  # the TP cost model: no TP instance here
    sim = _C.Simulator(
        hosts=hosts, gpus_per_host=cost.n_stages, max_tp=1, layout=[1], capacity=capacity,
        capacity_mid=capacity, **sched, cost_kind=unused.kind, cost_params=unused.params(),
        policy=policy, **knobs, sample_interval=sample_interval,
        record_tokens=bool(record_tokens), **arrays,
        pipeline=cost.params(block_size, fixed), pipe_layers=list(split),
        **_kv_args(cost, swap_bw))
    start = float(arrays["arrival"][0]) if n else 0.0
    return _drive(sim, policy, n, start, span, check, progress, t_wall, slo, {
        "policy": policy, "hosts": hosts, "gpus_per_host": cost.n_stages, "max_tp": 1,
        "layout": layout, "gpus": [g.name for g in cost.gpus], "split": list(split),
        "cost": cost.describe(), "capacity_blocks": capacity, "kv_resize": bool(kv_resize),
        "kv_blocks": fixed or None, **sched, **knobs,
        "weights": weights, "sample_interval": sample_interval,
        "record_tokens": bool(record_tokens), "swap_bw": swap_bw})


def _run_buddy(trace, policy, hosts, gpus_per_host, model, gpu, layout, slo, progress, cost,
               max_tp, block_size, max_batch_tokens, max_running, max_prefill_chunk, watermark,
               decode_weight, sample_interval, record_tokens, check, buddy_group, live_restore,
               buddy_strategy, restore_wait, swap_bw, t_wall, **unused) -> Results:
    """run() for weights="buddy" (the module docstring): every GPU a replica that can drop."""
    if policy not in ("kunserve", "least_load", "round_robin", "static", "llumnix"):
        raise SimError(f"a buddy cluster runs with policy 'kunserve' (or 'least_load', "
                       f"'round_robin', 'static', 'llumnix' for the baselines), not {policy!r}")
    if layout is not None or max_tp not in (None, 1):
        raise SimError("a buddy cluster has no layout or TP: buddy_group sets its start")
    if cost is None:
        n = 8 if gpus_per_host is None else _check_int("gpus_per_host", gpus_per_host, 2, 8)
        try:
            cost = PipelineCost.create(model, [gpu] * n)
        except CostModelError as e:
            raise SimError(str(e)) from None
    elif not isinstance(cost, PipelineCost):
        raise SimError(f"a buddy cluster needs a PipelineCost, got {type(cost).__name__}")
    if len(set(cost.gpus)) != 1:
        raise SimError("a buddy cluster's GPUs are all of one kind")
    if gpus_per_host not in (None, cost.n_stages):
        raise SimError(f"gpus_per_host {gpus_per_host}: the PipelineCost has {cost.n_stages} "
                       f"stages (the largest group)")
    group = _check_int("buddy_group", buddy_group, 1, cost.n_stages)
    if cost.n_stages % group:
        raise SimError(f"buddy_group {group} must divide gpus_per_host {cost.n_stages}")
    sched = _scheduler_args(block_size, max_batch_tokens, max_running, max_prefill_chunk,
                            watermark)
    block_size = sched["block_size"]
    knobs = Policy(policy, decode_weight=decode_weight, buddy_strategy=buddy_strategy,
                   restore_wait=restore_wait).config
    n_st, n_layers = cost.n_stages, cost.n_layers
    even = [n_layers // n_st + (i < n_layers % n_st) for i in range(n_st)]
    n, span, arrays = _trace_args(trace)
    sample_interval = _sample_interval(span, sample_interval)
    unused_cost = ConstantCost()  # the TP cost model: no TP instance here
    sim = _C.Simulator(
        hosts=hosts, gpus_per_host=n_st, max_tp=1, layout=[1], capacity=[1], capacity_mid=[1],
        **sched, cost_kind=unused_cost.kind, cost_params=unused_cost.params(), policy=policy,
        **knobs, sample_interval=sample_interval, record_tokens=bool(record_tokens), **arrays,
        pipeline=cost.params(block_size, 0), pipe_layers=even, buddy=True, buddy_group=group,
        live_restore=bool(live_restore),
        # a request migrates live (llumnix) over the link between replicas
        **_kv_args(cost, swap_bw, (cost.link_bw or 0.0) * cost.eff_xfer))
    start = float(arrays["arrival"][0]) if n else 0.0
    return _drive(sim, policy, n, start, span, check, progress, t_wall, slo, {
        "policy": policy, "hosts": hosts, "gpus_per_host": n_st, "max_tp": 1,
        "weights": "buddy", "buddy_group": group, "live_restore": bool(live_restore),
        "gpus": [g.name for g in cost.gpus], "cost": cost.describe(), **sched, **knobs,
        "sample_interval": sample_interval, "record_tokens": bool(record_tokens),
        "swap_bw": swap_bw})
