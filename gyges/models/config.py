"""Shape and hyper-parameters of a Llama-family decoder (dense, or a mixture of experts: Mixtral,
Qwen2-MoE, Qwen3-MoE), read from / written to HF config.json.

One frozen dataclass, `ModelConfig`, is the single description of a model that the engine, the
simulator, the checkpoint loader and the float64 reference all share. Everything it cannot
represent faithfully (an unknown RoPE scaling, sliding-window attention, another activation) is
rejected with a `ConfigError` rather than silently ignored, because ignoring it would produce a
model that runs but computes something else.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from ..core.checks import is_finite, show
from ..core.errors import InvalidArgumentError

__all__ = ["ConfigError", "ModelConfig", "SUPPORTED_MODEL_TYPES", "MOE_MODEL_TYPES",
           "read_json", "MAX_JSON_BYTES"]

# The most a model's JSON file (config.json, the safetensors index, tokenizer_config.json) may
# hold: the largest published ones are a few MB; the bound keeps a hostile file from costing more.
MAX_JSON_BYTES = 64 << 20


class ConfigError(InvalidArgumentError):
    """A config is malformed, inconsistent, or asks for a feature gyges does not implement."""


SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe")  # RMSNorm of each q and k head before RoPE

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}

# HF's defaults of each MoE family's config class, for keys a config.json leaves out:
# (num_experts, num_experts_per_tok, moe_intermediate_size, shared_expert_intermediate_size).
_MOE_DEFAULTS = {"mixtral": (8, 2, None, 0), "qwen2_moe": (60, 4, 1408, 5632),
                 "qwen3_moe": (128, 8, 768, 0)}

# RoPE scalings gyges implements (gyges/models/rope.py turns them into frequencies, and the float64
# reference in tests/ implements each on its own). Anything else (longrope, su, mrope...) changes
# the rotation angles in ways we do not reproduce, so it is refused rather than ignored.
# Each type: its required keys, then its optional ones; every value is a positive finite number
# (an int where the name says so) unless listed in _ROPE_SCALING_BOOLS.
_ROPE_SCALING_KEYS = {
    "linear": ({"factor"}, set()),
    # Dynamic NTK with a fixed base (vLLM's reading; see rope.py for why not HF's per-length one).
    "dynamic": ({"factor"}, set()),
    "llama3": ({"factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings"}, set()),
    "yarn": ({"factor"}, {"original_max_position_embeddings", "beta_fast", "beta_slow",
                          "attention_factor", "mscale", "mscale_all_dim", "truncate"}),
}
_ROPE_SCALING_INTS = {"original_max_position_embeddings"}
_ROPE_SCALING_BOOLS = {"truncate"}


def _normalise_rope_scaling(raw: Any) -> dict | None:
    """Returns None for no scaling, else {"rope_type": ..., params}; raises on the rest.

    Optional parameters given as null are left out (the frequencies take their defaults);
    unknown keys are ignored, as transformers does."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ConfigError(f"rope_scaling must be an object or null, got {show(raw)}")
    # HF used "type" before renaming it to "rope_type"; both appear in published configs.
    kinds = {raw[k] for k in ("rope_type", "type") if k in raw and isinstance(raw[k], str)}
    if len(kinds) > 1:
        raise ConfigError(f"rope_scaling names two types: rope_type={raw['rope_type']!r}, "
                          f"type={raw['type']!r}")
    kind = raw.get("rope_type", raw.get("type"))
    if kind is None and any(v is not None for v in raw.values()):
        # transformers fails on it too (no init function for a None type): parameters without a
        # type say a scaling was meant, and guessing which would serve another model
        raise ConfigError(f"rope_scaling {show(raw)} has parameters but no rope_type")
    if kind in (None, "default"):
        return None
    if not isinstance(kind, str) or kind not in _ROPE_SCALING_KEYS:
        raise ConfigError(
            f"rope_scaling.rope_type {kind!r} is not supported (supported: default, "
            f"{', '.join(sorted(_ROPE_SCALING_KEYS))}); refusing to ignore it")
    required, optional = _ROPE_SCALING_KEYS[kind]
    out: dict[str, Any] = {"rope_type": kind}
    for key in sorted(required | optional):
        if raw.get(key) is None:
            if key in required:
                raise ConfigError(f"rope_scaling of type {kind!r} is missing {key!r}")
            continue
        value = raw[key]
        if key in _ROPE_SCALING_BOOLS:
            if not isinstance(value, bool):
                raise ConfigError(f"rope_scaling.{key} must be true or false, got {show(value)}")
            out[key] = value
        elif key in _ROPE_SCALING_INTS:
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 2 ** 31:
                raise ConfigError(f"rope_scaling.{key} must be a positive integer below 2**31, "
                                  f"got {show(value)}")
            out[key] = value
        else:
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not is_finite(value) or not value > 0:
                raise ConfigError(f"rope_scaling.{key} must be a positive finite number, "
                                  f"got {show(value)}")
            out[key] = float(value)
    if kind == "llama3" and not out["high_freq_factor"] > out["low_freq_factor"]:
        raise ConfigError("rope_scaling: llama3 needs high_freq_factor > low_freq_factor")
    return out


