"""KunServe's buddy groups (csrc/policy/buddy.h): which instances drop their replicated parameters
together when the cluster runs short of KV memory.

    plan = gyges.kunserve.plan(8, required_bytes=5 * P, param_bytes=P)
    plan.groups   # ((0, 1, 2, 3), (4, 5), (6, 7)): each group keeps one copy of the parameters
    plan.met      # True: the groups free (4-1 + 2-1 + 2-1) * P = 5 * P >= required
    plan.freed    # bytes freed for KV

A group of g instances serves as a pipeline over one copy of the parameters and frees (g - 1)
copies for KV. strategy="throughput" is the paper's Algorithm 1: merge the two smallest groups
until the requirement is met (small groups keep pipelines short); "memory" grows a single group
while what it frees stays within the original KV region (kv_bytes). Groups are ranges of
neighbouring instances here: each is a pipeline of workers next to each other.

On a real host (Host.buddy and Host.restore call form and restore below):

    b = host.buddy((0, 1), live=True, link=Link(bandwidth=50e6, latency=20e-6))
    # Exchange: the victims' KV moves a layer at a time while the group serves; a layer not
    # moved yet attends on the worker holding it (remote attention, gy_engine_set_remote)
    host.restore(b, live=True)
    # Restoring: weights, then KV (patched through dirty bitmaps) stream back while it serves;
    # the switch sends every request home
    b.stats     # weight and KV bytes, remote attention calls and bytes, stall and link seconds

Both are transformations host.step advances (host.transformations); blocking forms do all of it
between two steps.
"""
import time
from dataclasses import dataclass

import numpy as np

from . import _C
from .checks import integer, number
from .errors import (BusyError, InvalidArgumentError, OutOfMemoryError, StateError,
                     UnavailableError)
from .pipelive import weight_bytes

__all__ = ["Buddy", "BuddyPlan", "Exchange", "Link", "Restoring", "plan", "STRATEGIES"]

STRATEGIES = {"throughput": 0, "memory": 1}


@dataclass(frozen=True)
class BuddyPlan:
    groups: tuple      # tuples of instance indices, in instance order
    met: bool          # whether the freed bytes reach the requirement
    freed: float       # bytes freed: sum over groups of (size - 1) * param_bytes
    required: float
    strategy: str


def plan(n_instances, required_bytes, param_bytes, strategy="throughput", kv_bytes=None):
    """Buddy groups for `n_instances` instances that must free `required_bytes` of KV memory,
    each copy of the parameters taking `param_bytes`; kv_bytes caps what the memory-greedy
    strategy frees (KunServe: the original KV region). Unmet requirements come back with
    met=False (KunServe then scales out a new instance)."""
    n = integer("n_instances", n_instances, lo=1, hi=1 << 20)
    required = number("required_bytes", required_bytes, lo=0)
    param = number("param_bytes", param_bytes, lo=0, lo_open=True)
    if strategy not in STRATEGIES:
        raise InvalidArgumentError(f"strategy must be one of {', '.join(STRATEGIES)}, got "
                                   f"{strategy!r}")
    kv = 0.0 if kv_bytes is None else number("kv_bytes", kv_bytes, lo=0, lo_open=True)
    group_of, met, freed = _C.buddy_plan(n, float(required), float(param), STRATEGIES[strategy],
                                         float(kv))
    groups = {}
    for instance, g in enumerate(group_of):
        groups.setdefault(g, []).append(instance)
    return BuddyPlan(tuple(tuple(groups[g]) for g in sorted(groups)), bool(met), float(freed),
                     float(required), strategy)


# ---- buddy groups on a real host (KunServe 4.1-4.3) ----

