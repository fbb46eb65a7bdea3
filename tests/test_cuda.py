"""The CUDA backend: its kernels against NumPy references, the CUDA arena, and a clean refusal
where there is no GPU.

Most tests need a GPU and skip with the reason when gyges was built without CUDA or no device is
visible. The refusal tests run everywhere else: on a machine without a driver, creating a CUDA
arena or launching a kernel must raise gyges.UnavailableError with a message, and leave the CPU
backend working.

References. The KV kernels are byte-exact copies, checked bit for bit against a NumPy model that
computes offsets with the same strides as csrc/kv/kv_layout.c (written out again below), on odd
sizes, all three layouts, fp32/fp16/bf16 element sizes, random bit patterns (NaNs included) and
poisoned outputs, so a missing or stray write shows. The model kernels are checked against a
float64 NumPy model fed the same dtype-rounded inputs.

Tolerance policy: exact for copies, ids, argmax and embedding lookups (one correctly rounded
conversion on both sides); otherwise |got - ref| <= ulps * u * (|ref| + scale), with u the unit
roundoff of the output dtype, `scale` the inputs' magnitude (it bounds the error of sums that
cancel) and `ulps` given beside each use with its reason. Failures report the largest error.
"""
import ctypes
import gc
import sys

import numpy as np
import pytest

import gyges
from gyges import _C
from gyges._C import InvalidArgumentError, OutOfMemoryError, UnavailableError

F32, F16, BF16 = 0, 1, 2  # gy_dtype
DTYPES = {"f32": F32, "f16": F16, "bf16": BF16}
ELEM_SIZE = {F32: 4, F16: 2, BF16: 2}
UNIT_ROUNDOFF = {F32: 2.0**-24, F16: 2.0**-11, BF16: 2.0**-8}
RAW, PAGE, HEAD = 0, 1, 2  # gy_kv_layout_kind
KINDS = {"raw": RAW, "page": PAGE, "head": HEAD}
MiB = 1 << 20


def _gpu_skip_reason():
    if not _C.WITH_CUDA:
        return "gyges was built without CUDA (nvcc was not found at build time)"
    if _C.cuda_device_count() == 0:
        return "no CUDA driver or device on this machine"
    return None


GPU_SKIP_REASON = _gpu_skip_reason()
needs_gpu = pytest.mark.skipif(GPU_SKIP_REASON is not None, reason=GPU_SKIP_REASON or "")


def _driver_loads():
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


# ---- dtypes in NumPy: storage arrays and exact decoding ----

def bf16_from_f32(x):
    """Round-to-nearest-even float32 -> bfloat16 bits (uint16), NaN kept quiet, as dtype.h."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF
    return np.where(nan, (bits >> 16) | 0x40, rounded).astype(np.uint16)


def bf16_to_f32(bits):
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def encode(values, dtype):
    """float64 values -> the array a kernel reads (float32, float16, or bf16 bits as uint16)."""
    values = np.asarray(values, dtype=np.float64)
    if dtype == F32:
        return values.astype(np.float32)
    if dtype == F16:
        return values.astype(np.float16)
    return bf16_from_f32(values.astype(np.float32))


def decode(array, dtype):
    """A kernel's array -> exact float64 values."""
    if dtype == BF16:
        return bf16_to_f32(array).astype(np.float64)
    return np.asarray(array).astype(np.float64)


def round_to(values, dtype):
    """What storing float64 values in `dtype` does to them."""
    return decode(encode(values, dtype), dtype)


def assert_close(got, ref, dtype, ulps, scale, what):
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, what
    assert np.isfinite(got).all(), f"{what}: non-finite output"
    err = np.abs(got - ref)
    tol = ulps * UNIT_ROUNDOFF[dtype] * (np.abs(ref) + scale)
    bad = err > tol
    worst = int(np.argmax(err - tol))
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {err.size} values off; largest error "
                           f"{err.max():.3g} (got {got.flat[worst]!r}, want {ref.flat[worst]!r}, "
                           f"tolerance {tol.flat[worst]:.3g})")


def random_bits(rng, shape, elem_size):
    """Arbitrary bit patterns (NaNs, infinities, subnormals included): a copy must keep them."""
    kind = np.uint32 if elem_size == 4 else np.uint16
    return rng.integers(0, np.iinfo(kind).max, size=shape, dtype=kind, endpoint=True)


def poison(shape, elem_size):
    kind = np.uint32 if elem_size == 4 else np.uint16
    return np.full(shape, 0xABADCAFE & np.iinfo(kind).max, dtype=kind)


