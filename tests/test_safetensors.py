"""gyges.safetensors against files built by hand, an independent bf16 conversion, and fuzzing."""

import json
import math
import os
import random
import struct
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyges.models import safetensors
from gyges.models.safetensors import SafetensorsError


# ---------------------------------------------------------------- independent helpers

def ref_f32_to_bf16(value: float) -> int:
    """Scalar float32 -> bf16 bits, round to nearest even, from the IEEE bit layout."""
    (bits,) = struct.unpack("<I", struct.pack("<f", value))
    if (bits & 0x7F800000) == 0x7F800000 and (bits & 0x007FFFFF):  # NaN: keep sign, quiet it
        return (bits >> 16) | 0x0040
    upper, lower = bits >> 16, bits & 0xFFFF
    if lower > 0x8000 or (lower == 0x8000 and upper & 1):
        upper += 1  # carries into the exponent correctly, up to infinity
    return upper


def ref_bf16_to_f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits << 16))[0]


def raw_file(path, header, data=b"", length=None):
    """Writes header (dict, str or bytes) and data exactly as given; length overrides N."""
    if isinstance(header, dict):
        header = json.dumps(header)
    if isinstance(header, str):
        header = header.encode("utf-8")
    n = len(header) if length is None else length
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", n) + header + data)
    return path


def entry(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


# ---------------------------------------------------------------- round trips

SHAPES = [(3, 5), (7,), (), (0, 4), (2, 3, 5)]


def _tensors(rng):
    t = {f"t{i}": rng.standard_normal(s).astype(np.float32) * 10 for i, s in enumerate(SHAPES)}
    t["ids"] = np.arange(-3, 6, dtype=np.int64)
    t["i32"] = np.array([[1, -2], [3, 2**31 - 1]], dtype=np.int32)
    t["mask"] = np.array([7, 0, 255], dtype=np.uint8)
    return t


def test_round_trip_f32_exact(tmp_path):
    t = _tensors(np.random.default_rng(1))
    safetensors.write(tmp_path / "a.safetensors", t, dtype="f32", metadata={"format": "pt"})
    back = safetensors.read(tmp_path / "a.safetensors")
    assert set(back) == set(t)
    for name, a in t.items():
        assert back[name].dtype == a.dtype and back[name].shape == a.shape
        np.testing.assert_array_equal(back[name], a)  # exact: no conversion happened
    assert safetensors.read_header(tmp_path / "a.safetensors").metadata == {"format": "pt"}


def test_round_trip_f16(tmp_path):
    t = _tensors(np.random.default_rng(2))
    safetensors.write(tmp_path / "a.safetensors", t, dtype="f16")
    hdr = safetensors.read_header(tmp_path / "a.safetensors").tensors
    assert hdr["t0"].dtype == "F16" and hdr["ids"].dtype == "I64"
    back = safetensors.read(tmp_path / "a.safetensors")
    raw = safetensors.read(tmp_path / "a.safetensors", as_float32=False)
    for name in (f"t{i}" for i in range(len(SHAPES))):
        # f16 is what NumPy's own (IEEE round-to-nearest-even) cast gives; exact after that.
        expect = t[name].astype(np.float16)
        assert raw[name].dtype == np.float16
        np.testing.assert_array_equal(raw[name], expect)
        assert back[name].dtype == np.float32
        np.testing.assert_array_equal(back[name], expect.astype(np.float32))


def test_round_trip_bf16_matches_independent_conversion(tmp_path):
    t = _tensors(np.random.default_rng(3))
    safetensors.write(tmp_path / "a.safetensors", t, dtype="bf16")
    raw = safetensors.read(tmp_path / "a.safetensors", as_float32=False)
    back = safetensors.read(tmp_path / "a.safetensors")
    for name in (f"t{i}" for i in range(len(SHAPES))):
        expect_bits = [ref_f32_to_bf16(float(v)) for v in t[name].reshape(-1)]
        assert raw[name].dtype == np.uint16 and raw[name].shape == t[name].shape
        assert raw[name].reshape(-1).tolist() == expect_bits
        expect = [ref_bf16_to_f32(b) for b in expect_bits]
        assert back[name].dtype == np.float32
        assert back[name].reshape(-1).tolist() == expect
        # bf16 keeps 8 significant bits (7 stored): rounding error at most half an ulp, 2^-8.
        np.testing.assert_allclose(back[name], t[name], rtol=2.0**-8, atol=0)


def test_bf16_conversion_edge_cases():
    specials = [0.0, -0.0, 1.0, -1.0, math.inf, -math.inf, math.nan,
                struct.unpack("<f", struct.pack("<I", 0x7F800001))[0],  # NaN with low payload
                struct.unpack("<f", struct.pack("<I", 0xFFC00001))[0],
                3.4028234663852886e38,  # max float32: rounds up to inf in bf16
                1e-45, 1.17549435e-38,  # subnormal and smallest normal
                1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8),  # exact ties: to even
                1 + 2**-8 + 2**-20]  # just above a tie: rounds up
    rng = np.random.default_rng(4)
    bits = rng.integers(0, 2**32, size=2000, dtype=np.uint64).astype(np.uint32)
    values = np.concatenate([np.array(specials, dtype=np.float32), bits.view(np.float32)])
    ours = safetensors.f32_to_bf16(values)
    ref = [ref_f32_to_bf16(float(v)) for v in values]
    assert ours.tolist() == ref
    # Decoding every one of the 65536 patterns agrees with the struct-based reference.
    all_bits = np.arange(2**16, dtype=np.uint16)
    decoded = safetensors.bf16_to_f32(all_bits).view(np.uint32)
    assert decoded.tolist() == [b << 16 for b in range(2**16)]


