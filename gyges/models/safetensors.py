"""Reader and writer for the safetensors format, so gyges needs no `safetensors` package.

Layout of a file:
    [0, 8)          u64 little-endian N: length of the JSON header
    [8, 8+N)        UTF-8 JSON object: name -> {"dtype", "shape", "data_offsets": [begin, end]},
                    plus an optional "__metadata__": {str: str}; may be padded with spaces
    [8+N, EOF)      data area; each tensor's bytes are data[begin:end], row-major, little-endian

Every header is checked before any tensor is touched, as the reference implementation does: the
tensors must tile the data area exactly (no overlap, no hole, nothing after the last one), so a
file that passes cannot make us read outside it. All problems raise `SafetensorsError` (a
gyges.FormatError, so also a ValueError), whose message names the file and, where there is one,
the tensor.

NumPy has no bfloat16: raw BF16 data is handled as uint16 and converted with bit shifts.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Iterable, Mapping

import numpy as np

from ..core.errors import FormatError, InvalidArgumentError

__all__ = [
    "SafetensorsError", "TensorInfo", "Header", "read", "read_header", "write",
    "bf16_to_f32", "f32_to_bf16", "MAX_HEADER_BYTES", "FLOAT_DTYPES",
]

# The reference implementation refuses headers above 100 MB (a guard against memory exhaustion).
MAX_HEADER_BYTES = 100_000_000

# safetensors dtype -> little-endian NumPy dtype of the stored bytes (BF16 kept raw as uint16).
_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"), "U32": np.dtype("<u4"), "U16": np.dtype("<u2"), "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
# (NumPy kind, itemsize) -> safetensors dtype, for arrays written in their own dtype.
_FROM_NUMPY = {(v.kind, v.itemsize): k for k, v in _DTYPES.items() if k != "BF16"}
_WRITE_TARGETS = {"f32": "F32", "f16": "F16", "bf16": "BF16", "f64": "F64"}
_MAX_NDIM = 32  # NumPy's own limit is 64; no model tensor comes close


class SafetensorsError(FormatError):
    """A safetensors file is malformed, or a request cannot be met by it. A gyges.FormatError,
    and so a gyges.Error and a ValueError."""


@dataclass(frozen=True)
class TensorInfo:
    dtype: str               # safetensors dtype name, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int               # byte offsets relative to the start of the data area
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class Header:
    tensors: dict[str, TensorInfo]  # in file order (by begin offset)
    metadata: dict[str, str]
    data_start: int                 # absolute file offset of the data area: 8 + N
    file_size: int


# ---------------------------------------------------------------- bf16 conversion

def bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    """uint16 bf16 bit patterns -> float32 (exact: bf16 is the top half of an f32)."""
    raw = np.asarray(raw)
    if raw.dtype != np.uint16:
        raise SafetensorsError(f"bf16 data must be uint16 bit patterns, got {raw.dtype}")
    wide = raw.astype(np.uint32)
    wide <<= 16  # in place: keeps a 0-d array an array
    return wide.view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> uint16 bf16 bit patterns, rounding to nearest, ties to even; NaN stays NaN."""
    x = np.asarray(x, dtype=np.float32, order="C")
    bits = x.view(np.uint32)
    # Adding 0x7FFF plus the lowest kept bit rounds half-way cases towards an even mantissa.
    lsb = (bits >> 16) & np.uint32(1)
    rounded = ((bits + np.uint32(0x7FFF) + lsb) >> 16).astype(np.uint16)
    # A NaN whose payload sits in the low half would otherwise round to Inf: keep it quiet NaN.
    nan = ((bits >> 16) | np.uint32(0x0040)).astype(np.uint16)
    return np.where(np.isnan(x), nan, rounded).astype(np.uint16)


# ---------------------------------------------------------------- header parsing

def _fail(path: str, msg: str) -> SafetensorsError:
    return SafetensorsError(f"{path}: {msg}")


