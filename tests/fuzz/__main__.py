"""python -m tests.fuzz run|replay|probe (from the repository root); see __init__.py."""
import argparse
import json
import os
import sys

from .campaign import pin_threads

pin_threads()  # before numpy is imported anywhere in this process
sys.path.insert(0, os.getcwd())


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m tests.fuzz")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="a campaign: table, and JSON with --json")
    r.add_argument("--seeds", default="1,2,3")
    r.add_argument("--mutants", type=int, default=300, help="in all, spread over the seeds")
    r.add_argument("--timeout", type=float, default=10.0, help="wall seconds per mutant")
    r.add_argument("--jobs", type=int, default=1)
    r.add_argument("--memory-gib", type=float, default=2.0,
                   help="address space a child may add to the fork-server's (RLIMIT_AS)")
    r.add_argument("--json", help="write the summary here")
    r.add_argument("--records", help="write every record here (JSON lines)")
    rp = sub.add_parser("replay", help="rebuild one mutant and run it in the foreground")
    rp.add_argument("--seed", type=int, required=True)
    rp.add_argument("--index", type=int, required=True)
    rp.add_argument("--keep", help="build it in this directory (kept) for a closer look")
    rp.add_argument("--timeout", type=float, default=60.0, help="SIGALRM after this (0: none)")
    rp.add_argument("--memory-gib", type=float, default=2.0, help="RLIMIT_AS over the start "
                    "(0: none)")
    pr = sub.add_parser("probe", help="the harness's self-checks: one child of each class")
    pr.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    from . import campaign, report
    if args.cmd == "run":
        seeds = [int(s) for s in args.seeds.split(",")]
        summary, records = campaign.run(seeds, args.mutants, timeout_s=args.timeout,
                                        jobs=args.jobs, memory_bytes=int(args.memory_gib * 2**30))
        print(report.table(summary))
        if args.json:
            report.write_json(summary, args.json)
        if args.records:
            with open(args.records, "w") as f:
                for rec in records:
                    f.write(json.dumps(rec, default=str) + "\n")
        return 1 if summary["failing"] else 0
    if args.cmd == "replay":
        record, root = campaign.replay(args.seed, args.index, args.keep, args.timeout,
                                       int(args.memory_gib * 2**30) or None)
        print(json.dumps(record, indent=1, default=str))
        if args.keep:
            print(f"(built under {root})")
        else:
            import shutil
            shutil.rmtree(root, ignore_errors=True)
        return 0
    results = campaign.probe()
    if args.json:
        print(json.dumps([{"probe": n, "expected": e, "record": r} for n, e, r in results],
                         default=str))
    else:
        for name, expected, record in results:
            print(f"{name:14} expected {expected:10} got {record['class']:10} "
                  f"{str(record.get('error', ''))[:80]}")
    return 0 if all(e == r["class"] for _, e, r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
