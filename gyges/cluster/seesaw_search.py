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

Its prefill instances' size:

    base, share = prefill_tp(cost, trace, max_tp)

is the smallest TP that holds the weights and prefills all but RARE of the trace's requests (a
prompt's activations and its KV must fit): a request a prefill instance cannot take merges a
unit out of its phase for itself, so where many need more (Qwen2.5-32B on L40S, whose TP2
prefills at most 1,367 tokens), the phases would churn.

Its prefill parallelism, where there is a choice (the weights need base >= 2 GPUs an instance):

    pp, rows = prefill_pp(cost, trace, base, decode_tp, max_batch_tokens=2048)

compares a TP-base instance with a base-stage pipeline (CostModel.pipeline_degree) on one
prefill step of the trace's mean prompt, batched as the scheduler batches it (as many whole
prompts as max_batch_tokens holds, or one chunk of a longer one at half its prompt's context):
the pipeline has no all-reduce but needs a prompt a stage to fill itself, so it wins where the
link is slow (PCIe) and prompts are short, and TP wins on one long prompt. With decode_tp <= base
there is no decode phase to move to and the instances decode too: the pipeline must then also
win a decode step of as many mean requests as a TP-base instance holds (it reads its weights
once a micro-batch, so it wins only where TP's all-reduces cost more than that).

Under the Table 1 fit (Qwen2.5-32B on H20, all-reduce at 1% of NVLink) a TP8 decodes a third of
what a TP2 does per GPU, so the search keeps Seesaw at TP2; with NVLink at NCCL's measured speed
(calibration "grounded") TP2-TP4 lead by a few percent. What Seesaw also searches and this does
not: data parallelism inside a phase (a unit is one decode instance, and its prefill instances
are of one size) and the CPU buffer's size.
"""
from __future__ import annotations

import numpy as np

from .costmodel import ConstantCost, CostModel
from .policy import PolicyError

__all__ = ["decode_tp", "prefill_tp", "prefill_pp"]


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


def _check_tp(name, tp):
    """tp, which must be a power of two >= 1 (a PolicyError naming `name` otherwise)."""
    if isinstance(tp, bool) or not isinstance(tp, (int, np.integer)) or tp < 1 or tp & (tp - 1):
        raise PolicyError(f"{name} must be a power of two >= 1, got {tp!r}")
    return int(tp)


def _decode_shape(blocks, block_size, context, max_running):
    """(batch, step_time keywords) of a decode step of requests at `context` tokens, as many as
    `blocks` KV blocks hold, at most max_running."""
    batch = int(min(max_running, blocks * block_size // max(context, 1.0)))
    return batch, dict(n_tokens=batch, n_seqs=batch, n_samples=batch,
                       kv_read_tokens=batch * context, attn_pairs=batch * context)


def decode_tp(cost, trace, max_tp: int, block_size: int = 16, max_running: int = 256):
    """(the TP Seesaw's decode phase should use, a row per candidate: tp, batch, step seconds,
    tokens/s per GPU, and whether every request fits it). A ConstantCost prices every TP alike,
    so there is nothing to search: max_tp."""
    max_tp = _check_tp("max_tp", max_tp)
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
        batch, shape = _decode_shape(blocks, block_size, context, max_running)
        step = cost.step_time(tp, **shape) if batch > 0 else float("inf")
        rows.append({"tp": tp, "batch": batch, "step": step,
                     "per_gpu": batch / (step * tp) if batch > 0 else 0.0,
                     "serves_all": tp >= need})
    fits = [r for r in rows if r["serves_all"] and r["batch"] > 0]
    if not fits:
        return max_tp, rows
    best = max(fits, key=lambda r: (r["per_gpu"], -r["tp"]))
    return best["tp"], rows


RARE = 0.05   # (ours) the share of requests whose own merges a unit's phases can take


def prefill_tp(cost, trace, max_tp: int, block_size: int = 16):
    """(the TP of Seesaw's prefill instances, the share of the trace's requests that need more).
    A ConstantCost holds everything at TP1."""
    max_tp = _check_tp("max_tp", max_tp)
    if isinstance(cost, ConstantCost) or trace.size == 0:
        return 1, 0.0
    capacity, _ = cost.capacities(max_tp, block_size)
    level = _min_levels(trace, capacity, cost.max_inputs(max_tp), block_size)
    served = level[level >= 0]
    fits = [l for l, blocks in enumerate(capacity) if blocks >= 1]
    if not fits or served.size == 0:
        return max_tp, 0.0
    for l in range(fits[0], len(capacity)):
        share = float(np.mean(served > l))
        if share <= RARE:
            return 1 << l, share
    return max_tp, 0.0


def prefill_pp(cost, trace, base: int, decode_tp: int, max_batch_tokens: int = 2048,
               max_running: int = 256, block_size: int = 16):
    """(whether Seesaw's instances of `base` GPUs should be pipelines, a row per candidate:
    parallelism, phase, sequences a step, step seconds, tokens/s). Only a roofline CostModel
    prices a pipeline; with base < 2 there is nothing to pick."""
    base, decode_tp = _check_tp("base", base), _check_tp("decode_tp", decode_tp)
    if not isinstance(cost, CostModel) or base < 2 or trace.size == 0:
        return False, []
    prompt = float(np.mean(trace["input_tokens"]))
    output = float(np.mean(trace["output_tokens"]))
    shapes = {}
    if prompt <= max_batch_tokens:   # whole prompts, as many as a step takes
        seqs = int(max(1, min(max_running, max_batch_tokens // max(prompt, 1.0))))
        tokens, context = seqs * prompt, 0.0
    else:                            # one chunk of a long prompt, half of it already computed
        seqs, tokens, context = 1, float(max_batch_tokens), prompt / 2
    per_seq = tokens / seqs
    shapes["prefill"] = dict(n_tokens=int(tokens), n_seqs=seqs, n_samples=seqs,
                             kv_read_tokens=seqs * (context + per_seq),
                             attn_pairs=seqs * (per_seq * context + per_seq * (per_seq + 1) / 2))
    if decode_tp <= base:            # no decode phase: the instances decode too
        seqs, shape = _decode_shape(cost.kv_blocks(base, block_size), block_size,
                                    prompt + output / 2, max_running)
        if seqs >= 1:
            shapes["decode"] = shape
    rows = []
    for name, model in ((f"TP{base}", cost.replace(pipeline_degree=0)),
                        (f"PP{base}", cost.replace(pipeline_degree=base))):
        for phase, shape in shapes.items():
            step = model.step_time(base, **shape)
            rows.append({"parallelism": name, "phase": phase, "seqs": shape["n_seqs"],
                         "step": step, "tokens_per_s": shape["n_tokens"] / step})
    if decode_tp <= base and "decode" not in shapes:
        return False, rows
    n = len(shapes)
    return all(pp["tokens_per_s"] > tp["tokens_per_s"] for tp, pp in zip(rows[:n], rows[n:])), rows
