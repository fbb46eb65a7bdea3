"""gyges.Cluster: hosts in processes of their own, placed on the nodes of a Ray cluster.

    cluster = gyges.Cluster(gyges.Model.tiny(), hosts=2, workers_per_host=4, layout="4xTP1")
    handles = cluster.generate(prompts, params)       # each request served by one host
    h = cluster.submit(prompt, params)                # its tokens stream into h.output_tokens
    cluster.wait([h], timeout=10)
    r = cluster.host(0).transform(workers=(0, 1, 2, 3), tp=4)   # a Host verb on host 0
    r.wait(); r.committed
    cluster.close()

Each host is a gyges.Host inside a Ray actor (distributed/host_actor.py) that steps on its own
whenever it has work; the driver only places requests and collects tokens. Ray, not a protocol
of our own, carries the calls: it is what vLLM and Llumnix scale out on, it starts processes on
other machines, and it tells the driver when one dies. `ray_address=None` starts a local Ray (as
ray.init() does) unless this process is already connected to one; an address ("auto",
"ray://...", "host:port") joins that cluster. Host i goes to node i mod (alive nodes), so hosts
take one node each while nodes last.

The model travels by its source (Model.source: a packaged name, a path, or the seed of a random
one), never as pickled weights: each host loads it itself.

A host that dies (its process killed, its node lost) is noticed by the driver's call that waits
on it; its unfinished requests are submitted again to the hosts left and recomputed from their
prompts. The tokens a request had already streamed are not sent twice: the recomputation must
give them again (tokens do not depend on the plan or the host), which the handle checks
(`recompute_mismatches`, 0 unless exactness breaks), then it goes on streaming.
"""
import dataclasses
import itertools
import logging
import math
import os
import threading
import time

from ..core import checks
from ..core.errors import (ArgumentTypeError, DependencyError, Error, InvalidArgumentError,
                           StateError)
from ..models.model import Model, load_tokenizer
from ..models.tokenizer import tokenize_prompt
from ..runtime.engine import Request, check_params, mix_seed
from .host_actor import HostActor
from .split_group import SplitBuddy

log = logging.getLogger(__name__)

# How long a host's long poll waits for tokens before it returns empty, and the least time
# between two polls of one host: tokens reach the driver in batches of at most that age, and a
# host that steps faster does not pay a Ray call per step (bench_cluster.py's overhead).
POLL_SECONDS = 0.05
STREAM_SECONDS = 0.02


def _ray():
    try:
        import ray
    except ImportError as e:
        raise DependencyError(f"gyges.Cluster runs its hosts on Ray, which is not installed "
                              f"here ({e}); pip install ray (make demo installs the pinned one)") from None
    return ray


def model_source(model):
    """What a host process loads: a Model's source, or a packaged name or path given as such."""
    if isinstance(model, Model):
        if model.source is None:
            raise InvalidArgumentError("model: a Model built from arrays cannot travel to other "
                                       "processes; save it (model.save(path)) and pass the path, "
                                       "or use Model.load / Model.random / Model.tiny")
        return model.source
    if isinstance(model, (str, os.PathLike)):
        return ("tiny",) if model == "tiny" else ("load", os.fspath(model), "f32")
    raise ArgumentTypeError(f"model must be a gyges.Model, a packaged model's name or a path, "
                            f"got {type(model).__name__}")


def _unwrapped(e):
    """The gyges.Error a host raised, out of Ray's wrapping (its message without the remote
    traceback), or None."""
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, Error) else None


