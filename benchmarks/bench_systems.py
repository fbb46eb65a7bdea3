"""All the systems side by side, through the one cluster controller: gyges (TP merges and
splits of sharded instances), PipeLive (live pipeline re-splits), Flying Serving (DP<->TP binds of
replicas), KunServe (buddy groups that drop replicated parameters), Seesaw (TP1 instances that
prefill, merged into a TP-N that decodes, N from its search, through host memory) and, in the
simulator, LoongServe
(elastic sequence parallelism over TP2 replicas), with least-load replication and the best static
layout beside them.

1. The simulator at paper scale: 8 H20 running Qwen2.5-32B, every system on the same GPUs
   (KunServe's groups and PipeLive's pipelines priced by a PipelineCost of H20 stages, 200 Gbps
   between GPUs; PipeLive runs four 2-stage pipelines, since it re-splits one pipeline per host).
   Four traces: Gyges 6.2.4 (short 1K prompts at 60/min and 50K prompts at 1/min, at 1.5x the
   paper's rate, where the baselines fall behind), the Azure LLM 2023 conversation trace scaled
   as bench_sim.py scales it (3% of requests exceed a TP1 instance), a KunServe-style memory
   burst (x3 for 60 s of 3,000-token outputs, bench_kunserve.BURSTS at half its rate) and Flying
   Serving's alternating load (30 s phases of low and high rate, at a quarter of its rates).
   Pipelines (PipeLive's, KunServe's groups) keep one micro-batch per stage in flight. The best
   static layout is, of the TP layouts of 8 GPUs, the one that rejects fewest requests, then has the
   highest goodput. Goodput: requests/s meeting TTFT <= 10 s (stretched to prompt / 500 tok/s
   for long prompts, bench_sim.goodputs) and TPOT <= 100 ms; a rejected request never meets it.
2. The CPU host at small scale (gyges.experiment: the tiny model on 4 workers of 24 MiB, the same
   C controller and policies): a burst of 24 s (x12 for 3 s at 4 s) of requests that each fit
   one worker. PipeLive runs on its own pipeline host (an
   8-layer tiny model on 2 workers of unequal memory; experiment.run's default for it), so its
   row is not comparable with the others'.

Papers: Gyges reports 1.75-6.57x the throughput of KunServe and others on its trace (Fig. 14);
KunServe 8.4-27.3x lower P99 TTFT than replication under bursts (Fig. 10); Flying Serving up to
4.79x (high load) and 3.47x (low load) over static DP/TP; PipeLive 33-36% end-to-end on
heterogeneous GPUs (its gains need unequal GPUs, which this cluster does not have).

--calibration grounded prices the TP systems and pipelines with NVLink at NCCL's measured speed
instead of the Table 1 fit (gyges.costmodel.GROUNDED; the traces stay the same).

Writes results/bench_systems.json and .png (bench_systems_grounded.*).
Run: .venv/bin/python benchmarks/bench_systems.py [--quick] [--no-host]
"""
import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_kunserve import BURSTS  # noqa: E402
from benchmarks.bench_sim import AZURE, LAYOUTS, SLO, azure_trace, goodputs  # noqa: E402
from benchmarks.common import RESULTS, print_table, write_json  # noqa: E402
from gyges import experiment, metrics, sim, traces  # noqa: E402
from gyges.cluster.costmodel import CALIBRATIONS, RDMA_200G, CostModel, PipelineCost  # noqa: E402

MODEL, GPU, N_GPUS = "qwen2.5-32b", "h20", 8


