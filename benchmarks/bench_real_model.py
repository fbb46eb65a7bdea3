"""SmolLM2-135M-Instruct (the packaged real model) on one worker: decode tokens/s at batch 1 and
32, f32 and bf16 weights, beside the machine's rooflines measured in the same run (batch 1: the
read-bandwidth bound of streaming the weights once per token; batch 32: the FMA peak), and with
the portable kernels (GYGES's path for CPUs without AVX-512, same bits) beside the AVX-512 ones.

Run: .venv/bin/python benchmarks/bench_real_model.py
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import gyges  # noqa: E402
from benchmarks.bench_engine import (THREADS, decode_rate, fma_peak, read_bandwidth,  # noqa: E402
                                     weight_bytes_per_token)
from benchmarks.common import print_table, write_json  # noqa: E402
from gyges import _C, _C_test  # noqa: E402

NAME = "smollm2-135m-instruct"


def main():
    bandwidth, peak = read_bandwidth(), fma_peak()
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s, FMA peak {peak / 1e9:.1f} GFLOP/s "
          f"({THREADS} threads)")
    paths = ["avx512", "portable"] if _C_test.kernel_isa_best() == "avx512" else ["portable"]
    rows = []
    for dtype, elem in (("f32", 4), ("bf16", 2)):
        model = gyges.Model.load(NAME, dtype=dtype)
        config = model.config
        engine = gyges.Engine(model, memory="2GiB", page_size="2MiB", threads=THREADS,
                              max_batch_tokens=1024)
        for path in paths:
            _C.set_cpu_isa(path)
            decode_rate(engine, 1, max_tokens=16)  # warm up
            b1 = max(decode_rate(engine, 1) for _ in range(3))
            b32 = max(decode_rate(engine, 32, max_tokens=64) for _ in range(2))
            rows.append({"dtype": dtype, "kernels": path, "b1": b1,
                         "b1_roofline": b1 * weight_bytes_per_token(config, elem) / bandwidth,
                         "b32": b32, "b32_peak": b32 * 2 * weight_bytes_per_token(config, 1) / peak,
                         "b32_over_b1": b32 / b1})
            print(f"  {dtype} {path} done", flush=True)
        _C.set_cpu_isa(_C_test.kernel_isa_best())
        engine.close()
    print_table(f"{NAME}: decode tokens/s, one worker, {THREADS} threads (of BW: fraction of the "
                f"weights-streaming bound at batch 1; of peak: of the FMA peak at batch 32)", rows,
                [("dtype", "weights", "{}"), ("kernels", "kernels", "{}"), ("b1", "b1 tok/s", "{:.1f}"),
                 ("b1_roofline", "of BW", "{:.0%}"), ("b32", "b32 tok/s", "{:.1f}"),
                 ("b32_peak", "of peak", "{:.0%}"), ("b32_over_b1", "b32/b1", "{:.1f}x")])
    write_json("bench_real_model", {"model": NAME, "threads": THREADS, "read_bandwidth": bandwidth,
                                    "fma_peak": peak, "rows": rows})


if __name__ == "__main__":
    main()
