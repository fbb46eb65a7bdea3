"""The gyges exception hierarchy: everything gyges raises is a gyges.Error. The subclasses say
what kind of failure it was, and several also derive from the matching builtin
(InvalidArgumentError is a ValueError, OutOfMemoryError a MemoryError, SystemCallError an
OSError) so ordinary handlers work. No class shadows a builtin name.

ArgumentTypeError is an InvalidArgumentError that is also a TypeError: an argument of the wrong
type (a dict where a prompt goes, 2.0 where a TP degree goes). The C extension raises it too.
Each module's own errors (TraceError, TransformError, ...) derive from one of these."""
from .._C import (ArgumentTypeError, BusyError, CudaError, Error, FormatError, InvalidArgumentError,
                 LimitError, OutOfMemoryError, StateError, SystemCallError, UnavailableError)


class DependencyError(UnavailableError, ImportError):
    """A package or a build that gyges needs is missing or stale (matplotlib for plots, an
    extension built from other sources); the message says how to get it."""


def require(module, needed_for, package=None):
    """`import module`, or a DependencyError saying what needs it and how to install it."""
    import sys
    try:
        __import__(module)  # (through builtins.__import__, as an import statement goes)
        return sys.modules[module]
    except ImportError:
        raise DependencyError(f"{needed_for} needs the `{package or module}` package, which is not "
                              f"installed: pip install {package or module}") from None


__all__ = ["Error", "InvalidArgumentError", "ArgumentTypeError", "OutOfMemoryError",
           "StateError", "BusyError", "SystemCallError", "CudaError", "UnavailableError",
           "LimitError", "FormatError", "DependencyError"]