class ClusterRequest(Request):
    """A request of a cluster, a gyges.Request built on the driver from what its host streams:
    its tokens so far (text too when the cluster's model has a tokenizer), whether it finished
    and why, and its metrics in the driver's clock; which host serves it (`host`), how often it
    was submitted again after its host was lost (`resubmitted`) or moved with its KV
    (`migrations`)."""

    def __init__(self, request_id, prompt, params, detokenizer=None, prompt_text=None):
        super().__init__(request_id, prompt, params, time.monotonic(), detokenizer, prompt_text)
        self.host = None
        self.resubmitted = 0
        self.migrations = 0
        self.recompute_mismatches = 0
        self.last_migration = None   # a Migration
        self._received = 0   # tokens the current host has sent
        self._epoch = 0      # which placement of it the current host serves (updates name it)
        self._done = threading.Event()

    def _place(self, host):
        """It goes to `host` (submitted, resubmitted or migrated there): that host's tokens
        count from the first again, and only updates of this placement are taken. Returns the
        placement's epoch, which travels with it to the host."""
        self.host, self._received = host, 0
        self._epoch += 1
        return self._epoch

    def _take(self, tokens, queued=None, scores=None):
        """Tokens from the current host: those a recomputation or a migration gives again are
        checked, the rest appended. queued: the host's seconds from scheduling the request to
        its first token, which place `metrics.scheduled` on the driver's clock. scores: the
        host's (logprobs entries of these tokens, cumulative_logprob, prompt_logprobs)."""
        entries, cumulative, prompt = scores if scores is not None else (None, None, None)
        for i, t in enumerate(tokens):
            if self._received < len(self.output_tokens):
                self.recompute_mismatches += self.output_tokens[self._received] != t
            else:
                self._append(t, time.monotonic())
                if self.logprobs is not None and entries is not None:
                    self.logprobs.append(entries[i])
            self._received += 1
        if cumulative is not None and self._received >= len(self.output_tokens):
            self.cumulative_logprob = cumulative   # (the host's covers every token it made)
        if prompt is not None and self.prompt_logprobs is not None:
            self.prompt_logprobs = list(prompt)
        if queued is not None and self.metrics.token_times and \
                math.isnan(self.metrics.scheduled):
            self.metrics.scheduled = self.metrics.token_times[0] - queued

    def _end(self, reason, error=None, now=None):
        super()._end(reason, error, time.monotonic() if now is None else now)
        self._done.set()

    def __repr__(self):
        state = f"finished ({self.finish_reason})" if self.finished else "running"
        return (f"ClusterRequest(id={self.id}, host={self.host}, "
                f"output={len(self.output_tokens)} tokens, {state})")


@dataclasses.dataclass
class Migration:
    """What one Cluster.migrate did (ClusterRequest.last_migration)."""
    mode: str                 # "live" (multi-round copy) or "stop" (stop and copy)
    source: int
    destination: int
    rounds: list = dataclasses.field(default_factory=list)   # KV bytes of each live round
    final_bytes: int = 0      # KV bytes moved while the request was stopped
    # driver's seconds from asking the source to stop it to its admission at the destination
    # (its step in flight and the Ray calls included): the request's downtime
    downtime: float = math.nan
    outcome: str = None       # "moved", "finished" (on its source, during the rounds), "refused"

    @property
    def bytes(self):
        return sum(self.rounds) + self.final_bytes


class RemoteReconfiguration:
    """A reconfiguration running on one host of a cluster: the fields of a gyges Reconfiguration
    (state, done, committed, rolled_back, blocked_by, error as text, stats), read from the host
    when asked while it runs."""

    def __init__(self, host, rid, fields):
        self.host, self.id, self._fields = host, rid, fields

    def refresh(self):
        if not self._fields["done"]:
            self._fields = self.host._call_actor("describe", self.id)
        return self

    def __getattr__(self, name):
        if name.startswith("_") or name not in self.__dict__.get("_fields", {}):
            raise AttributeError(name)
        return self.refresh()._fields[name]

    def wait(self, timeout=None):
        """Waits until it has ended (the host steps it on its own); returns done."""
        end = None if timeout is None else time.monotonic() + timeout
        while not self.refresh()._fields["done"]:
            if end is not None and time.monotonic() > end:
                break
            time.sleep(0.005)
        return self._fields["done"]

    def __repr__(self):
        return f"RemoteReconfiguration({self._fields['kind']} on host {self.host.index}, " \
               f"{self._fields['state']})"


