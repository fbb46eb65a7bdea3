"""The float64 reference model, and the checkpoint loading it runs on.

The reference is what the fast kernels are judged by, so it is itself checked against a closed
form derived by hand, against a scalar pure-Python transcription of the math (lists and the math
module, no NumPy), and against structural properties (RoPE, GQA, KV-cache consistency).
"""

import json
import math
import os
import re

import numpy as np
import pytest

from gyges.models import checkpoint, safetensors
from gyges.models.checkpoint import CheckpointError
from gyges.models.config import ModelConfig
from reference_model import ReferenceModel, apply_rope, attention, rope_inv_freq


def _model(config, seed=0):
    return ReferenceModel(config, checkpoint.random_weights(config, seed))


# ---------------------------------------------------------------- a scalar transcription

def _py_forward(cfg, tensors, tokens):
    """Logits of every position, one token at a time, in plain Python floats.

    RoPE is written as a rotation of each (i, i + d/2) pair, the same math as rotate_half but
    spelled differently, so a slip in either shows up as a mismatch.
    """
    w = {k: np.asarray(v, dtype=np.float64).tolist() for k, v in tensors.items()}
    d, eps = cfg.head_dim, cfg.rms_norm_eps

    def lin(name, x):
        out = [sum(a * b for a, b in zip(row, x)) for row in w[name + ".weight"]]
        if name + ".bias" in w:
            out = [o + b for o, b in zip(out, w[name + ".bias"])]
        return out

    def norm(x, g):
        s = math.sqrt(sum(v * v for v in x) / len(x) + eps)
        return [v / s * gi for v, gi in zip(x, g)]

    def rope(vec, pos):
        out = list(vec)
        for i in range(d // 2):
            angle = pos * cfg.rope_theta ** (-2 * i / d)
            c, s = math.cos(angle), math.sin(angle)
            out[i] = vec[i] * c - vec[i + d // 2] * s
            out[i + d // 2] = vec[i + d // 2] * c + vec[i] * s
        return out

    keys = [[] for _ in range(cfg.num_hidden_layers)]
    values = [[] for _ in range(cfg.num_hidden_layers)]
    all_logits = []
    for pos, tok in enumerate(tokens):
        x = list(w["model.embed_tokens.weight"][tok])
        for layer in range(cfg.num_hidden_layers):
            p = f"model.layers.{layer}."
            h = norm(x, w[p + "input_layernorm.weight"])
            q, k, v = (lin(p + f"self_attn.{n}_proj", h) for n in "qkv")
            heads_k = [rope(k[j * d:(j + 1) * d], pos) for j in range(cfg.num_key_value_heads)]
            keys[layer].append(heads_k)
            values[layer].append([v[j * d:(j + 1) * d] for j in range(cfg.num_key_value_heads)])
            attn = []
            for hq in range(cfg.num_attention_heads):
                kvh = hq * cfg.num_key_value_heads // cfg.num_attention_heads
                qh = rope(q[hq * d:(hq + 1) * d], pos)
                scores = [sum(a * b for a, b in zip(qh, kk[kvh])) / math.sqrt(d)
                          for kk in keys[layer]]
                m = max(scores)
                e = [math.exp(s - m) for s in scores]
                attn += [sum(e[t] * values[layer][t][kvh][i] for t in range(len(e))) / sum(e)
                         for i in range(d)]
            x = [a + b for a, b in zip(x, lin(p + "self_attn.o_proj", attn))]
            h = norm(x, w[p + "post_attention_layernorm.weight"])
            g, u = lin(p + "mlp.gate_proj", h), lin(p + "mlp.up_proj", h)
            act = [gi / (1 + math.exp(-gi)) * ui for gi, ui in zip(g, u)]
            x = [a + b for a, b in zip(x, lin(p + "mlp.down_proj", act))]
        x = norm(x, w["model.norm.weight"])
        head = w["model.embed_tokens.weight"] if cfg.tie_word_embeddings else w["lm_head.weight"]
        all_logits.append([sum(a * b for a, b in zip(row, x)) for row in head])
    return np.array(all_logits)


TINY_CONFIGS = [ModelConfig.tiny(), ModelConfig.qwen2_tiny()]

SMALL = ModelConfig(vocab_size=7, hidden_size=6, intermediate_size=5, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=4, rms_norm_eps=1e-6,
                    rope_theta=100.0, max_position_embeddings=64, bos_token_id=None,
                    eos_token_id=None)


@pytest.mark.parametrize("cfg", [
    SMALL,
    SMALL.replace(model_type="qwen2", attention_bias=True),
    SMALL.replace(tie_word_embeddings=True, num_key_value_heads=2),
], ids=["llama-gqa", "qwen2-bias", "tied-mha"])
def test_matches_scalar_transcription(cfg):
    tensors = checkpoint.random_weights(cfg, seed=3)
    tokens = [3, 0, 6, 3, 5]
    ours = ReferenceModel(cfg, tensors).prefill_logits(tokens)
    theirs = _py_forward(cfg, tensors, tokens)
    # Same float64 math in a different order: agreement to a few ulps of O(1) values.
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-12)


def test_hand_computed_single_token():
    # 1 layer, hidden 4, 1 head, tied Hadamard embedding, identity V and O, zero gate.
    # Token 0 at position 0: x = [1,-1,1,-1], mean(x^2) = 1, so norm1(x) = c*x, c = 1/sqrt(1+eps).
    # One key: softmax = 1 and attention returns v = c*x; residual h = (1+c)*x. MLP: silu(0) = 0.
    # Final norm: s*x with s = (1+c)/sqrt((1+c)^2 + eps). Logits = H @ (s*x) = [4s, 0, 0, 0]
    # because the Hadamard rows are orthogonal.
    eps = 1e-6
    cfg = ModelConfig(vocab_size=4, hidden_size=4, intermediate_size=2, num_hidden_layers=1,
                      num_attention_heads=1, num_key_value_heads=1, rms_norm_eps=eps,
                      tie_word_embeddings=True, bos_token_id=None, eos_token_id=None)
    H = np.array([[1, -1, 1, -1], [1, 1, 1, 1], [1, 1, -1, -1], [1, -1, -1, 1]], float)
    rng = np.random.default_rng(0)
    t = {"model.embed_tokens.weight": H, "model.norm.weight": np.ones(4),
         "model.layers.0.input_layernorm.weight": np.ones(4),
         "model.layers.0.post_attention_layernorm.weight": np.ones(4),
         "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((4, 4)),
         "model.layers.0.self_attn.k_proj.weight": rng.standard_normal((4, 4)),
         "model.layers.0.self_attn.v_proj.weight": np.eye(4),
         "model.layers.0.self_attn.o_proj.weight": np.eye(4),
         "model.layers.0.mlp.gate_proj.weight": np.zeros((2, 4)),
         "model.layers.0.mlp.up_proj.weight": rng.standard_normal((2, 4)),
         "model.layers.0.mlp.down_proj.weight": rng.standard_normal((4, 2))}
    c = 1 / math.sqrt(1 + eps)
    s = (1 + c) / math.sqrt((1 + c) ** 2 + eps)
    logits = ReferenceModel(cfg, t).prefill_logits([0])
    np.testing.assert_allclose(logits, [[4 * s, 0, 0, 0]], rtol=0, atol=1e-14)


# ---------------------------------------------------------------- structural properties

@pytest.mark.parametrize("cfg", TINY_CONFIGS, ids=["llama", "qwen2"])
def test_incremental_decode_equals_prefill(cfg):
    model = _model(cfg)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, size=11)
    full = model.prefill_logits(tokens)
    cache = model.new_cache()
    steps = [model.forward([tok], [i], cache)[0] for i, tok in enumerate(tokens)]
    assert len(cache) == tokens.size
    np.testing.assert_allclose(np.array(steps), full, rtol=0, atol=1e-12)
    # Chunked prefill (uneven chunks) sees the same causal context too.
    cache, chunks, start = model.new_cache(), [], 0
    for size in (3, 1, 5, 2):
        chunks.append(model.forward(tokens[start:start + size],
                                    np.arange(start, start + size), cache))
        start += size
    np.testing.assert_allclose(np.concatenate(chunks), full, rtol=0, atol=1e-12)


def test_rope_position_zero_is_identity_and_relative():
    cfg = ModelConfig.tiny()
    inv_freq = rope_inv_freq(cfg)
    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, 3, cfg.head_dim))
    k = rng.standard_normal((1, 3, cfg.head_dim))
    np.testing.assert_array_equal(apply_rope(q, np.array([0]), inv_freq), q)
    # A rotation: norms are kept, and q.k depends only on the distance between positions.
    r = apply_rope(q, np.array([37]), inv_freq)
    np.testing.assert_allclose(np.linalg.norm(r, axis=-1), np.linalg.norm(q, axis=-1), rtol=1e-13)

    def dot(pq, pk):
        return np.sum(apply_rope(q, np.array([pq]), inv_freq)
                      * apply_rope(k, np.array([pk]), inv_freq), axis=-1)
    np.testing.assert_allclose(dot(10, 3), dot(107, 100), rtol=1e-10)


