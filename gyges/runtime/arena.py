"""Page arenas: one worker's memory, managed like CUDA's virtual memory API.

An arena reserves `n_slots` virtual slots of `page_size` bytes and owns a physical budget.
Physical pages are created (up to the budget), mapped into slots, unmapped, moved between slots
without copying (remap) and released. The state is data: `page_table()` and `physical_pages()`
return NumPy structured arrays, and `view()` returns a zero-copy NumPy array over mapped memory
that pins its slots, so unmapping them raises instead of leaving a dangling array.
"""
import operator

import numpy as np

from .. import _C
from ..core.units import format_size, parse_size
from ..core.errors import ArgumentTypeError, InvalidArgumentError

BACKENDS = {"cpu": 0, "cuda": 1}
TAGS = ("weights", "kv", "staging", "other")

PAGE_TABLE_DTYPE = np.dtype([("slot", "<i8"), ("page", "<i8"), ("tag", "<i4"), ("pins", "<i4")])
PHYSICAL_DTYPE = np.dtype([("page", "<i8"), ("slot", "<i8"), ("tag", "<i4"), ("_reserved", "<i4")])
assert PAGE_TABLE_DTYPE.itemsize == _C.PAGE_ENTRY_SIZE
assert PHYSICAL_DTYPE.itemsize == _C.PHYS_ENTRY_SIZE


def _index(value, what):
    try:
        return operator.index(value)
    except TypeError:
        raise ArgumentTypeError(f"{what} must be an integer, got {type(value).__name__}") from None


def tag_id(tag):
    """Accepts a tag name ('weights', 'kv', 'staging', 'other') or its number."""
    if isinstance(tag, str):
        if tag not in TAGS:
            raise InvalidArgumentError(f"unknown page tag {tag!r}; expected one of {', '.join(TAGS)}")
        return TAGS.index(tag)
    return _index(tag, "tag")


