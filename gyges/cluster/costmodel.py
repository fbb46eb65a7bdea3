"""Cost models of the simulator: Python computes the parameters, C evaluates them.

A `CostModel` prices one step of one instance and one phase of a parallelism transformation
(csrc/policy/cost.h states the formulas; `step_time` and `phase_time` below are their float64
reference, which the tests compare with the C evaluation). Per TP rank of a TP-`tp` instance:

    bytes  = weight_bytes / tp + kv_rank * (kv_read_tokens + n_tokens)
    flops  = (2 * matmul_params * n_tokens + 2 * lm_head_params * n_samples
              + attn_flops_per_pair * attn_pairs) / tp
    step   = step_overhead + max(bytes / (hbm_bw * eff_bw), flops / (peak * eff_flops))
             + [tp > 1] 2 * layers * (2 (tp-1)/tp * n_tokens * hidden * dtype / (link * eff_link)
                                      + allreduce_latency)
    under a transformation: step * (1 + transform_slowdown), transform_slowdown derived by
    gyges.cluster.mechanisms.transform_slowdown (the KV phase's HBM and link traffic) unless given

KV room of a TP-`tp` instance: tp * (memory * mem_util - activation) - weights, in blocks of
`block_size` tokens (each rank holds max(1, kv_heads / tp) of the KV heads). During a scale-up
the FFN shards a rank drops (weights padded so that no bytes move, Gyges 4.2) become KV room
first (capacity_mid). The longest prompt it can prefill (Gyges Table 1's "maximal supported
sequence") is smaller: while a prompt is prefilled its activations need room too, so
max_input = room / (kv_rank + prefill_act_bytes / tp). Transformation phases: bytes moved per GPU / (link * eff_xfer) +
layers * phase_latency_per_layer; the KV phase moves the heads that change owner
((1 - small/large) of the KV in use), the scale-down weight phase gathers the FFN shards a rank
lacks.

Presets: GPU specs (A100-40GB, A100-80GB, H20, H100, H200, L40S) and the paper-scale
ModelConfig presets. The efficiency factors default to CALIBRATION: fitted so that Qwen2.5-32B
on H20 reproduces Gyges Table 1 (benchmarks/bench_sim.py --calibrate redoes the fit).

`PipelineCost` is the pipeline model of csrc/policy/pipeline.h (PipeLive): one GPU per stage, each
of its own kind, the layers split over them; it prices a step (the per-layer pieces of the
roofline above, summed over the stages, plus the hand-offs over the link), sizes the KV cache
(PipeLive's MaxBlocks, the least over the stages) and costs a re-split (the moved layers'
weights and KV over the link), and finds the static splits the PipeLive paper compares with
(`prefill_optimal`, `decode_optimal`, `balanced`).

`CostModel.profiled(samples, ...)` fits the efficiency factors and the step overhead to measured
(batch shape -> step time) samples by least squares on the same functional form, so that the
simulator can be compared with a real engine; gyges.cluster.profile.ProfiledCost measures a real
Host over a grid of batch shapes instead and prices steps by what it measured (a step linear in
its shape per TP, csrc/policy/cost.h's profiled backend). `ConstantCost` is for hand-checked
tests.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

from ..models.config import ModelConfig
from ..core.errors import InvalidArgumentError
from . import links, mechanisms

__all__ = ["GPUSpec", "GPUS", "CALIBRATION", "GROUNDED", "CALIBRATIONS", "CostModel",
           "ConstantCost", "PipelineCost", "CostModelError",
           "gpu_spec", "model_config", "MODEL_NAMES", "PHASES", "RDMA_100G", "RDMA_200G",
           "PCIE4_X16"]

GiB = 1024 ** 3

# Phase kinds, as in csrc/policy/cost.h.
PHASES = {"weights_drop": 0, "kv_scatter": 1, "weights_gather": 2}
# How a transformation moves its bytes (cost.h's reshard, in this order).
RESHARDS = ("gyges", "seesaw")


class CostModelError(InvalidArgumentError):
    """An unknown GPU or model name, or cost parameters that make no sense."""


@dataclass(frozen=True)
class GPUSpec:
    """One GPU: memory (bytes), HBM bandwidth (bytes/s), dense bf16 FLOP/s, and the bandwidth
    one GPU can send to a peer (bytes/s, one direction: NVLink, or PCIe for the L40S)."""
    name: str
    memory: float
    hbm_bw: float
    peak_flops: float
    link_bw: float


# Public datasheet numbers (dense bf16, no sparsity; NVLink per direction = half the quoted
# bidirectional figure). Memory as the driver reports it, in GiB.
GPUS = {
    "a100-40gb": GPUSpec("A100-40GB", 40 * GiB, 1.555e12, 312e12, 300e9),
    "a100-80gb": GPUSpec("A100-80GB", 80 * GiB, 2.039e12, 312e12, 300e9),
    # the A100's China variant (KunServe's testbed): same memory, HBM and FLOPs, NVLink 400 GB/s
    # bidirectional; across servers its link is the NIC (RDMA_100G, RDMA_200G below)
    "a800-80gb": GPUSpec("A800-80GB", 80 * GiB, 2.039e12, 312e12, 200e9),
    "h20": GPUSpec("H20", 96 * GiB, 4.0e12, 148e12, 450e9),
    "h100": GPUSpec("H100-SXM", 80 * GiB, 3.35e12, 989e12, 450e9),
    "h200": GPUSpec("H200", 140 * GiB, 4.8e12, 989e12, 450e9),
    "l40s": GPUSpec("L40S", 45 * GiB, 0.864e12, 362e12, 32e9),
}
_GPU_ALIASES = {"a800": "a800-80gb", "a100": "a100-80gb", "a10040": "a100-40gb", "a10080": "a100-80gb",
                "h100sxm": "h100", "h100-sxm": "h100"}

MODEL_NAMES = {
    "llama2-7b": "llama2_7b",
    "llama3-8b": "llama3_8b",
    "qwen2.5-14b": "qwen2_5_14b",
    "qwen2.5-32b": "qwen2_5_32b",
    "qwen3-32b": "qwen3_32b",
    "llama3-70b": "llama3_70b",
    "qwen3-30b-a3b": "qwen3_30b_a3b",
    "mixtral-8x7b": "mixtral_8x7b",
}

# Links between servers, bytes/s one direction (a pipeline's link_bw across servers: KunServe's
# 200 Gbps GPU-direct RDMA for Qwen-2.5-14B, 100 Gbps for its multi-GPU runs), and a GPU's
# PCIe 4.0 x16 read of host memory (a restore from the host copy of the weights).
RDMA_100G = links.RDMA_100G.bw
RDMA_200G = links.RDMA_200G.bw
PCIE4_X16 = 25e9

# The efficiency factors and latencies the defaults use: fitted on Qwen2.5-32B / H20 to Gyges
# Table 1 (see benchmarks/bench_sim.py, which prints the fit and its error).
CALIBRATION = {
    "eff_flops": 0.302,
    "eff_link": 0.00898,
    "allreduce_latency": 62.7e-6,
    "step_overhead": 7.10e-3,
    # Fitted to Table 1's "maximal supported sequence" row (3.75K, 41.25K, 120.5K): the memory
    # share the serving stack leaves usable and the activation bytes a prompt token needs while
    # it is prefilled (at TP1; a TP-tp rank holds 1/tp of them).
    "mem_util": 0.855,
    "prefill_act_bytes": 1.64e6,
}

# A calibration grounded in public measurements instead (`calibration="grounded"`): the link
# terms are cited, and only the compute efficiency is fitted, on Table 1's TP1 row, the one row
# with no communication in it; TP2 and TP4 are held out (benchmarks/bench_sim.py prints both
# calibrations' errors side by side). Table 1's TP rows then come out 1.5x (TP2) and 2.9x (TP4)
# the paper's: what CALIBRATION's eff_link of 1% of NVLink absorbs is a cost in proportion to
# the all-reduced bytes that no term of NVLink has (bench_sim's missing-term table).
GROUNDED = {
    # fitted: Table 1's TP1 throughput alone (bench_sim --calibrate --calibration grounded)
    "eff_flops": 0.292,
    # cited: NCCL all-reduce bus bandwidth over NVLink 4 is 0.8-0.87 of the link per direction
    # (nccl-tests on 8 x H100 SXM; NVIDIA/nccl issue 1264 measures 783 of 900 GB/s)
    "eff_link": 0.80,
    # cited: NCCL's ring LL latency model at 4 ranks over NVLink (links.NVLINK4: 3.6 us + 6 hops
    # of 0.47 us)
    "allreduce_latency": links.NVLINK4.allreduce(0, 4),
    # chosen: a serving engine's CPU work per step (scheduling, input preparation, output
    # processing), milliseconds per step by vLLM's own profile (vLLM blog, 2024-09-05: 29% of
    # an 8B model's serving time on one H100); Table 1's TP1 row barely depends on it
    # (eff_flops fits 0.279-0.308 for 2-10 ms)
    "step_overhead": 5e-3,
    # memory: as CALIBRATION (Table 1's maximal-sequence row; no throughput term touches them)
    "mem_util": CALIBRATION["mem_util"],
    "prefill_act_bytes": CALIBRATION["prefill_act_bytes"],
}
CALIBRATIONS = {"table1": CALIBRATION, "grounded": GROUNDED}

# Not calibrated: our choices, documented.
DEFAULTS = {
    "eff_bw": 0.80,                # typical achieved HBM bandwidth of decode GEMVs
    "eff_xfer": 0.70,              # bulk NVLink copies of a transformation
    "activation_fraction": 0.15,   # Gyges 3.1: 14.3 GB of runtime activations on a 96 GB H20
    "phase_latency_per_layer": 2e-3,   # driver calls per layer per phase (Gyges 6.2.2 scale)
}
# transform_slowdown and PipelineCost.stop_time are not here: gyges.cluster.mechanisms derives
# them from what the mechanisms move (Gyges 6.2.3's < 1% and PipeLive's ~10 ms are checks).


def _calibration(name) -> dict:
    if not isinstance(name, str) or name not in CALIBRATIONS:
        raise CostModelError(f"calibration must be one of {', '.join(CALIBRATIONS)}, got "
                             f"{name!r}")
    return CALIBRATIONS[name]


def _norm(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(" ", "-")


def gpu_spec(gpu) -> GPUSpec:
    """A GPUSpec from a preset name (case-insensitive: 'h20', 'A100-80GB', ...) or as given."""
    if isinstance(gpu, GPUSpec):
        return gpu
    if not isinstance(gpu, str):
        raise CostModelError(f"gpu must be a preset name or a GPUSpec, got {gpu!r}")
    key = _norm(gpu)
    key = _GPU_ALIASES.get(key, _GPU_ALIASES.get(key.replace("-", ""), key))
    if key not in GPUS:
        raise CostModelError(f"unknown GPU {gpu!r}; known: {', '.join(GPUS)}")
    return GPUS[key]


def model_config(model) -> ModelConfig:
    """A ModelConfig from a preset name ('qwen2.5-32b', 'llama3_8b', 'Qwen2.5-32B', ...) or as
    given."""
    if isinstance(model, ModelConfig):
        return model
    if not isinstance(model, str):
        raise CostModelError(f"model must be a preset name or a ModelConfig, got {model!r}")
    key = _norm(model)
    attr = MODEL_NAMES.get(key)
    if attr is None:
        for name, a in MODEL_NAMES.items():
            if key in (a, a.replace("_", "-"), name.replace(".", "-"), name.replace(".", "")):
                attr = a
    if attr is None:
        raise CostModelError(f"unknown model {model!r}; known: {', '.join(MODEL_NAMES)}")
    return getattr(ModelConfig, attr)()


def _ffn_widths(m: ModelConfig):
    """Per layer, (FFN width a token uses, FFN width stored): the dense FFN's, or in an MoE
    layer experts_per_tok (and the shared expert) of the experts' and all of them."""
    for i in range(m.num_hidden_layers):
        if not m.is_sparse_layer(i):
            yield m.intermediate_size, m.intermediate_size
        else:
            shared = m.shared_expert_intermediate_size
            yield (m.num_experts_per_tok * m.moe_intermediate_size + shared,
                   m.num_experts * m.moe_intermediate_size + shared)


