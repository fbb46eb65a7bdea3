"""Hugging Face checkpoint directories: tensor names and shapes, loading, saving, random weights.

A checkpoint directory holds config.json and one or more *.safetensors files; when there are
several, model.safetensors.index.json maps each tensor name to its file ("weight_map").

Tensors keep HF's names and orientation: projections are [out_features, in_features], so
y = x @ W.T. Loading returns float32 arrays whatever the stored dtype (f32, f16, bf16 or f64);
a weight stored as integers is refused (converting it by value would give another model).

Extra tensors: rotary `inv_freq` buffers (recomputed from the config) and a tied model's
`lm_head.weight` are dropped. Any other unexpected tensor is an error, because it almost always
means an architecture feature we do not implement (a biased o_proj, experts of another family)
and ignoring it would give a model that runs but computes the wrong thing.

A mixture-of-experts layer (Mixtral, Qwen2-MoE, Qwen3-MoE) holds a router and one FFN per expert
(ffn_units), under each family's names.
"""

from __future__ import annotations

import glob
import json
import os
import re
from typing import Mapping

import numpy as np

from . import safetensors
from .config import ConfigError, ModelConfig, read_json
from ..core.errors import FormatError
from ..core.logs import progress as progress_bar

__all__ = ["CheckpointError", "expected_shapes", "ffn_units", "attention_extras", "check_tensors", "random_weights", "load",
           "save", "INDEX_FILE", "CONFIG_FILE"]

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# Buffers some exporters save that carry no learned state.
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


class CheckpointError(FormatError):
    """A checkpoint directory is incomplete, inconsistent, or unsupported."""


# Each family's names of an expert's three matrices, as (gate, up, down).
_EXPERT_KINDS = {"mixtral": ("w1", "w3", "w2")}
_SWIGLU_KINDS = ("gate_proj", "up_proj", "down_proj")


def ffn_units(config: ModelConfig, i: int) -> list[tuple[str | None, dict[str, str], int]]:
    """Layer i's SwiGLU FFNs in storage order, each (unit, {"gate"|"up"|"down": HF weight name},
    width): the dense MLP (unit None), or an MoE layer's experts ("e0", "e1", ...) followed by
    its shared expert ("shared", Qwen2-MoE)."""
    p = f"model.layers.{i}."
    if not config.is_sparse_layer(i):
        return [(None, {k: f"{p}mlp.{n}.weight" for k, n in zip(("gate", "up", "down"),
                                                                _SWIGLU_KINDS)},
                 config.intermediate_size)]
    moe = p + ("block_sparse_moe." if config.model_type == "mixtral" else "mlp.")
    names = _EXPERT_KINDS.get(config.model_type, _SWIGLU_KINDS)
    units = [(f"e{e}", {k: f"{moe}experts.{e}.{n}.weight"
                        for k, n in zip(("gate", "up", "down"), names)},
              config.moe_intermediate_size) for e in range(config.num_experts)]
    if config.shared_expert_intermediate_size:
        units.append(("shared", {k: f"{moe}shared_expert.{n}.weight"
                                 for k, n in zip(("gate", "up", "down"), _SWIGLU_KINDS)},
                      config.shared_expert_intermediate_size))
    return units


