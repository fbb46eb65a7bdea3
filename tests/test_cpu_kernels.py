"""The CPU kernels (csrc/cpu) through gyges._C, against float64 NumPy references written here.

Tolerance policy (STYLE.md #8): fp32 kernels must be within 1e-5 relative error (normwise, and
elementwise against the sum of |terms| so that cancellation cannot hide a wrong order); bf16/f16
weights are compared with the float64 reference applied to the rounded weights (the widening is
exact, so the same bound holds); everything the kernels promise to be bit-exact (rows vs batch,
threads, k-split trees, layouts, block sizes, chunking, kernel paths) is compared with
np.array_equal on the raw bits. Each test reports its largest error in the assertion message."""
import sys

import numpy as np
import pytest

import gyges
from gyges import _C, _C_test

F32, F16, BF16 = _C_test.DTYPE_F32, _C_test.DTYPE_F16, _C_test.DTYPE_BF16
DTYPES = {"f32": F32, "f16": F16, "bf16": BF16}
LAYOUT_KINDS = {"raw": 0, "page": 1, "head": 2}
ISAS = ["portable"] + (["avx512"] if _C_test.kernel_isa_best() == "avx512" else [])


@pytest.fixture(autouse=True)
def restore_isa():
    yield
    _C.set_cpu_isa(_C_test.kernel_isa_best())


def rng(seed):
    return np.random.default_rng(seed)


def bits(a):
    return np.ascontiguousarray(a).view(np.uint32 if a.dtype == np.float32 else np.uint16)


def same_bits(a, b):
    return a.shape == b.shape and np.array_equal(bits(a), bits(b))


# ---- weights in each storage dtype ---------------------------------------------------------------

