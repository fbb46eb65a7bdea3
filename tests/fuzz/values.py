"""The odd values a mutator puts where a field's value goes: other JSON types, huge and negative
integers, non-finite floats, strings that look like the right value, nesting. Each is drawn from
an rng, so (seed, index) picks the same one again."""
import math

HUGE_INTS = (2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53 + 1, 2**62, 2**63 - 1, 2**63, 2**64 - 1,
             2**64, 10**30)
NEGATIVE_INTS = (-1, -2, -64, -(2**31), -(2**63))
ODD_FLOATS = (math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-40, 1e308, 0.5, 1.5, -1.5, 64.0, 2.0)
ODD_STRINGS = ("", "false", "true", "0", "1", "64", "2", "NaN", "null", "silu", "linear",
               "\x00", "é" * 3, "a" * 5000)


def nested(depth, leaf=1):
    """A list nested `depth` deep around leaf ([[[...1...]]])."""
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


def nested_dict(depth, leaf=1):
    value = leaf
    for _ in range(depth):
        value = {"a": value}
    return value


def swap(rng, current=None):
    """A value of another kind than `current` (or any odd value), as (value, words)."""
    kinds = [
        lambda: None,
        lambda: rng.choice((True, False)),
        lambda: rng.choice(HUGE_INTS),
        lambda: rng.choice(NEGATIVE_INTS),
        lambda: 0,
        lambda: rng.choice(ODD_FLOATS),
        lambda: rng.choice(ODD_STRINGS),
        lambda: str(current) if current is not None else "x",
        lambda: [] if rng.random() < 0.3 else [current],
        lambda: {} if rng.random() < 0.3 else {"value": current},
        lambda: nested(rng.choice((3, 50))),
    ]
    if isinstance(current, bool):
        kinds.append(lambda: "false" if current is False else "true")
        kinds.append(lambda: int(current))
    elif isinstance(current, int):
        kinds += [lambda: float(current), lambda: current + 0.5, lambda: current + 1,
                  lambda: current - 1, lambda: current * 2, lambda: str(current)]
    elif isinstance(current, float):
        kinds += [lambda: str(current), lambda: int(current) if math.isfinite(current) else 0,
                  lambda: -current]
    value = rng.choice(kinds)()
    return value
