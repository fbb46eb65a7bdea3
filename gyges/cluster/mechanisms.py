"""What the reconfiguration mechanisms of the seed papers cost, derived from what they move and do.

Each price is a `Price`: total seconds (or a fraction, for a slowdown) and the named terms it adds
up, every term priced with the cost model's own quantities (bytes per token, layers, step times)
and gyges.cluster.links' alpha-beta links and host constants. The simulator takes its mechanism
times from here (sim.run's switch_time, PipelineCost.stop_time and the cost models'
transform_slowdown default to these); the papers' reported figures are never inputs, they are
what tests/test_mechanisms.py and benchmarks/bench_sim.py compare the derived figures with.

flying_switch       Flying Serving's DP -> TP bind (its section 4): nothing is copied. The switch
                    signal rides the engines' control-plane all-reduce (host messages), the
                    pre-built communicator's first collective is a barrier over the group's link,
                    and every member re-points its weight views and KV strides (a host call per
                    sharded tensor per layer). The members also finish the step they are in
                    (the simulator runs that step itself); `drain` is its expected remainder,
                    half a decode step, counted only in `as_measured`.
loongserve_scale    LoongServe's elastic scale-up or scale-down of sequence parallelism: a
                    flying_switch without the rebind (whole replicas; a request's KV stays
                    where it was produced), so the signal and the group's first collective.
pipelive_stop       PipeLive's commit pause (its Algorithm 1, phase 5): the KV still lagging at
                    the switch point (fewer than tau tokens of the moved layers) crosses the
                    stage link, a two-phase SyncAndCommit handshake crosses it twice, and each
                    stage re-points the moved layers' weights and KV (host calls). Without KV
                    patching (stop_and_copy=True) the pause copies all live KV of the moved
                    layers instead.
transform_slowdown  A Gyges transformation's per-step slowdown with overlap (its 4.1 and 4.3):
                    the migration runs beside the step; each GPU's HBM carries the bytes it
                    sends and receives (2 B), taken from the memory-bound step, and a TP > 1
                    instance's all-reduce shares the link with the migration for the part of
                    the step the migration occupies it. Driver calls run beside the kernels
                    (Gyges 4.1) and cost no step time.
kunserve_exchange   KunServe's KV exchange of a drop (its 4.2): each member sends the KV of the
                    layers it dropped to the member that keeps them, over the buddy link, all at
                    once in both directions (pipeline.h's exchange formula).
seesaw_reshard      Seesaw's re-sharding of the KV through CPU shared memory (the baseline of
                    Gyges 6.2.3 / Figure 11): every GPU of the group offloads the KV it holds to
                    host memory and loads its share in the new geometry back, over its PCIe link
                    to the host, between two steps (nothing overlaps the step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import links as links_mod
from ..core.errors import InvalidArgumentError

__all__ = ["Price", "flying_switch", "pipelive_stop", "pipelive_stop_layers", "transform_slowdown",
           "pipeline_slowdown", "kunserve_exchange", "seesaw_reshard", "stage_link",
           "MechanismError"]


class MechanismError(InvalidArgumentError):
    """A mechanism asked of a cost model that cannot price it, or a bad argument."""


# costmodel.py imports this module for its defaults, so the cost models are told apart by
# their `kind` here rather than imported.
def _need(cost, kind, what):
    if getattr(cost, "kind", None) != kind:
        want = "CostModel" if kind == "roofline" else "PipelineCost"
        raise MechanismError(f"{what} prices a {want}, got {type(cost).__name__}")


def _decode(cost, tp, batch, context):
    """(step seconds, communication seconds) of a decode step of `batch` sequences."""
    shape = type(cost).batch_shape([(context, 1, True)] * batch)
    comm = cost.step_terms(tp, shape["n_tokens"], shape["n_samples"], shape["kv_read_tokens"],
                           shape["attn_pairs"])[2]
    return cost.step_time(tp, **shape), comm

# A linear layer's weight views a rank re-points when its TP degree changes: the fused QKV and
# output projections of attention, the fused gate/up and the down projection of the MLP; plus
# the layer's KV cache view (new strides, Flying Serving 4.2).
_VIEWS_PER_LAYER = 5
# A layer a pipeline stage gains or loses: its weights and its KV are two table entries.
_ENTRIES_PER_MOVED_LAYER = 2


@dataclass(frozen=True)
class Price:
    """`seconds` (or a fraction, for a slowdown) = the sum of `terms` (name -> value);
    `extra` holds what the price also reports but does not add up (e.g. a drain)."""
    seconds: float
    terms: dict
    extra: dict = field(default_factory=dict)

    @property
    def as_measured(self) -> float:
        """The price plus its extra terms: what an end-to-end measurement of the mechanism
        sees (e.g. a switch plus the wait for the step in flight)."""
        return self.seconds + sum(self.extra.values())


def _price(terms: dict, extra: dict | None = None) -> Price:
    return Price(float(sum(terms.values())), dict(terms), dict(extra or {}))


def _check_tps(tp_from, tp_to):
    for name, v in (("tp_from", tp_from), ("tp_to", tp_to)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1 or v & (v - 1):
            raise MechanismError(f"{name} must be a power of two >= 1, got {v!r}")
    if tp_from == tp_to:
        raise MechanismError(f"a reconfiguration changes the TP degree, got tp_from = tp_to = "
                             f"{tp_from}")
    return min(tp_from, tp_to), max(tp_from, tp_to)


def flying_switch(cost, tp_from: int, tp_to: int, decode_batch: int = 1,
                  decode_context: int = 1024, link: links_mod.Link | None = None) -> Price:
    """A bind of tp_to / tp_from engines of TP tp_from into one TP-tp_to group (or the release
    back: the same calls). `drain` (extra): half the source engines' decode step of
    `decode_batch` sequences at `decode_context` tokens, the expected wait for the step in
    flight when the switch is asked for at a random moment."""
    _need(cost, "roofline", "flying_switch")
    lo, hi = _check_tps(tp_from, tp_to)
    link = links_mod.gpu_link(cost.gpu) if link is None else link
    engines = hi // lo
    terms = {
        # the switch signal on the engines' control-plane ring all-reduce: 2 (n - 1) messages
        "signal": 2 * (engines - 1) * links_mod.HOST_MESSAGE,
        # the pre-built communicator's first collective over the group
        "barrier": link.barrier(hi),
        # every member re-points its views, all members at once
        "rebind": cost.model.num_hidden_layers * _VIEWS_PER_LAYER * links_mod.HOST_CALL,
    }
    step, _ = _decode(cost, lo, decode_batch, decode_context)
    return _price(terms, {"drain": step / 2})


def loongserve_scale(cost, tp_from: int, tp_to: int, decode_batch: int = 1,
                     decode_context: int = 1024, link: links_mod.Link | None = None) -> Price:
    """A scale-up of LoongServe's elastic sequence parallelism from groups of tp_from GPUs to
    one of tp_to (or the scale-down back). A flying_switch without the rebind: each elastic
    instance keeps the whole model, and a request's KV stays on the instance that produced it
    (a scale-down's KV is placed during the prefill), so nothing is re-pointed or moved; what
    is left is the signal and the first collective of the group's pre-built communicator, after
    the step in flight (`drain`)."""
    _need(cost, "roofline", "loongserve_scale")
    lo, hi = _check_tps(tp_from, tp_to)
    link = links_mod.gpu_link(cost.gpu) if link is None else link
    engines = hi // lo
    terms = {"signal": 2 * (engines - 1) * links_mod.HOST_MESSAGE, "barrier": link.barrier(hi)}
    step, _ = _decode(cost, lo, decode_batch, decode_context)
    return _price(terms, {"drain": step / 2})


def stage_link(pcost) -> links_mod.Link:
    """The link between a pipeline's stages: its link_bw over the network (a pipeline across
    servers, PipeLive's and KunServe's testbeds) when given, else the stage GPUs' own link."""
    if pcost.link_bw is not None:
        return links_mod.Link(f"{pcost.link_bw * 8 / 1e9:g} Gb/s", float(pcost.link_bw), "net")
    slowest = min(pcost.gpus, key=lambda g: g.link_bw)
    return links_mod.gpu_link(slowest)


