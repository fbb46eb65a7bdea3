"""Peak extra memory of a cross-GPU Gyges merge (4xTP1 -> TP4 on four GPUs over NCCL) against
the basic solution's, at 88% KV occupancy, in bytes (Gyges section 4.1.2 reports 91.6% below
basic). Ours: the pages a worker maps past what the dropped weights left, plus the comm
backend's staging (one layer of one round of the phased all-to-all, sent and received); basic:
a whole new KV built before the old one goes, measured on CPU workers (method="basic" builds
its KV through host copies), the same requests and pages.

    python benchmarks/bench_xgpu_merge.py            # a machine with four GPUs and NCCL, or the
                                                     # emulated one (tests/test_cuda_nccl.py's
                                                     # docstring says how to run it there)
Writes benchmarks/results/bench_xgpu_merge.json."""
import ctypes
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gyges  # noqa: E402
from gyges import _C  # noqa: E402

if os.environ.get("GYGES_CUDA_EMULATED") == "1":  # the pretend NCCL resolves the emulated runtime
    ctypes.CDLL(_C.__file__, mode=os.RTLD_GLOBAL | getattr(os, "RTLD_NOLOAD", 4))

from common import print_table, write_json  # noqa: E402
from test_cuda_nccl import WHY_NOT, merge_peak  # noqa: E402

GYGES_PAPER_BELOW_BASIC = 0.916


def main():
    if WHY_NOT is not None:
        raise SystemExit(f"cannot run: {WHY_NOT}")
    model = gyges.Model.tiny()
    basic = merge_peak(model, "cpu", "basic")
    rows = [dict(basic, solution="basic (CPU workers)", ratio=1.0, below=0.0)]
    for chunks in (1, 2, 4, 8):
        ours = merge_peak(model, "cuda", "gyges", phase_chunks=chunks)
        ratio = ours["peak_extra"] / basic["peak_extra"]
        rows.append(dict(ours, solution=f"gyges, 4 GPUs, phase_chunks={chunks}", ratio=ratio,
                         below=1 - ratio))
    rows.append(dict(solution="Gyges paper (section 4.1.2)", ratio=1 - GYGES_PAPER_BELOW_BASIC,
                     below=GYGES_PAPER_BELOW_BASIC))
    print_table("peak extra memory of a 4xTP1 -> TP4 merge at >= 88% KV occupancy", rows, [
        ("solution", "solution", "{}"), ("occupancy", "KV occupancy", "{:.1%}"),
        ("kv_bytes", "KV in use (B)", "{:,}"), ("staging", "staging/worker (B)", "{:,}"),
        ("peak_extra", "peak extra (B)", "{:,}"), ("ratio", "x basic", "{:.3f}"),
        ("below", "below basic", "{:.1%}")])
    write_json("bench_xgpu_merge", {"rows": rows})


if __name__ == "__main__":
    main()
