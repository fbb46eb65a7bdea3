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
import os
import sys

import numpy as np
import pytest

import gyges
from gyges import _C, _C_test
from gyges._C import InvalidArgumentError, OutOfMemoryError, UnavailableError

F32, F16, BF16 = 0, 1, 2  # gy_dtype
DTYPES = {"f32": F32, "f16": F16, "bf16": BF16}
ELEM_SIZE = {F32: 4, F16: 2, BF16: 2}
UNIT_ROUNDOFF = {F32: 2.0**-24, F16: 2.0**-11, BF16: 2.0**-8}
RAW, PAGE, HEAD = 0, 1, 2  # gy_kv_layout_kind
KINDS = {"raw": RAW, "page": PAGE, "head": HEAD}
MiB = 1 << 20


from gpu import GPU_SKIP_REASON, needs_gpu  # noqa: E402  (tests/gpu.py)


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

@pytest.mark.skipif(os.environ.get("GYGES_CUDA_EMULATED") != "1", reason="only under `make cudaemu`")
def test_the_emulated_kernels_are_the_ones_under_test():
    assert GPU_SKIP_REASON is None, GPU_SKIP_REASON
    assert os.path.join("kernels", "gyges") in gyges.__file__  # tests/gpu_emu/build.py's OUT/kernels


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
        _C_test.cuda_device_info(0)
    a = np.ones(5, np.float32)
    out = np.full(5, 7.0, np.float32)
    with pytest.raises(UnavailableError) as info:
        _C_test.cuda_residual_add(out, a, a, 5, F32)
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
            _C_test.cuda_kv_scatter(storage[:-1], layout.tuple(), k, k, table, 0, 5)
        if GPU_SKIP_REASON is not None:
            with pytest.raises(UnavailableError):
                _C_test.cuda_kv_scatter(storage, layout.tuple(), k, k, table, 0, 5)
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
        _C_test.cuda_kv_scatter(storage, (7, 4, 2, 8, 2, 3), k, k, np.zeros(2, np.int32), 0, 5)
    with pytest.raises(ValueError, match="block_table"):  # 5 tokens from 2 need 2 blocks of 4
        _C_test.cuda_kv_scatter(storage, layout.tuple(), k, k, np.zeros(1, np.int32), 2, 5)
    with pytest.raises(ValueError):
        _C_test.cuda_kv_gather(k[:-1], k, storage, layout.tuple(), np.zeros(2, np.int32), 0, 5)


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
    _C_test.cuda_kv_scatter(storage, layout.tuple(), k, v, table, start, n_tokens)
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
    _C_test.cuda_kv_gather(k, v, storage, layout.tuple(), table, start, n_tokens)
    idx, _ = token_indices(layout, table, start, n_tokens)
    np.testing.assert_array_equal(k, storage[idx[0]])
    np.testing.assert_array_equal(v, storage[idx[1]])
    # Round trip: scattering what was gathered into a copy changes nothing.
    again = storage.copy()
    _C_test.cuda_kv_scatter(again, layout.tuple(), k, v, table, start, n_tokens)
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
    _C_test.cuda_kv_scatter(storage, layout.tuple(), k, v, table, 0, n_tokens)
    np.testing.assert_array_equal(storage, want)
    k_out, v_out = poison(k.shape, 2), poison(v.shape, 2)
    _C_test.cuda_kv_gather(k_out, v_out, storage, layout.tuple(), table, 0, n_tokens)
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
    _C_test.cuda_kv_copy_heads(dst, dst_layout.tuple(), dst_blocks, d0, src, src_layout.tuple(),
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
        _C_test.cuda_kv_copy_heads(sb, b.tuple(), blocks, 0, sa, a.tuple(), blocks, 0, 2)
    with pytest.raises(InvalidArgumentError, match="out of range"):  # heads [3, 5) of 4
        _C_test.cuda_kv_copy_heads(sa, a.tuple(), blocks, 0, sa.copy(), a.tuple(), blocks, 3, 2)


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
    _C_test.cuda_rmsnorm(out, x, w, rows, dim, eps, act_dtype, w_dtype)
    # 16-bit: 4 ulps, for the rounding of the normalised row, which may go the other way near a
    # tie (rsqrtf is not exact), and that of the output. fp32: rsqrtf's 2 ulps and the order of
    # an fp32 sum of up to 4096 squares, 64 ulps. scale 1e-4 covers fp16's subnormal outputs.
    assert_close(decode(out, act_dtype), want, act_dtype, ulps=4 if act_dtype != F32 else 64,
                 scale=1e-4, what="rmsnorm")


def rope_reference(x, positions, inv_freq, mscale=1.0):
    """HF LlamaRotaryEmbedding + apply_rotary_pos_emb in float64, with the angles computed in
    float32 from the float32 frequencies, as HF does; cos and sin times the attention scaling."""
    half = x.shape[-1] // 2
    angle = (positions.astype(np.float32)[:, None] * inv_freq[None, :]).astype(np.float64)
    cos = mscale * np.concatenate([np.cos(angle)] * 2, axis=-1)[:, None, :]
    sin = mscale * np.concatenate([np.sin(angle)] * 2, axis=-1)[:, None, :]
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)  # rotate_half
    return x * cos + rotated * sin


def hf_inv_freq(head_dim, theta):
    """HF's float32 frequencies 1 / theta^(2i/d)."""
    return (1.0 / (np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32)
                                         / np.float32(head_dim)))).astype(np.float32)


@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("n_tokens,n_q,n_kv,head_dim",
                         [(1, 1, 1, 2), (7, 5, 3, 6), (33, 8, 2, 128)])
