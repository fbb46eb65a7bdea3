"""What the file says, read here without the loaders, to catch a silent misread: a load that
succeeds must hold exactly the file's values. Each check returns a verdict:
  ("refuse", why)   the file cannot mean a model gyges runs (or means one it cannot represent),
                    so a load that succeeds misread it;
  ("expect", value) a load must produce this value;
  None              not judged here.
The rules are the formats' own (HF transformers' config semantics, the safetensors spec,
llama.cpp's typed GGUF keys), written plainly."""
import glob
import json
import math
import os
import struct

import numpy as np

INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings")
FLOAT_FIELDS = ("rms_norm_eps", "rope_theta")
UNJUDGED = object()  # a value this module does not predict (the loaded one is not compared)


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def same(want, got):
    """Exact agreement: a bool only as a bool, an int only as an int, floats by value."""
    if isinstance(want, bool) or isinstance(got, bool):
        return type(want) is type(got) and want == got
    if isinstance(want, float) or isinstance(got, float):
        return _is_num(got) and _is_num(want) and float(got) == float(want)
    if isinstance(want, dict) or isinstance(got, dict):
        return isinstance(want, dict) and isinstance(got, dict) and want.keys() == got.keys() \
            and all(same(want[k], got[k]) for k in want)
    if isinstance(want, (list, tuple)) or isinstance(got, (list, tuple)):
        return isinstance(want, (list, tuple)) and isinstance(got, (list, tuple)) \
            and len(want) == len(got) and all(same(a, b) for a, b in zip(want, got))
    return type(want) is type(got) and want == got


# ---------------------------------------------------------------- HF config.json

def rope_scaling(raw):
    """HF rope_scaling -> ("expect", None | {"rope_type", params}) or ("refuse", why)."""
    if raw is None:
        return "expect", None
    if not isinstance(raw, dict):
        return "refuse", f"rope_scaling {raw!r} is not an object"
    kind = raw.get("rope_type", raw.get("type"))
    if kind is None:
        return ("expect", None) if all(v is None for v in raw.values()) else \
            ("refuse", f"rope_scaling {raw!r} has no type")
    if kind == "default":
        return "expect", None
    if kind in ("dynamic", "yarn"):
        # their optional knobs are many; the engine's tokens against the float64 reference
        # with the loaded scaling judge them. Here: the two parameters every reading needs.
        for key in ("factor",) + (("original_max_position_embeddings",) if kind == "yarn" else ()):
            v = raw.get(key)
            if not _is_num(v) or not v > 0:
                return "refuse", f"rope_scaling.{key} = {v!r} is not a positive finite number"
        return "expect", UNJUDGED
    if kind not in ("linear", "llama3"):
        return "refuse", f"rope_scaling type {kind!r} is not one gyges computes"
    keys = ("factor",) if kind == "linear" else ("factor", "low_freq_factor", "high_freq_factor")
    out = {"rope_type": kind}
    for key in keys:
        v = raw.get(key)
        if not _is_num(v) or not v > 0:
            return "refuse", f"rope_scaling.{key} = {v!r} is not a positive finite number"
        out[key] = float(v)
    if kind == "llama3":
        v = raw.get("original_max_position_embeddings")
        if not _is_int(v) or v <= 0:
            return "refuse", f"rope_scaling.original_max_position_embeddings = {v!r} is not " \
                             f"a positive integer"
        out["original_max_position_embeddings"] = v
        if not out["high_freq_factor"] > out["low_freq_factor"]:
            return "refuse", "rope_scaling: high_freq_factor <= low_freq_factor"
    return "expect", out


