"""The last resort of a reconfiguration whose rollback failed too (gyges/reconfig/
reconfiguration.py): a second failure while taking back the first can leave the workers between
two layouts (weights half restored, KV half moved back). The group is rebuilt instead:

  1. the group's serving loops stop (their C engines go; nothing is read from them any more);
  2. its workers are made anew from the host copy of the weights (new arenas: the old ones go
     with their last reference) and join the instances of the layout (the one the host had
     before, when the executor knows it; else one TP1 instance per worker);
  3. every unfinished request of the group is adopted by the new instances from its handle
     (prompt, tokens generated so far, parameters, timestamps), queued to be recomputed. The
     engine is deterministic, so its next tokens are the ones it would have produced anyway.

No request is lost and no page leaks; the cost is the recomputation (r.stats counts it, and
r.state is "recovered", not "rolled_back"). A step of the rebuild that fails is tried again (a
fault is usually transient); if the layout cannot be built, one TP1 instance per worker is
tried; if neither can, the group's requests finish with reason "error" and the cause.
"""
import math
import time
import warnings

import numpy as np

from ..core.errors import Error

ATTEMPTS = 3  # per layout
STATE_WAITING, STATE_PREEMPTED = 0, 1  # gy_sched_state


class RecoveryWarning(UserWarning):
    """A reconfiguration and its rollback failed, and its group was rebuilt (see above)."""


def group_handles(instances):
    """The unfinished request handles of these instances, by id, in submission order."""
    handles = {}
    for inst in instances:
        for rid, handle in inst.requests.items():
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


def _close_group(host, group, extra):
    """Stops every instance on the group's workers (the host's, and `extra`: a
    reconfiguration's engines out of the pool). Their KV is forgotten, not freed: the workers
    are replaced anyway."""
    doomed = [inst for inst in host.instances if set(inst.workers) & set(group)]
    for inst in doomed:
        host.pool.remove(inst)
    for inst in doomed + [e for e in extra if e not in doomed]:
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
        host.replace_worker(index, w)
    instances = [host.make_instance(range(first, first + tp), tp) for first, tp in layout]
    load = [0] * len(instances)
    for handle in sorted(handles, key=lambda h: -(len(h.prompt) + len(h.output_tokens))):
        j = min(range(len(instances)), key=lambda i: load[i])
        _adopt_for_recompute(instances[j], handle, host.model.config)
        load[j] += len(handle.prompt) + len(handle.output_tokens)
    return instances


def rebuild(host, r, layout, cause):
    """Rebuilds the group of reconfiguration `r` in `layout` ([(first worker, tp)], or None: one
    TP1 instance per worker), its unfinished requests recomputed."""
    start = time.perf_counter()
    group = list(r.workers)
    extra = list(r.engines())
    handles = group_handles([inst for inst in host.instances if set(inst.workers) & set(group)]
                            + extra)
    _close_group(host, group, extra)
    singles = [(w, 1) for w in group]
    last = None
    for plan in ([layout, singles] if layout else [singles]):
        for _ in range(ATTEMPTS):
            try:
                instances = _build(host, plan, handles)
            except Error as e:  # a transient failure: drop what was built, try again
                last = e
                continue
            for inst in instances:
                host.install(inst)
            r.stats["requests_recomputed"] = len(handles)
            r.stats["recovery_seconds"] = time.perf_counter() - start
            warnings.warn(f"{r!r} failed ({r.error}) and its rollback failed too; workers "
                          f"{group} were rebuilt and their {len(handles)} requests will be "
                          f"recomputed", RecoveryWarning, stacklevel=4)
            return r
    for handle in handles:  # nothing could be built: the requests end, saying why
        handle.finished, handle.finish_reason = True, "error"
        handle.error = f"workers {group} could not be rebuilt after {cause!r}: {last}"
    raise last
