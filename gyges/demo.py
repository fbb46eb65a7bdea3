"""`make demo`: a real model, then one trace, three ways to run four CPU workers.

0. SmolLM2-135M-Instruct answers a question, and a story generated across a live merge of three
   workers into one TP3 instance comes out the same as without it.
1. A live transformation in a few lines: four TP1 instances serving short requests merge into
   one TP4 instance for a request none of them can hold, and split back.
2. The main job: a mixed trace of short chat-like requests and a few long ones (longer than a
   TP1 instance can hold) replayed on the embedded tiny model with 4 CPU workers of 32 MiB,
   under the Gyges policy (gyges.experiment: the simulator's C policy driving the real host),
   under a static 4xTP1 layout (the long requests are rejected) and a static 1xTP4 layout
   (everything on one instance). A table compares throughput, TTFT, TPOT, rejections and
   transformations, one line per layout says what it won and why, and a PNG (written into the
   working directory, or --out DIR) shows throughput over time with the transformations and the
   layout timeline of each run.

Timings are wall-clock on whatever machine runs it; on a small shared machine they move by
10-20% from run to run.
"""
import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

import gyges
from gyges import experiment, traces

MEMORY = "32MiB"   # per worker: a TP1 instance holds ~3,000 tokens of KV, TP2 ~8,300, TP4 ~18,900
RUNS = (("gyges", "gyges", "4xTP1"), ("static 4xTP1", "static", "4xTP1"),
        ("static 1xTP4", "static", "1xTP4"))
PLOT = "gyges-demo.png"


def real_model(n_tokens=60):
    """SmolLM2-135M-Instruct (shipped by a PyPI package) on three CPU workers: a chat answer,
    then a story whose generation spans a live 3xTP1 -> TP3 merge and is the same text as
    without it."""
    model = gyges.Model.load("smollm2-135m-instruct")
    print(f"   {model}")
    host = gyges.Host(model, workers=3, memory_per_worker="768MiB", page_size="256KiB",
                      layout="3xTP1")
    q = "What is the capital of France?"
    chat = host.generate_chat([{"role": "user", "content": q}],
                              gyges.SamplingParams(max_tokens=40))[0]
    print(f"   user: {q}\n   assistant: {chat.text}")
    prompt = "Once upon a time, a lighthouse keeper"
    params = gyges.SamplingParams(max_tokens=n_tokens, ignore_eos=True)
    plain = host.generate(prompt, params)[0]
    live = host.submit(prompt, params)
    for _ in range(20):
        host.step()
    t = host.transform(workers=(0, 1, 2), tp=3)
    print(f"   after {len(live.output_tokens)} tokens, merged live {t.stats['requests_moved']} "
          f"request into {host.layout()}")
    host.run()
    host.transform(workers=(0, 1, 2), tp=1)
    same = "the same text" if live.text == plain.text else "A DIFFERENT TEXT"
    print(f"   {prompt}{live.text}\n   ({same} as without the merge; split back into "
          f"{host.layout()})")
    host.close()


def serve(model):
    """One worker, continuous batching: per-request metrics and the memory they used."""
    engine = gyges.Engine(model, memory="64MiB", page_size="64KiB", block_size=16, kv_layout="header")
    idle = engine.memory()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, model.config.vocab_size, size=n).tolist() for n in (12, 40, 7, 100, 25, 64)]
    params = gyges.SamplingParams(max_tokens=48, temperature=0.7, top_p=0.9, seed=1, ignore_eos=True)
    requests = [engine.submit(p, params) for p in prompts]
    peak_kv = 0
    while engine.has_unfinished():
        engine.step()
        peak_kv = max(peak_kv, engine.memory()["kv"])
    print(f"   weights {idle['weights']:,} bytes ({engine.weights.padding_overhead():.1%} FFN padding); "
          f"KV peaked at {peak_kv:,} bytes and went back to {engine.memory()['kv']} after "
          f"{engine.steps} steps")
    print(f"   {'id':>3} {'prompt':>6} {'output':>6} {'TTFT ms':>8} {'TPOT ms':>8} {'E2E ms':>8}  first tokens")
    for r in requests:
        m = r.metrics
        print(f"   {r.id:>3} {len(r.prompt):>6} {len(r.output_tokens):>6} {m.ttft * 1e3:>8.1f} "
              f"{m.tpot * 1e3:>8.2f} {m.e2e * 1e3:>8.1f}  {r.output_tokens[:6]}")