def paper_scale_systems(calibration="table1"):
    """name -> sim.run keyword arguments, every system on the same 8 GPUs, priced under
    `calibration` (gyges.costmodel.CALIBRATIONS)."""
    # pipelines keep one micro-batch per stage in flight (vLLM's virtual engines)
    buddy = PipelineCost.create(MODEL, [GPU] * N_GPUS, link_bw=RDMA_200G, micro_batches=None,
                                calibration=calibration)
    pair = PipelineCost.create(MODEL, [GPU] * 2, link_bw=RDMA_200G, micro_batches=None,
                               calibration=calibration)
    tp = CostModel.create(MODEL, GPU, calibration=calibration)
    systems = {
        "gyges": dict(policy="gyges"),
        "pipelive": dict(policy="pipelive", hosts=N_GPUS // 2, layout="PP2", cost=pair),
        "flying": dict(policy="flying", weights="replicated"),
        "kunserve": dict(policy="kunserve", weights="buddy", cost=buddy),
        # elastic instances of TP2 (a TP1 replica of a 32B model on an H20 has no room to
        # prefill a long prompt, even pooled)
        "loongserve": dict(policy="loongserve", weights="replicated", layout="4xTP2"),
        # Seesaw's re-sharding: units of GPUs prefill as TP1 instances and decode as one TP-N,
        # N from its search for each trace (seesaw_search), its transitions through host
        # memory (policy_seesaw.c)
        "seesaw": dict(policy="seesaw", reshard="seesaw"),
        "replication (least_load)": dict(policy="least_load", layout=f"{N_GPUS}xTP1",
                                         eager_scale_up=False, scale_up_cap=0.0),
    }
    # the TP cost model for every system that names none of its own (pipelines do)
    return {name: {"cost": tp, **kw} for name, kw in systems.items()}


def paper_scale_traces(quick):
    span = 300 if quick else 600
    out = {"gyges 6.2.4 x1.5": traces.scale_rate(traces.gyges_mixed(span, seed=0), 1.5)}
    if AZURE.exists():
        tr, _, _ = azure_trace(CostModel.create(MODEL, GPU), rate_factor=0.07)
        out["azure conv"] = traces.clip(tr, n=2000) if quick else tr
    else:
        print(f"(the Azure trace is skipped: {AZURE} is absent)")
    # KunServe's memory burst (4 req/s on 8 A800 serving Qwen2.5-14B), at half the rate: these
    # GPUs serve a model twice as large
    b = BURSTS["x3 60 s, out 3000"]
    out["burst x3 (KunServe)"] = traces.burst(
        b["rate"] / 2, 300, at=100, factor=b["factor"], length=b["length"], seed=1,
        input_tokens=traces.lognormal_lengths(b["input_mean"]),
        output_tokens=traces.lognormal_lengths(b["output_mean"], cap=8192))
    # Flying's phases are 2-5 and 10-30 req/s on 8 H200 serving Llama-70B; a quarter of that
    # loads these 8 H20 in the high phases and leaves them light in the low ones
    out["alternating (Flying)"] = traces.scale_rate(
        traces.flying_alternating(240 if quick else 480, seed=0), 1 / 4)
    return out


def row_of(res, trace_name, system):
    s = res.summary(slo=SLO, percentiles=(99,))
    r = res.requests
    pr = metrics.per_request(r)
    done = np.isfinite(r["finish"])
    good_rps, _, attained = goodputs(res)
    reconf = s["transformations"]   # completed, of every kind (merges, binds, drops, ...)
    tpot = pr["tpot"][done & (r["output_tokens"] > 1)]
    return {"trace": trace_name, "system": system, "requests": int(r.size),
            "throughput": s["total_token_throughput"], "output_tps": s["output_throughput"],
            "goodput": good_rps, "attained": attained, "ttft_mean": s["ttft_mean"],
            "ttft_p99": s["ttft_p99"], "tpot_mean_ms": 1e3 * s["tpot_mean"],
            "tpot_p99_ms": 1e3 * float(np.percentile(tpot, 99)) if tpot.size else None,
            "rejected": int(s["rejected"]), "reconfigurations": int(reconf),
            **{k: int(res.stats[k]) for k in ("binds", "drops", "resplits") if k in res.stats}}


def best_static(rows):
    """Of rows of static layouts ("static 4xTP1"), the one with the fewest rejections, then the
    most goodput, relabelled "best static (4xTP1)"."""
    best = dict(min(rows, key=lambda r: (r["rejected"], -r["goodput"])))
    best["system"] = f"best static ({best['system'][len('static '):]})"
    return best


def simulator_rows(quick, calibration="table1"):
    rows = []
    systems = paper_scale_systems(calibration)
    tp = systems["gyges"]["cost"]
    for name, tr in paper_scale_traces(quick).items():
        t = time.perf_counter()
        group = [row_of(res, name, f"{system} (decode TP{res.config['decode_tp']})"
                        if system == "seesaw" else system)   # (its search's pick)
                 for system, kw in systems.items() for res in [sim.run(tr, slo=SLO, **kw)]]
        static = best_static([row_of(sim.run(tr, policy="static", layout=layout, slo=SLO,
                                             cost=tp), name, f"static {layout}")
                              for layout in LAYOUTS])
        group.append(static)
        for r in group:  # each system against the best static layout
            r["goodput_vs_static"] = r["goodput"] / static["goodput"] if static["goodput"] else None
            r["p99_vs_static"] = r["ttft_p99"] / static["ttft_p99"]
        rows += group
        print(f"  {name}: {tr.size} requests, {time.perf_counter() - t:.1f} s")
    return rows


# Seesaw's own regime (Su et al., MLSys '25: throughput-oriented, offline batches, GPUs joined by
# PCIe): a model that needs two L40S an instance, whose prefill instances are then TP2s or
# 2-stage pipelines, and a batch that arrives at once. Its paper: up to 1.78x (1.36x on average)
# the throughput of vLLM (arXiv 2503.06433, abstract).
SEESAW_MODEL, SEESAW_GPU, SEESAW_PAPER = "qwen2.5-32b", "l40s", {"mean": 1.36, "max": 1.78}


def seesaw_regime_rows(calibration="table1"):
    """Seesaw with its searched prefill parallelism, with TP prefill, and the static layouts of
    8 L40S (TP and 2-stage pipelines): throughput of one offline batch (every token over the
    time to its last), and each against the best static layout."""
    cost = CostModel.create(SEESAW_MODEL, SEESAW_GPU, calibration=calibration)
    # prompts a TP2 prefills (below 1,367 tokens: its activations need TP4 beyond)
    tr = traces.poisson(1000, 0.5, input_tokens=(200, 1200), output_tokens=(100, 400), seed=1)
    runs = {"seesaw": dict(policy="seesaw", reshard="seesaw", cost=cost),
            "seesaw, TP prefill": dict(policy="seesaw", reshard="seesaw", cost=cost,
                                       prefill_pp=False)}
    runs.update({f"static {layout}": dict(policy="static", layout=layout, cost=cost)
                 for layout in ("4xTP2", "2xTP4", "1xTP8")})
    runs["static 4xPP2"] = dict(policy="static", layout="4xTP2",
                                cost=cost.replace(pipeline_degree=2))
    rows = []
    for system, kw in runs.items():
        res = sim.run(tr, **kw)
        r = res.requests
        span = float(np.nanmax(r["finish"]) - r["arrival"].min())
        label = system
        if system == "seesaw":
            c = res.config
            prefill = f"{'PP' if c['prefill_pp'] else 'TP'}{c['prefill_tp']}"
            decode = f"TP{c['decode_tp']}" if c["decode_tp"] > c["prefill_tp"] else prefill
            label = f"seesaw (prefill {prefill}, decode {decode})"
        rows.append({"system": label, "requests": int(r.size),
                     "rejected": int((r["status"] == 4).sum()), "makespan_s": span,
                     "throughput": float((r["input_tokens"] + r["output_tokens"]).sum()) / span,
                     "transformations": int(res.transformations.size)})
    static = max((r for r in rows if r["system"].startswith("static")),
                 key=lambda r: (-r["rejected"], r["throughput"]))
    for r in rows:
        r["vs_best_static"] = r["throughput"] / static["throughput"]
        r["paper"] = (f"{SEESAW_PAPER['mean']}x mean, {SEESAW_PAPER['max']}x max"
                      if r["system"].startswith("seesaw (") else "")
    return rows


def host_rows(quick):
    """The CPU host, the same C controller: a burst on the tiny model's 4 workers."""
    # every request fits one worker's KV (896 tokens of 24 MiB), as KunServe assumes: the
    # pressure comes from how many run at once
    tr = traces.burst(2.0, 12.0 if quick else 24.0, at=4.0, factor=12, length=3.0, seed=1,
                      input_tokens=traces.lognormal_lengths(200, cap=350),
                      output_tokens=traces.lognormal_lengths(300, cap=500))
    runs = {"gyges": dict(policy="gyges"), "flying": dict(policy="flying"),
            "kunserve": dict(policy="kunserve"), "seesaw": dict(policy="seesaw"),
            "replication (least_load)": dict(policy="least_load", eager_scale_up=False,
                                             scale_up_cap=0.0)}
    runs.update({f"static {layout}": dict(policy="static", layout=layout)
                 for layout in ("4xTP1", "2xTP2", "1xTP4")})
    runs["pipelive (own host)"] = dict(policy="pipelive")
    rows = []
    for system, kw in runs.items():
        t = time.perf_counter()
        res = experiment.run(tr, sample_interval=0.5, slo=SLO, **kw)
        rows.append({**row_of(res, "CPU burst", system), "wall_s": time.perf_counter() - t})
    statics = [r for r in rows if r["system"].startswith("static")]
    return [r for r in rows if r not in statics] + [best_static(statics)]


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(dict.fromkeys(r["trace"] for r in rows))
    systems = list(dict.fromkeys(r["system"].split(" (")[0] for r in rows))
    fig, axes = plt.subplots(2, len(names), figsize=(4.2 * len(names), 6.5), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for j, name in enumerate(names):
        group = {r["system"].split(" (")[0]: r for r in rows if r["trace"] == name}
        for i, (key, label) in enumerate((("goodput", "goodput (req/s)"),
                                          ("ttft_p99", "P99 TTFT (s)"))):
            ax = axes[i][j]
            vals = [group[s][key] if s in group and group[s][key] is not None else 0
                    for s in systems]
            ax.bar(range(len(systems)), vals, color=colours[:len(systems)])
            ax.set_xticks(range(len(systems)), systems, rotation=40, ha="right", fontsize=8)
            ax.set_title(f"{name}: {label}", fontsize=9)
            if key == "ttft_p99":
                ax.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


COLUMNS = [("trace", "trace", "{}"), ("system", "system", "{}"), ("throughput", "tok/s", "{:.0f}"),
           ("output_tps", "out tok/s", "{:.0f}"), ("goodput", "goodput r/s", "{:.3f}"),
           ("attained", "SLO met", "{:.1%}"), ("ttft_mean", "TTFT mean s", "{:.2f}"),
           ("ttft_p99", "TTFT p99 s", "{:.2f}"), ("tpot_mean_ms", "TPOT mean ms", "{:.1f}"),
           ("tpot_p99_ms", "TPOT p99 ms", "{:.1f}"), ("rejected", "rejected", "{}"),
           ("reconfigurations", "reconfig.", "{}")]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="shorter traces")
    ap.add_argument("--no-host", action="store_true", help="the simulator section only")
    ap.add_argument("--calibration", choices=CALIBRATIONS, default="table1",
                    help="the cost model's calibration (table1: fitted to Gyges Table 1; "
                         "grounded: NVLink at NCCL's measured speed)")
    args = ap.parse_args()
    out = {"calibration": args.calibration, "sim": simulator_rows(args.quick, args.calibration)}
    print_table(f"1. Simulator: {N_GPUS}x {GPU}, {MODEL}, {args.calibration} calibration; "
                f"goodput and P99 TTFT also against the best static layout", out["sim"],
                COLUMNS + [("goodput_vs_static", "goodput / static", "{:.2f}"),
                           ("p99_vs_static", "p99 / static", "{:.2f}")])
    out["seesaw_regime"] = seesaw_regime_rows(args.calibration)
    print_table(f"1b. Seesaw's regime: an offline batch on 8x {SEESAW_GPU} (PCIe), {SEESAW_MODEL} "
                f"({args.calibration} calibration); Seesaw's paper against vLLM's best",
                out["seesaw_regime"],
                [("system", "system", "{}"), ("requests", "requests", "{}"),
                 ("rejected", "rejected", "{}"), ("makespan_s", "makespan s", "{:.1f}"),
                 ("throughput", "tok/s", "{:.0f}"), ("transformations", "reconfig.", "{}"),
                 ("vs_best_static", "vs best static", "{:.2f}x"), ("paper", "paper", "{}")])
    if not args.no_host:
        out["host"] = host_rows(args.quick)
        print_table("2. CPU host (tiny model, 4 workers of 24 MiB, one burst; the same controller)",
                    out["host"], COLUMNS + [("wall_s", "wall s", "{:.1f}")])
    name = "bench_systems" if args.calibration == "table1" else \
        f"bench_systems_{args.calibration}"
    write_json(name, out)
    RESULTS.mkdir(exist_ok=True)
    plot(out["sim"] + out.get("host", []), RESULTS / f"{name}.png")


if __name__ == "__main__":
    main()
