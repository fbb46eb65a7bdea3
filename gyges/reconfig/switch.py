"""Flying Serving's switches on a replicated host (Host(..., weights="replicated"),
runtime/replicas.py): a bind makes an aligned group of workers one TP engine, a release gives
them back to DP. Nothing is copied, mapped or made: every worker keeps the whole model and one
KV pool that its DP engine and its groups' TP engines share, so a switch only changes which
engine of a worker steps.

    host = gyges.Host(model, workers=4, layout="4xTP1", weights="replicated")
    s = host.switch(workers=(0, 1, 2, 3), tp=4, preempt="soft")  # bind the four into TP4
    r = host.submit(prompt, params, tp=4)                         # TP work (binds if needed)
    host.step(); host.modes()                                     # ['TP4', 'TP4', 'TP4', 'TP4']
    host.switch(workers=(0, 1, 2, 3), tp=1)                       # release them to DP

A bind's preempt: "wait" binds once the members' running DP requests are done (the paper's
sequential switching; live, advanced by host.step); "soft" meanwhile starts the pending TP
requests in DP mode on a member with nothing to do, and at the bind recomputes them under TP;
"hard" binds at once, pausing the members' DP requests with their KV (they resume after the
release). A release waits for the group's running TP requests ("wait": the TP engine admits
nothing new meanwhile), or recomputes them on the members in DP mode at once ("soft", "hard").
A group bound for TP work (auto=True: what submit(tp=k) and the pool ask for) is released by
itself once no TP request is left; any bound group is, once it has no TP work and its members
have DP work waiting (runtime/replicas.py: tick).

Moving a request without its KV (a soft start, a bind, a release under load) keeps the KV it
leaves until the switch's commit, so a failure takes every move back exactly; the KV is freed
once the switch is made.
"""
import time

from ..core import checks
from ..core.errors import BusyError, InvalidArgumentError
from ..runtime import comm
from .reconfiguration import Reconfiguration

PREEMPT = ("wait", "soft", "hard")


def switch(host, workers, tp, preempt="wait", tp_work=(), auto=False):
    """host.switch's executor: a Bind (tp > 1) or a Release (tp = 1) of the aligned group."""
    workers = checks.int_sequence("workers", workers, 0, host.n_workers - 1)
    if "sharded" in host.weights_of(workers):
        raise InvalidArgumentError("switch() is for workers built with weights='replicated'; "
                                   f"workers {sorted(workers)} keep their shards only: use "
                                   f"transform()")
    if not workers or len(set(workers)) != len(workers):
        raise InvalidArgumentError(f"workers must name distinct workers, got {workers}")
    tp = checks.integer("tp", tp, lo=1, hi=host.n_workers)
    if preempt not in PREEMPT:
        raise InvalidArgumentError(f"preempt must be one of {', '.join(PREEMPT)}, got "
                                   f"{preempt!r}")
    group = host.replicas.group(workers)
    if tp == 1:
        if group.state == "binding":  # a bind under way is called off: taken back exactly
            host.cancel(group.switch, "released before it bound")
        return Release(host, group, preempt)
    if tp != len(workers):
        raise InvalidArgumentError(f"tp={tp} binds {tp} workers, but workers names "
                                   f"{len(workers)}: {sorted(workers)}")
    return Bind(host, group, preempt, tp_work, auto)


