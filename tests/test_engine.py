"""The single-worker engine against the float64 reference model, and the bit-exactness it
promises: every KV layout, batch composition, prefill chunking and FFN padding gives the same
bits. Tolerance policy: logits within 1e-4 relative to the largest reference logit (fp32
accumulation over a few thousand terms); tokens and promised bit-exactness are compared exactly."""
import numpy as np
import pytest
from reference_model import ReferenceModel
from worker_logits import paged_logits

import gyges
from gyges.models.config import ModelConfig
from gyges.runtime.worker import Worker

RTOL = 1e-4


@pytest.fixture(scope="module")
def tiny():
    return gyges.Model.tiny()


@pytest.fixture(scope="module")
def qwen():
    return gyges.Model.random(ModelConfig.qwen2_tiny(), seed=5)


def prompts(n, seed=0, lo=3, hi=70, vocab=4096):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


@pytest.mark.parametrize("which", ["tiny", "qwen"])
def test_prefill_and_decode_logits_match_the_reference(which, tiny, qwen):
    model = tiny if which == "tiny" else qwen
    ref = ReferenceModel(model.config, model.tensors)
    tokens = prompts(1, seed=1, lo=40, hi=41)[0]
    want = ref.prefill_logits(tokens)
    worker = Worker(model, memory="64MiB", page_size="64KiB")
    # A prefill of 30 tokens, then 10 decode steps.
    got = paged_logits(worker, tokens, [30] + [1] * 10)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < RTOL, f"largest relative error {err:.2e}"


def test_a_model_copying_its_rotary_tables_gives_the_same_logits(tiny):
    """A worker's next C model copies the rotary tables of the current one (a transformation
    builds one per new rank); the logits must not change by a bit. Tables that do not match
    (another max_pos) are computed, not copied: positions past the shorter table would be wrong."""
    worker = Worker(tiny, memory="64MiB", page_size="64KiB")
    tokens = prompts(1, seed=3, lo=100, hi=101)[0]
    computed = paged_logits(worker, tokens, [80] + [1] * 20)
    worker.c_model = worker._new_c_model()  # tables copied from the first
    np.testing.assert_array_equal(paged_logits(worker, tokens, [80] + [1] * 20), computed)
    worker.c_model = Worker(tiny, memory="64MiB", page_size="64KiB", max_pos=64).c_model
    worker.c_model = worker._new_c_model()  # 4096 positions: not from a table of 64
    np.testing.assert_array_equal(paged_logits(worker, tokens, [80] + [1] * 20), computed)
    worker.c_model = "tables"
    with pytest.raises(TypeError, match="tables_from must be a Model"):
        worker._new_c_model()


@pytest.mark.parametrize("which", ["tiny", "qwen"])
def test_greedy_tokens_equal_the_reference_for_64_steps(which, tiny, qwen):
    model = tiny if which == "tiny" else qwen
    ref = ReferenceModel(model.config, model.tensors)
    engine = gyges.Engine(model, memory="64MiB", page_size="64KiB")
    ps = prompts(3, seed=2)
    outs = engine.generate(ps, gyges.SamplingParams(max_tokens=64, ignore_eos=True))
    for p, out in zip(ps, outs):
        assert out.output_tokens == ref.generate_greedy(p, 64)
        assert out.finish_reason == "length"


def test_every_kv_layout_gives_identical_logits(tiny):
    tokens = prompts(1, seed=3, lo=50, hi=51)[0]
    results = []
    for layout in ("raw", "page", "header"):
        worker = Worker(tiny, memory="64MiB", page_size="64KiB", kv_layout=layout, block_size=8)
        results.append(paged_logits(worker, tokens, [20, 17, 1, 1, 11]))
    for other in results[1:]:
        np.testing.assert_array_equal(results[0], other)


def test_chunking_and_block_size_do_not_change_a_bit(tiny):
    tokens = prompts(1, seed=4, lo=45, hi=46)[0]
    base = paged_logits(Worker(tiny, memory="64MiB", block_size=16), tokens, [45])
    for block_size, chunks in ((16, [1] * 45), (4, [7, 13, 25]), (32, [44, 1])):
        worker = Worker(tiny, memory="64MiB", block_size=block_size)
        np.testing.assert_array_equal(paged_logits(worker, tokens, chunks), base)


def test_padded_ffn_equals_the_unpadded_layout(tiny):
    tokens = prompts(1, seed=6, lo=30, hi=31)[0]
    padded = paged_logits(Worker(tiny, memory="64MiB", pad_ffn=True), tokens, [30])
    packed = paged_logits(Worker(tiny, memory="64MiB", pad_ffn=False), tokens, [30])
    np.testing.assert_array_equal(padded, packed)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_request_gives_the_same_tokens_alone_and_in_a_batch_of_32(tiny, temperature):
    params = gyges.SamplingParams(max_tokens=20, temperature=temperature, top_p=0.95, seed=11,
                                  ignore_eos=True)
    ps = prompts(32, seed=7)
    alone = gyges.Engine(tiny, memory="64MiB").generate([ps[5]], params)[0].output_tokens
    batched = gyges.Engine(tiny, memory="128MiB", max_batch_tokens=256).generate(ps, params)
    assert batched[5].output_tokens == alone
    chunked = gyges.Engine(tiny, memory="64MiB", max_prefill_chunk=7,
                           max_batch_tokens=16).generate([ps[5]], params)[0]
    assert chunked.output_tokens == alone