# ---- the KV layouts, written out again from csrc/kv/kv_layout.c ----

def layout_strides(kind, block_size, n_heads, head_dim, n_blocks):
    """Strides in elements of (kv, block, token, head); d has stride 1."""
    b, h, d = block_size, n_heads, head_dim
    if kind == RAW:  # [K/V, Block, Token, Head, d]
        return n_blocks * b * h * d, b * h * d, h * d, d
    if kind == PAGE:  # [Block, K/V, Token, Head, d]
        return b * h * d, 2 * b * h * d, h * d, d
    if kind == HEAD:  # [Block, Head, K/V, Token, d]
        return b * d, h * 2 * b * d, d, 2 * b * d
    raise ValueError(kind)


class Layout:
    def __init__(self, kind, block_size, n_heads, head_dim, elem_size, n_blocks):
        self.kind, self.block_size, self.n_heads = kind, block_size, n_heads
        self.head_dim, self.elem_size, self.n_blocks = head_dim, elem_size, n_blocks
        self.strides = layout_strides(kind, block_size, n_heads, head_dim, n_blocks)
        self.n_elems = n_blocks * 2 * block_size * n_heads * head_dim

    def tuple(self):
        return (self.kind, self.block_size, self.n_heads, self.head_dim, self.elem_size,
                self.n_blocks)

    def index(self, kv, block, token, head):
        """Element indices of the head_dim values at (kv, block, token, head); broadcasts."""
        s_kv, s_block, s_token, s_head = self.strides
        base = (np.asarray(kv) * s_kv + np.asarray(block) * s_block + np.asarray(token) * s_token
                + np.asarray(head) * s_head)
        return base[..., None] + np.arange(self.head_dim)


