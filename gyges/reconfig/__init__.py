"""Every live change of parallelism, as executors of one protocol (reconfiguration.py: plan ->
begin -> advance -> commit | rollback). The host's verbs build them (registered below in
gyges.runtime.host.EXECUTORS, so that the runtime imports none of them):

    host.transform    Gyges: transform.py (shared), at_once.py, staggered.py, baselines.py,
                      with pure plans (plans.py), the requests that move (requests.py) and the
                      KV bytes (kv_move.py)
    host.reconfigure  PipeLive's live pipeline re-split: resplit.py
    host.switch       Flying Serving's DP <-> TP switches on a replicated host: switch.py
    host.buddy        KunServe's buddy groups and their live KV exchange: buddy.py (Buddy)
    host.restore      KunServe's restore, blocking or live: buddy.py (Restore)

A rollback that fails too falls back to rebuilding the group (recovery.py). link.py paces
transfers over a modelled worker-to-worker link.

How to add a sixth mechanism: docs/architecture.md, "Adding a reconfiguration"."""
from ..runtime.host import EXECUTORS
from . import baselines
from .at_once import ScaleDown, ScaleUp
from .buddy import Buddy, Restore
from .link import Link
from .reconfiguration import STATS, Reconfiguration, ReconfigurationWarning
from .recovery import RecoveryWarning
from .resplit import Resplit
from .staggered import StaggeredScaleDown, StaggeredScaleUp
from .switch import Bind, Release, switch
from .transform import Transform, TransformError, check_args, check_cuda

METHODS = baselines.METHODS


def transformation(host, workers, tp, method="gyges", layers_per_step=None,
                   weights_from="peers", phase_chunks=4, overlap=False):
    """host.transform's executor for (workers, tp): a merge into one TPk of the aligned group
    (tp = its size) or a split of the TPk instance there (tp a smaller divisor), at once or
    layer-staggered. Only the arguments are checked here; the host's state in plan()."""
    workers, tp, layers_per_step = check_args(host, workers, tp, method, layers_per_step,
                                              weights_from, phase_chunks, overlap)
    if "replicated" in host.weights_of(workers):
        raise TransformError("this host keeps a full replica on every worker "
                             "(weights='replicated'): it changes DP and TP with switch(), "
                             "which moves nothing; Gyges transformations move the shards of "
                             "a sharded host")
    if host.backend == "cuda":
        check_cuda(host, method, layers_per_step)
    first, k = workers[0], len(workers)
    if workers != list(range(first, first + k)) or first % k or k not in host.tp_degrees:
        raise TransformError(f"workers {workers} are not an aligned group (k consecutive "
                             f"workers from a multiple of k, k a TP degree of the model: "
                             f"{', '.join(map(str, host.tp_degrees))})")
    staggered = layers_per_step is not None and method != "stop_world"
    if host.expert_parallel and k > host.model.config.num_experts:
        raise TransformError(f"TP{k} with expert parallelism leaves a rank none of the "
                             f"{host.model.config.num_experts} experts")
    if tp == k:
        if staggered:
            return StaggeredScaleUp(host, first, k, method, layers_per_step, overlap)
        return ScaleUp(host, first, k, method, phase_chunks)
    one = [i for i in host.instances if set(i.workers) & set(workers)]
    if not (len(one) == 1 and set(one[0].workers) == set(workers) and one[0].tp == k
            and not one[0].stages):
        raise TransformError(f"cannot take workers {workers} (layout {host.layout()}) to "
                             f"TP{tp}: merge them into TP{k} (tp={k}) or split one TP{k} "
                             f"instance")
    host.check_group(first, tp)
    if tp > k or k % tp:
        raise TransformError(f"scale-down goes from TP{k} to a smaller divisor, not TP{tp}")
    if staggered:
        return StaggeredScaleDown(host, first, k, tp, method, layers_per_step, weights_from,
                                  overlap)
    return ScaleDown(host, first, k, tp, method, weights_from)



EXECUTORS.update(transform=transformation, reconfigure=Resplit, switch=switch, buddy=Buddy,
                 restore=Restore)

__all__ = ["Reconfiguration", "ReconfigurationWarning", "RecoveryWarning", "STATS", "Transform",
           "TransformError", "ScaleUp", "ScaleDown", "StaggeredScaleUp", "StaggeredScaleDown",
           "Resplit", "Bind", "Release", "Buddy", "Restore", "Link", "METHODS",
           "transformation", "switch"]
