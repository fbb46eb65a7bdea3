"""A KunServe buddy group whose two members sit on different hosts of a gyges.Cluster.

    g = cluster.buddy([(0, 1), (1, 0)])   # instance 1 of host 0 and instance 0 of host 1
    g.stats                               # bytes each way, weight bytes released, the steps
    cluster.restore(g)                    # both serve alone again

The first member leads: its host keeps every request of the group and runs layers [0, split);
each step's hidden states go to the second member's host, which runs [split, L) and sends the
logits back (engine/peer.h; reconfig/split_buddy.py has each side). The bytes travel as Ray
actor calls between the two host processes (the step from the leader's stepping thread straight
to the follower's actor, never through the driver; the KV exchanged at formation and restore as
Ray objects passed from one actor to the other): Ray's object store and its gRPC channels are
what a cluster of CPU hosts has between processes and machines, with no collective library to
set up, and one call per step is about a millisecond (benchmarks/bench_cluster.py measures it).
A formation or restore pauses both hosts between two of their steps (KunServe's blocking
exchange). If either host is lost, the other serves alone again (Cluster._lost): a lost
follower's leader recomputes the group's requests from their tokens; a lost leader's requests
are placed elsewhere like any lost host's.
"""
import itertools

from ..core import checks
from ..core.errors import InvalidArgumentError, StateError

_ids = itertools.count()


class _Outlet:
    """The leader's outlet: one Ray actor call per step to the follower's host (pickled into
    the leader's process)."""

    def __init__(self, actor, group):
        self.actor, self.group = actor, group

    def __call__(self, step):
        import ray
        return ray.get(self.actor.split_follow.remote(self.group, step))


class SplitBuddy:
    """A formed group (Cluster.buddy makes it): members [(host, instance index)], split, and
    whether it has been restored."""

    def __init__(self, cluster, members, split=None):
        if (not isinstance(members, (list, tuple)) or len(members) != 2 or
                any(not isinstance(m, (list, tuple)) or len(m) != 2 for m in members)):
            raise InvalidArgumentError(f"members must be two (host, instance) pairs, got "
                                       f"{members!r}")
        (ha, ia), (hb, ib) = members
        n = cluster.n_hosts
        checks.integer("members' host", ha, 0, n - 1)
        checks.integer("members' host", hb, 0, n - 1)
        if ha == hb:
            raise InvalidArgumentError(f"both members are on host {ha}: a buddy group on one host "
                                       f"is cluster.host({ha}).buddy(...)")
        self.cluster = cluster
        self.members = ((ha, ia), (hb, ib))
        self.split = split
        self.id = f"split-{next(_ids)}"
        self.restored = False
        self.stats = {}

    @property
    def hosts(self):
        return self.members[0][0], self.members[1][0]

    def _actors(self):
        a, b = self.hosts
        live = self.cluster.live_hosts
        for h in (a, b):
            if h not in live:
                raise StateError(f"host {h} is lost: {self.cluster.lost_hosts.get(h)}")
        return self.cluster._actors[a], self.cluster._actors[b]

    def _paused(self, fn):
        """fn() with both hosts paused between two steps."""
        c, (a, b) = self.cluster, self._actors()
        ia, ib = self.hosts
        c._get(ia, a.pause.remote())
        try:
            c._get(ib, b.pause.remote())
            try:
                return fn()
            finally:
                c._get(ib, b.resume.remote())
        finally:
            c._get(ia, a.resume.remote())

    def _place(self, ids, host):
        """The cluster's requests {host id: cluster id} now served by `host`: {host id:
        (cluster id, epoch)}."""
        out = {}
        with self.cluster._lock:
            for hid, rid in ids.items():
                h = self.cluster._handles.get(rid)
                if h is not None:
                    out[hid] = (rid, h._place(host))
        return out

    def form(self):
        c = self.cluster
        (ha, ia), (hb, ib) = self.members
        a, b = self._actors()
        if self.split is None:
            self.split = c._get(ha, a.info.remote())["layers"] // 2

        def run():
            upper = a.split_lead_begin.remote(self.id, ia, self.split)
            try:
                c._get(ha, upper)
                ids, packets, capacity = b.split_follow_form.options(num_returns=3).remote(
                    self.id, ib, self.split, upper)
                ids = c._get(hb, ids)
            except BaseException:
                c._get(ha, a.split_undo.remote(self.id))
                raise
            placed = self._place(ids, ha)
            try:
                moved = c._get(ha, a.split_lead_form.remote(self.id, packets, placed,
                                                             _Outlet(b, self.id), capacity))
            except BaseException:
                back = self._place({hid: rid for hid, (rid, _) in placed.items()}, hb)
                try:
                    undone = c._get(hb, b.split_undo.remote(self.id, back))
                except StateError:   # the follower's host is lost too
                    undone = False
                if not undone:
                    # a loss has dissolved the follower already, or taken it: the requests it
                    # let go are placed anew, on a live host
                    self._send_on(back.values())
                raise
            c._get(hb, b.split_follow_adopt.remote(self.id, moved))
            self.stats["moved_to_leader"] = len(moved)
        self._paused(run)
        self.refresh()
        return self

    def refresh(self):
        """Each side's counters now (weight bytes released, KV bytes sent and received, the
        follower's steps)."""
        c = self.cluster
        (ha, _), (hb, _) = self.members
        a, b = self._actors()
        self.stats["leader"] = c._get(ha, a.split_stats.remote(self.id))
        self.stats["follower"] = c._get(hb, b.split_stats.remote(self.id))
        return self.stats

    def restore(self):
        if self.restored:
            raise StateError(f"{self!r} is restored already")
        c = self.cluster
        (ha, _), (hb, _) = self.members
        a, b = self._actors()
        self.refresh()

        def run():
            ids, go, stay = a.split_lead_leave.options(num_returns=3).remote(self.id)
            placed = self._place(c._get(ha, ids), hb)
            upper = b.split_follow_restore.remote(self.id, go, stay, placed)
            try:
                c._get(hb, upper)
            except BaseException:
                # the follower took none of them (the leader's loss dissolved its side first,
                # or its own host is lost): each is placed anew, unless a loss has already
                self._send_on(placed.values())
                raise
            c._get(ha, a.split_lead_restore.remote(self.id, upper))
            self.stats["moved_to_follower"] = len(placed)
        self._paused(run)
        self.restored = True
        return self

    def _send_on(self, placed):
        """Requests [(cluster id, epoch)] this group placed on a member that did not take them:
        placed anew on a live host (those still at that placement)."""
        c = self.cluster
        for rid, epoch in placed:
            h = c._handles.get(rid)
            if h is not None:
                c._resubmit(h, epoch)

    def lost(self, host):
        """Host `host` (one of the members') is lost: the other serves alone again. (Every
        notice of the loss calls it; the second dissolve does nothing.)"""
        self.restored = True
        other = self.hosts[1] if host == self.hosts[0] else self.hosts[0]
        if other in self.cluster.live_hosts:
            try:
                self.cluster._get(other, self.cluster._actors[other].split_dissolve.remote(
                    self.id))
            except StateError:
                pass   # (that one is gone too)

    def __repr__(self):
        (ha, ia), (hb, ib) = self.members
        return (f"SplitBuddy(host {ha} instance {ia} layers [0, {self.split}) + host {hb} "
                f"instance {ib} layers [{self.split}, L){', restored' if self.restored else ''})")
