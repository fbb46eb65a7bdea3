"""KunServe's buddy group whose two members sit on different hosts: each host's side of it.

On one host a buddy group is one pipeline instance (gyges.reconfig.buddy). When the two TP1
instances are on different hosts (processes, machines), each keeps its half of the layers and
the pipeline is split between the processes (engine/peer.h): the LEADER's instance runs layers
[0, split) and keeps every request of the group (it schedules and samples); the FOLLOWER runs
[split, L) on each step the leader sends it and returns the logits. A gyges.Cluster drives the
two sides (gyges.distributed.cluster.Cluster.buddy), moving what crosses between them through
Ray; a test can drive them in one process.

Formation (blocking: both hosts pause between two steps for it):
    lead = Lead(host_a, instance, split)        upper = lead.upper_kv()
    follow = Follow(host_b, instance, split)    packets = follow.form(upper)
    moved = lead.form(packets, outlet, follow.capacity_blocks)
    follow.adopt(moved)                         # the follower's KV of the requests that moved
Each request's KV of the layers its host no longer serves crosses once: the leader's requests
send layers [split, L) to the follower, the follower's requests come to the leader with layers
[0, split) (as RequestPackets) and keep [split, L) where they are. The parameters of the layers
a side dropped are KV room at once.

Restore (blocking):
    go, stay = lead.split_homes()               # requests for the follower's host, and the rest
    upper, moved = follow.restore(go, stay)     # the follower's side back to a TP1 instance
    lead.restore(upper)                         # and the leader's
Every request goes to the less loaded member with its KV of every layer; each side's dropped
layers come back from its host copy (each host loaded the whole model).
"""
import numpy as np

from .. import _C
from ..core.errors import BusyError, InvalidArgumentError, OutOfMemoryError
from ..runtime import request_packet
from ..runtime.request_packet import gather_layers, write_layers
from .buddy import _new_seq


def _member(host, index):
    insts = host.instances
    if not isinstance(index, int) or not 0 <= index < len(insts):
        raise InvalidArgumentError(f"instance {index!r} is not an index into the host's "
                                   f"{len(insts)} instances")
    inst = insts[index]
    if inst.tp != 1 or inst.stages:
        raise InvalidArgumentError(f"a buddy group's member is a TP1 instance, got "
                                   f"{inst.layout} on workers {list(inst.workers)}")
    w = inst.workers[0]
    if "replicated" in host.weights_of([w]):
        raise InvalidArgumentError(f"worker {w} keeps replicas (weights='replicated'); a buddy "
                                   f"group needs sharded workers")
    busy = host._holding([w])
    if busy:
        raise BusyError(f"worker {w} is being reconfigured ({busy!r})")
    viewed = host.pinned([w])
    if viewed:
        raise BusyError(f"{viewed}: a buddy group changes the worker's pages; delete the views")
    return inst


def _check_split(host, split):
    L = host.model.config.num_hidden_layers
    if not isinstance(split, int) or not 0 < split < L:
        raise InvalidArgumentError(f"split must be a layer in (0, {L}), got {split!r}")


def _keep_layers(worker, first, end, embed, head):
    """The worker keeps the parameters of layers [first, end) (and the ends asked for) and
    serves them; returns the bytes released."""
    freed = worker.weights.drop_layers(worker.weights.held_layers - set(range(first, end)))
    worker.weights.set_ends(embed=embed, head=head)
    worker.install(c_model=worker.model_for_layers(first, end))
    return freed


def _keep_all(worker):
    """The worker holds every layer again, from the host copy; returns the bytes written."""
    L = worker.config.num_hidden_layers
    copied = worker.weights.restore_layers(set(range(L)))
    copied += worker.weights.set_ends(embed=True, head=True)
    worker.install(c_model=worker.model_for_layers(0, L))
    return copied


