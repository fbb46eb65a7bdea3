"""gyges: a research engine for LLM serving whose parallelism changes while it runs.

The performance-critical parts are C (and CUDA) in gyges._C; this package is the steering wheel.
"""
from . import _C
from .arena import Arena
from .errors import (ArgumentTypeError, BusyError, CudaError, DependencyError, Error, FormatError,
                     InvalidArgumentError, LimitError, OutOfMemoryError, StateError,
                     SystemCallError, UnavailableError)
from .engine import Engine, Request, SamplingParams
from .host import Host
from .kv_cache import KVCache
from .model import Model
from .units import format_size, parse_size

__version__ = "0.1.0"
WITH_CUDA = bool(_C.WITH_CUDA)

__all__ = ["Arena", "KVCache", "Model", "Engine", "SamplingParams", "Request", "Host",
           "Error", "InvalidArgumentError", "ArgumentTypeError", "OutOfMemoryError", "StateError",
           "BusyError", "SystemCallError", "CudaError", "UnavailableError", "LimitError",
           "FormatError", "DependencyError", "parse_size", "format_size", "WITH_CUDA"]