def test_rope_inv_freq_and_scaling():
    cfg = ModelConfig.tiny()
    d = cfg.head_dim
    np.testing.assert_allclose(rope_inv_freq(cfg), [10000.0 ** (-2 * i / d) for i in range(d // 2)],
                               rtol=1e-15)
    linear = cfg.replace(rope_scaling={"rope_type": "linear", "factor": 4.0})
    np.testing.assert_allclose(rope_inv_freq(linear), rope_inv_freq(cfg) / 4, rtol=1e-15)
    l3 = ModelConfig.llama3_8b().replace(rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})
    base, scaled = rope_inv_freq(ModelConfig.llama3_8b()), rope_inv_freq(l3)
    wavelen = 2 * np.pi / base
    short, long = wavelen < 8192 / 4, wavelen > 8192 / 1
    assert short.any() and long.any() and (~short & ~long).any()
    np.testing.assert_array_equal(scaled[short], base[short])  # high frequencies untouched
    np.testing.assert_allclose(scaled[long], base[long] / 8, rtol=1e-15)
    mid = ~short & ~long  # interpolated: strictly between the two
    assert np.all(scaled[mid] < base[mid]) and np.all(scaled[mid] > base[mid] / 8)


def _plain_mha(q, k, v):
    """softmax(q k^T / sqrt(d) + causal mask) v, every head at once; q, k, v: [t, heads, d]."""
    t, _, d = q.shape
    scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d)
    scores = np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, v)


