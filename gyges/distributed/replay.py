"""A trace replayed over the hosts of a gyges.Cluster by the one cluster controller.

    res = gyges.experiment.run(trace, policy="gyges", cluster=cluster, time_scale=0.1)

The controller (csrc/cluster/controller.h) is the one the simulator and the in-process executor
(gyges/cluster/experiment.py) drive; this is its third executor. It sees the cluster as
`hosts x workers_per_host` GPUs, host h's worker w being GPU h * workers_per_host + w, as
gyges.sim.run(hosts=N, gpus_per_host=W) numbers them, so a policy decides here exactly what it
decides at paper scale. The ops, over Ray:

    instances()    every instance of every live host, from each host's loads() (read between
                   two of its steps) plus the requests placed since
    assign()       Cluster.submit of the request to the chosen host and instance
    reconfigure()  a merge or a split: cluster.host(h).transform(...) on the host that holds
                   those GPUs (groups never span hosts); hosts transform at the same time,
                   one transformation at a time on each

Hosts step on their own (host_actor.py), so nothing here paces them: the driver wakes when a
request finishes (a cluster listener) or when the next arrival or sample is due, reads the
hosts' loads and asks the controller. A host that dies drops out of the view (its GPUs have no
instance), its requests are recomputed on the hosts left (Cluster._lost), and a transformation
it was running is recorded as abandoned; where each request is comes from the hosts' reports,
so a resubmitted or migrated request is followed.

Time is the driver's clock (time.monotonic, the clock of the ClusterRequest metrics): arrivals
are slept to (idle="sleep"); there is no single clock to skip.
"""
import math
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from .. import _C
from ..cluster.experiment import (QUEUED, ExperimentError, _Replay, checked_max_tp,
                                  controller_cost)
from ..cluster.policy import INST_VIEW_DTYPE, MIGRATE, XFORM_LOST
from ..core.errors import Error, StateError

__all__ = ["ClusterReplay", "RemoteInstance"]

# the policies that place requests and merge or split TP groups of sharded hosts, and
# Llumnix's, which moves running requests with their KV between TP1 replicas (any hosts)
POLICIES = ("gyges", "least_load", "round_robin", "static", "llumnix")
# how MIGRATE moves a request: Llumnix's multi-round live copy, or stop and copy
MIGRATE_MODES = ("live", "stop")


@dataclass(frozen=True)
class RemoteInstance:
    """An instance of a cluster's host as the controller sees it: its GPUs in the cluster's
    numbering and its TP (its identity), and where it is on its host."""
    host: int
    workers: tuple            # cluster GPU numbers
    tp: int
    index: int = field(compare=False)          # into that host's instances
    local: tuple = field(compare=False)        # the host's own worker numbers
    stages: tuple = field(default=(), compare=False)


