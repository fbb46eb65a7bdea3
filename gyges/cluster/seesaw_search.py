"""Seesaw's search of its decode parallelism (Su et al., MLSys '25): the TP its decode phase
merges each unit of GPUs into (policy_seesaw.c's decode_tp), picked from the cost model and the
workload before the run, as Seesaw picks its configurations offline.

    tp, rows = decode_tp(cost, trace, max_tp, block_size=16)
    sim.run(trace, policy="seesaw", decode_tp=tp)      # what sim.run does when decode_tp is None

The candidates are TP 1, 2, 4, ..., max_tp, those at least as large as the largest TP a request
of the trace needs (a smaller one would reject it: a candidate must serve the workload). Each is
scored by its decode throughput per GPU: a TP-N instance holds b requests at the trace's mean
decode context (prompt + half the output, the mean over a request's decode) in its KV blocks,
at most max_running, and decodes them in one step of cost.step_time(N, b, ...): b / (step * N)
tokens a second a GPU. The best wins; ties go to the smaller TP, whose re-shardings move less.
TP1 means no decode phase at all (the unit stays data parallel).

Under the Table 1 fit (Qwen2.5-32B on H20, all-reduce at 1% of NVLink) a TP8 decodes a third of
what a TP2 does per GPU, so the search keeps Seesaw at TP2; with NVLink at NCCL's measured speed
(calibration "grounded") TP2-TP4 lead by a few percent. What Seesaw also searches and this does
not: its prefill phase's parallelism (here always TP1) and the CPU buffer's size.
"""
from __future__ import annotations

import numpy as np

from .costmodel import ConstantCost
from .policy import PolicyError

__all__ = ["decode_tp"]


def _min_levels(trace, capacity, max_input, block_size):
    """Per request, the smallest TP level that holds it (its KV, and its prompt's prefill where
    max_input limits it); -1 where none does."""
    prompt = np.asarray(trace["input_tokens"], np.int64)
    blocks = -(-(prompt + np.asarray(trace["output_tokens"], np.int64)) // block_size)
    level = np.full(prompt.size, -1, np.int64)
    for l in reversed(range(len(capacity))):
        holds = blocks <= capacity[l]
        if max_input is not None:
            holds &= prompt <= max_input[l]
        level[holds] = l
    return level


def decode_tp(cost, trace, max_tp: int, block_size: int = 16, max_running: int = 256):
    """(the TP Seesaw's decode phase should use, a row per candidate: tp, batch, step seconds,
    tokens/s per GPU, and whether every request fits it). A ConstantCost prices every TP alike,
    so there is nothing to search: max_tp."""
    if isinstance(max_tp, bool) or not isinstance(max_tp, int) or max_tp < 1 or \
            max_tp & (max_tp - 1):
        raise PolicyError(f"max_tp must be a power of two >= 1, got {max_tp!r}")
    if isinstance(cost, ConstantCost) or trace.size == 0:
        return max_tp, []
    capacity, _ = cost.capacities(max_tp, block_size)
    level = _min_levels(trace, capacity, cost.max_inputs(max_tp), block_size)
    served = level >= 0
    if not served.any():
        return max_tp, []
    need = 1 << int(level[served].max())
    context = float(np.mean(trace["input_tokens"][served]) +
                    np.mean(trace["output_tokens"][served]) / 2)
    rows = []
    for l, blocks in enumerate(capacity):
        tp = 1 << l
        batch = int(min(max_running, blocks * block_size // max(context, 1.0)))
        step = cost.step_time(tp, batch, batch, batch, batch * context, batch * context) \
            if batch > 0 else float("inf")
        rows.append({"tp": tp, "batch": batch, "step": step,
                     "per_gpu": batch / (step * tp) if batch > 0 else 0.0,
                     "serves_all": tp >= need})
    fits = [r for r in rows if r["serves_all"] and r["batch"] > 0]
    if not fits:
        return max_tp, rows
    best = max(fits, key=lambda r: (r["per_gpu"], -r["tp"]))
    return best["tp"], rows
