"""The CUDA serving path: backend="cuda" through Worker and Engine, the CUDA forward pass against
the CPU backend and the float64 reference model, the KV cache and page accounting of a CUDA
worker, and the cuBLAS GEMM wrapper against NumPy.

Most tests need a GPU and skip with the reason when gyges was built without CUDA, no device is
visible, or (for the forward pass) the build lacks the paged-attention kernels. The refusal tests
run everywhere: unknown backends, backend="cuda" without a GPU, GEMM shapes refused before the
device, and the KV read path that device caches use (checked here on host arenas).

Tolerance policy (the reason is beside each threshold; the largest error is reported):
  - exact for tokens, ids, page and byte counts;
  - greedy tokens on CUDA fp32 equal the CPU backend's, except where the CPU logits' top two are
    closer than NEAR_TIE of the largest logit at the first divergence: there the order of fp32
    sums (cuBLAS vs the CPU's tree) may legitimately pick the other one, and the rest of the run
    is no longer comparable;
  - fp32 logits within FP32_RTOL of the largest reference logit: both backends accumulate in
    fp32, only the order of sums differs (a few thousand terms at ~6e-8 each);
  - bf16 logits within BF16_RTOL of the largest reference logit: every CUDA activation is
    rounded to bf16 (8 significant bits, relative error up to 2^-9 per rounding), about ten
    roundings a layer over 4 layers, against a reference that rounds only the weights;
  - GEMM: |got - ref| <= 2 u_y (|ref| + |y0| + |bias|) + 2 n_in 2^-24 sum|x w|: one rounding
    to y's dtype (two with a bias folded into y first) plus fp32 accumulation over n_in products
    (exact products on tensor cores for 16-bit inputs).
"""
import numpy as np
import pytest
from reference_model import ReferenceModel
from worker_logits import paged_logits

import gyges
from gyges import _C, _C_test
from gyges.models.config import ModelConfig
from gyges.runtime.kv_cache import KVCache, decode_values
from gyges.models.safetensors import bf16_to_f32, f32_to_bf16
from gyges.runtime.worker import Worker

F32, F16, BF16 = 0, 1, 2  # gy_dtype
OUT_IN, IN_OUT = 0, 1     # gy_gemm_weight
UNIT_ROUNDOFF = {F32: 2.0**-24, F16: 2.0**-11, BF16: 2.0**-8}
NEAR_TIE = 1e-4
FP32_RTOL = 1e-4
BF16_RTOL = 5e-2
KIB, MIB = 1 << 10, 1 << 20


from gpu import GPU_SKIP_REASON  # noqa: E402  (tests/gpu.py)
FORWARD_SKIP_REASON = GPU_SKIP_REASON or _C.cuda_forward_unavailable()
BLAS_SKIP_REASON = GPU_SKIP_REASON or (_C_test.cuda_blas_available() if _C.WITH_CUDA else None)
needs_forward = pytest.mark.skipif(FORWARD_SKIP_REASON is not None,
                                   reason=FORWARD_SKIP_REASON or "")
needs_blas = pytest.mark.skipif(BLAS_SKIP_REASON is not None, reason=BLAS_SKIP_REASON or "")
needs_cuda_build = pytest.mark.skipif(not _C.WITH_CUDA, reason="gyges was built without CUDA")


@pytest.fixture(scope="module")
def tiny():
    return gyges.Model.tiny()


def prompts(n, seed=0, lo=3, hi=70, vocab=4096):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def cuda_worker(model, **kw):
    return Worker(model, backend="cuda", memory=kw.pop("memory", "512MiB"), **kw)


def relative_error(got, want):
    return float(np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max())


# ---- refusals: these run on every machine ----

def test_unknown_backends_are_refused(tiny):
    for bad in ("tpu", "CUDA", "gpu", None):
        with pytest.raises(ValueError, match="unknown backend"):
            Worker(tiny, backend=bad, memory="64MiB")
        with pytest.raises(ValueError, match="unknown backend"):
            gyges.Engine(tiny, backend=bad, memory="64MiB")


