"""Where things sit in a (valid) GGUF file, for byte-level edits: the header's counts, each
key-value's key, type and value, each tensor info's n_dims, dims, type and offset, and where the
data starts. A plain walker of the format (v2/v3, little-endian), independent of the gguf
package; it reads the originals only, never a mutant."""
import struct
from dataclasses import dataclass, field

SCALAR_SIZE = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9


@dataclass
class KV:
    key: str
    at: int          # the key's u64 length
    type_at: int     # u32 value type
    value_at: int    # the value (a string's u64 length; an array's u32 item type)
    end: int


@dataclass
class TensorInfo:
    name: str
    at: int          # the name's u64 length
    ndims_at: int    # u32
    dims_at: int     # n_dims u64s, fastest first
    n_dims: int
    type_at: int     # u32 ggml type
    offset_at: int   # u64, relative to the data start
    end: int


@dataclass
class Layout:
    version: int
    n_tensors_at: int = 8
    n_kv_at: int = 16
    kvs: list = field(default_factory=list)
    tensors: list = field(default_factory=list)
    header_end: int = 0   # end of the last tensor info
    data_start: int = 0

    def kv(self, key):
        return next(k for k in self.kvs if k.key == key)

    def tensor(self, name):
        return next(t for t in self.tensors if t.name == name)


def _string(data, at):
    n = struct.unpack_from("<Q", data, at)[0]
    return data[at + 8:at + 8 + n].decode("utf-8"), at + 8 + n


def _skip_value(data, vtype, at):
    if vtype in SCALAR_SIZE:
        return at + SCALAR_SIZE[vtype]
    if vtype == STRING:
        return _string(data, at)[1]
    if vtype == ARRAY:
        itype, n = struct.unpack_from("<IQ", data, at)
        at += 12
        for _ in range(n):
            at = _skip_value(data, itype, at)
        return at
    raise ValueError(f"value type {vtype}")


def walk(data):
    if data[:4] != b"GGUF":
        raise ValueError("not GGUF")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", data, 4)
    layout = Layout(version)
    at, alignment = 24, 32
    for _ in range(n_kv):
        key_at = at
        key, at = _string(data, at)
        vtype = struct.unpack_from("<I", data, at)[0]
        value_at = at + 4
        end = _skip_value(data, vtype, value_at)
        layout.kvs.append(KV(key, key_at, at, value_at, end))
        if key == "general.alignment":
            alignment = struct.unpack_from("<I", data, value_at)[0]
        at = end
    for _ in range(n_tensors):
        name_at = at
        name, at = _string(data, at)
        n_dims = struct.unpack_from("<I", data, at)[0]
        dims_at = at + 4
        type_at = dims_at + 8 * n_dims
        layout.tensors.append(TensorInfo(name, name_at, at, dims_at, n_dims, type_at,
                                         type_at + 4, type_at + 12))
        at = type_at + 12
    layout.header_end = at
    layout.data_start = (at + alignment - 1) // alignment * alignment
    return layout