class _Side:
    """What both sides share: while formed, the side holds its worker (Host.holds): nothing
    else reconfigures it, and no request of it is exported (its KV is on two hosts)."""
    kind = "buddy group split between hosts"

    @property
    def done(self):
        return self not in self.host.holds

    def claims(self):
        return {self.member.workers[0]}

    def _hold(self, held):
        if held and self not in self.host.holds:
            self.host.holds.append(self)
        elif not held and self in self.host.holds:
            self.host.holds.remove(self)

    def __repr__(self):
        return (f"{type(self).__name__}(worker {self.member.workers[0]}, split {self.split}, "
                f"{'done' if self.done else 'formed'})")


class Lead(_Side):
    """The leader's side: the TP1 instance host.instances[index] becomes the pipeline's first
    part, layers [0, split), with every request of the group."""

    def __init__(self, host, index, split):
        _check_split(host, split)
        self.host, self.split = host, split
        self.member = _member(host, index)
        self.worker = host.worker(self.member.workers[0])
        self.instance = None     # the pipeline part, once formed
        self.stats = {"weight_bytes_released": 0, "kv_bytes_sent": 0, "kv_bytes_received": 0}

    def upper_kv(self):
        """{rid: KV of layers [split, L) of its computed tokens} of the member's requests that
        hold KV (the follower will keep it)."""
        L = self.host.model.config.num_hidden_layers
        out = {}
        with self.host._lock:
            for rid in self.member.request_ids():
                seq = self.member.request_seqs(rid)[0]
                n = self.member.info(rid)["n_computed"]
                if seq >= 0 and n > 0:
                    out[rid] = gather_layers(self.worker.kv, seq, self.split, L, 0, n)
        self.stats["kv_bytes_sent"] += sum(a.nbytes for a in out.values())
        return out

    def form(self, packets, outlet, capacity_blocks):
        """Drops layers [split, L), becomes the pipeline's first part with the member's requests
        and the follower's (packets: [(their id there, RequestPacket of layers [0, split))]),
        and sends each step to outlet. Returns ({their id there: id here}, {id here: handle})."""
        host, w = self.host, self.worker
        with host._lock:
            host._check_open()
            cp = w.checkpoint()
            moved, handles = {}, {}
            pipe = None
            try:
                self.stats["weight_bytes_released"] = _keep_layers(w, 0, self.split, True, False)
                pipe = host.make_instance(self.member.workers, 1, stages=[(0, self.split)],
                                          span=(0, self.split))
                for rid in self.member.request_ids():
                    pipe.take(self.member, rid, self.member.request_seqs(rid))
                for their, packet in packets:
                    handle = request_packet.import_request(pipe, packet, host._next_id,
                                                           host.clock())
                    host._next_id += 1
                    moved[their] = handle.id
                    handles[handle.id] = handle
                    self.stats["kv_bytes_received"] += packet.kv_bytes
                pipe.set_peer(outlet, capacity_blocks)
            except BaseException:
                if pipe is not None:   # the member's requests go back with their KV
                    for rid in list(pipe.request_ids()):
                        if rid in handles:
                            pipe.let_go(rid)
                        else:
                            self.member.take(pipe, rid, pipe.request_seqs(rid))
                    pipe.close()
                w.restore(cp)
                raise
            host.pool.remove(self.member)
            host.install(pipe)
            self.instance = pipe
            self._hold(True)
            return moved, handles

    def split_homes(self):
        """Restore, first part: the pipeline's requests are shared out between the two members
        by tokens (each to the less loaded so far, in the order they came). Those for the
        follower leave with their KV of layers [0, split): {id here: RequestPacket}; returns
        that and the ids that stay."""
        pipe, host = self.instance, self.host
        with host._lock:
            pipe.peer_flush()
            load, go, stay = [0, 0], {}, []
            for rid in pipe.request_ids():
                n = len(pipe.requests[rid].prompt) + len(pipe.requests[rid].output_tokens)
                home = 0 if load[0] <= load[1] else 1
                load[home] += n
                if home == 0:
                    stay.append(rid)
                else:
                    go[rid] = request_packet.export_request(pipe, rid, host.clock(),
                                                            layers=(0, self.split))
                    self.stats["kv_bytes_sent"] += go[rid].kv_bytes
            # (the follower keeps their KV above split: its restore sends it along with them)
            return go, stay

    def restore(self, upper):
        """Restore, last part: the layers [split, L) come back from the host copy, the requests
        that stayed get their KV of those layers (upper: {id here: array}) and the worker
        serves them as a TP1 instance again."""
        host, w, pipe = self.host, self.worker, self.instance
        with host._lock:
            _keep_all(w)
            for rid, kv in upper.items():
                seq = pipe.request_seqs(rid)[0]
                if seq >= 0:
                    write_layers(w.kv, seq, self.split, kv)
                self.stats["kv_bytes_received"] += kv.nbytes
            inst = host.make_instance(self.member.workers, 1)
            for rid in pipe.request_ids():
                seqs = pipe.request_seqs(rid)
                if rid not in upper and seqs[0] >= 0:   # its KV above split is not here
                    seqs = [-1]
                    w.kv.free(pipe.request_seqs(rid)[0])
                inst.take(pipe, rid, seqs)
            pipe.set_peer(None, 0)
            host.retire(pipe)
            host.install(inst)
            self.member, self.instance = inst, None
            self._hold(False)
            return inst

    def dissolve(self):
        """The follower's host is lost: the pipeline's requests go on in a TP1 instance here,
        recomputed from their tokens (their KV above split was there)."""
        host, w, pipe = self.host, self.worker, self.instance
        with host._lock:
            if pipe is None:
                return
            pipe.set_peer(None, 0)
            _keep_all(w)
            inst = host.make_instance(self.member.workers, 1)
            for rid in pipe.request_ids():
                seq = pipe.request_seqs(rid)[0]
                inst.take(pipe, rid, [-1])
                if seq >= 0:
                    w.kv.free(seq)
            host.retire(pipe)
            host.install(inst)
            self.member, self.instance = inst, None
            self._hold(False)


