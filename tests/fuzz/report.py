"""The campaign's summary: counts per class and per mutator, the findings grouped by cause
(class, mutator, stage, exception type) with a replay command each, as a table and as JSON."""
import json
import os
import re
from collections import Counter, defaultdict

CLASSES = ("ok", "refused", "silent", "non-gyges", "crash", "hang", "oom", "harness")
FAILING = ("silent", "non-gyges", "crash", "hang", "harness")  # must be zero


def cause(r):
    """What a finding is, without its particulars: class, mutator, stage, and the exception's
    type (refusals and crashes) or the message up to its values (a silent misread)."""
    what = r.get("error_type") or _gist(r.get("error") or "")
    return " | ".join(str(x) for x in (r["class"], r.get("mutator", "?"), r.get("stage", "-"),
                                       what))


def _gist(text):
    text = re.sub(r"\[[^\]]*\]", "[..]", str(text))
    text = re.split(r" = | is not| differs|!=| in the loaded| \(|, the file", text)[0]
    return " ".join(text.split()[:12])


def summarize(records, seconds, settings):
    per_class = Counter(r["class"] for r in records)
    per_mutator = defaultdict(Counter)
    for r in records:
        per_mutator[r.get("mutator", "?")][r["class"]] += 1
    groups = defaultdict(list)
    for r in records:
        if r["class"] in FAILING or r["class"] == "oom":
            groups[cause(r)].append(r)
    findings = [{"cause": c, "count": len(rs), "example": {k: rs[0].get(k) for k in (
        "seed", "index", "detail", "error", "error_type", "stage", "where")},
        "replay": rs[0].get("replay") or f"python -m tests.fuzz replay --seed {rs[0]['seed']} "
                                          f"--index {rs[0]['index']}",
        "others": [(r["seed"], r["index"]) for r in rs[1:6]]}
        for c, rs in sorted(groups.items(), key=lambda kv: -len(kv[1]))]
    return {"settings": settings, "mutants": len(records), "seconds": round(seconds, 1),
            "per_class": {c: per_class.get(c, 0) for c in CLASSES},
            "per_mutator": {m: {c: n for c, n in sorted(cs.items())}
                            for m, cs in sorted(per_mutator.items())},
            "failing": sum(per_class.get(c, 0) for c in FAILING),
            "findings": findings}


def table(summary):
    lines = [f"{summary['mutants']} mutants in {summary['seconds']} s  "
             f"({', '.join(f'{c} {n}' for c, n in summary['per_class'].items() if n)})", ""]
    cols = [c for c in CLASSES if summary["per_class"][c]]
    lines.append(f"{'mutator':22}" + "".join(f"{c:>10}" for c in cols))
    for m, cs in summary["per_mutator"].items():
        lines.append(f"{m:22}" + "".join(f"{cs.get(c, 0):>10}" for c in cols))
    if summary["findings"]:
        lines += ["", "findings by cause:"]
        for f in summary["findings"]:
            ex = f["example"]
            lines.append(f"  {f['count']:4}  {f['cause']}")
            lines.append(f"        e.g. {ex['detail']}")
            lines.append(f"        -> {str(ex.get('error'))[:160]!s}")
            if ex.get("where"):
                lines.append(f"        at {ex['where'][0]}")
            lines.append(f"        {f['replay']}")
    return "\n".join(lines)


def write_json(summary, path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1, default=str)
        f.write("\n")
