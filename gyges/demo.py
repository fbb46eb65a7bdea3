"""`make demo`: what gyges can show today, on the CPU backend.

An arena (one worker's memory) with a paged KV cache in each of the three Gyges layouts: their
page tables and block tables as NumPy arrays, a sequence's K/V read back through the logical
view, and the cost of growing the cache (bytes moved) per layout.
"""
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


def main():
    print(f"gyges {gyges.__version__} (CUDA backend compiled in: {gyges.WITH_CUDA})")
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