def test_preemption_by_recompute_loses_nothing(tiny):
    ps = prompts(12, seed=8, lo=60, hi=90)
    params = gyges.SamplingParams(max_tokens=40, ignore_eos=True)
    roomy = gyges.Engine(tiny, memory="64MiB").generate(ps, params)
    # Just over the weights: KV for only a few requests at a time, so requests get preempted.
    tight = gyges.Engine(tiny, memory="25MiB", page_size="64KiB", max_batch_tokens=128)
    outs = tight.generate(ps, params)
    assert tight.stats()["preemptions"] > 0
    for a, b in zip(roomy, outs):
        assert a.output_tokens == b.output_tokens


def test_stop_tokens_and_metrics(tiny):
    engine = gyges.Engine(tiny, memory="64MiB")
    p = prompts(1, seed=9)[0]
    free_run = engine.generate([p], gyges.SamplingParams(max_tokens=12, ignore_eos=True))[0]
    stop_at = free_run.output_tokens[4]
    stopped = engine.generate([p], gyges.SamplingParams(max_tokens=12, stop_token_ids=(stop_at,),
                                                        ignore_eos=True))[0]
    first = free_run.output_tokens.index(stop_at)
    assert stopped.output_tokens == free_run.output_tokens[:first + 1]
    assert stopped.finish_reason == "stop"
    m = free_run.metrics
    assert len(m.token_times) == 12
    assert m.arrival <= m.scheduled <= m.first_token <= m.finish
    assert m.ttft > 0 and m.tpot > 0 and m.e2e >= m.ttft
    assert np.all(m.itl >= 0)


def test_memory_returns_to_the_weights_baseline(tiny):
    engine = gyges.Engine(tiny, memory="64MiB")
    baseline = engine.memory()
    assert baseline["in_use"] == baseline["weights"] and baseline["kv"] == 0
    engine.generate(prompts(8, seed=10), gyges.SamplingParams(max_tokens=10))
    after = engine.memory()
    assert after["peak"] > baseline["in_use"]
    assert after["in_use"] == baseline["in_use"] and after["kv"] == 0


def test_bad_input_raises_and_the_engine_stays_usable(tiny):
    engine = gyges.Engine(tiny, memory="32MiB")
    bad = [
        (lambda: engine.submit([], gyges.SamplingParams()), ValueError, "at least one token"),
        (lambda: engine.submit([1, 4096]), ValueError, "outside the vocabulary"),
        (lambda: engine.submit([1, -1]), ValueError, "outside the vocabulary"),
        (lambda: engine.submit("hello"), ValueError, "sequence of token ids"),
        (lambda: gyges.SamplingParams(temperature=float("nan")), ValueError, "temperature"),
        (lambda: gyges.SamplingParams(temperature=-1.0), ValueError, "temperature"),
        (lambda: gyges.SamplingParams(max_tokens=0), ValueError, "max_tokens"),
        (lambda: gyges.SamplingParams(top_p=0.0), ValueError, "top_p"),
        (lambda: engine.submit([1] * 5000), gyges.Error, "positions"),
        (lambda: engine.submit([1, 2], gyges.SamplingParams(top_k=5000)), ValueError, "top_k"),
    ]
    for call, error, text in bad:
        with pytest.raises(error, match=text):
            call()
    # A request that cannot fit in what is left after the weights is refused at submit time.
    with pytest.raises(gyges.InvalidArgumentError, match="never fit"):
        engine.submit([1] * 2000, gyges.SamplingParams(max_tokens=2000))
    out = engine.generate([[1, 2, 3]], gyges.SamplingParams(max_tokens=4))[0]
    assert len(out.output_tokens) == 4


def test_checkpoint_round_trip_serves_the_same_tokens(tiny, tmp_path):
    tiny.save(tmp_path / "ckpt", dtype="f32", shard_bytes=4 << 20)
    loaded = gyges.Model.load(tmp_path / "ckpt")
    params = gyges.SamplingParams(max_tokens=8, ignore_eos=True)
    p = prompts(1, seed=12)
    a = gyges.Engine(tiny, memory="64MiB").generate(p, params)[0].output_tokens
    b = gyges.Engine(loaded, memory="64MiB").generate(p, params)[0].output_tokens
    assert a == b


def test_bf16_weights_track_the_reference_on_rounded_weights(tiny):
    from gyges.models.safetensors import bf16_to_f32, f32_to_bf16
    rounded = {k: (bf16_to_f32(f32_to_bf16(v)) if v.ndim == 2 else v) for k, v in tiny.tensors.items()}
    ref = ReferenceModel(tiny.config, rounded)
    tokens = prompts(1, seed=13, lo=25, hi=26)[0]
    want = ref.prefill_logits(tokens)
    got = paged_logits(Worker(tiny, memory="64MiB", weight_dtype="bf16"), tokens, [25])
    assert np.abs(got - want).max() / np.abs(want).max() < RTOL