def _matmul_params(m: ModelConfig) -> int:
    """Parameters of the decoder layers a token multiplies by (an MoE layer's routed experts and
    its router, not the others)."""
    h, q, kv = m.hidden_size, m.q_size, m.kv_size
    used = sum(u for u, _ in _ffn_widths(m))
    routers = sum(m.num_experts for i in range(m.num_hidden_layers) if m.is_sparse_layer(i))
    return m.num_hidden_layers * (h * q + 2 * h * kv + q * h) + 3 * h * used + h * routers


def _expert_params(m: ModelConfig) -> int:
    """Parameters of the routed experts (what a step reads only where its tokens go)."""
    return sum(3 * m.hidden_size * m.moe_intermediate_size * m.num_experts
               for i in range(m.num_hidden_layers) if m.is_sparse_layer(i))


@dataclass(frozen=True)
class CostModel:
    """The roofline cost model of one model on one GPU type (see the module docstring)."""
    model: ModelConfig
    gpu: GPUSpec
    dtype_bytes: int = 2
    eff_bw: float = DEFAULTS["eff_bw"]
    eff_flops: float = CALIBRATION["eff_flops"]
    eff_link: float = CALIBRATION["eff_link"]
    eff_xfer: float = DEFAULTS["eff_xfer"]
    step_overhead: float = CALIBRATION["step_overhead"]
    allreduce_latency: float = CALIBRATION["allreduce_latency"]
    phase_latency_per_layer: float = DEFAULTS["phase_latency_per_layer"]
    transform_slowdown: float | None = None   # None: derived (slowdown())
    mem_util: float = CALIBRATION["mem_util"]
    activation_bytes: float | None = None   # per GPU; None: activation_fraction of its memory
    prefill_act_bytes: float = CALIBRATION["prefill_act_bytes"]  # per prompt token at TP1
    # 0: an instance of tp GPUs is tensor parallel; u: sequence parallel over TP-u parts when
    # tp > u (LoongServe's elastic instances of u GPUs, cost.h)
    sequence_parallel: int = 0
    # 0: as above; q >= 2: an instance of exactly q GPUs is a q-stage pipeline of equal stages
    # (Seesaw's prefill phase, cost.h's pipeline_degree): no all-reduce, min(q, n_seqs)
    # micro-batches in flight, and its weights laid out by layers
    pipeline_degree: int = 0
    # how a transformation moves its bytes: "gyges" (GPU to GPU over the link: the KV heads
    # that change owner, the FFN shards a rank lacks) or "seesaw" (through host memory over
    # PCIe, links.host_link: every GPU's KV out and its new share back, the FFN shards from the
    # host copy; the simulator stops the instances meanwhile, sim.run(reshard=...))
    reshard: str = "gyges"
    note: str = field(default="", compare=False)

    kind = "roofline"

    def __post_init__(self):
        for name in ("eff_bw", "eff_flops", "eff_link", "eff_xfer"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or v <= 0:
                raise CostModelError(f"{name} must be a finite number > 0, got {v!r}")
        for name in ("step_overhead", "allreduce_latency", "phase_latency_per_layer",
                     "transform_slowdown"):
            v = getattr(self, name)
            if name == "transform_slowdown" and v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or v < 0:
                raise CostModelError(f"{name} must be a finite number >= 0, got {v!r}")
        v = self.prefill_act_bytes
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise CostModelError(f"prefill_act_bytes must be a finite number >= 0, got {v!r}")
        u = self.sequence_parallel
        if isinstance(u, bool) or not isinstance(u, int) or u < 0 or u & (u - 1):
            raise CostModelError(f"sequence_parallel must be 0 or a power of two, got {u!r}")
        q = self.pipeline_degree
        if isinstance(q, bool) or not isinstance(q, int) or q < 0 or q == 1 or q & (q - 1) \
                or q > self.model.num_hidden_layers:
            raise CostModelError(f"pipeline_degree must be 0 or a power of two >= 2 and at most "
                                 f"the model's {self.model.num_hidden_layers} layers, got {q!r}")
        if not 0 < self.mem_util <= 1:
            raise CostModelError(f"mem_util must be in (0, 1], got {self.mem_util!r}")
        if self.reshard not in RESHARDS:
            raise CostModelError(f"reshard must be one of {', '.join(RESHARDS)}, got "
                                 f"{self.reshard!r}")

    @classmethod
    def create(cls, model="qwen2.5-32b", gpu="h20", calibration: str = "table1",
               **overrides) -> "CostModel":
        """`model` on `gpu` with the factors of `calibration` ('table1': fitted to Gyges Table 1,
        the default; 'grounded': cited link terms, GROUNDED), any field overridden."""
        try:
            return cls(model=model_config(model), gpu=gpu_spec(gpu),
                       **{**_calibration(calibration), **overrides})
        except TypeError as e:
            raise CostModelError(f"bad cost model option: {e}") from None

    def replace(self, **changes) -> "CostModel":
        return dataclasses.replace(self, **changes)

    # ---- shapes ----

    @property
    def weight_bytes(self) -> float:
        return float(self.model.param_count() * self.dtype_bytes)

    @property
    def ffn_bytes(self) -> float:
        """The FFN weights: dense FFNs, experts and shared experts (what TP shards)."""
        m = self.model
        return float(3 * m.hidden_size * sum(w for _, w in _ffn_widths(m)) * self.dtype_bytes)

    @property
    def expert_bytes(self) -> float:
        """The routed experts' weights (0 for a dense model)."""
        return float(_expert_params(self.model) * self.dtype_bytes)

    @property
    def activation(self) -> float:
        if self.activation_bytes is not None:
            return float(self.activation_bytes)
        return DEFAULTS["activation_fraction"] * self.gpu.memory

    def kv_bytes_per_token_rank(self, tp: int) -> float:
        """One token's KV on one rank of a TP-`tp` instance."""
        return float(self.model.kv_bytes_per_token(self.dtype_bytes, tp))

    def kv_room(self, tp: int, ffn_tp: int | None = None) -> float:
        """Bytes of KV room per rank; ffn_tp: the TP the FFN is already sharded for (a scale-up
        under way), default tp."""
        ffn_tp = tp if ffn_tp is None else ffn_tp
        weights = (self.weight_bytes - self.ffn_bytes) / tp + self.ffn_bytes / ffn_tp
        return self.gpu.memory * self.mem_util - self.activation - weights

    def kv_blocks(self, tp: int, block_size: int = 16, ffn_tp: int | None = None) -> int:
        """KV blocks of a TP-`tp` instance (0 when the weights do not fit)."""
        room = self.kv_room(tp, ffn_tp)
        if room <= 0:
            return 0
        return int(room // (self.kv_bytes_per_token_rank(tp) * block_size))

    def capacities(self, max_tp: int, block_size: int = 16) -> tuple[list[int], list[int]]:
        """(capacity, capacity_mid) per level TP 1, 2, 4, ..., max_tp, as the simulator takes."""
        cap, mid = [], []
        tp = 1
        while tp <= max_tp:
            cap.append(self.kv_blocks(tp, block_size))
            mid.append(max(cap[-1], self.kv_blocks(tp, block_size, ffn_tp=2 * tp)))
            tp *= 2
        return cap, mid

    def max_tokens(self, tp: int, block_size: int = 16) -> int:
        """The most tokens (prompts + outputs) the KV of a TP-`tp` instance can hold."""
        return self.kv_blocks(tp, block_size) * block_size

    def max_input_tokens(self, tp: int) -> int:
        """The longest prompt a TP-`tp` instance can prefill: its KV and its activations while
        it is prefilled (both split over the ranks) must fit the room left after the weights."""
        room = self.kv_room(tp)
        if room <= 0:
            return 0
        return int(room // (self.kv_bytes_per_token_rank(tp) + self.prefill_act_bytes / tp))

    def max_inputs(self, max_tp: int) -> list[int]:
        """max_input_tokens per level TP 1, 2, 4, ..., max_tp, as the simulator takes them."""
        return [max(1, self.max_input_tokens(1 << l)) for l in range(int(math.log2(max_tp)) + 1)]

    def slowdown(self) -> float:
        """transform_slowdown as given, else derived: the KV phase of the first merge (the
        smallest TP the model fits -> twice it) with 90% of the KV in use (Gyges 6.2.1's
        setting), its bytes spread over the phase (gyges.cluster.mechanisms)."""
        if self.transform_slowdown is not None:
            return float(self.transform_slowdown)
        tp = 1
        while tp <= 64 and self.kv_blocks(tp) < 1:
            tp *= 2
        if tp > 64:
            return 0.0
        return mechanisms.transform_slowdown(self, tp, 2 * tp).seconds

    # ---- the parameters C evaluates ----

    def params(self) -> dict:
        return {**self._params(), "transform_slowdown": self.slowdown()}

    def _params(self) -> dict:
        """params() but the slowdown (which is derived from the others)."""
        m = self.model
        return {
            "weight_bytes": self.weight_bytes,
            "matmul_params": float(_matmul_params(m)),
            "lm_head_params": float(m.vocab_size * m.hidden_size),
            "attn_flops_per_pair": float(4 * m.num_hidden_layers * m.num_attention_heads
                                         * m.head_dim),
            "kv_bytes_per_token": float(m.kv_bytes_per_token(self.dtype_bytes, 1)),
            "allreduce_bytes_per_token": float(m.hidden_size * self.dtype_bytes),
            "ffn_bytes": self.ffn_bytes,
            "expert_bytes": self.expert_bytes,
            "n_experts": int(m.num_experts),
            "experts_per_tok": int(m.num_experts_per_tok if m.is_moe else 0),
            "kv_heads": int(m.num_key_value_heads),
            "n_layers": int(m.num_hidden_layers),
            "hbm_bw": float(self.gpu.hbm_bw),
            "peak_flops": float(self.gpu.peak_flops),
            "link_bw": float(self.gpu.link_bw),
            "eff_bw": float(self.eff_bw),
            "eff_flops": float(self.eff_flops),
            "eff_link": float(self.eff_link),
            "eff_xfer": float(self.eff_xfer),
            "step_overhead": float(self.step_overhead),
            "allreduce_latency": float(self.allreduce_latency),
            "phase_latency_per_layer": float(self.phase_latency_per_layer),
            "sequence_parallel": int(self.sequence_parallel),
            "pipeline_degree": int(self.pipeline_degree),
            "reshard": RESHARDS.index(self.reshard),
            "host_bw": float(links.host_link(self.gpu).bw),
        }

    # ---- the float64 reference of csrc/policy/cost.c ----

    def weight_read(self, n_tokens: int) -> float:
        """Bytes of weights a step of n_tokens reads (every rank together): an MoE layer's
        experts only where its tokens go, n tokens routed uniformly and independently touching
        1 - (1 - k/E)^n of them."""
        m = self.model
        if not m.is_moe:
            return self.weight_bytes
        touched = 1.0 - (1.0 - m.num_experts_per_tok / m.num_experts) ** n_tokens
        return self.weight_bytes - self.expert_bytes + self.expert_bytes * touched

    def step_terms(self, tp, n_tokens, n_samples, kv_read_tokens, attn_pairs):
        """(bytes per rank, FLOPs per rank, communication seconds) of one step. A TP instance
        is one part; a sequence-parallel one of tp GPUs (sequence_parallel = u < tp) is tp / u
        TP-u parts, each computing 1/(tp/u) of the tokens and keeping their KV (cost.h)."""
        p = self._params()
        u = int(self.sequence_parallel)
        parts, tp = (tp // u, u) if 0 < u < tp else (1, tp)
        heads = max(1, p["kv_heads"] // tp)
        kv_rank = p["kv_bytes_per_token"] * heads / p["kv_heads"]
        nbytes = self.weight_read(-(-n_tokens // parts)) / tp \
            + kv_rank * (kv_read_tokens + n_tokens) / parts
        attn_flops = p["attn_flops_per_pair"] * attn_pairs
        flops = (2 * p["matmul_params"] * n_tokens + 2 * p["lm_head_params"] * n_samples
                 + attn_flops) / (tp * parts)
        payload = p["allreduce_bytes_per_token"] * n_tokens / parts
        comm = 0.0
        if tp > 1:
            one = 2 * (tp - 1) / tp * payload / (p["link_bw"] * p["eff_link"]) \
                + p["allreduce_latency"]
            comm = 2 * p["n_layers"] * one
        if parts > 1:   # the KV ring behind the attention, and the partials combined per layer
            ring = (parts - 1) / parts * kv_rank * n_tokens / (p["link_bw"] * p["eff_xfer"])
            hidden = attn_flops / (tp * parts) / (p["peak_flops"] * p["eff_flops"])
            comm += max(0.0, ring - hidden)
            partials = p["allreduce_bytes_per_token"] * n_tokens / tp
            comm += p["n_layers"] * (2 * (parts - 1) / parts * partials
                                     / (p["link_bw"] * p["eff_link"]) + p["allreduce_latency"])
        return nbytes, flops, comm

    def step_time(self, tp: int, n_tokens: int, n_seqs: int = 1, n_samples: int = 1,
                  kv_read_tokens: float = 0.0, attn_pairs: float = 0.0,
                  transforming: bool = False) -> float:
        if n_tokens <= 0:
            return 0.0
        q = self.pipeline_degree
        if q > 1 and tp == q:
            t = self._pipeline_step(q, n_tokens, n_seqs, n_samples, kv_read_tokens, attn_pairs)
        else:
            nbytes, flops, comm = self.step_terms(tp, n_tokens, n_samples, kv_read_tokens,
                                                  attn_pairs)
            t = self.step_overhead + self._bound(nbytes, flops) + comm
        return t * (1 + self.slowdown()) if transforming else t

    def _bound(self, nbytes, flops):
        """The roofline of one GPU: the slower of reading nbytes and computing flops."""
        return max(nbytes / (self.gpu.hbm_bw * self.eff_bw),
                   flops / (self.gpu.peak_flops * self.eff_flops))

    def _pipeline_step(self, q, n_tokens, n_seqs, n_samples, kv_read_tokens, attn_pairs):
        """A step of a q-stage pipeline of equal stages (pipeline_degree): m = min(q, n_seqs)
        micro-batches circulate, one stage computes 1/(m q) of the step per micro-batch, and a
        step is the round trip of one: q stage times and q - 1 hand-offs (cost.h)."""
        p = self._params()
        m = min(q, max(1, n_seqs))
        share = 1.0 / (m * q)
        nbytes = self.weight_read(-(-n_tokens // m)) / q \
            + p["kv_bytes_per_token"] * (kv_read_tokens + n_tokens) * share
        flops = (2 * p["matmul_params"] * n_tokens + 2 * p["lm_head_params"] * n_samples
                 + p["attn_flops_per_pair"] * attn_pairs) * share
        stage = self._bound(nbytes, flops)
        hand_off = p["allreduce_bytes_per_token"] * n_tokens / m / p["link_bw"] \
            + p["allreduce_latency"]
        return self.step_overhead + q * stage + (q - 1) * hand_off

    def phase_time(self, phase: str, tp_from: int, tp_to: int, kv_tokens: float = 0.0):
        """(seconds, bytes each GPU receives) of one transformation phase."""
        if phase not in PHASES:
            raise CostModelError(f"unknown phase {phase!r}; known: {', '.join(PHASES)}")
        lo, hi = min(tp_from, tp_to), max(tp_from, tp_to)
        p = self._params()
        seesaw = self.reshard == "seesaw"
        if phase == "kv_scatter":   # the heads that change owner
            nbytes = (1 - lo / hi) * kv_tokens * p["kv_bytes_per_token"] / hi
        elif phase == "weights_gather":
            nbytes = self.ffn_bytes * (1 / lo - 1 / hi)
        else:
            nbytes = 0.0
        q = self.pipeline_degree
        if q > 1 and lo == q and hi > lo:
            # between a pipeline's layout (layers) and TP-hi's (heads): the new share but what
            # a GPU holds of it already (cost.c)
            if phase == "kv_scatter":
                whole = kv_tokens * p["kv_bytes_per_token"]
                nbytes = whole / hi - whole / (hi * hi)
            else:
                w = self.weight_bytes
                nbytes = (w / hi if tp_to == hi else w / q) - w / (q * hi)
        if seesaw and phase == "kv_scatter":   # all of a GPU's KV out and its new share back
            nbytes = 2 * kv_tokens * p["kv_bytes_per_token"] / hi
        link = p["host_bw"] if seesaw else self.gpu.link_bw
        t = nbytes / (link * self.eff_xfer) \
            + self.model.num_hidden_layers * self.phase_latency_per_layer
        return t, nbytes

    @staticmethod
    def batch_shape(entries):
        """Shape of a batch given [(context_before, n_new, samples), ...]: returns the keyword
        arguments of step_time (n_tokens, n_seqs, n_samples, kv_read_tokens, attn_pairs)."""
        n_tokens = n_seqs = n_samples = 0
        kv_read = pairs = 0.0
        for ctx, n, samples in entries:
            if n <= 0:
                continue
            end = ctx + n
            n_tokens += n
            n_seqs += 1
            n_samples += int(bool(samples))
            kv_read += end
            pairs += (end * (end + 1) - ctx * (ctx + 1)) / 2
        return {"n_tokens": n_tokens, "n_seqs": n_seqs, "n_samples": n_samples,
                "kv_read_tokens": kv_read, "attn_pairs": pairs}

    # ---- fitting to measurements ----

    @classmethod
    def profiled(cls, samples, model, gpu, tp: int = 1, iterations: int = 50,
                 **fixed) -> "CostModel":
        """Fit eff_bw, eff_flops and step_overhead to measured steps by least squares on
        t = overhead + max(bytes / (bw eff_bw), flops / (peak eff_flops)) (+ the known TP
        communication). `samples`: a structured array or list of dicts with n_tokens, n_samples,
        kv_read_tokens, attn_pairs and seconds (n_seqs optional). Each sample is assigned to the
        memory- or the compute-bound side by the current fit; the three coefficients then come
        from one linear least-squares solve; repeat until the assignment stops changing.
        prefill_act_bytes defaults to 0 here (an engine that prefills in chunks: only its KV
        limits a prompt) unless `fixed` sets it."""
        fixed.setdefault("prefill_act_bytes", 0.0)
        base = cls.create(model, gpu, **fixed)
        cols = {k: np.asarray([_get(s, k) for s in samples], dtype=np.float64)
                for k in ("n_tokens", "n_samples", "kv_read_tokens", "attn_pairs", "seconds")}
        n = cols["seconds"].size
        if n < 3:
            raise CostModelError(f"need at least 3 samples to fit 3 parameters, got {n}")
        if np.any(~np.isfinite(cols["seconds"])) or np.any(cols["seconds"] <= 0):
            raise CostModelError("sample times must be finite and > 0")
        terms = [base.step_terms(tp, t, s, k, a) for t, s, k, a in
                 zip(cols["n_tokens"], cols["n_samples"], cols["kv_read_tokens"],
                     cols["attn_pairs"])]
        B = np.array([x[0] for x in terms]) / base.gpu.hbm_bw      # seconds at eff 1
        F = np.array([x[1] for x in terms]) / base.gpu.peak_flops
        y = cols["seconds"] - np.array([x[2] for x in terms])
        mem = B >= F                                               # start: the raw roofline
        coef = None
        for _ in range(iterations):
            X = np.stack([np.ones(n), np.where(mem, B, 0.0), np.where(mem, 0.0, F)], axis=1)
            # a side with no samples keeps a neutral coefficient
            keep = [0] + [j for j in (1, 2) if np.any(X[:, j] > 0)]
            sol, *_ = np.linalg.lstsq(X[:, keep], y, rcond=None)
            coef = np.array([0.0, 1.0 / base.eff_bw, 1.0 / base.eff_flops])
            coef[keep] = sol
            coef[1:] = np.maximum(coef[1:], 1e-6)
            coef[0] = max(coef[0], 0.0)
            new_mem = B * coef[1] >= F * coef[2]
            if np.array_equal(new_mem, mem):
                break
            mem = new_mem
        fitted = base.replace(step_overhead=float(coef[0]), eff_bw=float(1.0 / coef[1]),
                              eff_flops=float(1.0 / coef[2]),
                              note=f"profiled from {n} samples")
        return fitted

    def describe(self) -> dict:
        return {"kind": self.kind, "model": _model_name(self.model), "gpu": self.gpu.name,
                **{k: getattr(self, k) for k in ("eff_bw", "eff_flops", "eff_link", "eff_xfer",
                                                 "step_overhead", "allreduce_latency",
                                                 "phase_latency_per_layer", "mem_util",
                                                 "prefill_act_bytes")},
                "transform_slowdown": self.slowdown(),
                "activation_bytes": self.activation, "sequence_parallel": self.sequence_parallel,
                "pipeline_degree": self.pipeline_degree, "reshard": self.reshard,
                "note": self.note}


@dataclass(frozen=True)
class ConstantCost:
    """Every step that computes something takes `step_time`, every transformation phase
    `phase_time`; KV capacities (blocks per TP level 1, 2, 4, ...) are given, not derived."""
    step: float = 1.0
    phase: float = 0.0
    capacity: tuple = (64, 128, 256, 512)
    capacity_mid: tuple | None = None
    transform_slowdown: float = 0.0
    max_input: tuple | None = None   # longest prompt per TP level; None: only the KV limits

    kind = "constant"

    def __post_init__(self):
        if not (isinstance(self.step, (int, float)) and self.step > 0):
            raise CostModelError(f"step must be > 0, got {self.step!r}")
        if not (isinstance(self.phase, (int, float)) and self.phase >= 0):
            raise CostModelError(f"phase must be >= 0, got {self.phase!r}")

    def params(self) -> dict:
        return {"step_time": float(self.step), "phase_time": float(self.phase),
                "transform_slowdown": float(self.transform_slowdown)}

    def capacities(self, max_tp: int, block_size: int = 16):
        levels = int(math.log2(max_tp)) + 1
        if len(self.capacity) < levels:
            raise CostModelError(f"ConstantCost has capacities for {len(self.capacity)} TP "
                                 f"levels; max_tp {max_tp} needs {levels}")
        cap = [int(c) for c in self.capacity[:levels]]
        mid = cap if self.capacity_mid is None else [int(c) for c in self.capacity_mid[:levels]]
        return cap, mid

    def max_inputs(self, max_tp: int):
        if self.max_input is None:
            return None
        return [int(c) for c in self.max_input[:int(math.log2(max_tp)) + 1]]

    def describe(self) -> dict:
        return {"kind": self.kind, "step": self.step, "phase": self.phase,
                "capacity": list(self.capacity), "transform_slowdown": self.transform_slowdown}


@dataclass(frozen=True)
class PipelineCost:
    """A pipeline of one GPU per stage (`gpus`, in stage order, kinds may differ) serving `model`
    (csrc/policy/pipeline.h has the formulas; the methods below are their float64 reference).

    Per stage i with L_i layers: budget_i = memory_i * mem_util - activation_i - the stage's
    fixed weights (embedding on the first, final norm and LM head on the last); the KV blocks are
    MaxBlocks(i, L_i) = floor((budget_i - L_i W) / (L_i P)), W a layer's weight bytes, P a
    block's KV bytes in one layer; the pipeline's capacity is the least over its stages. A step
    splits into m micro-batches (micro_batches, at most one per stage and one per sequence) that
    circulate through the stages: step_overhead + the larger of m times the busiest stage's
    roofline over its layers for 1/m of the step and one micro-batch's round trip (the sum over
    the stages + (n - 1) hand-offs of its tokens * hidden * dtype bytes over link_bw, default the
    slowest stage GPU's link, plus link_latency); with flush=True every step fills and drains the
    pipeline instead: m + n - 1 slots of the busiest stage plus the hand-offs (GPipe's bubble). A re-split moves the layers each stage gains (weights and KV of the
    live tokens) at link_bw * eff_xfer, stages receiving in parallel, its steps slowed by
    transform_slowdown, then stops stop_time. Both default to None: derived by
    gyges.cluster.mechanisms (pipeline_slowdown: the migration's HBM traffic beside the step;
    pipelive_stop_layers for a re-split moving a quarter of the layers: the lagging KV, the
    commit handshake and the table swaps).
    """
    model: ModelConfig
    gpus: tuple
    dtype_bytes: int = 2
    eff_bw: float = DEFAULTS["eff_bw"]
    eff_flops: float = CALIBRATION["eff_flops"]
    eff_xfer: float = DEFAULTS["eff_xfer"]
    step_overhead: float = CALIBRATION["step_overhead"]
    transform_slowdown: float | None = None   # None: derived (slowdown())
    mem_util: float = CALIBRATION["mem_util"]
    activation_fraction: float = DEFAULTS["activation_fraction"]  # of each stage GPU's memory
    link_bw: float | None = None      # bytes/s between stages; None: the least of the GPUs'
    link_latency: float = 20e-6       # seconds per hand-off (our choice: an RDMA send)
    stop_time: float | None = None    # seconds of the stop at a commit; None: derived
                                      # (stop_seconds())
    host_bw: float = 0.0              # bytes/s of a host copy of the weights (KunServe's
                                      # restore reads it beside its peers); 0: none
    micro_batches: int | None = 1     # batches in flight (at most one per stage counts);
                                      # None: one per stage (vLLM's virtual engines). PipeLive's
                                      # figures here are measured with 1, KunServe's with None
    flush: bool = False               # every step fills and drains the pipeline (synchronous
                                      # steps: (m + n - 1) busiest stages, GPipe's bubble)
    note: str = field(default="", compare=False)

    kind = "pipeline"

    def __post_init__(self):
        if not isinstance(self.gpus, tuple) or not 2 <= len(self.gpus) <= 8:
            raise CostModelError(f"a pipeline has 2 to 8 stage GPUs, got {self.gpus!r}")
        for name in ("eff_bw", "eff_flops", "eff_xfer", "mem_util"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or v <= 0:
                raise CostModelError(f"{name} must be a finite number > 0, got {v!r}")
        for name in ("step_overhead", "transform_slowdown", "activation_fraction",
                     "link_latency", "stop_time", "host_bw"):
            v = getattr(self, name)
            if name in ("transform_slowdown", "stop_time") and v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or v < 0:
                raise CostModelError(f"{name} must be a finite number >= 0, got {v!r}")
        if self.link_bw is not None and not (isinstance(self.link_bw, (int, float))
                                             and math.isfinite(self.link_bw) and self.link_bw > 0):
            raise CostModelError(f"link_bw must be a number > 0, got {self.link_bw!r}")
        if not isinstance(self.flush, bool):
            raise CostModelError(f"flush must be True or False, got {self.flush!r}")
        if self.micro_batches is not None and (isinstance(self.micro_batches, bool) or not
                                               isinstance(self.micro_batches, int) or
                                               not 1 <= self.micro_batches <= 2**31 - 1):
            raise CostModelError(f"micro_batches must be None or an int >= 1, got "
                                 f"{self.micro_batches!r}")

    @classmethod
    def create(cls, model, gpus, calibration: str = "table1", **overrides) -> "PipelineCost":
        """The pipeline of `model` over the stage GPUs `gpus` (preset names or GPUSpecs), with
        `calibration`'s factors that a pipeline has (CostModel.create)."""
        if isinstance(gpus, (str, GPUSpec)) or not hasattr(gpus, "__len__"):
            raise CostModelError(f"gpus must be a list of stage GPUs, got {gpus!r}")
        mine = {k: v for k, v in _calibration(calibration).items()
                if k in {f.name for f in dataclasses.fields(cls)}}
        try:
            return cls(model=model_config(model), gpus=tuple(gpu_spec(g) for g in gpus),
                       **{**mine, **overrides})
        except TypeError as e:
            raise CostModelError(f"bad pipeline cost option: {e}") from None

    def replace(self, **changes) -> "PipelineCost":
        return dataclasses.replace(self, **changes)

    # ---- the model's per-layer pieces ----

    @property
    def n_stages(self) -> int:
        return len(self.gpus)

    @property
    def n_layers(self) -> int:
        return self.model.num_hidden_layers

    @property
    def _vocab_bytes(self) -> float:
        return float(self.model.vocab_size * self.model.hidden_size * self.dtype_bytes)

    @property
    def head_bytes(self) -> float:
        """The last stage's weights beyond its layers: final norm and (untied) LM head."""
        m = self.model
        head = 0.0 if m.tie_word_embeddings else self._vocab_bytes
        return head + m.hidden_size * self.dtype_bytes

    @property
    def layer_bytes(self) -> float:
        """W: one decoder layer's weight bytes."""
        m = self.model
        rest = m.param_count() * self.dtype_bytes - self._vocab_bytes - self.head_bytes
        return float(rest / m.num_hidden_layers)

    @property
    def kv_layer(self) -> float:
        """One token's K and V in one layer (all KV heads)."""
        return float(self.model.kv_bytes_per_token(self.dtype_bytes, 1) / self.n_layers)

    def stage_budget(self, i: int) -> float:
        gpu = self.gpus[i]
        fixed = (self._vocab_bytes if i == 0 else 0.0) + \
            (self.head_bytes if i == self.n_stages - 1 else 0.0)
        return gpu.memory * self.mem_util - self.activation_fraction * gpu.memory - fixed

    @property
    def link(self) -> float:
        return float(self.link_bw if self.link_bw is not None
                     else min(g.link_bw for g in self.gpus))

    def slowdown(self) -> float:
        """transform_slowdown as given, else mechanisms.pipeline_slowdown."""
        if self.transform_slowdown is not None:
            return float(self.transform_slowdown)
        return mechanisms.pipeline_slowdown(self).seconds

    def stop_seconds(self) -> float:
        """stop_time as given, else mechanisms.pipelive_stop_layers for a re-split whose busiest
        stage gains a quarter of the layers (C takes one stop for every re-split)."""
        if self.stop_time is not None:
            return float(self.stop_time)
        return mechanisms.pipelive_stop_layers(self, max(1, self.n_layers // 4)).seconds

    def params(self, block_size: int = 16, fixed_blocks: int = 0) -> dict:
        """What C's gy_sim_pipeline takes (fixed_blocks > 0: no KV resizing, see pipeline.h)."""
        m = self.model
        return {
            "n_layers": int(self.n_layers),
            "stages": [{"budget_bytes": float(self.stage_budget(i)), "hbm_bw": float(g.hbm_bw),
                        "peak_flops": float(g.peak_flops), "eff_bw": float(self.eff_bw),
                        "eff_flops": float(self.eff_flops)} for i, g in enumerate(self.gpus)],
            "layer_bytes": self.layer_bytes,
            "layer_params": float(_matmul_params(m) / m.num_hidden_layers),
            "attn_flops_per_pair": float(4 * m.num_attention_heads * m.head_dim),
            "kv_layer": self.kv_layer,
            "lm_head_params": float(m.vocab_size * m.hidden_size),
            "head_bytes": self.head_bytes,
            "act_bytes": float(m.hidden_size * self.dtype_bytes),
            "link_bw": self.link,
            "link_latency": float(self.link_latency),
            "eff_xfer": float(self.eff_xfer),
            "step_overhead": float(self.step_overhead),
            "transform_slowdown": self.slowdown(),
            "stop_time": self.stop_seconds(),
            "host_bw": float(self.host_bw),
            "micro_batches": int(self.n_stages if self.micro_batches is None else self.micro_batches),
            "flush": bool(self.flush),
            "block_size": int(block_size),
            "fixed_blocks": int(fixed_blocks),
        }

    # ---- the float64 reference of csrc/policy/pipeline.c ----

    def check_split(self, layers) -> tuple:
        layers = tuple(int(x) for x in layers)
        if len(layers) != self.n_stages or min(layers) < 1 or sum(layers) != self.n_layers:
            raise CostModelError(f"split {list(layers)} is not {self.n_stages} stages of at least "
                                 f"one layer adding up to {self.n_layers}")
        return layers

    def max_blocks(self, stage: int, n_layers: int, block_size: int = 16) -> int:
        """PipeLive's MaxBlocks(i, L) (0 when the layers' weights leave no room)."""
        room = self.stage_budget(stage) - n_layers * self.layer_bytes
        if n_layers < 1 or room <= 0:
            return 0
        return int(math.floor(room / (n_layers * self.kv_layer * block_size)))

    def capacity(self, layers, block_size: int = 16) -> int:
        layers = self.check_split(layers)
        return min(self.max_blocks(i, n, block_size) for i, n in enumerate(layers))

    @staticmethod
    def _firsts(layers):
        return [sum(layers[:i]) for i in range(len(layers))]

    @staticmethod
    def _overlap(a, na, b, nb):
        return max(0, min(a + na, b + nb) - max(a, b))

    def shrink_capacity(self, cur, tgt, block_size: int = 16) -> int:
        """B_shrink: the blocks while a re-split holds both layer sets."""
        cur, tgt = self.check_split(cur), self.check_split(tgt)
        fc, ft = self._firsts(cur), self._firsts(tgt)
        return min(self.max_blocks(i, cur[i] + tgt[i] - self._overlap(fc[i], cur[i], ft[i],
                                                                     tgt[i]), block_size)
                   for i in range(self.n_stages))

    def migration_time(self, cur, tgt, kv_tokens: float = 0.0):
        """(seconds, weight bytes, KV bytes) of a re-split's migration."""
        cur, tgt = self.check_split(cur), self.check_split(tgt)
        fc, ft = self._firsts(cur), self._firsts(tgt)
        most = w = kv = 0.0
        for i in range(self.n_stages):
            gained = tgt[i] - self._overlap(fc[i], cur[i], ft[i], tgt[i])
            wi, ki = gained * self.layer_bytes, gained * self.kv_layer * kv_tokens
            w, kv, most = w + wi, kv + ki, max(most, wi + ki)
        return most / (self.link * self.eff_xfer), w, kv

    def stage_times(self, layers, n_tokens, n_seqs=1, n_samples=1, kv_read_tokens=0.0,
                    attn_pairs=0.0):
        """Seconds of each stage's part of a step (the roofline over its layers)."""
        layers = self.check_split(layers)
        p = self.params()
        out = []
        for i, (L, g) in enumerate(zip(layers, self.gpus)):
            last = i == self.n_stages - 1
            nbytes = L * (p["layer_bytes"] + p["kv_layer"] * (kv_read_tokens + n_tokens)) + \
                (p["head_bytes"] if last else 0.0)
            flops = L * (2 * p["layer_params"] * n_tokens + p["attn_flops_per_pair"] * attn_pairs) \
                + (2 * p["lm_head_params"] * n_samples if last else 0.0)
            out.append(max(nbytes / (g.hbm_bw * self.eff_bw),
                           flops / (g.peak_flops * self.eff_flops)))
        return out

    def step_time(self, layers, n_tokens, n_seqs=1, n_samples=1, kv_read_tokens=0.0,
                  attn_pairs=0.0, transforming=False) -> float:
        """pipeline.h's step: m micro-batches of 1/m of the step each circulate through the
        stages; the busiest stage (m times) or one micro-batch's round trip bounds it."""
        if n_tokens <= 0:
            return 0.0
        m = self.n_stages if self.micro_batches is None else self.micro_batches
        m = max(1, min(m, self.n_stages, n_seqs))
        times = self.stage_times(layers, n_tokens / m, n_seqs, n_samples / m,
                                 kv_read_tokens / m, attn_pairs / m)
        hops = (self.n_stages - 1) * (
            n_tokens / m * self.model.hidden_size * self.dtype_bytes / self.link + self.link_latency)
        if self.flush:   # fill and drain: m + n - 1 slots of the busiest stage
            t = self.step_overhead + (m + self.n_stages - 1) * max(times) + hops
        else:
            t = self.step_overhead + max(m * max(times), sum(times) + hops)
        return t * (1 + self.slowdown()) if transforming else t

    # ---- profiles and the paper's static splits ----

    def splits(self, granularity: int = 2):
        """Every split whose stages (but the last, which takes the rest) are multiples of
        `granularity` layers, in the order C's gy_sim_pipeline_next_split gives them."""
        n, L, g = self.n_stages, self.n_layers, granularity

        def rec(prefix, left):
            if len(prefix) == n - 1:
                if left >= 1:
                    yield tuple(prefix) + (left,)
                return
            x = g
            while left - x >= 1:
                yield from rec(prefix + [x], left - x)
                x += g
        yield from rec([], L)

    def profile(self, layers, prompt: float, output: float, batch: int = 1):
        """(TTFT, TPOT) the cost model predicts for a split: one step prefilling `prompt` tokens,
        and one decode step of `batch` requests at context prompt + output / 2."""
        ttft = self.step_time(layers, **CostModel.batch_shape([(0, int(round(prompt)), True)]))
        ctx = int(round(prompt + output / 2))
        tpot = self.step_time(layers, **CostModel.batch_shape([(ctx, 1, True)] * batch))
        return ttft, tpot

    def _feasible(self, granularity, block_size, min_kv_tokens):
        out = [s for s in self.splits(granularity)
               if self.capacity(s, block_size) * block_size >= min_kv_tokens]
        if not out:
            raise CostModelError(f"no split of {self.n_layers} layers over {self.n_stages} "
                                 f"stages holds {min_kv_tokens} tokens of KV")
        return out

    def prefill_optimal(self, prompt=512, output=16, granularity=2, block_size=16,
                        min_kv_tokens=8192) -> tuple:
        """The split with the least predicted TTFT for prompts of `prompt` tokens (among those
        whose KV holds min_kv_tokens): the paper's Prefill-Optimal."""
        return min(self._feasible(granularity, block_size, min_kv_tokens),
                   key=lambda s: self.profile(s, prompt, output)[0])

    def decode_optimal(self, prompt=128, output=512, batch=32, granularity=2, block_size=16,
                       min_kv_tokens=8192) -> tuple:
        """The split with the least predicted TPOT for `batch` decodes (among those whose KV
        holds the batch and min_kv_tokens): the paper's Decode-Optimal."""
        need = max(min_kv_tokens, batch * (prompt + output))
        return min(self._feasible(granularity, block_size, need),
                   key=lambda s: self.profile(s, prompt, output, batch)[1])

    def balanced(self, prefill=(512, 16), decode=(128, 512), batch=32, granularity=2,
                 block_size=16, min_kv_tokens=8192) -> tuple:
        """The split whose stages are the most even: the least largest stage time over a prefill
        of prefill[0] tokens plus a decode step of `batch` requests of the decode shape (among
        those whose KV holds the batch): the paper's Balanced."""
        need = max(min_kv_tokens, batch * sum(decode))
        pf = CostModel.batch_shape([(0, prefill[0], True)])
        ctx = int(round(decode[0] + decode[1] / 2))
        dec = CostModel.batch_shape([(ctx, 1, True)] * batch)

        def worst(s):
            return max(a + b for a, b in zip(self.stage_times(s, **pf),
                                             self.stage_times(s, **dec)))
        return min(self._feasible(granularity, block_size, need), key=worst)

    def describe(self) -> dict:
        return {"kind": self.kind, "model": _model_name(self.model),
                "gpus": [g.name for g in self.gpus], "dtype_bytes": self.dtype_bytes,
                **{k: getattr(self, k) for k in ("eff_bw", "eff_flops", "eff_xfer",
                                                 "step_overhead", "mem_util",
                                                 "activation_fraction", "link_latency",
                                                 "host_bw")},
                "transform_slowdown": self.slowdown(), "stop_time": self.stop_seconds(),
                "link_bw": self.link, "note": self.note}


def _get(sample, key):
    if isinstance(sample, dict):
        return sample.get(key, 0.0) if key != "seconds" else sample[key]
    return sample[key]


def _model_name(m: ModelConfig) -> str:
    for name, attr in MODEL_NAMES.items():
        if getattr(ModelConfig, attr)() == m:
            return name
    return f"custom({m.hidden_size}x{m.num_hidden_layers})"
