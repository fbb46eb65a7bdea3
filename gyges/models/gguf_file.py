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
"""
from __future__ import annotations

import os

import numpy as np

from .checkpoint import CheckpointError, check_tensors, expected_shapes
from .config import ConfigError, ModelConfig
from ..core.errors import require

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
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
}
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
        except (ValueError, IndexError, UnicodeDecodeError) as e:
            raise CheckpointError(f"metadata {key!r} cannot be read: {e}") from None
    return out


def config_from_metadata(meta, tensor_rows):
    """ModelConfig from a GGUF's metadata ("<arch>.block_count", ...); tensor_rows: {GGUF tensor
    name: its number of rows}, for what the metadata may leave out (the vocabulary size)."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(f"general.architecture {arch!r} is not supported "
                              f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")

    def need(key):
        full = f"{arch}.{key}"
        if full not in meta:
            raise CheckpointError(f"the metadata has no {full!r}")
        return meta[full]

    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    vocab = int(meta.get(f"{arch}.vocab_size", tensor_rows.get("token_embd.weight", 0)))
    eos = meta.get("tokenizer.ggml.eos_token_id")
    try:
        return ModelConfig(
            vocab_size=vocab, hidden_size=hidden,
            intermediate_size=int(need("feed_forward_length")),
            num_hidden_layers=int(need("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
            head_dim=int(meta.get(f"{arch}.attention.key_length", hidden // heads)),
            rms_norm_eps=_f32_value(need("attention.layer_norm_rms_epsilon")),
            rope_theta=_f32_value(meta.get(f"{arch}.rope.freq_base", 10000.0)),
            max_position_embeddings=int(need("context_length")),
            tie_word_embeddings="output.weight" not in tensor_rows,
            attention_bias=arch == "qwen2", model_type=arch,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=None if eos is None else int(eos))
    except ConfigError as e:
        raise CheckpointError(f"the metadata describes no model gyges can run: {e}") from None


def _f32_value(x):
    """A float32 of the metadata as the decimal it was written from (1e-5, not 9.99999975e-06):
    the shortest one that rounds to the same float32, as HF's config.json would say it."""
    return float(np.format_float_positional(np.float32(x), unique=True))


def unpermute_rows(w, n_heads):
    """Undoes llama.cpp's reordering of q/k rows: within each head, row 2i + j of the file (pair
    i, element j) goes back to row j * d/2 + i (half j, index i), HF's rotate-half order.
      w: (n_heads * d, ...) -> same shape."""
    d = w.shape[0] // n_heads
    return (w.reshape(n_heads, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def hf_name(name):
    """The HF name of a GGUF tensor name, or None for one to ignore; CheckpointError when
    unknown (an architecture feature gyges does not run)."""
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    if name.endswith(IGNORED_SUFFIXES):
        return None
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_NAMES:
        return f"model.layers.{int(parts[1])}.{LAYER_NAMES[parts[2]]}"
    raise CheckpointError(f"tensor {name!r} is not part of a model gyges can run")


def load(path):
    """(config, tensors, metadata) of a GGUF file: float32 tensors under HF names, in model
    order. Q4_0/Q4_1/Q8_0/F16/BF16/F32 (and every other type the gguf package dequantizes)."""
    path = os.fspath(path)
    reader = open_reader(path)
    gguf = require("gguf", "reading GGUF files")
    meta = metadata(reader)
    try:
        config = config_from_metadata(meta, {t.name: int(t.shape[-1]) for t in reader.tensors})
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
    tensors = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        try:
            array = gguf.quants.dequantize(t.data, t.tensor_type)
        except (NotImplementedError, ValueError) as e:
            raise CheckpointError(f"{path}: tensor {t.name!r} of type {t.tensor_type.name} "
                                  f"cannot be dequantized: {e}") from None
        array = np.ascontiguousarray(array, dtype=np.float32)
        if config.model_type == "llama" and name.endswith("q_proj.weight"):
            array = unpermute_rows(array, config.num_attention_heads)
        elif config.model_type == "llama" and name.endswith("k_proj.weight"):
            array = unpermute_rows(array, config.num_key_value_heads)
        if name in tensors:
            raise CheckpointError(f"{path}: tensor {t.name!r} appears twice")
        tensors[name] = array
    try:
        check_tensors(config, tensors)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
    return config, {name: tensors[name] for name in expected_shapes(config)}, meta