def read_json(path: str, what: str = "config", error: type | None = None,
              max_bytes: int | None = None) -> Any:
    """The parsed JSON of a model's file, or `error` (ConfigError by default) naming the file and
    what is wrong: unreadable, larger than max_bytes, not UTF-8, not JSON, a key given twice
    (json would keep the last one silently), or nested too deeply for the parser."""
    error = error or ConfigError
    max_bytes = MAX_JSON_BYTES if max_bytes is None else max_bytes
    try:
        with open(path, "rb") as f:
            blob = f.read(max_bytes + 1)
    except OSError as e:
        raise error(f"{path}: cannot read {what}: {e}") from None
    if len(blob) > max_bytes:
        raise error(f"{path}: cannot read {what}: larger than the {max_bytes}-byte limit of a "
                    f"model's JSON file")

    def no_duplicates(pairs):
        out = {}
        for key, value in pairs:
            if key in out:
                raise InvalidArgumentError(f"key {key!r} appears twice")  # a ValueError: below
            out[key] = value
        return out
    try:
        return json.loads(blob.decode("utf-8"), object_pairs_hook=no_duplicates)
    except UnicodeDecodeError as e:
        raise error(f"{path}: cannot read {what}: not UTF-8 ({e.reason} at byte {e.start})") \
            from None
    except RecursionError:
        raise error(f"{path}: cannot read {what}: JSON nested too deeply") from None
    except ValueError as e:  # JSONDecodeError is one
        raise error(f"{path}: cannot read {what}: not valid JSON: {e}") from None


