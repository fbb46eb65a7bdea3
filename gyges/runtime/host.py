"""gyges.Host: a group of workers (each a thread with its own arena, its "GPU") serving as one or
more instances, each a plan of stages (engine/stage.h): a tensor-parallel group over every layer,
or a pipeline of workers each running a range of layers.

    host = gyges.Host(model, workers=4, memory_per_worker="64MiB", page_size="64KiB",
                      layout="4xTP1")                    # or "2xTP2", "1xTP4", "TP2+2xTP1"
    host = gyges.Host(model, workers=4, layout="PP[3,1]+2xTP1")  # a pipeline and two TP1
    host = gyges.Host(model, workers=4, backend="cuda")  # the same, on GPUs
    r = host.submit(tokens, params)                      # least-loaded instance that can hold it
    host.step(); r.output_tokens

Instances are aligned groups as in Flying Serving section 4.3: a TPk instance starts at a worker
whose index is a multiple of k (pairs {0,1},{2,3}; the quartet {0..3}). One communicator per
aligned group is created at start-up, so forming a group never pays for set-up, and one more
for migration traffic (gyges.runtime.comm.CommPool).

How the workers are shared is the host's pool (runtime/pool.py): weights="sharded" (each keeps
its part of the model; the layout's instances) or "replicated" (each keeps the whole model: DP
and TP engines, runtime/replicas.py), or one of the two per worker (the replicated ones an
aligned group: MixedPool asks both parts). The host places requests through it and steps what
it says is serving; it never looks at how.

Live changes of parallelism are reconfigurations (gyges.reconfig): the verbs below (transform,
reconfigure, switch, buddy, restore) each make one and start it (Host.start), and host.step
advances the live ones. The host knows them only through their protocol
(gyges/reconfig/reconfiguration.py); the layer above registers their classes in EXECUTORS.

backend="cuda": each worker's arena is device memory and its forward pass runs on its own CUDA
stream. With one GPU per worker (devices=[0, 1, ...], or devices=None on a machine with as many
GPUs as workers) the workers are joined by NCCL (comm="nccl"); otherwise they are virtual workers
sharing one GPU (devices=None: device 0; or devices=d), each with its own arena and stream, joined
by device-to-device copies (comm="d2d"), which add partial sums in the CPU backend's order. When
NCCL cannot be loaded, devices=None falls back to virtual workers on device 0 (host.comm_note
says why). Without a usable GPU the constructor raises UnavailableError with the reason before
anything is allocated.

expert_parallel=True, or a layout that says so ('TP4EP4', '4xTP1EP1'; layout() says it too) (a
mixture-of-experts model, sharded weights, either backend): each TPk group partitions the
experts over its k workers (EPk: rank r holds experts [r*E/k, (r+1)*E/k) whole, every shard)
while attention, dense layers and a shared expert stay TP-sharded; the experts' outputs are
exchanged by the group's all-reduce and combined in TP1's order, so the tokens are TP1's to the
bit. Such a host changes TP (transform, at once or layer-staggered: AMOEBAs' 4x(TP1EP1) ->
TP4EP4): a merge keeps each new rank's block of experts whole and its dense shards and drops the
rest (nothing copied), a split maps the other experts again from the ranks that hold them; every
other reconfiguration is refused.
"""
import logging
import operator
from concurrent.futures import ThreadPoolExecutor

from .. import _C
from ..core import checks
from ..core.errors import (ArgumentTypeError, BusyError, Error, InvalidArgumentError, StateError,
                           UnavailableError)
from ..core.fairlock import FairLock
from ..core.units import parse_size
from ..models.tokenizer import tokenize_prompt
from .comm import CommPool, aligned_groups
from .engine import Clock, Request, Serving, check_one_sample, check_params
from .instance import Instance
from .layout import expert_parallel as layout_expert_parallel, layout_string
from .layout import parse as parse_layout
from . import request_packet
from .pool import MixedPool, ShardedPool
from .replicas import ReplicatedPool
from .worker import MEMORY_FLOOR, Worker, cuda_unavailable, default_max_tp, default_memory, tp_degrees

log = logging.getLogger(__name__)

COMMS = ("d2d", "nccl")
WEIGHTS = ("sharded", "replicated")
MAX_WORKERS = 1024

# verb -> the reconfiguration class it makes: filled by gyges.reconfig, the layer above this one
# (gyges/reconfig/__init__.py), so that the host imports none of them.
EXECUTORS = {}


def _executor(verb):
    if verb not in EXECUTORS:
        raise UnavailableError(f"{verb}: no reconfiguration is registered for it (import "
                               f"gyges.reconfig)")
    return EXECUTORS[verb]