def transform_live(model):
    host = gyges.Host(model, workers=4, memory_per_worker="24MiB", layout="4xTP1")
    rng = np.random.default_rng(1)
    params = gyges.SamplingParams(max_tokens=32, temperature=0.8, seed=7, ignore_eos=True)
    short = [host.submit(rng.integers(0, 4096, size=40).tolist(), params) for _ in range(8)]
    for _ in range(5):
        host.step()
    long_prompt = rng.integers(0, 4096, size=1500).tolist()
    try:
        host.submit(long_prompt, params)
    except ValueError as e:
        print(f"   a 1500-token request arrives at {host.layout()}: {str(e).split(';')[0]}")
    t = host.transform(workers=(0, 1, 2, 3), tp=4)
    s = t.stats
    print(f"   merged live into {host.layout()}: {s['requests_moved']} requests moved with their "
          f"progress, FFN pages released {sum(s['weight_bytes_released'].values()):,} bytes "
          f"(0 copied), KV sent {sum(s['bytes_sent'].values()):,} bytes")
    long = host.submit(long_prompt, params)
    host.run()
    back = host.transform(workers=(0, 1, 2, 3), tp=1)
    print(f"   the long request got {len(long.output_tokens)} tokens (TTFT "
          f"{long.metrics.ttft * 1e3:.0f} ms), the short ones "
          f"{sorted(set(len(r.output_tokens) for r in short))}; split back into {host.layout()} "
          f"in {sum(back.stats['phase_seconds'].values()) * 1e3:.0f} ms")


RATE = 6.0


def mixed_trace(duration=16.0, seed=0, n_long=4):
    """Short requests (Poisson, 5/s, 64-512 prompt tokens, 16-96 output tokens) and `n_long` long
    ones (3,200-3,900 prompt tokens: more KV than a TP1 instance holds at 32 MiB)."""
    short = traces.poisson(RATE, duration=duration, input_tokens=(64, 512),
                           output_tokens=(16, 96), seed=seed)
    rng = np.random.default_rng(seed + 1)
    arrival = np.sort(rng.uniform(0.1, 0.75, n_long)) * duration
    long = traces.from_arrays(arrival, rng.integers(3200, 3900, n_long), np.full(n_long, 48))
    return traces.merge([short, long])


def compare(trace, model):
    rows, results = [], {}
    for label, policy, layout in RUNS:
        host = gyges.Host(model, workers=4, memory_per_worker=MEMORY, layout=layout)
        start = time.perf_counter()
        res = experiment.run(trace, policy, host=host, time_scale=1.0)
        s = res.summary()
        results[label] = res
        rows.append({"run": label, "done": s["completed"], "rejected": s["policy_rejected"],
                     "out_tps": s["output_throughput"], "tok_tps": s["total_token_throughput"],
                     "ttft50": s["ttft_median"] * 1e3, "ttft99": s["ttft_p99"] * 1e3,
                     "tpot": s["tpot_mean"] * 1e3, "xf": s["transformations"],
                     "wall": time.perf_counter() - start})
        print(f"   {label:<13} {time.perf_counter() - start:5.1f} s, final layout "
              f"{res.stats['final_layout']}", flush=True)
    cols = (("run", "run", "{}"), ("done", "completed", "{}"), ("rejected", "rejected", "{}"),
            ("out_tps", "output tok/s", "{:.0f}"), ("tok_tps", "total tok/s", "{:.0f}"),
            ("ttft50", "TTFT p50 ms", "{:.0f}"), ("ttft99", "TTFT p99 ms", "{:.0f}"),
            ("tpot", "TPOT ms", "{:.1f}"), ("xf", "transformations", "{}"))
    cells = [[fmt.format(r[k]) for k, _, fmt in cols] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (_, h, _) in enumerate(cols)]
    print()
    print("   " + "  ".join(h.rjust(w) for (_, h, _), w in zip(cols, widths)))
    print("   " + "  ".join("-" * w for w in widths))
    for c in cells:
        print("   " + "  ".join(v.rjust(w) for v, w in zip(c, widths)))
    return rows, results


# What each column's winner is: the highest or the lowest value.
WINS = (("done", max, "most requests served"), ("out_tps", max, "most output tok/s"),
        ("ttft50", min, "lowest TTFT p50"), ("ttft99", min, "lowest TTFT p99"),
        ("tpot", min, "lowest TPOT"))


def why(rows, capacities, block_size):
    """One line per run: what it won in this table (computed, ties included) and the property
    of its layout that explains it, with this run's own figures."""
    by = {r["run"]: r for r in rows}
    tp1, tp4 = by["static 4xTP1"], by["static 1xTP4"]
    cap1, cap4 = capacities[0] * block_size, capacities[-1] * block_size
    reasons = {
        "static 4xTP1": (f"four TP1 instances step side by side with no all-reduce, but one holds "
                         f"{cap1:,} tokens of KV, so it rejected {tp1['rejected']} longer "
                         f"request(s)"),
        "static 1xTP4": (f"one TP4 instance holds {cap4:,} tokens, so nothing is rejected, but "
                         f"every request waits in its one queue, whose TP4 steps on "
                         f"{os.cpu_count()} CPU cores take {tp4['tpot']:.1f} ms a token (TP1's: "
                         f"{tp1['tpot']:.1f})"),
        "gyges": (f"serves what TP1 instances cannot hold by merging workers only while it must "
                  f"({by['gyges']['xf']} transformations), and runs the rest as TP1; requests "
                  f"placed on a merged instance queue behind its long prefill (its TTFT p99)"),
    }
    for r in rows:
        won = [what for key, best, what in WINS
               if r[key] == best(x[key] for x in rows) and len({x[key] for x in rows}) > 1]
        print(f"   {r['run']}: {', '.join(won) if won else 'wins no column'}: "
              f"{reasons[r['run']]}")