def token_indices(layout, table, start, n_tokens):
    """(2, n_tokens, n_heads, head_dim) storage indices of a sequence's tokens, and a mask of the
    tokens whose block id is valid."""
    pos = start + np.arange(n_tokens)
    blocks = np.asarray(table, dtype=np.int64)[pos // layout.block_size]
    valid = (blocks >= 0) & (blocks < layout.n_blocks)
    kv = np.arange(2)[:, None, None]
    idx = layout.index(kv, np.where(valid, blocks, 0)[None, :, None],
                       (pos % layout.block_size)[None, :, None],
                       np.arange(layout.n_heads)[None, None, :])
    return idx, valid


KV_SHAPES = [  # (block_size, n_heads, head_dim): odd sizes, 1s, and word-size edge cases
    (1, 1, 1),
    (3, 5, 7),
    (16, 2, 64),
    (5, 3, 128),
    (4, 1, 6),
]


def kv_case(rng, kind, dtype, shape, n_blocks=11):
    block_size, n_heads, head_dim = shape
    layout = Layout(kind, block_size, n_heads, head_dim, ELEM_SIZE[dtype], n_blocks)
    start = block_size + 1 if block_size > 1 else 2  # not block-aligned
    n_tokens = 2 * block_size + 3
    n_logical = -(-(start + n_tokens) // block_size)
    table = rng.permutation(n_blocks)[:n_logical].astype(np.int32)
    return layout, start, n_tokens, table


# ---- refusal where there is no GPU (these run on machines without one) ----

def test_import_and_device_count_never_raise():
    assert gyges.WITH_CUDA == bool(_C.WITH_CUDA)
    count = _C.cuda_device_count()
    assert isinstance(count, int) and count >= 0
    assert issubclass(UnavailableError, gyges.Error)


def test_cuda_arena_is_refused_cleanly_without_a_gpu():
    if GPU_SKIP_REASON is None:
        pytest.skip("a CUDA device is present: the GPU tests below cover the CUDA arena")
    try:
        arena = gyges.Arena(budget="8MiB", page_size="2MiB", backend="cuda", pool_pages=2)
    except UnavailableError as error:
        message = str(error)
        assert isinstance(error, gyges.Error)
        if not _C.WITH_CUDA:
            assert "not built with CUDA" in message
        elif not _driver_loads():
            assert "libcuda.so.1" in message, message
        else:
            assert "CUDA" in message, message
    else:
        # Only possible when the driver API works but the runtime sees no device (a driver older
        # than the runtime gyges was built with).
        assert _C.WITH_CUDA and _driver_loads()
        del arena
    # The refusal leaves the CPU backend working.
    cpu = gyges.Arena(budget="64KiB", page_size="4KiB", backend="cpu")
    cpu.grow(0, 2, "kv")
    assert cpu.stats()["bytes_in_use"] == 8192


def test_kernels_and_queries_refused_without_a_gpu():
    if GPU_SKIP_REASON is None:
        pytest.skip("a CUDA device is present")
    with pytest.raises(UnavailableError):
        _C.cuda_device_info(0)
    a = np.ones(5, np.float32)
    out = np.full(5, 7.0, np.float32)
    with pytest.raises(UnavailableError) as info:
        _C.cuda_residual_add(out, a, a, 5, F32)
    assert str(info.value)
    assert (out == 7.0).all()  # nothing was written


def test_refused_launches_release_their_buffers():
    """1000 failing calls (no device here, or a bad argument) keep no reference to the arrays."""
    if not _C.WITH_CUDA:
        pytest.skip("gyges was built without CUDA: the entry points raise before taking buffers")
    layout = Layout(PAGE, 4, 2, 8, 4, 3)
    storage = np.zeros(layout.n_elems, np.uint32)
    k = np.zeros((5, 2, 8), np.uint32)
    table = np.zeros(2, np.int32)
    before = [sys.getrefcount(x) for x in (storage, k, table)]
    for _ in range(1000):
        with pytest.raises(ValueError):  # storage one element short: refused before the device
            _C.cuda_kv_scatter(storage[:-1], layout.tuple(), k, k, table, 0, 5)
        if GPU_SKIP_REASON is not None:
            with pytest.raises(UnavailableError):
                _C.cuda_kv_scatter(storage, layout.tuple(), k, k, table, 0, 5)
    gc.collect()
    assert [sys.getrefcount(x) for x in (storage, k, table)] == before
    storage.resize(storage.size + 1, refcheck=False)  # raises if a buffer export were still held


def test_bad_layouts_and_tables_are_refused_before_the_device():
    if not _C.WITH_CUDA:
        pytest.skip("gyges was built without CUDA")
    layout = Layout(HEAD, 4, 2, 8, 2, 3)
    storage = np.zeros(layout.n_elems, np.uint16)
    k = np.zeros((5, 2, 8), np.uint16)
    with pytest.raises(InvalidArgumentError):
        _C.cuda_kv_scatter(storage, (7, 4, 2, 8, 2, 3), k, k, np.zeros(2, np.int32), 0, 5)
    with pytest.raises(ValueError, match="block_table"):  # 5 tokens from 2 need 2 blocks of 4
        _C.cuda_kv_scatter(storage, layout.tuple(), k, k, np.zeros(1, np.int32), 2, 5)
    with pytest.raises(ValueError):
        _C.cuda_kv_gather(k[:-1], k, storage, layout.tuple(), np.zeros(2, np.int32), 0, 5)


# ---- KV kernels (GPU) ----

@needs_gpu
@pytest.mark.parametrize("shape", KV_SHAPES, ids=lambda s: "b%d_h%d_d%d" % s)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
def test_kv_scatter_matches_reference(kind, dtype, shape):
    rng = np.random.default_rng(1000 + 100 * kind + 10 * dtype + KV_SHAPES.index(shape))
    layout, start, n_tokens, table = kv_case(rng, kind, dtype, shape)
    es = layout.elem_size
    k = random_bits(rng, (n_tokens, layout.n_heads, layout.head_dim), es)
    v = random_bits(rng, (n_tokens, layout.n_heads, layout.head_dim), es)
    storage = poison(layout.n_elems, es)
    want = storage.copy()
    idx, valid = token_indices(layout, table, start, n_tokens)
    assert valid.all()
    want[idx[0]] = k
    want[idx[1]] = v
    _C.cuda_kv_scatter(storage, layout.tuple(), k, v, table, start, n_tokens)
    diff = np.flatnonzero(storage != want)
    assert diff.size == 0, f"{diff.size} elements differ, first at {diff[:8]}"


@needs_gpu
@pytest.mark.parametrize("shape", KV_SHAPES, ids=lambda s: "b%d_h%d_d%d" % s)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
def test_kv_gather_matches_reference_and_inverts_scatter(kind, dtype, shape):
    rng = np.random.default_rng(2000 + 100 * kind + 10 * dtype + KV_SHAPES.index(shape))
    layout, start, n_tokens, table = kv_case(rng, kind, dtype, shape)
    es = layout.elem_size
    storage = random_bits(rng, layout.n_elems, es)
    shape3 = (n_tokens, layout.n_heads, layout.head_dim)
    k, v = poison(shape3, es), poison(shape3, es)
    _C.cuda_kv_gather(k, v, storage, layout.tuple(), table, start, n_tokens)
    idx, _ = token_indices(layout, table, start, n_tokens)
    np.testing.assert_array_equal(k, storage[idx[0]])
    np.testing.assert_array_equal(v, storage[idx[1]])
    # Round trip: scattering what was gathered into a copy changes nothing.
    again = storage.copy()
    _C.cuda_kv_scatter(again, layout.tuple(), k, v, table, start, n_tokens)
    np.testing.assert_array_equal(again, storage)


@needs_gpu
@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
def test_kv_invalid_block_ids_are_skipped(kind):
    """A stale table (-1, or an id past n_blocks) writes nothing and gathers zeros."""
    rng = np.random.default_rng(3000 + kind)
    layout = Layout(kind, 4, 3, 5, 2, 6)
    table = np.array([2, -1, 6, 0], np.int32)  # logical blocks 1 and 2 are invalid
    n_tokens = 16
    k = random_bits(rng, (n_tokens, 3, 5), 2)
    v = random_bits(rng, (n_tokens, 3, 5), 2)
    storage = poison(layout.n_elems, 2)
    want = storage.copy()
    idx, valid = token_indices(layout, table, 0, n_tokens)
    want[idx[0][valid]] = k[valid]
    want[idx[1][valid]] = v[valid]
    _C.cuda_kv_scatter(storage, layout.tuple(), k, v, table, 0, n_tokens)
    np.testing.assert_array_equal(storage, want)
    k_out, v_out = poison(k.shape, 2), poison(v.shape, 2)
    _C.cuda_kv_gather(k_out, v_out, storage, layout.tuple(), table, 0, n_tokens)
    np.testing.assert_array_equal(k_out[valid], k[valid])
    np.testing.assert_array_equal(v_out[~valid], 0)
    np.testing.assert_array_equal(k_out[~valid], 0)


COPY_CASES = [  # (src kind, src heads, dst kind, dst heads, src_head0, dst_head0, n_heads)
    (HEAD, 8, HEAD, 4, 4, 0, 4),   # TP 1 -> 2: the second half of the heads moves away
    (HEAD, 4, HEAD, 8, 0, 4, 4),   # TP 2 -> 1: received heads land in the second half
    (RAW, 5, HEAD, 3, 1, 0, 3),    # odd head counts, layout change on the way
    (PAGE, 3, RAW, 7, 0, 4, 3),
    (HEAD, 1, PAGE, 1, 0, 0, 1),
]


@needs_gpu
@pytest.mark.parametrize("case", COPY_CASES, ids=lambda c: "k%dh%d_to_k%dh%d" % c[:4])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("geometry", [(1, 1), (3, 7), (16, 128)], ids=["b1d1", "b3d7", "b16d128"])
def test_kv_copy_heads_matches_reference(case, dtype, geometry):
    src_kind, src_heads, dst_kind, dst_heads, s0, d0, n = case
    block_size, head_dim = geometry
    es = ELEM_SIZE[dtype]
    rng = np.random.default_rng(4000 + COPY_CASES.index(case) * 10 + dtype)
    src_layout = Layout(src_kind, block_size, src_heads, head_dim, es, 9)
    dst_layout = Layout(dst_kind, block_size, dst_heads, head_dim, es, 7)
    src_blocks = rng.permutation(9)[:5].astype(np.int32)
    dst_blocks = rng.permutation(7)[:5].astype(np.int32)
    src = random_bits(rng, src_layout.n_elems, es)
    dst = poison(dst_layout.n_elems, es)
    want = dst.copy()
    kv = np.arange(2)[None, :, None, None]
    tok = np.arange(block_size)[None, None, :, None]
    heads = np.arange(n)[None, None, None, :]
    s_idx = src_layout.index(kv, src_blocks[:, None, None, None], tok, s0 + heads)
    d_idx = dst_layout.index(kv, dst_blocks[:, None, None, None], tok, d0 + heads)
    want[d_idx] = src[s_idx]
    _C.cuda_kv_copy_heads(dst, dst_layout.tuple(), dst_blocks, d0, src, src_layout.tuple(),
                          src_blocks, s0, n)
    diff = np.flatnonzero(dst != want)
    assert diff.size == 0, f"{diff.size} elements differ, first at {diff[:8]}"


@needs_gpu
def test_kv_copy_heads_refuses_mismatched_layouts():
    a = Layout(HEAD, 4, 4, 8, 2, 3)
    b = Layout(HEAD, 4, 4, 16, 2, 3)  # head_dim differs
    blocks = np.arange(2, dtype=np.int32)
    sa, sb = np.zeros(a.n_elems, np.uint16), np.zeros(b.n_elems, np.uint16)
    with pytest.raises(InvalidArgumentError, match="head_dim"):
        _C.cuda_kv_copy_heads(sb, b.tuple(), blocks, 0, sa, a.tuple(), blocks, 0, 2)
    with pytest.raises(InvalidArgumentError, match="out of range"):  # heads [3, 5) of 4
        _C.cuda_kv_copy_heads(sa, a.tuple(), blocks, 0, sa.copy(), a.tuple(), blocks, 3, 2)


# ---- model kernels (GPU) ----

@needs_gpu
@pytest.mark.parametrize("w_dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("act_dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("rows,dim", [(1, 1), (3, 129), (5, 4096)])
def test_rmsnorm_matches_hf_llama(act_dtype, w_dtype, rows, dim):
    rng = np.random.default_rng(5000 + rows + dim)
    eps = 1e-5
    x = encode(rng.standard_normal((rows, dim)) * 3, act_dtype)
    w = encode(1 + 0.1 * rng.standard_normal(dim), w_dtype)
    xd, wd = decode(x, act_dtype), decode(w, w_dtype)
    r = 1 / np.sqrt(np.mean(xd * xd, axis=1, keepdims=True) + eps)
    want = wd * round_to(xd * r, act_dtype)  # HF: cast the normalised row, then weight
    out = poison(x.shape, ELEM_SIZE[act_dtype]).view(x.dtype)
    _C.cuda_rmsnorm(out, x, w, rows, dim, eps, act_dtype, w_dtype)
    # 16-bit: 4 ulps, for the rounding of the normalised row, which may go the other way near a
    # tie (rsqrtf is not exact), and that of the output. fp32: rsqrtf's 2 ulps and the order of
    # an fp32 sum of up to 4096 squares, 64 ulps. scale 1e-4 covers fp16's subnormal outputs.
    assert_close(decode(out, act_dtype), want, act_dtype, ulps=4 if act_dtype != F32 else 64,
                 scale=1e-4, what="rmsnorm")


def rope_reference(x, positions, head_dim, theta):
    """HF LlamaRotaryEmbedding + apply_rotary_pos_emb in float64, with the frequencies and
    angles computed in float32 as HF does."""
    half = head_dim // 2
    inv_freq = (1.0 / (np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32)
                                              / np.float32(head_dim)))).astype(np.float32)
    angle = (positions.astype(np.float32)[:, None] * inv_freq[None, :]).astype(np.float64)
    cos = np.concatenate([np.cos(angle)] * 2, axis=-1)[:, None, :]
    sin = np.concatenate([np.sin(angle)] * 2, axis=-1)[:, None, :]
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)  # rotate_half
    return x * cos + rotated * sin


