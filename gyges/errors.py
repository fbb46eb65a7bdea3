"""The gyges exception hierarchy. Every error raised by the C core is a gyges.Error; the
subclasses say what kind of failure it was, and several also derive from the matching builtin
(InvalidArgumentError is a ValueError, OutOfMemoryError a MemoryError) so ordinary handlers work."""
from ._C import (BusyError, CudaError, Error, FormatError, InvalidArgumentError, LimitError,
                 OutOfMemoryError, StateError, SystemError, UnavailableError)

__all__ = ["Error", "InvalidArgumentError", "OutOfMemoryError", "StateError", "BusyError",
           "SystemError", "CudaError", "UnavailableError", "LimitError", "FormatError"]
