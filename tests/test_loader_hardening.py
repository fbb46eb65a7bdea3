"""Model loaders never crash and never misread: every malformed or hostile file (an HF config,
the safetensors index, tokenizer files, a GGUF's metadata and tensors, a chat template) is
refused with a gyges.Error naming the file, the field and the value, within bounded time and
memory. The cases are those a fuzz probe of mutated model files found, each failing (a
non-gyges exception, a wrong model, or unbounded work) before its fix.

A small model of its own shape (2 layers, hidden 64) and a byte-level BPE of 300 tokens keep
every case fast; no packaged model is needed.
"""
import json
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
from gguf_writer import gguf_tensors

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


@pytest.mark.parametrize("scaling", [{"factor": 4.0}, {"a": {"a": 1}}, {"value": 1}])
def test_a_rope_scaling_with_parameters_but_no_type_is_refused(hf_dir, scaling):
    """It loaded as no scaling (the fuzz harness found it): a scaling was meant, but which?"""
    _edit_json(hf_dir / "config.json", rope_scaling=scaling)
    with pytest.raises(gyges.Error) as e:
        gyges.Model.load(str(hf_dir))
    _refused(e.value, "config.json", "no rope_type")


def test_rope_parameters_of_transformers_5_are_read(hf_dir):
    d = json.loads((hf_dir / "config.json").read_text())
    del d["rope_theta"], d["rope_scaling"]
    d["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0}
    (hf_dir / "config.json").write_text(json.dumps(d))
    c = gyges.Model.load(str(hf_dir)).config  # rope_theta was the default 10000 silently
    assert c.rope_theta == 500000.0 and c.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    _edit_json(hf_dir / "config.json", rope_parameters=[1])
    with pytest.raises(gyges.Error, match="rope_parameters must be an object"):
        gyges.Model.load(str(hf_dir))
    _edit_json(hf_dir / "config.json", rope_parameters=None, partial_rotary_factor=0.5)
    with pytest.raises(gyges.Error, match="partial_rotary_factor=0.5"):
        gyges.Model.load(str(hf_dir))


def test_a_tied_string_flag_no_longer_drops_the_lm_head(hf_dir):
    _edit_json(hf_dir / "config.json", tie_word_embeddings=False)
    assert "lm_head.weight" in gyges.Model.load(str(hf_dir)).tensors
    with pytest.raises(ConfigError, match="tie_word_embeddings must be true or false, got 'false'"):
        ModelConfig.from_dict({**CFG.to_dict(), "tie_word_embeddings": "false"})


# ---- the JSON files of a checkpoint: parsed in one place ----

def _deep(n):
    return "[" * n + "]" * n


@pytest.mark.parametrize("file", ["config.json", "model.safetensors.index.json",
                                  "tokenizer_config.json"])
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


def test_a_shard_tensor_the_index_leaves_out_is_refused(model, tmp_path):
    from gyges.models import safetensors
    model.save(str(tmp_path), shard_bytes=100_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = tmp_path / index["weight_map"]["model.norm.weight"]
    tensors = safetensors.read(shard)
    tensors["model.layers.0.self_attn.q_norm.weight"] = np.ones(16, np.float32)
    shard.unlink()
    safetensors.write(shard, tensors)
    with pytest.raises(CheckpointError, match="holds tensor 'model.layers.0.self_attn.q_norm"
                                              ".weight', which model.safetensors.index.json"):
        gyges.Model.load(str(tmp_path))


def test_a_value_no_check_foresaw_is_still_a_config_error(hf_dir):
    _edit_json(hf_dir / "config.json", rope_scaling={"rope_type": ["linear"], "factor": 2.0})
    with pytest.raises(gyges.Error, match="config.json"):
        gyges.Model.load(str(hf_dir))


def test_more_layers_than_the_tensors_hold_is_refused_before_listing_them(hf_dir):
    """expected_shapes(config) lists every layer's names: a config of 2**40 layers would list
    them until memory ran out; the count of tensors present bounds it first."""
    _edit_json(hf_dir / "config.json", num_hidden_layers=2 ** 40)
    t = time.monotonic()
    with pytest.raises(CheckpointError, match="1099511627776 layers, more than the 21 tensors"):
        gyges.Model.load(str(hf_dir))
    assert time.monotonic() - t < 5


# ---- tokenizer files of an HF directory ----

@pytest.mark.parametrize("settings, words", [
    ([], ["must be a JSON object"]),
    ({"chat_template": 5}, ["chat_template", "5"]),
    ({"chat_template": [{"name": "x"}]}, ["chat_template"]),
    ({"bos_token": 5}, ["bos_token", "5"]),                # AttributeError / wrong id before
    ({"eos_token": {"content": 5}}, ["eos_token"]),
    ({"eos_token": ["<|im_end|>"]}, ["eos_token"]),
    ({"add_bos_token": "false"}, ["add_bos_token", "'false'"]),
])
def test_tokenizer_settings_of_the_wrong_type_are_refused(hf_dir, settings, words):
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(settings))
    for load in (gyges.Model.load, load_tokenizer):
        with pytest.raises(CheckpointError) as e:
            load(str(hf_dir))
        _refused(e.value, "tokenizer_config.json", *words)


def test_named_chat_templates_and_chat_template_jinja_are_read(hf_dir):
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "T"}, {"name": "default", "template": TEMPLATE}]}))
    tok = load_tokenizer(str(hf_dir))
    assert tok.chat_template == TEMPLATE
    assert tok.apply_chat_template(HI) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    (hf_dir / "tokenizer_config.json").write_text("{}")
    (hf_dir / "chat_template.jinja").write_text("J{{ messages[0]['content'] }}")
    assert load_tokenizer(str(hf_dir)).apply_chat_template(HI) == "JHi"


