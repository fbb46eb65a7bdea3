"""Replay a request trace against a real gyges.Host under the simulator's cluster policies: one
controller (csrc/cluster/controller.h, with the policies of csrc/policy/policy_*.c), three
executors (gyges.sim's discrete events, this module's real host, and a gyges.Cluster's hosts,
gyges/distributed/replay.py, given as run(..., cluster=...)).

    res = gyges.experiment.run(trace, policy="gyges", host=host, time_scale=0.05)
    res.summary(); res.requests; res.plot("run.png"); res.save("runs/gyges")

This module only executes: it tells the controller (gyges._C.Controller) when a request arrives,
when an instance finished requests, when a transformation ended and when time passes, and
implements the controller's ops on the host: `instances` (a view of every instance: TP, KV blocks
total and used, queues, footprints, whether it transforms), `assign` (submit a request to the
chosen instance, or mark it deferred or rejected) and `reconfigure` (a merge or split op becomes
host.transform(...)). Which requests wait at the cluster, which instances the policy holds, and
when the policy is asked again are the controller's, the same code as in the simulator.

Every instance steps on its own thread, back to back while it has work, as the simulator's
instances (GPUs) do; Host.step's lockstep would make each instance wait for the slowest one's
step (a long prefill chunk on a TP2 instance would set the decode pace of the TP1 ones). The
main thread acts on an instance only between two of its steps: a request submitted to it, or a
transformation of it, waits for its step in flight. Policy views come from what each instance
reported at the end of its last step plus the requests the main thread placed since.

Time: trace arrivals are multiplied by `time_scale` (wall seconds per trace second, so a
10-minute trace can take seconds) and replayed open-loop on the host's clock; a request joins
its instance at the end of the step in flight there, and its latencies count from its arrival.
With idle="skip" the clock jumps over the gaps in which the host has nothing to do (no
sleeping); idle="sleep" waits for real. Every time in the Results is in seconds from the first
arrival, so `gyges.sim.run` on the same trace with arrivals multiplied by time_scale is the
simulated twin of a run (benchmarks/bench_experiment.py compares them).

The Results are gyges.results.Results, as gyges.sim.run returns: requests (status finished,
rejected, deferred-and-never-served, or queued-and-unfinished when time_limit cut the run),
transformations, layout events, per-instance samples, throughput bins and every token's time.
Prompt tokens enter the throughput bins when a request's first token comes out (the real engine
does not report its prefill chunks).
"""
from __future__ import annotations

import math
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from . import traces
from .. import _C
from .policy import (BIND, DEFER, DROP, INST_VIEW_DTYPE, MIGRATE, PARK, PLACE, RELEASE,
                     RESPLIT, RESTORE, UNPARK, XFORM_EXCHANGING, XFORM_MERGING, XFORM_NONE,
                     XFORM_RESPLITTING, Policy, check_number, check_policy, smallest_tp)
from .costmodel import CostModel as _CostModel
from . import seesaw_search
from ..runtime.engine import SamplingParams
from ..core.errors import Error as GygesError
from ..core.errors import InvalidArgumentError
from ..core.logs import progress as progress_bar
from .results import LAYOUT_DTYPE, REQUEST_DTYPE, TIMELINE_DTYPE, TOKEN_DTYPE, TRANSFORM_DTYPE, \
    Results

__all__ = ["run", "ExperimentError", "STEP_DTYPE", "capacities"]

# One measured instance step (record_steps=True): its TP, gyges.costmodel's batch shape, and
# two wall times: `seconds` from the end of the instance's previous step (or the start of its
# runner) to the end of this one, i.e. what the instance pays per step with the host's
# overhead and the CPU shared with the other workers, which is what the simulator's step time
# stands for; `busy_seconds` inside the step call only. `concurrent`: instances running when
# it started (CPU contention).
STEP_DTYPE = np.dtype([
    ("tp", "i4"), ("n_tokens", "i8"), ("n_seqs", "i8"), ("n_samples", "i8"),
    ("kv_read_tokens", "f8"), ("attn_pairs", "f8"), ("seconds", "f8"), ("busy_seconds", "f8"),
    ("concurrent", "i4")])

# gyges.results.STATUS
PENDING, DEFERRED, QUEUED, FINISHED, REJECTED = 0, 1, 2, 3, 4


class ExperimentError(InvalidArgumentError):
    """A bad argument to the experiment (the message names the value)."""


def _check_number(name, v, low, high=None, low_open=False):
    return check_number(name, v, low, high, low_open, ExperimentError)


# ---- the real host -------------------------------------------------------------------------

def pipeline_params(host, instances=None):
    """What the pipelive and kunserve policies price pipelines with on a CPU host
    (gyges.costmodel.PipelineCost over the workers of `instances`, default the first one's):
    each worker's budget as its stage's memory, f32 weights and KV, and a nominal CPU roofline
    (10 GB/s, 50 GFLOP/s, ours) that only ranks choices against each other."""
    from .costmodel import GPUSpec, PipelineCost
    workers = [w for inst in (instances or host.instances[:1]) for w in inst.workers]
    gpus = tuple(GPUSpec("cpu worker", host.worker(w).arena.stats()["budget_bytes"], 10e9,
                         50e9, 10e9) for w in workers)
    cost = PipelineCost(model=host.model.config, gpus=gpus, dtype_bytes=4, mem_util=1.0,
                        activation_fraction=0.0, step_overhead=0.0)
    return cost.params(block_size=host.block_size)