def test_f32_read_is_zero_copy_and_read_only(tmp_path):
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    safetensors.write(tmp_path / "a.safetensors", {"a": a})
    back = safetensors.read(tmp_path / "a.safetensors")["a"]
    assert isinstance(back.base, np.memmap) or isinstance(back.base.base, np.memmap)
    assert not back.flags.writeable


def test_read_subset_and_missing_name(tmp_path):
    path = tmp_path / "a.safetensors"
    safetensors.write(path, {"a": np.ones(2, np.float32), "b": np.zeros(3, np.float32)})
    assert list(safetensors.read(path, names=["b"])) == ["b"]
    with pytest.raises(SafetensorsError, match="no tensor.*'c'"):
        safetensors.read(path, names=["a", "c"])


def test_header_is_padded_so_data_is_aligned(tmp_path):
    path = tmp_path / "a.safetensors"
    safetensors.write(path, {"x": np.ones(3, np.float64), "y": np.ones(1, np.float16),
                             "z": np.ones(5, np.float32)}, dtype=None)
    h = safetensors.read_header(path)
    assert h.data_start % 8 == 0
    for info in h.tensors.values():
        itemsize = {"F64": 8, "F32": 4, "F16": 2}[info.dtype]
        assert info.begin % itemsize == 0


def test_write_errors(tmp_path):
    path = tmp_path / "a.safetensors"
    with pytest.raises(SafetensorsError, match="unknown dtype 'f8'"):
        safetensors.write(path, {"a": np.ones(1)}, dtype="f8")
    with pytest.raises(SafetensorsError, match="invalid tensor name '__metadata__'"):
        safetensors.write(path, {"__metadata__": np.ones(1)})
    with pytest.raises(SafetensorsError, match="invalid tensor name ''"):
        safetensors.write(path, {"": np.ones(1)})
    with pytest.raises(SafetensorsError, match="metadata must map strings"):
        safetensors.write(path, {"a": np.ones(1)}, metadata={"n": 1})
    with pytest.raises(SafetensorsError, match="cannot store NumPy dtype complex128"):
        safetensors.write(path, {"a": np.ones(1, np.complex128)})
    assert not os.listdir(tmp_path)  # nothing half-written left behind


# ---------------------------------------------------------------- a file built byte by byte

def test_read_hand_built_file(tmp_path):
    # Three tensors laid out by hand: F32 [2,2], F16 [3], BF16 [2], I64 [1].
    f32 = struct.pack("<4f", 1.5, -2.0, 0.25, 1e-3)
    f16 = struct.pack("<3e", 0.5, -65504.0, 6.1035156e-05)
    bf16 = struct.pack("<2H", 0x3FC0, 0xC2F7)  # 1.5 and -123.5
    i64 = struct.pack("<q", -(2**40))
    header = ('{"__metadata__":{"who":"hand"},'
              '"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},'
              '"h":{"dtype":"F16","shape":[3],"data_offsets":[16,22]},'
              '"b":{"dtype":"BF16","shape":[2],"data_offsets":[22,26]},'
              '"i":{"dtype":"I64","shape":[1],"data_offsets":[26,34]}}   ')
    path = raw_file(tmp_path / "hand.safetensors", header, f32 + f16 + bf16 + i64)
    hdr = safetensors.read_header(path)
    assert hdr.metadata == {"who": "hand"} and hdr.data_start == 8 + len(header)
    assert hdr.tensors["h"] == safetensors.TensorInfo("F16", (3,), 16, 22)
    t = safetensors.read(path)
    assert t["w"].tolist() == [[1.5, -2.0], [0.25, np.float32(1e-3)]]
    assert t["h"].dtype == np.float32 and t["h"].tolist() == [0.5, -65504.0, 6.103515625e-05]
    assert t["b"].tolist() == [1.5, -123.5]
    assert t["i"].dtype == np.int64 and t["i"].tolist() == [-(2**40)]
    assert safetensors.read(path, as_float32=False)["b"].tolist() == [0x3FC0, 0xC2F7]