class Follow(_Side):
    """The follower's side: the TP1 instance host.instances[index] becomes the pipeline's last
    part, layers [split, L), run for the leader (follow)."""

    def __init__(self, host, index, split):
        _check_split(host, split)
        self.host, self.split = host, split
        self.member = _member(host, index)
        self.worker = host.worker(self.member.workers[0])
        self._c = None
        self.capacity_blocks = 0
        self._kept, self._packets = {}, []   # its own requests let go to the leader (form)
        self.stats = {"weight_bytes_released": 0, "steps": 0}

    def form(self, upper):
        """Takes the leader's requests' KV of layers [split, L) (upper: {their id: array}), lets
        its own requests go to the leader (returned as [(id here, RequestPacket of layers
        [0, split))], their KV of [split, L) kept here) and drops layers [0, split)."""
        host, w = self.host, self.worker
        L = host.model.config.num_hidden_layers
        with host._lock:
            host._check_open()
            cp = w.checkpoint()
            made, packets, kept = [], [], {}
            try:
                for rid, kv in upper.items():
                    seq = _new_seq(w.kv, kv.shape[2])
                    made.append((rid, seq))
                    write_layers(w.kv, seq, self.split, kv)
                tied = host.model.config.tie_word_embeddings
                self.stats["weight_bytes_released"] = _keep_layers(w, self.split, L, tied, True)
                self._c = _C.Engine([[w.c_model]], [[w.kv.handle]], [None], host.max_batch_tokens,
                                    host.max_running, host.max_prefill_chunk,
                                    layers=[(self.split, L)], span=(self.split, L))
                for rid, seq in made:
                    self._c.follow_adopt(rid, [seq])
                self.capacity_blocks = self._c.stats()["capacity_blocks"]
            except BaseException:
                self._c = None
                for _, seq in made:
                    w.kv.free(seq)
                w.restore(cp)
                raise
            # the member's own requests leave for the leader (nothing fails past here)
            for rid in list(self.member.request_ids()):
                packet, held = request_packet.export_request(
                    self.member, rid, host.clock(), layers=(0, self.split), then="hold")
                packets.append((rid, packet))
                kept[rid] = held.seqs[0]   # (the follower's now: adopt)
            self._kept, self._packets = kept, packets
            host.pool.remove(self.member)
            self._hold(True)
            return packets

    def adopt(self, moved):
        """The requests that went to the leader ({id here: id there}) keep their KV of
        [split, L) here under their new ids."""
        for rid, there in moved.items():
            seq = self._kept.pop(rid)
            if seq >= 0:
                self._c.follow_adopt(there, [seq])
        for seq in self._kept.values():   # (none: every request went)
            if seq >= 0:
                self.worker.kv.free(seq)
        self._kept = {}

    def unform(self):
        """The leader could not form: this worker serves alone again, its own requests back
        ({id they had here: new handle}), recomputed from their tokens."""
        host, w = self.host, self.worker
        with host._lock:
            self._c = None   # (frees the leader's requests' KV here)
            for seq in self._kept.values():
                if seq >= 0:
                    w.kv.free(seq)
            inst = self._serve_alone()
            handles = {}
            for rid, packet in self._packets:
                handles[rid] = request_packet.import_request(inst, packet, host._next_id,
                                                             host.clock(), with_kv=False)
                host._next_id += 1
            self._kept, self._packets = {}, []
            return handles

    def _serve_alone(self):
        self._hold(False)
        _keep_all(self.worker)
        inst = self.host.make_instance(self.member.workers, 1)
        self.host.install(inst)
        self.member = inst
        return inst

    def dissolve(self):
        """The leader's host is lost (its requests are placed elsewhere by the cluster): the
        follower's KV goes and the worker serves alone again. (Its own requests, let go to the
        leader at the formation, are the cluster's to place again.)"""
        with self.host._lock:
            self._c = None   # (frees every sequence it held)
            for seq in self._kept.values():   # (a formation the loss cut short)
                if seq >= 0:
                    self.worker.kv.free(seq)
            self._kept, self._packets = {}, []
            self._serve_alone()

    def follow(self, step):
        """The leader's step (engine/peer.h): logits bytes, or None for a flush or a cancel."""
        if self._c is None:
            raise InvalidArgumentError("this follower has been restored")
        self.stats["steps"] += 1
        return self._c.follow(step)

    def restore(self, go, stay):
        """Takes the requests the leader sends home (go: {its id: RequestPacket of [0, split)})
        with their KV of [split, L) from here, gets layers [0, split) back from the host copy
        and serves them as a TP1 instance again. Returns ({id there: its KV of [split, L)} for
        the requests that stay there, {id there: handle here})."""
        host, w = self.host, self.worker
        L = host.model.config.num_hidden_layers
        with host._lock:
            upper = {}
            for rid in stay:
                seq = self._c.follow_seqs(rid)[0]
                if seq >= 0:
                    upper[rid] = gather_layers(w.kv, seq, self.split, L, 0, w.kv.n_tokens(seq))
            packets = {}
            for rid, packet in go.items():
                seq = self._c.follow_seqs(rid)[0]
                if packet.kv is not None and seq >= 0:
                    n = packet.kv.shape[2]
                    packet.kv = np.concatenate([packet.kv, gather_layers(
                        w.kv, seq, self.split, L, 0, n)])
                    packet.kv_layers = None
                elif packet.kv is not None:   # (no KV above: it is recomputed)
                    packet.kv = None
                packets[rid] = packet
            for rid in list(stay) + list(go):
                seq = self._c.follow_seqs(rid)[0]
                self._c.follow_forget(rid)
                if seq >= 0:
                    w.kv.free(seq)
            self._c = None
            inst = self._serve_alone()
            handles = {}
            for rid, packet in packets.items():
                try:
                    h = request_packet.import_request(inst, packet, host._next_id, host.clock())
                except OutOfMemoryError:
                    h = request_packet.import_request(inst, packet, host._next_id, host.clock(),
                                                      with_kv=False)
                host._next_id += 1
                handles[rid] = h
            return upper, handles