def _moved_layers(pcost, cur, tgt) -> int:
    cur, tgt = pcost.check_split(cur), pcost.check_split(tgt)
    fc, ft = pcost._firsts(cur), pcost._firsts(tgt)
    return max(t - pcost._overlap(a, c, b, t) for a, c, b, t in zip(fc, cur, ft, tgt))


def pipelive_stop(pcost, cur, tgt, tau: int = 50, kv_tokens: float = 0.0,
                  stop_and_copy: bool = False) -> Price:
    """The pause of a re-split cur -> tgt at its commit. tau: PipeLive's convergence threshold
    (tokens; its testbed's setting is 50); with stop_and_copy the pause copies the moved layers'
    KV of all `kv_tokens` live tokens instead (no KV patching)."""
    _need(pcost, "pipeline", "pipelive_stop")
    return pipelive_stop_layers(pcost, _moved_layers(pcost, cur, tgt), tau, kv_tokens,
                                stop_and_copy)


def pipelive_stop_layers(pcost, moved: int, tau: int = 50, kv_tokens: float = 0.0,
                         stop_and_copy: bool = False) -> Price:
    """pipelive_stop for a re-split whose busiest stage gains `moved` layers."""
    _need(pcost, "pipeline", "pipelive_stop")
    if isinstance(tau, bool) or not isinstance(tau, int) or tau < 0:
        raise MechanismError(f"tau must be an int >= 0, got {tau!r}")
    if isinstance(moved, bool) or not isinstance(moved, int) or not 0 <= moved <= pcost.n_layers:
        raise MechanismError(f"moved must be an int in [0, {pcost.n_layers}], got {moved!r}")
    if not kv_tokens >= 0:
        raise MechanismError(f"kv_tokens must be >= 0, got {kv_tokens!r}")
    link = stage_link(pcost)
    lagging = float(kv_tokens) if stop_and_copy else float(tau)
    terms = {
        # the stage gaining the most layers receives the lagging tokens' KV of those layers
        "patch": link.transfer(lagging * pcost.kv_layer * moved, pcost.eff_xfer),
        # SyncAndCommit: prepare and commit, each a message to every stage and its answer
        "commit": 4 * link.latency,
        # the stages swap the moved layers' weight and KV tables
        "rebind": moved * _ENTRIES_PER_MOVED_LAYER * links_mod.HOST_CALL,
    }
    return _price(terms)