def test_kv_dtype_must_fit_the_backend(tiny):
    with pytest.raises(ValueError, match="kv_dtype"):
        Worker(tiny, backend="cpu", memory="64MiB", kv_dtype="bf16")
    with pytest.raises(ValueError, match="kv_dtype"):
        Worker(tiny, backend="cuda", memory="64MiB", weight_dtype="bf16", kv_dtype="f16")


@pytest.mark.skipif(FORWARD_SKIP_REASON is None, reason="this machine runs the CUDA engine")
def test_cuda_backend_without_a_usable_gpu_raises_unavailable(tiny):
    # No GPU (or no CUDA build, or no forward kernels): a clear UnavailableError naming the
    # reason, before any weights are copied, and the CPU backend still works afterwards.
    for make in (lambda: gyges.Engine(tiny, backend="cuda"),
                 lambda: Worker(tiny, backend="cuda", memory="64MiB")):
        with pytest.raises(gyges.UnavailableError) as info:
            make()
        message = str(info.value)
        assert "CUDA" in message and len(message) > 30, message
    out = gyges.Engine(tiny, memory="64MiB").generate([[1, 2, 3]], gyges.SamplingParams(max_tokens=2))
    assert len(out[0].output_tokens) == 2


@needs_cuda_build
def test_gemm_refuses_bad_shapes_before_the_device():
    """Shape and dtype errors are InvalidArgumentError whether or not there is a GPU (they are
    checked before any device call); buffer sizes are ValueError."""
    f32 = lambda n: np.zeros(n, np.float32)
    ok = dict(y=f32(6), x=f32(6), w=f32(9), bias=None, yd=F32, xd=F32, wd=F32, o=OUT_IN,
              m=2, n_in=3, n_out=3, ldx=3, ldy=3, acc=False)

    def call(**kw):
        a = {**ok, **kw}
        _C_test.cuda_gemm(a["y"], a["x"], a["w"], a["bias"], a["yd"], a["xd"], a["wd"], a["o"],
                          a["m"], a["n_in"], a["n_out"], a["ldx"], a["ldy"], a["acc"])

    cases = [
        (dict(xd=BF16), "one dtype"),                      # x and w differ
        (dict(xd=F32, wd=F32, yd=F16), "f32"),             # an f32 product cannot be f16
        (dict(yd=7), "unknown dtype"),
        (dict(o=2), "orientation"),
        (dict(m=-1), "m >= 0"),
        (dict(n_in=0), "n_in > 0"),
        (dict(n_out=0), "n_out > 0"),
        (dict(ldx=2), "leading dimensions"),
        (dict(ldy=2), "leading dimensions"),
        (dict(m=1 << 31), "2\\^31"),
    ]
    for kw, text in cases:
        with pytest.raises(gyges.InvalidArgumentError, match=text):
            call(**kw)
    with pytest.raises(ValueError, match="w has"):
        call(w=f32(8))
    with pytest.raises(ValueError, match="bias has"):
        call(bias=f32(2))
    with pytest.raises(ValueError, match="x has"):
        call(x=f32(5))
    if GPU_SKIP_REASON is not None:  # good shapes reach the device, and there is none
        with pytest.raises(gyges.UnavailableError):
            call()


