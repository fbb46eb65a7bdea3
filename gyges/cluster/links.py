"""Interconnects of the simulator, priced by a latency-bandwidth (alpha-beta) model.

A `Link` is one kind of GPU-to-GPU (or GPU-to-host) path: its bandwidth per direction, from the
vendor's specification, and its latencies, from NCCL's own performance model. Every constant
below says where it comes from; none is a figure a seed paper reports for its mechanism (those
are what gyges.cluster.mechanisms checks its derived prices against).

    t(message of n bytes, one hop)      = base + hop + n / (bw * eff)
    t(ring all-reduce over k ranks)     = base + 2 (k - 1) hop + 2 (k - 1) / k * n / (bw * eff)

`eff` is the achieved fraction of the link for bulk copies (the cost models' eff_xfer: our
choice, documented there, not fitted to any paper's mechanism time).

Host-side costs are two constants: one control message between two processes on a host, and one
host-side runtime call (a kernel launch or a framework op that re-points a tensor view).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..core.errors import InvalidArgumentError

__all__ = ["Link", "LINKS", "NVLINK3", "NVLINK3_A800", "NVLINK4", "PCIE4_X16", "PCIE5_X16",
           "RDMA_100G", "RDMA_200G", "HOST_MESSAGE", "HOST_CALL", "gpu_link", "host_link",
           "LinkError"]


class LinkError(InvalidArgumentError):
    """A bad link parameter or message size."""


# NCCL's performance model (NVIDIA/nccl, src/graph/tuning.cc: "Latencies in us"): the ring
# algorithm's low-latency (LL) protocol, the one NCCL picks for small messages, starts at a base
# latency of 3.6 us and adds a per-step hardware latency of 0.47 us over NVLink, 1.0 us over
# PCIe and 2.7 us over the network (hwLat[NVLINK|PCI|NET][Ring][LL]).
_NCCL_LL_BASE = 3.6e-6
_NCCL_LL_HOP = {"nvlink": 0.47e-6, "pcie": 1.0e-6, "net": 2.7e-6}


@dataclass(frozen=True)
class Link:
    """One kind of link: `bw` bytes/s per direction, `base` seconds a collective or message pays
    once, `hop` seconds per step between two ranks; `kind` 'nvlink', 'pcie' or 'net'."""
    name: str
    bw: float
    kind: str
    base: float = _NCCL_LL_BASE
    hop: float | None = None

    def __post_init__(self):
        if self.kind not in _NCCL_LL_HOP:
            raise LinkError(f"link kind must be one of {', '.join(_NCCL_LL_HOP)}, got "
                            f"{self.kind!r}")
        if not (isinstance(self.bw, (int, float)) and math.isfinite(self.bw) and self.bw > 0):
            raise LinkError(f"bw must be a finite number > 0, got {self.bw!r}")
        if self.hop is None:
            object.__setattr__(self, "hop", _NCCL_LL_HOP[self.kind])

    @property
    def latency(self) -> float:
        """Seconds of one message from one rank to the next (alpha)."""
        return self.base + self.hop

    def transfer(self, nbytes: float, eff: float = 1.0) -> float:
        """Seconds to send `nbytes` to one peer at `eff` of the bandwidth."""
        _check_bytes(nbytes, eff)
        return self.latency + nbytes / (self.bw * eff)

    def allreduce(self, nbytes: float, ranks: int, eff: float = 1.0) -> float:
        """Seconds of a ring all-reduce of `nbytes` over `ranks` GPUs (0 for one rank)."""
        _check_bytes(nbytes, eff)
        if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
            raise LinkError(f"ranks must be an int >= 1, got {ranks!r}")
        if ranks == 1:
            return 0.0
        steps = 2 * (ranks - 1)
        return self.base + steps * self.hop + steps / ranks * nbytes / (self.bw * eff)

    def barrier(self, ranks: int) -> float:
        """Seconds of a barrier over `ranks` GPUs: an all-reduce of one element."""
        return self.allreduce(0.0, ranks)


def _check_bytes(nbytes, eff):
    if not (isinstance(nbytes, (int, float)) and math.isfinite(nbytes) and nbytes >= 0):
        raise LinkError(f"nbytes must be a finite number >= 0, got {nbytes!r}")
    if not (isinstance(eff, (int, float)) and math.isfinite(eff) and 0 < eff <= 1):
        raise LinkError(f"eff must be in (0, 1], got {eff!r}")


# Bandwidths per direction: half the bidirectional figure the datasheets quote.
# NVIDIA A100 datasheet: NVLink 3, 600 GB/s (bidirectional); the A800 (China variant) 400 GB/s.
NVLINK3 = Link("NVLink 3 (A100)", 300e9, "nvlink")
NVLINK3_A800 = Link("NVLink 3 (A800)", 200e9, "nvlink")
# NVIDIA H100 SXM, H200 and H20 datasheets: NVLink 4, 900 GB/s (bidirectional).
NVLINK4 = Link("NVLink 4 (H100/H200/H20)", 450e9, "nvlink")
# PCI-SIG: PCIe 4.0 x16 is 16 GT/s x 16 lanes, 128b/130b coding, about 31.5 GB/s per direction;
# PCIe 5.0 doubles it (about 63 GB/s per direction; NVIDIA's L40S datasheet: PCIe Gen4 x16,
# 64 GB/s bidirectional).
PCIE4_X16 = Link("PCIe 4.0 x16", 31.5e9, "pcie")
PCIE5_X16 = Link("PCIe 5.0 x16", 63e9, "pcie")
# InfiniBand HDR/NDR200 and 100G NICs: 200 and 100 Gbit/s line rate per direction.
RDMA_100G = Link("RDMA 100 Gb/s", 100e9 / 8, "net")
RDMA_200G = Link("RDMA 200 Gb/s", 200e9 / 8, "net")

LINKS = {x.name: x for x in (NVLINK3, NVLINK3_A800, NVLINK4, PCIE4_X16, PCIE5_X16, RDMA_100G,
                             RDMA_200G)}

# One control message between two processes of one host (a Gloo/TCP send over loopback, the
# channel vLLM's data-parallel engines synchronise on): Linux loopback TCP round trips measure
# about 20 us with netperf TCP_RR on current x86 servers, so about 10 us one way.
HOST_MESSAGE = 10e-6
# One host-side runtime call (a kernel launch, a driver call, or a framework op re-pointing a
# tensor view): NVIDIA's "Getting Started with CUDA Graphs" (developer blog, 2019) measures a few
# microseconds of CPU launch overhead per kernel; we take 5 us.
HOST_CALL = 5e-6


def host_link(gpu) -> Link:
    """The link between a GPU of the kind `gpu` and its host's memory: PCIe 5.0 x16 for the
    Hopper GPUs (the H100, H200 and H20 datasheets), PCIe 4.0 x16 for the A100, A800 and L40S;
    a GPU of no preset gets PCIe 4.0."""
    name = getattr(gpu, "name", str(gpu)).upper()
    return PCIE5_X16 if name.startswith(("H100", "H200", "H20")) else PCIE4_X16


def gpu_link(gpu) -> Link:
    """The link between two GPUs of one server of the kind `gpu` (a costmodel.GPUSpec): NVLink
    by generation, PCIe for a GPU without NVLink (the L40S); a GPU of no preset (a custom
    GPUSpec, the CPU host's workers) gets its own link_bw with PCIe's latencies."""
    name = getattr(gpu, "name", str(gpu)).upper()
    if name.startswith("A800"):
        return NVLINK3_A800
    if name.startswith("A100"):
        return NVLINK3
    if name.startswith(("H100", "H200", "H20")):
        return NVLINK4
    if name.startswith("L40S"):
        return PCIE4_X16
    bw = getattr(gpu, "link_bw", None)
    if bw is None:
        raise LinkError(f"no link preset for GPU {name!r} and no link_bw to build one from")
    return Link(f"{name} link", float(bw), "pcie")
