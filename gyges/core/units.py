"""Byte sizes written the way people write them: 64MiB, 2 MiB, 4096, "1.5GiB"."""
import re
from fractions import Fraction
from .errors import InvalidArgumentError

_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
          "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4, "k": 1 << 10, "m": 1 << 20,
          "g": 1 << 30}
_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value, what="size", lo=0):
    """Returns a byte count in [lo, 2**63) from an int or a string such as '64KiB'; raises
    InvalidArgumentError naming `what` for anything else (negative, fractional bytes, unknown
    unit, more bytes than a 64-bit size holds)."""
    if isinstance(value, bool):
        raise InvalidArgumentError(f"{what} must be a byte count, got {value!r}")
    if isinstance(value, int):
        number = value
    elif isinstance(value, str):
        match = _PATTERN.match(value)
        if match is None or match.group(2).lower() not in _UNITS:
            raise InvalidArgumentError(f"{what} {value[:80]!r} is not a size like '64MiB', "
                                       f"'2 MiB' or '4096'")
        # exact: a float would round 0.1GiB and overflow on a few hundred digits
        number = Fraction(match.group(1)) * _UNITS[match.group(2).lower()]
        if number.denominator != 1:
            raise InvalidArgumentError(f"{what} {value!r} is not a whole number of bytes")
        number = int(number)
    else:
        raise InvalidArgumentError(f"{what} must be an int or a string like '64MiB', got {value!r}")
    if number < lo:
        raise InvalidArgumentError(f"{what} must be at least {lo} bytes, got {value!r}"
                                   if lo else f"{what} must not be negative, got {value!r}")
    if number >= 1 << 63:
        raise InvalidArgumentError(f"{what} {value!r} is more bytes than a 64-bit size holds")
    return number


def format_size(nbytes):
    """The shortest exact binary unit: 65536 -> '64KiB'."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes}B"
