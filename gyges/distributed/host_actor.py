"""One host of a gyges.Cluster: a Host in a process of its own (a Ray actor), stepping on its own.

The actor owns a Host and a thread that steps it whenever a request is unfinished or a
reconfiguration is live, so hosts serve in parallel without the driver pacing them. The driver
talks to it through a few calls, each a Ray actor call (threaded actor: calls run beside the
stepping thread; the Host's own lock orders them with its steps):

    submit(rid, prompt, params, instance)   place a request (rid: the cluster's id)
    migrate_out(rid), migrate_in(rid, packet)
                                            a request with its KV out of one host, into
                                            another (runtime/request_packet.py)
    migrate_round, migrate_stop, migrate_settle (source); migrate_reserve, migrate_fill,
    migrate_cancel, migrate_in(..., reservation) (destination)
                                            a live migration's rounds (Cluster.migrate)
    updates(timeout)                        the tokens produced since the last call, per rid,
                                            waiting up to `timeout` seconds for some
    call(verb, args, kwargs)                a Host verb (transform, reconfigure, switch, buddy,
                                            restore, layout, memory, stats); a reconfiguration
                                            comes back as its id and its fields (describe)
    describe(rid)                           a reconfiguration's fields now
    pause(), resume()                       no step from here on (a step under way ends
                                            first), and serving again
    split_*(group, ...)                     one side of a buddy group split between two hosts
                                            (reconfig/split_buddy.py; Cluster.buddy drives them)
    facts(), loads()                         what a trace replay's controller needs of the host
                                            (distributed/replay.py): its shape, and each
                                            instance's load now
    abort(rid), close()

Nothing here imports Ray: gyges.distributed.cluster makes the class an actor, so the class can
be driven in-process too (benchmarks/bench_cluster.py measures the control overhead both ways).
"""
import logging
import threading

from ..cluster.experiment import capacities, instance_load
from ..core.errors import BusyError, Error, InvalidArgumentError, OutOfMemoryError, StateError
from ..models.model import Model
from ..reconfig.split_buddy import Follow, Lead
from ..runtime.host import Host

log = logging.getLogger(__name__)

# Host verbs that make a reconfiguration, and those that only read.
RECONFIGURING = ("transform", "reconfigure", "switch", "buddy", "restore")
READING = ("layout", "memory", "stats")
# A handle's fields that travel back to the driver.
FIELDS = ("state", "done", "committed", "rolled_back", "blocked_by", "error", "stats",
          "workers")