def attention_extras(config: ModelConfig, i: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Layer i's small replicated tensors beyond a Llama layer's, by role ("q_norm", "k_norm",
    "router", "shared_gate"): (HF name, shape)."""
    p, h = f"model.layers.{i}.", config.hidden_size
    out = {}
    if config.qk_norm:
        out["q_norm"] = (p + "self_attn.q_norm.weight", (config.head_dim,))
        out["k_norm"] = (p + "self_attn.k_norm.weight", (config.head_dim,))
    if config.is_sparse_layer(i):
        moe = p + ("block_sparse_moe." if config.model_type == "mixtral" else "mlp.")
        out["router"] = (moe + "gate.weight", (config.num_experts, h))
        if config.shared_expert_intermediate_size:
            out["shared_gate"] = (moe + "shared_expert_gate.weight", (1, h))
    return out


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF checkpoint of this config holds, with its shape, in model order."""
    h, q, kv = config.hidden_size, config.q_size, config.kv_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        if config.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q,)
            shapes[p + "self_attn.k_proj.bias"] = (kv,)
            shapes[p + "self_attn.v_proj.bias"] = (kv,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes.update(attention_extras(config, i).values())
        for _, names, ff in ffn_units(config, i):
            shapes[names["gate"]] = (ff, h)
            shapes[names["up"]] = (ff, h)
            shapes[names["down"]] = (h, ff)
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def random_weights(config: ModelConfig, seed: int = 0, normal=None) -> dict[str, np.ndarray]:
    """Deterministic random float32 weights with O(1) activations and non-degenerate logits.
    normal(shape) -> standard normal values stands in for the seeded generator's (a cheaper
    source for a model of billions of parameters whose values only time something).

    Projections are N(0, 1/fan_in), so each keeps its input's scale; the two that write into the
    residual stream (o_proj, down_proj) are further scaled by 1/sqrt(2 * layers) so the residual
    stays O(1) however deep the model is. Embedding rows are N(0, 1/hidden), i.e. of unit norm:
    with N(0, 1) rows a tied lm_head scores the input token ~sqrt(hidden) sigmas above the rest
    and greedy decoding just repeats it. Norm weights are 1 + N(0, 0.05^2) and biases
    N(0, 0.05^2), so every weight matters in tests but none dominates.
    """
    if normal is None:
        normal = np.random.default_rng(seed).standard_normal
    residual_scale = 1.0 / np.sqrt(2.0 * config.num_hidden_layers)
    out: dict[str, np.ndarray] = {}
    for name, shape in expected_shapes(config).items():
        z = normal(shape)
        if name.endswith(("layernorm.weight", "_norm.weight")) or name == "model.norm.weight":
            w = 1.0 + 0.05 * z
        elif name.endswith(".bias"):
            w = 0.05 * z
        else:
            w = z / z.dtype.type(np.sqrt(shape[1]))
            if name.endswith(("o_proj.weight", "down_proj.weight", ".w2.weight")):
                w *= residual_scale
        out[name] = w.astype(np.float32, copy=False)
    return out


def check_tensors(config: ModelConfig, tensors: Mapping[str, np.ndarray],
                  where: Mapping[str, str] | None = None) -> None:
    """Raises CheckpointError unless tensors holds exactly the expected names and shapes.

    `where` optionally maps names to the file they came from, for the message.
    """
    where = where or {}
    # Every layer has at least 9 tensors: a config asking for more layers than that allows is
    # refused before its names are listed (a config.json or GGUF of 2**32 layers would list them
    # until memory ran out).
    if config.num_hidden_layers > len(tensors) // 9:
        raise CheckpointError(f"the config has {config.num_hidden_layers} layers, more than "
                              f"the {len(tensors)} tensors of the checkpoint can hold")
    shapes = expected_shapes(config)
    missing = [n for n in shapes if n not in tensors]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"missing tensor {missing[0]!r} of shape {shapes[missing[0]]}"
                              f"{more}")
    unknown = sorted(n for n in tensors if n not in shapes)
    if unknown:
        raise CheckpointError(
            f"unexpected tensor(s) {', '.join(map(repr, unknown[:5]))}"
            f"{' ...' if len(unknown) > 5 else ''} in {where.get(unknown[0], 'the checkpoint')}"
            f": not part of a {config.model_type} model as configured")
    for name, shape in shapes.items():
        actual = tuple(np.shape(tensors[name]))
        if actual != shape:
            raise CheckpointError(f"tensor {name!r}: expected shape {shape}, got {actual}"
                                  f" in {where.get(name, 'the checkpoint')}")
        dtype = np.asarray(tensors[name]).dtype
        if dtype.kind != "f":  # converting integers by value would give another model
            raise CheckpointError(f"tensor {name!r} has dtype {dtype} in "
                                  f"{where.get(name, 'the checkpoint')}; model weights must be "
                                  f"floating point")


def _drop(config: ModelConfig, name: str) -> bool:
    """Tensors present in real checkpoints that we skip on purpose."""
    if _IGNORED.search(name):
        return True
    # Some exporters write lm_head even when tied; the tie wins, as in transformers.
    return config.tie_word_embeddings and name == "lm_head.weight"


def _shard_plan(path: str) -> dict[str, list[str] | None]:
    """file -> tensor names to read from it (None: all), from the index if there is one."""
    index_path = os.path.join(path, INDEX_FILE)
    if os.path.exists(index_path):
        index = read_json(index_path, "the weight_map", CheckpointError)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index_path}: weight_map must be an object")
        plan: dict[str, list[str] | None] = {}
        for name, fname in weight_map.items():
            if not isinstance(fname, str) or os.path.basename(fname) != fname:
                raise CheckpointError(f"{index_path}: tensor {name!r} maps to bad file "
                                      f"{fname!r}")
            plan.setdefault(fname, []).append(name)
        return plan
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files and no {INDEX_FILE}")
    return {os.path.basename(f): None for f in files}


def _check_float(config: ModelConfig, fpath: str, present: Mapping[str, safetensors.TensorInfo],
                 names: list[str] | None) -> None:
    """Refuses a weight stored as integers. The reader would hand it over as integers and it
    would be converted to floats by value: an F32 tensor relabelled I32 (same size, so the file
    is well formed) would load and run as a different model. Dropped buffers are not weights."""
    for name in present if names is None else names:
        dtype = present[name].dtype
        if dtype not in safetensors.FLOAT_DTYPES and not _drop(config, name):
            raise safetensors.SafetensorsError(
                f"{fpath}: tensor {name!r} has dtype {dtype}; model weights must be floating "
                f"point (F32, F16, BF16 or F64)")


