"""gyges: a research engine for LLM serving whose parallelism changes while it runs.

The performance-critical parts are C (and CUDA) in gyges._C; this package is the steering wheel.
Every public submodule is reachable after a bare `import gyges` (gyges.sim, gyges.traces,
gyges.experiment, gyges.metrics, gyges.results, gyges.serve, ...), imported when first used.
The package logs through `logging` (logger "gyges"); it prints nothing.
"""
import importlib
import logging
import os

from . import _C
from .arena import Arena
from .errors import (ArgumentTypeError, BusyError, CudaError, DependencyError, Error, FormatError,
                     InvalidArgumentError, LimitError, OutOfMemoryError, StateError,
                     SystemCallError, UnavailableError)
from .engine import Engine, Request, SamplingParams
from .host import Host
from .kv_cache import KVCache
from .llm import LLM
from .model import Model
from .units import format_size, parse_size

__version__ = "0.1.0"
WITH_CUDA = bool(_C.WITH_CUDA)

logging.getLogger(__name__).addHandler(logging.NullHandler())

# GYGES_CPU_ISA=portable runs the portable CPU kernels on a machine that has AVX-512 (same bits):
# how a machine without AVX-512 is timed here.
if os.environ.get("GYGES_CPU_ISA"):
    _C.kernel_set_isa(os.environ["GYGES_CPU_ISA"])

SUBMODULES = ("arena", "checkpoint", "cluster", "comm", "config", "costmodel", "demo",
              "experiment", "gguf_file", "layout", "metrics", "recovery", "results", "safetensors",
              "serve", "sim", "testing", "tokenizer", "traces", "transform", "units", "weights",
              "worker")


def __getattr__(name):
    if name in SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'gyges' has no attribute {name!r}")


__all__ = ["Arena", "KVCache", "Model", "Engine", "SamplingParams", "Request", "Host", "LLM",
           "Error", "InvalidArgumentError", "ArgumentTypeError", "OutOfMemoryError", "StateError",
           "BusyError", "SystemCallError", "CudaError", "UnavailableError", "LimitError",
           "FormatError", "DependencyError", "parse_size", "format_size", "WITH_CUDA"]
