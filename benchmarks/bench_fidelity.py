"""Fidelity of the simulator with a profiled cost model (issue 35, part 2): gyges.sim.run with a
gyges.cluster.profile.ProfiledCost measured on the real CPU engine, against gyges.experiment.run
on that engine, on traces the profile never saw.

1. Profile (Vidur-style): ProfiledCost.profile(host) runs a grid of decode batches x contexts
   and prefill lengths on every instance of the host at once ("all busy"; and once more on one
   instance while the others idle, "one busy"), at every TP it forms, and fits a step time
   linear in the batch shape per TP. SmolLM2-135M on 2 CPU workers (TP1 only: its 3
   KV heads split 1 or 3 ways), and the tiny model on 2 workers (TP1 and TP2, for the merges).
   The host is profiled again right before and right after each real run (a shared machine's
   speed drifts by more than the goal over minutes, its memory-bound decode steps most), so a
   run is set against the machine as it was then: it is simulated once with each pair of
   profiles, and the simulations' mean is its prediction. The last profiles are saved
   as JSON (benchmarks/results/profile_*.json; --reuse loads them for every run instead).
   The simulator runs with each (the CPU workers share cores and memory bandwidth, so a step's
   time depends on what the other instances do: the two profiles bracket it), and with both
   (ProfiledCost.with_alone): each step priced between them by the share of the host's other
   workers stepping when it starts, which the simulator knows.
2. Held-out traces, each replayed `--repeats` times on a fresh host and simulated twice per
   run, with that run's profiles and the same policy knobs (the profile's prefill rates in
   both); the means are compared:
   - smollm2 light: round robin over 2xTP1 at a rate the host keeps up with;
   - smollm2 saturated: least load over 2xTP1, arrivals faster than it serves;
   - tiny reconfig: gyges over 2xTP1 with short requests and two prompts only a TP2 instance
     holds: live merges and splits in the run.
   Errors: simulated / real - 1 for output throughput, mean TTFT and mean TPOT (goal: 5%).
3. Which term: every real step is recorded (record_steps) and set against the profile's
   prediction for its shape, by kind of step (decode only, prefill only, mixed), and how much of
   the instances' busy time each kind is; and the runs' time the steps do not account for
   (between steps, transformations).

Fixed seeds; times are wall-clock on a shared machine (the spread column: half the range of the
repeats, relative to their mean).

Run: .venv/bin/python benchmarks/bench_fidelity.py [--quick] [--repeats N] [--reuse]
"""
import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import RESULTS, print_table, write_json  # noqa: E402
import gyges  # noqa: E402
from gyges import experiment, sim, traces  # noqa: E402
from gyges.cluster.profile import ProfiledCost  # noqa: E402

WORKERS = 2
SETUPS = {
    # name: (model loader, memory per worker, profiling grid)
    "smollm2": (lambda: gyges.Model.load("smollm2-135m-instruct"), "1GiB",
                {"batch": (1, 4, 8), "context": (32, 160), "prefill": (64, 256)}),
    "tiny": (gyges.Model.tiny, "24MiB",
             # up to the long prompts' shapes, which only its TP2 holds (measured there)
             {"batch": (1, 2, 4), "context": (32, 96, 512, 1024),
              "prefill": (32, 96, 256, 640, 1280)}),
}


def held_out(quick):
    """(label, setup, policy, trace): none of them is the profiling grid."""
    d = 0.5 if quick else 1.0
    light = traces.poisson(0.3, duration=40 * d, input_tokens=(32, 192), output_tokens=(16, 48),
                           seed=11)
    saturated = traces.poisson(1.5, duration=10 * d, input_tokens=(32, 192),
                               output_tokens=(16, 48), seed=12)
    short = traces.poisson(3.0, duration=12 * d, input_tokens=(32, 200), output_tokens=(8, 48),
                           seed=13)
    rng = np.random.default_rng(14)
    n_long = 2
    long = traces.from_arrays(np.array([0.25, 0.65]) * 12 * d, rng.integers(1000, 1300, n_long),
                              np.full(n_long, 24))
    return (("smollm2 light, round_robin 2xTP1", "smollm2", "round_robin", light),
            ("smollm2 saturated, least_load 2xTP1", "smollm2", "least_load", saturated),
            ("tiny reconfig, gyges 2xTP1 (merges)", "tiny", "gyges", traces.merge([short, long])))


def profile(name, model, reuse, repeats, concurrent):
    path = RESULTS / f"profile_{name}{'' if concurrent else '_alone'}.json"
    if reuse and path.exists():
        return ProfiledCost.load(path), 0.0
    _, memory, grid = SETUPS[name]
    host = gyges.Host(model, workers=WORKERS, memory_per_worker=memory,
                      layout=f"{WORKERS}xTP1")
    t = time.perf_counter()
    cost = ProfiledCost.profile(host, grid, warmup=1, repeats=repeats, concurrent=concurrent)
    seconds = time.perf_counter() - t
    host.close()
    RESULTS.mkdir(exist_ok=True)
    cost.save(path)
    return cost, seconds


