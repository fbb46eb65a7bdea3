"""PipeLive: live in-place pipeline re-splits on the CPU host, beside the paper's figures.

1. Stop time and total migration time against the layers migrated (1, 2, 4, 8, 16) for the three
   modes, on a 34-layer variant of the tiny model split PP[17,17] over two workers, under load
   (8 requests decoding, prefill arrivals every few steps). Fig. 13: live keeps the stop near
   10 ms whatever the layers moved; no_patch and stop_copy grow with them. Goal: a live stop
   below one decode step (the mean step time before the re-split is printed beside it).
2. tau sweep at 4 layers: the stop time and the patch rounds as the commit threshold changes.
3. Compaction and resize against the live blocks to move (paper: pointer updates, under 1 ms;
   ours copies each moved block's bytes in every layer, then unmaps the freed pages).
4. Effective KV utilisation against the stacking factor k on a Llama-3-70B shape with 2 MiB
   pages (Fig. 11: 56% at k = 1): a block of one layer is a 2 MiB page / k, i.e. 512 / k tokens
   of 4 KiB each (8 KV heads x 128 x bf16 x K and V), over the requests of the Azure conversation
   trace (prompt + output) and over the paper's pattern-shifting mix (512+16 and 128+512 tokens,
   which gives the paper's 56% at k = 1), and the same check on a real stacked cache (blocks of
   each layer per page).
5. The second after a re-split per mode (Fig. 14: KV patching alone -49.7% TTFT and -29.5% TPOT
   against no_patch; with asynchronous loading -72.4% / -26.7% against stop_copy): 8 long
   requests decoding on the PP[17,17] host and Poisson arrivals of short ones, the re-split moving
   8 layers at the middle; TTFT of the arrivals and the decoders' mean and worst gap between
   tokens in the second after it starts.
6. The simulator at paper scale (benchmarks/bench_pipeline_sim.py, run at the end): Fig. 9 (the
   pipelive policy against the prefill-optimal, decode-optimal and balanced static splits on an
   A100-80GB + L40S pipeline; paper: +36% score) and Fig. 10 (TTFT against rate with and without
   KV resizing).

With --cuda (a GPU machine; benchmarks/gpu_check.sh runs it): sections 1 and 2 only, on
virtual CUDA workers sharing one GPU (weights and KV move by device copies), written to
bench_pipeline_cuda.json.

Run: .venv/bin/python benchmarks/bench_pipeline.py [--quick] [--cuda]
"""
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import gyges  # noqa: E402
from benchmarks.common import host_backend, print_table, step_times, write_json  # noqa: E402
from gyges import traces  # noqa: E402

QUICK = "--quick" in sys.argv
CUDA, HOST_KW = host_backend(sys.argv)
# a CUDA worker places the whole model (34 layers: 447 pages of 2 MiB) before it drops layers
MEMORY = "1536MiB" if CUDA else "512MiB"
LAYERS = 34
MODES = ("live", "no_patch", "stop_copy")
SHARED = Path(__file__).resolve().parent.parent.parent / "shared"


def deep_model():
    config = dataclasses.replace(gyges.Model.tiny().config, num_hidden_layers=LAYERS)
    return gyges.Model.random(config, seed=1)


def prompts(n, seed, lo, hi):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 4000, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def loaded_host(model, n=8):
    host = gyges.Host(model, workers=2, memory_per_worker=MEMORY, layout="PP[17,17]",
                      max_batch_tokens=256, max_prefill_chunk=128, **HOST_KW)
    p = gyges.SamplingParams(max_tokens=3000, ignore_eos=True)
    reqs = [host.submit(q, p) for q in prompts(n, 1, 200, 400)]
    while any(not q.output_tokens for q in reqs):  # every prompt in: decoding now
        host.step()
    return host, reqs, statistics.median(step_times(host, 10))


def resplit(host, target, mode, tau=50, arrivals=True):
    """Re-splits under load (a short prefill arrives every 4th step); returns the stats."""
    p = gyges.SamplingParams(max_tokens=8, ignore_eos=True)
    r = host.reconfigure(host.instances[0], target, mode=mode, tau=tau)
    steps = 0
    while not r.done:
        if arrivals and steps % 4 == 0:
            host.submit(prompts(1, steps, 32, 64)[0], p)
        host.step()
        steps += 1
    return r.stats, steps


def migration_rows(model):
    rows = []
    for m in ((1, 4, 16) if QUICK else (1, 2, 4, 8, 16)):
        for mode in MODES:
            host, reqs, step_s = loaded_host(model)
            st, steps = resplit(host, [17 - m, 17 + m], mode)
            rows.append({"layers": m, "mode": mode, "stop_ms": st.stop_s * 1e3,
                         "release_ms": st.release_s * 1e3,
                         "total_ms": st.total_s * 1e3, "step_ms": step_s * 1e3, "steps": steps,
                         "weight_mb": st.weight_bytes / 2**20,
                         "bulk_mb": st.kv_bulk_bytes / 2**20,
                         "patch_kb": st.kv_patch_bytes / 2**10, "rounds": st.patch_rounds,
                         "fallback": st.fallback,
                         "paper_stop": "~10 ms" if mode == "live" else "grows"})
            host.close()
    return rows