def test_a_malformed_tokenizer_json_is_refused_naming_it(hf_dir):
    (hf_dir / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": 5}}))
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        load_tokenizer(str(hf_dir))


# ---- chat templates: compiled and rendered in a sandbox with a budget ----

def _with_template(hf_dir, template):
    _edit_json(hf_dir / "tokenizer_config.json", chat_template=template)
    return load_tokenizer(str(hf_dir))


@pytest.mark.parametrize("template, kind", [
    ("{% for %}", "TemplateSyntaxError"),
    ("{{ ''.__class__.__mro__ }}", "SecurityError"),
    ("{{ messages[0].nothing.more }}", "UndefinedError"),
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
    ("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", "RecursionError"),
    ("{% include 'other' %}", "no loader"),
], ids=["syntax", "security", "undefined", "zerodiv", "macro-recursion", "deep-parens",
        "include"])
def test_a_broken_chat_template_is_a_gyges_error_naming_it(hf_dir, template, kind):
    tok = _with_template(hf_dir, template)
    with pytest.raises(tokenizer_mod.ChatTemplateError) as e:
        tok.apply_chat_template(HI)
    _refused(e.value, "chat template", "tokenizer_config.json", kind)


def test_the_templates_own_refusal_stays_about_the_messages(hf_dir):
    tok = _with_template(hf_dir, "{{ raise_exception('no system role') }}")
    with pytest.raises(gyges.InvalidArgumentError, match="refused the messages: no system role"):
        tok.apply_chat_template(HI)


@pytest.mark.parametrize("template", [
    "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
    "{% for i in range(99999) %}{% for j in range(99999) %}x{% endfor %}{% endfor %}",
    "{% set r = range(99999) %}{% for a in r %}{% for b in r %}{% endfor %}{% endfor %}",
    "{% set s = 'x' * 50000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
    "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}",
])
def test_a_chat_template_stops_at_its_time_limit(hf_dir, monkeypatch, template):
    monkeypatch.setattr(tokenizer_mod, "TEMPLATE_SECONDS", 0.2)
    tok = _with_template(hf_dir, template)
    t = time.monotonic()
    with pytest.raises(gyges.LimitError, match="tokenizer_config.json ran past its 0.2 s limit"):
        tok.apply_chat_template(HI)
    assert time.monotonic() - t < 0.2 + 0.5  # stopped within a bounded step of the deadline


@pytest.mark.parametrize("template", [
    "{{ 'x' * 1000000000 }}",
    "{{ 'x'.ljust(1000000000) }}",
    "{{ 'x'|center(1000000000) }}",
    "{{ '%0999999999d' % 1 }}",
    "{{ '{:>999999999}'.format(1) }}",
    "{{ 10 ** 100000000 }}",
    "{% set s = 'x' * 100000 %}{{ s.replace('', s) }}",
    "{% set s = 'x' * 100000 %}{{ s.join(s) }}",
    "{{ ('x\n' * 100000)|indent(100000) }}",
    "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}",
    "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
    "{% endfor %}",
    "{% for i in range(99999) %}{{ 'x' * 99999 }}{% endfor %}",
])
def test_a_chat_template_stops_at_its_size_limit(hf_dir, template):
    tok = _with_template(hf_dir, template)
    t = time.monotonic()
    with pytest.raises(gyges.LimitError, match="chat template of .*tokenizer_config.json builds"):
        tok.apply_chat_template(HI)
    assert time.monotonic() - t < 1.0


def test_the_size_limit_grows_with_the_messages(hf_dir):
    tok = _with_template(hf_dir, "{% for m in messages %}{{ m['content'] * 4 }}{% endfor %}")
    long = [{"role": "user", "content": "y" * (2 << 20)}]
    assert len(tok.apply_chat_template(long)) == 8 << 20


# ---- GGUF files ----


def _gguf_meta(config):
    import gguf
    T = gguf.GGUFValueType
    tokens, merges = _vocab()
    return {
        "llama.block_count": (config.num_hidden_layers, T.UINT32),
        "llama.context_length": (config.max_position_embeddings, T.UINT32),
        "llama.embedding_length": (config.hidden_size, T.UINT32),
        "llama.feed_forward_length": (config.intermediate_size, T.UINT32),
        "llama.attention.head_count": (config.num_attention_heads, T.UINT32),
        "llama.attention.head_count_kv": (config.num_key_value_heads, T.UINT32),
        "llama.attention.layer_norm_rms_epsilon": (config.rms_norm_eps, T.FLOAT32),
        "llama.rope.freq_base": (config.rope_theta, T.FLOAT32),
        "llama.rope.dimension_count": (config.head_dim, T.UINT32),
        "tokenizer.ggml.bos_token_id": (1, T.UINT32),
        "tokenizer.ggml.eos_token_id": (2, T.UINT32),
        "tokenizer.ggml.model": ("gpt2", T.STRING),
        "tokenizer.ggml.tokens": (tokens, T.ARRAY, T.STRING),
        "tokenizer.ggml.token_type": ([3, 3, 3] + [1] * (len(tokens) - 3), T.ARRAY, T.INT32),
        "tokenizer.ggml.merges": (merges, T.ARRAY, T.STRING),
        "tokenizer.chat_template": (TEMPLATE, T.STRING),
    }


def write_gguf(path, model, meta=None, tensors=None, drop=()):
    """A GGUF of `model` (the `gguf` package's writer), with metadata values replaced or added
    (meta: key -> (value, type[, sub_type])), tensors replaced or added, and keys or tensors
    dropped."""
    import gguf
    w = gguf.GGUFWriter(str(path), "llama")
    for key, v in {**_gguf_meta(model.config), **(meta or {})}.items():
        if key not in drop:
            w.add_key_value(key, v[0], v[1], sub_type=v[2] if len(v) > 2 else None)
    for name, t in {**gguf_tensors(model), **(tensors or {})}.items():
        if name not in drop:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _types():
    import gguf
    return gguf.GGUFValueType


def test_a_written_gguf_loads_with_its_tokenizer(model, tmp_path):
    path = write_gguf(tmp_path / "m.gguf", model)
    loaded = gyges.Model.load(path)
    assert loaded.config == CFG
    for name, t in model.tensors.items():
        assert np.array_equal(loaded.tensors[name], t), name
    assert loaded.tokenizer.apply_chat_template(HI).endswith("<|im_start|>assistant\n")
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("hello")) == "hello"