@pytest.mark.parametrize("layout", ["raw", "page", "header"])
def test_kv_read_path_equals_the_host_gather(layout):
    """Device caches are gathered through arena.read and the layout's strides; on a host arena
    that path must give exactly what the C gather gives, for every layout and an odd start."""
    arena = gyges.Arena(budget="4MiB", page_size="64KiB")
    kv = KVCache(arena, n_layers=3, n_kv_heads=3, head_dim=8, block_size=5, layout=layout)
    kv.grow(2)
    rng = np.random.default_rng(1)
    seqs = [kv.new_sequence() for _ in range(3)]
    for i, s in enumerate(seqs):  # interleaved reservations: non-contiguous block tables
        kv.reserve(s, 4 + 7 * i)
    for s in seqs:
        kv.reserve(s, 23)
    kv.grow(1)  # raw: moves the V half; the strides change with n_blocks
    for s in seqs:
        for layer in range(3):
            k = rng.standard_normal((23, 3, 8)).astype(np.float32)
            kv.write(s, layer, 0, k, k * 2 + 1)
    for s in seqs:
        for layer in range(3):
            for start, n in ((0, 23), (3, 11), (22, 1), (5, 0)):
                want = kv.gather(s, layer, start, n)
                got = kv._gather_copied(s, layer, start, n)
                np.testing.assert_array_equal(got[0], want[0])
                np.testing.assert_array_equal(got[1], want[1])
    with pytest.raises(gyges.InvalidArgumentError):
        kv._gather_copied(seqs[0], 0, 20, 30)


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("layout", ["raw", "page", "header"])
def test_16_bit_kv_is_gathered_through_the_layout(dtype, layout):
    arena = gyges.Arena(budget="4MiB", page_size="64KiB")
    kv = KVCache(arena, n_layers=2, n_kv_heads=2, head_dim=4, block_size=3, layout=layout,
                 dtype=dtype)
    kv.grow(1)
    s = kv.new_sequence()
    kv.reserve(s, 10)
    logical = kv.layer(1)  # (kv, block, token, head, dim) of stored values
    rng = np.random.default_rng(2)
    bits = rng.integers(0, 0x3C00, size=logical.shape).astype(np.uint16)  # finite values
    logical[...] = bits.view(kv.storage_dtype)
    blocks = kv.block_table(s)
    want_k = np.concatenate([logical[0, b] for b in blocks])[:10]
    want_v = np.concatenate([logical[1, b] for b in blocks])[:10]
    del logical
    k, v = kv.gather(s, 1)
    np.testing.assert_array_equal(k, decode_values(want_k, dtype))
    np.testing.assert_array_equal(v, decode_values(want_v, dtype))


def test_arena_write_and_read_round_trip():
    arena = gyges.Arena(budget="1MiB", page_size="64KiB")
    arena.grow(2, 3)
    data = np.arange(40_000, dtype=np.float32)  # slots 2..4, crossing two page boundaries
    arena.write(2 * 64 * KIB + 12, data)
    np.testing.assert_array_equal(arena.read(2 * 64 * KIB + 12, data.nbytes, np.float32), data)
    with pytest.raises(gyges.InvalidArgumentError, match="unmapped"):
        arena.write(0, data[:4])
    with pytest.raises(gyges.InvalidArgumentError, match="unmapped"):
        arena.read(5 * 64 * KIB - 8, 16)


# ---- the GEMM wrapper against NumPy ----

def _encode(values, dtype):
    values = np.asarray(values, np.float32)
    if dtype == BF16:
        return f32_to_bf16(values)
    return values.astype(np.float16 if dtype == F16 else np.float32)


def _decode(array, dtype):
    return (bf16_to_f32(array) if dtype == BF16 else np.asarray(array, np.float32)).astype(np.float64)


GEMM_SHAPES = [(1, 5, 3), (7, 67, 129), (33, 128, 17), (64, 96, 256)]


@needs_blas
@pytest.mark.parametrize("m,n_in,n_out", GEMM_SHAPES)
@pytest.mark.parametrize("orientation", [OUT_IN, IN_OUT])
@pytest.mark.parametrize("dtype,y_dtype", [(F32, F32), (F16, F16), (F16, F32), (BF16, BF16),
                                           (BF16, F32)])