def _no_duplicate_keys(pairs: list) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise InvalidArgumentError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _is_uint(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _parse_entry(path: str, name: str, entry: object) -> TensorInfo:
    where = f"tensor {name!r}"
    if not isinstance(entry, dict):
        raise _fail(path, f"{where}: entry must be an object, got {type(entry).__name__}")
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in entry]
    if missing:
        raise _fail(path, f"{where}: missing key(s) {', '.join(missing)}")
    extra = sorted(set(entry) - {"dtype", "shape", "data_offsets"})
    if extra:
        raise _fail(path, f"{where}: unexpected key(s) {', '.join(map(repr, extra))}")
    dtype = entry["dtype"]
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise _fail(path, f"{where}: unknown or unsupported dtype {dtype!r} "
                          f"(supported: {', '.join(_DTYPES)})")
    shape = entry["shape"]
    if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
        raise _fail(path, f"{where}: shape must be a list of non-negative integers, got {shape!r}")
    if len(shape) > _MAX_NDIM:
        raise _fail(path, f"{where}: {len(shape)} dimensions is more than {_MAX_NDIM}")
    # NumPy cannot make an array whose nominal size overflows int64, even an empty one.
    if math.prod(d for d in shape if d) >= 2**62:
        raise _fail(path, f"{where}: shape {shape} is too large")
    offsets = entry["data_offsets"]
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_uint, offsets))):
        raise _fail(path, f"{where}: data_offsets must be [begin, end] non-negative integers, "
                          f"got {offsets!r}")
    begin, end = offsets
    if begin > end:
        raise _fail(path, f"{where}: data_offsets begin {begin} > end {end}")
    expected = math.prod(shape) * _DTYPES[dtype].itemsize
    if end - begin != expected:
        raise _fail(path, f"{where}: shape {shape} of {dtype} needs {expected} bytes but "
                          f"data_offsets [{begin}, {end}] span {end - begin}")
    return TensorInfo(dtype, tuple(shape), begin, end)


