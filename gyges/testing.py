"""Test hooks of the C core, for the reliability tests and the soak benchmark.

Fault injection (csrc/core/fault.h, armed through the test extension gyges._C_test): every host
allocation of the core, every physical page it creates or maps, every KV or weight copy between
caches or workers and every collective passes a site; `inject(site, n)` makes the n-th event of
that site fail, once, as the real resource would. Sweeping n from 1 to `count(site, operation)`
fails each resource an operation uses in turn.

    with gyges.testing.inject("page_create", 3):
        host.step()        # the third page created during the step fails
"""
import os
import re
import warnings
from contextlib import contextmanager

import numpy as np

from . import _C_test
from .core.errors import InvalidArgumentError

SITES = {"alloc": _C_test.FAULT_ALLOC, "page_create": _C_test.FAULT_PAGE_CREATE,
         "page_map": _C_test.FAULT_PAGE_MAP, "copy": _C_test.FAULT_COPY,
         "comm": _C_test.FAULT_COMM}


def _site(site):
    if site not in SITES:
        raise InvalidArgumentError(f"unknown fault site {site!r}; expected one of {', '.join(SITES)}")
    return SITES[site]


@contextmanager
def inject(site, n):
    """Within the block, the n-th event (n >= 1) of `site` fails; yields a function telling how
    many faults fired so far in the block."""
    fired = _C_test.fault_fired()
    _C_test.fault_arm(_site(site), n)
    try:
        yield lambda: _C_test.fault_fired() - fired
    finally:
        _C_test.fault_disarm()


def count(site, operation):
    """Runs operation() counting the events of `site` (nothing fails); returns (count, result)."""
    _C_test.fault_arm(_site(site), 0)
    try:
        result = operation()
        return _C_test.fault_count(_site(site)), result
    finally:
        _C_test.fault_disarm()


# ---- the soak: random live transformations with requests arriving all the time ----

def _legal_targets(host):
    """(workers, tp) pairs a transformation may take from the host's layout: merging the
    instances of an aligned group of one degree, or splitting one instance."""
    out = []
    n = host.n_workers
    size = 2
    while size <= n:
        for first in range(0, n, size):
            group = tuple(range(first, first + size))
            inside = [i for i in host.instances if set(i.workers) & set(group)]
            if any(not set(i.workers) <= set(group) or i.stages for i in inside) or \
                    host.weights_of(group) != {"sharded"}:
                continue  # reaches outside, holds a pipeline or replicas (Gyges moves shards)
            tps = {i.tp for i in inside}
            if len(tps) == 1 and tps.pop() < size:
                out.append((group, size))
            if len(inside) == 1 and inside[0].tp == size:
                t = size // 2
                while t >= 1:
                    out.append((group, t))
                    t //= 2
        size *= 2
    return out


def soak(model, seed=0, transformations=100, workers=4, memory="48MiB", faults=False,
         max_steps=100000, layout=None):
    """Serves random requests on a Host of `layout` (default: one TP1 instance a worker) while it
    makes `transformations` random live transformations (merges and splits of random aligned
    groups outside pipelines, at once or layer-staggered, with and without overlap), then checks
    every request against the same request served by a plain Engine. faults=True also fails a random resource (fault site and event) inside about half of
    the transformations. Returns the counts: done, refused, rolled_back, recovered (a rollback
    that failed too), requests, lost, mismatches and, per worker, the bytes it holds beyond a
    fresh host of the same layout (page_delta)."""
    import numpy as np

    from .runtime.engine import Engine, SamplingParams
    from .core.errors import Error
    from .runtime.host import Host

    rng = np.random.default_rng(seed)
    host = Host(model, workers=workers, memory_per_worker=memory, layout=layout)
    vocab = model.config.vocab_size
    handles, params_of = [], []
    done = refused = rolled_back = recovered = failed_steps = steps = 0
    t = None
    site_names = list(SITES)
    while (done < transformations or (t is not None and not t.done)) and steps < max_steps:
        for _ in range(int(rng.integers(0, 3))):
            p = SamplingParams(max_tokens=int(rng.integers(2, 10)),
                               temperature=float(rng.choice([0.0, 0.8])),
                               top_p=float(rng.choice([1.0, 0.9])), seed=int(rng.integers(1 << 30)),
                               ignore_eos=True)
            prompt = rng.integers(0, vocab, size=int(rng.integers(2, 40))).tolist()
            handles.append(host.submit(prompt, p))
            params_of.append(p)
        if (t is None or t.done) and done < transformations and rng.random() < 0.5:
            group, tp = _legal_targets(host)[int(rng.integers(len(_legal_targets(host))))]
            lps = [None, None, 1, 2, model.config.num_hidden_layers][int(rng.integers(5))]
            overlap = bool(rng.integers(2)) if lps is not None else False
            armed = faults and rng.random() < 0.5
            site, nth = site_names[int(rng.integers(len(site_names)))], int(rng.integers(1, 60))
            with inject(site, nth if armed else 1 << 60):
                try:
                    t = host.transform(workers=group, tp=tp, layers_per_step=lps, overlap=overlap)
                except Error as e:
                    # refused (nothing changed: memory, a fault before a change) or rolled back
                    rolled_back += hasattr(e, "reconfiguration")
                    refused += not hasattr(e, "reconfiguration")
                    t = None
                while armed and t is not None and not t.done:  # it may fire as layers move
                    try:
                        host.step()
                    except Error:
                        failed_steps += 1  # a failed step changes nothing: the next one retries
                    steps += 1
            if t is not None:
                done += 1
                recovered += t.recovered
                rolled_back += t.rolled_back
        try:
            host.step()
        except Error:
            failed_steps += 1
        steps += 1
    host.run()
    # The reference: every request served by a plain engine (tokens do not depend on the batch).
    ref = Engine(model, memory="256MiB")
    want = [ref.submit(h.prompt, p) for h, p in zip(handles, params_of)]
    ref.run()
    lost = sum(1 for h in handles if not h.finished or h.finish_reason not in ("length", "stop"))
    mismatches = sum(1 for h, w in zip(handles, want) if h.output_tokens != w.output_tokens)
    fresh = Host(model, workers=workers, memory_per_worker=memory, layout=host.layout())
    page_delta = [host.worker(w).arena.stats()["bytes_in_use"] -
                  fresh.worker(w).arena.stats()["bytes_in_use"] for w in range(workers)]
    result = {"seed": seed, "transformations": done, "refused": refused,
              "rolled_back": rolled_back, "recovered": recovered,
              "requests": len(handles), "lost": lost, "mismatches": mismatches,
              "page_delta": page_delta, "steps": steps, "failed_steps": failed_steps,
              "layout": host.layout()}
    host.close()
    fresh.close()
    ref.close()
    return result


