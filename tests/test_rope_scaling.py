"""RoPE scaling reaches the engine: each supported rope_scaling type, served greedily by
gyges.Engine, gives the float64 reference's tokens with that scaling, and not the unscaled
model's (the defect this guards: scaling was normalised and then ignored, so a Llama 3.1 config
served the unscaled model's tokens). Types we do not implement are refused by name, and a
max_position_embeddings whose rotary table cannot exist is refused rather than crashing.
"""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import gyges
from gyges.models.config import ConfigError, ModelConfig
from gyges.models.rope import rope_frequencies
from gyges.runtime.worker import Worker
from reference_model import ReferenceModel, rope_parameters
from test_engine import paged_logits

# Relative error of fp32 logits against float64 (as tests/test_engine.py).
RTOL = 1e-4

BASE = ModelConfig.tiny().replace(num_hidden_layers=2)

# Each bites within the ~100 positions served: llama3 and yarn are given a short original
# context so that most wavelengths are scaled.
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"type": "dynamic", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn-mscale": {"type": "yarn", "factor": 8, "original_max_position_embeddings": 128,
                    "beta_fast": 16, "beta_slow": 2, "mscale": 0.707, "mscale_all_dim": 1.0,
                    "truncate": False},
    "yarn-attention-factor": {"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.3},
}


def prompts(n, seed, lo=30, hi=60, vocab=4096):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


@pytest.mark.parametrize("name", list(SCALINGS))
def test_each_scaling_serves_the_references_tokens_not_the_unscaled_ones(name):
    config = BASE.replace(rope_scaling=SCALINGS[name])
    model = gyges.Model.random(config, seed=11)
    ref = ReferenceModel(config, model.tensors)
    unscaled = ReferenceModel(BASE, model.tensors)

    # Logits of a prefill and decodes, against both references.
    tokens = prompts(1, seed=1, lo=96, hi=97)[0]
    got = paged_logits(Worker(model, memory="64MiB", page_size="64KiB"), tokens, [80] + [1] * 16)
    want, plain = ref.prefill_logits(tokens), unscaled.prefill_logits(tokens)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < RTOL, f"{name}: largest relative error {err:.2e}"
    off = np.abs(got - plain).max() / np.abs(plain).max()
    assert off > 100 * RTOL, f"{name}: the logits are the unscaled model's ({off:.2e})"

    # Greedy tokens through the engine.
    engine = gyges.Engine(model, memory="64MiB", page_size="64KiB")
    ps = prompts(2, seed=2)
    outs = engine.generate(ps, gyges.SamplingParams(max_tokens=32, ignore_eos=True))
    differs = False
    for p, out in zip(ps, outs):
        assert out.output_tokens == ref.generate_greedy(p, 32), name
        differs |= out.output_tokens != unscaled.generate_greedy(p, 32)
    assert differs, f"{name}: the engine's tokens are the unscaled model's"


