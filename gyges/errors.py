"""The gyges exception hierarchy. Every error raised by the C core is a gyges.Error; the
subclasses say what kind of failure it was, and several also derive from the matching builtin
(InvalidArgumentError is a ValueError, OutOfMemoryError a MemoryError) so ordinary handlers work.

ArgumentTypeError is an InvalidArgumentError that is also a TypeError: an argument of the wrong
type (a dict where a prompt goes, 2.0 where a TP degree goes)."""
from ._C import (BusyError, CudaError, Error, FormatError, InvalidArgumentError, LimitError,
                 OutOfMemoryError, StateError, SystemError, UnavailableError)


class ArgumentTypeError(InvalidArgumentError, TypeError):
    """An argument of the wrong type; the message names the parameter and the value."""


__all__ = ["Error", "InvalidArgumentError", "ArgumentTypeError", "OutOfMemoryError",
           "StateError", "BusyError", "SystemError", "CudaError", "UnavailableError",
           "LimitError", "FormatError"]
