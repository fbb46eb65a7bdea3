"""The CUDA backend on a GPU: page-arena latencies and decode-attention bandwidth.

1. CUDA arena operations per 2 MiB page (cuMemCreate, cuMemMap + cuMemSetAccess, cuMemUnmap,
   cuMemRelease, and create/release through the arena's pool of ready handles), next to the
   figures kvcached published for an A100: create 193 us, map 1.45 us, set-access 36 us, unmap
   25.6 us (our map is their map + set-access: 37.45 us). Then each driver call alone, as the
   arena timed it (Arena.driver_times), beside theirs call for call.
2. Paged decode attention (csrc/kernels/paged_attention_decode.cu) on a Llama-3-8B layer (32
   query heads, 8 KV heads, head_dim 128, blocks of 16 tokens): per layout, KV dtype, batch
   1/16/64 and context 1K/4K/16K, the KV bytes read per second as a fraction of the device's
   memory traffic in a device-to-device copy (which reads and writes each byte: 2 x bytes / time).
   The goal is >= 70%: decode attention reads each K and V row once and should run at the
   memory's speed.

Times come from CUDA events around many launches (_C_test.cuda_bench_*: everything stays on the
device); arena times from the host clock (the driver calls are synchronous). Fixed seeds.
Without a GPU it prints "skipped: <reason>" and returns.

Run: .venv/bin/python benchmarks/bench_cuda_kernels.py [--quick]
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import gyges  # noqa: E402
from gyges import _C_test  # noqa: E402
from benchmarks.common import print_table, write_json  # noqa: E402
from gyges.runtime.worker import cuda_device_unavailable  # noqa: E402

MiB = 1 << 20
KVCACHED_A100_US = {"create": 193.0, "map": 1.45 + 36.0, "unmap": 25.6}  # map = map + set-access
# kvcached's per-call figures on an A100 (cuMemCreate / cuMemMap / cuMemSetAccess / cuMemUnmap)
KVCACHED_A100_CALL_US = {"create": 193.0, "map": 1.45, "set_access": 36.0, "unmap": 25.6}
CALLS = ("create", "map", "set_access", "unmap", "release")
KINDS = {"raw": 0, "page": 1, "header": 2}
DTYPES = {"f32": (0, 4), "f16": (1, 2), "bf16": (2, 2)}
N_Q_HEADS, N_KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16


def per_page_us(fn, items):
    start = time.perf_counter()
    for item in items:
        fn(item)
    return (time.perf_counter() - start) / len(items) * 1e6


def arena_latencies(n_pages, pool_pages):
    """Microseconds per 2 MiB page of each operation; with pool_pages = 0 create and release
    are the driver's cuMemCreate and cuMemRelease, with a pool they pop and push handles. And
    microseconds per driver call, each timed alone (Arena.driver_times; None: not called)."""
    page = 2 * MiB
    arena = gyges.Arena(budget=(n_pages + pool_pages) * page, page_size=page,
                        n_slots=2 * n_pages, backend="cuda", pool_pages=pool_pages)
    out = {}
    pages = []
    out["create"] = per_page_us(lambda _: pages.append(arena.create_page("kv")), range(n_pages))
    out["map"] = per_page_us(lambda i: arena.map(i, pages[i]), range(n_pages))
    out["remap"] = per_page_us(lambda i: arena.remap(i, n_pages + i), range(n_pages))
    out["unmap"] = per_page_us(lambda i: arena.unmap(n_pages + i), range(n_pages))
    out["release"] = per_page_us(arena.release_page, pages)
    times = arena.driver_times()  # each driver call alone (with a pool: create/release few)
    del arena
    calls = {k: 1e6 * seconds / n if n else None for k, (n, seconds) in times.items()}
    return out, calls


def copy_traffic_gbps(nbytes, repeat):
    """Memory traffic of a device-to-device copy: it reads and writes nbytes each time."""
    seconds = _C_test.cuda_bench_memcpy(nbytes, repeat)
    return 2 * nbytes / seconds / 1e9


def timed_attention(layout, dtype, batch, context, min_seconds):
    """Seconds per decode call, repeated for about min_seconds after a short estimate."""
    estimate = _C_test.cuda_bench_paged_attention(False, layout, dtype, dtype, batch, context,
                                                  N_Q_HEADS, 3)
    repeat = max(3, min(10000, int(min_seconds / max(estimate, 1e-7))))
    return _C_test.cuda_bench_paged_attention(False, layout, dtype, dtype, batch, context,
                                              N_Q_HEADS,
                                              repeat)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer shapes, shorter timings")
    args = parser.parse_args(sys.argv[1:] if __name__ == "__main__" else [])
    reason = cuda_device_unavailable()
    if reason is not None:
        print(f"skipped: {reason}")
        return
    info = _C_test.cuda_device_info(0)
    print(f"device: {info['name']}, {info['multiprocessors']} SMs, "
          f"{info['total_bytes'] / 2**30:.0f} GiB")

    n_pages = 32 if args.quick else 128
    arena_rows, call_rows = [], []
    for pool in (0, n_pages):
        per_op, per_call = zip(*(arena_latencies(n_pages, pool) for _ in range(3)))
        arena_rows.append({"pool": "none (driver)" if pool == 0 else f"{pool} handles",
                           **{op: min(r[op] for r in per_op) for op in per_op[0]}})
        if pool == 0:  # the driver's calls, each timed alone inside the arena (best of 3)
            call_rows.append({"calls": "gyges (CUDA arena, no pool)",
                              **{k: min(r[k] for r in per_call) for k in CALLS}})
    arena_rows.append({"pool": "kvcached A100", **KVCACHED_A100_US})
    call_rows.append({"calls": "kvcached A100", **KVCACHED_A100_CALL_US})
    print_table("CUDA arena, microseconds per 2 MiB page (best of 3; map includes "
                "cuMemSetAccess)", arena_rows,
                [("pool", "pool", "{}"), ("create", "create", "{:.2f}"), ("map", "map", "{:.2f}"),
                 ("remap", "remap", "{:.2f}"), ("unmap", "unmap", "{:.2f}"),
                 ("release", "release", "{:.2f}")])
    print_table("The driver's calls, microseconds each (cuMemCreate, cuMemMap, cuMemSetAccess, "
                "cuMemUnmap, cuMemRelease)", call_rows,
                [("calls", "", "{}")] + [(k, k.replace("_", "-"), "{:.2f}") for k in CALLS])

    copy_gbps = copy_traffic_gbps(1 << 30, 5 if args.quick else 20)
    print(f"\ndevice-to-device copy: {copy_gbps:.0f} GB/s of memory traffic (read + write)")
    min_seconds = 0.02 if args.quick else 0.1
    contexts = (1024, 4096) if args.quick else (1024, 4096, 16384)
    attention_rows = []
    for kind_name, kind in KINDS.items():
        for dtype_name, (dtype, elem) in DTYPES.items():
            for batch in (1, 16, 64):
                for context in contexts:
                    n_blocks = batch * -(-context // BLOCK)
                    layout = (kind, BLOCK, N_KV_HEADS, HEAD_DIM, elem, n_blocks)
                    seconds = timed_attention(layout, dtype, batch, context, min_seconds)
                    kv_bytes = batch * context * N_KV_HEADS * HEAD_DIM * elem * 2
                    gbps = kv_bytes / seconds / 1e9
                    attention_rows.append({
                        "layout": kind_name, "kv_dtype": dtype_name, "batch": batch,
                        "context": context, "us": seconds * 1e6, "kv_mib": kv_bytes / MiB,
                        "gbps": gbps, "of_copy": gbps / copy_gbps})
    print_table(f"Decode attention, {N_Q_HEADS} query / {N_KV_HEADS} KV heads, head_dim "
                f"{HEAD_DIM}, blocks of {BLOCK}: KV bytes read per second against the copy's "
                f"{copy_gbps:.0f} GB/s (goal >= 70%)", attention_rows,
                [("layout", "layout", "{}"), ("kv_dtype", "kv", "{}"), ("batch", "batch", "{}"),
                 ("context", "context", "{}"), ("kv_mib", "KV MiB", "{:.1f}"),
                 ("us", "time us", "{:.1f}"), ("gbps", "GB/s", "{:.0f}"),
                 ("of_copy", "of copy", "{:.0%}")])
    write_json("bench_cuda_kernels", {
        "device": info, "arena_us_per_page": arena_rows, "driver_us_per_call": call_rows,
        "copy_traffic_gbps": copy_gbps,
        "decode_attention": attention_rows})


if __name__ == "__main__":
    main()