def plot(results, path):
    """Throughput over time of every run (scale-ups and scale-downs of the gyges run marked) and
    the layout timeline of each run, one row of workers per run."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 1, figsize=(11, 7.5), constrained_layout=True,
                             gridspec_kw={"height_ratios": [3, 2]})
    ax = axes[0]
    for label, res in results.items():
        t, out, _ = res.throughput()
        k = max(1, int(round(1.0 / res.bin_seconds)))   # 1-second moving average
        smooth = np.convolve(out, np.ones(k) / k, mode="same")
        ax.plot(t + res.bin_seconds / 2, smooth, lw=1.2, label=label)
    g = results.get("gyges")
    if g is not None:
        for tr in g.transformations:
            ax.axvline(tr["start"], color="tab:red" if tr["kind"] == 0 else "tab:green",
                       lw=0.8, ls="--", alpha=0.7)
        long = g.requests[g.requests["min_tp"] != 1]
        ax.plot(long["arrival"], np.zeros(long.size), "k^", ms=7, label="long request arrives")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("output tokens/s (1 s average)")
    ax.set_title("throughput; gyges run: red = merge (scale-up), green = split (scale-down)")
    ax.legend(loc="upper right", fontsize=8)
    ax = axes[1]
    colours = {1: "tab:blue", 2: "tab:orange", 4: "tab:red"}
    ticks = []
    for row, (label, res) in enumerate(results.items()):
        base = row * 5
        end = float(np.nanmax(res.requests["finish"]))
        open_at = {}
        for ev in res.layout[np.argsort(res.layout["time"], kind="stable")]:
            key = (int(ev["gpu"]), int(ev["tp"]))
            if ev["change"] > 0:
                open_at[key] = float(ev["time"])
            elif key in open_at:
                s = open_at.pop(key)
                ax.broken_barh([(s, float(ev["time"]) - s)], (base + key[0], key[1] - 0.1),
                               facecolors=colours.get(key[1], "k"))
        for (gpu, tp), s in open_at.items():
            ax.broken_barh([(s, end - s)], (base + gpu, tp - 0.1), facecolors=colours.get(tp, "k"))
        ticks.append((base + 2, label))
    ax.set_yticks([t for t, _ in ticks], [lab for _, lab in ticks])
    ax.invert_yaxis()
    ax.set_xlabel("time (s)")
    ax.set_title("layout over time, workers 0-3 per run (blue TP1, orange TP2, red TP4)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m gyges.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=".", help="where the plot goes (default: the working "
                        "directory)")
    out = parser.parse_args(argv).out
    if not os.path.isdir(out):
        parser.error(f"--out {out!r} is not a directory")
    start = time.perf_counter()
    print(f"gyges {gyges.__version__} (CUDA backend compiled in: {gyges.WITH_CUDA})")
    # GYGES_DEMO_QUICK=1 (the test suite): shorter runs, for machines whose CPU has no AVX-512
    # (the portable kernels are several times slower).
    quick = os.environ.get("GYGES_DEMO_QUICK") == "1"
    print("\n== a real model, text in and out, and a live transformation")
    real_model(n_tokens=32 if quick else 60)
    model = gyges.Model.tiny()
    print(f"\n== one worker serving the embedded tiny model ({model})")
    serve(model)
    print("\n== live transformation on 4 CPU workers")
    transform_live(model)

    trace = mixed_trace(duration=5.0, n_long=1) if quick else mixed_trace()
    n_long = int((trace["input_tokens"] > 3000).sum())
    print(f"\n== one trace, three layouts: {trace.size} requests over "
          f"{trace['arrival'][-1]:.0f} s ({trace.size - n_long} short, {n_long} long of "
          f"{trace['input_tokens'].max():,} tokens at most), 4 workers of {MEMORY}")
    host = gyges.Host(model, workers=4, memory_per_worker=MEMORY, layout="4xTP1")
    caps, block_size = experiment.capacities(host), host.block_size
    print(f"   a fresh instance holds {', '.join(f'TP{1 << i} {c * host.block_size:,}' for i, c in enumerate(caps))} "
          f"tokens of KV; the policies are the simulator's C code (csrc/policy/policy_*.c)")
    del host
    rows, results = compare(trace, model)
    print()
    why(rows, caps, block_size)
    path = Path(out) / PLOT
    try:
        plot(results, path)
        print(f"\nplot: {path}")
    except ImportError:
        print("\n(matplotlib is not installed: no plot)")
    g = results["gyges"]
    print("gyges transformations: " + ", ".join(
        f"{'merge' if t['kind'] == 0 else 'split'} TP{t['tp_from']}->TP{t['tp_to']} at worker "
        f"{t['gpu']} ({t['start']:.1f} s, {(t['end'] - t['start']) * 1e3:.0f} ms)"
        for t in g.transformations))
    print(f"demo finished in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