def soak_buddy(model, seed=0, operations=100, workers=4, memory="32MiB", faults=False,
               max_steps=100000):
    """KunServe's operations at random: while random requests arrive at every step, `operations`
    random buddy formations (g = 2 or 4 neighbouring TP1 instances, blocking or live, a random
    number of layers a step) and restores (blocking or live, from the peers or the host copy),
    then every request is checked against a plain Engine. faults=True also fails a random fault
    site and event inside about half of them (a refused call, or a failed step, must change
    nothing). Returns the counts: formed, restored, refused (what the state or a fault refused,
    nothing changed), busy (a restore while its exchange or restore ran), requests, lost,
    mismatches, and per worker the bytes held beyond a fresh host (page_delta; caches
    trimmed)."""
    import numpy as np

    from .runtime.engine import Engine, SamplingParams
    from .core.errors import BusyError, Error
    from .runtime.host import Host

    rng = np.random.default_rng(seed)
    host = Host(model, workers=workers, memory_per_worker=memory, layout=f"{workers}xTP1",
                max_batch_tokens=96)
    vocab = model.config.vocab_size
    handles, params_of, groups, formed = [], [], [], []
    counts = dict(refused=0, busy=0, failed_steps=0)
    ops = steps = 0
    site_names = list(SITES)

    def step():
        nonlocal steps
        try:
            host.step()
        except Error:
            counts["failed_steps"] += 1   # a failed step changes nothing: the next one retries
        steps += 1

    while ops < operations and steps < max_steps:
        for _ in range(int(rng.integers(0, 3))):
            p = SamplingParams(max_tokens=int(rng.integers(2, 12)),
                               temperature=float(rng.choice([0.0, 0.8])),
                               seed=int(rng.integers(1 << 30)), ignore_eos=True)
            handles.append(host.submit(rng.integers(3, vocab, size=int(rng.integers(2, 60)))
                                       .tolist(), p))
            params_of.append(p)
        if rng.random() < 0.3:
            ops += 1
            armed = faults and rng.random() < 0.5
            site, nth = site_names[int(rng.integers(len(site_names)))], int(rng.integers(1, 40))
            with inject(site, nth if armed else 1 << 60):
                try:
                    if groups and rng.random() < 0.5:
                        b = groups[-1]
                        host.restore(b, weights_from=str(rng.choice(["peers", "host"])),
                                     live=bool(rng.random() < 0.5))
                    elif not groups:
                        g = int(rng.choice([2, 4])) if workers >= 4 else 2
                        first = int(rng.integers(workers // g)) * g
                        insts = [i for i in host.instances
                                 if min(i.workers) in range(first, first + g)]
                        groups.append(host.buddy(insts, live=bool(rng.random() < 0.5),
                                                 layers_per_step=int(rng.integers(1, 3))))
                except BusyError:
                    counts["busy"] += 1
                except Error:
                    counts["refused"] += 1
                for _ in range(int(rng.integers(0, 3)) if armed else 0):
                    step()   # a live exchange's or restore's layers may meet the fault
        step()
        for b in list(groups):
            if b.committed and b not in formed:
                formed.append(b)
            if b.restored or b.rolled_back or b.recovered:  # restored, or never formed
                groups.remove(b)
    for b in groups:   # what is under way ends, and every group restores
        while any(t is not None and not t.done for t in (b.exchange, b.restoring)):
            step()
        if b.committed and b not in formed:
            formed.append(b)
        if b.committed and not b.restored:
            host.restore(b)
    host.run()
    with Engine(model, memory="256MiB") as ref:
        want = [ref.submit(h.prompt, p) for h, p in zip(handles, params_of)]
        ref.run()
        mismatches = sum(h.output_tokens != w.output_tokens for h, w in zip(handles, want))
    lost = sum(1 for h in handles if not h.finished or h.finish_reason not in ("length", "stop"))
    for w in range(workers):
        host.worker(w).kv.trim()
    with Host(model, workers=workers, memory_per_worker=memory, layout=host.layout()) as fresh:
        page_delta = [host.worker(w).arena.stats()["bytes_in_use"] -
                      fresh.worker(w).arena.stats()["bytes_in_use"] for w in range(workers)]
    result = {"seed": seed, "operations": ops, "formed": len(formed),
              "restored": sum(b.restored for b in formed), **counts,
              "requests": len(handles), "lost": lost,
              "mismatches": mismatches, "page_delta": page_delta, "steps": steps,
              "layout": host.layout()}
    host.close()
    return result


# ---- fault sweeps over every kind of reconfiguration ----

def _reconfiguration_cases():
    """kind -> (host kwargs, steps to serve first, prepare(host) or None, start(host) ->
    handle). Every kind of the protocol, blocking and live, on hosts serving eight requests;
    what `prepare` does (a buddy group for a restore) is not swept."""
    def buddy(live):
        return lambda h: h.buddy([i for i in h.instances][:2], live=live)

    groups = {}   # host -> the buddy group `formed` made on it

    def formed(h):
        groups[id(h)] = h.buddy([i for i in h.instances][:2])
        for _ in range(2):
            h.step()

    sharded2 = dict(workers=2, layout="2xTP1")
    replicated = dict(workers=4, layout="4xTP1", weights="replicated")
    return {
        "resplit, live": (dict(workers=2, layout="PP[3,1]"), 2, None,
                          lambda h: h.reconfigure(h.instances[0], [1, 3], mode="live", tau=4)),
        "resplit, stop_copy": (dict(workers=2, layout="PP[3,1]"), 2, None,
                               lambda h: h.reconfigure(h.instances[0], [2, 2], mode="stop_copy")),
        "bind, soft": (replicated, 2, None, lambda h: h.switch((0, 1, 2, 3), 4, preempt="soft")),
        "release, soft": (dict(workers=4, layout="TP4", weights="replicated"), 2, None,
                          lambda h: h.switch((0, 1, 2, 3), 1, preempt="soft")),
        "buddy": (sharded2, 2, None, buddy(False)),
        "buddy, live": (sharded2, 2, None, buddy(True)),
        "restore": (sharded2, 1, formed, lambda h: h.restore(groups[id(h)])),
        "restore, live": (sharded2, 1, formed, lambda h: h.restore(groups[id(h)], live=True)),
    }


RECONFIGURATIONS = tuple(_reconfiguration_cases())


def sweep_reconfiguration(model, kind, site, most=None, memory="32MiB"):
    """sweep_transformation for every other kind (RECONFIGURATIONS): the n-th `site` event of
    starting `kind` and driving it to its end fails, for every n (or `most` of them), each on a
    fresh host serving eight requests. Returns events, runs, refused, rolled_back, done,
    recovered, and what must stay 0: changed (a refusal, or a rollback between two steps, that
    left the host other than before), wrong_layout (a rollback not back in the layout it
    began in), lost, mismatches and leaked_pages."""
    from .core.errors import Error
    from .reconfig import RecoveryWarning, ReconfigurationWarning
    from .runtime.host import Host

    host_kwargs, warm, prepare, start = _reconfiguration_cases()[kind]
    load = _Workload(model, memory)

    def setup():
        host = Host(model, memory_per_worker=memory, **host_kwargs)
        reqs = [host.submit(p, q) for p, q in zip(load.prompts, load.params)]
        for _ in range(warm):
            host.step()
        if prepare is not None:
            prepare(host)
        return host, reqs

    def drive(host):
        r = start(host)
        while not r.done:
            try:
                host.step()
            except Error:
                pass   # a failed step changes nothing: the next one tries again
        return r

    host, _ = setup()
    events, _ = count(site, lambda: drive(host))
    host.close()
    out = dict(kind=kind, site=site, events=events, runs=0, refused=0, rolled_back=0, done=0,
               recovered=0, changed=0, wrong_layout=0, lost=0, mismatches=0, leaked_pages=0)
    for n in spread(events, most):
        host, reqs = setup()
        layout, before = host.layout(), snapshot(host, physical=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RecoveryWarning)
            warnings.simplefilter("ignore", ReconfigurationWarning)
            with inject(site, n):
                try:
                    r = drive(host)
                except Error as e:
                    r = getattr(e, "reconfiguration", None)
                    out["refused"] += r is None
                    # (a kind that starts with a blocking buddy may be refused at that buddy)
                    out["changed"] += r is None and snapshot(host, physical=False) != before
        out["runs"] += 1
        if r is not None:
            out[{"committed": "done"}.get(r.state, r.state)] += 1
            if r.rolled_back and r.stats["steps"] == 0:   # (nothing served since it began)
                out["changed"] += snapshot(host, physical=False) != before
            out["wrong_layout"] += r.rolled_back and host.layout() != layout
        host.run()
        out["lost"] += sum(q.finish_reason not in ("length", "stop") for q in reqs)
        out["mismatches"] += sum(q.output_tokens != w for q, w in zip(reqs, load.reference))
        for w in range(host.n_workers):
            host.worker(w).kv.trim()
        with Host(model, memory_per_worker=memory, **{**host_kwargs, "layout": host.layout()}) \
                as fresh:
            out["leaked_pages"] += sum(host.worker(w).arena.stats()["bytes_in_use"]
                                       for w in range(host.n_workers)) != sum(
                fresh.worker(w).arena.stats()["bytes_in_use"] for w in range(host.n_workers))
        host.close()
    return out


# ---- the mixed soak: every kind of reconfiguration on one host that serves all the while ----

# twelve workers: eight sharded (a pipeline, a TP group and four replicas for buddy groups) and
# four that keep the whole model (DP engines that switch() binds into TP groups)
MIXED_LAYOUT = "PP[3,1]+TP2+4xTP1+4xTP1"
MIXED_WEIGHTS = ["sharded"] * 8 + ["replicated"] * 4


def _mixed_request(rng, vocab):
    from .runtime.engine import SamplingParams
    params = SamplingParams(max_tokens=int(rng.integers(2, 12)),
                            temperature=float(rng.choice([0.0, 0.8])),
                            top_p=float(rng.choice([1.0, 0.9])), seed=int(rng.integers(1 << 30)),
                            ignore_eos=True)
    prompt = rng.integers(3, vocab, size=int(rng.integers(2, 48))).tolist()
    return prompt, params


def soak_mixed(model, seed=0, operations=100, faults=False, memory="32MiB", max_steps=50000):
    """Every kind of reconfiguration at random, with arrivals and aborts at every step, on one
    host of twelve workers (MIXED_LAYOUT, MIXED_WEIGHTS): its eight sharded workers (a PP[3,1]
    pipeline, a TP2 group and four TP1 instances) take merges and splits (at once and
    layer-staggered, with and without overlap), re-splits of its pipelines (buddy groups' too),
    buddy groups (blocking and live) and their restores (blocking and live); its four replicated
    workers take binds and releases of every aligned group ("wait", "soft", "hard") and TP work
    by degree; any live change may be cancelled. All of them run side by side on the one host,
    in one step loop. faults=True also fails a random fault site and event inside about half of
    the operations. Then every live change is driven to its end, every buddy group restored,
    and every request checked against the same request served by a plain Engine (greedy and
    seeded sampling alike).

    Returns the counts: operations and per kind (transform, reconfigure, buddy, restore, switch,
    cancel) how many were started, refused, committed, rolled_back, recovered; requests,
    aborted, steps, failed_steps; and what must be 0: lost (unfinished, or ended by anything
    but its length, a stop or our abort), mismatches, and the bytes each worker holds beyond a
    fresh host of the final layout (page_delta, one per worker)."""
    from .core.errors import Error
    from .reconfig import ReconfigurationWarning, RecoveryWarning
    from .runtime.engine import Engine
    from .runtime.host import Host

    rng = np.random.default_rng(seed)
    vocab = model.config.vocab_size
    L = model.config.num_hidden_layers
    n_sharded = MIXED_WEIGHTS.count("sharded")
    host = Host(model, workers=len(MIXED_WEIGHTS), memory_per_worker=memory,
                layout=MIXED_LAYOUT, weights=MIXED_WEIGHTS, max_batch_tokens=96)
    kinds = ("transform", "reconfigure", "buddy", "restore", "switch", "cancel")
    counts = {k: dict(started=0, refused=0, committed=0, rolled_back=0, recovered=0)
              for k in kinds}
    handles, aborted, buddies, tracked = [], set(), [], []
    steps = failed_steps = ops = 0
    site_names = list(SITES)

    def step():
        nonlocal steps, failed_steps
        try:
            host.step()
        except Error:
            failed_steps += 1  # a failed step changes nothing: the next one retries
        steps += 1

    def pick(seq):
        return seq[int(rng.integers(len(seq)))] if seq else None

    def operation(kind):
        """Starts one operation of `kind`; returns the handle, or None when nothing fits."""
        if kind == "transform":
            target = pick(_legal_targets(host))
            if target is None:
                return None
            lps = [None, None, 1, 2, L][int(rng.integers(5))]
            return host.transform(workers=target[0], tp=target[1], layers_per_step=lps,
                                  overlap=bool(rng.integers(2)) if lps is not None else False)
        if kind == "reconfigure":
            inst = pick([i for i in host.instances if i.stages])
            if inst is None:
                return None
            n = len(inst.stages)
            layers = pick([c for c in ([1, 3], [2, 2], [3, 1], [1, 1, 2], [2, 1, 1], [1, 2, 1],
                                       [1, 1, 1, 1]) if len(c) == n and
                           list(c) != [b - a for a, b in inst.stages]])
            if layers is None:
                return None
            return host.reconfigure(inst, list(layers), mode=pick(["live", "no_patch", "stop_copy"]),
                                    tau=int(rng.integers(0, 40)),
                                    layers_per_step=int(rng.integers(1, 3)))
        if kind == "buddy":
            singles = {min(i.workers): i for i in host.instances
                       if i.tp == 1 and not i.stages and min(i.workers) < n_sharded}
            groups = [[singles[w] for w in range(first, first + g)]
                      for g in (2, 4) for first in range(0, n_sharded, g)
                      if all(w in singles for w in range(first, first + g))]
            group = pick(groups)
            if group is None:
                return None
            b = host.buddy(group, live=bool(rng.integers(2)), layers_per_step=int(rng.integers(1, 3)))
            buddies.append(b)
            return b
        if kind == "restore":
            b = pick([b for b in buddies if b.committed and not b.restored])
            if b is None:
                return None
            return host.restore(b, weights_from=pick(["peers", "host"]), live=bool(rng.integers(2)))
        if kind == "switch":
            first, size = pick(list(host.replicas.groups))
            tp = size if rng.random() < 0.6 else 1
            return host.switch(range(first, first + size), tp,
                               preempt=pick(["wait", "soft", "hard"]))
        r = pick(list(host.reconfigurations))
        if r is None:
            return None
        host.cancel(r)
        return r

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReconfigurationWarning)
        warnings.simplefilter("ignore", RecoveryWarning)
        while ops < operations and steps < max_steps:
            for _ in range(int(rng.integers(0, 3))):
                prompt, params = _mixed_request(rng, vocab)
                tp = pick([None, None, None, None, 1, 2, 4])
                handles.append((host.submit(prompt, params, tp=tp), prompt, params))
            if handles and rng.random() < 0.05:
                h, _, _ = pick(handles)
                if not h.finished and host.abort(h):
                    aborted.add(h.id)
            if rng.random() < 0.3:
                kind = pick(kinds)
                # (a cancel's rollback meeting a fault would be the double failure recovery is
                # for: faults go to the changes themselves)
                armed = faults and kind != "cancel" and rng.random() < 0.5
                site, nth = pick(site_names), int(rng.integers(1, 60))
                with inject(site, nth if armed else 1 << 60):
                    try:
                        got = operation(kind)
                        if got is not None:
                            ops += 1
                            counts[kind]["started"] += 1
                            if kind != "cancel":
                                tracked.append((kind, got))
                    except Error as e:
                        ops += 1
                        counts[kind]["started"] += 1
                        r = getattr(e, "reconfiguration", None)
                        counts[kind]["refused" if r is None else r.state] += 1
                    for _ in range(int(rng.integers(0, 3)) if armed else 0):
                        step()   # a live change's advances may meet the fault
            step()
            for kind, r in list(tracked):
                if r.done:
                    counts[kind][r.state] += 1
                    tracked.remove((kind, r))
        # the end: what is under way ends, every buddy group is restored, everything served
        while host.reconfigurations and steps < max_steps + 10000:
            step()
        for b in buddies:
            if b.committed and not b.restored:
                try:
                    host.restore(b)
                except Error:
                    host.restore(b)   # (a fault cannot fire here: none is armed)
        for kind, r in tracked:
            if r.done:
                counts[kind][r.state] += 1
        host.run()
    with Engine(model, memory="256MiB") as ref:
        want = [ref.submit(prompt, params) for _, prompt, params in handles]
        ref.run()
    lost = sum(1 for h, _, _ in handles if not h.finished or
               (h.finish_reason not in ("length", "stop") and h.id not in aborted))
    wrong = [(h.id, len(prompt), params, len(h.output_tokens))
             for (h, prompt, params), w in zip(handles, want)
             if h.id not in aborted and h.output_tokens != w.output_tokens]
    for w in range(host.n_workers):
        host.worker(w).kv.trim()
    with Host(model, workers=host.n_workers, memory_per_worker=memory, layout=host.layout(),
              weights=MIXED_WEIGHTS) as fresh:
        page_delta = [host.worker(w).arena.stats()["bytes_in_use"] -
                      fresh.worker(w).arena.stats()["bytes_in_use"] for w in range(host.n_workers)]
        where = []
        for w in range(host.n_workers):   # by what the bytes hold, where they differ
            mine = host.worker(w).arena.stats()["bytes_by_tag"]
            theirs = fresh.worker(w).arena.stats()["bytes_by_tag"]
            where += [(w, tag, mine[tag] - theirs[tag]) for tag in mine
                      if mine[tag] != theirs[tag]]
    result = {"seed": seed, "operations": ops, **counts,
              "requests": len(handles), "aborted": len(aborted), "steps": steps,
              "failed_steps": failed_steps, "lost": lost, "mismatches": len(wrong),
              "page_delta": page_delta, "page_delta_by_tag": where, "wrong": wrong,
              "layout": host.layout()}
    host.close()
    return result


# ---- what a caller can see, to compare before and after a refused call ----

def snapshot(target, physical=True):
    """An Engine's or a Host's visible state: the layout, every worker's page table, KV cache
    shape and weights held, and every request's state and progress (in C and in its handle)
    with its KV block tables. Equal
    snapshots mean a call changed nothing a caller could see. physical=False compares which
    slots are mapped (and their tags) instead of which physical pages: a rollback maps again
    what it unmapped, from the pool, so the bytes and the slots are the same, not the pages."""
    from .runtime.engine import Engine

    if isinstance(target, Engine):
        parts = [(target, [target.worker])]
        workers, layout = [target.worker], None
    else:
        parts = [(inst, [target.worker(w) for w in inst.workers]) for inst in target.instances]
        workers, layout = [target.worker(w) for w in range(target.n_workers)], target.layout()

    def pages(w):
        table = w.arena.page_table()
        if physical:
            return table.tobytes()
        return (table["page"] >= 0).tobytes() + table["tag"].tobytes()
    state = {"layout": layout, "pages": [pages(w) for w in workers], "requests": {},
             # each cache's shape: the layers it holds, its heads, pages a layer and page cap
             "kv": [(w.kv.first_layer, w.kv.n_layers, w.kv.n_kv_heads, w.kv.page_cap,
                     w.kv.stats()["pages_per_layer"]) for w in workers],
             # what each worker holds of the model and which TP rank it is
             "weights": [(sorted(w.weights.held), sorted(w.weights.held_layers),
                          w.weights.has_embed, w.weights.has_head, w.tp_size, w.tp_rank,
                          w.layers, sorted(w.weights.held_experts or ())) for w in workers]}
    for owner, ranks in parts:
        for rid, r in owner.requests.items():
            ex = owner.export(rid)
            info = {k: ex["info"][k] for k in ("state", "n_generated", "n_computed", "prefill_end",
                                               "n_preemptions")}
            tables = [ranks[k].kv.block_table(seq).tolist() if seq >= 0 else None
                      for k, seq in enumerate(ex["seqs"])]
            state["requests"][rid] = (info, tables, list(r.output_tokens), r.finished)
    return state


# ---- fault sweeps over whole operations ----

SWEEP_MOST_ENV = "GYGES_SWEEP_MOST"


def sweep_most(default):
    """How many events of a site a sampled fault sweep fails: `default` (what `make test` can
    afford; the emulated GPU is slow), or what GYGES_SWEEP_MOST says, 0 meaning every event
    (`make sweep-cuda`)."""
    value = os.environ.get(SWEEP_MOST_ENV)
    if value is None:
        return default
    most = int(value)
    return None if most == 0 else max(2, most)


def spread(count, most=None):
    """Event numbers to fail: all of 1..count, or `most` of them spread evenly (the first and
    the last among them)."""
    if most is None or count <= most:
        return list(range(1, count + 1))
    return sorted({1 + round(i * (count - 1) / (most - 1)) for i in range(most)})


# kind -> (layout before, Host.transform arguments, layout after)
TRANSFORMS = {
    "merge": ("4xTP1", dict(workers=(0, 1, 2, 3), tp=4), "TP4"),
    "split": ("1xTP4", dict(workers=(0, 1, 2, 3), tp=1), "4xTP1"),
    "merge, staggered": ("4xTP1", dict(workers=(0, 1, 2, 3), tp=4, layers_per_step=1), "TP4"),
    "split, staggered": ("2xTP2", dict(workers=(0, 1), tp=1, layers_per_step=2, overlap=True),
                         "2xTP1+TP2"),
    "merge, basic": ("4xTP1", dict(workers=(0, 1, 2, 3), tp=4, method="basic"), "TP4"),
}


class _Workload:
    """Eight requests (greedy and seeded sampling) on a 4-worker host, their tokens served by a
    plain engine, and what each worker of an idle host of a layout holds."""

    def __init__(self, model, memory, **host_options):
        from .runtime.engine import Engine, SamplingParams

        self.model, self.memory, self.options = model, memory, host_options
        rng = np.random.default_rng(0)
        vocab = model.config.vocab_size
        self.prompts = [rng.integers(0, vocab, size=int(rng.integers(3, 40))).tolist()
                        for _ in range(8)]
        self.params = [SamplingParams(max_tokens=6, ignore_eos=True) if i % 2 == 0 else
                       SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=3,
                                      ignore_eos=True) for i in range(8)]
        with Engine(model, memory="128MiB") as e:
            reqs = [e.submit(p, q) for p, q in zip(self.prompts, self.params)]
            e.run()
            self.reference = [r.output_tokens for r in reqs]
        self._fresh = {}

    def host(self, layout, steps=2):
        from .runtime.host import Host

        host = Host(self.model, workers=4, memory_per_worker=self.memory, layout=layout,
                    **self.options)
        reqs = [host.submit(p, q) for p, q in zip(self.prompts, self.params)]
        for _ in range(steps):
            host.step()
        return host, reqs

    def fresh_bytes(self, layout):
        if layout not in self._fresh:
            from .runtime.host import Host

            with Host(self.model, workers=4, memory_per_worker=self.memory, layout=layout,
                      **self.options) as h:
                self._fresh[layout] = [h.worker(w).arena.stats()["bytes_in_use"] for w in range(4)]
        return self._fresh[layout]

    def finish(self, host, reqs, out):
        """Serves everything; counts lost requests, token mismatches and leftover pages."""
        host.run()
        out["lost"] += sum(r.finish_reason != "length" for r in reqs)
        out["mismatches"] += sum(r.output_tokens != w for r, w in zip(reqs, self.reference))
        held = [host.worker(w).arena.stats()["bytes_in_use"] for w in range(4)]
        out["leaked_pages"] += sum(held) != sum(self.fresh_bytes(host.layout()))