def test_empty_file_of_tensors(tmp_path):
    path = raw_file(tmp_path / "e.safetensors", "{}")
    assert safetensors.read(path) == {}
    path = raw_file(tmp_path / "z.safetensors", {"z": entry("F32", [0, 3], 0, 0)})
    assert safetensors.read(path)["z"].shape == (0, 3)


# ---------------------------------------------------------------- malformed files

F32_2 = struct.pack("<2f", 1.0, 2.0)

MALFORMED = {
    "truncated": (b"\x01\x02\x03", None, "truncated: 3 bytes"),
    "length_past_eof": ({"a": entry("F32", [2], 0, 8)}, 10_000, "header length 10000 is larger"),
    "header_too_large": ({}, 100_000_001, "exceeds the 100000000-byte limit"),
    "not_utf8": (b'{"a\xff":1}', None, "not valid UTF-8"),
    "not_json": ('{"a": ', None, "not valid JSON"),
    "not_object": ("[1, 2]", None, "starting with '{'"),
    "duplicate": ('{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
                  '"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}', None, "duplicate key"),
    "entry_not_object": ({"a": [1]}, None, "tensor 'a': entry must be an object"),
    "missing_key": ({"a": {"dtype": "F32", "shape": [2]}}, None,
                    "tensor 'a': missing key.*data_offsets"),
    "extra_key": ({"a": dict(entry("F32", [2], 0, 8), x=1)}, None, "unexpected key.*'x'"),
    "unknown_dtype": ({"a": entry("F8_E4M3", [8], 0, 8)}, None,
                      "tensor 'a': unknown or unsupported dtype 'F8_E4M3'"),
    "bad_shape": ({"a": entry("F32", [2, -1], 0, 8)}, None, "shape must be a list"),
    "bool_shape": ({"a": entry("F32", [True, 2], 0, 8)}, None, "shape must be a list"),
    "huge_shape": ({"a": entry("F32", [2**40, 2**40, 0], 0, 0), "b": entry("F32", [2], 0, 8)},
                   None, "too large"),
    "bad_offsets": ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0]}}, None,
                    "data_offsets must be"),
    "reversed_offsets": ({"a": entry("F32", [0], 8, 0)}, None, "begin 8 > end 0"),
    "size_mismatch": ({"a": entry("F32", [3], 0, 8)}, None,
                      r"tensor 'a': shape \[3\] of F32 needs 12 bytes but .* span 8"),
    "outside_data": ({"a": entry("F32", [4], 0, 16)}, None, "outside the data area of 8 bytes"),
    "overlap": ({"a": entry("F32", [2], 0, 8), "b": entry("F32", [1], 4, 8)}, None, "overlaps"),
    "hole": ({"a": entry("F32", [1], 4, 8)}, None, r"hole \[0, 4\) before tensor 'a'"),
    "trailing": ({"a": entry("F32", [1], 0, 4)}, None, "4 bytes after the last tensor"),
    "bad_metadata": ({"__metadata__": {"k": 1}, "a": entry("F32", [2], 0, 8)}, None,
                     "__metadata__ must be an object mapping strings"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_files_raise_clear_errors(case, tmp_path):
    header, length, message = MALFORMED[case]
    path = tmp_path / f"{case}.safetensors"
    if case == "truncated":
        path.write_bytes(header)
    else:
        raw_file(path, header, F32_2, length=length)
    with pytest.raises(SafetensorsError, match=message) as info:
        safetensors.read(path)
    assert str(path) in str(info.value)  # every message names the file
    with pytest.raises(SafetensorsError):
        safetensors.read_header(path)


def test_missing_file_is_a_safetensors_error(tmp_path):
    with pytest.raises(SafetensorsError, match="cannot read"):
        safetensors.read(tmp_path / "absent.safetensors")


# ---------------------------------------------------------------- fuzzing

def _valid_file_bytes() -> bytes:
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "v.safetensors")
        safetensors.write(p, {"a": np.arange(6, dtype=np.float32).reshape(2, 3),
                              "b": np.arange(3, dtype=np.float32),
                              "c": np.array([1, 2], dtype=np.int64)},
                          dtype="bf16", metadata={"k": "v"})
        with open(p, "rb") as f:
            return f.read()


VALID = _valid_file_bytes()

