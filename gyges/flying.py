"""Flying Serving: DP <-> TP switching on full replicas, for a gyges.Host built with
weights="replicated".

    host = gyges.Host(model, workers=4, layout="4xTP1", weights="replicated")
    s = host.switch(workers=(0, 1, 2, 3), tp=4, preempt="soft")  # bind the four into TP4
    r = host.submit(prompt, params, tp=4)                         # asks for TP4 (binds if needed)
    host.step(); host.modes()                                     # ['TP4', 'TP4', 'TP4', 'TP4']
    host.switch(workers=(0, 1, 2, 3), tp=1)                       # release them to DP

Nothing moves in a switch. Every worker keeps the whole model in its arena and one KV cache of all
the KV heads, its DP engine's. Every aligned group of k workers has a TPk engine, made at start-up
like the communicators (Flying Serving's eager initialisation): its rank r runs on worker r's own
C model, whose forward pass reads the rows of rank r's heads and its FFN shards out of the
replica (zero-copy shard views), and on a view of worker r's KV cache (KVCache.view, the KV cache
adaptor: blocks of k*B tokens of H/k heads, the same bytes, one block pool), joined by the group's
communicator from the host's pool. A switch changes only which engine of a worker steps:

    DP      the worker's DP engine steps and admits work
    paused  the worker waits to bind (preempt "wait" or "soft"): its DP engine admits nothing and
            runs its running requests to their end
    TPk     the group's TP engine steps; the DP engine's requests stay, paused, with their KV

preempt: "wait" binds once the members' running DP requests are done (the paper's sequential
switching); "soft" meanwhile starts the pending TP requests in DP mode on a member with nothing
to do, and at the bind frees their DP KV and recomputes them under TP; "hard" binds before the
next step, pausing the members' DP requests (their blocks stay in the pool, and they resume after
the release without recomputation). A group binds for TP work and is released by
switch(tp=1), once its TP requests are done ("wait") or at once with them recomputed on the
members in DP mode ("soft", "hard"), or by itself once no TP request is left when the bind came
from submit(tp=k).
"""
import time
import weakref

from . import checks, comm
from .errors import BusyError, InvalidArgumentError

PREEMPT = ("wait", "soft", "hard")


class Switch:
    """What host.switch returns: `done` once the group is bound (tp > 1) or released (tp = 1);
    `stats` says what it cost: seconds waiting for the members and seconds of the switch itself,
    the bytes and pages it moved or mapped, communicators it made, and the requests it paused or
    recomputed."""

    def __init__(self, workers, tp, preempt, auto_release=False):
        self.workers, self.tp, self.preempt = tuple(workers), tp, preempt
        self.auto_release = auto_release
        self.done = False
        self._asked = time.perf_counter()
        self.stats = {"wait_seconds": 0.0, "switch_seconds": 0.0, "weight_bytes_copied": 0,
                      "kv_bytes_moved": 0, "pages_mapped": 0, "communicators_created": 0,
                      "requests_paused": 0, "requests_recomputed": 0, "tokens_recomputed": 0,
                      "requests_soft_started": 0}

    def __repr__(self):
        state = "done" if self.done else "waiting"
        return (f"Switch(workers={list(self.workers)}, tp={self.tp}, preempt={self.preempt!r}, "
                f"{state})")


class Group:
    """An aligned group of k workers: its TPk instance over views of the members' KV caches,
    and where it stands ("free", "binding", "bound", "releasing")."""

    def __init__(self, first, size, instance, views):
        self.first, self.size, self.instance, self.views = first, size, instance, views
        self.workers = tuple(range(first, first + size))
        self.state = "free"
        self.switch = None      # the bind under way or done
        self.soft = {}          # request id -> the member whose DP engine runs it meanwhile
        self.release = None     # the Switch(tp=1) waiting for the TP work to end
        self.wanted = None      # free with TP requests queued: how to bind once it can


