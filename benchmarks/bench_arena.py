"""Page arena and KV cache growth on the CPU backend.

1. Latency per page of create, map, unmap, remap and release, for several page sizes.
2. Growing a KV cache by N pages per layer under each layout: bytes moved and time. Gyges
   (Table 2, Figure 4): the page-friendly and header-centric layouts move 0 bytes, the raw
   token-first layout has to shift every V block.

Run: .venv/bin/python benchmarks/bench_arena.py
"""
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import gyges  # noqa: E402
from benchmarks.common import best_of, print_table, write_json  # noqa: E402


def page_latencies(page_size, n_pages=512):
    arena = gyges.Arena(budget=n_pages * page_size, page_size=page_size, n_slots=2 * n_pages)
    timings = {}
    t = time.perf_counter()
    pages = [arena.create_page("kv") for _ in range(n_pages)]
    timings["create"] = time.perf_counter() - t
    t = time.perf_counter()
    for slot, page in enumerate(pages):
        arena.map(slot, page)
    timings["map"] = time.perf_counter() - t
    # Touch the pages once so unmap and release see real memory.
    for slot in range(0, n_pages, 64):
        arena.view(slot, min(64, n_pages - slot))[::4096] = 1
    t = time.perf_counter()
    for slot in range(n_pages):
        arena.remap(slot, n_pages + slot)
    timings["remap"] = time.perf_counter() - t
    t = time.perf_counter()
    for slot in range(n_pages):
        arena.unmap(n_pages + slot)
    timings["unmap"] = time.perf_counter() - t
    t = time.perf_counter()
    for page in pages:
        arena.release_page(page)
    timings["release"] = time.perf_counter() - t
    return {op: seconds / n_pages * 1e6 for op, seconds in timings.items()}


def kv_growth(layout, grow_pages, page_size=64 * 1024, layers=4, start_pages=16):
    """Fills a KV cache of `start_pages` pages per layer, then grows it by `grow_pages`."""
    per_layer = start_pages + grow_pages
    arena = gyges.Arena(budget=layers * per_layer * page_size, page_size=page_size,
                        n_slots=layers * per_layer)
    kv = gyges.KVCache(arena, n_layers=layers, n_kv_heads=4, head_dim=32, block_size=16,
                       layout=layout, slots_per_layer=per_layer)
    kv.grow(start_pages)
    seq = kv.new_sequence()
    kv.reserve(seq, kv.n_blocks * 16)
    k = np.ones((kv.n_blocks * 16, 4, 32), np.float32)
    for layer in range(layers):
        kv.write(seq, layer, 0, k, k)
    start = time.perf_counter()
    kv.grow(grow_pages)
    seconds = time.perf_counter() - start
    return {"layout": layout, "grow_pages": grow_pages, "bytes_moved": kv.stats()["bytes_moved"],
            "ms": seconds * 1e3, "used_bytes": layers * start_pages * page_size}


def main():
    latency_rows = []
    for page_size in (4096, 64 * 1024, 2 * 1024 * 1024):
        samples = [page_latencies(page_size, n_pages=256 if page_size > 65536 else 512)
                   for _ in range(3)]
        row = {"page_size": gyges.format_size(page_size)}
        for op in samples[0]:
            row[op] = min(s[op] for s in samples)
        latency_rows.append(row)
    print_table("Arena operations, microseconds per page (cpu backend, best of 3)", latency_rows,
                [("page_size", "page", "{}"), ("create", "create", "{:.2f}"),
                 ("map", "map", "{:.2f}"), ("remap", "remap", "{:.2f}"),
                 ("unmap", "unmap", "{:.2f}"), ("release", "release", "{:.2f}")])

    growth_rows = []
    for grow_pages in (1, 4, 16):
        for layout in ("raw", "page", "header"):
            runs = [kv_growth(layout, grow_pages) for _ in range(3)]
            best = min(runs, key=lambda r: r["ms"])
            growth_rows.append(best)
    print_table("KV cache growth from 16 full pages per layer (4 layers, 64KiB pages, best of 3)",
                growth_rows,
                [("layout", "layout", "{}"), ("grow_pages", "+pages/layer", "{}"),
                 ("used_bytes", "KV bytes held", "{:,}"), ("bytes_moved", "bytes moved", "{:,}"),
                 ("ms", "time ms", "{:.3f}")])
    write_json("bench_arena", {"page_latency_us": latency_rows, "kv_growth": growth_rows})


if __name__ == "__main__":
    main()
