"""The layout grammar: how a group of workers (GPUs) is cut into instances, for gyges.Host,
gyges.sim, gyges.experiment and their results.

    parse("TP2+2xTP1", 4)           -> [Group(0, 2, None), Group(2, 1, None), Group(3, 1, None)]
    parse("PP[3,1]+TP2", 4, 4)      -> [Group(0, 1, (3, 1)), Group(2, 2, None)]
    layout_string(["TP1", "TP1", "TP2"]) -> "2xTP1+TP2"

A layout is parts joined by '+', each `[count x]` one of:
  TPk        a tensor-parallel group of k workers over every layer;
  TPkEPk     the same group with its experts partitioned over its k workers (a mixture-of-experts
             model; AMOEBAs writes 4x(TP1EP1) and TP4EP4): a host's TP groups are all
             expert-parallel or none (expert_parallel says which a layout names);
  PPn        a pipeline of n one-worker stages, the layers as even as they go (the first stages
             take one more when they do not divide);
  PP[a,b,..] a pipeline whose stage i runs the next a_i layers.
Counts and TP degrees are at least 1; case and spaces do not matter, and 'x' may be '*'. A TP-k
group starts on a multiple of k (aligned groups, as the communicator pools and the cluster
policies assume), a pipeline on any worker; the parts cover the workers exactly. Which TP degrees
a model can run (they divide its heads) is the caller's to check with `tp_degrees` (a TP3 is
fine for a model with 3 KV heads); pipelines need the model's layer count.
"""
from __future__ import annotations

import re
from typing import NamedTuple

from ..core.errors import InvalidArgumentError

__all__ = ["Group", "parse", "tp_sizes", "part_string", "layout_string", "even_split",
           "expert_parallel"]

_PART = re.compile(r"^(?:(\d+)[x*])?(?:tp(\d+)(?:ep(\d+))?|pp(\d+)|pp\[(\d+(?:,\d+)*)\])$")
MAX_STAGES = 8


class Group(NamedTuple):
    """One instance: its first worker, TP degree (1 for a pipeline) and layers per pipeline
    stage (None: a TP group over every layer)."""
    first: int
    tp: int
    stages: tuple | None


def even_split(n_layers: int, n_stages: int) -> tuple:
    """PPn: layers as even as they go, the first stages taking one more when they do not divide."""
    base, extra = divmod(n_layers, n_stages)
    return tuple(base + (i < extra) for i in range(n_stages))