def tau_rows(model):
    rows = []
    for tau in (1, 8, 50, 400):
        host, _, step_s = loaded_host(model)
        st, steps = resplit(host, [13, 21], "live", tau=tau)
        rows.append({"tau": tau, "stop_ms": st.stop_s * 1e3, "total_ms": st.total_s * 1e3,
                     "rounds": st.patch_rounds, "last_lag": st.lags[-1] if st.lags else 0,
                     "fallback": st.fallback, "step_ms": step_s * 1e3})
        host.close()
    return rows


def compaction_rows():
    rows = []
    arena = gyges.Arena(budget="256MiB", page_size="64KiB", n_slots=8192)
    for live in (16, 64, 256, 1024):
        kv = gyges.KVCache(arena, n_layers=8, n_kv_heads=4, head_dim=32, block_size=16,
                           slots_per_layer=1000)
        total = 2 * live
        kv.grow(-(-total // int(kv.blocks_per_page())))
        low, high = kv.new_sequence(), kv.new_sequence()
        kv.reserve(low, live * 16)
        kv.reserve(high, live * 16)   # its blocks sit at [live, 2 live)
        for layer in range(8):  # the blocks hold values (pages touched), as in service
            kv.layer_raw(layer)[:] = 1.0
        kv.free(low)
        t = time.perf_counter()
        moved = kv.compact(live)
        t1 = time.perf_counter()
        kv.trim()
        t2 = time.perf_counter()
        rows.append({"live_blocks": live, "moved": moved, "bytes_mb": moved * kv.block_bytes * 8 / 2**20,
                     "compact_ms": (t1 - t) * 1e3, "resize_ms": (t2 - t1) * 1e3,
                     "gbps": moved * kv.block_bytes * 8 / max(t1 - t, 1e-9) / 1e9, "paper": "< 1 ms"})
        kv.free(high)
        del kv
    return rows


def utilisation_rows():
    """Fig. 11 on the Azure conversation trace (or a lognormal stand-in without ../shared)."""
    path = SHARED / "traces" / "azure_llm_2023_conv.csv"
    if path.exists():
        trace = traces.load_azure(str(path))
        lengths = (trace["input_tokens"] + trace["output_tokens"]).astype(np.int64)
        source = "azure_llm_2023_conv"
    else:
        lengths = np.random.default_rng(0).lognormal(7, 1, 20000).astype(np.int64) + 1
        source = "lognormal stand-in (../shared absent)"
    # the paper's pattern-shifting workload: 512 in / 16 out and 128 in / 512 out, half each
    shifting = np.array([512 + 16, 128 + 512] * 5000, dtype=np.int64)
    per_token = 2 * 8 * 128 * 2            # Llama-3-70B: K and V, 8 KV heads, 128, bf16
    page = 2 * 2**20
    rows = []
    arena = gyges.Arena(budget="64MiB", page_size="2MiB", n_slots=64)
    for k in (1, 2, 4, 8, 16):
        block = page // k // per_token     # tokens per block of one layer
        allocated = np.ceil(lengths / block) * block
        shift_alloc = np.ceil(shifting / block) * block
        real = gyges.KVCache(arena, n_layers=16, n_kv_heads=8, head_dim=128, block_size=block // 2,
                             slots_per_layer=2, stack=k, dtype="f32")
        rows.append({"k": k, "block_tokens": int(block), "utilisation": lengths.sum() / allocated.sum(),
                     "shifting": shifting.sum() / shift_alloc.sum(),
                     "blocks_per_page_real": real.blocks_per_page(),
                     "paper": "56%" if k == 1 else ("" if k != 4 else "default k"), "trace": source})
        del real
    return rows


def window_rows(model):
    """Eight long requests decoding and Poisson arrivals of short ones; a re-split moving 8
    layers at the middle. In the 1 s after it starts: TTFT of the arrivals, and the decoders'
    mean and worst gap between tokens (the stall a pause causes), per mode and without one."""
    duration = 4.0 if QUICK else 6.0
    arrivals = traces.poisson(4.0, duration=duration, seed=3)
    rng = np.random.default_rng(5)
    ps = [rng.integers(3, 4000, size=int(rng.integers(64, 200))).tolist() for _ in range(len(arrivals))]
    rows = []
    for mode in (None,) + MODES:
        host, decoders, _ = loaded_host(model)
        p = gyges.SamplingParams(max_tokens=24, ignore_eos=True)
        reqs, start, i, r, at = [], time.perf_counter(), 0, None, None
        while i < len(arrivals) or any(not q.finished for _, q in reqs):
            now = time.perf_counter() - start
            while i < len(arrivals) and arrivals["arrival"][i] <= now:
                reqs.append((arrivals["arrival"][i], host.submit(ps[i], p)))
                i += 1
            if mode and r is None and now >= duration / 2:
                r, at = host.reconfigure(host.instances[0], [9, 25], mode=mode), now
            host.step()
        at = duration / 2 if at is None else at
        t0 = host.now() - (time.perf_counter() - start) + at  # the host clock at the re-split
        ttft = [q.metrics.ttft for a, q in reqs if at <= a <= at + 1.0]
        gaps = np.concatenate([np.diff([t for t in q.metrics.token_times if t0 <= t <= t0 + 1.0])
                               for q in decoders])
        rows.append({"mode": mode or "no re-split", "requests": len(ttft),
                     "ttft_ms": 1e3 * statistics.mean(ttft), "gap_ms": 1e3 * gaps.mean(),
                     "worst_gap_ms": 1e3 * gaps.max(),
                     "stop_ms": r.stats.stop_s * 1e3 if r else None})
        host.close()
    base = {row["mode"]: row for row in rows}
    for row in rows:
        if row["mode"] == "live":
            for ref in ("no_patch", "stop_copy"):
                row[f"ttft_vs_{ref}"] = row["ttft_ms"] / base[ref]["ttft_ms"] - 1
                row[f"worst_vs_{ref}"] = row["worst_gap_ms"] / base[ref]["worst_gap_ms"] - 1
    return rows


def main():
    model = deep_model()
    out = {}
    out["migration"] = migration_rows(model)
    print_table("1. Stop and migration time vs layers migrated (PP[17,17] -> PP[17-m,17+m], "
                "under load; paper Fig. 13: live stop ~10 ms flat)", out["migration"],
                [("layers", "layers", "{}"), ("mode", "mode", "{}"), ("stop_ms", "stop ms", "{:.2f}"),
                 ("release_ms", "release ms", "{:.2f}"),
                 ("step_ms", "decode step ms", "{:.2f}"), ("total_ms", "total ms", "{:.1f}"),
                 ("steps", "steps", "{}"), ("weight_mb", "weights MiB", "{:.1f}"),
                 ("bulk_mb", "KV bulk MiB", "{:.1f}"), ("patch_kb", "patch KiB", "{:.0f}"),
                 ("rounds", "rounds", "{}"), ("fallback", "fallback", "{}"),
                 ("paper_stop", "paper stop", "{}")])
    out["tau"] = tau_rows(model)
    print_table("2. tau sweep (4 layers, live)", out["tau"],
                [("tau", "tau", "{}"), ("stop_ms", "stop ms", "{:.2f}"), ("total_ms", "total ms", "{:.1f}"),
                 ("rounds", "patch rounds", "{}"), ("last_lag", "lag at commit", "{}"),
                 ("fallback", "fallback", "{}"), ("step_ms", "decode step ms", "{:.2f}")])
    if CUDA:  # sections 1 and 2 on the GPU; the rest is host work or the simulator
        write_json("bench_pipeline_cuda", out)
        return
    out["compaction"] = compaction_rows()
    print_table("3. CompactKV + ResizeKV vs live blocks moved (8 layers; paper: < 1 ms)",
                out["compaction"],
                [("live_blocks", "live blocks", "{}"), ("moved", "moved", "{}"),
                 ("bytes_mb", "MiB copied", "{:.2f}"), ("compact_ms", "compact ms", "{:.3f}"),
                 ("gbps", "GB/s", "{:.1f}"), ("resize_ms", "resize ms", "{:.3f}"),
                 ("paper", "paper", "{}")])
    out["utilisation"] = utilisation_rows()
    print_table("4. Effective KV utilisation vs stacking factor (Llama-3-70B, 2 MiB pages; "
                "paper Fig. 11: 56% at k = 1)", out["utilisation"],
                [("k", "k", "{}"), ("block_tokens", "tokens/block", "{}"),
                 ("utilisation", "trace util.", "{:.1%}"),
                 ("shifting", "pattern-shift util.", "{:.1%}"),
                 ("blocks_per_page_real", "blocks/page (cache)", "{:.0f}"), ("paper", "paper", "{}"),
                 ("trace", "trace", "{}")])
    out["window"] = window_rows(model)
    print_table("5. The second after a re-split moving 8 layers, 8 long requests decoding and "
                "4 req/s arriving (paper Fig. 14: live -49.7% TTFT / -29.5% TPOT vs no_patch, "
                "-72.4% / -26.7% vs stop_copy)", out["window"],
                [("mode", "mode", "{}"), ("requests", "arrivals", "{}"), ("ttft_ms", "TTFT ms", "{:.1f}"),
                 ("gap_ms", "mean gap ms", "{:.2f}"), ("worst_gap_ms", "worst gap ms", "{:.1f}"),
                 ("stop_ms", "stop ms", "{:.2f}"),
                 ("ttft_vs_no_patch", "TTFT vs no_patch", "{:+.1%}"),
                 ("worst_vs_no_patch", "worst gap vs no_patch", "{:+.1%}"),
                 ("ttft_vs_stop_copy", "TTFT vs stop_copy", "{:+.1%}"),
                 ("worst_vs_stop_copy", "worst gap vs stop_copy", "{:+.1%}")])
    write_json("bench_pipeline", out)
    # 6. the simulator at paper scale: Fig. 9 and Fig. 10 (benchmarks/bench_pipeline_sim.py)
    from benchmarks import bench_pipeline_sim
    bench_pipeline_sim.main()


if __name__ == "__main__":
    main()
