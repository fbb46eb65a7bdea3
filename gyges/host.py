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
for migration traffic (gyges.comm.CommPool).

backend="cuda": each worker's arena is device memory and its forward pass runs on its own CUDA
stream. With one GPU per worker (devices=[0, 1, ...], or devices=None on a machine with as many
GPUs as workers) the workers are joined by NCCL (comm="nccl"); otherwise they are virtual workers
sharing one GPU (devices=None: device 0; or devices=d), each with its own arena and stream, joined
by device-to-device copies (comm="d2d"), which add partial sums in the CPU backend's order. When
NCCL cannot be loaded, devices=None falls back to virtual workers on device 0 (host.comm_note
says why). Without a usable GPU the constructor raises UnavailableError with the reason before
anything is allocated.
"""
import logging
import operator
import weakref
from concurrent.futures import ThreadPoolExecutor

from . import _C, checks, flying, kunserve, pipelive, recovery
from .comm import CommPool, aligned_groups
from .engine import Clock, InstanceLoop, Request, Serving, check_params
from .errors import ArgumentTypeError, BusyError, InvalidArgumentError, StateError, UnavailableError
from .fairlock import FairLock
from .tokenizer import tokenize_prompt
from .transform import (StaggeredScaleDown, StaggeredScaleUp, Transformation, TransformError,
                        kv_move, scale_down, scale_up, views_in)
from .layout import layout_string, part_string  # noqa: F401  (layout_string re-exported)
from .layout import parse as parse_layout
from .units import parse_size
from .worker import Worker, cuda_unavailable, default_max_tp, tp_degrees

log = logging.getLogger(__name__)

COMMS = ("d2d", "nccl")
DEFAULT_MEMORY = {"cpu": "64MiB", "cuda": "256MiB"}

class Instance:
    """A group of workers with one scheduler and serving loop, running a plan: a TP group over
    every layer (`stages` None), or a pipeline whose stage i runs layers stages[i] = (first, end)
    on workers[i]. `workers` lists the workers in rank order (after a transformation rank order
    need not be worker order)."""

    def __init__(self, host, workers, tp, stages=None, kvs=None):
        self.host = weakref.proxy(host)  # the host owns its instances: no cycle
        self.workers = tuple(workers)
        self.tp = tp
        self.stages = tuple(stages) if stages else None
        ranks = [host.worker(w) for w in self.workers]
        # kvs: the ranks' KV caches when not the workers' own (a replicated host's TP instances
        # run on views of them, whose blocks hold tp times the tokens)
        kvs = kvs or [w.kv for w in ranks]
        self.block_tokens = kvs[0].block_size
        if self.stages:
            self._c = _C.Engine([[w.c_model] for w in ranks], [[w.kv._c] for w in ranks],
                                [None] * len(ranks), host.max_batch_tokens, host.max_running,
                                host.max_prefill_chunk, layers=list(self.stages))
        else:
            comm = host.comm(min(self.workers), tp) if tp > 1 else None
            self._c = _C.Engine([w.c_model for w in ranks], [kv._c for kv in kvs], comm,
                                host.max_batch_tokens, host.max_running, host.max_prefill_chunk)
        self.loop = InstanceLoop(self._c, host.model.config, host.clock,
                                 getattr(host.model, "tokenizer", None))

    @property
    def layout(self):
        """'TP2', or 'PP2' (an even split) / 'PP[3,1]' (gyges.layout's grammar)."""
        return part_string(self.tp, [end - first for first, end in self.stages or ()])

    @property
    def requests(self):
        return self.loop.requests

    def close(self):
        """Stops the serving loop (its rank threads end); the requests' handles stay valid."""
        self._c = None
        self.loop._c = None

    @property
    def closed(self):
        return self._c is None

    def readmit(self, handle, tokens, stop_tokens, info):
        """Takes a request back from its handle alone, with no KV (gyges.recovery): tokens are
        its prompt and output so far, info the scheduler state it arrives in (queued)."""
        params = handle.params
        self._c.adopt(handle.id, tokens, len(handle.prompt), params.max_tokens,
                      float(params.temperature), params.top_k, float(params.top_p), params.seed,
                      stop_tokens, info, [-1] * self.tp)
        self.loop.requests[handle.id] = handle

    # ---- what transformations ask of an instance ----
    def request_ids(self):
        """The unfinished requests, in the order they came."""
        return self._c.request_ids()

    def request_seqs(self, rid):
        """The request's KV sequence in each rank's cache (-1: none)."""
        return self._c.export(rid)["seqs"]

    def stage_seq(self, stage, rid):
        """A pipeline's request `rid`: its KV sequence in stage `stage`'s cache (-1: none)."""
        return self._c.stage_seq(stage, 0, rid)

    def take(self, src, rid, seqs):
        """Moves request `rid` here from instance `src` with its progress and sampling state
        (gy_engine_take); seqs: its KV sequence in each of this instance's ranks' caches."""
        self._c.take(src._c, rid, list(seqs))
        self.loop.requests[rid] = src.loop.requests.pop(rid)

    def detach_kv(self):
        """Forgets the requests' KV sequences without freeing them: a transformation has
        planned where they go."""
        self._c.detach_kv()

    # A layer-staggered transformation runs a second stage over the same workers (per rank
    # another C model and KV cache, and its own TP groups) beside this instance's, split at a
    # boundary layer that moves down step by step (engine/stage.h).
    def begin_transition(self, models, kvs, groups, groups_above=False):
        """groups: [(engine ranks, Comm or None)]; they run layers [0, boundary) (scale-up: the
        old groups), or with groups_above layers [boundary, L) (scale-down: the new groups)."""
        self._c.transition_begin(models, [kv._c for kv in kvs], groups, groups_above)

    def transition_adopt(self, rid, group, seqs):
        self._c.transition_adopt(rid, group, list(seqs))

    def transition_table(self):
        return self._c.transition_table()

    def transition_seq(self, rid, rank):
        return self._c.transition_seq(rid, rank)

    @property
    def boundary(self):
        return self._c.transition_boundary()

    def set_boundary(self, layer):
        self._c.transition_set_boundary(layer)

    def end_transition(self):
        self._c.transition_end()

    def detach_transition(self):
        """Forgets the second geometry's sequences without freeing them."""
        self._c.transition_detach()

    def capacity_blocks(self):
        return self._c.stats()["capacity_blocks"]

    def blocks_for(self, tokens):
        return -(-tokens // self.block_tokens)

    def fits(self, tokens):
        """Whether a request of `tokens` tokens (prompt and max_tokens) fits the KV it could hold."""
        return self.blocks_for(tokens) <= self.capacity_blocks()

    def load(self):
        """Tokens this instance still has to hold, over its capacity: for placement."""
        blocks = sum(self.blocks_for(len(r.prompt) + r.params.max_tokens)
                     for r in self.loop.requests.values())
        return blocks / max(self.capacity_blocks(), 1)

    def __repr__(self):
        return f"Instance({self.layout}, workers={list(self.workers)}, requests={len(self.requests)})"


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
                 comm=None, weights="sharded", kv_stack=1):
        checks.integer("workers", workers, lo=1)
        for name, value in (("block_size", block_size), ("threads_per_worker", threads_per_worker),
                            ("max_batch_tokens", max_batch_tokens), ("max_running", max_running)):
            checks.integer(name, value, lo=1)
        checks.integer("max_prefill_chunk", max_prefill_chunk, lo=0)
        if backend not in DEFAULT_MEMORY:
            raise InvalidArgumentError(f"unknown backend {backend!r}; expected one of "
                                       f"{', '.join(DEFAULT_MEMORY)}")
        if layout is not None and not isinstance(layout, str):
            raise ArgumentTypeError(f"layout must be a string like '4xTP1', got {layout!r}")
        if weights not in ("sharded", "replicated"):
            raise InvalidArgumentError(f"weights must be 'sharded' (a TP rank keeps its shards; "
                                       f"Gyges transformations move them) or 'replicated' (every "
                                       f"worker keeps the whole model; Flying Serving switches), "
                                       f"got {weights!r}")
        if weights == "replicated" and backend != "cpu":
            raise UnavailableError("weights='replicated' runs on the CPU backend: the CUDA "
                                   "attention kernels have not been checked with the adaptor's "
                                   "longer TP blocks")
        self._lock = FairLock()
        layout = layout or f"{workers}xTP1"
        groups = parse_layout(layout, workers, model.config.num_hidden_layers)
        if not isinstance(kv_stack, int) or kv_stack < 1:
            raise InvalidArgumentError(f"kv_stack must be a positive int, got {kv_stack!r}")
        if any(n % kv_stack for _, _, stages in groups for n in stages or ()):
            raise InvalidArgumentError(f"layout {layout!r}: with kv_stack={kv_stack} every "
                                       f"pipeline stage holds whole runs of {kv_stack} layers")
        if weights == "replicated" and any(stages for _, _, stages in groups):
            raise InvalidArgumentError(f"layout {layout!r}: a replicated host switches between DP "
                                       f"and TP groups; pipelines need sharded weights")
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.kv_layout = kv_layout
        self.max_batch_tokens, self.max_running = max_batch_tokens, max_running
        self.max_prefill_chunk = max_prefill_chunk
        self.max_tp = max_tp or default_max_tp(model.config, limit=8)
        self.tp_degrees = tp_degrees(model.config, self.max_tp)
        memory_per_worker = memory_per_worker or DEFAULT_MEMORY[backend]
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
        # How transformations move KV bytes: host memory, or device copies (gyges.transform.kv_move)
        self.kv_move = kv_move.for_backend(backend)
        # What a worker is made of: how the host makes one again when its group is rebuilt.
        self._worker_args = dict(page_size=page_size,
                                 block_size=block_size, kv_layout=kv_layout,
                                 weight_dtype=weight_dtype, max_tp=self.max_tp,
                                 threads=threads_per_worker, pad_ffn=pad_ffn, backend=backend,
                                 kv_stack=kv_stack)
        self._workers = [self.new_worker(i) for i in range(workers)]
        self.instances = []
        self.replicas = None
        if weights == "replicated":
            # every worker keeps the whole model: DP and TP engines over the same replicas
            # (gyges.flying), the layout's TP groups bound from the start
            for first, tp, _ in groups:
                self.check_group(first, tp)
            self.replicas = flying.Replicas(
                self, lambda ws, tp, kvs: Instance(self, ws, tp, kvs=kvs))
            self.instances = self.replicas.instances()
            for first, tp, _ in groups:
                if tp > 1:
                    self.replicas.switch(range(first, first + tp), tp, "hard")
            groups = []
        for first, tp, stages in groups:
            if stages:  # a pipeline: worker first + i holds the layers of stage i
                bounds = [sum(stages[:i]) for i in range(len(stages) + 1)]
                ranges = list(zip(bounds[:-1], bounds[1:]))
                for i, (lo, hi) in enumerate(ranges):
                    self._workers[first + i].join_stage(lo, hi)
                self.instances.append(Instance(self, range(first, first + len(stages)), 1, ranges))
                continue
            self.check_group(first, tp)
            for rank in range(tp):
                if tp > 1:
                    self._workers[first + rank].join_tp(tp, rank)
            self.instances.append(Instance(self, range(first, first + tp), tp))
        self.transformations = []
        self._next_id = 0
        self._executor = ThreadPoolExecutor(max_workers=max(len(self.instances), 1))
        self.steps = 0

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
        return Worker(self.model, memory=self.worker_memory[index], device=self.devices[index] or 0,
                      **self._worker_args)

    def worker(self, index):
        self._check_open()
        checks.integer("index", index, 0, len(self._workers) - 1)
        return self._workers[index]

    @property
    def n_workers(self):
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
        if self.replicas is not None:
            return layout_string(self.replicas.layout_parts())
        return layout_string([inst.layout for inst in self.instances])

    @property
    def weights(self):
        """'replicated' (every worker keeps the whole model: switch()) or 'sharded'."""
        return "replicated" if self.replicas is not None else "sharded"

    def serving_instances(self):
        """The instances that step now: all of them, except on a replicated host, where each
        worker steps its DP engine or its bound group's TP engine."""
        return self.replicas.serving() if self.replicas is not None else list(self.instances)

    # ---- Flying Serving (weights="replicated") ----
    def switch(self, workers, tp, preempt="wait", tp_work=()):
        """Binds an aligned group of workers of a replicated host for TP work (tp = their
        number), or releases it to DP (tp=1); nothing is copied, mapped or made (gyges.flying).
        preempt: "wait" (bind once the members' running DP requests are done), "soft" (and
        meanwhile start pending TP requests in DP mode on idle members, recomputed at the bind)
        or "hard" (bind now, pausing the members' DP requests with their KV). A release waits
        for the group's TP requests to finish ("wait"), or recomputes them on the members in DP
        mode now ("soft", "hard"). tp_work: handles of requests on the members that are TP
        work started in DP mode (a controller's soft start): at the bind they move to the TP
        engine and are recomputed, like soft preemption's. Returns a flying.Switch: s.done,
        s.stats."""
        with self._lock:
            self._check_open()
            if self.replicas is None:
                raise InvalidArgumentError("switch() is for hosts built with "
                                           "weights='replicated'; this host's workers keep their "
                                           "shards only: use transform()")
            s = self.replicas.switch(workers, tp, preempt, tp_work=tp_work)
            log.info("switch of workers %s to TP%s (%s)%s", sorted(workers), tp, preempt,
                     "" if s.done else ": waiting")
            return s

    def modes(self):
        """Per worker: 'DP', 'TPk' (bound into a TPk group) or 'paused' (waiting to bind: it
        admits nothing and finishes its running DP requests). A sharded host: its TP degrees."""
        with self._lock:
            self._check_open()
            if self.replicas is not None:
                return self.replicas.modes()
            return [f"TP{inst.tp}" for inst in self.instances for _ in inst.workers]

    def make_instance(self, workers, tp):
        return Instance(self, workers, tp)

    # ---- what transformations change: instances come and go through these ----
    def install(self, instance):
        """Starts serving an instance (kept in order of first worker)."""
        self.instances.append(instance)
        self.instances.sort(key=lambda inst: min(inst.workers))

    def retire(self, instance):
        """Stops an instance; its requests must have moved elsewhere (or its KV been detached)."""
        if instance in self.instances:
            self.instances.remove(instance)
        instance.close()

    def begin_change(self):
        """Marks the point past which a failing transformation rebuilds its group
        (gyges.recovery) instead of being refused: before it, it has only looked."""
        self._changing = True

    # ---- transformation ----
    def transform(self, workers, tp, method="gyges", layers_per_step=None, weights_from="peers",
                  phase_chunks=4, overlap=False):
        """Changes the TP degree of an aligned group of workers while its requests are in flight:
        workers=(0, 1, 2, 3), tp=4 merges the instances there into one TP4 instance; tp=1 splits
        a TP4 instance into four TP1 ones. Without layers_per_step every layer moves at once,
        between two steps; with it, host.step() moves that many layers per step (last layer
        first) and serving goes on in between (t.done tells when it is over). overlap=True
        reads the next layers' KV on a low-priority thread while the step runs, so that a step
        only patches the tokens added since and writes them out; a scale-up also releases the
        moved layers' FFN pages there. phase_chunks cuts each all-to-all phase of the in-place KV
        migration into rounds (more rounds, less extra memory). weights_from: where a
        scale-down gets FFN shards back ("peers" or "host"). Returns the Transformation handle.

        Refused with a gyges.Error naming the reason, and nothing changed, when it cannot be
        done: bad arguments, too little memory, or a live NumPy view of a group worker's memory
        (its pages are about to change). A failure past that point (an allocation, a page, a
        copy or a collective failing) rebuilds the group in the target layout and recomputes its
        requests (gyges.recovery): t.recovered and t.error say so; no request is lost."""
        with self._lock:
            self._check_open()
            before = self.layout()
            try:
                t = self._transform(workers, tp, method, layers_per_step, weights_from,
                                    phase_chunks, overlap)
            except Exception as e:
                log.warning("transformation of workers %s to TP%s refused: %s", workers, tp, e)
                raise
            log.info("transformation %s -> %s (%s%s)%s", before, self.layout(), method,
                     "" if layers_per_step is None else f", {layers_per_step} layers a step",
                     "" if t.done else ": under way")
            return t

    def _check_transform_args(self, workers, tp, layers_per_step, weights_from, phase_chunks,
                              overlap):
        workers = checks.int_sequence("workers", workers, 0, len(self._workers) - 1)
        if not workers:
            raise InvalidArgumentError("workers must name at least one worker, got none")
        if len(set(workers)) != len(workers):
            raise InvalidArgumentError(f"workers {workers} name a worker twice")
        tp = checks.integer("tp", tp, lo=1)
        if layers_per_step is not None:
            checks.integer("layers_per_step", layers_per_step, lo=1)
        checks.integer("phase_chunks", phase_chunks, lo=1)
        checks.boolean("overlap", overlap)
        if weights_from not in ("peers", "host"):
            raise InvalidArgumentError(f"weights_from must be 'peers' or 'host', got "
                                       f"{weights_from!r}")
        return sorted(workers), tp

    def _transform(self, workers, tp, method, layers_per_step, weights_from, phase_chunks,
                   overlap):
        if self.replicas is not None:
            raise TransformError("this host keeps a full replica on every worker "
                                 "(weights='replicated'): it changes DP and TP with switch(), "
                                 "which moves nothing; Gyges transformations move the shards of "
                                 "a sharded host")
        if any(not t.done for t in self.transformations):
            raise TransformError("a transformation is already under way; wait until it is done")
        workers, tp = self._check_transform_args(workers, tp, layers_per_step, weights_from,
                                                 phase_chunks, overlap)
        if self.backend == "cuda":
            self._check_cuda_transform(method, layers_per_step)
        first, k = workers[0], len(workers)
        if workers != list(range(first, first + k)) or first % k or k not in self.tp_degrees:
            raise TransformError(f"workers {workers} are not an aligned group (k consecutive "
                                 f"workers from a multiple of k, k a TP degree of the model: "
                                 f"{', '.join(map(str, self.tp_degrees))})")
        current = [inst for inst in self.instances if set(inst.workers) & set(workers)]
        piped = [inst for inst in current if inst.stages]
        if piped:
            raise TransformError(f"workers {workers} serve a pipeline ({piped[0].layout} on "
                                 f"workers {list(piped[0].workers)}): Gyges transformations change "
                                 f"TP groups over every layer; re-splitting a pipeline is "
                                 f"PipeLive's reconfiguration")
        if any(not set(inst.workers) <= set(workers) for inst in current):
            raise TransformError(f"workers {workers} are busy in a group that reaches outside "
                                 f"them (layout {self.layout()})")
        staggered = layers_per_step is not None and method != "stop_world"
        if tp == k:
            self.check_group(first, k)
            target = [(first, k)]
            if staggered:
                build = lambda: StaggeredScaleUp(self, first, k, method, layers_per_step, overlap)
            else:
                build = lambda: scale_up(self, first, k, method, chunks=phase_chunks)
        elif len(current) == 1 and current[0].tp == k:
            self.check_group(first, tp)
            if tp > k or k % tp:
                raise TransformError(f"scale-down goes from TP{k} to a smaller divisor, not TP{tp}")
            target = [(first + j * tp, tp) for j in range(k // tp)]
            if staggered:
                build = lambda: StaggeredScaleDown(self, first, k, tp, method, layers_per_step,
                                                   weights_from, overlap)
            else:
                build = lambda: scale_down(self, first, k, tp, method, weights_from)
        else:
            raise TransformError(f"cannot take workers {workers} (layout {self.layout()}) to "
                                 f"TP{tp}: merge them into TP{k} or split one TP{k} instance")
        viewed = views_in(self, workers)
        if viewed:
            raise BusyError(f"{viewed}: a transformation of workers {workers} changes their "
                            f"pages; delete the views first")
        source = [(min(inst.workers), inst.tp) for inst in current]
        self._changing = False  # set by the transformation at its first change
        try:
            t = build()
        except Exception as e:
            if not self._changing:
                raise  # refused: nothing changed
            t = Transformation("scale-up" if tp == k else "scale-down", workers,
                               current[0].tp if current else tp, tp, method)
            t.source_layout, t.target_layout, t.source_instances = source, target, current
            self.transformations.append(t)
            return recovery.rebuild(self, t, target, source, recovery.group_handles(
                current + [i for i in self.instances if set(i.workers) & set(workers)]), e,
                extra_instances=current)
        t.source_layout, t.target_layout, t.source_instances = source, target, current
        self.transformations.append(t)
        return t

    def reconfigure(self, instance, layers, mode="live", tau=50, layers_per_step=1,
                    max_rounds=64):
        """Re-splits a pipeline instance live, in place (PipeLive, gyges.pipelive): `layers`
        gives each of its workers' new layer count (PP[3,1] -> layers=[1, 3]). mode "live"
        (weights and KV copied step by step, dirty-bitmap patching, a commit once fewer than
        `tau` tokens lag), "no_patch" (the KV copied in the pause at commit) or "stop_copy"
        (everything in that pause). host.step() advances it; returns the Reconfiguration
        (`done`, `stats`). Refused, changing nothing, when the blocks in use exceed what the
        intermediate layout leaves (B_shrink) or another change is under way."""
        with self._lock:
            self._check_open()
            if not isinstance(instance, Instance) or instance not in self.instances:
                raise InvalidArgumentError(f"instance must be one of this host's instances, got "
                                           f"{instance!r}")
            if any(not t.done for t in self.transformations):
                raise TransformError("a transformation is already under way; wait until it is done")
            viewed = views_in(self, instance.workers)
            if viewed:
                raise BusyError(f"{viewed}: a re-split changes the workers' pages; delete the "
                                f"views first")
            r = pipelive.Reconfiguration(self, instance, layers, mode, tau, layers_per_step,
                                         max_rounds)
            self.transformations.append(r)
            return r

    def buddy(self, instances, live=False, link=None, layers_per_step=1):
        """KunServe: the TP1 instances `instances` (Instance objects or indices into
        host.instances; neighbouring workers) become one buddy group:
        worker k of g keeps layers [k L/g, (k+1) L/g) of one shared copy of the parameters and
        drops the rest (that memory is KV room at once), each request's KV of the layers now
        held by a buddy is copied there, and the group serves as a pipeline (new requests enter
        at its first stage). Requests keep their tokens bit for bit. live=False exchanges the KV
        before the next step; live=True (CPU backend) serves on at once, moving the KV a layer
        at a time as host.step goes (`layers_per_step`, or what `link` leaves over), each layer
        not yet moved attending remotely on the worker that holds its KV
        (gyges.kunserve.Exchange). link, a gyges.kunserve.Link, paces the transfers. Refused,
        changing nothing, when g does not divide the layers or the KV does not fit. Returns a
        gyges.kunserve.Buddy (stats, exchange)."""
        with self._lock:
            self._check_open()
            if not isinstance(instances, (list, tuple)):
                raise InvalidArgumentError(f"instances must be a list of instances or indices "
                                           f"into host.instances, got {instances!r}")
            insts = [i if isinstance(i, Instance) else
                     self.instances[checks.integer("instances", i, 0, len(self.instances) - 1)]
                     for i in instances]
            return kunserve.form(self, insts, live, link, layers_per_step)

    def restore(self, buddy, weights_from="peers", live=False, link=None, layers_per_step=1):
        """KunServe: a buddy group gets its parameters back (from the peers that hold each part,
        or the host copy), its requests go to the least loaded member with their KV of every
        layer, and the members serve as TP1 instances again. live=True streams the parameters
        back while the group serves (`layers_per_step` a step, or what `link` carries), then
        switches between two steps (gyges.kunserve.Restoring, host.step advances it)."""
        with self._lock:
            self._check_open()
            return kunserve.restore(self, buddy, weights_from, live, link, layers_per_step)

    def _advance(self, t):
        """Moves a layer-staggered transformation on; a failure rebuilds its group (one that
        can take its changes back, a pipeline re-split, does so itself and raises)."""
        if t.rolls_back:
            return t.advance()
        try:
            t.advance()
        except Exception as e:
            group = set(t.workers)
            engines = [t.engine] if getattr(t, "engine", None) is not None else []
            handles = recovery.group_handles(
                engines + list(t.source_instances) +
                [i for i in self.instances if set(i.workers) & group])
            recovery.rebuild(self, t, t.target_layout, t.source_layout, handles, e,
                             extra_instances=engines + list(t.source_instances))

    def _check_cuda_transform(self, method, layers_per_step):
        """What a transformation of CUDA workers cannot do yet, refused before anything changes:
        the KV and the FFN shards move by device copies within one GPU (virtual workers), every
        layer at once."""
        if self.comm_backend != "d2d":
            raise UnavailableError(
                "transformations of CUDA workers on separate GPUs (comm='nccl') are not "
                "implemented: moving KV and FFN shards between GPUs needs peer copies or the "
                "migration communicator's all-to-all; virtual workers sharing one GPU (comm='d2d') "
                "can transform")
        if layers_per_step is not None:
            raise UnavailableError(
                "layer-staggered transformations (layers_per_step) run on the CPU backend only: "
                "on CUDA the old groups' hidden states at the boundary would have to be gathered "
                "on the device, which is not implemented; omit layers_per_step to move every "
                "layer at once")
        if method == "basic" or (method == "partial_swap" and self.kv_layout != "header"):
            how = ("method='basic'" if method == "basic" else
                   f"method='partial_swap' with the {self.kv_layout!r} KV layout (basic's migration)")
            raise UnavailableError(
                f"{how} builds the new KV blocks through host copies (KVCache.write), which "
                f"device arenas do not have; use 'gyges', 'stop_world' or 'partial_swap' with "
                f"the header layout")

    # ---- serving ----
    def submit(self, tokens, params=None, instance=None, tp=None, priority=0):
        """Places a request on `instance` (an index into host.instances) or on the least-loaded
        instance that can hold it; returns its handle. A bad prompt or parameter raises a
        gyges.Error naming it and queues nothing.

        On a replicated host, tp=k asks for TP work: the request queues on an aligned group of k
        workers, which binds for it ("soft", or "hard" when priority > 0) and goes back to DP
        once no TP request is left; a request no DP worker can hold binds the smallest group
        whose pooled KV holds it."""
        params = check_params(params)
        tokens, text = tokenize_prompt(tokens, getattr(self.model, "tokenizer", None))
        priority = checks.integer("priority", priority, lo=0)
        with self._lock:
            self._check_open()
            length = len(tokens) if hasattr(tokens, "__len__") else 0
            group = None
            if tp is not None:
                tp = checks.integer("tp", tp, lo=1)
                if self.replicas is None:
                    raise InvalidArgumentError("tp= asks a replicated host (weights='replicated') "
                                               "for a mode; this host's instances have theirs")
            if instance is not None:
                target = self.instances[checks.integer("instance", instance, 0,
                                                       len(self.instances) - 1)]
            elif tp is not None and tp > 1:
                group = self.replicas.group(tp=tp)
                target = group.instance
            else:
                pool = (self.replicas.placements() if self.replicas is not None
                        else self.instances)
                if tp == 1:
                    pool = [inst for inst in pool if inst.tp == 1]
                fits = [inst for inst in pool if inst.fits(length + params.max_tokens)]
                if not fits and self.replicas is not None and tp is None:
                    group = self.replicas.smallest_group_for(length + params.max_tokens)
                    fits = [group.instance] if group is not None else []
                if not fits:
                    raise InvalidArgumentError(
                        f"the request needs {length + params.max_tokens} tokens of KV but no "
                        f"instance holds that many (layout {self.layout()}); merge instances "
                        f"first")
                target = min(fits, key=Instance.load)
            request = target.loop.add(self._next_id, tokens, params, prompt_text=text)
            self._next_id += 1
            if group is not None:
                self.replicas.ask(group, "hard" if priority > 0 else "soft")
            return request

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
            for inst in self.instances:
                if inst.loop.requests.get(request.id) is request:
                    return inst.loop.abort(request)
            raise InvalidArgumentError(f"request {request.id} is not served by this host")

    def kv_sequences(self, request):
        """{worker: the KV sequence in that worker's cache holding the request} over the
        workers of its instance; -1 where it holds none (queued, preempted, finished)."""
        with self._lock:
            self._check_open()
            for inst in self.instances:
                if not request.finished and inst.loop.requests.get(request.id) is request:
                    return dict(zip(inst.workers, inst.request_seqs(request.id)))
            return {}

    def has_unfinished(self):
        with self._lock:
            if self._workers is None:
                return False
            return any(inst.loop.unfinished() for inst in self.instances) or any(
                not t.done for t in self.transformations)

    def step(self):
        """Advances a layer-staggered transformation by its layers, then runs one step of every
        instance, in parallel (each releases the GIL while it computes). A failed instance step
        changes nothing of that instance (the others' steps stand) and its error is raised
        after all have run."""
        with self._lock:
            self._check_open()
            for t in self.transformations:
                if not t.done and hasattr(t, "advance"):
                    self._advance(t)
            if self.replicas is not None:
                self.replicas.advance()
            busy = [inst for inst in self.serving_instances() if inst.loop.unfinished()]
            if not busy:
                blocked = [t for t in self.transformations if not t.done and t.blocked_by]
                if blocked:
                    raise BusyError(f"{blocked[0]!r} cannot move on: {blocked[0].blocked_by}")
                stuck = self.replicas and self.replicas.stuck()
                if stuck:
                    raise BusyError(stuck)
                return 0
            if len(busy) == 1:
                tokens = busy[0].loop.step()
            else:
                futures = [self._executor.submit(inst.loop.step) for inst in busy]
                results, errors = [], []
                for f in futures:  # every instance's step ends before anything is raised
                    try:
                        results.append(f.result())
                    except Exception as e:
                        errors.append(e)
                if errors:
                    raise errors[0]
                tokens = sum(results)
            if self.replicas is not None:
                self.replicas.advance(bind=False)
            if tokens:
                self.steps += 1
            return tokens

    def close(self):
        """Stops every instance and gives the workers' memory back (once no NumPy view of it
        is alive). Unfinished requests finish with reason "abort". Later calls raise StateError;
        closing twice is harmless."""
        with self._lock:
            if self._workers is None:
                return
            for t in self.transformations:
                if not t.done:
                    t.release_resources()
            for inst in self.instances:
                inst.loop.close("the host was closed")
                inst.close()
            self.instances = []
            self.transformations = []
            self._executor.shutdown(wait=True)
            self._workers = None
            self.comms = None

    def stats(self):
        """What a serving front end reports: per instance its layout, workers and requests
        waiting and running; per worker the KV blocks in use out of its instance's capacity."""
        with self._lock:
            self._check_open()
            instances, workers = [], []
            for inst in self.serving_instances():
                c = inst._c.stats()
                instances.append({"layout": inst.layout, "workers": list(inst.workers),
                                  "waiting": c["waiting"] + c["preempted_queued"],
                                  "running": c["running"]})
                for w in inst.workers:
                    kv = self._workers[w].kv.stats()
                    workers.append({"worker": w, "kv_blocks_used": kv["n_blocks"] - kv["free_blocks"],
                                    "kv_blocks_capacity": c["capacity_blocks"]})
            return {"instances": instances, "workers": sorted(workers, key=lambda x: x["worker"]),
                    "transformations": len(self.transformations)}

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
        where = "" if self.backend == "cpu" else f", backend='cuda', comm={self.comm_backend!r}"
        return f"Host(workers={len(self._workers)}, layout={self.layout()!r}{where})"