def _transform_to_the_end(host, kwargs):
    from .core.errors import Error

    t = host.transform(**kwargs)  # raises when refused
    while not t.done:
        try:
            host.step()
        except Error:
            pass  # a failed step changes nothing: the next one tries again
    return t


def sweep_transformation(model, kind, site, most=None, memory="48MiB", **host_options):
    """Fails the n-th `site` event of a transformation of `kind` (TRANSFORMS), for every n it
    has (or `most` of them), each on a fresh host serving eight requests. Returns the counts:
    events, runs; how each ended: refused (before its first change), rolled_back (after it:
    taken back), done (committed, a failed advance tried again), recovered (its rollback
    failed too: rebuilt and recomputed); and what must stay 0: refusals and rollbacks between
    two steps that left the host other than before (changed: its layout, pages by slot,
    requests' records, block tables, tokens), runs ending in a layout neither the start nor the
    target (wrong_layout), lost requests, token mismatches against a plain engine, and runs
    leaving pages behind (leaked_pages). host_options: the hosts' other arguments
    (expert_parallel=True)."""
    from .core.errors import Error
    from .reconfig import RecoveryWarning, ReconfigurationWarning

    start, kwargs, target = TRANSFORMS[kind]
    load = _Workload(model, memory, **host_options)
    host, _ = load.host(start)
    events, _ = count(site, lambda: _transform_to_the_end(host, kwargs))
    host.close()
    out = dict(kind=kind, site=site, events=events, runs=0, refused=0, rolled_back=0, done=0,
               recovered=0, changed=0, wrong_layout=0, lost=0, mismatches=0, leaked_pages=0)
    for n in spread(events, most):
        host, reqs = load.host(start)
        start_layout = host.layout()
        before = snapshot(host, physical=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RecoveryWarning)  # counted here instead
            warnings.simplefilter("ignore", ReconfigurationWarning)
            with inject(site, n):
                try:
                    t = _transform_to_the_end(host, kwargs)
                except Error as e:
                    t = getattr(e, "reconfiguration", None)
                    if t is None:
                        out["refused"] += 1
                    out["changed"] += snapshot(host, physical=False) != before
        out["runs"] += 1
        if t is not None:
            out[{"committed": "done"}.get(t.state, t.state)] += 1
            end = target if not host.expert_parallel else re.sub(r"TP(\d+)", r"TP\1EP\1",
                                                                  target)
            out["wrong_layout"] += host.layout() != (end if t.committed else start_layout)
        load.finish(host, reqs, out)
        host.close()
    return out


