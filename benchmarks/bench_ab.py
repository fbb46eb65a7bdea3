"""This tree against an earlier commit, side by side in one run: the engine's and a host's
decode speed, a transformation's time. The machines here are noisy, so the two builds take turns
(A B A B ...) and each figure is the median of its rounds; read the ratio, not the absolute rates.

    .venv/bin/python benchmarks/bench_ab.py --base HEAD~1 [--rounds 5]

The base is checked out into a temporary worktree and built there without CUDA; every
measurement runs in a fresh process with that build or this one on its path. Writes
benchmarks/results/bench_ab.json.
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import print_table, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

# Each prints one number. Only APIs both builds have.
CASES = {
    "engine TP1 decode, batch 1 (tok/s)": """
import time, gyges
m = gyges.Model.tiny()
e = gyges.Engine(m, memory="64MiB")
p = gyges.SamplingParams(max_tokens=64, ignore_eos=True)
e.generate([[1, 2, 3, 4]], p)
t = time.perf_counter(); e.generate([[5, 6, 7, 8]], p); print(64 / (time.perf_counter() - t))
""",
    "engine TP1 decode, batch 16 (tok/s)": """
import time, gyges
m = gyges.Model.tiny()
e = gyges.Engine(m, memory="64MiB")
p = gyges.SamplingParams(max_tokens=32, ignore_eos=True)
e.generate([[1, 2, 3, i] for i in range(16)], p)
t = time.perf_counter(); e.generate([[5, 6, 7, i] for i in range(16)], p)
print(16 * 32 / (time.perf_counter() - t))
""",
    # bench_engine.py's first row: the stories15M shape (random weights), 2 threads
    "engine stories15M decode, batch 1 (tok/s)": """
import time, gyges
ModelConfig = type(gyges.Model.tiny().config)  # gyges.models.config's, or the base's gyges.config's
m = gyges.Model.random(ModelConfig.stories15m(), seed=0)
e = gyges.Engine(m, memory="256MiB", threads=2)
p = gyges.SamplingParams(max_tokens=128, ignore_eos=True)
r = e.generate([[1, 2, 3, 4, 5, 6, 7, 8]], p)[0]
print(127 / (r.metrics.token_times[-1] - r.metrics.token_times[0]))
""",
    "host TP2 decode, batch 8 (tok/s)": """
import time, gyges
m = gyges.Model.tiny()
h = gyges.Host(m, workers=2, memory_per_worker="48MiB", layout="TP2")
p = gyges.SamplingParams(max_tokens=32, ignore_eos=True)
h.generate([[1, 2, 3, i] for i in range(8)], p)
t = time.perf_counter(); h.generate([[5, 6, 7, i] for i in range(8)], p)
print(8 * 32 / (time.perf_counter() - t))
""",
    "merge 4xTP1 -> TP4 with 8 requests (ms)": """
import time, gyges
m = gyges.Model.tiny()
h = gyges.Host(m, workers=4, memory_per_worker="48MiB", layout="4xTP1")
p = gyges.SamplingParams(max_tokens=64, ignore_eos=True)
for i in range(8):
    h.submit([1, 2, 3, i] * 8, p)
for _ in range(4):
    h.step()
t = time.perf_counter(); h.transform(workers=(0, 1, 2, 3), tp=4)
print(1000 * (time.perf_counter() - t))
""",
    "layer-staggered merge, mean step (ms)": """
import time, gyges
m = gyges.Model.tiny()
h = gyges.Host(m, workers=2, memory_per_worker="48MiB", layout="2xTP1")
p = gyges.SamplingParams(max_tokens=64, ignore_eos=True)
for i in range(8):
    h.submit([1, 2, 3, i] * 8, p)
for _ in range(4):
    h.step()
tr = h.transform(workers=(0, 1), tp=2, layers_per_step=1)
steps, t = 0, time.perf_counter()
while not tr.done:
    h.step(); steps += 1
print(1000 * (time.perf_counter() - t) / max(steps, 1))
""",
    # bench_transform.py's Figure 11 at the depth of Llama-3-8B: one layer of 32 per step
    "staggered merge 4xTP1 -> TP4, 32 layers, mean step (ms)": """
import time, gyges
tiny = gyges.Model.tiny()
ModelConfig = type(tiny.config)  # wherever the build keeps it
m = gyges.Model.random(ModelConfig.from_dict({**tiny.config.to_dict(), "num_hidden_layers": 32}),
                       seed=1)
h = gyges.Host(m, workers=4, memory_per_worker="256MiB", layout="4xTP1", page_size="256KiB")
p = gyges.SamplingParams(max_tokens=200, ignore_eos=True)
for i in range(8):
    h.submit([1, 2, 3, i] * 16, p)
for _ in range(4):
    h.step()
tr = h.transform(workers=(0, 1, 2, 3), tp=4, layers_per_step=1)
steps, t = 0, time.perf_counter()
while not tr.done:
    h.step(); steps += 1
print(1000 * (time.perf_counter() - t) / max(steps, 1))
""",
}


def build_base(rev, where):
    subprocess.run(["git", "worktree", "add", "--detach", str(where), rev], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL)
    env = dict(os.environ, GYGES_CUDA="0")
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace", "-j", "2"],
                   cwd=where, env=env, check=True, stdout=subprocess.DEVNULL)


def measure(tree, code):
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, check=True,
                         capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", default="HEAD~1", help="the commit to compare with")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    base_rev = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout.strip()
    here_rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        build_base(args.base, base)
        try:
            results = {name: {"base": [], "here": []} for name in CASES}
            for _ in range(args.rounds):
                for name, code in CASES.items():  # the two builds take turns
                    results[name]["base"].append(measure(base, code))
                    results[name]["here"].append(measure(ROOT, code))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT,
                           check=False)
    rows = []
    for name, r in results.items():
        b, h = statistics.median(r["base"]), statistics.median(r["here"])
        rows.append({"case": name, "base": b, "here": h, "ratio": h / b})
    print_table(f"{here_rev} against {base_rev}, median of {args.rounds} alternating rounds", rows,
                [("case", "case", "{}"), ("base", f"base {base_rev}", "{:.1f}"),
                 ("here", f"here {here_rev}", "{:.1f}"), ("ratio", "here / base", "{:.3f}")])
    write_json("bench_ab", {"base": base_rev, "here": here_rev, "rounds": args.rounds,
                            "results": results})


if __name__ == "__main__":
    main()