class Replicas:
    """The DP and TP engines of a replicated host and the switches between them. The host calls
    it from within its own lock."""

    def __init__(self, host, make_instance):
        self.host = weakref.proxy(host)
        n = host.n_workers
        self.dp = [make_instance([w], 1, None) for w in range(n)]
        self.groups = {}
        for first, size in comm.aligned_groups(n, sizes=host.tp_degrees):
            views = [host.worker(w).kv.view(size) for w in range(first, first + size)]
            self.groups[(first, size)] = Group(first, size,
                                               make_instance(range(first, first + size), size,
                                                             views), views)
        self.bound_to = [None] * n  # the group binding or bound over each worker

    def instances(self):
        return self.dp + [g.instance for g in self.groups.values()]

    # ---- what a worker does now ----
    def modes(self):
        out = []
        for w in range(len(self.dp)):
            g = self.bound_to[w]
            if g is None:
                out.append("DP")
            elif g.state == "binding":
                out.append("paused")
            else:
                out.append(f"TP{g.size}")
        return out

    def layout_parts(self):
        """The layout now, one part per serving unit in worker order ('TP4', 'TP1', ...)."""
        parts, w = [], 0
        while w < len(self.dp):
            g = self.bound_to[w]
            if g is not None and g.state in ("bound", "releasing"):
                parts.append(f"TP{g.size}")
                w += g.size
            else:
                parts.append("TP1")
                w += 1
        return parts

    def serving(self):
        """The instances whose steps run now: the TP instance of each bound group and the DP
        instance of every worker not bound."""
        out = []
        for w, inst in enumerate(self.dp):
            g = self.bound_to[w]
            if g is None or g.state == "binding":
                out.append(inst)
            elif w == g.first:
                out.append(g.instance)
        return out

    # ---- placement ----
    def group(self, workers=None, tp=None):
        if workers is not None:
            workers = sorted(workers)
            key = (workers[0], len(workers))
            if workers != list(range(key[0], key[0] + key[1])) or key not in self.groups:
                raise InvalidArgumentError(
                    f"workers {workers} are not an aligned group (k consecutive workers from a "
                    f"multiple of k, k a TP degree of the model: "
                    f"{', '.join(map(str, self.host.tp_degrees))})")
            return self.groups[key]
        # the group of degree tp already bound or binding, else the least loaded
        candidates = [g for g in self.groups.values() if g.size == tp]
        if not candidates:
            raise InvalidArgumentError(f"tp={tp}: the model runs at TP "
                                       f"{', '.join(map(str, self.host.tp_degrees))} on "
                                       f"{len(self.dp)} workers")
        engaged = [g for g in candidates if g.state in ("binding", "bound")]
        free = [g for g in candidates if g.state == "free" and self._overlap(g) is None]
        pool = engaged or free or candidates
        return min(pool, key=lambda g: sum(self.dp[w].load() for w in g.workers))

    def placements(self):
        """Where a request with no TP asked for may go now: DP instances of workers in DP mode and
        the TP instances of bound groups."""
        out = []
        for inst in self.serving():
            g = self.bound_to[inst.workers[0]]
            if g is None or (inst.tp > 1 and g.state == "bound"):
                out.append(inst)
        return out

    def smallest_group_for(self, tokens):
        """The smallest aligned group whose pooled KV holds `tokens` (None: no group does)."""
        fits = [g for g in self.groups.values() if g.instance.fits(tokens)]
        return min(fits, key=lambda g: (g.size, g.first), default=None)

    # ---- switching ----
    def _overlap(self, group):
        """Another group engaged over one of `group`'s workers (None when there is none)."""
        for w in group.workers:
            g = self.bound_to[w]
            if g is not None and g is not group:
                return g
        return None

    def switch(self, workers, tp, preempt, auto_release=False, tp_work=()):
        workers = checks.int_sequence("workers", workers, 0, len(self.dp) - 1)
        if not workers or len(set(workers)) != len(workers):
            raise InvalidArgumentError(f"workers must name distinct workers, got {workers}")
        tp = checks.integer("tp", tp, lo=1)
        if preempt not in PREEMPT:
            raise InvalidArgumentError(f"preempt must be one of {', '.join(PREEMPT)}, got "
                                       f"{preempt!r}")
        if tp == 1:
            return self._release(self.group(workers), preempt)
        if tp != len(workers):
            raise InvalidArgumentError(f"tp={tp} binds {tp} workers, but workers names "
                                       f"{len(workers)}: {sorted(workers)}")
        g = self.group(workers)
        other = self._overlap(g)
        if other is not None:
            raise BusyError(f"workers {list(g.workers)} overlap the TP{other.size} group of "
                            f"workers {list(other.workers)} ({other.state}); release it first")
        if g.state != "free":
            return g.switch  # already binding or bound: the same switch
        homes = {}
        for handle in tp_work:  # TP work a controller started in DP mode on a member
            home = [w for w in g.workers if self.dp[w].loop.requests.get(handle.id) is handle]
            if not home:
                raise InvalidArgumentError(f"tp_work: request {handle.id} is not served by a DP "
                                           f"worker of {list(g.workers)}")
            homes[handle.id] = home[0]
        s = Switch(g.workers, tp, preempt, auto_release)
        g.state, g.switch = "binding", s
        g.soft.update(homes)
        for w in g.workers:
            self.bound_to[w] = g
            self.dp[w]._c.hold(True)
        if preempt == "hard":
            self._bind(g)
        else:
            self.advance()
        return s

    def _release(self, g, preempt):
        """Back to DP: at once when the group has no TP request left (a group still binding gives
        its soft-started requests to the TP engine, to run when it binds again); else, with
        "wait", once its TP requests are done (new TP requests for it bind it again), or with
        "soft" or "hard" now, its TP requests recomputed on the members in DP mode (their KV
        has the TP geometry), each on the least-loaded member that holds it; refused, with
        nothing changed, when one fits no member."""
        s = Switch(g.workers, 1, preempt)
        if g.state == "binding":
            for rid, w in list(g.soft.items()):
                self._move_back(g, rid, w)
            self._free(g)
        elif g.state != "free" and preempt != "wait":
            plan = self._plan_dp(g)  # refused here, nothing changed, when one fits no member
            try:
                for rid, fits in plan:
                    self._recompute(min(fits, key=lambda m: m.load()), g.instance, rid, g.views,
                                    s)
            finally:
                # Past its first move a release is not undone (the moved requests' TP KV is
                # freed): a request whose move failed stays with the TP engine, whose group,
                # free now, binds again for it at the next step (advance); none is lost.
                self._free(g)
        elif g.state != "free":
            g.state, g.release = "releasing", s
            self.advance()
        s.done = g.state == "free"
        return s

    def _plan_dp(self, g):
        """For each TP request of group g, the members that can hold it in DP mode."""
        members = [self.dp[w] for w in g.workers]
        plan = []
        for rid in g.instance.request_ids():
            h = g.instance.loop.requests[rid]
            tokens = len(h.prompt) + h.params.max_tokens
            fits = [m for m in members if m.fits(tokens)]
            if not fits:
                raise BusyError(f"request {rid} ({tokens} tokens) fits no worker of the TP"
                                f"{g.size} group alone: release it with preempt='wait'")
            plan.append((rid, fits))
        return plan

    def _recompute(self, dst, src, rid, caches, s=None):
        """Moves request rid from instance src to dst without its KV, which had src's geometry:
        its sequences in `caches` (src's, one per rank) are freed, and dst computes its prompt
        and generated tokens again (counted in s.stats)."""
        seqs = src.request_seqs(rid)
        handle = src.loop.requests[rid]
        dst.take(src, rid, [-1] * dst.tp)
        for cache, seq in zip(caches, seqs):
            if seq >= 0:
                cache.free(seq)
        if s is not None:
            s.stats["requests_recomputed"] += 1
            s.stats["tokens_recomputed"] += len(handle.prompt) + len(handle.output_tokens)

    def ask(self, g, preempt):
        """A TP request was queued on group g: bind it (auto-released once no TP work is left)
        now, or once the group it overlaps is released; keep it bound if it was releasing."""
        if g.state == "free":
            g.wanted = "hard" if "hard" in (preempt, g.wanted) else preempt
            if self._overlap(g) is None:
                self.switch(g.workers, g.size, g.wanted, auto_release=True)
        elif g.state == "releasing":
            g.state = "bound"

    def advance(self, bind=True):
        """Binds the groups whose members are ready (bind=True: before a host step, so that a
        bind falls between two steps of every engine), starts soft requests on idle members, and
        releases drained groups (also after a step)."""
        for g in self.groups.values():
            if (bind and g.state == "free" and g.instance.loop.unfinished()
                    and self._overlap(g) is None):
                self.switch(g.workers, g.size, g.wanted or "soft", auto_release=True)
            if g.state == "binding" and bind:
                if g.switch.preempt == "soft":
                    self._soft_start(g)
                if self._members_drained(g):
                    self._bind(g)
            if g.state == "bound" and g.switch.auto_release and g.instance.loop.unfinished() == 0:
                g.state = "releasing"
            if g.state == "releasing" and g.instance.loop.unfinished() == 0:
                if g.release is not None:
                    g.release.done = True
                self._free(g)

    def _members_drained(self, g):
        """No member has a running DP request other than the soft-started TP requests."""
        for w in g.workers:
            stats = self.dp[w]._c.stats()
            soft_here = sum(1 for home in g.soft.values() if home == w)
            if stats["running"] - soft_here > 0:
                return False
        return True

    def _soft_start(self, g):
        """Pending TP requests start in DP mode on members whose DP engine has nothing to do."""
        pending = [rid for rid in g.instance.request_ids()
                   if g.instance._c.info(rid)["state"] == "waiting"]
        idle = [w for w in g.workers if self.dp[w].loop.unfinished() == 0]
        for rid, w in zip(pending, idle):
            inst = self.dp[w]
            handle = g.instance.loop.requests[rid]
            if not inst.fits(len(handle.prompt) + handle.params.max_tokens):
                continue  # too long for one worker: it waits for the bind
            inst.take(g.instance, rid, [-1])
            inst._c.hold(False)  # nothing else is queued here and no new DP work is placed here
            g.soft[rid] = w
            g.switch.stats["requests_soft_started"] += 1

    def _move_back(self, g, rid, w, s=None):
        """A soft-started request goes to the TP engine to be recomputed there (unless it
        finished in DP mode meanwhile)."""
        if rid in self.dp[w].loop.requests:
            self._recompute(g.instance, self.dp[w], rid, [self.host.worker(w).kv], s)
        del g.soft[rid]  # after the move: a failed one is moved at the next try

    def _bind(self, g):
        s = g.switch
        before = self._counters()
        start = time.perf_counter()
        for rid, w in list(g.soft.items()):
            self._move_back(g, rid, w, s)
        for w in g.workers:
            self.dp[w]._c.hold(True)
            s.stats["requests_paused"] += self.dp[w]._c.stats()["running"]
        g.state = "bound"
        end = time.perf_counter()
        s.stats["switch_seconds"] = end - start
        s.stats["wait_seconds"] = start - s._asked
        self._count(s, before)
        s.done = True

    def _free(self, g):
        for w in g.workers:
            self.bound_to[w] = None
            self.dp[w]._c.hold(False)
        g.state, g.switch, g.release, g.wanted = "free", None, None, None

    def _counters(self):
        arenas = [self.host.worker(w).arena.stats() for w in range(len(self.dp))]
        return (sum(a["bytes_copied_total"] for a in arenas),
                sum(a["maps_total"] for a in arenas), comm.communicators_made())

    def _count(self, s, before):
        """What the switch moved, mapped and made, measured on the arenas and the pool. The KV
        and weights live in the same arenas, so copied bytes count for both."""
        copied, maps, comms = (a - b for a, b in zip(self._counters(), before))
        s.stats["weight_bytes_copied"] = s.stats["kv_bytes_moved"] = copied
        s.stats["pages_mapped"] = maps
        s.stats["communicators_created"] = comms

    def stuck(self):
        """Why unfinished requests cannot move (None when something can run)."""
        for g in self.groups.values():
            if g.state == "free" and g.instance.loop.unfinished():
                return (f"{g.instance.loop.unfinished()} TP requests wait for workers "
                        f"{list(g.workers)}, which are not bound: bind them with "
                        f"host.switch(workers={list(g.workers)}, tp={g.size})")
            if g.state == "bound" and not g.switch.auto_release:
                paused = sum(self.dp[w].loop.unfinished() for w in g.workers)
                if paused and g.instance.loop.unfinished() == 0:
                    return (f"{paused} DP requests are paused on workers {list(g.workers)}, "
                            f"bound as TP{g.size} with no TP work: release them with "
                            f"host.switch(workers={list(g.workers)}, tp=1)")
        return None