class _Switch(Reconfiguration):
    """What a bind and a release share: the stats of Flying Serving's switch, and moving a
    request between two engines without its KV (recomputed where it lands)."""

    def __init__(self, host, group, tp, preempt):
        super().__init__(host, group.workers)
        self.group, self.tp, self.preempt = group, tp, preempt
        self.pool = host.replicas
        self._asked = time.perf_counter()
        self.stats.update(wait_seconds=0.0, switch_seconds=0.0, weight_bytes_copied=0,
                          kv_bytes_moved=0, pages_mapped=0, communicators_created=0,
                          requests_paused=0, requests_recomputed=0, tokens_recomputed=0,
                          requests_soft_started=0)
        self._to_free = []  # (cache, seq): KV of requests moved away, freed at the commit

    def __repr__(self):
        return (f"{type(self).__name__}(workers={list(self.workers)}, tp={self.tp}, "
                f"preempt={self.preempt!r}, {self.state})")

    def _recompute(self, dst, src, rid, caches):
        """Moves request rid from instance src to dst without its KV, which had src's geometry:
        dst computes its prompt and generated tokens again. Its KV in `caches` (src's, one per
        rank) stays until the commit (journaled: the request goes back with it)."""
        seqs, record = src.request_seqs(rid), src.record(rid)
        handle = src.requests[rid]
        dst.take(src, rid, [-1] * len(dst.workers))
        self.undo(lambda: src.take(dst, rid, seqs, record), f"request {rid}")
        self._to_free.extend((cache, seq) for cache, seq in zip(caches, seqs) if seq >= 0)
        self.stats["requests_recomputed"] += 1
        self.stats["tokens_recomputed"] += len(handle.prompt) + len(handle.output_tokens)
        self.stats["requests_moved"] += 1

    def _free_moved_kv(self):
        for cache, seq in self._to_free:
            cache.free(seq)
        self._to_free = []

    def _counters(self):
        arenas = [self.host.worker(w).arena.stats() for w in range(self.host.n_workers)]
        return (sum(a["bytes_copied_total"] for a in arenas),
                sum(a["maps_total"] for a in arenas), comm.communicators_made())

    def _count(self, before):
        """What the switch moved, mapped and made, measured on the arenas and the pool. The KV
        and weights live in the same arenas, so copied bytes count for both."""
        copied, maps, comms = (a - b for a, b in zip(self._counters(), before))
        self.stats["weight_bytes_copied"] = self.stats["kv_bytes_moved"] = copied
        self.stats["bytes_moved"] = copied
        self.stats["pages_mapped"] = maps
        self.stats["communicators_created"] = comms


class Bind(_Switch):
    """free -> binding -> bound. Live while the members drain ("wait", "soft")."""

    kind = "bind"

    def __init__(self, host, group, preempt, tp_work=(), auto=False):
        super().__init__(host, group, group.size, preempt)
        self.live = preempt != "hard"
        self.auto = auto
        self.tp_work = tuple(tp_work)

    def _plan(self):
        pool, g = self.pool, self.group
        other = pool.overlap(g)
        if other is not None:
            raise BusyError(f"workers {list(g.workers)} overlap the TP{other.size} group of "
                            f"workers {list(other.workers)} ({other.state}); release it first")
        if g.state != "free":
            raise BusyError(f"workers {list(g.workers)} are {g.state} as TP{g.size} already")
        self.homes = {}
        for handle in self.tp_work:  # TP work a controller started in DP mode on a member
            home = [w for w in g.workers if pool.dp[w].serves(handle)]
            if not home:
                raise InvalidArgumentError(f"tp_work: request {handle.id} is not served by a DP "
                                           f"worker of {list(g.workers)}")
            self.homes[handle.id] = home[0]
        # members with nothing running bind at once, as does a hard bind
        self.live = self.preempt != "hard" and not pool.members_drained(g)

    def _begin(self):
        pool, g = self.pool, self.group
        pool.engage(g, self, self.auto)
        self.undo(lambda: pool.free(g), "group")
        g.soft.update(self.homes)
        if self.live and self.preempt == "soft":
            self._soft_start()

    def _advance(self):
        """Starts soft requests on idle members; True once the members have drained (at once
        for a hard bind)."""
        if self.preempt == "hard":
            return True
        if self.preempt == "soft":
            self._soft_start()
        if not self.pool.members_drained(self.group):
            self.blocked_by = "members still run DP requests"
            return False
        self.blocked_by = None
        return True

    def _soft_start(self):
        """Pending TP requests start in DP mode on members whose DP engine has nothing to do."""
        pool, g = self.pool, self.group
        pending = [rid for rid in g.instance.request_ids()
                   if g.instance.info(rid)["state"] == "waiting"]
        idle = [w for w in g.workers if pool.dp[w].unfinished() == 0]
        for rid, w in zip(pending, idle):
            inst = pool.dp[w]
            handle = g.instance.requests[rid]
            if not inst.fits(len(handle.prompt) + handle.params.max_tokens):
                continue  # too long for one worker: it waits for the bind
            inst.take(g.instance, rid, [-1])
            self.undo(lambda rid=rid, w=w: self._unstart(rid, w), f"soft start of {rid}")
            inst.hold(False)  # nothing else is queued here and no new DP work is placed here
            self.undo(lambda inst=inst: inst.hold(True), "member held")
            g.soft[rid] = w
            self.stats["requests_soft_started"] += 1

    def _unstart(self, rid, w):
        """A soft start taken back (the bind called off): the request waits in the TP engine
        again, to recompute what it ran in DP mode there; its DP KV goes."""
        g, inst = self.group, self.pool.dp[w]
        if inst.requests.get(rid) is None:
            return  # it finished meanwhile
        seqs = inst.request_seqs(rid)
        g.instance.take(inst, rid, [-1] * g.size)
        if seqs[0] >= 0:
            self.host.worker(w).kv.free(seqs[0])

    def _commit(self):
        pool, g = self.pool, self.group
        before = self._counters()
        start = time.perf_counter()
        for rid, w in list(g.soft.items()):  # soft-started requests recompute under TP
            if w is not None and pool.dp[w].requests.get(rid) is not None:
                self._recompute(g.instance, pool.dp[w], rid, [self.host.worker(w).kv])
        for w in g.workers:
            self.stats["requests_paused"] += pool.dp[w].stats()["running"]
        pool.bind(g)
        g.soft.clear()
        end = time.perf_counter()
        self.stats["switch_seconds"] = end - start
        self.stats["wait_seconds"] = start - self._asked
        self._count(before)

    def _finish(self):
        self._free_moved_kv()