@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "scaled"])
def test_rope_matches_hf_rotate_half(dtype, n_tokens, n_q, n_kv, head_dim, scaled):
    rng = np.random.default_rng(6000 + n_tokens + head_dim)
    # The kernel rotates by the frequencies it is given (gyges/models/rope.py's, any scaling)
    # and multiplies cos and sin by mscale (YaRN's attention factor).
    inv_freq = hf_inv_freq(head_dim, 10000.0)
    mscale = 1.25 if scaled else 1.0
    if scaled:
        inv_freq = (inv_freq / np.linspace(1.0, 8.0, head_dim // 2)).astype(np.float32)
    positions = rng.integers(0, 200, n_tokens).astype(np.int32)
    q = encode(rng.standard_normal((n_tokens, n_q, head_dim)), dtype)
    k = encode(rng.standard_normal((n_tokens, n_kv, head_dim)), dtype)
    want_q = rope_reference(decode(q, dtype), positions, inv_freq, mscale)
    want_k = rope_reference(decode(k, dtype), positions, inv_freq, mscale)
    _C_test.cuda_rope(q, k, positions, n_tokens, n_q, n_kv, head_dim, inv_freq, mscale, dtype)
    # fp32: the device's fp32 angle and sincosf may differ from NumPy's float64 cos of it by a few
    # ulps, up to ~2e-4 on values of magnitude ~5: 4000 ulps of scale 1. 16-bit: one rounding of
    # the output of sums that may cancel (scale 1).
    ulps = 4000 if dtype == F32 else 2
    assert_close(decode(q, dtype), want_q, dtype, ulps=ulps, scale=1.0, what="rope q")
    assert_close(decode(k, dtype), want_k, dtype, ulps=ulps, scale=1.0, what="rope k")
    # q alone (k = None) gives the same q.
    q2 = encode(rng.standard_normal((n_tokens, n_q, head_dim)), dtype)
    want_q2 = rope_reference(decode(q2, dtype), positions, inv_freq, mscale)
    _C_test.cuda_rope(q2, None, positions, n_tokens, n_q, n_kv, head_dim, inv_freq, mscale, dtype)
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
    _C_test.cuda_silu_mul(out, x, rows, dim, dtype)
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
    _C_test.cuda_residual_add(out, a, b, n, dtype)
    # One rounding of a sum that may cancel: an ulp of the inputs' scale.
    assert_close(decode(out, dtype), want, dtype, ulps=1, scale=1.0, what="residual_add")


@needs_gpu
@pytest.mark.parametrize("shared,accumulate", [(False, False), (True, True), (True, False)])
@pytest.mark.parametrize("n,k,dim", [(1, 1, 1), (5, 2, 33), (17, 3, 257)])
def test_moe_combine_matches_reference(n, k, dim, shared, accumulate):
    """Each token's k expert rows weighted in rank order, a gated shared row after them, onto
    out or into it; against float64 with the slots permuted as the grouping leaves them."""
    rng = np.random.default_rng(8100 + n * k + dim)
    ys = rng.standard_normal((n * k + 2, dim)).astype(np.float32)
    slot = rng.permutation(n * k + 2)[:n * k].astype(np.int32)
    weight = rng.random((n, k)).astype(np.float32)
    sh = rng.standard_normal((n, dim)).astype(np.float32) if shared else None
    gate = rng.standard_normal(n).astype(np.float32) if shared else None
    out = rng.standard_normal((n, dim)).astype(np.float32)
    want = (out.astype(np.float64) if accumulate else 0.0) + np.einsum(
        "tr,trd->td", weight.astype(np.float64), ys[slot.reshape(n, k)].astype(np.float64))
    if shared:
        want = want + (1 / (1 + np.exp(-gate.astype(np.float64))))[:, None] * sh
    _C_test.cuda_moe_combine(out, ys, weight, slot, sh, gate, n, k, dim, accumulate)
    # k + 2 fp32 products and sums: a few units of rounding of the terms' scale
    assert_close(out, want, F32, ulps=4 * (k + 2), scale=1.0, what="moe_combine")
    with pytest.raises(ValueError, match="slot must hold"):
        _C_test.cuda_moe_combine(out, ys, weight, slot[:-1], None, None, n, k, dim, False)


@needs_gpu
@pytest.mark.parametrize("table_dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("out_dtype", DTYPES.values(), ids=DTYPES.keys())
def test_embedding_is_exact(out_dtype, table_dtype):
    rng = np.random.default_rng(9000 + 10 * out_dtype + table_dtype)
    vocab, dim = 37, 129
    table = encode(rng.standard_normal((vocab, dim)), table_dtype)
    ids = np.array([0, 36, 5, -1, 37, 5, 12], np.int32)  # -1 and 37 are out of range
    out = poison((ids.size, dim), ELEM_SIZE[out_dtype]).view(encode(0.0, out_dtype).dtype)
    _C_test.cuda_embedding(out, table, ids, ids.size, vocab, dim, out_dtype, table_dtype)
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
    _C_test.cuda_argmax(out, logits, rows, vocab, dtype)
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
    _C_test.cuda_kv_scatter(gpu, layout.tuple(), k, v, table, start, n_tokens)
    cpu_layout = (kind, layout.block_size, layout.n_heads, layout.head_dim, layout.n_blocks)
    _C_test.kernel_kv_write(cpu, cpu_layout, k, v, np.zeros(n_tokens, np.int32),
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
    _C_test.cuda_rmsnorm(gpu, x, w, rows, dim, 1e-5, F32, F32)
    _C_test.kernel_rmsnorm(cpu, x, w, rows, dim, 1e-5)
    # Two fp32 implementations: summation order and rsqrtf against 1/sqrtf, 64 ulps.
    assert_close(gpu, cpu, F32, ulps=64, scale=0.0, what="rmsnorm vs cpu")

    gate_up = rng.standard_normal((rows, 2 * dim)).astype(np.float32)
    gpu = np.empty((rows, dim), np.float32)
    cpu = np.empty((rows, dim), np.float32)
    _C_test.cuda_silu_mul(gpu, gate_up, rows, dim, F32)
    _C_test.kernel_swiglu(cpu, np.ascontiguousarray(gate_up[:, :dim]),
                          np.ascontiguousarray(gate_up[:, dim:]), rows * dim)
    # expf against the CPU's own exponential: a few ulps each, 16.
    assert_close(gpu, cpu, F32, ulps=16, scale=0.0, what="silu_mul vs cpu swiglu")

    a, b = x, rng.standard_normal((rows, dim)).astype(np.float32)
    gpu, cpu = np.empty_like(a), np.empty_like(a)
    _C_test.cuda_residual_add(gpu, a, b, a.size, F32)
    _C_test.kernel_add(cpu, a, b, a.size)
    np.testing.assert_array_equal(gpu, cpu)  # one IEEE addition on both sides

    for dtype in DTYPES.values():
        table = encode(rng.standard_normal((vocab, dim)), dtype)
        ids = rng.integers(0, vocab, 9).astype(np.int32)
        gpu = np.empty((ids.size, dim), np.float32)
        cpu = np.empty((ids.size, dim), np.float32)
        _C_test.cuda_embedding(gpu, table, ids, ids.size, vocab, dim, F32, dtype)
        _C_test.kernel_embedding(cpu, table, dtype, ids, ids.size, vocab, dim)
        np.testing.assert_array_equal(gpu, cpu)  # widening is exact

    logits = rng.standard_normal((rows, vocab)).astype(np.float32)
    logits[1, [3, 700]] = 9.0  # a tie
    gpu = np.full(rows, -1, np.int32)
    cpu = np.full(rows, -1, np.int32)
    _C_test.cuda_argmax(gpu, logits, rows, vocab, F32)
    _C_test.kernel_argmax(cpu, logits, rows, vocab)
    np.testing.assert_array_equal(gpu, cpu)


# ---- paged batches: sequences in one layer, and the tokens of a batch (cpu/paged.h's CSR) ----

class PagedBatch:
    """Sequences of the given lengths owning blocks of one layer in a shuffled order, and a batch
    of (sequence, position) tokens: the CSR arguments of kv_write and the attention kernels."""

    def __init__(self, rng, layout, seq_lens, tokens):
        bs = layout.block_size
        owned = [-(-n // bs) for n in seq_lens]
        assert sum(owned) <= layout.n_blocks
        self.indptr = np.concatenate([[0], np.cumsum(owned)]).astype(np.int32)
        self.indices = rng.permutation(layout.n_blocks)[:sum(owned)].astype(np.int32)
        self.token_seq = np.array([s for s, _ in tokens], np.int32)
        self.token_pos = np.array([p for _, p in tokens], np.int32)
        self.n_seqs, self.n_tokens = len(seq_lens), len(tokens)
        self.max_len = int(self.token_pos.max()) + 1 if tokens else 0

    def blocks(self, s):
        return self.indices[self.indptr[s]:self.indptr[s + 1]]

    def args(self):
        return (self.token_seq, self.token_pos, self.n_tokens, self.indptr, self.indices,
                self.n_seqs)

    def slots(self, layout, s, positions):
        """(2, len(positions), n_heads, head_dim) storage indices of positions of sequence s."""
        positions = np.asarray(positions)
        blocks = self.blocks(s)[positions // layout.block_size]
        return layout.index(np.arange(2)[:, None, None], blocks[None, :, None],
                            (positions % layout.block_size)[None, :, None],
                            np.arange(layout.n_heads)[None, None, :])


def nan_storage(layout, dtype):
    """A layer whose every value is NaN: a read of a slot nobody wrote poisons the output."""
    return encode(np.full(layout.n_elems, np.nan), dtype)


def fill_cache(rng, layout, batch, seq_lens, kv_dtype):
    """Random K and V for every position of every sequence, written by NumPy; returns the storage
    and the exact (decoded) K and V of each sequence, (len, n_heads, head_dim) float64."""
    storage = nan_storage(layout, kv_dtype)
    ks, vs = [], []
    for s, n in enumerate(seq_lens):
        shape = (n, layout.n_heads, layout.head_dim)
        k, v = encode(rng.standard_normal(shape), kv_dtype), encode(rng.standard_normal(shape), kv_dtype)
        idx = batch.slots(layout, s, np.arange(n))
        storage[idx[0]], storage[idx[1]] = k, v
        ks.append(decode(k, kv_dtype))
        vs.append(decode(v, kv_dtype))
    return storage, ks, vs


def attention_reference(q, ks, vs, batch, n_q_heads, scale, keep=None):
    """float64 causal attention: token t over positions 0..token_pos[t] of its sequence (those
    with keep[s][position] when given); GQA by repeating each KV head for its query heads."""
    out = np.zeros_like(q)
    for t in range(batch.n_tokens):
        s, p = int(batch.token_seq[t]), int(batch.token_pos[t])
        k, v = ks[s][:p + 1], vs[s][:p + 1]
        if keep is not None:
            k, v = k[keep[s][:p + 1]], v[keep[s][:p + 1]]
        group = n_q_heads // k.shape[1]
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # (len, n_q_heads, d)
        scores = np.einsum("lhd,hd->hl", k, q[t]) * scale
        w = np.exp(scores - scores.max(axis=1, keepdims=True))
        out[t] = np.einsum("hl,lhd->hd", w, v) / w.sum(axis=1)[:, None]
    return out


ATTENTION = {"decode": "cuda_paged_attention_decode", "prefill": "cuda_paged_attention_prefill"}


def run_attention(kernel, q, act_dtype, storage, layout, kv_dtype, batch, n_q_heads, scale,
                  max_len=0, check=True):
    out = poison(q.shape, ELEM_SIZE[act_dtype]).view(q.dtype)
    getattr(_C_test, ATTENTION[kernel])(out, q, act_dtype, storage, layout.tuple(), kv_dtype,
                                        *batch.args(), n_q_heads, max_len, scale, check)
    return out


# Tolerance: the reference is fed the same dtype-rounded q, K and V, so what remains is fp32
# arithmetic (dot products of head_dim terms, the online softmax's rescaling, sums of up to a few
# thousand weighted rows: measured within ~20 ulps of the V scale) and, for 16-bit outputs, one
# rounding, which fp32 noise may push to the other neighbour near a tie: 2 ulps. fp32: 200 ulps
# (~1e-5 relative to the V scale). The scale is max |V| because the output is a convex
# combination of V rows and errors do not shrink with cancelling outputs.
def attention_ulps(act_dtype):
    return 200 if act_dtype == F32 else 2


# A batch mixing every case: a prefill chunk cut in two by other tokens, a long decode (the KV
# split into partitions), a chunk in the middle of a sequence, a first token, and a 64-token
# prefill (two tiles of 32).
MIXED_LENS = [13, 150, 37, 1, 64]
MIXED_TOKENS = ([(0, p) for p in range(6)] + [(1, 149)] + [(0, p) for p in range(6, 13)]
                + [(2, p) for p in range(30, 37)] + [(3, 0), (4, 63)] + [(4, p) for p in range(64)])
# kv_write names no slot twice (the engine never does; two writes of one slot race on a GPU)
WRITE_TOKENS = [t for i, t in enumerate(MIXED_TOKENS) if t not in MIXED_TOKENS[:i]]


@needs_gpu
@pytest.mark.parametrize("act_dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("kv_dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
@pytest.mark.parametrize("kernel", ATTENTION)
def test_paged_attention_matches_reference(kernel, kind, kv_dtype, act_dtype):
    """Odd block size, 2 KV heads with 3 query heads each, head_dim 40 (a partial 16-byte chunk
    per lane group), every layout and dtype pair, on the mixed batch."""
    rng = np.random.default_rng(20000 + 100 * kind + 10 * kv_dtype + act_dtype)
    n_kv, group, head_dim = 2, 3, 40
    layout = Layout(kind, 5, n_kv, head_dim, ELEM_SIZE[kv_dtype], 60)
    batch = PagedBatch(rng, layout, MIXED_LENS, MIXED_TOKENS)
    storage, ks, vs = fill_cache(rng, layout, batch, MIXED_LENS, kv_dtype)
    n_q = n_kv * group
    q = encode(rng.standard_normal((batch.n_tokens, n_q, head_dim)), act_dtype)
    scale = float(np.float32(1 / np.sqrt(head_dim)))
    out = run_attention(kernel, q, act_dtype, storage, layout, kv_dtype, batch, n_q, scale)
    want = attention_reference(decode(q, act_dtype), ks, vs, batch, n_q, scale)
    assert_close(decode(out, act_dtype), want, act_dtype, ulps=attention_ulps(act_dtype),
                 scale=max(np.abs(v).max() for v in vs), what=f"{kernel} attention")


# (head_dim, n_kv_heads, query heads per KV head): every head-size bucket of the kernels (64,
# 128, 256) at and between sizes, and every group template (1, 2, 4, 8, and 12 = two chunks).
HEAD_CASES = [(8, 3, 1), (64, 2, 2), (128, 1, 5), (136, 2, 8), (256, 1, 12), (256, 2, 4)]


@needs_gpu
@pytest.mark.parametrize("kv_dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", HEAD_CASES, ids=lambda c: "d%d_kv%d_g%d" % c)
@pytest.mark.parametrize("kernel", ATTENTION)
def test_paged_attention_head_dims_and_groups(kernel, case, kv_dtype):
    head_dim, n_kv, group = case
    rng = np.random.default_rng(21000 + head_dim + 10 * group + kv_dtype)
    lens = [3, 20, 41]
    tokens = [(0, 2), (1, 19)] + [(2, p) for p in range(20, 41)]
    layout = Layout(HEAD, 16, n_kv, head_dim, ELEM_SIZE[kv_dtype], 7)
    batch = PagedBatch(rng, layout, lens, tokens)
    storage, ks, vs = fill_cache(rng, layout, batch, lens, kv_dtype)
    n_q = n_kv * group
    q = encode(rng.standard_normal((batch.n_tokens, n_q, head_dim)), F32)
    scale = float(np.float32(1 / np.sqrt(head_dim)))
    out = run_attention(kernel, q, F32, storage, layout, kv_dtype, batch, n_q, scale)
    want = attention_reference(q.astype(np.float64), ks, vs, batch, n_q, scale)
    assert_close(out, want, F32, ulps=200, scale=max(np.abs(v).max() for v in vs),
                 what=f"{kernel} d={head_dim} group={group}")


@needs_gpu
@pytest.mark.parametrize("max_len", [0, 100, 5000], ids=["exact", "too_small", "too_large"])
def test_paged_attention_decode_splits_long_sequences(max_len):
    """Two sequences of 2000 and 777 positions: the decode kernel splits the KV length into up to
    16 partitions and merges them. max_len is only an upper bound for the split: one that is too
    small (a single partition that takes everything) or too large gives the same result."""
    rng = np.random.default_rng(22000 + max_len)
    lens = [2000, 777]
    layout = Layout(PAGE, 16, 2, 64, 2, 176)
    batch = PagedBatch(rng, layout, lens, [(0, 1999), (1, 776)])
    storage, ks, vs = fill_cache(rng, layout, batch, lens, BF16)
    q = rng.standard_normal((2, 8, 64)).astype(np.float32)
    want = attention_reference(q.astype(np.float64), ks, vs, batch, 8, 0.125)
    for kernel in ATTENTION:
        out = run_attention(kernel, q, F32, storage, layout, BF16, batch, 8, 0.125, max_len)
        assert_close(out, want, F32, ulps=200, scale=max(np.abs(v).max() for v in vs),
                     what=f"{kernel} max_len={max_len}")


@needs_gpu
@pytest.mark.parametrize("kernel", ATTENTION)
def test_paged_attention_stale_entries_are_safe(kernel):
    """Tables the host did not check (check=False) never make a kernel read out of bounds: a
    token of an unknown sequence or at a negative position gets zeros, positions whose block id
    is invalid or past the sequence's blocks take no part."""
    rng = np.random.default_rng(23000)
    lens = [12, 15, 5]
    layout = Layout(RAW, 5, 1, 8, 4, 9)
    batch = PagedBatch(rng, layout, lens, [(0, 11), (5, 0), (1, -1), (1, 14), (2, 12)])
    storage, ks, vs = fill_cache(rng, layout, batch, lens, F32)
    batch.indices[batch.indptr[1] + 1] = -1  # sequence 1 loses positions 5..9
    batch.indices[batch.indptr[1] + 2] = 9   # and 10..14 (past the layer's 9 blocks)
    keep = [np.ones(n, bool) for n in lens]
    keep[1][5:] = False
    keep = [np.concatenate([k, np.zeros(20, bool)]) for k in keep]  # sequence 2 owns 5 slots
    q = rng.standard_normal((5, 1, 8)).astype(np.float32)
    out = run_attention(kernel, q, F32, storage, layout, F32, batch, 1, 0.5, max_len=15,
                        check=False)
    ks[2] = np.concatenate([ks[2], np.zeros((8, 1, 8))])  # positions 5..12: skipped anyway
    vs[2] = np.concatenate([vs[2], np.zeros((8, 1, 8))])
    valid = [0, 3, 4]
    sub = PagedBatch(rng, layout, lens, [(0, 11), (1, 14), (2, 12)])
    want = attention_reference(q[valid].astype(np.float64), ks, vs, sub, 1, 0.5, keep=keep)
    assert_close(out[valid], want, F32, ulps=200, scale=4.0, what=f"{kernel} stale")
    np.testing.assert_array_equal(out[[1, 2]], 0.0)


@needs_gpu
@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
def test_paged_attention_matches_the_cpu_backend(kind):
    """fp32 cache and activations: both kernels against gyges' own CPU attention on the mixed
    batch. Two fp32 implementations with different summation orders and exponentials: 200 ulps
    of the V scale, as against the float64 reference."""
    rng = np.random.default_rng(24000 + kind)
    layout = Layout(kind, 5, 2, 40, 4, 60)
    batch = PagedBatch(rng, layout, MIXED_LENS, MIXED_TOKENS)
    storage, ks, vs = fill_cache(rng, layout, batch, MIXED_LENS, F32)
    q = rng.standard_normal((batch.n_tokens, 6, 40)).astype(np.float32)
    scale = float(np.float32(1 / np.sqrt(40)))  # what the CPU kernel uses
    cpu = np.full(q.shape, np.nan, np.float32)
    _C_test.kernel_attention(cpu, q, storage, (kind, 5, 2, 40, 60), *batch.args()[:2],
                             batch.indptr, batch.indices, batch.n_tokens, batch.n_seqs, 6, 1)
    for kernel in ATTENTION:
        out = run_attention(kernel, q, F32, storage, layout, F32, batch, 6, scale)
        assert_close(out, cpu, F32, ulps=200, scale=max(np.abs(v).max() for v in vs),
                     what=f"{kernel} vs cpu")


def test_paged_attention_refuses_bad_arguments_before_the_device():
    """Refused with a gyges error naming the cause, on machines without a GPU too (the checks
    run before anything is copied)."""
    if not _C.WITH_CUDA:
        pytest.skip("gyges was built without CUDA")
    rng = np.random.default_rng(25000)

    def call(kernel="decode", head_dim=16, n_kv=2, n_q=4, kv_dtype=F32, elem_size=4, n_tokens=2,
             max_len=0, check=True, table=None, scale=0.25, act_dtype=F32):
        layout = Layout(HEAD, 4, n_kv, head_dim, elem_size, 4)
        batch = PagedBatch(rng, layout, [5], [(0, 3), (0, 4)])
        if table is not None:
            batch.indices[:] = table
        storage = np.zeros(layout.n_elems * elem_size, np.uint8)
        act = ELEM_SIZE.get(act_dtype, 4)
        q = np.zeros(max(n_tokens, 0) * n_q * head_dim * act, np.uint8)
        out = q.copy()
        seq, pos, _, indptr, indices, n_seqs = batch.args()
        getattr(_C_test, ATTENTION[kernel])(out, q, act_dtype, storage, layout.tuple(), kv_dtype,
                                            seq, pos, n_tokens, indptr, indices, n_seqs, n_q,
                                            max_len, scale, check)

    for kernel in ATTENTION:
        for kwargs, words in [
                (dict(head_dim=12), "head_dim=12 is not supported"),
                (dict(head_dim=264), "head_dim=264 is not supported"),
                (dict(n_q=3), "n_q_heads=3 must be a positive multiple"),
                (dict(n_q=0), "n_q_heads=0"),
                (dict(n_tokens=-1), "n_tokens=-1"),
                (dict(kv_dtype=BF16), "elem_size=4 does not match kv_dtype bf16"),
                (dict(kv_dtype=7), "unknown dtype 7"),
                (dict(act_dtype=5), "unknown dtype 5"),
                (dict(scale=float("inf")), "scale=inf"),
                (dict(check=False), "max_len=0"),
                (dict(table=[1, 4]), "outside the layer's 4 blocks"),
                (dict(table=[-1, 0]), "outside the layer's 4 blocks")]:
            with pytest.raises(InvalidArgumentError, match=words):
                call(kernel, **kwargs)
        with pytest.raises(ValueError, match="q has"):  # buffer sizes, before the device too
            call(kernel, n_tokens=1)


# ---- kv_write: new K/V rows of a batch into the paged cache ----

@needs_gpu
@pytest.mark.parametrize("act_dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("kv_dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
def test_kv_write_matches_reference(kind, kv_dtype, act_dtype):
    """The rows of a mixed batch land in their slots converted to the KV dtype (one rounding to
    nearest even from the exact value on both sides: bit-exact); every other value keeps its
    poison."""
    rng = np.random.default_rng(26000 + 100 * kind + 10 * kv_dtype + act_dtype)
    layout = Layout(kind, 5, 3, 7, ELEM_SIZE[kv_dtype], 60)
    batch = PagedBatch(rng, layout, MIXED_LENS, WRITE_TOKENS)
    shape = (batch.n_tokens, 3, 7)
    k = encode(rng.standard_normal(shape) * 10, act_dtype)
    v = encode(rng.standard_normal(shape) * 10, act_dtype)
    storage = poison(layout.n_elems, ELEM_SIZE[kv_dtype])
    want = storage.copy()
    for t in range(batch.n_tokens):
        idx = batch.slots(layout, int(batch.token_seq[t]), [int(batch.token_pos[t])])
        want[idx[0, 0]] = encode(decode(k[t], act_dtype), kv_dtype).view(want.dtype)
        want[idx[1, 0]] = encode(decode(v[t], act_dtype), kv_dtype).view(want.dtype)
    _C_test.cuda_kv_write(storage, layout.tuple(), kv_dtype, k, v, act_dtype, *batch.args())
    diff = np.flatnonzero(storage != want)
    assert diff.size == 0, f"{diff.size} elements differ, first at {diff[:8]}"


@needs_gpu
@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
def test_kv_write_matches_cpu_kv_write(kind):
    rng = np.random.default_rng(27000 + kind)
    layout = Layout(kind, 5, 3, 7, 4, 60)
    batch = PagedBatch(rng, layout, MIXED_LENS, WRITE_TOKENS)
    k = rng.standard_normal((batch.n_tokens, 3, 7)).astype(np.float32)
    v = rng.standard_normal((batch.n_tokens, 3, 7)).astype(np.float32)
    gpu = poison(layout.n_elems, 4).view(np.float32)
    cpu = gpu.copy()
    _C_test.cuda_kv_write(gpu, layout.tuple(), F32, k, v, F32, *batch.args())
    _C_test.kernel_kv_write(cpu, (kind, 5, 3, 7, 60), k, v, *batch.args()[:2], batch.indptr,
                            batch.indices, batch.n_tokens, batch.n_seqs)
    np.testing.assert_array_equal(gpu.view(np.uint32), cpu.view(np.uint32))


@needs_gpu
def test_kv_write_skips_stale_entries():
    """Unchecked tables (check=False): a token of an unknown sequence, at a negative position,
    past its sequence's blocks or in an invalid block writes nothing."""
    rng = np.random.default_rng(28000)
    layout = Layout(PAGE, 4, 2, 8, 2, 6)
    batch = PagedBatch(rng, layout, [8, 4], [(0, 1), (3, 0), (0, -2), (1, 4), (0, 6), (1, 2)])
    batch.indices[1] = 6  # sequence 0's second block is past the layer: position 6 is dropped
    k = encode(rng.standard_normal((6, 2, 8)), BF16)
    storage = poison(layout.n_elems, 2)
    want = storage.copy()
    for t in (0, 5):
        idx = batch.slots(layout, int(batch.token_seq[t]), [int(batch.token_pos[t])])
        want[idx[0, 0]], want[idx[1, 0]] = k[t], k[t]
    _C_test.cuda_kv_write(storage, layout.tuple(), BF16, k, k, BF16, *batch.args(), False)
    np.testing.assert_array_equal(storage, want)


def test_kv_write_refuses_bad_arguments_before_the_device():
    if not _C.WITH_CUDA:
        pytest.skip("gyges was built without CUDA")
    rng = np.random.default_rng(29000)
    layout = Layout(HEAD, 4, 2, 8, 2, 4)
    batch = PagedBatch(rng, layout, [6], [(0, 4), (0, 5)])
    storage = np.zeros(layout.n_elems, np.uint16)
    k = np.zeros((2, 2, 8), np.uint16)
    with pytest.raises(InvalidArgumentError, match="elem_size=2 does not match kv_dtype f32"):
        _C_test.cuda_kv_write(storage, layout.tuple(), F32, k, k, F16, *batch.args())
    with pytest.raises(InvalidArgumentError, match="unknown dtype 9"):
        _C_test.cuda_kv_write(storage, layout.tuple(), F16, k, k, 9, *batch.args())
    args = list(batch.args())
    args[2] = -1
    with pytest.raises(InvalidArgumentError, match="n_tokens=-1"):
        _C_test.cuda_kv_write(storage, layout.tuple(), F16, k, k, F16, *args)
    with pytest.raises(ValueError, match="k has"):
        _C_test.cuda_kv_write(storage, layout.tuple(), F16, k[:1], k, F16, *batch.args())
    batch.token_pos[1] = 8  # the sequence owns 2 blocks of 4: positions 0..7
    with pytest.raises(InvalidArgumentError, match="token 1 is at position 8"):
        _C_test.cuda_kv_write(storage, layout.tuple(), F16, k, k, F16, *batch.args())


# ---- Flying Serving's KV views: longer blocks of fewer heads over the same bytes ----

# (layout kind, block_size B, KV heads H, factor k, head_dim): a view of factor k
# (gy_kv_init_view, KVCache.view) reads each block of its base (B tokens of H heads) as k*B tokens
# of H/k heads, so a TPk rank of a replicated host attends over blocks k times longer than its
# worker's DP engine. Odd B (view blocks of 10, 12, 14, 20: neither the base's size nor powers of
# two), every layout, the factors of a 4-worker host, head sizes of every kernel bucket.
VIEW_CASES = [(RAW, 5, 4, 2, 40), (PAGE, 3, 4, 4, 8), (HEAD, 7, 2, 2, 64), (HEAD, 5, 4, 4, 128)]
# DP sequences on the base, TP sequences on the view (one of 150 positions: the decode kernel
# splits it into partitions), and the tokens attended: decodes, a first token, and prefill chunks
# that cross several of the view's blocks.
VIEW_DP_LENS, VIEW_TP_LENS = [13, 11], [150, 1, 37]
VIEW_DP_TOKENS = [(0, 12)] + [(1, p) for p in range(4, 11)]
VIEW_TP_TOKENS = ([(0, 149), (1, 0)] + [(2, p) for p in range(3, 37)]
                  + [(0, p) for p in range(100, 104)])


def view_of(layout, factor):
    """The layout of a view of `factor` over `layout`'s blocks (gy_kv_init_view)."""
    return Layout(layout.kind, layout.block_size * factor, layout.n_heads // factor,
                  layout.head_dim, layout.elem_size, layout.n_blocks)


def batch_on(layout, lens, tokens, blocks):
    """A PagedBatch whose sequences own the given block ids, in order."""
    batch = PagedBatch(np.random.default_rng(0), layout, lens, tokens)
    assert batch.indices.size == len(blocks)
    batch.indices = np.asarray(blocks, np.int32)
    return batch


def write_all(storage, layout, kv_dtype, batch, lens, ks, vs):
    """Every position of every sequence written by the kv_write kernel, as prefills do; ks, vs:
    per sequence (len, n_heads, head_dim) fp32 values exact in kv_dtype."""
    tokens = [(s, p) for s, n in enumerate(lens) for p in range(n)]
    write = batch_on(layout, lens, tokens, batch.indices)
    k = np.concatenate(ks).astype(np.float32)
    v = np.concatenate(vs).astype(np.float32)
    _C_test.cuda_kv_write(storage, layout.tuple(), kv_dtype, k, v, F32, *write.args())


@needs_gpu
@pytest.mark.parametrize("kv_dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", VIEW_CASES, ids=lambda c: "%s_b%d_h%d_k%d_d%d" % (
    "raw page head".split()[c[0]], *c[1:]))
def test_kernels_on_a_kv_view_share_blocks_with_its_base(case, kv_dtype):
    """One layer's storage as a replicated worker holds it: DP sequences written in the base's
    geometry and TP sequences in the view's, in blocks of one shuffled pool. kv_write puts every
    value where the layout says, bit for bit, and nowhere else (the rest keeps its poison); both
    attention kernels read the view's longer blocks and the base's short ones against float64,
    and on the view they give, to the bit, what a sharded TP rank's cache of B-token blocks of
    the same heads gives: the kernels' sums do not depend on the block size, so a Flying TP
    engine computes a sharded one's values."""
    kind, B, H, k, D = case
    rng = np.random.default_rng(31000 + 1000 * kind + 100 * B + 10 * k + kv_dtype)
    esz = ELEM_SIZE[kv_dtype]
    base = Layout(kind, B, H, D, esz, 30)
    view = view_of(base, k)
    # the view the engine makes has exactly these strides (what forward_cuda.c hands the kernels)
    arena = gyges.Arena(budget="4MiB", page_size="64KiB")
    made = gyges.KVCache(arena, n_layers=1, n_kv_heads=H, head_dim=D, block_size=B,
                         layout=("raw", "page", "header")[kind]).view(k)
    made.grow(1)
    got = made.layout()
    assert (got["block_size"], got["n_heads"]) == (view.block_size, view.n_heads)
    assert tuple(got[s] for s in ("stride_kv", "stride_block", "stride_token", "stride_head")) \
        == layout_strides(kind, view.block_size, view.n_heads, D, got["n_blocks"])
    del made, arena
    assert view.n_elems == base.n_elems

    # one pool: the DP sequences' blocks and the TP ones' drawn from one permutation
    pool = rng.permutation(base.n_blocks)
    dp_n = [-(-n // B) for n in VIEW_DP_LENS]
    tp_n = [-(-n // view.block_size) for n in VIEW_TP_LENS]
    dp_blocks, tp_blocks = pool[:sum(dp_n)], pool[sum(dp_n):sum(dp_n) + sum(tp_n)]
    dp = batch_on(base, VIEW_DP_LENS, VIEW_DP_TOKENS, dp_blocks)
    tp = batch_on(view, VIEW_TP_LENS, VIEW_TP_TOKENS, tp_blocks)

    def values(lens, heads):
        return [round_to(rng.standard_normal((n, heads, D)), kv_dtype) for n in lens]
    dp_k, dp_v = values(VIEW_DP_LENS, H), values(VIEW_DP_LENS, H)
    tp_k, tp_v = values(VIEW_TP_LENS, view.n_heads), values(VIEW_TP_LENS, view.n_heads)
    storage = poison(base.n_elems, esz)
    want = storage.copy()
    write_all(storage, base, kv_dtype, dp, VIEW_DP_LENS, dp_k, dp_v)
    write_all(storage, view, kv_dtype, tp, VIEW_TP_LENS, tp_k, tp_v)
    for layout, batch, ks, vs in ((base, dp, dp_k, dp_v), (view, tp, tp_k, tp_v)):
        for s, (kk, vv) in enumerate(zip(ks, vs)):
            idx = batch.slots(layout, s, np.arange(len(kk)))
            want[idx[0]] = encode(kk, kv_dtype).view(want.dtype)
            want[idx[1]] = encode(vv, kv_dtype).view(want.dtype)
    diff = np.flatnonzero(storage != want)
    assert diff.size == 0, f"{diff.size} elements differ, first at {diff[:8]}"

    kv_storage = storage.view(np.float32) if kv_dtype == F32 else storage
    group = 3
    for layout, batch, ks, vs in ((base, dp, dp_k, dp_v), (view, tp, tp_k, tp_v)):
        n_q = layout.n_heads * group
        q = rng.standard_normal((batch.n_tokens, n_q, D)).astype(np.float32)
        scale = float(np.float32(1 / np.sqrt(D)))
        ref = attention_reference(q.astype(np.float64), ks, vs, batch, n_q, scale)
        for kernel in ATTENTION:
            out = run_attention(kernel, q, F32, kv_storage, layout, kv_dtype, batch, n_q, scale)
            assert_close(out, ref, F32, ulps=attention_ulps(F32),
                         scale=max(np.abs(v).max() for v in vs),
                         what=f"{kernel} on {'the view' if layout is view else 'the base'}")
            if layout is not view:
                continue
            # the same heads' K/V in a sharded rank's cache: B-token blocks, shuffled anew
            plain = Layout(kind, B, view.n_heads, D, esz, base.n_blocks * k)
            sharded = PagedBatch(rng, plain, VIEW_TP_LENS, VIEW_TP_TOKENS)
            other = poison(plain.n_elems, esz)
            for s, (kk, vv) in enumerate(zip(ks, vs)):
                idx = sharded.slots(plain, s, np.arange(len(kk)))
                other[idx[0]] = encode(kk, kv_dtype).view(other.dtype)
                other[idx[1]] = encode(vv, kv_dtype).view(other.dtype)
            other = other.view(np.float32) if kv_dtype == F32 else other
            same = run_attention(kernel, q, F32, other, plain, kv_dtype, sharded, n_q, scale)
            np.testing.assert_array_equal(out.view(np.uint32), same.view(np.uint32),
                                          err_msg=f"{kernel}: the view's bits")


# ---- sampling on the device, against the CPU sampler ----

def sample_params(rng, n, vocab):
    """Random rows of (temperature, top_k, top_p, seed, token_index, min_p), every feature on and
    off, greedy included."""
    rows = []
    for _ in range(n):
        temperature = float(rng.choice([0.0, 0.3, 0.7, 1.0, 1.5, 4.0]))
        top_k = int(rng.choice([0, 1, 2, 50, vocab, int(rng.integers(0, vocab + 1))]))
        top_p = float(rng.choice([1.0, 1.0, 0.95, 0.5, 0.05, float(rng.uniform(0.01, 1.0))]))
        min_p = float(rng.choice([0.0, 0.0, 0.05, 0.3, 1.0]))
        rows.append((temperature, min(top_k, vocab), top_p, int(rng.integers(0, 2**63)),
                     int(rng.integers(0, 2**40)), min_p))
    return rows


def sample_rows(rng, n, vocab):
    x = rng.normal(0, 3, (n, vocab))
    x[::3] = np.round(x[::3])  # every third row: many equal logits (ties by index)
    x[1::4, ::7] = -np.inf     # some -inf logits
    x[:, 0] = np.where(np.isinf(x).all(axis=1), 0.0, x[:, 0])
    return x


@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("vocab", [1, 7, 1000, 5003])
def test_cuda_sample_picks_the_cpu_samplers_tokens(dtype, vocab):
    """The same token as gy_sampler_sample_batch for every row (16-bit logits: the CPU sampler
    fed the exactly widened values). sample.cu names the only possible difference, a draw or a
    top-p sum within a few double ulps of a boundary (~1e-13 per row): such rows would be
    reported, and none is expected."""
    rng = np.random.default_rng(30000 + vocab + dtype)
    n = 48
    logits = encode(sample_rows(rng, n, vocab), dtype)
    widened = decode(logits, dtype).astype(np.float32)
    params = sample_params(rng, n, vocab)
    tokens = np.full(n, -7, np.int32)
    _C_test.cuda_sample(tokens, logits, dtype, n, vocab, params)
    want = _C_test.sample(widened, n, vocab, params)
    differ = [r for r in range(n) if tokens[r] != want[r]]
    assert not differ, [(r, params[r], int(tokens[r]), want[r]) for r in differ]


@needs_gpu
def test_cuda_sample_large_vocab_and_top_p_near_one():
    """A Llama-3-sized vocabulary (every radix-select pass fully used) and top_p = 0.999 (the
    nucleus holds most of the vocabulary)."""
    rng = np.random.default_rng(31000)
    n, vocab = 6, 128256
    logits = rng.normal(0, 2, (n, vocab)).astype(np.float32)
    params = [(1.0, 0, 0.999, 1, 1, 0.0), (0.8, 40000, 0.9, 2, 2, 0.0), (1.2, 0, 1.0, 3, 3, 0.0),
              (0.5, 50, 1.0, 4, 4, 0.01), (2.0, 100000, 0.3, 5, 5, 0.0), (0.0, 0, 1.0, 6, 6, 0.0)]
    tokens = np.full(n, -7, np.int32)
    _C_test.cuda_sample(tokens, logits, F32, n, vocab, params)
    assert tokens.tolist() == _C_test.sample(logits, n, vocab, params)


@needs_gpu
def test_cuda_sample_refused_rows_get_minus_one():
    """Rows the CPU sampler refuses (NaN, +inf, only -inf) get -1 and leave the other rows alone;
    greedy ties go to the lowest index, -0 ties with +0."""
    x = np.zeros((5, 6), np.float32)
    x[0, 3] = np.nan
    x[1, 2] = np.inf
    x[2] = -np.inf
    x[3] = [1, 5, 2, 5, -1, 0]
    x[4] = [-0.0, 0.0, -1, -2, -3, -4]
    tokens = np.full(5, 9, np.int32)
    params = [(0.0, 0, 1.0, 0, 0)] * 4 + [(0.0, 0, 1.0, 0, 0)]
    _C_test.cuda_sample(tokens, x, F32, 5, 6, params)
    assert tokens.tolist() == [-1, -1, -1, 1, 0]
    sampled = [(1.0, 0, 1.0, 1, 1)] * 5
    _C_test.cuda_sample(tokens, x, F32, 5, 6, sampled)
    assert tokens[:3].tolist() == [-1, -1, -1]
    assert tokens[3:].tolist() == _C_test.sample(x[3:], 2, 6, sampled[3:])


def test_cuda_sample_refuses_bad_arguments_before_the_device():
    if not _C.WITH_CUDA:
        pytest.skip("gyges was built without CUDA")
    x = np.zeros((2, 4), np.float32)
    tokens = np.zeros(2, np.int32)
    ok = (1.0, 0, 1.0, 0, 0)
    for row, word in [((1.0, 5, 1.0, 0, 0), "top_k"), ((1.0, 0, 0.0, 0, 0), "top_p"),
                      ((-1.0, 0, 1.0, 0, 0), "temperature"), ((1.0, 0, 1.0, 0, 0, 2.0), "min_p")]:
        with pytest.raises(InvalidArgumentError, match=f"row 1: {word}"):
            _C_test.cuda_sample(tokens, x, F32, 2, 4, [ok, row])
    with pytest.raises(InvalidArgumentError, match="vocab=0"):
        _C_test.cuda_sample(tokens, x, F32, 2, 0, [ok, ok])
    with pytest.raises(InvalidArgumentError, match="unknown dtype"):
        _C_test.cuda_sample(tokens, x, 3, 2, 4, [ok, ok])
    with pytest.raises(ValueError, match="params has 1 rows"):
        _C_test.cuda_sample(tokens, x, F32, 2, 4, [ok])
    with pytest.raises(ValueError, match="logits has"):
        _C_test.cuda_sample(tokens, x, F16, 2, 4, [ok, ok])


def test_refused_new_entry_points_release_their_buffers():
    """kv_write, the attention kernels and the sampler: 1000 calls refused after their buffers
    were borrowed (a bad table, a short buffer, bad params) keep no reference to the arrays."""
    if not _C.WITH_CUDA:
        pytest.skip("gyges was built without CUDA")
    rng = np.random.default_rng(32000)
    layout = Layout(PAGE, 4, 2, 8, 4, 3)
    batch = PagedBatch(rng, layout, [5], [(0, 3), (0, 4)])
    batch.token_pos[1] = 9  # past the sequence's 2 blocks: refused by the host check
    storage = np.zeros(layout.n_elems, np.float32)
    q = np.zeros((2, 4, 8), np.float32)
    k = np.zeros((2, 2, 8), np.float32)
    logits = np.zeros((1, 5), np.float32)
    tokens = np.zeros(1, np.int32)
    arrays = (storage, q, k, batch.token_seq, batch.token_pos, batch.indptr, batch.indices,
              logits)
    before = [sys.getrefcount(x) for x in arrays]
    for _ in range(1000):
        with pytest.raises(InvalidArgumentError):
            _C_test.cuda_kv_write(storage, layout.tuple(), F32, k, k, F32, *batch.args())
        with pytest.raises(InvalidArgumentError):
            _C_test.cuda_paged_attention_decode(q.copy(), q, F32, storage, layout.tuple(), F32,
                                                *batch.args(), 4, 0, 0.5)
        with pytest.raises(ValueError):
            _C_test.cuda_paged_attention_prefill(q[:1].copy(), q, F32, storage, layout.tuple(),
                                                 F32, *batch.args(), 4, 0, 0.5)
        with pytest.raises(InvalidArgumentError):
            _C_test.cuda_sample(tokens, logits, F32, 1, 5, [(1.0, 9, 1.0, 0, 0)])
    gc.collect()
    assert [sys.getrefcount(x) for x in arrays] == before


def test_workspace_sizes():
    if not _C.WITH_CUDA:
        pytest.skip("gyges was built without CUDA")
    ws = _C_test.cuda_paged_attention_workspace_bytes
    assert ws(0, 32, 128, 4096) == 0
    assert ws(128, 32, 128, 4096) == 0  # 4096 (token, head) rows fill the GPU: no split
    assert ws(64, 32, 128, 4096) == 64 * 32 * 2 * 130 * 4  # 2048 rows: 2 partitions
    assert ws(1, 32, 128, 100) == 0  # shorter than one partition
    assert ws(1, 32, 128, 4096) == 32 * 32 * 130 * 4  # 32 partitions of 128 positions


# ---- the CUDA arena (GPU) ----

def _cuda_arena(pages=8, n_slots=16, pool_pages=4, page_size=2 * MiB):
    return gyges.Arena(budget=pages * page_size, page_size=page_size, n_slots=n_slots,
                       backend="cuda", pool_pages=pool_pages)


def _write(arena, offset, data):
    _C_test.cuda_memcpy_htod(arena.base_address + offset, np.ascontiguousarray(data))


def _read(arena, offset, nbytes):
    out = np.empty(nbytes, np.uint8)
    _C_test.cuda_memcpy_dtoh(out, arena.base_address + offset)
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
@pytest.mark.parametrize("pool_pages", [0, 8])
def test_cuda_arena_counts_and_times_each_driver_call(pool_pages):
    """driver_times: every cuMemMap, cuMemSetAccess and cuMemUnmap on the caller's path, and
    cuMemCreate / cuMemRelease only where the pool does not answer, each timed alone (what
    kvcached reports per call). A pool as large as the budget answers every create and takes
    every page back (a smaller one may have been refilled by its thread before a release, which
    then goes to the driver)."""
    arena = _cuda_arena(pool_pages=pool_pages)
    before = arena.driver_times()
    assert before["map"] == before["set_access"] == before["unmap"] == (0, 0.0)
    pages = [arena.create_page("kv") for _ in range(3)]
    for slot, page in enumerate(pages):
        arena.map(slot, page)
    arena.remap(0, 5)  # an unmap and a map with its set-access
    for slot in (1, 2, 5):
        arena.unmap(slot)
    for page in pages:
        arena.release_page(page)
    t = arena.driver_times()
    driver = 0 if pool_pages else 3
    assert {k: n for k, (n, _) in t.items()} == {"create": driver, "map": 4, "set_access": 4,
                                                 "unmap": 4, "release": driver}
    assert all(seconds > 0 for n, seconds in t.values() if n)


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
    before = _C_test.cuda_device_info(0)["free_bytes"]
    for _ in range(3):
        arena = _cuda_arena(pages=64, n_slots=64, pool_pages=16)
        for _ in range(20):
            arena.grow(0, 64, "kv")
            arena.shrink(0, 64)
        del arena
        gc.collect()
    after = _C_test.cuda_device_info(0)["free_bytes"]
    # Other processes may allocate meanwhile; one arena is 128 MiB, so a leak of even one would
    # show well beyond this slack.
    assert after >= before - 64 * MiB, (before, after)
