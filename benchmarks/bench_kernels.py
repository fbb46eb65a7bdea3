"""CPU linear kernels against the memory roofline.

For the shapes of the 15M and 110M Llama decoders (out x in: the FFN down projection 288x768 and
768x2048, the lm_head 32000x288), fp32 and bf16 weights, batch 1 (decode: bandwidth-bound, each
weight read once per step) and batch 32 (compute-bound): time per call, GFLOP/s, and weight GB/s
next to the read bandwidth of the same number of bytes measured by a plain C read loop
(_C_test.kernel_stream_read) with the same thread count, plus a 512 MiB read (DRAM).

Batch 32 is also shown as a fraction of the FMA peak of the same thread count
(_C_test.kernel_fma_peak: independent FMA chains on every thread).

"hot" timings: the same weights every call, as in a decode loop whose model fits the caches (the
15M model's 60 MB does on a 300 MB L3; the 110M model's 440 MB does not: compare with the DRAM
row). Fixed seeds; best of 5.

Run: .venv/bin/python benchmarks/bench_kernels.py [--quick]
"""
import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gyges import _C_test  # noqa: E402
from benchmarks.common import print_table, write_json  # noqa: E402

SHAPES = [(288, 768), (768, 2048), (32000, 288)]  # (out, in)
DTYPES = {"f32": (_C_test.DTYPE_F32, 4), "bf16": (_C_test.DTYPE_BF16, 2)}


def timed(fn, min_seconds, repeat=5):
    """Best-of-`repeat` seconds per call, each repeat running fn for about min_seconds."""
    fn()
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-7)
    iters = max(1, int(min_seconds / once))
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - start) / iters)
    return best


def read_bandwidth(nbytes, threads, min_seconds):
    x = np.ones(nbytes // 4, np.float32)
    seconds = timed(lambda: _C_test.kernel_stream_read(x, x.size, threads), min_seconds)
    return nbytes / seconds / 1e9


def bench_linear(form, out, in_, dtype_name, n, threads, min_seconds, rng):
    dtype, esize = DTYPES[dtype_name]
    w32 = rng.standard_normal((in_, out) if form == "linear_t" else (out, in_), np.float32)
    w = w32 if dtype == _C_test.DTYPE_F32 else (w32.view(np.uint32) >> 16).astype(np.uint16)
    x = rng.standard_normal((n, in_), np.float32)
    y = np.empty((n, out), np.float32)
    fn = _C_test.kernel_linear_t if form == "linear_t" else _C_test.kernel_linear
    seconds = timed(lambda: fn(y, x, w, dtype, None, n, in_, out, 1, threads), min_seconds)
    wbytes = out * in_ * esize
    return {"form": form, "out": out, "in": in_, "dtype": dtype_name, "n": n, "threads": threads,
            "us": seconds * 1e6, "gflops": 2.0 * n * in_ * out / seconds / 1e9,
            "gbs": wbytes / seconds / 1e9, "weight_mb": wbytes / 2**20}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter timings (noisier)")
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    args = parser.parse_args()
    min_seconds = 0.02 if args.quick else 0.1
    thread_counts = [int(t) for t in args.threads.split(",")]
    rng = np.random.default_rng(0)

    dram = {t: read_bandwidth(512 * 2**20, t, min_seconds) for t in thread_counts}
    peak = {t: max(_C_test.kernel_fma_peak(t) for _ in range(3)) for t in thread_counts}
    rows, roof = [], {}
    for out, in_ in SHAPES:
        forms = ["linear", "linear_t"] if out < in_ else ["linear"]
        for form in forms:
            for dtype_name in DTYPES:
                for n in (1, 32):
                    for threads in thread_counts:
                        row = bench_linear(form, out, in_, dtype_name, n, threads, min_seconds, rng)
                        key = (out * in_ * DTYPES[dtype_name][1], threads)
                        if key not in roof:
                            roof[key] = read_bandwidth(key[0], threads, min_seconds)
                        row["read_gbs"] = roof[key]
                        row["pct_read"] = 100.0 * row["gbs"] / row["read_gbs"]
                        row["pct_peak"] = 100.0 * row["gflops"] * 1e9 / peak[threads]
                        rows.append(row)
    print_table(
        f"linear kernels ({_C_test.kernel_isa()} path, {os.cpu_count()} CPUs; "
        + ", ".join(f"512 MiB read {dram[t]:.1f} GB/s and FMA peak {peak[t] / 1e9:.0f} GFLOP/s at "
                    f"{t} thread(s)" for t in thread_counts) + ")",
        rows,
        [("form", "form", "{}"), ("out", "out", "{}"), ("in", "in", "{}"), ("dtype", "dtype", "{}"),
         ("n", "batch", "{}"), ("threads", "thr", "{}"), ("us", "us/call", "{:.1f}"),
         ("gflops", "GFLOP/s", "{:.1f}"), ("gbs", "weight GB/s", "{:.1f}"),
         ("read_gbs", "read GB/s (same bytes)", "{:.1f}"), ("pct_read", "% of read", "{:.0f}"),
         ("pct_peak", "% of FMA peak", "{:.0f}")])
    write_json("bench_kernels", {"isa": _C_test.kernel_isa(), "cpus": os.cpu_count(),
                                 "dram_read_gbs": {str(t): v for t, v in dram.items()},
                                 "fma_peak_flops": {str(t): v for t, v in peak.items()},
                                 "rows": rows})


if __name__ == "__main__":
    main()