class HostProxy:
    """Host i of a cluster, with the Host verbs. Instances are named by their index into the
    host's instances (host.instances on a Host), a buddy group by its RemoteReconfiguration."""

    def __init__(self, cluster, index):
        self.cluster, self.index = cluster, index

    @property
    def actor(self):
        return self.cluster._actors[self.index]

    @property
    def alive(self):
        return self.index in self.cluster.live_hosts

    def _call_actor(self, method, *args):
        return self.cluster._get(self.index, getattr(self.actor, method).remote(*args))

    def _reconfigure(self, verb, *args, **kwargs):
        rid, fields = self._call_actor("call", verb, args, kwargs)
        return RemoteReconfiguration(self, rid, fields)

    def transform(self, workers, tp, **kwargs):
        return self._reconfigure("transform", list(workers), tp, **kwargs)

    def reconfigure(self, instance, layers, **kwargs):
        return self._reconfigure("reconfigure", instance, list(layers), **kwargs)

    def switch(self, workers, tp, **kwargs):
        return self._reconfigure("switch", list(workers), tp, **kwargs)

    def buddy(self, instances, **kwargs):
        return self._reconfigure("buddy", list(instances), **kwargs)

    def restore(self, buddy, **kwargs):
        if not isinstance(buddy, RemoteReconfiguration) or buddy.host is not self:
            raise InvalidArgumentError(f"buddy must be a group this host formed "
                                       f"(cluster.host({self.index}).buddy), got {buddy!r}")
        return self._reconfigure("restore", buddy.id, **kwargs)

    def layout(self):
        return self._call_actor("call", "layout")

    def memory(self):
        return self._call_actor("call", "memory")

    def stats(self):
        return self._call_actor("call", "stats")

    def steps(self):
        return self._call_actor("steps")

    def info(self):
        return self._call_actor("info")

    def __repr__(self):
        return f"HostProxy({self.index}, {'alive' if self.alive else 'lost'})"


