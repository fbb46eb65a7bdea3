"""The page arena through the Python API: operations, accounting to the byte, zero-copy views,
refusals that change nothing, and a long random operation sequence checked against a model."""
import gc

import numpy as np
import pytest

import gyges
from gyges.runtime.arena import TAGS

KIB = 1024


def make(budget_pages=8, page=64 * KIB, slots=None):
    return gyges.Arena(budget=budget_pages * page, page_size=page, n_slots=slots)


def snapshot(arena):
    return arena.page_table().copy(), arena.physical_pages().copy(), arena.stats()


def assert_unchanged(arena, before):
    table, phys, stats = snapshot(arena)
    np.testing.assert_array_equal(table, before[0])
    np.testing.assert_array_equal(phys, before[1])
    assert stats == before[2]


def test_sizes_are_parsed_and_checked():
    a = gyges.Arena(budget="1MiB", page_size="64KiB")
    assert a.page_size == 65536 and a.budget == 1 << 20 and a.n_slots == 64
    for bad in [dict(page_size="3KiB"), dict(page_size=6000), dict(page_size="2KiB"),
                dict(budget="100KiB", page_size="64KiB"), dict(budget="1 parsec"),
                dict(budget=-4096), dict(backend="tpu")]:
        with pytest.raises(ValueError):
            gyges.Arena(**{"budget": "1MiB", "page_size": "64KiB", **bad})


def test_accounting_to_the_byte():
    a = make(budget_pages=6)
    pages = [a.create_page(tag) for tag in ("weights", "weights", "kv", "staging")]
    assert pages == [0, 1, 2, 3]
    s = a.stats()
    page = a.page_size
    assert s["bytes_in_use"] == 4 * page and s["peak_bytes"] == 4 * page
    assert s["bytes_by_tag"] == {"weights": 2 * page, "kv": page, "staging": page, "other": 0}
    a.release_page(1)
    a.map(10, 2)
    s = a.stats()
    assert s["bytes_in_use"] == 3 * page and s["peak_bytes"] == 4 * page
    assert s["bytes_by_tag"]["weights"] == page and s["pages_mapped"] == 1
    assert a.create_page("kv") == 1  # lowest free id comes back
    phys = a.physical_pages()
    assert phys["page"].tolist() == [0, 1, 2, 3]
    assert phys["slot"].tolist() == [-1, -1, 10, -1]
    assert [TAGS[t] for t in phys["tag"]] == ["weights", "kv", "kv", "staging"]


def test_view_is_zero_copy_both_ways_and_pins():
    a = make()
    a.grow(3, 2, "kv")
    view = a.view(3, 2, dtype=np.float32)
    assert view.size == 2 * a.page_size // 4
    view[:] = np.arange(view.size, dtype=np.float32)
    # Read back through C: copy bytes inside the arena, then look at the destination.
    a.grow(7, 1, "kv")
    a.copy(7 * a.page_size, 3 * a.page_size + 4 * 100, a.page_size)
    dest = a.view(7, dtype=np.float32)
    np.testing.assert_array_equal(dest, np.arange(100, 100 + dest.size, dtype=np.float32))
    assert a.page_table()["pins"][[3, 4, 7]].tolist() == [1, 1, 1]
    with pytest.raises(gyges.BusyError, match="live NumPy view"):
        a.unmap(4)
    with pytest.raises(gyges.BusyError):
        a.remap(3, 20)
    with pytest.raises(gyges.BusyError):
        a.shrink(3, 2)
    slice_of_view = view[10:20]
    del view
    gc.collect()
    with pytest.raises(gyges.BusyError):  # a slice keeps the whole view alive
        a.unmap(3)
    del slice_of_view, dest
    gc.collect()
    assert a.page_table()["pins"].sum() == 0
    a.remap(3, 20)  # data moves with the page, no copy
    moved = a.view(20, dtype=np.float32)
    np.testing.assert_array_equal(moved[:5], np.arange(5, dtype=np.float32))
    assert a.stats()["bytes_copied_total"] == a.page_size


def test_view_keeps_the_arena_alive():
    a = make()
    a.grow(0, 1)
    view = a.view(0, dtype=np.uint8)
    view[:3] = [1, 2, 3]
    del a
    gc.collect()
    assert view[:3].tolist() == [1, 2, 3]


def test_views_of_unmapped_or_out_of_range_memory_are_refused():
    a = make(slots=16)
    a.grow(0, 2)
    with pytest.raises(gyges.StateError, match="not mapped"):
        a.view(1, 2)
    with pytest.raises(ValueError, match="does not fit"):
        a.view(15, 2)
    with pytest.raises(ValueError):
        a.view_bytes(0, 10, dtype=np.float32)
    with pytest.raises(ValueError):
        a.view(0, 0)