@pytest.mark.parametrize("mode", ["plain", "accumulate", "bias", "bias+accumulate"])
def test_gemm_matches_numpy(m, n_in, n_out, orientation, dtype, y_dtype, mode):
    rng = np.random.default_rng(m * 1000 + n_in + n_out)
    ldx, ldy = n_in + 3, n_out + 5  # strided rows: x and y are column blocks of wider matrices
    x = _encode(rng.standard_normal((m, ldx)), dtype)
    wshape = (n_out, n_in) if orientation == OUT_IN else (n_in, n_out)
    w = _encode(rng.standard_normal(wshape) / np.sqrt(n_in), dtype)
    y0 = _encode(rng.standard_normal((m, ldy)), y_dtype)
    bias = rng.standard_normal(n_out).astype(np.float32) if "bias" in mode else None
    accumulate = "accumulate" in mode
    y = y0.copy()
    _C_test.cuda_gemm(y, x, w, bias, y_dtype, dtype, dtype, orientation, m, n_in, n_out, ldx, ldy,
                      accumulate)
    xv, wv, y0v = _decode(x, dtype)[:, :n_in], _decode(w, dtype), _decode(y0, y_dtype)
    wt = wv.T if orientation == OUT_IN else wv
    ref = xv @ wt
    base = np.zeros((m, n_out))
    if accumulate:
        base += y0v[:, :n_out]
    if bias is not None:
        base += bias
    ref += base
    got = _decode(y, y_dtype)
    tol = (2 * UNIT_ROUNDOFF[y_dtype] * (np.abs(ref) + np.abs(base) + 1e-30)
           + 2 * n_in * 2.0**-24 * (np.abs(xv) @ np.abs(wt)))
    err = np.abs(got[:, :n_out] - ref)
    worst = np.unravel_index(np.argmax(err - tol), err.shape)
    assert (err <= tol).all(), (f"largest error {err.max():.3g}; at {worst}: got "
                                f"{got[:, :n_out][worst]!r}, want {ref[worst]!r}, tol {tol[worst]:.3g}")
    # Columns past n_out are another matrix's: untouched.
    np.testing.assert_array_equal(y[:, n_out:], y0[:, n_out:])


@needs_blas
def test_gemm_with_no_rows_is_a_no_op():
    y = np.full(4, 7.0, np.float32)
    _C_test.cuda_gemm(y, np.zeros(0, np.float32), np.ones(12, np.float32), None, F32, F32, F32,
                      OUT_IN,
                      0, 3, 4, 3, 4, False)
    np.testing.assert_array_equal(y, 7.0)


# ---- the CUDA forward pass against the CPU backend ----

@needs_forward
def test_weights_round_trip_through_device_memory(tiny):
    for dtype in ("f32", "bf16"):
        cpu = Worker(tiny, memory="128MiB", weight_dtype=dtype)
        gpu = cuda_worker(tiny, weight_dtype=dtype)
        assert gpu.arena.backend == "cuda" and not gpu.arena.host_accessible
        assert gpu.c_model.backend == "cuda"
        for name in ("model.embed_tokens.weight", "model.layers.3.self_attn.o_proj.weight",
                     "model.layers.0.input_layernorm.weight"):
            np.testing.assert_array_equal(gpu.weights.read(name), cpu.weights.read(name))
        np.testing.assert_array_equal(gpu.weights.read_ffn(2, "down"), cpu.weights.read_ffn(2, "down"))


@needs_forward
@pytest.mark.parametrize("layout", ["raw", "page", "header"])
def test_fp32_logits_match_the_cpu_backend_in_every_layout(tiny, layout):
    tokens = prompts(1, seed=1, lo=40, hi=41)[0]
    chunks = [30] + [1] * 10  # a prefill then ten decode steps
    cpu = paged_logits(Worker(tiny, memory="64MiB", kv_layout=layout, block_size=8), tokens, chunks)
    gpu = paged_logits(cuda_worker(tiny, kv_layout=layout, block_size=8), tokens, chunks)
    err = relative_error(gpu, cpu)
    assert err < FP32_RTOL, f"{layout}: largest relative error {err:.2e}"


@needs_forward
def test_prefill_and_decode_agree(tiny):
    # The two attention kernels, and any chunking, compute the same positions' logits.
    tokens = prompts(1, seed=4, lo=45, hi=46)[0]
    worker = cuda_worker(tiny, block_size=4)
    base = paged_logits(worker, tokens, [45])
    for chunks in ([1] * 45, [7, 13, 25], [44, 1], [2, 1, 40, 1, 1]):
        err = relative_error(paged_logits(worker, tokens, chunks), base)
        assert err < FP32_RTOL, f"{chunks}: largest relative error {err:.2e}"