class HostActor:
    def __init__(self, source, host_options):
        self.host = Host(Model.from_source(source), **host_options)
        self._cond = threading.Condition()
        self._requests = {}     # rid -> [gyges.Request, tokens already sent, epoch]
        self._held = {}         # rid -> its gyges.Request a live migration's last round stopped
        self._changed = set()   # rids with tokens or an end not yet sent
        self._reconfigs = {}    # id -> Reconfiguration (kept while the host lives)
        self._next_reconfig = 0
        self._step_errors = 0
        self._closing = False
        self._paused = 0        # pause() calls not yet resumed
        self._split = {}        # group id -> this host's side (split_buddy.Lead or Follow)
        # A side is made, changed and dissolved one call at a time (the driver's formation and
        # a loss noticed by another of its threads may overlap); a group dissolved here (its
        # other member lost) forms no side any more.
        self._split_lock = threading.RLock()
        self._dissolved = set()
        self._stepper = threading.Thread(target=self._step_loop, name="gyges-host-stepper",
                                         daemon=True)
        self._stepper.start()

    # ---- the stepping thread ----
    def _busy(self):
        return not self._paused and not self.host.closed and self.host.has_unfinished()

    def _step_loop(self):
        while True:
            with self._cond:
                while not self._closing and not self._busy():
                    self._cond.wait(0.5)
                if self._closing:
                    return
            tokens = 0
            try:
                tokens = self.host.step()
            except Error as e:  # a failed step changes nothing; the next one serves on
                self._step_errors += 1
                log.warning("host step failed (%s); serving on", str(e))
            except Exception:   # a bug: said loudly, but the host's other requests go on
                self._step_errors += 1
                log.exception("host step raised")
            with self._cond:
                if not tokens:   # only a waiting reconfiguration: do not spin
                    self._cond.wait(0.001)
                for rid, entry in self._requests.items():
                    r, sent, _ = entry
                    if len(r.output_tokens) > sent or r.finished:
                        self._changed.add(rid)
                if self._changed:
                    self._cond.notify_all()

    # ---- calls ----
    def info(self):
        import os
        import socket
        return {"pid": os.getpid(), "hostname": socket.gethostname(),
                "layout": self.host.layout(), "workers": self.host.n_workers,
                "layers": self.host.model.config.num_hidden_layers,
                "backend": self.host.backend}

    def steps(self):
        return self.host.steps

    def facts(self):
        """The host's shape as a trace replay checks and prices it (capacity: KV blocks of a
        TP 1, 2, 4, ... instance up to the largest TP it can run)."""
        h = self.host
        return {"n_workers": h.n_workers, "model_max_tp": h.max_tp, "weights": h.weights,
                "tps": [inst.tp for inst in h.instances],
                "piped": any(inst.stages for inst in h.instances), "layout": h.layout(),
                "capacity": capacities(h), "block_size": h.block_size,
                "max_pos": h.worker(0).max_pos, "vocab": h.model.config.vocab_size,
                "model": repr(h.model), "memory_per_worker": h.memory_per_worker,
                "page_size": h.worker(0).page_size, "max_batch_tokens": h.max_batch_tokens,
                "max_running": h.max_running, "max_prefill_chunk": h.max_prefill_chunk,
                "unfinished": h.has_unfinished()}

    def loads(self):
        """(layout, [per serving instance: its index into host.instances, workers, tp, whether
        a reconfiguration holds it, the cluster ids of its requests, and gyges.experiment's
        instance_load with its request ids the cluster's]), read between two steps."""
        with self._cond:
            ids = {entry[0].id: rid for rid, entry in self._requests.items()}

        def read(h):
            moving = set()
            for t in h.reconfigurations:
                if not t.done:
                    moving |= set(t.workers)
            out = []
            for inst in h.serving_instances():
                load = instance_load(h, inst)
                load["computed"] = {ids[i]: n for i, n in load["computed"].items() if i in ids}
                out.append({"index": h.instances.index(inst), "workers": list(inst.workers),
                            "tp": inst.tp, "transforming": bool(moving & set(inst.workers)),
                            "rids": [ids[i] for i in inst.requests if i in ids], **load})
            return h.layout(), out
        return self.host.between_steps(read, self.host)

    def submit(self, rid, prompt, params, instance=None, epoch=0):
        """Serves cluster request `rid` (its placement `epoch`, which its updates name)."""
        r = self.host.submit(prompt, params, instance=instance)
        self._adopt(rid, r, epoch)
        return r.id

    def _adopt(self, rid, r, epoch):
        """Request `rid` is served here as r; of two placements of it here (a race between two
        losses, or a loss and a migration's way back, may place it twice, in either order) the
        older one is aborted, so that one copy serves it: the one the driver follows."""
        with self._cond:
            old = self._requests.get(rid)
            if old is not None and old[2] > epoch:
                stale = r   # (a newer placement came first: this one is already given up)
            else:
                stale = old[0] if old is not None else None
                self._requests[rid] = [r, 0, epoch]
                self._changed.add(rid)
                self._cond.notify_all()   # wakes the stepping thread
        if stale is None or stale.finished:
            return
        with self._cond:
            held = self._held.get(rid) is stale
            if held:
                del self._held[rid]
        if held:   # a live migration's stopped copy (its destination lost): its KV freed
            self.host.settle_export(stale, True)
        else:
            self.host.abort(stale)

    def updates(self, timeout):
        """[(rid, epoch, new tokens, finished, finish_reason, error, queued, scores)] of every
        request that produced tokens or ended since the last call; waits up to `timeout`
        seconds for one. epoch: the placement it serves (Cluster's ClusterRequest._place).
        queued: seconds from its scheduling to its first token here (a span, which the driver
        can place on its own clock), None before its first token. scores: (the new tokens'
        logprobs entries or None, cumulative_logprob so far, prompt_logprobs or None), as the
        host's Request has them."""
        with self._cond:
            if not self._changed:
                self._cond.wait(timeout)
            out = []
            for rid in sorted(self._changed):
                entry = self._requests.get(rid)
                if entry is None:   # (already sent as finished, or moved out)
                    continue
                r, sent, epoch = entry
                tokens = list(r.output_tokens[sent:])
                entry[1] = sent + len(tokens)
                m = r.metrics
                queued = (m.token_times[0] - m.scheduled
                          if m.token_times and m.scheduled is not None and m.scheduled >= 0
                          else None)
                scores = (None if r.logprobs is None else r.logprobs[sent:sent + len(tokens)],
                          r.cumulative_logprob, r.prompt_logprobs)
                out.append((rid, epoch, tokens, r.finished, r.finish_reason, r.error, queued,
                            scores))
                if r.finished:
                    del self._requests[rid]
            self._changed.clear()
            return out

    def migrate_out(self, rid):
        """Request `rid` taken out with its KV: (a RequestPacket, Host.export_request; its KV
        bytes). This host serves it no more."""
        with self._cond:
            entry = self._requests.get(rid)
        if entry is None:
            raise InvalidArgumentError(f"request {rid} is not an unfinished request of this host")
        packet = self.host.export_request(entry[0])
        with self._cond:
            del self._requests[rid]
            self._changed.discard(rid)
        return packet, packet.kv_bytes   # (two returns: the driver reads the second only)

    def migrate_in(self, rid, packet, with_kv=True, instance=None, epoch=0, reservation=None):
        """Serves `packet`'s request as cluster request `rid` (Host.import_request); its tokens
        so far are sent again from the first (the driver checks them). With with_kv="if_room",
        where its KV cannot come in (no room, or a reconfiguration holds the instance) it comes
        in without (recomputed). instance: an index into host.instances (default: where the
        pool places it). reservation: a live migration's (migrate_reserve), which it ends."""
        try:
            r = self.host.import_request(packet, instance=instance, with_kv=bool(with_kv),
                                         reservation=reservation)
        except (OutOfMemoryError, BusyError):
            if with_kv != "if_room":
                raise
            r = self.host.import_request(packet, with_kv=False)   # recomputed: never lost
        self._adopt(rid, r, epoch)
        return packet.kv_bytes

    # ---- a live migration (Cluster.migrate(live=True)): the source's side ----
    def _round_info(self, packet):
        end, start = packet.computed, packet.kv_start
        bs = self.host.block_size
        return {"finished": False, "bytes": packet.kv_bytes, "start": start, "end": end,
                "blocks": -(-end // bs) - start // bs if end > start else 0}

    def _live_export(self, rid, start, then):
        """(packet, its round's info) of request rid, or (None, {"finished": True}) when it has
        ended here."""
        with self._cond:
            entry = self._requests.get(rid)
        if entry is None or entry[0].finished:
            return None, {"finished": True}
        try:
            packet = self.host.export_request(entry[0], start, then)
        except InvalidArgumentError:
            if entry[0].finished:   # it ended between the two lines above
                return None, {"finished": True}
            raise
        if then == "hold":
            with self._cond:
                self._held[rid] = entry[0]
        return packet, self._round_info(packet)

    def migrate_round(self, rid, start):
        """A round: the KV of request rid's tokens [start, computed) while it goes on here
        (two returns: the packet, and the round's info for the driver)."""
        return self._live_export(rid, start, "stay")

    def migrate_stop(self, rid, start):
        """The last round: request rid served here no more, its KV of tokens [start, computed)
        in the packet and the rest kept until migrate_settle."""
        return self._live_export(rid, start, "hold")

    def migrate_settle(self, rid, arrived, epoch=0):
        """After migrate_stop: arrived, this host forgets the request and frees its KV; else it
        serves it again as it was (placement `epoch`, its tokens sent again from the first).
        Where the destination's loss has placed the request here anew meanwhile (submit), that
        placement serves it and the stopped copy's KV is freed."""
        with self._cond:
            held = self._held.pop(rid, None)
            entry = self._requests.get(rid)
            superseded = entry is None or entry[0] is not held
        if held is None or not self.host.settle_export(held, arrived or superseded):
            return False
        if superseded:
            return True
        with self._cond:
            if arrived:
                del self._requests[rid]
                self._changed.discard(rid)
            else:
                self._requests[rid] = [held, 0, epoch]
                self._changed.add(rid)
                self._cond.notify_all()   # wakes the stepping thread
        return True

    # ---- a live migration: the destination's side ----
    def migrate_reserve(self, packet, instance=None):
        """The first round's KV into a reservation (Host.reserve_request); returns its id."""
        return self.host.reserve_request(packet, instance=instance)

    def migrate_fill(self, reservation, packet):
        return self.host.fill_reservation(reservation, packet)

    def migrate_cancel(self, reservation):
        return self.host.free_reservation(reservation)

    def abort(self, rid):
        with self._cond:
            entry = self._requests.get(rid)
        if entry is None or not self.host.abort(entry[0]):
            return False
        with self._cond:   # its end reaches the driver without waiting for a step
            self._changed.add(rid)
            self._cond.notify_all()
        return True

    def call(self, verb, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if verb in READING:
            return getattr(self.host, verb)(*args, **kwargs)
        if verb not in RECONFIGURING:
            raise InvalidArgumentError(f"verb={verb!r}: a cluster's host takes "
                                       f"{', '.join(RECONFIGURING + READING)}")
        # instances travel as indices into host.instances, a buddy group as its id
        if verb == "reconfigure":
            args = (self.host.instances[args[0]],) + tuple(args[1:])
        elif verb == "buddy":
            insts = self.host.instances
            args = ([insts[i] for i in args[0]],) + tuple(args[1:])
        elif verb == "restore":
            args = (self._reconfig(args[0]),) + tuple(args[1:])
        r = getattr(self.host, verb)(*args, **kwargs)
        with self._cond:
            rid = self._next_reconfig
            self._next_reconfig += 1
            self._reconfigs[rid] = r
            self._cond.notify_all()   # a live one needs steps
        return rid, self.describe(rid)

    def _reconfig(self, rid):
        if rid not in self._reconfigs:
            raise InvalidArgumentError(f"reconfiguration {rid} is not one of this host's")
        return self._reconfigs[rid]

    def describe(self, rid):
        r = self._reconfig(rid)
        out = {f: getattr(r, f, None) for f in FIELDS}
        out["error"] = None if out["error"] is None else str(out["error"])
        out["blocked_by"] = None if out["blocked_by"] is None else str(out["blocked_by"])
        out["kind"] = type(r).__name__
        return out

    # ---- pausing (a change that spans hosts happens while both are paused) ----
    def pause(self):
        """No step starts from here on; returns once a step under way has ended."""
        with self._cond:
            self._paused += 1
        self.host.between_steps(lambda: None)
        return True

    def resume(self):
        with self._cond:
            self._paused = max(0, self._paused - 1)
            self._cond.notify_all()
        return True

    # ---- a buddy group split between two hosts (reconfig/split_buddy.py) ----
    def _cluster_ids(self):
        with self._cond:
            return {entry[0].id: rid for rid, entry in self._requests.items()}

    def _forget(self, host_ids):
        """The requests (host ids) left this host: their cluster ids, and they are no more
        this host's to report."""
        ids = self._cluster_ids()
        out = {}
        with self._cond:
            for hid in host_ids:
                rid = ids.get(hid)
                if rid is not None:
                    out[hid] = rid
                    self._requests.pop(rid, None)
                    self._changed.discard(rid)
        return out

    def split_lead_begin(self, group, instance, split):
        """The leader's side: KV of layers [split, L) of the member's requests ({host id:
        array})."""
        with self._split_lock:
            self._check_group(group)
            lead = Lead(self.host, instance, split)
            upper = lead.upper_kv()
            self._split[group] = lead
            return upper

    def _check_group(self, group):
        if group in self._dissolved:
            raise StateError(f"buddy group {group} was dissolved: its other member's host is "
                             f"lost")

    def _side(self, group):
        """This host's side of a formed group (a restore's calls, under _split_lock: a loss
        noticed meanwhile dissolves it before or after, never during)."""
        self._check_group(group)
        if group not in self._split:
            raise InvalidArgumentError(f"buddy group {group} has no side on this host")
        return self._split[group]

    def split_follow_form(self, group, instance, split, upper):
        """The follower's side (three returns): {host id: cluster id} of its requests, which go
        to the leader; [(host id, RequestPacket)]; the follower's capacity in KV blocks."""
        with self._split_lock:
            self._check_group(group)
            follow = Follow(self.host, instance, split)
            packets = follow.form(upper)
            self._split[group] = follow
            return self._forget([hid for hid, _ in packets]), packets, follow.capacity_blocks

    def split_lead_form(self, group, packets, placed, outlet, capacity_blocks):
        """packets: [(the follower's host id, RequestPacket)]; placed: {that id: (cluster id,
        epoch)}. Returns {the follower's host id: host id here}."""
        with self._split_lock:
            lead = self._side(group)
            try:
                moved, handles = lead.form(packets, outlet, capacity_blocks)
            except BaseException:
                del self._split[group]
                raise
            for hid, (rid, epoch) in placed.items():
                self._adopt(rid, handles[moved[hid]], epoch)
            return moved

    def split_follow_adopt(self, group, moved):
        with self._split_lock:
            self._side(group).adopt(moved)
            return True

    def split_follow(self, group, step):
        """One leader step on the follower (engine/peer.h): logits bytes."""
        return self._split[group].follow(step)

    def split_lead_leave(self, group):
        """Restore, first part (leader; three returns): {host id: cluster id} of the requests
        going to the follower's host, {host id: RequestPacket} of them, [host ids staying]."""
        with self._split_lock:
            go, stay = self._side(group).split_homes()
            return self._forget(list(go)), go, stay

    def split_follow_restore(self, group, go, stay, placed):
        """Restore (follower): go {the leader's host id: RequestPacket}, placed {that id:
        (cluster id, epoch)}. Returns the KV above split of the requests staying there."""
        with self._split_lock:
            upper, handles = self._side(group).restore(go, stay)
            del self._split[group]
            for hid, (rid, epoch) in placed.items():
                self._adopt(rid, handles[hid], epoch)
            return upper

    def split_lead_restore(self, group, upper):
        with self._split_lock:
            self._side(group).restore(upper)
            del self._split[group]
            return True

    def split_undo(self, group, placed=None):
        """A formation given up before the leader formed: this side as before (a follower's
        own requests come back to it, recomputed; placed: {host id: (cluster id, epoch)}).
        False when this side was gone already (dissolved by the other host's loss)."""
        with self._split_lock:
            side = self._split.pop(group, None)
            if isinstance(side, Follow):
                handles = side.unform()
                for hid, (rid, epoch) in (placed or {}).items():
                    self._adopt(rid, handles[hid], epoch)
            return side is not None

    def split_dissolve(self, group):
        """The other side's host is lost: this side serves alone again (a leader's requests
        recomputed from their tokens, their KV above split gone with the follower)."""
        with self._split_lock:
            self._dissolved.add(group)
            side = self._split.pop(group, None)
            if side is not None:
                side.dissolve()
                with self._cond:
                    self._cond.notify_all()
            return side is not None

    def split_stats(self, group):
        return dict(self._split[group].stats) if group in self._split else None

    def close(self):
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._stepper.join()
        self.host.close()
        return True
