"""What every benchmark shares: timing, a printed table, and a JSON file of the same rows."""
import json
import platform
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def best_of(fn, repeat=5):
    """Smallest wall time of `repeat` runs of fn(), in seconds (the least disturbed run)."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def step_times(host, n):
    """Wall seconds of each of n host.step() calls."""
    times = []
    for _ in range(n):
        start = time.perf_counter()
        host.step()
        times.append(time.perf_counter() - start)
    return times


def print_table(title, rows, columns):
    """rows: list of dicts; columns: list of (key, header, format)."""
    print(f"\n{title}")
    cells = [[fmt.format(row[key]) if row.get(key) is not None else "-" for key, _, fmt in columns]
             for row in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (_, h, _) in enumerate(columns)]
    print("  ".join(h.rjust(w) for (_, h, _), w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths)))


def write_json(name, payload):
    RESULTS.mkdir(exist_ok=True)
    payload = {"machine": platform.machine(), "processor": platform.processor(),
               "python": platform.python_version(), **payload}
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2))
    print(f"\nwrote {path}")
    return path


def host_backend(argv):
    """--cuda in argv: (True, the Host arguments of virtual CUDA workers on one GPU, 2 MiB pages);
    else (False, {}) for CPU workers."""
    cuda = "--cuda" in argv
    return cuda, (dict(backend="cuda", page_size="2MiB") if cuda else {})


def soak_runs(seeds, run):
    """Calls run(seed, faults) for every seed, first without injected faults, then with them;
    yields (seed, faults, its result, wall seconds)."""
    for seed in range(seeds):
        for faults in (False, True):
            t0 = time.time()
            r = run(seed, faults)
            yield seed, faults, r, round(time.time() - t0, 1)