@pytest.mark.parametrize("name", list(SCALINGS))
def test_frequencies_match_the_reference(name):
    """gyges/models/rope.py and the reference's own implementation agree to rounding."""
    config = BASE.replace(rope_scaling=SCALINGS[name])
    inv_freq, mscale = rope_frequencies(config)
    want, want_mscale = rope_parameters(config)
    assert inv_freq.shape == (BASE.head_dim // 2,) and inv_freq.dtype == np.float64
    np.testing.assert_allclose(inv_freq, want, rtol=1e-13, atol=0)
    assert mscale == pytest.approx(want_mscale, rel=1e-15)
    assert (mscale == 1.0) == (not name.startswith("yarn"))


def test_unscaled_frequencies_are_the_old_ones_bit_for_bit():
    """theta ** (-2i/d) with the C library's pow, exactly as csrc/cpu/rope.c always computed it
    (so an unscaled model's tables, and its tokens, did not change by a bit)."""
    for config in (BASE, ModelConfig.llama3_8b(), ModelConfig.qwen2_5_14b()):
        inv_freq, mscale = rope_frequencies(config)
        d = config.head_dim
        assert mscale == 1.0
        assert inv_freq.tolist() == [config.rope_theta ** (-(2 * i) / d) for i in range(d // 2)]
    # llama3 with its published parameters (Llama 3.1) scales only the long wavelengths.
    l31 = ModelConfig.llama3_8b().replace(rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})
    scaled, plain = rope_frequencies(l31)[0], rope_frequencies(ModelConfig.llama3_8b())[0]
    assert scaled[0] == plain[0] and scaled[-1] == pytest.approx(plain[-1] / 8, rel=1e-15)


def test_dynamic_uses_one_fixed_base():
    """Dynamic NTK as vLLM: the base of the scaled context max_position_embeddings * factor."""
    config = BASE.replace(rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    d = BASE.head_dim
    base = BASE.rope_theta * (2.0 * 2.0 - 1.0) ** (d / (d - 2))
    np.testing.assert_allclose(rope_frequencies(config)[0],
                               base ** (-np.arange(0, d, 2) / d), rtol=1e-14)
    with pytest.raises(ConfigError, match="head_dim > 2"):
        rope_frequencies(ModelConfig(vocab_size=8, hidden_size=4, intermediate_size=4,
                                     num_hidden_layers=1, num_attention_heads=2,
                                     num_key_value_heads=2, bos_token_id=None, eos_token_id=None,
                                     rope_scaling={"rope_type": "dynamic", "factor": 2.0}))
    with pytest.raises(ConfigError, match="not finite"):
        rope_frequencies(BASE.replace(rope_scaling={"rope_type": "dynamic", "factor": 1e200}))


@pytest.mark.parametrize("scaling,names", [
    ({"rope_type": "longrope", "factor": 2.0, "short_factor": [1.0], "long_factor": [2.0]},
     "'longrope'"),
    ({"type": "su", "short_factor": [1.0], "long_factor": [2.0]}, "'su'"),
    ({"type": "mrope", "mrope_section": [16, 24, 24]}, "'mrope'"),
    ({"rope_type": "ntk-by-parts", "factor": 2.0}, "'ntk-by-parts'"),
    ({"rope_type": ["yarn"], "factor": 2.0}, r"\['yarn'\]"),
    ({"type": 3, "factor": 2.0}, "rope_type 3"),
    ({"rope_type": "yarn", "type": "linear", "factor": 2.0}, "two types"),
])
def test_unsupported_types_are_refused_by_name(scaling, names):
    with pytest.raises(gyges.Error, match=names):
        gyges.Model.random(BASE.to_dict() | {"rope_scaling": scaling})
    with pytest.raises(ConfigError, match=names):
        ModelConfig.from_dict(BASE.to_dict() | {"rope_scaling": scaling})


@pytest.mark.parametrize("scaling,message", [
    ({"rope_type": "yarn"}, "missing 'factor'"),
    ({"rope_type": "dynamic", "factor": True}, "factor must be a positive finite"),
    ({"rope_type": "linear", "factor": float("inf")}, "factor must be a positive finite"),
    ({"rope_type": "linear", "factor": float("nan")}, "factor must be a positive finite"),
    ({"rope_type": "linear", "factor": "2"}, "factor must be a positive finite"),
    ({"rope_type": "yarn", "factor": 4.0, "beta_fast": 0}, "beta_fast must be a positive"),
    ({"rope_type": "yarn", "factor": 4.0, "attention_factor": -1.0}, "attention_factor"),
    ({"rope_type": "yarn", "factor": 4.0, "mscale": float("inf")}, "mscale must be"),
    ({"rope_type": "yarn", "factor": 4.0, "truncate": 1}, "truncate must be true or false"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096.0},
     "original_max_position_embeddings must be a positive integer"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": True},
     "original_max_position_embeddings must be a positive integer"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 2 ** 40}, "below 2\\*\\*31"),
])
def test_parameters_are_validated(scaling, message):
    with pytest.raises(ConfigError, match=message):
        BASE.replace(rope_scaling=scaling)


def test_normalised_scalings_round_trip():
    for scaling in SCALINGS.values():
        config = BASE.replace(rope_scaling=scaling)
        assert config.rope_scaling["rope_type"] == scaling.get("rope_type", scaling.get("type"))
        assert ModelConfig.from_dict(config.to_dict()) == config
    yarn = BASE.replace(rope_scaling={"type": "yarn", "factor": 4, "beta_fast": None})
    assert yarn.rope_scaling == {"rope_type": "yarn", "factor": 4.0}  # null: the default


def test_a_huge_max_position_embeddings_is_refused():
    with pytest.raises(ConfigError, match="max_position_embeddings must be at most 2\\*\\*31"):
        BASE.replace(max_position_embeddings=2 ** 62)
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        BASE.replace(max_position_embeddings=2 ** 31)
    BASE.replace(max_position_embeddings=2 ** 31 - 1)  # the largest int32 position count


def test_a_table_that_cannot_fit_is_refused_by_the_engine_not_a_crash():
    """The C model's init (gy_model_init) sized the rotary table as max_pos * head_dim/2 without
    overflow checks: 2^62 wrapped and segfaulted. The Python layers refuse such a max_pos first
    now, so the C call is made here as the worker makes it, with the sizes they would refuse; and
    an engine whose int32 max_pos needs more memory than the machine has is refused too. Run in a
    child so that a crash is a failure, not the end of the test run."""
    code = textwrap.dedent("""
        import os, gyges
        from gyges.models.config import ModelConfig
        from gyges.runtime.worker import Worker
        model = gyges.Model.random(ModelConfig.tiny().replace(num_hidden_layers=1), seed=1)
        worker = Worker(model, memory="16MiB")
        for max_pos in (2 ** 62, 2 ** 31, 2 ** 63 - 1):
            worker.max_pos = max_pos
            try:
                worker._new_c_model()
            except gyges.Error as e:
                assert "max_pos=%d" % max_pos in str(e), str(e)
                print("refused", max_pos, type(e).__name__)
            else:
                raise SystemExit("max_pos=%d was accepted" % max_pos)
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGESIZE")
        if memory < 2 ** 38:  # 2^31 - 1 positions x 16 pairs x 8 bytes = 256 GiB of tables
            try:
                gyges.Engine(model, memory="16MiB", max_pos=2 ** 31 - 1)
            except gyges.OutOfMemoryError as e:
                assert "max_pos=2147483647" in str(e), str(e)
                print("refused", 2 ** 31 - 1, type(e).__name__)
            else:
                raise SystemExit("an engine of 2**31 - 1 positions was accepted")
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stderr + done.stdout
    small = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGESIZE") < 2 ** 38
    assert done.stdout.count("refused") == 3 + small, done.stdout