@pytest.mark.parametrize("key, value, words", [
    ("llama.attention.head_count_kv", (1.5, "FLOAT32"), ["1.5"]),        # int() made it 1
    ("llama.attention.head_count", (1e-40, "FLOAT32"), []),              # ZeroDivisionError
    ("llama.attention.head_count", (0, "UINT32"), ["0"]),                # ZeroDivisionError
    ("llama.feed_forward_length", ("yarn", "STRING"), ["'yarn'"]),       # ValueError
    ("llama.feed_forward_length", (float("inf"), "FLOAT32"), ["inf"]),   # OverflowError
    ("llama.embedding_length", ([1, 2], "ARRAY", "INT32"), ["[1, 2]"]),  # TypeError
    ("llama.vocab_size", ([1.5], "ARRAY", "FLOAT32"), ["[1.5]"]),        # TypeError
    ("llama.attention.layer_norm_rms_epsilon", (float("nan"), "FLOAT32"), ["nan"]),
    ("llama.rope.freq_base", ("x", "STRING"), ["'x'"]),
    ("llama.context_length", (True, "BOOL"), ["True"]),
    ("llama.block_count", (3, "UINT32"), ["block_count is 3", "blk.0 to blk.1"]),
    ("llama.block_count", (2 ** 32 - 1, "UINT32"), ["block_count is 4294967295"]),  # MemoryError
    ("llama.rope.dimension_count", (float("nan"), "FLOAT32"), ["nan"]),  # ignored before
    ("llama.rope.dimension_count", ("x", "STRING"), ["'x'"]),
    ("llama.rope.dimension_count", (8, "UINT32"), ["partial rotary"]),
    ("llama.rope.dimension_sections", ([4, 4], "ARRAY", "INT32"), []),
    ("llama.rope.scaling.yarn_ext_factor", (1.0, "FLOAT32"), []),
    ("llama.rope.scaling.factor", (4.0, "FLOAT32"), ["a scaling without its type"]),
    ("llama.attention.sliding_window", (64, "UINT32"), ["not supported"]),
    ("llama.logit_scale", (0.5, "FLOAT32"), ["not supported"]),
    ("llama.expert_count", (8, "UINT32"), ["no 'llama.expert_used_count'"]),
    ("llama.expert_gating_func", (2, "UINT32"), ["not supported"]),
    ("llama.rope.scaling.type", (["linear"], "ARRAY", "STRING"), ["['linear']"]),
    ("llama.rope.scaling.type", ("longrope", "STRING"), ["longrope"]),
    ("llama.attention.value_length", (8, "UINT32"), ["value_length 8"]),
    ("tokenizer.ggml.bos_token_id", (float("nan"), "FLOAT32"), ["nan"]),  # ValueError
    ("tokenizer.ggml.eos_token_id", (1e300, "FLOAT64"), ["1e+300"]),     # OverflowError
    ("tokenizer.ggml.eos_token_id", (300, "UINT32"), ["300"]),
    # float keys of an integer type (llama.cpp refuses them too): read as 9.2e18 before
    ("llama.attention.layer_norm_rms_epsilon", (2 ** 63, "UINT64"), ["a finite float"]),
    ("llama.rope.freq_base", (10000, "UINT32"), ["a finite float"]),
    # angles of 1e30 radians: the engine and the reference agreed on nothing (the fuzz found it)
    ("llama.rope.freq_base", (1e-30, "FLOAT32"), ["rope_theta must be above 1"]),
])
def test_gguf_metadata_of_the_wrong_type_or_value_is_refused_by_name(model, tmp_path, key,
                                                                     value, words):
    T = _types()
    v = (value[0], getattr(T, value[1]), *(getattr(T, s) for s in value[2:]))
    path = write_gguf(tmp_path / "m.gguf", model, meta={key: v})
    t = time.monotonic()
    with pytest.raises(gyges.Error) as e:
        gyges.Model.load(path)
    assert time.monotonic() - t < 5
    _refused(e.value, path, key, *words)


