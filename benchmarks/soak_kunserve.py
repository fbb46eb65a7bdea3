"""KunServe's reliability figures (issue 16): a thousand random drop / exchange / restore
operations on a CPU host while requests arrive at every step (gyges.testing.soak_buddy): buddy
groups of 2 and 4 formed blocking or live, restored blocking or live from the peers or the host
copy, and, in half the seeds, a random fault (allocation, page creation and mapping, KV and
weight copies, collectives) inside about half of them. Every request is checked against a plain
engine. The columns that count a failure (lost, mismatches, page delta) must be 0.

    .venv/bin/python benchmarks/soak_kunserve.py [--operations 1000] [--seeds 4]
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gyges  # noqa: E402
from gyges import testing  # noqa: E402

from benchmarks.common import print_table, write_json  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--operations", type=int, default=1000, help="over all seeds")
    ap.add_argument("--seeds", type=int, default=4)
    args = ap.parse_args()
    model = gyges.Model.tiny()
    rows = []
    for seed in range(args.seeds):
        t = time.perf_counter()
        r = testing.soak_buddy(model, seed=seed, operations=args.operations // args.seeds,
                               faults=seed % 2 == 1)
        rows.append({**r, "faults": seed % 2 == 1, "leaked_bytes": sum(r["page_delta"]),
                     "wall_s": time.perf_counter() - t})
    print_table(f"KunServe soak: {args.operations} random operations over {args.seeds} seeds "
                f"(tiny model, 4 CPU workers of 32 MiB)", rows,
                [("seed", "seed", "{}"), ("faults", "faults", "{}"),
                 ("operations", "operations", "{}"), ("formed", "formed", "{}"),
                 ("restored", "restored", "{}"), ("refused", "refused", "{}"),
                 ("busy", "busy", "{}"), ("failed_steps", "failed steps", "{}"),
                 ("requests", "requests", "{}"), ("lost", "lost", "{}"),
                 ("mismatches", "mismatches", "{}"), ("leaked_bytes", "leaked bytes", "{}"),
                 ("steps", "steps", "{}"), ("wall_s", "wall s", "{:.1f}")])
    write_json("soak_kunserve", {"rows": rows})
    bad = sum(r["lost"] + r["mismatches"] + r["leaked_bytes"] for r in rows)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
