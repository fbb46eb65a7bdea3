"""KunServe's buddy groups on a real host (KunServe 4.1-4.3): g TP1 instances on neighbouring
workers drop their replicated parameters down to one shared copy and serve as one pipeline, the
memory freed being KV room at once; a restore brings the parameters back and the members serve
alone again. Which groups to form is the cluster's question (gyges.cluster.buddy_plan).

    b = host.buddy((0, 1), live=True, link=Link(bandwidth=50e6, latency=20e-6))
    # the group serves at once; the victims' KV moves a layer at a time as host.step goes, a
    # layer not moved yet attending on the worker holding it (remote attention)
    b.instance, b.ranges      # the pipeline, and each member's layers (as it serves now)
    r = host.restore(b, live=True)
    # weights, then KV (patched through dirty bitmaps) stream back while it serves; the switch
    # sends every request home
    b.stats                   # weight and KV bytes, remote attention calls and bytes, stall and
                              # link seconds (a restore's own handle has its stats too)

Both are reconfigurations of the one protocol: `Buddy` (the formation; live while its exchange
moves KV) and `Restore`. Each change is journaled: a formation that fails goes back to the TP1
instances (every request home with its KV of every layer, what the pipeline wrote on other
members gathered back: `gather_home`), a restore that fails leaves the group serving as before.
"""
import time

import numpy as np

from .. import _C
from ..core.checks import integer
from ..core.errors import BusyError, InvalidArgumentError, OutOfMemoryError, StateError
from ..runtime.kv_cache import KVMove
from .kv_move import migration_comm
from .link import Link, Paced
from .reconfiguration import Reconfiguration
from .resplit import weight_bytes