@pytest.mark.parametrize("drop", ["llama.attention.head_count", "llama.block_count"])
def test_a_missing_gguf_key_is_named(model, tmp_path, drop):
    path = write_gguf(tmp_path / "m.gguf", model, drop=(drop,))
    with pytest.raises(CheckpointError, match=f"no '{drop}'"):
        gyges.Model.load(path)


def test_gguf_rope_scaling_becomes_the_hf_dict(model, tmp_path):
    T = _types()
    linear = {"llama.rope.scaling.type": ("linear", T.STRING),
              "llama.rope.scaling.factor": (2.0, T.FLOAT32)}
    loaded = gyges.Model.load(write_gguf(tmp_path / "a.gguf", model, meta=linear))
    assert loaded.config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    none = {"llama.rope.scaling.type": ("none", T.STRING)}
    assert gyges.Model.load(write_gguf(tmp_path / "b.gguf", model, meta=none)) \
        .config.rope_scaling is None
    yarn = {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
            "llama.rope.scaling.original_context_length": 32768,
            "llama.rope.scaling.yarn_beta_fast": 32.0, "llama.rope.scaling.attn_factor": 1.0}
    assert gguf_file.rope_scaling_from_metadata(yarn, "llama") == {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
        "beta_fast": 32.0, "attention_factor": 1.0}
    with pytest.raises(CheckpointError, match="original_context_length' must be an integer"):
        gguf_file.rope_scaling_from_metadata(
            {**yarn, "llama.rope.scaling.original_context_length": 1.5}, "llama")