class ClusterReplay(_Replay):
    """experiment.run's executor over a gyges.Cluster (see the module docstring)."""

    def __init__(self, trace, policy, cluster, time_scale, seed, temperature, method,
                 layers_per_step, sample_interval, max_tp, cost, policy_name, migrate="live"):
        if policy_name not in POLICIES:
            raise ExperimentError(f"policy {policy_name!r} on a cluster: its hosts merge and "
                                  f"split TP groups of sharded workers ({', '.join(POLICIES)}); "
                                  f"replay {policy_name!r} on one host (host=) or simulate it")
        if migrate not in MIGRATE_MODES:
            raise ExperimentError(f"migrate={migrate!r}: expected one of "
                                  f"{', '.join(MIGRATE_MODES)}")
        self.migrate_live = migrate == "live"
        self.cluster = cluster
        self.host = None
        if len(cluster.live_hosts) != cluster.n_hosts:
            raise ExperimentError(f"the cluster has lost hosts {sorted(cluster.lost_hosts)}; "
                                  f"replay on a whole cluster")
        facts = [cluster.host(h)._call_actor("facts") for h in range(cluster.n_hosts)]
        first = facts[0]
        for h, f in enumerate(facts):
            if f["unfinished"]:
                raise ExperimentError(f"host {h} still serves requests or transforms; give "
                                      f"run() an idle cluster")
            if f["weights"] != "sharded" or f["piped"]:
                raise ExperimentError(f"host {h} is {f['layout']!r} with {f['weights']} weights; "
                                      f"a cluster run merges and splits TP groups of sharded "
                                      f"workers")
            for key in ("n_workers", "capacity", "block_size", "memory_per_worker", "model"):
                if f[key] != first[key]:
                    raise ExperimentError(f"hosts 0 and {h} differ in {key} ({first[key]!r} vs "
                                          f"{f[key]!r}); the controller sees equal hosts")
        w = first["n_workers"]
        if policy_name == "llumnix":
            if max_tp not in (None, 1):
                raise ExperimentError(f"policy 'llumnix' moves requests between TP1 replicas: "
                                      f"max_tp 1, got {max_tp!r}")
            max_tp = 1
        max_tp = checked_max_tp(max_tp, w, first["model_max_tp"],
                                [tp for f in facts for tp in f["tps"]],
                                " | ".join(f["layout"] for f in facts))
        capacity = first["capacity"][:max_tp.bit_length()]   # (TP 1, 2, ..., max_tp)
        self.facts = first
        self.n_gpus, self.gpus_per_host = w * cluster.n_hosts, w
        self.views = {}              # host -> (layout, [RemoteInstance])
        self.begin(trace, policy, time_scale, seed, temperature, method, layers_per_step,
                   "sleep", sample_interval, max_tp, capacity, first["block_size"],
                   first["max_pos"], first["vocab"], "")
        self.stats.update({"n_hosts_lost": 0, "n_transformations_abandoned": 0,
                           "n_live_migrations": 0, "n_migrations_between_hosts": 0,
                           "migrate_bytes": 0, "n_load_reads": 0, "load_read_seconds": 0.0,
                           "migrate_mode": migrate, "migrate_rounds": 0,
                           "migrate_downtime_seconds": 0.0})
        self._woken = threading.Event()
        cluster.add_listener(self._heard)
        self.ctl = _C.Controller(
            self, policy.handle, self.n_gpus, w, max_tp, self.capacity.tolist(),
            self.block_size, 0.0,
            **controller_cost(cost, max_tp,
                              first["max_prefill_chunk"] or first["max_batch_tokens"]))
        self.fetch()
        self.initial_layout = self.layout()

    # ---- what the hosts report ----
    def _heard(self, handles):
        if any(h.finished for h in handles):
            self._woken.set()

    def fetch(self, hosts=None):
        """Reads the loads of `hosts` (default every live one) into the view and the cache, and
        where each request of this run is now. A host found lost leaves the view."""
        start = time.perf_counter()
        hosts = list(self.cluster.live_hosts) if hosts is None else hosts
        ray = self.cluster._ray
        refs = {h: self.cluster._actors[h].loads.remote() for h in hosts
                if h in self.cluster.live_hosts}
        where = {}
        for h, ref in refs.items():
            try:
                layout, rows = self.cluster._get(h, ref)
            except StateError:    # lost: Cluster._lost has sent its requests elsewhere
                continue
            except ray.exceptions.RayError:   # pragma: no cover - a call lost in transit
                continue
            base = h * self.gpus_per_host
            insts = []
            for row in rows:
                inst = RemoteInstance(h, tuple(base + w for w in row["workers"]), row["tp"],
                                      row["index"], tuple(row["workers"]))
                insts.append(inst)
                self.cache[inst] = {k: row[k] for k in ("capacity", "running", "waiting",
                                                         "kv_used", "computed", "preemptions")}
                self.cache[inst]["transforming"] = row["transforming"]
                for rid in row["rids"]:
                    where[rid] = inst
            for old in set(self.views.get(h, ("", []))[1]) - set(insts):
                self.cache.pop(old, None)   # (gone with a merge or a split)
            self.views[h] = (layout, insts)
        self._drop_lost()
        for r in self.active:
            inst = where.get(r.handle.id)
            if inst is not None and inst != r.inst:
                if r.inst is not None and r.inst.host != inst.host:
                    r.migrations += 1     # resubmitted after a loss, or migrated
                    self.stats["n_migrations"] += 1
                r.inst, r.gpu, r.tp = inst, inst.workers[0], inst.tp
        self.stats["n_load_reads"] += 1
        self.stats["load_read_seconds"] += time.perf_counter() - start

    def _drop_lost(self):
        now = self.now()
        for h in [h for h in self.views if h not in self.cluster.live_hosts]:
            _, insts = self.views.pop(h)
            self.stats["n_hosts_lost"] += 1
            for inst in insts:
                self.cache.pop(inst, None)
                self.layout_events.append((now, inst.workers[0], inst.tp, -1))

    def serving(self):
        return [inst for h in sorted(self.views) for inst in self.views[h][1]]

    def all_instances(self):
        return self.serving()

    def layout(self):
        return " | ".join(self.views[h][0] if h in self.views else "lost"
                          for h in range(self.cluster.n_hosts))

    def refresh(self, inst):
        """(The hosts' loads come in together, fetch.)"""

    # ---- clock and waiting ----
    def now(self):
        return time.monotonic()

    def skip_to(self, t):
        time.sleep(max(0.0, t - self.now()))

    @property
    def running(self):
        """Whether anything is under way (the hosts step on their own)."""
        return bool(self.active) or any(math.isnan(row["end"]) for row, _ in self.xforms)

    def busy(self):
        return self.running

    def launch(self):
        """(The hosts step on their own.)"""

    def quiesce(self, inst):
        """(A host orders a submit or a transformation with its steps itself.)"""

    def wait(self, timeout):
        if self._woken.wait(timeout):
            self._woken.clear()
        self.collect()

    def collect_transforms(self):
        """The transformations that ended, or were abandoned with their host."""
        for row, t in self.xforms:
            if not math.isnan(row["end"]):
                continue
            try:
                t.refresh()
            except (StateError, self.cluster._ray.exceptions.RayError):
                row["end"] = row["phase_end"] = self.now()
                row["abandoned"] = True
                self.stats["n_transformations_abandoned"] += 1
                self.ended += 1
                continue
            if t._fields["done"]:
                self.finish_transform(row, t)

    def _staggered(self):
        out = set()
        for inst in self.serving():
            if self.cache[inst]["transforming"]:
                out |= set(inst.workers)
        return out

    def control(self, method, *args):
        self.fetch()
        super().control(method, *args)

    # ---- the controller's ops ----
    def view_rows(self):
        """The live hosts' instances, and a lost host's GPUs as lost instances of max_tp
        (never placeable, never in a group to build: the controller wants every GPU owned)."""
        rows = super().view_rows()
        lost = [h for h in range(self.cluster.n_hosts) if h not in self.views]
        if not lost:
            return rows
        extra = np.zeros(len(lost) * (self.gpus_per_host // self.max_tp), INST_VIEW_DTYPE)
        firsts = [h * self.gpus_per_host + k for h in lost
                  for k in range(0, self.gpus_per_host, self.max_tp)]
        extra["gpu_first"], extra["tp"] = firsts, self.max_tp
        extra["host"] = [g // self.gpus_per_host for g in firsts]
        extra["xform"], extra["kv_total"] = XFORM_LOST, 1
        rows = np.concatenate([rows, extra])
        return rows[np.argsort(rows["gpu_first"], kind="stable")]

    def _inst_at(self, g, tp):
        for inst in self.serving():
            if inst.workers[0] == g and inst.tp == tp:
                return inst
        return None

    def submit(self, r, inst):
        tokens, params = self.request_of(r)
        try:
            r.handle = self.cluster.submit(tokens, params, host=inst.host, instance=inst.index)
        except StateError:   # its host was lost just now: the least loaded one takes it
            r.handle = self.cluster.submit(tokens, params)
        r.inst, r.gpu, r.tp = inst, inst.workers[0], inst.tp
        if r.handle.host != inst.host:
            r.inst = None     # (where is known at the next fetch)
        r.status = QUEUED
        self.by_id[r.handle.id] = r
        self.active.append(r)

    def reconfigure(self, kind, g, size, layers=(), target=-1):
        if kind not in (0, 1, MIGRATE):
            return self.refuse(f"op kind {kind}: a cluster's hosts merge and split TP groups "
                               f"and move requests")
        return super().reconfigure(kind, g, size, layers, target)

    def migrate(self, g, target):
        """Llumnix: of the running requests of the instance at GPU g, the one with the least KV
        whose footprint fits the free blocks of the instance at GPU `target` moves there with
        its KV (Cluster.migrate, live unless run(migrate="stop"): its KV copied in rounds while
        it decodes, through Ray's object store; between two instances of one host too), its
        tokens going on where they were. One that finishes during the rounds stays: refused."""
        src = next((i for i in self.serving() if i.workers[0] == g), None)
        dst = next((i for i in self.serving() if i.workers[0] == target), None)
        if src is None or dst is None or src == dst:
            return self.refuse(f"migrate: no instances at GPUs {g} and {target}")
        if self.cache[src]["transforming"] or self.cache[dst]["transforming"]:
            return self.refuse("migrate: an instance is reconfiguring")
        room = self.cache[dst]["capacity"] - self.cache[dst]["kv_used"]
        candidates = [r for r in self.active if r.inst == src and r.handle.output_tokens and
                      not r.handle.finished and r.footprint <= room]
        if not candidates:
            return self.refuse("migrate: no running request fits the destination")
        r = min(candidates, key=lambda r: r.prompt + len(r.handle.output_tokens))
        try:
            moved = self.cluster.migrate(r.handle, dst.host, instance=dst.index,
                                         live=self.migrate_live)
        except Error as e:
            self.last_refusal = str(e)
            return self.refuse(f"migrate: {type(e).__name__}")
        m = r.handle.last_migration
        if m.outcome != "moved":
            return self.refuse(f"migrate: the request {m.outcome} on its source")
        r.inst, r.gpu, r.tp = dst, dst.workers[0], dst.tp
        r.migrations += 1
        self.stats["n_migrations"] += 1
        self.stats["n_live_migrations"] += 1
        self.stats["n_migrations_between_hosts"] += src.host != dst.host
        self.stats["migrate_bytes"] += moved
        self.stats["migrate_rounds"] += len(m.rounds)
        self.stats["migrate_downtime_seconds"] += m.downtime
        self.fetch(sorted({src.host, dst.host}))   # their loads after the move
        return True

    def transforming(self, g):
        h = g // self.gpus_per_host
        return any(math.isnan(row["end"]) and row["gpu"] // self.gpus_per_host == h
                   for row, _ in self.xforms)

    def transform(self, kind, g, tp_from, tp_to, sources):
        try:
            return super().transform(kind, g, tp_from, tp_to, sources)
        except StateError:   # its host was lost once it began: recorded as abandoned
            return True      # (collect_transforms), as a loss later in it is

    def start_transform(self, workers, tp, layers_per_step):
        h = workers[0] // self.gpus_per_host
        local = [w - h * self.gpus_per_host for w in workers]
        try:
            return self.cluster.host(h).transform(workers=local, tp=tp, method=self.method,
                                                  layers_per_step=layers_per_step)
        except StateError as e:   # lost: refused like any op the state does not allow
            raise Error(str(e)) from None

    def instances_in(self, g, n):
        self.fetch([g // self.gpus_per_host])
        return [inst for inst in self.serving() if g <= inst.workers[0] < g + n]

    # ---- results ----
    def first_scheduled(self, handle):
        return handle.metrics.scheduled   # (placed on the driver's clock by its first token)

    def executor_config(self):
        f = self.facts
        return {"executor": "gyges.Cluster", "model": f["model"], "hosts": self.cluster.n_hosts,
                "memory_per_worker": f["memory_per_worker"], "page_size": f["page_size"],
                "max_batch_tokens": f["max_batch_tokens"], "max_running": f["max_running"],
                "max_prefill_chunk": f["max_prefill_chunk"]}

    def close(self):
        self.cluster.remove_listener(self._heard)
        handles = [r.handle for r in self.reqs if r.handle is not None]
        self.stats["n_resubmitted"] = sum(h.resubmitted for h in handles)
        self.stats["recompute_mismatches"] = sum(h.recompute_mismatches for h in handles)
