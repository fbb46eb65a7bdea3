"""Tensor-parallel instances and live transformations on the CPU backend (tiny model, 4 workers).

1. Capacity (our analogue of Gyges Table 1): under a fixed per-worker budget, the longest
   sequence one instance can hold and the decode throughput of one instance and of all
   instances together, for 4xTP1, 2xTP2 and 1xTP4. (4 worker threads share 2 cores here, so the
   throughput of several instances is bounded by the cores, not by the model.)
2. KV transformation 4xTP1 -> TP4 at 90% KV utilisation (Gyges Figure 9): time, bytes moved and
   peak extra memory per worker for `basic` (token-first `page` layout and header layout: new
   pages, migrate, trim) and `gyges` (header-centric, in place, phased). The budget has headroom
   above the nominal one so that `basic` can finish; utilisation is of the nominal budget.
3. Weights (Gyges Figure 10): bytes copied and time per layer for `partial_swap` (unpadded FFN)
   and padding (`gyges`), and the padding overhead.
4. Gyges Figure 11: the step time while 1, 2, ..., L layers move per step (layer-staggered,
   serving in between), without and with overlap, and stop_world's single pause; on the tiny
   model (4 layers) and on the same width with 32 and 64 layers (the paper's models have 32 to
   80: one layer per step is then 1/32 or 1/64 of the KV). The transforming host is stepped in
   turn with two control hosts serving the same requests: "plain" never transforms, "mix" runs
   the same boundary each step but moves nothing. "vs plain" is the transforming host's time
   over the plain host's for the same steps (the step time a user had without transforming);
   "vs mix" isolates the transformation's own work. Work still running beside a step when it
   ends is waited for and charged to that step. Median of 3 runs.

With --cuda (a GPU machine; benchmarks/gpu_check.sh runs it): sections 2 to 4 on virtual CUDA
workers sharing one GPU (2 MiB pages, a KV room of CUDA_KV_ROOM per worker; every KV byte moved
by the device backend of the KV move, the boundary's hidden states by device copies), written to
bench_transform_cuda.json; --quick: the tiny model only, 1 and 2 layers a step, one run each.

Run: .venv/bin/python benchmarks/bench_transform.py [--cuda [--quick]]
"""
import gc
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import gyges  # noqa: E402
from benchmarks.common import host_backend, print_table, write_json  # noqa: E402
from gyges.models.config import ModelConfig  # noqa: E402
from gyges.runtime.worker import Worker  # noqa: E402

MIB = 1 << 20
NOMINAL = 32 * MIB  # per-worker budget the utilisation refers to
CUDA, HOST_KW = host_backend(sys.argv)
QUICK = "--quick" in sys.argv
# On CUDA the pages are 2 MiB, which the CPU's nominal budget cannot hold with the padded
# weights: the KV room is given instead, beside whatever the weights take.
CUDA_KV_ROOM = 16 * MIB


def capacity_rows(model):
    rows = []
    params = gyges.SamplingParams(max_tokens=64, ignore_eos=True)
    for layout in ("4xTP1", "2xTP2", "1xTP4"):
        host = gyges.Host(model, workers=4, memory_per_worker=NOMINAL, layout=layout)
        inst = host.instances[0]
        longest = inst.capacity_blocks() * host.block_size
        prompts = [[(i * 7 + j) % 4000 + 1 for j in range(32)] for i in range(16)]
        start = time.perf_counter()
        reqs = [host.submit(p, params, instance=0) for p in prompts]
        host.run()
        single = sum(len(r.output_tokens) for r in reqs) / (time.perf_counter() - start)
        start = time.perf_counter()
        reqs = [host.submit(p, params, instance=i % len(host.instances))
                for i in range(len(host.instances)) for p in prompts]
        host.run()
        total = sum(len(r.output_tokens) for r in reqs) / (time.perf_counter() - start)
        weights = host.memory()[0]["weights"]
        rows.append({"layout": layout, "weights_per_worker": weights, "longest_seq": longest,
                     "single_tok_s": single, "total_tok_s": total})
    return rows


def weights_bytes(model, page_size="64KiB"):
    """Bytes of padded weights one 4xTP1 worker holds."""
    return Worker(model, memory="1GiB", page_size=page_size, max_tp=4,
                  backend=HOST_KW.get("backend", "cpu")).weights_bytes