@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("n_tokens,n_q,n_kv,head_dim",
                         [(1, 1, 1, 2), (7, 5, 3, 6), (33, 8, 2, 128)])
def test_rope_matches_hf_rotate_half(dtype, n_tokens, n_q, n_kv, head_dim):
    rng = np.random.default_rng(6000 + n_tokens + head_dim)
    theta = 10000.0
    positions = rng.integers(0, 200, n_tokens).astype(np.int32)
    q = encode(rng.standard_normal((n_tokens, n_q, head_dim)), dtype)
    k = encode(rng.standard_normal((n_tokens, n_kv, head_dim)), dtype)
    want_q = rope_reference(decode(q, dtype), positions, head_dim, theta)
    want_k = rope_reference(decode(k, dtype), positions, head_dim, theta)
    _C.cuda_rope(q, k, positions, n_tokens, n_q, n_kv, head_dim, theta, dtype)
    # fp32: the device's powf may differ from NumPy's by ~3 ulps of a frequency, which the
    # position (< 200) turns into up to 4e-5 rad, i.e. ~2e-4 on values of magnitude ~5: 4000
    # ulps of scale 1. 16-bit: one rounding of the output of sums that may cancel (scale 1).
    ulps = 4000 if dtype == F32 else 2
    assert_close(decode(q, dtype), want_q, dtype, ulps=ulps, scale=1.0, what="rope q")
    assert_close(decode(k, dtype), want_k, dtype, ulps=ulps, scale=1.0, what="rope k")
    # q alone (k = None) gives the same q.
    q2 = encode(rng.standard_normal((n_tokens, n_q, head_dim)), dtype)
    want_q2 = rope_reference(decode(q2, dtype), positions, head_dim, theta)
    _C.cuda_rope(q2, None, positions, n_tokens, n_q, n_kv, head_dim, theta, dtype)
    assert_close(decode(q2, dtype), want_q2, dtype, ulps=ulps, scale=1.0, what="rope q only")