def cuda_placement(n_workers, devices=None, comm=None):
    """Where CUDA workers go: (device of each worker, communicator backend), checked before
    anything is allocated. devices: None (one GPU each when there are enough, else all on device
    0), an int (all on that device) or one device per worker; comm: None (d2d when the workers
    share a device, nccl when each has its own), "d2d" or "nccl". Raises UnavailableError with
    the reason when CUDA cannot run here, ValueError for a placement that cannot work."""
    if comm is not None and comm not in COMMS:
        raise InvalidArgumentError(f"unknown communicator {comm!r} for CUDA workers; expected one of "
                         f"{', '.join(COMMS)} (or None to choose)")
    why = cuda_unavailable()
    if why is not None:
        raise UnavailableError(f"backend='cuda' cannot run here: {why}")
    count = _C.cuda_device_count()
    if devices is None:
        own = comm == "nccl" or (comm is None and 1 < n_workers <= count)
        devices = list(range(n_workers)) if own else [0] * n_workers
    elif isinstance(devices, int) and not isinstance(devices, bool):
        devices = [devices] * n_workers
    else:
        devices = [operator.index(d) for d in devices]
        if len(devices) != n_workers:
            raise InvalidArgumentError(f"devices names {len(devices)} GPUs for {n_workers} workers")
    missing = sorted({d for d in devices if not 0 <= d < count})
    if missing:
        raise InvalidArgumentError(f"CUDA device(s) {missing} do not exist: this machine has {count} "
                         f"(0..{count - 1})")
    shared = len(set(devices)) < len(devices)
    if comm is None:
        comm = "d2d" if len(set(devices)) == 1 else "nccl"
    if comm == "d2d" and len(set(devices)) > 1:
        raise InvalidArgumentError(f"comm='d2d' joins virtual workers sharing one GPU, but the workers are "
                         f"on devices {devices}; use comm='nccl' (one GPU each) or one device")
    if comm == "nccl" and shared:
        raise InvalidArgumentError(f"comm='nccl' needs one GPU per worker, but devices {devices} repeat "
                         f"one; use comm='d2d' with one device for virtual workers")
    return devices, comm