def test_refusals_leave_the_state_unchanged():
    a = make(budget_pages=3, slots=8)
    a.grow(0, 2, "kv")
    p = a.create_page("weights")
    before = snapshot(a)
    cases = [
        (gyges.StateError, lambda: a.map(0, p)),               # slot taken
        (gyges.StateError, lambda: a.map(5, 0)),               # page mapped elsewhere
        (gyges.InvalidArgumentError, lambda: a.map(8, p)),     # slot out of range
        (gyges.InvalidArgumentError, lambda: a.map(-1, p)),
        (gyges.InvalidArgumentError, lambda: a.map(5, 3)),     # page out of range
        (gyges.StateError, lambda: a.unmap(5)),                # not mapped
        (gyges.StateError, lambda: a.release_page(0)),         # mapped
        (gyges.OutOfMemoryError, lambda: a.create_page()),     # budget
        (gyges.OutOfMemoryError, lambda: a.grow(4, 1)),
        (gyges.StateError, lambda: a.grow(1, 2)),              # slot 1 taken
        (gyges.InvalidArgumentError, lambda: a.grow(7, 2)),    # past the end
        (gyges.StateError, lambda: a.shrink(1, 2)),            # slot 2 not mapped
        (gyges.StateError, lambda: a.remap(5, 6)),             # source unmapped
        (gyges.InvalidArgumentError, lambda: a.copy(0, 2 * a.page_size, 1)),
        (ValueError, lambda: a.create_page("gpu")),
        (TypeError, lambda: a.map(1.5, 0)),
    ]
    for error, call in cases:
        with pytest.raises(error):
            call()
        assert_unchanged(a, before)
    a.release_page(p)
    with pytest.raises(gyges.StateError, match="not been created"):
        a.release_page(p)  # double release


def test_error_classes_form_one_hierarchy():
    for cls in (gyges.InvalidArgumentError, gyges.OutOfMemoryError, gyges.StateError,
                gyges.BusyError, gyges.LimitError, gyges.UnavailableError):
        assert issubclass(cls, gyges.Error)
    assert issubclass(gyges.InvalidArgumentError, ValueError)
    assert issubclass(gyges.OutOfMemoryError, MemoryError)


def test_released_memory_goes_back_and_reads_zero():
    a = make(budget_pages=2)
    a.grow(0, 2)
    a.view(0, 2)[:] = 0xEE
    a.shrink(0, 2)
    assert a.stats()["bytes_in_use"] == 0
    a.grow(5, 2)
    assert not a.view(5, 2).any()


def test_pool_keeps_released_pages_and_their_contents():
    """pool_pages=1: the first released page keeps its memory and contents, the next one goes back
    to the system (zeros); the budget counts both free at once and still bounds creation."""
    a = gyges.Arena(budget=2 * 64 * KIB, page_size=64 * KIB, pool_pages=1)
    a.grow(0, 2)
    a.view(0, 2)[:] = 0xEE
    a.shrink(0, 2)
    assert a.stats()["bytes_in_use"] == 0
    a.grow(5, 2)
    again = a.view(5, 2)
    assert (again[:64 * KIB] == 0xEE).all() and not again[64 * KIB:].any()
    del again
    with pytest.raises(gyges.OutOfMemoryError):
        a.grow(0, 1)
    for bad in (-1, 1 << 32):
        with pytest.raises(ValueError, match="pool_pages must be in"):
            gyges.Arena(budget=2 * 64 * KIB, page_size=64 * KIB, pool_pages=bad)


class ArenaModel:
    """A pure-Python model of the arena's state, the reference for the random test."""

    def __init__(self, n_slots, max_pages):
        self.n_slots, self.max_pages = n_slots, max_pages
        self.slot_page = {}   # slot -> page
        self.created = {}     # page -> tag
        self.peak = 0

    def page_slot(self, page):
        return next((s for s, p in self.slot_page.items() if p == page), None)

    def create(self, tag):
        if len(self.created) == self.max_pages:
            return gyges.OutOfMemoryError
        page = min(set(range(self.max_pages)) - set(self.created))
        self.created[page] = tag
        self.peak = max(self.peak, len(self.created))
        return page

    def release(self, page):
        if not 0 <= page < self.max_pages:
            return gyges.InvalidArgumentError
        if page not in self.created or self.page_slot(page) is not None:
            return gyges.StateError
        del self.created[page]

    def map(self, slot, page):
        if not 0 <= slot < self.n_slots or not 0 <= page < self.max_pages:
            return gyges.InvalidArgumentError
        if page not in self.created or slot in self.slot_page or self.page_slot(page) is not None:
            return gyges.StateError
        self.slot_page[slot] = page

    def unmap(self, slot):
        if not 0 <= slot < self.n_slots:
            return gyges.InvalidArgumentError
        if slot not in self.slot_page:
            return gyges.StateError
        del self.slot_page[slot]

    def remap(self, a, b):
        if not 0 <= a < self.n_slots:
            return gyges.InvalidArgumentError
        if a not in self.slot_page:
            return gyges.StateError
        if not 0 <= b < self.n_slots:
            return gyges.InvalidArgumentError
        if b in self.slot_page:
            return gyges.StateError
        self.slot_page[b] = self.slot_page.pop(a)