@needs_forward
def test_qwen2_biases_match_the_cpu_backend():
    qwen = gyges.Model.random(ModelConfig.qwen2_tiny(), seed=5)
    tokens = prompts(1, seed=6, lo=20, hi=21)[0]
    cpu = paged_logits(Worker(qwen, memory="64MiB"), tokens, [12] + [1] * 8)
    gpu = paged_logits(cuda_worker(qwen), tokens, [12] + [1] * 8)
    assert relative_error(gpu, cpu) < FP32_RTOL


@needs_forward
@pytest.mark.parametrize("scaling", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
], ids=["yarn", "llama3"])
def test_rope_scaling_reaches_the_cuda_kernel(scaling):
    # The kernel rotates by the model's frequencies (and YaRN's mscale), not by theta alone:
    # fp32 logits follow the scaled reference, and are far from the unscaled one.
    config = ModelConfig.tiny().replace(num_hidden_layers=2, rope_scaling=scaling)
    model = gyges.Model.random(config, seed=11)
    tokens = prompts(1, seed=7, lo=90, hi=91)[0]
    gpu = paged_logits(cuda_worker(model), tokens, [70] + [1] * 20)
    err = relative_error(gpu, ReferenceModel(config, model.tensors).prefill_logits(tokens))
    assert err < FP32_RTOL, f"largest relative error {err:.2e}"
    plain = ReferenceModel(config.replace(rope_scaling=None), model.tensors).prefill_logits(tokens)
    assert relative_error(gpu, plain) > 100 * FP32_RTOL


@needs_forward
def test_bf16_logits_track_the_reference_on_rounded_weights(tiny):
    rounded = {k: (bf16_to_f32(f32_to_bf16(v)) if v.ndim == 2 else v) for k, v in tiny.tensors.items()}
    ref = ReferenceModel(tiny.config, rounded)
    tokens = prompts(1, seed=13, lo=25, hi=26)[0]
    want = ref.prefill_logits(tokens)
    worker = cuda_worker(tiny, weight_dtype="bf16")
    assert worker.kv.value_dtype == "bf16"
    got = paged_logits(worker, tokens, [17] + [1] * 8)
    err = relative_error(got, want)
    assert err < BF16_RTOL, f"largest relative error {err:.2e}"


_SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, bos_token_id=None,
              eos_token_id=None)
# Qwen3's q/k norms, and a mixture of experts of each family (Qwen2-MoE: a shared expert
# behind its gate and a dense layer among the sparse ones)
_FAMILIES = {
    "qwen3": ModelConfig(**_SMALL, model_type="qwen3"),
    "mixtral": ModelConfig(**_SMALL, model_type="mixtral", num_experts=5, num_experts_per_tok=2,
                           moe_intermediate_size=96, norm_topk_prob=True),
    "qwen2_moe": ModelConfig(**_SMALL, model_type="qwen2_moe", attention_bias=True,
                             num_experts=6, num_experts_per_tok=3, moe_intermediate_size=32,
                             shared_expert_intermediate_size=80, mlp_only_layers=(1,)),
    "qwen3_moe": ModelConfig(**_SMALL, model_type="qwen3_moe", num_experts=7,
                             num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True),
}


@needs_forward
@pytest.mark.parametrize("family", list(_FAMILIES))
def test_qwen3_and_mixtures_of_experts_track_the_cpu_pass(family):
    """On the device: Qwen3 RMS-normalises each q and k head before the rotation; a mixture of
    experts routes by the fp32 router and the CPU pass's top-k (so a token goes to the same
    experts), runs each expert's tokens as one GEMM and combines them per token; TP2 (virtual
    workers) gives TP1's tokens, and so does EP2 (each worker holds its experts whole, their
    outputs exchanged by the all-reduce). fp32 logits within FP32_RTOL of the CPU pass's."""
    model = gyges.Model.random(_FAMILIES[family], seed=2)
    tokens = prompts(1, seed=14, lo=20, hi=21, vocab=96)[0]
    cpu = paged_logits(Worker(model, memory="64MiB"), tokens, [12] + [1] * 8)
    gpu = paged_logits(cuda_worker(model), tokens, [12] + [1] * 8)
    assert relative_error(gpu, cpu) < FP32_RTOL
    ps = prompts(3, seed=15, vocab=96)
    params = gyges.SamplingParams(max_tokens=8, ignore_eos=True)
    got = {}
    for layout in ("2xTP1", "TP2") + (("TP2EP2",) if model.config.is_moe else ()):
        # 4 shards: a TP2 rank adds two onto its partial sum (each expert's shard on 2 MiB
        # pages of its own: the default budget sizes the workers for that)
        host = gyges.Host(model, workers=2, layout=layout, backend="cuda", devices=0, max_tp=4)
        got[layout] = [r.output_tokens for r in host.generate(ps, params)]
        host.close()
    assert got["TP2"] == got["2xTP1"] and got.get("TP2EP2", got["TP2"]) == got["2xTP1"]