def parse(layout: str, n_workers: int, n_layers: int | None = None, tp_degrees=None,
          error=InvalidArgumentError, unit: str = "workers") -> list[Group]:
    """The instances of `layout` over `n_workers` workers, in worker order. n_layers: the model's
    layers (None: pipelines are refused, as by an executor without layers); tp_degrees: the TP
    degrees allowed (None: any). Errors are `error` (an InvalidArgumentError class) naming the
    layout and the part; `unit` is what the messages call the workers ("GPUs" in the
    simulator)."""
    if not isinstance(layout, str) or not layout.strip():
        raise error(f"layout must be a string like '4xTP1', 'TP2+2xTP1' or 'PP[3,1]', got "
                    f"{layout!r}")
    groups, start = [], 0
    for part in layout.replace(" ", "").split("+"):
        match = _PART.match(part.lower())
        if match is None:
            raise error(f"layout part {part!r} is not like 'TP2', '4xTP1', 'TP4EP4', 'PP2' or "
                        f"'PP[3,1]' (in {layout!r})")
        count = int(match.group(1) or 1)
        if count < 1:
            raise error(f"layout part {part!r}: counts are at least 1 (in {layout!r})")
        stages = None
        if match.group(2) is not None:
            tp = int(match.group(2))
            if tp < 1:
                raise error(f"layout part {part!r}: TP degrees are at least 1 (in {layout!r})")
            if match.group(3) is not None and int(match.group(3)) != tp:
                raise error(f"layout part {part!r}: experts are partitioned over the TP group, "
                            f"so EP equals TP (TP{tp}EP{tp}; in {layout!r})")
            if tp_degrees is not None and tp not in tp_degrees:
                raise error(f"layout {layout!r}: TP{tp} is not one of the TP degrees here "
                            f"({', '.join(str(t) for t in sorted(tp_degrees))})")
        else:
            tp = 1
            if n_layers is None:
                raise error(f"layout {layout!r}: pipeline stages ({part!r}) need the model's "
                            f"layers; here only TP groups are run")
            if match.group(4) is not None:
                n = int(match.group(4))
                if not 2 <= n <= min(n_layers, MAX_STAGES):
                    raise error(f"layout part {part!r}: a pipeline has 2 to "
                                f"{min(n_layers, MAX_STAGES)} stages for {n_layers} layers")
                stages = even_split(n_layers, n)
            else:
                stages = tuple(int(x) for x in match.group(5).split(","))
                if len(stages) < 2 or len(stages) > MAX_STAGES or min(stages) < 1 \
                        or sum(stages) != n_layers:
                    raise error(f"layout part {part!r}: a pipeline has 2 to {MAX_STAGES} stages "
                                f"of at least one layer each, adding up to the model's "
                                f"{n_layers} layers")
        width = len(stages) if stages else tp
        if start + count * width > n_workers:  # before the loop: a count may be 10**11
            raise error(f"layout {layout!r} covers {start + count * width} {unit} or more, not "
                        f"the {n_workers} there are")
        for _ in range(count):
            if start % tp:
                raise error(f"layout {layout!r}: a TP{tp} instance would start at {unit[:-1]} "
                            f"{start}, "
                            f"which is not aligned to {tp} (groups are aligned, such as {{0,1}}, "
                            f"{{2,3}}, {{0..3}}: list larger instances first, e.g. "
                            f"'1xTP4+4xTP1')")
            groups.append(Group(start, tp, stages))
            start += width
    if start != n_workers:
        raise error(f"layout {layout!r} covers {start} {unit}, not the {n_workers} there are")
    return groups


def tp_sizes(layout: str, n_workers: int, error=InvalidArgumentError,
             unit: str = "GPUs") -> list[int]:
    """The TP degree of each instance of a layout of TP groups whose degrees are powers of two
    (what the cluster policies place on): '4xTP1+1xTP4' -> [1, 1, 1, 1, 4]."""
    degrees = [1 << k for k in range(n_workers.bit_length())]
    return [g.tp for g in parse(layout, n_workers, None, degrees, error, unit)]


def expert_parallel(layout: str, error=InvalidArgumentError) -> bool:
    """Whether `layout` (valid for parse) names expert-parallel groups: 'TP4EP4' and
    '4xTP1EP1' do, 'TP4' does not; one that mixes them is refused."""
    tps = [m.group(3) is not None for m in
           (_PART.match(p.lower()) for p in layout.replace(" ", "").split("+"))
           if m is not None and m.group(2) is not None]
    if any(tps) and not all(tps):
        raise error(f"layout {layout!r} mixes expert-parallel TP groups (TPkEPk) with others: "
                    f"a host's are all expert-parallel or none")
    return any(tps)


def part_string(tp: int, stages=None, ep: bool = False) -> str:
    """One instance's part: 'TP2' ('TP2EP2' expert-parallel), or for layers per stage 'PP2' (an
    even split) / 'PP[3,1]'."""
    if not stages:
        return f"TP{tp}EP{tp}" if ep else f"TP{tp}"
    stages = tuple(stages)
    if stages == even_split(sum(stages), len(stages)):
        return f"PP{len(stages)}"
    return "PP[" + ",".join(map(str, stages)) + "]"


def layout_string(parts) -> str:
    """['TP1', 'TP1', 'TP2'] -> '2xTP1+TP2' (runs of equal parts collapsed, in worker order)."""
    out, i = [], 0
    while i < len(parts):
        j = i
        while j < len(parts) and parts[j] == parts[i]:
            j += 1
        out.append(f"{j - i}x{parts[i]}" if j - i > 1 else parts[i])
        i = j
    return "+".join(out)
