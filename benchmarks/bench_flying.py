"""Flying Serving on the CPU host (tiny model, 4 workers, weights="replicated").

1. Switch latency (Flying Serving Table 2: 15 ms live vs 146-292 s cold restart): a hard bind of
   four DP workers into TP4 and the release back, at 0%, 50% and 90% of the KV in use by running
   DP requests, beside building a new Host in the TP4 layout (the cold restart) and a Gyges
   4xTP1 -> TP4 transformation of a sharded host at the same occupancy (which moves KV and
   weights). Goal: a switch under 1 ms whatever the occupancy. Median of 5.
2. Maximum context per mode (Table 2's first column): the longest request a DP worker, a bound
   TP2 and a bound TP4 group of the replicated host can hold, beside static sharded TP2 and TP4
   hosts of the same per-worker memory (sharded ranks keep 1/k of the FFN, so they hold more).
3. Priority workload (Table 1): a stream of normal requests with every fourth one a priority
   request, on static 4xTP1 (DP), static TP4, and the replicated host where priority requests
   ask for TP4 (hard) and the rest run in DP: mean TTFT/TPOT of priority requests and of all,
   and output tokens per second. The paper's figures are beside ours; 4 worker threads share
   2 cores here, so TP4 is not 4x faster per token than DP as on GPUs, and the ratios differ.

Run: .venv/bin/python benchmarks/bench_flying.py [--quick]
"""
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import gyges  # noqa: E402
from benchmarks.common import print_table, write_json  # noqa: E402

MEM = "32MiB"
QUICK = "--quick" in sys.argv


def prompts(n, seed, lo, hi):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 4000, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def fill(host, fraction, instance=None):
    """Submits and prefills DP requests until `fraction` of every worker's KV budget is in use."""
    reqs = []
    if fraction > 0:
        cap = host.instances[0].capacity_blocks() * host.block_size
        per_worker = int(cap * fraction)
        for w in range(4):
            length = per_worker - 64
            reqs.append(host.submit(prompts(1, w, length, length + 1)[0],
                                    gyges.SamplingParams(max_tokens=64, ignore_eos=True),
                                    instance=w))
        host.step()
    return reqs


def switch_rows(model):
    rows = []
    repeat = 3 if QUICK else 5
    for fraction in (0.0, 0.5, 0.9):
        binds, releases, transforms = [], [], []
        for _ in range(repeat):
            host = gyges.Host(model, workers=4, memory_per_worker=MEM, weights="replicated")
            fill(host, fraction)
            s = host.switch((0, 1, 2, 3), 4, preempt="hard")
            start = time.perf_counter()
            r = host.switch((0, 1, 2, 3), 1)
            releases.append(time.perf_counter() - start)
            assert r.done and s.done
            binds.append(s.stats["switch_seconds"])
            stats = s.stats
            host.close()
            sharded = gyges.Host(model, workers=4, memory_per_worker=MEM)
            fill(sharded, fraction)
            start = time.perf_counter()
            sharded.transform((0, 1, 2, 3), 4)
            transforms.append(time.perf_counter() - start)
            sharded.close()
        rows.append({"kv_used": f"{fraction:.0%}", "bind_ms": 1e3 * statistics.median(binds),
                     "release_ms": 1e3 * statistics.median(releases),
                     "gyges_transform_ms": 1e3 * statistics.median(transforms),
                     "bytes_copied": stats["weight_bytes_copied"],
                     "pages_mapped": stats["pages_mapped"],
                     "comms_made": stats["communicators_created"]})
    starts = []
    for _ in range(repeat):
        start = time.perf_counter()
        gyges.Host(model, workers=4, memory_per_worker=MEM, layout="TP4").close()
        starts.append(time.perf_counter() - start)
    return rows, 1e3 * statistics.median(starts)


def context_rows(model):
    rows = []
    rep = gyges.Host(model, workers=4, memory_per_worker=MEM, weights="replicated")
    dp = rep.replicas.dp[0]
    for name, inst in (("DP (one worker)", dp),
                       ("dynamic TP2", rep.replicas.groups[(0, 2)].instance),
                       ("dynamic TP4", rep.replicas.groups[(0, 4)].instance)):
        rows.append({"mode": name, "tokens": inst.capacity_blocks() * inst.block_tokens})
    for layout in ("2xTP2", "TP4"):
        host = gyges.Host(model, workers=4, memory_per_worker=MEM, layout=layout)
        inst = host.instances[0]
        rows.append({"mode": f"static {layout} (sharded)",
                     "tokens": inst.capacity_blocks() * inst.block_tokens})
        host.close()
    base = rows[0]["tokens"]
    for row in rows:
        row["x_dp"] = row["tokens"] / base
    paper = {"DP (one worker)": "264K (4DPx2TP)", "static 2xTP2 (sharded)": "959K (2DPx4TP)",
             "static TP4 (sharded)": "2.3M (1DPx8TP)", "dynamic TP4": "1.9M (dynamic)"}
    for row in rows:
        row["paper"] = paper.get(row["mode"])
    return rows