def test_attention_with_one_query_head_per_kv_head_is_plain_mha():
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((9, 4, 8)) for _ in range(3))
    np.testing.assert_allclose(attention(q, k, v, group=1), _plain_mha(q, k, v), atol=1e-14)


def test_gqa_equals_mha_with_duplicated_kv_heads():
    # Query head h reads KV head h // group: duplicating each KV head's rows `group` times
    # gives an MHA model that must compute exactly the same function.
    gqa_cfg = ModelConfig.tiny()
    group = gqa_cfg.kv_group_size
    mha_cfg = gqa_cfg.replace(num_key_value_heads=gqa_cfg.num_attention_heads)
    t = checkpoint.random_weights(gqa_cfg, seed=4)
    mha = dict(t)
    for i in range(gqa_cfg.num_hidden_layers):
        for n in "kv":
            name = f"model.layers.{i}.self_attn.{n}_proj.weight"
            w = t[name].reshape(gqa_cfg.num_key_value_heads, gqa_cfg.head_dim, -1)
            mha[name] = np.repeat(w, group, axis=0).reshape(mha_cfg.kv_size, -1)
    tokens = [5, 77, 1000, 3, 3, 4095]
    np.testing.assert_allclose(ReferenceModel(mha_cfg, mha).prefill_logits(tokens),
                               ReferenceModel(gqa_cfg, t).prefill_logits(tokens),
                               rtol=0, atol=1e-12)


def test_random_tiny_model_generates_varied_tokens():
    model = _model(ModelConfig.tiny())
    out = model.generate_greedy([1, 5, 9], 32)
    assert len(out) == 32 and all(0 <= x < 4096 for x in out)
    assert len(set(out)) > 8, out  # not constant, and not a short loop
    assert out == model.generate_greedy([1, 5, 9], 32)  # deterministic


@pytest.mark.parametrize("layers", [4, 32])
def test_random_weights_keep_logits_order_one(layers):
    cfg = ModelConfig.tiny().replace(num_hidden_layers=layers)
    logits = _model(cfg).prefill_logits([1, 2, 3, 4, 5])
    assert np.all(np.isfinite(logits))
    assert 0.3 < logits.std() < 3.0


def test_forward_rejects_bad_inputs():
    model = _model(SMALL)
    with pytest.raises(ValueError, match="token ids"):
        model.prefill_logits([7])
    with pytest.raises(ValueError, match="2 tokens but 1 positions"):
        model.forward([1, 2], [0], model.new_cache())
    with pytest.raises(ValueError, match="at least one token"):
        model.generate_greedy([], 3)


# ---------------------------------------------------------------- checkpoints

def test_random_weights_deterministic():
    cfg = ModelConfig.qwen2_tiny()
    a, b = checkpoint.random_weights(cfg, 7), checkpoint.random_weights(cfg, 7)
    c = checkpoint.random_weights(cfg, 8)
    assert list(a) == list(checkpoint.expected_shapes(cfg))
    assert all(a[n].dtype == np.float32 and np.array_equal(a[n], b[n]) for n in a)
    assert not np.array_equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    assert sum(x.size for x in a.values()) == cfg.param_count()