def capacities(host, max_tp=None) -> list[int]:
    """KV blocks of a fresh TP-1, 2, 4, ... instance of `host` (up to max_tp): the memory budget
    of a worker less the weights a rank of that TP keeps, in whole pages per layer, as blocks of
    that TP's geometry. Checked against the instances the host has."""
    max_tp = max_tp or min(host.max_tp, host.n_workers)
    if host.replicas is not None:  # a bound TP-k group pools k workers' blocks (in DP blocks)
        dp = host.replicas.dp[0].capacity_blocks()
        return [dp << level for level in range(max_tp.bit_length())]
    w = host.worker(0)
    c = host.model.config
    ws = w.weights
    page = w.page_size
    budget_pages = w.arena.stats()["budget_bytes"] // page
    block_bytes_tp1 = w.kv.block_bytes * w.tp_size  # a block of every KV head
    out = []
    tp = 1
    while tp <= max_tp:
        weight_pages = ws.replicated_slots + ws.ffn_slots(ws.max_tp // tp)
        per_layer = (budget_pages - weight_pages) // c.num_hidden_layers
        # blocks pack across a layer's pages (kv_cache.c's gy_kv_blocks_for_pages): a block of
        # SmolLM2's 3 KV heads is 24 KiB, 2.67 to a 64 KiB page
        out.append(max(per_layer, 0) * page // (block_bytes_tp1 // tp))
        tp *= 2
    for inst in host.instances:
        level = int(math.log2(inst.tp))
        if level < len(out) and inst.capacity_blocks() != out[level]:  # pragma: no cover
            raise ExperimentError(f"a TP{inst.tp} instance of the host holds "
                                  f"{inst.capacity_blocks()} KV blocks but the formula says "
                                  f"{out[level]}; gyges/experiment.py's capacities() is out of "
                                  f"date with gyges/weights.py")
    return out


def instance_load(host, inst) -> dict:
    """What the controller's view of one instance of `host` needs from the instance itself: KV
    blocks (capacity, in use) in the TP1 block size, requests running and waiting, preemptions
    so far, and per request not yet sampling its tokens computed ({host request id: n}). Read
    between two of its steps (a host actor reads it under the host's lock)."""
    st = inst.stats()
    kv = host.worker(inst.workers[0]).kv.stats()
    scale = inst.block_tokens // host.block_size  # a TP view's block: tp DP blocks' tokens
    if host.replicas is not None:  # the pool is shared: count this instance's own blocks, on rank 0
        cache = (host.replicas.groups[(min(inst.workers), inst.tp)].views[0]
                 if inst.tp > 1 else host.worker(inst.workers[0]).kv)
        used = sum(len(cache.block_table(seq)) for seq in
                   (inst.request_seqs(rid)[0] for rid in inst.requests) if seq >= 0)
        kv = {"n_blocks": used, "free_blocks": 0}
    computed = {rid: inst.info(rid)["n_computed"]
                for rid, handle in list(inst.requests.items()) if not handle.output_tokens}
    return {"capacity": st["capacity_blocks"] * scale, "running": st["running"],
            "waiting": st["waiting"] + st["preempted_queued"],
            "kv_used": (kv["n_blocks"] - kv["free_blocks"]) * scale,
            "computed": computed, "preemptions": st["preemptions"]}


@dataclass(eq=False)
class _Req:
    index: int
    prompt: int
    output: int
    footprint: int
    min_tp: int
    arrival: float                 # host clock
    status: int = PENDING
    handle: object = None
    inst: object = None            # the Instance serving it (queued)
    gpu: int = -1
    tp: int = 0
    preemptions: int = 0
    migrations: int = 0
    priority: int = 0
    tp_work: int = 0               # placed as TP work (flying): recomputed at its group's bind


class _Replay:
    """One run: the host, the policy, the requests and what was recorded.

    Every instance steps on its own thread, back to back while it has work, as a GPU would (the
    lockstep of Host.step would make each instance wait for the slowest one). The main thread
    decides and acts only at step boundaries of the instances it touches: it waits for an
    instance's step in flight before it submits to it or transforms it, and it builds views from
    what each instance reported at the end of its last step plus its own request records."""

    def __init__(self, trace, policy, host, time_scale, seed, temperature, method,
                 layers_per_step, idle, sample_interval, max_tp, record_steps=False,
                 pipeline_cost=None, buddy=False, cost_args=None):
        self.host = host
        self.n_gpus = self.gpus_per_host = host.n_workers
        self.begin(trace, policy, time_scale, seed, temperature, method, layers_per_step, idle,
                   sample_interval, max_tp,
                   [host.instances[0].capacity_blocks()] if host.instances[0].stages
                   else capacities(host, max_tp),
                   host.block_size, host.worker(0).max_pos, host.model.config.vocab_size,
                   host.layout())
        self.pool = ThreadPoolExecutor(max_workers=self.n_gpus,
                                       thread_name_prefix="gyges-experiment")
        self.running = {}            # Instance -> (Future of its runner, stop Event)
        self.events = queue.Queue()  # (what, Instance) from the runners
        # a replicated host (weights="replicated") binds and releases groups (gyges.flying)
        self.replicated = host.replicas is not None
        # a pipeline host (one pipeline over every worker) re-splits it (gyges.pipelive)
        self.pipeline = host.instances[0] if host.instances[0].stages else None
        pipeline = None
        # a buddy host (KunServe: whole replicas that drop into buddy groups, gyges.kunserve)
        self.buddy = buddy
        if self.pipeline is not None or buddy:
            pipeline = (pipeline_cost.params(block_size=self.block_size) if pipeline_cost
                        else pipeline_params(host, host.instances if buddy else None))
        self.ctl = _C.Controller(self, policy.handle, self.n_gpus, self.gpus_per_host, max_tp,
                                 self.capacity.tolist(), self.block_size, 0.0,
                                 replicated=self.replicated, base_tp=1, pipeline=pipeline,
                                 buddy=buddy, **(cost_args or {}))
        self.record_steps = record_steps
        for inst in host.instances:
            self.refresh(inst)

    def begin(self, trace, policy, time_scale, seed, temperature, method, layers_per_step, idle,
              sample_interval, max_tp, capacity, block_size, max_pos, vocab, layout):
        """What every executor of a run keeps: its knobs, the hosts' shape, the requests and
        what is recorded."""
        self.trace, self.policy = trace, policy
        self.time_scale, self.seed, self.temperature = time_scale, seed, temperature
        self.method, self.layers_per_step, self.idle = method, layers_per_step, idle
        self.max_tp = max_tp
        self.capacity = np.asarray(capacity, np.int64)
        self.block_size, self.max_pos, self.vocab = block_size, max_pos, vocab
        self.sample_interval = sample_interval
        self.initial_layout = layout
        self.reqs = []
        self.by_id = {}              # request id -> _Req
        self.active = []             # queued, unfinished
        self.xforms = []             # (row dict, reconfiguration handle)
        self.layout_events = []
        self.samples = []
        self.cache = {}              # instance -> what it reported after its last step
        self.stats = {"n_steps": 0, "n_merges": 0, "n_splits": 0, "n_binds": 0, "n_resplits": 0,
                      "n_drops": 0, "n_restores": 0,
                      "n_releases": 0, "n_migrations": 0,
                      "n_preemptions": 0, "refusals": {}, "skipped_idle_seconds": 0.0,
                      "controller_seconds": 0.0, "transform_seconds": 0.0}
        self.last_refusal = None
        self.replicated, self.pipeline, self.buddy = False, None, False
        self.buddies = {}            # (gpu_first, size) -> the Buddy serving there
        self.ended = 0               # transformations ended, not yet told to the controller
        self.steps_ended = []        # (gpu_first, tp) of instances that finished requests
        self.record_steps = False
        self.steps = []              # STEP_DTYPE rows

    def serving(self):
        """The instances that step now (a replicated host's bound groups and free workers)."""
        return sorted(self.host.serving_instances(), key=lambda inst: min(inst.workers))

    def layout(self):
        return self.host.layout()

    def all_instances(self):
        """The instances at the start (layout events)."""
        return self.host.instances

    def close(self):
        self.quiesce_all()
        self.pool.shutdown(wait=True)

    def executor_config(self):
        """What Results.config says of the executor and its host."""
        host = self.host
        return {"executor": "gyges.Host", "model": repr(host.model), "hosts": 1,
                "memory_per_worker": host.memory_per_worker,
                "page_size": host.worker(0).page_size,
                "max_batch_tokens": host.max_batch_tokens, "max_running": host.max_running,
                "max_prefill_chunk": host.max_prefill_chunk}

    def first_scheduled(self, handle):
        """When an unfinished request (cut by time_limit) was first scheduled: its instance
        knows."""
        for inst in self.host.instances:
            if handle.id in inst.requests:
                return inst.info(handle.id)["first_scheduled"]
        return handle.metrics.scheduled

    # ---- clock ----
    def now(self):
        return self.host.now()

    def skip_to(self, t):
        """Moves the host's clock forward to t (idle="skip": at once; "sleep": waits). Only
        while no step is in flight."""
        gap = t - self.host.now()
        if gap <= 0:
            return
        if self.idle == "sleep":
            time.sleep(gap)
        else:
            self.host.advance_clock(gap)  # every timestamp of the host comes from Host.now()
            self.stats["skipped_idle_seconds"] += gap

    # ---- steps ----
    def refresh(self, inst):
        """Reads an instance's load into the cache (from its runner thread after each step, or
        from the main thread while it is stopped)."""
        self.cache[inst] = instance_load(self.host, inst)

    def busy(self):
        return bool(self.active) or any(not t.done for t in self.host.reconfigurations)

    def _staggered(self):
        """The workers of a layer-staggered scale-up under way."""
        out = set()
        for t in self.host.reconfigurations:
            if not t.done:
                out |= set(t.workers)
        return out

    def launch(self):
        """Starts a runner on every stopped instance that has work."""
        has_work = {r.inst for r in self.active}
        staggered = [t for t in self.host.reconfigurations if not t.done]
        for inst in self.serving():
            if inst in self.running:
                continue
            moving = [t for t in staggered if set(t.workers) & set(inst.workers)]
            if inst not in has_work and not moving:
                continue
            stop = threading.Event()
            self.running[inst] = (self.pool.submit(self.runner, inst, stop, moving), stop)

    def runner(self, inst, stop, moving):
        """An instance's serving loop: steps back to back while it has work and the main thread
        does not need it. Only this thread touches the instance meanwhile. It tells the main
        thread when requests finished, when a transformation ended and when it stops."""
        steps = preemptions = 0
        last = time.perf_counter()
        try:
            while not stop.is_set():
                for t in moving:  # the host would do this at the start of its step
                    if not t.done:
                        t.advance()
                        if t.done:
                            self.events.put(("transformed", inst))
                if not inst.requests:
                    break
                before = self.snapshot(inst) if self.record_steps and not moving else None
                n_before = len(inst.requests)
                start = time.perf_counter()
                tokens = inst.step()
                end = time.perf_counter()
                if tokens:
                    steps += 1
                if before is not None and tokens:
                    self.record(inst, before, end - last, end - start)
                seen = self.cache[inst]["preemptions"] if inst in self.cache else 0
                self.refresh(inst)
                now_seen = self.cache[inst]["preemptions"]
                if now_seen > seen:
                    preemptions += now_seen - seen
                    for rid in list(inst.requests):
                        r = self.by_id.get(rid)
                        if r is not None:
                            r.preemptions = max(r.preemptions,
                                                inst.info(rid)["n_preemptions"])
                if len(inst.requests) < n_before:
                    self.events.put(("finished", inst))
                last = end
        finally:
            self.events.put(("stopped", inst))
        return steps, preemptions

    def snapshot(self, inst):
        return ({rid: (inst.info(rid)["n_computed"], len(h.output_tokens), len(h.prompt))
                 for rid, h in inst.requests.items()}, len(self.running))

    def quiesce(self, inst):
        """Stops inst's runner, if any, after its step in flight, and takes in what it did."""
        entry = self.running.pop(inst, None)
        if entry is None:
            return
        fut, stop = entry
        stop.set()
        steps, preemptions = fut.result()
        self.stats["n_steps"] += steps
        self.stats["n_preemptions"] += preemptions
        self.collect()

    def quiesce_all(self):
        for inst in list(self.running):
            self.quiesce(inst)

    def wait(self, timeout):
        """Waits for word from the runners (at most `timeout` seconds) and takes it in."""
        try:
            events = [self.events.get(timeout=timeout)]
        except queue.Empty:
            return
        while True:
            try:
                events.append(self.events.get_nowait())
            except queue.Empty:
                break
        for kind, inst in events:
            if kind == "stopped" and inst in self.running and self.running[inst][0].done():
                self.quiesce(inst)
        self.collect()

    def record(self, inst, before, seconds, busy):
        """The shape of the step that just ended on inst (gyges.costmodel's batch shape: from
        each request's computed tokens and outputs before and after) and its wall time."""
        snapshot, concurrent = before
        entries = []
        for rid, (computed, n_out, prompt) in snapshot.items():
            handle = inst.requests.get(rid)
            if handle is not None:
                after = inst.info(rid)["n_computed"]
                sampled = len(handle.output_tokens) - n_out
            else:  # finished in this step: its KV ends one token short of its tokens
                r = self.by_id.get(rid)
                if r is None or not r.handle.finished:
                    return
                sampled = len(r.handle.output_tokens) - n_out
                after = prompt + len(r.handle.output_tokens) - 1
            if after < computed:
                return  # preempted: the step recomputed what it had; no clean shape
            entries.append((computed, after - computed, sampled))
        shape = _CostModel.batch_shape(entries)
        if shape["n_tokens"] > 0:
            self.steps.append((inst.tp, shape["n_tokens"], shape["n_seqs"], shape["n_samples"],
                               shape["kv_read_tokens"], shape["attn_pairs"], seconds, busy,
                               concurrent))

    def collect(self):
        """Takes in the requests that finished and the transformations that ended."""
        self.collect_transforms()
        still = []
        for r in self.active:
            if r.handle.finished:
                r.status = FINISHED
                if (r.gpu, r.tp) not in self.steps_ended:
                    self.steps_ended.append((r.gpu, r.tp))
            else:
                still.append(r)
        self.active = still

    def collect_transforms(self):
        for row, t in self.xforms:
            if t is not None and math.isnan(row["end"]) and t.done:
                self.finish_transform(row, t)

    # ---- telling the controller (between its calls: its ops may not call back) ----
    def control(self, method, *args):
        start = time.perf_counter()
        getattr(self.ctl, method)(*args)
        self.stats["controller_seconds"] += time.perf_counter() - start

    @property
    def n_deferred(self):
        return self.ctl.stats()["deferred"]

    def react(self):
        """What happened since the controller last heard: instances that finished requests
        (it reconsiders the deferred ones and may rebalance; a held instance is reported even
        without a finish, as the simulator reports its every step), then every transformation
        that ended (reconsider, rebalance), until none is left (bounded: a policy that merges
        and splits in turn stops here)."""
        ended_steps, self.steps_ended = self.steps_ended, []
        for g, tp in ended_steps:
            self.control("step_ended", g, tp, True, self.now())
        if not ended_steps:
            held = [inst for inst in self.serving() if self.ctl.held(min(inst.workers), inst.tp)]
            if self.replicated and not self.running:  # a bound group idle over paused work
                held += [inst for inst in self.serving() if inst.tp > 1 and not inst.requests]
            if held:
                self.control("step_ended", min(held[0].workers), held[0].tp, False, self.now())
        for _ in range(16):
            if not self.ended:
                return
            self.ended -= 1
            self.control("reconfigured", True, self.now())

    # ---- the controller's ops ----
    def instances(self):
        return self.view_rows().tobytes()

    def view_rows(self):
        """gy_sim_inst_view rows of every instance in worker order (the controller adds held
        and reserved): what each reported at the end of its last step plus the requests placed
        on it since."""
        insts = self.serving()
        mine = {inst: [] for inst in insts}
        for r in self.active:
            mine.setdefault(r.inst, []).append(r)
        rows = np.zeros(len(insts), INST_VIEW_DTYPE)
        staggered = self._staggered()
        for row, i in zip(rows, insts):
            g, c, rs = min(i.workers), self.cache[i], mine[i]
            transforming = bool(staggered & set(i.workers))
            row["gpu_first"], row["tp"], row["host"] = g, i.tp, g // self.gpus_per_host
            row["xform"] = XFORM_MERGING if transforming else XFORM_NONE
            row["placeable"] = 0 if transforming else 1
            row["max_min_tp"] = max((r.min_tp for r in rs), default=0)
            row["kv_total"] = c["capacity"]
            row["kv_used"] = c["kv_used"]
            row["footprint"] = sum(r.footprint for r in rs)
            row["max_footprint"] = max((r.footprint for r in rs), default=0)
            row["n_requests"] = len(rs)
            row["n_running"] = c["running"]
            row["n_waiting"] = max(c["waiting"], len(rs) - c["running"])
            row["pending_prefill"] = sum(r.prompt - c["computed"].get(r.handle.id, 0)
                                         for r in rs if not r.handle.output_tokens)
            row["pending_output"] = sum(r.output - len(r.handle.output_tokens) for r in rs)
            row["n_tp_work"] = sum(r.tp_work for r in rs)
            row["n_priority"] = sum(r.priority > 0 for r in rs)
            if i.stages:  # a pipeline: a row of tp 1 over its stages' workers
                row["n_stages"] = len(i.stages)
                row["layers"][:len(i.stages)] = [end - first for first, end in i.stages]
                row["placeable"] = 1  # it serves on while it re-splits or exchanges KV
                row["xform"] = XFORM_NONE if not transforming else \
                    XFORM_EXCHANGING if self.buddy else XFORM_RESPLITTING
            if self.replicated and i.tp > 1:
                row["bound"] = 1
                row["n_paused"] = sum(1 for r in self.active if r.inst is not None and
                                      r.inst.tp == 1 and r.inst.workers[0] in i.workers)
        return rows

    def assign(self, index, action, gpu_first, tp, tp_work=0):
        r = self.reqs[index]
        r.tp_work = tp_work
        if action == PLACE:
            inst = self._inst_at(gpu_first, tp)
            if inst is None:  # pragma: no cover - the controller names a listed instance
                raise ExperimentError(f"no TP{tp} instance at worker {gpu_first}")
            self.submit(r, inst)
        elif action == DEFER:
            r.status = DEFERRED
        else:
            r.status = REJECTED

    def reconfigure(self, kind, g, size, layers=(), target=-1):
        """A merge (kind 0) of the two TP size/2 halves of workers g..g+size-1, or a split
        (kind 1) of the TP-size instance at g; on a replicated host a bind (kind 4) of workers
        g..g+size-1 or a release (kind 5) of the group bound there; on a pipeline host a live
        re-split (kind 6) of the pipeline at g to `layers`; a running request of the instance
        at g moved to the one at `target` (kind 9, where the executor moves requests):
        whether it started."""
        if kind == MIGRATE:
            return self.migrate(g, target)
        if kind in (PARK, UNPARK):   # (Seesaw's tiered KV buffer: the simulator's)
            return self.refuse(f"op kind {kind}: a CPU worker has no host-memory tier to park "
                               f"KV in")
        if kind in (DROP, RESTORE):
            if not self.buddy:
                return self.refuse(f"op kind {kind}: not a buddy run (policy 'kunserve')")
            return self.drop(g, size) if kind == DROP else self.restore(g, size)
        if kind == RESPLIT:
            return self.resplit(g, list(layers))
        if kind not in (0, 1, BIND, RELEASE) or self.pipeline is not None:
            return self.refuse(f"op kind {kind}: this host changes "
                               f"{'a pipeline' if self.pipeline else 'TP groups'} only")
        if (kind in (BIND, RELEASE)) != self.replicated:
            return self.refuse(f"op kind {kind}: the host's weights are "
                               f"{'replicated' if self.replicated else 'sharded'}")
        if kind == BIND:
            return self.bind(g, size)
        if kind == RELEASE:
            return self.release(g, size)
        if kind == 0:
            sources = [self._inst_at(g, size // 2), self._inst_at(g + size // 2, size // 2)]
            if size < 2 or None in sources:
                return self.refuse(f"merge: workers {g}..{g + size - 1} are not two "
                                   f"TP{size // 2} instances")
            return self.transform(0, g, size // 2, size, sources)
        src = self._inst_at(g, size)
        if size < 2 or src is None:
            return self.refuse(f"split: no TP{size} instance at worker {g}")
        return self.transform(1, g, size, size // 2, [src])

    def migrate(self, g, target):
        """(One in-process host does not move requests between its instances; a cluster
        does, distributed/replay.py.)"""
        return self.refuse("migrate: this executor does not move requests")

    def resplit(self, g, layers):
        """Starts a live re-split of the pipeline at worker g (host.reconfigure); its runner
        advances it step by step."""
        inst = self.pipeline
        if inst is None or min(inst.workers) != g:
            return self.refuse(f"resplit: no pipeline at worker {g}")
        if any(not t.done for t in self.host.reconfigurations):
            return self.refuse("a transformation is under way")
        self.quiesce(inst)
        start = self.now()
        try:
            r = self.host.reconfigure(inst, layers, mode="live")
        except GygesError as e:
            self.last_refusal = str(e)
            return self.refuse(f"resplit: {type(e).__name__}")
        row = {"kind": RESPLIT, "gpu": g, "tp_from": 1, "tp_to": 1, "start": start,
               "phase_end": math.nan, "end": math.nan, "migrated": len(inst.requests),
               "layers_from": [b - a for a, b in r.cur], "layers_to": list(layers)}
        self.xforms.append((row, r))
        return True

    def drop(self, g, size):
        """KunServe: the replicas on workers g..g+size-1 become one buddy group now
        (host.buddy: parameters dropped; on CPU workers the victims' KV then moves live while
        the group serves, their attention remote meanwhile, and the drop ends with that
        exchange; on CUDA workers it is exchanged between two steps)."""
        members = [inst for inst in self.serving()
                   if not inst.stages and g <= min(inst.workers) < g + size]
        if len(members) != size:
            return self.refuse(f"drop: workers {g}..{g + size - 1} are not {size} replicas")
        if any(not t.done for t in self.host.reconfigurations):
            return self.refuse("a transformation is under way")
        for inst in members:
            self.quiesce(inst)
        start = self.now()
        try:
            b = self.host.buddy(members, live=self.host.backend == "cpu")
        except GygesError as e:
            self.last_refusal = str(e)
            return self.refuse(f"drop: {type(e).__name__}")
        self.buddies[(g, size)] = b
        self._moved([b.instance], start, [(inst, -1) for inst in members] + [(b.instance, +1)])
        row = {"kind": DROP, "gpu": g, "tp_from": 1, "tp_to": 1, "start": start,
               "phase_end": start, "end": math.nan, "migrated": 0}
        self.xforms.append((row, b.exchange))   # a live one ends with its exchange (collect)
        if b.exchange is None or b.exchange.done:
            self._drop_ended(row, b)
        return True

    def _drop_ended(self, row, b):
        """A drop's exchange is over: its row, its count, and word to the controller."""
        row["end"] = self.now()
        row["kv_bytes"] = float(b.stats["kv_bytes_exchanged"])
        row["weight_bytes"] = float(b.stats["weight_bytes_released"])
        self.stats["n_drops"] += 1
        self.ended += 1

    def restore(self, g, size):
        """KunServe: the buddy group at g gets its parameters back from its peers and its
        members serve as replicas again (host.restore)."""
        b = self.buddies.get((g, size))
        if b is None:
            return self.refuse(f"restore: no buddy group at workers {g}..{g + size - 1}")
        self.quiesce(b.instance)
        start = self.now()
        try:
            self.host.restore(b)
        except GygesError as e:
            self.last_refusal = str(e)
            return self.refuse(f"restore: {type(e).__name__}")
        del self.buddies[(g, size)]
        singles = [inst for inst in self.serving() if g <= min(inst.workers) < g + size]
        self._moved(singles, start, [(b.instance, -1)] + [(inst, +1) for inst in singles])
        self._recorded(RESTORE, g, start, kv_bytes=b.stats["kv_bytes_returned"],
                       weight_bytes=b.stats["weight_bytes_restored"])
        return True

    def _recorded(self, kind, g, start, tp_from=1, tp_to=1, migrated=0, kv_bytes=0.0,
                  weight_bytes=0.0):
        """A reconfiguration that ended as it began (between two steps: a bind, a release, a
        restore): its row, its count, and word to the controller."""
        self.stats[{BIND: "n_binds", RELEASE: "n_releases", RESTORE: "n_restores"}[kind]] += 1
        self.ended += 1
        self.xforms.append(({"kind": kind, "gpu": g, "tp_from": tp_from, "tp_to": tp_to,
                             "start": start, "phase_end": start, "end": self.now(),
                             "migrated": migrated, "kv_bytes": float(kv_bytes),
                             "weight_bytes": float(weight_bytes)}, None))

    def bind(self, g, size):
        """Binds workers g..g+size-1 now: their DP requests pause, those placed there as TP work
        move to the group's TP engine (recomputed)."""
        workers = tuple(range(g, g + size))
        members = [inst for inst in self.serving() if set(inst.workers) <= set(workers)]
        if len(members) != size or any(inst.tp != 1 for inst in members):
            return self.refuse(f"bind: workers {g}..{g + size - 1} are not {size} DP workers")
        for inst in members:
            self.quiesce(inst)
        tp_work = [r.handle for r in self.active if r.inst in members and r.tp_work]
        start = self.now()
        try:
            self.host.switch(workers, size, preempt="hard", tp_work=tp_work)
        except GygesError as e:
            self.last_refusal = str(e)
            return self.refuse(f"bind: {type(e).__name__}")
        group = self.host.replicas.groups[(g, size)].instance
        self._moved(members + [group], start, [(inst, -1) for inst in members] + [(group, +1)])
        self._recorded(BIND, g, start, tp_to=size, migrated=len(tp_work))
        return True

    def release(self, g, size):
        """Releases the group bound at g: its members serve DP again, their paused requests
        resume, and its own TP requests are recomputed on them."""
        group = self.host.replicas.groups.get((g, size))
        if group is None or group.state != "bound":
            return self.refuse(f"release: no group bound at workers {g}..{g + size - 1}")
        self.quiesce(group.instance)
        moving = [r for r in self.active if r.inst is group.instance]
        start = self.now()
        try:
            self.host.switch(group.workers, 1, preempt="soft")
        except GygesError as e:
            self.last_refusal = str(e)
            return self.refuse(f"release: {type(e).__name__}")
        members = [self.host.replicas.dp[w] for w in group.workers]
        self._moved([group.instance] + members, start,
                    [(group.instance, -1)] + [(inst, +1) for inst in members])
        self._recorded(RELEASE, g, start, tp_from=size, migrated=len(moving))
        return True

    def _moved(self, instances, start, changes):
        """After a bind or a release: where each request of `instances` is now, fresh cache
        rows, and the layout events."""
        for inst, change in changes:
            self.layout_events.append((start, min(inst.workers), inst.tp, change))
        for inst in instances:
            self.refresh(inst)
            for rid in list(inst.requests):
                r = self.by_id.get(rid)
                if r is not None and r.inst is not inst:
                    r.inst, r.gpu, r.tp = inst, min(inst.workers), inst.tp
                    r.migrations += 1
                    r.tp_work = 0
                    self.stats["n_migrations"] += 1

    def arrive(self, r):
        self.control("arrive", r.index, r.prompt, r.output, r.footprint, r.min_tp, r.priority,
                     r.arrival, self.now())

    def request_of(self, r):
        """(prompt tokens, SamplingParams) of trace request r: random tokens seeded by the run's
        seed and its index, exactly its output length, sampled at the run's temperature."""
        rng = np.random.default_rng([self.seed, r.index])
        tokens = rng.integers(3, self.vocab, size=r.prompt).tolist()
        params = SamplingParams(max_tokens=r.output, temperature=self.temperature,
                                seed=(self.seed * 1_000_003 + r.index) % 2**63, ignore_eos=True)
        return tokens, params

    def submit(self, r, inst):
        tokens, params = self.request_of(r)
        self.quiesce(inst)
        r.handle = self.host.submit(tokens, params, instance=self.host.instances.index(inst))
        r.status = QUEUED
        r.inst, r.gpu, r.tp = inst, min(inst.workers), inst.tp
        self.by_id[r.handle.id] = r
        self.active.append(r)

    # ---- ops ----
    def _inst_at(self, g, tp):
        for inst in self.host.instances:
            if min(inst.workers) == g and inst.tp == tp:
                return inst
        return None

    def refuse(self, why):
        """An op the host's state does not allow: counted by the controller, the reason here."""
        self.stats["refusals"][why] = self.stats["refusals"].get(why, 0) + 1
        return False

    def transforming(self, g):
        """Whether a transformation is under way where worker g is (one at a time a host)."""
        return any(not t.done for t in self.host.reconfigurations)

    def start_transform(self, workers, tp, layers_per_step):
        """host.transform of `workers` to TP `tp`: its handle (a gyges.Error if refused)."""
        return self.host.transform(workers=workers, tp=tp, method=self.method,
                                   layers_per_step=layers_per_step)

    def instances_in(self, g, n):
        """The serving instances on workers g..g+n-1, their cache rows fresh and their requests
        followed there."""
        new = [inst for inst in self.host.instances if g <= min(inst.workers) < g + n]
        for inst in new:
            self.refresh(inst)
            for rid in list(inst.requests):
                r = self.by_id.get(rid)
                if r is not None:
                    r.inst, r.gpu, r.tp = inst, min(inst.workers), inst.tp
        return new

    def transform(self, kind, g, tp_from, tp_to, sources):
        if self.transforming(g):
            return self.refuse("a transformation is under way")
        for inst in sources:
            self.quiesce(inst)
        moving = [r for r in self.active if r.inst in sources]
        start_wall, start = time.perf_counter(), self.now()
        workers = tuple(range(g, g + max(tp_from, tp_to)))
        from ..reconfig import TransformError
        try:
            t = self.start_transform(workers, tp_to, self.layers_per_step if kind == 0 else None)
        except (TransformError, GygesError) as e:
            self.last_refusal = str(e)
            return self.refuse(f"{('merge', 'split')[kind]}: {type(e).__name__}")
        self.stats["transform_seconds"] += time.perf_counter() - start_wall
        for inst in sources:
            self.cache.pop(inst, None)
            self.layout_events.append((start, min(inst.workers), inst.tp, -1))
        for r in moving:
            r.migrations += 1
        self.stats["n_migrations"] += len(moving)
        row = {"kind": kind, "gpu": g, "tp_from": tp_from, "tp_to": tp_to, "start": start,
               "phase_end": math.nan, "end": math.nan, "migrated": len(moving)}
        self.xforms.append((row, t))
        for inst in self.instances_in(g, len(workers)):
            self.layout_events.append((start, min(inst.workers), inst.tp, +1))
        if t.done:
            self.finish_transform(row, t)
        return True

    def finish_transform(self, row, t):
        if row["kind"] == DROP:   # a live exchange ended
            return self._drop_ended(row, t)
        row["end"] = row["phase_end"] = self.now()
        s = t.stats
        if row["kind"] == RESPLIT:
            row["kv_bytes"] = s.kv_bulk_bytes + s.kv_patch_bytes
            row["weight_bytes"] = s.weight_bytes
            self.stats["n_resplits"] += 1
            self.ended += 1
            return
        n = max(len(t.workers), 1)
        row["kv_bytes"] = sum(s["bytes_received"].values()) / n
        row["weight_bytes"] = (sum(s["weight_bytes_released"].values()) +
                               sum(s["weight_bytes_copied"].values())) / n
        self.stats["n_merges" if row["kind"] == 0 else "n_splits"] += 1
        self.ended += 1

    def sample(self):
        t = self.now()
        staggered = self._staggered()
        for inst in self.serving():
            c = self.cache[inst]
            g = min(inst.workers)
            self.samples.append((t, g, inst.tp, int(bool(staggered & set(inst.workers))),
                                 int(self.ctl.held(g, inst.tp)), c["kv_used"], c["capacity"],
                                 c["running"], c["waiting"]))


def run(trace, policy: str = "gyges", host=None, time_scale: float = 1.0, slo: dict | None = None,
        progress: bool = False, *, layout: str | None = None, seed: int = 0,
        temperature: float = 0.0, method: str = "gyges", layers_per_step: int | None = None,
        idle: str | None = None, time_limit: float | None = None,
        sample_interval: float | None = None, max_tp: int | None = None,
        decode_weight: float | None = None, scale_down_free: float | None = None,
        scale_up_load: float | None = None, scale_up_cap: float | None = None,
        merge_wait: float = 1.0, eager_scale_up: bool | None = None,
        flying_tp: int | None = None, light_load: float | None = None,
        idle_load: float | None = None, record_steps: bool = False, pipeline_cost=None,
        cost=None, cluster=None, migrate: str | None = None,
        decode_tp: int | None = None) -> Results:
    """Replays `trace` (a gyges.traces array) on a real gyges.Host under `policy` (see the
    module docstring); returns gyges.results.Results.

    host: a gyges.Host with no requests (its layout is where the run starts); None builds one:
    the tiny model on 4 CPU workers of 24MiB in `layout` (default 4xTP1). time_scale: wall
    seconds per trace second. Prompts are random tokens (seeded by `seed` and the request's
    index), outputs exactly the trace's lengths (ignore_eos), sampled at `temperature`.
    A request that no TP up to max_tp (default: the host's largest) can hold, or longer than
    the model's positions, has min_tp 0 and every policy rejects it.
    method / layers_per_step: how merges run (host.transform); scale-downs run at once.
    idle: "skip" (jump the clock over idle gaps; the default) or "sleep". time_limit: wall seconds after
    which the run stops (requests still queued stay unfinished, deferred ones unserved).
    sample_interval: seconds between per-instance samples and throughput bins (default about
    1/100 of the scaled trace, at least 0.1 s). The policy knobs are gyges.sim.run's, in the
    host's seconds and tokens, defaults gyges.cluster.DEFAULTS; merge_wait defaults to 1 s here
    (2 s in the simulator), since a real run lasts seconds; gyges' latency mode (light_load,
    idle_load) is off here unless given, since its defaults are GPU tokens. cost: the
    gyges.costmodel CostModel (or ConstantCost, or gyges.cluster.profile.ProfiledCost) of this
    host, whose prefill rates per TP the policies compare placements by and whose step times
    they weigh (gyges' latency mode: a merged pair's decode step against its halves'), as
    gyges.sim.run does with its cost (default: rates proportional to TP, no step times).
    decode_tp: Seesaw's decode TP (policy "seesaw"); None searches it as gyges.sim.run does when
    cost is this host's profile (gyges.cluster.profile.ProfiledCost: its capacities are the
    host's), else max_tp. slo: kept for Results.summary (goodput). record_steps: also keep
    every instance step's batch shape and wall time as `res.steps` (STEP_DTYPE, not saved by
    res.save), the samples CostModel.profiled fits.
    cluster: a gyges.Cluster to replay over instead of one host (gyges/distributed/replay.py):
    every host's GPUs under the one controller, numbered as gyges.sim.run(hosts=N) numbers
    them; policies gyges, least_load, round_robin, static and llumnix (its MIGRATE op moves
    running requests with their KV between replicas on any hosts); idle gaps are slept.
    migrate: how a cluster run's MIGRATE moves a request, "live" (the default: Llumnix's KV
    copy in rounds while it decodes, stopped for the last round only) or "stop" (stop and
    copy); res.stats has migrate_mode, migrate_rounds and migrate_downtime_seconds.
    A pipeline host (one pipeline over every worker, e.g. layout="PP2"; the default host for
    policy "pipelive" is an 8-layer tiny model on workers of 112 and 80 MiB) re-splits live
    (host.reconfigure) when the policy says; pipeline_cost: the gyges.costmodel.PipelineCost it
    prices splits with (default: the workers' budgets and a nominal CPU roofline, under which
    equal CPU workers differ only in memory).
    """
    t_wall = time.perf_counter()
    traces.validate(trace)
    if trace.shape[0] == 0:
        raise ExperimentError("the trace has no requests")
    check_policy(policy, ExperimentError)
    time_scale = _check_number("time_scale", time_scale, 0.0, low_open=True)
    if idle not in (None, "skip", "sleep"):
        raise ExperimentError(f"idle must be 'skip' or 'sleep', got {idle!r}")
    if time_limit is not None:
        time_limit = _check_number("time_limit", time_limit, 0.0, low_open=True)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ExperimentError(f"seed must be an int >= 0, got {seed!r}")
    _check_number("temperature", temperature, 0.0)
    if layers_per_step is not None and (isinstance(layers_per_step, bool) or
                                        not isinstance(layers_per_step, int) or
                                        layers_per_step < 1):
        raise ExperimentError(f"layers_per_step must be a positive int or None, got "
                              f"{layers_per_step!r}")
    if policy == "seesaw" and decode_tp is None and getattr(cost, "kind", None) == "profiled":
        # Seesaw's search, as gyges.sim.run's, over this host's own profile (a ProfiledCost; not
        # imported: profile.py measures hosts through this module)
        decode_tp = seesaw_search.decode_tp(cost, trace, cost.max_tp if max_tp is None
                                            else max_tp, cost.block_size)[0]
    if policy == "gyges":
        light_load = 0.0 if light_load is None else light_load
        idle_load = 0.0 if idle_load is None else idle_load
    pol = Policy(policy, decode_weight=decode_weight, scale_down_free=scale_down_free,
                 scale_up_cap=scale_up_cap, merge_wait=merge_wait, scale_up_load=scale_up_load,
                 eager_scale_up=eager_scale_up, flying_tp=flying_tp, light_load=light_load,
                 idle_load=idle_load, decode_tp=decode_tp)

    n = trace.shape[0]
    arrival = np.asarray(trace["arrival"], np.float64)
    rel = (arrival - arrival[0]) * time_scale
    span = float(rel[-1])
    if sample_interval is None:
        sample_interval = max(0.1, span / 100)
    sample_interval = _check_number("sample_interval", sample_interval, 0.0, low_open=True)

    # told apart by kind: gyges.cluster.profile measures hosts with this module, so it is not
    # imported here
    if cost is not None and getattr(cost, "kind", None) not in ("roofline", "profiled",
                                                                 "constant"):
        raise ExperimentError(f"cost must be a gyges.costmodel.CostModel, ConstantCost or a "
                              f"ProfiledCost, got {type(cost).__name__}")
    if cluster is not None:   # hosts in processes of their own (gyges.distributed)
        replay = getattr(cluster, "replay_executor", None)
        if replay is None:
            raise ExperimentError(f"cluster must be a gyges.Cluster, got {type(cluster).__name__}")
        for name, value in (("host", host), ("layout", layout), ("pipeline_cost", pipeline_cost)):
            if value is not None:
                raise ExperimentError(f"{name}= does not apply to a cluster run: it replays on "
                                      f"the cluster's hosts as they are")
        if record_steps:
            raise ExperimentError("record_steps times each step inside one process; a cluster "
                                  "run does not record them")
        if idle == "skip":
            raise ExperimentError("idle='skip' moves one process's clock; a cluster's hosts keep "
                                  "their own, so a cluster run sleeps (idle='sleep')")
        rp = replay(trace, pol, cluster, time_scale, int(seed), float(temperature), method,
                    layers_per_step, sample_interval, max_tp, cost, policy,
                    migrate=migrate or "live")
    else:
        if migrate is not None:
            raise ExperimentError("migrate= is for a cluster run (cluster=...): one host's "
                                  "executor does not move requests between hosts")
        rp = _host_replay(trace, policy, pol, host, layout, time_scale, seed, temperature,
                          method, layers_per_step, idle or "skip", sample_interval, max_tp,
                          record_steps, pipeline_cost, cost)
    t0 = rp.now()
    for inst in sorted(rp.all_instances(), key=lambda i: min(i.workers)):
        rp.layout_events.append((t0, min(inst.workers), inst.tp, +1))
    for i in range(n):
        prompt, output = int(trace["input_tokens"][i]), int(trace["output_tokens"][i])
        fp = -(-(prompt + output) // rp.block_size)
        min_tp = 0 if prompt + output > rp.max_pos else smallest_tp(fp, rp.capacity)
        rp.reqs.append(_Req(i, prompt, output, fp, min_tp, t0 + float(rel[i]),
                            priority=int(trace["priority"][i])))
    try:
        with progress_bar(enabled=bool(progress), total=n, unit="req",
                          desc=f"experiment {policy}") as bar:
            stopped = _loop(rp, n, t0, t_wall, time_limit, bar if progress else None)
        rp.sample()
        cs = rp.ctl.stats()
        rp.controller_stats = {"n_ops_refused": cs["ops_refused"], "n_decisions": cs["decisions"],
                               "n_rebalances": cs["rebalances"]}
    finally:
        rp.close()
        rp.ctl = None  # the controller holds rp as its executor: no cycle left behind
    res = _results(rp, t0, policy, pol, slo, time.perf_counter() - t_wall, stopped)
    if record_steps:
        res.steps = np.array(rp.steps, dtype=STEP_DTYPE)
    return res


def checked_max_tp(max_tp, n_workers, model_max_tp, tps, layout):
    """max_tp (None: the largest a host of n_workers serves the model at) checked against a
    host of TP groups now at `tps` (its layout `layout`)."""
    if n_workers & (n_workers - 1):
        raise ExperimentError(f"the policies need a power-of-two number of workers (aligned "
                              f"groups), the host has {n_workers}")
    largest = min(model_max_tp, n_workers)
    if max_tp is None:
        max_tp = largest
    elif isinstance(max_tp, bool) or not isinstance(max_tp, int) or max_tp < 1 or \
            max_tp & (max_tp - 1) or max_tp > largest:
        raise ExperimentError(f"max_tp must be a power of two <= {largest}, got {max_tp!r}")
    if max(tps) > max_tp:
        raise ExperimentError(f"the host's layout {layout} has an instance above "
                              f"max_tp={max_tp}")
    return max_tp


def controller_cost(cost, max_tp, chunk):
    """What a cost model gives the controller's view (policy.h), as gyges._C.Controller's
    keywords: the prefill rate per TP level (prompts in chunks of `chunk` tokens) and the model
    itself, which prices the steps a policy weighs. None: neither (rates proportional to TP)."""
    if cost is None:
        return {}
    params = cost.params()
    return {"prefill_rate": _C.sim_prefill_rates(cost.kind, params, max_tp, chunk),
            "cost_kind": cost.kind, "cost_params": params}


def _host_replay(trace, policy, pol, host, layout, time_scale, seed, temperature, method,
                 layers_per_step, idle, sample_interval, max_tp, record_steps, pipeline_cost,
                 cost):
    """The executor of a run on one in-process Host (built here when host is None), its
    policy and knobs checked against the host."""
    from ..runtime.host import Host
    if host is None:
        from ..models.model import Model
        if policy == "pipelive":  # an 8-layer tiny model on two workers of unequal memory
            import dataclasses
            deep = dataclasses.replace(Model.tiny().config, num_hidden_layers=8)
            host = Host(Model.random(deep, seed=1), workers=2,
                        memory_per_worker=["112MiB", "80MiB"], layout=layout or "PP2")
        else:
            host = Host(Model.tiny(), workers=4, memory_per_worker="24MiB",
                        layout=layout or "4xTP1",
                        weights="replicated" if policy == "flying" else "sharded")
    elif not isinstance(host, Host):
        raise ExperimentError(f"host must be a gyges.Host, got {type(host).__name__}")
    elif layout is not None and layout.replace(" ", "") != host.layout():
        raise ExperimentError(f"the host's layout is {host.layout()!r}, not {layout!r}; layout= "
                              f"only applies when run() builds the host")
    if host.has_unfinished():
        raise ExperimentError("the host still serves requests or transforms; give run() an "
                              "idle host")
    if policy == "llumnix":
        raise ExperimentError("policy 'llumnix' migrates running requests live between "
                              "replicas, which one in-process host does not do; replay it on a "
                              "gyges.Cluster (cluster=..., even of one host) or simulate it "
                              "(gyges.sim.run(..., weights='buddy', policy='llumnix'))")
    if policy == "loongserve":
        raise ExperimentError("policy 'loongserve' serves groups of replicas as one sequence-"
                              "parallel instance, and the CPU engine has no sequence-parallel "
                              "plan: simulate it (gyges.sim.run(..., policy='loongserve', "
                              "weights='replicated'))")
    if host.weights == "mixed":
        raise ExperimentError("the controller drives a host whose workers are all sharded or all "
                              "replicated; this one mixes them (weights=[...] per worker)")
    if policy == "flying" and host.replicas is None:
        raise ExperimentError("policy 'flying' binds the replicas of a host built with "
                              "weights='replicated'")
    if policy not in ("flying", "static") and host.replicas is not None:
        raise ExperimentError(f"policy {policy!r} merges and splits by moving shards; a "
                              f"replicated host switches with policy 'flying'")
    n_gpus = host.n_workers
    piped = any(inst.stages for inst in host.instances)
    if piped and (len(host.instances) != 1 or len(host.instances[0].workers) != n_gpus):
        raise ExperimentError(f"a pipeline host runs one pipeline over every worker (PP2, "
                              f"PP[3,1]), not {host.layout()!r}")
    if policy == "kunserve":
        if piped or any(inst.tp != 1 for inst in host.instances):
            raise ExperimentError(f"policy 'kunserve' drops the parameters of whole replicas: "
                                  f"a host of TP1 instances, not {host.layout()!r}")
        if max_tp not in (None, 1):
            raise ExperimentError(f"a buddy host has max_tp 1, got {max_tp!r}")
        max_tp = 1
    if policy == "pipelive" and not piped:
        raise ExperimentError("policy 'pipelive' re-splits a pipeline host (layout='PP2', ...)")
    if piped:
        if max_tp not in (None, 1):
            raise ExperimentError(f"a pipeline host has max_tp 1, got {max_tp!r}")
        max_tp = 1
    else:
        max_tp = checked_max_tp(max_tp, n_gpus, host.max_tp,
                                [inst.tp for inst in host.instances], host.layout())

    if pipeline_cost is not None:
        from .costmodel import PipelineCost
        if not isinstance(pipeline_cost, PipelineCost) or not piped or \
                pipeline_cost.n_stages != len(host.instances[0].stages) or \
                pipeline_cost.model.num_hidden_layers != host.model.config.num_hidden_layers:
            raise ExperimentError("pipeline_cost must be a gyges.costmodel.PipelineCost of the "
                                  "host's pipeline (as many stages, the model's layers)")
    cost_args = controller_cost(cost, max_tp, host.max_prefill_chunk or host.max_batch_tokens)
    return _Replay(trace, pol, host, time_scale, int(seed), float(temperature), method,
                   layers_per_step, idle, sample_interval, max_tp, bool(record_steps),
                   pipeline_cost, buddy=policy == "kunserve", cost_args=cost_args)


def _loop(rp, n, t0, t_wall, time_limit, bar):
    """Arrivals, steps and timers until every request is done (or time_limit); returns whether
    time_limit stopped it. bar: a progress bar of requests done, or None."""
    nxt, next_sample, shown = 0, t0, 0.0
    stuck_since = None
    merge_wait = rp.policy.config["merge_wait"]
    while True:
        now = rp.now()
        if time_limit is not None and time.perf_counter() - t_wall > time_limit:
            return True
        while nxt < n and rp.reqs[nxt].arrival <= now:
            rp.arrive(rp.reqs[nxt])
            nxt += 1
            rp.react()
        if now >= next_sample:
            rp.sample()
            next_sample = now + rp.sample_interval
            # a policy may wait for time alone (merge_wait) or watch the load (gyges, kunserve)
            if rp.n_deferred or rp.policy.monitors:
                rp.control("tick", rp.now())
                rp.react()
        if bar is not None and time.perf_counter() - shown > 1.0:   # (counting is O(n))
            shown = time.perf_counter()
            bar.update(sum(r.status in (FINISHED, REJECTED) for r in rp.reqs) - bar.n)
            bar.set_postfix_str(f"{now - t0:.1f} s, layout {rp.layout()}")
        rp.launch()
        if rp.running:
            stuck_since = None
            until = min(rp.reqs[nxt].arrival, next_sample) if nxt < n else next_sample
            rp.wait(min(max(until - rp.now(), 0.0), 0.25))
            rp.react()
            continue
        # nothing runs
        if rp.n_deferred:
            rp.control("tick", rp.now())
            rp.react()
            if rp.busy():
                continue
            if stuck_since is None:
                stuck_since = rp.now()
        deferred = rp.n_deferred
        if nxt < n:
            rp.skip_to(min(rp.reqs[nxt].arrival, next_sample) if deferred else
                       rp.reqs[nxt].arrival)
            continue
        if not deferred:
            if bar is not None:
                bar.update(sum(r.status in (FINISHED, REJECTED) for r in rp.reqs) - bar.n)
            return False
        # only deferred requests are left and nothing serves: let the policy's timers run out
        if rp.now() - stuck_since > merge_wait + rp.sample_interval:
            return False
        rp.skip_to(rp.now() + rp.sample_interval)


def _results(rp, t0, policy, pol, slo, wall, stopped) -> Results:
    n = len(rp.reqs)
    req = np.zeros(n, REQUEST_DTYPE)
    token_rows = []
    for r, row in zip(rp.reqs, req):
        row["arrival"] = r.arrival - t0
        row["scheduled"] = row["first_token"] = row["finish"] = math.nan
        row["input_tokens"], row["output_tokens"] = r.prompt, r.output
        row["status"], row["min_tp"], row["gpu"], row["tp"] = r.status, r.min_tp, r.gpu, r.tp
        row["preemptions"], row["migrations"] = r.preemptions, r.migrations
        h = r.handle
        if h is None:
            continue
        m = h.metrics
        scheduled = m.scheduled if h.finished else rp.first_scheduled(h)
        if scheduled is not None and scheduled >= 0:
            row["scheduled"] = scheduled - t0
        if m.token_times:
            row["first_token"] = m.token_times[0] - t0
        if h.finished:
            row["finish"] = m.finish - t0
        token_rows += [(r.index, t - t0) for t in m.token_times]
    tokens = np.array(token_rows, dtype=TOKEN_DTYPE)
    bin_s = rp.sample_interval
    end = max(float(np.nanmax(req["finish"])) if np.isfinite(req["finish"]).any() else 0.0,
              float(tokens["time"].max()) if tokens.size else 0.0)
    n_bins = int(end // bin_s) + 1
    bins_output = np.bincount((tokens["time"] // bin_s).astype(np.int64),
                              minlength=n_bins).astype(np.float64)[:n_bins] \
        if tokens.size else np.zeros(n_bins)
    bins_prompt = np.zeros(n_bins)
    started = np.isfinite(req["first_token"])
    np.add.at(bins_prompt, np.minimum((req["first_token"][started] // bin_s).astype(np.int64),
                                      n_bins - 1), req["input_tokens"][started])
    xf = np.zeros(len(rp.xforms), TRANSFORM_DTYPE)
    for out, (row, _) in zip(xf, rp.xforms):
        out["kind"], out["gpu"], out["tp_from"], out["tp_to"] = (row["kind"], row["gpu"],
                                                                 row["tp_from"], row["tp_to"])
        out["start"] = row["start"] - t0
        out["phase_end"] = row["phase_end"] - t0
        out["end"] = row["end"] - t0
        out["kv_bytes"] = row.get("kv_bytes", math.nan)
        out["weight_bytes"] = row.get("weight_bytes", math.nan)
        out["migrated"] = row["migrated"]
        for key in ("layers_from", "layers_to"):  # a re-split's splits
            out[key][:len(row.get(key, ()))] = row.get(key, ())
    lay = np.zeros(len(rp.layout_events), LAYOUT_DTYPE)
    for out, (t, g, tp, change) in zip(lay, rp.layout_events):
        out["time"], out["gpu"], out["tp"], out["change"] = t - t0, g, tp, change
    tl = np.array([(t - t0, *rest) for t, *rest in rp.samples], dtype=TIMELINE_DTYPE)
    config = {"policy": policy, **rp.executor_config(), "workers": rp.n_gpus,
              "gpus_per_host": rp.gpus_per_host,
              "layout": rp.initial_layout, "max_tp": rp.max_tp,
              "capacity_blocks": rp.capacity.tolist(), "block_size": rp.block_size,
              "watermark": 0.0,
              "time_scale": rp.time_scale, "idle": rp.idle, "method": rp.method,
              "layers_per_step": rp.layers_per_step, "seed": rp.seed,
              "temperature": rp.temperature, **pol.config,
              "sample_interval": rp.sample_interval, "record_tokens": True}
    status = req["status"]
    stats = {"now": rp.now() - t0, "n_requests": n,
             "n_arrived": int(sum(r.status != PENDING for r in rp.reqs)),
             "n_finished": int((status == FINISHED).sum()),
             "n_rejected": int((status == REJECTED).sum()),
             "n_deferred": int((status == DEFERRED).sum()), "stopped_by_time_limit": stopped,
             "final_layout": rp.layout(), **rp.stats, **rp.controller_stats}
    return Results(requests=req, timeline=tl, layout=lay, transformations=xf,
                   bins_output=bins_output, bins_prompt=bins_prompt, bin_seconds=bin_s,
                   config=config, stats=stats, slo=slo, wall_seconds=wall, tokens=tokens)

