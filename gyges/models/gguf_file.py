"""GGUF files (llama.cpp's format) as gyges models: the config from the file's metadata, every
tensor dequantized to float32 by the `gguf` package (llama.cpp's own reader) under its Hugging
Face name and orientation, and the metadata a tokenizer and a chat template are built from.

    config, tensors, meta = gguf_file.load("SmolLM2-135M-Instruct.Q4_1.gguf")

Two conventions differ from an HF checkpoint:
  - for llama, llama.cpp's converter reorders the rows of each head of q_proj and k_proj so that rotary
    pairs sit next to each other (interleaved rotary); gyges, like HF, rotates the two halves of
    a head (rotate-half), so the rows are put back (`unpermute_rows`);
  - GGUF lists a tensor's dimensions fastest first; the reader's arrays are already [rows, cols]
    = HF's [out_features, in_features].
A model without `output.weight` ties its LM head to the embedding, as llama.cpp does.

Mixtures of experts (a llama file with experts is Mixtral; qwen2moe, qwen3moe) hold each layer's
experts stacked in one tensor per matrix (ffn_gate_exps: (experts, width, hidden) rows first),
which is cut into HF's one tensor per expert; the router is ffn_gate_inp, Qwen2-MoE's shared
expert ffn_*_shexp with its gate ffn_gate_inp_shexp.
"""
from __future__ import annotations

import os

import numpy as np

from . import gguf_header
from .checkpoint import CheckpointError, attention_extras, check_tensors, expected_shapes, ffn_units
from .config import ConfigError, ModelConfig
from ..core.checks import is_finite, show
from ..core.errors import require
from ..core.logs import progress as progress_bar

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe")
# llama.cpp's architecture -> gyges' model_type (a llama file with experts: Mixtral)
_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen2moe": "qwen2_moe",
                "qwen3moe": "qwen3_moe"}
# Whether llama.cpp renormalises the chosen experts' weights when the file does not say
# ({arch}.expert_weights_norm): always for Mixtral and Qwen3-MoE, never for Qwen2-MoE.
_NORM_TOPK = {"llama": True, "qwen2moe": False, "qwen3moe": True}
# GGUF tensor name (without "blk.N.") -> HF name (without "model.layers.N.")
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# A sparse layer's tensors (without "blk.N."): the stacked experts' matrices and the shared
# expert's by kind, and the routers by role (checkpoint.attention_extras)
EXPERT_NAMES = {"ffn_gate_exps.weight": "gate", "ffn_up_exps.weight": "up",
                "ffn_down_exps.weight": "down"}
SHARED_NAMES = {"ffn_gate_shexp.weight": "gate", "ffn_up_shexp.weight": "up",
                "ffn_down_shexp.weight": "down"}
ROUTER_NAMES = {"ffn_gate_inp.weight": "router", "ffn_gate_inp_shexp.weight": "shared_gate"}
GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
# Rotary buffers some converters store; recomputed from the config.
IGNORED_SUFFIXES = ("rope_freqs.weight",)


def open_reader(path):
    """A gguf.GGUFReader over `path`, or CheckpointError naming the file and what is wrong
    (missing, bad magic, truncated, unknown tensor type, a tensor past the end of the file: the
    reader shapes every tensor as it opens the file, so a short one fails here)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no such GGUF file")
    gguf = require("gguf", "reading GGUF files")
    gguf_header.check(path)  # before the reader, which trusts every count it reads
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, OSError, TypeError, OverflowError) as e:
        raise CheckpointError(f"{path}: not a readable GGUF file: {e}") from None
    return reader


def metadata(reader):
    """The file's key-value metadata as Python values (strings decoded; arrays as lists)."""
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            out[key] = field.contents()
        except (ValueError, IndexError, TypeError, OverflowError) as e:
            raise CheckpointError(f"metadata {key!r} cannot be read: {e}") from None
    return out


_REQUIRED = object()