def to_bf16_bits(x):
    """Round-to-nearest-even fp32 -> bf16, as uint16 (what the engine stores)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16_bits(h):
    return (h.astype(np.uint32) << 16).view(np.float32)


def store(w32, dtype):
    """(stored array passed to the kernel, its exact fp32 values)."""
    if dtype == F32:
        return w32, w32
    if dtype == BF16:
        h = to_bf16_bits(w32)
        return h, from_bf16_bits(h)
    h = w32.astype(np.float16)
    return h.view(np.uint16), h.astype(np.float32)


# ---- linear -------------------------------------------------------------------------------------

def linear(x, w, dtype, bias=None, k_splits=1, threads=1, transposed=False):
    n = x.shape[0]
    if transposed:
        in_, out = w.shape
    else:
        out, in_ = w.shape
    y = np.full((n, out), np.nan, np.float32)
    fn = _C_test.kernel_linear_t if transposed else _C_test.kernel_linear
    fn(y, x, w, dtype, bias, n, in_, out, k_splits, threads)
    return y


def check_close(y, x, w_exact, bias, transposed):
    """Normwise relative error < 1e-5 and elementwise within 1e-5 * sum|terms|; returns the error."""
    x64, w64 = x.astype(np.float64), w_exact.astype(np.float64)
    wt = w64 if transposed else w64.T
    ref = x64 @ wt + (0 if bias is None else bias.astype(np.float64))
    mag = np.abs(x64) @ np.abs(wt) + (0 if bias is None else np.abs(bias))
    err = np.abs(y - ref)
    rel = err.max() / max(np.abs(ref).max(), 1e-30)
    assert rel < 1e-5, f"normwise relative error {rel:.3g}"
    assert np.all(err <= 1e-5 * mag + 1e-30), f"largest elementwise error {(err / (mag + 1e-30)).max():.3g}"
    return rel


SHAPES = [(1, 1), (7, 3), (33, 47), (288, 64), (300, 17), (130, 290), (37, 2100)]  # (in, out)


@pytest.mark.parametrize("transposed", [False, True], ids=["w_out_in", "w_in_out"])
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("in_,out", SHAPES)
def test_linear_matches_float64_reference(in_, out, dtype, transposed):
    r = rng(in_ * 1000 + out)
    n = 9
    x = r.standard_normal((n, in_), np.float32)
    w32 = r.standard_normal((in_, out) if transposed else (out, in_), np.float32)
    w, w_exact = store(w32, DTYPES[dtype])
    bias = r.standard_normal(out, np.float32)
    for b in (None, bias):
        y = linear(x, w, DTYPES[dtype], b, transposed=transposed, threads=2)
        check_close(y, x, w_exact, b, transposed)
    # f16 is widened exactly and summed in the f32 order: the bits of fp32 weights holding the
    # rounded values (bf16 has its own lane order, dot.h; linear_t has one order for all dtypes).
    if dtype == "f16" or (dtype == "bf16" and transposed):
        assert same_bits(y, linear(x, w_exact, F32, bias, transposed=transposed, threads=2))


@pytest.mark.parametrize("transposed", [False, True], ids=["w_out_in", "w_in_out"])
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("in_,out", [(96, 77), (40, 1100)])
def test_linear_rows_are_bit_identical_across_batch_and_threads(dtype, transposed, in_, out):
    """out=1100: at batch 1 linear_t accumulates wide column ranges in memory, in batches it uses
    register tiles; both must give the same bits."""
    r = rng(5)
    nmax = 37
    x = r.standard_normal((nmax, in_), np.float32)
    w, _ = store(r.standard_normal((in_, out) if transposed else (out, in_), np.float32), DTYPES[dtype])
    base = linear(x, w, DTYPES[dtype], transposed=transposed)
    for n in (1, 2, 3, 4, 5, 8, 17, 32):
        for threads in (1, 2, 3, 5):
            start = (n * 7) % (nmax - n + 1)
            y = linear(x[start:start + n], w, DTYPES[dtype], threads=threads, transposed=transposed)
            assert same_bits(y, base[start:start + n]), (n, threads)
    # A row does not care what the other rows hold.
    x2 = x.copy()
    x2[1:] = r.standard_normal((nmax - 1, in_), np.float32) * 1e6
    assert same_bits(linear(x2, w, DTYPES[dtype], transposed=transposed)[0], base[0])


@pytest.mark.parametrize("transposed", [False, True], ids=["w_out_in", "w_in_out"])
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
def test_k_split_tree_makes_tensor_parallel_exact(dtype, transposed):
    """TP1 with k_splits=K == add_tree of t workers' shards (k_splits=K/t) + bias, bit for bit."""
    r = rng(6)
    n, in_, out = 5, 24 * 11, 41  # in_ divisible by every K below
    x = r.standard_normal((n, in_), np.float32)
    w32 = r.standard_normal((in_, out) if transposed else (out, in_), np.float32)
    w, w_exact = store(w32, DTYPES[dtype])
    bias = r.standard_normal(out, np.float32)
    # o_proj (transposed) may have any number of chunks (max_tp = 3 for 3 KV heads); a TP-t rank
    # takes K/t of them, a power of two, or t = K (core/tree.h's split rule)
    for K in ((1, 2, 3, 4, 6, 8) if transposed else (1, 2, 4, 8)):
        tp1 = linear(x, w, DTYPES[dtype], bias, k_splits=K, threads=2, transposed=transposed)
        check_close(tp1, x, w_exact, bias, transposed)
        for t in range(2, K + 1):
            if K % t or not (t == K or (K // t) & (K // t - 1) == 0):
                continue
            shard = in_ // t
            parts = []
            for s in range(t):
                xs = np.ascontiguousarray(x[:, s * shard:(s + 1) * shard])
                ws = np.ascontiguousarray(w[s * shard:(s + 1) * shard] if transposed
                                          else w[:, s * shard:(s + 1) * shard])
                parts.append(linear(xs, ws, DTYPES[dtype], None, k_splits=K // t,
                                    threads=1 + s % 2, transposed=transposed))
            total = np.empty_like(tp1)
            _C_test.kernel_add_tree(total, parts, total.size)
            _C_test.kernel_add_bias(total, bias, n, out)
            assert same_bits(total, tp1), (K, t)
    # Different k_splits are different (fixed) orders: not required equal, but each is reproducible.
    assert same_bits(linear(x, w, DTYPES[dtype], bias, k_splits=4, transposed=transposed),
                     linear(x, w, DTYPES[dtype], bias, k_splits=4, threads=3, transposed=transposed))


def tree_sum(parts):
    """core/tree.h's order by its recursive definition: the first 2^k parts (the largest power
    of two below their number), then the rest, added."""
    if len(parts) == 1:
        return parts[0]
    half = 1 << ((len(parts) - 1).bit_length() - 1)
    return tree_sum(parts[:half]) + tree_sum(parts[half:])


def test_add_tree_is_pairwise():
    a, b, c, d = (np.array([v], np.float32) for v in (1e8, 1.0, -1e8, 1.0))
    out = np.empty(1, np.float32)
    _C_test.kernel_add_tree(out, [a, b, c, d], 1)
    assert out[0] == np.float32(np.float32(1e8) + np.float32(1.0)) + np.float32(np.float32(-1e8) + np.float32(1.0))
    _C_test.kernel_add_tree(out, [a, b, c], 1)
    assert out[0] == np.float32(np.float32(1e8) + np.float32(1.0)) + np.float32(-1e8)  # 0, not 1
    r = rng(9)
    for n_parts in range(1, 12):  # both paths (16-wide and the tail), against the definition
        parts = [(r.standard_normal(37) * 10.0 ** r.integers(-3, 4, 37)).astype(np.float32)
                 for _ in range(n_parts)]
        _C_test.kernel_add_tree(out := np.empty(37, np.float32), parts, 37)
        assert same_bits(out, tree_sum(parts)), n_parts
    with pytest.raises(ValueError):
        _C_test.kernel_add_tree(out, [], 1)


@pytest.mark.skipif(len(ISAS) < 2, reason="the AVX-512 path is not compiled into this build")
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
def test_avx512_and_portable_paths_give_the_same_bits(dtype):
    r = rng(7)
    x = r.standard_normal((6, 83), np.float32)
    w, _ = store(r.standard_normal((50, 83), np.float32), DTYPES[dtype])
    wt, _ = store(r.standard_normal((83, 50), np.float32), DTYPES[dtype])
    g = r.standard_normal(301, np.float32) * 20
    results = {}
    for isa in ISAS:
        _C.set_cpu_isa(isa)
        e = np.empty_like(g)
        _C_test.kernel_exp(e, g, g.size)
        s = np.empty_like(g)
        _C_test.kernel_swiglu(s, g, g[::-1].copy(), g.size)
        norm = np.empty((3, 83), np.float32)
        _C_test.kernel_rmsnorm(norm, x[:3].copy(), x[3].copy(), 3, 83, 1e-5)
        tree = np.empty(301, np.float32)
        _C_test.kernel_add_tree(tree, [g, g[::-1].copy(), e, s], 301)
        results[isa] = [linear(x, w, DTYPES[dtype], k_splits=1), linear(x, wt, DTYPES[dtype], transposed=True),
                        e, s, norm, tree]
    for a, b in zip(results["portable"], results["avx512"]):
        assert same_bits(a, b)


# The batched paths (gy_cpu_linear packs x and runs 8-row tiles of W against 3 rows at a time;
# gy_cpu_linear_t runs register tiles of 4 rows over strips of up to 6 vectors) must give every row
# the bits of the batch-1 path and of the portable path (the plain definition: gy_dot_ref per
# output, or the sequential chain), whatever the batch, the thread count, the k-splits and sizes
# that leave partial lane blocks, partial tiles and partial groups.
ODD_SHAPES = [(1, 3), (17, 9), (31, 20), (33, 17), (64, 8), (77, 45), (290, 13), (66, 100)]  # (in, out)


@pytest.mark.parametrize("transposed", [False, True], ids=["w_out_in", "w_in_out"])
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("in_,out", ODD_SHAPES)
def test_batched_paths_give_the_batch1_and_portable_bits(in_, out, dtype, transposed):
    r = rng(in_ * 7 + out)
    nmax = 40
    x = r.standard_normal((nmax, in_), np.float32)
    w32 = r.standard_normal((in_, out) if transposed else (out, in_), np.float32)
    w, w_exact = store(w32, DTYPES[dtype])
    bias = r.standard_normal(out, np.float32)
    for k_splits in [k for k in (1, 2, 4) if in_ % k == 0]:
        rows = {}
        for isa in ISAS:
            _C.set_cpu_isa(isa)
            rows[isa] = np.concatenate([linear(x[i:i + 1], w, DTYPES[dtype], bias, k_splits,
                                               transposed=transposed) for i in range(nmax)])
        _C.set_cpu_isa(_C_test.kernel_isa_best())
        check_close(rows["portable"], x, w_exact, bias, transposed)
        assert same_bits(rows[ISAS[-1]], rows["portable"]), k_splits
        for n in range(1, nmax + 1):
            threads = 1 + n % 3
            start = (n * 5) % (nmax - n + 1)
            y = linear(x[start:start + n], w, DTYPES[dtype], bias if n % 2 else None, k_splits,
                       threads=threads, transposed=transposed)
            want = rows["portable"][start:start + n]
            if n % 2 == 0:  # without the bias: the same tree, no addition
                want = np.concatenate([linear(x[i:i + 1], w, DTYPES[dtype], None, k_splits,
                                              transposed=transposed) for i in range(start, start + n)])
            assert same_bits(y, want), (k_splits, n, threads)


def test_batched_linear_on_model_shapes_matches_batch1():
    """The decoder's shapes (15M: in 288, out 288/384/32000 cut short here) at the batch sizes the
    engine runs, fp32 and bf16, 2 threads."""
    r = rng(31)
    for dtype in ("f32", "bf16"):
        for in_, out in ((288, 288), (288, 384), (768, 200), (288, 1000)):
            x = r.standard_normal((32, in_), np.float32)
            w, _ = store(r.standard_normal((out, in_), np.float32), DTYPES[dtype])
            wt, _ = store(r.standard_normal((in_, out), np.float32), DTYPES[dtype])
            for tr, ww in ((False, w), (True, wt)):
                one = np.concatenate([linear(x[i:i + 1], ww, DTYPES[dtype], transposed=tr, threads=2)
                                      for i in range(32)])
                for n in (2, 3, 4, 7, 32):
                    assert same_bits(linear(x[:n], ww, DTYPES[dtype], transposed=tr, threads=2), one[:n])


def test_fma_peak_is_a_plausible_rate():
    for threads in (1, 2):
        flops = _C_test.kernel_fma_peak(threads, 0.01)
        assert 1e8 < flops < 1e14
    with pytest.raises(gyges.InvalidArgumentError):
        _C_test.kernel_fma_peak(1, 0.0)


def test_greedy_sampling_on_both_paths_is_numpy_argmax():
    """The sampler's greedy scan (gy_cpu_argmax_checked) on each kernel path: the first maximum,
    -inf skipped, and NaN / +inf / all -inf rows refused."""
    r = rng(32)
    V, n = 32000, 8
    x = r.standard_normal((n, V), np.float32)
    x[1, [3, 17, 31999]] = 9.0  # ties: the lowest index
    x[2, :] = np.round(x[2])
    x[3, :-1] = -np.inf
    x[4, 16:] = -np.inf
    x[5, 31999] = 12.0  # the maximum in the last element
    x[6, 0] = 0.0
    x[6, 1:] = -0.0
    params = [(0.0, 0, 1.0, i, i) for i in range(n)]
    for isa in ISAS:
        _C.set_cpu_isa(isa)
        assert _C_test.sample(x, n, V, params) == [int(np.argmax(row)) for row in x]
        for v in (33, 1, 17):
            xs = np.ascontiguousarray(x[:, :v])
            xs[:, -1] = np.where(np.isinf(xs).all(axis=1), 1.0, xs[:, -1])
            assert _C_test.sample(xs, n, v, params) == [int(np.argmax(row)) for row in xs]
        for bad in (np.nan, np.inf):
            y = x.copy()
            y[3, 5] = bad
            with pytest.raises(gyges.InvalidArgumentError, match="row 3"):
                _C_test.sample(y, n, V, params)
        y = x.copy()
        y[7, :] = -np.inf
        with pytest.raises(gyges.InvalidArgumentError, match="row 7"):
            _C_test.sample(y, n, V, params)


# ---- norm, rope, activation, embedding, argmax ------------------------------------------------

def test_rmsnorm_matches_reference():
    r = rng(8)
    n, dim = 7, 289
    x = r.standard_normal((n, dim), np.float32)
    w = r.standard_normal(dim, np.float32)
    out = np.empty_like(x)
    _C_test.kernel_rmsnorm(out, x, w, n, dim, 1e-5)
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt((x64 ** 2).mean(axis=1, keepdims=True) + 1e-5) * w
    err = (np.abs(out - ref) / (np.abs(ref) + 1e-30)).max()
    assert err < 1e-5, err
    one = np.empty((1, dim), np.float32)
    _C_test.kernel_rmsnorm(one, x[3:4].copy(), w, 1, dim, 1e-5)
    assert same_bits(one[0], out[3])


def hf_rope(x, positions, inv_freq, mscale=1.0):
    """Hugging Face Llama: q * cos + rotate_half(q) * sin (cos, sin times the attention
    scaling), in float64."""
    d = x.shape[-1]
    freqs = np.outer(positions.astype(np.float64), inv_freq)
    emb = np.concatenate([freqs, freqs], axis=-1)[:, None, :]
    x64 = x.astype(np.float64)
    rot = np.concatenate([-x64[..., d // 2:], x64[..., :d // 2]], axis=-1)
    return x64 * mscale * np.cos(emb) + rot * mscale * np.sin(emb)


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "scaled"])
def test_rope_matches_hugging_face_convention(scaled):
    r = rng(9)
    n, heads, d, max_pos, theta = 5, 3, 48, 4096, 10000.0
    inv_freq = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    # The frequencies are data: any scaling's, with YaRN's magnitude factor on cos and sin.
    mscale = 1.25 if scaled else 1.0
    if scaled:
        inv_freq = inv_freq / np.linspace(1.0, 8.0, d // 2)
    cos = np.empty((max_pos, d // 2), np.float32)
    sin = np.empty_like(cos)
    _C_test.kernel_rope_table(cos, sin, max_pos, d, inv_freq, mscale)
    x = r.standard_normal((n, heads, d), np.float32)
    pos = np.array([0, 1, 17, 1000, 4095], np.int32)
    y = x.copy()
    _C_test.kernel_rope(y, pos, cos, sin, n, heads, d, max_pos)
    ref = hf_rope(x, pos, inv_freq, mscale)
    # cos/sin are rounded to fp32 once (|angle| up to 4095 rad): error ~ |x| * 2^-24 per term.
    err = np.abs(y - ref).max() / np.abs(ref).max()
    assert err < 1e-6, err
    with pytest.raises(gyges.InvalidArgumentError):
        _C_test.kernel_rope(y, np.array([0, 1, 2, 3, max_pos], np.int32), cos, sin, n, heads, d,
                            max_pos)
    with pytest.raises(gyges.InvalidArgumentError, match="inv_freq"):
        _C_test.kernel_rope_table(cos, sin, max_pos, d, -inv_freq, mscale)


def test_swiglu_exp_and_add():
    r = rng(10)
    g = (r.standard_normal(1001) * 15).astype(np.float32)
    g[:4] = [-200.0, 0.0, 88.0, -88.0]
    u = r.standard_normal(1001).astype(np.float32)
    out = np.empty_like(g)
    _C_test.kernel_swiglu(out, g, u, g.size)
    g64 = g.astype(np.float64)
    ref = g64 / (1 + np.exp(-g64)) * u
    assert np.all(np.abs(out - ref) <= 1e-6 * np.abs(ref) + 1e-30), np.abs(out - ref).max()
    x = np.linspace(-103, 88.7, 100001, dtype=np.float32)
    e = np.empty_like(x)
    _C_test.kernel_exp(e, x, x.size)
    ref = np.exp(x.astype(np.float64))
    normal = ref > 1.2e-38
    rel = (np.abs(e - ref) / ref)[normal].max()
    assert rel < 4e-7, rel  # a few ulps
    specials = np.array([np.inf, -np.inf, np.nan, 0.0, 89.0, -105.0], np.float32)
    e = np.empty_like(specials)
    _C_test.kernel_exp(e, specials, specials.size)
    assert e[0] == np.inf and e[1] == 0 and np.isnan(e[2]) and e[3] == 1 and e[4] == np.inf and e[5] == 0
    a, b = r.standard_normal((2, 77), np.float32)
    s = np.empty_like(a)
    _C_test.kernel_add(s, a, b, 77)
    assert same_bits(s, a + b)


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
def test_embedding(dtype):
    r = rng(11)
    vocab, dim = 50, 33
    table, exact = store(r.standard_normal((vocab, dim), np.float32), DTYPES[dtype])
    tokens = np.array([3, 0, 49, 3, 17], np.int32)
    out = np.full((5, dim), np.nan, np.float32)
    _C_test.kernel_embedding(out, table, DTYPES[dtype], tokens, 5, vocab, dim)
    assert same_bits(out, exact[tokens])
    with pytest.raises(gyges.InvalidArgumentError):
        _C_test.kernel_embedding(out, table, DTYPES[dtype], np.array([0, 1, 2, 3, 50], np.int32),
                                 5, vocab, dim)
    with pytest.raises(gyges.InvalidArgumentError):
        _C_test.kernel_embedding(out, table, DTYPES[dtype], np.array([0, 1, -1, 3, 4], np.int32),
                                 5, vocab, dim)


def test_argmax_ties_go_to_the_lowest_index():
    r = rng(12)
    logits = r.standard_normal((4, 32000), np.float32)
    logits[1, [5, 900, 31999]] = 50.0
    logits[2, :] = np.nan
    logits[3, 7] = np.nan
    out = np.empty(4, np.int32)
    _C_test.kernel_argmax(out, logits, 4, 32000)
    assert out[0] == np.argmax(logits[0]) and out[1] == 5 and out[2] == 0
    assert out[3] == np.nanargmax(logits[3])


def test_dtype_conversions_round_to_nearest_even():
    r = rng(13)
    x = r.standard_normal(10007).astype(np.float32) * np.float32(1e3)
    x[:6] = [0.0, -0.0, np.inf, -np.inf, 65520.0, 1e-8]
    with np.errstate(over="ignore"):  # 65520 rounds to inf in f16, on purpose
        f16 = x.astype(np.float16).view(np.uint16)
    for dtype, ref in ((BF16, to_bf16_bits(x)), (F16, f16)):
        h = np.empty(x.size, np.uint16)
        _C_test.kernel_from_f32(h, dtype, x, x.size)
        assert np.array_equal(h, ref)
        back = np.empty_like(x)
        _C_test.kernel_to_f32(back, h, dtype, x.size)
        expect = from_bf16_bits(ref) if dtype == BF16 else ref.view(np.float16).astype(np.float32)
        assert same_bits(back, expect)


# ---- paged attention ----------------------------------------------------------------------------

def layout_strides(kind, B, H, D, n_blocks):
    """(kv, block, token, head) strides in elements: the same formulas as csrc/kv/kv_layout.c."""
    if kind == "raw":   # [K/V, Block, Token, Head, d]
        return n_blocks * B * H * D, B * H * D, H * D, D
    if kind == "page":  # [Block, K/V, Token, Head, d]
        return B * H * D, 2 * B * H * D, H * D, D
    return B * D, H * 2 * B * D, D, 2 * B * D  # head: [Block, Head, K/V, Token, d]


class Paged:
    """A layer's paged fp32 KV storage built in NumPy from logical K/V, with random block tables."""

    def __init__(self, kind, block_size, klog, vlog, lens, seed, spare_blocks=3):
        self.kind, self.B = kind, block_size
        self.H, self.D = klog[0].shape[1], klog[0].shape[2]
        r = rng(seed)
        counts = [-(-L // block_size) for L in lens]
        self.n_blocks = sum(counts) + spare_blocks
        perm = r.permutation(self.n_blocks).astype(np.int32)
        self.indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        self.indices = perm[:self.indptr[-1]].copy()
        self.storage = np.full(self.n_blocks * 2 * block_size * self.H * self.D, np.nan, np.float32)
        strides = layout_strides(kind, block_size, self.H, self.D, self.n_blocks)
        view = np.lib.stride_tricks.as_strided(
            self.storage, shape=(2, self.n_blocks, block_size, self.H, self.D),
            strides=tuple(4 * s for s in strides) + (4,))
        for s, L in enumerate(lens):
            for p in range(L):
                blk = self.indices[self.indptr[s] + p // block_size]
                view[0, blk, p % block_size] = klog[s][p]
                view[1, blk, p % block_size] = vlog[s][p]

    @property
    def layout(self):
        return (LAYOUT_KINDS[self.kind], self.B, self.H, self.D, self.n_blocks)

    def attention(self, q, tseq, tpos, n_q_heads, threads=1):
        n = len(tseq)
        out = np.full((n, n_q_heads, self.D), np.nan, np.float32)
        _C_test.kernel_attention(out, np.ascontiguousarray(q), self.storage, self.layout,
                                 np.asarray(tseq, np.int32), np.asarray(tpos, np.int32),
                                 self.indptr, self.indices, n, len(self.indptr) - 1, n_q_heads,
                                 threads)
        return out


def reference_attention(q, klog, vlog, tseq, tpos):
    n, QH, D = q.shape
    H = klog[0].shape[1]
    out = np.zeros((n, QH, D))
    for t, (s, p) in enumerate(zip(tseq, tpos)):
        for h in range(QH):
            k = klog[s][:p + 1, h // (QH // H)].astype(np.float64)
            v = vlog[s][:p + 1, h // (QH // H)].astype(np.float64)
            sc = k @ q[t, h].astype(np.float64) / np.sqrt(D)
            e = np.exp(sc - sc.max())
            out[t, h] = (e / e.sum()) @ v
    return out


def make_sequences(seed, lens, H, D):
    r = rng(seed)
    klog = [r.standard_normal((L, H, D), np.float32) for L in lens]
    vlog = [r.standard_normal((L, H, D), np.float32) for L in lens]
    return klog, vlog


@pytest.mark.parametrize("kind", list(LAYOUT_KINDS))
def test_attention_matches_reference_on_every_layout(kind):
    lens, H, QH, D = [37, 1, 20], 2, 6, 24
    klog, vlog = make_sequences(14, lens, H, D)
    tseq = [s for s, L in enumerate(lens) for _ in range(L)]
    tpos = [p for L in lens for p in range(L)]
    q = rng(15).standard_normal((len(tseq), QH, D), np.float32)
    paged = Paged(kind, 8, klog, vlog, lens, seed=16)
    out = paged.attention(q, tseq, tpos, QH, threads=2)
    ref = reference_attention(q, klog, vlog, tseq, tpos)
    err = np.abs(out - ref).max() / np.abs(ref).max()
    assert err < 1e-5, err


def test_kv_write_fills_the_same_storage_as_the_numpy_layout():
    lens, H, D = [13, 30], 3, 8
    klog, vlog = make_sequences(17, lens, H, D)
    for kind in LAYOUT_KINDS:
        for B in (1, 4, 16):
            ref = Paged(kind, B, klog, vlog, lens, seed=18)
            kv = np.full_like(ref.storage, np.nan)
            tseq = np.array([s for s, L in enumerate(lens) for _ in range(L)], np.int32)
            tpos = np.array([p for L in lens for p in range(L)], np.int32)
            k = np.concatenate(klog)
            v = np.concatenate(vlog)
            _C_test.kernel_kv_write(kv, ref.layout, k, v, tseq, tpos, ref.indptr, ref.indices,
                                    len(tseq), len(lens))
            assert same_bits(kv, ref.storage), (kind, B)


def test_attention_is_bit_identical_across_layouts_blocks_batching_chunking_threads():
    lens, H, QH, D = [50, 3, 33], 2, 4, 20
    klog, vlog = make_sequences(19, lens, H, D)
    tseq = [s for s, L in enumerate(lens) for _ in range(L)]
    tpos = [p for L in lens for p in range(L)]
    q = rng(20).standard_normal((len(tseq), QH, D), np.float32)
    base = None
    for i, kind in enumerate(LAYOUT_KINDS):
        for j, B in enumerate((1, 3, 16, 64)):
            paged = Paged(kind, B, klog, vlog, lens, seed=21 + 4 * i + j)
            out = paged.attention(q, tseq, tpos, QH, threads=1 + (i + j) % 3)
            if base is None:
                base = out
            assert same_bits(out, base), (kind, B)
            # Decode: each sequence's last token alone, and all of them as one batch.
            last = np.cumsum(lens) - 1
            batch = paged.attention(q[last], [tseq[t] for t in last], [tpos[t] for t in last], QH)
            assert same_bits(batch, base[last])
            for t in last:
                assert same_bits(paged.attention(q[t:t + 1], [tseq[t]], [tpos[t]], QH)[0], base[t])
            # Chunked prefill of sequence 0: three chunks, in reverse order even.
            for lo, hi in ((30, 50), (10, 30), (0, 10)):
                chunk = paged.attention(q[lo:hi], tseq[lo:hi], tpos[lo:hi], QH, threads=2)
                assert same_bits(chunk, base[lo:hi])
    for isa in ISAS:
        _C.set_cpu_isa(isa)
        assert same_bits(Paged("head", 5, klog, vlog, lens, seed=40).attention(q, tseq, tpos, QH), base)


def test_attention_grouped_query_heads_share_kv():
    lens, H, QH, D = [9], 2, 8, 16
    klog, vlog = make_sequences(22, lens, H, D)
    q = rng(23).standard_normal((1, QH, D), np.float32)
    q[0, 4:] = q[0, :4]  # heads 0-3 use KV head 0, heads 4-7 KV head 1
    paged = Paged("page", 4, klog, vlog, lens, seed=24)
    out = paged.attention(q, [0], [8], QH)
    ref = reference_attention(q, klog, vlog, [0], [8])
    assert np.abs(out - ref).max() < 1e-5
    assert not np.allclose(out[0, :4], out[0, 4:])


# ---- refusals: never a crash --------------------------------------------------------------------

def test_bad_arguments_raise_instead_of_crashing():
    x = np.zeros((2, 8), np.float32)
    w = np.zeros((4, 8), np.float32)
    y = np.zeros((2, 4), np.float32)
    _C_test.kernel_linear(y, x, w, F32, None, 2, 8, 4, 1, 1)
    with pytest.raises(ValueError, match="bytes"):
        _C_test.kernel_linear(y, x, w, F32, None, 3, 8, 4, 1, 1)           # x too small for n=3
    with pytest.raises(ValueError):
        _C_test.kernel_linear(y, x.astype(np.float64), w, F32, None, 2, 8, 4, 1, 1)
    with pytest.raises(ValueError, match="C-contiguous"):
        _C_test.kernel_linear(y, np.zeros((8, 2), np.float32).T, w, F32, None, 2, 8, 4, 1, 1)
    with pytest.raises(ValueError, match="writable"):
        ro = y.copy()
        ro.flags.writeable = False
        _C_test.kernel_linear(ro, x, w, F32, None, 2, 8, 4, 1, 1)
    with pytest.raises(gyges.InvalidArgumentError, match="k_splits"):
        _C_test.kernel_linear(y, x, w, F32, None, 2, 8, 4, 3, 1)
    with pytest.raises(gyges.InvalidArgumentError, match="multiple"):
        _C_test.kernel_linear(y, np.zeros((2, 6), np.float32), np.zeros((4, 6), np.float32), F32,
                              None, 2, 6, 4, 4, 1)
    with pytest.raises(gyges.InvalidArgumentError, match="dtype"):
        _C_test.kernel_linear(y, x, w, 9, None, 2, 8, 4, 1, 1)
    with pytest.raises(ValueError, match="negative"):
        _C_test.kernel_linear(y, x, w, F32, None, -2, 8, 4, 1, 1)
    with pytest.raises(ValueError, match="threads"):
        _C_test.kernel_linear(y, x, w, F32, None, 2, 8, 4, 1, 0)
    with pytest.raises(ValueError, match="bias"):
        _C_test.kernel_linear(y, x, w, F32, np.zeros(3, np.float32), 2, 8, 4, 1, 1)
    with pytest.raises(ValueError, match="overflow"):
        _C_test.kernel_linear(y, x, w, F32, None, 2**40, 2**40, 4, 1, 1)
    with pytest.raises(TypeError):
        _C_test.kernel_linear(y, x, w, F32, None, 2, 8, 4, 1)
    has_avx512 = _C_test.kernel_isa_best() == "avx512"
    with pytest.raises(ValueError if has_avx512 else gyges.UnavailableError):
        _C.set_cpu_isa("sse9" if has_avx512 else "avx512")


def test_bad_paged_arguments_raise_instead_of_crashing():
    lens, H, D = [10], 2, 8
    klog, vlog = make_sequences(25, lens, H, D)
    paged = Paged("raw", 4, klog, vlog, lens, seed=26)
    args = dict(seq=np.array([0], np.int32), pos=np.array([9], np.int32),
                indptr=paged.indptr.copy(), indices=paged.indices.copy(), layout=paged.layout, qh=2)

    def call(**kw):
        a = {**args, **kw}
        q = np.zeros((1, a["qh"], D), np.float32)
        out = np.empty_like(q)
        _C_test.kernel_attention(out, q, paged.storage, a["layout"], a["seq"], a["pos"],
                                 a["indptr"],
                                 a["indices"], 1, len(a["indptr"]) - 1, a["qh"], 1)

    call()
    with pytest.raises(gyges.InvalidArgumentError, match="position"):
        call(pos=np.array([12], np.int32))                       # beyond the 3 blocks
    with pytest.raises(gyges.InvalidArgumentError, match="position"):
        call(pos=np.array([-1], np.int32))
    with pytest.raises(gyges.InvalidArgumentError, match="sequence"):
        call(seq=np.array([1], np.int32))
    bad = paged.indices.copy()
    bad[1] = paged.n_blocks
    with pytest.raises(gyges.InvalidArgumentError, match="bt_indices"):
        call(indices=bad)
    with pytest.raises(gyges.InvalidArgumentError, match="decreases"):
        call(indptr=np.array([0, 3, 1], np.int32), indices=paged.indices[:1].copy())
    with pytest.raises(gyges.InvalidArgumentError, match="multiple"):
        call(qh=3)
    with pytest.raises(TypeError, match="layout"):
        call(layout=(0, 4, 2))
    with pytest.raises(gyges.InvalidArgumentError):
        call(layout=(7, 4, 2, D, paged.n_blocks))
    with pytest.raises(ValueError, match="kv has"):
        call(layout=(0, 4, 2, D, paged.n_blocks + 1))            # storage too small for the layout
    with pytest.raises(ValueError, match="bt_indices"):
        call(indices=paged.indices[:-1].copy())
    kv = paged.storage.copy()
    with pytest.raises(gyges.InvalidArgumentError):
        _C_test.kernel_kv_write(kv, paged.layout, np.zeros((1, H, D), np.float32),
                                np.zeros((1, H, D), np.float32), np.array([0], np.int32),
                                np.array([12], np.int32), paged.indptr, paged.indices, 1, 1)
    assert same_bits(kv, paged.storage)  # nothing was written


def test_no_reference_leaks_over_many_calls():
    x = np.ones((2, 16), np.float32)
    w = np.ones((8, 16), np.float32)
    y = np.empty((2, 8), np.float32)
    before = [sys.getrefcount(a) for a in (x, w, y)]
    for _ in range(1000):
        _C_test.kernel_linear(y, x, w, F32, None, 2, 16, 8, 1, 2)
        try:
            _C_test.kernel_linear(y, x, w, F32, None, 3, 16, 8, 1, 2)
        except ValueError:
            pass
    assert [sys.getrefcount(a) for a in (x, w, y)] == before


def test_concurrent_calls_from_python_threads_share_the_pools():
    """The GIL is released around the C work and a pool runs one job at a time: calls from several
    Python threads at once must each get their own, exact, result."""
    import threading
    r = rng(27)
    x = r.standard_normal((5, 200), np.float32)
    ws = [r.standard_normal((300, 200), np.float32) for _ in range(4)]
    expect = [linear(x, w, F32) for w in ws]
    errors = []

    def worker(i):
        try:
            for _ in range(50):
                if not same_bits(linear(x, ws[i], F32, threads=2), expect[i]):
                    errors.append(i)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
