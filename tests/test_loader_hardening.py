"""Model loaders never crash and never misread: every malformed or hostile file (an HF config,
the safetensors index, tokenizer files, a GGUF's metadata and tensors, a chat template) is
refused with a gyges.Error naming the file, the field and the value, within bounded time and
memory. The cases are those a fuzz probe of mutated model files found, each failing (a
non-gyges exception, a wrong model, or unbounded work) before its fix.

A small model of its own shape (2 layers, hidden 64) and a byte-level BPE of 300 tokens keep
every case fast; no packaged model is needed.
"""
import json
import os
import struct
import time

import numpy as np
import pytest

import gyges
from gyges.models import config as config_mod
from gyges.models import gguf_file, tokenizer as tokenizer_mod
from gyges.models.checkpoint import CheckpointError
from gyges.models.config import ConfigError, ModelConfig
from gyges.models.model import load_tokenizer
from gyges.models.safetensors import SafetensorsError

CFG = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
            "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
            "{{ '<|im_start|>assistant\n' }}{% endif %}")
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def model():
    return gyges.Model.random(CFG, seed=3)


def _vocab():
    from tokenizers.pre_tokenizers import ByteLevel
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + sorted(ByteLevel.alphabet())
    merges = ["h e", "l l", "he ll"]
    tokens += [m.replace(" ", "") for m in merges]
    tokens += [f"[PAD{i}]" for i in range(CFG.vocab_size - len(tokens))]
    return tokens, merges


def _hf_tokenizer():
    import tokenizers as tk
    tokens, merges = _vocab()
    backend = tk.Tokenizer(tk.models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                                         merges=[tuple(m.split(" ")) for m in merges]))
    backend.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tk.decoders.ByteLevel()
    backend.add_special_tokens(tokens[:3])
    return backend


@pytest.fixture
def hf_dir(model, tmp_path):
    """An HF checkpoint directory: config.json, model.safetensors, tokenizer.json and
    tokenizer_config.json with a chat template."""
    d = tmp_path / "hf"
    model.save(str(d))
    _hf_tokenizer().save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": TEMPLATE, "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|im_end|>"}, "add_bos_token": False}))
    return d


def _edit_json(path, **changes):
    d = json.loads(path.read_text())
    d.update(changes)
    path.write_text(json.dumps(d))


def _refused(exc, *words):
    """The error is a gyges.Error whose message holds every word (file, field, value)."""
    assert isinstance(exc, gyges.Error), type(exc)
    for w in words:
        assert str(w) in str(exc), (w, str(exc))


# ---- HF config.json: every field has its JSON type ----

@pytest.mark.parametrize("field, value", [
    ("tie_word_embeddings", "false"),  # bool("false") is True: the trained lm_head was dropped
    ("tie_word_embeddings", 0),
    ("attention_bias", "false"),
    ("mlp_bias", "false"),
    ("use_sliding_window", "no"),
    ("pretraining_tp", 1.0),
    ("model_type", ["llama"]),
    ("hidden_act", 1),
    ("rms_norm_eps", "1e-5"),
    ("rope_theta", 10 ** 400),         # math.isfinite raised OverflowError
    ("num_key_value_heads", 1.5),
    ("num_key_value_heads", True),
    ("head_dim", "16"),
    ("num_hidden_layers", 2.0),
    ("eos_token_id", "2"),
    ("eos_token_id", [2, "1"]),
    ("eos_token_id", [2, 300]),
    ("bos_token_id", 1.0),
    ("bos_token_id", False),
])
def test_an_hf_field_of_the_wrong_type_is_refused_by_name(hf_dir, field, value):
    _edit_json(hf_dir / "config.json", **{field: value})
    with pytest.raises(gyges.Error) as e:
        gyges.Model.load(str(hf_dir))
    _refused(e.value, "config.json", field)


def test_a_tied_string_flag_no_longer_drops_the_lm_head(hf_dir):
    _edit_json(hf_dir / "config.json", tie_word_embeddings=False)
    assert "lm_head.weight" in gyges.Model.load(str(hf_dir)).tensors
    with pytest.raises(ConfigError, match="tie_word_embeddings must be true or false, got 'false'"):
        ModelConfig.from_dict({**CFG.to_dict(), "tie_word_embeddings": "false"})


# ---- the JSON files of a checkpoint: parsed in one place ----

def _deep(n):
    return "[" * n + "]" * n