@needs_forward
def test_a_live_expert_parallel_merge_on_cuda_keeps_every_token():
    """2x(TP1EP1) -> TP2EP2 -> 2x(TP1EP1) layer-staggered on two virtual CUDA workers while
    requests decode (Mixtral's 5 experts split 2 and 3): no weight byte copied at the merge,
    the experts back from the peer at the split, and the tokens of a host that never
    transformed."""
    model = gyges.Model.random(_FAMILIES["mixtral"], seed=2)
    ps = prompts(4, seed=16, vocab=96)
    params = gyges.SamplingParams(max_tokens=10, ignore_eos=True)
    kw = dict(workers=2, backend="cuda", devices=0, max_tp=4)
    with gyges.Host(model, layout="2xTP1", **kw) as plain:
        want = [r.output_tokens for r in plain.generate(ps, params)]
    with gyges.Host(model, layout="2xTP1EP1", **kw) as host:
        reqs = [host.submit(p, params) for p in ps]
        host.step()
        merge = host.transform((0, 1), 2, layers_per_step=1)
        while not merge.done:
            host.step()
        assert host.layout() == "TP2EP2" and merge.committed
        assert sum(merge.stats["weight_bytes_copied"].values()) == 0
        assert [host.worker(w).weights.held_experts for w in range(2)] == [{0, 1}, {2, 3, 4}]
        split = host.transform((0, 1), 1, layers_per_step=1)
        while not split.done:
            host.step()
        assert host.layout() == "2xTP1EP1" and split.committed
        host.run()
        assert [r.output_tokens for r in reqs] == want