class Arena:
    """A worker's page arena.

    Arena(budget="64MiB", page_size="2MiB", n_slots=None, backend="cpu", device=0, pool_pages=0)
    `n_slots` defaults to four times the budget in pages: virtual space is cheap, and a layout
    that leaves gaps (one run of slots per KV layer, say) needs more slots than pages.
    `pool_pages` released pages are kept ready for the next creation (cuda: created handles,
    also made ahead of need; cpu: their memory, with their old contents). With no pool a cpu
    page goes back to the system when released and reads zeros when created again.
    """

    def __init__(self, budget="64MiB", page_size="2MiB", n_slots=None, backend="cpu", device=0,
                 pool_pages=0):
        page_size = parse_size(page_size, "page_size")
        budget = parse_size(budget, "budget")
        if backend not in BACKENDS:
            raise InvalidArgumentError(f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")
        if page_size < 4096 or page_size & (page_size - 1):
            raise InvalidArgumentError(f"page_size must be a power of two of at least 4KiB, got {page_size}")
        if budget % page_size:
            raise InvalidArgumentError(f"budget {budget} bytes is not a multiple of page_size {page_size}")
        if n_slots is None:
            n_slots = max(4 * (budget // page_size), 1)
        n_slots = _index(n_slots, "n_slots")
        pool_pages = _index(pool_pages, "pool_pages")
        if not 0 <= pool_pages < 1 << 32:  # the C config's field is 32 bits
            raise InvalidArgumentError(f"pool_pages must be in [0, 2**32), got {pool_pages}")
        self.backend = backend
        self._c = _C.Arena(BACKENDS[backend], _index(device, "device"), page_size, n_slots, budget,
                           pool_pages)

    # ---- properties ----
    @property
    def handle(self):
        """The C object (gyges._C.Arena) that engines and C models take."""
        return self._c

    @property
    def page_size(self):
        return self._c.page_size

    @property
    def n_slots(self):
        return self._c.n_slots

    @property
    def budget(self):
        return self._c.stats()["budget_bytes"]

    @property
    def base_address(self):
        return self._c.base_address

    @property
    def device(self):
        """The CUDA device ordinal (0 for a cpu arena)."""
        return self._c.device

    @property
    def host_accessible(self):
        """True when the pages are host memory: view() works. A cuda arena's pages are device
        memory, reached from the host only through write() and read()."""
        return self._c.host_accessible

    # ---- operations ----
    def create_page(self, tag="other"):
        """Creates a physical page (the lowest free id) and returns its id."""
        return self._c.create_page(tag_id(tag))

    def release_page(self, page):
        self._c.release_page(_index(page, "page"))

    def map(self, slot, page):
        self._c.map(_index(slot, "slot"), _index(page, "page"))

    def unmap(self, slot):
        self._c.unmap(_index(slot, "slot"))

    def remap(self, from_slot, to_slot):
        """Moves the page mapped at from_slot to the free to_slot; no bytes are copied."""
        self._c.remap(_index(from_slot, "from_slot"), _index(to_slot, "to_slot"))

    def grow(self, slot, n, tag="other"):
        """Creates and maps n pages at slots [slot, slot+n); all or nothing."""
        self._c.grow(_index(slot, "slot"), _index(n, "n"), tag_id(tag))

    def shrink(self, slot, n):
        """Unmaps and releases the pages at slots [slot, slot+n); all or nothing."""
        self._c.shrink(_index(slot, "slot"), _index(n, "n"))

    def copy(self, dst_offset, src_offset, nbytes):
        """memmove inside the arena (counted in stats()['bytes_copied_total'])."""
        self._c.copy(_index(dst_offset, "dst_offset"), _index(src_offset, "src_offset"),
                     _index(nbytes, "nbytes"))

    def copy_runs(self, src, dst_offsets, src_offsets, sizes):
        """Copies runs of bytes from arena `src` into this one: run i is sizes[i] bytes from
        src_offsets[i] there to dst_offsets[i] here (host memory; both arenas' pages mapped)."""
        as_u64 = lambda a: np.ascontiguousarray(a, dtype=np.uint64)
        self._c.copy_runs(src._c, as_u64(dst_offsets), as_u64(src_offsets), as_u64(sizes))

    def write(self, offset, data):
        """Copies the bytes of `data` (a C-contiguous array or buffer) into the arena at `offset`;
        every slot touched must be mapped. Works on every backend (for cuda: host to device)."""
        offset = _index(offset, "offset")
        if offset < 0:
            raise InvalidArgumentError(f"offset must not be negative, got {offset}")
        if isinstance(data, (bytes, bytearray, memoryview)):
            data = np.frombuffer(data, dtype=np.uint8)
        self._c.write(offset, np.ascontiguousarray(data).reshape(-1).view(np.uint8))

    def read(self, offset, nbytes, dtype=np.uint8):
        """A copy of [offset, offset+nbytes) as a 1-D array of `dtype`; every slot touched must
        be mapped. Works on every backend (for cuda: device to host)."""
        dtype = np.dtype(dtype)
        offset, nbytes = _index(offset, "offset"), _index(nbytes, "nbytes")
        if offset < 0 or nbytes < 0:
            raise InvalidArgumentError(f"read needs offset >= 0 and nbytes >= 0, got {offset}, {nbytes}")
        if nbytes % dtype.itemsize:
            raise InvalidArgumentError(f"{nbytes} bytes is not a whole number of {dtype} values")
        out = np.empty(nbytes // dtype.itemsize, dtype=dtype)
        if nbytes:
            self._c.read(offset, out)
        return out

    def reset_peak(self):
        self._c.reset_peak()

    # ---- state as data ----
    def page_table(self):
        """One row per virtual slot: slot, physical page (-1 when unmapped), tag, live views."""
        table = np.empty(self.n_slots, dtype=PAGE_TABLE_DTYPE)
        self._c.page_table(table)
        return table

    def pinned_slots(self):
        """The slots a live NumPy view pins now (they cannot be unmapped or remapped away)."""
        table = self.page_table()
        return table["slot"][table["pins"] > 0]

    def physical_pages(self):
        """One row per created physical page: page id, slot it is mapped at (-1 if none), tag."""
        table = np.empty(self._c.stats()["max_pages"], dtype=PHYSICAL_DTYPE)
        n = self._c.physical_table(table)
        return table[:n][["page", "slot", "tag"]].copy()

    def stats(self):
        """Bytes in use, peak, per tag, and operation counters, as a dict."""
        return self._c.stats()

    def driver_times(self):
        """{call: (calls, seconds)} of the backend's own calls on the caller's path, each timed
        alone: on "cuda", cuMemCreate (pool empty), cuMemMap, cuMemSetAccess, cuMemUnmap and
        cuMemRelease (pool full) as "create", "map", "set_access", "unmap", "release"; all
        zero on "cpu"."""
        return self._c.driver_times()

    def view(self, slot, n_slots=1, dtype=np.uint8, readonly=False):
        """A zero-copy NumPy array over slots [slot, slot+n_slots). The slots stay pinned (they
        cannot be unmapped or remapped away) until the array and every view of it are gone."""
        slot, n_slots = _index(slot, "slot"), _index(n_slots, "n_slots")
        if n_slots <= 0:
            raise InvalidArgumentError(f"n_slots must be positive, got {n_slots}")
        return self.view_bytes(slot * self.page_size, n_slots * self.page_size, dtype, readonly)

    def view_bytes(self, offset, nbytes, dtype=np.uint8, readonly=False):
        """Like view() for any byte range; nbytes must be a multiple of the dtype's size."""
        dtype = np.dtype(dtype)
        offset, nbytes = _index(offset, "offset"), _index(nbytes, "nbytes")
        if offset < 0 or nbytes <= 0:
            raise InvalidArgumentError(f"a view needs offset >= 0 and nbytes > 0, got {offset}, {nbytes}")
        if nbytes % dtype.itemsize:
            raise InvalidArgumentError(f"{nbytes} bytes is not a whole number of {dtype} values")
        buffer = self._c.view(offset, nbytes, bool(readonly))
        array = np.frombuffer(buffer, dtype=dtype)
        if not readonly:
            array.flags.writeable = True
        return array

    def __repr__(self):
        s = self._c.stats()
        return (f"Arena(backend={self.backend!r}, page_size={format_size(s['page_size'])}, "
                f"slots={s['n_slots']}, in_use={format_size(s['bytes_in_use'])}"
                f"/{format_size(s['budget_bytes'])}, mapped={s['pages_mapped']})")