class Host(Serving):
    def __init__(self, model, workers=4, memory_per_worker=None, page_size=None,
                 layout=None, block_size=16, kv_layout="header", weight_dtype=None,
                 threads_per_worker=1, max_batch_tokens=512, max_running=64,
                 max_prefill_chunk=0, max_tp=None, pad_ffn=True, backend="cpu", devices=None,
                 comm=None, weights="sharded", kv_stack=1, seed=0, expert_parallel=False):
        checks.integer("workers", workers, lo=1)
        # requests without a seed take one mixed from this and their id (engine.resolve_params)
        self.seed = checks.integer("seed", seed, lo=0, hi=2**64 - 1)
        if workers > MAX_WORKERS:
            raise InvalidArgumentError(f"workers={workers}: a host has at most {MAX_WORKERS} "
                                       f"(each is a thread with its own arena)")
        for name, value in (("block_size", block_size), ("threads_per_worker", threads_per_worker),
                            ("max_batch_tokens", max_batch_tokens), ("max_running", max_running)):
            checks.integer(name, value, lo=1)
        checks.integer("max_prefill_chunk", max_prefill_chunk, lo=0)
        if backend not in MEMORY_FLOOR:
            raise InvalidArgumentError(f"unknown backend {backend!r}; expected one of "
                                       f"{', '.join(MEMORY_FLOOR)}")
        if layout is not None and not isinstance(layout, str):
            raise ArgumentTypeError(f"layout must be a string like '4xTP1', got {layout!r}")
        replicated = self._replicated_workers(weights, workers)
        if layout is not None and layout_expert_parallel(layout):   # 'TP4EP4', '4xTP1EP1'
            expert_parallel = True
        if expert_parallel and replicated:
            raise InvalidArgumentError("expert_parallel=True partitions experts over the "
                                       "workers of sharded TP groups (weights='sharded')")
        self.expert_parallel = bool(expert_parallel)
        self._lock = FairLock()
        layout = layout or f"{workers}xTP1"
        groups = parse_layout(layout, workers, model.config.num_hidden_layers)
        if not isinstance(kv_stack, int) or kv_stack < 1:
            raise InvalidArgumentError(f"kv_stack must be a positive int, got {kv_stack!r}")
        if any(n % kv_stack for _, _, stages in groups for n in stages or ()):
            raise InvalidArgumentError(f"layout {layout!r}: with kv_stack={kv_stack} every "
                                       f"pipeline stage holds whole runs of {kv_stack} layers")
        if any(stages and set(range(first, first + len(stages))) & set(replicated)
               for first, _, stages in groups):
            raise InvalidArgumentError(f"layout {layout!r}: a replicated host switches between DP "
                                       f"and TP groups; pipelines need sharded weights")
        if any(tp > 1 and first in replicated and not set(range(first, first + tp)) <= set(replicated)
               or (first not in replicated and set(range(first, first + tp)) & set(replicated))
               for first, tp, stages in groups if not stages):
            raise InvalidArgumentError(f"layout {layout!r}: a TP group lies on sharded and "
                                       f"replicated workers at once (weights={weights!r})")
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.kv_layout = kv_layout
        self.max_batch_tokens, self.max_running = max_batch_tokens, max_running
        self.max_prefill_chunk = max_prefill_chunk
        self.max_tp = max_tp or default_max_tp(model.config, limit=8)
        self.tp_degrees = tp_degrees(model.config, self.max_tp)
        if memory_per_worker is None:  # every worker can hold the whole model (a TP1 instance)
            memory_per_worker = default_memory(model, backend, weight_dtype=weight_dtype,
                                               max_tp=self.max_tp, page_size=page_size,
                                               pad_ffn=pad_ffn)
        if isinstance(memory_per_worker, (list, tuple)):
            # heterogeneous workers (PipeLive pairs an 80 GB and a 48 GB GPU in one pipeline)
            if len(memory_per_worker) != workers:
                raise InvalidArgumentError(f"memory_per_worker lists {len(memory_per_worker)} sizes "
                                           f"for {workers} workers")
            self.worker_memory = [parse_size(m, f"memory_per_worker[{i}]")
                                  for i, m in enumerate(memory_per_worker)]
            self.memory_per_worker = list(self.worker_memory)
        else:
            self.memory_per_worker = parse_size(memory_per_worker, "memory_per_worker")
            self.worker_memory = [self.memory_per_worker] * workers
        self.comm_note = None
        if backend == "cuda":
            # Checked, and the communicators made, before any worker memory is allocated.
            self.devices, comm_backend = cuda_placement(workers, devices, comm)
            self.comms = self._cuda_comms(workers, comm_backend, devices is None and comm is None)
        else:
            if devices is not None or comm is not None:
                raise InvalidArgumentError("devices and comm are for backend='cuda'; CPU workers are "
                                 "threads joined by shared memory")
            self.devices = [None] * workers
            # A compute and a migration communicator per aligned group of every size, made now
            # (Flying Serving's pool).
            self.comms = CommPool(aligned_groups(workers, sizes=self.tp_degrees), backend="shm")
        self.clock = Clock()
        # What a worker is made of: how the host makes one again when its group is rebuilt.
        self._worker_args = dict(page_size=page_size,
                                 block_size=block_size, kv_layout=kv_layout,
                                 weight_dtype=weight_dtype, max_tp=self.max_tp,
                                 threads=threads_per_worker, pad_ffn=pad_ffn, backend=backend,
                                 kv_stack=kv_stack, expert_parallel=self.expert_parallel)
        self._workers = [self.new_worker(i) for i in range(workers)]
        self.reconfigurations = []  # the live ones, in the order they started
        # live migrations' KV (request_packet): held exports by request id, reservations by id
        self._held, self._reservations = {}, {}
        # changes that hold workers without needing steps (a buddy group split between hosts:
        # reconfig/split_buddy.py), refused to others as a live reconfiguration is
        self.holds = []
        self._next_reservation = 0
        self.reconfigurations_started = 0
        self._next_id = 0
        self.steps = 0
        sharded = ShardedPool()
        for first, tp, stages in groups:
            if first not in replicated:
                sharded.install(self._initial_instance(first, tp, stages))
            else:
                self.check_group(first, tp)
        if replicated:
            rep = ReplicatedPool(self, lambda ws, tp, kvs: Instance(self, ws, tp, kvs=kvs),
                                 workers=replicated)
            self.pool = rep if len(replicated) == workers else MixedPool(sharded, rep)
        else:
            self.pool = sharded
        self._executor = ThreadPoolExecutor(max_workers=max(len(self.pool.instances()), 1))
        for first, tp, _ in groups:   # a replicated part's TP groups bound from the start
            if first in replicated and tp > 1:
                self.switch(range(first, first + tp), tp, "hard")

    @staticmethod
    def _replicated_workers(weights, workers):
        """The workers that keep the whole model: weights "sharded" (none), "replicated" (all),
        or one of the two per worker (an aligned range replicated, the rest sharded)."""
        if isinstance(weights, str):
            if weights not in WEIGHTS:
                raise InvalidArgumentError(
                    f"weights must be 'sharded' (a TP rank keeps its shards; Gyges "
                    f"transformations move them) or 'replicated' (every worker keeps the whole "
                    f"model; Flying Serving switches), or one of them per worker, got {weights!r}")
            return list(range(workers)) if weights == "replicated" else []
        kinds = list(weights) if isinstance(weights, (list, tuple)) else None
        if kinds is None or len(kinds) != workers or set(kinds) - set(WEIGHTS):
            raise InvalidArgumentError(f"weights must be 'sharded', 'replicated' or one of them "
                                       f"for each of the {workers} workers, got {weights!r}")
        rep = [w for w, k in enumerate(kinds) if k == "replicated"]
        if rep and (rep != list(range(rep[0], rep[-1] + 1)) or rep[0] % len(rep)
                    or len(rep) & (len(rep) - 1)):
            raise InvalidArgumentError(f"weights={weights!r}: the replicated workers must be an "
                                       f"aligned group (k consecutive workers from a multiple of "
                                       f"k, k a power of two)")
        return rep

    def _initial_instance(self, first, tp, stages):
        if stages:  # a pipeline: worker first + i holds the layers of stage i
            bounds = [sum(stages[:i]) for i in range(len(stages) + 1)]
            ranges = list(zip(bounds[:-1], bounds[1:]))
            for i, (lo, hi) in enumerate(ranges):
                self._workers[first + i].join_stage(lo, hi)
            return Instance(self, range(first, first + len(stages)), 1, ranges)
        self.check_group(first, tp)
        if tp > 1:
            for rank in range(tp):
                self._workers[first + rank].join_tp(tp, rank)
        return Instance(self, range(first, first + tp), tp)

    def _cuda_comms(self, workers, backend, may_fall_back):
        """The pool for CUDA workers. nccl chosen on its own (devices=None) falls back to
        virtual workers on device 0 when NCCL cannot be loaded."""
        groups = aligned_groups(workers, sizes=self.tp_degrees)
        devices = self.devices if backend == "nccl" else self.devices[0]
        try:
            return CommPool(groups, backend=backend, devices=devices)
        except UnavailableError as e:
            if backend != "nccl" or not may_fall_back:
                raise
            self.comm_note = (f"virtual workers on device 0 (d2d): the nccl communicator is not "
                              f"available ({e})")
            self.devices = [0] * workers
            return CommPool(groups, backend="d2d", devices=0)

    @property
    def comm_backend(self):
        """"shm" (CPU workers), "d2d" (virtual workers sharing one GPU) or "nccl"."""
        return self.comms.backend

    def check_group(self, first, tp):
        """Refuses, naming the reason, a TP degree the model cannot use or an unaligned group."""
        if first % tp or first < 0 or first + tp > len(self._workers):
            raise InvalidArgumentError(f"workers {first}..{first + tp - 1} are not an aligned group of "
                             f"{tp} on a host of {len(self._workers)}")
        c = self.model.config
        if tp not in self.tp_degrees:
            raise InvalidArgumentError(
                f"TP{tp} does not fit the model: a TP degree divides its {c.num_key_value_heads} KV "
                f"heads and {c.num_attention_heads} heads and leaves each rank a power of two of "
                f"its {self.max_tp} FFN shards, or all of them; this model runs at TP "
                f"{', '.join(map(str, self.tp_degrees))}")

    # ---- parts ----
    def now(self):
        return self.clock()

    def advance_clock(self, seconds):
        """Moves the host's clock forward (an experiment that skips idle time between arrivals
        keeps every timestamp consistent this way)."""
        seconds = checks.number("seconds", seconds)
        if seconds < 0:
            raise InvalidArgumentError(f"seconds must be >= 0: the clock only moves forward, got "
                                       f"{seconds}")
        self.clock.advance(seconds)

    def new_worker(self, index):
        """A fresh worker for position `index` (TP1, the whole model), as the host made it."""
        name = ("memory_per_worker" if isinstance(self.memory_per_worker, int)
                else f"memory_per_worker[{index}]")
        return Worker(self.model, memory=self.worker_memory[index], memory_name=name,
                      device=self.devices[index] or 0, **self._worker_args)

    def worker(self, index):
        self._check_open()
        checks.integer("index", index, 0, len(self._workers) - 1)
        return self._workers[index]

    def replace_worker(self, index, worker):
        """Puts a new worker at position `index` (a recovery rebuilds a group's workers)."""
        self._workers[index] = worker

    @property
    def n_workers(self):
        self._check_open()
        return len(self._workers)

    @property
    def closed(self):
        return self._workers is None

    def _check_open(self):
        if self._workers is None:
            raise StateError("the host is closed")

    def comm(self, first, size):
        """The compute communicator of the aligned group of `size` workers from `first`."""
        return self.comms.comm(first, size)

    def migration_comm(self, first, size):
        """The same group's communicator for migration traffic."""
        return self.comms.migration(first, size)

    def layout(self):
        """The current layout, e.g. '2xTP1+TP2' or 'PP[3,1]+2xTP1'."""
        self._check_open()
        return layout_string([part for _, part in sorted(self.pool.layout_parts())])

    @property
    def weights(self):
        """'replicated' (every worker keeps the whole model: switch()), 'sharded', or 'mixed'
        (some of each: weights_of tells which)."""
        self._check_open()
        return self.pool.kind

    def weights_of(self, workers):
        """{'sharded', 'replicated'}: what the given workers keep."""
        rep = self.replicas
        mine = set(rep.workers) if rep is not None else set()
        return {"replicated" if w in mine else "sharded" for w in workers}

    @property
    def instances(self):
        """Every instance that exists: a sharded host's serving ones; a replicated host's DP
        engine of each worker and TP engine of each aligned group."""
        return self.pool.instances()

    @property
    def replicas(self):
        """The pool of the replicated workers (their DP engines and groups), else None."""
        if self.pool.kind == "mixed":
            return self.pool.replicated
        return self.pool if self.pool.kind == "replicated" else None

    def serving_instances(self):
        """The instances that step now."""
        return self.pool.serving()

    def modes(self):
        """Per worker: 'DP', 'TPk' (bound into a TPk group) or 'paused' (waiting to bind: it
        admits nothing and finishes its running DP requests). A sharded host: its TP degrees."""
        with self._lock:
            self._check_open()
            modes = self.pool.modes()
            return [modes[w] for w in range(self.n_workers)] if isinstance(modes, dict) else modes

    # ---- what reconfigurations change: instances come and go through these ----
    def make_instance(self, workers, tp, stages=None, kvs=None, span=None):
        return Instance(self, workers, tp, stages, kvs, span)

    def install(self, instance):
        """Starts serving an instance (kept in order of first worker)."""
        self.pool.install(instance)

    def retire(self, instance):
        """Stops an instance; its requests must have moved elsewhere (or its KV been detached)."""
        self.pool.retire(instance)

    def pinned(self, workers):
        """Why the workers' pages cannot change now (a live NumPy view pins a slot), or None."""
        for w in workers:
            pinned = self._workers[w].arena.pinned_slots()
            if pinned.size:
                return (f"worker {w} has {pinned.size} slot(s) under a live NumPy view (slot "
                        f"{int(pinned[0])} first)")
        return None

    # ---- reconfigurations ----
    def start(self, r):
        """Starts reconfiguration `r` (a gyges.reconfig executor made for this host): refused,
        changing nothing, while a live one holds one of its workers; else planned and begun (a
        kind that is not live is committed here too). Returns r."""
        with self._lock:
            self._check_open()
            other = self._holding(r.claims())
            moving = self._migrating(r.claims())
            if moving is not None and other is None:
                raise BusyError(f"a live migration holds KV on workers {list(moving.workers)}; "
                                f"{r.kind} once it ends")
            if other is not None:
                raise BusyError(f"{other!r} is under way on workers "
                                f"{sorted(other.claims() & r.claims())}; wait until it is done "
                                f"(r.done) before {r.kind}")
            if self.expert_parallel and not r.moves_experts:
                raise InvalidArgumentError(f"{r.kind}: an expert-parallel host changes TP "
                                           f"(host.transform) and nothing else: this one moves "
                                           f"no experts")
            before = self.layout()
            self.reconfigurations_started += 1
            try:
                r.start()
            except Error as e:
                log.info("%s on workers %s refused: %s", r.kind, list(r.workers), str(e))
                raise
            if not r.done:
                self.reconfigurations.append(r)
            if r.done:
                log.info("%s %s -> %s", r.kind, before, self.layout())
            else:   # (the layout a live one leads to is known once it ends)
                log.info("%s of %s on workers %s: under way", r.kind, before, list(r.workers))
            return r

    def cancel(self, r, why="cancelled"):
        """Takes a live reconfiguration back exactly (as if it had failed): the host is as it
        was before it began. Returns False when it had ended already."""
        with self._lock:
            self._check_open()
            done = r.cancel(why)
            self.reconfigurations = [x for x in self.reconfigurations if not x.done]
            return done

    def _begin(self, verb, **kwargs):
        """Makes the reconfiguration `verb` names (EXECUTORS) and starts it, under the lock."""
        with self._lock:
            self._check_open()
            return self.start(_executor(verb)(self, **kwargs))

    def _start_asked(self, asked):
        """Starts what the pool asked for (a bind for queued TP work, a release): what cannot
        start now is tried again before a later step."""
        for verb, kwargs in asked:
            try:
                self._begin(verb, **kwargs)
            except Error as e:
                log.debug("%s %s not started now: %s", verb, kwargs, str(e))

    def transform(self, workers, tp, method="gyges", layers_per_step=None, weights_from="peers",
                  phase_chunks=4, overlap=False):
        """Changes the TP degree of an aligned group of workers while its requests are in flight
        (Gyges): workers=(0, 1, 2, 3), tp=4 merges the instances there into one TP4 instance;
        tp=1 splits a TP4 instance into four TP1 ones. Without layers_per_step every layer moves
        at once, between two steps; with it, host.step() moves that many layers per step (last
        layer first) and serving goes on in between (t.done tells when it is over). overlap=True
        reads the next layers' KV on a low-priority thread while the step runs. phase_chunks
        cuts each all-to-all phase of the in-place KV migration into rounds (more rounds, less
        extra memory). weights_from: where a scale-down gets FFN shards back ("peers" or
        "host"). method: "gyges", or a baseline of Gyges 6.2 ("stop_world", "basic",
        "partial_swap"). Returns the reconfiguration (gyges.reconfig.transform.Transform).

        Refused with a gyges.Error naming the reason, and nothing changed, when it cannot be
        done (bad arguments, too little memory, a live NumPy view of a group worker's memory).
        A failure past its first change is rolled back: the host is exactly as before."""
        return self._begin("transform", workers=workers, tp=tp, method=method,
                           layers_per_step=layers_per_step, weights_from=weights_from,
                           phase_chunks=phase_chunks, overlap=overlap)

    def reconfigure(self, instance, layers, mode="live", tau=50, layers_per_step=1,
                    max_rounds=64):
        """Re-splits a pipeline instance live, in place (PipeLive): `layers` gives each of its
        workers' new layer count (PP[3,1] -> layers=[1, 3]). mode "live" (weights and KV copied
        step by step, dirty-bitmap patching, a commit once fewer than `tau` tokens lag, or after
        `max_rounds` patch rounds the residual copied in the pause), "no_patch" (the KV copied
        in the pause at commit) or "stop_copy" (everything in that pause). host.step() advances
        it. Refused, changing nothing, when the blocks in use exceed what the intermediate
        layout leaves (B_shrink) or another change holds its workers."""
        return self._begin("reconfigure", instance=instance, layers=layers, mode=mode, tau=tau,
                           layers_per_step=layers_per_step, max_rounds=max_rounds)

    def switch(self, workers, tp, preempt="wait", tp_work=()):
        """Binds an aligned group of workers of a replicated host for TP work (tp = their
        number), or releases it to DP (tp=1); nothing is copied, mapped or made (Flying
        Serving). preempt: "wait" (bind once the members' running DP requests are done), "soft"
        (and meanwhile start pending TP requests in DP mode on idle members, recomputed at the
        bind) or "hard" (bind now, pausing the members' DP requests with their KV). A group bound with
        no TP work while its members have DP work waiting is released at the next step. A release waits for the
        group's TP requests to finish ("wait"), or recomputes them on the members in DP mode now
        ("soft", "hard"). tp_work: handles of requests on the members that are TP work started
        in DP mode (a controller's soft start). Returns the reconfiguration (.done once bound
        or released)."""
        return self._begin("switch", workers=workers, tp=tp, preempt=preempt, tp_work=tp_work)

    def buddy(self, instances, live=False, link=None, layers_per_step=1):
        """KunServe: the TP1 instances `instances` (Instance objects or indices into
        host.instances; neighbouring workers) become one buddy group: worker k of g keeps layers
        [k L/g, (k+1) L/g) of one shared copy of the parameters and drops the rest (that memory
        is KV room at once), each request's KV of the layers now held by a buddy is copied
        there, and the group serves as a pipeline. live=False exchanges the KV before the next
        step; live=True serves on at once, moving the KV a layer at a time as host.step goes
        (`layers_per_step`, or what `link` leaves over), each layer not yet moved attending
        remotely on the worker that holds its KV. Members on different GPUs need KV moves
        between them (refused with the reason where the KV move has none). link, a
        gyges.reconfig.link.Link, paces the transfers. Returns the group's reconfiguration
        (gyges.reconfig.buddy.Buddy: .instance, .ranges; .done once the KV has moved)."""
        return self._begin("buddy", instances=instances, live=live, link=link,
                           layers_per_step=layers_per_step)

    def restore(self, buddy, weights_from="peers", live=False, link=None, layers_per_step=1):
        """KunServe: a buddy group gets its parameters back (from the peers that hold each part,
        or the host copy), its requests go to the least loaded member with their KV of every
        layer, and the members serve as TP1 instances again. live=True streams the parameters
        and KV back while the group serves (`layers_per_step` a step, or what `link` carries),
        then switches between two steps. Returns the restore's reconfiguration."""
        return self._begin("restore", buddy=buddy, weights_from=weights_from, live=live,
                           link=link, layers_per_step=layers_per_step)

    # ---- serving ----
    def submit(self, tokens, params=None, instance=None, tp=None, priority=0):
        """Places a request on `instance` (an index into host.instances) or where the host's pool
        says (the least-loaded instance that can hold it); returns its handle. A bad prompt or
        parameter raises a gyges.Error naming it and queues nothing.

        On a replicated host, tp=k asks for TP work: the request queues on an aligned group of k
        workers, which binds for it ("soft", or "hard" when priority > 0) and goes back to DP
        once no TP request is left; a request no DP worker can hold binds the smallest group
        whose pooled KV holds it."""
        params = check_params(params)
        check_one_sample(params)  # before placing it anywhere
        tokens, text = tokenize_prompt(tokens, getattr(self.model, "tokenizer", None))
        priority = checks.integer("priority", priority, lo=0)
        with self._lock:
            self._check_open()
            length = len(tokens) if hasattr(tokens, "__len__") else 0
            if tp is not None:
                tp = checks.integer("tp", tp, lo=1)
            if instance is not None:
                instance = self._instance_at(instance)
            # max_tokens None runs to the context's end: the whole context to place
            max_tokens = (params.max_tokens if params.max_tokens is not None else
                          max(self.model.config.max_position_embeddings - length, 1))
            target, asked = self.pool.place(self, length + max_tokens, tp=tp,
                                            instance=instance, priority=priority)
            request = target.add(self._next_id, tokens, params, prompt_text=text)
            self._next_id += 1
            self._start_asked(asked)
            return request

    def _instance_of(self, request):
        for inst in self.pool.instances():
            if inst.serves(request):
                return inst
        return None

    def abort(self, request):
        """Finishes a request wherever it is served (finish_reason "abort"; its KV is freed).
        Returns False when it had already finished."""
        if not isinstance(request, Request):
            raise ArgumentTypeError(f"request must be a gyges.Request, got "
                                    f"{type(request).__name__}")
        with self._lock:
            self._check_open()
            if request.finished:
                return False
            inst = self._instance_of(request)
            if inst is None:
                raise InvalidArgumentError(f"request {request.id} is not served by this host")
            return inst.abort(request)

    # ---- requests between hosts (runtime/request_packet.py) ----
    def export_request(self, request, start=0, then="let_go"):
        """Takes an unfinished request out of this host with its KV (a RequestPacket, plain data
        another host's import_request takes in); here its KV is freed and its handle, left
        unfinished, is served no more. Refused, changing nothing, for a request this host does
        not serve or one whose instance a live reconfiguration holds.

        A live migration's steps (gyges.Cluster.migrate(live=True)): start, the first token
        whose KV the packet carries (the destination's reservation holds those before it);
        then="stay": a copy while the request goes on here (a round); then="hold": it is served
        no more, but its KV stays until settle_export says whether it arrived."""
        if not isinstance(request, Request):
            raise ArgumentTypeError(f"request must be a gyges.Request, got "
                                    f"{type(request).__name__}")
        start = checks.integer("start", start, lo=0)
        if then not in request_packet.THEN:
            raise InvalidArgumentError(f"then={then!r}: expected one of "
                                       f"{', '.join(request_packet.THEN)}")
        with self._lock:
            self._check_open()
            inst = None if request.finished else self._instance_of(request)
            if inst is None:
                raise InvalidArgumentError(f"request {request.id} is not an unfinished request "
                                           f"of this host")
            busy = self._holding(inst.workers)
            if busy:
                raise BusyError(f"request {request.id}: its instance {inst.layout} on workers "
                                f"{list(inst.workers)} is being reconfigured ({busy!r}); "
                                f"move it once that ends")
            out = request_packet.export_request(inst, request.id, self.clock(), start, then)
            if then != "hold":
                return out
            packet, self._held[request.id] = out
            return packet

    def settle_export(self, request, arrived):
        """Ends an export held for a live migration: arrived, its KV here is freed; else the
        request is served here again as it was, with its KV. False when none was held."""
        with self._lock:
            self._check_open()
            held = self._held.get(getattr(request, "id", None))
            if held is None or held.handle is not request:
                return False
            if arrived:
                held.free()
            else:
                try:
                    held.restore()
                except Error:   # (no room in its running set now): recomputed, never lost
                    held.free()
                    held.restore()
            del self._held[request.id]
            return True

    def _migrating(self, workers):
        """A live migration's KV (a held export, a reservation) on one of `workers`, or None."""
        return next((m for m in list(self._held.values()) + list(self._reservations.values())
                     if set(m.workers) & set(workers)), None)

    def _holding(self, workers):
        """The first live reconfiguration (or hold) on one of `workers`, or None."""
        return next((r for r in self.reconfigurations + self.holds
                     if not r.done and r.claims() & set(workers)), None)

    def _instance_at(self, index):
        """host.instances[index], the index checked."""
        insts = self.instances
        return insts[checks.integer("instance", index, 0, len(insts) - 1)]

    def import_request(self, packet, instance=None, with_kv=True, reservation=None):
        """Serves the request of a RequestPacket (another host's export_request) on `instance`
        (an index into host.instances) or where the pool places it, going on from where it
        was: with its KV (with_kv=False: recomputed from its tokens). Returns its new handle.
        Raises OutOfMemoryError, changing nothing, when its KV does not fit there, and
        BusyError when a live reconfiguration holds that instance (its plan would not move the
        new KV; without KV the request comes in as a queued one does). reservation: the id
        reserve_request gave (its instance, and the KV before packet.kv_start); it ends with
        this call, whether the request comes in or not."""
        if not isinstance(packet, request_packet.RequestPacket):
            raise ArgumentTypeError(f"packet must be a RequestPacket (Host.export_request), "
                                    f"got {type(packet).__name__}")
        with self._lock:
            self._check_open()
            if reservation is not None:
                res = self._reservation(reservation)
                del self._reservations[reservation]
                handle = request_packet.import_request(res.instance, packet, self._next_id,
                                                       self.clock(), with_kv, res)
                self._next_id += 1
                return handle
            target, asked = self._place_packet(packet, instance, with_kv and packet.kv is not None)
            handle = request_packet.import_request(target, packet, self._next_id, self.clock(),
                                                   with_kv=with_kv)
            self._next_id += 1
            self._start_asked(asked)
            return handle

    def _place_packet(self, packet, instance, with_kv):
        """(instance, what the pool asks to start) for a packet's request, refused while a live
        reconfiguration holds it and it brings KV."""
        if instance is not None:
            instance = self._instance_at(instance)
        length = len(packet.prompt) + packet.params.max_tokens
        target, asked = self.pool.place(self, length, instance=instance)
        busy = self._holding(target.workers)
        if busy and with_kv:
            # its plan moves the KV of the requests it knew, not of one that comes now
            raise BusyError(f"instance {target.layout} on workers {list(target.workers)} "
                            f"is being reconfigured ({busy!r}); bring the request in once "
                            f"that ends, or without its KV (with_kv=False)")
        return target, asked

    def reserve_request(self, packet, instance=None):
        """A live migration's arrival: sequences on `instance` (or where the pool places the
        request) holding the KV the packet carries (a first round's, tokens [0, computed)),
        extended by fill_reservation and adopted with the request by import_request(packet,
        reservation=); returns the reservation's id. While it lives, no reconfiguration
        starts on its workers. Refused as import_request is, changing nothing."""
        if not isinstance(packet, request_packet.RequestPacket):
            raise ArgumentTypeError(f"packet must be a RequestPacket (Host.export_request), "
                                    f"got {type(packet).__name__}")
        with self._lock:
            self._check_open()
            target, asked = self._place_packet(packet, instance, True)
            res = request_packet.Reservation(target)
            res.take(packet)
            key = self._next_reservation
            self._next_reservation += 1
            self._reservations[key] = res
            self._start_asked(asked)
            return key

    def fill_reservation(self, reservation, packet):
        """Writes a later round's KV (packet.kv_start: the tokens the reservation holds) into
        it; returns the tokens it holds. A failure frees the reservation."""
        with self._lock:
            self._check_open()
            res = self._reservation(reservation)
            try:
                res.take(packet)
            except BaseException:
                del self._reservations[reservation]
                raise
            return res.tokens

    def free_reservation(self, reservation):
        """Gives back a reservation's KV (the migration was abandoned); False when none."""
        with self._lock:
            self._check_open()
            res = self._reservations.pop(reservation, None)
            if res is None:
                return False
            res.free()
            return True

    def _reservation(self, key):
        if key not in self._reservations:
            raise InvalidArgumentError(f"reservation={key!r} is not a live reservation of "
                                       f"this host")
        return self._reservations[key]

    def kv_sequences(self, request):
        """{worker: the KV sequence in that worker's cache holding the request} over the
        workers of its instance; -1 where it holds none (queued, preempted, finished)."""
        with self._lock:
            self._check_open()
            inst = None if request.finished else self._instance_of(request)
            if inst is None:
                return {}
            return dict(zip(inst.workers, inst.request_seqs(request.id)))

    def between_steps(self, fn, *args):
        """fn(*args) run between two of the host's steps (under its lock), e.g. to read every
        instance's state at one moment while another thread steps the host."""
        with self._lock:
            self._check_open()
            return fn(*args)

    def has_unfinished(self):
        with self._lock:
            if self._workers is None:
                return False
            return any(inst.unfinished() for inst in self.pool.instances()) or any(
                not r.done for r in self.reconfigurations)

    def step(self):
        """Starts what the pool asks for (binds for queued TP work, releases), advances every
        live reconfiguration by one step, then runs one step of every serving instance, in
        parallel (each releases the GIL while it computes), and asks the pool again. A failed instance step changes
        nothing of that instance (the others' steps stand) and its error is raised after all
        have run; a reconfiguration's own failure is rolled back and reported on its handle."""
        with self._lock:
            self._check_open()
            self._start_asked(self.pool.tick(self))
            for r in list(self.reconfigurations):
                r.advance()
            self.reconfigurations = [r for r in self.reconfigurations if not r.done]
            busy = [inst for inst in self.pool.serving() if inst.unfinished()]
            if not busy:
                return 0
            if len(busy) == 1:
                tokens = busy[0].step()
            else:
                futures = [self._executor.submit(inst.step) for inst in busy]
                results, errors = [], []
                for f in futures:  # every instance's step ends before anything is raised
                    try:
                        results.append(f.result())
                    except Exception as e:
                        errors.append(e)
                if errors:
                    raise errors[0]
                tokens = sum(results)
            if tokens:
                self.steps += 1
            # what the step changed may end a change at once (a release whose last TP request
            # finished) or ask for one
            for r in list(self.reconfigurations):
                if r.advance_after_step:
                    r.advance()
            self.reconfigurations = [r for r in self.reconfigurations if not r.done]
            self._start_asked(self.pool.tick(self))
            return tokens

    def run(self, on_step=None):
        """Steps until every submitted request has finished, calling on_step() after each step
        (a progress bar's update). Raises BusyError, instead of stepping forever, when nothing
        can move: requests wait only for a state a call asked to hold (say what, and how to
        release it)."""
        idle = 0
        while self.has_unfinished():
            moved = self.step()
            if on_step is not None:
                on_step()
            if moved or any(not r.done for r in self.reconfigurations):
                idle = 0
                continue
            idle += 1
            if idle > 2:
                raise BusyError(self._stuck())

    def _stuck(self):
        waiting = [(inst, inst.unfinished()) for inst in self.pool.instances() if inst.unfinished()]
        where = ", ".join(f"{n} on {inst.layout} workers {list(inst.workers)}" for inst, n in waiting)
        return (f"requests wait and nothing serves them ({where}; modes {self.pool.modes()}): "
                f"release what holds their workers")

    def close(self):
        """Stops every instance and gives the workers' memory back (once no NumPy view of it
        is alive). A reconfiguration under way is rolled back first. Unfinished requests finish
        with reason "abort". Later calls raise StateError; closing twice is harmless."""
        with self._lock:
            if self._workers is None:
                return
            for r in reversed(self.reconfigurations):
                r.close()
            self.reconfigurations = []
            self._held, self._reservations = {}, {}   # (their pages go with the workers')
            for inst in self.pool.instances():
                inst.stop("the host was closed")
            self._executor.shutdown(wait=True)
            self.pool = ShardedPool()
            self._workers = None
            self.comms = None

    def stats(self):
        """What a serving front end reports: per instance its layout, workers and requests
        waiting and running; per worker the KV blocks in use out of its instance's capacity."""
        with self._lock:
            self._check_open()
            instances, workers = [], []
            for inst in self.pool.serving():
                c = inst.stats()
                instances.append({"layout": inst.layout, "workers": list(inst.workers),
                                  "waiting": c["waiting"] + c["preempted_queued"],
                                  "running": c["running"], "preemptions": c["preemptions"]})
                for w in inst.workers:
                    kv = self._workers[w].kv.stats()
                    workers.append({"worker": w, "kv_blocks_used": kv["n_blocks"] - kv["free_blocks"],
                                    "kv_blocks_capacity": c["capacity_blocks"]})
            return {"instances": instances, "workers": sorted(workers, key=lambda x: x["worker"]),
                    "reconfigurations": len(self.reconfigurations),
                    "reconfigurations_started": self.reconfigurations_started}

    def memory(self):
        """Per worker: bytes in use, peak, weights and KV."""
        self._check_open()
        rows = []
        for i, w in enumerate(self._workers):
            s = w.arena.stats()
            rows.append({"worker": i, "in_use": s["bytes_in_use"], "peak": s["peak_bytes"],
                         "weights": s["bytes_by_tag"]["weights"], "kv": s["bytes_by_tag"]["kv"]})
        return rows

    def __repr__(self):
        if self._workers is None:
            return "Host(closed)"
        where = "" if self.backend == "cpu" else f", backend='cuda', comm={self.comm_backend!r}"
        return f"Host(workers={len(self._workers)}, layout={self.layout()!r}{where})"
