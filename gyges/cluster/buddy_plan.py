"""KunServe's buddy groups (csrc/policy/buddy.h): which instances drop their replicated parameters
together when the cluster runs short of KV memory.

    plan = gyges.cluster.buddy_plan.plan(8, required_bytes=5 * P, param_bytes=P)
    plan.groups   # ((0, 1, 2, 3), (4, 5), (6, 7)): each group keeps one copy of the parameters
    plan.met      # True: the groups free (4-1 + 2-1 + 2-1) * P = 5 * P >= required
    plan.freed    # bytes freed for KV

A group of g instances serves as a pipeline over one copy of the parameters and frees (g - 1)
copies for KV. strategy="throughput" is the paper's Algorithm 1: merge the two smallest groups
until the requirement is met (small groups keep pipelines short); "memory" grows a single group
while what it frees stays within the original KV region (kv_bytes). Groups are ranges of
neighbouring instances here: each is a pipeline of workers next to each other. On a real host,
host.buddy forms one (gyges.reconfig.buddy).
"""
from dataclasses import dataclass

from .. import _C
from ..core.checks import integer, number
from ..core.errors import InvalidArgumentError

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