class Cluster:
    def __init__(self, model, hosts=2, workers_per_host=4, layout=None, backend="cpu",
                 memory_per_worker=None, ray_address=None, seed=0, **host_options):
        checks.integer("hosts", hosts, lo=1)
        # a request without a seed draws from (seed, its cluster id), as on one Host
        self.seed = checks.integer("seed", seed, lo=0, hi=2**64 - 1)
        checks.integer("workers_per_host", workers_per_host, lo=1)
        self.source = model_source(model)
        # the driver's own copy, when given one (its config and tokenizer; a server's front)
        self.model = model if isinstance(model, Model) else None
        self.tokenizer = (self.model.tokenizer if self.model is not None else
                          load_tokenizer(self.source[1]) if self.source[0] == "load" else None)
        self.workers_per_host = workers_per_host
        self._listeners = []
        ray = self._ray = _ray()
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(address=ray_address, include_dashboard=False, log_to_driver=False,
                     configure_logging=False)
        elif ray_address is not None:
            raise StateError(f"ray_address={ray_address!r}: this process is already connected "
                             f"to a Ray cluster; leave ray_address out to use it")
        options = dict(host_options, workers=workers_per_host, layout=layout, backend=backend,
                       memory_per_worker=memory_per_worker)
        self._lock = threading.Lock()
        self._handles = {}       # request id -> ClusterRequest, until it finishes
        self._ids = itertools.count()
        self._closing = False
        self._actors, self._nodes = [], []
        self.live_hosts = []
        self.lost_hosts = {}     # index -> why
        self.groups = []         # buddy groups split between hosts (SplitBuddy), formed
        self._broken = {}        # lost host -> the groups its loss dissolved
        try:
            self._start_hosts(hosts, options, backend)
        except BaseException:
            self._shutdown()
            raise
        self._pollers = [threading.Thread(target=self._poll, args=(i,), daemon=True,
                                          name=f"gyges-cluster-poll-{i}") for i in range(hosts)]
        for t in self._pollers:
            t.start()

    # ---- hosts ----
    def _start_hosts(self, hosts, options, backend):
        ray = self._ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        nodes = sorted((n for n in ray.nodes() if n["Alive"]), key=lambda n: n["NodeID"])
        here = ray.get_runtime_context().get_node_id()
        nodes.sort(key=lambda n: n["NodeID"] != here)   # the driver's node first
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        actor_class = ray.remote(HostActor)
        for i in range(hosts):
            node = nodes[i % len(nodes)]["NodeID"]
            actor = actor_class.options(
                max_concurrency=8, num_cpus=0,
                num_gpus=options["workers"] if backend == "cuda" else 0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                runtime_env={"env_vars": {"PYTHONPATH": path}},
            ).remote(self.source, options)
            self._actors.append(actor)
            self._nodes.append(node)
        for i, actor in enumerate(self._actors):   # each host built, or its error raised here
            try:
                ray.get(actor.info.remote())
            except ray.exceptions.RayError as e:
                raise Error(f"host {i} could not start: {e}") from None
            self.live_hosts.append(i)

    def host(self, index):
        """Host `index`, with the Host verbs (a HostProxy)."""
        checks.integer("index", index, 0, len(self._actors) - 1)
        return HostProxy(self, index)

    @property
    def n_hosts(self):
        return len(self._actors)

    def _get(self, index, ref):
        """ray.get of a call to host `index`: its gyges.Error raised as such; a host that is
        gone raises StateError."""
        ray = self._ray
        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as e:
            self._lost(index, str(e).splitlines()[0])
            raise StateError(f"host {index} is lost: {self.lost_hosts[index]}") from None
        except ray.exceptions.RayTaskError as e:
            cause = _unwrapped(e)
            if cause is not None:
                raise cause from None
            raise

    # ---- requests ----
    def _least_loaded(self, exclude=()):
        load = {i: 0 for i in self.live_hosts if i not in exclude}
        for h in self._handles.values():
            if h.host in load:
                load[h.host] += 1
        return min(load, key=lambda i: (load[i], i)) if load else None

    def submit(self, prompt, params=None, host=None, instance=None):
        """Places a request on `host` (an index) or the live host with the fewest unfinished
        requests; returns its ClusterRequest, whose tokens stream in as the host serves it. A
        bad prompt or parameter raises the host's gyges.Error and queues nothing. A host found
        lost by this very call: a chosen one is replaced by the next least loaded; a named one
        raises StateError, unless the loss has already sent the request to another host (then
        it is served there, h.host says where)."""
        params = check_params(params)
        tokens, text = tokenize_prompt(prompt, self.tokenizer)
        if isinstance(tokens, str):
            raise InvalidArgumentError("prompt: this cluster's model has no tokenizer; give "
                                       "token ids")
        tokens = list(tokens)
        detokenizer = (self.tokenizer.detokenizer(tokens) if self.tokenizer is not None
                       else None)
        chosen = host is None
        if not chosen:
            checks.integer("host", host, 0, len(self._actors) - 1)
        h = ClusterRequest(None, tokens, params, detokenizer, text)
        while True:
            with self._lock:
                self._check_open()
                if chosen:
                    host = self._least_loaded()
                    if host is None:
                        raise StateError("every host of the cluster was lost")
                elif host not in self.live_hosts:
                    raise StateError(f"host {host} is lost: {self.lost_hosts.get(host)}")
                if h.id is None:
                    h.id = next(self._ids)
                    if params.seed is None:  # fixed here: a resubmission draws the same tokens
                        params = h.params = dataclasses.replace(params, seed=mix_seed(self.seed, h.id))
                epoch = h._place(host)
                self._handles[h.id] = h
            try:
                self._get(host, self._actors[host].submit.remote(h.id, tokens, params, instance,
                                                                  epoch))
                return h
            except StateError:
                with self._lock:
                    if h._epoch != epoch and self._handles.get(h.id) is h:
                        return h   # the loss already sent it to another host
                    self._handles.pop(h.id, None)
                if not chosen:
                    raise
            except BaseException:
                with self._lock:
                    self._handles.pop(h.id, None)
                raise

    def generate(self, prompts, params=None, timeout=None):
        """Submits every prompt and waits for them all; returns their handles in order."""
        handles = [self.submit(p, params) for p in prompts]
        if not self.wait(handles, timeout):
            raise Error(f"generate: {sum(not h.finished for h in handles)} of {len(handles)} "
                        f"requests unfinished after {timeout} s")
        return handles

    def wait(self, handles, timeout=None):
        """Waits until every handle has finished; False if `timeout` seconds pass first."""
        end = None if timeout is None else time.monotonic() + timeout
        for h in handles:
            left = None if end is None else max(0.0, end - time.monotonic())
            if not h._done.wait(left):
                return False
        return True

    def abort(self, handle):
        """Finishes a request wherever it is served (finish_reason "abort")."""
        return bool(self._get(handle.host, self._actors[handle.host].abort.remote(handle.id)))

    def add_listener(self, fn):
        """fn(handles) is called, on a driver thread, with the handles whose tokens or end
        have just arrived (a server's streams)."""
        self._listeners.append(fn)

    def remove_listener(self, fn):
        if fn in self._listeners:
            self._listeners.remove(fn)

    @property
    def replay_executor(self):
        """The executor gyges.experiment.run(trace, cluster=...) replays a trace with."""
        from .replay import ClusterReplay
        return ClusterReplay

    # ---- requests between hosts ----
    def migrate(self, handle, host, instance=None, live=False, max_rounds=8, stop_blocks=2):
        """Moves a running request with its KV to `host`, onto its `instance` (an index into its
        instances; default: where its pool places it; on the request's own host, another
        instance of it); its tokens go on the same as if it had stayed. The KV travels from the
        source's process to the destination's through Ray's object store, never through the
        driver. Refused (a gyges.Error, the request where it was) for a request that finished
        or whose instance is reconfiguring. Returns the KV bytes moved; handle.last_migration
        (a Migration) says how.

        live=False, stop and copy: the source takes the request out between two of its steps
        (Host.export_request) and the destination goes on from there; when the destination
        cannot take it, it goes back to its source (recomputed there if its room went
        meanwhile).

        live=True, Llumnix's multi-round copy: while the request decodes on, round 1 copies the
        KV of its tokens so far into sequences the destination reserves, each later round the
        tokens computed since the round before; once a round copied at most `stop_blocks` KV
        blocks, or after `max_rounds` rounds, the source stops it and the last tokens' KV and
        the request go over, its KV kept at the source until the destination has it. Its
        downtime is that last round. A destination that refuses or is lost before it has the
        request leaves it on its source as it was (the reservation freed); a request that
        finishes on its source during the rounds is left there (returns 0, outcome
        "finished")."""
        if not isinstance(handle, ClusterRequest):
            raise ArgumentTypeError(f"handle must be a ClusterRequest, got {type(handle).__name__}")
        checks.integer("host", host, 0, len(self._actors) - 1)
        if not isinstance(live, bool):
            raise ArgumentTypeError(f"live must be True or False, got {live!r}")
        checks.integer("max_rounds", max_rounds, lo=1)
        checks.integer("stop_blocks", stop_blocks, lo=0)
        with self._lock:
            self._check_open()
            if host not in self.live_hosts:
                raise StateError(f"host {host} is lost: {self.lost_hosts.get(host)}")
            if handle.finished or self._handles.get(handle.id) is not handle:
                raise InvalidArgumentError(f"request {handle.id} has finished")
            source = handle.host
            if source == host and instance is None:
                return 0
        m = Migration("live" if live else "stop", source, host)
        handle.last_migration = m
        if live:
            return self._migrate_live(handle, m, instance, max_rounds, stop_blocks)
        started = time.perf_counter()
        packet, kv_bytes = self._actors[source].migrate_out.options(num_returns=2).remote(
            handle.id)
        self._get(source, kv_bytes)   # a refusal is raised here, the request where it was
        # from here the tokens come from the destination, all of them again (checked)
        with self._lock:
            epoch = handle._place(host)
        try:
            moved = self._get(host, self._actors[host].migrate_in.remote(handle.id, packet,
                                                                         True, instance, epoch))
        except BaseException:
            m.outcome = "refused"
            with self._lock:   # (a destination that died has had it submitted elsewhere)
                back = handle._epoch == epoch
                if back:
                    epoch = handle._place(source)
            if back:
                self._get(source, self._actors[source].migrate_in.remote(
                    handle.id, packet, "if_room", None, epoch))
            raise
        m.downtime, m.final_bytes, m.outcome = time.perf_counter() - started, moved, "moved"
        handle.migrations += 1
        return moved

    def _migrate_live(self, handle, m, instance, max_rounds, stop_blocks):
        src, dst = self._actors[m.source], self._actors[m.destination]
        key, start = None, 0
        try:
            for _ in range(max_rounds):
                packet, info = src.migrate_round.options(num_returns=2).remote(handle.id, start)
                info = self._get(m.source, info)
                if info["finished"]:
                    m.outcome = "finished"
                    return 0
                if key is None:
                    key = self._get(m.destination, dst.migrate_reserve.remote(packet, instance))
                else:
                    self._get(m.destination, dst.migrate_fill.remote(key, packet))
                m.rounds.append(info["bytes"])
                start = info["end"]
                if info["blocks"] <= stop_blocks:
                    break
            started = time.perf_counter()
            packet, info = src.migrate_stop.options(num_returns=2).remote(handle.id, start)
            info = self._get(m.source, info)
            if info["finished"]:
                m.outcome = "finished"
                return 0
            with self._lock:   # from here its tokens come from the destination (checked)
                epoch = handle._place(m.destination)
            reservation, key = key, None   # (the import ends it, whatever happens)
            try:
                self._get(m.destination, dst.migrate_in.remote(handle.id, packet, True, None,
                                                               epoch, reservation))
            except BaseException:
                m.outcome = "refused"
                with self._lock:   # (a destination that died has had it submitted elsewhere)
                    back = handle._epoch == epoch
                    if back:
                        epoch = handle._place(m.source)
                self._get(m.source, src.migrate_settle.remote(handle.id, not back, epoch))
                raise
            m.downtime, m.final_bytes = time.perf_counter() - started, info["bytes"]
            self._get(m.source, src.migrate_settle.remote(handle.id, True))
            m.outcome = "moved"
            handle.migrations += 1
            return m.bytes
        except BaseException:
            if m.outcome is None:
                m.outcome = "refused"
            raise
        finally:
            if key is not None and m.destination in self.live_hosts:
                try:   # abandoned: the destination's reserved KV goes back
                    self._get(m.destination, dst.migrate_cancel.remote(key))
                except (Error, self._ray.exceptions.RayError):
                    pass

    # ---- buddy groups whose members sit on different hosts ----
    def buddy(self, members, split=None):
        """KunServe's buddy group of two TP1 instances on different hosts: members
        [(host, instance index), (host, instance index)]. The first keeps layers [0, split)
        (default: half the model) and every request of the group, the second [split, L); each
        drops the other's parameters (KV room at once), each request's KV of the layers now
        across crosses once, and the pair serves as one pipeline split between the two
        processes (gyges.distributed.split_group). Blocking: both hosts pause between two
        steps while it forms. Refused, nothing changed, for members that are not TP1 instances
        of sharded workers or that a reconfiguration holds. Returns the group (a SplitBuddy);
        two members on one host are cluster.host(h).buddy(...)."""
        self._check_open()
        group = SplitBuddy(self, members, split)
        with self._lock:   # (listed first: a member lost while it forms dissolves it)
            self.groups.append(group)
        try:
            return group.form()
        except BaseException:
            with self._lock:
                if group in self.groups:
                    self.groups.remove(group)
            raise

    def restore(self, group):
        """A split buddy group's members serve alone again: every request goes to the less
        loaded one with its KV of every layer, the parameters come back from each host's copy."""
        if not isinstance(group, SplitBuddy) or group.cluster is not self:
            raise ArgumentTypeError(f"group must be a SplitBuddy of this cluster, got {group!r}")
        self._check_open()
        group.restore()
        with self._lock:
            if group in self.groups:
                self.groups.remove(group)
        return group

    # ---- streaming and losses ----
    def _poll(self, index):
        ray = self._ray
        actor = self._actors[index]
        while not self._closing and index in self.live_hosts:
            started = time.monotonic()
            try:
                updates = ray.get(actor.updates.remote(POLL_SECONDS))
            except ray.exceptions.RayError as e:
                if not self._closing:
                    self._lost(index, str(e).splitlines()[0])
                return
            changed = []
            with self._lock:
                for rid, epoch, tokens, finished, reason, error, queued, scores in updates:
                    h = self._handles.get(rid)
                    if h is None or h.host != index or h._epoch != epoch:
                        continue   # (a request, or a placement of it, given up since)
                    h._take(tokens, queued, scores)
                    if finished:
                        del self._handles[rid]
                        h._end(reason, error)
                    changed.append(h)
            for listener in list(self._listeners) if changed else ():
                listener(changed)
            time.sleep(max(0.0, STREAM_SECONDS - (time.monotonic() - started)))

    def _lost(self, index, why):
        """Host `index` is gone: its unfinished requests go to the hosts left, recomputed. Found
        lost again (a later call to it), it sends on any request placed there since: an
        operation under way when the loss was noticed (a migration, a buddy group's formation
        or restore) may still have placed one there, and it always calls that host after.
        Every notice (the poller's and a driver call's may overlap) first dissolves the groups
        the host was in, so that no request is sent to a member still serving its group (the
        actor makes a second dissolve wait for the first and do nothing), and sends on a
        request only if no other notice has placed it meanwhile (its epoch)."""
        with self._lock:
            first = index in self.live_hosts
            if first:
                self.live_hosts.remove(index)
                self.lost_hosts[index] = why
                self._broken[index] = [g for g in self.groups if index in g.hosts]
                self.groups = [g for g in self.groups if index not in g.hosts]
            broken = list(self._broken.get(index, ()))
            orphans = [(h, h._epoch) for h in self._handles.values() if h.host == index]
        if first:
            log.warning("host %d lost (%s): %d requests submitted again", index, why,
                        len(orphans))
        elif orphans:
            log.warning("host %d (lost) had %d requests placed on it since: submitted again",
                        index, len(orphans))
        for g in broken:   # the other member serves alone again
            g.lost(index)
        for h, epoch in orphans:
            self._resubmit(h, epoch)

    def _resubmit(self, h, epoch=None):
        """Places request h anew on the least loaded live host that can hold it, recomputed.
        epoch: only if h is still at that placement (no other thread has placed it since)."""
        refused = {}   # host -> why it cannot take the request (no instance holds it)
        while True:
            with self._lock:
                if epoch is not None and (h._epoch != epoch or self._handles.get(h.id) is not h):
                    return   # placed again, or ended, meanwhile
                target = self._least_loaded(exclude=refused)
                if target is None or self._closing:
                    self._handles.pop(h.id, None)
                    h._end("error", "; ".join(f"host {i}: {why}" for i, why in refused.items())
                           or "every host of the cluster was lost")
                    return
                epoch = h._place(target)
                h.resubmitted += 1
            try:
                self._get(target, self._actors[target].submit.remote(h.id, h.prompt, h.params,
                                                                      None, epoch))
                return
            except StateError:
                continue   # that one is gone too (its loss may have placed h: the epoch says)
            except Error as e:   # (its layout holds no instance this large): the next
                refused[target] = str(e)

    # ---- the end ----
    def _check_open(self):
        if self._closing:
            raise StateError("the cluster is closed")

    def close(self):
        """Closes every host (unfinished requests finish with reason "abort") and stops Ray
        when this cluster started it. Closing twice is harmless."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        self._shutdown()

    def _shutdown(self):
        ray = self._ray
        self._closing = True
        for i, actor in enumerate(self._actors):
            if i in self.live_hosts:
                try:
                    ray.get(actor.close.remote(), timeout=30)
                except ray.exceptions.RayError:
                    pass
            ray.kill(actor, no_restart=True)
        for t in getattr(self, "_pollers", []):
            t.join()
        with self._lock:
            for h in self._handles.values():
                h._end("abort", "the cluster was closed")
            self._handles.clear()
        self.live_hosts = []
        if self._owns_ray:
            ray.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return (f"Cluster({len(self.live_hosts)} of {len(self._actors)} hosts alive, "
                f"model {self.source[0]})")