def _parse_header(path: str, blob: bytes, data_start: int, file_size: int) -> Header:
    try:
        text = blob.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _fail(path, f"header is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    if not text.startswith("{"):
        raise _fail(path, "header must be a JSON object starting with '{'")
    try:
        raw = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except (ValueError, RecursionError) as e:
        # JSONDecodeError is a ValueError, as is our duplicate-key complaint.
        raise _fail(path, f"header is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise _fail(path, f"header must be a JSON object, got {type(raw).__name__}")

    metadata = raw.pop("__metadata__", {})
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise _fail(path, "__metadata__ must be an object mapping strings to strings")

    infos = {name: _parse_entry(path, name, entry) for name, entry in raw.items()}

    # The tensors must tile [0, data_size) exactly.
    data_size = file_size - data_start
    expected_begin, prev = 0, None
    for name, info in sorted(infos.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if info.begin < expected_begin:
            raise _fail(path, f"tensor {name!r} [{info.begin}, {info.end}) overlaps tensor "
                              f"{prev!r} ending at {expected_begin}")
        if info.begin > expected_begin:
            raise _fail(path, f"data area not fully covered: hole [{expected_begin}, "
                              f"{info.begin}) before tensor {name!r}")
        if info.end > data_size:
            raise _fail(path, f"tensor {name!r} data_offsets [{info.begin}, {info.end}] lie "
                              f"outside the data area of {data_size} bytes (file truncated?)")
        expected_begin, prev = info.end, name
    if expected_begin != data_size:
        raise _fail(path, f"data area not fully covered: {data_size - expected_begin} bytes "
                          f"after the last tensor ({data_size} bytes of data, tensors end at "
                          f"{expected_begin})")
    ordered = dict(sorted(infos.items(), key=lambda kv: (kv[1].begin, kv[1].end)))
    return Header(ordered, metadata, data_start, file_size)


def read_header(path: str | os.PathLike) -> Header:
    """Parses and fully validates the header of a safetensors file (reads no tensor data)."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            file_size = os.fstat(f.fileno()).st_size
            if file_size < 8:
                raise _fail(path, f"truncated: {file_size} bytes, shorter than the 8-byte "
                                  f"header length")
            (n,) = struct.unpack("<Q", f.read(8))
            if n > MAX_HEADER_BYTES:
                raise _fail(path, f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit")
            if n > file_size - 8:
                raise _fail(path, f"header length {n} is larger than the {file_size - 8} bytes "
                                  f"after it (truncated file?)")
            blob = f.read(n)
    except OSError as e:
        raise SafetensorsError(f"{path}: cannot read: {e}") from e
    if len(blob) != n:
        raise _fail(path, "file changed size while being read")
    return _parse_header(path, blob, 8 + n, file_size)


# ---------------------------------------------------------------- reading

def read(path: str | os.PathLike, names: Iterable[str] | None = None,
         as_float32: bool = True) -> dict[str, np.ndarray]:
    """Loads tensors (all, or just `names`) from a safetensors file.

    Arrays are read-only views of a memory map (zero-copy) when no conversion is needed. With
    as_float32, every floating tensor (F16, BF16, F64) becomes a float32 copy; integer tensors are
    never converted. Without it, BF16 tensors come back as raw uint16 bit patterns. Model weights
    must be floating point: checkpoint.load refuses integer tensors before calling this.
    """
    path = os.fspath(path)
    header = read_header(path)
    if names is None:
        wanted = list(header.tensors)
    else:
        wanted = list(names)
        absent = [n for n in wanted if n not in header.tensors]
        if absent:
            raise _fail(path, f"no tensor(s) named {', '.join(map(repr, absent))}")
    data_size = header.file_size - header.data_start
    data = None
    if data_size > 0 and wanted:
        try:
            data = np.memmap(path, dtype=np.uint8, mode="r", offset=header.data_start,
                             shape=(data_size,))
        except (OSError, ValueError) as e:
            raise _fail(path, f"cannot map the data area: {e}") from e
    out: dict[str, np.ndarray] = {}
    for name in wanted:
        info = header.tensors[name]
        dt = _DTYPES[info.dtype]
        if info.nbytes == 0:
            arr = np.zeros(info.shape, dtype=dt)
        else:
            arr = np.ndarray(info.shape, dtype=dt, buffer=data, offset=info.begin)
        if as_float32 and info.dtype in FLOAT_DTYPES and info.dtype != "F32":
            arr = bf16_to_f32(arr) if info.dtype == "BF16" else arr.astype(np.float32)
        out[name] = arr
    return out


# ---------------------------------------------------------------- writing

def _encode(name: str, array: np.ndarray, target: str | None) -> tuple[str, np.ndarray]:
    """Returns (safetensors dtype, contiguous little-endian array of the bytes to store)."""
    a = np.asarray(array)
    if target is not None and a.dtype.kind == "f":
        if target == "BF16":
            return "BF16", f32_to_bf16(a.astype(np.float32))
        return target, np.asarray(a, dtype=_DTYPES[target], order="C")
    st = _FROM_NUMPY.get((a.dtype.kind, a.dtype.itemsize))
    if st is None:
        raise SafetensorsError(f"tensor {name!r}: cannot store NumPy dtype {a.dtype}")
    return st, np.asarray(a, dtype=_DTYPES[st], order="C")


def write(path: str | os.PathLike, tensors: Mapping[str, np.ndarray], dtype: str | None = "f32",
          metadata: Mapping[str, str] | None = None) -> None:
    """Writes tensors to a safetensors file.

    Floating arrays are stored as `dtype` ("f32", "f16", "bf16", "f64"; bf16 rounds to nearest
    even), or in their own dtype when dtype is None. Integer and bool arrays keep their dtype.
    The file is written under a temporary name and renamed, so a reader never sees half of it.
    """
    path = os.fspath(path)
    if dtype is not None and dtype not in _WRITE_TARGETS:
        raise SafetensorsError(f"{path}: unknown dtype {dtype!r} "
                               f"(choose from {', '.join(_WRITE_TARGETS)} or None)")
    target = None if dtype is None else _WRITE_TARGETS[dtype]
    if metadata is not None and not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise SafetensorsError(f"{path}: metadata must map strings to strings")

    encoded = []
    for name, array in tensors.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise SafetensorsError(f"{path}: invalid tensor name {name!r}")
        encoded.append((name, *_encode(name, array, target)))
    # Widest dtypes first keeps every tensor aligned to its element size (header is padded to 8).
    encoded.sort(key=lambda t: (-t[2].itemsize, t[0]))

    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, st, arr in encoded:
        header[name] = {"dtype": st, "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)
    if len(blob) > MAX_HEADER_BYTES:
        raise SafetensorsError(f"{path}: header of {len(blob)} bytes exceeds the "
                               f"{MAX_HEADER_BYTES}-byte limit")

    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for _, _, arr in encoded:
                f.write(arr.tobytes())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
