"""ModelConfig: presets, HF config.json round trips, and every validation error."""

import json

import pytest

from gyges.models.config import ConfigError, ModelConfig

# Published parameter counts (model cards / safetensors index totals), checked against
# param_count(), which counts from the shape fields alone.
KNOWN_PARAMS = {
    "llama2_7b": 6_738_415_616,
    "llama3_8b": 8_030_261_248,
    "llama3_70b": 70_553_706_496,
    "qwen2_5_32b": 32_763_876_352,
}


def _base(**overrides):
    d = ModelConfig.tiny().to_dict()
    d.update(overrides)
    return d


@pytest.mark.parametrize("name", sorted(ModelConfig.presets()))
def test_presets_valid_and_round_trip(name, tmp_path):
    cfg = ModelConfig.presets()[name]
    assert cfg.head_dim * cfg.num_attention_heads >= 1
    assert cfg.num_attention_heads % cfg.num_key_value_heads == 0
    # to_dict -> JSON text -> from_dict is the identity, and so is save -> from_json.
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    cfg.save(tmp_path)
    assert ModelConfig.from_json(tmp_path / "config.json") == cfg
    assert ModelConfig.from_json(tmp_path) == cfg


def test_tiny_preset_shape():
    c = ModelConfig.tiny()
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
            c.head_dim, c.intermediate_size, c.vocab_size) == (4, 256, 8, 4, 32, 688, 4096)
    assert (c.rope_theta, c.rms_norm_eps, c.tie_word_embeddings, c.max_position_embeddings) \
        == (10000.0, 1e-5, False, 4096)
    q = ModelConfig.qwen2_tiny()
    assert q.attention_bias and q.model_type == "qwen2" and q.hidden_size == 256


@pytest.mark.parametrize("name,count", sorted(KNOWN_PARAMS.items()))
def test_param_count_matches_published(name, count):
    assert ModelConfig.presets()[name].param_count() == count


def test_stories_param_counts_match_their_names():
    assert round(ModelConfig.stories15m().param_count() / 1e6) == 15
    assert round(ModelConfig.stories110m().param_count() / 1e6) == 110


def test_qwen3_head_dim_is_explicit():
    c = ModelConfig.qwen3_32b()
    assert c.head_dim == 128 and c.q_size == 8192 != c.hidden_size


def test_kv_bytes_and_weight_bytes():
    c = ModelConfig.llama3_8b()
    # 2 (K,V) * 32 layers * 8 heads * 128 dims * 2 bytes = 128 KiB per token.
    assert c.kv_bytes_per_token(2) == 131072
    assert c.kv_bytes_per_token(2, tp=2) == 65536
    assert c.kv_bytes_per_token(2, tp=16) == 2 * 32 * 1 * 128 * 2  # heads replicated
    assert c.weight_bytes(2) == 2 * c.param_count()
    with pytest.raises(ConfigError, match="tp=3"):
        c.kv_bytes_per_token(2, tp=3)
    with pytest.raises(ConfigError, match="tp must be a positive"):
        c.kv_bytes_per_token(2, tp=0)


def test_qwen2_bias_is_implicit_and_eos_list():
    d = _base(model_type="qwen2", eos_token_id=[2, 3])
    del d["attention_bias"]
    c = ModelConfig.from_dict(d)
    assert c.attention_bias and c.eos_tokens() == (2, 3)
    assert ModelConfig.from_dict(c.to_dict()) == c


def test_hf_defaults():
    d = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4}
    c = ModelConfig.from_dict(d)
    assert c.num_key_value_heads == 4 and c.head_dim == 16 and c.eos_tokens() == ()


def test_rope_scaling_accepted_and_normalised():
    assert ModelConfig.from_dict(_base(rope_scaling=None)).rope_scaling is None
    assert ModelConfig.from_dict(_base(rope_scaling={"rope_type": "default"})).rope_scaling is None
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    c = ModelConfig.from_dict(_base(rope_scaling=llama3))
    assert c.rope_scaling == llama3
    assert ModelConfig.from_dict(c.to_dict()) == c
    hash(c)  # a frozen config stays hashable with a scaling dict
    old_style = ModelConfig.from_dict(_base(rope_scaling={"type": "linear", "factor": 2}))
    assert old_style.rope_scaling == {"rope_type": "linear", "factor": 2.0}


@pytest.mark.parametrize("overrides,message", [
    ({"num_attention_heads": 7, "head_dim": None}, "does not divide hidden_size"),
    ({"num_key_value_heads": 3}, "num_key_value_heads \\(3\\) does not divide"),
    ({"vocab_size": 0}, "vocab_size must be a positive integer"),
    ({"hidden_size": -256}, "hidden_size must be a positive integer"),
    ({"intermediate_size": 1.5}, "intermediate_size must be a positive integer"),
    ({"num_hidden_layers": True}, "num_hidden_layers must be a positive integer"),
    ({"head_dim": 31}, "head_dim must be even"),
    ({"rms_norm_eps": 0}, "rms_norm_eps must be a positive"),
    ({"rope_theta": float("inf")}, "rope_theta must be a positive finite"),
    ({"model_type": "mistral"}, "model_type 'mistral' is not supported"),
    ({"attention_bias": True}, "o_proj"),
    ({"eos_token_id": 5000}, "token id 5000"),
    ({"bos_token_id": -1}, "token id -1"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"pretraining_tp": 2}, "pretraining_tp"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "'longrope' is not supported"),
    ({"rope_scaling": {"type": "su", "factor": 2.0}}, "'su' is not supported"),
    ({"rope_scaling": {"rope_type": "linear"}}, "missing 'factor'"),
    ({"rope_scaling": {"rope_type": "linear", "factor": -1}}, "factor must be a positive"),
    ({"rope_scaling": "linear"}, "rope_scaling must be an object"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8, "low_freq_factor": 4,
                       "high_freq_factor": 1, "original_max_position_embeddings": 8192}},
     "high_freq_factor > low_freq_factor"),
])
def test_validation_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(_base(**overrides))


def test_missing_keys_and_bad_files(tmp_path):
    d = _base()
    del d["hidden_size"], d["vocab_size"]
    with pytest.raises(ConfigError, match="missing required keys: vocab_size, hidden_size"):
        ModelConfig.from_dict(d)
    with pytest.raises(ConfigError, match="must be a JSON object"):
        ModelConfig.from_dict([1, 2])
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read config"):
        ModelConfig.from_json(bad)
    with pytest.raises(ConfigError, match="cannot read config"):
        ModelConfig.from_json(tmp_path / "absent.json")
    bad.write_text(json.dumps(_base(num_key_value_heads=3)))
    with pytest.raises(ConfigError, match="config.json: num_key_value_heads"):
        ModelConfig.from_json(bad)


def test_config_is_frozen_and_replace_revalidates():
    c = ModelConfig.tiny()
    with pytest.raises(AttributeError):
        c.hidden_size = 3  # type: ignore[misc]
    assert c.replace(num_hidden_layers=2).num_hidden_layers == 2
    assert c.replace(hidden_size=512).head_dim == 64  # derived again from the new hidden size
    with pytest.raises(ConfigError):
        c.replace(num_key_value_heads=5)
