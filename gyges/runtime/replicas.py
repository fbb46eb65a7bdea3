"""A replicated host's pool (Host(..., weights="replicated"), Flying Serving): every worker keeps
the whole model in its arena and one KV cache of all the KV heads, its DP engine's; every aligned
group of k workers has a TPk engine, made at start-up like the communicators (Flying Serving's
eager initialisation): its rank r runs on worker r's own C model, whose forward pass reads rank
r's heads and FFN shards out of the replica, and on a view of worker r's KV cache (KVCache.view,
the KV cache adaptor: blocks of k*B tokens of H/k heads, the same bytes, one block pool), joined
by the group's communicator from the host's pool. Which engine of a worker steps is all that a
switch changes; the switches themselves are reconfigurations (gyges.reconfig.switch) that move
a group through its states here:

    free       its members' DP engines step and admit work
    binding    a bind is under way: the members admit nothing new and run their running DP
               requests to their end (or, hard, are paused at once)
    bound      the group's TP engine steps; the members' DP requests stay, paused, with their KV
    releasing  a release waits for the TP engine's running requests; it admits nothing new

Placement never leaves a request where nothing will serve it: a request goes to an engine that
steps now, else to one that will once a switch under way ends (a binding group, a releasing
group's members), else it asks a free group to bind for it (auto: released once its TP work is
done). TP work asked for by degree (submit(tp=k)) waits for a group of k, which binds as soon as
what it overlaps is released."""
from ..core.errors import InvalidArgumentError
from .comm import aligned_groups

STATES = ("free", "binding", "bound", "releasing")


class Group:
    """An aligned group of k workers: its TPk instance over views of the members' KV caches,
    and where it stands."""

    def __init__(self, first, size, instance, views):
        self.first, self.size, self.instance, self.views = first, size, instance, views
        self.workers = tuple(range(first, first + size))
        self.state = "free"
        self.switch = None      # the bind under way or done (a gyges.reconfig.switch.Switch)
        self.release = None     # the release under way
        self.auto = False       # bound for TP work: released once none is left
        self.soft = {}          # request id -> the member whose DP engine runs it meanwhile
        self.wanted = None      # free with TP work queued: how to bind once it can

    def __repr__(self):
        return f"Group(workers={list(self.workers)}, TP{self.size}, {self.state})"