class Link:
    """A worker-to-worker link for the CPU host (KunServe's RDMA between buddies): a transfer of
    n bytes in m messages takes m * latency + n / bandwidth seconds of wall time, spent asleep.
    Workers of one process copy in microseconds; a link makes a blocking exchange stall as long
    as it would on the network, and charges remote attention its round trips, so that live and
    blocking can be told apart. Off (None) unless given to host.buddy. Scale it to the model:
    a tiny model's KV is a few MiB, so 200 Gbps would hide everything."""

    def __init__(self, bandwidth, latency=0.0):
        self.bandwidth = number("bandwidth", bandwidth, lo=0, lo_open=True)   # bytes / s
        self.latency = number("latency", latency, lo=0)                       # s per message

    def seconds(self, nbytes, messages=1):
        return messages * self.latency + nbytes / self.bandwidth

    def send(self, nbytes, messages=1):
        """Sleeps as long as the transfer takes; returns the seconds."""
        t = self.seconds(nbytes, messages)
        if t > 0:
            time.sleep(t)
        return t

    def __repr__(self):
        return f"Link({self.bandwidth * 8 / 1e9:g} Gbps, {self.latency * 1e6:g} us)"


class Buddy:
    """A buddy group formed by host.buddy: the pipeline `instance` over `workers`, worker k
    keeping layers `ranges[k]` of the one copy of the parameters. `exchange` is the live
    exchange still moving the victims' KV (None when blocking; `done` once it has all moved).
    stats: weight_bytes_released, kv_bytes_exchanged, exchange_seconds, stall_seconds (serving
    stopped for the exchange), remote_attention_calls, remote_attention_bytes, activation_seconds
    (the link's time for them) and, after host.restore, weight_bytes_restored,
    kv_bytes_returned, restore_seconds (and, live, restore_stall_seconds: the final switch)."""

    def __init__(self, instance, ranges, stats, exchange=None):
        self.instance, self.ranges, self.stats = instance, tuple(ranges), stats
        self.workers = tuple(instance.workers)
        self.exchange = exchange
        self.restoring = None   # a live restore under way (Restoring), or done
        self.restored = False

    def __repr__(self):
        return f"Buddy(workers={list(self.workers)}, {self.instance.layout}" + \
               (", restored)" if self.restored else ")")


