"""KunServe's buddy groups (csrc/sim/buddy.h): which instances drop their replicated parameters
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
"""
import time
from dataclasses import dataclass

from . import _C
from .checks import integer, number
from .errors import BusyError, InvalidArgumentError, StateError, UnavailableError
from .pipelive import weight_bytes

__all__ = ["BuddyPlan", "plan", "STRATEGIES"]

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

class Buddy:
    """A buddy group formed by host.buddy: the pipeline `instance` over `workers`, worker k
    keeping layers `ranges[k]` of the one copy of the parameters. stats: weight_bytes_released,
    kv_bytes_exchanged, exchange_seconds (and, after host.restore, weight_bytes_restored,
    kv_bytes_returned, restore_seconds)."""

    def __init__(self, instance, ranges, stats):
        self.instance, self.ranges, self.stats = instance, tuple(ranges), stats
        self.workers = tuple(instance.workers)
        self.restored = False

    def __repr__(self):
        return f"Buddy(workers={list(self.workers)}, {self.instance.layout}" + \
               (", restored)" if self.restored else ")")


def _new_seq(kv, n_tokens):
    """A sequence of kv with room for n_tokens, the cache grown as needed (OutOfMemoryError
    when the budget cannot)."""
    need = -(-n_tokens // kv.block_size)
    while kv.free_blocks < need:
        kv.grow(1)
    seq = kv.new_sequence()
    kv.reserve(seq, n_tokens)
    return seq


def form(host, instances, live=False):
    """host.buddy's work (the host's lock held): see Host.buddy."""
    if live:
        raise UnavailableError("a live exchange (victims' KV moved in chunks, attention run "
                               "remotely meanwhile) is not implemented yet; live=False exchanges "
                               "the KV between two steps")
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
        # 2. each worker receives, for every other member's request with KV, its layers' KV
        exchanged = 0
        for k, (w, (lo, hi)) in enumerate(zip(ws, ranges)):
            for j, seqs in own.items():
                for rid, seq in seqs.items():
                    if j == k or seq < 0:
                        continue
                    new = _new_seq(w.kv, ws[j].kv.n_tokens(seq))
                    made.append((k, rid, new))
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
    # 4. the caches keep their layers only (unmapping cannot fail), and the group serves
    for w, (lo, hi) in zip(ws, ranges):
        w.kv.set_layers(lo, hi)
        w.set_layers(lo, hi, w.c_model)
    for inst in insts:
        host.retire(inst)
    host.install(pipe)
    stats = {"weight_bytes_released":
             held_before - sum(weight_bytes(w, w.weights.held_layers) for w in ws),
             "kv_bytes_exchanged": exchanged, "exchange_seconds": time.perf_counter() - start}
    return Buddy(pipe, ranges, stats)


def restore(host, buddy, weights_from="peers"):
    """host.restore's work (the host's lock held): see Host.restore."""
    if not isinstance(buddy, Buddy):
        raise InvalidArgumentError(f"buddy must be what host.buddy returned, got {buddy!r}")
    if buddy.restored or buddy.instance not in host.instances:
        raise StateError(f"{buddy!r} is no longer serving")
    if weights_from not in ("peers", "host"):
        raise InvalidArgumentError(f"weights_from must be 'peers' or 'host', got {weights_from!r}")
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
                    restored += w.weights.restore_layers(set(range(lo, hi)),
                                                         ws[j].weights if peers else None)
                    back[-1][1].update(range(lo, hi))
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
            if seqs[h] >= 0:
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
    buddy.restored = True
    buddy.stats.update(weight_bytes_restored=restored, kv_bytes_returned=returned,
                       restore_seconds=time.perf_counter() - start)
    return buddy