class Release(_Switch):
    """bound -> free: at once when the group has no TP request left, or with "soft"/"hard" at
    once, its TP requests recomputed on the members in DP mode (refused, with nothing changed,
    when one fits no member); with "wait", live until its running TP requests are done (the
    queued ones stay, and bind the group again later). A group still binding has its bind
    called off (rolled back: its members' DP engines admit again, soft-started requests go back
    to the TP engine's queue)."""

    kind = "release"
    advance_after_step = True  # it ends as soon as the step ended the last TP request

    def __init__(self, host, group, preempt, auto=False):
        super().__init__(host, group, 1, preempt)
        self.auto = auto
        self.live = False

    def _plan(self):
        g = self.group
        if g.release is not None:
            raise BusyError(f"a release of workers {list(g.workers)} is under way")
        self._plan_dp = None
        if g.state == "bound" and g.instance.unfinished():
            if self.preempt == "wait":
                self.live = True
            else:
                self._plan_dp = self._members_for()

    def _members_for(self):
        """For each TP request of the group, the members that can hold it in DP mode."""
        g = self.group
        members = [self.pool.dp[w] for w in g.workers]
        plan = []
        for rid in g.instance.request_ids():
            h = g.instance.requests[rid]
            tokens = len(h.prompt) + h.params.max_tokens
            fits = [m for m in members if m.fits(tokens)]
            if not fits:
                raise BusyError(f"request {rid} ({tokens} tokens) fits no worker of the TP"
                                f"{g.size} group alone: release it with preempt='wait'")
            plan.append((rid, fits))
        return plan

    def _begin(self):
        pool, g = self.pool, self.group
        if self._plan_dp:
            for rid, fits in self._plan_dp:
                self._recompute(min(fits, key=lambda m: m.load()), g.instance, rid, g.views)
        if self.live:
            pool.start_release(g, self)
            self.undo(lambda: pool.unbind(g), "release")

    def _advance(self):
        if self.group.instance.stats()["running"]:
            self.blocked_by = "TP requests still run"
            return False
        self.blocked_by = None
        return True

    def _commit(self):
        if self.group.state != "free":
            self.pool.free(self.group)

    def _finish(self):
        self._free_moved_kv()
