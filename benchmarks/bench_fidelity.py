"""Fidelity of the simulator with a profiled cost model (issue 35, part 2): gyges.sim.run with a
gyges.cluster.profile.ProfiledCost measured on the real CPU engine, against gyges.experiment.run
on that engine, on traces the profile never saw.

1. Profile (Vidur-style): ProfiledCost.profile(host) runs a grid of decode batches x contexts
   and prefill lengths on every instance of the host at once ("all busy"; and once more on one
   instance while the others idle, "one busy"), at every TP it forms, and fits a step time
   linear in the batch shape per TP. SmolLM2-135M on 2 CPU workers (TP1 only: its 3
   KV heads split 1 or 3 ways), and the tiny model on 2 workers (TP1 and TP2, for the merges).
   The profiles are saved as JSON (benchmarks/results/profile_*.json; --reuse loads them).
   The simulator runs with each (the CPU workers share cores and memory bandwidth, so a step's
   time depends on what the other instances do: the two profiles bracket it), and with both
   (ProfiledCost.with_alone): each step priced between them by the share of the host's other
   workers stepping when it starts, which the simulator knows.
2. Held-out traces, each replayed `--repeats` times on a fresh host (the mean is compared) and
   once in the simulator with the same policy knobs, the profile's prefill rates in both:
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


def simulate(trace, policy, cost, host):
    knobs = {"light_load": 0.0, "idle_load": 0.0} if policy == "gyges" else {}
    return sim.run(trace, policy=policy, gpus_per_host=WORKERS, cost=cost, max_tp=cost.max_tp,
                   block_size=host.block_size, max_batch_tokens=host.max_batch_tokens,
                   max_running=host.max_running, max_prefill_chunk=host.max_prefill_chunk,
                   watermark=0.0, merge_wait=1.0, **knobs)


def step_kinds(steps, cost):
    """Measured vs predicted step time by kind of step (decode only, prefill only, mixed) and by
    how many of the host's instances were stepping when it began (the profile measured every
    instance busy at once)."""
    pred = np.array([cost.step_time(int(s["tp"]), int(s["n_tokens"]), int(s["n_seqs"]),
                                    int(s["n_samples"]), float(s["kv_read_tokens"]),
                                    float(s["attn_pairs"])) for s in steps])
    decode = steps["n_tokens"] == steps["n_seqs"]          # one token each
    prefill = (steps["n_seqs"] == 1) & ~decode
    kinds = (("decode only", decode), ("prefill only", prefill), ("mixed", ~decode & ~prefill))
    total = steps["seconds"].sum()
    out = []
    for kind, m in kinds:
        for busy in sorted(set(steps["concurrent"][m].tolist())):
            mb = m & (steps["concurrent"] == busy)
            real, p = steps["seconds"][mb].sum(), pred[mb].sum()
            out.append({"kind": kind, "busy": int(busy), "steps": int(mb.sum()),
                        "real_ms": 1e3 * real / mb.sum(), "pred_ms": 1e3 * p / mb.sum(),
                        "err": 100 * (p / real - 1), "share": 100 * real / total})
    return out


METRICS = (("output tok/s", "output_throughput", 1.0), ("TTFT ms", "ttft_mean", 1e3),
           ("TPOT ms", "tpot_mean", 1e3))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="half-length traces, 1 real run each")
    ap.add_argument("--repeats", type=int, default=None, help="real runs per trace (default 3)")
    ap.add_argument("--reuse", action="store_true",
                    help="load the profiles of an earlier run (benchmarks/results/profile_*.json)")
    args = ap.parse_args()
    repeats = args.repeats or (1 if args.quick else 3)
    print(f"gyges {gyges.__version__}: {WORKERS} CPU workers, {os.cpu_count()} cores, load "
          f"{os.getloadavg()[0]:.1f}; {repeats} real runs per trace")
    t0 = time.perf_counter()
    models = {name: loader() for name, (loader, _, _) in SETUPS.items()}
    costs, alone, fit_rows = {}, {}, []
    for name, concurrent in [(n, c) for n in SETUPS for c in (True, False)]:
        cost, seconds = profile(name, models[name], args.reuse, 3 if args.quick else 5,
                                concurrent)
        (costs if concurrent else alone)[name] = cost
        err = np.array([abs(r["error"]) for r in cost.fit_report()]) * 100
        fit_rows.append({"profile": f"{name}, {'all' if concurrent else 'one'} busy",
                         "points": len(cost.points), "tps": len(cost.levels),
                         "seconds": seconds, "median": float(np.median(err)),
                         "max": float(err.max()),
                         "xfer": cost.xfer_bw / 1e9,
                         "lat": cost.phase_latency_per_layer * 1e3})
    print_table("profiles: the fit on its own grid points (|fitted / measured - 1|)", fit_rows, [
        ("profile", "profile", "{}"), ("points", "grid points", "{}"), ("tps", "TP levels", "{}"),
        ("seconds", "profiling s", "{:.0f}"), ("median", "median err %", "{:.1f}"),
        ("max", "max err %", "{:.1f}"), ("xfer", "phase GB/s", "{:.2f}"),
        ("lat", "phase ms/layer", "{:.3f}")])

    rows, kind_rows, runs = [], [], []
    for label, name, policy, trace in held_out(args.quick):
        _, memory, _ = SETUPS[name]
        cost = costs[name]

        def new_host():
            return gyges.Host(models[name], workers=WORKERS, memory_per_worker=memory,
                              layout=f"{WORKERS}xTP1")
        real = []
        for _ in range(repeats):
            host = new_host()
            real.append(experiment.run(trace, policy, host=host, cost=cost, record_steps=True,
                                       max_tp=cost.max_tp))
            host.close()
        host = new_host()
        s = simulate(trace, policy, cost, host).summary()
        s1 = simulate(trace, policy, alone[name], host).summary()
        s2 = simulate(trace, policy, cost.with_alone(alone[name]), host).summary()
        host.close()
        reals = [r.summary() for r in real]
        for metric, key, scale in METRICS:
            values = np.array([r[key] for r in reals], float)
            mean = float(values.mean())
            rows.append({"trace": label, "metric": metric, "real": mean * scale,
                         "spread": 100 * (values.max() - values.min()) / 2 / mean,
                         "sim": s[key] * scale, "err": 100 * (s[key] / mean - 1),
                         "sim1": s1[key] * scale, "err1": 100 * (s1[key] / mean - 1),
                         "sim2": s2[key] * scale, "err2": 100 * (s2[key] / mean - 1)})
        steps = np.concatenate([r.steps for r in real])
        for k in step_kinds(steps, cost):
            kind_rows.append({"trace": label, **k})
        busy = float(np.mean([r.steps["seconds"].sum() for r in real]))
        runs.append({"trace": label, "requests": int(trace.size),
                     "real_merges": float(np.mean([r.stats["n_merges"] for r in real])),
                     "real_splits": float(np.mean([r.stats["n_splits"] for r in real])),
                     "sim_transformations": int(s["transformations"]),
                     "real_seconds": float(np.mean([r.stats["now"] for r in real])),
                     "steps_seconds": busy})
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
        ("sim_transformations", "transformations (sim)", "{}"),
        ("real_seconds", "run s (real)", "{:.1f}")])
    print(f"\n{time.perf_counter() - t0:.0f} s")
    write_json("bench_fidelity", {"workers": WORKERS, "cores": os.cpu_count(),
                                  "repeats": repeats, "quick": args.quick, "fits": fit_rows,
                                  "rows": rows, "step_kinds": kind_rows, "runs": runs,
                                  "profiles": {n: c.describe() for n, c in costs.items()},
                                  "profiles_one_busy": {n: c.describe()
                                                        for n, c in alone.items()}})


if __name__ == "__main__":
    main()