@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("rows,dim", [(1, 1), (3, 257), (4, 11008)])
def test_silu_mul_matches_reference(dtype, rows, dim):
    rng = np.random.default_rng(7000 + rows + dim)
    x = encode(rng.standard_normal((rows, 2 * dim)) * 4, dtype)
    xd = decode(x, dtype)
    gate, up = xd[:, :dim], xd[:, dim:]
    want = gate / (1 + np.exp(-gate)) * up
    out = poison((rows, dim), ELEM_SIZE[dtype]).view(x.dtype)
    _C.cuda_silu_mul(out, x, rows, dim, dtype)
    # fp32: expf and the division are within a few ulps; 16-bit: one rounding. scale 1e-4 covers
    # fp16's subnormal outputs, where a rounding is not relative.
    assert_close(decode(out, dtype), want, dtype, ulps=8 if dtype == F32 else 2, scale=1e-4,
                 what="silu_mul")


@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("n", [1, 1000, 1 << 20 | 3])
def test_residual_add_matches_reference(dtype, n):
    rng = np.random.default_rng(8000 + n)
    a = encode(rng.standard_normal(n), dtype)
    b = encode(rng.standard_normal(n), dtype)
    want = decode(a, dtype) + decode(b, dtype)
    out = poison(n, ELEM_SIZE[dtype]).view(a.dtype)
    _C.cuda_residual_add(out, a, b, n, dtype)
    # One rounding of a sum that may cancel: an ulp of the inputs' scale.
    assert_close(decode(out, dtype), want, dtype, ulps=1, scale=1.0, what="residual_add")