@pytest.mark.parametrize("name, tensor, words", [
    ("token_embd.weight", np.zeros((), np.float32), ["token_embd.weight"]),    # IndexError
    ("blk.0.attn_q.weight", np.zeros((65, 64), np.float32),                    # reshape error
     ["blk.0.attn_q.weight", "(64, 64)", "(65, 64)"]),
    ("blk.1.attn_k.weight", np.zeros(32 * 64, np.float32), ["blk.1.attn_k.weight"]),
    ("blk.0.ffn_up.weight", np.zeros((96, 64), np.int32), ["I32"]),            # read by value
    ("blk.0.attn_q_norm.weight", np.ones(16, np.float32), ["attn_q_norm"]),
    ("blk.5.attn_norm.weight", np.ones(64, np.float32), ["block_count is 2", "gaps"]),
    ("rope_freqs.weight", np.full(8, 2.0, np.float32), ["rope_freqs", "llama3"]),
])
def test_a_gguf_tensor_of_the_wrong_shape_or_kind_is_refused_before_reading(
        model, tmp_path, name, tensor, words):
    path = write_gguf(tmp_path / "m.gguf", model, tensors={name: tensor})
    with pytest.raises(CheckpointError) as e:
        gyges.Model.load(path)
    _refused(e.value, path, *words)


def test_unit_rope_freqs_are_ignored(model, tmp_path):
    path = write_gguf(tmp_path / "m.gguf", model,
                      tensors={"rope_freqs.weight": np.ones(8, np.float32)})
    assert gyges.Model.load(path).config == CFG


@pytest.mark.parametrize("key, value, words", [
    ("tokenizer.ggml.token_type", (64, "UINT32"), ["token_type", "64"]),     # TypeError
    ("tokenizer.ggml.tokens", (70, "UINT16"), ["tokens", "70"]),             # TypeError
    ("tokenizer.ggml.merges", ([1, 2], "ARRAY", "INT32"), ["merges"]),
    ("tokenizer.ggml.token_type", ([1, 2], "ARRAY", "INT32"), ["2 types"]),  # zip truncated
    ("tokenizer.ggml.tokens", (_vocab()[0][:-1] + ["a"], "ARRAY", "STRING"), ["'a' twice"]),
    ("tokenizer.ggml.merges", (["x y"], "ARRAY", "STRING"), ["make no tokenizer"]),  # Exception
    ("tokenizer.ggml.add_bos_token", ("yes", "STRING"), ["add_bos_token"]),
    ("tokenizer.ggml.pre", (5, "UINT32"), ["pre"]),
    ("tokenizer.chat_template", (5, "UINT32"), ["chat_template"]),
])
def test_gguf_tokenizer_metadata_of_the_wrong_type_is_refused(model, tmp_path, key, value,
                                                              words):
    T = _types()
    v = (value[0], getattr(T, value[1]), *(getattr(T, s) for s in value[2:]))
    path = write_gguf(tmp_path / "m.gguf", model, meta={key: v})
    for load in (gyges.Model.load, load_tokenizer):
        with pytest.raises(CheckpointError) as e:
            load(path)
        _refused(e.value, path, *words)


def test_gguf_integer_values_may_come_as_numpy_integers():
    meta = {"k": np.uint32(7), "f": np.float32(0.5), "b": np.bool_(True), "n": np.int64(-1)}
    assert gguf_file.meta_value(meta, "k", "count") == 7
    assert type(gguf_file.meta_value(meta, "k", "int")) is int
    assert gguf_file.meta_value(meta, "f", "float") == 0.5
    assert gguf_file.meta_value(meta, "b", "bool") is True
    meta["big"] = 10 ** 400  # float() of it raised OverflowError
    for key, kind in (("b", "int"), ("f", "int"), ("n", "count"), ("k", "bool"), ("k", "str"),
                      ("big", "float")):
        with pytest.raises(CheckpointError, match=f"metadata '{key}' must be"):
            gguf_file.meta_value(meta, key, kind)


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


@pytest.mark.parametrize("field", ["tokenizer.ggml.model", "tokenizer.ggml.tokens"])
def test_a_gguf_count_past_the_file_is_refused_before_the_reader_walks_it(model, tmp_path,
                                                                           field):
    """A string or array whose length was edited to 2**61: the gguf package's reader sliced past
    the end of the file element by element for hours (the fuzz harness found it)."""
    import struct
    path = write_gguf(tmp_path / "m.gguf", model)
    data = bytearray(open(path, "rb").read())
    name = field.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    kind = struct.unpack_from("<I", data, at)[0]
    count_at = at + 4 + (4 if kind == 9 else 0)  # an array: item type, then count
    struct.pack_into("<Q", data, count_at, 2 ** 61)
    open(path, "wb").write(data)
    t = time.monotonic()
    with pytest.raises(gyges.Error) as e:
        gyges.Model.load(path)
    assert time.monotonic() - t < 5
    _refused(e.value, path, "more than the file holds")