def test_expected_shapes_qwen2_bias_and_tied():
    shapes = checkpoint.expected_shapes(ModelConfig.qwen2_tiny())
    assert shapes["model.layers.3.self_attn.q_proj.bias"] == (256,)
    assert shapes["model.layers.3.self_attn.k_proj.bias"] == (128,)
    assert "model.layers.0.self_attn.o_proj.bias" not in shapes
    assert "lm_head.weight" in shapes
    tied = checkpoint.expected_shapes(ModelConfig.tiny().replace(tie_word_embeddings=True))
    assert "lm_head.weight" not in tied and not any(n.endswith(".bias") for n in tied)
    qwen3 = checkpoint.expected_shapes(ModelConfig.qwen3_32b())
    assert qwen3["model.layers.63.self_attn.k_norm.weight"] == (128,)


@pytest.mark.parametrize("cfg", TINY_CONFIGS, ids=["llama", "qwen2"])
def test_save_load_round_trip_single_file(cfg, tmp_path):
    t = checkpoint.random_weights(cfg, 1)
    assert checkpoint.save(tmp_path, cfg, t) == ["model.safetensors"]
    assert not (tmp_path / checkpoint.INDEX_FILE).exists()
    cfg2, t2 = checkpoint.load(tmp_path)
    assert cfg2 == cfg and list(t2) == list(t)
    for n in t:
        np.testing.assert_array_equal(t2[n], t[n])


def test_save_load_sharded_with_index(tmp_path):
    cfg = ModelConfig.qwen2_tiny()
    t = checkpoint.random_weights(cfg, 2)
    files = checkpoint.save(tmp_path, cfg, t, dtype="bf16", shard_bytes=2_000_000)
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((tmp_path / checkpoint.INDEX_FILE).read_text())
    assert set(index["weight_map"]) == set(t) and set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == 2 * cfg.param_count()
    for f in files:  # each shard within budget unless it holds one oversized tensor
        hdr = safetensors.read_header(tmp_path / f)
        assert hdr.file_size - hdr.data_start <= 2_000_000 or len(hdr.tensors) == 1
    cfg2, t2 = checkpoint.load(tmp_path)
    assert cfg2 == cfg
    for n in t:
        assert t2[n].dtype == np.float32
        np.testing.assert_allclose(t2[n], t[n], rtol=2.0**-8, atol=0)  # bf16 half-ulp
    # Logits from the bf16 copy stay close to the float32 original's.
    a = ReferenceModel(cfg, t).prefill_logits([1, 2, 3])
    b = ReferenceModel(cfg2, t2).prefill_logits([1, 2, 3])
    assert np.max(np.abs(a - b)) < 0.1


