"""The long fuzz campaign over model files (tests/fuzz/): `--mutants` mutants spread over
`--seeds`, a table of classes per mutator, the findings grouped by cause with a replay command
each, and the JSON in benchmarks/results/fuzz.json. Exit status 1 when any crash, hang,
non-gyges exception or silent misread was found.

    .venv/bin/python benchmarks/fuzz.py --mutants 2000 --seeds 1,2,3
"""
import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from tests.fuzz.campaign import pin_threads  # noqa: E402

pin_threads()  # before numpy: the campaign forks


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mutants", type=int, default=2000)
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "fuzz.json"))
    p.add_argument("--records", help="also every mutant's record here (JSON lines)")
    args = p.parse_args()
    from tests.fuzz import campaign, report
    os.chdir(ROOT)
    summary, records = campaign.run([int(s) for s in args.seeds.split(",")], args.mutants,
                              timeout_s=args.timeout, jobs=args.jobs)
    print(report.table(summary))
    report.write_json(summary, args.out)
    if args.records:
        with open(args.records, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, default=str) + "\n" for r in records)
    print(f"\nwrote {args.out}")
    return 1 if summary["failing"] else 0


if __name__ == "__main__":
    sys.exit(main())