def filled_host(model, kv_layout, method, kv_room=None, page_size="64KiB"):
    """4xTP1 whose KV holds 90% of what the nominal budget leaves after the weights (or of
    `kv_room` bytes per worker)."""
    if CUDA:
        kv_room, page_size = kv_room or CUDA_KV_ROOM, HOST_KW["page_size"]
    pad = method != "partial_swap"
    weights = weights_bytes(model, page_size) if kv_room else 0
    nominal = weights + kv_room if kv_room else NOMINAL
    # max_running: every request submitted runs at once, so the KV is as full as planned
    # whatever room the page size leaves
    host = gyges.Host(model, workers=4, memory_per_worker=3 * nominal, layout="4xTP1",
                      max_running=256, kv_layout=kv_layout, pad_ffn=pad, max_batch_tokens=4096,
                      page_size=page_size, backend=HOST_KW.get("backend", "cpu"))
    worker = host.worker(0)
    kv_room = nominal - worker.arena.stats()["bytes_in_use"]
    per_token = 2 * model.config.num_key_value_heads * model.config.head_dim * 4 * model.config.num_hidden_layers
    tokens = int(0.9 * kv_room / per_token)
    per_request = 240
    for inst in range(4):
        for i in range(tokens // per_request):
            host.submit([(inst * 131 + i * 17 + j) % 4000 + 1 for j in range(per_request - 8)],
                        gyges.SamplingParams(max_tokens=400, ignore_eos=True), instance=inst)
    for _ in range(4):  # prefill everything, decode a little
        host.step()
    used = worker.arena.stats()["bytes_by_tag"]["kv"]
    return host, used / kv_room


def kv_rows(model):
    rows = []
    for kv_layout, method, chunks in (("page", "basic", 1), ("header", "basic", 1),
                                      ("header", "gyges", 1), ("header", "gyges", 4),
                                      ("header", "gyges", 16)):
        best = None
        for _ in range(2):
            host, util = filled_host(model, kv_layout, method)
            gc.collect()
            kv_before = max(host.worker(w).arena.stats()["bytes_by_tag"]["kv"] for w in range(4))
            start = time.perf_counter()
            t = host.transform(workers=(0, 1, 2, 3), tp=4, method=method, phase_chunks=chunks)
            seconds = time.perf_counter() - start
            s = t.stats
            kv_seconds = sum(v for k, v in s["phase_seconds"].items() if k.startswith("kv") or k in ("reshape", "plan"))
            row = {"layout": kv_layout, "method": method, "chunks": chunks, "kv_util": util,
                   "kv_bytes": kv_before,
                   "kv_ms": kv_seconds * 1e3, "total_ms": seconds * 1e3,
                   "sent": max(s["bytes_sent"].values()), "trimmed": max(s["kv_bytes_trimmed"].values()),
                   "peak_extra": max(s["peak_extra_bytes"].values())}
            row["peak_extra_frac"] = row["peak_extra"] / kv_before
            if best is None or row["kv_ms"] < best["kv_ms"]:
                best = row
        rows.append(best)
    basic = next(r for r in rows if r["method"] == "basic" and r["layout"] == "page")
    for r in rows:
        r["peak_vs_basic"] = r["peak_extra"] / basic["peak_extra"]
    return rows


def weight_rows(model):
    rows = []
    L = model.config.num_hidden_layers
    for method in ("partial_swap", "gyges"):
        host, _ = filled_host(model, "header", method)
        t = host.transform(workers=(0, 1, 2, 3), tp=4, method=method)
        s = t.stats
        w = host.worker(1).weights
        rows.append({"method": method, "copied": max(s["weight_bytes_copied"].values()),
                     "released": max(s["weight_bytes_released"].values()),
                     "ms_per_layer": s["phase_seconds"]["weights"] * 1e3 / L,
                     "padding_overhead": w.padding_overhead() if w.pad else 0.0})
    return rows


def timed_step(host, t=None):
    """One host step, in seconds; with `t`, also the transformation work still running beside it
    (charged to the step, so that none of it spills into another host's timing)."""
    start = time.perf_counter()
    host.step()
    if t is not None and hasattr(t, "wait_background"):
        t.wait_background()
    return time.perf_counter() - start


def dry_transformation(host, lps):
    """The staggered 4xTP1 -> TP4 steps without the transformation's work: the boundary is set
    from outside and nothing moves (the KV above the boundary is garbage, so tokens differ; the
    requests ignore EOS, so every step's batch is the same as with the real one)."""
    t = host.transform(workers=(0, 1, 2, 3), tp=4, layers_per_step=lps or 1)
    t.advance = lambda: None
    return t


def stagger_run(model, lps, overlap, kv_room, page_size):
    """One transformation of a filled 4xTP1 host, stepped in turn with two controls that serve the
    same requests: `plain` never transforms, `mix` runs the same boundary every step but moves
    nothing. Their steps at the same index are the baselines (this machine's speed drifts, and the
    steps grow longer as the contexts grow, so steps taken before would overstate the overhead)."""
    hosts = [filled_host(model, "header", "gyges", kv_room, page_size)[0] for _ in range(3)]
    real, mix, plain = hosts
    gc.collect()  # the previous run's hosts (large arenas) must not be freed inside a timing
    for _ in range(2):
        for h in hosts:
            timed_step(h)
    dry = dry_transformation(mix, lps if lps != "stop_world" else None)
    times = {"real": [], "mix": [], "plain": []}
    boundaries = []
    t = None
    while t is None or not t.done:
        # The real one first (the mixed control follows its boundary); the controls swap places
        # every step, since whoever runs after whom finds the caches in another state.
        controls = [("mix", mix), ("plain", plain)][::1 if len(boundaries) % 2 else -1]
        for name, h in [("real", real)] + controls:
            start = time.perf_counter()
            if name == "real" and t is None:
                if lps == "stop_world":
                    t = real.transform(workers=(0, 1, 2, 3), tp=4, method="stop_world")
                else:
                    t = real.transform(workers=(0, 1, 2, 3), tp=4, layers_per_step=lps,
                                       overlap=overlap)
            if name == "mix":
                b = 0 if t is None or t.done or lps == "stop_world" else t.boundary
                dry.engine._c.transition_set_boundary(b)
            if name == "real":
                boundaries.append(0 if t.done else t.boundary)
            times[name].append(time.perf_counter() - start + timed_step(h, t if name == "real" else None))
    during, mixed, plain_t = (np.array(times[k]) for k in ("real", "mix", "plain"))
    return {"plain": float(np.mean(plain_t)), "mix": float(np.mean(mixed)), "during": list(during),
            "overhead": float(during.sum() / plain_t.sum()) - 1,
            "overhead_vs_mix": float(during.sum() / mixed.sum()) - 1,
            "mix_vs_plain": float(mixed.sum() / plain_t.sum()) - 1}


def stagger_rows(model, name, per_step, kv_room=None, page_size="64KiB", reps=3, stop_world=True):
    """Gyges Figure 11: the step time while `per_step` layers move per step, without and with
    overlap, against the plain and the mixed control steps, and stop_world's single pause. Each
    configuration runs `reps` times (this machine is noisy); the row is the run with the median
    overhead against the plain steps."""
    rows = []
    runs = [(n, o) for n in per_step for o in (False, True)] + [("stop_world", False)] * stop_world
    for lps, overlap in runs:
        results = sorted((stagger_run(model, lps, overlap, kv_room, page_size)
                          for _ in range(reps)), key=lambda r: r["overhead"])
        r = results[len(results) // 2]
        rows.append({"model": name, "layers_per_step": lps, "overlap": overlap,
                     "plain_step_ms": r["plain"] * 1e3, "mix_step_ms": r["mix"] * 1e3,
                     "steps_transforming": len(r["during"]),
                     "mean_step_ms": float(np.mean(r["during"])) * 1e3,
                     "worst_step_ms": max(r["during"]) * 1e3,
                     "overhead": r["overhead"], "overhead_vs_mix": r["overhead_vs_mix"],
                     "mix_vs_plain": r["mix_vs_plain"],
                     "overheads": [x["overhead"] for x in results],
                     "overheads_vs_mix": [x["overhead_vs_mix"] for x in results]})
    return rows


def main():
    model = gyges.Model.tiny()
    cap = [] if CUDA else capacity_rows(model)
    if cap:
        print_table("Capacity under a 32 MiB per-worker budget (tiny model; Gyges Table 1 analogue)", cap,
                [("layout", "layout", "{}"), ("weights_per_worker", "weights/worker", "{:,}"),
                 ("longest_seq", "longest seq", "{:,}"), ("single_tok_s", "1 instance tok/s", "{:.0f}"),
                 ("total_tok_s", "all instances tok/s", "{:.0f}")])
    kv = kv_rows(model)
    print_table("KV transformation 4xTP1 -> TP4 at ~90% KV utilisation (Gyges Figure 9)", kv,
                [("layout", "layout", "{}"), ("method", "method", "{}"),
                 ("chunks", "rounds/phase", "{}"), ("kv_util", "KV util", "{:.0%}"),
                 ("kv_bytes", "KV bytes/worker", "{:,}"), ("kv_ms", "KV ms", "{:.1f}"),
                 ("sent", "bytes sent", "{:,}"), ("trimmed", "bytes trimmed", "{:,}"),
                 ("peak_extra", "peak extra", "{:,}"), ("peak_extra_frac", "of KV", "{:.1%}"),
                 ("peak_vs_basic", "vs basic", "{:.3f}")])
    weights = weight_rows(model)
    print_table("Weight transformation at scale-up (Gyges Figure 10)", weights,
                [("method", "method", "{}"), ("copied", "bytes copied", "{:,}"),
                 ("released", "bytes released", "{:,}"), ("ms_per_layer", "ms/layer", "{:.3f}"),
                 ("padding_overhead", "padding overhead", "{:.1%}")])
    # The tiny model has 4 layers, so one layer per step moves a quarter of the KV in a step;
    # the paper's models have 32 to 80. The same width with 32 layers (and the same KV per layer)
    # shows the overhead at the paper's depth.
    L = model.config.num_hidden_layers
    stagger = stagger_rows(model, f"tiny ({L} layers)", (1, 2) if QUICK else range(1, L + 1),
                           reps=1 if QUICK else 3)
    # The same width at the depth of Llama-3-8B (32 layers) and of Qwen2.5-32B (64, the paper's
    # main model), with the same KV room per worker: each layer then holds 1/32 or 1/64 of it.
    kv_room = CUDA_KV_ROOM if CUDA else NOMINAL - weights_bytes(model)
    deeper = () if QUICK else ((32, (1, 8, 32), True),) if CUDA else (
        (32, (1, 8, 32), True), (64, (1,), False))
    for depth, per_step, stop_world in deeper:
        deep_config = ModelConfig.from_dict({**model.config.to_dict(), "num_hidden_layers": depth})
        deep = gyges.Model.random(deep_config, seed=1)
        stagger += stagger_rows(deep, f"tiny width, {depth} layers", per_step, kv_room=8 * kv_room,
                                page_size="256KiB",  # 64 KiB pages would pass vm.max_map_count
                                stop_world=stop_world)
    print_table("Step time while transforming 4xTP1 -> TP4 (Gyges Figure 11; plain and mix are "
                "control hosts stepped in turn with it: no transformation / same boundary, "
                "nothing moved)", stagger,
                [("model", "model", "{}"), ("layers_per_step", "layers/step", "{}"),
                 ("overlap", "overlap", "{}"), ("steps_transforming", "steps", "{}"),
                 ("mean_step_ms", "mean ms", "{:.2f}"), ("worst_step_ms", "worst ms", "{:.2f}"),
                 ("plain_step_ms", "plain ms", "{:.2f}"), ("mix_step_ms", "mix ms", "{:.2f}"),
                 ("overhead", "vs plain", "{:+.1%}"), ("overhead_vs_mix", "vs mix", "{:+.1%}"),
                 ("mix_vs_plain", "mix vs plain", "{:+.1%}")])
    write_json("bench_transform_cuda" if CUDA else "bench_transform", {"capacity": cap, "kv": kv, "weights": weights,
                                   "stagger": stagger})


if __name__ == "__main__":
    main()