def load(path: str | os.PathLike,
         progress: bool | None = None) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Reads config.json and all weights of a checkpoint directory, as float32 arrays in model
    order (the order of expected_shapes).

    With model.safetensors.index.json, each tensor is read from the file its weight_map names;
    without it, every *.safetensors file in the directory is read and a name found in two files
    is an error. A malformed safetensors file, or a weight whose dtype is not floating point,
    raises safetensors.SafetensorsError (a gyges.FormatError). progress: a bar per shard, as
    vLLM's "Loading safetensors checkpoint shards" (None: on a terminal, for a load over 1 s).
    """
    path = os.fspath(path)
    try:
        config = ModelConfig.from_json(os.path.join(path, CONFIG_FILE))
    except ConfigError as e:
        raise CheckpointError(str(e)) from e
    tensors: dict[str, np.ndarray] = {}
    where: dict[str, str] = {}
    plan = _shard_plan(path)
    for fname, names in progress_bar(plan.items(), progress, total=len(plan), unit="shard",
                                     desc="Loading safetensors checkpoint shards"):
        fpath = os.path.join(path, fname)
        if not os.path.exists(fpath):
            raise CheckpointError(f"{path}: {INDEX_FILE} names {fname!r}, which does not exist")
        present = safetensors.read_header(fpath).tensors
        if names is not None:
            absent = [n for n in names if n not in present]
            if absent:
                raise CheckpointError(f"{fpath}: {INDEX_FILE} places tensor {absent[0]!r} "
                                      f"here, but the file does not hold it")
            # a tensor the index leaves out would be left out of the model unseen (Qwen3's
            # q_norm in a shard, a copy of a tensor another shard holds)
            mapped = set(names)
            unmapped = [n for n in present if n not in mapped and not _drop(config, n)]
            if unmapped:
                raise CheckpointError(f"{fpath}: holds tensor {unmapped[0]!r}, which "
                                      f"{INDEX_FILE} does not place there")
        _check_float(config, fpath, present, names)
        for name, array in safetensors.read(fpath, names=names).items():
            if name in tensors:
                raise CheckpointError(f"tensor {name!r} appears in both {where[name]} and "
                                      f"{fpath}")
            if _drop(config, name):
                continue
            tensors[name] = array
            where[name] = fpath
    try:
        check_tensors(config, tensors, where)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
    return config, {name: tensors[name] for name in expected_shapes(config)}  # model order


def save(path: str | os.PathLike, config: ModelConfig, tensors: Mapping[str, np.ndarray],
         dtype: str = "f32", shard_bytes: int | None = None) -> list[str]:
    """Writes an HF checkpoint directory; returns the safetensors files written.

    With shard_bytes, tensors are packed in model order into shards of at most that many bytes
    (a larger tensor gets a shard of its own) and an index is written; otherwise one
    model.safetensors. Refuses a directory that already holds weights, since a leftover shard
    would be read back as part of the model.
    """
    path = os.fspath(path)
    check_tensors(config, tensors)
    itemsize = {"f32": 4, "f16": 2, "bf16": 2, "f64": 8}.get(dtype)
    if itemsize is None:
        raise CheckpointError(f"unknown dtype {dtype!r} (choose from f32, f16, bf16, f64)")
    if shard_bytes is not None and shard_bytes <= 0:
        raise CheckpointError(f"shard_bytes must be positive, got {shard_bytes}")
    os.makedirs(path, exist_ok=True)
    stale = glob.glob(os.path.join(path, "*.safetensors")) + \
        glob.glob(os.path.join(path, INDEX_FILE))
    if stale:
        raise CheckpointError(f"{path}: already holds weights ({os.path.basename(stale[0])}); "
                              f"save into an empty directory")

    names = list(expected_shapes(config))
    shards: list[list[str]] = [[]]
    size = 0
    for name in names:
        nbytes = int(np.prod(np.shape(tensors[name]))) * itemsize
        if shard_bytes is not None and shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes

    config.save(os.path.join(path, CONFIG_FILE))
    meta = {"format": "pt"}  # what transformers expects to find
    if len(shards) == 1 and shard_bytes is None:
        safetensors.write(os.path.join(path, SINGLE_FILE), tensors, dtype=dtype, metadata=meta)
        return [SINGLE_FILE]
    files, weight_map = [], {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        safetensors.write(os.path.join(path, fname), {n: tensors[n] for n in shard},
                          dtype=dtype, metadata=meta)
        files.append(fname)
        weight_map.update({n: fname for n in shard})
    total = sum(int(np.prod(np.shape(tensors[n]))) * itemsize for n in names)
    with open(os.path.join(path, INDEX_FILE), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        f.write("\n")
    return files