def hf_config(d):
    """config.json's dict -> ("expect", {ModelConfig field: value}) or ("refuse", why)."""
    if not isinstance(d, dict):
        return "refuse", "config.json is not an object"
    model_type = d.get("model_type", "llama")
    if model_type not in ("llama", "qwen2"):
        return "refuse", f"model_type {model_type!r}"
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads"):
        if key not in d:
            return "refuse", f"no {key}"
    d = {k: v for k, v in d.items() if v is not None}  # a null field reads as an absent one
    if d.get("hidden_act", "silu") != "silu":
        return "refuse", f"hidden_act {d['hidden_act']!r}"
    for flag in ("mlp_bias", "use_sliding_window"):
        if d.get(flag):
            return "refuse", f"{flag} = {d[flag]!r} (truthy: a feature gyges lacks)"
    if d.get("pretraining_tp", 1) not in (1, None):
        return "refuse", f"pretraining_tp = {d['pretraining_tp']!r}"
    fields = {"model_type": model_type}
    defaults = {"max_position_embeddings": 2048, "num_key_value_heads": None, "head_dim": None}
    for key in INT_FIELDS:
        v = d.get(key, defaults.get(key))
        if v is None and key == "num_key_value_heads":
            v = d["num_attention_heads"]
        if v is None and key == "head_dim":
            h, n = d["hidden_size"], d["num_attention_heads"]
            if not (_is_int(h) and _is_int(n) and n > 0 and h % n == 0):
                continue  # the loader's to refuse; not judged here
            v = h // n
        if not _is_int(v) or v <= 0:
            return "refuse", f"{key} = {v!r} is not a positive integer"
        fields[key] = v
    for key, default in (("rms_norm_eps", 1e-6), ("rope_theta", 10000.0)):
        v = d.get(key, default)
        if not _is_num(v) or not v > 0:
            return "refuse", f"{key} = {v!r} is not a positive finite number"
        fields[key] = float(v)
    tie = d.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        return "refuse", f"tie_word_embeddings = {tie!r} is not a bool"
    fields["tie_word_embeddings"] = tie
    bias = d.get("attention_bias", False)
    if model_type == "llama":
        if not isinstance(bias, bool):
            return "refuse", f"attention_bias = {bias!r} is not a bool"
        fields["attention_bias"] = bias
    if "bos_token_id" in d:
        v = d["bos_token_id"]
        if v is not None and not _is_int(v):
            return "refuse", f"bos_token_id = {v!r}"
        fields["bos_token_id"] = v
    if "eos_token_id" in d:
        v = d["eos_token_id"]
        if isinstance(v, list):
            if not all(_is_int(x) for x in v):
                return "refuse", f"eos_token_id = {v!r}"
            v = tuple(v)
        elif v is not None and not _is_int(v):
            return "refuse", f"eos_token_id = {v!r}"
        fields["eos_token_id"] = v
    verdict, scaling = rope_scaling(d.get("rope_scaling"))
    if verdict == "refuse":
        return verdict, scaling
    if scaling is not UNJUDGED:
        fields["rope_scaling"] = scaling
    return "expect", fields


# ---------------------------------------------------------------- safetensors

_ST = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2", "I64": "<i8", "I32": "<i4",
       "I16": "<i2", "I8": "i1", "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1",
       "BOOL": "?"}


def safetensors_file(path):
    """{name: (dtype, float32 array)} of one file, or ("refuse", why)."""
    try:
        data = open(path, "rb").read()
    except OSError as e:
        return "refuse", f"{path}: {e}"
    if len(data) < 8:
        return "refuse", "shorter than its length prefix"
    n = struct.unpack_from("<Q", data)[0]
    if 8 + n > len(data):
        return "refuse", "header past the end"
    try:
        header = json.loads(data[8:8 + n])
    except (ValueError, RecursionError) as e:
        return "refuse", f"header is not JSON: {type(e).__name__}"
    if not isinstance(header, dict):
        return "refuse", "header is not an object"
    body = memoryview(data)[8 + n:]
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(e, dict) or e.get("dtype") not in _ST:
            return "refuse", f"{name}: entry {e!r}"
        shape, offs = e.get("shape"), e.get("data_offsets")
        if not isinstance(shape, list) or not all(_is_int(s) and s >= 0 for s in shape):
            return "refuse", f"{name}: shape {shape!r}"
        if not isinstance(offs, list) or len(offs) != 2 or not all(_is_int(o) for o in offs):
            return "refuse", f"{name}: data_offsets {offs!r}"
        b, end = offs
        dt = np.dtype(_ST[e["dtype"]])
        if not 0 <= b <= end <= len(body) or end - b != math.prod(shape) * dt.itemsize:
            return "refuse", f"{name}: data_offsets {offs} do not hold {shape} {e['dtype']}"
        raw = np.frombuffer(body[b:end], dtype=dt).reshape(shape)
        if e["dtype"] == "BF16":
            array = (raw.astype(np.uint32) << 16).view(np.float32)
        else:
            array = raw.astype(np.float32)
        out[name] = (e["dtype"], array)
    return out


def hf_tensors(path, tie):
    """The weights a directory holds, by HF name (float32), or ("refuse", why)."""
    index = os.path.join(path, "model.safetensors.index.json")
    plan = {}
    if os.path.exists(index):
        try:
            wm = json.load(open(index, encoding="utf-8"))["weight_map"]
        except Exception as e:  # noqa: BLE001 (anything unreadable is a refusal here)
            return "refuse", f"index unreadable: {type(e).__name__}"
        if not isinstance(wm, dict) or not all(isinstance(f, str) and os.path.basename(f) == f
                                               for f in wm.values()):
            return "refuse", "index weight_map is not {name: file in this directory}"
        for name, f in wm.items():
            plan.setdefault(f, []).append(name)
    else:
        plan = {os.path.basename(f): None for f in glob.glob(os.path.join(path, "*.safetensors"))}
    tensors = {}
    for f, names in plan.items():
        got = safetensors_file(os.path.join(path, f))
        if isinstance(got, tuple):
            return got
        for name in (names if names is not None else got):
            if name not in got:
                return "refuse", f"{f} does not hold {name}"
            if name in tensors:
                return "refuse", f"{name} in two files"
            dtype, array = got[name]
            if name.endswith("rotary_emb.inv_freq") or (tie and name == "lm_head.weight"):
                continue
            if dtype not in ("F64", "F32", "F16", "BF16"):
                return "refuse", f"{name} stored as {dtype}"
            tensors[name] = array
    return "expect", tensors


