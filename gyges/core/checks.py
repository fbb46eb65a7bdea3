"""Argument checks for the public API: each raises a gyges error naming the parameter and the
value (ArgumentTypeError for a wrong type, InvalidArgumentError for a value out of range), so a
bad call fails before it changes anything."""
import math
import numbers

import numpy as np

from .errors import ArgumentTypeError, InvalidArgumentError

INT32_MAX = 2**31 - 1  # token ids, counts of tokens and positions: the C engine's int32


def is_finite(value):
    """math.isfinite, False for an int too large for a float (which makes isfinite raise)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def show(value):
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def integer(name, value, lo=None, hi=None):
    """An int (NumPy integers too; not a bool, not 2.0) in [lo, hi]; returns it as int."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Integral, np.integer)):
        raise ArgumentTypeError(f"{name} must be an integer, got {show(value)} "
                                f"({type(value).__name__})")
    value = int(value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        where = (f"in [{lo}, {hi}]" if lo is not None and hi is not None else
                 "a positive integer" if lo == 1 else
                 f">= {lo}" if lo is not None else f"<= {hi}")
        raise InvalidArgumentError(f"{name} must be {where}, got {value}")
    return value


def number(name, value, lo=None, hi=None, lo_open=False):
    """A finite real number (not a bool) in [lo, hi] (or (lo, hi] with lo_open); returns float."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Real, np.floating,
                                                                     np.integer)):
        raise ArgumentTypeError(f"{name} must be a number, got {show(value)} "
                                f"({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value):
        raise InvalidArgumentError(f"{name} must be finite, got {value}")
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise InvalidArgumentError(f"{name} must be {'>' if lo_open else '>='} {lo}, got {value}")
    if hi is not None and value > hi:
        raise InvalidArgumentError(f"{name} must be <= {hi}, got {value}")
    return value


def boolean(name, value):
    """True or False (NumPy bools too), not 'no' or 1."""
    if not isinstance(value, (bool, np.bool_)):
        raise ArgumentTypeError(f"{name} must be True or False, got {show(value)} "
                                f"({type(value).__name__})")
    return bool(value)


def int_sequence(name, value, lo=None, hi=None):
    """A list, tuple, range or 1-D integer array of integers in [lo, hi] (no bools, no floats,
    no strings, dicts or sets); returns a list of int."""
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or not (np.issubdtype(value.dtype, np.integer)):
            raise ArgumentTypeError(f"{name} must be a 1-D integer array, got an array of "
                                    f"{value.dtype} with shape {value.shape}")
        items = value.tolist()
    elif isinstance(value, (list, tuple, range)):
        items = list(value)
    else:
        raise ArgumentTypeError(f"{name} must be a list, tuple or 1-D integer array of ints, "
                                f"got {show(value)} ({type(value).__name__})")
    return [integer(f"{name}[{i}]", item, lo, hi) for i, item in enumerate(items)]