def test_tied_checkpoint_drops_lm_head_and_ignores_inv_freq(tmp_path):
    cfg = ModelConfig.tiny().replace(tie_word_embeddings=True)
    t = checkpoint.random_weights(cfg, 3)
    cfg.save(tmp_path)
    extra = dict(t)
    extra["lm_head.weight"] = np.zeros((cfg.vocab_size, cfg.hidden_size), np.float32)
    extra["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(16, np.float32)
    safetensors.write(tmp_path / "model.safetensors", extra)
    _, loaded = checkpoint.load(tmp_path)
    assert set(loaded) == set(t)
    model = ReferenceModel(cfg, loaded)
    assert model.lm_head is model.w["model.embed_tokens.weight"]


def _write_raw_checkpoint(path, cfg, tensors, files=None):
    """Writes config.json and the tensors as given (no checks), split as files says."""
    cfg.save(path)
    files = files or {"model.safetensors": list(tensors)}
    for fname, names in files.items():
        safetensors.write(path / fname, {n: tensors[n] for n in names})


def test_missing_tensor_error(tmp_path):
    cfg = ModelConfig.qwen2_tiny()
    t = checkpoint.random_weights(cfg, 0)
    del t["model.layers.2.self_attn.v_proj.bias"]
    _write_raw_checkpoint(tmp_path, cfg, t)
    # The message names the checkpoint, the tensor and the shape it should have.
    with pytest.raises(CheckpointError, match=re.escape(
            f"{tmp_path}: missing tensor 'model.layers.2.self_attn.v_proj.bias' of shape (128,)")):
        checkpoint.load(tmp_path)


def test_wrong_shape_error_names_tensor_shapes_and_file(tmp_path):
    cfg = ModelConfig.tiny()
    t = checkpoint.random_weights(cfg, 0)
    t["model.layers.1.mlp.up_proj.weight"] = t["model.layers.1.mlp.up_proj.weight"].T.copy()
    _write_raw_checkpoint(tmp_path, cfg, t)
    with pytest.raises(CheckpointError, match=r"'model.layers.1.mlp.up_proj.weight': expected "
                       r"shape \(688, 256\), got \(256, 688\) in .*model.safetensors"):
        checkpoint.load(tmp_path)


def test_unexpected_tensor_is_rejected(tmp_path):
    cfg = ModelConfig.tiny()
    t = checkpoint.random_weights(cfg, 0)
    t["model.layers.0.self_attn.q_norm.weight"] = np.ones(32, np.float32)  # a Qwen3 feature
    _write_raw_checkpoint(tmp_path, cfg, t)
    with pytest.raises(CheckpointError, match="unexpected tensor.*q_norm"):
        checkpoint.load(tmp_path)


def test_duplicate_tensor_across_files_without_index(tmp_path):
    cfg = ModelConfig.tiny().replace(num_hidden_layers=1)
    t = checkpoint.random_weights(cfg, 0)
    names = list(t)
    _write_raw_checkpoint(tmp_path, cfg, t, {"a.safetensors": names[:5],
                                             "b.safetensors": names[4:]})
    with pytest.raises(CheckpointError, match=f"{names[4]!r} appears in both"):
        checkpoint.load(tmp_path)


def test_index_errors(tmp_path):
    cfg = ModelConfig.tiny().replace(num_hidden_layers=1)
    t = checkpoint.random_weights(cfg, 0)
    checkpoint.save(tmp_path, cfg, t, shard_bytes=1_500_000)
    index_path = tmp_path / checkpoint.INDEX_FILE
    index = json.loads(index_path.read_text())
    files = sorted(set(index["weight_map"].values()))
    # The index puts a tensor in a file that does not hold it.
    moved = json.loads(json.dumps(index))
    moved["weight_map"]["model.norm.weight"] = files[0] if \
        index["weight_map"]["model.norm.weight"] != files[0] else files[1]
    index_path.write_text(json.dumps(moved))
    with pytest.raises(CheckpointError, match="places tensor 'model.norm.weight' here"):
        checkpoint.load(tmp_path)
    # The index names a shard that is not there.
    os.remove(tmp_path / files[-1])
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint.load(tmp_path)


def test_save_refuses_bad_input(tmp_path):
    cfg = ModelConfig.tiny().replace(num_hidden_layers=1)
    t = checkpoint.random_weights(cfg, 0)
    with pytest.raises(CheckpointError, match="missing tensor"):
        checkpoint.save(tmp_path / "a", cfg, {k: v for k, v in t.items() if k != "lm_head.weight"})
    with pytest.raises(CheckpointError, match="unknown dtype"):
        checkpoint.save(tmp_path / "b", cfg, t, dtype="int4")
    checkpoint.save(tmp_path / "c", cfg, t)
    with pytest.raises(CheckpointError, match="already holds weights"):
        checkpoint.save(tmp_path / "c", cfg, t)
    (tmp_path / "d").mkdir()
    cfg.save(tmp_path / "d")
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        checkpoint.load(tmp_path / "d")


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_moe_of_identical_experts_is_the_dense_model(family):
    """Renormalised weights sum to 1, so experts that are all one FFN give that FFN: the MoE
    reference equals the dense one (Mixtral against Llama, Qwen3-MoE against Qwen3, the
    attention tensors shared)."""
    dense = SMALL.replace(model_type="qwen3" if family == "qwen3_moe" else "llama")
    moe = dense.replace(model_type=family, num_experts=3, num_experts_per_tok=2,
                        moe_intermediate_size=SMALL.intermediate_size, norm_topk_prob=True)
    tensors = checkpoint.random_weights(dense, seed=4)
    experts = checkpoint.random_weights(moe, seed=5)
    for i in range(dense.num_hidden_layers):
        for (_, names, _), (_, dense_names, _) in zip(
                checkpoint.ffn_units(moe, i), checkpoint.ffn_units(dense, i) * moe.num_experts):
            for kind in ("gate", "up", "down"):
                experts[names[kind]] = tensors[dense_names[kind]]
    for name, array in tensors.items():
        if name in experts:
            experts[name] = array
    tokens = [1, 5, 2, 6, 0]
    np.testing.assert_allclose(ReferenceModel(moe, experts).prefill_logits(tokens),
                               ReferenceModel(dense, tensors).prefill_logits(tokens),
                               rtol=0, atol=1e-12)