def meta_value(meta, key, kind, default=_REQUIRED):
    """meta[key] as a Python value of `kind`, the one conversion of GGUF metadata: "int" (an
    integer type, Python's or NumPy's; never a float, a bool or a string), "count" (an int > 0),
    "float" (a finite number of a float type), "str", "bool", or "ints"/"strs" (a list of them).
    Anything else is a CheckpointError naming the key and the value, as is a missing key without
    a default: int() would turn a head count of 1.5 into 1, and bool() a string into True."""
    if key not in meta:
        if default is _REQUIRED:
            raise CheckpointError(f"the metadata has no {key!r}")
        return default
    value = meta[key]
    is_int = lambda v: isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))
    if kind in ("int", "count") and is_int(value) and (kind == "int" or value > 0):
        return int(value)
    # a float key of an integer type is an error to llama.cpp too (gguf_get_val_f32 checks it)
    if kind == "float" and isinstance(value, (float, np.floating)) and is_finite(value):
        return float(value)
    if kind == "str" and isinstance(value, str):
        return value
    if kind == "bool" and isinstance(value, (bool, np.bool_)):
        return bool(value)
    if kind == "ints" and isinstance(value, list) and all(map(is_int, value)):
        return [int(v) for v in value]
    if kind == "strs" and isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    expected = {"int": "an integer", "count": "a positive integer", "float": "a finite float",
                "str": "a string", "bool": "a bool", "ints": "a list of integers",
                "strs": "a list of strings"}[kind]
    raise CheckpointError(f"metadata {key!r} must be {expected}, got {show(value)}")


# {arch}.rope.* keys gyges reads; any other one (partial rotary per section, a sliding-window
# base, NTK alpha, llama.cpp's own yarn knobs) changes the rotation in a way gyges does not.
_ROPE_KEYS = ("dimension_count", "freq_base", "scaling.type", "scaling.factor",
              "scaling.original_context_length", "scaling.finetuned", "scaling.attn_factor",
              "scaling.yarn_beta_fast", "scaling.yarn_beta_slow")
# GGUF name of a scaling parameter -> its name in an HF rope_scaling dict
_ROPE_SCALING_PARAMS = {"scaling.factor": "factor",
                        "scaling.original_context_length": "original_max_position_embeddings",
                        "scaling.attn_factor": "attention_factor",
                        "scaling.yarn_beta_fast": "beta_fast",
                        "scaling.yarn_beta_slow": "beta_slow"}


# {arch}.* keys of features a llama or qwen2 model could be given that gyges does not compute;
# ignoring one would run another model than the file's
_UNSUPPORTED_KEYS = ("attention.sliding_window", "logit_scale", "attention.clamp_kqv",
                     "embedding_scale", "residual_scale", "attention.scale",
                     "attn_logit_softcapping", "final_logit_softcapping",
                     "attention.layer_norm_epsilon")


def rope_scaling_from_metadata(meta, arch):
    """The HF-style rope_scaling dict of "{arch}.rope.scaling.*" ({"rope_type": ..., "factor":
    ..., "original_max_position_embeddings": ...}), None for none; ModelConfig refuses the
    types it does not apply, by name."""
    kind = meta_value(meta, f"{arch}.rope.scaling.type", "str", None)
    present = {hf: meta_value(meta, f"{arch}.rope.{key}",
                              "int" if key.endswith("context_length") else "float")
               for key, hf in _ROPE_SCALING_PARAMS.items() if f"{arch}.rope.{key}" in meta}
    meta_value(meta, f"{arch}.rope.scaling.finetuned", "bool", False)
    if kind is None or kind == "none":
        if present.get("factor", 1.0) != 1.0 or len(present) > ("factor" in present):
            given = [f"{arch}.rope.{k}" for k, hf in _ROPE_SCALING_PARAMS.items() if hf in present]
            raise CheckpointError(f"metadata {', '.join(given)} given with "
                                  f"{arch}.rope.scaling.type {kind!r}: a scaling without its type")
        return None
    return {"rope_type": kind, **present}