@needs_gpu
@pytest.mark.parametrize("table_dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("out_dtype", DTYPES.values(), ids=DTYPES.keys())
def test_embedding_is_exact(out_dtype, table_dtype):
    rng = np.random.default_rng(9000 + 10 * out_dtype + table_dtype)
    vocab, dim = 37, 129
    table = encode(rng.standard_normal((vocab, dim)), table_dtype)
    ids = np.array([0, 36, 5, -1, 37, 5, 12], np.int32)  # -1 and 37 are out of range
    out = poison((ids.size, dim), ELEM_SIZE[out_dtype]).view(encode(0.0, out_dtype).dtype)
    _C.cuda_embedding(out, table, ids, ids.size, vocab, dim, out_dtype, table_dtype)
    rows = decode(table, table_dtype)[np.clip(ids, 0, vocab - 1)]
    rows[(ids < 0) | (ids >= vocab)] = 0.0
    # Widening is exact and narrowing rounds to nearest even on both sides: bit-exact. (f16 ->
    # bf16 goes through fp32 on both sides too.)
    want = encode(rows.astype(np.float32), out_dtype)
    np.testing.assert_array_equal(out.view(np.uint8), want.view(np.uint8))


@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("vocab", [1, 7, 1000, 32003])
def test_argmax_first_of_ties_and_nan(dtype, vocab):
    rng = np.random.default_rng(10000 + vocab + dtype)
    rows = 6
    values = rng.standard_normal((rows, vocab))
    if vocab > 3:
        values[1, [2, vocab - 1]] = 50.0  # a tie: the first wins
        values[2, [vocab // 2, 1]] = np.nan  # NaN beats everything; the first NaN wins
    values[3, :] = -np.inf
    logits = encode(values, dtype)
    out = np.full(rows, -7, np.int32)
    _C.cuda_argmax(out, logits, rows, vocab, dtype)
    # np.argmax: first occurrence of the maximum, and NaN counts as the maximum (like torch).
    np.testing.assert_array_equal(out, np.argmax(decode(logits, dtype), axis=1))


# ---- CUDA against the CPU backend (GPU), fp32 where the CPU kernels work ----

@needs_gpu
@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
def test_kv_scatter_matches_cpu_kv_write(kind):
    rng = np.random.default_rng(14000 + kind)
    layout, start, n_tokens, table = kv_case(rng, kind, F32, (5, 3, 7))
    k = rng.standard_normal((n_tokens, 3, 7)).astype(np.float32)
    v = rng.standard_normal((n_tokens, 3, 7)).astype(np.float32)
    gpu = poison(layout.n_elems, 4).view(np.float32)
    cpu = gpu.copy()
    _C.cuda_kv_scatter(gpu, layout.tuple(), k, v, table, start, n_tokens)
    cpu_layout = (kind, layout.block_size, layout.n_heads, layout.head_dim, layout.n_blocks)
    _C.kernel_kv_write(cpu, cpu_layout, k, v, np.zeros(n_tokens, np.int32),
                       (start + np.arange(n_tokens)).astype(np.int32),
                       np.array([0, table.size], np.int32), table, n_tokens, 1)
    np.testing.assert_array_equal(gpu.view(np.uint32), cpu.view(np.uint32))


@needs_gpu
def test_model_kernels_match_the_cpu_backend():
    rng = np.random.default_rng(15)
    rows, dim, vocab = 5, 257, 1001
    x = rng.standard_normal((rows, dim)).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(dim)).astype(np.float32)
    gpu, cpu = np.empty_like(x), np.empty_like(x)
    _C.cuda_rmsnorm(gpu, x, w, rows, dim, 1e-5, F32, F32)
    _C.kernel_rmsnorm(cpu, x, w, rows, dim, 1e-5)
    # Two fp32 implementations: summation order and rsqrtf against 1/sqrtf, 64 ulps.
    assert_close(gpu, cpu, F32, ulps=64, scale=0.0, what="rmsnorm vs cpu")

    gate_up = rng.standard_normal((rows, 2 * dim)).astype(np.float32)
    gpu = np.empty((rows, dim), np.float32)
    cpu = np.empty((rows, dim), np.float32)
    _C.cuda_silu_mul(gpu, gate_up, rows, dim, F32)
    _C.kernel_swiglu(cpu, np.ascontiguousarray(gate_up[:, :dim]),
                     np.ascontiguousarray(gate_up[:, dim:]), rows * dim)
    # expf against the CPU's own exponential: a few ulps each, 16.
    assert_close(gpu, cpu, F32, ulps=16, scale=0.0, what="silu_mul vs cpu swiglu")

    a, b = x, rng.standard_normal((rows, dim)).astype(np.float32)
    gpu, cpu = np.empty_like(a), np.empty_like(a)
    _C.cuda_residual_add(gpu, a, b, a.size, F32)
    _C.kernel_add(cpu, a, b, a.size)
    np.testing.assert_array_equal(gpu, cpu)  # one IEEE addition on both sides

    for dtype in DTYPES.values():
        table = encode(rng.standard_normal((vocab, dim)), dtype)
        ids = rng.integers(0, vocab, 9).astype(np.int32)
        gpu = np.empty((ids.size, dim), np.float32)
        cpu = np.empty((ids.size, dim), np.float32)
        _C.cuda_embedding(gpu, table, ids, ids.size, vocab, dim, F32, dtype)
        _C.kernel_embedding(cpu, table, dtype, ids, ids.size, vocab, dim)
        np.testing.assert_array_equal(gpu, cpu)  # widening is exact

    logits = rng.standard_normal((rows, vocab)).astype(np.float32)
    logits[1, [3, 700]] = 9.0  # a tie
    gpu = np.full(rows, -1, np.int32)
    cpu = np.full(rows, -1, np.int32)
    _C.cuda_argmax(gpu, logits, rows, vocab, F32)
    _C.kernel_argmax(cpu, logits, rows, vocab)
    np.testing.assert_array_equal(gpu, cpu)


# ---- the CUDA arena (GPU) ----

def _cuda_arena(pages=8, n_slots=16, pool_pages=4, page_size=2 * MiB):
    return gyges.Arena(budget=pages * page_size, page_size=page_size, n_slots=n_slots,
                       backend="cuda", pool_pages=pool_pages)


def _write(arena, offset, data):
    _C.cuda_memcpy_htod(arena.base_address + offset, np.ascontiguousarray(data))


def _read(arena, offset, nbytes):
    out = np.empty(nbytes, np.uint8)
    _C.cuda_memcpy_dtoh(out, arena.base_address + offset)
    return out


@needs_gpu
def test_cuda_arena_lifecycle_and_accounting():
    arena = _cuda_arena()
    ps = arena.page_size
    assert arena.base_address != 0
    pages = [arena.create_page("kv") for _ in range(6)]
    assert pages == list(range(6))
    for slot, page in enumerate(pages):
        arena.map(slot, page)
    rng = np.random.default_rng(11)
    data = rng.integers(0, 256, 6 * ps, dtype=np.uint8)
    _write(arena, 0, data)
    arena.remap(2, 9)  # no bytes move, the page does
    np.testing.assert_array_equal(_read(arena, 9 * ps, ps), data[2 * ps:3 * ps])
    arena.unmap(9)
    arena.map(12, pages[2])
    np.testing.assert_array_equal(_read(arena, 12 * ps, ps), data[2 * ps:3 * ps])
    arena.unmap(12)
    arena.release_page(pages[2])
    s = arena.stats()
    assert s["bytes_in_use"] == 5 * ps and s["bytes_by_tag"]["kv"] == 5 * ps
    assert s["pages_mapped"] == 5 and s["remaps_total"] == 1
    assert s["peak_bytes"] == 6 * ps
    arena.grow(13, 3, "weights")  # 8 pages: the whole budget, pool included
    with pytest.raises(OutOfMemoryError):
        arena.create_page("kv")
    with pytest.raises(ValueError):  # device memory has no NumPy view
        arena.view(0)
    arena.shrink(13, 3)
    assert arena.stats()["bytes_in_use"] == 5 * ps


@needs_gpu
def test_cuda_arena_copy_is_a_memmove():
    arena = _cuda_arena(pages=4, n_slots=4)
    ps = arena.page_size
    arena.grow(0, 4, "kv")
    rng = np.random.default_rng(12)
    host = rng.integers(0, 256, 4 * ps, dtype=np.uint8)
    _write(arena, 0, host)
    total = 4 * ps
    for dst, src, n in [(1, 0, total - 1), (0, 1, total - 1), (4096, 0, 3 * ps),
                        (0, ps + 4096, 2 * ps), (ps, 0, 3 * ps), (0, 2 * ps, 2 * ps),
                        (12345, 54321, 100000), (54321, 12345, 3 * ps)]:
        arena.copy(dst, src, n)
        host[dst:dst + n] = host[src:src + n].copy()
        np.testing.assert_array_equal(_read(arena, 0, total), host, err_msg=f"{dst} {src} {n}")
    assert arena.stats()["bytes_copied_total"] > 0


@needs_gpu
def test_cuda_arena_page_size_must_fit_the_granularity():
    with pytest.raises(InvalidArgumentError, match="granularity"):
        _cuda_arena(page_size=64 * 1024)


@needs_gpu
def test_cuda_arena_random_operations_match_a_model():
    """Random create/map/unmap/remap/release against a pure-Python model of the page table, with
    each page's bytes checked wherever it is mapped."""
    rng = np.random.default_rng(13)
    arena = _cuda_arena(pages=6, n_slots=10, pool_pages=3)
    ps = arena.page_size
    slot_of, created, stamp = {}, set(), {}
    for step in range(300):
        op = rng.integers(5)
        free_slots = [s for s in range(10) if s not in slot_of.values()]
        unmapped = [p for p in created if p not in slot_of]
        if op == 0 and len(created) < 6:
            page = arena.create_page("kv")
            assert page == min(set(range(6)) - created)
            created.add(page)
        elif op == 1 and unmapped and free_slots:
            page = unmapped[rng.integers(len(unmapped))]
            slot = free_slots[rng.integers(len(free_slots))]
            arena.map(slot, page)
            slot_of[page] = slot
            if page not in stamp:
                stamp[page] = rng.integers(0, 256, 4096, dtype=np.uint8)
                _write(arena, slot * ps, stamp[page])
        elif op == 2 and slot_of:
            page = list(slot_of)[rng.integers(len(slot_of))]
            arena.unmap(slot_of.pop(page))
        elif op == 3 and slot_of and free_slots:
            page = list(slot_of)[rng.integers(len(slot_of))]
            to = free_slots[rng.integers(len(free_slots))]
            arena.remap(slot_of[page], to)
            slot_of[page] = to
        elif op == 4 and unmapped:
            page = unmapped[rng.integers(len(unmapped))]
            arena.release_page(page)
            created.discard(page)
            stamp.pop(page, None)  # a recycled handle keeps old bytes: forget them
        table = arena.page_table()
        for page, slot in slot_of.items():
            assert table["page"][slot] == page
            if page in stamp:
                np.testing.assert_array_equal(_read(arena, slot * ps, 4096), stamp[page])
        assert (table["page"] >= 0).sum() == len(slot_of)
        assert arena.stats()["bytes_in_use"] == len(created) * ps


@needs_gpu
def test_cuda_arena_gives_memory_back():
    """Pages, the pool and the reservation are returned when the arena goes away."""
    before = _C.cuda_device_info(0)["free_bytes"]
    for _ in range(3):
        arena = _cuda_arena(pages=64, n_slots=64, pool_pages=16)
        for _ in range(20):
            arena.grow(0, 64, "kv")
            arena.shrink(0, 64)
        del arena
        gc.collect()
    after = _C.cuda_device_info(0)["free_bytes"]
    # Other processes may allocate meanwhile; one arena is 128 MiB, so a leak of even one would
    # show well beyond this slack.
    assert after >= before - 64 * MiB, (before, after)