def _new_seq(kv, n_tokens):
    """A sequence of kv with room for n_tokens, the cache grown as needed (OutOfMemoryError
    when the budget cannot)."""
    need = -(-n_tokens // kv.block_size)
    while kv.free_blocks < need:   # (a page holds whole blocks, or a block spans pages)
        kv.grow(max(1, int((need - kv.free_blocks) // kv.blocks_per_page())))
    seq = kv.new_sequence()
    kv.reserve(seq, n_tokens)
    return seq


def _move_seq(src, seq, dst, dst_seq, first, end, comm=None):
    """A request's KV of model layers [first, end), which both caches hold, from its sequence in
    `src` to dst_seq in `dst` (block for block, every slot; over `comm`, the members' migration
    communicator, when they are on different GPUs); returns the bytes."""
    return KVMove(range(first, end), comm=comm).add(src, dst, src_seq=seq,
                                                    dst_seq=dst_seq).run()["bytes"]


def _check_link(link):
    if link is not None and not isinstance(link, Link):
        raise InvalidArgumentError(f"link must be a gyges.reconfig.link.Link or None, got {link!r}")


def gather_home(host, pipe, ranges, workers, homes, valid, copy=True):
    """Where each request of a buddy pipeline goes home: {rid: (member, its sequence per
    stage)}. homes(rid) -> a member or None (then the least loaded by tokens); valid(rid, k) ->
    the layers of stage k that hold its KV there (a range). With copy, each request's KV of the
    other stages' layers is copied into its home cache, which holds every layer. Returns
    ({rid: (home, seqs)}, bytes copied)."""
    ws = [host.worker(w) for w in workers]
    comm = migration_comm(host, workers)
    g = len(ranges)
    load, out, copied = [0] * g, {}, 0
    for rid in pipe.request_ids():
        seqs = [pipe.stage_seq(k, rid) for k in range(g)]
        n = ws[0].kv.n_tokens(seqs[0]) if seqs[0] >= 0 else 0
        h = homes(rid)
        if h is None:
            h = min(range(g), key=lambda k: load[k])
        load[h] += n
        out[rid] = (h, seqs)
        if copy and seqs[h] >= 0:
            for k in range(g):
                lo, hi = valid(rid, k)
                if k != h and seqs[k] >= 0 and hi > lo:
                    copied += _move_seq(ws[k].kv, seqs[k], ws[h].kv, seqs[h], lo, hi, comm)
    return out, copied


class Buddy(Reconfiguration, Paced):
    """host.buddy's executor and the group's handle. Blocking (live=False): formed and the KV
    exchanged between two steps. live=True: formed between two steps, serving at once; each
    host.step then moves the victims' KV of the layers a buddy now holds, a layer at a time
    (`layers_per_step`, or what `link` left over), until then attending remotely; done when all
    has moved. stats: weight_bytes_released, kv_bytes_exchanged, exchange_seconds,
    stall_seconds, remote_attention_calls, remote_attention_bytes, activation_seconds (the
    link's time for them) and, after a restore, weight_bytes_restored, kv_bytes_returned,
    restore_seconds (and, live, restore_stall_seconds)."""

    kind = "buddy"
    max_retries = 3   # an exchange advance that fails keeps what moved; the rest is tried again

    def __init__(self, host, instances, live=False, link=None, layers_per_step=1):
        _check_link(link)
        layers_per_step = min(integer("layers_per_step", layers_per_step, lo=1),
                              host.model.config.num_hidden_layers)
        if not isinstance(instances, (list, tuple)):
            raise InvalidArgumentError(f"instances must be a list of instances or indices into "
                                       f"host.instances, got {instances!r}")
        insts = host.instances
        self.members = sorted((i if hasattr(i, "workers") else
                               insts[integer("instances", i, 0, len(insts) - 1)]
                               for i in instances), key=lambda i: min(i.workers))
        Reconfiguration.__init__(self, host, [i.workers[0] for i in self.members])
        Paced.__init__(self, link, layers_per_step)
        self.live = bool(live)
        self.instance = None          # the pipeline, once formed
        self.restoring = None         # a restore under way, or the last one
        self.restored = False
        self.pending = []             # [rid, src stage, dst stage, next layer] still to move
        self.stats.update(weight_bytes_released=0, kv_bytes_exchanged=0, exchange_seconds=0.0,
                          remote_attention_calls=0, remote_attention_bytes=0,
                          activation_seconds=0.0)

    @property
    def ranges(self):
        """Each member's layers as the group serves now (a re-split of the group changes them)."""
        if self.instance is None:
            return ()
        return tuple(self.instance.stages)

    @property
    def exchange(self):
        """The live exchange (this handle: .done once every victim's KV has moved), or None for
        a blocking formation."""
        return self if self.live else None

    def __repr__(self):
        where = self.instance.layout if self.instance is not None else "forming"
        return (f"Buddy(workers={list(self.workers)}, {where}, {self.state}" +
                (", restored)" if self.restored else ")"))

    def _plan(self):
        host, insts = self.host, self.members
        g = len(insts)
        L = host.model.config.num_hidden_layers
        workers = list(self.workers)
        if g < 2 or any(i.tp != 1 or i.stages or i not in host.instances for i in insts) or \
                workers != list(range(workers[0], workers[0] + g)):
            raise InvalidArgumentError(f"a buddy group is 2 or more TP1 instances of this host on "
                                       f"neighbouring workers, got {[i.layout for i in insts]} on "
                                       f"workers {workers}")
        if L % g:
            raise InvalidArgumentError(f"a group of {g} does not divide the model's {L} layers")
        if "replicated" in host.weights_of(workers):
            raise InvalidArgumentError(f"a buddy group needs sharded workers; workers {workers} "
                                       f"keep replicas that switch() binds (weights='replicated')")
        # members on different GPUs move KV over their aligned group's migration communicator
        # (an unaligned group has none: refused here, before any change)
        self._comm = migration_comm(host, workers)
        viewed = host.pinned(workers)
        if viewed:
            raise BusyError(f"{viewed}: a buddy group changes the workers' pages; delete the "
                            f"views first")
        self.planned = [(k * L // g, (k + 1) * L // g) for k in range(g)]

    def _begin(self):
        host, insts, ranges = self.host, self.members, self.planned
        g = len(insts)
        ws = self._w = [host.worker(w) for w in self.workers]
        self._start = time.perf_counter()
        # every request's sequence on its own worker
        self.own = own = {k: {rid: inst.request_seqs(rid)[0] for rid in inst.request_ids()}
                          for k, inst in enumerate(insts)}
        held_before = sum(weight_bytes(w, w.weights.held_layers) for w in ws)
        cps = [w.checkpoint() for w in ws]
        pages = [w.kv.stats()["pages_per_layer"] for w in ws]

        def back():   # the pages grown for the copies first: the weights need them back
            for w, p in zip(ws, pages):   # (down to what it had, as far as nothing is in use
                over = min(w.kv.stats()["pages_per_layer"] - p, w.kv.shrinkable())
                if over > 0:               # there: a live group served meanwhile)
                    w.kv.shrink(over)
            for w, cp in zip(ws, cps):
                w.restore(cp)
        self.undo(back, "members")
        # 1. the parameters each worker no longer keeps go: their memory is KV room at once
        tied = host.model.config.tie_word_embeddings
        for k, (w, (lo, hi)) in enumerate(zip(ws, ranges)):
            w.weights.drop_layers(w.weights.held_layers - set(range(lo, hi)))
            w.weights.set_ends(embed=k == 0 or (k == g - 1 and tied), head=k == g - 1)
        # 2. each worker gets a sequence, for every other member's request with KV, and (unless
        #    live: the exchange moves it later) its layers' KV
        made, exchanged, taken = [], 0, set()
        chunks = self.pending = []   # (live) what has not moved, as the rollback reads it
        # (a sequence the pipeline took is its request's: _go_home frees those)
        self.undo(lambda: [ws[k].kv.free(seq) for k, rid, seq in made if rid not in taken],
                  "exchange sequences")
        for k, (w, (lo, hi)) in enumerate(zip(ws, ranges)):
            for j, seqs in own.items():
                for rid, seq in seqs.items():
                    if j == k or seq < 0:
                        continue
                    new = _new_seq(w.kv, ws[j].kv.n_tokens(seq))
                    made.append((k, rid, new))
                    if self.live:
                        chunks.append([rid, j, k, lo])
                    else:
                        exchanged += _move_seq(ws[j].kv, seq, w.kv, new, lo, hi, self._comm)
        # 3. the pipeline over the members' stage models takes every request with its KV (the
        #    caches still hold every layer, so nothing is lost until all of it has worked)
        for w, (lo, hi) in zip(ws, ranges):
            w.install(c_model=w.model_for_layers(lo, hi))
        pipe = self.instance = host.make_instance(self.workers, 1, stages=ranges)
        news = {(k, rid): new for k, rid, new in made}
        host.install(pipe)
        self.undo(lambda: host.retire(pipe), "pipeline")
        for inst in insts:
            host.pool.remove(inst)
        self.undo(lambda: [host.install(inst) for inst in insts], "members' instances")
        self.undo(self._go_home, "requests")
        for j, inst in enumerate(insts):
            for rid, seq in own[j].items():
                pipe.take(inst, rid, [seq if k == j else news.get((k, rid), -1)
                                      for k in range(g)] if seq >= 0 else [-1] * g)
                taken.add(rid)
        # 4. live: until a layer's KV has arrived, its attention runs where the KV is
        for rid, j, k, lo in chunks:
            pipe.set_remote(rid, k, j, lo, ranges[k][1])
        self._calls = self._token_layers = self._advances = 0
        cfg = host.model.config
        hd = cfg.hidden_size // cfg.num_attention_heads
        # one token-layer of remote attention: q, k and v there, the attention output back
        self.row_bytes = 4 * hd * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
        # blocking with a link: serving holds up for as long as the KV would take to cross it
        if self.link is not None and not self.live:
            self.link.send(exchanged, len(made))
        self.stats["weight_bytes_released"] = held_before - sum(
            weight_bytes(w, w.weights.held_layers) for w in ws)
        self.stats["pages_freed"] = self.stats["weight_bytes_released"] // ws[0].page_size
        self.stats["kv_bytes_exchanged"] = exchanged
        self._moved_kv(exchanged)

    def _moved_kv(self, nbytes):
        self.stats["kv_bytes_moved"] += nbytes
        self.stats["bytes_moved"] += nbytes

    def _go_home(self):
        """The rollback of a formation: every request of the pipeline goes back to its
        member's instance with its KV of every layer (what the pipeline wrote on other members
        gathered there; a victim's layers not moved yet are at home already)."""
        pipe, insts = self.instance, self.members
        g = len(insts)
        origin = {rid: j for j, seqs in self.own.items() for rid in seqs}
        waiting = {(rid, k): layer for rid, _, k, layer in self.pending}
        ranges = self.planned

        def valid(rid, k):
            lo, hi = ranges[k]
            return lo, waiting.get((rid, k), hi)
        homes, _ = gather_home(self.host, pipe, ranges, self.workers, origin.get, valid)
        for rid, (h, seqs) in homes.items():
            insts[h].take(pipe, rid, [seqs[h]])
            for k in range(g):   # its other stages' sequences: nobody holds them now
                if k != h and seqs[k] >= 0:
                    self._w[k].kv.free(seqs[k])

    # ---- the live exchange (KunServe 4.2) ----
    def _activations(self):
        """Remote attention since the last look, in the stats and (with a link) on the link;
        returns the link's seconds for it."""
        now = self.instance.remote_stats()
        calls, rows = now["calls"] - self._calls, now["token_layers"] - self._token_layers
        self._calls, self._token_layers = now["calls"], now["token_layers"]
        st = self.stats
        st["remote_attention_calls"] += calls
        st["remote_attention_bytes"] += rows * self.row_bytes
        if self.link is None or not calls:
            return 0.0
        t = self.link.send(rows * self.row_bytes, 2 * calls)
        st["activation_seconds"] += t
        return t

    def _advance(self):
        """Moves the victims' next layers (what the link carried since, activations first).
        What moved stays moved when a later chunk fails; the rest waits for the next step."""
        if not self.live:
            return True
        busy = self._activations()   # activations first: they have priority on the link
        self._advances += 1
        if self._advances == 1 and self.pending:
            return False   # right after forming: the first layers are on their way this step
        self._refill(busy)   # the KV's share: the link's time the activations left over
        pipe, ranges = self.instance, self.ranges
        live = set(pipe.request_ids())
        moved, keep, i = {}, [], 0
        try:
            for i, chunk in enumerate(self.pending):
                rid, j, k, layer = chunk
                hi = ranges[k][1]
                src, dst = pipe.stage_seq(j, rid), pipe.stage_seq(k, rid)
                if rid not in live or src < 0 or dst < 0:
                    # finished, or preempted (it recomputes where its record says): nothing to move
                    if rid in live:
                        pipe.set_remote(rid, k, j, 0, 0)
                    continue
                if not self._may(moved, (rid, k), len(self._w[j].kv.block_table(src)) *
                                 self._w[j].kv.block_bytes):
                    keep.append(chunk)
                    if self.link is not None:
                        keep.extend(self.pending[i + 1:])   # in order: the next waits for this one
                        break
                    continue
                nbytes = _move_seq(self._w[j].kv, src, self._w[k].kv, dst, layer, layer + 1,
                                   self._comm)
                pipe.set_remote(rid, k, j, layer + 1, hi)
                self._moved(moved, (rid, k), nbytes)
                self.stats["kv_bytes_exchanged"] += nbytes
                self._moved_kv(nbytes)
                if layer + 1 < hi:
                    keep.append([rid, j, k, layer + 1])
        except BaseException:
            self.pending = keep + self.pending[i:]   # what moved stays moved; the rest waits
            raise
        self.pending = keep
        return not keep

    def _commit(self):
        """Every victim's KV is where its layers are."""

    def _finish(self):
        """The caches keep their own layers (their other pages go), the old instances go."""
        for w, (lo, hi) in zip(self._w, self.ranges):
            w.kv.set_layers(lo, hi)
            w.set_layers(lo, hi, w.c_model)
        for inst in self.members:
            inst.close()
        if self.live:
            self._activations()
        self.stats["exchange_seconds"] = time.perf_counter() - self._start

    def _release(self):
        self.pending = []


class Restore(Reconfiguration, Paced):
    """host.restore's executor: a buddy group gets its parameters back (from the peers that
    hold each part, or the host copy), its requests go to the least loaded member with their KV
    of every layer, and the members serve as TP1 instances again. Blocking: all between two
    steps. live=True (KunServe 4.3), while the group keeps serving as a pipeline (its stages'
    models do not use what comes back, so serving is unchanged):
      1. weights: each member gets the layers it gave up back, from the peer holding them or
         the host copy;
      2. KV: every member's cache holds every layer again, and each stage's layers of every
         request are copied to every other stage's cache (copy_layers), while each step marks
         the slots it writes (a dirty bitmap per stage, kv_dirty.h) and every advance patches
         them into the layers already copied (PipeLive's patching);
      3. between two steps (the commit): a last patch, and the switch: the members as TP1
         instances, each request home with its KV, which is there already.
    Each advance moves `layers_per_step` layers per member (weights) or per pair of stages (KV),
    or as many bytes as `link` carried since the last advance. What finds no room waits
    (blocked_by) and is tried again at the next step."""

    kind = "restore"
    max_retries = 3

    def __init__(self, host, buddy, weights_from="peers", live=False, link=None,
                 layers_per_step=1):
        if not isinstance(buddy, Buddy):
            raise InvalidArgumentError(f"buddy must be what host.buddy returned, got {buddy!r}")
        if weights_from not in ("peers", "host"):
            raise InvalidArgumentError(f"weights_from must be 'peers' or 'host', got "
                                       f"{weights_from!r}")
        _check_link(link)
        layers_per_step = min(integer("layers_per_step", layers_per_step, lo=1),
                              host.model.config.num_hidden_layers)
        Reconfiguration.__init__(self, host, buddy.workers)
        Paced.__init__(self, link, layers_per_step)
        self.buddy, self.weights_from, self.live = buddy, weights_from, bool(live)
        self.stats.update(weight_bytes_restored=0, kv_bytes_returned=0, restore_seconds=0.0,
                          restore_stall_seconds=0.0)

    def __repr__(self):
        return f"Restore(workers={list(self.workers)}, {self.state})"

    def _plan(self):
        host, buddy = self.host, self.buddy
        if not buddy.committed or buddy.restored or buddy.instance not in host.instances:
            raise StateError(f"{buddy!r} is not a group serving now")
        if buddy.restoring is not None and not buddy.restoring.done:
            raise BusyError(f"{buddy.restoring!r} is under way; restore once it is done")
        self.pipe = buddy.instance
        self.ranges = list(self.pipe.stages)
        self._w = [host.worker(w) for w in self.workers]
        self._comm = migration_comm(host, self.workers)
        # (member, layer, the member holding it): every layer a member gave up
        self.pending = [(k, layer, j) for k in range(len(self._w))
                        for j, (lo, hi) in enumerate(self.ranges) if j != k
                        for layer in range(lo, hi)]
        self.kv_pending = None     # (src stage, dst stage, layer) once the weights are back
        self.copied, self.dirty, self._words = set(), {}, None

    def _begin(self):
        self._t0 = time.perf_counter()
        cps = [w.checkpoint() for w in self._w]
        self.undo(lambda: [w.restore(cp) for w, cp in zip(self._w, cps)], "members")
        self._weights = self._kv = 0
        self.buddy.restoring = self
        if not self.live:
            self._weights_back(all_layers=True)

    # ---- the pieces ----
    def _weights_back(self, all_layers=False):
        """Layers back on their members: all of them (blocking), or what one advance may move;
        a member the KV leaves no room on waits (blocked_by)."""
        moved, keep = {}, []
        for i, (k, layer, j) in enumerate(self.pending):
            w = self._w[k]
            if not all_layers and (self.blocked_by is not None or
                                   not self._may(moved, k, w.weights.layer_bytes(layer))):
                keep.append((k, layer, j))
                continue
            source = self._w[j].weights if self.weights_from == "peers" else None
            try:
                nbytes = w.weights.restore_layers({layer}, source)
            except OutOfMemoryError as e:
                if all_layers:
                    raise
                self.blocked_by = str(e)   # the KV holds the room: wait for it
                keep.append((k, layer, j))
                continue
            except BaseException:
                self.pending = keep + self.pending[i:]
                raise
            self._moved(moved, k, nbytes)
            self._weights += nbytes
        self.pending = keep

    def _all_layers(self):
        """Every member's cache holds every layer again (journaled: back to its own)."""
        L = self.host.model.config.num_hidden_layers
        for w, (lo, hi) in zip(self._w, self.ranges):
            if (w.kv.first_layer, w.kv.first_layer + w.kv.n_layers) != (0, L):
                w.kv.set_layers(0, L)
                self.undo(lambda w=w, lo=lo, hi=hi: w.kv.set_layers(lo, hi), "KV layers")

    def _start_kv(self):
        try:
            self._all_layers()
        except OutOfMemoryError as e:
            self.blocked_by = str(e)
            return
        w = self._w[0]
        # every block id a cache could give out: its whole budget in one run of layers
        slots = int(w.arena.stats()["max_pages"] * w.kv.blocks_per_page() + 1) * w.kv.block_size
        self.undo(self._stop_marking, "dirty bitmaps")
        for j in range(len(self._w)):
            self.dirty[j] = _C.KVDirty(slots)
            self.pipe.set_dirty(j, self.dirty[j])
        self._words = np.zeros(self.dirty[0].words(), np.uint64)
        self.kv_pending = [(j, k, layer) for j, (lo, hi) in enumerate(self.ranges)
                           for k in range(len(self._w)) if k != j for layer in range(lo, hi)]
        self.copied = set()

    def _copy(self, j, k, layer, words=None, slots=0):
        n = self.pipe.copy_layers(j, k, layer, layer + 1, words, slots, comm=self._comm)
        nbytes = n * (self._w[0].kv.block_bytes // self._w[0].kv.block_size)
        self._kv += nbytes
        return nbytes

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
            kv = self._w[j].kv
            need = 0 if self.link is None else (kv.n_blocks - kv.free_blocks) * kv.block_bytes
            if not self._may(moved, (j, k), need):
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

    def _stop_marking(self):
        for j in self.dirty:
            self.pipe.set_dirty(j, None)
        self.dirty = {}

    def _advance(self):
        if not self.live:
            return True
        self._refill()
        self.blocked_by = None
        if self.pending:
            self._weights_back()
        if not self.pending and self.kv_pending is None and self.blocked_by is None:
            self._start_kv()
        if self.kv_pending:
            self._patch()
            self._kv_step()
        return self.kv_pending == [] and self.blocked_by is None

    # ---- the switch ----
    def _commit(self):
        host, pipe, ranges = self.host, self.pipe, self.ranges
        g, L = len(ranges), host.model.config.num_hidden_layers
        t = time.perf_counter()
        peers = self.weights_from == "peers"
        restored = self._weights
        if self.live:
            self._patch()          # nothing runs between this and the switch
            self._stop_marking()
        for k, w in enumerate(self._w):   # (blocking: every layer is back already)
            restored += w.weights.set_ends(True, w.weights.has_head,
                                           self._w[0].weights if peers else None)
            restored += w.weights.set_ends(True, True, self._w[-1].weights if peers else None)
        self._all_layers()
        # each request goes home to the least loaded worker, its KV of the other layers copied
        # in (into layers only its home cache held anew: nothing is overwritten), unless a live
        # restore copied it already
        homes, returned = gather_home(host, pipe, ranges, self.workers, lambda rid: None,
                                      lambda rid, k: ranges[k], copy=not self.live)
        self._kv += returned
        for w in self._w:
            w.install(c_model=w.model_for_layers(0, L))
        singles = [host.make_instance([w], 1) for w in self.workers]
        for inst in singles:
            host.install(inst)
            self.undo(lambda inst=inst: host.retire(inst), "member instance")
        host.pool.remove(pipe)
        self.undo(lambda: host.install(pipe), "pipeline")
        for rid, (h, seqs) in homes.items():
            singles[h].take(pipe, rid, [seqs[h]])
            self.undo(lambda rid=rid, h=h, seqs=seqs: pipe.take(singles[h], rid, seqs),
                      f"request {rid}")
        self._homes = homes
        if self.link is not None:   # serving stopped for what crossed: everything, or live the KV
            self.link.send(returned if self.live else restored + returned, len(homes) + g)
        self._weights_restored = restored
        self.stats["restore_stall_seconds"] = time.perf_counter() - t

    def _finish(self):
        """The other stages' copies are freed and the members serve alone."""
        host, L = self.host, self.host.model.config.num_hidden_layers
        for h, seqs in self._homes.values():
            for j, seq in enumerate(seqs):
                if j != h and seq >= 0:
                    self._w[j].kv.free(seq)
        for w in self._w:
            w.set_layers(0, L, w.c_model)
        host.retire(self.pipe)
        b = self.buddy
        b.restored = True
        self.stats["weight_bytes_restored"] = self._weights_restored
        self.stats["weight_bytes_moved"] = self._weights_restored
        self.stats["kv_bytes_returned"] = self.stats["kv_bytes_moved"] = self._kv
        self.stats["bytes_moved"] = self._weights_restored + self._kv
        self.stats["restore_seconds"] = time.perf_counter() - self._t0
        for key in ("weight_bytes_restored", "kv_bytes_returned", "restore_seconds"):
            b.stats[key] = self.stats[key]
        if self.live:
            b.stats["restore_stall_seconds"] = self.stats["restore_stall_seconds"]

    def _release(self):
        self.dirty, self._homes = {}, {}