def _first_divergence(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@needs_forward
def test_greedy_tokens_equal_the_cpu_backend(tiny):
    params = gyges.SamplingParams(max_tokens=48, ignore_eos=True)
    ps = prompts(6, seed=2)
    cpu = gyges.Engine(tiny, memory="64MiB").generate(ps, params)
    gpu_engine = gyges.Engine(tiny, backend="cuda", memory="512MiB")
    gpu = gpu_engine.generate(ps, params)
    checker = Worker(tiny, memory="64MiB")
    for p, a, b in zip(ps, cpu, gpu):
        assert b.finish_reason == "length" and len(b.output_tokens) == 48
        i = _first_divergence(a.output_tokens, b.output_tokens)
        if i is None:
            continue
        # Allowed only at a near-tie of the CPU's own logits (see the module docstring).
        context = p + a.output_tokens[:i]
        logits = paged_logits(checker, context, [len(context)])[-1]
        top = np.sort(logits)[-2:]
        margin = (top[1] - top[0]) / np.abs(logits).max()
        assert margin < NEAR_TIE, (f"tokens differ at {i} ({a.output_tokens[i]} vs "
                                   f"{b.output_tokens[i]}) where the CPU's top-2 margin is "
                                   f"{margin:.2e}")


@needs_forward
def test_two_workers_share_one_gpu(tiny):
    # Separate arenas, streams and cuBLAS handles; stepping them in turn changes nothing.
    params = gyges.SamplingParams(max_tokens=16, ignore_eos=True)
    ps = prompts(4, seed=3)
    alone = gyges.Engine(tiny, backend="cuda", memory="256MiB").generate(ps, params)
    a = gyges.Engine(tiny, backend="cuda", memory="256MiB")
    b = gyges.Engine(tiny, backend="cuda", memory="256MiB", kv_layout="raw")
    ra = [a.submit(p, params) for p in ps]
    rb = [b.submit(p, params) for p in ps]
    while a.has_unfinished() or b.has_unfinished():
        a.step()
        b.step()
    for x, y, z in zip(alone, ra, rb):
        assert x.output_tokens == y.output_tokens == z.output_tokens


@needs_forward
@pytest.mark.parametrize("weight_dtype,rtol", [("f32", 1e-5), ("bf16", 2.0**-5)])
def test_kv_contents_match_the_cpu_engine(tiny, weight_dtype, rtol):
    # fp32: the same K/V up to the order of sums in the projections (1e-5 of the largest value).
    # bf16: the CUDA cache stores bf16 (8 bits) computed from bf16 activations, the CPU's fp32
    # from fp32 activations and the same bf16 weights; the last layer's K/V has been through three
    # layers of bf16 residual stream, each rounding at 2^-9: a few 2^-8 of the largest value.
    # A wrong head, position or layout is off by the values themselves (order 1).
    tokens = prompts(1, seed=7, lo=37, hi=38)[0]
    cpu = Worker(tiny, memory="64MiB", weight_dtype=weight_dtype, kv_layout="page")
    gpu = cuda_worker(tiny, weight_dtype=weight_dtype, kv_layout="raw", block_size=8)
    _, cs = paged_logits(cpu, tokens, [20, 17], keep=True)
    _, gs = paged_logits(gpu, tokens, [20, 17], keep=True)
    for layer in range(tiny.config.num_hidden_layers):
        for want, got in zip(cpu.kv.gather(cs, layer, 0, 37), gpu.kv.gather(gs, layer, 0, 37)):
            err = relative_error(got, want)
            assert err < rtol, f"layer {layer}: largest relative error {err:.2e}"


@needs_forward
def test_cuda_worker_accounting_is_exact(tiny):
    engine = gyges.Engine(tiny, backend="cuda", memory="512MiB", max_batch_tokens=64)
    w = engine.worker
    page, layers = w.page_size, tiny.config.num_hidden_layers
    assert page == 2 * MIB
    base = engine.arena.stats()
    assert base["bytes_in_use"] == w.weights_bytes == w.weights.bytes_total
    assert base["bytes_by_tag"]["weights"] == w.weights_bytes and base["bytes_by_tag"]["kv"] == 0
    reqs = [engine.submit(p, gyges.SamplingParams(max_tokens=30, ignore_eos=True))
            for p in prompts(8, seed=8, lo=50, hi=200)]
    for _ in range(5):
        engine.step()
        s, kv = engine.arena.stats(), engine.kv.stats()
        kv_bytes = kv["pages_per_layer"] * layers * page
        assert kv_bytes > 0
        assert s["bytes_by_tag"]["kv"] == kv_bytes
        assert s["bytes_in_use"] == w.weights_bytes + kv_bytes
    engine.run()
    assert all(r.finished and len(r.output_tokens) == 30 for r in reqs)
    after = engine.arena.stats()
    assert after["bytes_in_use"] == w.weights_bytes and after["bytes_by_tag"]["kv"] == 0
    assert after["peak_bytes"] > w.weights_bytes
    m = engine.memory()
    assert m["in_use"] == m["weights"] and m["kv"] == 0


@needs_forward
def test_bad_requests_are_refused_and_the_cuda_engine_stays_usable(tiny):
    engine = gyges.Engine(tiny, backend="cuda", memory="256MiB")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.submit([1, 4096])
    with pytest.raises(gyges.Error, match="positions"):
        engine.submit([1] * 5000)
    # A direct forward with a token outside the vocabulary is refused before the device.
    w = engine.worker
    seq = w.kv.new_sequence()
    w.kv.grow(1)
    w.kv.reserve(seq, 2)
    with pytest.raises(gyges.InvalidArgumentError, match="vocabulary"):
        w.forward([1, 5000], [0, 0], [0, 1], [w.kv.block_table(seq)], [1])
    w.kv.free(seq)
    out = engine.generate([[1, 2, 3]], gyges.SamplingParams(max_tokens=4))[0]
    assert len(out.output_tokens) == 4