def config_from_metadata(meta, tensor_shapes):
    """ModelConfig from a GGUF's metadata ("<arch>.block_count", ...). tensor_shapes: {GGUF tensor
    name: its shape, rows first}: the counts the metadata gives are checked against the tensors
    the file holds before anything is built of them (a block count of 2**32 - 1 would otherwise
    list layers until memory ran out), and the vocabulary size may come from the embedding."""
    arch = meta_value(meta, "general.architecture", "str", None)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(f"general.architecture {arch!r} is not supported "
                              f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    unknown = sorted(k for k in meta if k.startswith(f"{arch}.rope.")
                     and k[len(arch) + 6:] not in _ROPE_KEYS)
    if unknown:
        raise CheckpointError(f"metadata {unknown[0]!r} is not supported: gyges rotates every "
                              f"head whole, with one frequency base and the scalings of "
                              f"{arch}.rope.scaling.type")

    changes = [k for k in _UNSUPPORTED_KEYS if f"{arch}.{k}" in meta]
    experts = meta_value(meta, f"{arch}.expert_count", "int", 0)
    if experts and arch not in _NORM_TOPK:
        changes.append("expert_count")
    # softmax gating (llama.cpp's 1) is what every family here routes by; anything else is not
    if meta_value(meta, f"{arch}.expert_gating_func", "int", 1) != 1:
        changes.append("expert_gating_func")
    if changes:
        raise CheckpointError(f"metadata {arch}.{changes[0]} is not supported: it changes the "
                              f"model in a way gyges does not compute")

    def need(key, kind="count"):
        return meta_value(meta, f"{arch}.{key}", kind)

    layers = need("block_count")
    blocks = {int(name.split(".")[1]) for name in tensor_shapes
              if name.startswith("blk.") and name.split(".")[1].isdigit()}
    dense = not blocks or max(blocks) == len(blocks) - 1  # blk.0 to blk.(n-1), no gaps
    if not dense or len(blocks) != layers:
        have = f"blk.0 to blk.{max(blocks)}" if blocks else "no blk.N tensors"
        raise CheckpointError(f"metadata {arch}.block_count is {layers}, but the file holds "
                              f"{have}" + ("" if dense else f" with gaps ({len(blocks)} blocks)"))
    heads = need("attention.head_count")
    hidden = need("embedding_length")
    embd = tensor_shapes.get("token_embd.weight")
    if f"{arch}.vocab_size" not in meta and (embd is None or len(embd) != 2):
        raise CheckpointError(f"the metadata has no {arch}.vocab_size and tensor "
                              f"'token_embd.weight' of shape {embd} gives none")
    vocab = meta_value(meta, f"{arch}.vocab_size", "count", embd[0] if embd else 0)
    head_dim = meta_value(meta, f"{arch}.attention.key_length", "count", hidden // heads)
    value_dim = meta_value(meta, f"{arch}.attention.value_length", "count", head_dim)
    if value_dim != head_dim:
        raise CheckpointError(f"metadata {arch}.attention.value_length {value_dim} differs from "
                              f"the key length {head_dim}: not supported")
    rotated = meta_value(meta, f"{arch}.rope.dimension_count", "count", head_dim)
    if rotated != head_dim:
        raise CheckpointError(f"metadata {arch}.rope.dimension_count is {rotated}, not the head "
                              f"dimension {head_dim}: partial rotary embedding is not supported")
    eos = meta_value(meta, "tokenizer.ggml.eos_token_id", "int", None)
    model_type = "mixtral" if arch == "llama" and experts else _MODEL_TYPES[arch]
    moe = {}
    if experts:
        moe = _experts_from_metadata(meta, arch, experts, need)
    try:
        return ModelConfig(
            vocab_size=vocab, hidden_size=hidden,
            intermediate_size=need("feed_forward_length"),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=meta_value(meta, f"{arch}.attention.head_count_kv", "count",
                                           heads),
            head_dim=head_dim,
            rms_norm_eps=_f32_value(need("attention.layer_norm_rms_epsilon", "float")),
            rope_theta=_f32_value(meta_value(meta, f"{arch}.rope.freq_base", "float", 10000.0)),
            max_position_embeddings=need("context_length"),
            tie_word_embeddings="output.weight" not in tensor_shapes,
            attention_bias=arch in ("qwen2", "qwen2moe"), model_type=model_type, **moe,
            bos_token_id=meta_value(meta, "tokenizer.ggml.bos_token_id", "int", None),
            eos_token_id=eos,
            rope_scaling=rope_scaling_from_metadata(meta, arch))
    except ConfigError as e:
        # the metadata keys of the config fields the message names
        keys = {"vocab_size": f"{arch}.vocab_size", "hidden_size": f"{arch}.embedding_length",
                "intermediate_size": f"{arch}.feed_forward_length",
                "num_attention_heads": f"{arch}.attention.head_count",
                "num_key_value_heads": f"{arch}.attention.head_count_kv",
                "head_dim": f"{arch}.attention.key_length",
                "rms_norm_eps": f"{arch}.attention.layer_norm_rms_epsilon",
                "rope_theta": f"{arch}.rope.freq_base",
                "max_position_embeddings": f"{arch}.context_length",
                "bos_token_id": "tokenizer.ggml.bos_token_id",
                "eos_token_id": "tokenizer.ggml.eos_token_id",
                "rope_scaling": f"{arch}.rope.scaling.type",
                "num_experts": f"{arch}.expert_count",
                "num_experts_per_tok": f"{arch}.expert_used_count",
                "moe_intermediate_size": f"{arch}.expert_feed_forward_length",
                "shared_expert": f"{arch}.expert_shared_feed_forward_length",
                "norm_topk_prob": f"{arch}.expert_weights_norm"}
        named = [key for field, key in keys.items() if field in str(e) and key in meta]
        raise CheckpointError(f"the metadata ({', '.join(named) or 'its shape'}) describes no "
                              f"model gyges can run: {e}") from None


def _experts_from_metadata(meta, arch, experts, need):
    """The ModelConfig fields of a file with `experts` experts a layer ({arch}.expert_*)."""
    try:
        return dict(
            num_experts=experts,
            num_experts_per_tok=meta_value(meta, f"{arch}.expert_used_count", "count"),
            moe_intermediate_size=(need("feed_forward_length") if arch == "llama" else
                                   need("expert_feed_forward_length")),
            shared_expert_intermediate_size=meta_value(
                meta, f"{arch}.expert_shared_feed_forward_length", "int", 0),
            norm_topk_prob=meta_value(meta, f"{arch}.expert_weights_norm", "bool",
                                      _NORM_TOPK[arch]))
    except CheckpointError as e:
        raise CheckpointError(f"metadata {arch}.expert_count is {experts}: {e}") from None


def _f32_value(x):
    """A float32 of the metadata as the decimal it was written from (1e-5, not 9.99999975e-06):
    the shortest one that rounds to the same float32, as HF's config.json would say it."""
    with np.errstate(over="ignore"):
        f = np.float32(x)
    if not np.isfinite(f):
        return float(x)  # past float32: ModelConfig names it as given
    return float(np.format_float_positional(f, unique=True))


def unpermute_rows(w, n_heads):
    """Undoes llama.cpp's reordering of q/k rows: within each head, row 2i + j of the file (pair
    i, element j) goes back to row j * d/2 + i (half j, index i), HF's rotate-half order.
      w: (n_heads * d, ...) -> same shape; the caller has checked the shape."""
    d = w.shape[0] // n_heads
    return (w.reshape(n_heads, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def hf_name(name):
    """The HF name of a GGUF tensor name, or None for one to ignore; CheckpointError when
    unknown (an architecture feature gyges does not run). A sparse layer's tensors: hf_targets."""
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    if name.endswith(IGNORED_SUFFIXES):
        return None
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_NAMES:
        return f"model.layers.{int(parts[1])}.{LAYER_NAMES[parts[2]]}"
    raise CheckpointError(f"tensor {name!r} is not part of a model gyges can run")


def hf_targets(name, config):
    """[(HF name, expert index or None)] a GGUF tensor becomes: one name, or for a stacked
    experts' tensor every expert's (index j: its slice j); [] for a tensor to ignore."""
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and \
            parts[2] in {**EXPERT_NAMES, **SHARED_NAMES, **ROUTER_NAMES}:
        layer = int(parts[1])
        if not 0 <= layer < config.num_hidden_layers or not config.is_sparse_layer(layer):
            raise CheckpointError(f"tensor {name!r}: layer {layer} has no experts as configured")
        units = {unit: names for unit, names, _ in ffn_units(config, layer)}
        if parts[2] in EXPERT_NAMES:
            kind = EXPERT_NAMES[parts[2]]
            return [(units[f"e{j}"][kind], j) for j in range(config.num_experts)]
        if parts[2] in SHARED_NAMES and "shared" in units:
            return [(units["shared"][SHARED_NAMES[parts[2]]], None)]
        extras = attention_extras(config, layer)
        if parts[2] in ROUTER_NAMES and ROUTER_NAMES[parts[2]] in extras:
            return [(extras[ROUTER_NAMES[parts[2]]][0], None)]
        raise CheckpointError(f"tensor {name!r} is not part of a {config.model_type} model as "
                              f"configured")
    target = hf_name(name)
    return [] if target is None else [(target, None)]


# ggml types that hold integers: read as weights they would be converted by value
_INTEGER_TYPES = ("I8", "I16", "I32", "I64")


def _shape(t):
    """A reader tensor's shape rows first (GGUF lists dimensions fastest first)."""
    return tuple(int(d) for d in reversed(t.shape.tolist()))


def load(path, progress=None):
    """(config, tensors, metadata) of a GGUF file: float32 tensors under HF names, in model
    order. Q4_0/Q4_1/Q8_0/F16/BF16/F32 (and every other type the gguf package dequantizes).
    Every name and shape is checked against the config before any tensor is dequantized.
    progress: a bar per tensor (None: on a terminal, for a load over 1 s)."""
    path = os.fspath(path)
    reader = open_reader(path)
    gguf = require("gguf", "reading GGUF files")
    try:
        meta = metadata(reader)
        shapes = {t.name: _shape(t) for t in reader.tensors}
        config = config_from_metadata(meta, shapes)
        expected = expected_shapes(config)
        names = {}  # HF name -> (reader tensor, expert index or None)
        for t in reader.tensors:
            targets = hf_targets(t.name, config)
            if not targets:
                _check_rope_freqs(t, shapes[t.name])
                continue
            for name, _ in targets:
                if name not in expected:
                    raise CheckpointError(f"tensor {t.name!r} is not part of a "
                                          f"{config.model_type} model as configured")
            name, expert = targets[0]
            # stacked experts lead with the expert count; a shared expert's gate is 1-D
            want = ((len(targets), *expected[name]) if expert is not None else
                    (expected[name][1],) if t.name.endswith("gate_inp_shexp.weight") and
                    shapes[t.name] == (expected[name][1],) else expected[name])
            if shapes[t.name] != want:
                raise CheckpointError(f"tensor {t.name!r}: expected shape {want}, got "
                                      f"{shapes[t.name]}")
            if t.tensor_type.name in _INTEGER_TYPES:
                raise CheckpointError(f"tensor {t.name!r} has type {t.tensor_type.name}; model "
                                      f"weights must be floating point or quantized")
            names.update((n, (t, j)) for n, j in targets)
        missing = [n for n in expected if n not in names]
        if missing:
            raise CheckpointError(f"missing tensor {missing[0]!r} of shape "
                                  f"{expected[missing[0]]}")
        tensors = {}
        stacked = {}  # a stacked experts' tensor, dequantized once for all its experts
        permuted = config.model_type in ("llama", "mixtral")  # llama.cpp's converter's rows
        for name in progress_bar(expected, progress, unit="tensor",
                                 desc="Loading GGUF tensors"):
            t, expert = names[name]
            if expert is None:
                array = _dequantize(gguf, t).reshape(expected[name])
            else:
                if t.name not in stacked:
                    stacked = {t.name: _dequantize(gguf, t)}
                array = np.ascontiguousarray(stacked[t.name][expert])
            if permuted and name.endswith("q_proj.weight"):
                array = unpermute_rows(array, config.num_attention_heads)
            elif permuted and name.endswith("k_proj.weight"):
                array = unpermute_rows(array, config.num_key_value_heads)
            tensors[name] = array
        check_tensors(config, tensors)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
    return config, tensors, meta


def _dequantize(gguf, t):
    try:
        array = gguf.quants.dequantize(t.data, t.tensor_type)
    except (NotImplementedError, ValueError, TypeError, IndexError) as e:
        raise CheckpointError(f"tensor {t.name!r} of type {t.tensor_type.name} cannot be "
                              f"dequantized: {e}") from None
    array = np.ascontiguousarray(array, dtype=np.float32)
    if array.shape != _shape(t):
        raise CheckpointError(f"tensor {t.name!r} of type {t.tensor_type.name} dequantized to "
                              f"shape {array.shape}, not {_shape(t)}")
    return array


def _check_rope_freqs(t, shape):
    """A rotary buffer is ignored only when it changes nothing: Llama 3.1's converter stores its
    llama3 frequency scaling as rope_freqs.weight (factors other than 1), which gyges does not
    read, and ignoring it would rotate by other angles than the model was trained with."""
    if len(shape) != 1 or shape[0] > 1 << 20:
        raise CheckpointError(f"tensor {t.name!r} of shape {shape} is not a rotary buffer")
    gguf = require("gguf", "reading GGUF files")
    factors = _dequantize(gguf, t)
    if not np.all(factors == 1.0):
        raise CheckpointError(f"tensor {t.name!r} scales the rotary frequencies (llama3-style "
                              f"rope_freqs), which gyges does not apply")