def host_knobs(host):
    """The simulator's knobs that are the host's: its blocks and its scheduler's limits."""
    return {"block_size": host.block_size, "max_batch_tokens": host.max_batch_tokens,
            "max_running": host.max_running, "max_prefill_chunk": host.max_prefill_chunk}


def simulate(trace, policy, cost, host_knobs):
    knobs = {"light_load": 0.0, "idle_load": 0.0} if policy == "gyges" else {}
    return sim.run(trace, policy=policy, gpus_per_host=WORKERS, cost=cost, max_tp=cost.max_tp,
                   watermark=0.0, merge_wait=1.0, **host_knobs, **knobs)


def step_kinds(runs):
    """Measured vs predicted step time by kind of step (decode only, prefill only, mixed) and by
    how many of the host's instances were stepping when it began (the all-busy profile measured
    every instance busy at once), over `runs` of (steps, the profiles taken before and after them:
their mean prediction)."""
    sums = {}                                  # (kind, busy) -> [steps, real s, predicted s]
    total = 0.0
    for steps, costs in runs:
        pred = np.array([np.mean([cost.step_time(int(s["tp"]), int(s["n_tokens"]),
                                                 int(s["n_seqs"]), int(s["n_samples"]),
                                                 float(s["kv_read_tokens"]),
                                                 float(s["attn_pairs"])) for cost in costs])
                         for s in steps])
        decode = steps["n_tokens"] == steps["n_seqs"]          # one token each
        prefill = (steps["n_seqs"] == 1) & ~decode
        total += steps["seconds"].sum()
        for kind, m in (("decode only", decode), ("prefill only", prefill),
                        ("mixed", ~decode & ~prefill)):
            for busy in set(steps["concurrent"][m].tolist()):
                mb = m & (steps["concurrent"] == busy)
                acc = sums.setdefault((kind, int(busy)), [0, 0.0, 0.0])
                acc[0] += int(mb.sum())
                acc[1] += steps["seconds"][mb].sum()
                acc[2] += pred[mb].sum()
    order = {"decode only": 0, "prefill only": 1, "mixed": 2}
    return [{"kind": kind, "busy": busy, "steps": n, "real_ms": 1e3 * real / n,
             "pred_ms": 1e3 * p / n, "err": 100 * (p / real - 1), "share": 100 * real / total}
            for (kind, busy), (n, real, p) in sorted(sums.items(),
                                                      key=lambda kv: (order[kv[0][0]], kv[0][1]))]


METRICS = (("output tok/s", "output_throughput", 1.0), ("TTFT ms", "ttft_mean", 1e3),
           ("TPOT ms", "tpot_mean", 1e3))


def profile_pair(name, model, reuse, repeats):
    """(all busy, one busy) profiles of setup `name`, and the seconds each took."""
    return [profile(name, model, reuse, repeats, concurrent) for concurrent in (True, False)]


