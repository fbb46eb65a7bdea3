"""Recovery of a group of workers whose transformation failed half-way.

A transformation is refused, changing nothing, for every reason it can see before it changes
something (arguments, memory, live views of the workers' pages). Past that point a failure (an
allocation, a page, a copy or a collective that fails, injected or real) may leave the workers
between two layouts: weights half dropped, KV half moved. Undoing every step would need a
second copy of the KV it overwrote, so the group is rebuilt instead, in the layout the
transformation was going to:

  1. the group's serving loops stop (their C engines go; nothing is read from them any more);
  2. its workers are made anew from the host copy of the weights (new arenas: the old ones go
     with their last reference) and join their TP groups;
  3. every unfinished request of the group is adopted by the new instances from its handle
     (prompt, tokens generated so far, parameters, timestamps), queued to be recomputed. The
     engine is deterministic, so its next tokens are the ones it would have produced anyway.

No request is lost and no page leaks; the cost is the recomputation (t.stats counts it). A
step of the rebuild that fails is tried again (a fault is usually transient); if the target
layout cannot be built, the source layout is tried; if neither can, the group's requests
finish with reason "error" and the cause, and the error is raised.
"""
import math
import time
import warnings

import numpy as np

from .errors import Error

ATTEMPTS = 3  # per layout
STATE_WAITING, STATE_PREEMPTED = 0, 1  # gy_sched_state


class RecoveryWarning(UserWarning):
    """A transformation failed half-way and its group was rebuilt (see gyges.recovery)."""


def group_handles(instances):
    """The unfinished request handles of these instances' loops, by id, in submission order."""
    handles = {}
    for inst in instances:
        for rid, handle in inst.loop.requests.items():
            if not handle.finished:
                handles.setdefault(rid, handle)
    return [handles[rid] for rid in sorted(handles)]


def _adopt_for_recompute(instance, handle, config):
    """Adopts a request into `instance` from its handle alone, queued to be recomputed."""
    params = handle.params
    stops = set(params.stop_token_ids)
    if not params.ignore_eos:
        stops |= set(config.eos_tokens())
    tokens = np.array(handle.prompt + handle.output_tokens, dtype=np.int32)
    generated = len(handle.output_tokens)
    ran = generated > 0 or not math.isnan(handle.metrics.scheduled)
    first_token = handle.metrics.token_times[0] if handle.metrics.token_times else math.nan
    info = (STATE_PREEMPTED if ran else STATE_WAITING, generated, 0, 0, 1 if ran else 0,
            handle.metrics.arrival, handle.metrics.scheduled, first_token)
    instance.readmit(handle, tokens, np.array(sorted(stops), dtype=np.int32), info)


def _close_group(host, group, extra_instances):
    """Stops every serving loop on the group's workers (host.instances and `extra_instances`,
    a transformation's engines that have left the host already). Their KV is forgotten, not
    freed: the workers are replaced anyway."""
    doomed = [inst for inst in host.instances if set(inst.workers) & set(group)]
    for inst in doomed:
        host.instances.remove(inst)
    for inst in doomed + list(extra_instances):
        if not inst.closed:
            inst.detach_kv()
            inst.detach_transition()
        inst.close()


def _build(host, layout, handles):
    """New workers for the group, the instances of `layout` [(first worker, tp)], and the
    requests spread over them (by tokens, largest first). Raises when any part fails; the
    partly built workers are then simply dropped."""
    workers = {}
    for first, tp in layout:
        for rank in range(tp):
            w = host.new_worker(first + rank)
            if tp > 1:
                w.join_tp(tp, rank)
            workers[first + rank] = w
    for index, w in workers.items():
        host._workers[index] = w
    instances = [host.make_instance(range(first, first + tp), tp) for first, tp in layout]
    load = [0] * len(instances)
    for handle in sorted(handles, key=lambda h: -(len(h.prompt) + len(h.output_tokens))):
        j = min(range(len(instances)), key=lambda i: load[i])
        _adopt_for_recompute(instances[j], handle, host.model.config)
        load[j] += len(handle.prompt) + len(handle.output_tokens)
    return instances


def rebuild(host, t, target, source, handles, cause, extra_instances=()):
    """Rebuilds the group of transformation `t` in layout `target` (else `source`), both lists of
    (first worker, tp), with `handles` to recompute. Marks t done and recovered; returns t."""
    start = time.perf_counter()
    group = list(t.workers)
    t.release_resources()
    _close_group(host, group, extra_instances)
    # The workers' arenas go with their last reference; the rebuilt ones take their place.
    for w in group:
        host._workers[w] = None
    last = None
    for layout in (target, source):
        for _ in range(ATTEMPTS):
            try:
                instances = _build(host, layout, handles)
            except Error as e:  # a transient failure: drop what was built, try again
                last = e
                for inst in [i for i in host.instances if set(i.workers) & set(group)]:
                    host.instances.remove(inst)
                    inst.close()
                continue
            host.instances.extend(instances)
            host.instances.sort(key=lambda inst: min(inst.workers))
            t.done = t.recovered = True
            t.error = f"{type(cause).__name__}: {cause}"
            t.to_tp = layout[0][1]
            t.stats["requests_recomputed"] = len(handles)
            t.stats["phase_seconds"]["recovery"] = time.perf_counter() - start
            warnings.warn(f"{t!r} failed half-way ({t.error}); workers {group} were rebuilt as "
                          f"TP{t.to_tp} and their {len(handles)} requests will be recomputed",
                          RecoveryWarning, stacklevel=3)
            return t
    for handle in handles:  # nothing could be built: the requests end, saying why
        handle.finished, handle.finish_reason = True, "error"
        handle.error = f"workers {group} could not be rebuilt after {cause!r}: {last}"
    t.done, t.recovered, t.error = True, False, f"{type(cause).__name__}: {cause}"
    raise last
