"""gyges: a research engine for LLM serving whose parallelism changes while it runs.

The performance-critical parts are C (and CUDA) in gyges._C; this package is the steering wheel.
Every public submodule is reachable after a bare `import gyges` (gyges.sim, gyges.traces,
gyges.experiment, gyges.metrics, gyges.results, gyges.serve, ...), imported when first used.
The package logs through `logging` (logger "gyges", in vLLM's line format): at INFO on stderr
while the application configures no logging of its own (gyges/core/logs.py); nothing print()s.
"""
import importlib
import os

from . import _C
from .core import logs as _logs
from .runtime.arena import Arena
from .core.errors import (ArgumentTypeError, BusyError, CudaError, DependencyError, Error, FormatError,
                     InvalidArgumentError, LimitError, OutOfMemoryError, StateError,
                     SystemCallError, UnavailableError)
from .runtime.engine import Engine, Logprob, Request, SamplingParams
from .runtime.host import Host
from .distributed.cluster import Cluster
from . import reconfig  # noqa: F401  (registers the host's reconfigurations: transform, switch, ...)
from .runtime.kv_cache import KVCache, KVMove, KVMoveStage
from .serve.llm import LLM
from .models.model import Model
from .core.units import format_size, parse_size

__version__ = "0.1.0"
WITH_CUDA = bool(_C.WITH_CUDA)

_logs.install_default()

# GYGES_CPU_ISA=portable runs the portable CPU kernels on a machine that has AVX-512 (same bits):
# how a machine without AVX-512 is timed here.
if os.environ.get("GYGES_CPU_ISA"):
    _C.set_cpu_isa(os.environ["GYGES_CPU_ISA"])

# The package's layers (each imports only those below it; tests/test_layers.py checks):
#   core < models < runtime < reconfig < cluster < serve < (demo, testing, this file)
# The subsystems a notebook reaches for are also here by their short names, imported when first
# used: gyges.sim, gyges.traces, gyges.experiment, ...
SUBMODULES = {"core": "core", "models": "models", "runtime": "runtime", "reconfig": "reconfig",
              "cluster": "cluster", "distributed": "distributed", "serve": "serve", "demo": "demo", "testing": "testing",
              "sim": "cluster.sim", "traces": "cluster.traces", "experiment": "cluster.experiment",
              "metrics": "cluster.metrics", "results": "cluster.results",
              "costmodel": "cluster.costmodel"}


def __getattr__(name):
    if name in SUBMODULES:
        return importlib.import_module(f".{SUBMODULES[name]}", __name__)
    raise AttributeError(f"module 'gyges' has no attribute {name!r}")


__all__ = ["Arena", "KVCache", "KVMove", "KVMoveStage", "Model", "Engine", "SamplingParams", "Request", "Logprob", "Host", "Cluster", "LLM",
           "Error", "InvalidArgumentError", "ArgumentTypeError", "OutOfMemoryError", "StateError",
           "BusyError", "SystemCallError", "CudaError", "UnavailableError", "LimitError",
           "FormatError", "DependencyError", "parse_size", "format_size", "WITH_CUDA"]