class ReplicatedPool:
    """workers: the host's workers it holds (all of them, or an aligned range of a host that
    mixes sharded and replicated workers)."""
    kind = "replicated"

    def __init__(self, host, make_instance, workers=None):
        self.workers = tuple(range(host.n_workers) if workers is None else workers)
        first, n = self.workers[0], len(self.workers)
        # {worker: its DP engine}; {(first, size): Group} of every aligned group inside
        self.dp = {w: make_instance([w], 1, None) for w in self.workers}
        self.groups = {}
        for g, size in aligned_groups(host.n_workers, sizes=host.tp_degrees):
            if first <= g and g + size <= first + n:
                views = [host.worker(w).kv.view(size) for w in range(g, g + size)]
                self.groups[(g, size)] = Group(g, size,
                                               make_instance(range(g, g + size), size, views),
                                               views)
        self.bound_to = {w: None for w in self.workers}  # the group engaged over each worker
        self.tp_degrees = host.tp_degrees

    # ---- what exists and what steps ----
    def instances(self):
        return list(self.dp.values()) + [g.instance for g in self.groups.values()]

    def serving(self):
        """The TP instance of each bound (or releasing) group and the DP instance of every
        worker not in one."""
        out = []
        for w, inst in self.dp.items():
            g = self.bound_to[w]
            if g is None or g.state == "binding":
                out.append(inst)
            elif w == g.first:
                out.append(g.instance)
        return out

    def modes(self):
        """Per worker: 'DP', 'TPk' (bound into a TPk group) or 'paused' (waiting to bind)."""
        out = []
        for w in self.workers:
            g = self.bound_to[w]
            out.append("DP" if g is None else "paused" if g.state == "binding" else f"TP{g.size}")
        return out

    def layout_parts(self):
        """[(first worker, part)] in worker order."""
        parts, i = [], 0
        while i < len(self.workers):
            w = self.workers[i]
            g = self.bound_to[w]
            if g is not None and g.state in ("bound", "releasing"):
                parts.append((w, f"TP{g.size}"))
                i += g.size
            else:
                parts.append((w, "TP1"))
                i += 1
        return parts

    # ---- groups ----
    def group(self, workers):
        """The aligned group of exactly these workers."""
        workers = sorted(workers)
        key = (workers[0], len(workers)) if workers else None
        if key not in self.groups or workers != list(range(key[0], key[0] + key[1])):
            raise InvalidArgumentError(
                f"workers {workers} are not an aligned group (k consecutive workers from a "
                f"multiple of k, k a TP degree of the model: "
                f"{', '.join(map(str, self.tp_degrees))})")
        return self.groups[key]

    def overlap(self, group):
        """Another group engaged over one of `group`'s workers (None when there is none)."""
        for w in group.workers:
            g = self.bound_to[w]
            if g is not None and g is not group:
                return g
        return None

    def engaged(self):
        return [g for g in self.groups.values() if g.state != "free"]

    # ---- the states a switch moves a group through (gyges.reconfig.switch) ----
    def engage(self, g, switch, auto):
        """free -> binding: the members admit nothing new."""
        g.state, g.switch, g.auto = "binding", switch, auto
        for w in g.workers:
            self.bound_to[w] = g
            self.dp[w].hold(True)

    def bind(self, g):
        """binding -> bound: the TP engine steps from now on, the members' DP requests pause."""
        for w in g.workers:
            self.dp[w].hold(True)
        g.state = "bound"
        g.instance.hold(False)

    def start_release(self, g, release):
        """bound -> releasing: the TP engine admits nothing new; its running requests end."""
        g.state, g.release = "releasing", release
        g.instance.hold(True)

    def unbind(self, g):
        """releasing -> bound again (a release taken back)."""
        g.state, g.release = "bound", None
        g.instance.hold(False)

    def free(self, g):
        """-> free: the members' DP engines admit and step again."""
        for w in g.workers:
            self.bound_to[w] = None
            self.dp[w].hold(False)
        g.instance.hold(False)
        g.state, g.switch, g.release, g.wanted, g.auto = "free", None, None, None, False
        g.soft.clear()

    def members_drained(self, g):
        """No member runs a DP request other than the TP requests soft-started there."""
        for w in g.workers:
            soft_here = sum(1 for home in g.soft.values() if home == w)
            if self.dp[w].stats()["running"] - soft_here > 0:
                return False
        return True

    def smallest_group_for(self, tokens):
        fits = [g for g in self.groups.values() if g.instance.fits(tokens)]
        return min(fits, key=lambda g: (g.size, g.first), default=None)

    # ---- placement ----
    def place(self, host, tokens, tp=None, instance=None, priority=0):
        """(instance, [(verb, kwargs) of reconfigurations to start]) for a request of `tokens`
        tokens: tp=k asks for TP work on an aligned group of k; instance: an index into
        host.instances (its own engine, whatever it does now)."""
        preempt = "hard" if priority > 0 else "soft"
        if instance is not None:
            return instance, ()
        if tp is not None and tp > 1:
            return self._place_tp(tokens, tp, preempt)
        # engines that step now, and, on a host with nothing free, engines that will
        now = [inst for inst in self.serving()
               if self.bound_to[inst.workers[0]] is None
               or (inst.tp > 1 and self.bound_to[inst.workers[0]].state == "bound")]
        if tp == 1:
            now = [inst for inst in now if inst.tp == 1]
        fits = [inst for inst in now if inst.fits(tokens)]
        if fits:
            return min(fits, key=lambda inst: inst.load()), ()
        # engines that will step once a switch under way (or a group with no TP work left, which
        # the next tick releases) lets them: a binding group's TP engine, engaged members' DP
        soon = []
        for g in self.engaged():
            if g.state == "binding" and tp is None:
                soon.append(g.instance)
            elif g.state == "releasing" or tp == 1:
                soon.extend(self.dp[w] for w in g.workers)
        fits = [inst for inst in soon if inst.fits(tokens)]
        if fits:
            return min(fits, key=lambda inst: inst.load()), ()
        if tp is None:
            g = self.smallest_group_for(tokens)
            if g is not None:
                return self._place_tp(tokens, g.size, preempt, smallest=g)
        raise InvalidArgumentError(
            f"the request needs {tokens} tokens of KV but no instance holds that many (layout "
            f"{'+'.join(part for _, part in self.layout_parts())}); merge instances first")

    def _place_tp(self, tokens, tp, preempt, smallest=None):
        candidates = [smallest] if smallest is not None else \
            [g for g in self.groups.values() if g.size == tp]
        if not candidates:
            raise InvalidArgumentError(f"tp={tp}: the model runs at TP "
                                       f"{', '.join(map(str, self.tp_degrees))} on the "
                                       f"{len(self.dp)} replicated workers")
        load = lambda g: sum(self.dp[w].load() for w in g.workers)
        engaged = [g for g in candidates if g.state in ("binding", "bound")]
        if engaged:
            return min(engaged, key=load).instance, ()
        free = [g for g in candidates if g.state == "free" and self.overlap(g) is None]
        if free:
            g = min(free, key=load)
            g.wanted = "hard" if "hard" in (preempt, g.wanted) else preempt
            return g.instance, [("switch", dict(workers=g.workers, tp=g.size,
                                                preempt=g.wanted, auto=True))]
        # every group of this degree overlaps one engaged now: it queues on the least loaded,
        # which binds once what it overlaps is released (tick)
        g = min(candidates, key=load)
        g.wanted = "hard" if "hard" in (preempt, g.wanted) else preempt
        return g.instance, ()

    # ---- what a host starts before a step ----
    def tick(self, host):
        """[(verb, kwargs)]: a bind for every free group with TP work queued and nothing in its
        way; a release for every bound group with no TP work left that was bound for TP work
        (auto), or whose workers other work waits for (DP requests on its members, TP requests
        of a group it overlaps): a group bound by hand holds its workers while it has TP work,
        and never stops anything else from being served."""
        out = []
        claimed = set()
        blocked = [g for g in self.groups.values()
                   if g.state == "free" and g.instance.unfinished()]  # TP work waiting
        for g in self.groups.values():
            if g.state == "bound" and g.release is None and not g.instance.unfinished():
                waiting = any(self.dp[w].unfinished() for w in g.workers) or any(
                    set(b.workers) & set(g.workers) for b in blocked)
                if g.auto or waiting:
                    out.append(("switch", dict(workers=g.workers, tp=1, preempt="wait",
                                               auto=True)))
                    claimed |= set(g.workers)
        for g in self.groups.values():
            if (g.state == "free" and g.instance.unfinished() and self.overlap(g) is None
                    and not claimed & set(g.workers)):
                out.append(("switch", dict(workers=g.workers, tp=g.size,
                                           preempt=g.wanted or "soft", auto=True)))
                claimed |= set(g.workers)
        return out
