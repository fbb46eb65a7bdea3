"""The cluster layer: the policies and their controller as seen from Python (policy), the two
executors that run them (sim: the discrete-event simulator; experiment: a real Host), and what
they take and give (costmodel, traces, results, metrics).

    gyges.cluster.POLICIES, gyges.cluster.Policy, gyges.cluster.View   (from policy)"""
from .policy import (DEFAULTS, GROUP_DTYPE, INST_VIEW_DTYPE, POLICIES, Decision, Policy,
                     PolicyError, View, check_number, check_policy, smallest_tp)

__all__ = ["POLICIES", "Policy", "View", "Decision", "PolicyError", "INST_VIEW_DTYPE",
           "GROUP_DTYPE", "DEFAULTS", "check_policy", "check_number", "smallest_tp"]