@pytest.mark.parametrize("file", ["config.json", "model.safetensors.index.json"])
@pytest.mark.parametrize("content, words", [
    (_deep(100_000), ["nested too deeply"]),                # RecursionError
    (b"{\"a\": \"\xff\xfe\"}", ["not UTF-8"]),             # UnicodeDecodeError
    ("{\"a\": 1,", ["not valid JSON"]),                     # JSONDecodeError
    ("{\"weight_map\": {}, \"weight_map\": {}, \"a\": 1, \"a\": 2}", ["appears twice"]),
], ids=["deep", "not-utf8", "truncated", "duplicate-key"])
def test_a_broken_json_file_is_refused_naming_it(model, tmp_path, file, content, words):
    d = tmp_path / "hf"
    model.save(str(d), shard_bytes=100_000 if file.startswith("model.") else None)
    _hf_tokenizer().save(str(d / "tokenizer.json"))
    (d / file).write_bytes(content if isinstance(content, bytes) else content.encode())
    for load in (gyges.Model.load, load_tokenizer):
        if load is load_tokenizer and file.startswith("model."):
            continue
        with pytest.raises(gyges.Error) as e:
            load(str(d))
        _refused(e.value, file, *words)


def test_a_json_file_is_read_up_to_a_bound(hf_dir, monkeypatch):
    monkeypatch.setattr(config_mod, "MAX_JSON_BYTES", 100)
    with pytest.raises(gyges.Error, match="config.json: cannot read config: larger than the "
                                          "100-byte limit"):
        gyges.Model.load(str(hf_dir))


def test_an_index_without_a_weight_map_object_is_refused(model, tmp_path):
    model.save(str(tmp_path), shard_bytes=100_000)
    for index in ([1], {"weight_map": [1]}, {"weight_map": {"a": 5}}):
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
        with pytest.raises(CheckpointError, match="model.safetensors.index.json"):
            gyges.Model.load(str(tmp_path))


def test_more_layers_than_the_tensors_hold_is_refused_before_listing_them(hf_dir):
    """expected_shapes(config) lists every layer's names: a config of 2**40 layers would list
    them until memory ran out; the count of tensors present bounds it first."""
    _edit_json(hf_dir / "config.json", num_hidden_layers=2 ** 40)
    t = time.monotonic()
    with pytest.raises(CheckpointError, match="1099511627776 layers, more than the 21 tensors"):
        gyges.Model.load(str(hf_dir))
    assert time.monotonic() - t < 5


# ---- safetensors headers ----

def _header_file(path, header, body=b"\0" * 16):
    blob = json.dumps(header).encode() if not isinstance(header, bytes) else header
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + body)
    return path


@pytest.mark.parametrize("header, words", [
    (b"{\"a\": ", ["not valid JSON"]),
    (("{\"a\": " + _deep(100_000) + "}").encode(), ["not valid JSON"]),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, ["overlaps"]),
    ({"a": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]}}, ["outside the data area"]),
    ({"a": {"dtype": "F8", "shape": [16], "data_offsets": [0, 16]}}, ["unknown", "'F8'"]),
    ({"a": {"dtype": ["F32"], "shape": [4], "data_offsets": [0, 16]}}, ["unknown"]),
    ({"a": {"dtype": "F32", "shape": [2 ** 62, 2 ** 62], "data_offsets": [0, 16]}},
     ["too large"]),
    ({"a": {"dtype": "F32", "shape": [4.0], "data_offsets": [0, 16]}}, ["shape"]),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 2 ** 64]}}, ["needs 16 bytes"]),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [16, 0]}}, ["begin 16 > end 0"]),
    ({"__metadata__": {"a": 1}}, ["__metadata__"]),
    ({"a": 5}, ["must be an object"]),
], ids=lambda v: None if isinstance(v, list) else ("deep" if isinstance(v, bytes) and len(v) > 100
                                                     else None))
def test_a_mutated_safetensors_header_is_refused(tmp_path, header, words):
    from gyges.models import safetensors
    path = _header_file(tmp_path / "x.safetensors", header)
    with pytest.raises(SafetensorsError) as e:
        safetensors.read(path)
    _refused(e.value, path, *words)


def test_a_safetensors_header_length_past_the_file_is_refused(tmp_path):
    from gyges.models import safetensors
    for n in (2 ** 63, 2 ** 64 - 1, 1000):
        path = tmp_path / "x.safetensors"
        path.write_bytes(struct.pack("<Q", n) + b"{}")
        with pytest.raises(SafetensorsError, match="header length"):
            safetensors.read_header(path)
