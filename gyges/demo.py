"""`make demo`: what gyges can show today, on the CPU backend.

1. The engine: the embedded tiny model serves a batch of requests with continuous batching;
   per-request metrics (vLLM's TTFT, TPOT, E2E) and the worker's memory before, during and after.
2. The memory underneath: an arena with a paged KV cache in each of the three Gyges layouts,
   page tables and block tables as NumPy arrays, and the bytes each layout moves when it grows.
"""
import time

import numpy as np

import gyges


def show_layout(layout):
    arena = gyges.Arena(budget="1MiB", page_size="16KiB", n_slots=40)
    kv = gyges.KVCache(arena, n_layers=2, n_kv_heads=4, head_dim=16, block_size=8,
                       layout=layout, first_slot=0, slots_per_layer=20)
    kv.grow(3)
    seqs = [kv.new_sequence() for _ in range(3)]
    rng = np.random.default_rng(0)
    lengths = (21, 9, 30)
    for seq, n in zip(seqs, lengths):
        kv.reserve(seq, n)
        for layer in range(2):
            k = rng.standard_normal((n, 4, 16)).astype(np.float32)
            kv.write(seq, layer, 0, k, -k)
    before = kv.stats()["bytes_moved"]
    kv.grow(1)
    moved = kv.stats()["bytes_moved"] - before
    k, v = kv.gather(seqs[2], 1)
    view = kv.layer(1)  # logical axes (kv, block, token, head, dim), zero-copy
    table = kv.block_table(seqs[2])
    assert np.array_equal(view[0, table[0], 3], k[3])
    print(f"\n== layout {layout!r}: {kv}")
    print(f"   stride order (outermost first): "
          f"{[('kv', 'block', 'token', 'head')[i] for i in kv.layout()['stride_order']]}")
    print(f"   growing by one page per layer moved {moved:,} bytes")
    indptr, indices, last = kv.block_tables(seqs)
    print(f"   block tables (CSR): indptr={indptr.tolist()} indices={indices.tolist()} "
          f"last_page_len={last.tolist()}")
    table = arena.page_table()
    mapped = table[table["page"] >= 0]
    print(f"   mapped slots -> physical pages: {dict(zip(mapped['slot'].tolist(), mapped['page'].tolist()))}")
    print(f"   arena: {arena.stats()['bytes_in_use']:,} bytes in use, "
          f"{arena.stats()['bytes_by_tag']['kv']:,} of them KV")


def serve():
    model = gyges.Model.tiny()
    print(f"\n== serving {model}")
    engine = gyges.Engine(model, memory="64MiB", page_size="64KiB", block_size=16,
                          kv_layout="header", threads=2)
    idle = engine.memory()
    print(f"   weights {idle['weights']:,} bytes ({idle['weight_padding']:,} of FFN padding, "
          f"{engine.weights.padding_overhead():.1%}); KV 0 bytes until requests arrive")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, model.config.vocab_size, size=n).tolist()
               for n in (12, 40, 7, 100, 25, 64, 3, 33)]
    params = gyges.SamplingParams(max_tokens=48, temperature=0.7, top_p=0.9, seed=1,
                                  ignore_eos=True)
    start = time.perf_counter()
    requests = [engine.submit(p, params) for p in prompts]
    peak_kv = 0
    while engine.has_unfinished():
        engine.step()
        peak_kv = max(peak_kv, engine.memory()["kv"])
    seconds = time.perf_counter() - start
    print(f"   {len(requests)} requests, {sum(len(r.output_tokens) for r in requests)} tokens in "
          f"{seconds:.2f} s over {engine.steps} steps; KV peaked at {peak_kv:,} bytes")
    print(f"   {'id':>3} {'prompt':>6} {'output':>6} {'TTFT ms':>8} {'TPOT ms':>8} {'E2E ms':>8}  first tokens")
    for r in requests:
        m = r.metrics
        print(f"   {r.id:>3} {len(r.prompt):>6} {len(r.output_tokens):>6} {m.ttft * 1e3:>8.1f} "
              f"{m.tpot * 1e3:>8.2f} {m.e2e * 1e3:>8.1f}  {r.output_tokens[:6]}")
    after = engine.memory()
    print(f"   after: {after['in_use']:,} bytes in use (weights only: {after['in_use'] == after['weights']})")


def transform_live():
    model = gyges.Model.tiny()
    host = gyges.Host(model, workers=4, memory_per_worker="24MiB", page_size="64KiB",
                      layout="4xTP1")
    print(f"\n== {host}: four TP1 instances, 24 MiB a worker")
    rng = np.random.default_rng(1)
    params = gyges.SamplingParams(max_tokens=32, temperature=0.8, seed=7, ignore_eos=True)
    short = [host.submit(rng.integers(0, 4096, size=40).tolist(), params) for _ in range(8)]
    for _ in range(5):
        host.step()
    long_prompt = rng.integers(0, 4096, size=1500).tolist()
    try:
        host.submit(long_prompt, params)
    except ValueError as e:
        print(f"   a 1500-token request arrives: {e}")
    t = host.transform(workers=(0, 1, 2, 3), tp=4)
    s = t.stats
    print(f"   merged live into {host.layout()}: {s['requests_moved']} requests moved with their "
          f"progress; FFN pages released {sum(s['weight_bytes_released'].values()):,} bytes, "
          f"0 copied; KV sent {sum(s['bytes_sent'].values()):,} bytes; extra KV pages mapped "
          f"{max(s['peak_extra_bytes'].values()):,} bytes at most")
    long = host.submit(long_prompt, params)
    host.run()
    print(f"   the long request got {len(long.output_tokens)} tokens (TTFT {long.metrics.ttft * 1e3:.0f} ms); "
          f"the short ones kept going: {[len(r.output_tokens) for r in short]}")
    back = host.transform(workers=(0, 1, 2, 3), tp=1)
    print(f"   split back into {host.layout()} in "
          f"{sum(back.stats['phase_seconds'].values()) * 1e3:.1f} ms; memory per worker: "
          f"{[m['in_use'] for m in host.memory()]}")


def main():
    print(f"gyges {gyges.__version__} (CUDA backend compiled in: {gyges.WITH_CUDA})")
    serve()
    transform_live()
    arena = gyges.Arena(budget="256KiB", page_size="64KiB", n_slots=8)
    arena.grow(0, 2, "weights")
    page = arena.create_page("kv")
    arena.map(5, page)
    print("\nAn arena of 4 pages of 64KiB with 8 virtual slots:")
    print(arena.page_table())
    print(arena.stats())
    for layout in ("raw", "page", "header"):
        show_layout(layout)


if __name__ == "__main__":
    main()
