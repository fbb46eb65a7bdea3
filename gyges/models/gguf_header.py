"""A GGUF file's header walked once with every length and count bounded by the bytes left,
before the `gguf` package reads it.

The package's reader trusts the counts it reads: an array whose count was edited to 2**40 makes it
slice its memory map element by element past the end of the file for hours (each slice comes back
short, nothing checks). Here every string length, array count and tensor count is checked
against what the rest of the file could hold, so the walk is at most one step per byte of the
header and a lying count is refused at once, naming the key.

    check(path)    # CheckpointError, or the header is consistent enough to hand to the reader

Layout (llama.cpp's gguf.h; little-endian, or big-endian when the version reads that way):
    magic "GGUF", version u32 (2 or 3), n_tensors u64, n_kv u64,
    n_kv times: key (u64 length + bytes), value type u32, value
    n_tensors times: name (string), n_dims u32, dims u64[n_dims], type u32, offset u64
A value is a scalar (its size below), a string, or an array: item type u32, count u64, items.
"""
import mmap
import os
import struct

from .checkpoint import CheckpointError

# GGUF value type -> size in bytes of one scalar (8: string and 9: array have none)
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_MAX_NESTING = 8    # arrays of arrays: llama.cpp writes none; a few levels are plenty
_MAX_DIMS = 8       # GGML_MAX_DIMS is 4


class _Walk:
    def __init__(self, view, path, order):
        self.view, self.path, self.order, self.at = view, path, order, 0

    def fail(self, what):
        raise CheckpointError(f"{self.path}: not a readable GGUF file: {what} (at byte "
                              f"{self.at} of {len(self.view)})")

    def take(self, fmt, what):
        size = struct.calcsize(fmt)
        if self.at + size > len(self.view):
            self.fail(f"the file ends inside {what}")
        value = struct.unpack_from(self.order + fmt, self.view, self.at)[0]
        self.at += size
        return value

    def room(self, count, size, what):
        """Refuses `count` items of at least `size` bytes each if the rest of the file is
        shorter: a count is checked before a single item is walked."""
        if count > (len(self.view) - self.at) // size:
            self.fail(f"{what} claims {count} items of {size} bytes, more than the file holds")

    def skip(self, count, size, what):
        self.room(count, size, what)
        self.at += count * size

    def string(self, what):
        n = self.take("Q", what)
        self.skip(n, 1, what)

    def value(self, kind, what, depth=0):
        if kind in _SCALAR_SIZES:
            self.skip(1, _SCALAR_SIZES[kind], what)
        elif kind == _STRING:
            self.string(what)
        elif kind == _ARRAY:
            if depth >= _MAX_NESTING:
                self.fail(f"{what} nests arrays over {_MAX_NESTING} deep")
            item = self.take("I", what)
            count = self.take("Q", what)
            if item in _SCALAR_SIZES:
                self.skip(count, _SCALAR_SIZES[item], what)
                return
            self.room(count, 8 if item == _STRING else 12, what)  # a length, or type + count
            for _ in range(count):
                self.value(item, what, depth + 1)
        else:
            self.fail(f"{what} has the unknown value type {kind}")


def check(path):
    """Walks the header of the GGUF file at `path`; CheckpointError naming what is wrong."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise CheckpointError(f"{path}: not a readable GGUF file: {size} bytes")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
                _walk(view, path)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e}") from None


def _walk(view, path):
    if view[:4] != b"GGUF":
        raise CheckpointError(f"{path}: not a readable GGUF file: the magic is "
                              f"{bytes(view[:4])!r}, not b'GGUF'")
    order = "<" if struct.unpack_from("<I", view, 4)[0] in (2, 3) else ">"
    w = _Walk(view, path, order)
    w.at = 4
    version = w.take("I", "the version")
    if version not in (2, 3):
        return  # the reader says which versions it reads
    n_tensors = w.take("Q", "the tensor count")
    n_kv = w.take("Q", "the metadata count")
    w.room(n_kv, 12, "the metadata")  # a key's length and a value's type
    for i in range(n_kv):
        key = f"metadata key {i}"
        w.string(key)
        w.value(w.take("I", key), key)
    w.room(n_tensors, 24, "the tensor list")  # a name's length, n_dims, type, offset
    for i in range(n_tensors):
        what = f"tensor info {i}"
        w.string(what)
        n_dims = w.take("I", what)
        if n_dims > _MAX_DIMS:
            w.fail(f"{what} has {n_dims} dimensions")
        w.skip(n_dims, 8, what)
        w.skip(1, 12, what)  # the type (u32) and the offset (u64)