def _typed(d: dict, key: str, kind: str, default: Any = None) -> Any:
    """d[key] (default when absent or null) if it has the JSON type `kind` (int, number, bool,
    str, or token: an int or a list of ints), else ConfigError naming the key and the value: an
    HF config is JSON, so a field of another type ("false", 1.5 for an int) is a broken file,
    never a value to convert (bool("false") is True)."""
    value = d.get(key)
    if value is None:
        return default
    ok = {
        "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "bool": lambda v: isinstance(v, bool),
        "str": lambda v: isinstance(v, str),
        "token": lambda v: (isinstance(v, int) and not isinstance(v, bool)) or (
            isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)),
    }[kind](value)
    if not ok:
        expected = {"int": "an integer", "number": "a number", "bool": "true or false",
                    "str": "a string", "token": "a token id or a list of them"}[kind]
        raise ConfigError(f"{key} must be {expected}, got {show(value)}")
    return value


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama/Qwen2 decoder. Field names follow HF config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None  # None -> hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # biases on q/k/v projections (always on for qwen2)
    model_type: str = "llama"
    bos_token_id: int | None = 1
    eos_token_id: int | tuple[int, ...] | None = 2
    # Normalised (see _normalise_rope_scaling); a dict, so left out of the hash.
    rope_scaling: dict | None = field(default=None, hash=False)
    # Mixture of experts (num_experts 0: dense). A sparse layer routes each token to its
    # num_experts_per_tok experts (FFN width moe_intermediate_size) by softmax probability,
    # renormalised over the chosen when norm_topk_prob (always, in Mixtral); Qwen2-MoE adds a
    # shared expert of width shared_expert_intermediate_size behind a sigmoid gate. Layer i is
    # sparse unless in mlp_only_layers, when (i + 1) % decoder_sparse_step == 0 (HF's rule); the
    # others have a dense FFN of intermediate_size.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # Frozen: normalise through object.__setattr__ so presets and from_dict agree.
        if self.head_dim is None:
            if not _is_pos_int(self.hidden_size) or not _is_pos_int(self.num_attention_heads):
                self._check_positive()
            if self.hidden_size % self.num_attention_heads != 0:
                raise ConfigError(
                    f"num_attention_heads ({self.num_attention_heads}) does not divide "
                    f"hidden_size ({self.hidden_size}) and no head_dim is given")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        if isinstance(self.mlp_only_layers, list):
            object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        object.__setattr__(self, "rope_scaling", _normalise_rope_scaling(self.rope_scaling))
        self._validate()

    def _check_positive(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if not _is_pos_int(value):
                raise ConfigError(f"{name} must be a positive integer, got {show(value)}")
        if self.max_position_embeddings > 2 ** 31 - 1:  # positions are int32 in the engine
            raise ConfigError(f"max_position_embeddings must be at most 2**31 - 1, "
                              f"got {self.max_position_embeddings}")

    def _validate(self) -> None:
        self._check_positive()
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ConfigError(
                f"num_key_value_heads ({self.num_key_value_heads}) does not divide "
                f"num_attention_heads ({self.num_attention_heads})")
        if self.head_dim % 2 != 0:
            raise ConfigError(f"head_dim must be even for rotary embedding, got {self.head_dim}")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not is_finite(value) or not value > 0:
                raise ConfigError(f"{name} must be a positive finite number, got {show(value)}")
        if not self.rope_theta > 1:
            # the base of the rotary wavelengths: at or below 1 they shrink with the pair index,
            # and angles of 1e30 radians (theta 1e-30) leave nothing but rounding in cos and sin
            raise ConfigError(f"rope_theta must be above 1, got {self.rope_theta!r}")
        if not isinstance(self.model_type, str) or self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"model_type {self.model_type!r} is not supported "
                              f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        if self.model_type == "qwen2" and not self.attention_bias:
            raise ConfigError("qwen2 always has q/k/v biases; attention_bias must be True")
        if self.model_type == "llama" and self.attention_bias:
            # HF Llama's attention_bias also biases o_proj, unlike Qwen2; we do not implement that.
            raise ConfigError("llama with attention_bias=True (biased o_proj too) is not supported")
        for name in ("tie_word_embeddings", "attention_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.model_type in ("qwen3", "qwen3_moe", "mixtral") and self.attention_bias:
            raise ConfigError(f"{self.model_type} with attention_bias=True (a biased o_proj too) "
                              f"is not supported")
        if self.model_type == "qwen2_moe" and not self.attention_bias:
            raise ConfigError("qwen2_moe always has q/k/v biases; attention_bias must be True")
        self._validate_experts()
        ids = [("eos_token_id", tok) for tok in self.eos_tokens()]
        if self.bos_token_id is not None:
            ids.append(("bos_token_id", self.bos_token_id))
        for name, tok in ids:
            if not isinstance(tok, int) or isinstance(tok, bool) or not 0 <= tok < self.vocab_size:
                raise ConfigError(f"{name}: token id {tok!r} is not in "
                                  f"[0, vocab_size={self.vocab_size})")

    def _validate_experts(self) -> None:
        moe = self.model_type in MOE_MODEL_TYPES
        n = self.num_experts
        if not isinstance(n, int) or isinstance(n, bool) or not (0 < n <= 1024 if moe else n == 0):
            raise ConfigError(f"num_experts={show(n)}: a {self.model_type} model has "
                              + ("1 to 1024 experts" if moe else "none"))
        if not moe:
            return
        k, width = self.num_experts_per_tok, self.moe_intermediate_size
        if not _is_pos_int(k) or k > n:
            raise ConfigError(f"num_experts_per_tok must be in [1, num_experts={n}], got {show(k)}")
        if not _is_pos_int(width):
            raise ConfigError(f"moe_intermediate_size must be a positive integer, got {show(width)}")
        shared = self.shared_expert_intermediate_size
        if not isinstance(shared, int) or isinstance(shared, bool) or shared < 0 or \
                (shared and self.model_type != "qwen2_moe"):
            raise ConfigError(f"shared_expert_intermediate_size={show(shared)}: only qwen2_moe "
                              f"has a shared expert, of a non-negative width")
        if not isinstance(self.norm_topk_prob, bool):
            raise ConfigError(f"norm_topk_prob must be a bool, got {show(self.norm_topk_prob)}")
        if self.model_type == "mixtral" and (not self.norm_topk_prob or
                                             width != self.intermediate_size):
            raise ConfigError("mixtral's experts are intermediate_size wide "
                              "(moe_intermediate_size) and always renormalise their top-k "
                              "weights (norm_topk_prob)")
        if not _is_pos_int(self.decoder_sparse_step):
            raise ConfigError(f"decoder_sparse_step must be a positive integer, "
                              f"got {show(self.decoder_sparse_step)}")
        if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.num_hidden_layers
                   for i in self.mlp_only_layers):
            raise ConfigError(f"mlp_only_layers must list layers in [0, "
                              f"{self.num_hidden_layers}), got {show(list(self.mlp_only_layers))}")

    # ---- derived quantities ----

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def qk_norm(self) -> bool:
        """Whether attention RMS-normalises each q and k head (q_norm / k_norm) before RoPE."""
        return self.model_type in QK_NORM_MODEL_TYPES

    def is_sparse_layer(self, i: int) -> bool:
        """Whether layer i's FFN is a mixture of experts (HF's rule for Qwen2/3-MoE; every layer
        of Mixtral)."""
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def kv_group_size(self) -> int:
        """Query heads sharing one KV head."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def eos_tokens(self) -> tuple[int, ...]:
        """eos_token_id as a tuple (HF allows an int, a list, or null)."""
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, tuple):
            return self.eos_token_id
        return (self.eos_token_id,)

    def param_count(self) -> int:
        """Parameters as stored in an HF checkpoint (lm_head counted only when untied)."""
        h, q, kv = self.hidden_size, self.q_size, self.kv_size
        per_layer = (
            2 * h                                   # input + post-attention RMSNorm
            + h * q + 2 * h * kv + q * h            # q, k, v, o projections
        )
        if self.attention_bias:
            per_layer += q + 2 * kv
        if self.qk_norm:
            per_layer += 2 * self.head_dim          # q_norm, k_norm
        total = self.vocab_size * h + self.num_hidden_layers * per_layer + h
        for i in range(self.num_hidden_layers):
            if not self.is_sparse_layer(i):
                total += 3 * h * self.intermediate_size   # gate, up, down
                continue
            total += self.num_experts * (3 * h * self.moe_intermediate_size + h)  # and router
            if self.shared_expert_intermediate_size:
                total += 3 * h * self.shared_expert_intermediate_size + h  # and its gate
        if not self.tie_word_embeddings:
            total += self.vocab_size * h
        return total

    def weight_bytes(self, dtype_bytes: int | float) -> int:
        """Bytes of all weights stored at dtype_bytes per element."""
        return int(self.param_count() * dtype_bytes)

    def kv_bytes_per_token(self, dtype_bytes: int | float, tp: int = 1) -> int:
        """K and V bytes for one token, all layers, on ONE tensor-parallel rank.

        KV heads are split across tp ranks; when tp exceeds the KV head count, each rank holds
        one replicated head (as vLLM does), so tp must divide or be a multiple of the KV heads.
        """
        if not _is_pos_int(tp):
            raise ConfigError(f"tp must be a positive integer, got {tp!r}")
        kv = self.num_key_value_heads
        if kv % tp != 0 and tp % kv != 0:
            raise ConfigError(f"tp={tp} neither divides nor is a multiple of "
                              f"num_key_value_heads={kv}")
        heads_per_rank = max(1, kv // tp)
        return int(2 * self.num_hidden_layers * heads_per_rank * self.head_dim * dtype_bytes)

    # ---- HF config.json ----

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """Builds a config from a parsed HF config.json, refusing features we do not implement."""
        if not isinstance(d, dict):
            raise ConfigError(f"config must be a JSON object, got {type(d).__name__}")
        model_type = _typed(d, "model_type", "str", "llama")
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads")
        missing = [k for k in required if k not in d]
        if missing:
            raise ConfigError(f"config is missing required keys: {', '.join(missing)}")
        act = _typed(d, "hidden_act", "str", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act {act!r} is not supported (only silu / SwiGLU)")
        if _typed(d, "mlp_bias", "bool", False):
            raise ConfigError("mlp_bias=True is not supported")
        if model_type == "mixtral" and d.get("sliding_window") is not None:
            raise ConfigError("mixtral with a sliding_window is not supported (full attention only)")
        if _typed(d, "use_sliding_window", "bool", False):
            raise ConfigError("use_sliding_window=True is not supported (full attention only)")
        if _typed(d, "pretraining_tp", "int", 1) != 1:
            raise ConfigError("pretraining_tp != 1 changes the MLP computation; not supported")
        if _typed(d, "partial_rotary_factor", "number", 1.0) != 1.0:
            raise ConfigError(f"partial_rotary_factor={d['partial_rotary_factor']!r} is not "
                              f"supported (gyges rotates the whole head)")
        # transformers 5 writes rope_theta and the scaling as one rope_parameters object
        rope = d.get("rope_parameters")
        if rope is not None and not isinstance(rope, dict):
            raise ConfigError(f"rope_parameters must be an object, got {rope!r}")
        rope = rope or {}
        # Qwen2's q/k/v biases are implicit in the architecture, not in config.json.
        attention_bias = _typed(d, "attention_bias", "bool", False)
        if model_type in ("qwen2", "qwen2_moe"):
            attention_bias = True
        # The shape fields are checked as the dataclass checks them (positive integers).
        ints = {k: d[k] for k in required}
        # HF's default for num_key_value_heads is num_attention_heads (plain MHA).
        kv_heads = d.get("num_key_value_heads")
        if kv_heads is None:
            kv_heads = ints["num_attention_heads"]
        eos = _typed(d, "eos_token_id", "token")
        bos = _typed(d, "bos_token_id", "int")
        fields = dict(
            **ints,
            num_key_value_heads=kv_heads,
            head_dim=d.get("head_dim"),
            rms_norm_eps=_typed(d, "rms_norm_eps", "number", 1e-6),
            rope_theta=_typed(d, "rope_theta", "number",
                              _typed(rope, "rope_theta", "number", 10000.0)),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=_typed(d, "tie_word_embeddings", "bool", False),
            attention_bias=attention_bias,
            model_type=model_type,
            bos_token_id=bos,
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            rope_scaling=d.get("rope_scaling",
                               {k: v for k, v in rope.items() if k != "rope_theta"} or None),
        )
        if model_type in _MOE_DEFAULTS:
            n, k, width, shared = _MOE_DEFAULTS[model_type]
            mixtral = model_type == "mixtral"
            fields.update(
                num_experts=_typed(d, "num_local_experts" if mixtral else "num_experts", "int", n),
                num_experts_per_tok=_typed(d, "num_experts_per_tok", "int", k),
                # Mixtral's experts are intermediate_size wide and always renormalised
                moe_intermediate_size=(ints["intermediate_size"] if mixtral else
                                       _typed(d, "moe_intermediate_size", "int", width)),
                shared_expert_intermediate_size=(
                    _typed(d, "shared_expert_intermediate_size", "int", shared)
                    if model_type == "qwen2_moe" else 0),
                norm_topk_prob=mixtral or _typed(d, "norm_topk_prob", "bool", False),
                decoder_sparse_step=_typed(d, "decoder_sparse_step", "int", 1),
                mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
            )
        try:
            return cls(**fields)
        except ConfigError:
            raise
        except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as e:
            # the loader's boundary: a value of a type no check above foresaw (a list where the
            # rope scaling's type goes) is still a malformed config, never a crash
            raise ConfigError(f"malformed config: {type(e).__name__}: {e}") from None

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "ModelConfig":
        """Reads config.json (or a directory holding one)."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        d = read_json(path)
        try:
            return cls.from_dict(d)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from e

    def to_dict(self) -> dict:
        """HF-compatible config.json contents (loadable by transformers and by from_dict)."""
        d: dict[str, Any] = {
            "architectures": [_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_scaling is None else dict(self.rope_scaling),
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple)
            else self.eos_token_id,
        }
        if self.model_type == "mixtral":
            d.update(num_local_experts=self.num_experts,
                     num_experts_per_tok=self.num_experts_per_tok, sliding_window=None)
        elif self.is_moe:
            d.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                     moe_intermediate_size=self.moe_intermediate_size,
                     norm_topk_prob=self.norm_topk_prob,
                     decoder_sparse_step=self.decoder_sparse_step,
                     mlp_only_layers=list(self.mlp_only_layers))
            if self.model_type == "qwen2_moe":
                d["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
        return d

    def save(self, path: str | os.PathLike) -> None:
        """Writes config.json to path (a file name, or a directory to put config.json in)."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")

    def replace(self, **changes: Any) -> "ModelConfig":
        """A copy with some fields changed (re-validated)."""
        if "hidden_size" in changes or "num_attention_heads" in changes:
            changes.setdefault("head_dim", None)
        return dataclasses.replace(self, **changes)

    # ---- presets ----
    # Small ones are for tests and demos; the paper-scale ones carry the public config.json
    # shapes of the released models and are used by the simulator (no weights needed).

    @classmethod
    def tiny(cls) -> "ModelConfig":
        return cls(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                   rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096,
                   tie_word_embeddings=False)

    @classmethod
    def qwen2_tiny(cls) -> "ModelConfig":
        return dataclasses.replace(cls.tiny(), attention_bias=True, model_type="qwen2",
                                   rms_norm_eps=1e-6)

    @classmethod
    def stories15m(cls) -> "ModelConfig":
        # karpathy/tinyllamas stories15M (llama2.c): the classifier shares the embedding, which
        # is what makes it 15M parameters.
        return cls(vocab_size=32000, hidden_size=288, intermediate_size=768, num_hidden_layers=6,
                   num_attention_heads=6, num_key_value_heads=6, rms_norm_eps=1e-5,
                   max_position_embeddings=256, tie_word_embeddings=True)

    @classmethod
    def stories110m(cls) -> "ModelConfig":
        return cls(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                   num_attention_heads=12, num_key_value_heads=12, rms_norm_eps=1e-5,
                   max_position_embeddings=1024, tie_word_embeddings=True)

    @classmethod
    def llama2_7b(cls) -> "ModelConfig":
        # meta-llama/Llama-2-7b-hf
        return cls(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                   num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                   rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096,
                   bos_token_id=1, eos_token_id=2)

    @classmethod
    def llama3_8b(cls) -> "ModelConfig":
        # meta-llama/Meta-Llama-3-8B (no rope_scaling; 3.1 adds llama3 scaling and 128K context)
        return cls(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                   num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                   rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
                   bos_token_id=128000, eos_token_id=128001)

    @classmethod
    def llama3_70b(cls) -> "ModelConfig":
        # meta-llama/Meta-Llama-3-70B
        return cls(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                   num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                   rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
                   bos_token_id=128000, eos_token_id=128001)

    @classmethod
    def qwen2_5_14b(cls) -> "ModelConfig":
        # Qwen/Qwen2.5-14B (KunServe's model): 48 layers, 8 KV heads of 128: 192 KB of KV a token
        return cls(vocab_size=152064, hidden_size=5120, intermediate_size=13824,
                   num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8,
                   rms_norm_eps=1e-5, rope_theta=1000000.0, max_position_embeddings=131072,
                   attention_bias=True, model_type="qwen2",
                   bos_token_id=151643, eos_token_id=151643)

    @classmethod
    def qwen2_5_32b(cls) -> "ModelConfig":
        # Qwen/Qwen2.5-32B (base; the Instruct config differs only in eps 1e-6, eos, context)
        return cls(vocab_size=152064, hidden_size=5120, intermediate_size=27648,
                   num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8,
                   rms_norm_eps=1e-5, rope_theta=1000000.0, max_position_embeddings=131072,
                   attention_bias=True, model_type="qwen2",
                   bos_token_id=151643, eos_token_id=151643)

    @classmethod
    def qwen3_32b(cls) -> "ModelConfig":
        # Qwen/Qwen3-32B: head_dim 128 is given explicitly (64 * 128 != 5120).
        return cls(vocab_size=151936, hidden_size=5120, intermediate_size=25600,
                   num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8,
                   head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
                   max_position_embeddings=40960, model_type="qwen3",
                   bos_token_id=151643, eos_token_id=151645)

    @classmethod
    def qwen3_30b_a3b(cls) -> "ModelConfig":
        # Qwen/Qwen3-30B-A3B (AMOEBAs' MoE model): 128 experts of 768, 8 a token, 3B active
        return cls(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                   num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                   head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
                   max_position_embeddings=40960, model_type="qwen3_moe", num_experts=128,
                   num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                   bos_token_id=151643, eos_token_id=151645)

    @classmethod
    def mixtral_8x7b(cls) -> "ModelConfig":
        # mistralai/Mixtral-8x7B-v0.1
        return cls(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                   num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                   rms_norm_eps=1e-5, rope_theta=1000000.0, max_position_embeddings=32768,
                   model_type="mixtral", num_experts=8, num_experts_per_tok=2,
                   moe_intermediate_size=14336, norm_topk_prob=True,
                   bos_token_id=1, eos_token_id=2)

    @classmethod
    def presets(cls) -> dict[str, "ModelConfig"]:
        """Every named preset, by name."""
        names = ("tiny", "qwen2_tiny", "stories15m", "stories110m", "llama2_7b", "llama3_8b",
                 "qwen2_5_14b", "qwen2_5_32b", "qwen3_32b", "llama3_70b", "qwen3_30b_a3b",
                 "mixtral_8x7b")
        return {name: getattr(cls, name)() for name in names}


def _is_pos_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