def priority_rows(model):
    n = 32 if QUICK else 64
    ps = prompts(n, 7, 16, 96)
    params = gyges.SamplingParams(max_tokens=32, ignore_eos=True)
    gap = 0.004  # seconds between arrivals: a queue builds on 4 workers sharing 2 cores
    rows = []
    for system in ("static DP (4xTP1)", "static TP4", "flying (priority -> TP4)"):
        if system == "static TP4":
            host = gyges.Host(model, workers=4, memory_per_worker=MEM, layout="TP4")
        elif system.startswith("flying"):
            host = gyges.Host(model, workers=4, memory_per_worker=MEM, weights="replicated")
        else:
            host = gyges.Host(model, workers=4, memory_per_worker=MEM)
        reqs, priority = [], []
        start = host.now()
        i = 0
        while i < n or host.has_unfinished():
            while i < n and host.now() - start >= i * gap:
                urgent = i % 4 == 3
                tp = 4 if urgent and system.startswith("flying") else None
                r = host.submit(ps[i], params, tp=tp, priority=int(urgent))
                reqs.append(r)
                if urgent:
                    priority.append(r)
                i += 1
            if host.has_unfinished():
                host.step()
        elapsed = max(r.metrics.finish for r in reqs) - start
        tokens = sum(len(r.output_tokens) for r in reqs)
        mean = lambda rs, f: 1e3 * statistics.mean(getattr(r.metrics, f) for r in rs)
        rows.append({"system": system, "ttft_priority_ms": mean(priority, "ttft"),
                     "tpot_priority_ms": mean(priority, "tpot"), "ttft_all_ms": mean(reqs, "ttft"),
                     "tokens_per_s": tokens / elapsed})
        host.close()
    paper = {"static DP (4xTP1)": (166, 32, 166, 3164), "static TP4": (63, 22, 2130, None),
             "flying (priority -> TP4)": (74, 24, 142, 3040)}
    for row in rows:
        p = paper[row["system"]]
        row["paper"] = (f"TTFT prio {p[0]} ms, TPOT prio {p[1]} ms, TTFT all {p[2]} ms" +
                        (f", {p[3]} tok/s" if p[3] else ""))
    return rows


def main():
    model = gyges.Model.tiny()
    switches, cold_ms = switch_rows(model)
    print_table(f"1. Switch latency, 4 workers (cold start of a TP4 host: {cold_ms:.1f} ms; "
                f"paper: 15 ms live vs 146-292 s cold)", switches,
                [("kv_used", "KV used", "{}"), ("bind_ms", "bind ms", "{:.3f}"),
                 ("release_ms", "release ms", "{:.3f}"),
                 ("gyges_transform_ms", "Gyges 4xTP1->TP4 ms", "{:.2f}"),
                 ("bytes_copied", "bytes copied", "{}"), ("pages_mapped", "pages mapped", "{}"),
                 ("comms_made", "comms made", "{}")])
    contexts = context_rows(model)
    print_table(f"2. Longest request per mode ({MEM} per worker)", contexts,
                [("mode", "mode", "{}"), ("tokens", "tokens", "{}"), ("x_dp", "x DP", "{:.2f}"),
                 ("paper", "paper (Llama-3-70B, 8 H200)", "{}")])
    priorities = priority_rows(model)
    print_table("3. Priority workload (every 4th request priority)", priorities,
                [("system", "system", "{}"), ("ttft_priority_ms", "TTFT prio ms", "{:.1f}"),
                 ("tpot_priority_ms", "TPOT prio ms", "{:.2f}"),
                 ("ttft_all_ms", "TTFT all ms", "{:.1f}"), ("tokens_per_s", "tok/s", "{:.0f}"),
                 ("paper", "paper (Table 1)", "{}")])
    write_json("bench_flying", {"switch": switches, "cold_start_ms": cold_ms,
                                "context": contexts, "priority": priorities})


if __name__ == "__main__":
    main()