def pipeline_slowdown(pcost) -> Price:
    """The slowdown of a pipeline's steps while a re-split migrates: the migration streams at
    the stage link's rate (pipeline.h's migration time), and the slowest-memory stage's HBM
    carries it in and out beside the step (term `hbm`, a fraction)."""
    _need(pcost, "pipeline", "pipeline_slowdown")
    rate = stage_link(pcost).bw * pcost.eff_xfer
    return _price({"hbm": max(2 * rate / (g.hbm_bw * pcost.eff_bw) for g in pcost.gpus)})


def transform_slowdown(cost, tp_from: int, tp_to: int, kv_fraction: float = 0.9,
                       layers_per_step: int | None = None, decode_batch: int = 32,
                       decode_context: int = 1024) -> Price:
    """The slowdown of an instance's steps while a Gyges transformation tp_from -> tp_to moves
    its KV, with `kv_fraction` of the KV in use (Gyges 6.2.1 runs at 90%).

    layers_per_step None: the simulator's view, the KV phase's bytes spread over the phase's
    duration (costmodel.phase_time); an int: the paper's Figure 11 view, that many layers' KV
    moved beside each decode step of `decode_batch` sequences at `decode_context` tokens.
    Terms are fractions of the step: `hbm` (the migration's reads and writes taken from the
    step's memory bandwidth) and `link` (the all-reduce's share of the link, for tp_from > 1)."""
    _need(cost, "roofline", "transform_slowdown")
    if not 0 <= kv_fraction <= 1:
        raise MechanismError(f"kv_fraction must be in [0, 1], got {kv_fraction!r}")
    lo, hi = _check_tps(tp_from, tp_to)
    kv_tokens = kv_fraction * cost.max_tokens(lo) * (hi // lo)   # the instances being merged
    phase, nbytes = cost.phase_time("kv_scatter", lo, hi, kv_tokens)   # bytes per GPU
    src = tp_from
    step, comm = _decode(cost, src, decode_batch, decode_context)
    if layers_per_step is None:
        rate = nbytes / phase if phase > 0 else 0.0                 # bytes/s per GPU
        comm_share = comm / step if src > 1 else 0.0
        terms = {"hbm": 2 * rate / (cost.gpu.hbm_bw * cost.eff_bw),
                 "link": comm_share * min(1.0, rate / (cost.gpu.link_bw * cost.eff_xfer))}
        return _price(terms)
    if isinstance(layers_per_step, bool) or not isinstance(layers_per_step, int) or \
            not 1 <= layers_per_step <= cost.model.num_hidden_layers:
        raise MechanismError(f"layers_per_step must be an int in [1, "
                             f"{cost.model.num_hidden_layers}], got {layers_per_step!r}")
    per_step = nbytes * layers_per_step / cost.model.num_hidden_layers
    on_link = per_step / (cost.gpu.link_bw * cost.eff_xfer)
    terms = {"hbm": 2 * per_step / (cost.gpu.hbm_bw * cost.eff_bw) / step,
             "link": min(comm, on_link) / step if src > 1 else 0.0}
    # without overlap (Gyges-): the copy runs between the steps instead
    return _price(terms, {"serial": on_link / step})


def seesaw_reshard(cost, tp_from: int, tp_to: int, kv_fraction: float = 0.9,
                   layers: int | None = None, decode_batch: int = 32,
                   decode_context: int = 1024) -> Price:
    """Seesaw's move of `layers` layers' KV (default all of them) for a TP change tp_from ->
    tp_to with `kv_fraction` of the KV in use, as a fraction of a decode step of `decode_batch`
    sequences at `decode_context` tokens (Figure 11's axis; transform_slowdown's `serial` is
    Gyges' without overlap on the same axis). Terms: `offload` (each GPU's KV of those layers
    to host memory over PCIe at eff_xfer) and `reload` (its share in the new geometry back);
    the GPUs' PCIe links run in parallel."""
    _need(cost, "roofline", "seesaw_reshard")
    if not 0 <= kv_fraction <= 1:
        raise MechanismError(f"kv_fraction must be in [0, 1], got {kv_fraction!r}")
    lo, hi = _check_tps(tp_from, tp_to)
    L = cost.model.num_hidden_layers
    layers = L if layers is None else layers
    if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= L:
        raise MechanismError(f"layers must be an int in [1, {L}], got {layers!r}")
    kv_tokens = kv_fraction * cost.max_tokens(lo) * (hi // lo)   # as transform_slowdown's
    # each of the hi GPUs holds 1/hi of the group's KV before and after
    per_gpu = kv_tokens * cost.model.kv_bytes_per_token(cost.dtype_bytes, 1) / hi * layers / L
    pcie = links_mod.host_link(cost.gpu).bw * cost.eff_xfer
    step, _ = _decode(cost, tp_from, decode_batch, decode_context)
    return _price({"offload": per_gpu / pcie / step, "reload": per_gpu / pcie / step})


def kunserve_exchange(pcost, tokens, layers=None) -> Price:
    """The KV exchange of a drop that forms a buddy group of len(tokens) members, member k
    holding tokens[k] live tokens of every layer and keeping layers[k] of them afterwards
    (default: an even split). Terms: `bytes` (the busiest member's sends or receives over the
    buddy link at eff_xfer) and `latency` (one message)."""
    _need(pcost, "pipeline", "kunserve_exchange")
    g = len(tokens)
    if not 2 <= g <= pcost.n_stages:
        raise MechanismError(f"a buddy group has 2 to {pcost.n_stages} members, got {g}")
    n = pcost.n_layers
    if layers is None:
        layers = [n // g + (i < n % g) for i in range(g)]
    if len(layers) != g or sum(layers) != n or min(layers) < 1:
        raise MechanismError(f"layers {list(layers)} are not {g} shares of {n} layers")
    everyone = float(sum(tokens))
    most = 0.0
    for t, keep in zip(tokens, layers):
        sent = t * pcost.kv_layer * (n - keep)
        received = (everyone - t) * pcost.kv_layer * keep
        most = max(most, sent, received)
    link = stage_link(pcost)
    return _price({"bytes": most / (link.bw * pcost.eff_xfer), "latency": link.latency})