def test_random_operations_match_a_model():
    rng = np.random.default_rng(1234)
    n_slots, max_pages = 24, 12
    arena = gyges.Arena(budget=max_pages * 4096, page_size=4096, n_slots=n_slots)
    model = ArenaModel(n_slots, max_pages)
    contents = {}  # page -> byte written into it
    ops = ["create", "release", "map", "unmap", "remap"]
    for step in range(4000):
        op = ops[rng.integers(len(ops))]
        slot, slot2 = (int(x) for x in rng.integers(-1, n_slots + 1, size=2))
        page = int(rng.integers(-1, max_pages + 1))
        if op == "create":
            tag = TAGS[rng.integers(4)]
            expected = model.create(tag)
            call = lambda: arena.create_page(tag)
        elif op == "release":
            expected = model.release(page)
            call = lambda: arena.release_page(page)
        elif op == "map":
            expected = model.map(slot, page)
            call = lambda: arena.map(slot, page)
        elif op == "unmap":
            expected = model.unmap(slot)
            call = lambda: arena.unmap(slot)
        else:
            expected = model.remap(slot, slot2)
            call = lambda: arena.remap(slot, slot2)
        if isinstance(expected, type) and issubclass(expected, Exception):
            with pytest.raises(expected):
                call()
        else:
            result = call()
            if op == "create":
                assert result == expected
                contents.pop(result, None)  # new pages read zero
        if step % 50 == 0:
            table = arena.page_table()
            want = np.full(n_slots, -1)
            for s, p in model.slot_page.items():
                want[s] = p
            np.testing.assert_array_equal(table["page"], want, err_msg=f"step {step}")
            stats = arena.stats()
            assert stats["bytes_in_use"] == len(model.created) * 4096
            assert stats["peak_bytes"] == model.peak * 4096
            assert stats["pages_mapped"] == len(model.slot_page)
            for tag_index, tag in enumerate(TAGS):
                n = sum(1 for t in model.created.values() if t == tag)
                assert stats["bytes_by_tag"][tag] == n * 4096
            # Memory follows its page through remaps: write a marker, check it later.
            for s, p in model.slot_page.items():
                view = arena.view(s)
                if p in contents:
                    assert view[0] == contents[p] and view[-1] == contents[p]
                marker = int(rng.integers(1, 255))
                view[0] = view[-1] = marker
                contents[p] = marker
                del view
            for p in list(contents):
                if p not in model.created:
                    del contents[p]


def test_mappings_stop_short_of_vm_max_map_count():
    """Each mapped slot can cost the process two kernel VMAs; past the safe share of
    vm.max_map_count the arena refuses with LimitError instead of failing inside mmap."""
    max_map_count = int(open("/proc/sys/vm/max_map_count").read())
    limit = (max_map_count - 4096) // 2
    if limit > 200_000:
        pytest.skip(f"vm.max_map_count={max_map_count} is too large to reach in a test")
    arena = gyges.Arena(budget=(limit + 8) * 4096, page_size=4096, n_slots=2 * (limit + 8))
    with pytest.raises(gyges.LimitError, match="max_map_count"):
        for i in range(limit + 8):
            arena.map(2 * i, arena.create_page())  # every other slot: no VMA merging
    mapped = arena.stats()["pages_mapped"]
    assert mapped <= limit
    table = arena.page_table()
    assert (table["page"] >= 0).sum() == mapped  # the refused map left nothing behind
    del arena  # gives the mappings back to the process-wide count
    fresh = gyges.Arena(budget="64KiB", page_size=4096)
    fresh.grow(0, 16)


def test_a_cpu_arena_has_no_driver_calls_to_time():
    """driver_times() counts the CUDA backend's virtual memory calls (tests/test_cuda.py); the
    cpu backend maps with mmap inside its own range and reports none."""
    arena = gyges.Arena(budget="1MiB", page_size="64KiB", n_slots=8)
    arena.map(0, arena.create_page("kv"))
    arena.unmap(0)
    assert arena.driver_times() == {k: (0, 0.0) for k in ("create", "map", "set_access",
                                                          "unmap", "release")}