def _new_seq(kv, n_tokens):
    """A sequence of kv with room for n_tokens, the cache grown as needed (OutOfMemoryError
    when the budget cannot)."""
    need = -(-n_tokens // kv.block_size)
    while kv.free_blocks < need:   # (a page holds whole blocks, or a block spans pages)
        kv.grow(max(1, int((need - kv.free_blocks) // kv.blocks_per_page())))
    seq = kv.new_sequence()
    kv.reserve(seq, n_tokens)
    return seq


class _Paced:
    """What a live exchange and a live restore share: what one advance may move. Without a link,
    `layers_per_step` layers per key (a victim and buddy, a member, a pair of stages); with one,
    as many bytes as the link carried since the last advance, less what it spent on other
    traffic (`busy` seconds: remote attention's activations, which go first)."""

    def __init__(self, link, layers_per_step):
        self.link, self.layers_per_step = link, layers_per_step
        self._credit, self._last = 0.0, time.perf_counter()

    def _refill(self, busy=0.0):
        now = time.perf_counter()
        if self.link is not None:
            self._credit += max(now - self._last - busy, 0.0) * self.link.bandwidth
        self._last = now

    def _may(self, moved, key, nbytes):
        if self.link is None:
            return moved.get(key, 0) < self.layers_per_step
        return self._credit >= nbytes

    def _moved(self, moved, key, nbytes):
        self._credit -= nbytes
        moved[key] = moved.get(key, 0) + 1


class Exchange(_Paced):
    """A live KV exchange (KunServe 4.2): the victims, requests that ran on a member when the
    group formed, keep running in the pipeline while their KV of the layers a buddy now holds
    moves there one layer at a time. Until a layer has arrived, that layer's attention runs on
    the worker holding its KV (remote attention, gy_engine_set_remote: q, k, v go there, the
    output comes back; the parameters stay). A layer's KV moves whole between two steps, so
    nothing written meanwhile is lost or left stale. host.step advances it first; with a link
    (one, shared by the group's transfers), the activations of the step before go first and the
    KV takes what the link had left over since the last advance, else `layers_per_step` layers
    of every victim and buddy move per step. When all has moved, the caches keep their own
    layers (their other pages go)."""

    rolls_back = True   # a failed advance changes nothing; the next one tries again

    def __init__(self, host, buddy, chunks, link, layers_per_step, start):
        super().__init__(link, layers_per_step)
        self.host, self.buddy = host, buddy
        self.workers = buddy.workers
        self._w = [host.worker(w) for w in self.workers]
        self.pending = chunks           # [rid, src stage, dst stage, next layer], in order
        self.done, self.blocked_by, self.error = False, None, None
        self._calls = self._token_layers = 0
        self._start, self._advances = start, 0
        cfg = host.model.config
        hd = cfg.hidden_size // cfg.num_attention_heads
        # one token-layer of remote attention: q, k and v there, the attention output back
        self.row_bytes = 4 * hd * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
        if not chunks:
            self._finish()

    def __repr__(self):
        return f"Exchange(workers={list(self.workers)}, {len(self.pending)} layers to move)"

    def _activations(self):
        """Remote attention since the last look, in the stats and (with a link) on the link;
        returns the link's seconds for it."""
        pipe, st = self.buddy.instance, self.buddy.stats
        now = pipe._c.remote_stats()
        calls, rows = now["calls"] - self._calls, now["token_layers"] - self._token_layers
        self._calls, self._token_layers = now["calls"], now["token_layers"]
        st["remote_attention_calls"] += calls
        st["remote_attention_bytes"] += rows * self.row_bytes
        if self.link is None or not calls:
            return 0.0
        t = self.link.send(rows * self.row_bytes, 2 * calls)
        st["activation_seconds"] += t
        return t

    def advance(self):
        busy = self._activations()   # activations first: they have priority on the link
        self._advances += 1
        if self._advances == 1:
            return True   # right after forming: the first layers are on their way this step
        self._refill(busy)   # the KV's share: the link's time the activations left over
        pipe, live = self.buddy.instance, set(self.buddy.instance.request_ids())
        moved, keep, i = {}, [], 0
        try:
            for i, chunk in enumerate(self.pending):
                rid, j, k, layer = chunk
                hi = self.buddy.ranges[k][1]
                src, dst = pipe.stage_seq(j, rid), pipe.stage_seq(k, rid)
                if rid not in live or src < 0 or dst < 0:
                    # finished, or preempted (it recomputes where its record says): nothing to move
                    if rid in live:
                        pipe._c.set_remote(rid, k, j, 0, 0)
                    continue
                if not self._may(moved, (rid, k), len(self._w[j].kv.block_table(src)) *
                                 self._w[j].kv.block_bytes):
                    keep.append(chunk)
                    if self.link is not None:
                        keep.extend(self.pending[i + 1:])   # in order: the next waits for this one
                        break
                    continue
                nbytes = self._w[k].kv.copy_tokens_from(self._w[j].kv, dst, src, layer, layer + 1)
                pipe._c.set_remote(rid, k, j, layer + 1, hi)
                self._moved(moved, (rid, k), nbytes)
                self.buddy.stats["kv_bytes_exchanged"] += nbytes
                if layer + 1 < hi:
                    keep.append([rid, j, k, layer + 1])
        except BaseException:
            self.pending = keep + self.pending[i:]   # what moved stays moved; the rest waits
            raise
        self.pending = keep
        if not keep:
            self._finish()
        return True

    def _finish(self):
        """Every victim's KV is where its layers are: the caches keep their own layers."""
        for w, (lo, hi) in zip(self._w, self.buddy.ranges):
            w.kv.set_layers(lo, hi)
        self._activations()
        self.buddy.stats["exchange_seconds"] = time.perf_counter() - self._start
        self.done = True


def form(host, instances, live=False, link=None, layers_per_step=1):
    """host.buddy's work (the host's lock held): see Host.buddy."""
    if link is not None and not isinstance(link, Link):
        raise InvalidArgumentError(f"link must be a gyges.kunserve.Link or None, got {link!r}")
    layers_per_step = integer("layers_per_step", layers_per_step, lo=1)
    if live and host.backend != "cpu":
        raise UnavailableError("a live exchange runs attention remotely, which the CPU backend "
                               "does only; live=False exchanges the KV between two steps")
    insts = sorted(instances, key=lambda i: min(i.workers))
    g = len(insts)
    L = host.model.config.num_hidden_layers
    workers = [i.workers[0] for i in insts]
    if g < 2 or any(i.tp != 1 or i.stages or i not in host.instances for i in insts) or \
            workers != list(range(workers[0], workers[0] + g)):
        raise InvalidArgumentError(f"a buddy group is 2 or more TP1 instances of this host on "
                                   f"neighbouring workers, got {[i.layout for i in insts]} on "
                                   f"workers {workers}")
    if L % g:
        raise InvalidArgumentError(f"a group of {g} does not divide the model's {L} layers")
    if host.replicas is not None or any(not t.done for t in host.transformations):
        raise InvalidArgumentError("a buddy group needs a sharded host with no transformation "
                                   "under way")
    running = sum(inst._c.stats()["running"] for inst in insts)
    if running > host.max_running:
        raise BusyError(f"the members run {running} requests together, more than one instance "
                        f"runs (max_running={host.max_running})")
    ranges = [(k * L // g, (k + 1) * L // g) for k in range(g)]
    ws = [host.worker(w) for w in workers]
    start = time.perf_counter()
    # every request's sequence on its own worker, and its tokens
    own = {k: {rid: inst.request_seqs(rid)[0] for rid in inst.request_ids()}
           for k, inst in enumerate(insts)}
    held_before = sum(weight_bytes(w, w.weights.held_layers) for w in ws)
    dropped, made, moved = [], [], []
    old_models = [w.c_model for w in ws]
    pipe = None
    try:
        # 1. the parameters each worker no longer keeps go: their memory is KV room at once
        for k, (w, (lo, hi)) in enumerate(zip(ws, ranges)):
            gone = w.weights.held_layers - set(range(lo, hi))
            w.weights.drop_layers(gone)
            dropped.append((k, gone, w.weights.has_embed, w.weights.has_head))
            tied = host.model.config.tie_word_embeddings
            w.weights.set_ends(embed=k == 0 or (k == g - 1 and tied), head=k == g - 1)
        # 2. each worker gets a sequence, for every other member's request with KV, and (unless
        #    live: the exchange moves it later) its layers' KV
        exchanged, chunks = 0, []
        for k, (w, (lo, hi)) in enumerate(zip(ws, ranges)):
            for j, seqs in own.items():
                for rid, seq in seqs.items():
                    if j == k or seq < 0:
                        continue
                    new = _new_seq(w.kv, ws[j].kv.n_tokens(seq))
                    made.append((k, rid, new))
                    if live:
                        chunks.append([rid, j, k, lo])
                    else:
                        exchanged += w.kv.copy_tokens_from(ws[j].kv, new, seq, lo, hi)
        # 3. the pipeline over the members' stage models takes every request with its KV (the
        #    caches still hold every layer, so nothing is lost until all of it has worked)
        for w, (lo, hi) in zip(ws, ranges):
            w.c_model = w.model_for_layers(lo, hi)
        from .host import Instance
        pipe = Instance(host, workers, 1, ranges)
        news = {(k, rid): new for k, rid, new in made}
        for j, inst in enumerate(insts):
            for rid, seq in own[j].items():
                pipe.take(inst, rid, [seq if k == j else news.get((k, rid), -1)
                                      for k in range(g)] if seq >= 0 else [-1] * g)
                moved.append((j, rid))
        # 4. live: until a layer's KV has arrived, its attention runs where the KV is
        for rid, j, k, lo in chunks:
            pipe._c.set_remote(rid, k, j, lo, ranges[k][1])
    except BaseException:
        # refused past the first change: everything goes back (the weights from the host copy)
        for j, rid in reversed(moved):
            insts[j].take(pipe, rid, [own[j][rid]])
        if pipe is not None:
            pipe.close()
        for w, m in zip(ws, old_models):
            w.c_model = m
        for k, rid, new in made:
            ws[k].kv.free(new)
        for w in ws:  # the pages grown for the copies first: the weights need them back
            w.kv.trim()
        for k, gone, embed, head in dropped:
            ws[k].weights.restore_layers(gone)
            ws[k].weights.set_ends(embed, head)
        raise
    # 5. the group serves; blocking, the caches keep their layers only (unmapping cannot fail)
    #    and the link, if any, holds serving up for as long as the KV would take to cross it
    if link is not None and not live:
        link.send(exchanged, len(made))
    for w, (lo, hi) in zip(ws, ranges):
        if not live:
            w.kv.set_layers(lo, hi)
        w.set_layers(lo, hi, w.c_model)
    for inst in insts:
        host.retire(inst)
    host.install(pipe)
    stats = {"weight_bytes_released":
             held_before - sum(weight_bytes(w, w.weights.held_layers) for w in ws),
             "kv_bytes_exchanged": exchanged, "exchange_seconds": time.perf_counter() - start,
             "stall_seconds": time.perf_counter() - start, "remote_attention_calls": 0,
             "remote_attention_bytes": 0, "activation_seconds": 0.0}
    buddy = Buddy(pipe, ranges, stats)
    if live:
        buddy.exchange = Exchange(host, buddy, chunks, link, layers_per_step, start)
        host.transformations.append(buddy.exchange)
    return buddy


def _check_restore(host, buddy, weights_from):
    if not isinstance(buddy, Buddy):
        raise InvalidArgumentError(f"buddy must be what host.buddy returned, got {buddy!r}")
    if buddy.restored or buddy.instance not in host.instances:
        raise StateError(f"{buddy!r} is no longer serving")
    for t in (buddy.exchange, buddy.restoring):
        if t is not None and not t.done:
            raise BusyError(f"{t!r} is under way; restore once it is done")
    if weights_from not in ("peers", "host"):
        raise InvalidArgumentError(f"weights_from must be 'peers' or 'host', got {weights_from!r}")


class Restoring(_Paced):
    """A live restore (KunServe 4.3, host.restore(live=True)), while the group keeps serving as
    a pipeline (its stages' models do not use what comes back, so serving is unchanged):
      1. weights: each member gets the layers it gave up back, from the peer holding them or
         the host copy;
      2. KV: every member's cache holds every layer again, and each stage's layers of every
         request are copied to every other stage's cache (copy_layers), while each step marks
         the slots it writes (a dirty bitmap per stage, kv_patch.h) and every advance patches
         them into the layers already copied (PipeLive's patching);
      3. between two steps: a last patch, and the restore's switch (restore(): the ends, the
         members as TP1 instances, each request home with its KV, which is there already).
    Each advance moves `layers_per_step` layers per member (weights) or per pair of stages (KV),
    or as many bytes as `link` carried since the last advance. What finds no room waits
    (blocked_by) and is tried again at the next step; a failed switch starts the KV over."""

    rolls_back = True

    def __init__(self, host, buddy, weights_from, link, layers_per_step):
        super().__init__(link, integer("layers_per_step", layers_per_step, lo=1))
        self.host, self.buddy, self.weights_from = host, buddy, weights_from
        self.workers = buddy.workers
        self._w = [host.worker(w) for w in self.workers]
        self.pipe = buddy.instance
        # (member, layer, the member holding it): every layer a member gave up
        self.pending = [(k, layer, j) for k in range(len(self._w))
                        for j, (lo, hi) in enumerate(buddy.ranges) if j != k
                        for layer in range(lo, hi)]
        self.kv_pending = None     # (src stage, dst stage, layer) once the weights are back
        self.copied, self.dirty, self._words = set(), {}, None
        self.kv_home = False       # every request's KV is on every member (the switch's case)
        self.done, self.blocked_by, self.error = False, None, None
        self._start = time.perf_counter()
        self._weights = self._kv = 0
        w = self._w[0]
        self._slot_bytes = w.kv.block_bytes // w.kv.block_size   # a token of one layer

    def __repr__(self):
        left = len(self.pending) + len(self.kv_pending or ())
        return f"Restoring(workers={list(self.workers)}, {left} layers to go)"

    def advance(self):
        self._refill()
        self.blocked_by = None
        if self.pending:
            self._weights_step()
        if not self.pending and self.kv_pending is None and self.blocked_by is None:
            self._start_kv()
        if self.kv_pending:
            self._patch()
            self._kv_step()
        if self.kv_pending == [] and self.blocked_by is None:
            self._switch()
        return True

    def _weights_step(self):
        moved, keep = {}, []
        for i, (k, layer, j) in enumerate(self.pending):
            w = self._w[k]
            if self.blocked_by is not None or not self._may(moved, k, w.weights.layer_bytes(layer)):
                keep.append((k, layer, j))
                continue
            source = self._w[j].weights if self.weights_from == "peers" else None
            try:
                nbytes = w.weights.restore_layers({layer}, source)
            except OutOfMemoryError as e:   # the KV holds the room: wait for it
                self.blocked_by = str(e)
                keep.append((k, layer, j))
                continue
            except BaseException:
                self.pending = keep + self.pending[i:]
                raise
            self._moved(moved, k, nbytes)
            self._weights += nbytes
        self.pending = keep

    def _start_kv(self):
        """Every cache holds every layer again, and every stage marks the slots it writes."""
        L = self.host.model.config.num_hidden_layers
        try:
            for w in self._w:
                w.kv.set_layers(0, L)
        except OutOfMemoryError as e:
            self.blocked_by = str(e)
            return
        w = self._w[0]
        # every block id a cache could give out: its whole budget in one run of layers
        slots = int(w.arena.stats()["max_pages"] * w.kv.blocks_per_page() + 1) * w.kv.block_size
        for j in range(len(self._w)):
            self.dirty[j] = _C.KVDirty(slots)
            self.pipe._c.set_dirty(j, 0, self.dirty[j])
        self._words = np.zeros(self.dirty[0].words(), np.uint64)
        self.kv_pending = [(j, k, layer) for j, (lo, hi) in enumerate(self.buddy.ranges)
                           for k in range(len(self._w)) if k != j for layer in range(lo, hi)]
        self.copied = set()

    def _copy(self, j, k, layer, words=None, slots=0):
        n = self.pipe._c.copy_layers(j, k, 0, layer, layer + 1, words, slots)
        self._kv += n * self._slot_bytes
        return n * self._slot_bytes

    def _patch(self):
        """The slots written since the last look, into the layers already copied."""
        for j, d in self.dirty.items():
            if not d.take(self._words):
                continue
            done = [c for c in self.copied if c[0] == j]
            try:
                for _, k, layer in done:
                    self._copy(j, k, layer, self._words, d.slots())
            except BaseException:   # the taken marks are gone: those layers copy again whole
                self.copied -= set(done)
                self.kv_pending = done + self.kv_pending
                raise

    def _kv_step(self):
        moved, keep = {}, []
        for i, (j, k, layer) in enumerate(self.kv_pending):
            if not self._may(moved, (j, k), 0 if self.link is None else
                             self._credit_needed(j, layer)):
                keep.append((j, k, layer))
                continue
            try:
                nbytes = self._copy(j, k, layer)
            except BaseException:
                self.kv_pending = keep + self.kv_pending[i:]
                raise
            self.copied.add((j, k, layer))
            self._moved(moved, (j, k), nbytes)
        self.kv_pending = keep

    def _credit_needed(self, j, layer):
        """Bytes of one layer of stage j's requests (every block of its cache in use)."""
        kv = self._w[j].kv
        return (kv.n_blocks - kv.free_blocks) * kv.block_bytes

    def _stop_marking(self):
        for j in self.dirty:
            self.pipe._c.set_dirty(j, 0, None)
        self.dirty = {}

    def _switch(self):
        self._patch()          # nothing runs between this and the switch
        self._stop_marking()
        self.kv_home = True
        t = time.perf_counter()
        try:
            restore(self.host, self.buddy, self.weights_from, link=self.link, _live=self)
        except BaseException as e:
            # taken back (the caches keep their stages' layers again): the KV starts over
            self.kv_home, self.kv_pending, self.copied = False, None, set()
            if isinstance(e, OutOfMemoryError):
                self.blocked_by = str(e)
                return
            raise
        st = self.buddy.stats
        st["weight_bytes_restored"] += self._weights
        st["kv_bytes_returned"] += self._kv
        st["restore_stall_seconds"] = time.perf_counter() - t
        st["restore_seconds"] = time.perf_counter() - self._start
        self.done = True


def restore(host, buddy, weights_from="peers", live=False, link=None, layers_per_step=1,
            _live=None):
    """host.restore's work (the host's lock held): see Host.restore."""
    if _live is None:
        _check_restore(host, buddy, weights_from)
        if link is not None and not isinstance(link, Link):
            raise InvalidArgumentError(f"link must be a gyges.kunserve.Link or None, got {link!r}")
        if live:
            buddy.restoring = Restoring(host, buddy, weights_from, link, layers_per_step)
            host.transformations.append(buddy.restoring)
            return buddy
    start = time.perf_counter()
    pipe, ranges = buddy.instance, buddy.ranges
    g, L = len(ranges), host.model.config.num_hidden_layers
    ws = [host.worker(w) for w in buddy.workers]
    peers = weights_from == "peers"
    back = []                          # (worker, layers restored, ends before, layers before)
    old_models = [w.c_model for w in ws]
    singles, moved, restored, returned = [], [], 0, 0
    try:
        # 1. every worker gets the whole model back, from the peer holding each part, or the host
        for k, (w, mine) in enumerate(zip(ws, ranges)):
            back.append((w, set(), (w.weights.has_embed, w.weights.has_head), mine))
            for j, (lo, hi) in enumerate(ranges):
                if j != k:
                    new = set(range(lo, hi)) - w.weights.held_layers   # (a live restore's are in)
                    restored += w.weights.restore_layers(new, ws[j].weights if peers else None)
                    back[-1][1].update(new)
            restored += w.weights.set_ends(True, w.weights.has_head,
                                           ws[0].weights if peers else None)
            restored += w.weights.set_ends(True, True, ws[-1].weights if peers else None)
            w.kv.set_layers(0, L)
        # 2. each request goes home to the least loaded worker, its KV of the other layers
        #    copied in (into layers only its home cache held anew: nothing is overwritten)
        load = [0] * g
        homes = {}
        for rid in pipe.request_ids():
            seqs = [pipe.stage_seq(k, rid) for k in range(g)]
            n = ws[0].kv.n_tokens(seqs[0]) if seqs[0] >= 0 else 0
            h = min(range(g), key=lambda k: load[k])
            load[h] += n
            homes[rid] = (h, seqs)
            if seqs[h] >= 0 and not (_live is not None and _live.kv_home):
                for j, (lo, hi) in enumerate(ranges):
                    if j != h:
                        returned += ws[h].kv.copy_tokens_from(ws[j].kv, seqs[h], seqs[j], lo, hi)
        # 3. g TP1 instances over whole models take them
        from .host import Instance
        for w in ws:
            w.c_model = w.model_for_layers(0, L)
        singles = [Instance(host, [w], 1) for w in buddy.workers]
        for rid, (h, seqs) in homes.items():
            singles[h].take(pipe, rid, [seqs[h]])
            moved.append(rid)
    except BaseException:
        # everything goes back: the requests to the pipeline, the models, the KV layers and
        # the weights the members held
        for rid in reversed(moved):
            h, seqs = homes[rid]
            pipe.take(singles[h], rid, seqs)
        for inst in singles:
            inst.close()
        for w, m in zip(ws, old_models):
            w.c_model = m
        for w, layers, (embed, head), (lo, hi) in back:
            if (w.kv.first_layer, w.kv.first_layer + w.kv.n_layers) != (lo, hi):
                w.kv.set_layers(lo, hi)
            w.weights.drop_layers(layers)
            w.weights.set_ends(embed, head)
        raise
    # 4. the other stages' copies are freed (cannot fail) and the members serve alone
    for h, seqs in homes.values():
        for j, seq in enumerate(seqs):
            if j != h and seq >= 0:
                ws[j].kv.free(seq)
    for w in ws:
        w.set_layers(0, L, w.c_model)
    host.retire(pipe)
    for inst in singles:
        host.install(inst)
    if link is not None:   # serving stopped for what crossed: everything, or live the KV
        link.send(restored + returned, len(moved) + len(ws))
    buddy.restored = True
    buddy.stats.update(weight_bytes_restored=restored, kv_bytes_returned=returned,
                       restore_seconds=time.perf_counter() - start)
    return buddy
