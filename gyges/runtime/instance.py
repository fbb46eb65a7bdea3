"""An Instance: a group of a host's workers with one C serving loop (gyges._C.Engine) running a
plan (engine/stage.h): a TP group over every layer, or a pipeline whose stage i runs layers
stages[i] = (first, end) on workers[i]. Its requests' handles live in its InstanceLoop.

Everything a reconfiguration does to an instance goes through the methods below (moving requests
and their KV sequences, holding admission, a layer-staggered transition's second stage, a
pipeline's dirty bitmaps, copies between stages and re-plans, remote attention): the C engine
and the loop are this class's own."""
import weakref

from .. import _C
from .engine import InstanceLoop, engine_params
from .kv_cache import KVMove
from .layout import part_string


class Instance:
    """workers: in rank order (after a transformation rank order need not be worker order);
    stages: None (a TP group) or the layer range of each worker (a pipeline); kvs: the ranks'
    KV caches when not the workers' own (a replicated host's TP instances run on views of
    them, whose blocks hold tp times the tokens); span: the layers the stages cover when the
    rest of the model runs in another process (a leader, engine/peer.h: set_peer)."""

    def __init__(self, host, workers, tp, stages=None, kvs=None, span=None):
        self.host = weakref.proxy(host)  # the host owns its instances: no cycle
        self.workers = tuple(workers)
        self.tp = tp
        self.stages = tuple(stages) if stages else None
        ranks = [host.worker(w) for w in self.workers]
        kvs = kvs or [w.kv for w in ranks]
        self.kvs = tuple(kvs)  # the ranks' caches, in rank order
        self.block_tokens = kvs[0].block_size
        self.peered = False   # a leader with its follower attached (set_peer)
        if self.stages:
            self._c = _C.Engine([[w.c_model] for w in ranks], [[kv.handle] for kv in kvs],
                                [None] * len(ranks), host.max_batch_tokens, host.max_running,
                                host.max_prefill_chunk, layers=list(self.stages), span=span)
        else:
            comm = host.comm(min(self.workers), tp) if tp > 1 else None
            self._c = _C.Engine([w.c_model for w in ranks], [kv.handle for kv in kvs], comm,
                                host.max_batch_tokens, host.max_running, host.max_prefill_chunk)
        self._loop = InstanceLoop(self._c, host.model.config, host.clock,
                                  getattr(host.model, "tokenizer", None),
                                  seed=getattr(host, "seed", 0), max_pos=ranks[0].max_pos)

    @property
    def layout(self):
        """'TP2' ('TP2EP2' on an expert-parallel host), or 'PP2' (an even split) / 'PP[3,1]'
        (gyges.runtime.layout's grammar)."""
        return part_string(self.tp, [end - first for first, end in self.stages or ()],
                           getattr(self.host, "expert_parallel", False))

    def __repr__(self):
        return f"Instance({self.layout}, workers={list(self.workers)}, requests={len(self.requests)})"

    # ---- serving ----
    @property
    def requests(self):
        """{id: Request} of the requests it serves (unfinished)."""
        return self._loop.requests

    def add(self, request_id, tokens, params, prompt_text=None, arrival=None):
        return self._loop.add(request_id, tokens, params, arrival=arrival, prompt_text=prompt_text)

    def step(self):
        """One step of its C loop; returns the tokens it ran through the model."""
        tokens = self._loop.step()
        if self.peered and not self._loop.unfinished():
            self._c.peer_flush()   # an idle pair holds no KV on either side
        return tokens

    def abort(self, request):
        aborted = self._loop.abort(request)
        if aborted and self.peered and not self._loop.unfinished():
            self._c.peer_flush()
        return aborted

    def serves(self, request):
        return self._loop.requests.get(request.id) is request

    def unfinished(self):
        return self._loop.unfinished()

    def stop(self, why):
        """Stops serving: its requests finish with reason "abort" and `why`; the C loop goes."""
        if self._c is not None:
            self._loop.close(why)
        self.close()

    def close(self):
        """Lets the C loop go (its rank threads end); the requests' handles stay valid."""
        self._c = None
        self._loop.drop_engine()

    @property
    def closed(self):
        return self._c is None

    # ---- its state ----
    def stats(self):
        """The scheduler's counters: waiting, running, preempted, capacity_blocks, ..."""
        return self._c.stats()

    def info(self, rid):
        """A request's scheduler record (state, n_computed, n_generated, timings, ...)."""
        return self._c.info(rid)

    def export(self, rid):
        """A request's record and its KV sequence on every rank ({"info", "seqs", ...})."""
        return self._c.export(rid)

    def hold(self, held):
        """held: admits nothing new (queued requests wait) until released."""
        self._c.hold(bool(held))

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
                     for r in self._loop.requests.values())
        return blocks / max(self.capacity_blocks(), 1)

    # ---- a pipeline split between processes (engine/peer.h) ----
    def set_peer(self, outlet, capacity_blocks):
        """The rest of the model runs behind outlet(step) -> logits (a Follower's follow, maybe
        in another process), which holds capacity_blocks KV blocks; None detaches it."""
        self._c.set_outlet(outlet, int(capacity_blocks))
        self.peered = outlet is not None

    def peer_flush(self):
        """Tells the follower of the requests this instance let go of since its last step."""
        self._c.peer_flush()

    # ---- moving requests ----
    def request_ids(self):
        """The unfinished requests, in the order they came."""
        return self._c.request_ids()

    def request_seqs(self, rid):
        """The request's KV sequence in each rank's cache (-1: none)."""
        return self._c.export(rid)["seqs"]

    def stage_seq(self, stage, rid):
        """A pipeline's request `rid`: its KV sequence in stage `stage`'s cache (-1: none)."""
        return self._c.stage_seq(stage, 0, rid)

    def take(self, src, rid, seqs, record=None):
        """Moves request `rid` here from instance `src` with its progress and sampling state
        (gy_engine_take); seqs: its KV sequence in each of this instance's ranks' caches (a
        pipeline's: one per stage). record: what record() said of it before an earlier move,
        to arrive as it was then (a rollback of a move that made it recompute)."""
        self._c.take(src._c, rid, list(seqs), record)
        self._loop.requests[rid] = src._loop.requests.pop(rid)

    def record(self, rid):
        """A request's scheduler progress, for take(..., record=): (state, generated, computed,
        prefill end, preemptions, arrival, first scheduled, first token)."""
        i = self._c.export(rid)["info"]
        return (i["state_id"], i["n_generated"], i["n_computed"], i["prefill_end"],
                i["n_preemptions"], i["arrival"], i["first_scheduled"], i["first_token"])

    def readmit(self, handle, tokens, stop_tokens, info, seqs=None):
        """Takes a request in from its handle: tokens are its prompt and output so far, info the
        scheduler state it arrives in, seqs its KV sequence in each rank's cache (None: no KV, it
        is recomputed: gyges.reconfig.recovery)."""
        self._c.adopt(handle.id, tokens, len(handle.prompt), engine_params(handle.params, stop_tokens),
                      info, list(seqs) if seqs is not None else [-1] * len(self.kvs))
        self._loop.requests[handle.id] = handle

    def let_go(self, rid):
        """Forgets request `rid` (its KV freed) without finishing its handle: it goes on
        elsewhere (runtime/request_packet.py)."""
        self._c.abort(rid)
        self._c.release(rid)
        self._loop.requests.pop(rid)

    @property
    def tokenizer(self):
        return self._loop.tokenizer

    def detach_kv(self):
        """Forgets the requests' KV sequences without freeing them: a reconfiguration has
        planned where they go."""
        self._c.detach_kv()

    def attach_kv(self, rid, seqs):
        """Sets request `rid`'s KV sequence on every rank (a rollback gives back what detach_kv
        or a take let go of)."""
        self._c.attach_kv(rid, list(seqs))

    # ---- a layer-staggered transformation's second stage (engine/transition.h) ----
    def begin_transition(self, models, kvs, groups, groups_above=False):
        """groups: [(engine ranks, Comm or None)]; they run layers [0, boundary) (scale-up: the
        old groups), or with groups_above layers [boundary, L) (scale-down: the new groups)."""
        self._c.transition_begin(models, [kv.handle for kv in kvs], groups, groups_above)

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

    def abort_transition(self):
        """Drops the second stage wherever the boundary is, freeing none of its sequences (a
        rollback moved its layers back and frees them itself); nothing when none runs."""
        self._c.transition_abort()

    # ---- a pipeline's stages (engine/replan.h, engine/remote.h) ----
    def set_dirty(self, stage, bitmap):
        """From the next step on, stage `stage` marks the KV slots it writes in `bitmap` (a
        _C.KVDirty; None stops)."""
        self._c.set_dirty(stage, 0, bitmap)

    def copy_layers(self, src_stage, dst_stage, first, end, words=None, slots=0, comm=None):
        """Every request's KV of model layers [first, end) from one stage's cache to another's
        (with `words`, a taken dirty bitmap of `slots` slots: only those slots), one KVMove of
        the sequences the engine pairs (over `comm`, the stages' migration communicator, when
        they are on different GPUs); returns the token slots copied."""
        src, dst = self.kvs[src_stage], self.kvs[dst_stage]
        move = KVMove(range(first, end), dirty=words, dirty_slots=slots if words is not None else None,
                      comm=comm)
        for src_seq, dst_seq in self._c.stage_pairs(src_stage, dst_stage, 0):
            move.add(src, dst, src_seq=src_seq, dst_seq=dst_seq)
        return move.run()["slots"]

    def replan(self, stages, models):
        """The same stages, ranks and caches with new layer ranges and models (between two
        steps; every request keeps its sequences)."""
        self._c.replan(list(stages), [[m] for m in models])
        self.stages = tuple(stages)

    def set_remote(self, rid, stage, src_stage, first, end):
        """Request `rid`'s attention in layers [first, end) of `stage` runs on `src_stage`'s
        ranks, over its KV there (an empty range ends it)."""
        self._c.set_remote(rid, stage, src_stage, first, end)

    def remote_stats(self):
        return self._c.remote_stats()