def sweep_step(model, site, most=None, memory="48MiB", layout="TP2+2xTP1"):
    """Fails the n-th `site` event of a step of a host of three instances (TP2+2xTP1, or a
    pipeline beside two TP1: PP[3,1]+2xTP1) that also grows its KV (long prompts arrive), for
    every n (or `most`). A failed step raises, and the instance it failed in
    is as before (the others' steps stand). Returns events, runs, failed, and what must stay 0:
    changed (a failed instance that changed), lost, mismatches, leaked_pages."""
    from .core.errors import Error

    load = _Workload(model, memory)
    rng = np.random.default_rng(9)
    long = [rng.integers(0, model.config.vocab_size, size=int(rng.integers(60, 90))).tolist()
            for _ in range(6)]

    def setup():
        from .runtime.engine import SamplingParams

        host, reqs = load.host(layout, steps=1)
        for i, p in enumerate(long):
            host.submit(p, SamplingParams(max_tokens=4, ignore_eos=True), instance=i % 3)
        return host, reqs

    host, _ = setup()
    events, _ = count(site, host.step)
    host.close()
    out = dict(site=site, events=events, runs=0, failed=0, changed=0, lost=0, mismatches=0,
               leaked_pages=0)
    for n in spread(events, most):
        host, reqs = setup()
        before = snapshot(host)
        with inject(site, n):
            try:
                host.step()
                failed = False
            except Error:
                failed = True
        out["runs"] += 1
        if failed:
            out["failed"] += 1
            after = snapshot(host)
            untouched = any(all(before["requests"][rid] == after["requests"][rid]
                                for rid in inst.requests) for inst in host.instances)
            out["changed"] += not untouched or before["layout"] != after["layout"]
        load.finish(host, reqs, out)
        out["lost"] += sum(not r.finished for inst in host.instances
                           for r in inst.requests.values())
        host.close()
    return out