mutation = st.one_of(
    st.tuples(st.just("flip"), st.lists(st.tuples(st.integers(0, len(VALID) - 1),
                                                  st.integers(1, 255)), min_size=1, max_size=4)),
    st.tuples(st.just("truncate"), st.integers(0, len(VALID) - 1)),
    st.tuples(st.just("length"), st.integers(0, 2**64 - 1)),
    st.tuples(st.just("length_near"), st.integers(-16, 16)),
    st.tuples(st.just("append"), st.binary(min_size=1, max_size=16)),
)


def _mutate(data: bytes, m) -> bytes:
    kind, arg = m
    b = bytearray(data)
    if kind == "flip":
        for pos, x in arg:
            b[pos] ^= x
    elif kind == "truncate":
        del b[arg:]
    elif kind == "length":
        b[:8] = struct.pack("<Q", arg)
    elif kind == "length_near":
        (n,) = struct.unpack("<Q", bytes(b[:8]))
        b[:8] = struct.pack("<Q", max(0, n + arg))
    else:
        b += arg
    return bytes(b)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutation)
def test_fuzz_mutated_files_only_raise_safetensors_error(m):
    data = _mutate(VALID, m)
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "m.safetensors")
        with open(p, "wb") as f:
            f.write(data)
        try:
            tensors = safetensors.read(p)
        except SafetensorsError:
            return
        # Accepted: every tensor must be fully readable within the file.
        for arr in tensors.values():
            np.asarray(arr).tobytes()


def test_fuzz_header_json_values():
    """Random but well-formed JSON headers with wrong types are refused cleanly."""
    rng = random.Random(5)
    junk = [None, True, -1, 1.5, "x", [], {}, [1, 2, 3], [0, 2**70], {"a": 1}, 2**64]
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "j.safetensors")
        for _ in range(200):
            e = entry("F32", [2], 0, 8)
            e[rng.choice(["dtype", "shape", "data_offsets"])] = rng.choice(junk)
            raw_file(p, {"a": e}, F32_2)
            with pytest.raises(SafetensorsError):
                safetensors.read(p)


# ---------------------------------------------------------------- model weights must be floats

SMALL_MODEL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8)
RELABELLED = "model.layers.0.mlp.up_proj.weight"


def relabel_dtype(path, name, new):
    """Rewrites tensor `name`'s header dtype in place. The header keeps its length (padded with
    the spaces the format allows), so the bytes are untouched and only their label changes."""
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    old = header[name]["dtype"]
    header[name]["dtype"] = new
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    assert len(blob) <= n
    data[8:8 + n] = blob + b" " * (n - len(blob))
    path.write_bytes(bytes(data))
    return old


def test_safetensors_error_is_a_gyges_format_error():
    import gyges
    assert issubclass(SafetensorsError, gyges.FormatError)
    assert issubclass(SafetensorsError, gyges.Error) and issubclass(SafetensorsError, ValueError)


# Each float dtype relabelled to an integer dtype of the same byte size, which the reader would
# otherwise accept and convert to floats by value: a silently different model.
@pytest.mark.parametrize("dtype, label", [("f32", "I32"), ("f16", "I16"), ("bf16", "U16"),
                                          ("f64", "I64"), ("f32", "U32")])
@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_model_load_refuses_integer_weights(tmp_path, dtype, label, sharded):
    import gyges
    model = gyges.Model.random(gyges.models.config.ModelConfig.tiny().replace(**SMALL_MODEL), seed=3)
    files = model.save(tmp_path, dtype=dtype, shard_bytes=4096 if sharded else None)
    fname = next(f for f in files if RELABELLED in
                 safetensors.read_header(tmp_path / f).tensors)
    relabel_dtype(tmp_path / fname, RELABELLED, label)
    # The generic reader still hands out the raw integers: it is not reading model weights.
    assert safetensors.read(tmp_path / fname, [RELABELLED])[RELABELLED].dtype.kind in "iu"
    with pytest.raises(gyges.FormatError) as err:
        gyges.Model.load(tmp_path)
    assert isinstance(err.value, SafetensorsError)
    msg = str(err.value)
    for fragment in (fname, repr(RELABELLED), f"dtype {label}", "floating point"):
        assert fragment in msg, f"{fragment!r} missing from: {msg}"


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16", "f64"])
def test_model_load_accepts_every_float_dtype(tmp_path, dtype):
    import gyges
    model = gyges.Model.random(gyges.models.config.ModelConfig.tiny().replace(**SMALL_MODEL), seed=3)
    model.save(tmp_path, dtype=dtype)
    back = gyges.Model.load(tmp_path)
    tol = {"f32": 0, "f64": 0, "f16": 2.0**-11, "bf16": 2.0**-8}[dtype]  # half an ulp
    for name, w in model.tensors.items():
        assert back.tensors[name].dtype == np.float32
        np.testing.assert_allclose(back.tensors[name], w, rtol=tol, atol=1e-7 if tol else 0)