def fit_row(label, costs_and_seconds):
    """The fit on its own grid points, over every profile taken of one kind."""
    err = np.concatenate([[abs(r["error"]) for r in c.fit_report()]
                          for c, _ in costs_and_seconds]) * 100
    last = costs_and_seconds[-1][0]
    return {"profile": label, "taken": len(costs_and_seconds), "points": len(last.points),
            "tps": len(last.levels),
            "seconds": float(np.mean([s for _, s in costs_and_seconds])),
            "median": float(np.median(err)), "max": float(err.max()),
            "xfer": last.xfer_bw / 1e9, "lat": last.phase_latency_per_layer * 1e3}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="half-length traces, 1 real run each")
    ap.add_argument("--repeats", type=int, default=None, help="real runs per trace (default 3)")
    ap.add_argument("--reuse", action="store_true",
                    help="load the profiles of an earlier run (benchmarks/results/profile_*.json)"
                         " instead of profiling before each real run")
    args = ap.parse_args()
    repeats = args.repeats or (1 if args.quick else 3)
    grid_repeats = 3 if args.quick else 5
    print(f"gyges {gyges.__version__}: {WORKERS} CPU workers, {os.cpu_count()} cores, load "
          f"{os.getloadavg()[0]:.1f}; {repeats} real runs per trace, each right after a profile "
          f"of its host")
    t0 = time.perf_counter()
    models = {name: loader() for name, (loader, _, _) in SETUPS.items()}
    taken = {(name, c): [] for name in SETUPS for c in ("all", "one")}
    rows, kind_rows, runs, last = [], [], [], {}
    for label, name, policy, trace in held_out(args.quick):
        _, memory, _ = SETUPS[name]

        def new_host():
            return gyges.Host(models[name], workers=WORKERS, memory_per_worker=memory,
                              layout=f"{WORKERS}xTP1")
        real, sims, all_steps = [], {"sim": [], "sim1": [], "sim2": []}, []
        for _ in range(repeats):
            # profiles just before and just after the run: a shared machine's speed drifts by
            # more than the 5% goal over minutes (memory-bound decode steps most), so each real
            # run is set against profiles of the machine as it was then, on both sides of it
            pairs = [profile_pair(name, models[name], args.reuse, grid_repeats)]
            host = new_host()
            r = experiment.run(trace, policy, host=host, cost=pairs[0][0][0],
                               record_steps=True, max_tp=pairs[0][0][0].max_tp)
            knobs = host_knobs(host)
            host.close()   # (a process maps so many pages; the next profile's host needs them)
            pairs.append(profile_pair(name, models[name], args.reuse, grid_repeats))
            for (busy, s_busy), (alone, s_alone) in pairs:
                taken[name, "all"].append((busy, s_busy))
                taken[name, "one"].append((alone, s_alone))
                for key, cost in (("sim", busy), ("sim1", alone),
                                  ("sim2", busy.with_alone(alone))):
                    sims[key].append(simulate(trace, policy, cost, knobs).summary())
            real.append(r)
            all_steps.append((r.steps, [busy for (busy, _), _ in pairs]))
            last[name] = pairs[-1][0][0], pairs[-1][1][0]
        reals = [r.summary() for r in real]
        for metric, key, scale in METRICS:
            values = np.array([r[key] for r in reals], float)
            mean = float(values.mean())
            row = {"trace": label, "metric": metric, "real": mean * scale,
                   "spread": 100 * (values.max() - values.min()) / 2 / mean}
            for col, summaries in sims.items():
                sim_mean = float(np.mean([s[key] for s in summaries]))
                row[col] = sim_mean * scale
                row[col.replace("sim", "err")] = 100 * (sim_mean / mean - 1)
            rows.append(row)
        for k in step_kinds(all_steps):
            kind_rows.append({"trace": label, **k})
        runs.append({"trace": label, "requests": int(trace.size),
                     "real_merges": float(np.mean([r.stats["n_merges"] for r in real])),
                     "real_splits": float(np.mean([r.stats["n_splits"] for r in real])),
                     "sim_transformations": float(np.mean([s["transformations"]
                                                           for s in sims["sim"]])),
                     "real_seconds": float(np.mean([r.stats["now"] for r in real])),
                     "steps_seconds": float(np.mean([r.steps["seconds"].sum() for r in real]))})
    fit_rows = [fit_row(f"{name}, {c} busy", ps) for (name, c), ps in taken.items() if ps]
    print_table("profiles: the fit on its own grid points (|fitted / measured - 1|, over every "
                "profile taken)", fit_rows, [
        ("profile", "profile", "{}"), ("taken", "profiles", "{}"),
        ("points", "grid points", "{}"), ("tps", "TP levels", "{}"),
        ("seconds", "profiling s", "{:.0f}"), ("median", "median err %", "{:.1f}"),
        ("max", "max err %", "{:.1f}"), ("xfer", "phase GB/s", "{:.2f}"),
        ("lat", "phase ms/layer", "{:.3f}")])
    print_table(f"simulator (profiled cost) vs real CPU host, held-out traces (real: the mean of "
                f"{repeats} runs; goal |err| < 5%)", rows, [
        ("trace", "trace", "{}"), ("metric", "metric", "{}"), ("real", "real", "{:.2f}"),
        ("spread", "spread %", "{:.1f}"), ("sim", "sim (all busy)", "{:.2f}"),
        ("err", "err %", "{:+.1f}"), ("sim1", "sim (one busy)", "{:.2f}"),
        ("err1", "err %", "{:+.1f}"), ("sim2", "sim (by busy share)", "{:.2f}"),
        ("err2", "err %", "{:+.1f}")])
    print_table("where the error comes from: real steps vs the all-busy profile's prediction for "
                "their shape", kind_rows, [
        ("trace", "trace", "{}"), ("kind", "step kind", "{}"),
        ("busy", "instances running (0, 1: alone)", "{}"), ("steps", "steps", "{}"),
        ("share", "share of step time %", "{:.0f}"), ("real_ms", "real ms", "{:.2f}"),
        ("pred_ms", "profile ms", "{:.2f}"), ("err", "err %", "{:+.1f}")])
    print_table("the runs", runs, [
        ("trace", "trace", "{}"), ("requests", "requests", "{}"),
        ("real_merges", "merges (real)", "{:.1f}"), ("real_splits", "splits (real)", "{:.1f}"),
        ("sim_transformations", "transformations (sim)", "{:.1f}"),
        ("real_seconds", "run s (real)", "{:.1f}")])
    print(f"\n{time.perf_counter() - t0:.0f} s")
    write_json("bench_fidelity", {"workers": WORKERS, "cores": os.cpu_count(),
                                  "repeats": repeats, "quick": args.quick, "fits": fit_rows,
                                  "rows": rows, "step_kinds": kind_rows, "runs": runs,
                                  "profiles": {n: b.describe() for n, (b, _) in last.items()},
                                  "profiles_one_busy": {n: a.describe()
                                                        for n, (_, a) in last.items()}})


if __name__ == "__main__":
    main()