# ---- two threads on one host ----

def stress_threads(model, seed=1, requests=60, memory="48MiB"):
    """One thread steps a 4-worker host without pause while another submits requests, aborts
    some (a long one at once, and a random earlier one), and starts random transformations
    (refused ones change nothing). Returns the counts: requests, aborted, transformations,
    refused, and what must stay 0: errors raised to the stepping thread, unfinished or lost
    requests, token mismatches of the requests not aborted against a plain engine, aborts
    that did not finish their handle."""
    import threading
    import time

    from .runtime.engine import SamplingParams
    from .core.errors import Error
    from .runtime.host import Host

    load = _Workload(model, memory)
    host = Host(model, workers=4, memory_per_worker=memory)
    stop, errors = threading.Event(), []
    handles, aborted = [], set()
    out = dict(seed=seed, requests=0, aborted=0, transformations=0, refused=0, errors=0,
               lost=0, mismatches=0, bad_aborts=0)

    def stepper():
        while not stop.is_set():
            try:
                host.step()
            except Error as e:
                errors.append(e)

    thread = threading.Thread(target=stepper)
    thread.start()
    rng = np.random.default_rng(seed)
    moves = [((0, 1, 2, 3), 4), ((0, 1, 2, 3), 1), ((0, 1), 2), ((2, 3), 2), ((0, 1, 2, 3), 2)]
    try:
        for k in range(requests):
            i = k % len(load.prompts)
            handles.append((i, host.submit(load.prompts[i], load.params[i])))
            if k % 7 == 3:  # a long request aborted at once cannot have finished
                long = host.submit(load.prompts[i], SamplingParams(max_tokens=200))
                out["bad_aborts"] += not host.abort(long) or long.finish_reason != "abort"
                out["aborted"] += 1
                _, h = handles[int(rng.integers(len(handles)))]  # and one that may be done
                if host.abort(h):
                    aborted.add(h.id)
            if k % 10 == 5:
                workers, tp = moves[int(rng.integers(len(moves)))]
                try:
                    host.transform(workers=workers, tp=tp,
                                   layers_per_step=[None, 1][int(rng.integers(2))])
                    out["transformations"] += 1
                except Error:
                    out["refused"] += 1  # not a legal move from the layout of the moment
            time.sleep(0.002)
        deadline = time.time() + 300
        while host.has_unfinished() and time.time() < deadline:
            time.sleep(0.01)
    finally:
        stop.set()
        thread.join()
    out["requests"] = len(handles)
    out["aborted"] += len(aborted)
    out["errors"] = len(errors)
    for i, h in handles:
        if h.id in aborted:
            out["bad_aborts"] += h.finish_reason != "abort"
        else:
            out["lost"] += h.finish_reason != "length"
            out["mismatches"] += h.output_tokens != load.reference[i]
    host.close()
    return out
