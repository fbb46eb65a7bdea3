"""The reliability figures of issue 12: random live transformations by the thousand, every
fault of whole operations, and two threads on one host.

1. Soak: per seed, `--transformations` random merges and splits (at once and layer-staggered,
   with and without overlap) while requests arrive at every step, without faults and with a
   random fault inside about half of them. Counts transformations done, refused, rolled back
   and recovered (a rollback that failed too),
   requests, lost ones, token mismatches against the same requests served by a plain engine,
   and the bytes each worker holds beyond a host that never transformed (page delta).
2. Fault sweeps: every event of every fault site (allocation, page creation and mapping, KV and
   weight copies, collectives) fails in turn, in a merge, a split, their layer-staggered forms
   and a host step. Refusals must change nothing; nothing is lost, mismatched or leaked.
3. Two threads: one steps, one submits, aborts and transforms.

The model is Model.tiny()'s shape at a quarter of its width (--model tiny for the full one): the
figures count events, not time. Every column that counts a failure must be 0.

    .venv/bin/python benchmarks/soak_transform.py [--seeds 4] [--transformations 1000] [--quick]
"""
import argparse
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gyges  # noqa: E402
from gyges import testing  # noqa: E402
from gyges.models.config import ModelConfig  # noqa: E402
from gyges.reconfig import ReconfigurationWarning, RecoveryWarning  # noqa: E402

from benchmarks.common import print_table, soak_runs, write_json  # noqa: E402


def model_of(name):
    if name == "tiny":
        return gyges.Model.tiny()
    config = ModelConfig.tiny().replace(hidden_size=64, intermediate_size=128,
                                        num_attention_heads=4, num_key_value_heads=4,
                                        vocab_size=512)
    return gyges.Model.random(config, seed=12)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--transformations", type=int, default=1000)
    ap.add_argument("--model", choices=("small", "tiny"), default="small")
    ap.add_argument("--layout", default=None,
                    help="the host's starting layout, e.g. PP[3,1]+2xTP1 (default 4xTP1); "
                         "transformations leave pipelines alone")
    ap.add_argument("--quick", action="store_true",
                    help="100 transformations a seed and at most 24 events a sweep")
    args = ap.parse_args()
    n = 100 if args.quick else args.transformations
    most = 24 if args.quick else None
    model = model_of(args.model)
    warnings.simplefilter("ignore", RecoveryWarning)
    warnings.simplefilter("ignore", ReconfigurationWarning)
    started = time.time()

    soak = []
    runs = soak_runs(args.seeds, lambda seed, faults: testing.soak(
        model, seed=seed, transformations=n, faults=faults, layout=args.layout))
    for seed, faults, r, seconds in runs:
        r.update(faults=faults, seconds=seconds, page_delta=sum(abs(d) for d in r["page_delta"]))
        soak.append(r)
        print(f"  soak seed {seed} faults={faults}: {r}", flush=True)
    print_table(f"Soak: {n} random live transformations a run, requests arriving every step "
                f"({args.model} model)", soak,
                [("seed", "seed", "{}"), ("faults", "faults", "{}"),
                 ("transformations", "done", "{:,}"), ("refused", "refused", "{}"),
                 ("rolled_back", "rolled back", "{}"), ("recovered", "recovered", "{}"),
                 ("requests", "requests", "{:,}"),
                 ("failed_steps", "failed steps", "{}"), ("lost", "lost", "{}"),
                 ("mismatches", "mismatches", "{}"), ("page_delta", "page delta B", "{}"),
                 ("seconds", "s", "{}")])

    sweeps = []
    for kind in testing.TRANSFORMS:
        for site in testing.SITES:
            r = testing.sweep_transformation(model, kind, site, most=most)
            sweeps.append(r)
            print(f"  sweep {kind} / {site}: {r}", flush=True)
    for site in ("alloc", "page_create", "page_map", "comm"):
        r = testing.sweep_step(model, site, most=most)
        r.update(kind="host step", done=r["runs"] - r["failed"], refused=r["failed"],
                 rolled_back=0, recovered=0, wrong_layout=0)
        sweeps.append(r)
        print(f"  sweep host step / {site}: {r}", flush=True)
    print_table("Fault sweeps: the n-th event of a site fails, for every n "
                "(refused = raised with nothing changed; a failed step counts as refused)",
                sweeps,
                [("kind", "operation", "{}"), ("site", "site", "{}"), ("events", "events", "{:,}"),
                 ("runs", "runs", "{:,}"), ("refused", "refused", "{}"),
                 ("rolled_back", "rolled back", "{}"), ("done", "done", "{}"),
                 ("recovered", "recovered", "{}"), ("changed", "changed", "{}"),
                 ("wrong_layout", "wrong layout", "{}"), ("lost", "lost", "{}"),
                 ("mismatches", "mismatches", "{}"), ("leaked_pages", "leaks", "{}")])

    threads = [testing.stress_threads(model, seed=seed, requests=120) for seed in range(args.seeds)]
    print_table("Two threads on one host: one steps; one submits, aborts and transforms", threads,
                [("seed", "seed", "{}"), ("requests", "requests", "{}"),
                 ("aborted", "aborted", "{}"), ("transformations", "transformations", "{}"),
                 ("refused", "refused", "{}"), ("errors", "errors", "{}"), ("lost", "lost", "{}"),
                 ("mismatches", "mismatches", "{}"), ("bad_aborts", "bad aborts", "{}")])

    bad = (sum(r["lost"] + r["mismatches"] + r["page_delta"] + r["recovered"] for r in soak) +
           sum(r["changed"] + r["wrong_layout"] + r["lost"] + r["mismatches"] + r["leaked_pages"]
               + r["recovered"] for r in sweeps) +
           sum(r["errors"] + r["lost"] + r["mismatches"] + r["bad_aborts"] for r in threads))
    print(f"\nfailures counted: {bad} (must be 0); {time.time() - started:.0f} s")
    write_json("soak_transform", {"model": args.model, "transformations_per_run": n,
                                  "soak": soak, "sweeps": sweeps, "threads": threads,
                                  "failures": bad})
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
