"""The one reconfiguration protocol under load (issue 30): every kind of live change together, by
the thousand, with arrivals, aborts and faults; and every kind's fault sweep over every event.

1. Mixed soak (gyges.testing.soak_mixed): per seed, `--operations` random operations on one
   host of twelve workers: its eight sharded ones (PP[3,1] + TP2 + four TP1 instances) take
   merges and splits (at once and layer-staggered, with and without overlap), re-splits of its
   pipelines (buddy groups' too), buddy groups (blocking and live) and restores (blocking and
   live); its four replicated ones take binds and releases of every aligned group with every
   preemption and TP work by degree; any live change may be cancelled; all of them side by side
   in one step loop. With faults, a random fault site and event
   fails inside about half of them. Every request is checked against the same request served
   alone by a plain engine (greedy and seeded sampling), and every worker's bytes against a
   fresh host of its final layout.
2. Fault sweeps (gyges.testing.sweep_reconfiguration): for every kind (re-splits, binds,
   releases, buddy groups, restores; blocking and live) and every fault site, every event fails
   in turn (or `--most` of them, spread): refused, rolled back, or done; never recovered.

The model is Model.tiny()'s shape at a quarter of its width: the figures count events, not time.
Every column that counts a failure must be 0.

    .venv/bin/python benchmarks/soak_mixed.py [--seeds 3] [--operations 1700] [--most 0]
"""
import argparse
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gyges import testing  # noqa: E402
from gyges.reconfig import ReconfigurationWarning, RecoveryWarning  # noqa: E402

from benchmarks.common import print_table, soak_runs, write_json  # noqa: E402
from benchmarks.soak_transform import model_of  # noqa: E402

KINDS = ("transform", "reconfigure", "buddy", "restore", "switch")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--operations", type=int, default=1700, help="a run (two runs a seed)")
    ap.add_argument("--most", type=int, default=0,
                    help="at most this many events a sweep (0: every event)")
    ap.add_argument("--model", choices=("small", "tiny"), default="small")
    ap.add_argument("--quick", action="store_true", help="200 operations a run, 12 events a sweep")
    args = ap.parse_args()
    n = 200 if args.quick else args.operations
    most = 12 if args.quick else (args.most or None)
    model = model_of(args.model)
    warnings.simplefilter("ignore", RecoveryWarning)
    warnings.simplefilter("ignore", ReconfigurationWarning)
    started = time.time()

    soak = []
    runs = soak_runs(args.seeds, lambda seed, faults: testing.soak_mixed(
        model, seed=seed, operations=n, faults=faults))
    for seed, faults, r, seconds in runs:
        row = dict(seed=seed, faults=faults, operations=r["operations"],
                   requests=r["requests"], aborted=r["aborted"], steps=r["steps"],
                   failed_steps=r["failed_steps"], lost=r["lost"], mismatches=r["mismatches"],
                   page_delta=sum(abs(d) for d in r["page_delta"]), seconds=seconds)
        for key in ("started", "committed", "rolled_back", "recovered", "refused"):
            row[key] = sum(r[k][key] for k in KINDS)
        row["cancelled"] = r["cancel"]["started"]
        row["by_kind"] = {k: r[k] for k in KINDS}
        soak.append(row)
        print(f"  soak seed {seed} faults={faults}: {row}", flush=True)
    print_table(f"Mixed soak: {n} random operations a run over every kind of reconfiguration, "
                f"requests arriving and aborted every step ({args.model} model)", soak,
                [("seed", "seed", "{}"), ("faults", "faults", "{}"),
                 ("operations", "ops", "{:,}"), ("committed", "committed", "{:,}"),
                 ("rolled_back", "rolled back", "{}"), ("refused", "refused", "{}"),
                 ("cancelled", "cancelled", "{}"), ("recovered", "recovered", "{}"),
                 ("requests", "requests", "{:,}"), ("aborted", "aborted", "{}"),
                 ("failed_steps", "failed steps", "{}"), ("lost", "lost", "{}"),
                 ("mismatches", "mismatches", "{}"), ("page_delta", "page delta B", "{}"),
                 ("seconds", "s", "{}")])
    print("  by kind (started / committed / rolled back / refused), summed over the runs:")
    for k in KINDS:
        c = {key: sum(row["by_kind"][k][key] for row in soak)
             for key in ("started", "committed", "rolled_back", "refused")}
        print(f"    {k:12s} {c['started']:6,} / {c['committed']:6,} / {c['rolled_back']:5,} / "
              f"{c['refused']:5,}")

    sweeps = []
    for kind in testing.RECONFIGURATIONS:
        for site in testing.SITES:
            r = testing.sweep_reconfiguration(model, kind, site, most=most)
            sweeps.append(r)
            print(f"  sweep {kind} / {site}: {r}", flush=True)
    print_table("Fault sweeps: the n-th event of a site fails while a kind starts and runs to its "
                "end, for every n", sweeps,
                [("kind", "operation", "{}"), ("site", "site", "{}"), ("events", "events", "{:,}"),
                 ("runs", "runs", "{:,}"), ("refused", "refused", "{}"),
                 ("rolled_back", "rolled back", "{}"), ("done", "done", "{}"),
                 ("recovered", "recovered", "{}"), ("changed", "changed", "{}"),
                 ("wrong_layout", "wrong layout", "{}"), ("lost", "lost", "{}"),
                 ("mismatches", "mismatches", "{}"), ("leaked_pages", "leaks", "{}")])

    bad = (sum(r["lost"] + r["mismatches"] + r["page_delta"] + r["recovered"] for r in soak) +
           sum(r["failed_steps"] for r in soak if not r["faults"]) +
           sum(r["changed"] + r["wrong_layout"] + r["lost"] + r["mismatches"] + r["leaked_pages"]
               + r["recovered"] for r in sweeps))
    total = sum(r["operations"] for r in soak)
    print(f"\n{total:,} operations over {args.seeds} seeds; failures counted: {bad} (must be 0); "
          f"{time.time() - started:.0f} s")
    write_json("soak_mixed", {"model": args.model, "operations_per_run": n, "soak": soak,
                              "sweeps": sweeps, "operations": total, "failures": bad})
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