def tensors_differ(want, got):
    """The first difference between two {name: array} maps, or None."""
    if set(want) != set(got):
        return f"tensor names differ: {sorted(set(want) ^ set(got))[:3]}"
    for name, a in want.items():
        b = np.asarray(got[name])
        if a.shape != b.shape or not np.array_equal(a, b, equal_nan=True):
            return f"tensor {name} differs from the file's"
    return None


# ---------------------------------------------------------------- GGUF metadata

def gguf_config(meta, tensor_names, vocab_rows):
    """meta: {key: (GGUFValueType int of the value, value)} -> like hf_config."""
    INTS, FLOATS = (0, 1, 2, 3, 4, 5, 10, 11), (6, 12)
    arch = meta.get("general.architecture", (None, None))[1]
    if arch not in ("llama", "qwen2"):
        return "refuse", f"general.architecture {arch!r}"

    def count(key, default=None):
        if f"{arch}.{key}" not in meta:
            return default
        vtype, v = meta[f"{arch}.{key}"]
        return v if vtype in INTS and _is_int(v) and v > 0 else ("bad", v)

    def real(key, default=None):
        if f"{arch}.{key}" not in meta:
            return default
        vtype, v = meta[f"{arch}.{key}"]
        return float(np.float32(v)) if vtype in FLOATS and _is_num(v) and v > 0 else ("bad", v)

    heads, hidden = count("attention.head_count"), count("embedding_length")
    fields = {"model_type": arch, "attention_bias": arch == "qwen2",
              "tie_word_embeddings": "output.weight" not in tensor_names,
              "num_hidden_layers": count("block_count"), "hidden_size": hidden,
              "intermediate_size": count("feed_forward_length"),
              "num_attention_heads": heads, "max_position_embeddings": count("context_length"),
              "num_key_value_heads": count("attention.head_count_kv", heads),
              "vocab_size": count("vocab_size", vocab_rows),
              "rms_norm_eps": real("attention.layer_norm_rms_epsilon"),
              "rope_theta": real("rope.freq_base", 10000.0)}
    for key, v in fields.items():
        if v is None:
            return "refuse", f"no {key}"
        if isinstance(v, tuple):
            return "refuse", f"{key} = {v[1]!r} is not of the key's type and range"
    default_dim = hidden // heads if hidden % heads == 0 else None
    head_dim = count("attention.key_length", default_dim)
    if isinstance(head_dim, tuple):
        return "refuse", f"key_length = {head_dim[1]!r}"
    if head_dim is None:
        return None  # the loader's to refuse
    fields["head_dim"] = head_dim
    for key in ("rope.dimension_count", "attention.value_length"):
        v = count(key, head_dim)
        if v != head_dim:
            v = v[1] if isinstance(v, tuple) else v
            return "refuse", f"{key} = {v!r}, not head_dim {head_dim} (partial rotary / other " \
                             f"value heads: not what gyges computes)"
    kind = meta.get(f"{arch}.rope.scaling.type", (8, None))
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind[0] != 8:
        return "refuse", f"rope.scaling.type {kind[1]!r} is not a string"
    if factor is not None and (factor[0] not in FLOATS or not _is_num(factor[1])
                               or factor[1] < 0):
        return "refuse", f"rope.scaling.factor {factor[1]!r}"
    f = None if factor is None or factor[1] in (0.0, 1.0) else float(np.float32(factor[1]))
    if kind[1] in (None, "linear") and f is not None:
        fields["rope_scaling"] = {"rope_type": "linear", "factor": f}
    elif kind[1] in (None, "none", "linear"):
        fields["rope_scaling"] = None
    elif kind[1] == "yarn":  # the engine's tokens against the reference judge its reading
        if f is None or f"{arch}.rope.scaling.original_context_length" not in meta:
            return "refuse", "yarn without its factor or original context length"
    else:
        return "refuse", f"rope.scaling.type {kind[1]!r} is not one gyges computes"
    if f"{arch}.rope.scale_linear" in meta:
        return "refuse", "rope.scale_linear (the older key of a linear factor) is not applied"
    for key, field in (("tokenizer.ggml.bos_token_id", "bos_token_id"),
                       ("tokenizer.ggml.eos_token_id", "eos_token_id")):
        if key in meta:
            vtype, v = meta[key]
            if vtype not in INTS:
                return "refuse", f"{key} = {v!r} is not an integer"
            fields[field] = v
    return "expect", fields
